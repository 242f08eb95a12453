"""The CPU mapping stage: how each kernel's loop nest runs on the host.

Between the isl AST and emission, each kernel gets a typed plan
(:class:`CpuPlan`), decided from the AST and the statements' accesses
before any IR is emitted; the emitter (codegen.cpu) then only emits what
the plan says, and the plans print as a stage of their own
(``exe.ir("mapping")``, the debug folder). A plan names:

- the parallel loops the thread team's parts share: a loop split into
  chunks (:class:`SplitLoop`), or, under a parallel loop too short to keep
  every thread busy, (iteration, strip) pairs of the sequential loop below,
  each strip first recomputing its halo of private values
  (:class:`SplitStrips`: a blur of three images on two threads);
- library calls (:class:`LibraryCall`): BLAS's sgemm, each part on its
  strip of the product unless a parallel loop already shares the kernel;
- streaming stores (:class:`StreamedLoop`): in a kernel that keeps private
  buffers (a fused stencil's rolling rows), an innermost loop that writes a
  row of a large output in order, its stores made nontemporal once LLVM
  vectorizes them (codegen.cpu.streaming_stores);
- register blocks: the contraction updates the emitter unrolls into a
  block whose accumulators stay in vector registers (the scheduler's
  cpu_rewrites sized it and marked its loops); their padded loads read a
  fill cell rather than select a value. A block's innermost loop whose
  iterations are whole vectors of contiguous float32 elements is emitted
  as vector operations (:class:`VectorBlock`): LLVM's SLP vectorizer would
  make the same vectors of the scalar copies, in most of a product's
  compile time;
- private buffers, on the stack or the heap.

Which loops may run in parallel is the scheduler's to say, not the plan's
(schedule.cpu_rewrites: mark_parallel's ``parallel:`` marks, and
balance_parallel's strips of a coincident inner loop under a short outer
one): which loops carry no dependence is known on isl's schedule tree, where
a rewrite's legality is also checked, and the AST keeps neither; a strip
loop made here instead would be other loops, other IR. The plan decides how
a marked loop runs: in chunks, in strips of a sequential loop below that
only private buffers connect (row_strips), or not split at all inside a
loop already shared.

Which other loops are vectorized, and how wide, is LLVM's choice after
emission (codegen.cpu.optimize; every function prefers 512-bit vectors on
an AVX-512 host, prefer_wide_vectors): no plan names them.

Decisions are keyed by where they sit in the kernel's AST: a path of child
positions from its root (a block's i-th child, 0 for a loop's body, a
mark's node and a branch's then, 1 for its else), which the emitter tracks
as it walks (LoopEmission.at). isl's nodes have no identity of their own
in Python.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Union

import islpy as isl

from .. import sizes as sz
from ..affine import AffineProgram, Array
from ..dtypes import DataType
from ..expr import Const, Expr, Load, Op, Var, iter_vars, loads, merged_index, moves_by_one, select_parts, walk
from ..schedule import MIN_PARALLEL_EXTENT, Scheduled, is_update
from ..schedule.ast import (ast_affine, ast_calls, ast_nodes, ast_uses, fixed_extent, in_order_kernel, static_extent,
                            statements_in, unit_step)
from ..schedule.tree import unrolled_trips
from .mapping import Strips, StripMapping, loop_iterator, on_stack

STREAM_BYTES = 8 << 20  # outputs at least this large are written with streaming stores
ONE_THREAD_WORK = 4096  # a kernel of less work (CpuMapper.work) runs on one thread
PLAIN_WORK = 1 << 16  # a kernel of less work is compiled without LLVM's unrolling and vectorizers

Path = tuple[int, ...]


# ------------------------------------------------------------------ plans
@dataclass
class SplitLoop:
    """A parallel loop cut into one chunk of iterations per part."""

    iterator: str

    def __str__(self) -> str:
        return f"parallel {self.iterator}"


@dataclass
class SplitStrips:
    """A parallel loop too short for the team: each of its iterations cut
    into one strip of the sequential loop below per part, and the
    (iteration, strip) pairs shared between the parts."""

    iterator: str
    strips: Strips

    def __str__(self) -> str:
        s = self.strips
        ring = f", ring {s.ring}" if s.ring else ""
        return f"parallel {self.iterator} x strips of {loop_iterator(s.loop)} (halo {s.halo}{ring})"


@dataclass
class StreamedLoop:
    """An innermost loop whose stores of array stream: aligned groups of its
    iterations, their stores tagged to become nontemporal."""

    iterator: str
    array: str
    call: isl.AstExpr  # the storing statement's call (its first address sets the alignment)

    def __str__(self) -> str:
        return f"streaming stores to {self.array} along {self.iterator}"


@dataclass
class LibraryCall:
    """A library statement: each part calls it on its strip (split), or it
    runs whole in each iteration of a parallel loop already shared."""

    statement: Any
    split: bool

    def __str__(self) -> str:
        g = self.statement.library
        how = f"strips of {g.split} per part" if self.split else "in the parallel loop"
        return f"BLAS sgemm of {self.statement.name}, {how}"


@dataclass
class VectorBlock:
    """The innermost unrolled loop of a register block, emitted in vectors
    of lanes iterations (the rest in narrower ones): each statement under
    it reads vectors of contiguous elements along it (or one element,
    broadcast) and writes one vector."""

    iterator: str
    lanes: int
    trips: int

    @property
    def widths(self) -> list[int]:
        """The vectors' widths in order: whole ones, then a power of two for each bit of the rest."""
        rest = self.trips % self.lanes
        return [self.lanes] * (self.trips // self.lanes) + [1 << b for b in range(rest.bit_length() - 1, -1, -1)
                                                            if rest >> b & 1]

    def __str__(self) -> str:
        rest = self.trips % self.lanes
        return f"{self.iterator} in vectors of {self.lanes}" + (f" and {rest} more" if rest else "")


