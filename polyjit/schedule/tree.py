"""Helpers shared by the scheduling passes: walking isl lists and schedule
trees, reading band members, and the statement roles passes key on."""
from __future__ import annotations

import islpy as isl

from ..affine import AffineProgram, Role
from ..expr import Var


def isl_items(lst) -> list:
    """The elements of an isl list. Used instead of isl's foreach callbacks,
    which swallow exceptions: an operation limit reached inside one would
    go unnoticed (a legality check would pass)."""
    return [lst.get_at(i) for i in range(len(lst))]


def visit(node: isl.ScheduleNode, fn) -> isl.ScheduleNode:
    """node and every node under it rewritten by fn, top down; fn returns
    the node it was given, rewritten, at the same place."""
    node = fn(node)
    for i in range(node.n_children()):
        node = visit(node.child(i), fn).parent()
    return node


def member_iter(upa: isl.UnionPwAff) -> dict[str, int | None]:
    """For each statement, which of its iterators the band member follows."""
    out: dict[str, int | None] = {}
    for pa in isl_items(upa.get_pw_aff_list()):
        name = pa.get_domain_space().get_tuple_name(isl.dim_type.set)
        best = None
        for _, aff in pa.get_pieces()[:1]:
            for d in range(aff.dim(isl.dim_type.in_)):
                if aff.get_coefficient_val(isl.dim_type.in_, d).to_python() != 0:
                    best = d
        out[name] = best
    return out


def statement_names(node) -> set[str]:
    """The statements a schedule node's domain holds."""
    return {st.get_tuple_name() for st in isl_items(node.get_domain().get_set_list())}


def rebuild_band(node, members, coincident, permutable):
    """node's band with its members in the order members gives (coincident:
    per old member)."""
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


def band_sizes(node, values) -> isl.MultiVal:
    """values as the MultiVal band_tile takes for node's band."""
    mv = isl.MultiVal.zero(node.band_get_space())
    for i, t in enumerate(values):
        mv = mv.set_val(i, isl.Val.int_from_si(node.get_ctx(), int(t)))
    return mv


def _cst(pa: isl.PwAff) -> int:
    return pa.get_pieces()[0][1].get_constant_val().to_python()


def member_extent(node, m: int) -> int | None:
    """The static trip count of band member m, or None when it depends on sizes."""
    upa = node.band_get_partial_schedule().get_at(m)
    umap = isl.UnionMap.from_union_pw_aff(upa).intersect_domain(node.get_domain())
    rng = umap.range()
    out: list = []
    for st in isl_items(rng.get_set_list()):
        lo, hi = st.dim_min(0), st.dim_max(0)
        if lo.is_cst() and hi.is_cst() and lo.n_piece() == 1 and hi.n_piece() == 1:
            out.append(_cst(hi) - _cst(lo) + 1)
        else:
            out.append(None)
    if not out or None in out:
        return None
    return max(out)


UNROLL = "unroll:"  # a mark over loops code generation unrolls: their trip counts, outermost first (0: plain)


def unroll_mark(trips: list[int]) -> str:
    """The name of a mark over loops to unroll that run at most trips times."""
    return UNROLL + ",".join(str(t) for t in trips)


def unrolled_trips(name: str) -> tuple[int, ...] | None:
    """The trip counts an unroll mark names, or None for another mark."""
    return tuple(int(t) for t in name[len(UNROLL):].split(",") if t) if name.startswith(UNROLL) else None


def member_trips(node, m: int) -> int | None:
    """The most iterations band member m takes for one iteration of the
    loops outside it (a tile's width), or None where that has no bound."""
    mupa = node.band_get_partial_schedule()
    prefix = node.get_prefix_schedule_multi_union_pw_aff()  # (isl's union map of it took 3/4 of the time)
    for k in range(m):
        prefix = prefix.flat_range_product(isl.MultiUnionPwAff.from_union_pw_aff(mupa.get_at(k)))
    values = isl.UnionMap.from_multi_union_pw_aff(prefix).reverse().apply_range(
        isl.UnionMap.from_union_pw_aff(mupa.get_at(m)).intersect_domain(node.get_domain()))
    spans = values.lexmin().reverse().apply_range(values.lexmax()).deltas()
    out = []
    for st in isl_items(spans.get_set_list()):  # the most over any sizes too (a tile's width, where they are symbolic)
        hi = st.max_val(isl.Aff.var_on_domain(isl.LocalSpace.from_space(st.get_space()), isl.dim_type.set, 0))
        if not hi.is_int():
            return None
        out.append(hi.to_python() + 1)
    return max(out) if out else None


def is_update(s) -> bool:
    """Whether statement s accumulates a contraction's products."""
    return s.role is Role.UPDATE and s.contraction


def is_product_init(s) -> bool:
    """Whether statement s initializes a contraction's result."""
    return s.role is Role.INIT and s.contraction


def contractions_in(node, prog):
    """The contraction updates under a schedule node."""
    names = statement_names(node)
    return [s for s in prog.statements if s.name in names and is_update(s)]


