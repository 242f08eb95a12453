"""The pipeline driver: graph -> affine program -> schedule -> LLVM -> CompiledProgram.

Each stage's output is kept as text on the CompiledProgram (``exe.ir``); with
``debug`` they are also written to ``dump_dir``.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from contextlib import contextmanager

from . import cache
from . import sizes as sz
from .cuda import GpuProgram
from .fold import fold_scales
from .graph import Graph
from .library import LibraryPolicy
from .lowering import GPU_RECOMPUTE_LIMIT, RECOMPUTE_LIMIT, lower
from .options import CompileOptions
from .runtime import CompiledProgram
from .targets.cpu import packed_operands
from .schedule import schedule_program

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
    t0 = time.perf_counter()
    timer = StageTimer()
    gpu = options.target == "nvgpu"
    with timer("lower"):
        graph, folded = fold_scales(graph.deduplicated())
        if not gpu:
            graph = packed_operands(graph)
    key = exe = None
    hits = 0
    arch, sms = (options.gpu_arch or _device_arch(), _multiprocessors()) if gpu else (None, None)
    if options.cache or gpu:  # (GPU programs are also shared within the process, as CPU kernels are)
        from .codegen.cpu import host_key
        with timer("cache"):
            key = cache.key(graph, name, options.key(), f"nvgpu|{arch}|{sms}" if gpu else host_key())
            hit, hits = _lookup(key, gpu, options.cache)
            exe = _from_cache(graph, options, name, *hit) if hit else None
        hits = hits if exe is not None else 0
    if exe is None:
        policy = LibraryPolicy(options.contractions, options.num_threads, options.target)
        with timer("lower"):
            prog = lower(graph, GPU_RECOMPUTE_LIMIT if gpu else RECOMPUTE_LIMIT, policy)
        exe = _compile_gpu(graph, prog, options, name, timer, arch, sms) if gpu else \
            _compile_cpu(graph, prog, options, name, timer)
        exe.stats["contractions"] = policy.choices if policy else []
        if key is not None:
            with timer("cache"):
                _keep(key, exe, options.cache)
    exe.stats["cache_hits"] = hits
    exe.stats["folded"] = folded
    exe.stats["compile_seconds"] = time.perf_counter() - t0
    exe.stats["compile_seconds_by_stage"] = timer.seconds
    log.info("compiled %s (%d kernels, %d compiled) in %.3f s: %s", name, len(exe.kernels),
             exe.stats["kernels_compiled"], exe.stats["compile_seconds"], timer.summary())
    log.debug("%s: %s", name, exe.stats)
    if options.debug:
        dump(exe, options.dump_dir)
    return exe


def _compile_cpu(graph: Graph, prog, options: CompileOptions, name: str, timer: StageTimer) -> CompiledProgram:
    """Kernels of one structure share code (codegen.program), compiled once per process."""
    from .codegen.cpu import host_key, vector_bits
    from .codegen.program import CodeSet, LoadedProgram, build_program, entries_object
    codes = CodeSet(host_key(), timer)  # each group's kernels are emitted, and go to LLVM, once it is scheduled
    with timer("schedule"):
        sched = schedule_program(prog, options.fusion, options.tile_sizes, "cpu", vector_bits(), timer, each=codes.of)
    code = build_program(prog, sched, name, codes)
    with timer("llvm"):
        loaded = LoadedProgram([c.obj for c in code.codes] + [entries_object(code.entries)])
    ir = {"llvm": "\n".join([code.entries] + [c.ir for c in code.codes]),
          "llvm_opt": "\n".join(c.optimized for c in code.codes)}
    exe = _executable(CompiledProgram, graph, prog, sched, loaded.bind(code.kernels), code.buffers, code.int_slots,
                      options, name, loaded, ir, {})
    exe.stats["kernels_compiled"] = code.compiled
    return exe


GPU_PROGRAMS = 32  # GPU programs (plan, IR texts and PTX: megabytes for a model) kept per process, by key
_gpu_programs: dict[str, tuple[dict, list[bytes]]] = {}


def _lookup(key: str, gpu: bool, disk: bool) -> tuple[tuple | None, int]:
    """(plan, objects) compiled before under key (GPU programs: in this
    process too), or None; and 1 where it came from the disk."""
    hit = _gpu_programs.get(key) if gpu else None
    if hit is not None or not disk:
        return hit, 0
    hit = cache.load(key)
    if hit and gpu:
        _gpu_programs[key] = hit
    return hit, int(hit is not None)


def _keep(key: str, exe: CompiledProgram, disk: bool) -> None:
    """Keep a compiled program under key (on disk where disk; GPU programs
    also in this process). A GPU program's object is its PTX, as text."""
    gpu = isinstance(exe, GpuProgram)
    if any(k.library is not None for k in exe.kernels if gpu):
        return  # (cuBLAS steps hold their statement: not kept as JSON yet)
    plan, objects = _plan(exe), [exe.ptx.encode()] if gpu else exe.keepalive.objects
    if gpu:
        _gpu_programs[key] = (plan, objects)
        while len(_gpu_programs) > GPU_PROGRAMS:
            _gpu_programs.pop(next(iter(_gpu_programs)))
    if disk:
        cache.store(key, plan, objects)


