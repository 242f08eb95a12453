"""compile_options: validated once, with errors that name the key and the allowed values."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from .errors import CompileOptionError

from .targets import TARGETS

FUSION = ("max", "none")
CONTRACTIONS = ("auto", "generated", "library")


def usable_cores() -> int:
    """The cores this process may run on (its affinity: taskset, a container's
    cpuset), not the machine's: more threads than cores spin against each other."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # (no affinity on macOS)
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CompileOptions:
    """Validated compile options. ``target=None`` (the default) compiles for
    the device that holds the inputs, as Inductor and XLA do; an executable
    then keeps one compiled program per device it meets."""

    target: str | None = None
    debug: bool = False
    dump_dir: str = "polyjit_dump"
    tile_sizes: tuple[int, ...] | None = None
    fusion: str = "max"
    num_threads: int = field(default_factory=lambda: usable_cores())
    strict: bool = False
    gpu_arch: str | None = None
    contractions: str = "auto"
    cache: bool = True  # the on-disk compile cache (polyjit.cache)
    tf32: bool | None = None  # library convolutions on TF32 tensor cores; None: as the framework's eager does
    matmul_tf32: bool | None = None  # library products (matmul, dot_general) on TF32 tensor cores; None: likewise

    def on(self, target: str) -> "CompileOptions":
        """These options for ``target``: the device a call's inputs resolved to."""
        return self if self.target == target else replace(self, target=target)

    def key(self) -> tuple:
        """What changes the generated code (debug output does not)."""
        return (self.target, self.tile_sizes, self.fusion, self.gpu_arch, self.contractions,
                bool(self.tf32) and self.target != "cpu",  # (TF32 only on GPU libraries)
                bool(self.matmul_tf32) and self.target != "cpu")


_KEYS = {
    "target": f"one of {tuple(TARGETS)}, or None (where the inputs are)",
    "debug": "True or False",
    "dump_dir": "a folder path",
    "tile_sizes": "a list of positive ints, or None",
    "fusion": f"one of {FUSION}",
    "num_threads": "a positive int",
    "strict": "True or False",
    "contractions": f"one of {CONTRACTIONS} (generated code, a vendor library, or per shape the library unless "
                    "generated code measures faster)",
    "gpu_arch": "'sm_XX' (compile nvgpu code for that GPU without one present), or None (the GPU in use)",
    "cache": "True or False (keep compiled programs in POLYJIT_CACHE_DIR and load them from there)",
    "tf32": "True, False, or None (library convolutions on the GPU may round operands to TF32, as "
            "torch.backends.cudnn.allow_tf32 lets eager's; None: as the framework does, False elsewhere)",
    "matmul_tf32": "True, False, or None (library products on the GPU may round operands to TF32, as jax.jit's "
                   "default precision does and torch.set_float32_matmul_precision('high') lets eager's; None: as "
                   "the framework does, False elsewhere)",
}


def parse_options(opts: Mapping[str, Any] | CompileOptions | None,
                  extra: Mapping[str, str] | None = None) -> CompileOptions:
    """Validate a compile_options dict; `extra` names keys a frontend handles itself."""
    if isinstance(opts, CompileOptions):
        return opts
    opts = dict(opts or {})
    extra = extra or {}
    for k in opts:
        if k not in _KEYS and k not in extra:
            allowed = sorted(list(_KEYS) + list(extra))
            raise CompileOptionError(f"unknown compile option {k!r}; allowed keys: {allowed}")
    kw = {k: v for k, v in opts.items() if k in _KEYS}
    t = kw.get("target")
    if t is not None and t not in TARGETS:
        raise CompileOptionError(f"compile option 'target' is {t!r}; allowed values: {list(TARGETS)} or None "
                                 f"(the device that holds the inputs)")
    for k in ("debug", "strict", "cache", "tf32", "matmul_tf32"):
        if k in kw and not isinstance(kw[k], bool) and not (k.endswith("tf32") and kw[k] is None):
            allowed = "True, False, None" if k.endswith("tf32") else "True, False"
            raise CompileOptionError(f"compile option {k!r} is {kw[k]!r}; allowed values: {allowed}")
    if "fusion" in kw and kw["fusion"] not in FUSION:
        raise CompileOptionError(f"compile option 'fusion' is {kw['fusion']!r}; allowed values: {list(FUSION)}")
    if "contractions" in kw and kw["contractions"] not in CONTRACTIONS:
        raise CompileOptionError(f"compile option 'contractions' is {kw['contractions']!r}; "
                                 f"allowed values: {list(CONTRACTIONS)}")
    if "num_threads" in kw and (not isinstance(kw["num_threads"], int) or isinstance(kw["num_threads"], bool)
                                or kw["num_threads"] < 1):
        raise CompileOptionError(f"compile option 'num_threads' is {kw['num_threads']!r}; expected {_KEYS['num_threads']}")
    if kw.get("tile_sizes") is not None:
        ts = kw["tile_sizes"]
        if not isinstance(ts, (list, tuple)) or not ts or not all(
                isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in ts):
            raise CompileOptionError(f"compile option 'tile_sizes' is {ts!r}; expected {_KEYS['tile_sizes']}")
        kw["tile_sizes"] = tuple(ts)
    if t is not None and kw.get("tile_sizes") is not None:
        TARGETS[t].check_tile_sizes(kw["tile_sizes"])
    ga = kw.get("gpu_arch")
    if ga is not None and not (isinstance(ga, str) and ga.startswith("sm_") and ga[3:].rstrip("a").isdigit()):
        raise CompileOptionError(f"compile option 'gpu_arch' is {ga!r}; expected {_KEYS['gpu_arch']}")
    if "dump_dir" in kw and not isinstance(kw["dump_dir"], (str, os.PathLike)):
        raise CompileOptionError(f"compile option 'dump_dir' is {kw['dump_dir']!r}; expected {_KEYS['dump_dir']}")
    if os.environ.get("POLYJIT_DEBUG", "") not in ("", "0"):
        kw.setdefault("debug", True)
    return CompileOptions(**kw)