def product_inits(prog: AffineProgram) -> set[str]:
    """The names of the statements that initialize contraction results."""
    return {s.name for s in prog.statements if is_product_init(s)}


def plain_iters(index) -> list[str] | None:
    """The iterators of an index made of distinct plain iterators, else None."""
    its = [e.name for e in index if isinstance(e, Var) and e.kind == "iter"]
    return its if len(its) == len(index) == len(set(its)) else None


def group_domain(ctx, prog, dom, names) -> isl.UnionSet:
    """dom restricted to the statements names."""
    text = prog.prefix() + "{ " + "; ".join(f"{s.name}[{', '.join(s.iters)}]" for s in prog.statements
                                          if s.name in names) + " }"
    return dom.intersect(isl.UnionSet.read_from_str(ctx, text))


IN_ORDER = "in order"  # a mark over a group's statements, each its own nest, one after another: one kernel, one thread
SIDE_BY_SIDE = "side by side"  # the same over independent nests, their loops parallel: one kernel, threads for each


def in_order(ctx, prog, dom) -> isl.Schedule:
    """The group's statements one after another, each in a nest of its own
    with its loops in its iterators' order, under an IN_ORDER mark: one
    kernel (schedule.ast.kernel_nodes) that one thread runs (a target's
    preparation, schedule.fusion.preparation), with no work for isl's
    scheduler."""
    return _marked_nests(ctx, prog, dom, IN_ORDER)


def side_by_side(ctx, prog, dom) -> isl.Schedule:
    """The group's statements, none reading another's result, each in a
    nest of its own whose loops are all parallel (marked so), under a
    SIDE_BY_SIDE mark: one kernel whose threads are dealt out among the
    nests (schedule.fusion.side_by_side_statements, codegen.gpu_mapping.SideBySide)."""
    return _marked_nests(ctx, prog, dom, SIDE_BY_SIDE)


def _marked_nests(ctx, prog, dom, mark: str) -> isl.Schedule:
    """A sequence of the statements' nests, loops in their iterators' order,
    under mark; side by side, every loop coincident and marked parallel."""
    parallel = mark == SIDE_BY_SIDE
    parts = []
    for s in prog.statements:
        part = isl.Schedule.from_domain(group_domain(ctx, prog, dom, [s.name]))
        if s.iters:
            loops = isl.UnionMap.read_from_str(
                ctx, prog.prefix() + f"{{ {s.name}[{', '.join(s.iters)}] -> [{', '.join(s.iters)}] }}")
            part = part.insert_partial_schedule(isl.MultiUnionPwAff.from_union_map(loops))
            if parallel:
                band = part.get_root().child(0)
                for m in range(band.band_n_member()):
                    band = band.band_member_set_coincident(m, 1)
                part = band.get_schedule()
        parts.append(part)
    sched = parts[0]
    for part in parts[1:]:
        sched = sched.sequence(part)
    if parallel:
        from .rewrites import mark_parallel  # (rewrites imports this module)
        sched = mark_parallel(sched, all_coincident=True)
    return sched.get_root().child(0).insert_mark(isl.Id(mark, context=ctx)).get_schedule()


def joined_sums(ctx, prog, dom, pairs: list[tuple[str, str]]) -> isl.Schedule:
    """Sibling sums (schedule.fusion.sibling_sums: (init, update) pairs over
    the same iterations) in one nest: their elements' loops outside,
    coincident, and in each element the initializations, then the
    reduction's loops with every update in their body."""
    by_name = {s.name: s for s in prog.statements}
    inits, updates = [by_name[i] for i, _ in pairs], [by_name[u] for _, u in pairs]
    kept = len(inits[0].iters)

    def band(statements, dims: slice) -> isl.MultiUnionPwAff:
        maps = "; ".join(f"{s.name}[{', '.join(s.iters)}] -> [{', '.join(s.iters[dims])}]" for s in statements)
        return isl.MultiUnionPwAff.from_union_map(isl.UnionMap.read_from_str(ctx, prog.prefix() + f"{{ {maps} }}"))

    def each(node, statements) -> isl.ScheduleNode:
        if len(statements) == 1:
            return node
        filters = isl.UnionSetList.alloc(ctx, len(statements))
        for s in statements:
            filters = filters.add(group_domain(ctx, prog, dom, [s.name]))
        return node.insert_sequence(filters)

    names = [n for pair in pairs for n in pair]
    node = isl.Schedule.from_domain(group_domain(ctx, prog, dom, names)).get_root().child(0)
    node = node.insert_partial_schedule(band(inits + updates, slice(0, kept))).band_set_permutable(1)
    for m in range(kept):
        node = node.band_member_set_coincident(m, 1)
    parts = isl.UnionSetList.alloc(ctx, 2)
    for group in (inits, updates):
        parts = parts.add(group_domain(ctx, prog, dom, [s.name for s in group]))
    node = node.child(0).insert_sequence(parts)
    node = each(node.child(0).child(0), inits).parent().parent()
    node = node.child(1).child(0).insert_partial_schedule(band(updates, slice(kept, None)))
    return each(node.child(0), updates).get_schedule()