def _compile_gpu(graph: Graph, prog, options: CompileOptions, name: str, timer: StageTimer, arch: str,
                 sms: int | None) -> CompiledProgram:
    """Kernels of one structure share PTX (codegen.gpu_program), compiled once
    per process, for GPU arch with sms multiprocessors (None: not known, no
    GPU present); where one cannot be shared, one module of every kernel,
    emitted from the whole program."""
    from .codegen.gpu_program import build_program
    with timer("schedule"):  # (512 bits: unused, the nvgpu schedule has no register blocks)
        sched = schedule_program(prog, options.fusion, options.tile_sizes, "nvgpu", 512, timer)
    code = build_program(prog, sched, name, (arch, sms, options.tile_sizes), timer)
    if code is None:
        return _compile_gpu_whole(graph, prog, options, name, timer, arch, sms)
    ir = {"mapping": code.mapping, "llvm": code.ir, "llvm_opt": code.optimized, "ptx": code.ptx}
    exe = _executable(GpuProgram, graph, prog, sched, code.kernels, code.buffers, code.int_slots, options, name,
                      None, ir, _gpu_fields(prog, code.kernels, code.ptx, arch))
    exe.stats["kernels_compiled"] = code.compiled
    return exe


def _gpu_fields(prog, kernels, ptx_text: str, arch: str) -> dict:
    return {"ptx": ptx_text, "arch": arch, "writes": [  # the arrays each kernel writes size its grid
        [prog.arrays[a] for a in sorted({s.array for s in prog.statements if s.name in k.statements})]
        for k in kernels]}


def _compile_gpu_whole(graph: Graph, prog, options: CompileOptions, name: str, timer: StageTimer, arch: str,
                       sms: int | None) -> CompiledProgram:
    """One module of every kernel, emitted from the whole program."""
    from .codegen.nvgpu import GpuEmitter, ptx
    with timer("schedule"):
        sched = schedule_program(prog, options.fusion, options.tile_sizes, "nvgpu", 512, timer, canonical=False)
    with timer("emit"):
        emitter = GpuEmitter(prog, sched, name)
        emitter.tile_sizes = options.tile_sizes
        emitter.multiprocessors = sms
        llvm_text = str(emitter.emit())
    with timer("llvm"):
        optimized, ptx_text = ptx(llvm_text, arch)
    kernels = emitter.kernels
    exe = _executable(GpuProgram, graph, prog, sched, kernels, emitter.buffer_arrays, emitter.int_slots,
                      options, name, None, {"mapping": emitter.mapping_text(), "llvm": llvm_text,
                                            "llvm_opt": optimized, "ptx": ptx_text},
                      _gpu_fields(prog, kernels, ptx_text, arch))
    exe.stats["kernels_compiled"] = len(kernels)
    return exe


_PLAN_STATS = ("kernels", "statements", "fused", "inlined", "contracted_buffers", "parallel_kernels",
               "library_calls", "fusions_refused", "fusion_refusals", "contractions")


def _plan(exe: CompiledProgram) -> dict:
    """What _from_cache needs to run the program again, as JSON."""
    return {
        "inputs": [cache.array_json(a) for a in exe.inputs], "outputs": [cache.array_json(a) for a in exe.outputs],
        "output_arrays": exe.output_arrays, "buffers": [cache.array_json(a) for a in exe.buffers],
        "int_slots": exe.int_slots, "params": exe.params,
        "constraints": [[cache.size_json(a), cache.size_json(b)] for a, b in exe.constraints],
        "kernels": [[k.name, k.parallel, list(k.statements)] for k in exe.kernels],
        "contracted": [[[cache.size_json(s) for s in shape], itemsize, list(moduli), par]
                       for shape, itemsize, moduli, par in exe.contracted_bytes.buffers],
        "stats": {k: exe.stats[k] for k in _PLAN_STATS},
        "ir": {k: v for k, v in exe.ir.items() if k != "ptx"},  # (a GPU program's PTX is its object)
        **({"gpu": {"arch": exe.arch, "writes": [[cache.array_json(a) for a in w] for w in exe.writes],
                    "kernels": [[k.lanes, list(k.zeroed), k.strips] for k in exe.kernels]}}
           if isinstance(exe, GpuProgram) else {}),
    }


