"""The cpu target's rewrites: contractions tiled and blocked in registers,
transposing copies tiled, short parallel loops helped by strips of an inner
one, and an innermost loop per statement."""
from __future__ import annotations

import islpy as isl

from ..affine import AffineProgram, Role
from ..expr import Var, loads, walk
from .dependences import legal_or_kept
from .rewrites import mark_parallel
from .tree import (band_sizes, contractions_in, member_extent, member_iter, member_trips, product_inits,
                   rebuild_band, statement_names, unroll_mark, visit)


REG_VECTORS = 4  # a register block of a contraction, where sizes are symbolic: rows x four vectors of columns
MAX_VECTORS = 4  # the widest block, in vectors: a reduction tile of its columns stays in L1
TILE_ROWS, TILE_RED, TILE_COLS = 64, 128, 256
UNTILED = 1 << 30  # a tile size no loop reaches


def _block_sizes(node, prog, n):
    """Per member: (role, tile size) with roles 'red', 'col' (innermost), 'row'."""
    mupa = node.band_get_partial_schedule()
    red = set()
    for s in contractions_in(node, prog):
        for m in range(n):
            d = member_iter(mupa.get_at(m)).get(s.name)
            if d is not None and s.iters[d] in s.reduction_iters:
                red.add(m)
    col = max((m for m in range(n) if m not in red), default=None)
    return ["red" if m in red else "col" if m == col else "row" for m in range(n)]


def _row_member(node, prog, roles) -> int | None:
    """The member a register block spans as its rows: the one the most
    operands do not depend on while they walk the columns (those operands'
    vectors then serve every row: B[k, j] for rows i of A[i, k] * B[k, j]);
    the innermost such member on a tie."""
    st = contractions_in(node, prog)[0]
    mupa = node.band_get_partial_schedule()
    follows = [member_iter(mupa.get_at(m)).get(st.name) for m in range(len(roles))]
    col = follows[roles.index("col")] if "col" in roles else None
    operands = [ld.index for ld in loads(st.body)]

    def uses(index, d):
        return d is not None and any(isinstance(x, Var) and x.name == st.iters[d] for i in index for x in walk(i))
    best, best_score = None, -1
    for m, r in enumerate(roles):
        if r != "row" or follows[m] is None:
            continue
        score = sum(1 for index in operands if uses(index, col) and not uses(index, follows[m]))
        if score >= best_score:
            best, best_score = m, score
    return best


def merge_reductions(node, prog) -> isl.ScheduleNode:
    """Fold the bands below a contraction's band that only run its reduction
    (isl puts each later reduction loop in a band of its own, since the
    reduction's order is not permutable) into that band, in their order, so
    that a register block holds the whole reduction inside it."""
    st = contractions_in(node, prog)[0]
    mupa = node.band_get_partial_schedule()
    n = node.band_n_member()
    coinc = [node.band_member_get_coincident(m) for m in range(n)]
    child = node.child(0)
    merged = 0
    while child.get_type() == isl.schedule_node_type.band:
        cm = child.band_get_partial_schedule()
        its = [member_iter(cm.get_at(m)).get(st.name) for m in range(child.band_n_member())]
        if any(d is None or st.iters[d] not in st.reduction_iters for d in its):
            break
        mupa = mupa.flat_range_product(cm)
        coinc += [False] * len(its)
        child = child.delete()
        merged += 1
    if merged:
        node = child.parent().delete().insert_partial_schedule(mupa).band_set_permutable(True)
        for m, c in enumerate(coinc):
            node = node.band_member_set_coincident(m, c)
    return node


def accumulators(lanes: int) -> int:
    """The most vectors a register block accumulates in, the other registers
    holding its operands: half of AVX-512's 32; 12 of AVX2's 16, where a
    block of four vectors' columns holds its rows' broadcasts and a column
    vector in the other four (16 accumulators spilled there: a generated
    512x256x256 product took twice as long, MobileNetV3's training step
    1.2x). Fewer where whole blocks of rows call for it: 512 rows take two
    rows of four vectors on AVX2 (block_shape)."""
    return 16 if lanes >= 16 else 12


