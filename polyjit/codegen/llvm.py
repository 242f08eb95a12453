"""isl AST + affine program -> LLVM IR, with llvmlite's IRBuilder.

One function per top-level loop nest (a *kernel*), with the signature
``void kernel(ptr buffers, ptr ints, i64 part, i64 parts)``: ``buffers`` holds
the data pointer of every array that lives outside the kernel, ``ints`` the
size parameters and the element strides of strided arrays. The loop marked
parallel by the scheduler is split into ``parts`` chunks and only chunk
``part`` runs; a target decides what a part is (a CPU thread, a GPU block).
Contracted arrays live inside the kernel, so each part has its own.

The emitter is split by concern: loops.py walks the AST, strips.py cuts
short parallel loops' inner loops into strips, values.py emits scalar
expressions; the types are irtypes.py's. What is split, and how, each
target's mapping stage decides first (codegen.cpu_mapping, codegen.gpu_mapping).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import islpy as isl
from llvmlite import ir

from .. import sizes as sz
from ..affine import AffineProgram, Array, Role, Statement
from ..expr import Const, Expr, Load, merged_index
from ..schedule import Scheduled, statements_in
from ..schedule.ast import ast_calls, ast_children, ast_uses, in_order_kernel, static_extent
from .folding import FoldingBuilder
from .irtypes import BF16, COMPUTE, F16, F32, F64, I1, I8, I32, I64, PTR, STORAGE
from .loops import LoopEmission
from .mapping import Strips, on_stack
from .strips import StripEmission
from .values import ValueEmission

__all__ = ["BF16", "COMPUTE", "F16", "F32", "F64", "I1", "I8", "I32", "I64", "PTR", "STORAGE", "Emitter",
           "KernelInfo", "Strips", "ast_calls", "ast_children", "ast_uses", "buffer_layout", "kernel_name",
           "static_extent"]


@dataclass
class KernelInfo:
    name: str
    parallel: bool
    statements: tuple[str, ...]
    lanes: int = 0  # nvgpu: threads per parallel iteration (a warp or a block), 0 for one
    zeroed: tuple[str, ...] = ()  # nvgpu: arrays to zero before the launch (atomic sums)
    strips: bool = False  # nvgpu: strips of a sum, more threads than elements written
    library: Any = None  # nvgpu: the library statement this step runs on the host's stream (no PTX)
    params: tuple[int, ...] | None = None  # nvgpu: the program's argument slots it takes, in order (None: all)
    fn: Any = None  # cpu: the compiled function, once JIT-compiled (nvgpu kernels load in runtime.gpu_program)


class Emitter(LoopEmission, StripEmission, ValueEmission):
    """Shared LLVM emission: kernels, their arguments and private buffers,
    statements and memory; the AST walk, strips and scalar values come from
    the mixins. Targets override the hooks (marked so in their docstrings)."""

    triple = ""

    def __init__(self, prog: AffineProgram, sched: Scheduled, name: str = "fn") -> None:
        self.prog, self.sched, self.fname = prog, sched, name
        self.module = ir.Module(name=name)
        if self.triple:
            self.module.triple = self.triple
        self.stmts = {s.name: s for s in prog.statements}
        self.buffer_arrays, self.int_slots = buffer_layout(prog, sched.contracted)
        self.slot = {a.name: k for k, a in enumerate(self.buffer_arrays)}
        self.kernels: list[KernelInfo] = []
        self.symbol: str | None = None  # the name of the next kernel's entry, where not kernel_name's

    # ------------------------------------------------------------ module
    def emit(self) -> ir.Module:
        for k, node in enumerate(self.sched.kernel_asts()):
            self.kernel(k, node)
        return self.module

    def kernel_name(self, k: int, names: set[str]) -> str:
        return kernel_name(self.prog, self.fname, k, names)

    def kernel(self, k: int, node: isl.AstNode) -> None:
        """An entry with the fixed signature that unpacks its arguments and
        calls the loop nest's body, whose array pointers are ``noalias``: inputs
        are only read, and outputs and temporaries are fresh allocations.

        The body stays a function of its own (noinline), its arrays noalias
        arguments: inlined, LLVM's O3 simplified its loops twice (the body
        alone, then its entry with the body in it), and each noalias pointer
        became an alias scope on every access."""
        names, name, body_fn = self.body_function(k, node)
        nb, ni = len(self.buffer_arrays), len(self.int_slots)
        body_fn.attributes.add("noinline")
        if in_order_kernel(node):
            body_fn.attributes.add("optsize")  # (a preparation: LLVM's time 0.32 -> 0.19 s, its own as fast)
        self.body(body_fn, node)
        fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [PTR, PTR, I64, I64]), name)
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        bufs, ints, part, parts = fn.args
        args = [b.load(b.gep(bufs, [ir.Constant(I64, i)], source_etype=PTR), typ=PTR) for i in range(nb)]
        args += [b.load(b.gep(ints, [ir.Constant(I64, i)], source_etype=I64), typ=I64) for i in range(ni)]
        b.call(body_fn, args + [part, parts])
        b.ret_void()
        self.kernels.append(KernelInfo(name, self.parallel, tuple(sorted(names))))

    def body_function(self, k: int, node: isl.AstNode) -> tuple[set[str], str, ir.Function]:
        """The statements of kernel k, its name, and its (still empty) body
        function ``void (ptr arrays..., i64 ints..., i64 part, i64 parts)``."""
        self.k = k
        names = statements_in(node)
        name = self.symbol or self.kernel_name(k, names)
        nb, ni = len(self.buffer_arrays), len(self.int_slots)
        fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [PTR] * nb + [I64] * (ni + 2)), name + "_body")
        fn.linkage = "internal"
        for arg in fn.args[:nb]:
            arg.add_attribute("noalias")
        return names, name, fn

    def body(self, fn: ir.Function, node: isl.AstNode) -> None:
        k = self.k
        self.fn = fn
        self.entry = fn.append_basic_block("entry")
        body = fn.append_basic_block("body")
        self.b = FoldingBuilder(self.entry)
        nb = len(self.buffer_arrays)
        ints = fn.args[nb:-2]
        self.part, self.parts = fn.args[-2:]
        self.vars: dict[str, ir.AllocaInstr] = {}
        self.params = {p: ints[i] for i, (p, d) in enumerate(self.int_slots) if d < 0}
        self.base, self.strides, self.freed = {}, {}, []
        for i, a in enumerate(self.buffer_arrays):
            self.base[a.name] = fn.args[i]
            if a.strided:
                self.strides[a.name] = [ints[j] for j, (n, d) in enumerate(self.int_slots) if n == a.name]
            else:
                self.strides[a.name] = self.row_major([self.size(s) for s in a.shape])
        for name, moduli in self.sched.contracted.items():
            if self.sched.kernel_of_array.get(name) == k:
                self.alloc_contracted(self.prog.arrays[name], moduli)
        self.b.branch(body)
        self.b.position_at_end(body)
        self.in_parallel = False
        self.parallel = False
        self.strip_start = None  # (iterator slot, first own iteration) inside a strip with a halo
        self.at = ()  # the path of the node being emitted (LoopEmission.descend)
        self.node(node)
        for ptr in self.freed:
            self.free(ptr)
        self.b.ret_void()

    def row_major(self, extents: list[ir.Value]) -> list[ir.Value]:
        out, acc = [], ir.Constant(I64, 1)
        for e in reversed(extents):
            out.append(acc)
            acc = self.b.mul(acc, e)
        return out[::-1]

    def size(self, s) -> ir.Value:
        if sz.is_static(s):
            return ir.Constant(I64, int(s))
        v = ir.Constant(I64, s.const)
        for n, c in s.terms:
            v = self.b.add(v, self.b.mul(self.params[n], ir.Constant(I64, c)))
        return v

    def alloc_contracted(self, a: Array, moduli) -> None:
        """A private buffer: on the stack where mapping.on_stack says, else on the heap, freed at the end."""
        extents = [self.size(s) if m is None else ir.Constant(I64, m) for s, m in zip(a.shape, moduli)]
        self.strides[a.name] = self.row_major(extents)
        count = ir.Constant(I64, 1)
        for e in extents:
            count = self.b.mul(count, e)
        if on_stack(a, moduli):
            self.base[a.name] = self.b.alloca(STORAGE[a.dtype], size=count)
        else:
            ptr = self.malloc(self.b.mul(count, ir.Constant(I64, a.dtype.itemsize)))
            self.base[a.name] = ptr
            self.freed.append(ptr)

    # --------------------------------------------------------- statements
    def statement(self, call: isl.AstExpr) -> None:
        name = call.get_op_arg(0).get_id().get_name()
        s: Statement = self.stmts[name]
        strip = self.strip_start
        if strip is not None and s.array not in self.sched.contracted:
            slot, start = strip  # halo iterations of a strip compute private values only
            then = self.fn.append_basic_block("strip.own")
            after = self.fn.append_basic_block("strip.next")
            self.b.cbranch(self.b.icmp_signed(">=", self.b.load(slot, typ=I64), start), then, after)
            self.b.position_at_end(then)
            self.strip_start = None
            self.statement(call)
            self.strip_start = strip
            self.b.branch(after)
            self.b.position_at_end(after)
            return
        env = {it: self.aexpr(call.get_op_arg(i + 1)) for i, it in enumerate(s.iters)}
        cache: dict[int, ir.Value] = {}
        if s.library is not None:
            return self.library_call(s, env, cache)
        val = self.value(s.body, env, cache)
        arr = self.prog.arrays[s.array]
        ptr = self.address(arr, s.index, env, cache)
        if s.combine is not None:
            old = self.accumulated(arr, s.index, ptr)
            val = self.combine(s.combine, old, val, arr.dtype)
        self.store_element(arr, s.index, ptr, val)

    def padded_load(self, cond: Expr, load: Load, fill: Const, env, cache) -> ir.Value:
        """select(cond, load, fill) with cond on iterators only: a convolution's
        padding (a hook: the CPU selects the address instead)."""
        return self.b.select(self.value(cond, env, cache), self.value(load, env, cache),
                             self.value(fill, env, cache))

    def accumulated(self, arr: Array, index, ptr) -> ir.Value:
        """The value a reduction's update combines with, read from ptr (a hook)."""
        return self.from_storage(self.b.load(ptr, typ=STORAGE[arr.dtype]), arr.dtype)

    def load_element(self, arr: Array, index, ptr) -> ir.Value:
        """arr[index], read from ptr (a hook: targets may add alignment)."""
        return self.from_storage(self.b.load(ptr, typ=STORAGE[arr.dtype]), arr.dtype)

    def store_element(self, arr: Array, index, ptr, val):
        """Store val at ptr (a hook: targets may add alignment or metadata); the store."""
        return self.b.store(self.to_storage(val, arr.dtype), ptr)

    def address(self, arr: Array, index, env, cache) -> ir.Value:
        moduli = self.sched.contracted.get(arr.name)
        offset = ir.Constant(I64, 0)
        dims = enumerate(index) if moduli is not None or arr.strided else \
            ((d, e) for e, d in merged_index(index, arr.shape))
        for d, e in dims:
            v = self.value(e, env, cache)
            if moduli is not None and moduli[d] is not None:
                if moduli[d] == 1:
                    continue
                v = self.private_index(arr, d, e, v, moduli[d])
            offset = self.b.add(offset, self.b.mul(v, self.strides[arr.name][d]))
        return self.b.gep(self.base[arr.name], [offset], source_etype=STORAGE[arr.dtype])

    def private_index(self, arr: Array, d: int, e, v, modulus: int) -> ir.Value:
        """The slot of index v (expression e) along a contracted dimension that
        keeps modulus rows (a hook: targets may number the rows otherwise)."""
        return self.b.urem(v, ir.Constant(I64, modulus))

    # ------------------------------------------------------ target hooks
    def library_call(self, s: Statement, env, cache) -> None:
        """Library statement s's call (a hook: where a target runs them as steps of their own, none is emitted)."""
        raise NotImplementedError(f"{s.library} in a kernel")

    def malloc(self, nbytes) -> ir.Value:
        fn = self.module.globals.get("malloc") or ir.Function(
            self.module, ir.FunctionType(PTR, [I64]), "malloc")
        return self.b.call(fn, [nbytes])

    def free(self, ptr) -> None:
        fn = self.module.globals.get("free") or ir.Function(
            self.module, ir.FunctionType(ir.VoidType(), [PTR]), "free")
        self.b.call(fn, [ptr])


