"""The pipeline driver: graph -> affine program -> schedule -> LLVM -> Executable.

Each stage's output is kept as text on the Executable (``exe.ir``); with
``debug`` they are also written to ``dump_dir``.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import replace

from . import sizes as sz
from .cuda import GpuExecutable
from .graph import Graph
from .library import LibraryPolicy
from .lowering import GPU_RECOMPUTE_LIMIT, RECOMPUTE_LIMIT, lower
from .options import CompileOptions
from .runtime import Executable
from .schedule import schedule_program

log = logging.getLogger("polyjit")
_dump_ids = itertools.count()


def compile_graph(graph: Graph, options: CompileOptions, name: str = "fn") -> Executable:
    t0 = time.perf_counter()
    gpu = options.target == "nvgpu"
    if gpu:
        from .codegen.nvgpu import GpuEmitter as emitter_class
        arch = options.gpu_arch or _device_arch()
        bits = 512  # unused: the nvgpu schedule has no register blocks
    else:
        from .codegen.cpu import CpuEmitter as emitter_class
        from .codegen.cpu import vector_bits
        bits = vector_bits()

    graph = graph.deduplicated()
    if not gpu:
        graph = graph.packed()
    policy = None if gpu else LibraryPolicy(options.contractions, options.num_threads)
    prog = lower(graph, GPU_RECOMPUTE_LIMIT if gpu else RECOMPUTE_LIMIT, policy)
    sched = schedule_program(prog, options.fusion, options.tile_sizes, options.target, bits)
    emitter = emitter_class(prog, sched, name)
    if gpu:
        emitter.tile_sizes = options.tile_sizes
        emitter.multiprocessors = _multiprocessors()
    module = emitter.emit()
    if gpu:
        from .codegen.nvgpu import ptx
        optimized, ptx_text = ptx(str(module), arch)
        jit = None
        kernels = emitter.kernels
    else:
        from .codegen.cpu import JitModule
        jit = JitModule(str(module))
        optimized = jit.optimized_ir
        kernels = [replace(k, fn=jit.function(k.name)) for k in emitter.kernels]
    inputs = sorted((a for a in prog.arrays.values() if a.kind == "input"), key=lambda a: a.index)
    outputs = sorted((a for a in prog.arrays.values() if a.kind == "output"), key=lambda a: a.index)
    consts = [n.attrs["value"] for n in graph.nodes() if n.op == "tensor_constant"]
    kernel_parallel = {i: k.parallel for i, k in enumerate(emitter.kernels)}
    contracted = [(prog.arrays[n], m, kernel_parallel.get(sched.kernel_of_array.get(n), False))
                  for n, m in sched.contracted.items()]

    def contracted_bytes(env) -> int:
        total = 0
        for arr, moduli, par in contracted:
            count = 1
            for s, m in zip(arr.shape, moduli):
                count *= sz.evaluate(s, env) if m is None else m
            total += count * arr.dtype.itemsize * (options.num_threads if par else 1)
        return total

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
        "contractions": policy.choices if policy else [],
    }
    gpu_fields = {}
    if gpu:  # the arrays each kernel writes size its grid
        gpu_fields = {"ptx": ptx_text, "arch": arch, "writes": [
            [prog.arrays[a] for a in sorted({s.array for s in prog.statements if s.name in k.statements})]
            for k in kernels]}
    exe = (GpuExecutable if gpu else Executable)(name=name, inputs=inputs, outputs=outputs, output_arrays=prog.outputs,
                     buffers=emitter.buffer_arrays, int_slots=emitter.int_slots,
                     params=prog.params, constraints=prog.constraints, constants=consts,
                     kernels=kernels, num_threads=options.num_threads, stats=stats,
                     contracted_bytes=contracted_bytes, keepalive=jit, **gpu_fields)
    exe.ir = {
        "graph": str(graph),
        "affine": str(prog),
        "schedule": str(sched.schedule.get_root()) if hasattr(sched.schedule, "get_root") else str(sched.schedule),
        "ast": sched.ast_text() + ("\ncontracted: " + ", ".join(
            f"{n}{list(m)}" for n, m in sched.contracted.items()) if sched.contracted else ""),
        "llvm": str(module),
        "llvm_opt": optimized,
    }
    if gpu:
        exe.ir["ptx"] = ptx_text
    stats["compile_seconds"] = time.perf_counter() - t0
    log.debug("compiled %s in %.3fs: %s", name, stats["compile_seconds"], stats)
    if options.debug:
        dump(exe, options.dump_dir)
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


def dump(exe: Executable, folder: str) -> str:
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
