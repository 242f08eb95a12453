"""A GPU program built from kernel PTX shared by structure.

As on the CPU (codegen.program), kernels of the same structure (a fusion
group's canonical statements, arrays and schedule, the kernel's place in it,
the GPU's sm_XX and multiprocessors, and which of the group's arrays the
program writes anywhere) are emitted, optimized and turned into PTX once
per process, each in a module of its own whose entry takes its group's
buffers and integers. The program's PTX then holds one entry per kernel
of the program, with the runtime's fixed argument list (every buffer of the
program, then every integer): a copy of the shared entry's text, renamed,
its parameters declared in the program's order and its reads of them
(``ld.param``) pointed at the program's slots. Nothing else changes in the
code, so the launch sequence is the one of a program emitted whole. The
program's LLVM IR (``ir["llvm"]``) is the kernels' modules linked with one
entry per kernel of the program, in the runtime's signature, that calls its
shared kernel.
"""
from __future__ import annotations

import hashlib
import re
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import llvmlite.binding as llvm
from llvmlite import ir

from ..affine import AffineProgram
from ..cache import ProcessCache
from ..schedule import ProgramSchedule, ScheduledGroup
from .llvm import I64, PTR, KernelInfo, buffer_layout, kernel_name
from .gpu_mapping import GpuMapper, Library
from .mapping import mapping_text
from .nvgpu import TRIPLE, GpuEmitter, ptx
from . import workers
from .program import CODE_CACHE, _submit, finish


@dataclass(frozen=True)
class GpuKernelCode:
    """One kernel's code, in its group's names: a module whose only entry is symbol."""

    symbol: str
    info: KernelInfo  # parallel, lanes, zeroed (the group's array names), strips
    mapping: str  # its plan as printed (the plan holds AST nodes: not kept)
    ir: str
    job: Future | None = field(default=None, compare=False)  # (optimized IR, PTX, seconds); None: a cuBLAS step

    @property
    def optimized(self) -> str:
        return self.job.result()[0] if self.job else ""

    @property
    def parts(self) -> tuple[str, str] | None:
        """(the PTX before the entry: .version, .target, .address_size; the
        entry's PTX, from ".visible .entry"), or None where the PTX has more
        than one entry or anything at module scope (not the form instance() copies)."""
        text = self.job.result()[1]
        starts = [m.start() for m in _ENTRY.finditer(text)]
        if len(starts) != 1 or _SCOPE.search(text[:starts[0]]):
            return None
        return text[:starts[0]], text[starts[0]:]


_codes = ProcessCache(CODE_CACHE)  # (key, variant) -> GpuKernelCode
_ENTRY = re.compile(r"^\.visible \.entry ", re.M)
_SCOPE = re.compile(r"^\s*(\.(?:shared|global|const|extern|func|weak)\b)", re.M)


def kernel_code(group: ScheduledGroup, j: int, config: tuple, timer, variant: tuple = ()) \
        -> tuple[GpuKernelCode, bool]:
    """Kernel j of group (emitted now, its PTX made in a worker process or on
    the LLVM thread; or earlier in this process for the same variant, what
    else chose its schedule: second result True)."""
    arch, sms, tile_sizes = config
    key = hashlib.sha256(f"{group.problem.key}|{config}|{j}".encode()).hexdigest()
    code = _codes.get((key, variant))
    if code is not None and not (code.job and code.job.done() and code.job.exception()):
        return code, True
    node = group.sched.kernel_asts()[j]
    with timer("mapping"):
        plan = GpuMapper(group.problem.prog, group.sched, sms, tile_sizes, arch).kernel(node)
    with timer("emit"):
        emitter = GpuEmitter(group.problem.prog, group.sched, "k")
        emitter.symbol = f"polyjit_gpu_{key[:24]}"
        emitter.kernel(j, node, plan)
        text = str(emitter.module)
    if emitter.kernels[0].library is not None:  # a cuBLAS step: no PTX
        return GpuKernelCode(emitter.symbol, emitter.kernels[0], str(plan), ""), False
    code = GpuKernelCode(emitter.symbol, emitter.kernels[0], str(plan), text, _ptx_job(text, arch))
    _codes.put((key, variant), code)
    return code, False


def _ptx_job(text: str, arch: str) -> Future:
    """(optimized IR, PTX, seconds) of a kernel's module, made in a worker
    process once one has started, else on the LLVM thread."""
    return workers.workers().submit(arch, text, lambda t: _on_thread(t, arch))


def _on_thread(text: str, arch: str) -> Future:
    return _submit(_timed_ptx, text, arch)


def _timed_ptx(text: str, arch: str) -> tuple[str, str, float]:
    start = time.perf_counter()
    optimized, ptx_text = ptx(text, arch)
    return optimized, ptx_text, time.perf_counter() - start


