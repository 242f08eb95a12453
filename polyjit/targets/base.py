"""What every target does the same way: the stages in order (``Target.compile``).

A target fills in what differs: the graph passes its code needs, how far
lowering inlines, which rewrites the scheduler applies, the emitter that
writes its code, how that code is built and loaded, and the executable
class that runs it.
"""
from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Callable, Sequence

from .. import cache, ops
from .. import sizes as sz
from ..compiler import StageTimer, dump, plan
from ..dtypes import DataType
from ..fold import fold_scales
from ..graph import Graph, Node
from ..library import LibraryPolicy
from ..lowering import RECOMPUTE_LIMIT, lower, tabled_positions
from ..runtime import CompiledProgram

if TYPE_CHECKING:
    import islpy as isl

    from ..affine import AffineProgram
    from ..options import CompileOptions

log = logging.getLogger("polyjit")


class Target:
    """A compilation target. Subclasses set the attributes and override the
    hooks below compile()."""

    name: str
    executable: type[CompiledProgram]  # the class that runs its programs
    device_arrays: bool = False  # whether its programs take arrays in device memory
    recompute_limit: int = RECOMPUTE_LIMIT  # extra work lowering accepts to inline a value read more than once
    load_work: int = 0  # the work lowering counts for each whole array a recomputation loads again
    fuses_epilogues: bool = False  # contractions may share a nest with their elementwise consumers
    clusters_first: bool = False  # isl's clustering scheduler before its whole-component one (its mapping reads either)
    sums_sums_apart: bool = False  # a reduction of a reduction's results starts a fusion group (fusion._sums_a_sum)
    small_statements_apart: bool = False  # small statements unrelated to a fusion run go before it (fusion._apart)
    windows_apart: bool = False  # every window, not only strided ones, ends its fusion group (fusion._window)
    column_sums_apart: bool = False  # a sum over leading dims of a value its run makes starts a group (fusion._column_sum)
    joins_sibling_sums: bool = False  # reductions over the same iterations that read an array in common share a nest
    # (fusion.sibling_sums)
    gathers_preparation: bool = False  # small statements of the inputs alone run first, one kernel (fusion.preparation)
    side_by_side_nests: int = 0  # statements of the inputs alone in one kernel, at most (fusion.side_by_side_statements)
    column_convolutions: bool = False  # generated channels-first convolutions as products over their columns
    library: str = ""  # the vendor library under generated contractions
    times_library: bool = False  # time each contraction both ways (else the library wherever it applies)
    keeps_programs: bool = False  # compiled programs are also shared within the process (by cache key)
    tensor_float32: bool = False  # its library products may round operands to TF32 (the tf32 options)
    library_products: tuple = (DataType.Float,)  # operand dtypes its library multiplies (in float32)
    launched_library_calls: bool = False  # each library call is a launch of its own (cuBLAS on a GPU)
    folds_each_call: bool = True  # inference folding may scale weights that are inputs at each call (fold.py)

    def known_choice(self, L, n: Node) -> tuple[bool, str] | None:
        """The target's model of itself for contraction n: (whether the
        library wins, why) where it can tell without a timing, else None."""
        return None

    def __repr__(self) -> str:
        return f"<target {self.name}>"

    def compile(self, graph: Graph, options: CompileOptions, name: str = "fn") -> CompiledProgram:
        """graph through every stage, or from the compile cache."""
        t0 = time.perf_counter()
        timer = StageTimer()
        with timer("lower"):
            graph, folded = fold_scales(graph.deduplicated(), self.folds_each_call)
            graph = self.graph_passes(graph, options)
        machine = self.machine(options)
        key = exe = None
        hits = 0
        if options.cache or self.keeps_programs:
            with timer("cache"):
                key = cache.key(graph, name, options.key(), self.machine_key(machine))
                hit, hits = self.lookup(key, options.cache)
                exe = self.load(graph.constant_arrays(), options, name, *hit) if hit and cache.define_derived(hit[0]) else None
            hits = hits if exe is not None else 0
        if exe is None:
            policy = LibraryPolicy(options.contractions, options.num_threads, self,
                                   bool(options.tf32) and self.tensor_float32,
                                   bool(options.matmul_tf32) and self.tensor_float32)
            with timer("lower"):
                prog = lower(graph, self.recompute_limit, policy, self.load_work)
            exe = self.build(graph, prog, options, name, timer, machine)
            exe.stats["contractions"] = policy.choices
            if key is not None:
                with timer("cache"):
                    self.keep(key, exe, options.cache)
        exe.stats["cache_hits"] = hits
        exe.stats["folded"] = folded
        exe.stats["compile_seconds"] = time.perf_counter() - t0
        exe.stats["compile_seconds_by_stage"] = timer.seconds
        log.info("compiled %s (%d kernels, %d compiled) in %.3f s: %s", name, len(exe.kernels),
                 exe.stats["kernels_compiled"], exe.stats["compile_seconds"], timer.summary())
        log.debug("%s: %s", name, exe.stats)
        if options.debug:
            dump(exe, options.dump_dir)
        return exe

    # ---------------------------------------------------------------- graph and schedule
    def graph_passes(self, graph: Graph, options: CompileOptions) -> Graph:
        """The rewrites this target's code needs, after inference folding."""
        return tabled_positions(expand_input_dilation(graph, lambda n: self.keeps_input_dilation(n, options)))

    def output_orders(self, graph: Graph, options: CompileOptions) -> dict[int, tuple[int, ...]]:
        """{output k: p} for the outputs this target computes in another
        order: output k's value is made as ``transpose(value, p)``. A caller
        free to choose their layout (a saved activation) takes them so, and
        no store transposes them back."""
        return {}

    def keeps_input_dilation(self, n: Node, options: CompileOptions) -> bool:
        """Whether convolution n, its input spread with zeros, is a call of the
        target's library as it is (else expand_input_dilation expands it)."""
        return False

    def schedule_rewrites(self, sched: isl.Schedule, prog: AffineProgram, validity, tile_sizes) -> isl.Schedule:
        """This target's rewrites of a fusion group's isl schedule (each checked by isl)."""
        raise NotImplementedError

    def private_buffers(self, prog: AffineProgram, ast: isl.AstNode, contracted: dict, fused: bool) -> dict | None:
        """The contracted temporaries (array -> storage moduli) a group keeps
        private (all of them), or None: schedule the group again without fusion."""
        return contracted

    def check_tile_sizes(self, tile_sizes: tuple[int, ...]) -> None:
        """Raise CompileOptionError where tile_sizes mean nothing to this target."""

    # ---------------------------------------------------------------- code
    def machine(self, options: CompileOptions):
        """What the code depends on besides the program (the host's CPU, a GPU's arch)."""
        raise NotImplementedError

    def machine_key(self, machine) -> str:
        """machine, as the compile cache's key holds it."""
        return str(machine)

    def build(self, graph: Graph, prog: AffineProgram, options: CompileOptions, name: str, timer: StageTimer,
              machine) -> CompiledProgram:
        """Schedule, emit, build and load prog's code: the executable."""
        raise NotImplementedError

    def variant(self, options: CompileOptions) -> tuple:
        """What, besides a fusion group's statements, chose its schedule: kernels
        shared by structure within the process are shared only within it."""
        return (self.name, options.fusion, options.tile_sizes)

    def library_available(self) -> bool:
        """Whether the vendor library loads here."""
        return False

    def direct_convolutions(self) -> bool:
        """Whether a library convolution is one call on whole arrays (cuDNN),
        rather than im2col and a product (BLAS, cuBLAS)."""
        return False

    # ---------------------------------------------------------------- the compile cache

    def lookup(self, key: str, disk: bool) -> tuple[tuple | None, int]:
        """(plan, objects) compiled before under key, or None; and 1 where it came from the disk."""
        hit = cache.load(key) if disk else None
        return hit, int(hit is not None)

    def keep(self, key: str, exe: CompiledProgram, disk: bool) -> None:
        """Keep a compiled program under key (on disk where disk)."""
        if disk:
            cache.store(key, *self.entry(exe))

    def entry(self, exe: CompiledProgram) -> tuple[dict, list[bytes]]:
        """The program as the compile cache keeps it: its plan (JSON) and objects."""
        return plan(exe, self.plan_fields(exe)), self.objects(exe)

    def plan_fields(self, exe: CompiledProgram) -> dict:
        """The target's own part of a program's plan, as JSON."""
        return {}

    def objects(self, exe: CompiledProgram) -> list[bytes]:
        """The program's code, as the compile cache keeps it."""
        raise NotImplementedError

    def load(self, constants: list, options: CompileOptions, name: str, plan: dict,
             objects: list[bytes]) -> CompiledProgram | None:
        """A program from its plan, objects and its graph's tensor constants
        (None: compile it again here)."""
        raise NotImplementedError

    def foreign_code(self, machine_key: str) -> str | None:
        """Why code made for ``machine_key`` (machine_key's text, in a saved
        executable) cannot run here; None where it can."""
        return None


