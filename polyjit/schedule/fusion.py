"""Which statements share loop nests: fusion groups in program order, a
contraction's nest shared with its elementwise epilogue (cpu), and the cost
models that refuse a fusion (cpu) or undo one that starves the GPU."""
from __future__ import annotations

from dataclasses import dataclass, field

import islpy as isl

from .. import sizes as sz
from ..affine import TAPS, AffineProgram, Role
from ..expr import QUASI_AFFINE, Const, Load, Op, Var, iter_vars, loads, merged_index, select_parts, walk
from .ast import ast_nodes, ast_uses, kernel_nodes, statements_in, static_extent
from .cpu_rewrites import TILE_RED
from .dependences import is_legal
from .tree import (group_domain, is_product_init, is_update, isl_items, member_iter, plain_iters, product_inits,
                   statement_names, visit)


MAX_GROUP = 6  # statements the isl scheduler fuses at once; its cost grows steeply


@dataclass
class FusionPlan:
    """What the cpu schedule may fuse into a contraction's nest, and the
    fusions its cost model refused, each with its reason."""

    refused: list[str] = field(default_factory=list)


def fusion_groups(prog: AffineProgram, epilogues: bool = False,
                  plan: FusionPlan | None = None, sums_apart: bool = False,
                  small_apart: bool = False, windows_apart: bool = False,
                  column_sums_apart: bool = False, first: list[str] = ()) -> list[list[str]]:
    """Runs of statements, in program order, that isl may fuse together.

    Program order is a topological order of the dataflow, so consecutive runs
    can always run one after another. A scatter is a group of its own: its
    loop cannot be shared by threads, and fused with its target's zeroing
    and readers (BERT's word-embedding gradient, 30522x256) it made them
    run on one thread too (7.3 ms of a 2-thread training step). A
    contraction (its initialization and update, with epilogues its
    elementwise consumers) is a group of its own; other runs are cut at
    MAX_GROUP statements, some sums' initializations not counted (_size; a sum's
    initialization going with its update; one more where it reads only the
    run's last statement, _pointwise_tail),
    around a strided window (with windows_apart, any window: _window) or,
    with sums_apart, before a reduction of a reduction's results
    (_sums_a_sum). A convolution's taps (role TAPS: im2col, a padded copy)
    start a group: fused with their producer (a batch norm and relu),
    isl's shifted nest wrote the taps out of memory order, 0.38 ms against
    0.15 for the two passes (2x64x28x28, 3x3); plan records it.

    With small_apart, a statement that shares no array with the current run
    and has a small fraction of the iterations of its largest statement (a
    weight's transposed copy, a folded batch norm's per-channel scale, among
    the activations' statements) goes into a group just before the run
    instead, out of program order where nothing requires it: nothing in the
    run depends on it or it on the run. In the run it only steered isl:
    MobileNetV3's depthwise weights in their consumer's group took isl 4-18
    s a group on the GPU, whose kernels never shared a nest with them. On
    the host, with both options, MobileNetV2 compiled 0.45 s sooner and ran
    3-10% slower (bench/NOTES.md): its groups stay as they were. A run's
    small heads go before it too (_small_heads). With column_sums_apart, a
    sum over the leading dimensions of a value the run makes starts a group
    (_column_sum).

    first (the target's preparation, where it gathers one) is the first
    group, its statements then taken out of the others: the runs keep their
    bounds, where closing them without it fused more of the activations'
    statements in each, which isl took longer over and MobileNetV2 ran
    slower with. Its tables of positions (an upsampling's indices and
    weights, _positional) are no part of a run: counted, they cut the run of
    an upsampling's row gathers and their blend in two, and the rows
    gathered were stored whole between them.
    """
    groups: list[list[str]] = []
    current: list[str] = []
    update = None
    inits = {s.name for s in prog.statements if s.role is Role.INIT}
    by_name = {s.name: s for s in prog.statements}
    ahead = None  # a group of statements apart from the current run, just before it
    windows: set[str] = set()  # windows (their readers start the next group)
    tables = _positional(prog) & set(first)
    for s in prog.statements:
        if s.name in tables:  # (the preparation's tables of positions: no part of a run)
            continue
        if small_apart and update is None and current and _apart(s, [by_name[n] for n in current], prog):
            if ahead is None or len(ahead) >= MAX_GROUP or groups[-1] is not ahead:
                ahead = [s.name]
                groups.append(ahead)
            else:
                ahead.append(s.name)
            continue
        if s.role == TAPS and current:
            _refuse_taps_fusion(prog, s, current, plan)
            groups.append(current)
            current = []
        if s.library is not None or _scatters(s):  # a library call runs alone; so does a scatter, whose
            if current:  # writes may collide (one thread): its zeroed target and readers stay parallel
                groups.append(current)
            groups.append([s.name])
            current, update = [], None
            continue
        if update is not None and epilogues and reduction_fits_tile(update) and _epilogue_of(s, update, prog):
            groups[-1].append(s.name)
            continue
        update = s if is_update(s) else None
        if update or is_product_init(s):
            if current and not (update and current[-1] in product_inits(prog)):
                groups.append(current)
                current = []
            current.append(s.name)
            if update:
                groups.append(current)
                current = []
            continue
        if current and (_size(current, inits, by_name, prog) >= MAX_GROUP
                        and not _pointwise_tail(s, current, by_name, inits, prog)
                        or _reads_reshaped(s, current, prog)
                        or sums_apart and _sums_a_sum(s, current, prog)
                        or windows and _reads_window(s, {by_name[n].array for n in current if n in windows}, prog)
                        or column_sums_apart and _column_sum(s, {by_name[n].array for n in current
                                                                 if _plain(by_name[n])}, prog)):
            held = [n for n in current if n in inits and by_name[n].array == s.array] \
                if s.role is Role.UPDATE else []  # (a sum's initialization goes with it)
            current = [n for n in current if n not in held]
            if current:
                groups.append(current)
            current = held
        elif current and _window(s, {by_name[n].array for n in current}, windows_apart):
            if len(current) > 1:
                groups.append(current[:-1])
            current = current[-1:]
            windows.add(s.name)
        current.append(s.name)
    if current:
        groups.append(current)
    if small_apart:
        groups = [part for g in groups for part in _small_heads(g, by_name, prog)]
    if first:
        gathered = set(first)
        groups = [list(first)] + [kept for g in groups if (kept := [n for n in g if n not in gathered])]
    return groups


