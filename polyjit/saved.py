"""Saved executables: an Executable's compiled programs in one file, run in
another process without tracing or compiling.

A file holds what the compile cache keeps of each program the executable
compiled (its plan as JSON and its objects: machine code, a GPU program's
PTX), the program's tensor constants as raw bytes, and the inputs' shapes
and dtypes; never pickles. A frontend's function (jit_jax's) adds how its
arguments reach the program: the arguments' and results' structure
(tuples, lists, dicts, None), which leaf is which input, and results that
are inputs or constants (a ``SavedFunction``). It is written in the
compile cache's form (cache.encode) behind a magic of its own and a
SHA-256, to a temporary file renamed into place. ``polyjit.load`` checks the magic, the checksum and the
polyjit version that wrote it at once, and a program's machine (the host's
CPU features for CPU code; a GPU's arch at its first call) when a call
first needs it.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from collections.abc import Mapping
from typing import Sequence

import numpy as np

from . import cache, interop
from .api import Executable
from .dtypes import DataType
from .errors import InputError, SavedExecutableError
from .graph import Graph
from .options import CompileOptions
from .runtime import CompiledProgram
from .targets import TARGETS

MAGIC = b"PJX1"
FORMAT = 1


def save(exe: Executable, path: str | os.PathLike, call: dict | None = None,
         constants: Sequence[np.ndarray] = ()) -> None:
    """Write exe's compiled programs (every target and input layout it has
    compiled for) to path; ``call`` (JSON) and ``constants`` (its arrays,
    by number): a frontend's function around exe (SavedFunction)."""
    programs = list(exe._variants.items())
    if not programs:
        raise InputError(f"{exe.name} has compiled nothing yet: call it once (or save it after polyjit.compile)")
    objects: list[bytes] = []
    entries = []
    for (layout, target), prog in programs:
        try:
            plan, code = TARGETS[target].entry(prog)
        except TypeError as e:  # a library step the cache's JSON cannot write (polyjit.library.CALLS)
            raise SavedExecutableError(f"{exe.name}: its {target} program cannot be saved: {e}") from None
        held = [np.asarray(c) for c in prog.constants]  # (tobytes: C order, any strides)
        entries.append({"layout": list(layout), "target": target,
                        "machine": TARGETS[target].machine_key(TARGETS[target].machine(exe.options.on(target))),
                        "plan": plan, "objects": len(code),
                        "constants": [[c.dtype.str, list(c.shape)] for c in held]})
        objects += code + [c.tobytes() for c in held]
    from . import __version__
    head = {"format": FORMAT, "polyjit": __version__, "name": exe.name, "single_output": exe._single,
            "scalar_inputs": sorted(exe._scalars), "target": exe.options.target,
            "inputs": [{"shape": [cache.size_json(s) for s in n.shape], "dtype": n.dtype.value,
                        "name": n.attrs["name"], "strided": bool(n.attrs.get("declared_strided", False))}
                       for n in exe.graph.inputs],
            "programs": entries}
    if call is not None:
        constants = [np.asarray(c) for c in constants]
        head["call"] = {**call, "constants": [[c.dtype.str, list(c.shape)] for c in constants]}
        objects += [c.tobytes() for c in constants]
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cache.encode(head, objects, MAGIC))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load(path: str | os.PathLike) -> SavedExecutable | SavedFunction:
    """The executable saved at path, or the frontend's function around it
    (SavedExecutableError where the file is damaged, not one, or written by
    another polyjit version)."""
    from . import __version__
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SavedExecutableError(f"cannot read the saved executable {str(path)!r}: {e}") from None
    try:
        head, objects = cache.decode(data, MAGIC)
        written_by = head["polyjit"]
    except cache.DAMAGED as e:
        raise SavedExecutableError(f"{str(path)!r} is not a polyjit saved executable, or it is damaged ({e})") \
            from None
    if head.get("format") != FORMAT or written_by != __version__:
        raise SavedExecutableError(f"{str(path)!r} was saved by polyjit {written_by} (format {head.get('format')}); "
                                   f"this is polyjit {__version__} (format {FORMAT}): save it again with this version")
    exe = SavedExecutable(head, objects, str(path))
    if "call" not in head:
        return exe
    rest = objects[sum(p["objects"] + len(p["constants"]) for p in head["programs"]):]
    return SavedFunction(exe, head["call"], [_array(dt, shape, b) for (dt, shape), b in
                                             zip(head["call"]["constants"], rest)])


