"""Affine program -> isl schedule -> isl AST.

Dependences come from isl's dataflow analysis; the isl scheduler fuses
producer and consumer loop nests (with shifts, as for two stencils), and a
few tree rewrites follow, each kept only if isl confirms that every
dependence still holds: the loop that walks contiguous memory goes innermost,
bands with reuse (contractions) are tiled, and the outermost coincident loop
of each nest is marked parallel. Temporary arrays whose values die within a
few iterations of the loop that makes them are contracted (to a scalar, a row,
a rolling window); isl checks every candidate storage map for overlapping
live ranges.
"""
from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import islpy as isl

from . import sizes as sz
from .affine import TAPS, AffineProgram, Role
from .expr import Load, Op, Var, loads, substitute, walk

log = logging.getLogger("polyjit.schedule")

DEFAULT_TILE = 32
MAX_MODULUS = 8


@dataclass
class Scheduled:
    schedule: isl.Schedule
    ast: isl.AstNode
    contracted: dict[str, tuple[int | None, ...]] = field(default_factory=dict)
    kernels: list[set[str]] = field(default_factory=list)  # statement names per top-level nest
    kernel_of_array: dict[str, int] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)  # fusions the cost model refused, with why

    def ast_text(self) -> str:
        return self.ast.to_C_str()

    def kernel_asts(self) -> list[isl.AstNode]:
        """The top-level nests, one kernel each."""
        return _kernels(self.ast)


@dataclass
class GroupProblem:
    """A fusion group as a program of its own, in names of its own."""

    prog: AffineProgram
    statements: dict[str, str]  # a statement's name in prog -> in the whole program
    arrays: dict[str, str]  # likewise for arrays
    shared: frozenset[str]  # arrays (named as in prog) that other groups use too
    key: str  # everything the group's schedule and code depend on


_CANONICAL = re.compile(r"\b_[sa]\d+\b")


def group_problem(prog: AffineProgram, group: list[str], shared: set[str], canonical: bool = True) -> GroupProblem:
    """The statements of group (and the arrays they touch), renamed _s0, _s1,
    ... and _a0, _a1, ... in order of appearance where canonical."""
    arrays: dict[str, str] = {}

    def array(name: str) -> str:
        return arrays.setdefault(name, f"_a{len(arrays)}" if canonical else name)

    def rename(e):
        if isinstance(e, Load):
            return Load(e.dtype, array(e.array), tuple(substitute(i, rename) for i in e.index))
        return None
    stmts, names = [], {}
    for s in prog.statements:
        if s.name in group:
            name = f"_s{len(stmts)}" if canonical else s.name
            names[name] = s.name
            stmts.append(replace(s, name=name, array=array(s.array), index=tuple(substitute(i, rename) for i in s.index),
                                 body=substitute(s.body, rename),
                                 library=s.library and s.library.renamed(array)))
    arrs = {new: replace(prog.arrays[old], name=new, index=k if canonical else prog.arrays[old].index)
            for k, (old, new) in enumerate(arrays.items())}
    mine = frozenset(new for old, new in arrays.items() if old in shared)
    sub = AffineProgram(list(prog.params), arrs, stmts, [])
    key = "\n".join([repr(prog.params), *map(repr, arrs.values()), *map(repr, stmts), repr(sorted(mine))])
    return GroupProblem(sub, names, {new: old for old, new in arrays.items()}, mine,
                        hashlib.sha256(key.encode()).hexdigest())


@dataclass
class ScheduledGroup:
    problem: GroupProblem
    sched: Scheduled

    def real_names(self, text: str) -> str:
        """text with the group's names replaced by the program's."""
        p = self.problem
        return _CANONICAL.sub(lambda m: p.statements.get(m.group(0)) or p.arrays.get(m.group(0), m.group(0)), text)


class ProgramSchedule:
    """The groups' schedules, and what they say about the whole program, in
    its names: the statements of each kernel, contracted temporaries, the
    first kernel writing each array."""

    def __init__(self, prog: AffineProgram, groups: list[ScheduledGroup], refused: list[str] = ()) -> None:
        self.groups = groups
        self.kernels: list[set[str]] = []
        self.contracted: dict[str, tuple[int | None, ...]] = {}
        self.kernel_of_array: dict[str, int] = {}
        self.refused = list(refused) + [g.real_names(why) for g in groups for why in g.sched.refused]
        for g in groups:
            p = g.problem
            for a, k in _kernel_of_array(p.prog, g.sched.kernels, len(self.kernels), p.arrays).items():
                self.kernel_of_array.setdefault(a, k)
            self.kernels += [{p.statements[n] for n in k} for k in g.sched.kernels]
            self.contracted.update({p.arrays[a]: m for a, m in g.sched.contracted.items()})

    def kernel_asts(self) -> list[isl.AstNode]:
        return [node for g in self.groups for node in g.sched.kernel_asts()]

    def ast_text(self) -> str:
        return "\n".join(g.real_names(g.sched.ast_text()).rstrip("\n") for g in self.groups) + "\n"

    def schedule_text(self) -> str:
        return "\n".join(g.real_names(str(g.sched.schedule.get_root())) for g in self.groups)


def make_context() -> isl.Context:
    ctx = isl.Context()
    ctx.set_schedule_whole_component(1)
    ctx.set_schedule_serialize_sccs(0)
    # Fuse only where the fused band's outer loop stays parallel: a layer
    # norm's row sums fused with its weight gradient's column sums had no
    # parallel loop left and ran on one GPU thread (1.5 s instead of ~0.1 ms).
    ctx.set_schedule_outer_coincidence(1)
    ctx.set_tile_scale_tile_loops(0)
    ctx.set_tile_shift_point_loops(0)
    return ctx


def _empty(ctx) -> isl.UnionMap:
    return isl.UnionMap.empty(isl.Space.params_alloc(ctx, 0))


def program_order(ctx, prog: AffineProgram) -> isl.UnionMap:
    depth = max([len(s.iters) for s in prog.statements] + [0])
    parts = []
    for k, s in enumerate(prog.statements):
        dims = [str(k)] + list(s.iters) + ["0"] * (depth - len(s.iters))
        parts.append(f"{s.name}[{', '.join(s.iters)}] -> [{', '.join(dims)}]")
    return isl.UnionMap.read_from_str(ctx, prog.prefix() + "{ " + "; ".join(parts) + " }")


def dependences(ctx, prog: AffineProgram, dom: isl.UnionSet):
    """(validity, flow): all ordering constraints, and the dataflow among them."""
    must, may = prog.writes(ctx)
    reads = prog.reads(ctx)
    order = program_order(ctx, prog).intersect_domain(dom)
    must, may, reads = (m.intersect_domain(dom) for m in (must, may, reads))

    def flow(sink, must_src, may_src):
        info = isl.UnionAccessInfo.from_sink(sink).set_must_source(must_src)
        info = info.set_may_source(may_src).set_schedule_map(order)
        return info.compute_flow().get_may_dependence()

    raw = flow(reads, must, may)
    waw = flow(may, must, may)
    war = flow(may, _empty(ctx), reads)
    validity = raw.union(waw).union(war).coalesce()
    return validity, raw.coalesce()


