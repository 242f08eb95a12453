"""The NVIDIA GPU target: its scheduling rewrites, PTX and executable.

Kernels of one structure share PTX (codegen.gpu_program), loaded on the
device at a program's first call and run by polyjit.runtime.gpu_program.GpuProgram on
the caller's stream. Programs are also kept within the process by their
cache key (plan, IR texts and PTX), as CPU kernels are; a cuBLAS step is
kept as its statement (cache.statement_json), run again from it.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import TYPE_CHECKING

from .. import cache
from .. import sizes as sz
from ..cache import ProcessCache
from ..channels_last import channels_last, inverse
from ..codegen.gpu_mapping import held_rows
from ..codegen.gpu_program import GpuCodeSet, build_program
from ..codegen.llvm import KernelInfo
from ..codegen.nvgpu import BLOCK, GpuEmitter, ptx
from ..compiler import executable, from_plan
from ..runtime.cuda import default_ordinal, device
from ..runtime.gpu_program import GpuProgram
from ..dtypes import DataType
from ..errors import CompileOptionError, DeviceError
from ..graph import ELEMENTWISE, Graph, Node, free_dims
from ..lowering import LAYOUT_OPS, UNROLL_LIMIT
from ..library import Convolution, backward_data
from ..schedule import gpu_rewrites, schedule_program
from .base import Target, matrix_products, reduced_in_steps, runs_from_inside

if TYPE_CHECKING:
    import islpy as isl

    from ..affine import AffineProgram
    from ..options import CompileOptions

log = logging.getLogger("polyjit")
GPU_TILES, GPU_KTILES = (32, 64, 128), (8, 16, 32)  # what nvgpu contraction tiles can be
GPU_PROGRAMS = 32  # GPU programs (plan, IR texts and PTX: megabytes for a model) kept per process, by key
_programs = ProcessCache(GPU_PROGRAMS)  # key -> (plan, objects)


SPLIT_ROWS = 32  # a reduction's contiguous inner part at least this long is summed by rows first
COLUMN_PART = 256  # a column reduction over more rows than this is combined in steps


def narrow_products(graph: Graph) -> Graph:
    """A copy in which a product of half-precision values widened to float32
    (PyTorch's addmm decomposition computes in float32) reads the half
    values themselves, its result still float32: cuBLAS then multiplies them
    on tensor cores (GemmEx), summing in float32 as before, where the
    widened copies had made it a float32 product (sgemm) of twice the bytes.
    Layout ops between the widening and the product apply to the half values
    instead, and scalings by constants (attention's math path scales q and
    k) move to the product's result."""
    def narrow(old: Node, n: Node, new: dict[int, Node]) -> Node:
        if n.op != "dot_general" or n.dtype != DataType.Float:
            return n
        (a, sa), (b, sb) = (_half_source(x) or (None, 1.0) for x in n.inputs)
        if a is None or b is None or a.dtype != b.dtype:
            return n
        product = Node("dot_general", (a, b), n.attrs, n.shape, n.dtype)
        if sa * sb == 1.0:
            return product
        scale = Node("broadcast_in_dim", (Node("constant", (), {"value": sa * sb, "weak": False}, (), n.dtype),),
                     {"dims": ()}, n.shape, n.dtype)
        return Node("mul", (product, scale), {}, n.shape, n.dtype)
    return graph.rewritten(narrow)


SMALL_PRODUCT = 1 << 14  # a float32 product of at most this many multiplications is a sum of products
SMALL_DEPTH = 256  # ... over at most this many terms


def small_products(graph: Graph) -> Graph:
    """A copy in which a float32 product small enough that its launch is
    most of its time (a classifier head, [8, 64] x [64, 10], and its
    gradients) is a sum over the contracted dims of the operands' products:
    a thread per result element then sums its terms, fused with its
    neighbours (the mean pooling before it, the bias after), where the
    product was a tiled kernel of its own or a cuBLAS call."""
    def as_sum(old: Node, n: Node, new: dict[int, Node]) -> Node:
        if n.op != "dot_general" or n.dtype != DataType.Float:
            return n
        a, b = n.inputs
        at = n.attrs
        depth = sz.static_product(a.shape[d] for d in at["lc"])
        size = sz.static_product(n.shape)
        if depth is None or size is None or depth > SMALL_DEPTH or depth * size > SMALL_PRODUCT:
            return n
        lf, rf = free_dims(n)
        nb, nl, nr = len(at["lb"]), len(lf), len(rf)
        shape = (*n.shape, *(a.shape[d] for d in at["lc"]))  # the result's dims, then the contracted ones
        contracted = range(len(n.shape), len(shape))

        def spread(x, batch, free, summed, placed):  # x's dims in order, broadcast over the other's free dims
            return graph.broadcast_in_dim(graph.transpose(x, (*batch, *free, *summed)), shape,
                                          (*range(nb), *placed, *contracted))
        terms = (spread(a, at["lb"], lf, at["lc"], range(nb, nb + nl)),
                 spread(b, at["rb"], rf, at["rc"], range(nb + nl, nb + nl + nr)))
        return graph.reduce("sum", graph.binary("mul", *terms), contracted)
    return graph.rewritten(as_sum)


NARROW_PRODUCT = 1024  # a matrix product's result at most this wide is joined with its siblings


def sibling_products(graph: Graph) -> Graph:
    """A copy in which matrix products of one left operand by several narrow
    right ones (a transformer's query, key and value projections of the
    same hidden states, each [t, d] x [d, d]) are one product by their
    right operands joined along the result's columns, each former result a
    slice of its columns: cuBLAS runs the wide product nearer its peak than
    the narrow ones (bench/NOTES.md). Joined only where the right operands
    (weights, copied into one array at each call) are smaller than the
    shared left one: a single token's projections would copy the weights
    for nothing."""
    groups: dict[tuple, list[Node]] = collections.defaultdict(list)
    for n in graph.nodes():
        if n.op != "dot_general" or n.attrs["lb"] or n.inputs[1].rank != 2 or len(n.attrs["rc"]) != 1:
            continue
        a, b = n.inputs
        free = 1 - n.attrs["rc"][0]
        if not all(sz.is_static(x) for x in a.shape + b.shape) or int(b.shape[free]) > NARROW_PRODUCT:
            continue
        groups[(_viewed(a), n.attrs["lc"], n.attrs["rc"], b.shape[n.attrs["rc"][0]], b.dtype)].append(n)
    joined: dict[int, tuple[int, list[Node]]] = {}  # a sibling's id -> (its group's number, the group)
    for k, group in enumerate(groups.values()):
        a = group[0].inputs[0]
        if len(group) > 1 and sum(sz.static_product(m.inputs[1].shape) for m in group) < sz.static_product(a.shape):
            joined.update((m.id, (k, group)) for m in group)
    if not joined:
        return graph
    products: dict[int, Node] = {}  # a group's number -> its joined product

    def join(old: Node, n: Node, new: dict[int, Node]) -> Node:
        if old.id not in joined:
            return n
        k, group = joined[old.id]
        if k not in products:
            weights = [new.get(w.id, w if _unchanged(w) else None) for w in (m.inputs[1] for m in group)]
            products[k] = None
            if all(w is not None for w in weights):  # (else a later sibling's weight is made after this product)
                free = 1 - n.attrs["rc"][0]
                weights = graph.concatenate(weights, free)  # (Linear's [n, d] weights: copied as [d, 3n])
                products[k] = Node("dot_general", (n.inputs[0], weights), n.attrs,
                                   (*n.shape[:-1], weights.shape[free]), n.dtype)
        whole = products[k]
        if whole is None:
            return n
        start = sum(int(m.shape[-1]) for m in group[:group.index(old)])
        return graph.slice(whole, [0] * (whole.rank - 1) + [start], [*whole.shape[:-1], start + int(n.shape[-1])])
    return graph.rewritten(join)


def _unchanged(x: Node) -> bool:
    """Whether x is layout ops over the graph's sources: a rewrite that
    changes products only leaves it as it is."""
    return x.is_source or (x.op in ("reshape", "transpose") and _unchanged(x.inputs[0]))


def _viewed(x: Node) -> tuple | int:
    """x's identity through layout ops: matrix_products reshapes each
    product's operand with a node of its own."""
    if x.op in ("reshape", "transpose"):
        return (x.op, _viewed(x.inputs[0]), tuple(x.shape), x.attrs.get("perm"))
    return x.id


_HALVES = (DataType.Half, DataType.BFloat16)
_MOVES = ("transpose", "reshape", "broadcast_in_dim")  # layout ops that apply to a half array as to its widening


def _half_source(x: Node) -> tuple[Node, float] | None:
    """x as layout ops and scalings by constants over a half array widened to
    float32: (the layout ops on the half array, the scalings' product); None
    where x is not that."""
    scale, chain = 1.0, []
    while not (x.op == "cast" and x.dtype == DataType.Float and x.inputs[0].dtype in _HALVES):
        if x.op in _MOVES and x.inputs:
            chain.append(x)
            x = x.inputs[0]
            continue
        factor = [_scalar(i) for i in x.inputs] if x.op == "mul" else []
        if len(factor) != 2 or (factor[0] is None) == (factor[1] is None):
            return None
        scale *= factor[0] if factor[0] is not None else factor[1]
        x = x.inputs[1] if factor[0] is not None else x.inputs[0]
    x = x.inputs[0]
    for move in reversed(chain):
        x = Node(move.op, (x,), move.attrs, move.shape, x.dtype)
    return x, scale


def _scalar(x: Node) -> float | None:
    """The value of a float constant broadcast to x's shape, or None."""
    while x.op == "broadcast_in_dim" and x.inputs:
        x = x.inputs[0]
    value = x.attrs.get("value") if x.op == "constant" else None
    return float(value) if isinstance(value, float) else None


def split_reductions(graph: Graph) -> Graph:
    """A copy in which a reduction that one thread per output would run
    over many values is combined in parallel steps:
    - over outer dimensions and a contiguous suffix of inner ones (a batch
      norm's per-channel sums over NCHW's N, H and W): each row of the
      suffix first (a warp per row, reading memory in order), then the few
      values left. Whole, it ran a thread per output, 64 threads for 400K
      values each in ResNet-18's first batch norm;
    - over leading dimensions, the inner ones kept (the same sums over
      NHWC's N, H and W), where one such sum reads another's result (a
      batch norm's variance, its mean): over W first, a thread per image,
      row and channel (reading memory in order across the threads), then
      over H, then N. Fused, the two ran a thread per channel; a column
      sum alone already runs in strips (codegen.gpu_mapping.AtomicStrips)."""
    chained = _chained_columns(graph)

    def split(old: Node, n: Node, new: dict[int, Node]) -> Node:
        if n.op != "reduce":
            return n
        x, axes = n.inputs[0], tuple(n.attrs["axes"])
        if _leading(n):
            return (_columns(n) if old.id in chained else None) or n
        k = x.rank
        while k - 1 in axes:
            k -= 1
        inner = sz.static_product(x.shape[d] for d in range(k, x.rank))
        if k == x.rank or k - 1 < min(axes, default=k) or inner is None or inner < SPLIT_ROWS:
            return n  # no outer reduced dimension, or a short row
        flat = Node("reshape", (x,), {}, (*x.shape[:k], inner), x.dtype)  # one row loop: a warp's lanes share it
        rows = Node("reduce", (flat,), {**n.attrs, "axes": (k,), "keepdim": False}, x.shape[:k], n.dtype)
        outer = tuple(a for a in axes if a < k)
        keep = n.attrs.get("keepdim", False)
        rest = Node("reduce", (rows,), {**n.attrs, "axes": outer},
                    tuple(1 if d in outer else s for d, s in enumerate(x.shape[:k]) if keep or d not in outer), n.dtype)
        return rest if tuple(rest.shape) == tuple(n.shape) else Node("reshape", (rest,), {}, n.shape, n.dtype)
    return graph.rewritten(split)


def _leading(n: Node) -> bool:
    """Whether n reduces over its operand's leading dimensions, keeping others."""
    if n.op != "reduce":
        return False
    axes = tuple(n.attrs["axes"])
    return bool(axes) and axes == tuple(range(len(axes))) and len(axes) < n.inputs[0].rank


def _chained_columns(graph: Graph) -> set[int]:
    """The reductions over leading dimensions that read another's result,
    or whose result another reads, through elementwise and layout ops."""
    reach: dict[int, frozenset] = {}  # node -> the leading-dimension reductions it reads through those ops
    chained: set[int] = set()
    for n in graph.nodes():
        through = n.op in ELEMENTWISE + LAYOUT_OPS + ("reduce",)
        read = frozenset().union(*(reach[i.id] for i in n.inputs)) if through else frozenset()
        if _leading(n):
            if read:
                chained |= read | {n.id}
            read = read | {n.id}
        reach[n.id] = read
    return chained


def _columns(n: Node) -> Node | None:
    """Reduction n over x's leading dimensions as a reduction over each run
    of them in turn, innermost first (a run: the fewest dimensions from the
    inside that hold more values than unroll into one expression, so each
    step stays a loop of its own); None where they are few or one run.
    Whole dimensions keep every access affine: rows flattened and cut into
    parts read through divisions, on which isl gave up for seconds."""
    x, lead = n.inputs[0], len(n.attrs["axes"])
    sizes = [int(s) if sz.is_static(s) else None for s in x.shape[:lead]]
    if None in sizes or math.prod(sizes) <= COLUMN_PART:
        return None
    runs = runs_from_inside(sizes, range(lead), UNROLL_LIMIT)
    return reduced_in_steps(n, runs) if len(runs) > 1 else None


class NvgpuTarget(Target):
    """An NVIDIA GPU, through NVPTX and the CUDA driver."""

    name = "nvgpu"
    executable = GpuProgram
    device_arrays = True
    recompute_limit = 16  # on a GPU, memory traffic costs more than arithmetic
    load_work = 1  # and recomputing a value loads its arrays again: in BERT's backward, a value three
    # kernels each recomputed from its inputs is made once, in the kernel of its row sums
    library = "cuBLAS"
    keeps_programs = True
    tensor_float32 = True
    library_products = (DataType.Float, DataType.Half, DataType.BFloat16)  # half types on tensor cores
    launched_library_calls = True
    small_statements_apart = True  # (its mapping gives them kernels of their own anyway)
    side_by_side_nests = BLOCK  # (one launch for a model's weight copies, not one each; a thread at least for each)
    windows_apart = True  # (a window's readers would fuse into its halo strips only with isl's seconds)
    sums_sums_apart = True  # (fused, a classifier head's sum and the pooled sums it reads starved the grid)
    joins_sibling_sums = True  # (a layer norm's weight and bias gradients: one kernel reading the gradient once)
    column_sums_apart = True  # (isl gives such a sum and its producers kernels of their own, after seconds)
    folds_each_call = False  # the library's convolution leaves a pass over its result anyway: the scale joins it

    def graph_passes(self, graph: Graph, options: CompileOptions) -> Graph:
        """Small products as sums (small_products; not where the options ask
        for the library), products over runs of dims as products of
        matrices (matrix_products), siblings joined (sibling_products),
        channels-last arrays around cuDNN's TF32 convolutions
        (polyjit.channels_last), and reductions split."""
        graph = super().graph_passes(graph, options)
        if self._channels_last(options):
            graph = channels_last(graph, stencils=options.contractions != "library")
        if options.contractions != "library":
            graph = small_products(graph)
        return split_reductions(sibling_products(narrow_products(matrix_products(graph))))

    def _channels_last(self, options: CompileOptions) -> bool:
        """Where cuDNN runs TF32: its tensor-core kernels take NHWC (FMA ones take NCHW as it is)."""
        return options.contractions != "generated" and bool(options.tf32) and self.direct_convolutions()

    def output_orders(self, graph: Graph, options: CompileOptions) -> dict[int, tuple[int, ...]]:
        """The outputs the channels-last pass computes channels last: a
        training forward's saved activations, which its backward then reads
        in place."""
        if not self._channels_last(options):
            return {}
        converted = channels_last(graph)
        return {k: inverse(tuple(n.attrs["perm"])) for k, (o, n) in enumerate(zip(graph.outputs, converted.outputs))
                if n is not o and n.is_index_transpose and not n.inputs[0].is_source}

    def keeps_input_dilation(self, n: Node, options: CompileOptions) -> bool:
        """Where cuDNN's backward data takes it (library.backward_data)."""
        return options.contractions != "generated" and self.direct_convolutions() and backward_data(n) is not None

    def schedule_rewrites(self, sched: isl.Schedule, prog: AffineProgram, validity, tile_sizes) -> isl.Schedule:
        """Every coincident loop outside (they become the thread grid), all of them marked."""
        return gpu_rewrites.rewrite(sched, prog, validity)

    def private_buffers(self, prog: AffineProgram, ast: isl.AstNode, contracted: dict, fused: bool) -> dict | None:
        """Those a thread's registers hold, and rows the lanes of a warp hold
        in theirs (gpu_mapping.held_rows); None where the fusion starves the grid."""
        kept = gpu_rewrites.private_buffers(prog, ast, contracted, fused)
        return None if kept is None else {**kept, **held_rows(prog, ast, contracted, kept)}

    def check_tile_sizes(self, tile_sizes: tuple[int, ...]) -> None:
        ts = tile_sizes
        if len(ts) > 2 or ts[0] not in GPU_TILES or (len(ts) == 2 and ts[1] not in GPU_KTILES):
            raise CompileOptionError(f"compile option 'tile_sizes' is {list(ts)!r} for target 'nvgpu'; expected "
                                     f"[tile] or [tile, ktile] for contractions: tile (the side of the output "
                                     f"tile a block computes) one of {list(GPU_TILES)}, ktile (the reduction "
                                     f"slice staged in shared memory) one of {list(GPU_KTILES)}")

    def machine(self, options: CompileOptions) -> tuple[str, int | None]:
        """The GPU's sm_XX (options.gpu_arch, else the GPU in use: DeviceError
        without one) and multiprocessors (None without a GPU)."""
        return options.gpu_arch or _device_arch(), _multiprocessors()

    def machine_key(self, machine: tuple[str, int | None]) -> str:
        """The GPU, and which libraries load (their steps are in the program)."""
        arch, sms = machine
        return f"nvgpu|{arch}|{sms}|cublas {self.library_available()}|cudnn {self.direct_convolutions()}"

    def build(self, graph: Graph, prog: AffineProgram, options: CompileOptions, name: str, timer,
              machine: tuple[str, int | None]) -> GpuProgram:
        """Kernels of one structure share PTX (codegen.gpu_program), compiled once
        per process, for GPU arch with sms multiprocessors (None: not known, no
        GPU present); where one cannot be shared, one module of every kernel,
        emitted from the whole program."""
        arch, sms = machine
        codes = GpuCodeSet((arch, sms, options.tile_sizes), timer, self.variant(options))
        with timer("schedule"):
            sched = schedule_program(prog, options.fusion, options.tile_sizes, self, timer, each=codes.of)
        code = build_program(prog, sched, name, codes)
        if code is None:
            return self._build_whole(graph, prog, options, name, timer, arch, sms)
        ir = {"mapping": code.mapping, "llvm": code.ir, "llvm_opt": code.optimized, "ptx": code.ptx}
        exe = executable(self.executable, graph, prog, sched, code.kernels, code.buffers, code.int_slots, options, name,
                         None, ir, _fields(prog, code.kernels, code.ptx, arch))
        exe.stats["kernels_compiled"] = code.compiled
        return exe

    def _build_whole(self, graph: Graph, prog: AffineProgram, options: CompileOptions, name: str, timer,
                     arch: str, sms: int | None) -> GpuProgram:
        """One module of every kernel, emitted from the whole program."""
        with timer("schedule"):
            sched = schedule_program(prog, options.fusion, options.tile_sizes, self, timer, canonical=False)
        with timer("emit"):
            emitter = GpuEmitter(prog, sched, name)
            emitter.tile_sizes = options.tile_sizes
            emitter.multiprocessors, emitter.arch = sms, arch
            llvm_text = str(emitter.emit())
        with timer("llvm"):
            optimized, ptx_text = ptx(llvm_text, arch)
        kernels = emitter.kernels
        exe = executable(self.executable, graph, prog, sched, kernels, emitter.buffer_arrays, emitter.int_slots,
                         options, name, None, {"mapping": emitter.mapping_text(), "llvm": llvm_text,
                                               "llvm_opt": optimized, "ptx": ptx_text},
                         _fields(prog, kernels, ptx_text, arch))
        exe.stats["kernels_compiled"] = len(kernels)
        return exe

    def library_available(self) -> bool:
        from ..runtime.cublas import cublas
        return cublas() is not None

    def direct_convolutions(self) -> bool:
        from ..runtime.cudnn import cudnn
        return cudnn() is not None

    # ---------------------------------------------------------------- the compile cache
    def lookup(self, key: str, disk: bool) -> tuple[tuple | None, int]:
        """In this process first, then on disk."""
        hit = _programs.get(key)
        if hit is not None or not disk:
            return hit, 0
        hit, hits = super().lookup(key, disk)
        if hit:
            _programs.put(key, hit)
        return hit, hits

    def keep(self, key: str, exe: GpuProgram, disk: bool) -> None:
        """Kept in this process too; its object is its PTX, as text; a
        library step's statement is part of its plan."""
        try:
            kept = self.entry(exe)
        except TypeError as e:  # a library call the cache cannot write (polyjit.library.CALLS)
            log.warning("polyjit: %s not kept in the compile cache: %s", exe.name, e)
            return
        _programs.put(key, kept)
        if disk:
            cache.store(key, *kept)

    def plan_fields(self, exe: GpuProgram) -> dict:
        return {"gpu": {"arch": exe.arch, "writes": [[cache.array_json(a) for a in w] for w in exe.writes],
                        "kernels": [[k.lanes, list(k.zeroed), k.strips,
                                     None if k.library is None else cache.statement_json(k.library),
                                     None if k.params is None else list(k.params)]
                                    for k in exe.kernels]}}

    def objects(self, exe: GpuProgram) -> list[bytes]:
        return [exe.ptx.encode()]

    def load(self, constants: list, options: CompileOptions, name: str, plan: dict,
             objects: list[bytes]) -> GpuProgram | None:
        """PTX, loaded on the device at the first call; None (compiled again)
        where the program has library steps and cuBLAS (or cuDNN) does not load here."""
        gpu = plan["gpu"]
        if any(lib is not None for _, _, _, lib, _ in gpu["kernels"]) and not self.library_available():
            return None
        fields = {"ptx": objects[0].decode(), "arch": gpu["arch"],
                  "writes": [[cache.array_from(a) for a in w] for w in gpu["writes"]]}
        kernels = [KernelInfo(n, par, tuple(st), lanes, tuple(zeroed), strips,
                              None if lib is None else cache.statement_from(lib),
                              None if params is None else tuple(params))
                   for (n, par, st), (lanes, zeroed, strips, lib, params) in zip(plan["kernels"], gpu["kernels"])]
        if any(isinstance(k.library.library, Convolution) for k in kernels if k.library is not None) \
                and not self.direct_convolutions():
            return None  # (cuDNN's convolutions, where it no longer loads)
        exe = from_plan(self.executable, constants, options, name, plan, kernels, None, fields)
        exe.ir["ptx"] = fields["ptx"]
        return exe


def _fields(prog: AffineProgram, kernels, ptx_text: str, arch: str) -> dict:
    return {"ptx": ptx_text, "arch": arch,
            "writes": [  # the arrays each kernel writes size its grid
        [prog.arrays[a] for a in sorted({s.array for s in prog.statements if s.name in k.statements})]
        for k in kernels]}


def _device_arch() -> str:
    """The sm_XX of the GPU in use; DeviceError without a driver or GPU."""
    return device(default_ordinal()).arch


def _multiprocessors() -> int | None:
    """The multiprocessors of the GPU in use (None without one: PTX for gpu_arch)."""
    try:
        return device(default_ordinal()).multiprocessors
    except DeviceError:
        return None
