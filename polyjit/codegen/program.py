"""A CPU program built from kernel code shared by structure.

Kernels of the same structure (a fusion group's canonical statements, arrays
and schedule, the kernel's place in it: a model's identical layers) are
emitted and compiled once per process; a kernel of the same IR as another
(of a group that differs elsewhere) is compiled once too. LLVM's passes and
machine code run on a thread of their own while the next kernels are
scheduled and emitted in Python (llvmlite's calls release the GIL; its lock
keeps one LLVM call at a time, so one thread is all it can use). Each such
kernel's code takes its group's buffers and integers in the group's own
order; a small entry per kernel of the program, with the runtime's fixed
signature, gathers the program's buffers into that order and calls it. The
machine code is object code, loaded into one MCJIT engine per program, so
that it can be kept on disk as it is (polyjit.cache).
"""
from __future__ import annotations

import functools
import hashlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable

import llvmlite.binding as llvm
from llvmlite import ir

from ..affine import AffineProgram
from .. import cache
from ..cache import ProcessCache
from ..collector import collect_young
from ..errors import UnsupportedOpError
from ..schedule import ProgramSchedule, ScheduledGroup
from .blas import SGEMM, register_symbols
from . import workers
from .cpu import (KERNEL_T, CpuEmitter, _lock, host_key, module_target, object_machine, optimized_module,
                  target_machine, vector_bits)
from .cpu_mapping import CpuMapper
from .llvm import I64, PTR, KernelInfo, buffer_layout, kernel_name
from .mapping import mapping_text

CODE_CACHE = 8192  # compiled kernels kept per process, each by two keys (_kept)


@dataclass(frozen=True)
class KernelCode:
    """One kernel's code: entry `symbol(buffers, ints, part, parts)` over its group's slots."""

    symbol: str
    parallel: bool
    mapping: str  # its plan as printed (codegen.cpu_mapping; the plan holds AST nodes: not kept)
    ir: str  # as emitted
    job: Future = field(compare=False)  # (optimized IR, object code, seconds), made on the LLVM thread

    @property
    def optimized(self) -> str:
        """The IR after LLVM's passes."""
        return self.job.result()[0]

    @property
    def obj(self) -> bytes:
        """The machine code."""
        return self.job.result()[1]


_codes = ProcessCache(CODE_CACHE)  # (key, variant) -> KernelCode
_llvm_thread: ThreadPoolExecutor | None = None
_thread_lock = threading.Lock()


def _forget_thread() -> None:
    """In a forked child the LLVM thread is gone: start another on demand."""
    global _llvm_thread, _thread_lock
    _llvm_thread, _thread_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_thread)


def _submit(fn, *args) -> Future:
    """Run fn on the LLVM thread (started on first use)."""
    global _llvm_thread
    with _thread_lock:
        if _llvm_thread is None:
            _llvm_thread = ThreadPoolExecutor(1, thread_name_prefix="polyjit-llvm")
        return _llvm_thread.submit(fn, *args)


def kernel_code(group: ScheduledGroup, j: int, config: str, timer, variant: tuple = ()) -> tuple[KernelCode, bool]:
    """The code of kernel j of group (compiled now, or earlier in this process
    for the same variant, what else chose its schedule, or for another
    kernel of the same IR: second result True); its machine code may still
    be on the way (KernelCode.job)."""
    key = _kernel_key(group, j, config)
    code = _codes.get((key, variant))
    if _usable(code):
        return code, True
    emitted = _emitted(group, j, timer)
    same = _same_ir(emitted[0])
    if same is not None:
        return _kept(key, variant, emitted, same.job), True
    job = workers.workers().submit(workers.OBJECT, emitted[-1], _on_thread)  # (its IR)
    return _kept(key, variant, emitted, job), False


def _usable(code: KernelCode | None) -> bool:
    return code is not None and not (code.job.done() and code.job.exception())


def _same_ir(symbol: str) -> KernelCode | None:
    """The code made in this process of the IR that symbol names (_emitted), or None."""
    code = _codes.get(symbol)
    return code if _usable(code) else None


def _finished(optimized: str, obj: bytes, seconds: float) -> Future:
    """A job done already: a kernel's code made in a worker process."""
    job: Future = Future()
    job.set_result((optimized, obj, seconds))
    return job