def _items(lst) -> list:
    """The elements of an isl list. Used instead of isl's foreach callbacks,
    which swallow exceptions: an operation limit reached inside one would
    go unnoticed (a legality check would pass)."""
    return [lst.get_at(i) for i in range(len(lst))]


def is_legal(schedule: isl.Schedule, validity: isl.UnionMap) -> bool:
    """Every dependence source runs strictly before its sink."""
    if validity.is_empty():
        return True
    smap = schedule.get_map()
    rel = validity.apply_domain(smap).apply_range(smap)
    return all(m.is_subset(isl.Map.lex_lt(m.get_space().domain())) for m in _items(rel.get_map_list()))


# --------------------------------------------------------------- rewrites
def _visit(node: isl.ScheduleNode, fn) -> isl.ScheduleNode:
    node = fn(node)
    for i in range(node.n_children()):
        node = _visit(node.child(i), fn).parent()
    return node


def _member_iter(upa: isl.UnionPwAff) -> dict[str, int | None]:
    """For each statement, which of its iterators the band member follows."""
    out: dict[str, int | None] = {}
    for pa in _items(upa.get_pw_aff_list()):
        name = pa.get_domain_space().get_tuple_name(isl.dim_type.set)
        best = None
        for _, aff in pa.get_pieces()[:1]:
            for d in range(aff.dim(isl.dim_type.in_)):
                if aff.get_coefficient_val(isl.dim_type.in_, d).to_python() != 0:
                    best = d
        out[name] = best
    return out


def _contiguity(prog: AffineProgram, vectors: bool = True) -> dict[tuple[str, int], int]:
    """(statement, iterator) -> how many accesses walk memory contiguously
    along it; without vectors, loads of one-dimensional arrays in nests of
    three loops or more (a batch norm's per-channel parameters, in cache) count none."""
    score: dict[tuple[str, int], int] = {}
    for s in prog.statements:
        # a reduction's target stays in a register while its loop runs innermost
        accesses = [ld.index for ld in loads(s.body) if vectors or len(ld.index) > 1 or len(s.iters) < 3]
        accesses += [] if s.combine else [s.index]
        for d, name in enumerate(s.iters):
            n = 0
            for index in accesses:
                if index and any(isinstance(x, Var) and x.name == name for x in walk(index[-1])):
                    n += 2
                elif index and any(isinstance(x, Var) and x.name == name for i in index[:-1] for x in walk(i)):
                    n -= 1
            score[(s.name, d)] = n
    return score


def _memory_depth(prog: AffineProgram) -> dict[tuple[str, int], int]:
    """(statement, iterator) -> how far inside its arrays the iterator indexes:
    loops over outer dimensions go outside, so that rows are walked in order."""
    depth: dict[tuple[str, int], int] = {}
    for s in prog.statements:
        accesses = [ld.index for ld in loads(s.body)] + [s.index]
        for d, name in enumerate(s.iters):
            depth[(s.name, d)] = sum(p for index in accesses for p, i in enumerate(index)
                                     if any(isinstance(x, Var) and x.name == name for x in walk(i)))
    return depth


def _rebuild_band(node, members, coincident, permutable):
    mupa = node.band_get_partial_schedule()
    ups = isl.UnionPwAffList.alloc(node.get_ctx(), len(members))
    for m in members:
        ups = ups.add(mupa.get_at(m))
    new = isl.MultiUnionPwAff.from_union_pw_aff_list(mupa.get_space(), ups)
    node = node.delete().insert_partial_schedule(new)
    node = node.band_set_permutable(permutable)
    for i, m in enumerate(members):
        node = node.band_member_set_coincident(i, coincident[m])
    return node


def innermost_contiguous(schedule, prog, ctx, validity) -> isl.Schedule:
    """Order each permutable band's members as memory is laid out: the loop
    with the most contiguous accesses innermost, loops over outer dimensions
    outside."""
    score, depth = _contiguity(prog), _memory_depth(prog)

    def fn(node):
        if node.get_type() != isl.schedule_node_type.band or node.band_n_member() < 2 \
                or not node.band_get_permutable():
            return node
        n = node.band_n_member()
        mupa = node.band_get_partial_schedule()
        totals = []
        for m in range(n):
            follows = _member_iter(mupa.get_at(m))
            totals.append(sum(score.get((st, d), 0) for st, d in follows.items() if d is not None))
        deep = [sum(depth.get((st, d), 0) for st, d in _member_iter(mupa.get_at(m)).items() if d is not None)
                for m in range(n)]
        order = sorted(range(n), key=lambda m: (totals[m], deep[m], m))
        coinc = [node.band_member_get_coincident(m) for m in range(n)]
        outer = [m for m in order[:-1] if coinc[m]]
        if outer and not coinc[order[0]]:  # keep a parallel loop outermost
            order.remove(outer[0])
            order.insert(0, outer[0])
        if order == list(range(n)):
            return node
        return _rebuild_band(node, order, coinc, True)
    new = _visit(schedule.get_root(), fn).get_schedule()
    return new if is_legal(new, validity) else schedule


def sink_inner(schedule, prog, validity) -> isl.Schedule:
    """Give each statement under a band its own innermost loop.

    A band over a sequence of statements runs them interleaved in its
    innermost loop; sinking that loop below the sequence yields one clean,
    vectorizable inner loop per statement (e.g. a row of blur_x, then a row
    of blur_y) and hoists guards out of it.
    """
    def fn(node):
        if node.get_type() != isl.schedule_node_type.band or node.band_n_member() < 2 \
                or not node.has_children() or _contractions(node, prog):
            return node  # a contraction's blocks already end in a clean loop per statement
        seq = node.child(0)
        if seq.get_type() not in (isl.schedule_node_type.sequence, isl.schedule_node_type.set):
            return node
        if any(seq.child(i).child(0).get_type() in (isl.schedule_node_type.sequence, isl.schedule_node_type.set)
               for i in range(seq.n_children())):
            return node  # isl sinks to the leaves: statements that share a loop (a row's exp and sum) would part
        n = node.band_n_member()
        return node.band_split(n - 1).child(0).band_sink().parent()
    new = _visit(schedule.get_root(), fn).get_schedule()
    return new if is_legal(new, validity) else schedule


def _statement_names(node) -> set[str]:
    return {st.get_tuple_name() for st in _items(node.get_domain().get_set_list())}


def is_update(s) -> bool:
    """Whether statement s accumulates a contraction's products."""
    return s.role is Role.UPDATE and s.contraction


def is_product_init(s) -> bool:
    return s.role is Role.INIT and s.contraction


def _contractions(node, prog):
    names = _statement_names(node)
    return [s for s in prog.statements if s.name in names and is_update(s)]