def _positional(prog: AffineProgram) -> set[str]:
    """The plain statements computed from positions and constants alone
    (an upsampling's index tables and weights)."""
    made: set[str] = set()
    for s in prog.statements:
        if _plain(s) and all(ld.array in made for ld in prog.statement_loads(s)):
            made.add(s.array)
    return {s.name for s in prog.statements if s.array in made}


PREPARATION_POINTS = 4096  # the most instances a statement of the preparation (below) has


def preparation(prog: AffineProgram) -> list[str]:
    """The program's preparation, in program order: plain statements of at
    most PREPARATION_POINTS instances each (static sizes), computed from the
    program's inputs and one another alone (a folded batch norm's
    per-channel scale and shift, its scaled weights, a gain's broadcast),
    where there are two or more and other statements besides (a small
    program stays whole, its statements fused). Nothing else writes their arrays, and
    nothing they read is made after them, so they may all run first, as one
    group and one kernel on one thread (schedule.tree.in_order): each a
    kernel of its own, Keras MobileNetV2's 87 cost LLVM about 12 ms apiece
    and joined the activations' fusion groups, enlarging isl's problems."""
    writers: dict[str, set[str]] = {}
    for s in prog.statements:
        writers.setdefault(s.array, set()).add(s.name)
    prep = {s.name for s in prog.statements if _plain(s) and s.points is not None and s.points <= PREPARATION_POINTS}
    while True:
        made = {s.array for s in prog.statements if s.name in prep}
        kept = {s.name for s in prog.statements if s.name in prep and writers[s.array] <= prep
                and all(ld.array not in writers or ld.array in made for ld in prog.statement_loads(s))}
        if kept == prep:
            break
        prep = kept
    return [s.name for s in prog.statements if s.name in prep] if 1 < len(prep) < len(prog.statements) else []


def side_by_side_statements(prog: AffineProgram, most: int) -> list[str]:
    """The statements a GPU runs first, side by side in one kernel
    (schedule.tree.side_by_side): plain ones of static sizes computed from
    the program's inputs alone, each its array's only writer, that copy an
    input (a weight laid out for cuDNN, a depthwise kernel's taps along the
    channels) or have at most 1/APART of the largest statement's
    iterations (a folded batch norm's scale); where there are two or more
    and other statements besides. No one of them reads another's result,
    so each takes threads of its own: as kernels of their own, MobileNetV3's
    forty weight copies took a launch each, longer than the copying. At
    most `most` of them (the target's Target.side_by_side_nests)."""
    writers: dict[str, int] = {}
    for s in prog.statements:
        writers[s.array] = writers.get(s.array, 0) + 1
    largest = max((s.points or 0 for s in prog.statements), default=0)
    chosen = [s.name for s in prog.statements
              if _plain(s) and s.points is not None and s.points > 1 and writers[s.array] == 1
              and all(ld.array not in writers for ld in prog.statement_loads(s))
              and (isinstance(s.body, Load) or s.points * APART <= largest)][:most]
    return chosen if 1 < len(chosen) < len(prog.statements) else []