def _kept(key: str, variant: tuple, emitted: tuple[str, bool, str, str], job: Future) -> KernelCode:
    """The code of an emitted kernel (_emitted's result) and its job, kept in
    the process's cache by its group's key and by its symbol, which names
    its IR (_emitted)."""
    code = KernelCode(*emitted, job)
    _codes.put((key, variant), code)
    _codes.put(code.symbol, code)
    return code


def _kernel_key(group: ScheduledGroup, j: int, config: str) -> str:
    return hashlib.sha256(f"{group.problem.key}|{config}|{j}".encode()).hexdigest()


def _emitted(group: ScheduledGroup, j: int, timer) -> tuple[str, bool, str, str]:
    """Kernel j of group emitted: its symbol, whether it is parallel, its
    mapping as printed and its LLVM IR. The symbol ends in a hash of the IR
    (emitted under a placeholder name): kernels of groups that differ
    elsewhere (a transpose, a pack, a per-channel sum beside other
    statements) are often the same IR, compiled once (kernel_code,
    WorkerCodes.make)."""
    node = group.sched.kernel_asts()[j]
    with timer("mapping"):
        plan = CpuMapper(group.problem.prog, group.sched, vector_bits()).kernel(j, node)
    with timer("emit"):
        emitter = CpuEmitter(group.problem.prog, group.sched, "k")
        placeholder = kernel_name(group.problem.prog, "", j, group.sched.kernels[j]).replace("_kernel", "_" + _UNNAMED)
        emitter.symbol = placeholder
        emitter.kernel(j, node, plan)
        text = str(emitter.module)
        symbol = placeholder.replace(_UNNAMED, hashlib.sha256(text.encode()).hexdigest()[:16])
    return symbol, emitter.kernels[0].parallel, str(plan), text.replace(placeholder, symbol)


_UNNAMED = "0" * 16  # a kernel's symbol's hash while its IR is emitted


@dataclass(frozen=True)
class WorkerCodes:
    """What a worker process that schedules a group needs to make its
    kernels' code as well (schedule_program's remote): it holds the group's
    AST already, which the caller would otherwise build again from the
    schedule's text to emit the same IR, and sends the same IR to a worker."""

    def make(self, group: ScheduledGroup, timer) -> list[tuple]:
        """Each kernel's (symbol, parallel, mapping, IR, optimized IR, object
        code, LLVM's seconds); the seconds are None for a kernel of the same
        IR as one this process made before, which is not compiled again."""
        out = []
        for j in range(len(group.sched.kernels)):
            emitted = _emitted(group, j, timer)
            same = _same_ir(emitted[0])
            if same is not None:
                out.append((*emitted, same.optimized, same.obj, None))
                continue
            with timer("llvm"):
                start = time.perf_counter()
                optimized, obj = compile_object(emitted[-1])
            seconds = time.perf_counter() - start
            _codes.put(emitted[0], KernelCode(*emitted, _finished(optimized, obj, seconds)))
            out.append((*emitted, optimized, obj, seconds))
        return out


def _on_thread(ir_text: str) -> Future:
    return _submit(_timed_object, ir_text)


def _timed_object(ir_text: str) -> tuple[str, bytes, float]:
    start = time.perf_counter()
    optimized, obj = compile_object(ir_text)
    return optimized, obj, time.perf_counter() - start


def compile_object(ir_text: str) -> tuple[str, bytes]:
    """(optimized IR, object code) of a module, for this host."""
    with _lock:
        tm = object_machine()
        mod, optimized = optimized_module(ir_text, tm)
        return optimized, tm.emit_object(mod)


def finish(codes: list[KernelCode], new: list[KernelCode], timer) -> None:
    """Wait for the machine code of codes: the wait is the "llvm" stage; the
    LLVM thread's own seconds for those of them compiled for this program
    (new) go to "llvm/thread" (in the log's detail)."""
    with timer("llvm"):
        for c in codes:
            c.job.result()
    timer.add("llvm/thread", sum(c.job.result()[2] for c in new))
@dataclass
class ProgramCode:
    """What a CPU program runs: its buffers, integers, kernels and their code."""

    buffers: list
    int_slots: list[tuple[str, int]]
    kernels: list[KernelInfo]  # names of the entries, statements in the program's names
    codes: list[KernelCode]  # each distinct kernel code once
    entries: str  # the entries module's IR
    compiled: int  # kernels whose code was compiled for this program
    mapping: str  # the mapping stage: a line per kernel