def distribute_inits(schedule, prog, validity) -> isl.Schedule:
    """Put the initialization of contraction results in a nest of its own,
    so that the contraction's band holds only its update and can be blocked."""
    inits = [s for s in prog.statements if is_product_init(s)]
    if not inits:
        return schedule
    root = schedule.get_root()
    dom = root.domain_get_domain()
    init_names = {s.name for s in inits}
    first = isl.UnionSet.empty(dom.get_space())
    rest = isl.UnionSet.empty(dom.get_space())
    for st in _items(dom.get_set_list()):
        if st.get_tuple_name() in init_names:
            first = first.union(isl.UnionSet.from_set(st))
        else:
            rest = rest.union(isl.UnionSet.from_set(st))
    if rest.is_empty():
        return schedule
    filters = isl.UnionSetList.alloc(root.get_ctx(), 2).add(first).add(rest)
    new = root.child(0).insert_sequence(filters).get_schedule()
    return new if is_legal(new, validity) else schedule


@dataclass
class FusionPlan:
    """What the cpu schedule may fuse into a contraction's nest, and the
    fusions its cost model refused, each with its reason."""

    refused: list[str] = field(default_factory=list)


def fusion_refusal(up, outs: list[str]) -> str | None:
    """Why sharing one nest with contraction `up` would lose, or None.

    A fused nest runs each register block's whole reduction; its columns
    run along the last output loop. Where an operand's padding guard
    depends on that loop (NCHW: the output columns are image columns, and
    the window's taps step over the border), every vector lane needs its
    own address: the fused nest ran 2.6-4.4x slower than the tiled,
    unfused one (2x64x64x64 3x3 NCHW: 51 against 19 ms), while NHWC, whose
    columns are channels, gained (0.91 -> 0.77 ms)."""
    if not _reduction_fits_tile(up):
        lo, hi = dict(zip(up.iters, up.bounds))[up.reduction_iters[0]]
        return (f"{up.name} ({up.label}): its outer reduction loop ({sz.isl_str(hi)} - {sz.isl_str(lo)}) "
                f"exceeds a tile ({TILE_RED})")
    col = outs[-1] if outs else None
    for x in walk(up.body):
        if isinstance(x, Op) and x.op == "select" and any(isinstance(v, Var) and v.name == col
                                                          for v in walk(x.args[0])):
            return f"{up.name} ({up.label}): a padding guard varies along the register block's columns ({col})"
    return None


def fuse_contraction(schedule, prog, dom, validity, plan: FusionPlan | None = None) -> isl.Schedule | None:
    """One nest for a contraction whose reduction is not tiled: each block of
    outputs is zeroed, runs its whole reduction and its elementwise epilogue
    (bias, activation) in turn, all inside the block's loops, so the
    accumulators start from zero in registers and leave finished, instead of
    a pass over the whole result before the contraction and one after.

    schedule is isl's for the contraction (the update's loop order is taken
    from its bands), dom the group's with its epilogue; tile() then blocks
    the shared output band. None where the nest cannot be built."""
    names = [st.get_tuple_name() for st in _items(dom.get_set_list())]
    stmts = [s for s in prog.statements if s.name in names]
    updates = [s for s in stmts if is_update(s)]
    if len(updates) != 1:
        return None
    up = updates[0]
    point = {s.name: _plain(s.index) for s in stmts if s.role is Role.INIT and s.array == up.array}
    point[up.name] = _plain(up.index)
    for s in stmts:
        if s.name not in point:
            point[s.name] = _plain(next(ld for ld in prog.statement_loads(s) if ld.array == up.array).index)
    order: list[str] = []

    def follow(node):
        if node.get_type() == isl.schedule_node_type.band and up.name in _statement_names(node):
            mupa = node.band_get_partial_schedule()
            for m in range(node.band_n_member()):
                d = _member_iter(mupa.get_at(m)).get(up.name)
                if d is not None and up.iters[d] not in order:
                    order.append(up.iters[d])
        return node
    _visit(schedule.get_root(), follow)
    order += [it for it in up.iters if it not in order]
    red = [it for it in order if it in up.reduction_iters]
    outs = [it for it in order if it not in up.reduction_iters]
    why = fusion_refusal(up, outs)
    if why is not None:
        if plan is not None:
            plan.refused.append(why)
        return None
    if len(point) != len(stmts) or None in point.values() or sorted(outs) != sorted(point[up.name]) \
            or len(outs) < 2 or not red:
        return None
    ctx = schedule.get_ctx()

    def band(members, among):
        text = ", ".join("{ " + "; ".join(f"{s.name}[{', '.join(s.iters)}] -> [({m(s)})]" for s in among) + " }"
                         for m in members)
        # ("[] -> [...]" reads as an empty tuple: the prefix only with parameters)
        return isl.MultiUnionPwAff.read_from_str(ctx, (prog.prefix() if prog.params else "") + "[" + text + "]")
    k_of = {it: point[up.name].index(it) for it in outs}
    outer = band([lambda s, it=it: point[s.name][k_of[it]] for it in outs], stmts)
    node = isl.Schedule.from_domain(dom).get_root().child(0).insert_partial_schedule(outer).band_set_permutable(True)
    for m in range(len(outs)):
        node = node.band_member_set_coincident(m, True)
    filters = isl.UnionSetList.alloc(ctx, len(stmts))
    for s in stmts:
        filters = filters.add(_group_domain(ctx, prog, dom, [s.name]))
    node = node.child(0).insert_sequence(filters)
    at = stmts.index(up)
    node = node.child(at).child(0).insert_partial_schedule(band([lambda s, r=r: r for r in red], [up]))
    new = node.get_schedule()
    return new if is_legal(new, validity) else None


def _reduction_fits_tile(s) -> bool:
    """Whether the contraction's reduction stays whole inside each register
    block: tile() tiles only its outermost loop, and that fits one tile."""
    lo, hi = dict(zip(s.iters, s.bounds))[s.reduction_iters[0]]
    return sz.is_static(lo) and sz.is_static(hi) and int(hi) - int(lo) <= TILE_RED


REG_ROWS = 4  # a register block of a contraction: rows x four vectors of contiguous columns
REG_VECTORS = 4  # (16 accumulators: half of AVX-512's registers)
TILE_ROWS, TILE_RED, TILE_COLS = 64, 128, 256
UNTILED = 1 << 30  # a tile size no loop reaches


def _block_sizes(node, prog, n):
    """Per member: (role, tile size) with roles 'red', 'col' (innermost), 'row'."""
    mupa = node.band_get_partial_schedule()
    red = set()
    for s in _contractions(node, prog):
        for m in range(n):
            d = _member_iter(mupa.get_at(m)).get(s.name)
            if d is not None and s.iters[d] in s.reduction_iters:
                red.add(m)
    col = max((m for m in range(n) if m not in red), default=None)
    return ["red" if m in red else "col" if m == col else "row" for m in range(n)]


def _sizes(node, values) -> isl.MultiVal:
    mv = isl.MultiVal.zero(node.band_get_space())
    for i, t in enumerate(values):
        mv = mv.set_val(i, isl.Val.int_from_si(node.get_ctx(), int(t)))
    return mv