def _small_heads(group: list[str], by_name: dict, prog: AffineProgram) -> list[list[str]]:
    """The group as its small heads, then the rest. A head is a plain
    statement with at most 1/APART of the iterations of the group's largest
    that reads nothing the rest writes, and whose result the rest reads only
    broadcast (a batch norm's mean, divided from sums an earlier group made,
    read at every image row, and its running mean's update). A GPU kernel
    cannot wait for values other threads make, so such a head runs in a
    kernel of its own either way; in the group, its dependences on every
    point of the larger statements took isl's scheduler 8 s over one group
    of ResNet-18's training forward, which it then split."""
    stmts = [by_name[n] for n in group]
    largest = max((s.points or 0 for s in stmts), default=0)
    heads = {s.name for s in stmts if _plain(s) and s.points is not None and s.points * APART <= largest}
    while heads:
        kept = {h for h in heads if _may_go_first(stmts, group.index(h), heads, prog)}
        if kept == heads:
            break
        heads = kept
    if not heads or len(heads) == len(group):  # (all of them heads: statements of no iterations)
        return [group]
    return [[n for n in group if n in heads], [n for n in group if n not in heads]]


def _may_go_first(stmts: list, k: int, heads: set[str], prog: AffineProgram) -> bool:
    """Whether stmts[k] may run before the statements of stmts not in heads:
    it reads nothing they write, those before it touch nothing it writes,
    and those after it read its result broadcast only."""
    h = stmts[k]
    reads = {ld.array for ld in prog.statement_loads(h)}
    for j, r in enumerate(stmts):
        if r.name in heads:
            continue
        if r.array in reads or r.array == h.array:
            return False
        r_loads = [ld for ld in loads(r.body) if ld.array == h.array]
        if r_loads and (j < k or not all(_broadcast(r, ld) for ld in r_loads)):
            return False
    return True


def _broadcast(s, ld) -> bool:
    """Whether load ld of s reads one element at several of s's points: one
    of its loops of more than one iteration is in none of its indices."""
    used = {x.name for i in ld.index for x in walk(i) if isinstance(x, Var)}
    return any(it not in used and not (isinstance(lo, int) and isinstance(hi, int) and hi - lo <= 1)
               for it, (lo, hi) in zip(s.iters, s.bounds))


def _reads_window(s, made: set[str], prog: AffineProgram) -> bool:
    """Whether s reads one of the arrays windows made."""
    return any(ld.array in made for ld in prog.statement_loads(s))


APART = 16  # a statement this many times smaller than a run's largest, sharing no array with it, goes before it


def _apart(s, run: list, prog: AffineProgram) -> bool:
    """Whether plain statement s touches no array the statements of run do
    and has at most 1/APART of the iterations of the largest of them."""
    if not _plain(s):
        return False
    touched = {t.array for t in run} | {ld.array for t in run for ld in prog.statement_loads(t)}
    if s.array in touched or any(ld.array in touched for ld in prog.statement_loads(s)):
        return False
    largest = max((t.points or 0 for t in run), default=0)
    return s.points is not None and s.points * APART <= largest


LARGE_WINDOW = 36  # points of an array a window reads (6x6 and up) from which it starts a group on every target


def _window(s, written: set[str], any_stride: bool) -> bool:
    """Whether s reads a window of an array the group writes at a stride (a
    strided depthwise convolution), at LARGE_WINDOW points or more (ConvNeXt's
    7x7 depthwise convolution, its padding's clamped indices included: isl
    took 1-4 s a group over its producer's dependences), or with
    any_stride, at several shifted positions (any depthwise convolution).
    It then shares a group with the
    statement before it only (its producer, or its weights' copy), and its
    readers start the next group, on every target. Shifting a chain of
    producers (a batch norm, then hardswish) under a stride-2 window took
    isl's scheduler 8-19 s a group in MobileNetV3; a reduction of the
    window's result (squeeze-excite's pooling) with the two, 3.3 s; on the
    GPU, with the window's own batch norm between them (training), 13-18 s."""
    def strided(e) -> bool:  # one iterator, times a stride, plus a tap: ((i * 2) - 1)
        its = [x for x in walk(e) if isinstance(x, Var) and x.kind == "iter"]
        return len(its) == 1 and any(isinstance(x, Op) and x.op == "mul" and x.args[0] == its[0]
                                     and isinstance(x.args[1], Const) and abs(x.args[1].value) > 1 for x in walk(e))
    reads = [ld for ld in loads(s.body) if ld.array in written]
    if any(strided(i) for ld in reads for i in ld.index):
        return True
    points: dict[str, set] = {}
    for ld in reads:
        points.setdefault(ld.array, set()).add(ld.index)
    if any(len(p) >= LARGE_WINDOW for p in points.values()):
        return True
    if not any_stride:
        return False
    taps: dict[str, set] = {}
    for ld in reads:
        if any(isinstance(i, Op) and iter_vars(i) and not any(isinstance(x, Op) and x.op in QUASI_AFFINE
                                                              for x in walk(i)) for i in ld.index):
            taps.setdefault(ld.array, set()).add(ld.index)
    return any(len(t) > 1 for t in taps.values())


