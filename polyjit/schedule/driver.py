"""schedule_program: each fusion group scheduled by isl within a budget of
operations, rewritten for the target, built into an AST, its temporaries
contracted; results kept per process."""
from __future__ import annotations

import logging
import pickle
import time
from contextlib import contextmanager

import islpy as isl

from .. import sizes as sz
from ..affine import AffineProgram
from ..cache import ProcessCache
from .ast import kernel_nodes, statements_in
from .contraction import contract
from .dependences import accesses, dependences, is_legal, make_context
from .fusion import (FusionPlan, fuse_contraction, fusion_groups, preparation, side_by_side_statements,
                     sibling_sums)
from .groups import (GroupProblem, ProgramSchedule, Scheduled, ScheduledGroup, WorkerAstMismatch, check_worker_ast,
                     group_problem, kernel_of_each_array)
from .rewrites import distribute_inits, innermost_contiguous, order_sets
from .tree import group_domain, in_order, is_update, joined_sums, product_inits, side_by_side

log = logging.getLogger("polyjit.schedule")


SCHEDULE_BUDGET = 3_000_000  # isl operations one group may take before it is split
SOLVER_BUDGET = 8_000  # operations of isl's scheduler's first try on a group (most need fewer than 16000)
SOLVER_SECONDS = 0.5  # a try that ran out of operations sooner than this gets twice as many


def _schedule_group(ctx, prog, dom, validity, raw, names, fusion, fuse: FusionPlan | None,
                    clusters_first: bool) -> isl.Schedule:
    """isl's schedule for a group; a group whose problem exceeds the budget is
    split in two and each half scheduled alone, one after the other."""
    sched = _whole_group(ctx, prog, dom, validity, raw, names, fusion, fuse, clusters_first)
    if sched is None:
        sched = _split_group(ctx, prog, dom, validity, raw, names, fusion, fuse, clusters_first)
    return sched


def _whole_group(ctx, prog, dom, validity, raw, names, fusion, fuse: FusionPlan | None,
                 clusters_first: bool) -> isl.Schedule | None:
    """isl's schedule for the group as one problem, or None where isl gives
    up. A single statement is tried again without outer coincidence (which
    only steers fusion): with it, isl could not carry a 2x2 convolution's
    reduction over taps of extent 2, whose update then ran on one thread."""
    for outer in (1, 0) if len(names) == 1 else (1,):
        ctx.set_max_operations(SCHEDULE_BUDGET)
        ctx.reset_operations()
        ctx.set_schedule_outer_coincidence(outer)
        try:
            return _schedule_one_group(ctx, prog, dom, validity, raw, names, fusion, fuse, clusters_first)
        except isl.Error:
            log.debug("schedule of %d statements over budget; splitting", len(names))
        finally:
            ctx.set_max_operations(0)
            ctx.set_schedule_outer_coincidence(1)
    return None


def _split_group(ctx, prog, dom, validity, raw, names, fusion, fuse: FusionPlan | None,
                 clusters_first: bool) -> isl.Schedule:
    """The group's two halves scheduled alone, one after the other; a
    single statement isl gave up on (accesses full of integer divisions,
    e.g. a flattened pooling window feeding a matmul) in its own loop order."""
    if len(names) == 1:
        return isl.Schedule.from_domain(group_domain(ctx, prog, dom, names))
    half = len(names) // 2
    first = _schedule_group(ctx, prog, dom, validity, raw, names[:half], fusion, fuse, clusters_first)
    return first.sequence(_schedule_group(ctx, prog, dom, validity, raw, names[half:], fusion, fuse, clusters_first))