def _array(dt: str, shape: list, data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.dtype(dt)).reshape(shape).copy()


class SavedExecutable(Executable):
    """An executable read from a file: its programs load as calls first
    need them, and nothing is traced or compiled. Called like the
    Executable that was saved, and also with torch tensors, JAX arrays or
    DLPack arrays, whose kind its results take (as FusionDefinition.execute)."""

    def __init__(self, head: dict, objects: list[bytes], path: str) -> None:
        g = Graph()
        for spec in head["inputs"]:
            n = g.input([cache.size_from(s) for s in spec["shape"]], DataType(spec["dtype"]), spec["name"],
                        spec["strided"])
            n.attrs["declared_strided"] = spec["strided"]
        super().__init__(g, CompileOptions(target=head["target"]), head["name"], head["scalar_inputs"],
                         head["single_output"])
        self.path = path
        self._saved: dict[tuple, tuple] = {}  # (layout, target) -> (entry, objects, constants)
        at = 0
        for entry in head["programs"]:
            code = objects[at:at + entry["objects"]]
            at += entry["objects"]
            constants = [_array(dt, shape, b) for (dt, shape), b in zip(entry["constants"], objects[at:])]
            at += len(constants)
            self._saved[tuple(entry["layout"]), entry["target"]] = (entry, code, constants)

    def variant(self, layout: tuple, target: str | None = None, example: Sequence | None = None) -> CompiledProgram:
        target = self._named(target)
        key = (tuple(layout), target)
        if key not in self._variants:
            if key not in self._saved:
                raise InputError(f"{self.name} (saved in {self.path!r}) has no program for this call: it needs "
                                 f"{_described(key)}, and the file holds {', '.join(map(_described, self._saved))}; "
                                 "compile it for such inputs and save it again")
            self._variants[key] = self._load(key)
        return self._variants[key]

    def _load(self, key: tuple) -> CompiledProgram:
        entry, code, constants = self._saved[key]
        t = TARGETS[entry["target"]]
        start = time.perf_counter()
        why = t.foreign_code(entry["machine"])
        if why is not None:
            raise SavedExecutableError(f"{self.name} (saved in {self.path!r}) cannot run here: {why}; "
                                       "compile it on this machine instead")
        plan = entry["plan"]
        prog = (t.load(constants, self.options.on(entry["target"]), self.name, plan, code)
                if cache.define_derived(plan) else None)
        if prog is None:
            raise SavedExecutableError(f"{self.name} (saved in {self.path!r}): its {entry['target']} program calls "
                                       "a library (BLAS, cuBLAS or cuDNN) that does not load here")
        prog.stats.update(cache_hits=0, compile_seconds=time.perf_counter() - start)
        return prog

    def __call__(self, *args, **launch):
        if launch:
            return super().__call__(*args, **launch)
        call = interop.Call(args, self.name)
        outs = super().__call__(*call.arrays, **call.launch)
        results = call.results([outs] if self._single else list(outs))
        return results[0] if self._single else tuple(results)


def _described(key: tuple) -> str:
    layout, target = key
    strided = [k for k, s in enumerate(layout) if s]
    return f"{target} with " + (f"inputs {strided} strided" if strided else "contiguous inputs")


class SavedFunction:
    """A frontend's function read from a file (``jit_jax(f).save(path,
    *args)``): called with the arguments the function took, less the
    static ones, in the same structure; returns its results' structure,
    as arrays of the arguments' kind. ``call`` (the file's) says where
    each argument leaf goes (``inputs``: the leaf for each program input;
    ``bound``: the constants that are leaves after the arguments') and
    where each result leaf comes from (``outputs``: ["output", k],
    ["input", leaf] or ["constant", k])."""

    def __init__(self, exe: SavedExecutable, call: dict, constants: list[np.ndarray]) -> None:
        self.exe, self.call, self.constants = exe, call, constants
        self.__name__ = call.get("name", exe.name)

    @property
    def stats(self) -> dict:
        return self.exe.stats

    def __call__(self, *args, **kwargs):
        positional, named = self.call["args"]["tuple"]
        leaves = flatten(positional, list(args), self.__name__, "arguments") + \
            flatten(named, kwargs, self.__name__, "keyword arguments") + \
            [self.constants[k] for k in self.call.get("bound", ())]  # (values saved with it: TF's variables)
        given = interop.Call(leaves, self.__name__)  # (the kind results take: the leaves')
        inputs = self.exe.graph.inputs
        # Python numbers as the traced function took them: arrays of its input's dtype
        outs = self.exe(*[np.asarray(leaves[k], inputs[i].dtype.numpy) if isinstance(leaves[k], (bool, int, float))
                          else leaves[k] for i, k in enumerate(self.call["inputs"])]) if self.call["inputs"] else ()
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        made = given.results([outs[k] if kind == "output" else self.constants[k]
                              for kind, k in self.call["outputs"] if kind != "input"])
        made.reverse()  # (an input handed back is the caller's own)
        return unflatten(self.call["results"], [leaves[k] if kind == "input" else made.pop()
                                                for kind, k in self.call["outputs"]])


