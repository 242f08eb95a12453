"""Strips: a sequential loop cut into pieces that run in parallel, each
first recomputing the halo of private values it needs (a stencil's rolling
rows), when the parallel loop above is too short to keep every part busy."""
from __future__ import annotations

import islpy as isl
from llvmlite import ir

from .irtypes import I64
from .mapping import Strips


class StripEmission:
    """Emitter's strips (the mapping's SplitStrips): the parallel walk of
    (iteration, strip) pairs."""

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
            self.range_loop(self.var(it2), begin, end, inc2, lambda: self.descend(inner.for_get_body(), 0, 0))
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