def _compute_schedule(ctx, sc: isl.ScheduleConstraints, clusters_first: bool) -> isl.Schedule:
    """isl's schedule for sc; isl.Error where its solver gives up.

    With clusters_first (the target's choice), isl's clustering scheduler
    (each SCC alone, then clusters merged along proximity) goes first: it
    solves at once groups on which the whole-component one (a band for all
    statements at once) grows its integer programs for seconds or gives up
    (a MobileNetV2 block's depthwise convolution and its folded scale, a
    ResNet stem's relu under its strided max pool, BERT's embedding
    gather; bench/NOTES.md). Its schedule stands where its outer band joins
    every statement a dependence links; otherwise (a stencil under its
    producer, a row's statistics and its normalization: clustering keeps
    them apart) the whole-component scheduler tries, and where it gives up,
    the clustering schedule is taken (isl's error only where neither
    scheduler found one)."""
    if not clusters_first or not ctx.get_schedule_whole_component():  # (fusion "none": clustering alone)
        return _solve(ctx, sc)
    ctx.set_schedule_whole_component(0)
    try:
        clustered = _solve(ctx, sc)
    except isl.Error:
        clustered = None
    finally:
        ctx.set_schedule_whole_component(1)
    if clustered is not None and _outer_band_joins(clustered, sc.get_validity()):
        return clustered
    try:
        return _solve(ctx, sc)
    except isl.Error:
        if clustered is None:
            raise
        return clustered


def _solve(ctx, sc: isl.ScheduleConstraints) -> isl.Schedule:
    """sc.compute_schedule() with a budget of operations that doubles while
    tries fail faster than SOLVER_SECONDS: isl counts operations, not time,
    and on some problems (a transformer layer's backward: a transposed copy
    feeding a batched product) its integer programs grow numbers whose every
    operation costs more than the last, while other problems need many cheap
    ones. The first try is small, so a fast failure costs little
    (bench/NOTES.md has the measurements). The group's own budget is
    restored for what follows."""
    budget = SOLVER_BUDGET
    while True:
        ctx.set_max_operations(budget)
        ctx.reset_operations()
        start = time.perf_counter()
        try:
            return sc.compute_schedule()
        except isl.Error as e:
            spent = time.perf_counter() - start
            if spent > SOLVER_SECONDS or budget >= SCHEDULE_BUDGET or not _over_budget(e):
                log.debug("isl's scheduler gave up after %d operations (%.2f s)", budget, spent)
                raise
            budget *= 2
        finally:
            ctx.set_max_operations(SCHEDULE_BUDGET)
            ctx.reset_operations()


def _outer_band_joins(sched: isl.Schedule, validity: isl.UnionMap) -> bool:
    """Whether each statement sits under an outer band with every statement
    a dependence links it to: the root's child is a band, or a set or
    sequence of bands (unlinked parts) with no dependence from one part to
    the rest."""
    top = sched.get_root().child(0)
    if top.get_type() not in (isl.schedule_node_type.set, isl.schedule_node_type.sequence):
        return _banded(top)
    parts = [top.child(i) for i in range(top.n_children())]
    if not all(_banded(p.child(0)) for p in parts):
        return False
    domain = sched.get_domain()
    return all(validity.intersect_domain(f).intersect_range(domain.subtract(f)).is_empty()
               for f in (p.filter_get_filter() for p in parts))


def _banded(node: isl.ScheduleNode) -> bool:
    """A band of loops, or a leaf (statements without loops)."""
    kind = node.get_type()
    return kind == isl.schedule_node_type.leaf or (kind == isl.schedule_node_type.band and node.band_n_member() > 0)


def _over_budget(e: isl.Error) -> bool:
    """Whether isl stopped for its operation budget (another error, such as
    dependences it cannot carry, comes back whatever the budget)."""
    return "maximal number of operations" in str(e)


