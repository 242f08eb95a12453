"""The nvgpu target: one PTX ``.entry`` per kernel, from llvmlite's NVPTX backend.

The scheduler puts a nest's coincident loops outermost and marks each; here
those loops collapse into one index space that a grid-stride loop shares
among all threads of the launch (consecutive threads take consecutive
iterations of the innermost parallel loop, so accesses along it coalesce).
What runs for each iteration takes the first form that fits (each checked
from the AST and the statements' accesses):

- a warp, or a block for long static rows, whose lanes share the inner
  loops, reductions combined with warp shuffles and shared memory
  (:class:`_WarpPlan`);
- strips of a sequential loop that carries values only through buffers
  private to the thread, each strip recomputing its halo (a stencil);
- strips of a loop that only sums, added with atomics (a column sum; a
  sum of everything, which has no parallel loop, too);
- a block per tile of a float32 contraction, its operands staged in shared
  memory (:class:`_Tiles`);
- one thread, running the inner loops in order.

A kernel with none of these runs on one thread.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import islpy as isl
import llvmlite.binding as llvm
from llvmlite import ir

from .. import scalar
from ..dtypes import DataType
from ..schedule import ast_nodes, statements_in
from ..errors import UnsupportedOpError
from ..expr import Const, Load, Op, Var, loads, walk
from . import mathlib
from .llvm import (COMPUTE, F32, F64, I32, I64, PTR, STORAGE, Emitter, KernelInfo, Strips, ast_calls, ast_children,
                   ast_uses, static_extent)

TRIPLE = "nvptx64-nvidia-cuda"
DEFAULT_ARCH = "sm_90"
WARP = 32
BLOCK = 256  # threads per block (polyjit.cuda launches this many)
BLOCK_ROW = 4096  # rows at least this long get a block of lanes rather than a warp
UNROLL = 4  # copies of a lane loop's body per trip
VECTOR = 4  # consecutive iterations of an elementwise loop per group (16 bytes of float32)
VECTOR_UNROLL = 2  # groups per trip of a grid loop (a lane loop takes one)
ROW_GROUPS = 8  # a lane loop of at most this many groups per lane is unrolled whole
TILE, KTILE = 64, 16  # a contraction's output tile per block, and its reduction slice in shared memory
BIG_TILE = 128  # the tile of long products
STRIP_REDUCE = 256  # iterations of a summing loop per thread before its atomic add
THREAD_STRIP = 64  # iterations of a sequential loop per thread when strips run in parallel
THREADS_PER_MULTIPROCESSOR = 2048  # resident threads (sm_70 to sm_90)
DEFAULT_MULTIPROCESSORS = 132  # where no GPU says (PTX for gpu_arch): an H100's
_SREG = "llvm.nvvm.read.ptx.sreg."
_GPU_INTRINSIC = {"sqrt": "llvm.sqrt", "floor": "llvm.floor", "ceil": "llvm.ceil", "round": "llvm.roundeven",
                  "abs": "llvm.fabs", "maximum": "llvm.maximum", "minimum": "llvm.minimum"}


class GpuEmitter(Emitter):
    triple = TRIPLE

    def kernel(self, k: int, node: isl.AstNode) -> None:
        """``ptx_kernel void name(ptr buffers..., i64 ints...)``; the body gets
        the thread's global index as its part and the thread count as parts.
        A library statement (which runs alone) is no kernel: a step that
        polyjit.cuda runs through cuBLAS."""
        names = statements_in(node)
        called = [self.stmts[n] for n in names if self.stmts[n].library is not None]
        if called:
            self.kernels.append(KernelInfo(self.kernel_name(k, names), False, tuple(sorted(names)),
                                           library=called[0]))
            return
        names, name, body_fn = self.body_function(k, node)
        nb, ni = len(self.buffer_arrays), len(self.int_slots)
        body_fn.attributes.add("alwaysinline")
        self.top = _parallel_top(node)
        self.sum_root = self.top is None and self.atomic_plan(node, set()) is not None  # a sum of everything
        self.lanes = 0
        self.zeroed, self.strips = (), False
        self.claims, self.deferred, self.row_vectors, self.row_offsets = None, None, {}, {}
        self.ring = None
        self.written = {st.array for st in self.prog.statements}
        self.body(body_fn, node)
        fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [PTR] * nb + [I64] * ni), name)
        fn.calling_convention = "ptx_kernel"
        for arg in fn.args[:nb]:
            arg.add_attribute("noalias")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        sreg = lambda r: b.zext(b.call(self.module.declare_intrinsic(  # noqa: E731
            _SREG + r, (), ir.FunctionType(I32, [])), []), I64)
        ntid = sreg("ntid.x")
        gid = b.add(b.mul(sreg("ctaid.x"), ntid), sreg("tid.x"))
        b.call(body_fn, list(fn.args) + [gid, b.mul(sreg("nctaid.x"), ntid)])
        b.ret_void()
        self.kernels.append(KernelInfo(name, self.parallel, tuple(sorted(names)), self.lanes, self.zeroed,
                                        self.strips))

    def node(self, n: isl.AstNode) -> None:
        if self.sum_root and not self.in_parallel:  # a sum of everything: strips of it in parallel
            self.in_parallel = self.parallel = True
            self.grid_loop(None, n)
            return
        if n.get_type() == isl.ast_node_type.mark and n.mark_get_id().get_name().startswith("parallel:"):
            if n.mark_get_id().get_name() == self.top and not self.in_parallel:
                self.in_parallel = self.parallel = True
                self.grid_loop(n)
            else:  # a parallel loop inside a sequential one runs in order
                self.node(n.mark_get_node())
            return
        super().node(n)

    def grid_loop(self, mark: isl.AstNode | None, rest: isl.AstNode | None = None) -> None:
        """The chain of marked loops under mark as one collapsed loop, its
        iterations dealt out to threads: thread t runs t, t + parts, ...
        Without a mark, rest is a whole sum whose strips are the grid."""
        loops, seen = [], set()
        rest = mark if mark is not None else rest
        while rest.get_type() == isl.ast_node_type.mark and rest.mark_get_id().get_name().startswith("parallel:"):
            want = rest.mark_get_id().get_name()[len("parallel:"):]
            child = rest.mark_get_node()
            if child.get_type() == isl.ast_node_type.for_:
                if child.for_get_iterator().get_id().get_name() != want or not self.splittable(child) \
                        or ast_uses(child.for_get_init(), seen) or ast_uses(child.for_get_cond(), seen):
                    rest = child
                    break
                loops.append(child)
                seen.add(want)
                rest = child.for_get_body()
            else:
                rest = child
        b = self.b
        one, zero = ir.Constant(I64, 1), ir.Constant(I64, 0)
        bounds, total = [], one
        for loop in loops:
            lo, inc, hi = self.loop_range(loop)
            trips = self.trip_count(lo, inc, hi)
            bounds.append((loop.for_get_iterator().get_id().get_name(), lo, inc, trips))
            total = b.mul(total, trips)
        tiles = _Tiles.of(self, loops, rest)
        if tiles is not None:
            self.tiled_contraction(tiles, [b_[1:] for b_ in bounds])
            return
        plan = _WarpPlan.of(self, rest, [it for it, *_ in bounds]) if bounds else None
        strip = None
        if plan is None:
            strip = self.strip_plan(rest, seen, THREAD_STRIP, bounded=True)
            if strip is None and not self.fills_device(loops):
                strip = self.atomic_plan(rest, seen)
        if strip is not None:  # strips of the sequential loop become a parallel dimension
            strip_range = self.loop_range(strip.loop)
            strips = self.trip_count(zero, one, self.trip_count(*strip_range), strip.size)
            bounds.insert(0, ("gpu.strip", zero, one, strips))
            total = b.mul(total, strips)
        first, step = self.part, self.parts
        if plan is not None:  # a warp (or block) per iteration: its lanes share the inner loops
            self.lanes = plan.lanes
            shift = ir.Constant(I64, plan.lanes.bit_length() - 1)
            first, step = b.lshr(first, shift), b.lshr(step, shift)
            self.lane = b.and_(self.part, ir.Constant(I64, plan.lanes - 1))
        g = self.var("gpu.g")
        inner: dict = {}

        def iteration(copy: int | None = None) -> None:
            """Iteration g; in a vector group, copy c > 0 is copy 0's with the
            innermost iterator c further on (the group lies within one row)."""
            b = self.b
            self.claims = vector.claims if copy == 0 else None
            if copy:
                b.store(b.add(inner["first"], ir.Constant(I64, copy)), self.var(bounds[-1][0]))
            else:
                rem = b.load(g, typ=I64)
                for k, (it, first_it, inc, trips) in enumerate(reversed(bounds)):
                    idx = rem if k == len(bounds) - 1 else b.urem(rem, trips)
                    if k < len(bounds) - 1:
                        rem = b.udiv(rem, trips)
                    b.store(b.add(first_it, b.mul(idx, inc)), self.var(it))
                    if k == 0:
                        inner["first"] = b.load(self.var(it), typ=I64)
            if plan is not None:
                self.row(plan)
            elif strip is not None and strip.zeroed is not None:
                self.atomic_loop(strip, *strip_range)
            elif strip is not None:
                self.strip_loop(strip, *strip_range)
            else:
                self.node(rest)
            self.claims = None

        # straight-line bodies (elementwise code) take several iterations per
        # trip, their stores after all their loads, so that each thread has
        # several loads in flight; where the accesses move along the innermost
        # loop and the arrays are aligned (checked here, at run time), groups of
        # VECTOR consecutive iterations, which LLVM turns into vector accesses
        vector = None
        if plan is None and strip is None and not _has_loop(rest):
            defer = self.deferrable(rest)
            vector = self.vector_plan(rest, loops[-1], seen) if loops else None
            width = ir.Constant(I64, VECTOR)
            grouped = lambda: self.strided_loop(  # noqa: E731
                g, b.mul(first, width), total, b.mul(step, width), "vector",
                lambda: [iteration(c) for c in range(VECTOR)], VECTOR_UNROLL, defer)
            aligned = self.vector_check(vector, *bounds[-1][:2], bounds[-1][3]) if vector is not None else None
            self.vector_branch(aligned, grouped,
                               lambda: self.strided_loop(g, first, total, step, "grid", iteration, UNROLL, defer))
            return
        self.strided_loop(g, first, total, step, "grid", iteration)

    def fills_device(self, loops: list[isl.AstNode]) -> bool:
        """Whether the grid loops alone have an iteration for a quarter of the
        threads the device holds at once: then a sum stays whole in each thread, where
        strips added atomically would only contend (MobileNetV3-small's
        convolutions, 32x96x7x7 outputs and more, each summed by one atomic
        add per input channel, took most of its 455 ms)."""
        extents = [static_extent(loop) for loop in loops]
        if not loops or None in extents:
            return False
        threads = (self.multiprocessors or DEFAULT_MULTIPROCESSORS) * THREADS_PER_MULTIPROCESSOR
        return math.prod(extents) * 4 >= threads

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

    def vector_plan(self, rest: isl.AstNode, inner: isl.AstNode, unset: set[str]) -> "_Vector | None":
        """The accesses of rest's statements whose last index moves with
        inner's iterator (and no other index does), from a start known before
        the loop (free of the iterators in unset): in a group of VECTOR
        iterations these are consecutive, and with VECTOR-aligned rows and
        start the first one is aligned to the group's width."""
        if inner.for_get_inc().get_val().to_python() != 1:
            return None
        it = inner.for_get_iterator().get_id().get_name()
        out = _Vector()
        for node in _users(rest):
            call = node.user_get_expr()
            st = self.stmts[call.get_op_arg(0).get_id().get_name()]
            args = [call.get_op_arg(i + 1) for i in range(len(st.iters))]
            along = [(x, a) for x, a in zip(st.iters, args) if _steps_with(a, it)]
            if len(along) != 1 or sum(ast_uses(a, {it}) for a in args) != 1:
                continue
            along, start = along[0]
            if ast_uses(start, unset - {it}):
                continue
            for name, index in [(ld.array, ld.index) for ld in loads(st.body)] + [(st.array, st.index)]:
                arr = self.prog.arrays[name]
                last = index[-1] if index else None
                if name in self.sched.contracted or arr.strided or not isinstance(last, Var) \
                        or last.kind != "iter" or last.name != along or _depends(index[:-1], {along}):
                    continue
                align = min(16, VECTOR * arr.dtype.itemsize)
                out.claims[id(index)] = align
                out.arrays[name] = max(out.arrays.get(name, 1), align)
                out.starts[start.to_C_str()] = start
        return out if out.claims else None

    def vector_check(self, vector: "_Vector", it: str, first, trips) -> ir.Value:
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

    def deferrable(self, rest: isl.AstNode) -> bool:
        """Whether rest's stores may wait until the end of a trip: straight-line
        statements that read none of the arrays they write."""
        calls = ast_calls(rest)
        if not calls:
            return False
        stmts = [self.stmts[c.get_op_arg(0).get_id().get_name()] for c in calls]
        written = {st.array for st in stmts}
        return all(st.combine is None and not any(ld.array in written for ld in loads(st.body)) for st in stmts)

    # ------------------------------------------------------------ loops
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
            self.deferred = [] if defer else None
            for _ in range(copies):
                body()
                b = self.b
                b.store(b.add(b.load(slot, typ=I64), step), slot)
            self.flush_stores()
            b.branch(head)
            b.position_at_end(done)

    # ------------------------------------------------------------ strips
    def atomic_plan(self, rest: isl.AstNode, grid_iters: set[str]) -> "Strips | None":
        """Strips of a sum when rest zeroes some arrays and then one loop (or
        perfect nest) sums into elements that do not move with it (a column
        sum): strips run in parallel, each adding its partial sums
        atomically; the runtime zeroes the arrays before the launch."""
        kids = ast_children(rest)
        if not kids or kids[-1].get_type() != isl.ast_node_type.for_:
            return None
        loop, inits = kids[-1], kids[:-1]
        if not self._free(loop, grid_iters):
            return None
        calls = ast_children(loop.for_get_body())
        nest = [loop.for_get_iterator().get_id().get_name()]
        while calls and len(calls) == 1 and calls[0].get_type() == isl.ast_node_type.for_:
            nest.append(calls[0].for_get_iterator().get_id().get_name())  # a perfect nest: each
            calls = ast_children(calls[0].for_get_body())  # thread takes one outer iteration
        if not calls or any(c.get_type() != isl.ast_node_type.user for c in calls):
            return None
        targets = set()
        for c in calls:
            call = c.user_get_expr()
            st = self.stmts[call.get_op_arg(0).get_id().get_name()]
            dt = self.prog.arrays[st.array].dtype
            if st.combine != "sum" or st.array in self.sched.contracted \
                    or any(any(self._write_moves(loop, st, x)) for x in nest) \
                    or dt not in (DataType.Float, DataType.Double, DataType.Int32, DataType.Int):
                return None
            targets.add(st.array)
        zeroed = set()
        for k in inits:
            if k.get_type() != isl.ast_node_type.user:
                return None
            st = self.stmts[k.user_get_expr().get_op_arg(0).get_id().get_name()]
            if st.array not in targets or not isinstance(st.body, Const) or st.body.value != 0:
                return None
            zeroed.add(st.array)
        if not zeroed <= targets or any(ld.array in targets for c in calls for ld in loads(
                self.stmts[c.user_get_expr().get_op_arg(0).get_id().get_name()].body)):
            return None
        return Strips(loop, STRIP_REDUCE if len(nest) == 1 else 1, 0, tuple(sorted(zeroed)),
                       [c.user_get_expr() for c in calls])

    def atomic_loop(self, strip: "Strips", lo, inc, hi) -> None:
        """This thread's strip of a summing loop into registers, then one
        atomic add per target element."""
        b = self.b
        self.zeroed, self.strips = strip.zeroed, True
        loop = strip.loop
        size = ir.Constant(I64, strip.size)
        start = b.add(lo, b.mul(b.load(self.var("gpu.strip"), typ=I64), b.mul(inc, size)))
        end = b.add(start, b.mul(inc, size))
        end = b.select(b.icmp_signed("<", end, hi), end, hi)
        sums = [self.stmts[c.get_op_arg(0).get_id().get_name()] for c in strip.calls]
        self.start_partials(sums)
        self.strided_loop(self.var(loop.for_get_iterator().get_id().get_name()), start, end, inc, "sum",
                          lambda: self.node(loop.for_get_body()))
        partials, self.partials = self.partials, {}
        for st in sums:
            slot, call = partials[st.name]
            arr = self.prog.arrays[st.array]
            ptr = self.reduction_address(st, call)
            self.b.atomic_rmw("fadd" if arr.dtype.is_float else "add", ptr,
                              self.b.load(slot, typ=COMPUTE[arr.dtype]), "monotonic")

    def start_partials(self, stmts) -> None:
        """A register per reduction statement, set to its identity; statement()
        accumulates there while the loop runs."""
        self.partials = {}
        for st in stmts:
            dt = self.prog.arrays[st.array].dtype
            slot = self.var("partial." + st.name, COMPUTE[dt])
            self.b.store(self.constant(scalar.identity(st.combine, dt), dt), slot)
            self.partials[st.name] = (slot, None)

    def reduction_address(self, st, call: isl.AstExpr) -> ir.Value:
        """Where a reduction statement's call writes; its index does not
        depend on the loop being reduced, so it is known after the loop."""
        used = {x for i in st.index for x in _vars(i)}
        env = {x: self.aexpr(call.get_op_arg(i + 1)) for i, x in enumerate(st.iters) if x in used}
        return self.address(self.prog.arrays[st.array], st.index, env, {})

    def strip_loop(self, strip: "Strips", lo, inc, hi) -> None:
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
                self.ring = (it, begin, ring, c)
                body()
                self.ring = None
                self.b.branch(after)
                self.b.position_at_end(after)
        self.range_loop(trip, begin, end, ir.Constant(I64, ring), copies)

    def private_index(self, arr, d: int, e, v, modulus: int) -> ir.Value:
        """In a ring loop, a rolling row's slot is (row - begin) mod ring: a
        constant where the index is the loop's iterator plus a constant."""
        if self.ring is None or modulus != self.ring[2]:
            return super().private_index(arr, d, e, v, modulus)
        it, begin, ring, copy = self.ring
        offset = self._ring_offset(e, it)
        if offset is not None:
            return ir.Constant(I64, (copy + offset) % ring)
        m = ir.Constant(I64, ring)
        return self.b.urem(self.b.add(self.b.sub(v, begin), m), m)

    def _ring_offset(self, e, it: str) -> int | None:
        """k when index e of the current statement is the AST iterator it plus k."""
        k = 0
        if isinstance(e, Op) and e.op in ("add", "sub") and isinstance(e.args[1], Const):
            k = int(e.args[1].value) * (1 if e.op == "add" else -1)
            e = e.args[0]
        if not (isinstance(e, Var) and e.kind == "iter"):
            return None
        call = self.current_call
        st = self.stmts[call.get_op_arg(0).get_id().get_name()]
        arg = call.get_op_arg(st.iters.index(e.name) + 1)
        shift = _ast_offset(arg, it)
        return None if shift is None else shift + k

    # ------------------------------------------------------ contractions
    tile_sizes: tuple[int, ...] | None = None  # compile_options' (tile, ktile) for contractions
    multiprocessors: int | None = None  # of the GPU in use, when one is

    def contraction_tiles(self, t: "_Tiles") -> tuple[int, int]:
        """(tile, ktile): as the options say, else 128 x 128 tiles (half the
        shared-memory reads per multiply-add) where i and j are both that long
        and there are tiles for every multiprocessor, else 64 x 64 (measured on
        the H100: matmul 2048^3 30 against 20 TFLOP/s, 1024^3 12 against 17)."""
        if self.tile_sizes:
            return self.tile_sizes[0], (self.tile_sizes[1:] or (KTILE,))[0]
        if self.multiprocessors and None not in t.extents:
            m, n = t.extents[t.i], t.extents[t.j]
            batch = math.prod(x for q, x in enumerate(t.extents) if q not in (t.i, t.j))
            count = -(-m // BIG_TILE) * -(-n // BIG_TILE) * batch
            if m >= BIG_TILE and n >= BIG_TILE and count >= self.multiprocessors:
                return BIG_TILE, KTILE
        return TILE, KTILE

    def tiled_contraction(self, t: "_Tiles", bounds) -> None:
        """C[i, j] += A[i, k] * B[k, j] with a block per tile x tile tile of C:
        the block stages ktile-wide slices of A and B in shared memory; its
        16 x 16 threads each accumulate tile/16 x tile/16 outputs in registers,
        in groups of four rows (and columns) 64 apart, so that a warp's
        vector reads of shared memory do not collide in its banks."""
        b = self.b
        self.lanes = BLOCK
        i64 = lambda v: ir.Constant(I64, v)  # noqa: E731
        m_lo, _, m = bounds[t.i]
        n_lo, _, n = bounds[t.j]
        batch = [(it, bd) for q, (it, bd) in enumerate(zip(t.grid_its, bounds)) if q not in (t.i, t.j)]
        side, depth = self.contraction_tiles(t)
        staged_n = side * depth // BLOCK  # elements of each slice a thread stages
        per = side // 16  # outputs per thread along each side
        group = min(per, 4)  # consecutive ones

        def own(x, q: int):
            """Row (or column) q of those this thread (x = ty or tx) accumulates."""
            return self.b.add(self.b.mul(x, i64(group)), i64((q // group) * 16 * group + q % group))
        i_it, j_it = t.grid_its[t.i], t.grid_its[t.j]
        red = []  # per reduction loop: (iterator, first, extent); k runs over their product
        k_hi = i64(1)
        for it, loop in zip(t.red_its, t.reds):
            lo, _, hi = self.loop_range(loop)
            extent = b.sub(hi, lo)
            red.append((it, lo, extent))
            k_hi = b.mul(k_hi, extent)
        k_lo = i64(0)
        lane = b.and_(self.part, i64(BLOCK - 1))
        ty, tx = b.udiv(lane, i64(16)), b.urem(lane, i64(16))
        tiles_n = b.udiv(b.add(n, i64(side - 1)), i64(side))
        tiles = b.mul(b.udiv(b.add(m, i64(side - 1)), i64(side)), tiles_n)
        total = tiles
        for _, (_, _, trips) in batch:  # the other parallel loops: a batch of products
            total = b.mul(total, trips)
        shared = [self.shared_array(f"polyjit_tile_{x}{side}x{depth}", F32, depth * side, 16) for x in "ab"]
        acc = [self.var(f"gpu.acc{q}", F32) for q in range(per * per)]
        staged = [[self.var(f"gpu.staged{x}{q}", F32) for q in range(staged_n)] for x in "ab"]
        # plain factors read the next slice while the block computes on this one; computed
        # factors (a convolution's guarded input) would hold too many registers meanwhile
        prefetch = isinstance(t.a, Load) and isinstance(t.b, Load)
        innermost_red = t.red_its[-1]
        # A walks memory along k unless it is a plain load whose last index is i (A.T @ B);
        # B along j unless it is a plain load whose last index is k (x @ W.T)
        a_along_k = not (isinstance(t.a, Load) and getattr(t.a.index[-1], "name", None) == t.grid_its[t.i])
        b_along_k = isinstance(t.b, Load) and getattr(t.b.index[-1], "name", None) == innermost_red
        tile, k0 = self.var("gpu.tile"), self.var("gpu.k0")
        env0: dict = {}

        def reduction_env(k) -> dict:
            b = self.b
            env = {}
            for it, lo, extent in reversed(red):
                env[it] = b.add(lo, b.urem(k, extent)) if len(red) > 1 else b.add(lo, k)
                k = b.udiv(k, extent)
            return env

        def element(x, fixed: dict, k) -> ir.Value:
            return self.value(x, {**env0, **fixed, **reduction_env(k)}, {})

        def one_tile() -> None:
            b = self.b
            tv = b.load(tile, typ=I64)
            if batch:  # tile index = (batch..., tile of C)
                rest = b.udiv(tv, tiles)
                for it, (lo, _, trips) in reversed(batch):
                    env0[it] = b.add(lo, b.urem(rest, trips))
                    rest = b.udiv(rest, trips)
                tv = b.urem(tv, tiles)
            r0, c0 = b.mul(b.udiv(tv, tiles_n), i64(side)), b.mul(b.urem(tv, tiles_n), i64(side))
            for slot in acc:
                b.store(ir.Constant(F32, 0.0), slot)

            def share(q: int) -> tuple:
                """Element q of this thread's share of a slice: A's (row, k) and B's
                (column, k), consecutive lanes taking consecutive elements of the
                dimension each factor holds contiguously, so that reads coalesce."""
                b = self.b
                e = b.add(lane, i64(q * BLOCK))
                along_k = (b.udiv(e, i64(depth)), b.urem(e, i64(depth)))
                along_side = (b.urem(e, i64(side)), b.udiv(e, i64(side)))
                return along_k if a_along_k else along_side, along_k if b_along_k else along_side

            def fetch(kv, q: int) -> None:
                """Read element q of this thread's share of the slice of A[rows, kv ..]
                and B[kv .., columns] into registers (zeros past the edges)."""
                b = self.b
                (r, ka), (c, kb) = share(q)
                self._fetch(staged[0][q], b.add(r0, r), m, b.add(kv, ka), k_hi,
                            lambda x, k: element(t.a, {i_it: b.add(m_lo, x)}, k))
                self._fetch(staged[1][q], b.add(c0, c), n, b.add(kv, kb), k_hi,
                            lambda x, k: element(t.b, {j_it: b.add(n_lo, x)}, k))

            def k_step() -> None:
                for q in range(staged_n):
                    if not prefetch:
                        fetch(self.b.load(k0, typ=I64), q)
                    b = self.b
                    (r, ka), (c, kb) = share(q)
                    b.store(b.load(staged[0][q], typ=F32), self._shared_at(shared[0], b.add(b.mul(ka, i64(side)), r)))
                    b.store(b.load(staged[1][q], typ=F32), self._shared_at(shared[1], b.add(b.mul(kb, i64(side)), c)))
                self.barrier()
                for q in range(staged_n if prefetch else 0):
                    fetch(self.b.add(self.b.load(k0, typ=I64), i64(depth)), q)
                b = self.b
                sums = [b.load(slot, typ=F32) for slot in acc]
                for kk in range(depth):
                    a = [b.load(self._shared_at(shared[0], b.add(i64(kk * side), own(ty, q))), typ=F32) for q in range(per)]
                    w = [b.load(self._shared_at(shared[1], b.add(i64(kk * side), own(tx, q))), typ=F32) for q in range(per)]
                    sums = [self.call("llvm.fmuladd", [a[q // per], w[q % per], sums[q]]) for q in range(per * per)]
                for slot, v in zip(acc, sums):
                    b.store(v, slot)
                self.barrier()
            for q in range(staged_n if prefetch else 0):
                fetch(k_lo, q)
            self.strided_loop(k0, k_lo, k_hi, i64(depth), "ktile", k_step)
            b = self.b
            out = self.prog.arrays[t.st.array]
            for q in range(per * per):
                i, j = b.add(r0, own(ty, q // per)), b.add(c0, own(tx, q % per))
                write, after = self.fn.append_basic_block("tile.write"), self.fn.append_basic_block("tile.next")
                b.cbranch(b.and_(b.icmp_signed("<", i, m), b.icmp_signed("<", j, n)), write, after)
                b.position_at_end(write)
                ptr = self.address(out, t.st.index, {**env0, i_it: b.add(m_lo, i), j_it: b.add(n_lo, j)}, {})
                b.store(b.fadd(b.load(ptr, typ=F32), b.load(acc[q], typ=F32)), ptr)
                b.branch(after)
                b.position_at_end(after)
        shift = i64(BLOCK.bit_length() - 1)
        self.strided_loop(tile, b.lshr(self.part, shift), total, b.lshr(self.parts, shift), "tiles", one_tile)

    def _fetch(self, slot, x, extent, k, k_end, read) -> None:
        """slot = read(x, k) where x < extent and k < k_end, else 0."""
        b = self.b
        b.store(ir.Constant(F32, 0.0), slot)
        inside = b.and_(b.icmp_signed("<", x, extent), b.icmp_signed("<", k, k_end))
        then, after = self.fn.append_basic_block("stage.read"), self.fn.append_basic_block("stage.next")
        b.cbranch(inside, then, after)
        b.position_at_end(then)
        b.store(read(x, k), slot)
        b.branch(after)
        b.position_at_end(after)

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

    def _shared_at(self, g, index) -> ir.Value:
        return self.b.gep(g, [ir.Constant(I32, 0), self.b.trunc(index, I32)])

    def barrier(self) -> None:
        """Wait for the whole block (bar.sync 0)."""
        fn = self.module.declare_intrinsic("llvm.nvvm.barrier0", (), ir.FunctionType(ir.VoidType(), []))
        self.b.call(fn, [])

    # ------------------------------------------------------------- warps
    def warp_sync(self) -> None:
        """Order the memory accesses of the lanes sharing an iteration."""
        if self.lanes > WARP:
            self.barrier()
            return
        fn = self.module.declare_intrinsic("llvm.nvvm.bar.warp.sync", (), ir.FunctionType(ir.VoidType(), [I32]))
        self.b.call(fn, [ir.Constant(I32, -1)])

    def across_warps(self, total, how: str, dt) -> ir.Value:
        """Combine one value per warp of the block through shared memory."""
        b = self.b
        shared = self.shared_array("polyjit_partials", I64, BLOCK // WARP)
        zero32 = ir.Constant(I32, 0)
        warp = b.trunc(b.lshr(self.lane, ir.Constant(I64, 5)), I32)
        first = b.icmp_unsigned("==", b.and_(self.lane, ir.Constant(I64, WARP - 1)), ir.Constant(I64, 0))
        write = self.fn.append_basic_block("partials.write")
        after = self.fn.append_basic_block("partials.read")
        b.cbranch(first, write, after)
        b.position_at_end(write)
        b.store(self.to_bits(total), b.gep(shared, [zero32, warp]))
        b.branch(after)
        b.position_at_end(after)
        self.warp_sync()
        out = None
        for w in range(self.lanes // WARP):
            v = self.from_bits(b.load(b.gep(shared, [zero32, ir.Constant(I32, w)]), typ=I64), total.type)
            out = v if out is None else self.combine(how, out, v, dt)
        self.warp_sync()
        return out

    def row(self, plan: "_WarpPlan") -> None:
        """One iteration for a warp (or block): its statements and the loops
        its lanes share. Where one check at the row's start finds every lane
        loop's accesses aligned, all of them take 16-byte groups, so that
        loads of the same element in several loops are one load."""
        vectors = {}
        aligned = None
        for loop in plan.children:
            if loop.get_type() == isl.ast_node_type.for_:
                vector = self.vector_plan(loop.for_get_body(), loop, set())
                if vector is not None:
                    vectors[id(loop)] = vector
                    lo, _, hi = self.loop_range(loop)
                    ok = self.vector_check(vector, loop.for_get_iterator().get_id().get_name(), lo,
                                           self.b.sub(hi, lo))
                    aligned = ok if aligned is None else self.b.and_(aligned, ok)

        def emit(grouped: bool) -> None:
            self.row_vectors = vectors if grouped else {}
            self.row_offsets = {}
            for child in plan.children:
                if child.get_type() == isl.ast_node_type.for_:
                    self.lane_loop(child, plan)
                else:
                    self.statement(child.user_get_expr(), shared=True)
                self.warp_sync()
            self.row_vectors = {}
        self.vector_branch(aligned, lambda: emit(True), lambda: emit(False))

    def lane_loop(self, loop: isl.AstNode, plan: "_WarpPlan") -> None:
        """An inner loop whose iterations the lanes share (lane, lane + 32, ...);
        reductions gather in a register per lane, then across the warp."""
        b = self.b
        it = loop.for_get_iterator().get_id().get_name()
        lo, inc, hi = self.loop_range(loop)
        for call in plan.hoisted[id(loop)]:
            self.statement(call, shared=True)
        if plan.hoisted[id(loop)]:
            self.warp_sync()
        self.skipped = {c.get_op_arg(0).get_id().get_name() for c in plan.hoisted[id(loop)]}
        self.start_partials([self.stmts[name] for name in plan.reductions[id(loop)]])
        body = loop.for_get_body()
        lanes, width = ir.Constant(I64, self.lanes), ir.Constant(I64, VECTOR)
        vector = self.row_vectors.get(id(loop))
        defer = self.deferrable(body)
        group = self.var(it + ".group")

        def copies() -> None:  # VECTOR consecutive iterations from the group's first
            first = self.b.load(group, typ=I64)
            for c in range(VECTOR):
                self.claims = vector.claims if c == 0 else None
                self.b.store(self.b.add(first, ir.Constant(I64, c)), self.var(it))
                self.node(body)
            self.claims = None
        trips = _static_trips(loop)
        groups = trips // (self.lanes * VECTOR) if trips and trips % (self.lanes * VECTOR) == 0 else 0
        if vector is None:
            self.strided_loop(self.var(it), b.add(lo, b.mul(self.lane, inc)), hi, b.mul(inc, lanes),
                              "lanes", lambda: self.node(body), UNROLL, defer)
        elif 0 < groups <= ROW_GROUPS:  # unrolled whole: a row read again comes from registers
            self.deferred = [] if defer else None
            for k in range(groups):
                for c in range(VECTOR):
                    # the same offset value in every loop of the row, so that after
                    # folding each loop's start the addresses, then the loads, are one
                    key = (k, c)
                    if key not in self.row_offsets:
                        self.row_offsets[key] = b.add(b.mul(self.lane, width),
                                                      ir.Constant(I64, k * self.lanes * VECTOR + c))
                    self.claims = vector.claims if c == 0 else None
                    self.b.store(self.b.add(lo, self.row_offsets[key]), self.var(it))
                    self.node(body)
                self.claims = None
            self.flush_stores()
        else:
            self.strided_loop(group, b.add(lo, b.mul(self.lane, width)), hi, b.mul(lanes, width),
                              "lanes.vector", copies, 1, defer)
        self.skipped = set()
        b = self.b
        partials, self.partials = self.partials, {}
        for name, (slot, call) in partials.items():
            s = self.stmts[name]
            arr = self.prog.arrays[s.array]
            total = b.load(slot, typ=COMPUTE[arr.dtype])
            for offset in (16, 8, 4, 2, 1):
                total = self.combine(s.combine, total, self.shuffle(total, offset), arr.dtype)
            if self.lanes > WARP:
                total = self.across_warps(total, s.combine, arr.dtype)
            ptr = self.reduction_address(s, call)
            old = self.from_storage(b.load(ptr, typ=STORAGE[arr.dtype]), arr.dtype)
            self.warp_sync()
            b.store(self.to_storage(self.combine(s.combine, old, total, arr.dtype), arr.dtype), ptr)

    def to_bits(self, v: ir.Value) -> ir.Value:
        """v's bits in an i64 (the width of a shared-memory slot)."""
        b, t = self.b, v.type
        if not isinstance(t, ir.IntType):
            v = b.bitcast(v, ir.IntType(32 if t == F32 else 64))
        return v if v.type.width == 64 else b.zext(v, I64)

    def from_bits(self, v: ir.Value, t) -> ir.Value:
        b = self.b
        width = t.width if isinstance(t, ir.IntType) else (32 if t == F32 else 64)
        if width < 64:
            v = b.trunc(v, ir.IntType(width))
        return v if isinstance(t, ir.IntType) else b.bitcast(v, t)

    def shuffle(self, v: ir.Value, offset: int) -> ir.Value:
        """The value lane ^ offset holds (shfl.sync.bfly), for any width."""
        b = self.b
        t = v.type
        fn = self.module.declare_intrinsic("llvm.nvvm.shfl.sync.bfly.i32", (),
                                           ir.FunctionType(I32, [I32, I32, I32, I32]))
        shfl = lambda x: b.call(fn, [ir.Constant(I32, -1), x, ir.Constant(I32, offset), ir.Constant(I32, 31)])  # noqa: E731
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
        if name in getattr(self, "skipped", ()):
            return
        self.current_call = call
        partial = getattr(self, "partials", {}).get(name)
        if partial is None and not shared:
            return super().statement(call)
        s = self.stmts[name]
        env = {it: self.aexpr(call.get_op_arg(i + 1)) for i, it in enumerate(s.iters)}
        cache: dict = {}
        val = self.value(s.body, env, cache)
        arr = self.prog.arrays[s.array]
        if partial is not None:
            slot = partial[0]
            self.partials[name] = (slot, call)
            self.b.store(self.combine(s.combine, self.b.load(slot, typ=COMPUTE[arr.dtype]), val, arr.dtype), slot)
            return
        ptr = self.address(arr, s.index, env, cache)
        if s.combine is not None:
            old = self.from_storage(self.b.load(ptr, typ=STORAGE[arr.dtype]), arr.dtype)
            val = self.combine(s.combine, old, val, arr.dtype)
        self.warp_sync()
        self.b.store(self.to_storage(val, arr.dtype), ptr)

    # ------------------------------------------------------ target hooks
    def load_element(self, arr, index, ptr) -> ir.Value:
        """Arrays no statement writes are invariant: their loads may take the
        read-only cache (ld.global.nc)."""
        align = self.claims.get(id(index)) if self.claims else None
        v = self.b.load(ptr, typ=STORAGE[arr.dtype], align=align)
        if arr.name not in self.written:
            v.set_metadata("invariant.load", self.module.add_metadata([]))
        return self.from_storage(v, arr.dtype)

    def flush_stores(self) -> None:
        """The stores deferred since self.deferred was set to a list, in order."""
        for value, ptr, align in self.deferred or ():
            self.b.store(value, ptr, align=align)
        self.deferred = None

    def store_element(self, arr, index, ptr, val) -> None:
        align = self.claims.get(id(index)) if self.claims else None
        if self.deferred is not None:
            self.deferred.append((self.to_storage(val, arr.dtype), ptr, align))
        else:
            self.b.store(self.to_storage(val, arr.dtype), ptr, align=align)

    def math(self, op: str, a: list) -> ir.Value:
        """No C library on the device: float32 kernels from mathlib and
        compositions of them; NVPTX's own instructions for the rest."""
        t = a[0].type
        if t == F32 and op in mathlib.KERNELS:
            return mathlib.KERNELS[op](self.b, self.module, *a)
        if op in _GPU_INTRINSIC:
            return self.call(_GPU_INTRINSIC[op], a)
        if t == F32 and scalar.OPS[op].decompose is not None:
            return self.decomposed(op, a)
        raise UnsupportedOpError(f"{op} on {'float32' if t == F32 else str(t)} is not supported by target 'nvgpu'")

    def malloc(self, nbytes):
        raise UnsupportedOpError("a buffer too large for a GPU thread")


@dataclass
class _Tiles:
    """A float32 contraction nest as a matrix product: parallel loops around
    one or more reduction loops (their iterations, flattened, are the k of
    the product) whose only statement is C[...] sum= A * B, C indexed by the
    parallel iterators. The last parallel loop is j, the columns; B is the
    factor that reads along j, and A, which must not, reads along i, the last
    parallel loop B does not read along; the other parallel loops (a batch,
    or a convolution's image and row) are fixed per tile. A and B may be any
    expressions: a convolution's input, read through its padding guard,
    is one."""

    reds: list  # the reduction loops, outermost first
    st: Any
    a: Any
    b: Any
    grid_its: list  # per parallel loop: the statement iterator it runs
    red_its: list  # per reduction loop: the statement iterator it runs
    i: int  # the positions of i and j among the parallel loops
    j: int
    extents: list  # per parallel loop: its trip count where the AST fixes it, else None

    @classmethod
    def of(cls, e: "GpuEmitter", loops: list, rest: isl.AstNode) -> "_Tiles | None":
        reds = []
        while rest.get_type() == isl.ast_node_type.for_:
            reds.append(rest)
            rest = rest.for_get_body()
        if len(loops) < 2 or not reds or rest.get_type() != isl.ast_node_type.user:
            return None
        names = [x.for_get_iterator().get_id().get_name() for x in loops + reds]
        if any(x.for_get_inc().get_val().to_python() != 1 for x in loops + reds) \
                or any(ast_uses(x.for_get_init(), set(names))
                       or ast_uses(x.for_get_cond(), set(names) - {x.for_get_iterator().get_id().get_name()})
                       for x in reds):
            return None
        call = rest.user_get_expr()
        st = e.stmts[call.get_op_arg(0).get_id().get_name()]
        args = [call.get_op_arg(q + 1) for q in range(call.get_op_n_arg() - 1)]
        if len(args) != len(names) or any(a.get_type() != isl.ast_expr_type.id for a in args):
            return None
        loop_of = {it: names.index(a.get_id().get_name()) if a.get_id().get_name() in names else -1
                   for it, a in zip(st.iters, args)}
        if sorted(loop_of.values()) != list(range(len(names))):
            return None
        its = sorted(st.iters, key=lambda it: loop_of[it])
        grid_its, red_its = its[:len(loops)], its[len(loops):]
        body = st.body
        arrays = e.prog.arrays
        if st.combine != "sum" or not isinstance(body, Op) or body.op != "mul" or len(body.args) != 2 \
                or st.array in e.sched.contracted \
                or sorted(getattr(x, "name", "") for x in st.index) != sorted(grid_its) \
                or any(arrays[x].dtype is not DataType.Float for x in [st.array] + [ld.array for ld in loads(body)]) \
                or any(ld.array in e.sched.contracted or ld.array == st.array for ld in loads(body)):
            return None

        def used(x) -> set[str]:
            return {v.name for v in walk(x) if isinstance(v, Var) and v.kind == "iter"}
        j = len(loops) - 1
        reading = [x for x in body.args if grid_its[j] in used(x)]
        if len(reading) != 1:
            return None
        bb = reading[0]
        a = body.args[1] if body.args[0] is bb else body.args[0]
        rows = [q for q in range(j) if grid_its[q] in used(a) and grid_its[q] not in used(bb)]
        if not rows:
            return None
        return cls(reds, st, a, bb, grid_its, red_its, rows[-1], j, [static_extent(x) for x in loops])


@dataclass
class _Vector:
    claims: dict = field(default_factory=dict)  # id(index) -> alignment of a group's first access
    arrays: dict = field(default_factory=dict)  # array -> alignment its base must have
    starts: dict = field(default_factory=dict)  # the claimed accesses' last index, as AST expressions


class _WarpPlan:
    """Whether a warp per parallel iteration fits the nest below the grid
    loop, and what it needs: the nest is a sequence of statements and
    one-level loops whose statements either write elements along the loop
    (read back only at the same element) or reduce into one element; and
    lanes walking the loop touch contiguous memory more often than
    threads walking the parallel loop would."""

    def __init__(self) -> None:
        self.children: list[isl.AstNode] = []
        self.lanes = WARP
        self.hoisted: dict[int, list] = {}
        self.reductions: dict[int, list[str]] = {}

    @classmethod
    def of(cls, e: "GpuEmitter", rest: isl.AstNode, grid_iters: list[str]) -> "_WarpPlan | None":
        plan = cls()
        kids = ast_children(rest)
        if kids is None or not any(k.get_type() == isl.ast_node_type.for_ for k in kids):
            return None
        lanes_contiguous = threads_contiguous = 0
        for k in kids:
            if k.get_type() == isl.ast_node_type.user:
                continue
            if k.get_type() != isl.ast_node_type.for_ or not e.splittable(k):
                return None
            calls = ast_children(k.for_get_body())
            if calls is None:
                return None
            it = k.for_get_iterator().get_id().get_name()
            guarded = [c for c in calls if c.get_type() == isl.ast_node_type.if_]
            calls = [c for c in calls if c.get_type() != isl.ast_node_type.if_]
            inits = []
            for g in guarded:  # an initialization isl placed at one iteration: run it before the loop
                then = g.if_get_then_node()
                if g.if_has_else_node() or then.get_type() != isl.ast_node_type.user:
                    return None
                call = then.user_get_expr()
                if any(ast_uses(call.get_op_arg(i), {it}) for i in range(1, call.get_op_n_arg())):
                    return None
                inits.append(call)
            if any(c.get_type() != isl.ast_node_type.user for c in calls):
                return None
            written: dict[str, tuple] = {}
            reduced: set[str] = set()
            plan.reductions[id(k)] = []
            stmts = []
            for c in calls:  # what the loop writes, then what it reads
                call = c.user_get_expr()
                s = e.stmts[call.get_op_arg(0).get_id().get_name()]
                args = [call.get_op_arg(i + 1) for i in range(len(s.iters))]
                along = {x for x, a in zip(s.iters, args) if ast_uses(a, {it})}
                grid = {x for x, a in zip(s.iters, args) if ast_uses(a, {grid_iters[-1]})}
                text = {x: a.to_C_str() for x, a in zip(s.iters, args)}
                stmts.append((s, along, grid, text))
                deps = _depends(s.index, along)
                if s.combine is not None and not deps:
                    reduced.add(s.array)
                    plan.reductions[id(k)].append(s.name)
                elif s.combine is None and deps:
                    moduli = e.sched.contracted.get(s.array)
                    key = _index_text(s.index, text)
                    if key is None or (moduli is not None and any(m != 1 for m in moduli)) \
                            or s.array in written:
                        return None
                    written[s.array] = key
                else:
                    return None
            for call in inits:
                st = e.stmts[call.get_op_arg(0).get_id().get_name()]
                if st.combine is not None or not isinstance(st.body, Const) or st.array not in reduced:
                    return None
            plan.hoisted[id(k)] = inits
            for s, along, grid, text in stmts:
                for ld in loads(s.body):
                    if ld.array in reduced:
                        return None
                    if ld.array in written and _index_text(ld.index, text) != written[ld.array]:
                        return None
                accesses = {(ld.array, str(ld.index)): ld.index for ld in loads(s.body)}
                if not s.combine:
                    accesses[s.array, str(s.index)] = s.index
                for index in accesses.values():  # once each; a row's own scalars (gather indices) do not count
                    if index and _depends(index, along):
                        lanes_contiguous += _depends(index[-1:], along)
                        threads_contiguous += _depends(index[-1:], grid)
        if lanes_contiguous <= threads_contiguous:
            return None
        trips = [_static_trips(k) for k in kids if k.get_type() == isl.ast_node_type.for_]
        if all(t is not None and t >= BLOCK_ROW for t in trips):
            plan.lanes = BLOCK  # long rows: a block each, so that rereading one hits the cache
        plan.children = kids
        return plan


def _has_loop(n: isl.AstNode) -> bool:
    return any(x.get_type() == isl.ast_node_type.for_ for x in ast_nodes(n))


def _steps_with(e: isl.AstExpr, it: str) -> bool:
    """Whether the AST expression e is it plus terms free of it."""
    if e.get_type() == isl.ast_expr_type.id:
        return e.get_id().get_name() == it
    if e.get_type() != isl.ast_expr_type.op or e.get_op_n_arg() != 2:
        return False
    x, y = e.get_op_arg(0), e.get_op_arg(1)
    if e.get_op_type() == isl.ast_expr_op_type.add:
        return (_steps_with(x, it) and not ast_uses(y, {it})) or (_steps_with(y, it) and not ast_uses(x, {it}))
    return e.get_op_type() == isl.ast_expr_op_type.sub and _steps_with(x, it) and not ast_uses(y, {it})


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


def _users(n: isl.AstNode) -> list[isl.AstNode]:
    """The statement calls under n, in order."""
    t = n.get_type()
    if t == isl.ast_node_type.user:
        return [n]
    if t == isl.ast_node_type.block:
        lst = n.block_get_children()
        return [u for i in range(lst.n_ast_node()) for u in _users(lst.get_at(i))]
    if t == isl.ast_node_type.for_:
        return _users(n.for_get_body())
    if t == isl.ast_node_type.mark:
        return _users(n.mark_get_node())
    if t == isl.ast_node_type.if_:
        return _users(n.if_get_then_node()) + (_users(n.if_get_else_node()) if n.if_has_else_node() else [])
    return []


def _static_trips(loop: isl.AstNode) -> int | None:
    init, cond = loop.for_get_init(), loop.for_get_cond()
    hi = cond.get_op_arg(1)
    if init.get_type() != isl.ast_expr_type.int or hi.get_type() != isl.ast_expr_type.int \
            or loop.for_get_inc().get_val().to_python() != 1:
        return None
    last = hi.get_val().to_python() + (1 if cond.get_op_type() == isl.ast_expr_op_type.le else 0)
    return last - init.get_val().to_python()


def _vars(e) -> set[str]:
    return {x.name for x in walk(e) if isinstance(x, Var) and x.kind == "iter"}


def _depends(index, names: set[str]) -> bool:
    return any(_vars(i) & names for i in index)


def _index_text(index, text: dict[str, str]) -> tuple | None:
    """An index in terms of the AST's loop iterators, when each component is a
    plain iterator or constant; None otherwise."""
    out = []
    for i in index:
        if isinstance(i, Var) and i.kind == "iter":
            out.append(text[i.name])
        elif isinstance(i, Const):
            out.append(str(i.value))
        else:
            return None
    return tuple(out)


def _parallel_top(node: isl.AstNode) -> str | None:
    """The name of the parallel mark that encloses all of the kernel (below
    guards on sizes only), or None: only such a loop may be dealt to threads
    without a barrier between its iterations and the rest of the nest."""
    while True:
        t = node.get_type()
        if t == isl.ast_node_type.if_ and not node.if_has_else_node():
            node = node.if_get_then_node()
        elif t == isl.ast_node_type.mark:
            if node.mark_get_id().get_name().startswith("parallel:"):
                return node.mark_get_id().get_name()
            node = node.mark_get_node()
        else:
            return None


@functools.cache
def _nvptx_target():
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    return llvm.Target.from_triple(TRIPLE)


def ptx(ir_text: str, arch: str = DEFAULT_ARCH) -> tuple[str, str]:
    """(optimized LLVM IR, PTX) for a GPU of the given sm_XX."""
    from .cpu import _lock
    tm = _nvptx_target().create_target_machine(cpu=arch, opt=3)
    with _lock:
        mod = llvm.parse_assembly(ir_text)
        mod.verify()
        mod.triple = TRIPLE
        mod.data_layout = str(tm.target_data)
        pto = llvm.create_pipeline_tuning_options(speed_level=3)
        pto.loop_unrolling = True
        pb = llvm.create_pass_builder(tm, pto)
        pb.getModulePassManager().run(mod, pb)
        return str(mod), tm.emit_assembly(mod)
