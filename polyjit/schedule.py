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

import logging
from dataclasses import dataclass, field

import islpy as isl

from . import sizes as sz
from .affine import AffineProgram
from .expr import Var, loads, walk

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

    def ast_text(self) -> str:
        return self.ast.to_C_str()


def make_context() -> isl.Context:
    ctx = isl.Context()
    ctx.set_schedule_whole_component(1)
    ctx.set_schedule_serialize_sccs(0)
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


def is_legal(schedule: isl.Schedule, validity: isl.UnionMap) -> bool:
    """Every dependence source runs strictly before its sink."""
    if validity.is_empty():
        return True
    smap = schedule.get_map()
    rel = validity.apply_domain(smap).apply_range(smap)
    ok = True

    def check(m):
        nonlocal ok
        lt = isl.Map.lex_lt(m.get_space().domain())
        if not m.is_subset(lt):
            ok = False
    rel.foreach_map(check)
    return ok


# --------------------------------------------------------------- rewrites
def _visit(node: isl.ScheduleNode, fn) -> isl.ScheduleNode:
    node = fn(node)
    for i in range(node.n_children()):
        node = _visit(node.child(i), fn).parent()
    return node


def _member_iter(upa: isl.UnionPwAff) -> dict[str, int | None]:
    """For each statement, which of its iterators the band member follows."""
    out: dict[str, int | None] = {}

    def one(pa: isl.PwAff):
        name = pa.get_domain_space().get_tuple_name(isl.dim_type.set)
        best = None
        for _, aff in pa.get_pieces()[:1]:
            for d in range(aff.dim(isl.dim_type.in_)):
                if aff.get_coefficient_val(isl.dim_type.in_, d).to_python() != 0:
                    best = d
        out[name] = best
    upa.foreach_pw_aff(one)
    return out


def _contiguity(prog: AffineProgram) -> dict[tuple[str, int], int]:
    """(statement, iterator) -> how many accesses walk memory contiguously along it."""
    score: dict[tuple[str, int], int] = {}
    for s in prog.statements:
        # a reduction's target stays in a register while its loop runs innermost
        accesses = [ld.index for ld in loads(s.body)] + ([] if s.combine else [s.index])
        for d, name in enumerate(s.iters):
            n = 0
            for index in accesses:
                if index and any(isinstance(x, Var) and x.name == name for x in walk(index[-1])):
                    n += 2
                elif index and any(isinstance(x, Var) and x.name == name for i in index[:-1] for x in walk(i)):
                    n -= 1
            score[(s.name, d)] = n
    return score


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
    score = _contiguity(prog)

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
        best = max(range(n), key=lambda m: (totals[m], m))
        if best == n - 1:
            return node
        order = [m for m in range(n) if m != best] + [best]
        coinc = [node.band_member_get_coincident(m) for m in range(n)]
        return _rebuild_band(node, order, coinc, True)
    new = _visit(schedule.get_root(), fn).get_schedule()
    return new if is_legal(new, validity) else schedule


def sink_inner(schedule, validity) -> isl.Schedule:
    """Give each statement under a band its own innermost loop.

    A band over a sequence of statements runs them interleaved in its
    innermost loop; sinking that loop below the sequence yields one clean,
    vectorizable inner loop per statement (e.g. a row of blur_x, then a row
    of blur_y) and hoists guards out of it.
    """
    def fn(node):
        if node.get_type() != isl.schedule_node_type.band or node.band_n_member() < 2 \
                or not node.has_children():
            return node
        if node.child(0).get_type() not in (isl.schedule_node_type.sequence, isl.schedule_node_type.set):
            return node
        n = node.band_n_member()
        return node.band_split(n - 1).child(0).band_sink().parent()
    new = _visit(schedule.get_root(), fn).get_schedule()
    return new if is_legal(new, validity) else schedule


def _has_reuse(node, prog) -> bool:
    names = set()
    node.get_domain().foreach_set(lambda s: names.add(s.get_tuple_name()))
    return any(s.combine and s.label in ("dot_general", "conv") for s in prog.statements if s.name in names)