def _row_member(node, prog, roles) -> int | None:
    """The member a register block spans as its rows: the one the most
    operands do not depend on while they walk the columns (those operands'
    vectors then serve every row: B[k, j] for rows i of A[i, k] * B[k, j]);
    the innermost such member on a tie."""
    st = _contractions(node, prog)[0]
    mupa = node.band_get_partial_schedule()
    follows = [_member_iter(mupa.get_at(m)).get(st.name) for m in range(len(roles))]
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
    st = _contractions(node, prog)[0]
    mupa = node.band_get_partial_schedule()
    n = node.band_n_member()
    coinc = [node.band_member_get_coincident(m) for m in range(n)]
    child = node.child(0)
    merged = 0
    while child.get_type() == isl.schedule_node_type.band:
        cm = child.band_get_partial_schedule()
        its = [_member_iter(cm.get_at(m)).get(st.name) for m in range(child.band_n_member())]
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


def register_block(point, roles, row, cols: int) -> isl.ScheduleNode:
    """Within a tile: loop over register blocks, then the reduction, with the
    block itself unrolled, so its accumulators stay in vector registers."""
    n = len(roles)
    sizes = [cols if r == "col" else REG_ROWS if m == row else 1 for m, r in enumerate(roles)]
    node = point.band_tile(_sizes(point, sizes))
    order = [m for m in range(n) if roles[m] != "red"] + [m for m in range(n) if roles[m] == "red"]
    coinc = [node.band_member_get_coincident(m) for m in range(n)]
    node = _rebuild_band(node, order, coinc, True)
    inner = node.child(0)
    for m in range(n):
        inner = inner.band_member_set_ast_loop_type(m, isl.ast_loop_type.unroll)
    return inner.parent()


def block_fused(node, prog, cols: int) -> isl.ScheduleNode:
    """Tile and register-block the output band of fuse_contraction's nest;
    the unrolled block sinks below each statement (below the reduction's
    loops for the update), so a block's initialization, reduction and
    epilogue run one after another on the same registers."""
    roles = _block_sizes(node, prog, node.band_n_member())
    if "red" in roles:
        return node
    row = _row_member(node, prog, roles)
    node = node.band_tile(_sizes(node, [TILE_COLS if r == "col" else TILE_ROWS for r in roles]))
    block = register_block(node.child(0), roles, row, cols)
    seq = block.child(0).band_sink()
    inits = _inits(prog)
    for i in range(seq.n_children()):
        band = seq.child(i).child(0)
        if _statement_names(band) & inits or _contractions(band, prog):
            continue
        # the epilogue loops over the block instead: LLVM vectorizes its math
        # along the columns (unrolled, tanh's code was left scalar: 3x slower)
        for m in range(band.band_n_member()):
            band = band.band_member_set_ast_loop_type(m, isl.ast_loop_type.default)
        seq = band.parent().parent()
    return seq.parent().parent()


def tile(schedule, prog, validity, tile_sizes, vector_bits: int = 512) -> isl.Schedule:
    """Tile outer permutable bands with reuse (contractions), or every one when
    tile_sizes is given; contractions also get register blocks of REG_ROWS x
    REG_VECTORS vectors of the host's width (float32 lanes)."""
    cols = REG_VECTORS * vector_bits // 32
    def fn(node):
        if node.get_type() != isl.schedule_node_type.band or not node.band_get_permutable():
            return node
        n = node.band_n_member()
        if n < 2 or node.get_parent_type() == isl.schedule_node_type.band:
            return node
        contraction = bool(_contractions(node, prog)) and len(_statement_names(node)) == 1
        fused = node.child(0).get_type() == isl.schedule_node_type.sequence  # fuse_contraction's nest
        if tile_sizes is None and fused and _contractions(node, prog):
            return block_fused(node, prog, cols)
        if tile_sizes is None and not contraction:
            return _tile_transposition(node, prog)
        if contraction:
            node = merge_reductions(node, prog)
            n = node.band_n_member()
        roles = _block_sizes(node, prog, n) if contraction else []
        row = _row_member(node, prog, roles) if contraction else None
        if tile_sizes:
            sizes = (list(tile_sizes) + [tile_sizes[-1]] * n)[:n]
        elif contraction:
            sizes = [TILE_RED if r == "red" else TILE_COLS if r == "col" else TILE_ROWS for r in roles]
        if "red" in roles:  # tiling an inner reduction loop would reorder the reduction: only the outermost
            first = roles.index("red")
            sizes = [UNTILED if r == "red" and m != first else t for m, (r, t) in enumerate(zip(roles, sizes))]
        node = node.band_tile(_sizes(node, sizes))
        if contraction and "red" in roles:
            node = register_block(node.child(0), roles, row, cols).parent()
        return node
    new = _visit(schedule.get_root(), fn).get_schedule()
    return new if is_legal(new, validity) else schedule


TRANSPOSE_TILE = 32  # a transposing copy walks tiles of this many rows and columns


def _tile_transposition(node, prog):
    """A band of one statement that writes along its innermost loop and reads
    along another (a transposing copy: a weight's transpose each call) walks
    square tiles, so that the lines its strided reads bring in are used for
    a tile's rows before they leave the cache."""
    names = _statement_names(node)
    n = node.band_n_member()
    if len(names) != 1:
        return node
    st = next(s for s in prog.statements if s.name in names)
    if st.role is not Role.ASSIGN or st.library is not None:
        return node
    mupa = node.band_get_partial_schedule()
    follows = [_member_iter(mupa.get_at(m)).get(st.name) for m in range(n)]
    inner, outer = follows[-1], follows[-2]
    if inner is None or outer is None:
        return node

    def uses(index, d) -> bool:
        return any(isinstance(x, Var) and x.name == st.iters[d] for x in walk(index))
    along = [ld for ld in loads(st.body) if ld.index and uses(ld.index[-1], outer) and not uses(ld.index[-1], inner)]
    if not along or not st.index or not uses(st.index[-1], inner):
        return node
    sizes = [UNTILED] * (n - 2) + [TRANSPOSE_TILE, TRANSPOSE_TILE]
    return node.band_tile(_sizes(node, sizes))


STRIP_COLUMNS = 512  # columns per parallel strip when the outer loop is too short to share
ROW_STRIP = 16  # rows per parallel strip, likewise, when an outer dimension can be cut instead
MIN_PARALLEL_EXTENT = 8  # a parallel loop shorter than this shares an inner loop's strips too


def _cst(pa: isl.PwAff) -> int:
    return pa.get_pieces()[0][1].get_constant_val().to_python()


def _member_extent(node, m: int) -> int | None:
    """The static trip count of band member m, or None when it depends on sizes."""
    upa = node.band_get_partial_schedule().get_at(m)
    umap = isl.UnionMap.from_union_pw_aff(upa).intersect_domain(node.get_domain())
    rng = umap.range()
    out: list = []
    for st in _items(rng.get_set_list()):
        lo, hi = st.dim_min(0), st.dim_max(0)
        if lo.is_cst() and hi.is_cst() and lo.n_piece() == 1 and hi.n_piece() == 1:
            out.append(_cst(hi) - _cst(lo) + 1)
        else:
            out.append(None)
    if not out or None in out:
        return None
    return max(out)


