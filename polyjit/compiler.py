"""The pipeline's entry, and what every target's compile shares.

``compile_graph`` hands a graph to its target (``polyjit.targets``), whose
``compile`` runs the stages: graph passes, lowering, scheduling, emission,
building and loading the code. Each stage's output is kept as text on the
CompiledProgram (``exe.ir``); with ``debug`` they are also written to
``dump_dir``. Here: the stage timer, the executable a target's code makes,
its plan for the compile cache, and the dump.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

from . import cache
from . import sizes as sz
from .collector import collector_paused
from .graph import Graph
from .runtime import CompiledProgram

if TYPE_CHECKING:
    from .options import CompileOptions

log = logging.getLogger("polyjit")
_dump_ids = itertools.count()


def _log_from_env() -> None:
    """POLYJIT_LOG=info (or debug, warning): polyjit's log on stderr, without
    configuring logging for the whole process."""
    level = os.environ.get("POLYJIT_LOG", "").upper()
    if not level or level == "0" or log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if level in ("1", "TRUE") else level)


_log_from_env()


class StageTimer:
    """Seconds spent in each compile stage, summed over repeated entries; a
    stage entered inside another (emission started while scheduling) is
    taken out of the outer one's seconds. A stage named "outer/inner" is a
    part of "outer", kept in ``detail``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.detail: dict[str, float] = {}
        self._open: list[list] = []  # [stage, when its current stretch began], outermost first

    @contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        if "/" in stage:
            try:
                yield
            finally:
                self.add(stage, time.perf_counter() - start)
            return
        if self._open:
            outer = self._open[-1]
            self.add(outer[0], start - outer[1])
        self._open.append([stage, start])
        try:
            yield
        finally:
            end = time.perf_counter()
            self.add(stage, end - self._open.pop()[1])
            if self._open:
                self._open[-1][1] = end

    def add(self, stage: str, seconds: float) -> None:
        into = self.detail if "/" in stage else self.seconds
        into[stage] = into.get(stage, 0.0) + seconds

    def summary(self) -> str:
        return ", ".join(f"{k} {v:.3f}" for k, v in self.seconds.items()) + "".join(
            f"\n  {k} {v:.3f}" for k, v in self.detail.items())


def compile_graph(graph: Graph, options: CompileOptions, name: str = "fn") -> CompiledProgram:
    """graph compiled by its target (options.target; None: the host's)."""
    from .targets import target
    with collector_paused():
        return target(options.target).compile(graph, options, name)


def expect_compile(trace: str | None = None) -> None:
    """Start the compile's worker processes (codegen.workers) now: a
    frontend calls this as it begins tracing a program it has not compiled,
    so that the workers' imports run on another core beside the trace, not
    after it, when the compile's first code waits for them. ``trace`` says
    what is traced, as text that is the same in every process (None: the
    compile cache is off). Where the cache marks it as compiled before
    (``compiled``), its programs will load from the cache: no worker starts
    now (they start on first use, for one that does not), as their imports
    would take a core from the program's first calls."""
    from .codegen import workers
    if trace is not None and cache.load(_mark(trace)) is not None:
        return
    workers.workers()


def compiled(trace: str | None) -> None:
    """Mark in the compile cache that what ``expect_compile(trace)``
    announced has compiled (or compiles at the call that follows the trace:
    jit_jax's and jit_tf's programs); nothing where trace is None."""
    if trace is None:
        return
    key = _mark(trace)
    if cache.load(key) is None:
        cache.store(key, {"compiled": True}, [])


def _mark(trace: str) -> str:
    return cache.digest("compiled", trace)


PLAN_STATS = ("kernels", "statements", "fused", "inlined", "contracted_buffers", "parallel_kernels",
              "library_calls", "fusions_refused", "fusion_refusals", "contractions")


def plan(exe: CompiledProgram, fields: dict) -> dict:
    """What from_plan needs to run the program again, as JSON; fields: the
    target's own (under a key of its own)."""
    return {
        "inputs": [cache.array_json(a) for a in exe.inputs], "outputs": [cache.array_json(a) for a in exe.outputs],
        "output_arrays": exe.output_arrays, "buffers": [cache.array_json(a) for a in exe.buffers],
        "int_slots": exe.int_slots, "params": exe.params,
        "derived": {n: [kind, cache.size_json(a), cache.size_json(b)]
                    for n, (kind, a, b) in sz.definitions(exe.params).items()},
        "constraints": [[cache.size_json(a), cache.size_json(b)] for a, b in exe.constraints],
        "kernels": [[k.name, k.parallel, list(k.statements)] for k in exe.kernels],
        "lifetimes": {n: list(span) for n, span in exe.lifetimes.items()},
        "contracted": [[[cache.size_json(s) for s in shape], itemsize, list(moduli), par]
                       for shape, itemsize, moduli, par in exe.contracted_bytes.buffers],
        "stats": {k: exe.stats[k] for k in PLAN_STATS},
        "ir": {k: v for k, v in exe.ir.items() if k != "ptx"},  # (a GPU program's PTX is its object)
        **fields,
    }


