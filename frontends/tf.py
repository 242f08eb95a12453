"""TensorFlow frontend: ``jit_tf`` from ``tf.function`` graphs.

The function is traced with ``tf.function`` (for its ``input_signature``, or
per input shapes and dtypes without one); the ops of the concrete graph map
onto core ops through :data:`TF_OPS`, the one table. ``Const`` ops, and
shape arithmetic (:data:`_FOLDS`), are compile-time values: a shape with
symbolic sizes, known element by element, is a reshape's shape over those
sizes; captured tensors become constants and variables
(``ReadVariableOp``) runtime inputs read at each call. An op outside the
table runs in TensorFlow between compiled segments: counted, warned once,
refused under ``strict``. A ``None`` dimension in the signature is a
symbolic size. Tensors cross through DLPack, without copies.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from polyjit import ops, saved
from polyjit import sizes as sz
from polyjit.compiler import compiled, expect_compile
from polyjit.dtypes import DataType
from polyjit.errors import CompileOptionError, DefinitionError, InputError, SavedExecutableError, UnsupportedOpError
from polyjit.interop import tf_from_host
from polyjit.saved import structure
from polyjit.options import CompileOptions, parse_options

from .common import (USER_ERRORS, Const, KnownSizes, Op, SegmentedProgram, Stats, Value, check_execution_backend,
                     core_dtype, elementwise, function_text, identity, internal_failure, live, operand_values,
                     static_value, trace_text)

log = logging.getLogger("polyjit.tf")

# ====================================================================== table
def _static(x: ops.Tensor, what: str) -> np.ndarray:
    try:
        return static_value(x)
    except UnsupportedOpError:
        raise UnsupportedOpError(f"{what} computed at run time") from None


def _sizes(x, what: str) -> list:
    """An operand that is a shape, as sizes: known element by element (a
    tuple, symbolic sizes among them: see :data:`_FOLDS`) or the numbers of
    a compile-time tensor."""
    return list(x) if isinstance(x, tuple) else [int(s) for s in _static(x, what)]


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _axes(x: ops.Tensor, rank: int) -> list[int]:
    return sorted({int(a) % max(rank, 1) for a in np.atleast_1d(_static(x, "axes"))})


def _float_div(o, a, b):
    if not a.dtype.is_float:
        raise UnsupportedOpError("integer division")
    return a / b


def _floor_div(o, a, b):
    """TensorFlow's FloorDiv: floor(a / b) for floats (infinite where the
    quotient is, where Python's and the core op's divmod give NaN)."""
    return ops.floor(a / b) if a.dtype.is_float else ops.floor_divide(a, b)


_POW_AS = {0.5: ops.sqrt, -0.5: ops.rsqrt}  # grappler's rewrites that differ from pow at -0 and -inf


def _pow(o, a, b):
    """Pow as a tf.function runs it: grappler makes pow(x, 0.5) sqrt(x) and
    pow(x, -0.5) rsqrt(x) (NaN at -inf and a signed result at -0, where pow
    is +inf or +0 there), for a constant exponent that leaves x's shape."""
    rewrite = None
    if a.dtype.is_float and b.ndim <= a.ndim and all(d == 1 for d in b.shape):
        try:
            exponent = np.unique(static_value(b))
        except UnsupportedOpError:  # (computed at run time)
            exponent = ()
        rewrite = _POW_AS.get(float(exponent[0])) if len(exponent) == 1 else None
    return ops.pow(a, b) if rewrite is None else rewrite(a)


def _elu(x, scale=1.0, alpha=1.0):
    neg = ops.expm1(x)
    if alpha != 1.0:
        neg = neg * alpha
    y = ops.where(x > 0, x, neg)
    return y if scale == 1.0 else y * scale


def _channel_axis(o, rank: int) -> int:
    fmt = _text(o.get_attr("data_format"))
    return 1 if fmt.startswith("NC") else rank - 1


def _select(o, c, a, b):
    if o.type == "Select" and c.ndim == 1 and a.ndim > 1:  # selects rows
        c = ops.broadcast_in_dim(c, [c.shape[0]] + list(a.shape[1:]), [0])
    return ops.where(c, a, b)


def _reshape(o, x, shape):
    try:
        return ops.reshape(x, _sizes(shape, "reshape's shape"))
    except DefinitionError as e:
        raise UnsupportedOpError(str(e)) from None


def _band_part(o, x, lower, upper):
    """tf.linalg.band_part: x where row - column <= lower and column - row <=
    upper (a negative bound keeps that whole triangle; Keras's causal mask)."""
    lower, upper = (int(_static(n, "band_part bounds")) for n in (lower, upper))
    rows, cols = ops.iota(x.shape, x.ndim - 2, like=x), ops.iota(x.shape, x.ndim - 1, like=x)
    keep = None
    for bound, far in ((lower, rows - cols), (upper, cols - rows)):
        if bound >= 0:
            inside = far <= bound
            keep = inside if keep is None else ops.logical_and(keep, inside)
    return x if keep is None else ops.where(keep, x, ops.zeros_like(x))


def _slice_op(o, x, begin, size):
    begin = [int(b) for b in _static(begin, "slice begin")]
    size = [int(s) for s in _static(size, "slice size")]
    end = [x.shape[d] if s == -1 else b + s for d, (b, s) in enumerate(zip(begin, size))]
    return ops.slice(x, begin, end)


