"""Schedule-tree rewrites both targets use, each kept only where isl confirms
that every dependence still holds: loop order by memory layout, a
contraction's initialization in a nest of its own, sets as sequences, and
the parallel marks code generation splits."""
from __future__ import annotations

import islpy as isl

from ..affine import AffineProgram
from ..expr import Var, data_loads, loads, walk
from .dependences import legal_or_kept
from .tree import is_product_init, isl_items, member_extent, member_iter, rebuild_band, visit


def contiguity(prog: AffineProgram, vectors: bool = True) -> dict[tuple[str, int], int]:
    """(statement, iterator) -> how many accesses walk memory contiguously
    along it; without vectors, loads of one-dimensional arrays in nests of
    three loops or more (a batch norm's per-channel parameters, in cache) count none.
    A gather's indices count none either: read once per gathered row, they
    outvoted the rows themselves (BERT's embeddings walked the table down
    its columns, the token loop innermost: 4x slower than along the rows)."""
    score: dict[tuple[str, int], int] = {}
    for s in prog.statements:
        # a reduction's target stays in a register while its loop runs innermost
        accesses = [ld.index for ld in data_loads(s.body) if vectors or len(ld.index) > 1 or len(s.iters) < 3]
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


def memory_depth(prog: AffineProgram) -> dict[tuple[str, int], int]:
    """(statement, iterator) -> how far inside its arrays the iterator indexes:
    loops over outer dimensions go outside, so that rows are walked in order."""
    depth: dict[tuple[str, int], int] = {}
    for s in prog.statements:
        accesses = [ld.index for ld in loads(s.body)] + [s.index]
        for d, name in enumerate(s.iters):
            depth[(s.name, d)] = sum(p for index in accesses for p, i in enumerate(index)
                                     if any(isinstance(x, Var) and x.name == name for x in walk(i)))
    return depth


def innermost_contiguous(schedule, prog, ctx, validity) -> isl.Schedule:
    """Order each permutable band's members as memory is laid out: the loop
    with the most contiguous accesses innermost, loops over outer dimensions
    outside."""
    score, depth = contiguity(prog), memory_depth(prog)

    def scores(band) -> list[int]:  # each member's contiguous accesses
        mupa = band.band_get_partial_schedule()
        return [sum(score.get((st, d), 0) for st, d in member_iter(mupa.get_at(m)).items() if d is not None)
                for m in range(band.band_n_member())]

    def fn(node):
        if node.get_type() != isl.schedule_node_type.band or node.band_n_member() < 2 \
                or not node.band_get_permutable():
            return node
        n = node.band_n_member()
        mupa = node.band_get_partial_schedule()
        totals = scores(node)
        deep = [sum(depth.get((st, d), 0) for st, d in member_iter(mupa.get_at(m)).items() if d is not None)
                for m in range(n)]
        order = sorted(range(n), key=lambda m: (totals[m], deep[m], m))
        coinc = [node.band_member_get_coincident(m) for m in range(n)]
        # the last member may move outside only where a loop inside the band walks memory in order (a batch
        # norm's backward: its image rows); elsewhere it is the nest's innermost (a bias gradient's column
        # sums: moved outside, each thread read its columns down the rows, 0.02 -> 0.07 ms at 512x256)
        inner = [t for band in _bands_inside(node) for t in scores(band)]
        last = order if inner and max(inner) > 0 else order[:-1]
        outer = [m for m in last if coinc[m]]  # (a band over inner nests may move its last out)
        if outer and not coinc[order[0]]:  # keep a parallel loop outermost
            order.remove(outer[0])
            order.insert(0, outer[0])
        if order == list(range(n)):
            return node
        return rebuild_band(node, order, coinc, True)
    new = visit(schedule.get_root(), fn).get_schedule()
    return legal_or_kept(new, schedule, validity)


def _bands_inside(node) -> list:
    """The band nodes below node."""
    kids = [node.child(i) for i in range(node.n_children())] if node.has_children() else []
    return [b for k in kids for b in ([k] if k.get_type() == isl.schedule_node_type.band else []) + _bands_inside(k)]


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
    for st in isl_items(dom.get_set_list()):
        if st.get_tuple_name() in init_names:
            first = first.union(isl.UnionSet.from_set(st))
        else:
            rest = rest.union(isl.UnionSet.from_set(st))
    if rest.is_empty():
        return schedule
    filters = isl.UnionSetList.alloc(root.get_ctx(), 2).add(first).add(rest)
    new = root.child(0).insert_sequence(filters).get_schedule()
    return legal_or_kept(new, schedule, validity)


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
    return visit(schedule.get_root(), fn).get_schedule()


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
            all(member_extent(node, m) == 1 for m in range(node.band_n_member()))
        if node.get_type() == isl.schedule_node_type.band and not inside and not trivial:
            inside = True
            n = node.band_n_member()
            m = 0
            while m < n - 1 and member_extent(node, m) == 1:
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
