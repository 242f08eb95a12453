"""The GPU mapping stage: how each kernel's loop nest runs on the grid.

Between the isl AST and emission, each kernel gets a typed plan, decided
from the AST and the statements' accesses before any IR is emitted; the
emitter (codegen.nvgpu) then only emits what the plan says, and the plans
print as a stage of their own (``exe.ir("mapping")``, the debug folder).

It lives in codegen, beside the emitter, because it reads the isl AST with
the helpers codegen has for it (and a plan holds AST nodes the emitter then
walks); it decides nothing the emitter could not, and imports no LLVM.

The scheduler puts a nest's coincident loops outermost and marks each; the
chain of those loops under the mark that encloses the kernel collapses into
one index space (a :class:`Grid`) that a grid-stride loop shares among all
threads. What runs for each of its iterations takes the first form that
fits:

- :class:`TiledContraction`: a block per tile of a float32 contraction, its
  operands staged in shared memory, multiplied on tensor cores from sm_80;
- :class:`WarpRows`: a warp, or a block for long static rows, whose lanes
  share the inner loops, reductions combined with warp shuffles and shared
  memory;
- :class:`HaloStrips`: strips of a sequential loop that carries values only
  through buffers private to the thread, each strip recomputing its halo
  (a stencil);
- :class:`AtomicStrips`: strips of a loop that only sums, added with atomics
  (a column sum; a sum of everything, which has no parallel loop, too);
- :class:`ScatterPoints`: a scatter-add alone in its kernel, every loop of it
  in the grid, each iteration adding at its position with an atomic;
- :class:`PointPerThread`: straight-line code, several iterations per trip
  and groups of VECTOR consecutive ones where the accesses allow;
- :class:`NestPerThread`: one thread per iteration, running the inner loops
  in order.

Independent nests that the schedule puts side by side in one kernel (a
model's weight copies) each take one of the last two forms, with threads of
their own (:class:`SideBySide`).

A kernel with none of these runs on one thread (:class:`OneThread`); a
library statement is a step of its own (:class:`Library`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Union

import islpy as isl

from .. import scalar
from .. import sizes as sz
from ..affine import AffineProgram, Statement
from ..dtypes import DataType
from ..expr import Const, Load, Op, Var, iter_vars, loads, moves_by_one, walk
from ..schedule import Scheduled, ast_nodes, statements_in
from ..schedule.ast import ast_affine, kernel_nodes, side_by_side_kernel, unit_step
from ..schedule.fusion import GPU_STRIP
from .llvm import Strips, ast_calls, ast_children, ast_uses, static_extent
from .mapping import StripMapping, loop_iterator, on_stack

WARP = 32
BLOCK = 256  # threads per block (runtime.gpu_program launches this many)
BLOCK_ROW = 4096  # rows at least this long get a block of lanes rather than a warp
TILE_COLS, TILE_ROWS = 8, 4  # a transposing copy's warp tile: 8 stored floats (a sector) by 4 rows
THREAD_BLOCK = 16  # the most iterations of a transposing copy's small side a thread runs whole (thread_loops)
VECTOR = 4  # consecutive iterations of an elementwise loop per group (16 bytes of float32)
ROW_GROUPS = 8  # a lane loop of at most this many groups per lane is unrolled whole
TILE, KTILE = 64, 16  # a contraction's output tile per block, and its reduction slice in shared memory
BIG_TILE = 128  # the tile of long products
DEFAULT_ARCH = "sm_90"  # what PTX is for where neither the options nor a GPU say
MMA_ARCH, MMA_SIDE, MMA_K = 80, 32, 8  # TF32 mma.sync from sm_80; a block's 2 x 4 warps of m16n8k8 products
MMA_PAD = 8  # elements after each staged row of a tensor-core tile (a fragment's reads then take 32 banks)
MMA_STAGES = 2  # slices of plain factors in shared memory at once, copied by cp.async (sm_80 too)
STATIC_SHARED = 48 * 1024  # the bytes of shared memory a kernel may declare
STRIP_REDUCE = 256  # iterations of a sum of everything per thread before its atomic add (one address)
STRIP_COLUMN = 64  # the same where a grid loop spreads the atomics (a column sum); and of a nest's innermost loop
COLUMN_STRIP_TARGETS = 256  # column sums at least this many may take shorter strips (_column_strip)
ATOMIC_COMBINES = ("sum",)  # reductions whose strips end in an atomic read-modify-write (an atomic add)
ATOMIC_DTYPES = (DataType.Float, DataType.Double, DataType.Int32, DataType.Int)  # what atomics add
THREADS_PER_MULTIPROCESSOR = 2048  # resident threads (sm_70 to sm_90)
DEFAULT_MULTIPROCESSORS = 132  # where no GPU says (PTX for gpu_arch): an H100's


# ------------------------------------------------------------------ plans
@dataclass
class Grid:
    """The collapsed parallel loops and what each iteration runs."""

    top: str | None  # the parallel mark the grid replaces; None: the kernel's root (a sum of everything)
    loops: list  # the collapsed loops, outermost first
    rest: isl.AstNode  # the nest under them
    iters: set[str]  # their iterators

    def __str__(self) -> str:
        return "grid " + " x ".join(loop_iterator(x) for x in self.loops) if self.loops else "no grid loop"


@dataclass
class Vector:
    """Accesses that move with a loop's iterator: in a group of VECTOR
    iterations they are consecutive, the group's first aligned when the
    arrays and starts are (checked at run time)."""

    claims: dict = field(default_factory=dict)  # id(index) -> alignment of a group's first access
    arrays: dict = field(default_factory=dict)  # array -> alignment its base must have
    starts: dict = field(default_factory=dict)  # the claimed accesses' last index, as AST expressions


@dataclass
class Library:
    """A library statement (which runs alone): a step runtime.gpu_program runs through cuBLAS."""

    statement: Any

    def __str__(self) -> str:
        return f"library: {self.statement.library}"


@dataclass
class OneThread:
    """No parallel loop encloses the kernel: one thread runs all of it."""

    def __str__(self) -> str:
        return "one thread"


@dataclass
class NestPerThread:
    """One thread per grid iteration, running the inner loops in order."""

    grid: Grid

    def __str__(self) -> str:
        return f"nest per thread: {self.grid}"


@dataclass
class PointPerThread:
    """Straight-line code per grid iteration: UNROLL iterations per trip, or
    groups of VECTOR consecutive ones where vector's accesses are aligned;
    with defer, a trip's stores after all its loads."""

    grid: Grid
    defer: bool
    vector: Vector | None
    tile: tuple[str, str] | None = None  # (cols, rows): warps take TILE_COLS x TILE_ROWS tiles of these loops
    whole: tuple[str, ...] = ()  # grid loops each thread runs whole (thread_loops), the rest shared

    def __str__(self) -> str:
        vector = f", groups of {VECTOR} where aligned ({_n(len(self.vector.claims), 'access')})" if self.vector else ""
        tiles = f", warps in {TILE_COLS}x{TILE_ROWS} tiles of {' x '.join(self.tile)}" if self.tile else ""
        whole = f", {' x '.join(self.whole)} whole in each thread" if self.whole else ""
        return f"point per thread: {self.grid}{vector}{tiles}{whole}{', stores deferred' if self.defer else ''}"