def runs_from_inside(sizes: Sequence[int], axes: Sequence[int], least: int) -> list[list[int]]:
    """A reduction's dims (axes of an operand of these sizes) as runs from
    the inside, each the fewest dims that hold more than `least` values, the
    outermost few joining the run inside them."""
    runs: list[list[int]] = []
    run: list[int] = []
    for a in sorted(axes, reverse=True):
        run.insert(0, a)
        if math.prod(sizes[d] for d in run) > least:
            runs.append(run)
            run = []
    if run and runs:
        runs[-1] = run + runs[-1]
    return runs


def reduced_in_steps(n: Node, runs: list[list[int]]) -> Node:
    """Reduction n as a reduction over each run of its operand's dims in
    turn, innermost first (the dims of the runs after it keep their places)."""
    value = n.inputs[0]
    for run in runs:
        shape = tuple(s for d, s in enumerate(value.shape) if d not in run)
        value = Node("reduce", (value,), {**n.attrs, "axes": tuple(run), "keepdim": False}, shape, n.dtype)
    return value if tuple(value.shape) == tuple(n.shape) else Node("reshape", (value,), {}, n.shape, n.dtype)


def expand_input_dilation(graph: Graph, keep: Callable[[Node], bool] = lambda n: False) -> Graph:
    """A copy in which each convolution of an input spread with zeros (a
    strided convolution's input gradient) that keep does not take as it is
    becomes convolutions of the input itself (ops.spread_conv)."""
    def expand(old: Node, n: Node, new: dict[int, Node]) -> Node:
        if n.op != "conv" or "input_dilation" not in n.attrs or keep(n):
            return n
        at = n.attrs
        x, w = (ops.Tensor(graph, i) for i in n.inputs)
        return ops.spread_conv(x, w, at["strides"], at["padding"], at["dilation"], at["groups"], at["layout"],
                               at["kernel_layout"], at["input_dilation"]).node
    return graph.rewritten(expand)