VECTOR_OPS = frozenset({"add", "sub", "mul", "neg"})  # what a vector block's statements may compute
NARROWEST_VECTOR = 4  # a block's fewest columns in vectors (8 of 16 lanes: LLVM's SLP vectorizer joined
# 96 scalar statements again, 0.35 s for a 1x1 convolution's kernel that ran at twice the vector block's time)

Split = Union[SplitLoop, SplitStrips]


@dataclass
class CpuPlan:
    """One kernel's mapping: its decisions, keyed by path in its AST."""

    splits: dict[Path, Split] = field(default_factory=dict)  # parallel marks the parts share
    streams: dict[Path, StreamedLoop] = field(default_factory=dict)  # loops that stream their stores
    library: dict[Path, LibraryCall] = field(default_factory=dict)  # library statements' calls
    blocked: frozenset[str] = frozenset()  # contraction updates, unrolled into register blocks
    block: int = 0  # the most updates unrolled into one loop body (a register block)
    vectors: dict[Path, VectorBlock] = field(default_factory=dict)  # unrolled loops emitted in vectors
    buffers: dict[str, bool] = field(default_factory=dict)  # private buffer -> on the stack
    plain_loops: bool = False  # LLVM neither unrolls nor vectorizes the kernel's loops (CpuMapper.work)

    @property
    def parallel(self) -> bool:
        """Whether the thread team runs the kernel (else one thread does)."""
        return bool(self.splits) or any(c.split for c in self.library.values())

    @property
    def strength_reduction(self) -> bool:
        """Whether LLVM's code generation reduces the strength of the kernel's
        loops: a register block's many address streams need it (3x3
        convolutions ran up to 1.3x slower without); elsewhere (elementwise,
        depthwise windows) it took a quarter of LLVM's time, for no speed
        measured (bench/NOTES.md)."""
        return bool(self.blocked)

    def __str__(self) -> str:
        parts = [str(x) for x in self.splits.values()] + [str(x) for x in self.library.values()]
        if self.blocked:
            parts.append(f"register blocks of {self.block} products")
        parts += [str(x) for x in self.vectors.values()]
        parts += [str(x) for x in self.streams.values()]
        if self.buffers:
            parts.append("private " + ", ".join(f"{a} ({'stack' if s else 'heap'})"
                                                for a, s in self.buffers.items()))
        if self.plain_loops:
            parts.append("plain loops")
        return "; ".join(["thread team" if self.parallel else "one thread"] + parts)