class CodeSet:
    """The kernel codes of one program, asked for as its groups are scheduled
    (of) and again as the program is built; the codes compiled for it (not
    found in the process's cache) are in ``new``. variant: what else than
    a group's statements chose its schedule (target, fusion, tile sizes).
    As schedule_program's remote, it has the groups scheduled in worker
    processes made there (spec) and takes their code in (adopt)."""

    def __init__(self, config: str, timer, variant: tuple = ()) -> None:
        self.config, self.timer, self.variant = config, timer, variant
        self.new: list[KernelCode] = []
        self.spec = WorkerCodes()

    def adopt(self, group: ScheduledGroup, made: list[tuple]) -> None:
        """group's kernels as spec.make made them in a worker: compiled for
        this program, but those the worker had made before."""
        for j, (*emitted, optimized, obj, seconds) in enumerate(made):
            code = _kept(_kernel_key(group, j, self.config), self.variant, tuple(emitted),
                         _finished(optimized, obj, seconds or 0.0))
            if seconds is not None:
                self.new.append(code)

    def of(self, group: ScheduledGroup) -> list[KernelCode]:
        out = []
        for j in range(len(group.sched.kernels)):
            code, reused = kernel_code(group, j, self.config, self.timer, self.variant)
            if not reused:
                self.new.append(code)
                collect_young()  # (the kernel's llvmlite module, printed, is cycles now)
            out.append(code)
        return out


def build_program(prog: AffineProgram, sched: ProgramSchedule, name: str, codeset: CodeSet) -> ProgramCode:
    timer = codeset.timer
    buffers, int_slots = buffer_layout(prog, sched.contracted)
    slot = {a.name: k for k, a in enumerate(buffers)}
    int_slot = {s: k for k, s in enumerate(int_slots)}
    module = ir.Module(name=name)
    kernels, codes, plans = [], {}, []
    k = 0
    for group in sched.groups:
        mini_buffers, mini_ints = buffer_layout(group.problem.prog, group.sched.contracted)
        arrays = group.problem.arrays
        bufs = [slot[arrays[a.name]] for a in mini_buffers]
        ints = [int_slot[(p, d) if d < 0 else (arrays[p], d)] for p, d in mini_ints]
        for code in codeset.of(group):
            codes.setdefault(code.symbol, code)
            entry = kernel_name(prog, name, k, sched.kernels[k])
            with timer("emit"):
                _entry(module, entry, code.symbol, bufs, ints)
            kernels.append(KernelInfo(entry, code.parallel, tuple(sorted(sched.kernels[k]))))
            plans.append((entry, group.real_names(code.mapping)))
            k += 1
    finish(list(codes.values()), codeset.new, timer)
    return ProgramCode(buffers, int_slots, kernels, list(codes.values()), str(module), len(codeset.new),
                       mapping_text(plans))


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


def host_object(ir_text: str) -> bytes:
    """Machine code of straight-line host code (loads, stores and calls: a
    program's entries module, a native launcher), no passes, selected as at
    -O0: the same instructions as the kernels' machine makes of it
    (bench/NOTES.md), in a fraction of the time."""
    with _lock:
        mod = llvm.parse_assembly(ir_text)
        mod.triple, mod.data_layout = module_target()
        return _host_machine().emit_object(mod)


def cached_host_object(kind: str, structure: tuple | None, ir_text: Callable[[], str]) -> tuple[bytes, bool]:
    """host_object of ir_text(), host code of this kind ("launcher") whose
    code depends on ``structure`` alone (its addresses filled in as it
    loads): taken from the compile cache where it is there, else made and
    stored (structure None: made only, the cache off); and whether it was
    made. So a warm process compiles no launcher or XLA handler."""
    key = cache.digest(kind, host_key(), *map(repr, structure)) if structure is not None else None
    hit = cache.load(key) if key is not None else None
    if hit and hit[0].get(kind) and len(hit[1]) == 1:
        return hit[1][0], False
    code = host_object(ir_text())
    if key is not None:
        cache.store(key, {kind: True}, [code])
    return code, True


@functools.cache
def _host_machine():
    """The target machine that makes host code's objects (use with _lock held)."""
    return target_machine(0)


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
            mod.triple, mod.data_layout = module_target()
            self.engine = llvm.create_mcjit_compiler(mod, tm)
            for obj in objects:
                self.engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
            self.engine.finalize_object()

    def function(self, name: str):
        return KERNEL_T(self.engine.get_function_address(name))

    def bind(self, kernels: list[KernelInfo]) -> list[KernelInfo]:
        return [replace(k, fn=self.function(k.name)) for k in kernels]