def balance_parallel(schedule, prog, validity) -> isl.Schedule:
    """Share work between threads when a nest's outer loop cannot (three
    images for two threads leave one idle a third of the time): strip-mine
    another coincident loop, rows where one is long enough, else columns (of
    an image whose rows carry a stencil's rolling buffer), and run the strips
    outermost, in parallel."""
    def fn(node):
        if node.get_type() != isl.schedule_node_type.band or not node.band_get_permutable() \
                or node.get_parent_type() == isl.schedule_node_type.band or node.band_n_member() < 2:
            return node
        if _contractions(node, prog):
            return node
        n = node.band_n_member()
        ext0 = _member_extent(node, 0)
        if node.band_member_get_coincident(0) and (ext0 is None or ext0 >= MIN_PARALLEL_EXTENT):
            return node
        coincident = [m for m in range(1, n) if node.band_member_get_coincident(m)]
        rows = [m for m in coincident if m < n - 1
                and (_member_extent(node, m) or ROW_STRIP * MIN_PARALLEL_EXTENT) >= ROW_STRIP * MIN_PARALLEL_EXTENT]
        cols = [m for m in coincident
                if (_member_extent(node, m) or STRIP_COLUMNS * MIN_PARALLEL_EXTENT) >= 2 * STRIP_COLUMNS]
        if not rows and not cols:
            return node
        m, size = (rows[0], ROW_STRIP) if rows else (cols[-1], STRIP_COLUMNS)
        upa = node.band_get_partial_schedule().get_at(m).scale_down_val(isl.Val.int_from_si(node.get_ctx(), size))
        outer = isl.MultiUnionPwAff.from_union_pw_aff(upa.floor())
        return node.insert_partial_schedule(outer).band_set_permutable(True).band_member_set_coincident(0, True)
    new = _visit(schedule.get_root(), fn).get_schedule()
    return new if is_legal(new, validity) else schedule


def coincident_outside(schedule, validity, prog: AffineProgram) -> isl.Schedule:
    """Move the coincident members of each permutable band outside the others:
    a GPU maps every parallel loop around the sequential ones to threads, so
    a stencil's rows run down each thread. The coincident ones go in memory
    order, the most contiguous last, so that consecutive threads touch
    consecutive elements (a padded copy of NCHW images, its channel loop
    innermost for the batch norm's per-channel loads, wrote 12996 floats
    apart from thread to thread)."""
    score, depth = _contiguity(prog, vectors=False), _memory_depth(prog)

    def rank(mupa, m):
        follows = [(st, d) for st, d in _member_iter(mupa.get_at(m)).items() if d is not None]
        return sum(score.get(k, 0) for k in follows), sum(depth.get(k, 0) for k in follows), m

    def fn(node):
        if node.get_type() != isl.schedule_node_type.band or node.band_n_member() < 2 \
                or not node.band_get_permutable():
            return node
        n = node.band_n_member()
        coinc = [node.band_member_get_coincident(m) for m in range(n)]
        mupa = node.band_get_partial_schedule()
        order = sorted((m for m in range(n) if coinc[m]), key=lambda m: rank(mupa, m))
        order += [m for m in range(n) if not coinc[m]]
        return node if order == list(range(n)) else _rebuild_band(node, order, coinc, True)
    new = _visit(schedule.get_root(), fn).get_schedule()
    return new if is_legal(new, validity) else schedule


def order_sets(schedule, validity) -> isl.Schedule:
    """Each set node as a sequence, producers first, then smaller children
    first. A set's children may run in any order, and isl's AST builder
    picks one that the schedule's flattened map (what legality checks and
    contraction read) does not show: a row buffer's slot was overwritten
    before its last read. A sequence in dependence order keeps the code, the
    map and later moves (sinking a band below the children) in agreement."""
    def fn(node):
        if node.get_type() != isl.schedule_node_type.set:
            return node
        kids = [node.child(i).filter_get_filter() for i in range(node.n_children())]
        after = {i: {j for j in range(len(kids)) if j != i and not validity.intersect_domain(kids[j])
                     .intersect_range(kids[i]).is_empty()} for i in range(len(kids))}
        order: list[int] = []
        while len(order) < len(kids):
            left = [i for i in range(len(kids)) if i not in order]
            ready = [i for i in left if after[i] <= set(order)] or left
            order.append(min(ready, key=lambda i: kids[i].n_set()))  # an accumulator's initialization first
        filters = isl.UnionSetList.alloc(node.get_ctx(), len(kids))
        for i in order:
            filters = filters.add(kids[i])
        return node.insert_sequence(filters)
    return _visit(schedule.get_root(), fn).get_schedule()


def mark_parallel(schedule, all_coincident: bool = False) -> isl.Schedule:
    """Mark the outermost loop of each nest that carries no dependence (with
    all_coincident, each loop of the outer band's coincident prefix).

    isl leaves a loop of one iteration out of the AST, so the mark skips
    such members and names the schedule dimension it means (isl's iterator
    ``c<d>``): code generation must never split the loop below it instead,
    which may carry a reduction.
    """
    def visit(node, inside):
        ups = 0
        trivial = node.get_type() == isl.schedule_node_type.band and \
            all(_member_extent(node, m) == 1 for m in range(node.band_n_member()))
        if node.get_type() == isl.schedule_node_type.band and not inside and not trivial:
            inside = True
            n = node.band_n_member()
            m = 0
            while m < n - 1 and _member_extent(node, m) == 1:
                m += 1
            if node.band_member_get_coincident(m):
                if m > 0:
                    node = node.band_split(m).child(0)
                    ups += 1
                while True:
                    more = all_coincident and n - m > 1 and node.band_member_get_coincident(1)
                    if n - m > 1:
                        node = node.band_split(1)
                    depth = node.get_schedule_depth()
                    node = node.insert_mark(isl.Id(f"parallel:c{depth}", context=node.get_ctx())).child(0)
                    ups += 1
                    if not more:
                        break
                    node = node.child(0)
                    ups += 1
                    m += 1
        for i in range(node.n_children()):
            node = visit(node.child(i), inside).parent()
        for _ in range(ups):
            node = node.parent()
        return node
    return visit(schedule.get_root(), False).get_schedule()


# ------------------------------------------------------------ contraction
def _slot_map(ctx, prog: AffineProgram, name: str, moduli) -> isl.Map:
    rank = len(prog.arrays[name].shape)
    i = [f"i{d}" for d in range(rank)]
    o = [f"o{d}" for d in range(rank)]
    cons = []
    for d, m in enumerate(moduli):
        if m is None:
            cons.append(f"o{d} = i{d}")
        elif m > 1:
            cons.append(f"(o{d} - i{d}) mod {m} = 0")
    diff = " or ".join(f"o{d} > i{d} or o{d} < i{d}" for d in range(rank)) or "1 = 0"
    cons.append(f"({diff})")
    text = prog.prefix() + f"{{ {name}[{', '.join(i)}] -> {name}[{', '.join(o)}] : {' and '.join(cons)} }}"
    return isl.Map.read_from_str(ctx, text)