def matrix_products(graph: Graph, keep: Callable[[Node], bool] = lambda n: False) -> Graph:
    """A copy in which a dot_general without batch dims over runs of
    adjacent dims ([b, t, d] x [d, n], as JAX writes a dense layer over a
    sequence, and its weight's gradient over (b, t)) that keep does not
    take as it is is a product of matrices, its operands and result
    reshaped (views): cuBLAS takes it, where the nest generated over three
    dimensions missed it (jax_block's products on an H200), and so does a
    CPU's BLAS where products are timed against it or sizes are symbolic
    (CpuTarget.graph_passes)."""
    def flatten(old: Node, n: Node, new: dict[int, Node]) -> Node:
        if n.op != "dot_general" or n.attrs["lb"] or keep(n):
            return n
        form = _matrix_form(*n.inputs, n.attrs["lc"], n.attrs["rc"])
        if form is None:
            return n
        (a_shape, a_free_first), (b_shape, b_free_first) = form
        a, b = (graph.reshape(x, shape) for x, shape in zip(n.inputs, (a_shape, b_shape)))
        out = graph.dot_general(a, b, ((1 if a_free_first else 0,), (1 if b_free_first else 0,)))
        return graph.reshape(out, n.shape)
    return graph.rewritten(flatten)


def _matrix_form(a: Node, b: Node, lc: tuple, rc: tuple) -> tuple | None:
    """Each operand's shape as a matrix ([free, contracting] or [contracting,
    free]) and whether its free run comes first, where its free dims and its
    contracting dims each form one run of adjacent dims (the contracting
    ones in the same order in both) and some run has more than one dim. A
    run of symbolic sizes is their product's size ([b, s, d] as [b*s, d]):
    a weight's gradient over (b, s) was a nest over both, not a product."""
    lf = [d for d in range(a.rank) if d not in lc]
    rf = [d for d in range(b.rank) if d not in rc]
    if len(lc) + len(lf) + len(rf) <= 3 or list(lc) != sorted(lc) or list(rc) != sorted(rc):
        return None
    out = []
    for x, free, con in ((a, lf, list(lc)), (b, rf, list(rc))):
        if not free or any(r != list(range(r[0], r[0] + len(r))) for r in (free, con)):
            return None
        sizes = [sz.product(x.shape[d] for d in r) for r in (free, con)]
        out.append((sizes if free[0] < con[0] else sizes[::-1], free[0] < con[0]))
    return tuple(out)