def _schedule_one_group(ctx, prog, dom, validity, raw, names, fusion, fuse: FusionPlan | None,
                        clusters_first: bool) -> isl.Schedule:
    """isl's schedule of the group; a contraction's group (its epilogue
    aside, which isl need not see) then shares one nest with its
    initialization and epilogue where fuse_contraction can build it."""
    if any(s.library is not None for s in prog.statements if s.name in names):
        # its loops, unmarked: the call itself shares the work between the kernel's parts
        return isl.Schedule.from_domain(group_domain(ctx, prog, dom, names))
    core = [s.name for s in prog.statements if s.name in names and (s.name in product_inits(prog) or is_update(s))]
    epilogue = [n for n in names if n not in core] if core else []
    cdom = group_domain(ctx, prog, dom, [n for n in names if n not in epilogue])
    cval = validity.intersect_domain(cdom).intersect_range(cdom).coalesce()
    sc = isl.ScheduleConstraints.on_domain(cdom).set_validity(cval).set_coincidence(cval)
    if fusion != "none":
        sc = sc.set_proximity(raw.intersect_domain(cdom).intersect_range(cdom).coalesce())
    sched = order_sets(_compute_schedule(ctx, sc, clusters_first), cval)
    sched = innermost_contiguous(sched, prog, ctx, cval)
    if fuse is not None and core:
        gdom = group_domain(ctx, prog, dom, names)
        fused = fuse_contraction(sched, prog, gdom, validity.intersect_domain(gdom).intersect_range(gdom), fuse)
        if fused is not None:
            return fused
    sched = distribute_inits(sched, prog, cval)
    if epilogue:  # consumers that could not share the contraction's nest follow it
        sched = sched.sequence(_schedule_one_group(ctx, prog, dom, validity, raw, epilogue, fusion, None, clusters_first))
    return sched


def schedule_program(prog: AffineProgram, fusion: str = "max", tile_sizes=None, target=None,
                     timer=None, canonical: bool = True, each=None, remote=None) -> "ProgramSchedule":
    """target (a polyjit.targets.Target; None: the host's) gives its rewrites
    (the cpu's tile with register blocks sized for its vectors,
    balance threads and sink inner loops; nvgpu's put every coincident loop
    outside), whether contractions may own their epilogues, and which
    contracted buffers stay private (nvgpu: those a thread's registers hold).

    Each fusion group is scheduled as a program of its own (its statements
    run after the groups before it, so no dependence is lost), with its
    statements and arrays renamed canonically: groups of the same structure
    (a model's identical layers) share one result, scheduled once per
    process. canonical=False keeps the program's names (a target whose
    emitter reads the whole program's). each(group), where given, is called
    with each group as soon as it is scheduled (code generation starts).
    The groups a process has not scheduled before are offered to the
    worker processes that compile kernels (codegen.workers), which schedule
    them side by side; the caller takes back, in order, those none has
    begun. remote, where given, goes with each group to its worker:
    ``remote.spec.make(group, timer)`` there makes the group's code, which
    ``remote.adopt(group, made)`` takes in here before each(group), so that
    the caller does not build the AST of a worker's schedule again."""
    timer = timer or _no_timer
    if target is None:
        from ..targets import target as named
        target = named(None)
    fuse = target.fuses_epilogues and fusion != "none" and not tile_sizes
    config = (fusion, tile_sizes, target, fuse)
    plan = FusionPlan() if fuse else None
    with timer("schedule/groups"):
        first = preparation(prog) if target.gathers_preparation and fusion != "none" else []
        apart = (side_by_side_statements(prog, target.side_by_side_nests)
                 if target.side_by_side_nests and fusion != "none" and not first else [])
        names = fusion_groups(prog, epilogues=fuse, plan=plan, sums_apart=target.sums_sums_apart,
                              small_apart=target.small_statements_apart, windows_apart=target.windows_apart,
                              column_sums_apart=target.column_sums_apart,
                              first=first or apart)
    users: dict[str, set[int]] = {}
    for g, group in enumerate(names):
        for s in prog.statements:
            if s.name in group:
                for a in [s.array] + [ld.array for ld in prog.statement_loads(s)]:
                    users.setdefault(a, set()).add(g)
    with timer("schedule/canonical"):
        problems = [group_problem(prog, group, {a for a, gs in users.items() if gs != {g}}, canonical,
                                  in_order=bool(first) and g == 0, side_by_side=bool(apart) and g == 0)
                    for g, group in enumerate(names)]
    offered = _offer(problems, config, remote)
    groups = []
    for problem in problems:
        key = (problem.key, config)
        sched, made = _groups.get(key), None
        if sched is None:
            sched, made = _from_worker(problem, offered.get(problem.key), timer)
            if sched is None:
                sched = _schedule_problem(problem, config, timer)
            _groups.put(key, sched)
        groups.append(ScheduledGroup(problem, sched))
        if made is not None:
            remote.adopt(groups[-1], made)
        if each is not None:
            each(groups[-1])
    return ProgramSchedule(prog, groups, plan.refused if plan else [])


