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
import threading
from dataclasses import dataclass

import llvmlite.binding as llvm
from llvmlite import ir

from ..affine import AffineProgram
from ..schedule import ProgramSchedule, ScheduledGroup
from .llvm import I64, PTR, KernelInfo, buffer_layout, kernel_name
from .gpu_mapping import GpuMapper, Library, mapping_text
from .nvgpu import TRIPLE, GpuEmitter, ptx

CODE_CACHE = 4096  # kernels kept per process


@dataclass(frozen=True)
class GpuKernelCode:
    """One kernel's code, in its group's names: a module whose only entry is symbol."""

    symbol: str
    info: KernelInfo  # parallel, lanes, zeroed (the group's array names), strips
    mapping: str  # its plan as printed (the plan holds AST nodes: not kept)
    ir: str
    optimized: str
    header: str  # the PTX before the entry (.version, .target, .address_size)
    entry: str  # the entry's PTX, from ".visible .entry"


_codes: dict[tuple[str, tuple], GpuKernelCode] = {}
_codes_lock = threading.Lock()
_ENTRY = re.compile(r"^\.visible \.entry ", re.M)
_SCOPE = re.compile(r"^\s*(\.(?:shared|global|const|extern|func|weak)\b)", re.M)


def kernel_code(group: ScheduledGroup, j: int, config: tuple, written: frozenset, timer, variant: tuple = ()) \
        -> tuple[GpuKernelCode | None, bool]:
    """Kernel j of group (compiled now, or earlier in this process for the
    same variant, what else chose its schedule: second result True); None
    where its PTX has more than one entry and nothing at module scope, the
    form build_program can copy."""
    arch, sms, tile_sizes = config
    key = hashlib.sha256(f"{group.problem.key}|{config}|{sorted(written)}|{j}".encode()).hexdigest()
    with _codes_lock:
        code = _codes.get((key, variant))
    if code is not None:
        return code, True
    node = group.sched.kernel_asts()[j]
    with timer("mapping"):
        plan = GpuMapper(group.problem.prog, group.sched, sms, tile_sizes).kernel(node)
    with timer("emit"):
        emitter = GpuEmitter(group.problem.prog, group.sched, "k")
        emitter.tile_sizes, emitter.multiprocessors = tile_sizes, sms
        # the arrays other groups of the program write count as written too (their loads must
        # not take the read-only cache in the program as emitted whole; kept so, for the same code)
        emitter.written |= written
        emitter.symbol = f"polyjit_gpu_{key[:24]}"
        emitter.kernel(j, node, plan)
        text = str(emitter.module)
    if emitter.kernels[0].library is not None:  # a cuBLAS step: no PTX
        code = GpuKernelCode(emitter.symbol, emitter.kernels[0], str(plan), "", "", "", "")
        return code, False
    with timer("llvm"):
        optimized, ptx_text = ptx(text, arch)
    starts = [m.start() for m in _ENTRY.finditer(ptx_text)]
    if len(starts) != 1 or _SCOPE.search(ptx_text[:starts[0]]):
        return None, False
    code = GpuKernelCode(emitter.symbol, emitter.kernels[0], str(plan), text, optimized, ptx_text[:starts[0]],
                         ptx_text[starts[0]:])
    with _codes_lock:
        _codes[key, variant] = code
        while len(_codes) > CODE_CACHE:
            _codes.pop(next(iter(_codes)))
    return code, False


def instance(code: GpuKernelCode, name: str) -> str:
    """code's entry as name, taking its own parameters (the program's argument
    slots KernelInfo.params lists: a launch passes only those)."""
    own = f"{code.symbol}_param_"
    return re.sub(rf"\b{re.escape(own)}(\d+)\b", lambda m: f"{name}_param_{m.group(1)}",
                  code.entry).replace(code.symbol, name)


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


def build_program(prog: AffineProgram, sched: ProgramSchedule, name: str, config: tuple, timer,
                  variant: tuple = ()) -> GpuProgramCode | None:
    """The program's PTX from kernels shared by structure (variant: what else
    than a group's statements chose its schedule); None where one of them
    is not in the form instance() copies (then emit the program whole)."""
    buffers, int_slots = buffer_layout(prog, sched.contracted)
    slot = {a.name: k for k, a in enumerate(buffers)}
    int_slot = {s: len(buffers) + k for k, s in enumerate(int_slots)}
    program_writes = {s.array for s in prog.statements}
    kernels, entries, codes, compiled, k = [], [], {}, 0, 0
    plans = []  # (kernel name, plan)
    module = ir.Module(name=name)
    module.triple = TRIPLE
    for group in sched.groups:
        arrays = group.problem.arrays
        mini_buffers, mini_ints = buffer_layout(group.problem.prog, group.sched.contracted)
        params = [slot[arrays[a.name]] for a in mini_buffers]
        params += [int_slot[(p, d) if d < 0 else (arrays[p], d)] for p, d in mini_ints]
        written = frozenset(a for a, whole in arrays.items() if whole in program_writes)
        for j in range(len(group.sched.kernels)):
            code, reused = kernel_code(group, j, config, written, timer, variant)
            if code is None:
                return None
            entry = kernel_name(prog, name, k, sched.kernels[k])
            if code.info.library is not None:  # run by polyjit.cuda, in the program's names
                kernels.append(KernelInfo(entry, False, tuple(sorted(sched.kernels[k])), library=next(
                    s for s in prog.statements if s.name in sched.kernels[k] and s.library is not None)))
                plans.append((entry, Library(kernels[-1].library)))
                k += 1
                continue
            compiled += not reused
            codes.setdefault(code.symbol, code)
            with timer("emit"):
                entries.append(instance(code, entry))
                _entry(module, entry, code.symbol, [PTR if p < len(buffers) else I64 for p in params])
            i = code.info
            kernels.append(KernelInfo(entry, i.parallel, tuple(sorted(sched.kernels[k])), i.lanes,
                                      tuple(arrays[a] for a in i.zeroed), i.strips, params=tuple(params)))
            plans.append((entry, code.mapping))
            k += 1
    header = next(iter(codes.values())).header if codes else ""
    with timer("emit"):
        linked = _linked(module, [c.ir for c in codes.values()])
    return GpuProgramCode(buffers, int_slots, kernels, header + "\n".join(entries), linked,
                          "\n".join(c.optimized for c in codes.values()), compiled, mapping_text(plans))


def _entry(module: ir.Module, name: str, target: str, types: list) -> None:
    """name(arguments of these types) calls target with them: the kernel's entry in the program."""
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), types), name)
    fn.calling_convention = "ptx_kernel"
    callee = module.globals.get(target) or ir.Function(module, ir.FunctionType(ir.VoidType(), types), target)
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    b.call(callee, list(fn.args))
    b.ret_void()


def _linked(module: ir.Module, kernels: list[str]) -> str:
    """module with the kernels' modules linked in, as text."""
    from .cpu import _lock
    with _lock:
        mod = llvm.parse_assembly(str(module))
        for text in kernels:
            mod.link_in(llvm.parse_assembly(text))
        return str(mod)