class GpuCodeSet:
    """The kernel codes of one program, asked for as its groups are scheduled
    (of: emission starts, and PTX in worker processes or on the LLVM thread,
    while isl schedules the next groups) and again as the program is built;
    those compiled for it (not found in the process's cache) are in ``new``."""

    def __init__(self, config: tuple, timer, variant: tuple = ()) -> None:
        self.config, self.timer, self.variant = config, timer, variant
        self.new: list[GpuKernelCode] = []

    def of(self, group: ScheduledGroup) -> list[GpuKernelCode]:
        out = []
        for j in range(len(group.sched.kernels)):
            code, reused = kernel_code(group, j, self.config, self.timer, self.variant)
            if not reused and code.job is not None:
                self.new.append(code)
            out.append(code)
        return out


def instance(code: GpuKernelCode, name: str) -> str:
    """code's entry as name, taking its own parameters (the program's argument
    slots KernelInfo.params lists: a launch passes only those)."""
    own = f"{code.symbol}_param_"
    return re.sub(rf"\b{re.escape(own)}(\d+)\b", lambda m: f"{name}_param_{m.group(1)}",
                  code.parts[1]).replace(code.symbol, name)


@dataclass
class GpuProgramCode:
    buffers: list
    int_slots: list
    kernels: list[KernelInfo]
    ptx: str
    ir: str  # the distinct kernels' modules as emitted
    optimized: str
    compiled: int
    mapping: str  # the mapping stage: a line per kernel


def build_program(prog: AffineProgram, sched: ProgramSchedule, name: str, codeset: GpuCodeSet) \
        -> GpuProgramCode | None:
    """The program's PTX from kernels shared by structure; None where one of
    them is not in the form instance() copies (then emit the program whole)."""
    timer = codeset.timer
    buffers, int_slots = buffer_layout(prog, sched.contracted)
    slot = {a.name: k for k, a in enumerate(buffers)}
    int_slot = {s: len(buffers) + k for k, s in enumerate(int_slots)}
    kernels, codes, k = [], {}, 0
    uses = []  # (kernel name, code) of each PTX kernel
    plans = []  # (kernel name, plan)
    module = ir.Module(name=name)
    module.triple = TRIPLE
    for group in sched.groups:
        arrays = group.problem.arrays
        mini_buffers, mini_ints = buffer_layout(group.problem.prog, group.sched.contracted)
        params = [slot[arrays[a.name]] for a in mini_buffers]
        params += [int_slot[(p, d) if d < 0 else (arrays[p], d)] for p, d in mini_ints]
        for code in codeset.of(group):
            entry = kernel_name(prog, name, k, sched.kernels[k])
            if code.info.library is not None:  # run by polyjit.runtime.gpu_program, in the program's names
                kernels.append(KernelInfo(entry, False, tuple(sorted(sched.kernels[k])), library=next(
                    s for s in prog.statements if s.name in sched.kernels[k] and s.library is not None)))
                plans.append((entry, Library(kernels[-1].library)))
                k += 1
                continue
            codes.setdefault(code.symbol, code)
            uses.append((entry, code))
            with timer("emit"):
                _entry(module, entry, code.symbol, [PTR if p < len(buffers) else I64 for p in params])
            i = code.info
            kernels.append(KernelInfo(entry, i.parallel, tuple(sorted(sched.kernels[k])), i.lanes,
                                      tuple(arrays[a] for a in i.zeroed), i.strips, params=tuple(params)))
            plans.append((entry, code.mapping))
            k += 1
    # the program's LLVM IR on the LLVM thread, while the PTX is still being made (in workers)
    linked = _submit(_linked, str(module), [c.ir for c in codes.values()])
    finish(list(codes.values()), codeset.new, timer)
    if any(c.parts is None for c in codes.values()):
        return None
    with timer("emit"):
        entries = [instance(code, entry) for entry, code in uses]
    with timer("llvm"):
        linked = linked.result()
    header = next(iter(codes.values())).parts[0] if codes else ""
    return GpuProgramCode(buffers, int_slots, kernels, header + "\n".join(entries), linked,
                          "\n".join(c.optimized for c in codes.values()), len(codeset.new), mapping_text(plans))


def _entry(module: ir.Module, name: str, target: str, types: list) -> None:
    """name(arguments of these types) calls target with them: the kernel's entry in the program."""
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), types), name)
    fn.calling_convention = "ptx_kernel"
    callee = module.globals.get(target) or ir.Function(module, ir.FunctionType(ir.VoidType(), types), target)
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    b.call(callee, list(fn.args))
    b.ret_void()


def _linked(module: str, kernels: list[str]) -> str:
    """module with the kernels' modules linked in, as text."""
    from .cpu import _lock
    with _lock:
        mod = llvm.parse_assembly(module)
        for text in kernels:
            mod.link_in(llvm.parse_assembly(text))
        return str(mod)