@dataclass
class _StripForm:
    """Strips of a sequential loop, each a grid iteration of its own."""

    grid: Grid
    strips: Strips

    def __str__(self) -> str:
        s = self.strips
        strips = f"strips of {_n(s.size, 'iteration')} of {loop_iterator(s.loop)}"
        return f"{self.what}: {self.grid}, {strips}{self.detail()}"


class HaloStrips(_StripForm):
    """Strips of a loop that carries values only through private buffers, in
    parallel, each recomputing its halo of them."""

    what = "halo strips"

    def detail(self) -> str:
        return f" (halo {self.strips.halo}{f', ring {self.strips.ring}' if self.strips.ring else ''})"


class AtomicStrips(_StripForm):
    """Strips of a summing loop in parallel, each adding its partial sums atomically."""

    what = "atomic strips"

    def detail(self) -> str:
        s = self.strips
        outer = f" in each iteration of {', '.join(map(loop_iterator, s.outer))}" if s.outer else ""
        return f"{outer}, {_n(len(s.calls), 'sum')} added atomically, {_n(len(s.zeroed), 'array')} zeroed first"


@dataclass
class WarpRows:
    """A warp (or block) per grid iteration, its lanes sharing the inner loops."""

    grid: Grid
    lanes: int
    children: list  # the statements and loops of a row, in order
    hoisted: dict  # id(loop) -> initialization calls run before it
    reductions: dict  # id(loop) -> the reduction statements in it
    vectors: dict  # id(loop) -> its accesses in groups of VECTOR
    deferred: set = field(default_factory=set)  # id(loop) of the loops whose stores may go last in a trip
    unrolled: dict = field(default_factory=dict)  # id(loop) -> groups per lane, where unrolled whole
    guards: dict = field(default_factory=dict)  # id(child) -> the condition on the grid's iterators it runs under
    registers: frozenset = frozenset()  # rows (contracted to one) whose elements each lane keeps in registers

    def __str__(self) -> str:
        loops = [k for k in self.children if k.get_type() == isl.ast_node_type.for_]
        sums = sum(len(r) for r in self.reductions.values())
        held = f", {_n(len(self.registers), 'row')} in registers" if self.registers else ""
        return (f"warp rows: {self.grid}, {self.lanes} lanes, {_n(len(loops), 'lane loop')} ({len(self.vectors)} "
                f"in groups of {VECTOR}, {len(self.unrolled)} unrolled), {_n(sums, 'reduction')}{held}")


@dataclass
class TiledContraction:
    """A float32 contraction nest as a matrix product, a block per side x side
    tile of C: parallel loops around one or more reduction loops (their
    iterations, flattened, are the k of the product) whose only statement is
    C[...] sum= A * B, C indexed by the parallel iterators. The last parallel
    loop is j, the columns; B is the factor that reads along j, and A, which
    must not, reads along i, the last parallel loop B does not read along;
    the other parallel loops (a batch, or a convolution's image and row) are
    fixed per tile. A and B may be any expressions: a convolution's input,
    read through its padding guard, is one."""

    grid: Grid
    reds: list  # the reduction loops, outermost first
    st: Any
    a: Any
    b: Any
    grid_its: list  # per parallel loop: the statement iterator it runs
    red_its: list  # per reduction loop: the statement iterator it runs
    i: int  # the positions of i and j among the parallel loops
    j: int
    extents: list  # per parallel loop: its trip count where the AST fixes it, else None
    side: int = TILE
    depth: int = KTILE  # the reduction slice staged at once
    tensor_cores: bool = False  # 3xTF32 mma products (float32's precision), not FMAs
    stages: int = 1  # > 1: slices copied into shared memory asynchronously, stages - 1 ahead

    def __str__(self) -> str:
        i, j = (loop_iterator(self.grid.loops[q]) for q in (self.i, self.j))
        return (f"tiled contraction: {self.grid}, tiles {self.side}x{self.side} of {i} x {j}, k slices of "
                f"{self.depth} over {_n(len(self.reds), 'reduction loop')}"
                + (f", {self.stages} stages copied asynchronously" if self.stages > 1 else "")
                + (", 3xTF32 tensor cores" if self.tensor_cores else ""))


@dataclass
class ScatterPoints:
    """A scatter-add's loops all in the grid, each iteration adding its
    value at its position with an atomic (the positions it writes may repeat)."""

    grid: Grid

    def __str__(self) -> str:
        return f"scatter points: {self.grid}, added atomically"


@dataclass
class SideBySide:
    """Independent nests in one kernel (schedule.tree.side_by_side), each
    with threads of its own: of the kernel's threads, nest k takes a share
    in proportion to its points (at least one thread), for its own grid."""

    parts: list  # each nest's plan: PointPerThread or NestPerThread
    points: list[int]  # each nest's grid iterations

    def __str__(self) -> str:
        return f"side by side, {len(self.parts)} nests: " + "; ".join(map(str, self.parts))


KernelPlan = Union[Library, OneThread, NestPerThread, PointPerThread, HaloStrips, AtomicStrips, WarpRows,
                   TiledContraction, ScatterPoints, SideBySide]