def kernel_name(prog: AffineProgram, fname: str, k: int, names: set[str]) -> str:
    """polyjit_<program>_<the labels of its first three statements but inits>_<k>_kernel."""
    labels = []
    for s in prog.statements:
        if s.name in names and s.label not in labels and s.role is not Role.INIT:
            labels.append(s.label)
    safe = "".join(c if c.isalnum() else "_" for c in fname)
    return f"polyjit_{safe}_{'_'.join(labels[:3]) or 'nest'}_{k}_kernel"


def buffer_layout(prog: AffineProgram, contracted) -> tuple[list[Array], list[tuple[str, int]]]:
    """The arrays kernels take as buffers (all but the contracted), and their
    integer arguments: the size parameters, then each strided buffer's strides."""
    buffers = [a for a in _ordered(prog) if a.name not in contracted]
    ints: list[tuple[str, int]] = [(p, -1) for p in prog.params]
    for a in buffers:
        if a.strided:
            ints += [(a.name, d) for d in range(len(a.shape))]
    return buffers, ints


def _ordered(prog: AffineProgram) -> list[Array]:
    """Arrays in buffer-slot order: inputs, outputs, constants, temporaries."""
    rank = {"input": 0, "output": 1, "const": 2, "temp": 3}
    return sorted(prog.arrays.values(), key=lambda a: (rank[a.kind], a.index, a.name))
