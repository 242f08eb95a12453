"""Strips: a sequential loop cut into pieces that run in parallel, each
first recomputing the halo of private values it needs (a stencil's rolling
rows), when the parallel loop above is too short to keep every part busy."""
from __future__ import annotations

from dataclasses import dataclass, field

import islpy as isl
from llvmlite import ir

from ..expr import Var, loads, walk
from ..schedule import MIN_PARALLEL_EXTENT
from ..schedule.ast import ast_nodes, ast_uses, static_extent, statements_in
from .irtypes import I64


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


class StripEmission:
    """Emitter's strips: the plan (which loop, how wide a halo) and the
    parallel walk of (iteration, strip) pairs."""

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

    def strip_bounds(self, start, size, halo: int, lo, inc, hi) -> tuple:
        """[begin, end) of the strip of size iterations from start, with halo
        iterations before it, inside the loop lo, lo + inc, ... < hi."""
        b = self.b
        begin = b.sub(start, b.mul(inc, ir.Constant(I64, halo)))
        begin = b.select(b.icmp_signed("<", begin, lo), lo, begin)
        end = b.add(start, b.mul(inc, size))
        return begin, b.select(b.icmp_signed("<", end, hi), end, hi)

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