def _from_cache(graph: Graph, options: CompileOptions, name: str, plan: dict,
                objects: list[bytes]) -> CompiledProgram | None:
    """A program loaded from the compile cache: nothing lowered, scheduled or compiled."""
    from .codegen.llvm import KernelInfo
    from .codegen.program import LoadedProgram
    from .library import blas
    gpu = plan.get("gpu")
    if gpu:  # PTX: loaded on the device at the first call
        loaded, gpu_fields = None, {"ptx": objects[0].decode(), "arch": gpu["arch"],
                                    "writes": [[cache.array_from(a) for a in w] for w in gpu["writes"]]}
        kernels = [KernelInfo(n, par, tuple(st), lanes, tuple(zeroed), strips)
                   for (n, par, st), (lanes, zeroed, strips) in zip(plan["kernels"], gpu["kernels"])]
    else:
        if plan["stats"].get("library_calls") and blas() is None:
            return None  # made where a BLAS was: compiled again here
        loaded, gpu_fields = LoadedProgram(objects), {}
        kernels = loaded.bind([KernelInfo(n, par, tuple(st)) for n, par, st in plan["kernels"]])
    contracted = [(tuple(cache.size_from(s) for s in shape), itemsize, tuple(moduli), par)
                  for shape, itemsize, moduli, par in plan["contracted"]]
    exe = (GpuProgram if gpu else CompiledProgram)(
        name=name, inputs=[cache.array_from(a) for a in plan["inputs"]],
        outputs=[cache.array_from(a) for a in plan["outputs"]], output_arrays=plan["output_arrays"],
        buffers=[cache.array_from(a) for a in plan["buffers"]], int_slots=[tuple(s) for s in plan["int_slots"]],
        params=plan["params"], constraints=[(cache.size_from(a), cache.size_from(b)) for a, b in plan["constraints"]],
        constants=[n.attrs["value"] for n in graph.nodes() if n.op == "tensor_constant"], kernels=kernels,
        num_threads=options.num_threads, stats={**plan["stats"], "intermediate_bytes": 0, "fallbacks": 0,
                                                "kernels_compiled": 0},
        contracted_bytes=ContractedBytes(contracted, options.num_threads), keepalive=loaded, **gpu_fields)
    exe.ir = {**plan["ir"], **({"ptx": gpu_fields["ptx"]} if gpu else {})}
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


def _executable(cls, graph: Graph, prog, sched, kernels, buffers, int_slots, options: CompileOptions, name: str,
                keepalive, ir: dict, gpu_fields: dict) -> CompiledProgram:
    inputs = sorted((a for a in prog.arrays.values() if a.kind == "input"), key=lambda a: a.index)
    outputs = sorted((a for a in prog.arrays.values() if a.kind == "output"), key=lambda a: a.index)
    consts = [n.attrs["value"] for n in graph.nodes() if n.op == "tensor_constant"]
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
    }
    exe = cls(name=name, inputs=inputs, outputs=outputs, output_arrays=prog.outputs, buffers=buffers,
              int_slots=int_slots, params=prog.params, constraints=prog.constraints, constants=consts,
              kernels=kernels, num_threads=options.num_threads, stats=stats,
              contracted_bytes=ContractedBytes(contracted, options.num_threads), keepalive=keepalive, **gpu_fields)
    exe.ir = {
        "graph": str(graph),
        "affine": str(prog),
        "schedule": sched.schedule_text(),
        "ast": sched.ast_text() + ("\ncontracted: " + ", ".join(
            f"{n}{list(m)}" for n, m in sched.contracted.items()) if sched.contracted else ""),
        **ir,
    }
    return exe


def _device_arch() -> str:
    """The sm_XX of the GPU in use; DeviceError without a driver or GPU."""
    from .cuda import device
    from .cuda import default_ordinal
    return device(default_ordinal()).arch


def _multiprocessors() -> int | None:
    """The multiprocessors of the GPU in use (None without one: PTX for gpu_arch)."""
    from .cuda import default_ordinal, device
    from .errors import DeviceError
    try:
        return device(default_ordinal()).multiprocessors
    except DeviceError:
        return None


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