def _live_conflict(ctx, prog, name, moduli, tw: isl.Map, between: isl.Map) -> bool:
    same = _slot_map(ctx, prog, name, moduli)
    return not same.apply_range(tw).intersect(between).is_empty()


def contract(ctx, prog: AffineProgram, schedule: isl.Schedule, dom, kernels, shared=frozenset()) -> dict:
    """Moduli of the temporaries (not in shared: used by other groups too)
    that one kernel keeps to itself, along dimensions where a window suffices."""
    smap = schedule.get_map().intersect_domain(dom)
    _, may = prog.writes(ctx)
    reads = prog.reads(ctx)
    where: dict[str, set[int]] = {}
    for k, names in enumerate(kernels):
        for s in prog.statements:
            if s.name in names:
                where.setdefault(s.array, set()).add(k)
                for ld in prog.statement_loads(s):
                    where.setdefault(ld.array, set()).add(k)
    out = {}
    called = {box[0] for s in prog.statements if s.library is not None  # a library call's operands stay whole
              for box in [s.library.written()] + s.library.read()}
    for name, arr in prog.arrays.items():
        if arr.kind != "temp" or name in shared or len(where.get(name, ())) != 1 or not arr.shape or name in called:
            continue
        space = isl.Set.read_from_str(ctx, prog.prefix() + f"{{ {name}[{', '.join(f'x{d}' for d in range(len(arr.shape)))}] }}").get_space()
        tw_u = may.intersect_range(isl.UnionSet.from_set(isl.Set.universe(space))).reverse().apply_range(smap)
        tr_u = reads.intersect_range(isl.UnionSet.from_set(isl.Set.universe(space))).reverse().apply_range(smap)
        if tw_u.is_empty() or tr_u.is_empty():
            continue
        tw, tr = isl.Map.from_union_map(tw_u), isl.Map.from_union_map(tr_u)
        lt = isl.Map.lex_lt(tw.get_space().range())
        between = tw.lexmin().apply_range(lt).intersect(tr.lexmax().apply_range(lt.reverse()))
        moduli: list[int | None] = [None] * len(arr.shape)
        for d, extent in enumerate(arr.shape):
            limit = MAX_MODULUS if not sz.is_static(extent) else min(MAX_MODULUS, int(extent) - 1)
            for m in range(1, limit + 1):
                trial = moduli[:d] + [m] + moduli[d + 1:]
                if not _live_conflict(ctx, prog, name, trial, tw, between):
                    moduli = trial
                    break
        if any(m is not None for m in moduli):
            out[name] = tuple(moduli)
    return out


def _private_bytes(arr, moduli) -> float:
    count = 1
    for s, m in zip(arr.shape, moduli):
        if m is None and not sz.is_static(s):
            return float("inf")
        count *= int(s) if m is None else m
    return count * arr.dtype.itemsize


# ------------------------------------------------------------------ driver
def _kernels(ast: isl.AstNode) -> list[isl.AstNode]:
    if ast.get_type() == isl.ast_node_type.block:
        return _items(ast.block_get_children())
    return [ast]


def ast_nodes(node: isl.AstNode) -> list[isl.AstNode]:
    """node and every node under it, top down (walked in Python: isl's
    foreach callbacks swallow exceptions, see _items)."""
    out = [node]
    t = node.get_type()
    if t == isl.ast_node_type.block:
        for kid in _items(node.block_get_children()):
            out += ast_nodes(kid)
    elif t == isl.ast_node_type.for_:
        out += ast_nodes(node.for_get_body())
    elif t == isl.ast_node_type.if_:
        out += ast_nodes(node.if_get_then_node())
        if node.if_has_else_node():
            out += ast_nodes(node.if_get_else_node())
    elif t == isl.ast_node_type.mark:
        out += ast_nodes(node.mark_get_node())
    return out


def statements_in(node: isl.AstNode) -> set[str]:
    return {n.user_get_expr().get_op_arg(0).get_id().get_name()
            for n in ast_nodes(node) if n.get_type() == isl.ast_node_type.user}


MAX_GROUP = 6  # statements the isl scheduler fuses at once; its cost grows steeply


def fusion_groups(prog: AffineProgram, epilogues: bool = False,
                  plan: FusionPlan | None = None) -> list[list[str]]:
    """Runs of statements, in program order, that isl may fuse together.

    Program order is a topological order of the dataflow, so consecutive runs
    can always run one after another. A contraction (its initialization and
    update, with epilogues its elementwise consumers) is a group of its own;
    other runs are cut at MAX_GROUP statements. A library call's taps (role
    TAPS, im2col) start a group: fused with their producer (a batch norm and
    relu), isl's shifted nest wrote the taps out of memory order, 0.38 ms
    against 0.15 for the two passes (2x64x28x28, 3x3); plan records it.
    """
    groups: list[list[str]] = []
    current: list[str] = []
    update = None
    for s in prog.statements:
        if s.role == TAPS and current:
            _refuse_taps_fusion(prog, s, current, plan)
            groups.append(current)
            current = []
        if s.library is not None:  # a library call runs alone
            if current:
                groups.append(current)
            groups.append([s.name])
            current, update = [], None
            continue
        if update is not None and epilogues and _reduction_fits_tile(update) and _epilogue_of(s, update, prog):
            groups[-1].append(s.name)
            continue
        update = s if is_update(s) else None
        if update or is_product_init(s):
            if current and not (update and current[-1] in _inits(prog)):
                groups.append(current)
                current = []
            current.append(s.name)
            if update:
                groups.append(current)
                current = []
            continue
        if len(current) >= MAX_GROUP or _reads_reshaped(s, current, prog):
            groups.append(current)
            current = []
        current.append(s.name)
    if current:
        groups.append(current)
    return groups


def _refuse_taps_fusion(prog: AffineProgram, s, current: list[str], plan: FusionPlan | None) -> None:
    written = {t.array for t in prog.statements if t.name in current}
    if plan is not None and any(ld.array in written for ld in prog.statement_loads(s)):
        plan.refused.append(f"{s.name} ({s.label}) with its producers ({', '.join(current)}): "
                            "the taps' copy keeps its memory order")


def _plain(index) -> list[str] | None:
    """The iterators of an index made of distinct plain iterators, else None."""
    its = [e.name for e in index if isinstance(e, Var) and e.kind == "iter"]
    return its if len(its) == len(index) == len(set(its)) else None


def _epilogue_of(s, update, prog: AffineProgram) -> bool:
    """Whether s applies elementwise to the contraction's result: it reads
    the result only at its own point, over the result's whole extent."""
    if s.role in (Role.INIT, Role.UPDATE) or s.extra:
        return False
    reads = [ld for ld in prog.statement_loads(s) if ld.array == update.array]
    its = _plain(reads[0].index) if reads else None
    if its is None or sorted(its) != sorted(s.iters) or any(ld.index != reads[0].index for ld in reads):
        return False
    bounds = dict(zip(s.iters, s.bounds))
    shape = prog.arrays[update.array].shape
    return all(sz.isl_str(bounds[it][0]) == "0" and sz.isl_str(bounds[it][1]) == sz.isl_str(shape[k])
               for k, it in enumerate(its))


