"""isl's context for scheduling, the program's dependences from isl's
dataflow analysis, and the legality check every rewrite passes."""
from __future__ import annotations

import islpy as isl

from ..affine import AffineProgram
from .tree import isl_items


def make_context() -> isl.Context:
    """A fresh isl context with the scheduler's and tiler's options."""
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
    """The statements' instances in program order: statement by statement."""
    depth = max([len(s.iters) for s in prog.statements] + [0])
    parts = []
    for k, s in enumerate(prog.statements):
        dims = [str(k)] + list(s.iters) + ["0"] * (depth - len(s.iters))
        parts.append(f"{s.name}[{', '.join(s.iters)}] -> [{', '.join(dims)}]")
    return isl.UnionMap.read_from_str(ctx, prog.prefix() + "{ " + "; ".join(parts) + " }")


def accesses(ctx, prog: AffineProgram, dom: isl.UnionSet) -> tuple[isl.UnionMap, isl.UnionMap, isl.UnionMap]:
    """(must-writes, may-writes, reads) within dom, coalesced: the dataflow
    analysis of a 5x5 depthwise window's 25 reads, one relation each, took
    2 s a group where one takes 0.05 (a padded window's taps are one box:
    AffineProgram.reads)."""
    must, may = prog.writes(ctx)
    return tuple(m.intersect_domain(dom).coalesce() for m in (must, may, prog.reads(ctx)))


def dependences(ctx, prog: AffineProgram, dom: isl.UnionSet, access=None):
    """(validity, flow): all ordering constraints, and the dataflow among them
    (access: accesses(ctx, prog, dom), where already known)."""
    must, may, reads = access or accesses(ctx, prog, dom)
    order = program_order(ctx, prog).intersect_domain(dom)

    def flow(sink, must_src, may_src):
        info = isl.UnionAccessInfo.from_sink(sink).set_must_source(must_src)
        info = info.set_may_source(may_src).set_schedule_map(order)
        return info.compute_flow().get_may_dependence()

    raw = flow(reads, must, may)
    rewritten = _rewritten(prog, must, may, reads)
    must, may, reads = (_onto(ctx, m, rewritten) for m in (must, may, reads))
    waw = flow(may, must, may)
    war = flow(may, _empty(ctx), reads)
    validity = raw.union(waw).union(war).coalesce()
    return validity, raw.coalesce()


def _rewritten(prog: AffineProgram, must: isl.UnionMap, may: isl.UnionMap, reads: isl.UnionMap) -> set[str]:
    """The arrays whose elements may be written twice, or read before they
    are written: only these have output and anti dependences. An array
    that one plain statement writes, each element once (an affine,
    one-to-one write), and that only later statements read has neither;
    most temporaries of a tensor program are such, and the inputs have
    none, so the two analyses run over a few arrays (a reduction's, a
    scatter's) rather than every access."""
    position = {s.name: k for k, s in enumerate(prog.statements)}
    plain = {s.name for s in prog.statements if s.combine is None and s.library is None}
    writers: dict[str, list] = {}
    for m in isl_items(may.get_map_list()):
        writers.setdefault(m.get_tuple_name(isl.dim_type.out), []).append(m)
    certain = {(m.get_tuple_name(isl.dim_type.in_), m.get_tuple_name(isl.dim_type.out))
               for m in isl_items(must.get_map_list())}
    readers: dict[str, list[str]] = {}
    for m in isl_items(reads.get_map_list()):
        readers.setdefault(m.get_tuple_name(isl.dim_type.out), []).append(m.get_tuple_name(isl.dim_type.in_))
    out = set()
    for array, maps in writers.items():
        writer = maps[0].get_tuple_name(isl.dim_type.in_)
        once = len(maps) == 1 and writer in plain and (writer, array) in certain and maps[0].is_injective()
        if not once or any(position[r] <= position[writer] for r in readers.get(array, ())):
            out.add(array)
    return out


def _onto(ctx, m: isl.UnionMap, arrays: set[str]) -> isl.UnionMap:
    """The maps of m into the given arrays."""
    out = _empty(ctx)
    for x in isl_items(m.get_map_list()):
        if x.get_tuple_name(isl.dim_type.out) in arrays:
            out = out.union(isl.UnionMap.from_map(x))
    return out


def legal_or_kept(new: isl.Schedule, schedule: isl.Schedule, validity: isl.UnionMap) -> isl.Schedule:
    """A rewrite's result where every dependence holds in it, else the
    (legal) schedule it rewrote. Most rewrites change nothing on most
    groups; the tree's comparison then saves the check."""
    if new.plain_is_equal(schedule):
        return schedule
    return new if is_legal(new, validity) else schedule


def is_legal(schedule: isl.Schedule, validity: isl.UnionMap) -> bool:
    """Every dependence source runs strictly before its sink."""
    if validity.is_empty():
        return True
    smap = schedule.get_map()
    rel = validity.apply_domain(smap).apply_range(smap)
    return all(m.is_subset(isl.Map.lex_lt(m.get_space().domain())) for m in isl_items(rel.get_map_list()))
