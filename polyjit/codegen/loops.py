"""Emission of isl's AST: nodes, loops (a parallel loop split into the
parts' shares), branches and the integer expressions of bounds and indices."""
from __future__ import annotations

import islpy as isl
from llvmlite import ir

from ..schedule.ast import fixed_extent, static_extent
from ..schedule.tree import unrolled_trips
from .folding import power_of_two
from .irtypes import I64


class LoopEmission:
    """Emitter's walk of the AST, into the function ``self.fn`` at the
    builder ``self.b``; iterators live in entry-block slots (``self.var``),
    the path of the node being emitted is ``self.at``."""

    def node(self, n: isl.AstNode) -> None:
        t = n.get_type()
        if t == isl.ast_node_type.block:
            lst = n.block_get_children()
            for i in range(lst.n_ast_node()):
                self.descend(lst.get_at(i), i)
        elif t == isl.ast_node_type.for_:
            self.loop(n, split=False)
        elif t == isl.ast_node_type.if_:
            self.branch(n)
        elif t == isl.ast_node_type.mark:
            self.mark(n)
        elif t == isl.ast_node_type.user:
            self.statement(n.user_get_expr())
        else:
            raise NotImplementedError(f"isl AST node {t}")

    def descend(self, n: isl.AstNode, *steps: int) -> None:
        """Emit n, the node at steps below the one at ``self.at`` (the path
        from the kernel's root that keys the mapping's decisions)."""
        at = self.at
        self.at = at + steps
        self.node(n)
        self.at = at

    unroll: tuple[int, ...] = ()  # under an unroll mark: the trip counts of the loops still to unroll

    def mark(self, n: isl.AstNode) -> None:
        """A mark's node (a hook: the CPU splits the parallel loops its
        mapping says); under an unroll mark, the loops it names are unrolled."""
        trips = unrolled_trips(n.mark_get_id().get_name())
        if trips is None:
            return self.descend(n.mark_get_node(), 0)
        outer, self.unroll = self.unroll, trips
        self.descend(n.mark_get_node(), 0)
        self.unroll = outer

    def var(self, name: str, typ: ir.Type = I64) -> ir.AllocaInstr:
        """A named slot in the entry block (mem2reg makes it a register)."""
        if name not in self.vars:
            with self.b.goto_block(self.entry):
                self.b.position_at_start(self.entry)
                self.vars[name] = self.b.alloca(typ, name=name)
        return self.vars[name]

    def loop(self, n: isl.AstNode, split: bool) -> None:
        if self.unroll and not split:
            if 0 < self.unroll[0] and (static_extent(n) or 0) <= self.unroll[0]:
                return self.unrolled(n)
            # a loop the mark leaves plain (0: unbounded), or longer than it says: plain, the loops
            # inside unrolled by the rest of the mark, or plain where this one is longer
            outer, self.unroll = self.unroll, self.unroll[1:] if self.unroll[0] == 0 else ()
            try:
                return self.plain_loop(n, split)
            finally:
                self.unroll = outer
        self.plain_loop(n, split)

    def plain_loop(self, n: isl.AstNode, split: bool) -> None:
        """n as a loop (split: the range of this thread's part of it)."""
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
        self.descend(n.for_get_body(), 0)
        self.b.store(self.b.add(self.b.load(slot, typ=I64), inc), slot)
        self.b.branch(head)
        self.b.position_at_end(done)

    def unrolled(self, n: isl.AstNode) -> None:
        """Loop n's body copied as many times as the loop runs at most (the
        mark's first count: isl's maximum over the loops outside, so no
        iteration is left over), each copy run where its iteration is in the
        loop's range: a check LLVM folds away where the range is a whole
        register block, whose accumulators then stay in registers. Where
        the range may be shorter (the last block of 50257 columns:
        min(50256, 64 t + 63), or rows over a symbolic size), a check per
        block picks copies without the checks for a whole block: checked in
        every block, the copies had kept the sums in memory, and LLVM took
        seconds over the checks (a product over 50257 columns:
        bench/NOTES.md)."""
        b = self.b
        trips, rest = self.unroll[0], self.unroll[1:]
        lo, inc, end = self.loop_range(n)
        span = b.sub(end, lo)
        outer, self.unroll = self.unroll, rest
        if fixed_extent(n) is None:
            whole, part, done = (self.fn.append_basic_block(f"block.{k}") for k in ("whole", "part", "done"))
            b.cbranch(b.icmp_signed(">=", span, b.mul(ir.Constant(I64, trips), inc)), whole, part)
            b.position_at_end(whole)
            self._copies(n, trips, lo, inc, None)
            b.branch(done)
            b.position_at_end(part)
            self._copies(n, trips, lo, inc, span)
            b.branch(done)
            b.position_at_end(done)
        else:
            self._copies(n, trips, lo, inc, span)
        self.unroll = outer

    def _copies(self, n: isl.AstNode, trips: int, lo, inc, span) -> None:
        """Loop n's body copied trips times, each run where its iteration is
        below span (every one where span is None)."""
        b = self.b
        it = n.for_get_iterator().get_id().get_name()
        slot = self.var(it)
        for i in range(trips):
            offset = b.mul(ir.Constant(I64, i), inc)
            copy = self.fn.append_basic_block(f"{it}.copy")
            after = self.fn.append_basic_block(f"{it}.next")
            b.cbranch(b.icmp_signed("<", offset, span) if span is not None else ir.Constant(ir.IntType(1), 1),
                      copy, after)
            b.position_at_end(copy)
            b.store(b.add(lo, offset), slot)
            self.descend(n.for_get_body(), 0)
            b.branch(after)
            b.position_at_end(after)

    def branch(self, n: isl.AstNode) -> None:
        c = self.aexpr(n.if_get_cond())
        then = self.fn.append_basic_block("then")
        other = self.fn.append_basic_block("else") if n.if_has_else_node() else None
        done = self.fn.append_basic_block("endif")
        self.b.cbranch(c, then, other or done)
        self.b.position_at_end(then)
        self.descend(n.if_get_then_node(), 0)
        self.b.branch(done)
        if other is not None:
            self.b.position_at_end(other)
            self.descend(n.if_get_else_node(), 1)
            self.b.branch(done)
        self.b.position_at_end(done)

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

    def floordiv(self, x, y):
        b = self.b
        k = power_of_two(y)
        if k is not None:  # an arithmetic shift floors
            return b.ashr(x, ir.Constant(x.type, k))
        q = b.sdiv(x, y)
        r = b.srem(x, y)
        zero = ir.Constant(x.type, 0)
        adjust = b.and_(b.icmp_signed("!=", r, zero),
                        b.icmp_signed("!=", b.icmp_signed("<", r, zero), b.icmp_signed("<", y, zero)))
        return b.sub(q, b.zext(adjust, x.type))


def _fold(b, args, f):
    v = args[0]
    for x in args[1:]:
        v = f(v, x)
    return v