def _plain(s) -> bool:
    """Whether s assigns each point once, in loops of its own: no sum, library call or scatter."""
    return s.role is Role.ASSIGN and s.library is None and not _scatters(s)


UNCOUNTED_INITS = 2  # sums' initializations a run along rows holds beyond MAX_GROUP


def _size(run: list[str], inits: set[str], by_name: dict, prog: AffineProgram) -> int:
    """A run's size as MAX_GROUP counts it: its statements, but up to
    UNCOUNTED_INITS sums' initializations where every statement runs along
    rows (_along_rows). A training layer norm's two sums, their results,
    its inverse deviation and its output are then one run, one pass over
    each row, where its sums' zeroings had cut it before the last two:
    three kernels on the GPU, the rows read twice. Any run so counted (an
    average pool's padded window and its gradient's sum) took isl 7.6 s
    where two runs took 0.6 (flax_cnn's training step, bench/NOTES.md)."""
    held = sum(n in inits for n in run)
    if not held or not all(_along_rows(by_name[n], prog) for n in run):
        return len(run)
    return len(run) - min(UNCOUNTED_INITS, held)


def _along_rows(s, prog: AffineProgram) -> bool:
    """Whether s writes and reads each array at its own loops' iterators, in
    their order (some left out: a row's sum, its broadcast; some merged: a
    product's result read as [batch, tokens, features]), or at constants:
    no window, shift, transpose, gather or library call."""
    if s.library is not None or s.extra or _scatters(s):
        return False
    for index in [s.index] + [ld.index for ld in prog.statement_loads(s)]:
        at = -1
        for e in index:
            names = _unshifted(e)
            if names is None:
                return False
            for name in names:
                if name not in s.iters or s.iters.index(name) <= at:
                    return False
                at = s.iters.index(name)
    return True


def _unshifted(e) -> list[str] | None:
    """The iterators of index e in order where it is a constant, an
    iterator, or sums of iterators times constants (a merge of dimensions);
    None where it adds a constant (a shift) or is anything else."""
    if isinstance(e, (Const, int)):
        return []
    if isinstance(e, Var):
        return [e.name] if e.kind == "iter" else None
    if isinstance(e, Op) and e.op == "mul" and len(e.args) == 2:
        k = [a for a in e.args if isinstance(a, (Const, int))]
        rest = [a for a in e.args if not isinstance(a, (Const, int))]
        return _unshifted(rest[0]) if len(k) == 1 and len(rest) == 1 else None
    if isinstance(e, Op) and e.op == "add" and len(e.args) == 2:
        parts = [_unshifted(a) for a in e.args]
        return None if any(p is None or not p for p in parts) else parts[0] + parts[1]
    return None


def _pointwise_tail(s, current: list[str], by_name: dict, inits: set[str], prog: AffineProgram) -> bool:
    """Whether s, one past MAX_GROUP, may join the run: the run's last
    statement is its only producer in the run, read at s's own point over
    the same loops (a training layer norm's `x_hat * w + b`, after the
    x_hat it saves). Cut off, it read the whole of x_hat back in a kernel of
    its own; fused, it adds isl one statement and one dependence."""
    last = by_name[current[-1]]
    if _size(current, inits, by_name, prog) != MAX_GROUP or not _plain(s) or not _plain(last) or s.extra or last.extra \
            or s.bounds != last.bounds or plain_iters(last.index) != list(last.iters):
        return False
    written = {by_name[n].array for n in current}
    reads = [ld for ld in prog.statement_loads(s) if ld.array in written]
    return bool(reads) and all(ld.array == last.array and plain_iters(ld.index) == list(s.iters) for ld in reads)


def _scatters(s) -> bool:
    """Whether s writes where loaded values say (a scatter: an embedding's gradient)."""
    return any(loads(i) for i in s.index)


def _refuse_taps_fusion(prog: AffineProgram, s, current: list[str], plan: FusionPlan | None) -> None:
    written = {t.array for t in prog.statements if t.name in current}
    if plan is not None and any(ld.array in written for ld in prog.statement_loads(s)):
        plan.refused.append(f"{s.name} ({s.label}) with its producers ({', '.join(current)}): "
                            "the taps' copy keeps its memory order")


def _epilogue_of(s, update, prog: AffineProgram) -> bool:
    """Whether s applies elementwise to the contraction's result: it reads
    the result only at its own point, over the result's whole extent."""
    if s.role in (Role.INIT, Role.UPDATE) or s.extra or plain_iters(update.index) is None:
        return False  # (a product along flattened positions writes them unflattened: no shared nest)
    reads = [ld for ld in prog.statement_loads(s) if ld.array == update.array]
    its = plain_iters(reads[0].index) if reads else None
    if its is None or sorted(its) != sorted(s.iters) or any(ld.index != reads[0].index for ld in reads):
        return False
    bounds = dict(zip(s.iters, s.bounds))
    shape = prog.arrays[update.array].shape
    return all(sz.isl_str(bounds[it][0]) == "0" and sz.isl_str(bounds[it][1]) == sz.isl_str(shape[k])
               for k, it in enumerate(its))


