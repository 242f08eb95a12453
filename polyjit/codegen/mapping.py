"""What both targets' mapping stages share: strips of a sequential loop that
run in parallel, each first recomputing the halo of private values it needs
(a stencil's rolling rows), where a private buffer lives (stack or heap),
and the stage's printed form.

The CPU's mapping (codegen.cpu_mapping) cuts such a loop when the parallel
loop above is too short to keep every thread busy; the GPU's
(codegen.gpu_mapping) when a thread's share of the grid would run it whole.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import islpy as isl

from .. import sizes as sz
from ..affine import AffineProgram, Array
from ..expr import Var, loads, walk
from ..schedule import Scheduled
from ..schedule.ast import ast_nodes, ast_uses, statements_in

STACK_LIMIT = 16384  # bytes: smaller private buffers go on the stack


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
    outer: list = field(default_factory=list)  # loops of a perfect nest around loop: an iteration each per strip


def mapping_text(lines: list[tuple[str, object]]) -> str:
    """The mapping stage as printed: a line per kernel, its name and plan."""
    return "\n".join(f"{name}: {plan}" for name, plan in lines)


def on_stack(a: Array, moduli) -> bool:
    """Whether private buffer a (keeping moduli rows where not None) goes on
    the stack: its size is known and at most STACK_LIMIT bytes."""
    extents = [s if m is None else m for s, m in zip(a.shape, moduli)]
    return all(sz.is_static(e) for e in extents) and \
        a.dtype.itemsize * math.prod(int(e) for e in extents) <= STACK_LIMIT


def loop_iterator(loop: isl.AstNode) -> str:
    return loop.for_get_iterator().get_id().get_name()


class StripMapping:
    """The strips test, for a mapper of prog scheduled as sched."""

    prog: AffineProgram
    sched: Scheduled

    @staticmethod
    def splittable(n: isl.AstNode) -> bool:
        """Whether for loop n's range is known before it runs (parts may share it)."""
        c = n.for_get_cond()
        return c.get_op_type() in (isl.ast_expr_op_type.le, isl.ast_expr_op_type.lt) and \
            n.for_get_inc().get_type() == isl.ast_expr_type.int

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
                   bounded: bool = False) -> Strips | None:
        """Strips of rest when it is one sequential loop whose iterations
        depend on each other only through buffers private to the thread (a
        stencil's rolling rows): strips of size iterations can then run in
        parallel, each first recomputing the halo of private values it
        needs. bounded: only private buffers of a fixed size (a GPU thread's)."""
        if rest.get_type() != isl.ast_node_type.for_ or not self._free(rest, grid_iters):
            return None
        it = loop_iterator(rest)
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