def from_plan(cls, constants: list, options: CompileOptions, name: str, plan: dict, kernels, keepalive,
              fields: dict) -> CompiledProgram:
    """A program of class cls loaded from the compile cache (or a saved
    executable): nothing lowered, scheduled or compiled; constants are its
    graph's tensor constants (Graph.constant_arrays), kernels, keepalive
    and fields the target's."""
    contracted = [(tuple(cache.size_from(s) for s in shape), itemsize, tuple(moduli), par)
                  for shape, itemsize, moduli, par in plan["contracted"]]
    exe = cls(
        name=name, inputs=[cache.array_from(a) for a in plan["inputs"]],
        outputs=[cache.array_from(a) for a in plan["outputs"]], output_arrays=plan["output_arrays"],
        buffers=[cache.array_from(a) for a in plan["buffers"]], int_slots=[tuple(s) for s in plan["int_slots"]],
        params=plan["params"], constraints=[(cache.size_from(a), cache.size_from(b)) for a, b in plan["constraints"]],
        constants=constants, kernels=kernels,
        num_threads=options.num_threads, stats={**plan["stats"], "intermediate_bytes": 0, "fallbacks": 0,
                                                "kernels_compiled": 0, "launchers_compiled": 0},
        contracted_bytes=ContractedBytes(contracted, options.num_threads), keepalive=keepalive,
        lifetimes={n: tuple(span) for n, span in plan["lifetimes"].items()}, cached=options.cache, **fields)
    exe.ir = dict(plan["ir"])
    return exe


class ContractedBytes:
    """Memory the contracted buffers take at given sizes: (shape, itemsize,
    moduli, parallel) each, a copy per thread where its kernel is parallel."""

    def __init__(self, buffers: list[tuple], num_threads: int) -> None:
        self.buffers, self.num_threads = buffers, num_threads

    def __call__(self, env) -> int:
        total = 0
        for shape, itemsize, moduli, par in self.buffers:
            count = 1
            for s, m in zip(shape, moduli):
                count *= sz.evaluate(s, env) if m is None else m
            total += count * itemsize * (self.num_threads if par else 1)
        return total


def executable(cls, graph: Graph, prog, sched, kernels, buffers, int_slots, options: CompileOptions, name: str,
               keepalive, ir: dict, fields: dict) -> CompiledProgram:
    """A program of class cls running kernels; ir: the target's stages' texts, fields: its own."""
    inputs = sorted((a for a in prog.arrays.values() if a.kind == "input"), key=lambda a: a.index)
    outputs = sorted((a for a in prog.arrays.values() if a.kind == "output"), key=lambda a: a.index)
    consts = graph.constant_arrays()
    contracted = [(prog.arrays[n].shape, prog.arrays[n].dtype.itemsize, m,
                   kernels[sched.kernel_of_array[n]].parallel if n in sched.kernel_of_array else False)
                  for n, m in sched.contracted.items()]
    stats = {
        "kernels": len(kernels),
        "statements": len(prog.statements),
        "fused": sum(max(len(k) - 1, 0) for k in sched.kernels),
        "inlined": prog.inlined,
        "contracted_buffers": len(sched.contracted),
        "intermediate_bytes": 0,
        "fallbacks": 0,
        "parallel_kernels": sum(k.parallel for k in kernels),
        "library_calls": sum(s.library is not None for s in prog.statements),
        "fusions_refused": len(sched.refused),
        "fusion_refusals": sched.refused,
        "launchers_compiled": 0,  # a call's native launcher, compiled rather than loaded from the cache
    }
    exe = cls(name=name, inputs=inputs, outputs=outputs, output_arrays=prog.outputs, buffers=buffers,
              int_slots=int_slots, params=prog.params, constraints=prog.constraints, constants=consts,
              kernels=kernels, num_threads=options.num_threads, stats=stats,
              contracted_bytes=ContractedBytes(contracted, options.num_threads), keepalive=keepalive,
              lifetimes=lifetimes(prog, kernels), cached=options.cache, **fields)
    exe.ir = {
        "graph": str(graph),
        "affine": str(prog),
        "schedule": sched.schedule_text(),
        "ast": sched.ast_text() + ("\ncontracted: " + ", ".join(
            f"{n}{list(m)}" for n, m in sched.contracted.items()) if sched.contracted else ""),
        **ir,
    }
    return exe


def lifetimes(prog, kernels) -> dict[str, tuple[int, int]]:
    """The first and last kernel (by position) that touch each temporary, so
    that temporaries whose spans are disjoint can share memory."""
    stmts = {s.name: s for s in prog.statements}
    spans: dict[str, tuple[int, int]] = {}
    for k, info in enumerate(kernels):
        for name in info.statements:
            s = stmts[name]
            written = s.library.written()[0] if s.library is not None else s.array
            for a in {written, *(ld.array for ld in prog.statement_loads(s))}:
                if prog.arrays[a].kind == "temp":
                    first, _ = spans.get(a, (k, k))
                    spans[a] = (first, k)
    return spans


def dump(exe: CompiledProgram, folder: str) -> str:
    """Write every stage of exe to folder/<name>_<n>/ and return that path."""
    path = os.path.join(folder, f"{exe.name}_{next(_dump_ids)}")
    os.makedirs(path, exist_ok=True)
    for i, (stage, text) in enumerate(exe.ir.items()):
        with open(os.path.join(path, f"{i}_{stage}.txt"), "w") as f:
            f.write(text + "\n")
    with open(os.path.join(path, f"{len(exe.ir)}_stats.txt"), "w") as f:
        f.write("\n".join(f"{k}: {v}" for k, v in exe.stats.items()) + "\n")
    log.info("polyjit: dumped %s to %s", exe.name, path)
    return path