def _sums_a_sum(s, group: list[str], prog: AffineProgram) -> bool:
    """Whether s combines several results of a reduction in group: along
    its own reduced dimensions, or at several positions (a short sum
    inlined; column strips' sums added: targets.cpu.column_strips). Fused,
    isl ran it in the last iteration of the loop over those results, which
    then carried a dependence and ran on one thread."""
    summed = {t.array for t in prog.statements if t.name in group and t.role is Role.UPDATE}
    red = set(s.reduction_iters)
    positions: dict[str, set] = {}
    for ld in loads(s.body):
        if ld.array in summed:
            if any(isinstance(x, Var) and x.name in red for i in ld.index for x in walk(i)):
                return True
            positions.setdefault(ld.array, set()).add(ld.index)
    return any(len(p) > 1 for p in positions.values())


def _column_sum(s, made: set[str], prog: AffineProgram) -> bool:
    """Whether s reduces over the leading dimensions of an array in made (a
    batch norm's per-channel sums over NHWC, in training's backward). Its
    kept dimensions are its outer loops and its producers' inner ones, so
    the nvgpu target runs it in strips of its own (AtomicStrips) either way;
    with them, its producers (a strided depthwise convolution's input
    gradient and the batch norm's) took isl's scheduler 0.5-2.6 s a group in
    MobileNetV3's backward before it gave each a kernel of its own."""
    red = set(s.reduction_iters)
    return s.role is Role.UPDATE and bool(red) and any(
        ld.array in made and ld.index and isinstance(ld.index[0], Var) and ld.index[0].name in red
        for ld in loads(s.body))


def sibling_sums(prog: AffineProgram) -> list[list[tuple[str, str]]]:
    """Sets of two or more reductions, each with its initialization (as
    (init, update) names), over the same iterations and reading an array in
    common: a layer norm's weight and bias gradients, column sums of one
    gradient. Each set shares a nest (tree.joined_sums), where each thread
    adds every sum's terms for its element: what the sums share is read
    once. isl keeps them apart (no dependence joins them): one kernel each,
    each reading the summed gradients again. Only a sum's own pair writes
    its array and no statement of the group reads it: a layer norm's row
    sums stay in the nest isl fuses them into with the input gradient that
    reads them."""
    writers: dict[str, list] = {}
    for s in prog.statements:
        writers.setdefault(s.array, []).append(s)
    pairs: dict[tuple, list] = {}
    for u in prog.statements:
        p = len(u.iters) - len(u.reduction_iters)
        if u.role is not Role.UPDATE or u.contraction or u.library is not None or u.extra or p < 1 \
                or not u.reduction_iters or plain_iters(u.index) != list(u.iters[:p]) or len(writers[u.array]) != 2:
            continue
        init = next(w for w in writers[u.array] if w is not u)
        if init.role is not Role.INIT or not isinstance(init.body, Const) or init.extra \
                or init.iters != u.iters[:p] or init.bounds != u.bounds[:p] or init.index != u.index:
            continue
        pairs.setdefault((u.bounds, p, u.combine, prog.arrays[u.array].dtype), []).append((init, u))
    sets = []
    for alike in pairs.values():
        while len(alike) > 1:
            first, *others = alike
            shared = {ld.array for ld in loads(first[1].body)}
            joined = [first] + [q for q in others if shared & {ld.array for ld in loads(q[1].body)}]
            alike = [q for q in alike if q not in joined]
            made = {u.array for _, u in joined}
            if len(joined) > 1 and not any(ld.array in made for t in prog.statements for ld in loads(t.body)):
                sets.append([(i.name, u.name) for i, u in joined])
    return sets


def _reads_reshaped(s, group: list[str], prog: AffineProgram) -> bool:
    written = {t.array for t in prog.statements if t.name in group}
    return any(ld.array in written and any(isinstance(x, Op) and x.op in QUASI_AFFINE
                                           for i in ld.index for x in walk(i))
               for ld in loads(s.body))


def fusion_refusal(up, outs: list[str]) -> str | None:
    """Why sharing one nest with contraction `up` would lose, or None.

    A fused nest runs each register block's whole reduction; its columns
    run along the last output loop. Where an operand's padding guard
    depends on that loop (NCHW: the output columns are image columns, and
    the window's taps step over the border), every vector lane needs its
    own address: the fused nest ran 2.6-4.4x slower than the tiled,
    unfused one (2x64x64x64 3x3 NCHW: 51 against 19 ms), while NHWC, whose
    columns are channels, gained (0.91 -> 0.77 ms)."""
    if not reduction_fits_tile(up):
        lo, hi = dict(zip(up.iters, up.bounds))[up.reduction_iters[0]]
        return (f"{up.name} ({up.label}): its outer reduction loop ({sz.isl_str(hi)} - {sz.isl_str(lo)}) "
                f"exceeds a tile ({TILE_RED})")
    col = outs[-1] if outs else None
    for x in walk(up.body):
        guard = select_parts(x)
        if guard is not None and any(isinstance(v, Var) and v.name == col for v in walk(guard[0])):
            return f"{up.name} ({up.label}): a padding guard varies along the register block's columns ({col})"
    return None