# ------------------------------------------------------------ argument structure
def structure(tree, is_leaf, sort_keys: bool = True) -> object:
    """A nest of tuples, lists, dicts (string or int keys) and None whose
    leaves ``is_leaf`` tells, as JSON: what flatten checks arguments
    against and unflatten builds results of. Leaves are in the order the
    framework flattens them: dicts by sorted keys (JAX, TensorFlow), or as
    they were built (``sort_keys=False``: PyTorch)."""
    if is_leaf(tree):
        return "*"
    if tree is None:
        return None
    if type(tree) in (tuple, list):
        return {type(tree).__name__: [structure(t, is_leaf, sort_keys) for t in tree]}
    if type(tree) is dict and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in tree):
        keys = sorted(tree) if sort_keys else list(tree)
        return {"dict": [[k, structure(tree[k], is_leaf, sort_keys)] for k in keys]}
    if not sort_keys and isinstance(tree, Mapping) and all(isinstance(k, str) for k in tree):
        # a mapping of a class of its own (transformers' ModelOutput), flattened in its own order: a Record
        return {"record": [[k, structure(tree[k], is_leaf, sort_keys)] for k in tree]}
    raise SavedExecutableError(f"a {type(tree).__name__} among the arguments or results: a saved function takes "
                               "and returns arrays in tuples, lists, dicts and None (wrap a model whose results "
                               "are a class of its own in a function that returns its arrays)")


class Record(dict):
    """Results that were a mapping of a class of their own (transformers'
    ModelOutput): a dict of them, read by attribute too and, as a
    ModelOutput is, by position."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, key):
        return list(self.values())[key] if isinstance(key, (int, slice)) else super().__getitem__(key)


def flatten(spec, tree, name: str, path: str) -> list:
    """tree's leaves, where it has spec's structure (InputError naming
    where it differs: ``path`` is tree's name)."""
    if spec == "*":
        return [tree]
    if spec is None:
        if tree is not None:
            raise InputError(f"{name}: {path}: got a {type(tree).__name__}, expected None")
        return []
    (kind, items), = spec.items()
    if kind in ("dict", "record"):
        keys = [k for k, _ in items]
        if not isinstance(tree, Mapping) or sorted(tree, key=str) != sorted(keys, key=str):
            got = f"keys {sorted(tree, key=str)}" if isinstance(tree, Mapping) else f"a {type(tree).__name__}"
            raise InputError(f"{name}: {path}: got {got}, expected a dict of keys {keys}")
        return [x for k, sub in items for x in flatten(sub, tree[k], name, f"{path}[{k!r}]")]
    if not isinstance(tree, (tuple, list)) or len(tree) != len(items):
        got = f"a {type(tree).__name__}" + (f" of {len(tree)}" if isinstance(tree, (tuple, list)) else "")
        raise InputError(f"{name}: {path}: got {got}, expected a {kind} of {len(items)}")
    return [x for k, (sub, t) in enumerate(zip(items, tree)) for x in flatten(sub, t, name, f"{path}[{k}]")]


def unflatten(spec, leaves: Sequence):
    """The tree of spec's structure holding leaves, in order."""
    it = iter(leaves)

    def build(s):
        if s == "*":
            return next(it)
        if s is None:
            return None
        (kind, items), = s.items()
        if kind in ("dict", "record"):
            made = {k: build(sub) for k, sub in items}
            return made if kind == "dict" else Record(made)
        made = [build(sub) for sub in items]
        return tuple(made) if kind == "tuple" else made
    return build(spec)
