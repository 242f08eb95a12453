"""The nvgpu target's rewrites: every coincident loop outside (they become
the thread grid), marked parallel; then only the contracted buffers a thread
can hold, and no fusion that starves the grid."""
from __future__ import annotations

import islpy as isl

from ..affine import AffineProgram
from .contraction import private_bytes
from .dependences import legal_or_kept
from .fusion import starved
from .rewrites import contiguity, mark_parallel, memory_depth
from .tree import member_iter, rebuild_band, visit

GPU_PRIVATE_BYTES = 256  # a contracted buffer a GPU thread keeps to itself


def coincident_outside(schedule, validity, prog: AffineProgram) -> isl.Schedule:
    """Move the coincident members of each permutable band outside the others:
    a GPU maps every parallel loop around the sequential ones to threads, so
    a stencil's rows run down each thread. The coincident ones go in memory
    order, the most contiguous last, so that consecutive threads touch
    consecutive elements (a padded copy of NCHW images, its channel loop
    innermost for the batch norm's per-channel loads, wrote 12996 floats
    apart from thread to thread)."""
    score, depth = contiguity(prog, vectors=False), memory_depth(prog)

    def rank(mupa, m):
        follows = [(st, d) for st, d in member_iter(mupa.get_at(m)).items() if d is not None]
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
        return node if order == list(range(n)) else rebuild_band(node, order, coinc, True)
    new = visit(schedule.get_root(), fn).get_schedule()
    return legal_or_kept(new, schedule, validity)


def rewrite(sched: isl.Schedule, prog: AffineProgram, validity) -> isl.Schedule:
    """The nvgpu target's rewrites of a group's schedule, each checked by isl (the driver then orders sets)."""
    sched = coincident_outside(sched, validity, prog)
    return mark_parallel(sched, all_coincident=True)


def private_buffers(prog: AffineProgram, ast: isl.AstNode, contracted: dict, fused: bool) -> dict | None:
    """The contracted buffers small enough for a thread's registers; None
    where the group's fusion starves the grid (fusion.starved): scheduled
    again without fusion."""
    kept = {n: m for n, m in contracted.items() if private_bytes(prog.arrays[n], m) <= GPU_PRIVATE_BYTES}
    return None if fused and starved(ast, prog, kept) else kept