def _loop_order(schedule: isl.Schedule, up) -> list[str]:
    """The update's iterators in the order schedule's bands run them."""
    order: list[str] = []

    def follow(node):
        if node.get_type() == isl.schedule_node_type.band and up.name in statement_names(node):
            mupa = node.band_get_partial_schedule()
            for m in range(node.band_n_member()):
                d = member_iter(mupa.get_at(m)).get(up.name)
                if d is not None and up.iters[d] not in order:
                    order.append(up.iters[d])
        return node
    visit(schedule.get_root(), follow)
    return order + [it for it in up.iters if it not in order]


def fuse_contraction(schedule, prog, dom, validity, plan: FusionPlan | None = None) -> isl.Schedule | None:
    """One nest for a contraction whose reduction is not tiled: each block of
    outputs is zeroed, runs its whole reduction and its elementwise epilogue
    (bias, activation) in turn, all inside the block's loops, so the
    accumulators start from zero in registers and leave finished, instead of
    a pass over the whole result before the contraction and one after.

    schedule is isl's for the contraction (the update's loop order is taken
    from its bands), dom the group's with its epilogue; tile() then blocks
    the shared output band. None where the nest cannot be built."""
    names = [st.get_tuple_name() for st in isl_items(dom.get_set_list())]
    stmts = [s for s in prog.statements if s.name in names]
    updates = [s for s in stmts if is_update(s)]
    if len(updates) != 1:
        return None
    up = updates[0]
    shape = prog.arrays[up.array].shape
    point = {s.name: _point(s.index, shape) for s in stmts if s.role is Role.INIT and s.array == up.array}
    point[up.name] = _point(up.index, shape)
    for s in stmts:
        if s.name not in point:
            point[s.name] = _point(next(ld for ld in prog.statement_loads(s) if ld.array == up.array).index, shape)
    order = _loop_order(schedule, up)
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
        filters = filters.add(group_domain(ctx, prog, dom, [s.name]))
    node = node.child(0).insert_sequence(filters)
    at = stmts.index(up)
    node = node.child(at).child(0).insert_partial_schedule(band([lambda s, r=r: r for r in red], [up]))
    new = node.get_schedule()
    return new if is_legal(new, validity) else None


def _point(index, shape) -> list[str] | None:
    """The iterators of an index of distinct plain iterators, a position
    split over dimensions as (x // k, x % k) counting as x (a weight
    gradient's flattened channels x window); else None."""
    return plain_iters([e for e, _ in reversed(merged_index(index, shape))])


def reduction_fits_tile(s) -> bool:
    """Whether the contraction's reduction stays whole inside each register
    block: tile() tiles only its outermost loop, and that fits one tile."""
    lo, hi = dict(zip(s.iters, s.bounds))[s.reduction_iters[0]]
    return sz.is_static(lo) and sz.is_static(hi) and int(hi) - int(lo) <= TILE_RED


GPU_GRID_FLOOR = 1 << 16  # parallel iterations below which a GPU kernel leaves most of the device idle
GPU_THIN_GRID = 1 << 12  # threads below which a kernel has less than a warp per SM (132 on an H100)
GPU_THIN_LOSS = 4  # times more threads a statement alone would have, which a thin grid's fusion may not lose
GPU_STRIP = 64  # iterations of a sequential loop per thread where strips run in parallel (codegen.gpu_mapping)


