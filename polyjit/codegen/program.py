"""A CPU program built from kernel code shared by structure.

Kernels of the same structure (a fusion group's canonical statements,
arrays and schedule, the kernel's place in it: a model's identical layers)
are emitted and compiled once per process. Each such kernel's code takes
its group's buffers and integers in the group's own order; a small entry
per kernel of the program, with the runtime's fixed signature, gathers the
program's buffers into that order and calls it. The machine code is object
code, loaded into one MCJIT engine per program, so that it can be kept on
disk as it is (polyjit.cache).
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, replace

import llvmlite.binding as llvm
from llvmlite import ir

from ..affine import AffineProgram
from ..errors import UnsupportedOpError
from ..schedule import ProgramSchedule, ScheduledGroup
from .blas import SGEMM, register_symbols
from .cpu import KERNEL_T, CpuEmitter, _lock, optimized_module, target_machine
from .llvm import I64, PTR, KernelInfo, buffer_layout, kernel_name

CODE_CACHE = 4096  # compiled kernels kept per process


@dataclass(frozen=True)
class KernelCode:
    """One kernel's code: entry `symbol(buffers, ints, part, parts)` over its group's slots."""

    symbol: str
    parallel: bool
    ir: str  # as emitted
    optimized: str  # after LLVM's passes
    obj: bytes  # machine code


_codes: dict[str, KernelCode] = {}
_codes_lock = threading.Lock()


def kernel_code(group: ScheduledGroup, j: int, config: str, timer) -> tuple[KernelCode, bool]:
    """The code of kernel j of group (compiled now, or earlier in this process: second result True)."""
    key = hashlib.sha256(f"{group.problem.key}|{config}|{j}".encode()).hexdigest()
    with _codes_lock:
        code = _codes.get(key)
    if code is not None:
        return code, True
    with timer("emit"):
        emitter = CpuEmitter(group.problem.prog, group.sched, "k")
        node = group.sched.kernel_asts()[j]
        emitter.symbol = kernel_name(group.problem.prog, "", j, group.sched.kernels[j]).replace(
            "_kernel", "_" + key[:16])
        emitter.kernel(j, node)
        text = str(emitter.module)
    with timer("llvm"):
        optimized, obj = compile_object(text)
    code = KernelCode(emitter.symbol, emitter.kernels[0].parallel, text, optimized, obj)
    with _codes_lock:
        _codes[key] = code
        while len(_codes) > CODE_CACHE:
            _codes.pop(next(iter(_codes)))
    return code, False


def compile_object(ir_text: str) -> tuple[str, bytes]:
    """(optimized IR, object code) of a module, for this host."""
    tm = target_machine()
    with _lock:
        mod, optimized = optimized_module(ir_text, tm)
        return optimized, tm.emit_object(mod)


@dataclass
class ProgramCode:
    """What a CPU program runs: its buffers, integers, kernels and their code."""

    buffers: list
    int_slots: list[tuple[str, int]]
    kernels: list[KernelInfo]  # names of the entries, statements in the program's names
    codes: list[KernelCode]  # each distinct kernel code once
    entries: str  # the entries module's IR
    compiled: int  # kernels whose code was compiled for this program


def build_program(prog: AffineProgram, sched: ProgramSchedule, name: str, config: str, timer) -> ProgramCode:
    buffers, int_slots = buffer_layout(prog, sched.contracted)
    slot = {a.name: k for k, a in enumerate(buffers)}
    int_slot = {s: k for k, s in enumerate(int_slots)}
    module = ir.Module(name=name)
    kernels, codes, compiled = [], {}, 0
    k = 0
    for group in sched.groups:
        mini_buffers, mini_ints = buffer_layout(group.problem.prog, group.sched.contracted)
        arrays = group.problem.arrays
        bufs = [slot[arrays[a.name]] for a in mini_buffers]
        ints = [int_slot[(p, d) if d < 0 else (arrays[p], d)] for p, d in mini_ints]
        for j in range(len(group.sched.kernels)):
            code, reused = kernel_code(group, j, config, timer)
            compiled += not reused
            codes.setdefault(code.symbol, code)
            entry = kernel_name(prog, name, k, sched.kernels[k])
            with timer("emit"):
                _entry(module, entry, code.symbol, bufs, ints)
            kernels.append(KernelInfo(entry, code.parallel, tuple(sorted(sched.kernels[k]))))
            k += 1
    return ProgramCode(buffers, int_slots, kernels, list(codes.values()), str(module), compiled)


def _entry(module: ir.Module, name: str, target: str, bufs: list[int], ints: list[int]) -> None:
    """name(buffers, ints, part, parts) calls target with the buffers and
    integers at slots bufs and ints, in that order."""
    sig = ir.FunctionType(ir.VoidType(), [PTR, PTR, I64, I64])
    callee = module.globals.get(target) or ir.Function(module, sig, target)
    fn = ir.Function(module, sig, name)
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    src_b, src_i, part, parts = fn.args
    mb = b.alloca(PTR, size=max(len(bufs), 1))
    mi = b.alloca(I64, size=max(len(ints), 1))
    for arr, src, typ, slots in ((mb, src_b, PTR, bufs), (mi, src_i, I64, ints)):
        for dst, s in enumerate(slots):
            v = b.load(b.gep(src, [ir.Constant(I64, s)], source_etype=typ), typ=typ)
            b.store(v, b.gep(arr, [ir.Constant(I64, dst)], source_etype=typ))
    b.call(callee, [mb, mi, part, parts])
    b.ret_void()


def entries_object(entries: str) -> bytes:
    """Machine code of the entries module (loads, stores and calls: no passes)."""
    tm = target_machine()
    with _lock:
        mod = llvm.parse_assembly(entries)
        mod.triple = tm.triple
        mod.data_layout = str(tm.target_data)
        return tm.emit_object(mod)


class LoadedProgram:
    """A program's objects (its entries and kernels) in one MCJIT engine."""

    def __init__(self, objects: list[bytes]) -> None:
        self.objects = objects
        tm = target_machine()
        if any(SGEMM.encode() in obj for obj in objects):
            if not register_symbols():  # code made where a BLAS was, loaded where none is
                raise UnsupportedOpError("a program calling BLAS, loaded without a BLAS library")
        with _lock:
            mod = llvm.parse_assembly("")
            mod.triple = tm.triple
            mod.data_layout = str(tm.target_data)
            self.engine = llvm.create_mcjit_compiler(mod, tm)
            for obj in objects:
                self.engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
            self.engine.finalize_object()

    def function(self, name: str):
        return KERNEL_T(self.engine.get_function_address(name))

    def bind(self, kernels: list[KernelInfo]) -> list[KernelInfo]:
        return [replace(k, fn=self.function(k.name)) for k in kernels]