def _offer(problems: list[GroupProblem], config: tuple, remote) -> dict:
    """The groups not scheduled yet in this process, offered to the worker
    processes (by key), where there are two or more: the caller schedules
    in order each that no worker has begun (_from_worker)."""
    todo = {}
    for p in problems:
        if _groups.get((p.key, config)) is None and p.key not in todo:
            todo[p.key] = p
    if len(todo) < 2:
        return {}
    from ..codegen import workers
    pool = workers.workers()
    offered = {}
    for key, p in todo.items():
        future = pool.offer(workers.SCHEDULE, pickle.dumps((p, config, sz.definitions(p.prog.params),
                                                               remote and remote.spec)))
        if future is None:
            return {}
        offered[key] = future
    return offered


def _from_worker(problem: GroupProblem, future, timer) -> tuple[Scheduled | None, list | None]:
    """The group as a worker scheduled it, and the code it made (None where
    it was not asked to); (None, None) where no worker has begun it (taken
    back: the caller schedules it) or the worker failed."""
    if future is None or future.cancel():
        return None, None
    start = time.perf_counter()
    try:
        reply, _ = future.result()
        done = pickle.loads(reply)
    except Exception as e:  # (the worker died: the caller schedules it)
        log.debug("a worker did not schedule a group: %s", e)
        return None, None
    timer.add("schedule/waited", time.perf_counter() - start)
    if done[0] == "error":  # (scheduled again here, where the error is raised as usual)
        return None, None
    texts, contracted, kernels, kernel_of_array, refused, seconds, made = done
    for stage, s in seconds.items():
        timer.add(stage + " (workers)", s)
    if made is None:  # (no code from the worker: the caller's emitter walks the AST)
        ctx = make_context()
        sched = isl.Schedule.read_from_str(ctx, texts[0])
        with timer("schedule/ast"):
            ast = _ast(ctx, problem.prog, sched)
        try:
            check_worker_ast(ast, kernels)
        except WorkerAstMismatch as e:
            log.warning("%s: scheduled here", e)
            return None, None
        return Scheduled(sched, ast, contracted, kernels, kernel_of_array, refused), None
    return Scheduled(None, None, contracted, kernels, kernel_of_array, refused, texts,
                     lambda sched: _ast(sched.get_ctx(), problem.prog, sched)), made


def schedule_job(payload: bytes) -> bytes:
    """A worker process's job: a pickled (GroupProblem, config, the derived
    sizes it names, a remote's spec or None) scheduled, and its code made
    where a spec is given; the schedule as isl's texts (the schedule, its
    tree as printed, the AST in C) with the rest of its Scheduled, the
    stages' seconds and spec.make's result, pickled."""
    from ..compiler import StageTimer
    try:
        problem, config, derived, spec = pickle.loads(payload)
        if not all(sz.define(name, *definition) for name, definition in derived.items()):
            return pickle.dumps(("error", "a derived size's name stands for another here"))
        timer = StageTimer()
        s = _schedule_problem(problem, config, timer)
        made = spec.make(ScheduledGroup(problem, s), timer) if spec is not None else None
        texts = (s.schedule.to_str(), s.schedule_tree(), s.ast_text())
        return pickle.dumps((texts, s.contracted, s.kernels, s.kernel_of_array, s.refused,
                             {**timer.detail, **{f"schedule/{k}": v for k, v in timer.seconds.items()}}, made))
    except Exception as e:  # noqa: BLE001  (the caller schedules the group itself)
        return pickle.dumps(("error", repr(e)))