def starved(ast: isl.AstNode, prog: AffineProgram, contracted) -> bool:
    """nvgpu: whether a kernel's fusion cost the device its parallelism: its
    marked loops give fewer than GPU_GRID_FLOOR threads where one of its
    statements alone would have 16 times as many (a producer fused with a
    stencil, pooling or im2col consumer, shifted along image rows, left a
    thread per image and channel: 10.6 of MobileNetV3-small's 18 ms, 60 of
    ResNet-18's 70). Sums compare their own outputs (a row sum keeps its
    rows, and a warp each where they run along rows), unless the grid is
    thinner than GPU_THIN_GRID and a sum is not along rows (a batch norm's
    backward, its per-channel sums fused with the elementwise pass after
    them, ran a thread per channel: 16 of a ResNet-18 training step's 40
    ms; a folded batch norm's per-channel shift, fused with the pooled
    means of 8 images that read it, ran 64 threads), where a statement
    alone would have GPU_THIN_LOSS times the threads, and where the grid
    is below GPU_GRID_FLOOR and a sum not along rows is read in its own
    kernel (_column_sum_read). Elementwise statements
    whose arrays are all kept whole gain nothing from sharing a nest and
    lose a thread per element (ResNet-18's
    max pool, fused with its padded input along image rows, ran a row per
    thread, consecutive threads channels apart: 4.7 ms), whatever the grid.
    A kernel with contracted buffers may run strips of its next loop in
    parallel, each recomputing its halo (a blur): those count, against half
    the floor, and a thread may take four strips' work (ResNet-18's last
    im2col, fused with its relu, took 0.7 ms a thread per image and channel),
    where one loop follows the grid: a sequence of nests under it has no
    strips (a squeeze-excite block fused whole ran a thread per image), nor
    has a loop shorter than a strip, where the statements alone would fill
    the device (a depthwise convolution's input gradient over its producer,
    14x14 images, ran a thread per image and channel). Nor may a thin grid
    hold a statement that alone would fill the device with GPU_THIN_LOSS
    times the grid's rows (its own but the innermost: a warp may take
    those): Swin's padded windows, fused with the layer norm's variance
    they read at clamped rows, ran a thread per image over 4x14x14x384
    elements (8.5 ms of a 14 ms forward, against eager's 14 ms whole)."""
    stmts = {s.name: s for s in prog.statements}
    for node in kernel_nodes(ast):
        own = [stmts[n] for n in statements_in(node)]
        if len(own) < 2:
            continue
        grid, inner = _grid_extent(node, set(prog.params))
        sums = [s for s in own if s.combine is not None]
        if grid is not None and grid < GPU_THIN_GRID and not all(map(_row_sum, sums)) \
                and max((_parallel_extent(s) for s in own), default=0) >= GPU_THIN_LOSS * grid:
            return True
        if grid is not None and grid < GPU_GRID_FLOOR and _column_sum_read(own, sums):
            return True
        if grid is not None and grid < GPU_THIN_GRID and any(
                _parallel_extent(s) >= GPU_GRID_FLOOR and _row_extent(s) >= GPU_THIN_LOSS * grid for s in own):
            return True
        floor, per_thread = (GPU_GRID_FLOOR if sums else None), 16
        widest = max((_parallel_extent(s) for s in (sums or own)), default=0)
        if inner is not None and any(s.array in contracted for s in own):
            strips = -(-inner // GPU_STRIP)
            grid, floor = grid and grid * strips, GPU_GRID_FLOOR // 2
            # a strip's own rows are no loss; a loop too short to strip leaves a thread its whole
            # nest, a loss where the statements alone would fill the device
            if strips > 1 or widest < GPU_GRID_FLOOR:
                per_thread = 4 * GPU_STRIP
        if grid is not None and (floor is None or grid < floor) and widest >= per_thread * grid:
            return True
    return False


CPU_SERIAL_POINTS = 1 << 14  # a statement's iterations (its reduction's aside) worth the thread team


def serialized(ast: isl.AstNode, prog: AffineProgram) -> bool:
    """cpu: whether a group's fusion left a kernel with no parallel loop
    that holds a statement of CPU_SERIAL_POINTS iterations or more: isl's
    clustering scheduler put a weight's transpose under the outer loops of
    the broadcast product that reads it (a dense layer's input gradient
    spread over 8x17x17x64 pooled cells, flax's average pooling), and those
    loops, carrying the dependence, ran on one thread. A group scheduled
    without fusion keeps each statement's own parallel loops."""
    if len(prog.statements) < 2:
        return False
    stmts = {s.name: s for s in prog.statements}
    return any(not _has_parallel_mark(node)
               and max((_parallel_extent(stmts[n]) for n in statements_in(node)), default=0) >= CPU_SERIAL_POINTS
               for node in kernel_nodes(ast))


def guarded_inner_loop(ast: isl.AstNode, min_points: int = 1 << 16) -> bool:
    """cpu: whether a fused kernel's innermost loop holds branches on outer
    loops only (isl interleaves the fused statements' phases there), over
    at least min_points statement instances. LLVM then leaves that loop
    scalar: a softmax over the leading dimension (its three passes fused
    along a skewed phase loop) took 31 ms for 64x256x256 against 2.1
    unfused and eager's 2.4."""
    for node in ast_nodes(ast):
        if node.get_type() != isl.ast_node_type.for_:
            continue
        body = ast_nodes(node.for_get_body())
        if any(n.get_type() == isl.ast_node_type.for_ for n in body):
            continue
        inner = {node.for_get_iterator().get_id().get_name()}
        guards = [n for n in body if n.get_type() == isl.ast_node_type.if_]
        if guards and not any(ast_uses(g.if_get_cond(), inner) for g in guards) and _points(ast) >= min_points:
            return True
    return False


def _points(ast: isl.AstNode) -> int:
    """The product of the nest's loops' extents, where they are numbers (a bound on its instances)."""
    product = 1
    for node in ast_nodes(ast):
        if node.get_type() == isl.ast_node_type.for_:
            product *= static_extent(node) or 1
    return product


def _has_parallel_mark(node: isl.AstNode) -> bool:
    return any(n.get_type() == isl.ast_node_type.mark and n.mark_get_id().get_name().startswith("parallel:")
               for n in ast_nodes(node))


def _column_sum_read(own: list, sums: list) -> bool:
    """Whether a long sum not along rows, which alone runs in atomic strips
    (codegen.gpu_mapping), is read by a statement of the same kernel: the
    strips would have to wait for each other, so the kernel keeps a thread
    per output (a bfloat16 bias gradient, summed in float32 and rounded in
    the same nest, took 0.8 ms for 3 MB; a channels-last squeeze-excite's
    mean over 14x14 images ran a thread per image and channel)."""
    read = {ld.array for s in own if s.combine is None for ld in loads(s.body)}
    return any(s.array in read and not _row_sum(s) and _reduction_extent(s) >= 2 * GPU_STRIP for s in sums)


def _reduction_extent(s) -> int:
    """Iterations of a statement's reduction loops (symbolic sizes at their estimates)."""
    total = 1
    for it, (lo, hi) in zip(s.iters, s.bounds):
        if it in s.reduction_iters:
            total *= max(sz.estimate(hi) - sz.estimate(lo), 0)
    return total


def _row_sum(s) -> bool:
    """Whether sum s reduces along its loads' last dimension only (a row: a warp's lanes share it)."""
    red = set(s.reduction_iters)
    return all(not any(isinstance(x, Var) and x.name in red for i in ld.index[:-1] for x in walk(i))
               for ld in loads(s.body))


def _grid_extent(node: isl.AstNode, params: set[str]) -> tuple[int | None, int | None]:
    """The iterations of the chain of parallel-marked loops at node's top, and
    of the loop after them (None where not numbers; symbolic sizes at their
    estimates, sizes.estimate)."""
    total = 1
    while True:
        marked = node.get_type() == isl.ast_node_type.mark and node.mark_get_id().get_name().startswith("parallel:")
        loop = node.mark_get_node() if marked else node
        if loop.get_type() != isl.ast_node_type.for_:
            return total, None
        init, cond = loop.for_get_init(), loop.for_get_cond()
        lo, hi = _estimated(init, params), _estimated(cond.get_op_arg(1), params)
        trips = None
        if lo is not None and hi is not None:
            last = hi - (cond.get_op_type() == isl.ast_expr_op_type.lt)
            step = loop.for_get_inc().get_val().to_python()
            trips = max(-(-(last - lo + 1) // step), 0)
        if not marked:
            return total, trips
        if trips is None:
            return None, None
        total *= trips
        node = loop.for_get_body()


def _row_extent(s) -> int:
    """A statement's parallel iterations but its innermost loop's (the rows a warp each may take)."""
    inner = [max(sz.estimate(hi) - sz.estimate(lo), 1) for it, (lo, hi) in zip(s.iters, s.bounds)
             if it not in s.reduction_iters]
    return _parallel_extent(s) // inner[-1] if inner else 1


def _parallel_extent(s) -> int:
    """Iterations of a statement's loops that are not its reduction's (symbolic sizes at their estimates)."""
    total = 1
    for it, (lo, hi) in zip(s.iters, s.bounds):
        if it not in s.reduction_iters:
            total *= max(sz.estimate(hi) - sz.estimate(lo), 0)
    return total


_AST_OPS = {isl.ast_expr_op_type.add: lambda a, b: a + b, isl.ast_expr_op_type.sub: lambda a, b: a - b,
            isl.ast_expr_op_type.mul: lambda a, b: a * b, isl.ast_expr_op_type.min: min,
            isl.ast_expr_op_type.max: max, isl.ast_expr_op_type.fdiv_q: lambda a, b: a // b,
            isl.ast_expr_op_type.pdiv_q: lambda a, b: a // b, isl.ast_expr_op_type.div: lambda a, b: a // b}


def _estimated(e: isl.AstExpr, params: set[str]) -> int | None:
    """An AST expression of numbers and size parameters at the sizes'
    estimates; None where it names an iterator or an operation beyond these."""
    kind = e.get_type()
    if kind == isl.ast_expr_type.int:
        return e.get_val().to_python()
    if kind == isl.ast_expr_type.id:
        name = e.get_id().get_name()
        return sz.estimate(sz.Lin.param(name)) if name in params else None
    op = e.get_op_type()
    args = [_estimated(e.get_op_arg(k), params) for k in range(e.get_op_n_arg())]
    if None in args:
        return None
    if op == isl.ast_expr_op_type.minus and len(args) == 1:
        return -args[0]
    if op not in _AST_OPS or len(args) != 2 or (op in (isl.ast_expr_op_type.fdiv_q, isl.ast_expr_op_type.pdiv_q,
                                                         isl.ast_expr_op_type.div) and args[1] == 0):
        return None
    return _AST_OPS[op](*args)