def tile(schedule, prog, validity, tile_sizes) -> isl.Schedule:
    def fn(node):
        if node.get_type() != isl.schedule_node_type.band or not node.band_get_permutable():
            return node
        n = node.band_n_member()
        if n < 2 or getattr(node, "_tiled", False):
            return node
        if tile_sizes is None and not _has_reuse(node, prog):
            return node
        if node.get_parent_type() == isl.schedule_node_type.band:
            return node
        sizes = list(tile_sizes) if tile_sizes else [DEFAULT_TILE] * n
        sizes = (sizes + [sizes[-1]] * n)[:n]
        mv = isl.MultiVal.zero(node.band_get_space())
        for i, t in enumerate(sizes):
            mv = mv.set_val(i, isl.Val.int_from_si(node.get_ctx(), int(t)))
        return node.band_tile(mv)
    new = _visit(schedule.get_root(), fn).get_schedule()
    return new if is_legal(new, validity) else schedule


def mark_parallel(schedule) -> isl.Schedule:
    def visit(node, inside):
        marked = False
        if node.get_type() == isl.schedule_node_type.band and not inside:
            inside = True
            if node.band_member_get_coincident(0):
                if node.band_n_member() > 1:
                    node = node.band_split(1)
                node = node.insert_mark(isl.Id("parallel", context=node.get_ctx())).child(0)
                marked = True
        for i in range(node.n_children()):
            node = visit(node.child(i), inside).parent()
        return node.parent() if marked else node
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


def contract(ctx, prog: AffineProgram, schedule: isl.Schedule, dom, kernels) -> dict:
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
    for name, arr in prog.arrays.items():
        if arr.kind != "temp" or len(where.get(name, ())) != 1 or not arr.shape:
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


# ------------------------------------------------------------------ driver
def _kernels(ast: isl.AstNode) -> list[isl.AstNode]:
    if ast.get_type() == isl.ast_node_type.block:
        return list(ast.block_get_children().get_list()) if hasattr(ast.block_get_children(), "get_list") \
            else [ast.block_get_children().get_at(i) for i in range(ast.block_get_children().n_ast_node())]
    return [ast]


def statements_in(node: isl.AstNode) -> set[str]:
    names: set[str] = set()

    def visit(n):
        if n.get_type() == isl.ast_node_type.user:
            names.add(n.user_get_expr().get_op_arg(0).get_id().get_name())
        return True
    node.foreach_descendant_top_down(visit)
    return names


def schedule_program(prog: AffineProgram, fusion: str = "max", tile_sizes=None) -> Scheduled:
    ctx = make_context()
    if fusion == "none":
        ctx.set_schedule_whole_component(0)
        ctx.set_schedule_serialize_sccs(1)
    dom = prog.domain(ctx)
    validity, raw = dependences(ctx, prog, dom)
    sc = isl.ScheduleConstraints.on_domain(dom).set_validity(validity).set_coincidence(validity)
    if fusion != "none":
        sc = sc.set_proximity(raw)
    sched = sc.compute_schedule()
    sched = innermost_contiguous(sched, prog, ctx, validity)
    sched = tile(sched, prog, validity, tile_sizes)
    sched = sink_inner(sched, validity)
    sched = mark_parallel(sched)
    params = prog.prefix() + "{ : " + (" and ".join(f"{p} >= 0" for p in prog.params) or "1 = 1") + " }"
    build = isl.AstBuild.from_context(isl.Set.read_from_str(ctx, params))
    ast = build.node_from_schedule(sched)
    kernels = [statements_in(k) for k in _kernels(ast)]
    contracted = contract(ctx, prog, sched, dom, kernels)
    result = Scheduled(sched, ast, contracted, kernels)
    for k, names in enumerate(kernels):
        for s in prog.statements:
            if s.name in names:
                result.kernel_of_array.setdefault(s.array, k)
    return result