def block_shape(rows: int | None, cols: int | None, lanes: int) -> tuple[int, int]:
    """(rows, columns) of a contraction's register block for a result of
    rows x cols (None: symbolic). Its columns divide cols where a width of
    up to MAX_VECTORS vectors does, and its rows divide rows where that
    keeps the accumulators busy: a partial block is code with a guard on
    each product (a 784-column image ran at a third of the speed of 768), and
    a block of fewer than accumulators(lanes) vectors waits on its FMAs'
    latency (16 columns by 4 rows: a fifth of the speed of 16 by 16)."""
    return _block_choice(rows, cols, lanes)[0]


def block_fit(rows: int, cols: int, lanes: int) -> float:
    """How well block_shape's block fits a rows x cols result: 1.0 where
    the blocks are whole and keep every accumulator busy, less for guarded
    partial blocks, partial vectors or idle accumulators."""
    return _block_choice(rows, cols, lanes)[1]


def _block_choice(rows: int | None, cols: int | None, lanes: int) -> tuple[tuple[int, int], float]:
    acc = accumulators(lanes)
    default = (acc // REG_VECTORS, REG_VECTORS * lanes)
    if cols is None:
        return default, 0.0
    best, best_score = default, -1.0
    for c in range(min(cols, MAX_VECTORS * lanes), 0, -1):  # the widest of equals: fewer broadcasts
        if cols % c and c != REG_VECTORS * lanes:
            continue
        # the vectors LLVM makes of c columns: whole ones, then a power of two for each bit of the rest
        vectors = c // lanes + bin(c % lanes).count("1")
        most = max(1, acc // vectors)
        r = max(1, min(most, rows) if rows is not None else most)
        if rows is not None and rows % r:
            whole = max((d for d in range(1, r + 1) if rows % d == 0))
            r = whole if 2 * whole >= r else r
        score = c / (vectors * lanes) * min(1.0, r * vectors / acc) \
            * (0.5 if cols % c or (rows is not None and rows % r) else 1.0)
        if score > best_score + 1e-9:
            best, best_score = (r, c), score
    return best, best_score


def register_block(point, roles, row, shape: tuple[int, int]) -> isl.ScheduleNode:
    """Within a tile: loop over register blocks (shape: rows, columns), then
    the reduction, with the block itself unrolled, so its accumulators stay
    in vector registers."""
    n = len(roles)
    rows, cols = shape
    sizes = [cols if r == "col" else rows if m == row else 1 for m, r in enumerate(roles)]
    node = point.band_tile(band_sizes(point, sizes))
    order = [m for m in range(n) if roles[m] != "red"] + [m for m in range(n) if roles[m] == "red"]
    coinc = [node.band_member_get_coincident(m) for m in range(n)]
    node = rebuild_band(node, order, coinc, True)
    inner = node.child(0)
    for m in range(n):
        inner = inner.band_member_set_ast_loop_type(m, isl.ast_loop_type.unroll)
    return inner.parent()


def _tiling(node, roles, row, lanes: int) -> tuple[list[int], tuple[int, int]]:
    """A contraction band's tile sizes per member and its register block's
    shape: tiles whole numbers of blocks, and rows tiled finer where the
    loops outside them would otherwise give the thread team fewer than
    MIN_PARALLEL_EXTENT tiles to share (64 output channels: one tile)."""
    ext = [member_extent(node, m) for m in range(len(roles))]
    rows, cols = shape = block_shape(ext[row] if row is not None else None,
                                     ext[roles.index("col")] if "col" in roles else None, lanes)
    tile_rows = rows * max(1, TILE_ROWS // rows)
    if row is not None and ext[row] is not None:
        outside = 1
        for m in range(row):
            if roles[m] == "row":
                outside *= -(-(ext[m] or TILE_ROWS * MIN_PARALLEL_EXTENT) // TILE_ROWS)
        wanted = -(-MIN_PARALLEL_EXTENT // outside)
        if -(-ext[row] // tile_rows) < wanted:
            tile_rows = max(rows, ext[row] // wanted // rows * rows)
    sizes = [TILE_RED if r == "red" else cols * max(1, TILE_COLS // cols) if r == "col"
             else tile_rows if m == row else TILE_ROWS for m, r in enumerate(roles)]
    return sizes, shape


def block_fused(node, prog, lanes: int) -> isl.ScheduleNode:
    """Tile and register-block the output band of fuse_contraction's nest;
    the unrolled block sinks below each statement (below the reduction's
    loops for the update), so a block's initialization, reduction and
    epilogue run one after another on the same registers."""
    roles = _block_sizes(node, prog, node.band_n_member())
    if "red" in roles:
        return node
    row = _row_member(node, prog, roles)
    sizes, shape = _tiling(node, roles, row, lanes)
    node = node.band_tile(band_sizes(node, sizes))
    block = register_block(node.child(0), roles, row, shape)
    seq = block.child(0).band_sink()
    inits = product_inits(prog)
    for i in range(seq.n_children()):
        band = seq.child(i).child(0)
        if statement_names(band) & inits or contractions_in(band, prog):
            continue
        # the epilogue loops over the block instead: LLVM vectorizes its math
        # along the columns (unrolled, tanh's code was left scalar: 3x slower)
        for m in range(band.band_n_member()):
            band = band.band_member_set_ast_loop_type(m, isl.ast_loop_type.default)
        seq = band.parent().parent()
    return seq.parent().parent()


def _rows_outside_reduction(node, roles, row):
    """The band with its reduction members moved inside the block rows'
    member, as a matrix product's (rows, reduction, columns): a reduction
    loop outside the rows (the flipped kernel of a convolution's input
    gradient reads its reduction channels outermost) is the outermost loop
    of its tiles once a batch of two images fits one tile, and nothing
    outside it runs in parallel."""
    n = len(roles)
    order = [m for m in range(row + 1) if roles[m] != "red"] + [m for m in range(n) if roles[m] == "red"] \
        + [m for m in range(row + 1, n) if roles[m] != "red"]
    node = rebuild_band(node, order, [node.band_member_get_coincident(m) for m in range(n)], True)
    return node, [roles[m] for m in order], order.index(row)


def tile(schedule, prog, validity, tile_sizes, vector_bits: int = 512) -> isl.Schedule:
    """Tile outer permutable bands with reuse (contractions), or every one when
    tile_sizes is given; contractions also get register blocks of vectors of
    the host's width (float32 lanes), shaped by block_shape (its shape for
    symbolic sizes under tile_sizes)."""
    lanes = vector_bits // 32

    def fn(node):
        if node.get_type() != isl.schedule_node_type.band or not node.band_get_permutable():
            return node
        n = node.band_n_member()
        if n < 2 or node.get_parent_type() == isl.schedule_node_type.band:
            return node
        contraction = bool(contractions_in(node, prog)) and len(statement_names(node)) == 1
        fused = node.child(0).get_type() == isl.schedule_node_type.sequence  # fuse_contraction's nest
        if tile_sizes is None and fused and contractions_in(node, prog):
            return block_fused(node, prog, lanes)
        if tile_sizes is None and not contraction:
            return _tile_transposition(node, prog)
        if contraction:
            node = merge_reductions(node, prog)
            n = node.band_n_member()
        roles = _block_sizes(node, prog, n) if contraction else []
        row = _row_member(node, prog, roles) if contraction else None
        if row is not None and "red" in roles[:row]:
            node, roles, row = _rows_outside_reduction(node, roles, row)
        shape = block_shape(None, None, lanes)
        if tile_sizes:
            sizes = (list(tile_sizes) + [tile_sizes[-1]] * n)[:n]
        elif contraction:
            sizes, shape = _tiling(node, roles, row, lanes)
        if "red" in roles:  # tiling an inner reduction loop would reorder the reduction: only the outermost
            first = roles.index("red")
            sizes = [UNTILED if r == "red" and m != first else t for m, (r, t) in enumerate(zip(roles, sizes))]
        node = node.band_tile(band_sizes(node, sizes))
        if contraction and "red" in roles:
            node = register_block(node.child(0), roles, row, shape).parent()
        return node
    new = visit(schedule.get_root(), fn).get_schedule()
    return legal_or_kept(new, schedule, validity)


TRANSPOSE_TILE = 32  # a transposing copy walks tiles of this many rows and columns


def _tile_transposition(node, prog):
    """A band of one statement that writes along its innermost loop and reads
    along another (with a stride in the innermost: not a per-channel value
    that loop leaves alone, a group norm's bias), or reads along it and
    writes along another (a transposing copy: a weight's transpose each
    call, the keys of attention laid out transposed), walks square tiles
    of those two loops, so that the lines
    its strided accesses touch are used for a tile's rows before they leave
    the cache. The other loop moves next to the innermost where it is not.
    Trailing dims that the store and every load walk with the same loops
    (a kernel's window, exchanging its channel dims) stay inside: the
    transposition is then of the dims before them."""
    names = statement_names(node)
    n = node.band_n_member()
    if len(names) != 1:
        return node
    st = next(s for s in prog.statements if s.name in names)
    if st.role is not Role.ASSIGN or st.library is not None or not st.index:
        return node
    mupa = node.band_get_partial_schedule()
    follows = [member_iter(mupa.get_at(m)).get(st.name) for m in range(n)]
    reads = [ld.index for ld in loads(st.body) if ld.index]

    def along(index, m, dim) -> bool:  # whether index's dimension dim (from the end) moves with band member m
        return len(index) > dim and follows[m] is not None and any(
            isinstance(x, Var) and x.name == st.iters[follows[m]] for x in walk(index[-1 - dim]))
    shared = 0  # small trailing dims walked alike: the innermost members, one each
    while shared < n - 2 and all(along(i, n - 1 - shared, shared) for i in [st.index] + reads) \
            and (member_extent(node, n - 1 - shared) or TRANSPOSE_TILE + 1) <= TRANSPOSE_TILE:
        shared += 1
    inner = n - 1 - shared
    if follows[inner] is None:
        return node
    def moves(index, m) -> bool:  # whether band member m moves index at all
        return follows[m] is not None and any(
            isinstance(x, Var) and x.name == st.iters[follows[m]] for d in index for x in walk(d))
    if along(st.index, inner, shared):  # written along the innermost loop: a load along another, strided in it
        other = [m for m in range(inner) if any(along(i, m, shared) and not along(i, inner, shared)
                                                and moves(i, inner) for i in reads)]
    else:  # read along it: written along another
        other = [m for m in range(inner) if along(st.index, m, shared)] \
            if any(along(i, inner, shared) for i in reads) else []
    if not other:
        return node
    if other[-1] != inner - 1:
        order = [m for m in range(n) if m not in (other[-1], inner)]
        order = order[:inner - 1] + [other[-1], inner] + order[inner - 1:]
        node = rebuild_band(node, order, [node.band_member_get_coincident(m) for m in range(n)], True)
    sizes = [UNTILED] * (inner - 1) + [TRANSPOSE_TILE, TRANSPOSE_TILE] + [UNTILED] * shared
    return node.band_tile(band_sizes(node, sizes))


STRIP_COLUMNS = 512  # columns per parallel strip when the outer loop is too short to share
ROW_STRIP = 16  # rows per parallel strip, likewise, when an outer dimension can be cut instead
MIN_PARALLEL_EXTENT = 8  # a parallel loop shorter than this shares an inner loop's strips too


def balance_parallel(schedule, prog, validity) -> isl.Schedule:
    """Share work between threads when a nest's outer loop cannot (three
    images for two threads leave one idle a third of the time): strip-mine
    another coincident loop, rows where one is long enough, else columns (of
    an image whose rows carry a stencil's rolling buffer), and run the strips
    outermost, in parallel. (Where it strips none, the mapping may still
    split the sequential loop below in strips with halos:
    codegen.cpu_mapping.CpuMapper.row_strips.)"""
    def fn(node):
        if node.get_type() != isl.schedule_node_type.band or not node.band_get_permutable() \
                or node.get_parent_type() == isl.schedule_node_type.band or node.band_n_member() < 2:
            return node
        if contractions_in(node, prog):
            return node
        n = node.band_n_member()
        ext0 = member_extent(node, 0)
        if node.band_member_get_coincident(0) and (ext0 is None or ext0 >= MIN_PARALLEL_EXTENT):
            return node
        coincident = [m for m in range(1, n) if node.band_member_get_coincident(m)]
        rows = [m for m in coincident if m < n - 1
                and (member_extent(node, m) or ROW_STRIP * MIN_PARALLEL_EXTENT) >= ROW_STRIP * MIN_PARALLEL_EXTENT]
        cols = [m for m in coincident
                if (member_extent(node, m) or STRIP_COLUMNS * MIN_PARALLEL_EXTENT) >= 2 * STRIP_COLUMNS]
        if not rows and not cols:
            return node
        m, size = (rows[0], ROW_STRIP) if rows else (cols[-1], STRIP_COLUMNS)
        upa = node.band_get_partial_schedule().get_at(m).scale_down_val(isl.Val.int_from_si(node.get_ctx(), size))
        outer = isl.MultiUnionPwAff.from_union_pw_aff(upa.floor())
        return node.insert_partial_schedule(outer).band_set_permutable(True).band_member_set_coincident(0, True)
    new = visit(schedule.get_root(), fn).get_schedule()
    return legal_or_kept(new, schedule, validity)


def sink_inner(schedule, prog, validity) -> isl.Schedule:
    """Give each statement under a band its own innermost loop.

    A band over a sequence of statements runs them interleaved in its
    innermost loop; sinking that loop below the sequence yields one clean,
    vectorizable inner loop per statement (e.g. a row of blur_x, then a row
    of blur_y) and hoists guards out of it.
    """
    def fn(node):
        if node.get_type() != isl.schedule_node_type.band or node.band_n_member() < 2 \
                or not node.has_children() or contractions_in(node, prog):
            return node  # a contraction's blocks already end in a clean loop per statement
        seq = node.child(0)
        if seq.get_type() not in (isl.schedule_node_type.sequence, isl.schedule_node_type.set):
            return node
        if any(seq.child(i).child(0).get_type() in (isl.schedule_node_type.sequence, isl.schedule_node_type.set)
               for i in range(seq.n_children())):
            return node  # isl sinks to the leaves: statements that share a loop (a row's exp and sum) would part
        n = node.band_n_member()
        return node.band_split(n - 1).child(0).band_sink().parent()
    new = visit(schedule.get_root(), fn).get_schedule()
    return legal_or_kept(new, schedule, validity)


def unroll_marks(schedule) -> isl.Schedule:
    """Each band whose loops register_block unrolls, unrolled by code
    generation instead: under a mark naming their trip counts
    (``unroll:4,64``), its loops are plain in isl's AST, and the emitter
    copies their bodies (codegen.loops.LoopEmission.unrolled). isl's AST
    builder, unrolling a block, took most of a convolution's scheduling
    time, each copy an AST of its own."""
    def fn(node):
        if node.get_type() != isl.schedule_node_type.band or not all(
                node.band_member_get_ast_loop_type(m) == isl.ast_loop_type.unroll
                for m in range(node.band_n_member())):
            return node
        trips = [member_trips(node, m) for m in range(node.band_n_member())]
        for m in range(node.band_n_member()):
            node = node.band_member_set_ast_loop_type(m, isl.ast_loop_type.default)
        marked = [0 if t is None else t for t in trips if t != 1]  # (0: no bound, a plain loop)
        return node.insert_mark(isl.Id(unroll_mark(marked), context=node.get_ctx()))
    return visit(schedule.get_root(), fn).get_schedule()


def rewrite(sched: isl.Schedule, prog: AffineProgram, validity, tile_sizes, vector_bits: int) -> isl.Schedule:
    """The cpu target's rewrites of a group's schedule, each checked by isl (the driver then orders sets)."""
    sched = tile(sched, prog, validity, tile_sizes, vector_bits)
    sched = balance_parallel(sched, prog, validity)
    sched = sink_inner(sched, prog, validity)
    return unroll_marks(mark_parallel(sched))