def _slice_geometry(o, shape: list, *bounds) -> tuple[list, list, list, list, list]:
    """A StridedSlice of an array of ``shape`` as (low, high, step) per dim
    of a forward walk, the dims walked backwards (negative strides), and the
    result's shape (shrunk and new axes): what the slice and its gradient
    share."""
    begin, end, strides = (list(map(int, _static(n, "strided_slice bounds"))) for n in bounds)
    masks = {k: o.get_attr(k) for k in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                                        "shrink_axis_mask")}
    lo, hi, st, flip, final = [], [], [], [], []
    d, rank = 0, len(shape)
    for i in range(len(begin)):
        bit = 1 << i
        if masks["ellipsis_mask"] & bit:
            n = rank - (len(begin) - i - 1 - sum(1 for j in range(i + 1, len(begin))
                                                  if masks["new_axis_mask"] & (1 << j))) - d
            for _ in range(n):
                lo.append(0), hi.append(shape[d]), st.append(1), final.append(shape[d])
                d += 1
            continue
        if masks["new_axis_mask"] & bit:
            final.append(1)
            continue
        size = shape[d]
        s = strides[i]
        if not isinstance(size, int):  # only the whole dim: its clamped bounds are not known here
            if s != 1 or masks["shrink_axis_mask"] & bit or not (masks["begin_mask"] & bit or begin[i] == 0) \
                    or not masks["end_mask"] & bit:
                raise UnsupportedOpError("strided_slice of part of a symbolic size")
            lo.append(0), hi.append(size), st.append(1), final.append(size)
            d += 1
            continue
        if masks["shrink_axis_mask"] & bit:
            b = begin[i] + size if begin[i] < 0 else begin[i]
            lo.append(b), hi.append(b + 1), st.append(1)
        else:
            b, e = begin[i], end[i]
            if s > 0:
                b = 0 if masks["begin_mask"] & bit else min(max(b + size if b < 0 else b, 0), size)
                e = size if masks["end_mask"] & bit else min(max(e + size if e < 0 else e, 0), size)
                lo.append(b), hi.append(max(e, b)), st.append(s)
                final.append(max(0, -(-(max(e, b) - b) // s)))
            else:  # walk the reversed axis forwards
                b = size - 1 if masks["begin_mask"] & bit else min(max(b + size if b < 0 else b, -1), size - 1)
                e = -1 if masks["end_mask"] & bit else min(max(e + size if e < 0 else e, -1), size - 1)
                rb, re = size - 1 - b, size - 1 - e
                lo.append(rb), hi.append(max(re, rb)), st.append(-s)
                flip.append(d)
                final.append(max(0, -(-(max(re, rb) - rb) // -s)))
        d += 1
    while d < rank:
        lo.append(0), hi.append(shape[d]), st.append(1), final.append(shape[d])
        d += 1
    return lo, hi, st, flip, final


def _strided_slice(o, x, *bounds):
    lo, hi, st, flip, final = _slice_geometry(o, list(x.shape), *bounds)
    y = ops.reverse(x, flip) if flip else x
    return ops.reshape(ops.slice(y, lo, hi, st), final)


def _strided_slice_grad(o, shape, *bounds_and_dy):
    """StridedSliceGrad: zeros of the sliced array's shape with dy where the
    slice read (dy spread by the steps, padded to the edges)."""
    *bounds, dy = bounds_and_dy
    shape = _sizes(shape, "strided_slice_grad shape")
    lo, hi, st, flip, _ = _slice_geometry(o, shape, *bounds)
    taken = [-(-(h - lo_) // s) for lo_, h, s in zip(lo, hi, st)]
    g = ops.dilate(ops.reshape(dy, taken), st) if any(s > 1 for s in st) else ops.reshape(dy, taken)
    g = ops.pad_edges(g, lo, [n - lo_ - int(m) for n, lo_, m in zip(shape, lo, g.shape)])
    return ops.reverse(g, flip) if flip else g


def _pad(o, x, paddings, value=None):
    pads = _static(paddings, "paddings").astype(int)
    value = _static(value, "pad value").item() if value is not None else 0
    return ops.pad_edges(x, [int(p[0]) for p in pads], [int(p[1]) for p in pads], value)


def _concat(o, *xs):
    return ops.cat(xs[:-1], int(_static(xs[-1], "axis")) % xs[0].ndim)


def _pack(o, *xs):
    axis = o.get_attr("axis") % (xs[0].ndim + 1)
    return ops.cat([ops.unsqueeze(x, axis) for x in xs], axis)


def _unpack(o, x):
    axis = o.get_attr("axis") % x.ndim
    return [ops.squeeze(p, [axis]) for p in ops.split(x, [1] * x.shape[axis], axis)]


def _split_v(o, x, sizes, axis):
    axis = int(_static(axis, "axis")) % x.ndim
    sizes = [int(s) for s in _static(sizes, "split sizes")]
    if -1 in sizes:
        sizes[sizes.index(-1)] = x.shape[axis] - sum(s for s in sizes if s != -1)
    return ops.split(x, sizes, axis)


def _reduce(reduce):
    return lambda o, x, axes: reduce(x, _axes(axes, x.ndim), o.get_attr("keep_dims"))


def _mean(o, x, axes):
    if not x.dtype.is_float:
        raise UnsupportedOpError("integer mean")
    return ops.mean(x, _axes(axes, x.ndim), o.get_attr("keep_dims"))


def _cumulative(op: str):
    def rule(o, x, axis):
        return ops.cumulative(op, x, int(_static(axis, "cumulative axis")), bool(o.get_attr("reverse")),
                              bool(o.get_attr("exclusive")))
    return rule


def _gather(o, x, index, axis):
    if o.get_attr("batch_dims"):
        raise UnsupportedOpError("GatherV2 with batch_dims")
    return ops.take(x, index, int(_static(axis, "gather axis")) % x.ndim)


def _gather_nd(o, params, idx):
    """GatherNd: the index vectors name positions in params' leading dims,
    taken as one row-major position over those dims flattened; an index out
    of range gives zeros, as on a GPU (the CPU kernel raises)."""
    if not isinstance(idx.shape[-1], int) or not all(isinstance(n, int) for n in params.shape[:idx.shape[-1]]):
        raise UnsupportedOpError("GatherNd over symbolic sizes")
    k = idx.shape[-1]
    lead, batch = params.shape[:k], list(idx.shape[:-1])
    flat = valid = None
    for d in range(k):
        i = ops.cast(ops.reshape(ops.slice(idx, [0] * (idx.ndim - 1) + [d], batch + [d + 1]), batch), DataType.Int)
        n = ops.full([], int(lead[d]), DataType.Int, like=idx)
        ok = (i >= ops.full([], 0, DataType.Int, like=idx)) & (i < n)
        valid = ok if valid is None else valid & ok
        flat = i if flat is None else flat * n + i
    rest = list(params.shape[k:])
    out = ops.take(ops.reshape(params, [math.prod(int(n) for n in lead)] + rest), flat, 0)
    return ops.where(ops.broadcast_in_dim(valid, batch + rest, list(range(len(batch)))), out, 0)


def _top_k(o, x, k):
    n = o.outputs[0].shape[-1]  # as TensorFlow inferred it (tf.sort computes k from a shape)
    values, at = ops.topk(x, n if n is not None else int(_static(k, "TopKV2's k")), -1)
    return [values, ops.cast(at, core_dtype(o.outputs[1].dtype))]


def _resize_bilinear(o, x, size):
    """ResizeBilinear (NHWC, float32 result) with TensorFlow's sample
    positions (align_corners, half_pixel_centers): the two source rows and
    columns of each output cell and their weights are compile-time
    constants; gathers along H and W, then the blend."""
    out = [int(v) for v in _static(size, "ResizeBilinear's size")]
    if not all(isinstance(n, int) for n in x.shape[1:3]):
        raise UnsupportedOpError("ResizeBilinear over symbolic image sizes")
    align, half = o.get_attr("align_corners"), o.get_attr("half_pixel_centers")
    x = ops.cast(x, DataType.Float)

    def samples(n_in: int, n_out: int):
        scale = (n_in - 1) / (n_out - 1) if align and n_out > 1 else n_in / n_out
        pos = np.arange(n_out, dtype=np.float64)
        at = (pos + 0.5) * scale - 0.5 if half else pos * scale
        lo = np.maximum(np.floor(at), 0).astype(np.int64)
        hi = np.minimum(np.ceil(at) if half else lo + 1, n_in - 1).astype(np.int64)
        return lo, hi, (at - np.floor(at)).astype(np.float32)
    blend = []
    for axis, (n_in, n_out) in enumerate(zip(x.shape[1:3], out), 1):
        lo, hi, w = samples(n_in, n_out)
        shape = [1, 1, 1, 1]
        shape[axis] = n_out
        blend.append((axis, lo, hi, w.reshape(shape)))  # arrays: constants of the graph, each one node

    def lerp(a, b, w):
        return a + (b - a) * w
    (ay, y0, y1, wy), (ax, x0, x1, wx) = blend
    top, bottom = ops.take(x, y0, ay), ops.take(x, y1, ay)
    top = lerp(ops.take(top, x0, ax), ops.take(top, x1, ax), wx)
    bottom = lerp(ops.take(bottom, x0, ax), ops.take(bottom, x1, ax), wx)
    return lerp(top, bottom, wy)


def _one_hot(o, index, depth, on, off):
    depth = int(_static(depth, "one_hot depth"))
    axis = o.get_attr("axis") % (index.ndim + 1)
    shape = list(index.shape[:axis]) + [depth] + list(index.shape[axis:])
    spread = ops.broadcast_in_dim(index, shape, [d for d in range(len(shape)) if d != axis])
    hit = ops.iota(shape, axis, index.dtype, like=index) == spread
    return ops.where(hit, ops.broadcast_in_dim(on, shape, []), ops.broadcast_in_dim(off, shape, []))


def _argreduce(argreduce):
    return lambda o, x, axis: argreduce(x, int(_static(axis, "axis")))


def _matmul(o, a, b):
    ta, tb = o.get_attr("transpose_a"), o.get_attr("transpose_b")
    return ops.dot_general(a, b, ([0 if ta else 1], [1 if tb else 0]))


def _batch_matmul(o, a, b):
    adj_x, adj_y = o.get_attr("adj_x"), o.get_attr("adj_y")
    batch = list(ops.broadcast_shapes(a, a.shape[:-2], b.shape[:-2]))
    a = ops.broadcast_to(a, batch + list(a.shape[-2:])) if list(a.shape[:-2]) != batch else a
    b = ops.broadcast_to(b, batch + list(b.shape[-2:])) if list(b.shape[:-2]) != batch else b
    r = len(batch)
    bd = list(range(r))
    return ops.dot_general(a, b, ([r if adj_x else r + 1], [r + 1 if adj_y else r]), (bd, bd))


def _same_padding(sizes, ksizes, strides, dilations):
    pads = []
    for n, k, s, dl in zip(sizes, ksizes, strides, dilations):
        if not isinstance(n, int):
            raise UnsupportedOpError("SAME padding over a symbolic size")
        out = -(-n // s)
        total = max((out - 1) * s + (k - 1) * dl + 1 - n, 0)
        pads.append((total // 2, total - total // 2))
    return pads


def _window(o, shape, ksizes):
    """Layout letters, spatial dims, strides, dilations and padding of a conv
    or pool op over an input of this shape."""
    rank = len(shape)
    nchw = _channel_axis(o, rank) == 1
    sp = list(range(2, rank)) if nchw else list(range(1, rank - 1))
    strides = [o.get_attr("strides")[d] for d in sp]
    dil = [o.get_attr("dilations")[d] for d in sp] if "dilations" in o.node_def.attr else [1] * len(sp)
    padding = _text(o.get_attr("padding"))
    if padding == "SAME":
        pads = _same_padding([shape[d] for d in sp], ksizes, strides, dil)
    elif padding == "VALID":
        pads = [(0, 0)] * len(sp)
    elif padding == "EXPLICIT":
        e = o.get_attr("explicit_paddings")
        pads = [(e[2 * d], e[2 * d + 1]) for d in sp]
    else:
        raise UnsupportedOpError(f"padding {padding}")
    return ("NCHW" if nchw else "NHWC"), sp, strides, dil, pads


def _conv2d(o, x, w):
    """Groups where the kernel takes fewer input channels than x has (TF's
    grouped Conv2D, Keras's ``Conv2D(groups=...)``)."""
    layout, _, strides, dil, pads = _window(o, x.shape, [w.shape[0], w.shape[1]])
    channels = x.shape[_channel_axis(o, x.ndim)]
    groups = channels // w.shape[2] if isinstance(channels, int) and isinstance(w.shape[2], int) else 1
    return ops.conv(x, w, strides, pads, dil, groups, layout, "HWIO")


def _depthwise_kernel(w):
    """A depthwise filter (H, W, C, M) as the grouped kernel (H, W, 1, C * M) of C groups."""
    return ops.reshape(w, [w.shape[0], w.shape[1], 1, w.shape[2] * w.shape[3]]), int(w.shape[2])


def _conv2d_backprop_input(o, sizes, w, dy, depthwise: bool = False):
    """A transposed convolution (conv2d_transpose, Keras' Conv2DTranspose):
    the output gradient spread with zeros by the strides, padded so that the
    result has input_sizes, convolved with the flipped filter, its channel
    roles swapped. A depthwise filter read that way is a grouped kernel."""
    sizes = _sizes(sizes, "Conv2DBackpropInput's input_sizes")
    layout, sp, strides, dil, pads = _window(o, sizes, [w.shape[0], w.shape[1]])
    if any(not isinstance(sizes[d], int) or sizes[d] < 0 for d in sp):
        raise UnsupportedOpError("Conv2DBackpropInput with spatial sizes known only at run time")
    channels = sizes[_channel_axis(o, len(sizes))]
    w, groups = _depthwise_kernel(w) if depthwise else (
        w, channels // w.shape[2] if isinstance(channels, int) and isinstance(w.shape[2], int) else 1)
    return ops.conv_input_grad(dy, w, [sizes[d] for d in sp], strides, pads, dil, groups, layout, "HWIO")


def _depthwise(o, x, w):
    layout, _, strides, dil, pads = _window(o, x.shape, [w.shape[0], w.shape[1]])
    w, groups = _depthwise_kernel(w)
    return ops.conv(x, w, strides, pads, dil, groups, layout, "HWIO")


def _pool_window(o, x):
    """A pooling op's layout, spatial dims, and its window sizes, strides and padding there."""
    k = o.get_attr("ksize")
    spatial = range(2, 4) if x.ndim == 4 and _channel_axis(o, x.ndim) == 1 else range(1, 3)
    layout, sp, strides, _, pads = _window(o, x.shape, [k[d] for d in spatial])
    return layout, sp, [k[d] for d in sp], strides, pads


def _pool_dims(o, x) -> tuple[list, list, list, list]:
    """A pooling op's window, strides and padding over every dim of x (1s
    outside the spatial ones), and its spatial dims."""
    _, sp, ks, strides, pads = _pool_window(o, x)
    window, st, pd = [1] * x.ndim, [1] * x.ndim, [(0, 0)] * x.ndim
    for i, d in enumerate(sp):
        window[d], st[d], pd[d] = ks[i], strides[i], pads[i]
    return window, st, pd, sp


def _pool(op: str):
    def rule(o, x):
        window, st, pd, _ = _pool_dims(o, x)
        y = ops.reduce_window("max" if op == "max" else "sum", x, window, st, pd)
        if op == "max":
            return y
        return y / ops.window_cells(x, window, st, pd)  # TF averages over the cells inside
    return rule


def _space_to_batch(o, x, block, paddings):
    """SpaceToBatchND (how TensorFlow runs a dilated convolution): the
    spatial dims padded, each split into (size / block, block), the block
    offsets moved in front of the batch."""
    block = [int(b) for b in np.ravel(_static(block, "SpaceToBatchND's block_shape"))]
    pads = np.asarray(_static(paddings, "SpaceToBatchND's paddings")).reshape(-1, 2).tolist()
    m, rest = len(block), list(x.shape[1 + len(block):])
    x = ops.pad(x, [w for lo, hi in reversed(list(pads) + [[0, 0]] * len(rest)) for w in (lo, hi)])
    split = [x.shape[0]] + [v for d in range(m) for v in (x.shape[1 + d] // block[d], block[d])] + rest
    x = ops.reshape(x, split)
    perm = [2 + 2 * d for d in range(m)] + [0] + [1 + 2 * d for d in range(m)] + list(range(1 + 2 * m, len(split)))
    x = ops.permute(x, perm)
    return ops.reshape(x, [math.prod(block) * split[0]] + [split[1 + 2 * d] for d in range(m)] + rest)


def _batch_to_space(o, x, block, crops):
    """BatchToSpaceND, SpaceToBatchND's inverse: the block offsets taken
    from the batch back into the spatial dims, which are then cropped."""
    block = [int(b) for b in np.ravel(_static(block, "BatchToSpaceND's block_shape"))]
    crops = np.asarray(_static(crops, "BatchToSpaceND's crops")).reshape(-1, 2).tolist()
    m, rest = len(block), list(x.shape[1 + len(block):])
    batch = x.shape[0] // math.prod(block)
    x = ops.reshape(x, block + [batch] + list(x.shape[1:]))
    perm = [m] + [v for d in range(m) for v in (m + 1 + d, d)] + list(range(2 * m + 1, x.ndim))
    x = ops.permute(x, perm)
    x = ops.reshape(x, [batch] + [x.shape[1 + 2 * d] * block[d] for d in range(m)] + rest)
    start = [0] + [lo for lo, _ in crops] + [0] * len(rest)
    end = [batch] + [x.shape[1 + d] - crops[d][1] for d in range(m)] + rest
    return ops.slice(x, start, end)


def _avg_pool_grad(o, sizes, dy):
    """AvgPoolGrad: each window's gradient, divided by the cells the forward
    averaged (those inside the image), spread back over the window."""
    shape = _sizes(sizes, "AvgPoolGrad's orig_input_shape")
    x = ops.full(shape, 1.0, dy.dtype, like=dy)
    window, st, pd, sp = _pool_dims(o, x)
    g = dy / ops.window_cells(x, window, st, pd)
    first = sp[0]  # (the adjoint's window covers the trailing dims: channels last ride along with 1s)
    return ops.window_sum_adjoint(g, shape, window[first:], st[first:], pd[first:])


def _max_pool_grad(o, x, _, dy):
    """MaxPoolGrad: each window's gradient added at its first maximum in the
    original input (padding never wins), through the channels-first pooling
    composites."""
    layout, _, ks, strides, pads = _pool_window(o, x)
    to_first = [0, x.ndim - 1] + list(range(1, x.ndim - 1)) if layout == "NHWC" else list(range(x.ndim))
    xt = ops.permute(x, to_first)
    _, at = ops.max_pool_with_positions(xt, ks, strides, pads)  # (SAME pads the high side more where uneven)
    dx = ops.max_pool_grad(ops.permute(dy, to_first), at, list(xt.shape), ks, strides, pads)
    return ops.permute(dx, [to_first.index(d) for d in range(x.ndim)])


def _conv2d_backprop_filter(o, x, sizes, dy):
    """The kernel's gradient of a Conv2D (HWIO), through the core's conv_weight_grad."""
    sizes = [int(v) for v in _static(sizes, "Conv2DBackpropFilter's filter_sizes")]
    layout, _, strides, dil, pads = _window(o, x.shape, sizes[:2])
    channels = x.shape[_channel_axis(o, x.ndim)]
    groups = channels // sizes[2] if isinstance(channels, int) else 1  # (a grouped Conv2D's)
    return ops.conv_weight_grad(x, dy, sizes[:2], strides, pads, dil, layout, "HWIO", groups=groups)


def _depthwise_backprop_filter(o, x, sizes, dy):
    """A depthwise filter's gradient: the grouped kernel's (C groups), shaped back to (H, W, C, M)."""
    sizes = [int(v) for v in _static(sizes, "DepthwiseConv2dNativeBackpropFilter's filter_sizes")]
    layout, _, strides, dil, pads = _window(o, x.shape, sizes[:2])
    return ops.reshape(ops.conv_weight_grad(x, dy, sizes[:2], strides, pads, dil, layout, "HWIO", groups=sizes[2]),
                       sizes)


def _bias_add_grad(o, dy):
    axis = _channel_axis(o, dy.ndim)
    return ops.sum(dy, [d for d in range(dy.ndim) if d != axis])


def _softmax_cross_entropy(sparse: bool):
    """(Sparse)SoftmaxCrossEntropyWithLogits: per row, the loss and its
    gradient softmax(x) - labels (one-hot labels when sparse; a label out
    of range gives NaN, as on a GPU)."""
    def rule(o, x, labels):
        ax = x.ndim - 1
        logp = ops.log_softmax(x, ax)
        if sparse:
            lab = ops.cast(labels, DataType.Int)
            labels = ops.cast(ops.iota(x.shape, ax, like=x) == ops.broadcast_in_dim(lab, x.shape, list(range(ax))),
                              x.dtype)
            zero, n = ops.full([], 0, DataType.Int, like=x), ops.full([], x.shape[ax], DataType.Int, like=x)
            bad = (lab < zero) | (lab >= n)
        loss = -ops.sum(labels * logp, [ax])
        grad = ops.exp(logp) - labels
        if sparse:
            loss = ops.where(bad, math.nan, loss)
            grad = ops.where(ops.broadcast_in_dim(bad, x.shape, list(range(ax))), math.nan, grad)
        return [loss, grad]
    return rule


def _fused_batch_norm(o, x, scale, offset, mean, var):
    if o.get_attr("is_training"):
        raise UnsupportedOpError("FusedBatchNorm in training mode")
    axis = _channel_axis(o, x.ndim)
    dt = DataType.Float if x.dtype in (DataType.Half, DataType.BFloat16) else x.dtype
    inv = ops.rsqrt(ops.cast(var, dt) + ops.full([], o.get_attr("epsilon"), dt, like=x)) * ops.cast(scale, dt)
    shift = ops.cast(offset, dt) - ops.cast(mean, dt) * inv
    y = ops.cast(x, dt) * ops.broadcast_in_dim(inv, x.shape, [axis]) + ops.broadcast_in_dim(shift, x.shape, [axis])
    rest = [mean, var] + [ops.full(_shape(t) or [], 0, DataType.Float, like=x)  # reserve spaces
                          for t in o.outputs[3:]]
    return [y] + rest


# TensorFlow's stateless random numbers (Keras's dropout and noise layers):
# Philox-4x32-10 bits, bit for bit as TensorFlow draws them
_SEED_KEY = 0x02461E29_3EC8F720  # GenerateKey's fixed key (words 0x3ec8f720, 0x02461e29)
_PHILOX_ALGS = (1, 3)  # Philox, and auto-select (Philox on CPUs and GPUs)


def _key_counter(o, seed):
    """StatelessRandomGetKeyCounter: the seed's two numbers, widened to 64
    bits as C++ converts them (an int32 sign-extends), are a counter that
    Philox mixes once under a fixed key: the mix's first two words make
    the key, its last two the counter's high half."""
    mix = ops.philox_bits(ops.full([1], _SEED_KEY, DataType.UInt64, like=seed), ops.cast(seed, DataType.UInt64), [4])
    pair = lambda k: _u64(ops.slice(mix, [k], [k + 1]), ops.slice(mix, [k + 1], [k + 2]))  # noqa: E731
    return [pair(0), ops.cat([ops.full([1], 0, DataType.UInt64, like=seed), pair(2)], 0)]


def _u64(lo, hi):
    """The 64-bit numbers of two tensors of 32-bit words (TensorFlow's
    order: the lower word first)."""
    return ops.bitwise_or(ops.cast(lo, DataType.UInt64), ops.shift_left(ops.cast(hi, DataType.UInt64), 32))


def _philox_words(o, sizes: list, key, counter, alg, per_element: int = 1) -> list:
    """The bits of a stateless random op: ``per_element`` consecutive words
    for each element (a 64-bit number takes two), as a list of tensors of
    the op's shape, one per word."""
    algorithm = int(_static(alg, "the RNG algorithm"))
    if algorithm not in _PHILOX_ALGS:
        raise UnsupportedOpError(f"{o.type} with RNG algorithm {algorithm} (polyjit draws Philox's)")
    if per_element == 1:
        return [ops.philox_bits(key, counter, sizes)]
    bits, n = ops.philox_bits(key, counter, sizes + [per_element]), len(sizes)
    return [ops.squeeze(ops.slice(bits, [0] * n + [k], sizes + [k + 1]), [n]) for k in range(per_element)]


_MANTISSA = {DataType.Float: 23, DataType.Half: 10, DataType.BFloat16: 7}


def _unit(bits, dt: DataType):
    """TensorFlow's float in [0, 1) of 32 random bits: 1.f - 1 for a
    fraction f of the type's mantissa width of low bits, which is exactly
    those bits times 2**-width."""
    m = _MANTISSA[dt]
    return ops.cast(ops.cast(ops.bitwise_and(bits, (1 << m) - 1), DataType.Float) * 2.0 ** -m, dt)


def _uniform(o, shape, key, counter, alg):
    dt = core_dtype(o.get_attr("dtype"))
    if dt is DataType.Double:  # 52 mantissa bits: 20 of the first word above the second's 32
        hi, lo = _philox_words(o, _sizes(shape, "shape"), key, counter, alg, 2)
        return (ops.cast(ops.bitwise_and(hi, 0xFFFFF), DataType.Double) * 2.0 ** -20
                + ops.cast(lo, DataType.Double) * 2.0 ** -52)
    return _unit(_philox_words(o, _sizes(shape, "shape"), key, counter, alg)[0], dt)


def _normal(o, shape, key, counter, alg):
    """StatelessRandomNormalV2: Box-Muller on consecutive pairs of the
    elements' words (TensorFlow's BoxMullerFloat), the sine for the first
    of a pair and the cosine for the second."""
    dt = core_dtype(o.get_attr("dtype"))
    sizes = _sizes(shape, "shape")
    if dt not in _MANTISSA or not all(isinstance(s, (int, np.integer)) for s in sizes):
        raise UnsupportedOpError(f"{o.type} of {dt} or of sizes known only at run time")
    n = math.prod(sizes)
    pairs = -(-n // 2)
    words = _philox_words(o, [pairs], key, counter, alg, 2)
    u1 = ops.maximum(_unit(words[0], DataType.Float), 1e-7)
    v1 = ops.cast(ops.cast(_unit(words[1], DataType.Float), DataType.Double) * (2 * math.pi), DataType.Float)
    u2 = ops.sqrt(ops.log(u1) * -2.0)
    both = ops.cat([ops.unsqueeze(ops.sin(v1) * u2, 1), ops.unsqueeze(ops.cos(v1) * u2, 1)], 1)
    return ops.cast(ops.reshape(ops.slice(ops.reshape(both, [2 * pairs]), [0], [n]), sizes), dt)


def _full_int(o, shape, key, counter, alg):
    """StatelessRandomUniformFullIntV2: the bits themselves (two words of a 64-bit number, the lower first)."""
    dt = core_dtype(o.get_attr("dtype"))
    if dt.itemsize == 4:
        return ops.cast(_philox_words(o, _sizes(shape, "shape"), key, counter, alg)[0], dt)
    return ops.cast(_u64(*_philox_words(o, _sizes(shape, "shape"), key, counter, alg, 2)), dt)


def _seeded(rule):
    """A first-generation stateless op (shape, seed): the key and counter of its seed, then its V2 form."""
    return lambda o, shape, seed: rule(o, shape, *_key_counter(o, seed), ops.full([], 1, DataType.Int32, like=seed))


def _add_n(o, *xs):
    acc = xs[0]
    for x in xs[1:]:
        acc = acc + x
    return acc


TF_OPS: dict[str, Callable] = {
    **{name: elementwise(op) for name, op in [
        ("Neg", "neg"), ("Abs", "abs"), ("Exp", "exp"), ("Log", "log"), ("Log1p", "log1p"),
        ("Expm1", "expm1"), ("Sqrt", "sqrt"), ("Rsqrt", "rsqrt"), ("Sin", "sin"), ("Cos", "cos"),
        ("Tan", "tan"), ("Tanh", "tanh"), ("Sigmoid", "sigmoid"), ("Erf", "erf"), ("Floor", "floor"),
        ("Ceil", "ceil"), ("Round", "round"), ("Sign", "sign"), ("IsNan", "isnan"), ("IsInf", "isinf"),
        ("IsFinite", "isfinite"), ("Relu", "relu"), ("LogicalNot", "logical_not"),
        ("Reciprocal", "reciprocal"), ("Inv", "reciprocal"), ("Erfc", "erfc"), ("Lgamma", "lgamma"),
        ("Digamma", "digamma"),
        ("Add", "add"), ("AddV2", "add"), ("Sub", "sub"), ("Mul", "mul"), ("Maximum", "maximum"),
        ("Minimum", "minimum"), ("Atan2", "atan2"), ("Less", "lt"), ("LessEqual", "le"),
        ("Greater", "gt"), ("GreaterEqual", "ge"), ("Equal", "eq"), ("NotEqual", "ne"),
        ("LogicalAnd", "logical_and"), ("LogicalOr", "logical_or"), ("FloorMod", "remainder"),
        ("TruncateMod", "fmod"), ("TruncateDiv", "trunc_divide")]},
    "RealDiv": _float_div, "Div": _float_div, "FloorDiv": _floor_div, "Pow": _pow,
    "DivNoNan": lambda o, x, y: ops.where(y == 0, ops.zeros_like(x / y), x / y),
    "Square": lambda o, x: x * x,
    "SquaredDifference": lambda o, a, b: (lambda d: d * d)(a - b),
    "Relu6": lambda o, x: ops.clamp(x, 0, 6),
    "Elu": lambda o, x: _elu(x),
    "Selu": lambda o, x: _elu(x, 1.0507009873554805, 1.6732632423543772),
    "Softplus": lambda o, x: ops.log1p(ops.exp(-abs(x))) + ops.maximum(x, 0),
    "LeakyRelu": lambda o, x: ops.leaky_relu(x, o.get_attr("alpha")),
    "BiasAdd": lambda o, x, b: x + ops.broadcast_in_dim(b, x.shape, [_channel_axis(o, x.ndim)]),
    "Cast": lambda o, x: ops.cast(x, core_dtype(o.get_attr("DstT"))),
    "Select": _select, "SelectV2": _select,
    "ClipByValue": lambda o, x, lo, hi: ops.clamp(x, lo, hi),
    "AddN": _add_n,
    "Identity": identity, "IdentityN": identity, "StopGradient": identity, "Snapshot": identity,
    "ReadVariableOp": identity, "PreventGradient": identity,
    # a variable's new value (the program's output, written back after the call: _Trace.write_variables)
    "AssignVariableOp": lambda o, current, x: x,
    "AssignAddVariableOp": lambda o, current, x: current + x,
    "AssignSubVariableOp": lambda o, current, x: current - x,
    # layout
    "Reshape": _reshape, "ExpandDims": lambda o, x, axis: ops.unsqueeze(x, int(_static(axis, "axis"))),
    "Squeeze": lambda o, x: ops.squeeze(x, {d % x.ndim for d in o.get_attr("squeeze_dims")}
                                        or {d for d, s in enumerate(x.shape) if s == 1}),
    "Transpose": lambda o, x, perm: ops.permute(x, [int(p) for p in _static(perm, "perm")]),
    "StridedSlice": _strided_slice, "StridedSliceGrad": _strided_slice_grad, "Slice": _slice_op, "Pad": _pad, "PadV2": _pad, "MatrixBandPart": _band_part,
    "ConcatV2": _concat, "Pack": _pack, "Unpack": _unpack, "SplitV": _split_v,
    "Split": lambda o, axis, x: ops.split(x, o.get_attr("num_split"), int(_static(axis, "axis")) % x.ndim),
    "Fill": lambda o, dims, value: ops.broadcast_to(value, _sizes(dims, "fill dims")),
    "ZerosLike": lambda o, x: ops.full_like(x, 0), "OnesLike": lambda o, x: ops.full_like(x, 1),
    "Tile": lambda o, x, reps: ops.tile(x, _sizes(reps, "multiples")),
    "BroadcastTo": lambda o, x, shape: ops.broadcast_to(x, _sizes(shape, "shape")),
    # reductions
    "Sum": _reduce(ops.sum), "Max": _reduce(ops.max), "Min": _reduce(ops.min), "Prod": _reduce(ops.prod),
    "Mean": _mean, "ArgMax": _argreduce(ops.argmax), "ArgMin": _argreduce(ops.argmin),
    "Any": _reduce(ops.reduce_any), "All": _reduce(ops.reduce_all),
    "Cumsum": _cumulative("sum"), "Cumprod": _cumulative("prod"), "CumulativeLogsumexp": _cumulative("logsumexp"),
    "GatherV2": _gather, "GatherNd": _gather_nd, "OneHot": _one_hot, "TopKV2": _top_k,
    "ResizeBilinear": _resize_bilinear,
    "ReverseV2": lambda o, x, axes: ops.reverse(x, [int(a) for a in np.atleast_1d(_static(axes, "axes"))]),
    "Softmax": lambda o, x: ops.softmax(x, x.ndim - 1),
    "LogSoftmax": lambda o, x: ops.log_softmax(x, x.ndim - 1),
    "MaxPool": _pool("max"), "AvgPool": _pool("avg"),
    "FusedBatchNormV3": _fused_batch_norm, "FusedBatchNorm": _fused_batch_norm,
    # contractions
    "MatMul": _matmul, "BatchMatMulV2": _batch_matmul, "BatchMatMulV3": _batch_matmul,
    "Einsum": lambda o, *xs: ops.einsum(_text(o.get_attr("equation")), *xs),
    "Conv2D": _conv2d, "DepthwiseConv2dNative": _depthwise, "Conv2DBackpropInput": _conv2d_backprop_input,
    # gradients (a GradientTape in a tf.function)
    "ReluGrad": lambda o, dy, x: ops.where(x > 0, dy, 0),
    "SigmoidGrad": lambda o, y, dy: dy * (y * (1 - y)),
    "TanhGrad": lambda o, y, dy: dy * (1 - y * y),
    "RsqrtGrad": lambda o, y, dy: dy * (y * y * y) * -0.5,  # (a batch norm's in training)
    "SqrtGrad": lambda o, y, dy: dy * 0.5 / y,
    "ReciprocalGrad": lambda o, y, dy: -dy * (y * y), "InvGrad": lambda o, y, dy: -dy * (y * y),
    "Relu6Grad": lambda o, dy, x: ops.where(ops.logical_and(x > 0, x < 6), dy, 0),
    "LeakyReluGrad": lambda o, dy, x: ops.where(x > 0, dy, dy * o.get_attr("alpha")),
    "EluGrad": lambda o, dy, y: ops.where(y > 0, dy, dy * (y + 1)),
    "SoftplusGrad": lambda o, dy, x: dy * ops.sigmoid(x),
    "BiasAddGrad": _bias_add_grad, "MaxPoolGrad": _max_pool_grad, "AvgPoolGrad": _avg_pool_grad,
    "SpaceToBatchND": _space_to_batch, "BatchToSpaceND": _batch_to_space, "Conv2DBackpropFilter": _conv2d_backprop_filter,
    "DepthwiseConv2dNativeBackpropInput": lambda o, *xs: _conv2d_backprop_input(o, *xs, depthwise=True),
    "DepthwiseConv2dNativeBackpropFilter": _depthwise_backprop_filter,
    # random numbers
    "StatelessRandomGetKeyCounter": _key_counter, "StatelessRandomUniformV2": _uniform,
    "StatelessRandomNormalV2": _normal, "StatelessRandomUniformFullIntV2": _full_int,
    "StatelessRandomUniform": _seeded(_uniform), "StatelessRandomNormal": _seeded(_normal),
    "SoftmaxCrossEntropyWithLogits": _softmax_cross_entropy(False),
    "SparseSoftmaxCrossEntropyWithLogits": _softmax_cross_entropy(True),
}
TF_OPS = {k: v for k, v in TF_OPS.items() if v is not None}


# ============================================================ shape arithmetic
# Rules of the table below, on numpy arrays of dtype object whose elements
# are numbers or sizes (polyjit.sizes.Lin): Python's operators on sizes
# give sums, products and quotients of sizes, and refuse the rest.
def _ints(x: np.ndarray) -> np.ndarray:
    """An operand that must hold numbers (indices, axes, bounds)."""
    return np.asarray(x.tolist(), np.int64)


def _int(x: np.ndarray) -> int:
    """An operand that must be one number (an axis)."""
    return int(_ints(x).reshape(()))


def _fold_strided_slice(o, x, begin, end, strides):
    """numpy's basic indexing, which TensorFlow's strided_slice copies."""
    index: list = []
    for i, (b, e, st) in enumerate(zip(_ints(begin), _ints(end), _ints(strides))):
        bit = 1 << i
        if o.get_attr("ellipsis_mask") & bit:
            index.append(Ellipsis)
        elif o.get_attr("new_axis_mask") & bit:
            index.append(np.newaxis)
        elif o.get_attr("shrink_axis_mask") & bit:
            index.append(int(b))
        else:
            index.append(slice(None if o.get_attr("begin_mask") & bit else int(b),
                               None if o.get_attr("end_mask") & bit else int(e), int(st)))
    return x[tuple(index)]


def _fold_gather(o, x, index, axis):
    index, axis = _ints(index), _int(axis) % x.ndim
    if o.get_attr("batch_dims") or ((index < 0) | (index >= x.shape[axis])).any():
        raise ValueError("GatherV2 with batch_dims, or out of range")
    return np.take(x, index, axis)


def _fold_reduce(reduce):
    return lambda o, x, axes: reduce(x, tuple(int(a) % max(x.ndim, 1) for a in np.atleast_1d(_ints(axes))),
                                     keepdims=o.get_attr("keep_dims"))


def _fold_concat_offset(o, axis, *shapes):
    """Where each operand of a concatenation starts in it (a concatenation's gradient slices there)."""
    a = _int(axis) % len(shapes[0])
    out, at = [], 0
    for shape in shapes:
        offset = np.zeros(len(shape), object)
        offset[a] = at
        out.append(offset)
        at = at + shape[a]
    return out


def _fold_cast(o, x):
    if not o.get_attr("SrcT").is_integer:  # (the result is an integer: the table's rules make only those)
        raise ValueError("a cast of numbers that are not integers")
    return x


def _fold_slice(o, x, begin, size):
    """tf.slice: size -1 takes the rest of the dim (a padding's gradient slices its paddings)."""
    index = tuple(slice(int(b), None if int(n) == -1 else int(b) + int(n)) for b, n in zip(_ints(begin), _ints(size)))
    return x[index]


def _fold_broadcast_gradient_args(o, s0, s1):
    """The dims a broadcast binary op's gradient sums for each operand: with
    the shapes aligned at the right, those where the operand's size is 1 (or
    missing); none where the shapes are equal, as TensorFlow's BCast."""
    a, b = list(s0.tolist()), list(s1.tolist())
    if len(a) == len(b) and all(x == y for x, y in zip(a, b)):
        return [np.zeros(0, object), np.zeros(0, object)]
    n = max(len(a), len(b))
    a, b = [1] * (n - len(a)) + a, [1] * (n - len(b)) + b
    if any(not isinstance(x, int) and not isinstance(y, int) and x != y for x, y in zip(a, b)):
        raise ValueError("a broadcast of two sizes known only at run time")
    return [np.array([i for i, x in enumerate(a) if isinstance(x, int) and x == 1], object),
            np.array([i for i, y in enumerate(b) if isinstance(y, int) and y == 1], object)]


def _numbers(o, xs: tuple) -> tuple:
    """Operands that are integers or booleans (not floats, which _ints would truncate)."""
    if not all(t.dtype.is_integer or t.dtype == tf.bool for t in o.inputs):
        raise ValueError("a comparison of numbers that are not integers")
    return xs


def _fold_squeeze(o, x):
    dims = tuple(d % x.ndim for d in o.get_attr("squeeze_dims"))
    return np.squeeze(x, dims or None)


# Integer ops folded at compile time: shape arithmetic (Keras' Flatten and
# Dense compute a reshape's shape from tf.shape of their input). TensorFlow
# folds an op whose operands are all constants; the rule folds one whose
# operands are constants and known sizes (a shape of symbolic dims: each a
# parameter standing for the dim), to a Const, or to KnownSizes that the ops
# taking a shape (_SHAPE_INPUTS) read as sizes: a reshape over symbolic
# sizes. None: only TensorFlow folds it. What no rule folds runs as its ops.
_FOLDS: dict[str, Callable | None] = {
    "Shape": lambda o, dims: dims, "ShapeN": lambda o, *dims: list(dims),
    "Size": lambda o, dims: sz.product(dims.tolist()), "Rank": lambda o, dims: len(dims),
    "StridedSlice": _fold_strided_slice, "GatherV2": _fold_gather,
    "Pack": lambda o, *xs: np.stack(xs, o.get_attr("axis")),
    "Unpack": lambda o, x: list(np.moveaxis(x, o.get_attr("axis"), 0)),
    "ConcatV2": lambda o, *xs: np.concatenate(xs[:-1], _int(xs[-1]) % xs[0].ndim),
    "Reshape": lambda o, x, shape: x.reshape(_ints(shape)),
    "ExpandDims": lambda o, x, axis: np.expand_dims(x, _int(axis) % (x.ndim + 1)),
    "Squeeze": _fold_squeeze, "Identity": lambda o, x: x,
    "Fill": lambda o, dims, value: np.full(_ints(dims), value.item(), object),
    "Prod": _fold_reduce(np.prod), "Cast": _fold_cast,
    "Mul": lambda o, a, b: a * b, "Add": lambda o, a, b: a + b, "AddV2": lambda o, a, b: a + b,
    "Sub": lambda o, a, b: a - b, "Neg": lambda o, x: -x, "FloorDiv": lambda o, a, b: a // b,
    "FloorMod": lambda o, a, b: a % b,
    "Maximum": lambda o, a, b: np.maximum(a, b), "Minimum": lambda o, a, b: np.minimum(a, b),
    "Range": None, "InvertPermutation": lambda o, perm: np.argsort(_ints(perm)),  # (a transpose's gradient)
    "ConcatOffset": _fold_concat_offset, "Slice": _fold_slice,
    "BroadcastGradientArgs": _fold_broadcast_gradient_args,  # (a broadcast's gradient: its sums' axes)
    # a loop's condition (see _Trace.unroll): on numbers only
    **{name: (lambda f: lambda o, *xs: f(*map(_ints, _numbers(o, xs))))(f) for name, f in [
        ("Less", np.less), ("LessEqual", np.less_equal), ("Greater", np.greater),
        ("GreaterEqual", np.greater_equal), ("Equal", np.equal), ("NotEqual", np.not_equal),
        ("LogicalAnd", np.logical_and), ("LogicalOr", np.logical_or), ("LogicalNot", np.logical_not)]},
    "Max": lambda o, x, axes: _fold_reduce(np.max)(o, _ints(x), axes),
    "Min": lambda o, x, axes: _fold_reduce(np.min)(o, _ints(x), axes),
}
_MEASURES = {"Shape", "ShapeN", "Size", "Rank"}  # ops that read their operands' shapes only
_MAX_KNOWN = 64  # elements of a known-sizes result: shape arithmetic is small


# ============================================================= programs
def _op_runner(op: tf.Operation) -> Callable[[list], list]:
    """Run one graph op in TensorFlow, built once from its NodeDef."""
    gd = tf.compat.v1.GraphDef()
    for k, t in enumerate(op.inputs):
        ph = gd.node.add()
        ph.op, ph.name = "Placeholder", f"in{k}"
        ph.attr["dtype"].type = t.dtype.as_datatype_enum
        ph.attr["shape"].shape.CopyFrom(t.shape.as_proto())  # (some ops' shape functions need them)
    node = gd.node.add()
    node.CopyFrom(op.node_def)
    node.name = "op"
    del node.input[:]
    node.input.extend(f"in{k}" for k in range(len(op.inputs)))
    wrapped = tf.compat.v1.wrap_function(lambda: tf.compat.v1.import_graph_def(gd, name=""), [])
    fn = wrapped.prune([wrapped.graph.as_graph_element(f"in{k}:0") for k in range(len(op.inputs))],
                       [wrapped.graph.as_graph_element(f"op:{j}") for j in range(len(op.outputs))])

    def run(args):
        return [_host(t) for t in fn(*[tf.convert_to_tensor(a) for a in args])]
    return run


def _host(t: tf.Tensor):
    """A result of an op run in TensorFlow as a numpy array, without a copy;
    a value numpy cannot hold (a TensorList's variant, a resource, strings,
    which DLPack would abort the process on) stays a TensorFlow tensor for
    the ops run in TensorFlow after it."""
    if t.dtype.is_floating or t.dtype.is_integer or t.dtype.is_complex or t.dtype == tf.bool:
        return np.from_dlpack(t)
    return t


def _lazy_runner(op: tf.Operation) -> Callable[[list], list]:
    cell: list = []

    def run(args):
        if not cell:
            cell.append(_op_runner(op))
        return cell[0](args)
    return run


# assignments to variables: run (where a rule refuses them) on the values, not
# the variable, whose new value is written back after the call
_ASSIGNS: dict[str, Callable[[list], list]] = {
    "AssignVariableOp": lambda args: [args[1]],
    "AssignAddVariableOp": lambda args: [np.asarray(args[0]) + np.asarray(args[1])],
    "AssignSubVariableOp": lambda args: [np.asarray(args[0]) - np.asarray(args[1])],
}


def _in_order(operations: list) -> list:
    """The graph's operations, each after the ones whose results it reads;
    otherwise in creation order. A loop's gradient adds accumulators to the
    forward loop after ops that read them were made (control flow v2)."""
    done: set[str] = set()
    order: list = []
    for root in operations:
        stack = [(root, False)]
        while stack:
            o, ready = stack.pop()
            if o.name in done:
                continue
            if ready:
                done.add(o.name)
                order.append(o)
                continue
            stack.append((o, True))
            stack.extend((t.op, False) for t in reversed(list(o.inputs)) if t.op.name not in done)
    return order


def _shape(t: tf.Tensor) -> tuple:
    return tuple(t.shape.as_list()) if t.shape.rank is not None else None


class _Trace:
    """A concrete function's graph as polyjit ops: inputs are the user's
    arguments, then the variables it reads."""

    def __init__(self, cf, n_user: int) -> None:
        self.cf = cf
        env: dict[str, Any] = {}
        placeholders = cf.graph.inputs
        self.invars: list[Value] = []
        self.variables: list[tf.Variable] = []
        self.known: dict[Value, KnownSizes] = {}  # a Value's elements, where shape arithmetic knows them
        self.dim_params: dict[tuple[Value, int], str] = {}  # (a Value, dim) -> the parameter standing for it
        self.param_dims: dict[str, tuple[Value, int]] = {}  # and back
        by_handle = {id(v.handle): v for v in cf.variables}
        handles: dict[str, Const] = {}  # a variable's placeholder -> its handle, for ops that take the resource
        self.variable_of: dict[int, tf.Variable] = {}  # id of a handle's Const -> its variable
        self.assigned: dict[int, Value] = {}  # id of a handle's Const -> the variable's value as last assigned
        for t in placeholders[:n_user]:
            env[t.name] = Value(_shape(t), t.dtype)
            self.invars.append(env[t.name])
        for t, cap in zip(placeholders[n_user:], cf.captured_inputs):
            if t.dtype == tf.resource:
                var = by_handle.get(id(cap))
                if var is None:
                    raise UnsupportedOpError(f"captured resource {t.name}")
                env[t.name] = Value(tuple(var.shape.as_list()), var.dtype)
                handles[t.name] = Const(var.handle)
                self.variable_of[id(handles[t.name])] = var
                self.invars.append(env[t.name])
                self.variables.append(var)
            else:
                env[t.name] = Const(np.from_dlpack(cap))
        variables = list(self.variables)
        self._reader = tf.function(lambda: [v.read_value() for v in variables], autograph=False)
        self._read = self._write = None  # their concrete functions, once traced (trace_reader)
        self.calls = 0  # calls run
        self.ops: list[Op] = []
        self.unrolling = 0  # depth of while loops being unrolled: what they cannot take aborts the unrolling
        self.trace_ops(cf.graph.get_operations(), env, handles)
        self.structure = cf.structured_outputs
        flat = tf.nest.flatten(self.structure, expand_composites=True)
        self.out_positions = [k for k, t in enumerate(flat) if isinstance(t, tf.Tensor)]
        self.written = [self.variable_of[h] for h in self.assigned]  # written back after each call, in this order
        written = list(self.written)
        self._writer = tf.function(lambda *values: [v.assign(x) for v, x in zip(written, values)], autograph=False)
        self.outvars = [env[flat[k].name] for k in self.out_positions] + list(self.assigned.values())
        self.flat = flat
        self.ops = live(self.ops, self.outvars)

    def variable_values(self) -> list[np.ndarray]:
        """The variables' current values: read in one TensorFlow call once
        that call is traced (trace_reader), one ReadVariableOp each until
        then (a third of the time ``read_value`` takes)."""
        if not self.variables:
            return []
        if self._read is not None:
            return [np.from_dlpack(t) for t in self._read()]
        return [np.from_dlpack(tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=v.dtype)) for v in self.variables]

    def write_variables(self, values: list) -> None:
        """Assign the values the program computed to the variables it
        assigns (``written``), after the call: in one TensorFlow call once
        traced (trace_reader), one by one until then."""
        if not values:
            return
        if self._write is not None:
            self._write(*map(_to_tensor, values))
            return
        for v, x in zip(self.written, values):
            tf.raw_ops.AssignVariableOp(resource=v.handle, value=_to_tensor(x))

    def trace_reader(self) -> None:
        """Trace the one-call reader (and writer): called as the second call
        starts, on its thread. Not in the first call, which a cached program
        makes a trace of the function and little more (the reader's trace
        would add half of it for a MobileNetV2); nor on a thread beside the
        calls, which it slowed each to more than its own time (each read
        waiting for the interpreter); nor later, as the one-by-one reads
        cost a MobileNetV2 a third of its call (bench/NOTES.md)."""
        if not self.variables or self._read is not None:
            return
        self._read = self._reader.get_concrete_function()
        if self.written:
            self._write = self._writer.get_concrete_function(*[tf.TensorSpec(v.shape, v.dtype) for v in self.written])

    def trace_ops(self, operations: list, env: dict, handles: dict) -> None:
        """Translate a graph's operations into ``self.ops``: ``env`` maps the
        names of its tensors to what they are (a Value, Const, KnownSizes or
        :class:`_TensorList`), ``handles`` its variables' placeholders to
        their handles. A while loop whose trip count is known here is unrolled
        in place (:meth:`unroll`)."""
        for o in _in_order(operations):
            if o.type in ("Placeholder", "NoOp"):
                continue
            if o.type == "Const":
                env[o.outputs[0].name] = Const(tf.make_ndarray(o.get_attr("value")))
                continue
            if o.type == "VariableShape" and isinstance(env.get(o.inputs[0].name), Value) \
                    and env[o.inputs[0].name].shape is not None \
                    and all(isinstance(d, int) for d in env[o.inputs[0].name].shape):
                out_dtype = o.get_attr("out_type").as_numpy_dtype
                env[o.outputs[0].name] = Const(np.asarray(env[o.inputs[0].name].shape, out_dtype))
                continue
            if self.unrolling and o.type != "ReadVariableOp" and any(t.name in handles for t in o.inputs):
                raise UnsupportedOpError(f"{o.type} of a resource in a while loop")
            if o.type in _ASSIGNS and o.inputs[0].name in handles:
                handle = handles[o.inputs[0].name]
                current = self.assigned.get(id(handle), env[o.inputs[0].name])
                self.assigned[id(handle)] = Value(current.shape, current.dtype)
                self.ops.append(Op(o.type, TF_OPS[o.type], o, [current, env[o.inputs[1].name]],
                                   [self.assigned[id(handle)]], _ASSIGNS[o.type], o.name, effects=True))
                continue
            if o.type == "ReadVariableOp" and o.inputs[0].name in handles:
                ins = [self.assigned.get(id(handles[o.inputs[0].name]), env[o.inputs[0].name])]
            else:
                ins = [env[t.name] if o.type == "ReadVariableOp" or t.name not in handles else handles[t.name]
                       for t in o.inputs]  # a loop or call that reads variables itself gets them as variables
            made = None
            if o.type in ("PartitionedCall", "StatefulPartitionedCall"):  # (Keras's grouped Conv2D: a function of its own)
                fn = o.graph._get_function(o.get_attr("f").name)
                if fn is not None:
                    results = self.call(fn.graph, [(env[t.name], handles.get(t.name)) for t in o.inputs])
                    for t, (v, h) in zip(o.outputs, results):
                        env[t.name] = v
                        if h is not None:
                            handles[t.name] = h
                    continue
            if o.type in ("While", "StatelessWhile"):
                carried = self.unroll(o, [(env[t.name], handles.get(t.name)) for t in o.inputs])
                if carried is not None:
                    for t, (v, h) in zip(o.outputs, carried):
                        env[t.name] = v
                        if h is not None:
                            handles[t.name] = h
                    continue
            elif o.type in _TENSOR_LISTS:
                try:
                    made = _TENSOR_LISTS[o.type](self, o, *ins)
                except UnsupportedOpError:
                    if self.unrolling:
                        raise
                    made = None
                if made is not None and (o.type not in _LIST_MAKERS or self.unrolling):
                    for t, m in zip(o.outputs, made if isinstance(made, tuple) else (made,)):
                        env[t.name] = m
                    continue
            if any(isinstance(x, _TensorList) and (x.value is None or self.unrolling) for x in ins):
                raise UnsupportedOpError(f"{o.type} of a TensorList")
            ins = [x.value if isinstance(x, _TensorList) else x for x in ins]
            folded = self.fold(o, ins)
            if folded is not None and all(isinstance(f, Const) for f in folded):
                for t, f in zip(o.outputs, folded):
                    env[t.name] = f
                continue
            shape_input, inferred = _SHAPE_INPUTS.get(o.type, (None, False))
            if shape_input is not None and not isinstance(ins[shape_input], Const):
                ins[shape_input] = self.known_sizes(ins[shape_input]) or (
                    inferred and _inferred_shape(o)) or ins[shape_input]
            outs = [Value(_shape(t), t.dtype) for t in o.outputs]
            for t, v, f in zip(o.outputs, outs, folded or [None] * len(outs)):
                env[t.name] = f if isinstance(f, Const) else v
                if isinstance(f, KnownSizes):
                    self.known[v] = f
            if isinstance(made, _TensorList):  # the list itself, for what reads it whole (a loop run in TensorFlow)
                made.value = outs[0]
                env[o.outputs[0].name] = made
            self.ops.append(Op(o.type, TF_OPS.get(o.type), o, ins, outs, _lazy_runner(o), o.name,
                               effects=o.op_def.is_stateful))

    def unroll(self, o: tf.Operation, carried: list[tuple]) -> list[tuple] | None:
        """A while loop (control flow v2) as its body traced once per
        iteration, where its condition folds to a constant at each one (a
        Keras RNN's: counters that start and step by constants): the steps
        fuse, and no host turn per iteration. ``carried``: (value, handle)
        per loop variable, a handle for a variable's resource. None where
        the trip count is known only at run time, or the unrolled loop would
        be too long: the loop runs in TensorFlow."""
        cond, body = (o.graph._get_function(o.get_attr(k).name).graph for k in ("cond", "body"))
        start = len(self.ops)
        self.unrolling += 1
        try:
            for step in range(UNROLL_LIMIT + 1):
                more = self.call(cond, carried)[0][0]
                if not isinstance(more, Const):
                    raise UnsupportedOpError("a trip count known only at run time")
                if not more.value.item():
                    return carried
                if step == UNROLL_LIMIT or len(self.ops) - start > UNROLL_OPS_LIMIT:
                    raise UnsupportedOpError("a loop too long to unroll")
                carried = self.call(body, carried)
        except UnsupportedOpError:
            del self.ops[start:]
            return None
        finally:
            self.unrolling -= 1

    def call(self, graph, args: list[tuple]) -> list[tuple]:
        """A function graph traced inline on ``args`` ((value, handle) each): its results, likewise."""
        env = {t.name: v for t, (v, _) in zip(graph.inputs, args)}
        handles = {t.name: h for t, (_, h) in zip(graph.inputs, args) if h is not None}
        self.trace_ops(graph.get_operations(), env, handles)
        return [(env[t.name], handles.get(t.name)) for t in graph.outputs]

    def fold(self, o: tf.Operation, ins: list) -> list | None:
        """o's results where shape arithmetic knows them (see :data:`_FOLDS`),
        each a Const or KnownSizes; None where it does not. A result that
        is only KnownSizes still has its op, run should an op read it as a
        tensor."""
        if o.type not in _FOLDS:
            return None
        if all(isinstance(x, Const) for x in ins):
            vals = [tf.get_static_value(t) for t in o.outputs]  # (not where a constant came from a rule below)
            if all(v is not None for v in vals):
                return [Const(np.asarray(v)) for v in vals]
        rule = _FOLDS[o.type]
        if rule is None or not all((t.dtype.is_integer or t.dtype == tf.bool)
                                   and (t.shape.num_elements() or 0) <= _MAX_KNOWN for t in o.outputs):
            return None  # (an output of unknown length is measured below)
        args = []
        for x in ins:
            if o.type in _MEASURES:
                if isinstance(x, Const) or x.shape is None:
                    return None  # (TensorFlow folds a constant's; an unknown rank has none)
                args.append(self.shape_sizes(x))
            elif isinstance(x, Const):
                args.append(np.array(x.value.tolist(), object))
            elif self.known_sizes(x) is not None:
                args.append(self.known[x].value)
            else:
                return None
        try:
            results = rule(o, *args)
        except (UnsupportedOpError, ArithmeticError, TypeError, ValueError, IndexError):  # not sizes: run the op
            return None
        out = []
        for t, r in zip(o.outputs, results if isinstance(results, list) else [results]):
            r = np.asarray(r, object)
            if not t.shape.is_compatible_with(r.shape) or r.size > _MAX_KNOWN:
                return None
            if not any(isinstance(e, sz.Lin) for e in r.flat):
                out.append(Const(np.asarray(r.tolist(), t.dtype.as_numpy_dtype)))
                continue
            params = set().union(*(e.base_params() for e in r.flat if isinstance(e, sz.Lin)))
            out.append(KnownSizes(r, {p: self.param_dims[p] for p in sorted(params)}, t.dtype.as_numpy_dtype))
        return out

    def known_sizes(self, x) -> KnownSizes | None:
        """What shape arithmetic knows of x's elements, where x is a Value.
        Facts are keyed by the Value itself, not its id: the values of a
        loop whose unrolling is given up may be freed, and an id reused."""
        return self.known.get(x) if isinstance(x, Value) else None

    def shape_sizes(self, x: Value) -> np.ndarray:
        """x's shape as sizes: a parameter for each dim known only at run time."""
        out = np.empty(len(x.shape), object)
        for d, s in enumerate(x.shape):
            if s is None:
                if (x, d) not in self.dim_params:
                    name = f"tf_dim{len(self.dim_params)}"
                    self.dim_params[x, d] = name
                    self.param_dims[name] = (x, d)
                out[d] = sz.Lin.param(self.dim_params[x, d])
            else:
                out[d] = int(s)
        return out


UNROLL_LIMIT = 256  # most iterations of a while loop unrolled into the program
UNROLL_OPS_LIMIT = 8192  # most ops an unrolled loop adds to it


class _TensorList:
    """A TensorList (a TensorArray) while tracing: its items known one by
    one, where loops that fill and read it are unrolled and index it by
    constants. An item not set is a slice of ``source`` (TensorListFromTensor)
    or zeros. ``value``: the list as TensorFlow makes it, where it runs
    there (a loop not unrolled reads that)."""

    def __init__(self, items: list, source: Value | Const | None, dtype, element_shape) -> None:
        self.items, self.source, self.dtype, self.element_shape = items, source, dtype, element_shape
        self.value: Value | None = None

    def item(self, trace: "_Trace", o: tf.Operation, i: int):
        if not 0 <= i < len(self.items):
            raise UnsupportedOpError("a TensorList index out of range")
        if self.items[i] is None:
            if self.source is not None:
                out = Value(_shape(o.outputs[0]) if o.type == "TensorListGetItem" else self.element_shape,
                            self.dtype)
                trace.ops.append(Op("TensorListGetItem", lambda _, x: ops.squeeze(
                    ops.slice(x, [i] + [0] * (x.ndim - 1), [i + 1] + list(x.shape[1:])), [0]),
                    o, [self.source], [out], lambda args: [np.asarray(args[0])[i]], o.name))
                return out  # (not kept: a loop whose unrolling is given up drops the op)
            elif self.element_shape is not None and all(isinstance(n, int) for n in self.element_shape):
                self.items[i] = Const(np.zeros(self.element_shape, self.dtype.as_numpy_dtype))
            else:
                raise UnsupportedOpError("an unset TensorList item of unknown shape")
        return self.items[i]


def _list_shape(x) -> tuple | None:
    if not isinstance(x, Const):
        return None
    dims = np.atleast_1d(x.value).tolist()
    return None if x.value.ndim == 0 or any(d < 0 for d in dims) else tuple(dims)


def _list_index(x) -> int:
    if not isinstance(x, Const):
        raise UnsupportedOpError("a TensorList indexed at run time")
    return int(x.value)


def _list_reserve(trace, o, shape, n):
    if not isinstance(n, Const) or int(n.value) < 0:
        return None
    return _TensorList([None] * int(n.value), None, o.get_attr("element_dtype"), _list_shape(shape))


def _list_from_tensor(trace, o, x, shape):
    if isinstance(x, _TensorList) or x.shape is None or not isinstance(x.shape[0], int):
        return None
    return _TensorList([None] * x.shape[0], x, o.get_attr("element_dtype"), tuple(x.shape[1:]))


def _list_get(trace, o, tl, i, shape):
    return tl.item(trace, o, _list_index(i)) if isinstance(tl, _TensorList) else None


def _list_set(trace, o, tl, i, v):
    if not isinstance(tl, _TensorList) or isinstance(v, _TensorList):
        return None
    i = _list_index(i)
    if not 0 <= i < len(tl.items):
        raise UnsupportedOpError("a TensorList index out of range")
    out = _TensorList(list(tl.items), tl.source, tl.dtype, tl.element_shape)
    out.items[i] = v
    return out


def _list_stack(trace, o, tl, shape):
    """TensorListStack: the source where no item was set, else the items packed."""
    if not isinstance(tl, _TensorList):
        return None
    if tl.source is not None and all(v is None for v in tl.items):
        return tl.source
    items = [tl.item(trace, o, i) for i in range(len(tl.items))]
    out = Value(_shape(o.outputs[0]), o.outputs[0].dtype)
    trace.ops.append(Op("TensorListStack", lambda _, *xs: ops.cat([ops.unsqueeze(x, 0) for x in xs], 0), o, items,
                        [out], lambda args: [np.stack([np.asarray(a) for a in args])], o.name))
    return out


def _list_length(trace, o, tl):
    return Const(np.asarray(len(tl.items), np.int32)) if isinstance(tl, _TensorList) else None


def _in_tensorflow(trace, tl: _TensorList) -> bool:
    """Whether tl is a list TensorFlow made, outside a loop being unrolled:
    its pushes and pops stay ops there, for a loop run in TensorFlow to read."""
    return tl.value is not None and not trace.unrolling


def _list_element_shape(trace, o, tl):
    """TensorListElementShape: the declared shape, else the items' (an accumulator declares none)."""
    if not isinstance(tl, _TensorList):
        return None
    shapes = {tl.element_shape} if tl.element_shape is not None else {
        _shape_of(v) for v in tl.items if v is not None}
    if len(shapes) != 1 or None in shapes or not all(isinstance(d, int) for d in next(iter(shapes))):
        return None
    return Const(np.asarray(next(iter(shapes)), o.get_attr("shape_type").as_numpy_dtype))


def _list_add(trace, o, *tls):
    """AddN of TensorLists (a loop's gradient summed over its uses): the
    lists of the items' sums."""
    if not all(isinstance(tl, _TensorList) for tl in tls) or len({len(tl.items) for tl in tls}) != 1:
        return None
    items = []
    for i in range(len(tls[0].items)):
        terms = [tl.item(trace, o, i) for tl in tls]
        out = Value(_shape_of(terms[0]), tls[0].dtype)
        trace.ops.append(Op("AddN", _add_n, o, terms, [out], lambda args: [sum(np.asarray(a) for a in args)],
                            o.name))
        items.append(out)
    return _TensorList(items, None, tls[0].dtype, tls[0].element_shape)


def _list_zeros(trace, o, tl):
    """ZerosLike of a TensorList (the gradient of a list no loss reads): zeros for each item."""
    if not isinstance(tl, _TensorList):
        return None
    items = []
    for v in tl.items:
        shape = None if v is None else _shape_of(v)
        if v is not None and (shape is None or not all(isinstance(d, int) for d in shape)):
            raise UnsupportedOpError("zeros like a TensorList item of unknown shape")
        items.append(None if v is None else Const(np.zeros(shape, tl.dtype.as_numpy_dtype)))
    return _TensorList(items, None, tl.dtype, tl.element_shape)


def _shape_of(v) -> tuple | None:
    return tuple(v.value.shape) if isinstance(v, Const) else v.shape


def _list_empty(trace, o, shape, n):
    """EmptyTensorList: a stack that a loop pushes to (a gradient's accumulator of a step's values)."""
    return _TensorList([], None, o.get_attr("element_dtype"), _list_shape(shape))


def _list_push(trace, o, tl, v):
    if not isinstance(tl, _TensorList) or isinstance(v, _TensorList) or _in_tensorflow(trace, tl):
        return None
    return _TensorList(list(tl.items) + [v], tl.source, tl.dtype, tl.element_shape)


def _list_pop(trace, o, tl, shape):
    """TensorListPopBack: (the list without its last item, that item)."""
    if not isinstance(tl, _TensorList) or tl.source is not None or _in_tensorflow(trace, tl):
        return None
    if not tl.items:
        raise UnsupportedOpError("TensorListPopBack of an empty list")
    last = tl.item(trace, o, len(tl.items) - 1)
    return _TensorList(tl.items[:-1], None, tl.dtype, tl.element_shape), last


# TensorList ops while tracing: each gives a _TensorList, a value, or None
# (the op as it is). Outside a loop being unrolled, a list made by one of
# _LIST_MAKERS keeps its op, for a loop that runs in TensorFlow to read.
_TENSOR_LISTS: dict[str, Callable] = {
    "TensorListReserve": _list_reserve, "TensorListFromTensor": _list_from_tensor,
    "TensorListGetItem": _list_get, "TensorListSetItem": _list_set, "TensorListStack": _list_stack,
    "TensorListLength": _list_length, "EmptyTensorList": _list_empty, "TensorListPushBack": _list_push,
    "TensorListPopBack": _list_pop, "TensorListElementShape": _list_element_shape, "AddN": _list_add,
    "ZerosLike": _list_zeros,
    "Identity": lambda trace, o, x: x if isinstance(x, _TensorList) else None,
}
_LIST_MAKERS = {"TensorListReserve", "TensorListFromTensor", "EmptyTensorList"}


# ops that take a shape: its operand's position, and whether the shape
# TensorFlow inferred for the result stands for it where it is unknown
_SHAPE_INPUTS = {"Reshape": (1, True), "Conv2DBackpropInput": (0, True),
                 "DepthwiseConv2dNativeBackpropInput": (0, True), "BroadcastTo": (1, False), "Fill": (0, False),
                 "Tile": (1, False)}


def _inferred_shape(o: tf.Operation) -> Const | None:
    """The shape input of a Reshape (or a transposed convolution's output
    size) computed at run time from values (not sizes, which _FOLDS knows),
    as the constant shape TensorFlow inferred for its result, when that
    leaves at most one size unknown: for a reshape the element count fixes
    it (-1); a convolution reads only spatial sizes."""
    dims = o.outputs[0].shape
    if dims.rank is None or sum(d is None for d in dims.as_list()) > 1:
        return None
    return Const(np.array([-1 if d is None else d for d in dims.as_list()], np.int64))


class TFFunction:
    """A function compiled with polyjit per signature; ``.stats`` says what it did."""

    def __init__(self, fn: Callable, options: CompileOptions, input_signature, backend: str,
                 reduce_retracing: bool = False) -> None:
        self.fn, self.options, self.backend = fn, options, backend
        self.input_signature = list(input_signature) if input_signature is not None else None
        self.reduce_retracing = reduce_retracing
        self._stats = Stats()
        self._programs: dict[tuple, tuple[_Trace, SegmentedProgram]] = {}
        self._failed: set[tuple] = set()  # signatures whose program raised where TensorFlow does not
        # reduce_retracing: per family (each argument's rank and dtype), the shapes of its last exact
        # program, the relaxed shapes compiled for it, and the families whose relaxed program failed
        self._last_shapes: dict[tuple, tuple] = {}
        self._relaxed: dict[tuple, list[tuple]] = {}
        self._exact_only: set[tuple] = set()
        self._plain_fn = None
        self._tf = None
        if backend != "polyjit":
            self._tf = tf.function(fn, input_signature=input_signature, jit_compile=backend == "xla",
                                   reduce_retracing=reduce_retracing)
        functools.update_wrapper(self, fn)
        if not hasattr(self, "__name__"):  # a Keras layer or model, any callable object
            self.__name__ = getattr(fn, "name", type(fn).__name__)

    @property
    def stats(self) -> dict:
        return self._stats.as_dict()

    def _arrays(self, args) -> list:
        flat = tf.nest.flatten(list(args))
        out = []
        for k, x in enumerate(flat):
            if isinstance(x, tf.Tensor):
                if "CPU" not in x.device.upper() and x.device:
                    raise InputError(f"{self.__name__}: argument {k} is on {x.device}; jit_tf takes tensors "
                                     f"on the host (target 'nvgpu' copies them to the GPU and back)")
                x = np.from_dlpack(x)
            elif isinstance(x, tf.Variable):
                x = np.from_dlpack(x.read_value())
            elif isinstance(x, (bool, int, float)):
                x = np.asarray(x, np.float32 if isinstance(x, float) else np.int32 if not isinstance(x, bool)
                               else np.bool_)
            elif not isinstance(x, np.ndarray):
                raise InputError(f"{self.__name__}: argument {k} is a {type(x).__name__}; expected a "
                                 f"tf.Tensor or a numpy array")
            out.append(x)
        return out

    def _check_signature(self, arrays) -> None:
        sig = tf.nest.flatten(self.input_signature)
        if len(sig) != len(arrays):
            raise InputError(f"{self.__name__}: got {len(arrays)} arguments, the input_signature has {len(sig)}")
        for k, (x, spec) in enumerate(zip(arrays, sig)):
            name = f" ({spec.name})" if getattr(spec, "name", None) else ""
            if tf.as_dtype(x.dtype) != spec.dtype or not spec.shape.is_compatible_with(x.shape):
                raise InputError(f"{self.__name__}: argument {k}{name} is {tf.as_dtype(x.dtype).name}"
                                 f"{list(x.shape)}, which does not match the input_signature: "
                                 f"{spec.dtype.name}{spec.shape.as_list()}")

    def _key(self, arrays) -> tuple:
        """The program for these arrays: the signature's, their exact shapes',
        or (reduce_retracing) the relaxed shapes' that fit them."""
        if self.input_signature is not None:
            return ("signature",)
        exact = tuple((x.shape, x.dtype) for x in arrays)
        if self.reduce_retracing and exact not in self._programs:
            for shapes in self._relaxed.get(_family(arrays), ()):
                if _fits(shapes, arrays):
                    return ("relaxed", shapes)
        return exact

    def _plain(self):
        """The function as a plain tf.function (what a failed program runs as)."""
        if self._plain_fn is None:
            self._plain_fn = tf.function(self.fn, input_signature=self.input_signature,
                                         reduce_retracing=self.reduce_retracing)
        return self._plain_fn

    def _recover(self, key: tuple, err: Exception, args):
        """A call whose compiled program raised: where TensorFlow raises too
        (a failed assertion, an index out of range in an op run in TensorFlow)
        that is the program's own error and propagates; otherwise it was
        polyjit's, and this signature runs as a plain tf.function from now
        on, counted and warned (raised under strict)."""
        try:
            result = self._plain()(*args)
        except Exception:
            raise err from None
        internal_failure(self._stats, f"graph {self.__name__}", err, "TensorFlow", self.options.strict)
        self._failed.add(key)
        return result

    def program(self, arrays) -> tuple[_Trace, SegmentedProgram]:
        return self._program(arrays)[1]

    def _program(self, arrays) -> tuple[tuple, tuple[_Trace, SegmentedProgram]]:
        """(the key, the trace and program) for these arrays, traced and
        translated where no earlier call's fits them."""
        key = self._key(arrays)
        if key in self._programs:
            return key, self._programs[key]
        if self.input_signature is not None:
            specs = self.input_signature
        else:
            if self.reduce_retracing and (relaxed := self._relax(arrays)) is not None:
                return relaxed
            specs = [tf.TensorSpec(x.shape, tf.as_dtype(x.dtype)) for x in arrays]
        self._programs[key] = self._trace(specs, len(arrays), self.options)
        if self.input_signature is None:
            self._last_shapes[_family(arrays)] = tuple(x.shape for x in arrays)
        return key, self._programs[key]

    def _trace(self, specs, n: int, options: CompileOptions) -> tuple[_Trace, SegmentedProgram]:
        traced = trace_text(options, ("tf", tf.__version__, specs), function_text(self.fn))
        expect_compile(traced)
        cf = tf.function(self.fn, autograph=False).get_concrete_function(*specs)
        trace = _Trace(cf, n)
        prog = SegmentedProgram(trace.invars, trace.ops, trace.outvars, options, self._stats,
                                f"{self.__name__}{len(self._programs)}", "TensorFlow")
        compiled(traced)  # (its programs compile on the call that follows)
        return trace, prog

    def _relax(self, arrays) -> tuple[tuple, tuple[_Trace, SegmentedProgram]] | None:
        """reduce_retracing, as tf.function's: a second shape of a family
        (each argument's rank and dtype) traces the function once more with
        the sizes that changed as None, symbolic sizes of one program for
        every value; sizes of 0 or 1 stay as they are (broadcasting). It is
        translated strictly: a relaxed program that would run an op in
        TensorFlow, or any failure, leaves the family compiled per shape."""
        family = _family(arrays)
        last = self._last_shapes.get(family)
        if last is None or family in self._exact_only:
            return None
        shapes = tuple(tuple(None if a != b and min(a, b) > 1 else b for a, b in zip(old, x.shape))
                       for old, x in zip(last, arrays))
        if not any(None in s for s in shapes):
            return None
        key = ("relaxed", shapes)
        specs = [tf.TensorSpec(s, tf.as_dtype(x.dtype)) for s, x in zip(shapes, arrays)]
        try:
            self._programs[key] = self._trace(specs, len(arrays), dataclasses.replace(self.options, strict=True))
        except Exception as err:  # (the function itself may need static sizes: compiled per shape)
            log.debug("%s: no relaxed program for %s (%s: %s)", self.__name__, shapes, type(err).__name__, err)
            self._exact_only.add(family)
            return None
        self._relaxed.setdefault(family, []).append(shapes)
        return key, self._programs[key]

    def _unrelax(self, key: tuple, arrays) -> None:
        """A relaxed program failed at a call: its family is compiled per shape from now on."""
        family = _family(arrays)
        self._relaxed[family].remove(key[1])
        self._exact_only.add(family)
        del self._programs[key]

    def save(self, path, *args) -> None:
        """The program for these arguments, compiled and written to
        ``path``: ``polyjit.load(path)`` calls it in any process on a
        machine like this one, with neither TensorFlow tracing nor polyjit
        compiling, and returns tf.Tensors for tf.Tensors. The variables it
        reads (a Keras model's weights) are saved with their values now, as
        a SavedModel's serving function holds them; a function that
        assigns variables (a training step) is not saved."""
        if self.backend != "polyjit":
            raise CompileOptionError(f"{self.__name__}: execution_backend={self.backend!r} compiles nothing to save")
        arrays = self._arrays(args)
        if self.input_signature is not None:
            self._check_signature(arrays)
        trace, prog = self.program(arrays)
        if trace.written:
            raise SavedExecutableError(f"{self.__name__}: it assigns variables ({', '.join(v.name for v in trace.written)}"
                                       "); a saved function keeps no state")
        if len(trace.out_positions) != len(trace.flat):
            raise SavedExecutableError(f"{self.__name__}: it returns values other than tensors; a saved function "
                                       "returns tensors")
        exe, call, constants = prog.saved_call(self.__name__, self.options.target or "cpu")
        variables = trace.variable_values()  # (the program's last inputs)
        call["bound"] = list(range(len(constants), len(constants) + len(variables)))
        leaf = object()
        try:
            results = tf.nest.pack_sequence_as(trace.structure, [leaf] * len(trace.flat), expand_composites=True)
        except (TypeError, ValueError) as e:
            raise SavedExecutableError(f"{self.__name__}: its results' structure cannot be saved ({e})") from None
        is_leaf = lambda x: x is leaf  # noqa: E731
        given = lambda x: x is not None and not isinstance(x, (tuple, list, dict))  # noqa: E731
        saved.save(exe, path, {"name": self.__name__, "args": structure((list(args), {}), given),
                               "results": structure(results, is_leaf), **call}, constants + variables)

    def __call__(self, *args):
        if self._tf is not None:
            return self._tf(*args)
        arrays = self._arrays(args)
        if self.input_signature is not None:
            self._check_signature(arrays)
        key = self._key(arrays)
        if key in self._failed:
            return self._plain()(*args)
        try:
            key, (trace, prog) = self._program(arrays)
            if trace.calls:
                trace.trace_reader()
            outs = prog(arrays + trace.variable_values())
            trace.write_variables(outs[len(trace.out_positions):])
            trace.calls += 1
        except USER_ERRORS:
            raise
        except Exception as err:  # polyjit's own failure, or the program's error that TensorFlow raises too
            if key[0] == "relaxed":
                log.debug("%s: relaxed program %s failed (%s: %s)", self.__name__, key[1], type(err).__name__, err)
                self._unrelax(key, arrays)
                return self(*args)
            return self._recover(key, err, args)
        flat = list(trace.flat)
        for k, o in zip(trace.out_positions, outs):
            flat[k] = _to_tensor(o)
        return tf.nest.pack_sequence_as(trace.structure, flat, expand_composites=True)


def _family(arrays) -> tuple:
    """What a relaxed program keeps of its arguments: each one's rank and dtype."""
    return tuple((x.ndim, x.dtype) for x in arrays)


def _fits(shapes: tuple, arrays) -> bool:
    """Whether relaxed shapes (None: symbolic) take these arrays: the fixed
    sizes equal, the symbolic ones above 1 (as they were traced)."""
    return all(n > 1 if d is None else d == n for s, x in zip(shapes, arrays) for d, n in zip(s, x.shape))


def _to_tensor(x) -> tf.Tensor:
    return x if isinstance(x, tf.Tensor) else tf_from_host(x)


def jit_tf(fn: Callable | Sequence | None = None, compile_options: dict | None = None, *, input_signature=None,
           reduce_retracing: bool = False, execution_backend: str = "polyjit"):
    """Compile a TensorFlow function with polyjit (as ``tf.function`` would).

    With ``input_signature`` the code is specialized to it (a ``None``
    dimension is a symbolic size) and calls that violate it raise
    InputError; without, it compiles once per input shapes and dtypes, or
    with ``reduce_retracing=True`` (as Keras's ``predict`` sets it) once
    more at a second shape, with the sizes that changed symbolic.
    As a decorator with arguments, the signature may come first, as
    PolyBlocks writes it: ``@jit_tf([tf.TensorSpec(...)], {"target": "cpu"})``.
    ``execution_backend="std"`` runs a plain ``tf.function`` and ``"xla"``
    one with ``jit_compile=True``, for comparison.
    """
    if fn is not None and not callable(fn):  # the signature, positionally
        if input_signature is not None:
            raise CompileOptionError("jit_tf: input_signature given twice (positionally and by keyword)")
        fn, input_signature = None, fn
    check_execution_backend("tf", execution_backend)
    options = parse_options(compile_options)

    def wrap(f):
        return TFFunction(f, options, input_signature, execution_backend, reduce_retracing)
    return wrap(fn) if fn is not None else wrap