GROUP_CACHE = 4096  # scheduled groups kept per process
_groups = ProcessCache(GROUP_CACHE)
# Structures of groups isl gave up on whole: a model's blocks repeat one at
# other sizes (MobileNetV3's batch-norm backward with a depthwise
# convolution's, five times), and each failure took 0.6-2 s.
_gave_up = ProcessCache(GROUP_CACHE)


def _schedule_problem(problem: "GroupProblem", config: tuple, timer) -> Scheduled:
    """One group scheduled as a program: isl's schedule, the target's
    rewrites, the AST, contracted temporaries."""
    fusion, tile_sizes, target, fuse = config
    prog = problem.prog
    ctx = make_context()
    if fusion == "none":
        ctx.set_schedule_whole_component(0)
        ctx.set_schedule_serialize_sccs(1)
    with timer("schedule/dependences"):
        dom = prog.domain(ctx)
        access = None if problem.nests_apart else accesses(ctx, prog, dom)
    plan = FusionPlan() if fuse else None
    if problem.in_order:  # (program order: every dependence holds)
        sched = in_order(ctx, prog, dom)
    elif problem.side_by_side:  # (no dependence among them)
        sched = side_by_side(ctx, prog, dom)
    else:
        with timer("schedule/dependences"):
            validity, raw = dependences(ctx, prog, dom, access)
        joined = sibling_sums(prog) if target.joins_sibling_sums and fusion != "none" else []
        apart = {n for pairs in joined for pair in pairs for n in pair}
        names = [s.name for s in prog.statements if s.name not in apart]
        group = (ctx, prog, dom, validity, raw, names, fusion, plan, target.clusters_first)
        structure = (problem.structure, config)
        with timer("schedule/isl"):
            sched = None
            if names:
                known = len(names) > 1 and _gave_up.get(structure) is not None
                sched = None if known else _whole_group(*group)
                if sched is None:
                    _gave_up.put(structure, True)
                    sched = _split_group(*group)
            if joined:
                sched = _with_sibling_sums(ctx, prog, dom, validity, sched, joined) or \
                    _schedule_group(ctx, prog, dom, validity, raw, [s.name for s in prog.statements], fusion, plan,
                                    target.clusters_first)
        with timer("schedule/rewrites"):
            sched = order_sets(target.schedule_rewrites(sched, prog, validity, tile_sizes), validity)
    with timer("schedule/ast"):
        ast = _ast(ctx, prog, sched)
        kernels = [statements_in(k) for k in kernel_nodes(ast)]
    with timer("schedule/contract"):
        contracted = {} if problem.nests_apart else contract(ctx, prog, sched, dom, kernels, problem.shared, access)
    contracted = target.private_buffers(prog, ast, contracted, fusion != "none")
    if contracted is None:
        return _schedule_problem(problem, ("none",) + config[1:], timer)
    return Scheduled(sched, ast, contracted, kernels, kernel_of_each_array(prog, kernels), plan.refused if plan else [])


def _with_sibling_sums(ctx, prog: AffineProgram, dom, validity, rest: isl.Schedule | None,
                       joined: list) -> isl.Schedule | None:
    """The group's sibling sums (fusion.sibling_sums) each in a nest of its
    own (tree.joined_sums), before or after the schedule of the rest, in
    whichever order every dependence holds; None in neither."""
    nests = [joined_sums(ctx, prog, dom, pairs) for pairs in joined]
    sums = nests[0]
    for nest in nests[1:]:
        sums = sums.sequence(nest)
    if rest is None:
        return sums
    for sched in (sums.sequence(rest), rest.sequence(sums)):
        if is_legal(sched, validity):
            return sched
    return None


def _ast(ctx: isl.Context, prog: AffineProgram, sched: isl.Schedule) -> isl.AstNode:
    params = prog.prefix() + "{ : " + sz.param_context(prog.params) + " }"
    return isl.AstBuild.from_context(isl.Set.read_from_str(ctx, params)).node_from_schedule(sched)


class _NoTimer:
    @contextmanager
    def __call__(self, stage: str):
        yield

    def add(self, stage: str, seconds: float) -> None:
        pass


_no_timer = _NoTimer()
