"""isl AST + affine program -> LLVM IR, with llvmlite's IRBuilder.

One function per top-level loop nest (a *kernel*), with the signature
``void kernel(ptr buffers, ptr ints, i64 part, i64 parts)``: ``buffers`` holds
the data pointer of every array that lives outside the kernel, ``ints`` the
size parameters and the element strides of strided arrays. The loop marked
parallel by the scheduler is split into ``parts`` chunks and only chunk
``part`` runs; a target decides what a part is (a CPU thread, a GPU block).
Contracted arrays live inside the kernel, so each part has its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import islpy as isl
from llvmlite import ir

from .. import scalar
from .. import sizes as sz
from ..affine import AffineProgram, Array, Statement
from ..dtypes import DataType
from ..expr import Const, Expr, Load, Op, Var, loads, walk
from ..schedule import MIN_PARALLEL_EXTENT, Scheduled, ast_nodes, statements_in
from ..errors import UnsupportedOpError
from . import mathlib
from .rules import rule_for

I1, I8, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64)
F16, F32, F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()
PTR = ir.PointerType()
BF16 = ir.BFloatType() if hasattr(ir, "BFloatType") else ir.IntType(16)

COMPUTE = {DataType.Bool: I1, DataType.Int32: I32, DataType.UInt32: I32, DataType.Int: I64, DataType.Half: F32,
           DataType.BFloat16: F32, DataType.Float: F32, DataType.Double: F64}
STORAGE = {DataType.Bool: I8, DataType.Int32: I32, DataType.UInt32: I32, DataType.Int: I64, DataType.Half: F16,
           DataType.BFloat16: BF16, DataType.Float: F32, DataType.Double: F64}
STACK_LIMIT = 16384  # bytes: smaller contracted buffers go on the stack

_INTRINSIC = {"exp": "llvm.exp", "log": "llvm.log", "sin": "llvm.sin", "cos": "llvm.cos",
              "sqrt": "llvm.sqrt", "floor": "llvm.floor", "ceil": "llvm.ceil",
              "round": "llvm.roundeven", "abs": "llvm.fabs", "pow": "llvm.pow",
              "maximum": "llvm.maximum", "minimum": "llvm.minimum"}


@dataclass
class KernelInfo:
    name: str
    parallel: bool
    statements: tuple[str, ...]
    lanes: int = 0  # nvgpu: threads per parallel iteration (a warp or a block), 0 for one
    zeroed: tuple[str, ...] = ()  # nvgpu: arrays to zero before the launch (atomic sums)
    strips: bool = False  # nvgpu: strips of a sum, more threads than elements written
    library: Any = None  # nvgpu: the library statement this step runs on the host's stream (no PTX)
    fn: Any = None  # cpu: the compiled function, once JIT-compiled (nvgpu kernels load in polyjit.cuda)


@dataclass
class Strips:
    """A sequential loop cut into strips of size iterations that run in
    parallel: with a halo of private values recomputed (zeroed None), or as
    partial sums added atomically (zeroed: the arrays to zero first)."""

    loop: isl.AstNode
    size: int
    halo: int = 0
    zeroed: tuple[str, ...] | None = None
    calls: list = field(default_factory=list)  # the summing statements' calls
    ring: int | None = None  # the one modulus of the private buffers' rolling dimensions


def static_extent(loop: isl.AstNode) -> int | None:
    """The trip count of a unit-step loop whose bounds are numbers."""
    init, cond = loop.for_get_init(), loop.for_get_cond()
    hi = cond.get_op_arg(1)
    if init.get_type() != isl.ast_expr_type.int or hi.get_type() != isl.ast_expr_type.int \
            or loop.for_get_inc().get_type() != isl.ast_expr_type.int or loop.for_get_inc().get_val().to_python() != 1:
        return None
    last = hi.get_val().to_python() - (cond.get_op_type() == isl.ast_expr_op_type.lt)
    return max(last - init.get_val().to_python() + 1, 0)


def ast_children(n: isl.AstNode) -> list[isl.AstNode] | None:
    """The loops, statements and branches of n, blocks flattened (None for other nodes)."""
    if n.get_type() == isl.ast_node_type.block:
        lst = n.block_get_children()
        out = []
        for i in range(lst.n_ast_node()):
            kids = ast_children(lst.get_at(i))
            if kids is None:
                return None
            out += kids
        return out
    if n.get_type() in (isl.ast_node_type.for_, isl.ast_node_type.user, isl.ast_node_type.if_):
        return [n]
    return None


def ast_calls(n: isl.AstNode) -> list[isl.AstExpr] | None:
    """The statement calls of a straight-line body (None where it has loops or branches)."""
    kids = ast_children(n)
    if kids is None or any(k.get_type() != isl.ast_node_type.user for k in kids):
        return None
    return [k.user_get_expr() for k in kids]


def ast_uses(e: isl.AstExpr, names: set[str]) -> bool:
    """Whether an isl AST expression reads any of the iterators in names."""
    if not names:
        return False
    t = e.get_type()
    if t == isl.ast_expr_type.id:
        return e.get_id().get_name() in names
    if t == isl.ast_expr_type.op:
        return any(ast_uses(e.get_op_arg(i), names) for i in range(e.get_op_n_arg()))
    return False


class Emitter:
    """Shared LLVM emission; targets override the hooks at the bottom."""

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
        are only read, and outputs and temporaries are fresh allocations."""
        names, name, body_fn = self.body_function(k, node)
        nb, ni = len(self.buffer_arrays), len(self.int_slots)
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
        self.b = ir.IRBuilder(self.entry)
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
        extents = [self.size(s) if m is None else ir.Constant(I64, m) for s, m in zip(a.shape, moduli)]
        self.strides[a.name] = self.row_major(extents)
        count = ir.Constant(I64, 1)
        for e in extents:
            count = self.b.mul(count, e)
        ety = STORAGE[a.dtype]
        static = all(isinstance(e, ir.Constant) for e in extents)
        nbytes = a.dtype.itemsize * math.prod(e.constant for e in extents) if static else None
        if nbytes is not None and nbytes <= STACK_LIMIT:
            self.base[a.name] = self.b.alloca(ety, size=count)
        else:
            ptr = self.malloc(self.b.mul(count, ir.Constant(I64, a.dtype.itemsize)))
            self.base[a.name] = ptr
            self.freed.append(ptr)

    # --------------------------------------------------------------- AST
    def node(self, n: isl.AstNode) -> None:
        t = n.get_type()
        if t == isl.ast_node_type.block:
            lst = n.block_get_children()
            for i in range(lst.n_ast_node()):
                self.node(lst.get_at(i))
        elif t == isl.ast_node_type.for_:
            self.loop(n, split=False)
        elif t == isl.ast_node_type.if_:
            self.branch(n)
        elif t == isl.ast_node_type.mark:
            child = n.mark_get_node()
            if n.mark_get_id().get_name().startswith("parallel:") and not self.in_parallel \
                    and child.get_type() == isl.ast_node_type.for_ and self.splittable(child) \
                    and n.mark_get_id().get_name() == "parallel:" + child.for_get_iterator().get_id().get_name():
                self.in_parallel = self.parallel = True
                strips = self.row_strips(child)
                if strips is not None:
                    self.strip_parallel(child, strips)
                else:
                    self.loop(child, split=True)
                self.in_parallel = False
            else:
                self.node(child)
        elif t == isl.ast_node_type.user:
            self.statement(n.user_get_expr())
        else:
            raise NotImplementedError(f"isl AST node {t}")

    def var(self, name: str, typ: ir.Type = I64) -> ir.AllocaInstr:
        """A named slot in the entry block (mem2reg makes it a register)."""
        if name not in self.vars:
            with self.b.goto_block(self.entry):
                self.b.position_at_start(self.entry)
                self.vars[name] = self.b.alloca(typ, name=name)
        return self.vars[name]

    @staticmethod
    def splittable(n: isl.AstNode) -> bool:
        c = n.for_get_cond()
        return c.get_op_type() in (isl.ast_expr_op_type.le, isl.ast_expr_op_type.lt) and \
            n.for_get_inc().get_type() == isl.ast_expr_type.int

    def loop(self, n: isl.AstNode, split: bool) -> None:
        it = n.for_get_iterator().get_id().get_name()
        slot = self.var(it)
        lo = self.aexpr(n.for_get_init())
        inc = self.aexpr(n.for_get_inc())
        hi = None
        if split:
            cond = n.for_get_cond()
            hi = self.aexpr(cond.get_op_arg(1))
            if cond.get_op_type() == isl.ast_expr_op_type.le:
                hi = self.b.add(hi, ir.Constant(I64, 1))
            lo, hi = self.split_range(lo, hi, inc)
        self.b.store(lo, slot)
        head = self.fn.append_basic_block(f"{it}.head")
        body = self.fn.append_basic_block(f"{it}.body")
        done = self.fn.append_basic_block(f"{it}.done")
        self.b.branch(head)
        self.b.position_at_end(head)
        if split:
            c = self.b.icmp_signed("<", self.b.load(slot, typ=I64), hi)
        else:
            c = self.aexpr(n.for_get_cond())
        self.b.cbranch(c, body, done)
        self.b.position_at_end(body)
        self.node(n.for_get_body())
        self.b.store(self.b.add(self.b.load(slot, typ=I64), inc), slot)
        self.b.branch(head)
        self.b.position_at_end(done)

    def row_strips(self, loop: isl.AstNode) -> Strips | None:
        """Strips of the sequential loop under a parallel loop too short to keep
        every thread busy (three images of a blur for two threads), when its
        iterations depend on each other only through private buffers."""
        extent = static_extent(loop)
        if extent is None or extent >= MIN_PARALLEL_EXTENT:
            return None
        return self.strip_plan(loop.for_get_body(), {loop.for_get_iterator().get_id().get_name()}, 0)

    def strip_parallel(self, outer: isl.AstNode, strip: Strips) -> None:
        """Each iteration of outer cut into parts strips of the inner loop, and
        the (iteration, strip) pairs shared between the parts; a strip first
        recomputes the halo of private values it needs."""
        b = self.b
        one = ir.Constant(I64, 1)
        lo, inc, hi = self.loop_range(outer)
        inner = strip.loop
        lo2, inc2, hi2 = self.loop_range(inner)
        per = self.parts
        size = b.sdiv(b.add(self.trip_count(lo2, inc2, hi2), b.sub(per, one)), per)
        first, last = self.split_range(ir.Constant(I64, 0), b.mul(self.trip_count(lo, inc, hi), per), one)
        item = self.var("strip.item")
        it, it2 = (x.for_get_iterator().get_id().get_name() for x in (outer, inner))

        def one_strip() -> None:
            b = self.b
            k = b.load(item, typ=I64)
            b.store(b.add(lo, b.mul(b.sdiv(k, per), inc)), self.var(it))
            start = b.add(lo2, b.mul(b.mul(b.srem(k, per), size), inc2))
            begin, end = self.strip_bounds(start, size, strip.halo, lo2, inc2, hi2)
            self.strip_start = (self.var(it2), start)
            self.range_loop(self.var(it2), begin, end, inc2, lambda: self.node(inner.for_get_body()))
            self.strip_start = None
        self.range_loop(item, first, last, one, one_strip)

    def loop_range(self, loop: isl.AstNode) -> tuple:
        """(first, step, end) of an isl for loop, end exclusive."""
        lo, inc = self.aexpr(loop.for_get_init()), self.aexpr(loop.for_get_inc())
        cond = loop.for_get_cond()
        hi = self.aexpr(cond.get_op_arg(1))
        if cond.get_op_type() == isl.ast_expr_op_type.le:
            hi = self.b.add(hi, ir.Constant(I64, 1))
        return lo, inc, hi

    def trip_count(self, first, step, end, per: int = 1):
        """How many times of per iterations first, first + step, ... < end takes (at least 0)."""
        b = self.b
        trips = b.sdiv(b.add(b.sub(end, first), b.sub(step, ir.Constant(I64, 1))), step)
        if per > 1:
            trips = b.sdiv(b.add(trips, ir.Constant(I64, per - 1)), ir.Constant(I64, per))
        return b.select(b.icmp_signed("<", trips, ir.Constant(I64, 0)), ir.Constant(I64, 0), trips)

    def strip_bounds(self, start, size, halo: int, lo, inc, hi) -> tuple:
        """[begin, end) of the strip of size iterations from start, with halo
        iterations before it, inside the loop lo, lo + inc, ... < hi."""
        b = self.b
        begin = b.sub(start, b.mul(inc, ir.Constant(I64, halo)))
        begin = b.select(b.icmp_signed("<", begin, lo), lo, begin)
        end = b.add(start, b.mul(inc, size))
        return begin, b.select(b.icmp_signed("<", end, hi), end, hi)

    def range_loop(self, slot, begin, end, step, body) -> None:
        """slot = begin, begin + step, ... < end, running body() each time."""
        b = self.b
        b.store(begin, slot)
        head, block, done = (self.fn.append_basic_block(f"range.{x}") for x in ("head", "body", "done"))
        b.branch(head)
        b.position_at_end(head)
        b.cbranch(b.icmp_signed("<", b.load(slot, typ=I64), end), block, done)
        b.position_at_end(block)
        body()
        self.b.store(self.b.add(self.b.load(slot, typ=I64), step), slot)
        self.b.branch(head)
        self.b.position_at_end(done)

    def split_range(self, lo, hi, inc):
        """This part's share [lo', hi') of the iterations lo, lo+inc, ... < hi."""
        b = self.b
        span = b.sub(hi, lo)
        trips = b.sdiv(b.add(span, b.sub(inc, ir.Constant(I64, 1))), inc)
        trips = b.select(b.icmp_signed("<", trips, ir.Constant(I64, 0)), ir.Constant(I64, 0), trips)
        chunk = b.sdiv(b.add(trips, b.sub(self.parts, ir.Constant(I64, 1))), self.parts)
        first = b.mul(self.part, chunk)
        last = b.add(first, chunk)
        last = b.select(b.icmp_signed("<", last, trips), last, trips)
        return b.add(lo, b.mul(first, inc)), b.add(lo, b.mul(last, inc))

    def branch(self, n: isl.AstNode) -> None:
        c = self.aexpr(n.if_get_cond())
        then = self.fn.append_basic_block("then")
        other = self.fn.append_basic_block("else") if n.if_has_else_node() else None
        done = self.fn.append_basic_block("endif")
        self.b.cbranch(c, then, other or done)
        self.b.position_at_end(then)
        self.node(n.if_get_then_node())
        self.b.branch(done)
        if other is not None:
            self.b.position_at_end(other)
            self.node(n.if_get_else_node())
            self.b.branch(done)
        self.b.position_at_end(done)

    def aexpr(self, e: isl.AstExpr) -> ir.Value:
        t = e.get_type()
        b = self.b
        if t == isl.ast_expr_type.int:
            return ir.Constant(I64, e.get_val().to_python())
        if t == isl.ast_expr_type.id:
            name = e.get_id().get_name()
            if name in self.params:
                return self.params[name]
            return b.load(self.var(name), typ=I64)
        op = e.get_op_type()
        args = [self.aexpr(e.get_op_arg(i)) for i in range(e.get_op_n_arg())]
        T = isl.ast_expr_op_type
        if op == T.add:
            return b.add(*args)
        if op == T.sub:
            return b.sub(*args)
        if op == T.mul:
            return b.mul(*args)
        if op == T.minus:
            return b.neg(args[0])
        if op in (T.div, T.pdiv_q):
            return b.sdiv(*args)
        if op == T.fdiv_q:
            return self.floordiv(*args)
        if op in (T.pdiv_r, T.zdiv_r):
            return b.srem(*args)
        if op == T.max:
            return _fold(b, args, lambda x, y: b.select(b.icmp_signed(">", x, y), x, y))
        if op == T.min:
            return _fold(b, args, lambda x, y: b.select(b.icmp_signed("<", x, y), x, y))
        if op in (T.and_, T.and_then):
            return b.and_(*args)
        if op in (T.or_, T.or_else):
            return b.or_(*args)
        if op in (T.cond, T.select):
            return b.select(*args)
        cmp = {T.eq: "==", T.le: "<=", T.lt: "<", T.ge: ">=", T.gt: ">"}
        if op in cmp:
            return b.icmp_signed(cmp[op], *args)
        raise NotImplementedError(f"isl AST expression {op}")

    def int_division(self, op: str, x, y) -> ir.Value:
        """Signed quotient (floor_divide: floor; trunc_divide: toward zero;
        div and floordiv, index arithmetic: floor for int64, else toward zero)
        or remainder (fmod: with the dividend's sign; else the divisor's). Division by zero gives 0, as in
        numpy, and MIN / -1 wraps: the machine's divide would trap on both and
        kill the process."""
        b = self.b
        t = y.type
        zero, one = ir.Constant(t, 0), ir.Constant(t, 1)
        by_zero = b.icmp_signed("==", y, zero)
        by_minus_one = b.icmp_signed("==", y, ir.Constant(t, -1))
        safe = b.select(b.or_(by_zero, by_minus_one), one, y)
        if op.endswith(("div", "divide")):
            floor = op == "floor_divide" or (op != "trunc_divide" and t == I64)
            q = self.floordiv(x, safe) if floor else b.sdiv(x, safe)
            q = b.select(by_minus_one, b.sub(zero, x), q)
            return b.select(by_zero, zero, q)
        r = b.srem(x, safe)  # 0 where y is -1
        if op == "fmod":
            return b.select(by_zero, zero, r)
        fix = b.and_(b.icmp_signed("!=", r, zero),
                     b.xor(b.icmp_signed("<", r, zero), b.icmp_signed("<", y, zero)))
        return b.select(by_zero, zero, b.select(fix, b.add(r, y), r))

    def floordiv(self, x, y):
        b = self.b
        q = b.sdiv(x, y)
        r = b.srem(x, y)
        zero = ir.Constant(x.type, 0)
        adjust = b.and_(b.icmp_signed("!=", r, zero),
                        b.icmp_signed("!=", b.icmp_signed("<", r, zero), b.icmp_signed("<", y, zero)))
        return b.sub(q, b.zext(adjust, x.type))

    # ------------------------------------------------------------ strips
    def _free(self, loop: isl.AstNode, grid_iters: set[str]) -> bool:
        """Whether loop's bounds are known before the grid loop's iterators."""
        return self.splittable(loop) and not ast_uses(loop.for_get_init(), grid_iters) \
            and not ast_uses(loop.for_get_cond(), grid_iters)

    def _write_moves(self, loop: isl.AstNode, st, it: str) -> list[bool]:
        """For each call of st under loop, whether the element it writes moves with it."""
        used = {x.name for i in st.index for x in walk(i) if isinstance(x, Var) and x.kind == "iter"}
        calls = [n.user_get_expr() for n in ast_nodes(loop) if n.get_type() == isl.ast_node_type.user]
        return [any(ast_uses(call.get_op_arg(k + 1), {it}) for k, x in enumerate(st.iters) if x in used)
                for call in calls if call.get_op_arg(0).get_id().get_name() == st.name]

    def strip_plan(self, rest: isl.AstNode, grid_iters: set[str], size: int,
                   bounded: bool = False) -> "Strips | None":
        """Strips of rest when it is one sequential loop whose iterations
        depend on each other only through buffers private to the thread (a
        stencil's rolling rows): strips of size iterations can then run in
        parallel, each first recomputing the halo of private values it
        needs. bounded: only private buffers of a fixed size (a GPU thread's)."""
        if rest.get_type() != isl.ast_node_type.for_ or not self._free(rest, grid_iters):
            return None
        it = rest.for_get_iterator().get_id().get_name()
        names = statements_in(rest)
        inside = [st for st in self.prog.statements if st.name in names]
        private = {st.array for st in inside if st.array in self.sched.contracted}
        if any(st.array in private for st in self.prog.statements if st.name not in names):
            return None
        written = {st.array for st in inside}
        halo = 0
        for st in inside:
            if any(ld.array in written and ld.array not in private for ld in loads(st.body)):
                return None
            moves = self._write_moves(rest, st, it)
            if st.array not in private and (st.combine is not None or not moves or not all(moves)):
                return None
        rings = set()
        for a in private:
            moduli = self.sched.contracted[a]
            if None in moduli and bounded:
                return None
            halo = max([halo] + [m - 1 for m in moduli if m is not None])
            rings |= {m for m in moduli if m is not None and m > 1}
        ring = rings.pop() if len(rings) == 1 and rest.for_get_inc().get_val().to_python() == 1 else None
        return Strips(rest, size, halo, ring=ring) if private else None


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
            from .blas import emit_gemm
            emit_gemm(self, s.library, env, cache)
            return
        val = self.value(s.body, env, cache)
        arr = self.prog.arrays[s.array]
        ptr = self.address(arr, s.index, env, cache)
        if s.combine is not None:
            old = self.from_storage(self.b.load(ptr, typ=STORAGE[arr.dtype]), arr.dtype)
            val = self.combine(s.combine, old, val, arr.dtype)
        self.store_element(arr, s.index, ptr, val)

    def padded_load(self, cond: Expr, load: Load, fill: Const, env, cache) -> ir.Value:
        """select(cond, load, fill) with cond on iterators only: a convolution's
        padding (a hook: the CPU selects the address instead)."""
        return self.b.select(self.value(cond, env, cache), self.value(load, env, cache),
                             self.value(fill, env, cache))

    def load_element(self, arr: Array, index, ptr) -> ir.Value:
        """arr[index], read from ptr (a hook: targets may add alignment)."""
        return self.from_storage(self.b.load(ptr, typ=STORAGE[arr.dtype]), arr.dtype)

    def store_element(self, arr: Array, index, ptr, val):
        """Store val at ptr (a hook: targets may add alignment or metadata); the store."""
        return self.b.store(self.to_storage(val, arr.dtype), ptr)

    def address(self, arr: Array, index, env, cache) -> ir.Value:
        moduli = self.sched.contracted.get(arr.name)
        offset = ir.Constant(I64, 0)
        for d, e in enumerate(index):
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

    def combine(self, how: str, old, new, dt: DataType) -> ir.Value:
        v = self.op(scalar.COMBINE[how], [old, new], dt, [dt, dt])
        if how in ("sum", "prod") and dt.is_float:
            v.flags.append("reassoc")
            if how == "sum" and getattr(new, "opname", "") == "fmul":
                # a sum of products: one fused multiply-add per term, as BLAS does
                new.flags.append("contract")
                v.flags.append("contract")
        return v

    def from_storage(self, v, dt: DataType):
        if dt is DataType.Bool:
            return self.b.icmp_unsigned("!=", v, ir.Constant(I8, 0))
        if dt in (DataType.Half, DataType.BFloat16):
            return self.b.fpext(v, F32)
        return v

    def to_storage(self, v, dt: DataType):
        if dt is DataType.Bool:
            return self.b.zext(v, I8)
        if dt in (DataType.Half, DataType.BFloat16):
            return self.b.fptrunc(v, STORAGE[dt])
        return v

    # -------------------------------------------------------- expressions
    def value(self, e: Expr, env, cache) -> ir.Value:
        key = id(e)
        if key in cache:
            return cache[key][0]
        v = self._value(e, env, cache)
        cache[key] = (v, e)  # keep e alive so its id stays unique
        return v

    def _value(self, e: Expr, env, cache) -> ir.Value:
        if isinstance(e, Const):
            return self.constant(e.value, e.dtype)
        if isinstance(e, Var):
            return env[e.name] if e.kind == "iter" else self.params[e.name]
        if isinstance(e, Load):
            arr = self.prog.arrays[e.array]
            return self.load_element(arr, e.index, self.address(arr, e.index, env, cache))
        assert isinstance(e, Op)
        if e.op == "select" and isinstance(e.args[1], Load) and isinstance(e.args[2], Const) \
                and not loads(e.args[0]):
            return self.padded_load(e.args[0], e.args[1], e.args[2], env, cache)
        args = [self.value(a, env, cache) for a in e.args]
        return self.op(e.op, args, e.dtype, [a.dtype for a in e.args])

    def constant(self, value, dt: DataType) -> ir.Constant:
        t = COMPUTE[dt]
        if dt is DataType.Bool:
            return ir.Constant(I1, int(bool(value)))
        if dt.is_float:
            return ir.Constant(t, float(value))
        return ir.Constant(t, int(value))

    def op(self, op: str, a: list, dt: DataType, adts: list[DataType]) -> ir.Value:
        """op on values a of types adts, giving dt: its rule for the operands'
        class, or its decomposition (polyjit.scalar) where the target has none."""
        src = adts[0] if adts else dt
        rule = rule_for(op, src)
        if rule is not None:
            return rule(self, a, dt, src)
        if src.is_float and op in scalar.OPS:  # the target's math: a kernel, an intrinsic, libm, a decomposition
            return self.math(op, a)
        raise UnsupportedOpError(f"{op} on {src} has no lowering")

    def decomposed(self, op: str, a: list) -> ir.Value:
        """op's decomposition in polyjit.scalar, emitted op by op."""
        dt = DataType.Double if a[0].type == F64 else DataType.Float
        names = [f"%{k}" for k in range(len(a))]
        e = scalar.OPS[op].decompose(*(Var(dt, n) for n in names))
        return self.value(e, dict(zip(names, a)), {})

    def float_floor_divide(self, x, y) -> ir.Value:
        """floor(x / y) as numpy and torch compute it: from the exact
        remainder, so that a quotient rounded up to an integer is not off by
        one; y = 0 gives x / y (inf or nan)."""
        b = self.b
        t = x.type
        zero, one = ir.Constant(t, 0.0), ir.Constant(t, 1.0)
        mod = b.frem(x, y)
        div = b.fdiv(b.fsub(x, mod), y)
        fix = b.and_(b.fcmp_ordered("!=", mod, zero),
                     b.xor(b.fcmp_ordered("<", y, zero), b.fcmp_ordered("<", mod, zero)))
        div = b.select(fix, b.fsub(div, one), div)
        fl = self.call("llvm.floor", [div])
        fl = b.select(b.fcmp_ordered(">", b.fsub(div, fl), ir.Constant(t, 0.5)), b.fadd(fl, one), fl)
        fl = b.select(b.fcmp_ordered("==", div, zero), self.call("llvm.copysign", [zero, b.fdiv(x, y)]), fl)
        return b.select(b.fcmp_ordered("==", y, zero), b.fdiv(x, y), fl)

    def erf_inv(self, x) -> ir.Value:
        """Giles' single-precision inverse error function (the polynomials XLA
        uses): w = -log1p(-x^2), a polynomial in w - 2.5 below 5, else in
        sqrt(w) - 3; +-inf at +-1, NaN beyond."""
        b = self.b
        t = x.type
        k = lambda v: ir.Constant(t, v)  # noqa: E731
        w = b.fneg(self.math("log1p", [b.fneg(b.fmul(x, x))]))
        small = b.fcmp_ordered("<", w, k(5.0))
        z = b.select(small, b.fsub(w, k(2.5)), b.fsub(self.call("llvm.sqrt", [w]), k(3.0)))
        near = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
        far = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
               -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)
        p = b.select(small, k(near[0]), k(far[0]))
        for c0, c1 in zip(near[1:], far[1:]):
            p = self.call("llvm.fmuladd", [p, z, b.select(small, k(c0), k(c1))])
        r = b.fmul(p, x)
        one = b.fcmp_ordered("==", self.call("llvm.fabs", [x]), k(1.0))
        return b.select(one, b.fmul(x, k(math.inf)), r)

    def math(self, op: str, a: list) -> ir.Value:
        """Transcendental functions: vectorizable float32 kernels, LLVM
        intrinsics, the C math library, or the op's decomposition."""
        if a[0].type == F32 and op in mathlib.KERNELS:
            return mathlib.KERNELS[op](self.b, self.module, *a)
        if op in _INTRINSIC:
            return self.call(_INTRINSIC[op], a)
        if scalar.OPS[op].libm:
            name = op + ("f" if a[0].type == F32 else "")
            fn = self.module.globals.get(name) or ir.Function(
                self.module, ir.FunctionType(a[0].type, [x.type for x in a]), name)
            return self.b.call(fn, a)
        if scalar.OPS[op].decompose is not None:
            return self.decomposed(op, a)
        raise UnsupportedOpError(f"{op} has no lowering")

    def call(self, intrinsic: str, a: list) -> ir.Value:
        fn = self.module.declare_intrinsic(intrinsic, [a[0].type],
                                           ir.FunctionType(a[0].type, [x.type for x in a]))
        return self.b.call(fn, a)

    def threefry_bits(self, k0, k1, count) -> ir.Value:
        """JAX's 32 random bits for element count under key (k0, k1): both
        words of Threefry-2x32 (20 rounds) of the 64-bit count, xor-ed."""
        b = self.b
        c = lambda v: ir.Constant(I32, v)  # noqa: E731
        ks = [k0, k1, b.xor(b.xor(k0, k1), c(0x1BD11BDA))]
        x = [b.add(b.trunc(b.lshr(count, ir.Constant(I64, 32)), I32), ks[0]), b.add(b.trunc(count, I32), ks[1])]
        rotations = [(13, 15, 26, 6), (17, 29, 16, 24)]
        for i in range(5):
            for r in rotations[i % 2]:
                x[0] = b.add(x[0], x[1])
                x[1] = b.or_(b.shl(x[1], c(r)), b.lshr(x[1], c(32 - r)))
                x[1] = b.xor(x[0], x[1])
            x = [b.add(x[0], ks[(i + 1) % 3]), b.add(b.add(x[1], ks[(i + 2) % 3]), c(i + 1))]
        return b.xor(x[0], x[1])

    def cast(self, v, src: DataType, dst: DataType) -> ir.Value:
        b = self.b
        st, dt_ = COMPUTE[src], COMPUTE[dst]
        if dst in (DataType.Half, DataType.BFloat16):  # round to the narrow type
            f = self.cast(v, src, DataType.Float)
            return b.fpext(b.fptrunc(f, STORAGE[dst]), F32)
        if dst is DataType.Bool:
            if src.is_float:
                return b.fcmp_unordered("!=", v, ir.Constant(st, 0.0))
            return b.icmp_signed("!=", v, ir.Constant(st, 0))
        if src is DataType.Bool:
            return b.uitofp(v, dt_) if dst.is_float else b.zext(v, dt_)
        if src.is_float and dst.is_float:
            if st == dt_:
                return v
            return b.fpext(v, dt_) if dt_ == F64 else b.fptrunc(v, dt_)
        if src.is_float:
            return b.fptoui(v, dt_) if dst.is_unsigned else b.fptosi(v, dt_)
        if dst.is_float:
            return b.uitofp(v, dt_) if src.is_unsigned else b.sitofp(v, dt_)
        if st.width == dt_.width:
            return v
        if dt_.width < st.width:
            return b.trunc(v, dt_)
        return b.zext(v, dt_) if src.is_unsigned else b.sext(v, dt_)

    def philox_uniform(self, seed, counter) -> ir.Value:
        """Philox 4x32-10 of (counter, seed); the first word, as a float in [0, 1)."""
        b = self.b
        I32c = lambda x: ir.Constant(I32, x)  # noqa: E731
        c = [b.trunc(counter, I32), b.trunc(b.lshr(counter, ir.Constant(I64, 32)), I32), I32c(0), I32c(0)]
        k0, k1 = b.trunc(seed, I32), b.trunc(b.lshr(seed, ir.Constant(I64, 32)), I32)

        def mulhilo(m, x):
            p = b.mul(ir.Constant(I64, m), b.zext(x, I64))
            return b.trunc(b.lshr(p, ir.Constant(I64, 32)), I32), b.trunc(p, I32)
        for _ in range(10):
            hi0, lo0 = mulhilo(0xD2511F53, c[0])
            hi1, lo1 = mulhilo(0xCD9E8D57, c[2])
            c = [b.xor(b.xor(hi1, c[1]), k0), lo1, b.xor(b.xor(hi0, c[3]), k1), lo0]
            k0, k1 = b.add(k0, I32c(0x9E3779B9)), b.add(k1, I32c(0xBB67AE85))
        bits = b.lshr(c[0], I32c(8))
        return b.fmul(b.uitofp(bits, F32), ir.Constant(F32, 2.0 ** -24))

    # ------------------------------------------------------ target hooks
    def malloc(self, nbytes) -> ir.Value:
        fn = self.module.globals.get("malloc") or ir.Function(
            self.module, ir.FunctionType(PTR, [I64]), "malloc")
        return self.b.call(fn, [nbytes])

    def free(self, ptr) -> None:
        fn = self.module.globals.get("free") or ir.Function(
            self.module, ir.FunctionType(ir.VoidType(), [PTR]), "free")
        self.b.call(fn, [ptr])


def _fold(b, args, f):
    v = args[0]
    for x in args[1:]:
        v = f(v, x)
    return v


def kernel_name(prog: AffineProgram, fname: str, k: int, names: set[str]) -> str:
    """polyjit_<program>_<the labels of its first three statements>_<k>_kernel."""
    labels = []
    for s in prog.statements:
        if s.name in names and s.label not in labels and not s.label.endswith("_init"):
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