def _reads_reshaped(s, group: list[str], prog: AffineProgram) -> bool:
    written = {t.array for t in prog.statements if t.name in group}
    return any(ld.array in written and any(isinstance(x, Op) and x.op in ("floordiv", "mod")
                                           for i in ld.index for x in walk(i))
               for ld in loads(s.body))


def _inits(prog: AffineProgram) -> set[str]:
    return {s.name for s in prog.statements if is_product_init(s)}


SCHEDULE_BUDGET = 3_000_000  # isl operations one group may take before it is split
SOLVER_BUDGET = 8_000  # operations of isl's scheduler's first try on a group (most need fewer than 16000)
SOLVER_SECONDS = 0.5  # a try that ran out of operations sooner than this gets twice as many


def _schedule_group(ctx, prog, dom, validity, raw, names, fusion, fuse: FusionPlan | None) -> isl.Schedule:
    """isl's schedule for a group; a group whose problem exceeds the budget is
    split in two and each half scheduled alone, one after the other. A single
    statement over budget (accesses full of integer divisions, e.g. a
    flattened pooling window feeding a matmul) runs in its own loop order."""
    ctx.set_max_operations(SCHEDULE_BUDGET)
    ctx.reset_operations()
    try:
        return _schedule_one_group(ctx, prog, dom, validity, raw, names, fusion, fuse)
    except isl.Error:
        log.debug("schedule of %d statements over budget; splitting", len(names))
    finally:
        ctx.set_max_operations(0)
    if len(names) == 1:
        return isl.Schedule.from_domain(_group_domain(ctx, prog, dom, names))
    half = len(names) // 2
    first = _schedule_group(ctx, prog, dom, validity, raw, names[:half], fusion, fuse)
    return first.sequence(_schedule_group(ctx, prog, dom, validity, raw, names[half:], fusion, fuse))


def _compute_schedule(ctx, sc: isl.ScheduleConstraints) -> isl.Schedule:
    """isl's schedule for sc; isl.Error where its solver gives up. Its budget
    of operations doubles while tries fail fast: isl counts operations, not
    time, and on some problems (a transformer layer's backward: a transposed
    copy feeding a batched product) its integer programs grow numbers whose
    every operation costs more than the last, 0.25 s for 16000 operations
    and 4.4 s for 64000, where problems that need 128000 take a tenth of a
    second. The first try is small (a fast failure costs little): BERT's
    embedding group (a gather, its positions broadcast over the batch) took
    0.02 s for 8000 operations, 0.56 s for 16000 and 2.1 s for 32000, then
    was split; from 8000 it is split after 0.6 s, with the same schedule.
    The group's own budget is restored for what follows."""
    budget = SOLVER_BUDGET
    while True:
        ctx.set_max_operations(budget)
        ctx.reset_operations()
        start = time.perf_counter()
        try:
            return sc.compute_schedule()
        except isl.Error:
            spent = time.perf_counter() - start
            if spent > SOLVER_SECONDS or budget >= SCHEDULE_BUDGET:
                log.debug("isl's scheduler gave up after %d operations (%.2f s)", budget, spent)
                raise
            budget *= 2
        finally:
            ctx.set_max_operations(SCHEDULE_BUDGET)
            ctx.reset_operations()


def _group_domain(ctx, prog, dom, names) -> isl.UnionSet:
    text = prog.prefix() + "{ " + "; ".join(f"{s.name}[{', '.join(s.iters)}]" for s in prog.statements
                                          if s.name in names) + " }"
    return dom.intersect(isl.UnionSet.read_from_str(ctx, text))


def _schedule_one_group(ctx, prog, dom, validity, raw, names, fusion, fuse: FusionPlan | None) -> isl.Schedule:
    """isl's schedule of the group; a contraction's group (its epilogue
    aside, which isl need not see) then shares one nest with its
    initialization and epilogue where fuse_contraction can build it."""
    if any(s.library is not None for s in prog.statements if s.name in names):
        # its loops, unmarked: the call itself shares the work between the kernel's parts
        return isl.Schedule.from_domain(_group_domain(ctx, prog, dom, names))
    core = [s.name for s in prog.statements if s.name in names and (s.name in _inits(prog) or is_update(s))]
    epilogue = [n for n in names if n not in core] if core else []
    cdom = _group_domain(ctx, prog, dom, [n for n in names if n not in epilogue])
    cval = validity.intersect_domain(cdom).intersect_range(cdom).coalesce()
    sc = isl.ScheduleConstraints.on_domain(cdom).set_validity(cval).set_coincidence(cval)
    if fusion != "none":
        sc = sc.set_proximity(raw.intersect_domain(cdom).intersect_range(cdom).coalesce())
    sched = order_sets(_compute_schedule(ctx, sc), cval)
    sched = innermost_contiguous(sched, prog, ctx, cval)
    if fuse is not None and core:
        gdom = _group_domain(ctx, prog, dom, names)
        fused = fuse_contraction(sched, prog, gdom, validity.intersect_domain(gdom).intersect_range(gdom), fuse)
        if fused is not None:
            return fused
    sched = distribute_inits(sched, prog, cval)
    if epilogue:  # consumers that could not share the contraction's nest follow it
        sched = sched.sequence(_schedule_one_group(ctx, prog, dom, validity, raw, epilogue, fusion, None))
    return sched


GPU_PRIVATE_BYTES = 256  # a contracted buffer a GPU thread keeps to itself


def schedule_program(prog: AffineProgram, fusion: str = "max", tile_sizes=None, target=None,
                     vector_bits: int = 512, timer=None, canonical: bool = True, each=None) -> "ProgramSchedule":
    """target (a polyjit.targets.Target; None: the host's) gives its rewrites
    (the cpu's tile with register blocks sized for vectors of vector_bits,
    balance threads and sink inner loops; nvgpu's put every coincident loop
    outside), whether contractions may own their epilogues, and whether
    parallel loops become a thread grid (then only contracted buffers small
    enough for a thread's registers are kept).

    Each fusion group is scheduled as a program of its own (its statements
    run after the groups before it, so no dependence is lost), with its
    statements and arrays renamed canonically: groups of the same structure
    (a model's identical layers) share one result, scheduled once per
    process. canonical=False keeps the program's names (a target whose
    emitter reads the whole program's). each(group), where given, is called
    with each group as soon as it is scheduled (code generation starts)."""
    timer = timer or _no_timer
    if target is None:
        from .targets import target as named
        target = named(None)
    fuse = target.fuses_epilogues and fusion != "none" and not tile_sizes
    config = (fusion, tile_sizes, target, vector_bits, fuse)
    plan = FusionPlan() if fuse else None
    with timer("schedule/groups"):
        names = fusion_groups(prog, epilogues=fuse, plan=plan)
    users: dict[str, set[int]] = {}
    for g, group in enumerate(names):
        for s in prog.statements:
            if s.name in group:
                for a in [s.array] + [ld.array for ld in prog.statement_loads(s)]:
                    users.setdefault(a, set()).add(g)
    groups = []
    for g, group in enumerate(names):
        shared = {a for a, gs in users.items() if gs != {g}}
        with timer("schedule/canonical"):
            problem = group_problem(prog, group, shared, canonical)
        key = (problem.key, config)
        with _group_lock:
            sched = _group_cache.get(key)
        if sched is None:
            sched = _schedule_problem(problem, config, timer)
            with _group_lock:
                _group_cache[key] = sched
                while len(_group_cache) > GROUP_CACHE:
                    _group_cache.pop(next(iter(_group_cache)))
        groups.append(ScheduledGroup(problem, sched))
        if each is not None:
            each(groups[-1])
    return ProgramSchedule(prog, groups, plan.refused if plan else [])


