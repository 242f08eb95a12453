"""A launch plan as host code, compiled once with llvmlite, so that a caller
outside Python (an XLA custom call) runs a program's kernels with no
interpreter in between (the Python that did these launches was a large
part of a small training step's time: bench/NOTES.md).

The function built is

    int32_t launch(void **inputs, void **outputs, CUstream stream, char *message, size_t size)

It places the input and output pointers in the kernels' argument block
(constants' pointers and the integer arguments are fixed in the code), then
runs the steps in order. A GPU plan first checks that ``stream`` belongs to
its context (the kernels were loaded there) and makes that context current;
on the first failing driver call it writes what failed into ``message`` and
returns the CUDA error code. A CPU plan (stream NULL) runs its kernels with
IEEE subnormals and restores the caller's floating-point mode. 0 when all
went well.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Mapping, Sequence

from llvmlite import ir

from .cpu import JitModule, ieee_floats

I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
PTR = I8.as_pointer()
LAUNCH_T = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)  # the launch function's type
CUDA_ERROR_INVALID_CONTEXT = 201
SYMBOLS = ("cuStreamGetCtx", "cuCtxGetCurrent", "cuCtxSetCurrent", "cuMemsetD8Async", "cuMemsetD32Async",
           "cuLaunchKernel", "snprintf")  # the functions a GPU launcher calls, by address
CPU_SYMBOLS = ("GOMP_parallel", "polyjit_omp_part", "omp_get_thread_num", "omp_get_num_threads",
               "snprintf")  # a CPU launcher's (the first four where a kernel runs on the team)


@dataclass(frozen=True)
class Memset:
    """Fill ``count`` elements of ``width`` bytes (1 or 4) at argument slot
    ``slot``: cuMemsetD8/D32Async on the GPU, a loop on the CPU."""
    slot: int
    value: int
    count: int
    width: int
    what: str


@dataclass(frozen=True)
class Launch:
    """cuLaunchKernel of ``function`` (a CUfunction's address) on a 1-D grid."""
    function: int
    grid: int
    block: int
    what: str


@dataclass(frozen=True)
class Run:
    """A CPU kernel ``kernel(buffers, ints, part, parts)`` at address ``kernel``:
    whole (threads 1), or its parts on libgomp's team (GOMP_parallel of the
    team's trampoline)."""
    kernel: int
    threads: int
    what: str


@dataclass(frozen=True)
class LaunchPlan:
    """What a native launcher does: ``slots`` kernel arguments that are
    pointers (then ``ints``, fixed), of which ``inputs`` and ``outputs`` (by
    position in the call) are set per call and ``fixed`` maps the others'
    slots to their addresses."""
    slots: int
    inputs: Sequence[int]
    outputs: Sequence[int]
    fixed: Mapping[int, int]
    ints: Sequence[int]
    steps: Sequence[Memset | Launch | Run]
    context: int | None  # the CUDA context of a GPU plan; None on the CPU


class NativeLauncher:
    """A LaunchPlan compiled for the host; ``address`` is the launch function's.
    ``symbols``: the address of each function in SYMBOLS (CPU_SYMBOLS for a
    CPU plan, whose kernels run with IEEE subnormals whatever the calling
    thread's floating-point mode: XLA's threads flush them). ``results``: what the
    caller passes as outputs, as (name, shape, numpy dtype). ``owner`` stays
    alive with it (the program whose modules hold the kernels)."""

    def __init__(self, name: str, plan: LaunchPlan, symbols: Mapping[str, int], results: Sequence[tuple] = (),
                 owner=None) -> None:
        self.plan, self.results, self.owner = plan, list(results), owner
        self.ir = str(_module(name, plan, symbols))
        self._jit = JitModule(self.ir)
        self.address = self._jit.engine.get_function_address(name)


def _module(name: str, plan: LaunchPlan, symbols: Mapping[str, int]) -> ir.Module:
    mod = ir.Module(name=name)
    fn = ir.Function(mod, ir.FunctionType(I32, [PTR.as_pointer(), PTR.as_pointer(), PTR, PTR, I64]), name)
    ins, outs, stream, message, size = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    fail = fn.append_basic_block("fail")
    strings: dict[str, ir.GlobalVariable] = {}

    def string(text: str) -> ir.Value:
        if text not in strings:
            strings[text] = string_constant(mod, f"{name}.s{len(strings)}", text)
        return strings[text].bitcast(PTR)

    def function(call: str, *types: ir.Type) -> ir.Value:
        return b.inttoptr(ir.Constant(I64, symbols[call]), ir.FunctionType(I32, types).as_pointer())

    # on failure: message <- "<what> failed: CUDA error <code>", return code
    b.position_at_end(fail)
    what = b.phi(PTR, "what")
    code = b.phi(I32, "code")
    fmt = string("%s failed: CUDA error %d")
    printf = b.inttoptr(ir.Constant(I64, symbols["snprintf"]),
                        ir.FunctionType(I32, [PTR, I64, PTR], var_arg=True).as_pointer())
    b.call(printf, [message, size, fmt, what, code])
    b.ret(code)
    b.position_at_end(fn.entry_basic_block)

    def checked(result: ir.Value, text: str) -> None:
        ok = fn.append_basic_block()
        what.add_incoming(string(text), b.block)
        code.add_incoming(result, b.block)
        b.cbranch(b.icmp_unsigned("==", result, ir.Constant(I32, 0)), ok, fail)
        b.position_at_end(ok)

    ctx = b.alloca(PTR)
    pointers = b.alloca(ir.ArrayType(PTR, max(plan.slots, 1)))
    ints = b.alloca(ir.ArrayType(I64, max(len(plan.ints), 1)))
    params = b.alloca(ir.ArrayType(PTR, max(plan.slots + len(plan.ints), 1)))
    cpu = plan.context is None
    if cpu:
        restore = ieee_floats(b)
    else:  # the stream's context must be the plan's; make it current
        checked(b.call(function("cuStreamGetCtx", PTR, PTR.as_pointer()), [stream, ctx]), "cuStreamGetCtx")
        mine = ir.Constant(I64, plan.context).inttoptr(PTR)
        other = b.icmp_unsigned("!=", b.load(ctx), mine)
        result = b.select(other, ir.Constant(I32, CUDA_ERROR_INVALID_CONTEXT), ir.Constant(I32, 0))
        checked(result, "matching the stream's context to the one the kernels were loaded in")
        checked(b.call(function("cuCtxGetCurrent", PTR.as_pointer()), [ctx]), "cuCtxGetCurrent")
        with b.if_then(b.icmp_unsigned("!=", b.load(ctx), mine)):
            checked(b.call(function("cuCtxSetCurrent", PTR), [mine]), "cuCtxSetCurrent")

    zero = ir.Constant(I32, 0)

    def slot(k: int) -> ir.Value:
        return b.gep(pointers, [zero, ir.Constant(I32, k)])
    for given, slots in ((ins, plan.inputs), (outs, plan.outputs)):
        for k, s in enumerate(slots):
            b.store(b.load(b.gep(given, [ir.Constant(I32, k)])), slot(s))
    for s, address in plan.fixed.items():
        b.store(ir.Constant(I64, address).inttoptr(PTR), slot(s))
    for k, value in enumerate(plan.ints):
        b.store(ir.Constant(I64, value), b.gep(ints, [zero, ir.Constant(I32, k)]))
    places = [slot(k) for k in range(plan.slots)] + [b.gep(ints, [zero, ir.Constant(I32, k)])
                                                      for k in range(len(plan.ints))]
    for k, place in enumerate(places):
        b.store(b.bitcast(place, PTR), b.gep(params, [zero, ir.Constant(I32, k)]))
    argv = b.bitcast(params, PTR.as_pointer())

    kernel_type = ir.FunctionType(ir.VoidType(), [PTR, PTR, I64, I64]).as_pointer()
    for step in plan.steps:
        if cpu and isinstance(step, Memset):
            _fill(b, b.load(slot(step.slot)), step)
            continue
        if isinstance(step, Run):
            kernel = b.inttoptr(ir.Constant(I64, step.kernel), kernel_type)
            buffers, numbers = b.bitcast(pointers, PTR), b.bitcast(ints, PTR)
            if step.threads > 1:
                data = b.alloca(ir.ArrayType(PTR, 5))
                team = [b.bitcast(kernel, PTR), buffers, numbers] + [
                    ir.Constant(I64, symbols[n]).inttoptr(PTR) for n in ("omp_get_thread_num", "omp_get_num_threads")]
                for k, v in enumerate(team):
                    b.store(v, b.gep(data, [zero, ir.Constant(I32, k)]))
                parallel = b.inttoptr(ir.Constant(I64, symbols["GOMP_parallel"]), ir.FunctionType(
                    ir.VoidType(), [PTR, PTR, I32, I32]).as_pointer())
                b.call(parallel, [ir.Constant(I64, symbols["polyjit_omp_part"]).inttoptr(PTR), b.bitcast(data, PTR),
                                  ir.Constant(I32, step.threads), ir.Constant(I32, 0)])
            else:
                b.call(kernel, [buffers, numbers, ir.Constant(I64, 0), ir.Constant(I64, 1)])
            continue
        if isinstance(step, Memset):
            width = I8 if step.width == 1 else I32
            call = function("cuMemsetD8Async" if step.width == 1 else "cuMemsetD32Async", I64, width, I64, PTR)
            target = b.ptrtoint(b.load(slot(step.slot)), I64)
            result = b.call(call, [target, ir.Constant(width, step.value), ir.Constant(I64, step.count), stream])
        else:
            call = function("cuLaunchKernel", PTR, I32, I32, I32, I32, I32, I32, I32, PTR, PTR.as_pointer(),
                            PTR.as_pointer())
            dims = [ir.Constant(I32, x) for x in (step.grid, 1, 1, step.block, 1, 1, 0)]
            result = b.call(call, [ir.Constant(I64, step.function).inttoptr(PTR), *dims, stream, argv,
                                   ir.Constant(PTR.as_pointer(), None)])
        checked(result, step.what)
    if cpu:
        restore()
    b.ret(ir.Constant(I32, 0))
    return mod


def _fill(b: ir.IRBuilder, base: ir.Value, step: Memset) -> None:
    """A loop storing step.value into step.count elements at base (a CPU memset)."""
    width = I8 if step.width == 1 else I32
    start, loop, done = b.block, b.append_basic_block("fill"), b.append_basic_block("filled")
    b.cbranch(b.icmp_unsigned("!=", ir.Constant(I64, step.count), ir.Constant(I64, 0)), loop, done)
    b.position_at_end(loop)
    i = b.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), start)
    b.store(ir.Constant(width, step.value), b.gep(b.bitcast(base, width.as_pointer()), [i]))
    nxt = b.add(i, ir.Constant(I64, 1))
    i.add_incoming(nxt, b.block)
    b.cbranch(b.icmp_unsigned("<", nxt, ir.Constant(I64, step.count)), loop, done)
    b.position_at_end(done)


def string_constant(mod: ir.Module, name: str, text: str) -> ir.GlobalVariable:
    """A private NUL-terminated string in mod."""
    data = bytearray(text.encode() + b"\0")
    g = ir.GlobalVariable(mod, ir.ArrayType(I8, len(data)), name)
    g.global_constant, g.linkage, g.initializer = True, "private", ir.Constant(g.type.pointee, data)
    return g