# --------------------------------------------------------------- mapping
class GpuMapper(StripMapping):
    """What a kernel is mapped for: the program, its schedule and the device
    (halo strips are the CPU mapping's row strips, on a thread's bounded
    buffers: StripMapping's test, shared)."""

    def __init__(self, prog: AffineProgram, sched: Scheduled, multiprocessors: int | None = None,
                 tile_sizes: tuple[int, ...] | None = None, arch: str = DEFAULT_ARCH) -> None:
        self.prog, self.sched = prog, sched
        self.stmts = {s.name: s for s in prog.statements}
        self.multiprocessors, self.tile_sizes, self.arch = multiprocessors, tile_sizes, arch

    def tensor_cores(self) -> bool:
        """Whether the GPU multiplies TF32 in mma.sync (sm_80 on)."""
        return int(self.arch.removeprefix("sm_").rstrip("a")) >= MMA_ARCH

    def kernel(self, node: isl.AstNode) -> KernelPlan:
        """The plan of the kernel whose nest is node."""
        if side_by_side_kernel(node):
            return self.side_by_side(node)
        called = [self.stmts[n] for n in statements_in(node) if self.stmts[n].library is not None]
        if called:
            return Library(called[0])
        scatter = scatter_points(self, node)
        if scatter is not None:
            return scatter
        top = _parallel_top(node)
        if top is not None:
            return self.grid_form(top)
        if atomic_strips(self, node, set()) is not None:  # a sum of everything: strips of it in parallel
            return self.grid_form(None, node)
        return OneThread()

    def side_by_side(self, node: isl.AstNode) -> KernelPlan:
        """Each nest's grid form; one thread for all of them (in order, as
        any independent nests may run) where one has no grid of static
        extents that a thread's iterations cover alone, or where a launch's
        one block would not give each nest a thread."""
        nests = kernel_nodes(node.mark_get_node())
        if len(nests) > BLOCK:
            return OneThread()
        parts, points = [], []
        for nest in nests:
            top = _parallel_top(nest)
            plan = self.grid_form(top) if top is not None else None
            extents = [static_extent(loop) for loop in plan.grid.loops] if plan is not None else [None]
            if not isinstance(plan, (PointPerThread, NestPerThread)) or None in extents:
                return OneThread()
            parts.append(plan)
            points.append(math.prod(extents))
        return SideBySide(parts, points)

    def grid_form(self, mark: isl.AstNode | None, root: isl.AstNode | None = None) -> KernelPlan:
        """The form of the grid under mark (or, without one, of the whole sum at root)."""
        grid = self.grid(mark, root)
        loops, rest, seen = grid.loops, grid.rest, grid.iters
        tiles = tiled_contraction(self, grid)
        if tiles is not None:
            return tiles
        rows = warp_rows(self, grid) if loops else None
        if rows is not None:
            return rows
        strip = self.strip_plan(rest, seen, GPU_STRIP, bounded=True)
        if strip is not None:
            return HaloStrips(grid, strip)
        strip = atomic_strips(self, rest, seen, loops) if not self.fills_device(loops) else None
        if strip is not None:
            return AtomicStrips(grid, strip)
        if _has_loop(rest):
            return NestPerThread(grid)
        vector = vector_plan(self, rest, loops[-1], seen) if loops else None
        tile = transposing_tile(self, rest, loops, VECTOR if vector else 1)
        if tile is None and vector is not None:  # stores across the loads' vectors: whole sectors stored gain
            # more than vector loads (a channels-last batch norm gradient of NCHW operands)
            tile = transposing_tile(self, rest, loops, 1)
            vector = None if tile is not None else vector
        whole = thread_loops(self, rest, loops) if tile is None else ()
        if whole:  # (the tile's sides are too short for it)
            return PointPerThread(grid, deferrable(self, rest), None, None, whole)
        return PointPerThread(grid, deferrable(self, rest), vector, tile)

    def grid(self, mark: isl.AstNode | None, root: isl.AstNode | None) -> Grid:
        """The chain of marked loops under mark that may collapse into one
        (each splittable, its bounds free of the outer ones' iterators)."""
        loops, seen = [], set()
        rest = mark if mark is not None else root
        while rest.get_type() == isl.ast_node_type.mark and rest.mark_get_id().get_name().startswith("parallel:"):
            want = rest.mark_get_id().get_name()[len("parallel:"):]
            child = rest.mark_get_node()
            if child.get_type() == isl.ast_node_type.for_:
                if loop_iterator(child) != want or not self.splittable(child) \
                        or ast_uses(child.for_get_init(), seen) or ast_uses(child.for_get_cond(), seen):
                    rest = child
                    break
                loops.append(child)
                seen.add(want)
                rest = child.for_get_body()
            else:
                rest = child
        return Grid(mark.mark_get_id().get_name() if mark is not None else None, loops, rest, seen)

    def fills_device(self, loops: list[isl.AstNode]) -> bool:
        """Whether the grid loops alone have an iteration for a quarter of the
        threads the device holds at once: then a sum stays whole in each thread, where
        strips added atomically would only contend (MobileNetV3-small's
        convolutions, 32x96x7x7 outputs and more, each summed by one atomic
        add per input channel, took most of its time)."""
        extents = [static_extent(loop) for loop in loops]
        if not loops or None in extents:
            return False
        threads = (self.multiprocessors or DEFAULT_MULTIPROCESSORS) * THREADS_PER_MULTIPROCESSOR
        return math.prod(extents) * 4 >= threads

    def contraction_tiles(self, extents: list, i: int, j: int) -> tuple[int, int]:
        """(tile, ktile): as the options say, else 128 x 128 tiles (half the
        shared-memory reads per multiply-add) where i and j are both that long
        and there are tiles for every multiprocessor, else 64 x 64 (the larger
        tiles pay only on long products)."""
        if self.tile_sizes:
            return self.tile_sizes[0], (self.tile_sizes[1:] or (KTILE,))[0]
        if self.multiprocessors and None not in extents:
            m, n = extents[i], extents[j]
            batch = math.prod(x for q, x in enumerate(extents) if q not in (i, j))
            count = -(-m // BIG_TILE) * -(-n // BIG_TILE) * batch
            if m >= BIG_TILE and n >= BIG_TILE and count >= self.multiprocessors:
                return BIG_TILE, KTILE
        return TILE, KTILE

    def call_statement(self, call: isl.AstExpr) -> Statement:
        """The statement an AST call runs."""
        return self.stmts[call.get_op_arg(0).get_id().get_name()]


# ------------------------------------------------------ straight-line code
def deferrable(m: GpuMapper, rest: isl.AstNode) -> bool:
    """Whether rest's stores may wait until the end of a trip: straight-line
    statements that read none of the arrays they write."""
    calls = ast_calls(rest)
    if not calls:
        return False
    stmts = [m.call_statement(c) for c in calls]
    written = {st.array for st in stmts}
    return all(st.combine is None and not any(ld.array in written for ld in loads(st.body)) for st in stmts)


def vector_plan(m: GpuMapper, rest: isl.AstNode, inner: isl.AstNode, unset: set[str]) -> Vector | None:
    """The accesses of rest's statements whose last index moves with
    inner's iterator (and no other index does), from a start known before
    the loop (free of the iterators in unset): in a group of VECTOR
    iterations these are consecutive, and with VECTOR-aligned rows and
    start the first one is aligned to the group's width."""
    if inner.for_get_inc().get_val().to_python() != 1:
        return None
    it = loop_iterator(inner)
    out = Vector()
    for node in [n for n in ast_nodes(rest) if n.get_type() == isl.ast_node_type.user]:
        call = node.user_get_expr()
        st = m.call_statement(call)
        args = [call.get_op_arg(i + 1) for i in range(len(st.iters))]
        along = [(x, a) for x, a in zip(st.iters, args) if unit_step(a, it)]
        if len(along) != 1 or sum(ast_uses(a, {it}) for a in args) != 1:
            continue
        along, start = along[0]
        if ast_uses(start, unset - {it}):
            continue
        for name, index in _accesses(st):
            arr = m.prog.arrays[name]
            last = index[-1] if index else None
            if name in m.sched.contracted or arr.strided or not isinstance(last, Var) \
                    or last.kind != "iter" or last.name != along or _depends(index[:-1], {along}):
                continue
            align = min(16, VECTOR * arr.dtype.itemsize)
            out.claims[id(index)] = align
            out.arrays[name] = max(out.arrays.get(name, 1), align)
            out.starts[start.to_C_str()] = start
    return out if out.claims else None


def transposing_tile(m: GpuMapper, rest: isl.AstNode, loops: list, group: int) -> tuple[str, str] | None:
    """(cols, rows): the grid loop the stores move along and another that
    a load of the whole grid moves along instead (a transposing copy: the
    attention heads split and merged), where a thread per point makes one
    side strided, 4 bytes of each 32-byte sector. A warp then takes
    TILE_COLS of cols by TILE_ROWS of rows: whole sectors stored, half
    sectors loaded (the block's next warp loads the other halves). A
    vector group (`group` consecutive iterations of the innermost loop)
    counts as one column, where cols is that loop. Static trip counts,
    multiples of the tile's sides."""
    if len(loops) < 2:
        return None
    inner = loop_iterator(loops[-1])
    trips = {loop_iterator(x): static_extent(x) if x.for_get_inc().get_val().to_python() == 1 else None
             for x in loops}
    tile = None
    for node in [n for n in ast_nodes(rest) if n.get_type() == isl.ast_node_type.user]:
        call = node.user_get_expr()
        st = m.call_statement(call)
        args = dict(zip(st.iters, (call.get_op_arg(i + 1) for i in range(len(st.iters)))))
        cols = _moves_along(st.index, args, trips)
        if cols is None:
            return None
        for ld in loads(st.body):
            used = {q for x in ld.index for y in walk(x) if isinstance(y, Var) and y.name in args
                    for q in trips if ast_uses(args[y.name], {q})}
            rows = _moves_along(ld.index, args, trips) if used == set(trips) else None
            if rows is not None and rows != cols and not any(
                    ast_uses(args[y.name], {cols}) for y in walk(ld.index[-1]) if isinstance(y, Var) and y.name in args):
                tile = tile or (cols, rows)
    if tile is None or (tile[0] != inner and group > 1):
        return None
    cols, rows = tile
    side = TILE_COLS * (group if cols == inner else 1)
    return tile if trips[cols] and trips[rows] and trips[cols] % side == 0 and trips[rows] % TILE_ROWS == 0 else None


def thread_loops(m: GpuMapper, rest: isl.AstNode, loops: list) -> tuple[str, ...]:
    """The grid loops of a small block that one side of a transposing copy
    holds contiguous (an image's 3 channels, a 3x3 filter's taps) where the
    other side's last index moves along a long loop: a thread then runs the
    block whole, so that across the warp each of its accesses moves along
    the long loop (whole sectors), and the block's own accesses, one per
    copy, fill their sectors together (through L1 for loads, L2 for
    stores). With the block in the grid, one side or the other is strided
    (OIHW weights to OHWI: 4 bytes of each sector at a time). Empty where
    no access holds such a block, or no other moves along the grid's
    innermost loop left."""
    if len(loops) < 2 or not all(x.for_get_inc().get_val().to_python() == 1 for x in loops):
        return ()
    trips = {loop_iterator(x): static_extent(x) for x in loops}
    if None in trips.values():
        return ()
    block, lasts = set(), set()
    for node in [n for n in ast_nodes(rest) if n.get_type() == isl.ast_node_type.user]:
        call = node.user_get_expr()
        st = m.call_statement(call)
        args = (call.get_op_arg(i + 1) for i in range(len(st.iters)))
        loop_of = {x: a.get_id().get_name() for x, a in zip(st.iters, args)  # iterator -> the grid loop it is
                   if a.get_type() == isl.ast_expr_type.id and a.get_id().get_name() in trips}
        for name, index in _accesses(st):
            arr = m.prog.arrays[name]
            if arr.strided or name in m.sched.contracted or not index:
                continue
            last = index[-1]
            if isinstance(last, Var) and last.kind == "iter" and last.name in loop_of:
                lasts.add(loop_of[last.name])
            held, size = [], 1
            for x, extent in zip(reversed(index), reversed(arr.shape)):
                q = loop_of.get(x.name) if isinstance(x, Var) and x.kind == "iter" else None
                if q is None or trips[q] != extent or size * extent > THREAD_BLOCK:
                    break
                held.append(q)
                size *= extent
            if size > 1:
                block.update(held)
    left = [loop_iterator(x) for x in loops if loop_iterator(x) not in block]
    if not block or not left or left[-1] not in lasts or trips[left[-1]] <= THREAD_BLOCK:
        return ()
    return tuple(loop_iterator(x) for x in loops if loop_iterator(x) in block)


def _accesses(st: Statement) -> list[tuple[str, tuple]]:
    """(array, index) of each load of st's body, then of its store."""
    return [(ld.array, ld.index) for ld in loads(st.body)] + [(st.array, st.index)]


def _moves_along(index, args: dict, trips: dict) -> str | None:
    """The grid loop an access's last index moves by one with, if any."""
    v = next((x for x in args if moves_by_one(index[-1], x)), None) if index else None
    return next((q for q in trips if unit_step(args[v], q)), None) if v is not None else None


# -------------------------------------------------------------- scatters
def scatter_points(m: GpuMapper, node: isl.AstNode) -> ScatterPoints | None:
    """The grid of a kernel that only adds values where loaded positions say
    (an embedding's or a max pool's gradient), in a perfect nest: its loops
    carry no dependence but the additions' own, which atomics make safe; a
    thread per outer iteration ran the rest in order (a max pool's gradient,
    32x64x56x56, took 2.6 ms on an H100 as a thread per image and channel)."""
    stmts = [m.stmts[name] for name in statements_in(node)]
    targets = {st.array for st in stmts}
    if not stmts or any(st.combine not in ATOMIC_COMBINES or not any(loads(i) for i in st.index)
                        or m.prog.arrays[st.array].dtype not in ATOMIC_DTYPES or st.array in m.sched.contracted
                        or any(ld.array in targets for ld in loads(st.body)) for st in stmts):
        return None
    loops, seen, rest = [], set(), node
    while True:
        if rest.get_type() == isl.ast_node_type.mark:
            rest = rest.mark_get_node()
        elif rest.get_type() == isl.ast_node_type.for_ and m._free(rest, seen):
            loops.append(rest)
            seen.add(loop_iterator(rest))
            rest = rest.for_get_body()
        else:
            break
    calls = ast_children(rest) or [rest]
    if not loops or any(k.get_type() != isl.ast_node_type.user for k in calls):
        return None
    return ScatterPoints(Grid(None, _contiguous_last(m, loops, calls), rest, seen))


def _contiguous_last(m: GpuMapper, loops: list, calls: list) -> list:
    """loops (free of each other, so in any order) with the one the first
    statement's target moves along last: consecutive threads then add to
    consecutive addresses, a warp's atomics one memory transaction where
    they were 32 (an embedding's gradient, its rows picked by the ids,
    had its column loop outermost)."""
    call = calls[0].user_get_expr()
    st = m.call_statement(call)
    args = dict(zip(st.iters, (call.get_op_arg(i + 1) for i in range(len(st.iters)))))
    trips = {loop_iterator(x): None for x in loops if x.for_get_inc().get_val().to_python() == 1}
    cols = _moves_along(st.index, args, trips)
    return [x for x in loops if loop_iterator(x) != cols] + [x for x in loops if loop_iterator(x) == cols]


# ---------------------------------------------------------------- strips
def atomic_strips(m: GpuMapper, rest: isl.AstNode, grid_iters: set[str], grid_loops: list = ()) -> Strips | None:
    """Strips of a sum when rest zeroes some arrays and then one loop (or
    perfect nest) sums into elements that do not move with it (a column
    sum): strips run in parallel, each adding its partial sums
    atomically; the runtime zeroes the arrays before the launch. In a
    perfect nest whose bounds are free of each other, the innermost loop
    is stripped and each strip runs in one iteration of the loops around
    it. A strip per iteration of the outer loop had left too few loads in
    flight: a [32, 3136, 64] sum over its first two dimensions (a
    channels-last batch norm's) took 30x as long (bench/NOTES.md). Column
    strips are shorter where the grid and strips would leave the device's
    threads idle (_column_strip)."""
    kids = ast_children(rest)
    if not kids or kids[-1].get_type() != isl.ast_node_type.for_:
        return None
    loop, inits = kids[-1], kids[:-1]
    if not m._free(loop, grid_iters):
        return None
    calls = ast_children(loop.for_get_body())
    nest = [loop_iterator(loop)]
    while calls and len(calls) == 1 and calls[0].get_type() == isl.ast_node_type.for_:
        nest.append(loop_iterator(calls[0]))  # a perfect nest: each thread takes one outer iteration
        calls = ast_children(calls[0].for_get_body())
    if not calls or any(c.get_type() != isl.ast_node_type.user for c in calls):
        return None
    targets = set()
    for c in calls:
        st = m.call_statement(c.user_get_expr())
        dt = m.prog.arrays[st.array].dtype
        if st.combine not in ATOMIC_COMBINES or st.array in m.sched.contracted \
                or any(any(m._write_moves(loop, st, x)) for x in nest) \
                or dt not in ATOMIC_DTYPES:
            return None
        targets.add(st.array)
    zeroed = _zeroed_first(m, inits, targets)
    if zeroed is None or any(ld.array in targets for c in calls
                             for ld in loads(m.call_statement(c.user_get_expr()).body)):
        return None
    sums = [c.user_get_expr() for c in calls]
    if len(nest) == 1:
        size = _column_strip(m, list(grid_loops), [], loop) if grid_iters else STRIP_REDUCE
        return Strips(loop, size, 0, tuple(sorted(zeroed)), sums)
    loops = [loop]
    while len(loops) < len(nest):
        loops.append(ast_children(loops[-1].for_get_body())[0])
    if all(m._free(x, grid_iters | set(nest) - {loop_iterator(x)}) for x in loops):
        size = _column_strip(m, list(grid_loops), loops[:-1], loops[-1])
        return Strips(loops[-1], size, 0, tuple(sorted(zeroed)), sums, outer=loops[:-1])
    return Strips(loop, 1, 0, tuple(sorted(zeroed)), sums)


def _column_strip(m: GpuMapper, grid: list, outer: list, stripped: isl.AstNode) -> int:
    """STRIP_COLUMN iterations a strip, halved (to a quarter at most) while
    the grid, the loops around the strips and the strips themselves give
    fewer threads than the device holds at once: BERT's bias gradients
    (768 columns of 4096 rows, some recomputing a layer norm's gradient
    from five arrays) ran 49152 threads, a dozen warps a multiprocessor.
    Only over COLUMN_STRIP_TARGETS sums or more: shorter strips add more
    atomics to each sum, which a batch norm's 32 channels would queue on."""
    extents = [static_extent(x) for x in grid + outer + [stripped]]
    if None in extents or math.prod(extents[:len(grid)]) < COLUMN_STRIP_TARGETS:
        return STRIP_COLUMN
    threads = (m.multiprocessors or DEFAULT_MULTIPROCESSORS) * THREADS_PER_MULTIPROCESSOR
    size = STRIP_COLUMN
    while size > STRIP_COLUMN // 4 and math.prod(extents[:-1]) * -(-extents[-1] // size) < threads:
        size //= 2
    return size


def _zeroed_first(m: GpuMapper, inits: list, targets: set[str]) -> set[str] | None:
    """The arrays the statements inits set to zero, where each is one of targets."""
    zeroed = set()
    for k in inits:
        if k.get_type() != isl.ast_node_type.user:
            return None
        st = m.call_statement(k.user_get_expr())
        if st.array not in targets or not isinstance(st.body, Const) or st.body.value != 0:
            return None
        zeroed.add(st.array)
    return zeroed


# ------------------------------------------------------------- warp rows
def warp_rows(m: GpuMapper, grid: Grid) -> WarpRows | None:
    """A warp per grid iteration where the nest below is a sequence of
    statements and one-level loops whose statements either write elements
    along the loop (read back only at the same element) or reduce into one
    element; and lanes walking the loops touch contiguous memory more often
    than threads walking the parallel loop would."""
    kids = ast_children(grid.rest)
    if kids is None:
        return None
    kids, guards = _unguarded(kids)
    if kids is None or not any(k.get_type() == isl.ast_node_type.for_ for k in kids):
        return None
    plan = WarpRows(grid, WARP, kids, {}, {}, {}, guards=guards)
    grid_it = loop_iterator(grid.loops[-1])
    lanes_contiguous = threads_contiguous = 0
    for k in kids:
        if k.get_type() == isl.ast_node_type.user:
            continue
        if k.get_type() != isl.ast_node_type.for_ or not m.splittable(k):
            return None
        counts = _lane_loop(m, plan, k, grid_it)
        if counts is None:
            return None
        lanes_contiguous += counts[0]
        threads_contiguous += counts[1]
    if lanes_contiguous <= threads_contiguous:
        return None
    trips = [static_extent(k) for k in kids if k.get_type() == isl.ast_node_type.for_]
    if all(t is not None and t >= BLOCK_ROW for t in trips):
        plan.lanes = BLOCK  # long rows: a block each, so that rereading one hits the cache
    for loop in kids:
        if loop.get_type() == isl.ast_node_type.for_:
            _lane_groups(m, plan, loop)
    registers = _row_registers(m, plan)
    if registers is None:
        return None
    plan.registers = registers
    return plan


def _row_moduli(moduli: tuple) -> bool:
    """Whether a buffer contracted to these moduli holds a thread's scalar or
    one row: one element along each dim but those it keeps whole."""
    return all(x in (1, None) for x in moduli)


def _row_buffer(arr, moduli: tuple | None) -> bool:
    """Whether a buffer contracted to moduli holds a row: whole along a dim
    of more than one element, one element along the others."""
    return moduli is not None and _row_moduli(moduli) and any(
        x is None and not (sz.is_static(s) and int(s) == 1) for x, s in zip(moduli, arr.shape))


def _row_registers(m: GpuMapper, plan: WarpRows) -> frozenset | None:
    """The buffers contracted to a row (whole along some dim) that the row's
    lanes hold, each lane its own elements in registers; None where one
    cannot be held so: every loop that touches it must be unrolled whole,
    each access must reach the same element at the same step of its loop
    (a lane's k-th element is then the same one in each: isl may shift the
    loops of a row one after another), and neither the loop nor the
    statement may be under a guard (a register must reach every read)."""
    held, steps = set(), {}
    for child in plan.children:
        loop = child.get_type() == isl.ast_node_type.for_
        guarded = set() if not loop else {
            m.call_statement(g.if_get_then_node().user_get_expr()).name
            for g in ast_children(child.for_get_body()) or () if g.get_type() == isl.ast_node_type.if_}
        for node in ast_nodes(child):
            if node.get_type() != isl.ast_node_type.user:
                continue
            call = node.user_get_expr()
            st = m.call_statement(call)
            for a, index in _accesses(st):
                moduli = m.sched.contracted.get(a)
                if not _row_buffer(m.prog.arrays[a], moduli):
                    continue
                if not loop or id(child) not in plan.unrolled or id(child) in plan.guards or st.name in guarded:
                    return None
                step = _row_step(m.prog.arrays[a], moduli, index, call, st, child)
                if step is None or steps.setdefault(a, step) != step:
                    return None
                held.add(a)
    return frozenset(held)


def _row_step(arr, moduli: tuple, index: tuple, call: isl.AstExpr, st: Statement, loop: isl.AstNode) -> tuple | None:
    """(the loop's trips, then per dim a row buffer keeps whole: its index
    at the loop's first step, and 1 where it moves with the loop, else 0);
    None where such an index is not one of the statement's iterators, or
    moves otherwise."""
    it, first = loop_iterator(loop), ast_affine(loop.for_get_init())
    if first is None or set(first) - {""}:
        return None
    args = {x: call.get_op_arg(i + 1) for i, x in enumerate(st.iters)}
    out = [static_extent(loop)]
    for e, x, extent in zip(index, moduli, arr.shape):
        if x is not None or (sz.is_static(extent) and int(extent) == 1):
            continue
        if not isinstance(e, Var) or e.name not in args:
            return None
        c = ast_affine(args[e.name])
        if c is None or set(c) - {it, ""} or c.get(it, 0) not in (0, 1):
            return None
        out.append((c.get(it, 0) * first.get("", 0) + c.get("", 0), c.get(it, 0)))
    return tuple(out)


def held_rows(prog: AffineProgram, ast: isl.AstNode, rows: dict, kept: dict) -> dict:
    """Of rows (buffers contracted to one row, too large for a thread), those
    the lanes of a warp-rows kernel hold in registers (WarpRows.registers),
    mapped with kept and rows contracted: a layer norm's centred row, read
    for its variance and again for its result, stays in the lanes that
    computed it instead of going to memory and back."""
    rows = {n: m for n, m in rows.items() if n not in kept and _row_buffer(prog.arrays[n], m)
            and on_stack(prog.arrays[n], m)}  # (a kernel emitted otherwise keeps it on its stack)
    if not rows:
        return {}
    mapper = GpuMapper(prog, Scheduled(None, ast, {**kept, **rows}))
    held = {}
    for node in kernel_nodes(ast):
        if not any(a in rows for n in statements_in(node) for a, _ in _accesses(mapper.stmts[n])):
            continue
        plan = mapper.kernel(node)
        if isinstance(plan, WarpRows):
            held.update((n, rows[n]) for n in plan.registers)
    return held


def _unguarded(kids: list) -> tuple[list | None, dict]:
    """A row's children with the guards taken off those isl put under a
    condition on the grid's iterators alone (a class token's layer norm
    output, read for one token of each image, under its statistics for
    all): a row's lanes all take such a branch or none, so the lanes may
    share what it guards. (None, {}) where a branch has an else or more
    than one statement or loop."""
    out, guards = [], {}
    for k in kids:
        if k.get_type() == isl.ast_node_type.if_:
            then = k.if_get_then_node()
            if k.if_has_else_node() or then.get_type() not in (isl.ast_node_type.for_, isl.ast_node_type.user):
                return None, {}
            guards[id(then)] = k.if_get_cond()
            k = then
        out.append(k)
    return out, guards


def _lane_groups(m: GpuMapper, plan: WarpRows, loop: isl.AstNode) -> None:
    """How a lane loop runs: in groups of VECTOR where its accesses allow (one
    check at the row's start finds every lane loop's groups aligned), unrolled
    whole where it has at most ROW_GROUPS groups per lane (a row read again
    then comes from registers), its stores last in a trip where they may be."""
    trips = static_extent(loop)
    per = plan.lanes * VECTOR
    vector = vector_plan(m, loop.for_get_body(), loop, set())
    if vector is not None:
        plan.vectors[id(loop)] = vector
        if trips and trips % per == 0 and 0 < trips // per <= ROW_GROUPS:
            plan.unrolled[id(loop)] = trips // per
    if deferrable(m, loop.for_get_body()):
        plan.deferred.add(id(loop))


def _lane_loop(m: GpuMapper, plan: WarpRows, k: isl.AstNode, grid_it: str) -> tuple[int, int] | None:
    """Whether the lanes may share loop k (its initializations and reductions
    noted in plan); and how many of its accesses are contiguous along it and
    along the grid's innermost iterator grid_it."""
    calls = ast_children(k.for_get_body())
    if calls is None:
        return None
    it = loop_iterator(k)
    inits, guarded = _hoisted(k, calls, it)
    calls = [c for c in calls if c.get_type() != isl.ast_node_type.if_] + list(guarded)
    if inits is None or any(c.get_type() != isl.ast_node_type.user for c in calls):
        return None
    plan.reductions[id(k)] = []
    found = _row_statements(m, calls, it, grid_it, plan.reductions[id(k)],
                            {id(c): _equalities(cond) for c, cond in guarded.items()})
    if found is None:
        return None
    stmts, written, reduced = found
    for call in inits:
        st = m.call_statement(call)
        if st.combine is not None or not isinstance(st.body, Const) or st.array not in reduced:
            return None
    plan.hoisted[id(k)] = inits
    return _contiguity(stmts, written, reduced)


def _hoisted(k: isl.AstNode, calls: list, it: str) -> tuple[list | None, dict]:
    """(the initializations isl placed at one iteration of loop k, guarded
    calls whose indices are free of it: they run before the loop; the
    statements along k under a condition free of it, which every lane of
    the row takes or none, each with its condition: a class token's copy
    of its layer norm's row beside the whole output, which the emitted
    loop keeps under its guard)."""
    inits, guarded = [], {}
    for g in calls:
        if g.get_type() != isl.ast_node_type.if_:
            continue
        then = g.if_get_then_node()
        if g.if_has_else_node() or then.get_type() != isl.ast_node_type.user:
            return None, {}
        call = then.user_get_expr()
        if any(ast_uses(call.get_op_arg(i), {it}) for i in range(1, call.get_op_n_arg())):
            if ast_uses(g.if_get_cond(), {it}):
                return None, {}
            guarded[then] = g.if_get_cond()
        else:
            inits.append(call)
    return inits, guarded


def _equalities(cond: isl.AstExpr) -> dict[str, str]:
    """The iterators a condition fixes, as text (``c1 == 0 && c2 == 3``:
    {"c1": "0", "c2": "3"}); those of its other terms are not known."""
    op = cond.get_op_type() if cond.get_type() == isl.ast_expr_type.op else None
    if op == isl.ast_expr_op_type.and_:
        return {**_equalities(cond.get_op_arg(0)), **_equalities(cond.get_op_arg(1))}
    if op == isl.ast_expr_op_type.eq:
        a, b = cond.get_op_arg(0), cond.get_op_arg(1)
        if a.get_type() == isl.ast_expr_type.id and b.get_type() == isl.ast_expr_type.int:
            return {a.get_id().get_name(): b.to_C_str()}
    return {}


def _row_statements(m: GpuMapper, calls: list, it: str, grid_it: str, reductions: list[str],
                    fixed: dict[int, dict]) -> tuple | None:
    """What a lane loop's statements write (along the loop, by index) and
    reduce (appended to reductions); None where one does neither. fixed:
    id(call) -> the iterators its guard fixes (_equalities)."""
    written: dict[str, tuple] = {}
    reduced: set[str] = set()
    stmts = []
    for c in calls:
        call = c.user_get_expr()
        s = m.call_statement(call)
        args = [call.get_op_arg(i + 1) for i in range(len(s.iters))]
        along = {x for x, a in zip(s.iters, args) if ast_uses(a, {it})}
        grid = {x for x, a in zip(s.iters, args) if ast_uses(a, {grid_it})}
        text = {x: a.to_C_str() for x, a in zip(s.iters, args)}
        stmts.append((s, along, grid, text, fixed.get(id(c), {})))
        deps = _depends(s.index, along)
        if s.combine is not None and not deps:
            reduced.add(s.array)
            reductions.append(s.name)
        elif s.combine is None and deps:
            moduli = m.sched.contracted.get(s.array)
            key = _index_text(s.index, text)
            if key is None or (moduli is not None and not _row_moduli(moduli)) or s.array in written:
                return None
            written[s.array] = key
        else:
            return None
    return stmts, written, reduced


def _contiguity(stmts: list, written: dict, reduced: set[str]) -> tuple[int, int] | None:
    """(accesses contiguous along the lane loop, along the grid loop); None
    where a statement reads a reduction's target, or a written element
    elsewhere than where it was written."""
    lanes_contiguous = threads_contiguous = 0
    for s, along, grid, text, fixed in stmts:
        for ld in loads(s.body):
            if ld.array in reduced:
                return None
            if ld.array in written and _index_text(ld.index, text) != tuple(
                    fixed.get(c, c) for c in written[ld.array]):  # (under a guard: the element it fixes)
                return None
        accesses = {(ld.array, str(ld.index)): ld.index for ld in loads(s.body)}
        if not s.combine:
            accesses[s.array, str(s.index)] = s.index
        for index in accesses.values():  # once each; a row's own scalars (gather indices) do not count,
            # nor what every grid iteration reads alike (a warp's threads read it at once)
            if index and _depends(index, along) and _depends(index, grid):
                lanes_contiguous += _depends(index[-1:], along)
                threads_contiguous += _depends(index[-1:], grid)
    return lanes_contiguous, threads_contiguous


# ---------------------------------------------------------- contractions
def tiled_contraction(m: GpuMapper, grid: Grid) -> TiledContraction | None:
    """The grid's nest as a tiled contraction (see TiledContraction), where it is one."""
    loops, rest = grid.loops, grid.rest
    reds = []
    while rest.get_type() == isl.ast_node_type.for_:
        reds.append(rest)
        rest = rest.for_get_body()
    if len(loops) < 2 or not reds or rest.get_type() != isl.ast_node_type.user:
        return None
    names = [loop_iterator(x) for x in loops + reds]
    if any(x.for_get_inc().get_val().to_python() != 1 for x in loops + reds) \
            or any(ast_uses(x.for_get_init(), set(names)) or ast_uses(x.for_get_cond(), set(names) - {loop_iterator(x)})
                   for x in reds):
        return None
    call = rest.user_get_expr()
    st = m.call_statement(call)
    args = [call.get_op_arg(q + 1) for q in range(call.get_op_n_arg() - 1)]
    if len(args) != len(names) or any(a.get_type() != isl.ast_expr_type.id for a in args):
        return None
    loop_of = {it: names.index(a.get_id().get_name()) if a.get_id().get_name() in names else -1
               for it, a in zip(st.iters, args)}
    if sorted(loop_of.values()) != list(range(len(names))):
        return None
    its = sorted(st.iters, key=lambda it: loop_of[it])
    grid_its, red_its = its[:len(loops)], its[len(loops):]
    if not _product(m, st, grid_its):
        return None
    factors = _factors(st.body, grid_its)
    if factors is None:
        return None
    a, b, i = factors
    j = len(loops) - 1
    extents = [static_extent(x) for x in loops]
    side, depth = m.contraction_tiles(extents, i, j)
    mma = m.tensor_cores() and side >= MMA_SIDE and depth % MMA_K == 0
    # plain factors (not a convolution's guarded input) go from global to shared memory by cp.async
    copied = mma and isinstance(a, Load) and isinstance(b, Load) \
        and 2 * MMA_STAGES * depth * (side + MMA_PAD) * 4 <= STATIC_SHARED
    return TiledContraction(grid, reds, st, a, b, grid_its, red_its, i, j, extents, side, depth, mma,
                            MMA_STAGES if copied else 1)


def _product(m: GpuMapper, st, grid_its: list[str]) -> bool:
    """Whether st is C[grid iterators] sum= x * y on float32 arrays, C not read."""
    body, arrays = st.body, m.prog.arrays
    return not (scalar.product_factors(st.combine, body) is None or st.array in m.sched.contracted
                or sorted(getattr(x, "name", "") for x in st.index) != sorted(grid_its)
                or any(arrays[x].dtype is not DataType.Float for x in [st.array] + [ld.array for ld in loads(body)])
                or any(ld.array in m.sched.contracted or ld.array == st.array for ld in loads(body)))


def _factors(body: Op, grid_its: list[str]) -> tuple | None:
    """(A, B, i): B the one factor that reads along j (the last grid
    iterator), i the last grid loop A reads along and B does not."""
    j = len(grid_its) - 1
    reading = [x for x in body.args if grid_its[j] in iter_vars(x)]
    if len(reading) != 1:
        return None
    b = reading[0]
    a = body.args[1] if body.args[0] is b else body.args[0]
    rows = [q for q in range(j) if grid_its[q] in iter_vars(a) and grid_its[q] not in iter_vars(b)]
    return (a, b, rows[-1]) if rows else None


# --------------------------------------------------------------- helpers
def _n(count: int, what: str) -> str:
    return f"{count} {what}{'' if count == 1 else 'es' if what.endswith('s') else 's'}"


def _has_loop(n: isl.AstNode) -> bool:
    return any(x.get_type() == isl.ast_node_type.for_ for x in ast_nodes(n))


def _depends(index, names: set[str]) -> bool:
    return any(iter_vars(i) & names for i in index)


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


def _parallel_top(node: isl.AstNode) -> isl.AstNode | None:
    """The parallel mark that encloses all of the kernel (below guards on
    sizes only), or None: only such a loop may be dealt to threads without
    a barrier between its iterations and the rest of the nest."""
    while True:
        t = node.get_type()
        if t == isl.ast_node_type.if_ and not node.if_has_else_node():
            node = node.if_get_then_node()
        elif t == isl.ast_node_type.mark:
            if node.mark_get_id().get_name().startswith("parallel:"):
                return node
            node = node.mark_get_node()
        else:
            return None