GROUP_CACHE = 4096  # scheduled groups kept per process
_group_cache: dict = {}
_group_lock = threading.Lock()


def _schedule_problem(problem: "GroupProblem", config: tuple, timer) -> Scheduled:
    """One group scheduled as a program: isl's schedule, the target's
    rewrites, the AST, contracted temporaries."""
    fusion, tile_sizes, target, vector_bits, fuse = config
    prog = problem.prog
    ctx = make_context()
    if fusion == "none":
        ctx.set_schedule_whole_component(0)
        ctx.set_schedule_serialize_sccs(1)
    with timer("schedule/dependences"):
        dom = prog.domain(ctx)
        validity, raw = dependences(ctx, prog, dom)
    plan = FusionPlan() if fuse else None
    with timer("schedule/isl"):
        sched = _schedule_group(ctx, prog, dom, validity, raw, [s.name for s in prog.statements], fusion, plan)
    with timer("schedule/rewrites"):
        sched = order_sets(target.schedule_rewrites(sched, prog, validity, tile_sizes, vector_bits), validity)
    with timer("schedule/ast"):
        params = prog.prefix() + "{ : " + sz.param_context(prog.params) + " }"
        build = isl.AstBuild.from_context(isl.Set.read_from_str(ctx, params))
        ast = build.node_from_schedule(sched)
        kernels = [statements_in(k) for k in _kernels(ast)]
    with timer("schedule/contract"):
        contracted = contract(ctx, prog, sched, dom, kernels, problem.shared)
    if target.thread_grid:
        contracted = {n: m for n, m in contracted.items() if _private_bytes(prog.arrays[n], m) <= GPU_PRIVATE_BYTES}
        if fusion != "none" and _starved(ast, prog, contracted):
            return _schedule_problem(problem, ("none",) + config[1:], timer)
    return Scheduled(sched, ast, contracted, kernels, _kernel_of_array(prog, kernels), plan.refused if plan else [])


GPU_GRID_FLOOR = 1 << 16  # parallel iterations below which a GPU kernel leaves most of the device idle
GPU_STRIP = 64  # iterations of a sequential loop per strip (codegen.nvgpu.STRIP)


def _starved(ast: isl.AstNode, prog: AffineProgram, contracted) -> bool:
    """nvgpu: whether a kernel's fusion cost the device its parallelism: its
    marked loops give fewer than GPU_GRID_FLOOR threads where one of its
    statements alone would have 16 times as many (a producer fused with a
    stencil, pooling or im2col consumer, shifted along image rows, left a
    thread per image and channel: 10.6 of MobileNetV3-small's 18 ms, 60 of
    ResNet-18's 70). Sums compare their own outputs (a row sum keeps its
    rows). Elementwise statements whose arrays are all kept whole gain
    nothing from sharing a nest and lose a thread per element (ResNet-18's
    max pool, fused with its padded input along image rows, ran a row per
    thread, consecutive threads channels apart: 4.7 ms), whatever the grid.
    A kernel with contracted buffers may run strips of its next loop in
    parallel, each recomputing its halo (a blur): those count, against half
    the floor, and a thread may take four strips' work (ResNet-18's last
    im2col, fused with its relu, took 0.7 ms a thread per image and channel),
    where one loop follows the grid: a sequence of nests under it has no
    strips (a squeeze-excite block fused whole ran a thread per image)."""
    stmts = {s.name: s for s in prog.statements}
    for node in _kernels(ast):
        own = [stmts[n] for n in statements_in(node)]
        if len(own) < 2:
            continue
        grid, inner = _grid_extent(node)
        sums = [s for s in own if s.combine is not None]
        floor, per_thread = (GPU_GRID_FLOOR if sums else None), 16
        if inner is not None and any(s.array in contracted for s in own):
            grid, floor = grid and grid * -(-inner // GPU_STRIP), GPU_GRID_FLOOR // 2
            per_thread = 4 * GPU_STRIP  # a strip's own rows are no loss
        widest = max((_parallel_extent(s) or 0 for s in (sums or own)), default=0)
        if grid is not None and (floor is None or grid < floor) and widest >= per_thread * grid:
            return True
    return False


def _grid_extent(node: isl.AstNode) -> tuple[int | None, int | None]:
    """The iterations of the chain of parallel-marked loops at node's top, and
    of the loop after them (None where not numbers)."""
    total = 1
    while True:
        marked = node.get_type() == isl.ast_node_type.mark and node.mark_get_id().get_name().startswith("parallel:")
        loop = node.mark_get_node() if marked else node
        if loop.get_type() != isl.ast_node_type.for_:
            return total, None
        init, cond = loop.for_get_init(), loop.for_get_cond()
        hi = cond.get_op_arg(1)
        trips = None
        if init.get_type() == isl.ast_expr_type.int and hi.get_type() == isl.ast_expr_type.int:
            last = hi.get_val().to_python() - (cond.get_op_type() == isl.ast_expr_op_type.lt)
            step = loop.for_get_inc().get_val().to_python()
            trips = max(-(-(last - init.get_val().to_python() + 1) // step), 0)
        if not marked:
            return total, trips
        if trips is None:
            return None, None
        total *= trips
        node = loop.for_get_body()


def _parallel_extent(s) -> int | None:
    """Iterations of a statement's loops that are not its reduction's."""
    total = 1
    for it, (lo, hi) in zip(s.iters, s.bounds):
        if it not in s.reduction_iters:
            if not (sz.is_static(lo) and sz.is_static(hi)):
                return None
            total *= max(int(hi) - int(lo), 0)
    return total


def _kernel_of_array(prog: AffineProgram, kernels: list[set[str]], offset: int = 0,
                     names: dict[str, str] | None = None) -> dict[str, int]:
    """The first kernel writing each array (names: the statements' and
    arrays' names in prog, where the kernels use others)."""
    out: dict[str, int] = {}
    for k, stmts in enumerate(kernels):
        for s in prog.statements:
            if s.name in stmts:
                out.setdefault(names[s.array] if names else s.array, k + offset)
    return out


@contextmanager
def _no_timer(stage: str):
    yield
