"""The CPU target: its graph passes, scheduling rewrites, code and executable.

The CPU's generated contractions load vectors of the product's columns, so
an operand that does not run along them is packed first (packed_operands).
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from .. import sizes as sz
from ..channels_last import stencils_channels_last
from ..codegen.cpu import host_key, vector_bits
from ..codegen.cpu_mapping import NARROWEST_VECTOR
from ..codegen.llvm import KernelInfo
from ..codegen.program import CodeSet, LoadedProgram, build_program, host_object
from ..columns import columns_form
from ..compiler import executable, from_plan
from ..dtypes import DataType
from ..graph import ELEMENTWISE, Graph, Node, free_dims
from ..library import blas, gemm_form
from ..runtime import CompiledProgram
from ..schedule import cpu_rewrites, schedule_program
from ..schedule.cpu_rewrites import STRIP_COLUMNS
from ..schedule.fusion import guarded_inner_loop, serialized
from .base import Target, matrix_products, reduced_in_steps, runs_from_inside

if TYPE_CHECKING:
    import islpy as isl

    from ..affine import AffineProgram
    from ..options import CompileOptions


STRIP_MIN = 1 << 15  # values a sum over leading dimensions reads before column_strips cuts it
CASCADE_SUM = 4096  # values a float sum adds into each result before cascaded_sums adds them in steps
CASCADE_RUN = 16  # values each step of a cascaded column sum adds at least (its dims from the inside)


def cascaded_sums(graph: Graph) -> Graph:
    """A copy in which a float sum of more than CASCADE_SUM values into each
    result adds them in steps: over runs of its reduced dims from the
    inside, each run adding CASCADE_RUN values or more (a batch norm's sums
    over NCHW's N, H and W: along each row of W, then down H, then over N).
    Each step's running sums then take in few values. Whole, one running
    sum took in every value: a training batch norm's mean over 32 x 112 x
    112 values was 1e-4 off, its outputs 7.6e-4 from eager's, whose sums
    cascade (8e-7). A sum along one dim keeps its form: its vector lanes
    and unrolled copies each hold a running sum."""
    def split(old: Node, n: Node, new: dict[int, Node]) -> Node:
        if n.op != "reduce" or n.attrs["op"] != "sum" or not n.dtype.is_float:
            return n
        return _cascaded(n) or n
    return graph.rewritten(split)


def _cascaded(n: Node) -> Node | None:
    """Sum n in steps (cascaded_sums); None where it adds few values into
    each result or one step would take them all. A sum over a symbolic
    size may add any number (a training batch norm compiled once for every
    batch size still sums each image's H x W first); its runs are cut at
    the size's estimate."""
    x, axes = n.inputs[0], tuple(sorted(n.attrs["axes"]))
    sizes = [sz.estimate(s) for s in x.shape]
    symbolic = any(not sz.is_static(x.shape[a]) for a in axes)
    if not axes or (math.prod(sizes[a] for a in axes) <= CASCADE_SUM and not symbolic):
        return None
    runs = runs_from_inside(sizes, axes, CASCADE_RUN)
    if len(runs) < 2 or math.prod(sizes) // math.prod(sizes[a] for a in runs[0]) > _source_elements(x):
        return None  # (a first step larger than what the operand is made from: a sum of broadcast products)
    return reduced_in_steps(n, runs)


def _source_elements(x: Node) -> int:
    """The elements of the largest array x is computed from elementwise,
    through broadcasts and reshapes (x's own where it is one): what a
    sum's first step may store without storing more than exists already."""
    largest, stack, seen = 0, [x], set()
    while stack:
        n = stack.pop()
        if n.id in seen:
            continue
        seen.add(n.id)
        if n.op in ELEMENTWISE or n.op in ("broadcast_in_dim", "reshape"):
            stack.extend(n.inputs)
        else:
            largest = max(largest, math.prod(map(sz.estimate, n.shape)))
    return largest


def column_strips(graph: Graph, parts: int) -> Graph:
    """A copy in which a sum over leading dimensions, the trailing ones kept
    (a batch norm's per-channel sums over NHWC's N, H and W, and their
    gradients), is cut into parts strips along its first reduced dimension
    that parts divides: the strips are summed side by side, each by one
    thread, then added. Whole, its one parallel loop ran along the kept
    channels inside the reduction: one thread (a flax CNN's gradient spent
    half its time in such sums). Rows of 2 * STRIP_COLUMNS or more are left
    whole: the threads share strips of their columns
    (cpu_rewrites.balance_parallel)."""
    def split(old: Node, n: Node, new: dict[int, Node]) -> Node:
        if parts < 2 or n.op != "reduce" or n.attrs["op"] != "sum" or n.inputs[0].op == "reduce":
            return n
        x, axes = n.inputs[0], tuple(n.attrs["axes"])
        if not axes or axes != tuple(range(len(axes))) or len(axes) == x.rank:
            return n
        size, row = sz.static_product(x.shape), sz.static_product(x.shape[len(axes):])
        cut = next((d for d in axes if sz.is_static(x.shape[d]) and int(x.shape[d]) % parts == 0
                    and int(x.shape[d]) > 1), None)
        if size is None or size < STRIP_MIN or cut is None or row is None or row >= 2 * STRIP_COLUMNS:
            return n
        strips = (*x.shape[:cut], parts, int(x.shape[cut]) // parts, *x.shape[cut + 1:])
        xs = Node("reshape", (x,), {}, strips, x.dtype)
        inner = tuple(a + (a >= cut) for a in axes if a != cut) + (cut + 1,)
        kept = tuple(s for d, s in enumerate(strips) if d not in inner)
        partial = Node("reduce", (xs,), {**n.attrs, "axes": tuple(sorted(inner)), "keepdim": False},
                       kept, n.dtype)
        whole = Node("reduce", (partial,), {**n.attrs, "axes": (0,), "keepdim": False}, kept[1:], n.dtype)
        return whole if tuple(whole.shape) == tuple(n.shape) else Node("reshape", (whole,), {}, n.shape, n.dtype)
    return graph.rewritten(split)


def packed_operands(graph: Graph, min_rows: int = 8) -> Graph:
    """A copy in which a contraction whose second operand does not run
    contiguously along the result's last dimension (x @ W.T, as
    nn.Linear computes) reads a copy of it laid out (batch, contracting,
    free): the CPU's register blocks load vectors along that dimension,
    and the copy costs one pass over the operand against a pass over it
    for every row block. Only where the first operand has `min_rows`
    rows or more (or a symbolic count)."""
    def pack(old: Node, n: Node, new: dict[int, Node]) -> Node:
        if n.op != "dot_general":
            return n
        a, b = n.inputs
        at = n.attrs
        lf, rf = free_dims(n)
        rows = sz.static_product(a.shape[d] for d in lf)
        if not rf or _innermost(b, rf[-1]) or (rows is not None and rows < min_rows):
            return n
        perm = tuple(at["rb"]) + tuple(at["rc"]) + tuple(rf)
        shape = tuple(b.shape[p] for p in perm)
        src = b
        while src.is_index_transpose:
            perm, src = tuple(src.attrs["perm"][p] for p in perm), src.inputs[0]
        bt = Node("transpose", (src,), {"perm": perm, "packed": True}, shape, b.dtype)
        nb, nc = len(at["rb"]), len(at["rc"])
        return dataclasses.replace(n, inputs=(a, bt), attrs={**at, "rb": tuple(range(nb)),
                                                             "rc": tuple(range(nb, nb + nc))})
    return graph.rewritten(pack)


def _innermost(n: Node, d: int) -> bool:
    """Whether dimension d of n is the innermost of the memory it reads
    (transposes are access relations, not copies), through reshapes of the
    dimensions before d and of dimensions of one (attention's keys
    transposed, their batch and heads then merged for a batched product:
    q @ k.transpose(-1, -2), or einsum's "bhqd,bhkd->bhqk")."""
    while True:
        if n.is_index_transpose:
            d, n = n.attrs["perm"][d], n.inputs[0]
        elif n.op == "reshape" and n.inputs and _reshaped(n, d) is not None:
            d, n = _reshaped(n, d), n.inputs[0]
        else:  # (another reshape: taken as laid out as it reads)
            return all(s == 1 for s in n.shape[d + 1:])


def _reshaped(n: Node, d: int) -> int | None:
    """The dimension of reshape n's operand that its dimension d runs along,
    where the reshape keeps d and the dimensions after it (ones aside); else None."""
    src = n.inputs[0]
    tail = [s for s in n.shape[d:] if s != 1]
    kept = [(j, s) for j, s in enumerate(src.shape) if s != 1]
    if n.shape[d] == 1 or not tail or len(kept) < len(tail) or [s for _, s in kept[-len(tail):]] != tail:
        return None
    return kept[-len(tail)][0]


def _read_across(n: Node) -> bool:
    """Whether unbatched product n's second operand runs across the
    result's last dimension and was not packed (packed_operands: too few
    rows): the generated register blocks then gather it a column at a
    time, where the library reads it in place. A classifier's x @ W.T at 2
    rows (512 -> 1000) took 0.320 ms generated, 0.081 ms in the library.
    (Batched products, attention's, would be a call per batch element.)"""
    b, at = n.inputs[1], n.attrs
    free = [d for d in range(b.rank) if d not in at["rc"] and d not in at["rb"]]
    return not at["rb"] and bool(free) and not b.attrs.get("packed") and not _innermost(b, free[-1])


FEW_ROWS, MANY_COLUMNS = 16, 512  # a product of so few rows reading its weight in place runs generated
LARGE_SIDE = 256  # with 256-bit vectors, an unbatched product this long on every side calls the library


def _large_product(L, n: Node) -> str:
    """Why an unbatched float32 product calls the library untimed on a host
    of vectors narrower than 512 bits, or "": its rows, columns and depth
    are each LARGE_SIDE or more. At every such product of the bench's
    transformers (BERT, GPT-2, the encoder and jax_block, forward and
    training: 256 to 50257 on each side), generated code took 1.10-2.61x the
    library's time (bench/NOTES.md), far from GENERATED_MARGIN's 0.8x, and
    each timing cost two compiles. Batched products (attention's) came
    within 0.89-1.96x, and stay timed."""
    if n.op != "dot_general" or n.dtype != DataType.Float or n.attrs["lb"]:
        return ""
    a, b = n.inputs
    lf, rf = free_dims(n)
    sides = ([L.shape(a)[d] for d in lf], [L.shape(b)[d] for d in rf], [L.shape(a)[d] for d in n.attrs["lc"]])
    if not all(sz.is_static(s) for side in sides for s in side):
        return ""
    rows, cols, depth = (sz.static_product(side) for side in sides)
    if min(rows, cols, depth) < LARGE_SIDE:
        return ""
    return f"{rows} x {depth} x {cols}: large on every side for 256-bit vectors"


def _whole_blocks(L, n: Node, lanes: int, min_rows: int = 64, min_rows_packed: int = 128,
                  max_elements: int = 1 << 22) -> str:
    """Why a float32 product runs generated without timing, or "": one free
    dimension on each side, its register blocks whole with every
    accumulator busy (cpu_rewrites.block_fit), rows enough to pay for an
    operand read through a transpose or packed at each call, and a result
    of at most max_elements. Such products beat OpenBLAS at every shape of
    bench/products.py (bench/NOTES.md); partial blocks (197 rows, 77 or
    6282 columns), a packed weight under few rows and larger results lost
    or came level: those stay timed. A classifier head (_classifier_head)
    runs generated too: it streams the weight's rows once, and beat sgemm
    at every such shape measured (1 to 16 rows, 256 to 2048 deep, 512 to
    3072 wide: 0.12-0.86x)."""
    if _classifier_head(L, n):
        return f"{L.shape(n)[-2]} rows along the weight's rows"
    if not _one_free_dim_each(L, n):
        return ""
    shape = L.shape(n)
    rows, cols = shape[-2], int(shape[-1])
    packed = _operand_copied(n)
    if not sz.is_static(rows):  # (a batch's tokens: whole blocks but the last, which has a checked copy)
        block = cpu_rewrites.block_shape(None, cols, lanes)
        rows = max(sz.estimate(rows) // block[0], 1) * block[0]
    if rows < (min_rows_packed if packed else min_rows) or rows * cols > max_elements \
            or cpu_rewrites.block_fit(int(rows), cols, lanes) < 1.0:
        return ""
    return f"whole {'x'.join(map(str, cpu_rewrites.block_shape(int(rows), cols, lanes)))} register blocks"


def _one_free_dim_each(L, n: Node) -> bool:
    """Whether n is a float32 product of one free dimension on each side,
    its result's sizes static but for the rows."""
    a, b = n.inputs
    at, shape = n.attrs, L.shape(n)
    free = [x.rank - len(at[c]) - len(at[bt]) for x, c, bt in ((a, "lc", "lb"), (b, "rc", "rb"))]
    return n.dtype == DataType.Float and free == [1, 1] and all(map(sz.is_static, shape[:-2] + shape[-1:]))


def _operand_copied(n: Node) -> bool:
    """Whether product n reads an operand through a transpose or packed at each call."""
    return any(i.is_index_transpose or i.attrs.get("packed") for i in n.inputs)


def _classifier_head(L, n: Node) -> tuple[int, int] | None:
    """(rows, columns) of a classifier head: an unbatched float32 product
    of FEW_ROWS rows or fewer, MANY_COLUMNS wide or more, its weight read
    in place (not through a transpose, not packed); else None."""
    if n.op != "dot_general" or n.attrs["lb"] or not _one_free_dim_each(L, n):
        return None
    rows, cols = L.shape(n)[-2], int(L.shape(n)[-1])
    if _operand_copied(n) or not sz.is_static(rows):
        return None
    return (int(rows), cols) if int(rows) <= FEW_ROWS and cols >= MANY_COLUMNS else None


def _head_in_blocks(L, n: Node, lanes: int) -> str:
    """Why a classifier head (_classifier_head) calls the library untimed
    on a host of vectors narrower than 512 bits, or "": its rows take more
    than one register block, and each block streams the whole weight
    again. Timed alone, its weight stays in cache and the two came level
    or the library won (8 x 1280 x 1000: 1.03x; 8 x 768 x 3072: 0.86x; 16 x
    1024 x 1024: 1.50x); in MobileNetV2, where the weight comes from
    memory, a timing that chose generated code left the head at twice the
    library's time (bench/NOTES.md)."""
    head = _classifier_head(L, n)
    if head is None:
        return ""
    rows, cols = head
    block = cpu_rewrites.block_shape(rows, cols, lanes)[0]
    return f"{rows} rows of a classifier head in blocks of {block}: the weight read again" if rows > block else ""


def _image_channels(L, n: Node, lanes: int) -> bool:
    """Whether channels-last convolution n reads fewer input channels than
    a vector holds (an image's three), its kernel's output channels last:
    its reduction is a few taps of a few channels, which generated code
    ran in 0.39-0.92x sgemm's time over im2col at every such shape measured
    on an AVX2 host too, strided or not (bench/convolutions.py,
    bench/NOTES.md)."""
    kernel, klay = L.shape(n.inputs[1]), n.attrs["kernel_layout"]
    return klay[-1] == "O" and int(kernel[klay.index("I")]) < lanes


def _pointwise(L, n: Node) -> bool:
    """Whether convolution n's kernel is 1 wide in every spatial dim."""
    return all(int(s) == 1 for s, c in zip(L.shape(n.inputs[1]), n.attrs["kernel_layout"]) if c not in "OI")


def _scalar_rows(L, n: Node, lanes: int) -> str:
    """Why a 1x1 convolution of NCHW images (gemm_form "nchw") calls the
    library untimed on a host of vectors narrower than 512 bits, or "": its
    output rows, narrower than a vector and no multiple of NARROWEST_VECTOR,
    leave its register blocks no vector block, so its generated code is
    scalar. MobileNetV3's at 7x7 positions took 5-12x the library's time
    (bench/NOTES.md), below MIN_MACS, where nothing was timed; at 4x4 and
    14x14 positions the two came level."""
    width = int(L.shape(n)[-1])  # (gemm_form "nchw": the sizes are numbers, a position's dim last)
    if not _pointwise(L, n) or not 1 < width < lanes or width % NARROWEST_VECTOR == 0:
        return ""
    return f"rows of {width} positions fill no vector: generated code is scalar"


FITTING_BLOCKS = 0.75  # a strided image's register blocks fit its rows this well: generated (_channels_last)


def _channels_last(L, n: Node, lanes: int, min_rows: int = 64) -> tuple[bool, str] | None:
    """The model's choice for an ungrouped float32 convolution of
    channels-last images (NHWC, as JAX and Keras hold them; gemm_form
    "nhwc"), or None where only a timing tells (bench/convolutions.py
    measures each case against the model):
    - generated, where the output channels run in vectors (whole ones and
      narrower ones of NARROWEST_VECTOR lanes or more: 8, 24, 40 or 56 channels)
      along both the kernel's rows and the result (kernel layout ...O), with
      odd kernel sizes, at stride 1 or from a vector of input channels or
      more: generated beat sgemm over im2col at every such shape measured
      (0.31-0.86x); strided convolutions of an image's 3 channels, where
      the result's rows fill the register blocks (cpu_rewrites.block_fit of
      FITTING_BLOCKS or more): 0.35-0.91x, where rows of 47 took partial
      blocks and lost (1.17-1.47x);
    - the library, where the kernel holds 2 vectors or more of output
      channels strided (an input gradient's flipped kernel, ...OI): the
      generated nest loads no vector along them, and lost at every such
      shape (up to 11x); with 16 it won at short reductions."""
    at = n.attrs
    if at["groups"] != 1 or "input_dilation" in at:
        return None
    kernel, klay, out = L.shape(n.inputs[1]), at["kernel_layout"], L.shape(n)
    outputs = int(kernel[klay.index("O")])
    if klay[-1] != "O":
        return (True, "output channels strided in the kernel") if outputs >= 2 * lanes else None
    spatial = [int(kernel[k]) for k, c in enumerate(klay) if c not in "OI"]
    rows = sz.static_product(out[:-1])
    inputs = int(kernel[klay.index("I")])
    vectors = outputs % NARROWEST_VECTOR == 0 and outputs >= 2 * NARROWEST_VECTOR
    if not (vectors and all(k % 2 for k in spatial) and rows is not None and rows >= min_rows):
        return None
    if all(s == 1 for s in at["strides"]) or inputs >= lanes:
        return False, "output channels in vectors along the kernel's rows and the result"
    width = out[max(k for k, c in enumerate(at["layout"]) if c not in "NC")]  # (a register block's rows)
    if sz.is_static(width) and cpu_rewrites.block_fit(int(width), outputs, lanes) >= FITTING_BLOCKS:
        return False, "a strided image's rows in register blocks that fit"
    return None


def _channels_last_weight_gradient(L, n: Node, min_channels: int = 64) -> tuple[bool, str] | None:
    """The model's choice for a channels-last weight gradient (the images
    and positions reduced: gemm_form "cfirst" with the images last, CHWN by
    IHWO), or None where only a timing tells. With min_channels or more
    input and output channels the library, untimed: generated code lost at
    every such shape measured, on 512-bit and AVX2 hosts alike, and won
    only below (bench/NOTES.md: the channels-last convolutions' choices,
    DenseNet121's Keras training step), while a timing compiles the
    contraction both ways at each shape, and a DenseNet's growing
    concatenations make each layer's weight gradient another shape."""
    ins = L.shape(n.inputs[0])[n.attrs["layout"].index("N")]
    outs = L.shape(n.inputs[1])[n.attrs["kernel_layout"].index("O")]
    if sz.is_static(ins) and sz.is_static(outs) and min(int(ins), int(outs)) >= min_channels:
        return True, f"a weight gradient of {ins} -> {outs} channels"
    return None


class CpuTarget(Target):
    """The host: kernels shared by structure, compiled by LLVM on a thread
    of its own into object code, loaded into an MCJIT engine, run by the
    thread team (codegen.program, runtime.CompiledProgram)."""

    name = "cpu"
    executable = CompiledProgram
    fuses_epilogues = True
    clusters_first = True
    sums_sums_apart = True
    gathers_preparation = True  # (on one thread: a GPU thread alone would take longer than the kernels it saves)
    column_convolutions = True
    library = "BLAS"
    times_library = True

    def graph_passes(self, graph: Graph, options: CompileOptions) -> Graph:
        """Products over runs of dims as products of matrices where products
        are timed against the library (vectors narrower than 512 bits; not
        under contractions "generated"): the library's form takes them, and
        it ran each of jax_block's dense layers faster than generated code
        (bench/NOTES.md); on wider vectors, those of symbolic sizes, which
        the library takes (a weight's gradient over a symbolic batch and
        sequence ran as a nest over both, 40 times slower). Stencils of
        channels-last images computed channels last (polyjit.channels_last).
        Then weights packed and column strips."""
        graph = stencils_channels_last(super().graph_passes(graph, options))
        if options.contractions != "generated":
            wide = self.vector_bits() >= 512
            graph = matrix_products(graph, lambda n: wide and all(
                sz.is_static(s) for x in n.inputs for s in x.shape))
        return column_strips(packed_operands(cascaded_sums(graph)), options.num_threads)

    def schedule_rewrites(self, sched: isl.Schedule, prog: AffineProgram, validity, tile_sizes) -> isl.Schedule:
        """Register blocks and cache tiles, threads balanced, inner loops sunk, the parallel loop marked."""
        return cpu_rewrites.rewrite(sched, prog, validity, tile_sizes, self.vector_bits())

    def private_buffers(self, prog: AffineProgram, ast: isl.AstNode, contracted: dict, fused: bool) -> dict | None:
        """All of them; None where the fusion left a long kernel on one thread
        (fusion.serialized) or branches on outer loops in an innermost loop
        (fusion.guarded_inner_loop)."""
        return None if fused and (serialized(ast, prog) or guarded_inner_loop(ast)) else contracted

    def vector_bits(self) -> int:
        """The width register blocks are sized for: the host's vectors."""
        return vector_bits()

    def machine(self, options: CompileOptions) -> str:
        return host_key()

    def build(self, graph: Graph, prog: AffineProgram, options: CompileOptions, name: str, timer,
              machine: str) -> CompiledProgram:
        """Kernels of one structure share code (codegen.program), compiled once per process."""
        # each group's kernels are emitted, and go to LLVM, once it is scheduled
        codes = CodeSet(machine, timer, self.variant(options))
        with timer("schedule"):
            sched = schedule_program(prog, options.fusion, options.tile_sizes, self, timer, each=codes.of,
                                     remote=codes)
        code = build_program(prog, sched, name, codes)
        with timer("llvm"):
            loaded = LoadedProgram([c.obj for c in code.codes] + [host_object(code.entries)])
        ir = {"mapping": code.mapping, "llvm": "\n".join([code.entries] + [c.ir for c in code.codes]),
              "llvm_opt": "\n".join(c.optimized for c in code.codes)}
        exe = executable(self.executable, graph, prog, sched, loaded.bind(code.kernels), code.buffers,
                         code.int_slots, options, name, loaded, ir, {})
        exe.stats["kernels_compiled"] = code.compiled
        return exe

    def known_choice(self, L, n: Node) -> tuple[bool, str] | None:
        """On a host with 512-bit vectors: a float32 product in whole register
        blocks (_whole_blocks) and a channels-first convolution along its
        positions (polyjit.columns) run generated, faster than sgemm over
        im2col at every ResNet-18 shape measured (bench/NOTES.md), the
        columns' copy included; those shapes had odd kernels. An even one (a
        phase of a strided convolution's input gradient) is timed: a 2x2
        phase of a padded 14x14 gradient ran at 20x the library's time.
        Channels-last convolutions: _channels_last (on an AVX2 host, 1x1
        kernels and an image's few channels only: the timings agreed at
        every such shape of MobileNetV2, while a Keras CNN's 3x3 kernel of
        32 channels, generated, took twice sgemm's time);
        their weight gradients (images and positions, the reduction, strided
        in both operands): the library from 64 channels, else timed
        (_channels_last_weight_gradient). On any host, a product whose weight
        it would read across rows calls the library (_read_across), below
        the size where products are not timed too. With 256-bit vectors, an
        unbatched product large on every side calls it (_large_product), and
        so do a classifier head of more rows than a register block holds
        (_head_in_blocks) and a 1x1 convolution of NCHW images whose rows
        fill no vector (_scalar_rows)."""
        if n.op == "dot_general" and _read_across(n):
            return True, "its weight read across rows: too few rows to pack it"
        lanes = self.vector_bits() // 32
        library = (_large_product(L, n) or _head_in_blocks(L, n, lanes)) if lanes < 16 else ""
        if library:
            return True, library
        form = None if n.op == "dot_general" else gemm_form(L, n)
        if form == "cfirst" and n.attrs["layout"][-1] == "N":
            return _channels_last_weight_gradient(L, n)
        if form == "nchw" and lanes < 16:
            scalar = _scalar_rows(L, n, lanes)
            if scalar:
                return True, scalar
        if form == "nhwc":
            return _channels_last(L, n, lanes) if lanes >= 16 or _pointwise(L, n) or _image_channels(L, n, lanes) \
                else None
        if lanes < 16:
            return None
        if n.op == "dot_general":
            why = _whole_blocks(L, n, lanes)
            return (False, why) if why else None
        if columns_form(L, n) is None:
            return None
        kernel, klay = L.shape(n.inputs[1]), n.attrs["kernel_layout"]
        if form != "cfirst" and not all(int(kernel[k]) % 2 for k, c in enumerate(klay) if c not in "OI"):
            return None
        return False, "a product along its positions, 512-bit register blocks"

    def library_available(self) -> bool:
        return blas() is not None

    def foreign_code(self, machine_key: str) -> str | None:
        """Machine code runs on a host of the same triple with every feature
        it was made for (another CPU of those features too)."""
        triple, cpu, features = machine_key.split("|", 2)
        here_triple, here_cpu, here = host_key().split("|", 2)
        if triple != here_triple:
            return f"it was compiled for {triple}, and this host is {here_triple}"
        missing = sorted(set(f for f in features.split(",") if f.startswith("+")) - set(here.split(",")))
        if missing:
            return (f"it was compiled for a {cpu} CPU, and this host's {here_cpu} lacks "
                    f"{', '.join(f[1:] for f in missing)}")
        return None

    def objects(self, exe: CompiledProgram) -> list[bytes]:
        return exe.keepalive.objects

    def load(self, constants: list, options: CompileOptions, name: str, plan: dict,
             objects: list[bytes]) -> CompiledProgram | None:
        if plan["stats"].get("library_calls") and not self.library_available():
            return None  # made where a BLAS was: compiled again here
        loaded = LoadedProgram(objects)
        kernels = loaded.bind([KernelInfo(n, par, tuple(st)) for n, par, st in plan["kernels"]])
        return from_plan(self.executable, constants, options, name, plan, kernels, loaded, {})