# --------------------------------------------------------------- mapping
class CpuMapper(StripMapping):
    """What a kernel is mapped for: the program and its schedule."""

    def __init__(self, prog: AffineProgram, sched: Scheduled, vector_bits: int = 512) -> None:
        self.prog, self.sched = prog, sched
        self.stmts = {s.name: s for s in prog.statements}
        self.lanes = vector_bits // 32  # float32 elements in a vector
        self.unroll: tuple[int, ...] = ()  # under an unroll mark: trip counts still to unroll, as LoopEmission

    def kernel(self, k: int, node: isl.AstNode) -> CpuPlan:
        """The plan of kernel k, whose nest is node."""
        private = {a: m for a, m in self.sched.contracted.items() if self.sched.kernel_of_array.get(a) == k}
        blocked = frozenset(n for n in self.sched.kernels[k] if is_update(self.stmts[n]))
        work = self.work(k)
        plan = CpuPlan(blocked=blocked, buffers={a: on_stack(self.prog.arrays[a], m) for a, m in private.items()},
                       plain_loops=work is not None and work < PLAIN_WORK)
        self.walk(node, (), plan, work is not None and work < ONE_THREAD_WORK or in_order_kernel(node))
        if blocked:
            marks = [(n, unrolled_trips(n.mark_get_id().get_name())) for n in ast_nodes(node)
                     if n.get_type() == isl.ast_node_type.mark]
            plan.block = max((math.prod(t for t in trips if t) for n, trips in marks
                              if trips is not None and statements_in(n) & blocked), default=0)
        return plan

    def work(self, k: int) -> int | None:
        """Kernel k's work: its statement instances, each counted once per
        array element it reads (an inlined 7x7 stencil's instance reads 49;
        counted once, ConvNeXt's depthwise convolutions were scalar code);
        None where a library call or a symbolic size makes it unknown.
        Under ONE_THREAD_WORK it is too little to share (a per-channel
        scale folded into a convolution's weights): on one thread its loops
        keep their constant trip counts (no chunk bounds of a part), which
        LLVM vectorizes without remainder loops, in a fraction of the
        compile time, and no call wakes the team for a few hundred elements. Under PLAIN_WORK LLVM neither unrolls nor
        vectorizes its loops: unrolled whole, the short nests of a small
        network's last layers ([8, 6, 6, 32]) took most of their kernels'
        compile time, and the vectorizers' analyses most of a network's
        weight preparation's (about a hundred short loops), for microseconds
        a call."""
        work = 0
        for name in self.sched.kernels[k]:
            s = self.stmts[name]
            points = s.points if s.library is None else None
            if points is None:
                return None
            work += max(points, 0) * max(len(loads(s.body)), 1)
        return work

    @staticmethod
    def may_stream(plan: CpuPlan) -> bool:
        """Only a kernel that keeps private buffers (a fused stencil's rows)
        streams its stores. A contraction's private block is no stencil's
        rows: its epilogue writes rows of one block's width, and tagging
        them kept LLVM from holding the accumulators in registers."""
        return bool(plan.buffers) and not plan.blocked

    def walk(self, n: isl.AstNode, at: Path, plan: CpuPlan, shared: bool) -> None:
        """The decisions under n, at path at; shared: inside a loop the parts
        share, or in a kernel one thread runs (nothing more is split)."""
        t = n.get_type()
        if t == isl.ast_node_type.block:
            lst = n.block_get_children()
            for i in range(lst.n_ast_node()):
                self.walk(lst.get_at(i), at + (i,), plan, shared)
        elif t == isl.ast_node_type.for_:
            stream = self.stream_target(n) if self.may_stream(plan) else None
            if stream is not None:
                plan.streams[at] = stream
            unroll = self.unroll
            if unroll and 0 < unroll[0] and (static_extent(n) or 0) <= unroll[0]:  # LoopEmission.unrolled
                self.unroll = unroll[1:]
                vectors = self.vector_block(n, unroll[0]) if plan.blocked and not self.unroll else None
                if vectors is not None:
                    plan.vectors[at] = vectors
            elif unroll:
                self.unroll = unroll[1:] if unroll[0] == 0 else ()
            self.walk(n.for_get_body(), at + (0,), plan, shared)
            self.unroll = unroll
        elif t == isl.ast_node_type.if_:
            self.walk(n.if_get_then_node(), at + (0,), plan, shared)
            if n.if_has_else_node():
                self.walk(n.if_get_else_node(), at + (1,), plan, shared)
        elif t == isl.ast_node_type.mark:
            self.mark(n, at, plan, shared)
        elif t == isl.ast_node_type.user:
            st = self.stmts[self.call_name(n.user_get_expr())]
            if st.library is not None:
                plan.library[at] = LibraryCall(st, not shared)

    def mark(self, n: isl.AstNode, at: Path, plan: CpuPlan, shared: bool) -> None:
        """A parallel mark outside the loops the parts share, on the loop it
        names, is split: in chunks, or in strips where the loop is short."""
        child, name = n.mark_get_node(), n.mark_get_id().get_name()
        trips = unrolled_trips(name)
        if trips is not None:
            outer, self.unroll = self.unroll, trips
            self.walk(child, at + (0,), plan, shared)
            self.unroll = outer
            return
        if shared or not name.startswith("parallel:") or child.get_type() != isl.ast_node_type.for_ \
                or not self.splittable(child) or name != "parallel:" + loop_iterator(child):
            return self.walk(child, at + (0,), plan, shared)
        strips = self.row_strips(child)
        if strips is None:
            plan.splits[at] = SplitLoop(loop_iterator(child))
            return self.walk(child.for_get_body(), at + (0, 0), plan, True)  # (a split loop streams nothing)
        plan.splits[at] = SplitStrips(loop_iterator(child), strips)
        self.walk(strips.loop.for_get_body(), at + (0, 0, 0), plan, True)

    def vector_block(self, loop: isl.AstNode, trips: int) -> VectorBlock | None:
        """Loop, unrolled trips times innermost in a register block, in
        vectors: it runs exactly trips iterations, and each float32
        statement under it stores along it (one element further in memory
        per iteration) what VECTOR_OPS compute of loads that run so too or
        do not move with it. Through a private buffer's modulus only whole
        vectors from a multiple of the lanes, which never wrap."""
        it, lanes = loop_iterator(loop), self.lanes
        first = ast_affine(loop.for_get_init())
        aligned = first is not None and not trips % lanes and not any(v % lanes for v in first.values())
        if fixed_extent(loop) != trips or trips < NARROWEST_VECTOR:
            return None
        calls = ast_calls(loop.for_get_body())
        if not calls:
            return None
        for call in calls:
            s = self.stmts[self.call_name(call)]
            arr = self.prog.arrays[s.array]
            args = [call.get_op_arg(i + 1) for i in range(len(s.iters))]
            moving = [k for k, a in enumerate(args) if ast_uses(a, {it})]
            if s.library is not None or arr.dtype is not DataType.Float or len(moving) != 1 \
                    or args[moving[0]].get_type() != isl.ast_expr_type.id:
                return None
            var = s.iters[moving[0]]
            if self._contiguous(s.array, s.index, var, aligned) is not True or not self._vector_value(s.body, var):
                return None
        return VectorBlock(it, lanes, trips)

    def _contiguous(self, name: str, index, var: str, aligned: bool = False) -> bool | None:
        """Whether array name's elements at index run one after the other in
        memory as var moves (None: they do not move with it); aligned: var
        starts at a multiple of the lanes and runs whole vectors."""
        arr = self.prog.arrays[name]
        moduli = self.sched.contracted.get(name)
        if arr.strided:
            return False
        dims = list(enumerate(index)) if moduli is not None else [(d, e) for e, d in merged_index(index, arr.shape)]
        moving = [(d, e) for d, e in dims if var in iter_vars(e)]
        if not moving:
            return None
        (d, e), = moving if len(moving) == 1 else ((None, None),)
        if d is None or not moves_by_one(e, var) or any(x != 1 for x in arr.shape[d + 1:]):
            return False
        return moduli is None or moduli[d] is None or (aligned and moduli[d] % self.lanes == 0 and e == Var(e.dtype, var))

    def _vector_value(self, e: Expr, var: str) -> bool:
        """Whether e can be computed in vectors along iterator var."""
        if isinstance(e, Const):
            return True
        if isinstance(e, Load):
            return self._contiguous(e.array, e.index, var) is not False and (
                self.prog.arrays[e.array].dtype is DataType.Float or var not in iter_vars(e))
        if isinstance(e, Op):
            sel = select_parts(e)
            if sel is not None:  # a padded load, kept scalar: its fill cell holds one element
                return var not in iter_vars(e)
            return e.op in VECTOR_OPS and all(self._vector_value(a, var) for a in e.args)
        return False

    def row_strips(self, loop: isl.AstNode) -> Strips | None:
        """Strips of the sequential loop under a parallel loop too short to keep
        every thread busy (three images of a blur for two threads), when its
        iterations depend on each other only through private buffers."""
        extent = static_extent(loop)
        if extent is None or extent >= MIN_PARALLEL_EXTENT:
            return None
        return self.strip_plan(loop.for_get_body(), {loop_iterator(loop)}, 0)

    def call_name(self, call: isl.AstExpr) -> str:
        return call.get_op_arg(0).get_id().get_name()

    def stream_target(self, n: isl.AstNode) -> StreamedLoop | None:
        """Loop n's streamed stores, when it is innermost with unit step and
        its body stores one large float32/float64 output along n, element
        after element."""
        if not self.splittable(n) or n.for_get_inc().get_val().to_python() != 1:
            return None
        calls = ast_calls(n.for_get_body())
        if calls is None:
            return None
        it = loop_iterator(n)
        found = None
        for call in calls:
            s = self.stmts[self.call_name(call)]
            arr = self.prog.arrays[s.array]
            if arr.kind != "output" or s.array in self.sched.contracted:
                continue
            if found is not None or s.combine is not None or arr.strided \
                    or arr.dtype not in (DataType.Float, DataType.Double):
                return None
            elements = sz.static_product(arr.shape)
            if elements is None or elements * arr.dtype.itemsize < STREAM_BYTES:
                return None
            if not _along_one_dimension(s, arr, [call.get_op_arg(i + 1) for i in range(len(s.iters))], it):
                return None
            found = StreamedLoop(it, arr.name, call)
        return found


def _along_one_dimension(s, arr: Array, args: list, it: str) -> bool:
    """Whether statement s, called with args, writes arr along iterator it:
    one of its iterators moves with it, by one step, and indexes the one
    dimension it moves along, contiguous (unit dimensions after it)."""
    moving = [k for k, a in enumerate(args) if ast_uses(a, {it})]
    if len(moving) != 1 or not unit_step(args[moving[0]], it):
        return False
    var = s.iters[moving[0]]
    along = [d for d, e in enumerate(s.index) if any(isinstance(x, Var) and x.name == var for x in walk(e))]
    return len(along) == 1 and s.index[along[0]] == Var(s.index[along[0]].dtype, var) \
        and all(x == 1 for x in arr.shape[along[0] + 1:])
