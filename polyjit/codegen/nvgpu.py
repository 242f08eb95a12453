"""The nvgpu target: one PTX ``.entry`` per kernel, from llvmlite's NVPTX backend.

Each kernel is mapped first (codegen.gpu_mapping: a typed plan saying how
its nest runs on the grid); the emitter then emits what the plan says. The
grid's loops collapse into one index space that a grid-stride loop shares
among all threads of the launch (consecutive threads take consecutive
iterations of the innermost parallel loop, so accesses along it coalesce);
each form of plan has its part here: the grid and point-per-thread loops
(:class:`GpuEmitter`), strips (:class:`_StripEmission`), warp rows
(:class:`_RowEmission`) and tiled contractions (:class:`_TileEmission`,
on tensor cores :class:`_MmaTileEmission`).
What the emitter tracks while it emits one kernel is a
:class:`KernelContext`.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import islpy as isl
import llvmlite.binding as llvm
from llvmlite import ir

from .. import scalar
from ..errors import UnsupportedOpError
from ..expr import Load, Var, offset
from ..schedule import statements_in
from ..schedule.ast import kernel_nodes, side_by_side_kernel
from . import mathlib
from .gpu_mapping import (BLOCK, DEFAULT_ARCH, MMA_PAD, TILE_COLS, TILE_ROWS, VECTOR, WARP, AtomicStrips, GpuMapper,
                          HaloStrips, KernelPlan, Library, PointPerThread, ScatterPoints, SideBySide, TiledContraction,
                          Vector, WarpRows, iter_vars)
from .mapping import mapping_text
from .llvm import COMPUTE, F32, F64, I32, I64, PTR, STORAGE, Emitter, KernelInfo, Strips, static_extent

TRIPLE = "nvptx64-nvidia-cuda"
UNROLL = 4  # copies of a lane loop's body per trip
VECTOR_UNROLL = 2  # groups per trip of a grid loop (a lane loop takes one)
_SREG = "llvm.nvvm.read.ptx.sreg."
_GPU_INTRINSIC = {"sqrt": "llvm.sqrt", "floor": "llvm.floor", "ceil": "llvm.ceil", "round": "llvm.roundeven",
                  "abs": "llvm.fabs", "maximum": "llvm.maximum", "minimum": "llvm.minimum"}
_LOG2E_HI, _LOG2E_LO = 1.44269502162933349609375, 1.925963033500011079e-08  # log2(e) as a float32 and the rest


def _exp(b: ir.IRBuilder, m: ir.Module, x):
    """exp(x) = 2**j * 2**f, j = rint(x log2 e) held in [-126, 127] so that
    2**j is a normal float built in the exponent bits, and f = x log2 e - j
    found with log2 e in two parts (exact to well under an ulp of 2**f).
    2**f comes from the special function unit (ex2.approx, within 2 ulp):
    a dozen instructions where the polynomial kernel takes about thirty.
    Beyond j's range f itself overflows or underflows, so infinities and
    zeros come out as in C, and NaN passes through f."""
    two = ir.FunctionType(F32, [F32, F32])
    j = b.call(m.declare_intrinsic("llvm.roundeven", [F32]), [b.fmul(x, ir.Constant(F32, _LOG2E_HI))])
    j = b.call(m.declare_intrinsic("llvm.maxnum", [F32], two), [j, ir.Constant(F32, -126.0)])
    j = b.call(m.declare_intrinsic("llvm.minnum", [F32], two), [j, ir.Constant(F32, 127.0)])
    fma = m.declare_intrinsic("llvm.fma", [F32], ir.FunctionType(F32, [F32, F32, F32]))
    f = b.call(fma, [x, ir.Constant(F32, _LOG2E_HI), b.fneg(j)])
    f = b.call(fma, [x, ir.Constant(F32, _LOG2E_LO), f])
    p = b.call(m.declare_intrinsic("llvm.nvvm.ex2.approx.f", (), ir.FunctionType(F32, [F32])), [f])
    scale = b.bitcast(b.shl(b.add(b.fptosi(j, I32), ir.Constant(I32, 127)), ir.Constant(I32, 23)), F32)
    return b.fmul(p, scale)


def _div_approx(b: ir.IRBuilder, p, q):
    """p / q as div.approx.f32 (a reciprocal and a product, within 2 ulp where
    |q| lies in [2**-126, 2**126]): for denominators known to lie there."""
    fn = b.module.declare_intrinsic("llvm.nvvm.div.approx.f", (), ir.FunctionType(F32, [F32, F32]))
    return b.call(fn, [p, q])


def _rsqrt(b: ir.IRBuilder, m: ir.Module, x):
    """1 / sqrt(x) as rsqrt.approx.f32 (within 2**-22.9 relative error,
    subnormals, zeros, infinities and NaN as IEEE has them): one instruction
    of the special function unit where a division of a square root takes
    two long sequences (a batch norm's inverse deviation, per element).
    lowering turns reciprocal(sqrt(x)) into rsqrt, so float32 code that
    writes the two gets this too."""
    return b.call(m.declare_intrinsic("llvm.nvvm.rsqrt.approx.f", (), ir.FunctionType(F32, [F32])), [x])


# float32 kernels that differ from mathlib's on the device
_GPU_KERNELS = {"exp": _exp, "erf": functools.partial(mathlib.erf, div=_div_approx),
                "tanh": functools.partial(mathlib.tanh, div=_div_approx), "rsqrt": _rsqrt}


def _fits_32_bits(trips: list) -> bool:
    """Whether a grid of these trip counts (LLVM values) is known to index
    below 2**31: its iterators then come from 32-bit divisions (one
    multiply-high each, where a 64-bit one is a sequence of them)."""
    if not all(isinstance(t, ir.Constant) and int(t.constant) > 0 for t in trips):
        return False
    return math.prod(int(t.constant) for t in trips) < 2 ** 31


@dataclass
class KernelContext:
    """What the emitter tracks while it emits one kernel."""

    plan: KernelPlan
    written: frozenset = frozenset()  # the arrays its statements write: no load of them is invariant
    lanes: int = 0  # threads per grid iteration (a warp or a block), 0 for one
    lane: Any = None  # this thread's lane among them
    zeroed: tuple[str, ...] = ()  # arrays the runtime zeroes before the launch (atomic strips)
    strips: bool = False  # strips of a sum: more threads than elements written
    claims: dict | None = None  # id(index) -> alignment, in the first copy of a vector group
    deferred: list | None = None  # the stores that wait until the end of a trip: (value, pointer, alignment, copy)
    copy: int | None = None  # the copy being emitted of a vector group's VECTOR consecutive iterations
    vector_loads: dict = field(default_factory=dict)  # (array, id(index)) -> (block, the group's elements), copy 0's
    copy_block: Any = None  # the block copy 0 began in
    grouped: bool = False  # a row's lane loops take groups of VECTOR (its accesses are aligned)
    row_offsets: dict = field(default_factory=dict)  # (group, copy) -> a lane's offset in an unrolled row
    row_step: tuple | None = None  # the (group, copy) of an unrolled lane loop being emitted
    row_values: dict = field(default_factory=dict)  # (array, group, copy) -> a lane's element of a held row
    ring: tuple | None = None  # (iterator, first, ring, copy) in a copy of a ring loop
    partials: dict = field(default_factory=dict)  # reduction statement -> (register, its call)
    skipped: set = field(default_factory=set)  # statements hoisted out of the lane loop being emitted
    current_call: Any = None  # the statement call being emitted


class _StripEmission:
    """Strips of a sequential loop per thread: with a halo, or summed atomically."""

    def atomic_loop(self, strip: Strips, lo, inc, hi) -> None:
        """This thread's strip of a summing loop into registers, then one
        atomic add per target element."""
        b = self.b
        self.ctx.zeroed, self.ctx.strips = strip.zeroed, True
        loop = strip.loop
        size = ir.Constant(I64, strip.size)
        start = b.add(lo, b.mul(b.load(self.var("gpu.strip"), typ=I64), b.mul(inc, size)))
        end = b.add(start, b.mul(inc, size))
        end = b.select(b.icmp_signed("<", end, hi), end, hi)
        sums = [self.stmts[c.get_op_arg(0).get_id().get_name()] for c in strip.calls]
        self.start_partials(sums)
        self.strided_loop(self.var(loop.for_get_iterator().get_id().get_name()), start, end, inc, "sum",
                          lambda: self.node(loop.for_get_body()))
        partials, self.ctx.partials = self.ctx.partials, {}
        for st in sums:
            slot, call = partials[st.name]
            arr = self.prog.arrays[st.array]
            ptr = self.reduction_address(st, call)
            self.b.atomic_rmw("fadd" if arr.dtype.is_float else "add", ptr,
                              self.b.load(slot, typ=COMPUTE[arr.dtype]), "monotonic")

    def start_partials(self, stmts) -> None:
        """A register per reduction statement, set to its identity; statement()
        accumulates there while the loop runs."""
        self.ctx.partials = {}
        for st in stmts:
            dt = self.prog.arrays[st.array].dtype
            slot = self.var("partial." + st.name, COMPUTE[dt])
            self.b.store(self.constant(scalar.identity(st.combine, dt), dt), slot)
            self.ctx.partials[st.name] = (slot, None)

    def reduction_address(self, st, call: isl.AstExpr) -> ir.Value:
        """Where a reduction statement's call writes; its index does not
        depend on the loop being reduced, so it is known after the loop."""
        used = {x for i in st.index for x in iter_vars(i)}
        env = {x: self.aexpr(call.get_op_arg(i + 1)) for i, x in enumerate(st.iters) if x in used}
        return self.address(self.prog.arrays[st.array], st.index, env, {})

    def strip_loop(self, strip: Strips, lo, inc, hi) -> None:
        """This thread's strip of the loop, from halo iterations before it;
        statements writing shared memory run only inside the strip."""
        b = self.b
        loop = strip.loop
        size = ir.Constant(I64, strip.size)
        start = b.add(lo, b.mul(b.load(self.var("gpu.strip"), typ=I64), b.mul(inc, size)))
        begin, end = self.strip_bounds(start, size, strip.halo, lo, inc, hi)
        it = loop.for_get_iterator().get_id().get_name()
        slot = self.var(it)
        self.strip_start = (slot, start)
        if strip.ring is None:
            self.strided_loop(slot, begin, end, inc, "strip", lambda: self.node(loop.for_get_body()))
        else:
            self.ring_loop(strip.ring, it, begin, end, lambda: self.node(loop.for_get_body()))
        self.strip_start = None

    def ring_loop(self, ring: int, it: str, begin, end, body) -> None:
        """it = begin, begin + 1, ... < end in trips of ring iterations, each
        guarded: copy c of a trip is ring slot c of the private buffers
        (whose rows are numbered from begin), so their indices are constants
        and the buffers live in registers."""
        slot = self.var(it)
        trip = self.var(it + ".trip")

        def copies() -> None:
            for c in range(ring):
                i = self.b.add(self.b.load(trip, typ=I64), ir.Constant(I64, c))
                then, after = self.fn.append_basic_block("ring.copy"), self.fn.append_basic_block("ring.next")
                self.b.cbranch(self.b.icmp_signed("<", i, end), then, after)
                self.b.position_at_end(then)
                self.b.store(i, slot)
                self.ctx.ring = (it, begin, ring, c)
                body()
                self.ctx.ring = None
                self.b.branch(after)
                self.b.position_at_end(after)
        self.range_loop(trip, begin, end, ir.Constant(I64, ring), copies)

    def private_index(self, arr, d: int, e, v, modulus: int) -> ir.Value:
        """In a ring loop, a rolling row's slot is (row - begin) mod ring: a
        constant where the index is the loop's iterator plus a constant."""
        if self.ctx.ring is None or modulus != self.ctx.ring[2]:
            return super().private_index(arr, d, e, v, modulus)
        it, begin, ring, copy = self.ctx.ring
        shift = self._ring_offset(e, it)
        if shift is not None:
            return ir.Constant(I64, (copy + shift) % ring)
        m = ir.Constant(I64, ring)
        return self.b.urem(self.b.add(self.b.sub(v, begin), m), m)

    def _ring_offset(self, e, it: str) -> int | None:
        """k when index e of the current statement is the AST iterator it plus k."""
        e, k = offset(e)
        if not (isinstance(e, Var) and e.kind == "iter"):
            return None
        call = self.ctx.current_call
        st = self.stmts[call.get_op_arg(0).get_id().get_name()]
        arg = call.get_op_arg(st.iters.index(e.name) + 1)
        shift = _ast_offset(arg, it)
        return None if shift is None else shift + k


class _RowEmission:
    """A warp (or block) per grid iteration: lane loops, shuffles, partial sums."""

    def row(self, plan: WarpRows) -> None:
        """One iteration for a warp (or block): its statements and the loops
        its lanes share. Where one check at the row's start finds every lane
        loop's accesses aligned, all of them take 16-byte groups, so that
        loads of the same element in several loops are one load."""
        aligned = None
        for loop in plan.children:
            vector = plan.vectors.get(id(loop))
            if vector is not None:
                lo, _, hi = self.loop_range(loop)
                ok = self.vector_check(vector, loop.for_get_iterator().get_id().get_name(), lo, self.b.sub(hi, lo))
                aligned = ok if aligned is None else self.b.and_(aligned, ok)

        def child_of(child: isl.AstNode) -> None:
            if child.get_type() == isl.ast_node_type.for_:
                self.lane_loop(child, plan)
            else:
                self.statement(child.user_get_expr(), shared=True)

        def emit(grouped: bool) -> None:
            self.ctx.grouped, self.ctx.row_offsets, self.ctx.row_values = grouped, {}, {}
            for child in plan.children:
                cond = plan.guards.get(id(child))
                if cond is None:
                    child_of(child)
                else:  # the same for every lane of the row; offsets made inside do not dominate what follows
                    offsets = dict(self.ctx.row_offsets)
                    with self.b.if_then(self.aexpr(cond)):
                        child_of(child)
                    self.ctx.row_offsets = offsets
                self.warp_sync()
            self.ctx.grouped = False
        self.vector_branch(aligned, lambda: emit(True), lambda: emit(False))

    def lane_loop(self, loop: isl.AstNode, plan: WarpRows) -> None:
        """An inner loop whose iterations the lanes share (lane, lane + 32, ...);
        reductions gather in a register per lane, then across the warp."""
        b = self.b
        it = loop.for_get_iterator().get_id().get_name()
        lo, inc, hi = self.loop_range(loop)
        hoisted = plan.hoisted[id(loop)]
        for call in hoisted:
            self.statement(call, shared=True)
        if hoisted:
            self.warp_sync()
        self.ctx.skipped = {c.get_op_arg(0).get_id().get_name() for c in hoisted}
        self.start_partials([self.stmts[name] for name in plan.reductions[id(loop)]])
        body = loop.for_get_body()
        lanes, width = ir.Constant(I64, self.ctx.lanes), ir.Constant(I64, VECTOR)
        vector = plan.vectors.get(id(loop)) if self.ctx.grouped else None
        defer = id(loop) in plan.deferred
        group = self.var(it + ".group")

        def copies() -> None:  # VECTOR consecutive iterations from the group's first
            first = self.b.load(group, typ=I64)
            for c in range(VECTOR):
                self.begin_copy(vector, c)
                self.b.store(self.b.add(first, ir.Constant(I64, c)), self.var(it))
                self.node(body)
            self.ctx.claims = self.ctx.copy = None
        if id(loop) in plan.unrolled and (vector is not None or plan.registers):  # (held rows: both ways)
            self.unrolled_lanes(it, lo, body, vector, plan.unrolled[id(loop)], defer)
        elif vector is None:
            self.strided_loop(self.var(it), b.add(lo, b.mul(self.ctx.lane, inc)), hi, b.mul(inc, lanes),
                              "lanes", lambda: self.node(body), UNROLL, defer)
        else:
            self.strided_loop(group, b.add(lo, b.mul(self.ctx.lane, width)), hi, b.mul(lanes, width),
                              "lanes.vector", copies, 1, defer)
        self.ctx.skipped = set()
        self.combine_lanes()

    def unrolled_lanes(self, it: str, lo, body, vector: Vector | None, groups: int, defer: bool) -> None:
        """A lane loop of groups groups per lane, unrolled whole: a row read
        again comes from registers, and so does a row the plan holds
        (WarpRows.registers: each lane's elements of it are values, never
        stored). Without vector, each element is accessed alone."""
        b = self.b
        width = ir.Constant(I64, VECTOR)
        self.ctx.deferred = [] if defer else None
        for k in range(groups):
            for c in range(VECTOR):
                # the same offset value in every loop of the row, so that after
                # folding each loop's start the addresses, then the loads, are one
                key = (k, c)
                if key not in self.ctx.row_offsets:
                    self.ctx.row_offsets[key] = b.add(b.mul(self.ctx.lane, width),
                                                      ir.Constant(I64, k * self.ctx.lanes * VECTOR + c))
                self.begin_copy(vector, c)
                self.b.store(self.b.add(lo, self.ctx.row_offsets[key]), self.var(it))
                self.ctx.row_step = key
                self.node(body)
            self.ctx.claims = self.ctx.copy = self.ctx.row_step = None
        self.flush_stores()

    def combine_lanes(self) -> None:
        """Each lane's partial reductions combined across the warp (and the
        block's warps), then into their elements."""
        b = self.b
        partials, self.ctx.partials = self.ctx.partials, {}
        for name, (slot, call) in partials.items():
            s = self.stmts[name]
            arr = self.prog.arrays[s.array]
            total = b.load(slot, typ=COMPUTE[arr.dtype])
            for mask in (16, 8, 4, 2, 1):
                total = self.combine(s.combine, total, self.shuffle(total, mask), arr.dtype)
            if self.ctx.lanes > WARP:
                total = self.across_warps(total, s.combine, arr.dtype)
            ptr = self.reduction_address(s, call)
            old = self.from_storage(b.load(ptr, typ=STORAGE[arr.dtype]), arr.dtype)
            self.warp_sync()
            b.store(self.to_storage(self.combine(s.combine, old, total, arr.dtype), arr.dtype), ptr)

    def _value(self, e, env, cache) -> ir.Value:
        """A load of a held row is the value its lane computed at this step."""
        if isinstance(e, Load) and e.array in getattr(self.ctx.plan, "registers", ()):
            return self.ctx.row_values[(e.array,) + self.ctx.row_step]
        return super()._value(e, env, cache)

    def warp_sync(self) -> None:
        """Order the memory accesses of the lanes sharing an iteration."""
        if self.ctx.lanes > WARP:
            self.barrier()
            return
        fn = self.module.declare_intrinsic("llvm.nvvm.bar.warp.sync", (), ir.FunctionType(ir.VoidType(), [I32]))
        self.b.call(fn, [ir.Constant(I32, -1)])

    def across_warps(self, total, how: str, dt) -> ir.Value:
        """Combine one value per warp of the block through shared memory."""
        b = self.b
        shared = self.shared_array("polyjit_partials", I64, BLOCK // WARP)
        zero32 = ir.Constant(I32, 0)
        warp = b.trunc(b.lshr(self.ctx.lane, ir.Constant(I64, 5)), I32)
        first = b.icmp_unsigned("==", b.and_(self.ctx.lane, ir.Constant(I64, WARP - 1)), ir.Constant(I64, 0))
        write = self.fn.append_basic_block("partials.write")
        after = self.fn.append_basic_block("partials.read")
        b.cbranch(first, write, after)
        b.position_at_end(write)
        b.store(_to_bits(b, total), b.gep(shared, [zero32, warp]))
        b.branch(after)
        b.position_at_end(after)
        self.warp_sync()
        out = None
        for w in range(self.ctx.lanes // WARP):
            v = _from_bits(b, b.load(b.gep(shared, [zero32, ir.Constant(I32, w)]), typ=I64), total.type)
            out = v if out is None else self.combine(how, out, v, dt)
        self.warp_sync()
        return out

    def shuffle(self, v: ir.Value, mask: int) -> ir.Value:
        """The value lane ^ mask holds (shfl.sync.bfly), for any width."""
        b = self.b
        t = v.type
        fn = self.module.declare_intrinsic("llvm.nvvm.shfl.sync.bfly.i32", (),
                                           ir.FunctionType(I32, [I32, I32, I32, I32]))
        shfl = lambda x: b.call(fn, [ir.Constant(I32, -1), x, ir.Constant(I32, mask), ir.Constant(I32, 31)])  # noqa: E731
        bits = t.width if isinstance(t, ir.IntType) else {F32: 32, F64: 64}[t]
        as_int = v if isinstance(t, ir.IntType) else b.bitcast(v, ir.IntType(bits))
        if bits <= 32:
            out = b.trunc(shfl(b.zext(as_int, I32)), t) if bits < 32 else shfl(as_int)
            return out if isinstance(t, ir.IntType) else b.bitcast(out, t)
        lo = shfl(b.trunc(as_int, I32))
        hi = shfl(b.trunc(b.lshr(as_int, ir.Constant(I64, 32)), I32))
        out = b.or_(b.zext(lo, I64), b.shl(b.zext(hi, I64), ir.Constant(I64, 32)))
        return out if isinstance(t, ir.IntType) else b.bitcast(out, t)

    def statement(self, call: isl.AstExpr, shared: bool = False) -> None:
        """Reductions inside a lane loop go to the lane's partial; a statement
        the whole warp runs (shared) reads before any lane writes."""
        name = call.get_op_arg(0).get_id().get_name()
        if name in self.ctx.skipped:
            return
        self.ctx.current_call = call
        partial = self.ctx.partials.get(name)
        scatter = isinstance(self.ctx.plan, ScatterPoints)
        s = self.stmts[name]
        held = s.array in getattr(self.ctx.plan, "registers", ())  # (a lane's element of a held row: a value)
        if partial is None and not shared and not scatter and not held:
            return super().statement(call)
        env = {it: self.aexpr(call.get_op_arg(i + 1)) for i, it in enumerate(s.iters)}
        cache: dict = {}
        val = self.value(s.body, env, cache)
        arr = self.prog.arrays[s.array]
        if held:  # (rounded to its storage, as a store and a load would)
            self.ctx.row_values[(s.array,) + self.ctx.row_step] = self.from_storage(self.to_storage(val, arr.dtype),
                                                                                   arr.dtype)
            return
        if scatter:  # (scatter_points: a sum, in a type atomics add)
            self.b.atomic_rmw("fadd" if arr.dtype.is_float else "add", self.address(arr, s.index, env, cache),
                              self.to_storage(val, arr.dtype), "monotonic")
            return
        if partial is not None:
            slot = partial[0]
            self.ctx.partials[name] = (slot, call)
            self.b.store(self.combine(s.combine, self.b.load(slot, typ=COMPUTE[arr.dtype]), val, arr.dtype), slot)
            return
        ptr = self.address(arr, s.index, env, cache)
        if s.combine is not None:
            old = self.from_storage(self.b.load(ptr, typ=STORAGE[arr.dtype]), arr.dtype)
            val = self.combine(s.combine, old, val, arr.dtype)
        self.warp_sync()
        self.b.store(self.to_storage(val, arr.dtype), ptr)


class GpuEmitter(_RowEmission, _StripEmission, Emitter):
    """Emits each kernel as its plan (codegen.gpu_mapping) says."""

    triple = TRIPLE
    tile_sizes: tuple[int, ...] | None = None  # compile_options' (tile, ktile) for contractions
    multiprocessors: int | None = None  # of the GPU in use, when one is
    arch: str = DEFAULT_ARCH  # the sm_XX the PTX is for

    def __init__(self, prog, sched, name: str = "fn") -> None:
        super().__init__(prog, sched, name)
        self.plans: list[KernelPlan] = []  # per kernel emitted, its plan
        self.ctx: KernelContext | None = None  # the kernel being emitted

    def mapper(self) -> GpuMapper:
        return GpuMapper(self.prog, self.sched, self.multiprocessors, self.tile_sizes, self.arch)

    def emit(self) -> ir.Module:
        """Every kernel, all of them mapped first."""
        asts = self.sched.kernel_asts()
        mapper = self.mapper()
        for k, (node, plan) in enumerate(zip(asts, [mapper.kernel(node) for node in asts])):
            self.kernel(k, node, plan)
        return self.module

    def mapping_text(self) -> str:
        """The mapping stage of the kernels emitted, as printed."""
        return mapping_text([(k.name, plan) for k, plan in zip(self.kernels, self.plans)])

    def kernel(self, k: int, node: isl.AstNode, plan: KernelPlan) -> None:
        """``ptx_kernel void name(ptr buffers..., i64 ints...)``; the body gets
        the thread's global index as its part and the thread count as parts.
        A library statement (which runs alone) is no kernel: a step that
        runtime.gpu_program runs through cuBLAS."""
        self.plans.append(plan)
        if isinstance(plan, Library):
            names = statements_in(node)
            self.kernels.append(KernelInfo(self.kernel_name(k, names), False, tuple(sorted(names)),
                                           library=plan.statement))
            return
        names, name, body_fn = self.body_function(k, node)
        nb, ni = len(self.buffer_arrays), len(self.int_slots)
        body_fn.attributes.add("alwaysinline")
        self.ctx = ctx = KernelContext(plan, frozenset(self.stmts[n].array for n in names))
        self.body(body_fn, node)
        fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [PTR] * nb + [I64] * ni), name)
        fn.calling_convention = "ptx_kernel"
        for arg, array in zip(fn.args[:nb], self.buffer_arrays):
            arg.add_attribute("noalias")
            if array.name not in ctx.written:  # its loads take the read-only cache (ld.global.nc), vector ones
                set.add(arg.attributes, "readonly")  # too (llvmlite's list of parameter attributes lacks it)
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        sreg = lambda r: b.zext(b.call(self.module.declare_intrinsic(  # noqa: E731
            _SREG + r, (), ir.FunctionType(I32, [])), []), I64)
        ntid = sreg("ntid.x")
        gid = b.add(b.mul(sreg("ctaid.x"), ntid), sreg("tid.x"))
        b.call(body_fn, list(fn.args) + [gid, b.mul(sreg("nctaid.x"), ntid)])
        b.ret_void()
        self.kernels.append(KernelInfo(name, self.parallel, tuple(sorted(names)), ctx.lanes, ctx.zeroed,
                                       ctx.strips))

    def node(self, n: isl.AstNode) -> None:
        if isinstance(self.ctx.plan, SideBySide) and side_by_side_kernel(n):
            self.side_by_side(self.ctx.plan, n)
            return
        grid = getattr(self.ctx.plan, "grid", None)
        mark = n.get_type() == isl.ast_node_type.mark and n.mark_get_id().get_name().startswith("parallel:")
        if grid is not None and not self.in_parallel and (
                grid.top is None or (mark and n.mark_get_id().get_name() == grid.top)):
            self.in_parallel = self.parallel = True  # the grid (without a mark: strips of a whole sum)
            self.grid_loop(self.ctx.plan)
        elif mark:  # a parallel loop inside a sequential one runs in order
            self.node(n.mark_get_node())
        else:
            super().node(n)

    def side_by_side(self, plan: SideBySide, n: isl.AstNode) -> None:
        """Each nest on threads of its own: of the kernel's T threads, nest k
        of P takes [k + floor((T - P) * f_k), k + 1 + floor((T - P) * f_(k+1))),
        where f_k is the fraction of all points in the nests before it (at
        least one thread each: a launch has at least P threads). The
        fractions are constants in double precision, where 64-bit integer
        divisions, two a nest in every thread, took longer than the copies."""
        b = self.b
        part, parts = self.part, self.parts
        total, count = sum(plan.points), len(plan.parts)
        spare = b.uitofp(b.sub(parts, _i64(count)), F64)
        before = itertools.accumulate(plan.points, initial=0)  # each nest's points before it
        lo = _i64(0)
        for k, (nest, sub, points) in enumerate(zip(kernel_nodes(n.mark_get_node()), plan.parts, before)):
            hi = parts if k + 1 == count else b.add(_i64(k + 1), b.fptoui(
                b.fmul(spare, ir.Constant(F64, (points + plan.points[k]) / total)), I64))
            mine = b.and_(b.icmp_unsigned(">=", part, lo), b.icmp_unsigned("<", part, hi))
            with b.if_then(mine):
                self.part, self.parts = b.sub(part, lo), b.sub(hi, lo)
                self.ctx.plan, self.in_parallel = sub, False
                self.node(nest)
            lo = hi
        self.part, self.parts, self.ctx.plan, self.in_parallel = part, parts, plan, False

    # ------------------------------------------------------------ the grid
    def grid_loop(self, plan: KernelPlan) -> None:
        """The grid's loops as one collapsed loop, its iterations dealt out
        to threads: thread t runs t, t + parts, ... (strips of a sequential
        loop count as one more grid loop, outermost)."""
        b = self.b
        one, zero = ir.Constant(I64, 1), ir.Constant(I64, 0)
        bounds, total, whole = [], one, []
        for loop in plan.grid.loops:
            lo, inc, hi = self.loop_range(loop)
            trips = self.trip_count(lo, inc, hi)
            it = loop.for_get_iterator().get_id().get_name()
            if it in getattr(plan, "whole", ()):  # (static trips: thread_loops)
                whole.append((it, lo, inc, static_extent(loop)))
                continue
            bounds.append((it, lo, inc, trips))
            total = b.mul(total, trips)
        if isinstance(plan, TiledContraction):
            (_MmaTileEmission if plan.tensor_cores else _TileEmission)(self, plan, [b_[1:] for b_ in bounds]).emit()
            return
        strip_range = None
        if isinstance(plan, (HaloStrips, AtomicStrips)):
            strip_range = self.loop_range(plan.strips.loop)
            strips = self.trip_count(zero, one, self.trip_count(*strip_range), plan.strips.size)
            bounds.insert(0, ("gpu.strip", zero, one, strips))
            total = b.mul(total, strips)
            for loop in reversed(plan.strips.outer):  # a nest's outer loops: an iteration per strip
                lo, inc, hi = self.loop_range(loop)
                trips = self.trip_count(lo, inc, hi)
                bounds.insert(0, (loop.for_get_iterator().get_id().get_name(), lo, inc, trips))
                total = b.mul(total, trips)
        first, step = self.part, self.parts
        if isinstance(plan, WarpRows):  # a warp (or block) per iteration: its lanes share the inner loops
            self.ctx.lanes = plan.lanes
            shift = ir.Constant(I64, plan.lanes.bit_length() - 1)
            first, step = b.lshr(first, shift), b.lshr(step, shift)
            self.ctx.lane = b.and_(self.part, ir.Constant(I64, plan.lanes - 1))
        g = self.var("gpu.g")
        iteration = functools.partial(self.grid_iteration, plan, g, bounds, strip_range, {}, whole=whole)
        if isinstance(plan, PointPerThread):
            self.point_loops(plan, iteration, g, (first, total, step), bounds)
        else:
            self.strided_loop(g, first, total, step, "grid", iteration)

    def grid_iteration(self, plan: KernelPlan, g, bounds: list, strip_range, inner: dict,
                       copy: int | None = None, whole: list = ()) -> None:
        """Iteration g; in a vector group, copy c > 0 is copy 0's with the
        innermost iterator c further on (the group lies within one row).
        The loops in whole run all their iterations in it, one copy each."""
        b = self.b
        self.begin_copy(getattr(plan, "vector", None), copy)
        if copy:
            b.store(b.add(inner["first"], ir.Constant(I64, copy)), self.var(bounds[-1][0]))
        elif isinstance(plan, PointPerThread) and plan.tile:
            self.tile_point(*plan.tile, b.load(g, typ=I64), bounds, VECTOR if copy == 0 else 1)
            inner["first"] = b.load(self.var(bounds[-1][0]), typ=I64)
        else:
            rem = b.load(g, typ=I64)
            narrow = _fits_32_bits([x[3] for x in bounds])
            if narrow:
                rem = b.trunc(rem, I32)
            for k, (it, first_it, inc, trips) in enumerate(reversed(bounds)):
                if narrow:
                    trips = ir.Constant(I32, trips.constant)
                idx = rem if k == len(bounds) - 1 else b.urem(rem, trips)
                if k < len(bounds) - 1:
                    rem = b.udiv(rem, trips)
                b.store(b.add(first_it, b.mul(b.zext(idx, I64) if narrow else idx, inc)), self.var(it))
                if k == 0:
                    inner["first"] = b.load(self.var(it), typ=I64)
        if isinstance(plan, WarpRows):
            self.row(plan)
        elif isinstance(plan, AtomicStrips):
            self.atomic_loop(plan.strips, *strip_range)
        elif isinstance(plan, HaloStrips):
            self.strip_loop(plan.strips, *strip_range)
        else:
            for point in itertools.product(*(range(x[3]) for x in whole)):
                for (it, first_it, inc, _), k in zip(whole, point):
                    b.store(b.add(first_it, b.mul(ir.Constant(I64, k), inc)), self.var(it))
                self.node(plan.grid.rest)
        self.ctx.claims = self.ctx.copy = None

    def tile_point(self, cols: str, rows: str, rem: ir.Value, bounds: list, group: int) -> None:
        """The iterators of grid iteration rem where each warp's 32 take a
        TILE_COLS x TILE_ROWS tile of loops cols and rows (a column: a
        vector group of `group` iterations), the block's warps consecutive
        tiles along rows."""
        b = self.b
        if group > 1:
            rem = b.udiv(rem, ir.Constant(I64, group))
        lane = b.urem(rem, ir.Constant(I64, WARP))
        rem = b.udiv(rem, ir.Constant(I64, WARP))
        by_name = {x[0]: x for x in bounds}
        order = [by_name[rows], by_name[cols]] + [x for x in reversed(bounds) if x[0] not in (cols, rows)]
        for it, first_it, inc, trips in order:
            side, at = {cols: (TILE_COLS * group, b.mul(b.urem(lane, ir.Constant(I64, TILE_COLS)),
                                                         ir.Constant(I64, group))),
                        rows: (TILE_ROWS, b.udiv(lane, ir.Constant(I64, TILE_COLS)))}.get(it, (1, None))
            tiles = b.udiv(trips, ir.Constant(I64, side)) if side > 1 else trips
            idx = b.urem(rem, tiles)
            rem = b.udiv(rem, tiles)
            if at is not None:
                idx = b.add(b.mul(idx, ir.Constant(I64, side)), at)
            b.store(b.add(first_it, b.mul(idx, inc)), self.var(it))

    def point_loops(self, plan: PointPerThread, iteration, g, span: tuple, bounds: list) -> None:
        """Straight-line bodies (elementwise code) take several iterations per
        trip, their stores after all their loads, so that each thread has
        several loads in flight; where the accesses move along the innermost
        loop and the arrays are aligned (checked here, at run time), groups of
        VECTOR consecutive iterations, which LLVM turns into vector accesses."""
        b = self.b
        first, total, step = span
        vector, defer = plan.vector, plan.defer
        width = ir.Constant(I64, VECTOR)
        grouped = lambda: self.strided_loop(  # noqa: E731
            g, b.mul(first, width), total, b.mul(step, width), "vector",
            lambda: [iteration(c) for c in range(VECTOR)], VECTOR_UNROLL, defer)
        aligned = self.vector_check(vector, *bounds[-1][:2], bounds[-1][3]) if vector is not None else None
        self.vector_branch(aligned, grouped,
                           lambda: self.strided_loop(g, first, total, step, "grid", iteration, UNROLL, defer))

    def vector_branch(self, aligned: ir.Value | None, grouped, scalar) -> None:
        """grouped() where the accesses are aligned at run time, else scalar()."""
        if aligned is None:
            scalar()
            return
        blocks = [self.fn.append_basic_block(f"vector.{x}") for x in ("grouped", "scalar", "done")]
        self.b.cbranch(aligned, blocks[0], blocks[1])
        for block, emit in zip(blocks, (grouped, scalar)):
            self.b.position_at_end(block)
            emit()
            self.b.branch(blocks[2])
        self.b.position_at_end(blocks[2])

    def vector_check(self, vector: Vector, it: str, first, trips) -> ir.Value:
        """Whether groups of VECTOR iterations start on aligned elements: the
        innermost loop starts and ends on a multiple of VECTOR, and every
        claimed array is aligned with rows a multiple of VECTOR long."""
        b = self.b
        zero = ir.Constant(I64, 0)
        low = ir.Constant(I64, VECTOR - 1)
        bits = b.and_(trips, low)
        b.store(first, self.var(it))
        for start in vector.starts.values():  # the last index at the loop's first iteration
            bits = b.or_(bits, b.and_(self.aexpr(start), low))
        for name, align in vector.arrays.items():
            bits = b.or_(bits, b.and_(b.ptrtoint(self.base[name], I64), ir.Constant(I64, align - 1)))
            strides = self.strides[name]
            if len(strides) > 1:
                bits = b.or_(bits, b.and_(strides[-2], low))
        return b.icmp_unsigned("==", bits, zero)

    def strided_loop(self, slot, begin, end, step, label: str, body, unroll: int = 1, defer: bool = False) -> None:
        """slot = begin, begin + step, ... while < end, running body() each
        time; with unroll, unroll bodies per trip while all of them fit, then
        one per trip for the rest; with defer, a trip's stores go last."""
        b = self.b
        b.store(begin, slot)
        for copies in ((unroll, 1) if unroll > 1 else (1,)):
            head = self.fn.append_basic_block(f"{label}{copies}.head")
            block = self.fn.append_basic_block(f"{label}{copies}.body")
            done = self.fn.append_basic_block(f"{label}{copies}.done")
            b = self.b
            b.branch(head)
            b.position_at_end(head)
            last = b.add(b.load(slot, typ=I64), b.mul(step, ir.Constant(I64, copies - 1)))
            b.cbranch(b.icmp_signed("<", last, end), block, done)
            b.position_at_end(block)
            self.ctx.deferred = [] if defer else None
            for _ in range(copies):
                body()
                b = self.b
                b.store(b.add(b.load(slot, typ=I64), step), slot)
            self.flush_stores()
            b.branch(head)
            b.position_at_end(done)

    # ------------------------------------------------------ shared memory
    def shared_array(self, name: str, elem: ir.Type, count: int, align: int | None = None) -> ir.GlobalVariable:
        """A block's shared-memory array (one per module: kernels run one at a time)."""
        g = self.module.globals.get(name)
        if g is None:
            g = ir.GlobalVariable(self.module, ir.ArrayType(elem, count), name, addrspace=3)
            g.linkage = "internal"
            if align:
                g.align = align
            g.initializer = ir.Constant(g.value_type, ir.Undefined)
        return g

    def barrier(self) -> None:
        """Wait for the whole block (bar.sync 0)."""
        fn = self.module.declare_intrinsic("llvm.nvvm.barrier0", (), ir.FunctionType(ir.VoidType(), []))
        self.b.call(fn, [])

    # ------------------------------------------------------ target hooks
    def begin_copy(self, vector: Vector | None, copy: int | None) -> None:
        """Copy `copy` of a vector group (None: no group) is emitted next."""
        self.ctx.claims, self.ctx.copy = (vector.claims if vector is not None and copy == 0 else None), copy
        if copy == 0:
            self.ctx.vector_loads, self.ctx.copy_block = {}, self.b.block

    def load_element(self, arr, index, ptr) -> ir.Value:
        """Arrays the kernel does not write are invariant while it runs (its
        buffers do not overlap): their loads may take the read-only cache
        (ld.global.nc), and LLVM may reuse one across a warp's barriers (a
        softmax's row, loaded for its maximum, again for its sum, then for
        its result, where a kernel before had made it).

        In a vector group, a claimed load of such an array that copy 0 makes
        unconditionally (in the block the copy began in) loads the group's
        VECTOR elements at once, and the later copies take theirs from it
        while they are still in that block (an array the kernel writes may
        get its later elements from those copies: a layer norm's centred
        row, stored, then read back for its variance). Left to LLVM, loop
        strength reduction gave copy 0's address a pointer of its own before
        the load-store vectorizer ran, and an NHWC batch norm's input went
        as four scalar loads, each address rebuilt from the grid index with
        64-bit divisions."""
        key, invariant = (arr.name, id(index)), arr.name not in self.ctx.written
        got = self.ctx.vector_loads.get(key) if self.ctx.copy else None
        if got is not None and got[0] is self.b.block:
            return self.from_storage(self.b.extract_element(got[1], ir.Constant(I32, self.ctx.copy)), arr.dtype)
        align = self.ctx.claims.get(id(index)) if self.ctx.claims else None
        whole = align is not None and invariant and self.b.block is self.ctx.copy_block
        storage = STORAGE[arr.dtype]
        v = self.b.load(ptr, typ=ir.VectorType(storage, VECTOR) if whole else storage, align=align)
        if invariant:
            v.set_metadata("invariant.load", self.module.add_metadata([]))
        if whole:
            self.ctx.vector_loads[key] = (self.b.block, v)
            v = self.b.extract_element(v, ir.Constant(I32, 0))
        return self.from_storage(v, arr.dtype)

    def flush_stores(self) -> None:
        """The stores deferred since ctx.deferred was set to a list. In a
        vector group, a claimed store's VECTOR copies (consecutive elements,
        the first aligned to them all) go as one vector store: LLVM had
        merged the copies' loads but not their stores, and a warp wrote
        every fourth element four times over (an elementwise pass's stores
        took four times its loads' instructions)."""
        runs: list[list] = []  # the stores of each copy emitted, in order
        for value, ptr, align, copy in self.ctx.deferred or ():
            if not runs or copy is None or copy != runs[-1][0][3]:
                runs.append([])
            runs[-1].append((value, ptr, align, copy))
        self.ctx.deferred = None
        k = 0
        while k < len(runs):
            group = runs[k:k + VECTOR]
            whole = [r[0][3] for r in group] == list(range(VECTOR)) and len({len(r) for r in group}) == 1
            for stores in (zip(*group) if whole else ([st] for st in runs[k])):
                self.store_copies(list(stores))
            k += VECTOR if whole else 1

    def store_copies(self, stores: list) -> None:
        """One store's copies: a vector store where there are VECTOR of them
        and the first is claimed (the others' elements follow its own)."""
        value, ptr, align, _ = stores[0]
        if len(stores) < VECTOR or align is None:
            for value, ptr, align, _ in stores:
                self.b.store(value, ptr, align=align)
            return
        vec = ir.Constant(ir.VectorType(value.type, VECTOR), ir.Undefined)
        for c, st in enumerate(stores):
            vec = self.b.insert_element(vec, st[0], ir.Constant(I32, c))
        self.b.store(vec, ptr, align=align)

    def store_element(self, arr, index, ptr, val) -> None:
        align = self.ctx.claims.get(id(index)) if self.ctx.claims else None
        if self.ctx.deferred is not None:
            self.ctx.deferred.append((self.to_storage(val, arr.dtype), ptr, align, self.ctx.copy))
        else:
            self.b.store(self.to_storage(val, arr.dtype), ptr, align=align)

    def math(self, op: str, a: list) -> ir.Value:
        """No C library on the device: float32 kernels from mathlib and
        compositions of them; NVPTX's own instructions for the rest."""
        t = a[0].type
        if t == F32 and op in _GPU_KERNELS:
            return _GPU_KERNELS[op](self.b, self.module, *a)
        if t == F32 and op in mathlib.KERNELS:
            return mathlib.KERNELS[op](self.b, self.module, *a)
        if op in _GPU_INTRINSIC:
            return self.call(_GPU_INTRINSIC[op], a)
        if op == "rsqrt":  # (float64: no instruction for it; the host's square root and division)
            return super().math(op, a)
        if t == F32 and scalar.OPS[op].decompose is not None:
            return self.decomposed(op, a)
        raise UnsupportedOpError(f"{op} on {'float32' if t == F32 else str(t)} is not supported by target 'nvgpu'")

    def alloc_contracted(self, a, moduli) -> None:
        """Not for a row the lanes hold in registers."""
        if a.name not in getattr(self.ctx.plan, "registers", ()):
            super().alloc_contracted(a, moduli)

    def malloc(self, nbytes):
        raise UnsupportedOpError("a buffer too large for a GPU thread")


class _TileEmission:
    """C[i, j] += A[i, k] * B[k, j] with a block per side x side tile of C
    (a TiledContraction): the block stages depth-wide slices of A and B in
    shared memory; its 16 x 16 threads each accumulate side/16 x side/16
    outputs in registers, in groups of four rows (and columns) 64 apart, so
    that a warp's vector reads of shared memory do not collide in its banks."""

    NAME, PAD = "tile", 0

    def __init__(self, e: GpuEmitter, t: TiledContraction, bounds: list) -> None:
        b = e.b
        e.ctx.lanes = BLOCK
        self.e, self.t = e, t
        self.m_lo, _, self.m = bounds[t.i]
        self.n_lo, _, self.n = bounds[t.j]
        self.batch = [(it, bd) for q, (it, bd) in enumerate(zip(t.grid_its, bounds)) if q not in (t.i, t.j)]
        side, depth = self.side, self.depth = t.side, t.depth
        self.staged_n = side * depth // BLOCK  # elements of each slice a thread stages
        self.red = []  # per reduction loop: (iterator, first, extent); k runs over their product
        self.k_hi = _i64(1)
        for it, loop in zip(t.red_its, t.reds):
            lo, _, hi = e.loop_range(loop)
            extent = b.sub(hi, lo)
            self.red.append((it, lo, extent))
            self.k_hi = b.mul(self.k_hi, extent)
        self.k_lo = _i64(0)
        self.lane = b.and_(e.part, _i64(BLOCK - 1))
        self.threads()
        self.tiles_n = b.udiv(b.add(self.n, _i64(side - 1)), _i64(side))
        self.tiles = b.mul(b.udiv(b.add(self.m, _i64(side - 1)), _i64(side)), self.tiles_n)
        self.total = self.tiles
        for _, (_, _, trips) in self.batch:  # the other parallel loops: a batch of products
            self.total = b.mul(self.total, trips)
        self.stride = side + self.PAD  # a staged slice's row of side elements, in shared memory
        stages = f"x{t.stages}" if t.stages > 1 else ""
        self.shared = [e.shared_array(f"polyjit_{self.NAME}_{x}{side}x{depth}{stages}", F32,
                                      t.stages * depth * self.stride, 16) for x in "ab"]
        self.staged = [[e.var(f"gpu.staged{x}{q}", F32) for q in range(self.staged_n)] for x in "ab"]
        # plain factors read the next slice while the block computes on this one; computed
        # factors (a convolution's guarded input) would hold too many registers meanwhile
        self.prefetch = isinstance(t.a, Load) and isinstance(t.b, Load)
        # A walks memory along k unless it is a plain load whose last index is i (A.T @ B);
        # B along j unless it is a plain load whose last index is k (x @ W.T)
        self.a_along_k = not (isinstance(t.a, Load) and getattr(t.a.index[-1], "name", None) == t.grid_its[t.i])
        self.b_along_k = isinstance(t.b, Load) and getattr(t.b.index[-1], "name", None) == t.red_its[-1]
        self.tile, self.k0 = e.var("gpu.tile"), e.var("gpu.k0")
        self.env0: dict = {}  # the batch iterators of the tile being emitted
        self.r0 = self.c0 = None  # its first row and column

    def threads(self) -> None:
        """This thread's part of the tile: a place (ty, tx) in 16 x 16, and
        slots for its side/16 x side/16 sums."""
        b = self.e.b
        self.per = self.side // 16  # outputs per thread along each side
        self.group = min(self.per, 4)  # consecutive ones
        self.ty, self.tx = b.udiv(self.lane, _i64(16)), b.urem(self.lane, _i64(16))
        self.acc = [self.e.var(f"gpu.acc{q}", F32) for q in range(self.per * self.per)]

    def emit(self) -> None:
        e = self.e
        shift = _i64(BLOCK.bit_length() - 1)
        e.strided_loop(self.tile, e.b.lshr(e.part, shift), self.total, e.b.lshr(e.parts, shift), "tiles",
                       self.one_tile)

    def own(self, x, q: int):
        """Row (or column) q of those this thread (x = ty or tx) accumulates."""
        b, group = self.e.b, self.group
        return b.add(b.mul(x, _i64(group)), _i64((q // group) * 16 * group + q % group))

    def reduction_env(self, k) -> dict:
        b = self.e.b
        env = {}
        for it, lo, extent in reversed(self.red):
            env[it] = b.add(lo, b.urem(k, extent)) if len(self.red) > 1 else b.add(lo, k)
            k = b.udiv(k, extent)
        return env

    def element(self, x, fixed: dict, k) -> ir.Value:
        return self.e.value(x, {**self.env0, **fixed, **self.reduction_env(k)}, {})

    def one_tile(self) -> None:
        b = self.e.b
        tv = b.load(self.tile, typ=I64)
        if self.batch:  # tile index = (batch..., tile of C)
            rest = b.udiv(tv, self.tiles)
            for it, (lo, _, trips) in reversed(self.batch):
                self.env0[it] = b.add(lo, b.urem(rest, trips))
                rest = b.udiv(rest, trips)
            tv = b.urem(tv, self.tiles)
        side = _i64(self.side)
        self.r0, self.c0 = b.mul(b.udiv(tv, self.tiles_n), side), b.mul(b.urem(tv, self.tiles_n), side)
        for slot in self.acc:
            b.store(ir.Constant(F32, 0.0), slot)
        self.k_loop()
        self.write_back()

    def k_loop(self) -> None:
        for q in range(self.staged_n if self.prefetch else 0):
            self.fetch(self.k_lo, q)
        self.e.strided_loop(self.k0, self.k_lo, self.k_hi, _i64(self.depth), "ktile", self.k_step)

    def share(self, q: int) -> tuple:
        """Element q of this thread's share of a slice: A's (row, k) and B's
        (column, k), consecutive lanes taking consecutive elements of the
        dimension each factor holds contiguously, so that reads coalesce."""
        b = self.e.b
        e = b.add(self.lane, _i64(q * BLOCK))
        along_k = (b.udiv(e, _i64(self.depth)), b.urem(e, _i64(self.depth)))
        along_side = (b.urem(e, _i64(self.side)), b.udiv(e, _i64(self.side)))
        return along_k if self.a_along_k else along_side, along_k if self.b_along_k else along_side

    def fetch(self, kv, q: int) -> None:
        """Read element q of this thread's share of the slice of A[rows, kv ..]
        and B[kv .., columns] into registers (zeros past the edges)."""
        b, t = self.e.b, self.t
        (r, ka), (c, kb) = self.share(q)
        i_it, j_it = t.grid_its[t.i], t.grid_its[t.j]
        self.staged_read(self.staged[0][q], b.add(self.r0, r), self.m, b.add(kv, ka),
                         lambda x, k: self.element(t.a, {i_it: b.add(self.m_lo, x)}, k))
        self.staged_read(self.staged[1][q], b.add(self.c0, c), self.n, b.add(kv, kb),
                         lambda x, k: self.element(t.b, {j_it: b.add(self.n_lo, x)}, k))

    def staged_read(self, slot, x, extent, k, read) -> None:
        """slot = read(x, k) where x < extent and k < k_hi, else 0."""
        e = self.e
        b = e.b
        b.store(ir.Constant(F32, 0.0), slot)
        inside = b.and_(b.icmp_signed("<", x, extent), b.icmp_signed("<", k, self.k_hi))
        then, after = e.fn.append_basic_block("stage.read"), e.fn.append_basic_block("stage.next")
        b.cbranch(inside, then, after)
        b.position_at_end(then)
        b.store(read(x, k), slot)
        b.branch(after)
        b.position_at_end(after)

    def k_step(self) -> None:
        """One slice: staged into shared memory (the next one read meanwhile), then multiplied."""
        e = self.e
        for q in range(self.staged_n):
            if not self.prefetch:
                self.fetch(e.b.load(self.k0, typ=I64), q)
            b = e.b
            (r, ka), (c, kb) = self.share(q)
            b.store(b.load(self.staged[0][q], typ=F32), self.shared_at(0, self.slot(0, ka, r)))
            b.store(b.load(self.staged[1][q], typ=F32), self.shared_at(1, self.slot(1, kb, c)))
        e.barrier()
        for q in range(self.staged_n if self.prefetch else 0):
            self.fetch(e.b.add(e.b.load(self.k0, typ=I64), _i64(self.depth)), q)
        self.multiply()
        e.barrier()

    def slot(self, which: int, k, x) -> ir.Value:
        """Where factor which's element (k, row or column x) of a slice is staged."""
        b = self.e.b
        return b.add(b.mul(k, _i64(self.stride)), x)

    def multiply(self) -> None:
        """This thread's sums += its rows of the staged A times its columns of B."""
        e = self.e
        b, per, side = e.b, self.per, self.side
        sums = [b.load(slot, typ=F32) for slot in self.acc]
        for kk in range(self.depth):
            a = [b.load(self.shared_at(0, b.add(_i64(kk * side), self.own(self.ty, q))), typ=F32) for q in range(per)]
            w = [b.load(self.shared_at(1, b.add(_i64(kk * side), self.own(self.tx, q))), typ=F32) for q in range(per)]
            sums = [e.call("llvm.fmuladd", [a[q // per], w[q % per], sums[q]]) for q in range(per * per)]
        for slot, v in zip(self.acc, sums):
            b.store(v, slot)

    def outputs(self) -> list:
        """(row, column, sum slot) per output this thread accumulates, in its tile."""
        per = self.per
        return [(self.own(self.ty, q // per), self.own(self.tx, q % per), self.acc[q]) for q in range(per * per)]

    def shared_at(self, which: int, index) -> ir.Value:
        b = self.e.b
        return b.gep(self.shared[which], [ir.Constant(I32, 0), b.trunc(index, I32)])

    def write_back(self) -> None:
        """C[i, j] += this thread's sums, inside C."""
        for r, c, acc in self.outputs():
            self.add_to_c(r, c, lambda i, j, acc=acc: self.e.b.load(acc, typ=F32))

    def add_to_c(self, r, c, value) -> None:
        """C[i, j] += value(i, j) at the tile's row r and column c (i, j
        counted from the first row and column C has), inside C."""
        e, t = self.e, self.t
        b = e.b
        out = e.prog.arrays[t.st.array]
        i_it, j_it = t.grid_its[t.i], t.grid_its[t.j]
        i, j = b.add(self.r0, r), b.add(self.c0, c)
        write, after = e.fn.append_basic_block("tile.write"), e.fn.append_basic_block("tile.next")
        b.cbranch(b.and_(b.icmp_signed("<", i, self.m), b.icmp_signed("<", j, self.n)), write, after)
        b.position_at_end(write)
        ptr = e.address(out, t.st.index, {**self.env0, i_it: b.add(self.m_lo, i), j_it: b.add(self.n_lo, j)}, {})
        v = value(i, j)
        b = e.b
        b.store(b.fadd(b.load(ptr, typ=F32), v), ptr)
        b.branch(after)
        b.position_at_end(after)


class _MmaTileEmission(_TileEmission):
    """A tiled contraction on tensor cores at float32's precision (3xTF32):
    each factor is split into a TF32 part (its bits cut to TF32's) and the
    TF32 rest (x - big, rounded), and a product is big*big + big*small +
    small*big, the smaller terms first, summed in float32; only small*small
    (about 2**-20 relative) is dropped. An infinite or NaN factor makes NaN
    of every sum it takes part in; a thread with such a sum writes float32
    FMA sums instead, so that infinities and NaN come out as float32's
    (write_back). The block's 8 warps take 2 x 4 parts of its tile, each a grid
    of m16n8k8 mma.sync products; staged rows are padded by 8 elements so
    that a fragment's reads (rows 0-3 of k, 8 apart in m) take 32 banks.
    A factor staged with a warp's lanes along k (16 of them on one row of a
    16-deep slice) would then store four to a bank; its rows are swizzled
    in their aligned groups of 8 by a constant of each 4 k (slot).

    Plain factors (t.stages > 1) are copied from global to shared memory by
    cp.async, element by element into the same places, the next slice while
    the block multiplies this one: no registers hold them on the way.
    A warp multiplies a row of its tiles at a time, so that only that row's
    partial sums are live beside the tile's sums."""

    NAME, PAD = "mma", MMA_PAD
    MMA = "llvm.nvvm.mma.m16n8k8.row.col.tf32"

    def __init__(self, e: GpuEmitter, t: TiledContraction, bounds: list) -> None:
        super().__init__(e, t, bounds)
        self.swizzled = (self.a_along_k, self.b_along_k)
        self.flip = WARP // self.depth  # the swizzle's step for each 4 k (a warp stages 32 // depth rows at once)
        self.stage = _i64(0)  # the offset of the slice being multiplied in the shared arrays

    def k_loop(self) -> None:
        """Slices copied asynchronously, stages - 1 ahead of the one multiplied:
        a slice's wait and one barrier before it is multiplied (the barrier
        also tells that every warp is done with the stage copied into next)."""
        if self.t.stages == 1:
            return super().k_loop()
        e, depth, stages = self.e, self.depth, self.t.stages
        b = e.b
        for s in range(stages - 1):
            self.copy_slice(b.add(self.k_lo, _i64(s * depth)), _i64(s))
        e.strided_loop(self.k0, self.k_lo, self.k_hi, _i64(depth), "ktile", self.k_step_async)
        self.async_wait(0)
        e.barrier()

    def k_step_async(self) -> None:
        e, depth, stages = self.e, self.depth, self.t.stages
        b = e.b
        k0 = b.load(self.k0, typ=I64)
        n = b.udiv(b.sub(k0, self.k_lo), _i64(depth))
        self.async_wait(stages - 2)
        e.barrier()
        self.copy_slice(b.add(k0, _i64((stages - 1) * depth)), b.urem(b.add(n, _i64(stages - 1)), _i64(stages)))
        self.stage = b.mul(b.urem(n, _i64(stages)), _i64(depth * self.stride))
        self.multiply()

    def copy_slice(self, kv, stage) -> None:
        """Start copying the slice at kv into a stage (zeros past the edges), as one group."""
        e, t = self.e, self.t
        b, m = e.b, e.module
        copy = m.declare_intrinsic("llvm.nvvm.cp.async.ca.shared.global.4.s", (),
                                   ir.FunctionType(ir.VoidType(), [ir.PointerType(addrspace=3),
                                                                   ir.PointerType(addrspace=1), I32]))
        offset = b.mul(stage, _i64(self.depth * self.stride))
        i_it, j_it = t.grid_its[t.i], t.grid_its[t.j]
        for q in range(self.staged_n):
            for which, (x, kk) in enumerate(self.share(q)):
                first, lo, extent, it, factor = ((self.r0, self.m_lo, self.m, i_it, t.a) if which == 0 else
                                                 (self.c0, self.n_lo, self.n, j_it, t.b))
                xa, k = b.add(first, x), b.add(kv, kk)
                inside = b.and_(b.icmp_signed("<", xa, extent), b.icmp_signed("<", k, self.k_hi))
                arr = e.prog.arrays[factor.array]
                env = {**self.env0, it: b.add(lo, xa), **self.reduction_env(k)}
                src = b.select(inside, e.address(arr, factor.index, env, {}), e.base[arr.name])
                dst = self.shared_at(which, b.add(offset, self.slot(which, kk, x)))
                b.call(copy, [dst, b.addrspacecast(src, ir.PointerType(addrspace=1)),
                              b.select(inside, ir.Constant(I32, 4), ir.Constant(I32, 0))])
        b.call(m.declare_intrinsic("llvm.nvvm.cp.async.commit.group", (), ir.FunctionType(ir.VoidType(), [])), [])

    def async_wait(self, pending: int) -> None:
        """Wait until at most `pending` of this thread's copy groups are in flight."""
        m = self.e.module
        wait = m.declare_intrinsic("llvm.nvvm.cp.async.wait.group", (), ir.FunctionType(ir.VoidType(), [I32]))
        self.e.b.call(wait, [ir.Constant(I32, pending)])

    def threads(self) -> None:
        """This thread's warp's part of the tile (its first row and column), its
        place in the warp's fragments (g, tg), and slots for its sums."""
        b, side = self.e.b, self.side
        self.mt = self.nt = side // 32  # m16 (n8) products along a warp's rows (columns)
        warp, lane = b.lshr(self.lane, _i64(5)), b.and_(self.lane, _i64(WARP - 1))
        self.g, self.tg = b.lshr(lane, _i64(2)), b.and_(lane, _i64(3))
        self.wrow = b.mul(b.lshr(warp, _i64(2)), _i64(side // 2))
        self.wcol = b.mul(b.and_(warp, _i64(3)), _i64(side // 4))
        self.acc = [self.e.var(f"gpu.acc{q}", F32) for q in range(self.mt * self.nt * 4)]

    def swizzle(self, which: int, k4: int) -> int:
        """The swizzle of the rows (or columns) of factor which at k = 4 k4 .. 4 k4 + 3."""
        return k4 * self.flip if self.swizzled[which] else 0

    def slot(self, which: int, k, x) -> ir.Value:
        if not self.swizzled[which]:
            return super().slot(which, k, x)
        b = self.e.b
        return super().slot(which, k, b.xor(x, b.mul(b.lshr(k, _i64(2)), _i64(self.flip))))

    def write_back(self) -> None:
        """The tile's sums; where one of this thread's is NaN, float32 FMA
        sums in their place: a non-finite factor makes NaN of every sum it
        takes part in (its small part is NaN), and FMAs give what float32
        gives there (an infinite factor times a finite one stays infinite)."""
        e = self.e
        b = e.b
        nan = functools.reduce(b.or_, [b.fcmp_unordered("uno", v, v) for v in
                                       (b.load(acc, typ=F32) for _, _, acc in self.outputs())])
        fast, slow, done = (e.fn.append_basic_block(f"tile.{x}") for x in ("fast", "exact", "written"))
        b.cbranch(nan, slow, fast)
        b.position_at_end(fast)
        super().write_back()
        e.b.branch(done)
        e.b.position_at_end(slow)
        q = e.var("gpu.exact_q")
        per = self.nt * 4

        def one() -> None:
            b = e.b
            qv = b.load(q, typ=I64)
            self.add_to_c(*self.place(b.udiv(qv, _i64(per)), b.urem(b.udiv(qv, _i64(4)), _i64(self.nt)),
                                      b.urem(qv, _i64(4))), self.exact)
        e.strided_loop(q, _i64(0), _i64(self.mt * per), _i64(1), "exact.sums", one)
        e.b.branch(done)
        e.b.position_at_end(done)

    def exact(self, i, j) -> ir.Value:
        """Row i of A times column j of B, summed by float32 FMAs."""
        e, t = self.e, self.t
        total, k = e.var("gpu.exact", F32), e.var("gpu.exact_k")
        e.b.store(ir.Constant(F32, 0.0), total)
        i_it, j_it = t.grid_its[t.i], t.grid_its[t.j]

        def term() -> None:
            kv = e.b.load(k, typ=I64)
            x = self.element(t.a, {i_it: e.b.add(self.m_lo, i)}, kv)
            y = self.element(t.b, {j_it: e.b.add(self.n_lo, j)}, kv)
            e.b.store(e.call("llvm.fmuladd", [x, y, e.b.load(total, typ=F32)]), total)
        e.strided_loop(k, self.k_lo, self.k_hi, _i64(1), "exact", term)
        return e.b.load(total, typ=F32)

    def split(self, x) -> tuple:
        """x as TF32 operands (big, small). The tensor cores read a TF32
        operand's top 19 bits of 32, so x's own bits are its big part (cut,
        not rounded), and the rest x - big is rounded to nearest (ties away)
        by adding half of TF32's last place to its bits. Exact for finite x;
        the rest of an infinity or NaN is NaN (write_back)."""
        b = self.e.b
        bits = b.bitcast(x, I32)
        rest = b.fsub(x, b.bitcast(b.and_(bits, ir.Constant(I32, -8192)), F32))  # (TF32 lacks 13 bits)
        return bits, b.add(b.bitcast(rest, I32), ir.Constant(I32, 4096))

    def multiply(self) -> None:
        """The slice's products summed from zero, then added to the sums: an
        mma truncates its sum to float32 (it does not round), so a long chain
        of them drifts; this way its truncations are of the slice's sum."""
        e = self.e
        b, m, stride = e.b, e.module, self.stride
        mma = m.declare_intrinsic(self.MMA, (), ir.FunctionType(ir.LiteralStructType([F32] * 4), [I32] * 6 + [F32] * 4))
        tgs, g = b.add(b.mul(self.tg, _i64(stride)), self.stage), {}
        base = (b.add(tgs, self.wrow), b.add(tgs, self.wcol))

        def at(which: int, k: int, offset: int) -> ir.Value:  # element (k + tg, offset + g) of the warp's part
            c = self.swizzle(which, k // 4)  # (offsets are multiples of 8: the swizzle stays with g)
            if c not in g:
                g[c] = b.xor(self.g, _i64(c)) if c else self.g
            return b.add(b.add(base[which], g[c]), _i64(k * stride + offset))

        w = [[[self.split(b.load(self.shared_at(1, at(1, ks + dk, ni * 8)), typ=F32)) for dk in (0, 4)]
              for ni in range(self.nt)] for ks in range(0, self.depth, 8)]
        for mi in range(self.mt):  # a row of tiles at a time: its partial sums alone are live
            part = [ir.Constant(F32, 0.0)] * (self.nt * 4)
            for s, ks in enumerate(range(0, self.depth, 8)):
                a = [self.split(b.load(self.shared_at(0, at(0, ks + dk, mi * 16 + dr)), typ=F32))
                     for dr, dk in ((0, 0), (8, 0), (0, 4), (8, 4))]
                for ha, hb in ((1, 0), (0, 1), (0, 0)):  # small x big, big x small, big x big
                    for ni in range(self.nt):
                        r = b.call(mma, [*(x[ha] for x in a), *(x[hb] for x in w[s][ni]), *part[ni * 4:ni * 4 + 4]])
                        part[ni * 4:ni * 4 + 4] = [b.extract_value(r, x) for x in range(4)]
            for slot, v in zip(self.acc[mi * self.nt * 4:(mi + 1) * self.nt * 4], part):
                b.store(b.fadd(b.load(slot, typ=F32), v), slot)

    def outputs(self) -> list:
        return [(*self.place(_i64(q // (self.nt * 4)), _i64(q // 4 % self.nt), _i64(q % 4)), acc)
                for q, acc in enumerate(self.acc)]

    def place(self, mi, ni, x) -> tuple:
        """(row, column) in the tile of element x of this thread's part of product (mi, ni)."""
        b = self.e.b
        r = b.add(b.mul(mi, _i64(16)), b.mul(b.udiv(x, _i64(2)), _i64(8)))
        c = b.add(b.mul(ni, _i64(8)), b.urem(x, _i64(2)))
        return b.add(self.wrow, b.add(self.g, r)), b.add(self.wcol, b.add(b.mul(self.tg, _i64(2)), c))


def _i64(v: int) -> ir.Constant:
    return ir.Constant(I64, v)


def _to_bits(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """v's bits in an i64 (the width of a shared-memory slot)."""
    t = v.type
    if not isinstance(t, ir.IntType):
        v = b.bitcast(v, ir.IntType(32 if t == F32 else 64))
    return v if v.type.width == 64 else b.zext(v, I64)


def _from_bits(b: ir.IRBuilder, v: ir.Value, t) -> ir.Value:
    width = t.width if isinstance(t, ir.IntType) else (32 if t == F32 else 64)
    if width < 64:
        v = b.trunc(v, ir.IntType(width))
    return v if isinstance(t, ir.IntType) else b.bitcast(v, t)


def _ast_offset(e: isl.AstExpr, it: str) -> int | None:
    """k when the AST expression e is it + k."""
    if e.get_type() == isl.ast_expr_type.id:
        return 0 if e.get_id().get_name() == it else None
    if e.get_type() != isl.ast_expr_type.op or e.get_op_n_arg() != 2 \
            or e.get_op_type() not in (isl.ast_expr_op_type.add, isl.ast_expr_op_type.sub):
        return None
    x, k = e.get_op_arg(0), e.get_op_arg(1)
    if x.get_type() != isl.ast_expr_type.id or x.get_id().get_name() != it or k.get_type() != isl.ast_expr_type.int:
        return None
    k = k.get_val().to_python()
    return k if e.get_op_type() == isl.ast_expr_op_type.add else -k


ZEROING_KERNEL = "polyjit_zeroing"
ZEROING_ARRAYS = 32  # the arrays one launch of it zeroes


@functools.cache
def zeroing_kernel() -> str:
    """LLVM IR of ZEROING_KERNEL(p0, n0, ..., p31, n31), which sets n_k
    32-bit words at each p_k to zero (n_k 0: p_k is not touched), each array
    by a grid-stride loop over all the launch's threads: the arrays that
    several sums' atomic strips add into, zeroed in one launch where a
    memset each had cost a launch each (bench/NOTES.md)."""
    m = ir.Module(name=ZEROING_KERNEL)
    m.triple = TRIPLE
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [PTR, I64] * ZEROING_ARRAYS), ZEROING_KERNEL)
    fn.calling_convention = "ptx_kernel"
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    sreg = lambda r: b.zext(b.call(m.declare_intrinsic(_SREG + r, (), ir.FunctionType(I32, [])), []), I64)  # noqa: E731
    ntid = sreg("ntid.x")
    gid = b.add(b.mul(sreg("ctaid.x"), ntid), sreg("tid.x"))
    stride = b.mul(sreg("nctaid.x"), ntid)
    for k in range(ZEROING_ARRAYS):
        words, n = fn.args[2 * k], fn.args[2 * k + 1]
        start = b.block
        body, done = fn.append_basic_block(f"zero{k}"), fn.append_basic_block(f"zeroed{k}")
        b.cbranch(b.icmp_signed("<", gid, n), body, done)
        b.position_at_end(body)
        i = b.phi(I64)
        b.store(ir.Constant(I32, 0), b.gep(words, [i], source_etype=I32))
        following = b.add(i, stride)
        i.add_incoming(gid, start)
        i.add_incoming(following, body)
        b.cbranch(b.icmp_signed("<", following, n), body, done)
        b.position_at_end(done)
    b.ret_void()
    return str(m)


@functools.cache
def _nvptx_target():
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    return llvm.Target.from_triple(TRIPLE)


def ptx(ir_text: str, arch: str = DEFAULT_ARCH) -> tuple[str, str]:
    """(optimized LLVM IR, PTX) for a GPU of the given sm_XX."""
    from .cpu import LLVM_UNROLL_THRESHOLD, _lock, pipeline_options
    tm = _nvptx_target().create_target_machine(cpu=arch, opt=3)
    with _lock:
        pipeline_options(LLVM_UNROLL_THRESHOLD)  # (the CPU's kernels set others)
        mod = llvm.parse_assembly(ir_text)
        mod.verify()
        mod.triple = TRIPLE
        mod.data_layout = str(tm.target_data)
        pto = llvm.create_pipeline_tuning_options(speed_level=3)
        pto.loop_unrolling = True
        pb = llvm.create_pass_builder(tm, pto)
        pb.getModulePassManager().run(mod, pb)
        return str(mod), tm.emit_assembly(mod)
