"""PyTorch frontend: ``torch.compile(backend="polyjit")`` and ``jit_torch``.

Dynamo captures the program; AOTAutograd splits it into forward and backward
ATen graphs after the core ATen decompositions and a chosen few more
(dropout, batch and group norms: their parts fuse with their neighbours),
leaving whole the composites the table lowers in one step (GELU, layer
norm's backward; without a backward, softmax and layer norm too), and
attention as one op each way (torch_attention); each
graph is translated into a polyjit graph through :data:`ATEN`, the one
table from ATen ops to polyjit ops, and compiled. Nodes outside the table
run in eager PyTorch, in partitions of their own: counted in the stats,
warned about once, refused under ``strict=True``.

On the CPU, tensors reach the compiled code through the numpy bridge, which
shares memory: no copies.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._dynamo.backends.common import aot_autograd
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupport
from torch.nn.attention import SDPBackend, sdpa_kernel

from polyjit import ops, saved
from polyjit.api import Executable, takes_device_arrays
from polyjit.channels_last import inverse
from polyjit.compiler import compiled, expect_compile
from polyjit.runtime.buffers import BufferCache, new_buffer
from polyjit.runtime.gpu_buffers import GpuView
from polyjit.dtypes import DataType
from polyjit.errors import CompileOptionError, InputError, SavedExecutableError, UnsupportedOpError
from polyjit.graph import Graph
from polyjit.interop import torch_from_host, torch_host_array
from polyjit.options import CompileOptions, parse_options
from polyjit.saved import structure
from polyjit import sizes as sz
from polyjit.sizes import Lin
from polyjit.targets import holding

from . import torch_attention, torch_partition
from .common import (USER_ERRORS, Stats, check_execution_backend, elementwise, fallback, internal_failure,
                     logical, trace_text)

log = logging.getLogger("polyjit.torch")
aten = torch.ops.aten
prims = torch.ops.prims


def _numpy_dtype(d: DataType) -> np.dtype | None:
    try:
        return np.dtype(d.numpy)
    except TypeError:  # bfloat16 without ml_dtypes
        return None


_DTYPES = {torch.float32: DataType.Float, torch.float64: DataType.Double, torch.float16: DataType.Half,
           torch.int8: DataType.Int8, torch.uint8: DataType.UInt8, torch.int16: DataType.Int16,
           torch.int32: DataType.Int32, torch.int64: DataType.Int, torch.bool: DataType.Bool}
if _numpy_dtype(DataType.BFloat16) is not None:
    _DTYPES[torch.bfloat16] = DataType.BFloat16
_TORCH = {v: k for k, v in _DTYPES.items()}
_NUMPY_TO_TORCH = {_numpy_dtype(d): t for t, d in _DTYPES.items()}
_NUMPY_DTYPES = {t: _numpy_dtype(d) for t, d in _DTYPES.items()}


def _implicit(op) -> bool:
    """Whether ``op`` is a composite that torch's own kernel decomposes
    (CompositeImplicitAutograd: matmul, linear). The tracer then runs that
    kernel, as backend="aot_eager" does; its Python decomposition gives the
    same graph, traced more slowly."""
    has = getattr(op, "has_kernel_for_dispatch_key", None)
    return has is not None and has(torch._C.DispatchKey.CompositeImplicitAutograd)


_CHOSEN = get_decompositions([  # beyond the core set: ops whose parts fuse with their neighbours
    aten.native_layer_norm, aten._softmax, aten._log_softmax,  # (in training graphs: see WHOLE)
    aten._softmax_backward_data, aten._log_softmax_backward_data,
    aten.native_dropout, aten.native_dropout_backward, aten.threshold_backward,
    aten.silu, aten.silu_backward, aten.sigmoid_backward, aten.tanh_backward, aten.mse_loss,
    aten.mse_loss_backward, aten.nll_loss_forward, aten.nll_loss_backward, aten._to_copy,
    aten.rms_norm, aten.embedding_dense_backward, aten.repeat, aten.elu, aten.elu_backward,
    aten.native_group_norm, aten.native_group_norm_backward, aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional, aten._native_batch_norm_legit_no_training,
    aten.linalg_vector_norm, aten.reflection_pad2d, aten.upsample_nearest2d,
    aten.upsample_bilinear2d,
])
_TORCH_DECOMPOSITIONS = {**{op: d for op, d in core_aten_decompositions().items() if not _implicit(op)}, **_CHOSEN}


def _foreach(single: Callable, overload: str, per_element: bool = False) -> Callable:
    """An optimizer's _foreach_<op> (a list of tensors at once, as torch.optim
    runs on the GPU) as one single-tensor op per element: a list argument
    gives each element its own, a scalar is shared; the "Tensor" overloads
    of addcmul and addcdiv take a value per element from a 1-d tensor."""
    def decomposed(self, *args, **kwargs):
        def pick(a, i):
            if isinstance(a, (list, tuple)):
                return a[i]
            if overload == "Tensor" and per_element and isinstance(a, torch.Tensor):
                return a[i] if a.ndim else a
            return a
        if overload == "ScalarAndTensor":  # pow(scalar, tensors)
            return [single(self, x) for x in args[0]]
        return [single(x, *(pick(a, i) for a in args), **{k: pick(v, i) for k, v in kwargs.items()})
                for i, x in enumerate(self)]
    return decomposed


def _addc(fn, combine):
    """addcmul or addcdiv, also with a value that is a tensor (a capturable optimizer's)."""
    return lambda x, t1, t2, value=1: (x + value * combine(t1, t2) if isinstance(value, torch.Tensor)
                                       else fn(x, t1, t2, value=value))


_FOREACH = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
            "addcmul": _addc(torch.addcmul, torch.mul), "addcdiv": _addc(torch.addcdiv, torch.div),
            "lerp": torch.lerp,
            "maximum": torch.maximum, "minimum": torch.minimum, "pow": torch.pow,
            "clamp_min": torch.clamp_min, "clamp_max": torch.clamp_max, "sqrt": torch.sqrt, "neg": torch.neg,
            "exp": torch.exp, "reciprocal": torch.reciprocal, "sign": torch.sign, "abs": torch.abs,
            "sigmoid": torch.sigmoid, "log": torch.log, "rsqrt": torch.rsqrt,
            "norm": lambda x, ord=2, dtype=None: torch.linalg.vector_norm(x, ord, dtype=dtype)}
for _name, _single in _FOREACH.items():
    _packet = getattr(aten, "_foreach_" + _name, None)
    for _ov in (_packet.overloads() if _packet is not None else ()):
        if not _ov.endswith("out"):
            _TORCH_DECOMPOSITIONS[getattr(_packet, _ov)] = _foreach(_single, _ov, _name in ("addcmul", "addcdiv"))


# Ops the table lowers whole. Among them views, which torch's references
# trace as a chain of dispatches (t: transpose, then permute); the
# partition of a training step comes out the same.
for _keep in (aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices_backward.default,
              aten.max_pool3d_with_indices.default, aten.max_pool3d_with_indices_backward.default,
              aten.split.Tensor, aten.split_with_sizes.default,
              aten.t.default, aten.transpose.int, aten._unsafe_view.default):
    _TORCH_DECOMPOSITIONS.pop(_keep, None)


def _safe_softmax(x, dim, dtype=None):
    """aten._safe_softmax (attention's softmax: a row of -inf gives zeros)
    with the masked rows found by the row's maximum, which the softmax
    computes anyway, rather than a reduction of its own: all of a row's
    reductions and its result then fit one kernel. NaN propagates as in
    eager (a NaN maximum is not -inf)."""
    out = torch.softmax(x, dim=dim, dtype=dtype)
    if x.ndim == 0 or isinstance(x.shape[dim], int) and x.shape[dim] == 0:  # (a symbolic size: no guard)
        return out
    masked = torch.amax(x, dim=dim, keepdim=True) == float("-inf")
    return torch.where(masked, torch.zeros_like(out), out)


_TORCH_DECOMPOSITIONS[aten._safe_softmax.default] = _safe_softmax


# The composites below stand for ops that torch._decomp leaves whole and that
# carry autograd formulas of their own: AOTAutograd decomposes below autograd,
# so each op's backward op appears in the backward graph and needs one too.

def _embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """aten._embedding_bag and _embedding_bag_forward_only (nn.EmbeddingBag;
    torch._decomp has none): the rows gathered, summed into their bags
    (index_add) or their maximum taken (scatter_reduce), empty bags and
    padding rows giving zeros. Its other results as ATen's, for the backward
    below: each row's bag (offset2bag), each bag's size, and for max the row
    each maximum came from (the first of equals)."""
    if indices.ndim != 1 or indices.shape[0] == 0:
        return NotImplemented
    itype = indices.dtype
    starts = offsets[:-1] if include_last_offset else offsets
    n, bags, dim = indices.shape[0], starts.shape[0], weight.shape[1]
    ones = torch.ones_like(starts, dtype=itype)
    offset2bag = torch.zeros(n + 1, dtype=itype, device=indices.device).index_add(0, starts.to(itype), ones)
    offset2bag = offset2bag.cumsum(0)[:n] - 1
    keep = (offset2bag >= 0) & (indices != padding_idx)
    bag = offset2bag.clamp(min=0)
    bag_size = torch.zeros(bags, dtype=itype, device=indices.device).index_add(0, bag, keep.to(itype))
    rows = weight[indices]
    if mode == 2:
        rows = torch.where(keep[:, None], rows, float("-inf"))
        at = bag[:, None].expand(n, dim)
        out = torch.zeros(bags, dim, dtype=weight.dtype, device=weight.device).scatter_reduce(
            0, at, rows, "amax", include_self=False)
        filled = (bag_size > 0)[:, None]
        out = torch.where(filled, out, 0)
        pos = torch.arange(n, dtype=itype, device=indices.device)[:, None].expand(n, dim)
        hit = keep[:, None] & (rows == out[bag])
        first = torch.full((bags, dim), n - 1, dtype=itype, device=indices.device).scatter_reduce(
            0, at, torch.where(hit, pos, n - 1), "amin")
        return out, offset2bag, bag_size, torch.where(filled, indices[first], 0)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None]
    out = torch.zeros(bags, dim, dtype=weight.dtype, device=weight.device).index_add(
        0, bag, torch.where(keep[:, None], rows, 0))
    if mode == 1:
        out = out / bag_size.clamp(min=1)[:, None]
    return out, offset2bag, bag_size, bag_size


def _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                  scale_grad_by_freq, mode, per_sample_weights=None, padding_idx=-1):
    """The weight's gradient of _embedding_bag above: each bag's gradient
    added into the rows it was made of (scaled by the mean's bag size or the
    row's weight), or for max into the rows its maxima came from.
    scale_grad_by_freq stays eager's (torch 2.13's CPU kernel divides each
    row by another row's count)."""
    if scale_grad_by_freq:
        return NotImplemented
    if mode == 2:
        grad = torch.where((bag_size > 0)[:, None], grad, 0)
        return grad.new_zeros(num_weights, grad.shape[1]).scatter_add(0, maximum_indices, grad)
    keep = (offset2bag >= 0) & (indices != padding_idx)
    bag = offset2bag.clamp(min=0)
    rows = grad[bag]
    if mode == 1:
        rows = rows / bag_size[bag].clamp(min=1)[:, None]
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None]
    return grad.new_zeros(num_weights, grad.shape[1]).index_add(0, indices, torch.where(keep[:, None], rows, 0))


def _embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    """per_sample_weights' gradient of _embedding_bag above (mode sum): each
    row's dot product with its bag's gradient."""
    keep = (offset2bag >= 0) & (indices != padding_idx)
    return torch.where(keep, (grad[offset2bag.clamp(min=0)] * weight[indices]).sum(1), 0)


def _embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                            scale_grad_by_freq, mode, sparse, per_sample_weights=None, padding_idx=-1):
    """_embedding_bag's backward as the trace meets it, whole (a composite
    in ATen, not run before the trace): its dense case above; a sparse
    gradient stays eager's."""
    if sparse:
        return NotImplemented
    return _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                         scale_grad_by_freq, mode, per_sample_weights, padding_idx)


for _op in (aten._embedding_bag.default, aten._embedding_bag_forward_only.default):
    _TORCH_DECOMPOSITIONS[_op] = _embedding_bag
_TORCH_DECOMPOSITIONS[aten._embedding_bag_backward.default] = _embedding_bag_backward
_TORCH_DECOMPOSITIONS[aten._embedding_bag_dense_backward.default] = _embedding_bag_dense_backward
_TORCH_DECOMPOSITIONS[aten._embedding_bag_per_sample_weights_backward.default] = _embedding_bag_per_sample_weights_backward


def _cdist_forward(x1, x2, p, compute_mode=None):
    """aten._cdist_forward (torch.cdist where it does not take the matrix
    product route, aten._euclidean_dist; torch._decomp has none): the
    p-norm of every pair's difference, a reduction over the last dim. ATen's
    own choice of the product route is kept (compute_mode 1, or more than
    25 rows by default)."""
    if p == 2 and (compute_mode == 1 or not compute_mode and (x1.shape[-2] > 25 or x2.shape[-2] > 25)):
        return aten._euclidean_dist(x1, x2)
    d = (x1.unsqueeze(-2) - x2.unsqueeze(-3)).abs()
    if p == 0:
        return (d != 0).to(x1.dtype).sum(-1)
    if p == math.inf:
        return d.amax(-1)
    if p == 1:
        return d.sum(-1)
    if p == 2:
        return (d * d).sum(-1).sqrt()
    return (d ** p).sum(-1) ** (1 / p)


def _cdist_backward(grad, x1, x2, p, dist):
    """x1's gradient of _cdist_forward, ATen's formulas: the sum over x2's
    rows of grad * d dist / d x1, zero where a distance is zero (and for p 0);
    x2's is this with the two swapped. The batch dims are the broadcast
    ones, as ATen's (autograd sums them down)."""
    diff = x1.unsqueeze(-2) - x2.unsqueeze(-3)
    g, dist = grad.unsqueeze(-1), dist.unsqueeze(-1)
    if p == 0:
        term = torch.zeros_like(diff)
    elif p == 1:
        term = g * diff.sign()
    elif p == math.inf:
        term = g * diff.sign() * (diff.abs() == dist)
    elif p == 2:
        term = torch.where(dist == 0, 0, g * diff / dist)
    elif p < 2:
        term = torch.where(dist == 0, 0, g * diff.sign() * diff.abs() ** (p - 1) / dist ** (p - 1))
    else:
        term = torch.where(dist == 0, 0, g * diff * diff.abs() ** (p - 2) / dist ** (p - 1))
    return term.sum(-2)


_TORCH_DECOMPOSITIONS[aten._cdist_forward.default] = _cdist_forward
_TORCH_DECOMPOSITIONS[aten._cdist_backward.default] = _cdist_backward


def _grid_source(coords, size, padding_mode, align_corners):
    """grid_sample's source position along one axis from the grid's [-1, 1]
    coordinates, padded (border clamps, reflection folds back and clamps),
    and its derivative by the coordinate: ATen's *_set_grad helpers (zero
    at and past a clamped border, the sign flipped in a reflection). Sizes
    enter the tensors' arithmetic only (a symbolic size stays an integer)."""
    span = size - 1 if align_corners else size  # the positions [-1, 1] spans, halved below
    x = (coords + 1) * span / 2 - (0 if align_corners else 0.5)
    slope = torch.ones_like(x) * span / 2
    if padding_mode == 2:
        if span == 0:
            return torch.zeros_like(x), torch.zeros_like(x)
        low = 0 if align_corners else -0.5
        t = x - low
        sign = torch.where(t < 0, -1.0, 1.0)
        t = t.abs()
        extra, flips = torch.fmod(t, span), torch.floor(t / span)
        odd = torch.fmod(flips, 2) == 1
        x = torch.where(odd, (low - extra) + span, extra + low)
        slope = slope * torch.where(odd, -sign, sign)
    if padding_mode != 0:
        slope = torch.where((x > 0) & (x < size - 1), slope, 0)
        x = x.clamp(0, size - 1)
    return x, slope


def _grid_corners(a, grid, interpolation_mode, padding_mode, align_corners):
    """The input's values a 2-d grid sample reads, shape (N, C, H, W, K):
    the K = 4 corners around each point (bilinear) or the nearest one, zero
    outside the input; with each corner's weight and its derivatives by the
    grid's x and y, shape (N, H, W, K), and the sources' slopes."""
    n, c, h, w = a.shape
    ix, sx = _grid_source(grid[..., 0], w, padding_mode, align_corners)
    iy, sy = _grid_source(grid[..., 1], h, padding_mode, align_corners)
    if interpolation_mode == 0:
        x0, y0 = ix.floor(), iy.floor()
        fx, fy = (ix - x0).unsqueeze(-1), (iy - y0).unsqueeze(-1)
        k = torch.arange(4, device=a.device)
        dx, dy = (k % 2).to(a.dtype), (k // 2).to(a.dtype)  # the corners: (x0, y0), (x1, y0), (x0, y1), (x1, y1)
        xs, ys = x0.unsqueeze(-1) + dx, y0.unsqueeze(-1) + dy
        wx, wy = torch.where(dx == 1, fx, 1 - fx), torch.where(dy == 1, fy, 1 - fy)
        weight, dwx, dwy = wx * wy, (2 * dx - 1) * wy, (2 * dy - 1) * wx
    else:
        xs, ys = ix.round().unsqueeze(-1), iy.round().unsqueeze(-1)
        weight = torch.ones_like(xs)
        dwx = dwy = torch.zeros_like(xs)
    inside = (xs >= 0) & (xs < w) & (ys >= 0) & (ys < h)
    xi = torch.where(inside, xs, 0).to(torch.int64).unsqueeze(1)
    yi = torch.where(inside, ys, 0).to(torch.int64).unsqueeze(1)
    ni = torch.arange(n, device=a.device).view(n, 1, 1, 1, 1)
    ci = torch.arange(c, device=a.device).view(1, c, 1, 1, 1)
    index = (ni, ci, yi, xi)
    values = torch.where(inside.unsqueeze(1), a[index], 0)
    return values, index, torch.where(inside, weight, 0), dwx, dwy, sx, sy


def _grid_sampler_2d(a, grid, interpolation_mode=0, padding_mode=0, align_corners=False):
    """aten.grid_sampler_2d, bilinear and nearest: the corners' values by
    their weights, the same corners its backward below reads (torch._decomp's
    decomposition, kept for bicubic, has no backward)."""
    if interpolation_mode == 2:
        return _TORCH_GRID_SAMPLER_2D(a, grid, interpolation_mode, padding_mode, align_corners)
    values, _, weight, *_ = _grid_corners(a, grid, interpolation_mode, padding_mode, align_corners)
    return (values * weight.unsqueeze(1)).sum(-1)


def _grid_sampler_2d_backward(grad, a, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    """aten.grid_sampler_2d_backward (torch._decomp has none): the input's
    gradient adds each output's gradient into its corners by their weights
    (index_put, accumulating); the grid's sums the corners' values by the
    weights' derivatives, times the source's slope (zero for nearest)."""
    if interpolation_mode == 2:
        return NotImplemented
    values, index, weight, dwx, dwy, sx, sy = _grid_corners(a, grid, interpolation_mode, padding_mode,
                                                            align_corners)
    g = grad.unsqueeze(-1)
    grad_a = grad_grid = None
    if output_mask[0]:
        grad_a = torch.zeros_like(a).index_put(index, g * weight.unsqueeze(1), accumulate=True)
    if output_mask[1]:
        seen = (values * g).sum(1)
        grad_grid = torch.stack([(seen * dwx).sum(-1) * sx, (seen * dwy).sum(-1) * sy], -1)
    return grad_a, grad_grid


_TORCH_GRID_SAMPLER_2D = get_decompositions([aten.grid_sampler_2d])[aten.grid_sampler_2d.default]
_TORCH_DECOMPOSITIONS[aten.grid_sampler_2d.default] = _grid_sampler_2d
_TORCH_DECOMPOSITIONS[aten.grid_sampler_2d_backward.default] = _grid_sampler_2d_backward
# (cuDNN's, which torch.grid_sampler picks on the GPU for bilinear, zeros, align_corners)
_TORCH_DECOMPOSITIONS[aten.cudnn_grid_sampler.default] = lambda a, grid: _grid_sampler_2d(a, grid, 0, 0, True)
_TORCH_DECOMPOSITIONS[aten.cudnn_grid_sampler_backward.default] = (
    lambda a, grid, grad: _grid_sampler_2d_backward(grad, a, grid, 0, 0, True, (True, True)))


# --------------------------------------------------------------------------
# The table: ATen op -> polyjit ops. Each entry takes the translation context
# and the op's arguments (tensors already translated) and returns a Tensor,
# or a tuple of them for multi-output ops.
# --------------------------------------------------------------------------
ATEN: dict[Any, Callable] = {}


def _reg(*targets):
    def deco(fn):
        for t in targets:
            ATEN[t] = fn
        return fn
    return deco


# elementwise: the ATen op -> the core op of that name (unless renamed)
_RENAMED = {"erfinv": "erf_inv", "true_divide": "div"}
for _name in ("add", "sub", "mul", "div", "true_divide", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
              "logical_and", "logical_or", "logical_xor", "atan2", "remainder", "fmod", "copysign", "hypot",
              "logaddexp2", "fmax", "fmin"):
    _packet = getattr(aten, _name)
    for _ov in ("Tensor", "Scalar", "default"):
        if hasattr(_packet, _ov):
            ATEN[getattr(_packet, _ov)] = elementwise(_RENAMED.get(_name, _name))

for _name in ("neg", "abs", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "sin", "cos", "tan", "tanh", "erf",
              "erfc", "sigmoid", "floor", "ceil", "round", "reciprocal", "relu", "logical_not", "isnan",
              "isinf", "lgamma", "digamma", "exp2", "log2", "log10", "trunc", "signbit", "erfinv", "asin", "acos",
              "atan", "sinh", "cosh", "asinh", "acosh", "atanh"):
    ATEN[getattr(aten, _name).default] = elementwise(_RENAMED.get(_name, _name))


@_reg(aten.sign.default)
def _sign(cx, x):
    """PyTorch's sign of NaN is 0 (it computes (0 < x) - (x < 0)); the core op's, as NumPy's and JAX's, is NaN."""
    return ops.where(ops.isnan(x), 0.0, ops.sign(x)) if x.dtype.is_float else ops.sign(x)


for _name in ("and", "or", "xor", "not"):
    _packet = getattr(aten, "bitwise_" + _name)
    for _ov in ("Tensor", "Scalar", "default"):
        if hasattr(_packet, _ov):
            ATEN[getattr(_packet, _ov)] = logical(_name)
for _ov in (aten.bitwise_left_shift.Tensor, aten.__lshift__.Scalar, aten.__lshift__.Tensor):
    ATEN[_ov] = lambda cx, a, b: ops.shift_left(a, b)
for _ov in (aten.bitwise_right_shift.Tensor, aten.__rshift__.Scalar, aten.__rshift__.Tensor):  # (unsigned: logical)
    ATEN[_ov] = lambda cx, a, b: (ops.shift_right_logical if a.dtype.is_unsigned else ops.shift_right_arithmetic)(a, b)


@_reg(aten.add.Tensor, aten.add.Scalar)
def _add(cx, a, b, alpha=1):
    return a + (b * alpha if alpha != 1 else b)


@_reg(aten.sub.Tensor, aten.sub.Scalar)
def _sub(cx, a, b, alpha=1):
    return a - (b * alpha if alpha != 1 else b)


@_reg(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(cx, a, b, alpha=1):
    return b - (a * alpha if alpha != 1 else a)


@_reg(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(cx, a, b, rounding_mode=None):
    if rounding_mode == "floor":
        return ops.floor_divide(a, b)
    if rounding_mode == "trunc":
        return ops.trunc_divide(a, b)
    return a / b


ATEN[aten.floor_divide.default] = lambda cx, a, b: ops.floor_divide(a, b)


@_reg(aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar)
def _pow(cx, a, b):
    if isinstance(b, (int, float)) and b == 2:
        return a * a
    if isinstance(b, (int, float)) and b == 0.5:
        return ops.sqrt(a)
    return ops.pow(a, b)


@_reg(aten.round.decimals)
def _round_decimals(cx, x, decimals=0):
    """torch's rounding to decimals: scaled, rounded half to even, scaled back."""
    scale = 10.0 ** abs(decimals)
    return ops.round(x * scale) / scale if decimals >= 0 else ops.round(x / scale) * scale


ATEN[aten.clamp.default] = ATEN[aten.clamp.Tensor] = lambda cx, x, min=None, max=None: ops.clamp(x, min, max)
ATEN[aten.clamp_min.default] = lambda cx, x, v: ops.clamp(x, v)
ATEN[aten.clamp_max.default] = lambda cx, x, v: ops.clamp(x, None, v)
ATEN[aten.where.self] = lambda cx, c, a, b: ops.where(c, a, b)
ATEN[aten.where.ScalarSelf] = ATEN[aten.where.ScalarOther] = ATEN[aten.where.Scalar] = ATEN[aten.where.self]
ATEN[aten.leaky_relu.default] = lambda cx, x, slope=0.01: ops.leaky_relu(x, slope)
ATEN[aten.hardtanh.default] = lambda cx, x, lo=-1.0, hi=1.0: ops.clamp(x, lo, hi)
ATEN[prims.fma.default] = lambda cx, a, b, c: a * b + c  # (lerp's decomposition, Adam's moments)


# hardsigmoid and hardswish, and their gradients, as torch's decompositions
# compute them (in the compute type)
@_reg(aten.hardsigmoid.default)
def _hardsigmoid(cx, x):
    return ops.cast(ops.clamp(_computed(x) + 3, 0, 6) / 6, x.dtype)


@_reg(aten.hardswish.default)
def _hardswish(cx, x):
    xc = _computed(x)
    return ops.cast(xc * ops.clamp(xc + 3, 0, 6) / 6, x.dtype)


@_reg(aten.hardsigmoid_backward.default)
def _hardsigmoid_backward(cx, grad, x):
    xc = _computed(x)
    return ops.cast(ops.where((xc > -3.0) & (xc < 3.0), _computed(grad) * (1.0 / 6.0), 0.0), grad.dtype)


@_reg(aten.hardswish_backward.default)
def _hardswish_backward(cx, grad, x):
    xc, g = _computed(x), _computed(grad)
    return ops.cast(ops.where(xc <= -3, 0.0, ops.where(xc < 3, g * (xc / 3 + 0.5), g)), grad.dtype)


@_reg(prims.convert_element_type.default)
def _convert(cx, x, dtype):
    return ops.cast(x, cx.dtype(dtype))


@_reg(aten._to_copy.default, aten.clone.default, aten.alias.default, aten.detach.default,
      aten.lift_fresh_copy.default, aten.contiguous.default)
def _copy(cx, x, dtype=None, **kw):
    _same_device(cx)
    return ops.cast(x, cx.dtype(dtype)) if dtype is not None else x


@_reg(prims.device_put.default)
def _device_put(cx, x, device=None, non_blocking=False):
    _same_device(cx)  # (a constant's or a scalar's ``.to(device)``: see _transfer)
    return x


def _same_device(cx) -> None:
    """UnsupportedOpError where the node is a transfer the program cannot
    make (_transfer)."""
    why = _transfer(cx.node)
    if why:
        raise UnsupportedOpError(why)


def _transfer(node: torch.fx.Node) -> str | None:
    """Why node, a copy to another device (as traced), cannot be part of a
    compiled graph: it moves a graph input's tensor of more than one element
    (the program runs on one device). None where it can: a constant (a
    model's ``torch.tensor(window).to(device)``: transformers'
    sliding-window caches) or a scalar is read where the program runs, and
    each result is handed out on the device the trace gives it
    (CompiledGraph._results)."""
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    src, out = _node_val(node.args[0]), _node_val(node)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) or src.device == out.device \
            or src.dim() == 0 or not _reads_inputs(node.args[0]):
        return None
    return f"a device transfer inside a compiled graph ({src.device} to {out.device})"


def _reads_inputs(node: torch.fx.Node) -> bool:
    """Whether node's value depends on one of its graph's placeholders."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            return True
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return False


ATEN[aten.copy.default] = lambda cx, dst, src, non_blocking=False: ops.cast(ops.broadcast_to(src, dst.shape), dst.dtype)


# layout
@_reg(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(cx, x, shape):
    return ops.reshape(x, cx.sizes(shape))


@_reg(aten.expand.default)
def _expand(cx, x, shape, implicit=False):
    shape = list(cx.sizes(shape))
    off = len(shape) - x.ndim
    for d in range(len(shape)):
        if shape[d] == -1:
            shape[d] = x.shape[d - off]
    return ops.broadcast_to(x, shape)


ATEN[aten.permute.default] = lambda cx, x, dims: ops.permute(x, dims)
ATEN[aten.t.default] = lambda cx, x: ops.permute(x, [1, 0]) if x.ndim == 2 else x
ATEN[aten.transpose.int] = lambda cx, x, a, b: ops.transpose(x, a, b)
ATEN[aten.unsqueeze.default] = lambda cx, x, d: ops.unsqueeze(x, d)


@_reg(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(cx, x, dims=None):
    if dims is None:
        dims = [d for d, s in enumerate(x.shape) if s == 1]
    dims = [dims] if isinstance(dims, int) else dims
    return ops.squeeze(x, [d for d in dims if x.ndim and x.shape[d] == 1])


@_reg(aten.slice.Tensor)
def _slice(cx, x, dim=0, start=None, end=None, step=1):
    dim %= x.ndim
    start, end = _slice_bounds(cx, x, dim, start, end)
    starts = [0] * x.ndim
    ends = list(x.shape)
    steps = [1] * x.ndim
    starts[dim], ends[dim], steps[dim] = start, end, step
    return ops.slice(x, starts, ends, steps)


@_reg(aten.slice_scatter.default)
def _slice_scatter(cx, x, src, dim=0, start=None, end=None, step=1):
    """x with src at x[start:end:step] along dim (a slice's gradient): src
    spread by the step, padded into place, selected where it lands."""
    dim %= x.ndim
    start, _ = _slice_bounds(cx, x, dim, start, end, (3, 4))
    factors = [1] * src.ndim
    factors[dim] = step
    spread = ops.dilate(src, factors) if step != 1 else src
    lo, hi = [0] * x.ndim, [0] * x.ndim
    lo[dim], hi[dim] = start, x.shape[dim] - start - spread.shape[dim]
    if isinstance(lo[dim], int) and isinstance(hi[dim], int) and lo[dim] == hi[dim] == 0 and step == 1:
        return src
    ones = ops.full_like(src, True, DataType.Bool)
    mask = ops.pad_edges(ops.dilate(ones, factors) if step != 1 else ones, lo, hi)
    return ops.where(mask, ops.pad_edges(spread, lo, hi), x)


def _slice_bounds(cx, x, dim: int, start, end, at: tuple[int, int] = (2, 3)):
    """aten.slice's start and end along dim (arguments ``at`` of the node),
    negative and open ends resolved, and clamped into the dim as torch does."""
    n = x.shape[dim]
    start, end = cx.size(start) if start is not None else 0, cx.size(end) if end is not None else n
    if isinstance(start, ops.Tensor) or isinstance(end, ops.Tensor) or isinstance(n, ops.Tensor):
        raise UnsupportedOpError(f"{cx.target} with a bound or size from an integer argument (its result's size)")
    if isinstance(start, int) and start < 0 or isinstance(start, Lin) and _known_negative(cx, at[0], "start"):
        start = n + start
    if isinstance(end, Lin) and _known_negative(cx, at[1], "end"):
        end = n + end
    if isinstance(end, int) and not isinstance(n, Lin):
        end = n + end if end < 0 else min(end, n)
    elif isinstance(end, int) and end < 0:
        end = n + end
    elif isinstance(end, int) and end >= 2 ** 62:
        end = n
    if isinstance(n, int):
        start = min(max(start, 0), n) if isinstance(start, int) else start
        end = min(max(end, 0), n) if isinstance(end, int) else end
    return start, end


@_reg(aten.select.int)
def _select(cx, x, dim, index):
    key = [slice(None)] * x.ndim
    key[dim] = index
    return x[tuple(key)]


@_reg(aten.split.Tensor, aten.split_with_sizes.default)
def _split(cx, x, sizes, dim=0):
    dim %= x.ndim
    n = x.shape[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - k) for k in range(0, n, sizes)]
    out, start = [], 0
    for s in sizes:
        out.append(_slice(cx, x, dim, start, start + s))
        start += s
    return tuple(out)


@_reg(aten.cat.default)
def _cat(cx, xs, dim=0):
    """torch.cat leaves out 1-d empty tensors, whatever the others' rank (a
    cache that starts as ``torch.tensor([])``)."""
    kept = [x for x in xs if tuple(x.shape) != (0,)] or list(xs[:1])
    return kept[0] if len(kept) == 1 else ops.cat(kept, dim)


ATEN[aten.flip.default] = lambda cx, x, dims: ops.reverse(x, dims)


@_reg(aten.constant_pad_nd.default)
def _pad(cx, x, pad, value=0):
    """Padding, negative widths cutting (after the positive ones are added)."""
    y = ops.pad(x, [max(p, 0) for p in pad], value)
    if all(p >= 0 for p in pad):
        return y
    start, end = [0] * y.ndim, list(y.shape)
    for k in range(len(pad) // 2):
        d = y.ndim - 1 - k
        start[d], end[d] = max(-pad[2 * k], 0), end[d] - max(-pad[2 * k + 1], 0)
    return ops.slice(y, start, end)


def _diagonal_cells(x, offset, dim1, dim2):
    """A diagonal's place: x permuted (dim1 and dim2 last) and those two
    merged, the diagonal a strided slice of them: (flat, perm, count, start, step)."""
    d1, d2 = dim1 % x.ndim, dim2 % x.ndim
    n, m = x.shape[d1], x.shape[d2]
    if not isinstance(n, int) or not isinstance(m, int):
        raise UnsupportedOpError("diagonal over symbolic sizes")
    perm = [d for d in range(x.ndim) if d not in (d1, d2)] + [d1, d2]
    flat = ops.reshape(ops.permute(x, perm), [x.shape[d] for d in perm[:-2]] + [n * m])
    count = max(0, min(n, m - offset) if offset >= 0 else min(n + offset, m))
    start = 0 if not count else offset if offset >= 0 else -offset * m
    return flat, perm, count, start, m + 1


@_reg(aten.diagonal.default)
def _diagonal(cx, x, offset=0, dim1=0, dim2=1):
    flat, _, count, start, step = _diagonal_cells(x, offset, dim1, dim2)
    lead = list(flat.shape[:-1])
    return ops.slice(flat, [0] * len(lead) + [start], lead + [start + max(count - 1, 0) * step + min(count, 1)],
                     [1] * len(lead) + [step])


@_reg(aten.diagonal_scatter.default)
def _diagonal_scatter(cx, x, src, offset=0, dim1=0, dim2=1):
    """x with src on the diagonal: src spread by the diagonal's step (a
    dilation) and padded into place, selected where it lands."""
    flat, perm, count, start, step = _diagonal_cells(x, offset, dim1, dim2)
    if count == 0:
        return x
    factors = [1] * (src.ndim - 1) + [step]
    spread = ops.dilate(src, factors)
    widths = [start, flat.shape[-1] - start - spread.shape[-1]]
    mask = ops.pad(ops.dilate(ops.full_like(src, True, DataType.Bool), factors), widths)
    y = ops.where(mask, ops.pad(spread, widths), flat)
    y = ops.reshape(y, [x.shape[d] for d in perm])
    return ops.permute(y, [perm.index(d) for d in range(x.ndim)])


@_reg(aten.cummax.default, aten.cummin.default)
def _cummax(cx, x, dim):
    """Running maximum (minimum) and where it was last reached (NaN once
    seen stays, at the latest NaN), as torch's cummax gives them."""
    v = ops.cumulative("max" if cx.target is aten.cummax.default else "min", x, dim)
    if x.ndim == 0:
        return v, ops.zeros_like(ops.cast(x, DataType.Int))
    hit = x == v
    if x.dtype.is_float:
        hit = ops.logical_or(hit, ops.isnan(x))
    return v, ops.cumulative("max", ops.where(hit, ops.iota(x.shape, dim, like=x), -1), dim)


# reductions
def _dims(x, dims):
    """A reduction's dims: none given (None, [] or ()) means all of them, as in torch."""
    if dims is None or isinstance(dims, (list, tuple)) and not dims:
        return None
    return [dims] if isinstance(dims, int) else list(dims)


def _in(cx, x, dtype):
    """x in the dtype a reduction's ``dtype=`` asks for (None: its own)."""
    return ops.cast(x, cx.dtype(dtype)) if dtype is not None else x


ATEN[aten.sum.dim_IntList] = ATEN[aten.sum.default] = lambda cx, x, dims=None, keepdim=False, dtype=None: ops.sum(
    _in(cx, x, dtype), _dims(x, dims), keepdim)
ATEN[aten.mean.dim] = ATEN[aten.mean.default] = lambda cx, x, dims=None, keepdim=False, dtype=None: ops.mean(
    _in(cx, x, dtype), _dims(x, dims), keepdim)


ATEN[aten.amax.default] = lambda cx, x, dims=(), keepdim=False: ops.max(x, _dims(x, dims), keepdim)
ATEN[aten.amin.default] = lambda cx, x, dims=(), keepdim=False: ops.min(x, _dims(x, dims), keepdim)
ATEN[aten.prod.dim_int] = lambda cx, x, dim, keepdim=False, dtype=None: ops.prod(
    x, [dim], keepdim, cx.dtype(dtype) if dtype is not None else None)
ATEN[aten.prod.default] = lambda cx, x, dtype=None: ops.prod(x, None, False, cx.dtype(dtype) if dtype is not None else None)
ATEN[aten.argmax.default] = lambda cx, x, dim=None, keepdim=False: ops.argmax(
    x if dim is not None else ops.reshape(x, [-1]), dim if dim is not None else 0, keepdim)
ATEN[aten.argmin.default] = lambda cx, x, dim=None, keepdim=False: ops.argmin(
    x if dim is not None else ops.reshape(x, [-1]), dim if dim is not None else 0, keepdim)
ATEN[aten.max.dim] = lambda cx, x, dim, keepdim=False: (ops.max(x, [dim], keepdim), ops.argmax(x, dim, keepdim))
ATEN[aten.min.dim] = lambda cx, x, dim, keepdim=False: (ops.min(x, [dim], keepdim), ops.argmin(x, dim, keepdim))
ATEN[aten.max.default] = lambda cx, x: ops.max(x)
ATEN[aten.min.default] = lambda cx, x: ops.min(x)
ATEN[aten.any.dim] = ATEN[aten.any.dims] = lambda cx, x, dim=None, keepdim=False: ops.reduce_any(
    x, _dims(x, dim), keepdim)
ATEN[aten.all.dim] = ATEN[aten.all.dims] = lambda cx, x, dim=None, keepdim=False: ops.reduce_all(
    x, _dims(x, dim), keepdim)
ATEN[aten.any.default] = lambda cx, x: ops.reduce_any(x)
ATEN[aten.all.default] = lambda cx, x: ops.reduce_all(x)
ATEN[aten.cumsum.default] = lambda cx, x, dim, dtype=None: ops.cumsum(_in(cx, x, dtype), dim)
ATEN[aten.sort.default] = lambda cx, x, dim=-1, descending=False: ops.sort(x, dim, descending)
ATEN[aten.sort.stable] = lambda cx, x, *, stable=None, dim=-1, descending=False: ops.sort(x, dim, descending)
ATEN[aten.topk.default] = lambda cx, x, k, dim=-1, largest=True, sorted=True: ops.topk(x, k, dim, largest)
ATEN[aten.cumprod.default] = lambda cx, x, dim, dtype=None: ops.cumprod(_in(cx, x, dtype), dim)
ATEN[aten.logcumsumexp.default] = lambda cx, x, dim: ops.cumulative("logsumexp", x, dim)


@_reg(aten.var_mean.correction, aten.var.correction)
def _var_mean(cx, x, dims=None, correction=None, keepdim=False):
    dims = _dims(x, dims)
    corr = 1 if correction is None else correction
    v, m = ops.var_mean(x, dims, corr, keepdim)
    return (v, m) if cx.target is aten.var_mean.correction else v


# contractions
ATEN[aten.mm.default] = lambda cx, a, b: ops.matmul(a, b)
ATEN[aten.bmm.default] = lambda cx, a, b: ops.matmul(a, b)
ATEN[aten.dot.default] = lambda cx, a, b: ops.sum(a * b)


def _per_dim(v, nsp: int, fill: int = 0) -> list[int]:
    """A convolution's or a pooling's stride, padding, dilation... with one
    entry per spatial dim: ATen repeats a single entry (``padding="valid"``
    gives [0]), and an empty list is fill in every dim."""
    return [fill] * nsp if not v else list(v) * nsp if len(v) == 1 else list(v)


@_reg(aten.convolution.default)
def _convolution(cx, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    nsp = x.ndim - 2
    letters = "DHW"[-nsp:] if nsp <= 3 else None
    if letters is None:
        raise UnsupportedOpError(f"{nsp}-d convolution")
    stride, padding, dilation, output_padding = (_per_dim(v, nsp) for v in (stride, padding, dilation,
                                                                            output_padding))
    if transposed:  # the adjoint of the convolution by w, at the sizes it would have taken
        sizes = [(x.shape[2 + i] - 1) * s - 2 * p + d * (k - 1) + o + 1
                 for i, (s, p, d, k, o) in enumerate(zip(stride, padding, dilation, w.shape[2:], output_padding))]
        y = ops.conv_input_grad(x, w, sizes, list(stride), [(p, p) for p in padding], list(dilation), groups,
                                "NC" + letters, "OI" + letters)
    else:
        y = ops.conv(x, w, list(stride), [(p, p) for p in padding], list(dilation), groups,
                     "NC" + letters, "OI" + letters)
    if bias is not None:
        y = y + ops.reshape(bias, [1, -1] + [1] * nsp)
    return y


@_reg(aten.convolution_backward.default)
def _convolution_backward(cx, grad, x, w, bias_sizes, stride, padding, dilation, transposed,
                          output_padding, groups, output_mask):
    """Gradients of a convolution, as convolutions (dilated, flipped, transposed).
    A transposed convolution's are those of the convolution it is the adjoint
    of: its input gradient a strided convolution of the gradient, its weight
    gradient the same as a convolution's with input and gradient swapped."""
    nsp = x.ndim - 2
    letters = "DHW"[-nsp:]
    stride, padding, dilation = (_per_dim(v, nsp) for v in (stride, padding, dilation))
    ks = list(w.shape[2:])
    gx = gw = gb = None
    if output_mask[0] and transposed:
        gx = ops.conv(grad, w, list(stride), [(p, p) for p in padding], list(dilation), groups,
                      "NC" + letters, "OI" + letters)
    elif output_mask[0]:
        gx = ops.conv_input_grad(grad, w, list(x.shape[2:]), list(stride), [(p, p) for p in padding],
                                 list(dilation), groups, "NC" + letters, "OI" + letters)
    if output_mask[1]:
        a, b = (grad, x) if transposed else (x, grad)
        gw = ops.conv_weight_grad(a, b, ks, list(stride), [(p, p) for p in padding], list(dilation),
                                  "NC" + letters, "OI" + letters, groups)
    if output_mask[2]:
        gb = ops.sum(grad, [0] + list(range(2, 2 + nsp)))
    return gx, gw, gb


# pooling
def _window_args(x, nsp: int, kernel, stride, padding, dilation, ceil_mode):
    """Kernel, strides, (low, high) padding and dilation of an nsp-d pooling
    over x's trailing dims. With ceil_mode, a last window that starts inside
    the image or its low padding pads the high side further. A single
    window longer than the padded image (EfficientNet's pooler: 1280 cells
    over 2) is cut to it: the cells past it are padding, which changes
    neither the window's max, nor its sum, nor torch's count."""
    k = _per_dim(kernel, nsp, 1)
    s, d = _per_dim(stride, nsp, 1) if stride else list(k), _per_dim(dilation, nsp, 1)
    pads = [(p, p) for p in _per_dim(padding, nsp)]
    if ceil_mode:
        spatial = list(x.shape[-nsp:])
        if not all(isinstance(n, int) for n in spatial):
            raise UnsupportedOpError("pooling with ceil_mode=True over symbolic sizes")
        for i, (n, kk, ss, (p, _), dd) in enumerate(zip(spatial, k, s, pads, d)):
            reach = n + 2 * p - dd * (kk - 1) - 1
            out = -(-reach // ss) + 1
            out -= (out - 1) * ss >= n + p  # torch's rule: no window starts in the high padding
            pads[i] = (p, p + max(0, (out - 1) * ss - reach))
            if out == 1 and dd == 1 and kk > n + 2 * p:  # (its stride then the window's: a window that tiles)
                k[i] = s[i] = n + 2 * p
                pads[i] = (p, p)
    return k, s, pads, d


def _max_pool(nsp: int):
    def rule(cx, x, kernel, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
        k, s, p, d = _window_args(x, nsp, kernel, stride, padding, dilation, ceil_mode)
        return ops.max_pool_with_positions(x, k, s, p, d)
    return rule


def _max_pool_backward(nsp: int):
    def rule(cx, grad, x, kernel, stride, padding, dilation, ceil_mode, indices):
        k, s, p, d = _window_args(x, nsp, kernel, stride, padding, dilation, ceil_mode)
        return ops.max_pool_grad(grad, indices, list(x.shape), k, s, p, d)
    return rule


def _avg_divisor(x, k, s, pads, count_include_pad, divisor_override):
    """What average pooling divides each window's sum by: a number, or per
    window the cells inside the image and, with count_include_pad, its
    declared padding (never the cells ceil_mode adds past it)."""
    if divisor_override:
        return float(divisor_override)
    declared, extra = [a for a, _ in pads], [b - a for a, b in pads]
    if not any(extra) and (count_include_pad or not any(declared)):
        return float(math.prod(k))
    lead = x.ndim - len(k)
    counted = [(0, 0)] * lead + [(a, a) for a in declared] if count_include_pad else None
    return ops.window_cells(x, [1] * lead + k, [1] * lead + s, [(0, 0)] * lead + list(pads), counted)


def _window_sum(x, k, s, pads):
    lead = x.ndim - len(k)
    return ops.reduce_window("sum", x, [1] * lead + k, [1] * lead + s, [(0, 0)] * lead + list(pads))


def _avg_pool(nsp: int):
    def rule(cx, x, kernel, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True, divisor_override=None):
        k, s, p, _ = _window_args(x, nsp, kernel, stride, padding, (1,), ceil_mode)
        return _window_sum(x, k, s, p) / _avg_divisor(x, k, s, p, count_include_pad, divisor_override)
    return rule


def _avg_pool_backward(nsp: int):
    def rule(cx, grad, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override=None):
        """Each window's gradient, divided as the forward divided, to every cell of the window."""
        k, s, p, _ = _window_args(x, nsp, kernel, stride, padding, (1,), ceil_mode)
        g = grad / _avg_divisor(x, k, s, p, count_include_pad, divisor_override)
        return ops.window_sum_adjoint(g, list(x.shape), k, s, p)
    return rule


for _n, _ops in ((2, (aten.max_pool2d_with_indices, aten.max_pool2d_with_indices_backward, aten.avg_pool2d,
                      aten.avg_pool2d_backward)),
                 (3, (aten.max_pool3d_with_indices, aten.max_pool3d_with_indices_backward, aten.avg_pool3d,
                      aten.avg_pool3d_backward))):
    for _packet, _rule in zip(_ops, (_max_pool, _max_pool_backward, _avg_pool, _avg_pool_backward)):
        ATEN[_packet.default] = _rule(_n)
for _packet in (aten._adaptive_avg_pool2d, aten._adaptive_avg_pool3d):
    ATEN[_packet.default] = lambda cx, x, size: ops.adaptive_avg_pool(x, cx.sizes(size))
for _packet in (aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d_backward):
    ATEN[_packet.default] = lambda cx, grad, x: ops.adaptive_avg_pool_grad(grad, list(x.shape))
for _packet in (aten.adaptive_max_pool2d, aten.adaptive_max_pool3d):
    ATEN[_packet.default] = lambda cx, x, size: ops.adaptive_max_pool_with_positions(x, cx.sizes(size))
for _packet, _n in ((aten.adaptive_max_pool2d_backward, 2), (aten.adaptive_max_pool3d_backward, 3)):
    ATEN[_packet.default] = (lambda n: lambda cx, grad, x, indices: ops.positions_grad(grad, indices, list(x.shape), n))(_n)


def _strided_positions(cx, x, size, stride, storage_offset):
    """Where an as_strided view of x's elements lies: None where the view is
    x's own elements in row-major order (a reshape), else the int64 positions
    in x's flat elements, of the view's shape."""
    src = _node_val(cx.node.args[0])
    if not isinstance(src, torch.Tensor) or not src.is_contiguous() or src.storage_offset() != 0:
        raise UnsupportedOpError(f"{cx.target} of a tensor that is not contiguous")
    size, stride, offset = [cx.size(v) for v in size], [int(v) for v in stride], int(storage_offset or 0)
    if not all(isinstance(v, int) for v in list(size) + list(x.shape)):
        raise UnsupportedOpError(f"{cx.target} over symbolic sizes")
    row_major = [math.prod(size[d + 1:]) for d in range(len(size))]
    if offset == 0 and math.prod(size) == math.prod(x.shape) and \
            all(a == b for a, b, n in zip(stride, row_major, size) if n != 1):
        return size, None
    at = ops.full_like(ops.reshape(x, [-1])[0:1], offset, "int64")
    at = ops.reshape(at, [1] * len(size)) if size else ops.reshape(at, [])
    for d, st in enumerate(stride):
        at = at + ops.iota(size, d, like=x) * st
    return size, at


@_reg(aten.as_strided.default)
def _as_strided(cx, x, size, stride, storage_offset=None):
    """A strided view of a contiguous tensor's elements (group norm's
    backward takes one): a reshape when the strides are row-major, else a
    take at the positions the strides name."""
    size, at = _strided_positions(cx, x, size, stride, storage_offset)
    return ops.reshape(x, size) if at is None else ops.take(ops.reshape(x, [-1]), at, 0)


@_reg(aten.as_strided_scatter.default)
def _as_strided_scatter(cx, x, src, size, stride, storage_offset=None):
    """x with src written through an as_strided view of it (what
    functionalization makes of an in-place update of such a view): src's
    elements scattered to the view's positions in x's flat elements."""
    size, at = _strided_positions(cx, x, size, stride, storage_offset)
    src = ops.cast(src, x.dtype)
    if at is None:
        return ops.reshape(src, list(x.shape))
    flat = ops.scatter(ops.reshape(x, [-1]), ops.reshape(at, [-1]), ops.reshape(src, [-1]), 0)
    return ops.reshape(flat, list(x.shape))


def _flat_index(shape, indices, what: str):
    """The index tensors of x[..., i, j, ...] on consecutive dimensions as one
    row-major position over them: (first dimension, last, how many positions
    those dimensions hold, position)."""
    dims = [d for d, i in enumerate(indices) if i is not None]
    if not dims or dims != list(range(dims[0], dims[-1] + 1)):
        raise UnsupportedOpError(f"{what} with index tensors on dimensions that are not consecutive")
    flat = None
    for d in dims:
        i = ops.cast(indices[d], "int64")
        i = ops.where(i < 0, i + shape[d], i)
        flat = i if flat is None else flat * shape[d] + i
    return dims[0], dims[-1], sz.product(shape[d] for d in dims), flat


def _separable_index(shape, indices) -> list | None:
    """The index tensors of x[..., i, j, ...] on consecutive dimensions where
    each varies along its own axis of their broadcast shape, in order (an
    upsampling's rows and columns): [(dimension, its 1-d index)], a take
    along each dimension in turn; None otherwise."""
    dims = [d for d, i in enumerate(indices) if i is not None]
    if len(dims) < 2 or dims != list(range(dims[0], dims[-1] + 1)):
        return None
    takes = []
    for t, d in enumerate(dims):
        i = indices[d]
        if i.dtype == DataType.Bool or i.ndim > len(dims):
            return None
        along = [1] * (len(dims) - i.ndim) + list(i.shape)  # (right-aligned, as they broadcast)
        if any(not sz.is_static(n) or (a != t and int(n) != 1) for a, n in enumerate(along)):
            return None
        takes.append((d, ops.reshape(i, [along[t]])))
    return takes


@_reg(aten.index.Tensor, aten._unsafe_index.Tensor)
def _index(cx, x, indices):
    """x[..., i, j, ...] with index tensors on consecutive dimensions (what
    upsampling and reflection padding decompose into): a take along each
    dimension where each index varies along its own axis (rows and columns:
    no position divided back into them per element), else one take over
    those dimensions flattened, at the row-major position the indices name."""
    shape = list(x.shape)
    takes = _separable_index(shape, indices)
    if takes is not None:
        for d, i in takes:
            x = ops.take(x, i, d)
        return x
    first, last, n, flat = _flat_index(shape, indices, "aten.index")
    return ops.take(ops.reshape(x, shape[:first] + [n] + shape[last + 1:]), flat, first)


def _mutates_input(node: torch.fx.Node) -> bool:
    """Whether ``copy_`` node writes a graph input that nothing reads after
    it: an input mutation AOTAutograd keeps in the graph (a later read would
    see the value before the copy)."""
    return node.args[0].op == "placeholder" and not node.users


@_reg(aten.copy_.default)
def _copy_(cx, into, src, non_blocking=False):
    """``copy_`` into a graph input (a batch norm's running statistics): the
    value is an output, copied into the argument after the call, all of
    them together (CompiledGraph: _copy_into)."""
    if not _mutates_input(cx.node):
        raise UnsupportedOpError("copy_ into a tensor that is not a graph input, or read after it")
    if isinstance(src, ops.Tensor):
        value = ops.broadcast_to(ops.cast(src, into.dtype), list(into.shape))
    else:
        value = ops.full(list(into.shape), src, into.dtype, like=into)
    cx.graph.add_output(value.node)
    cx.mutations.append((cx.placeholders[cx.node.args[0]], len(cx.graph.outputs) - 1))
    return into


@_reg(aten.index_put.default, aten._unsafe_index_put.default)
def _index_put(cx, x, indices, values, accumulate=False):
    """x with values at x[..., i, j, ...] (``x[i] = v``, a cache's update):
    added (accumulate=True: the backward of indexing), or written, where a
    position named twice takes the last of its values (eager leaves the
    winner undefined)."""
    shape = list(x.shape)
    masks = [d for d, i in enumerate(indices) if i is not None and i.dtype == DataType.Bool]
    if masks:  # x[mask] = v: one value for every selected element, else their number depends on the mask
        d = masks[0]
        mask = indices[d]
        if len(masks) > 1 or any(i is not None for i in indices[d + 1:]) or not all(
                sz.is_static(n) and int(n) == 1 for n in values.shape):
            raise UnsupportedOpError("index_put with a boolean mask and more than one value")
        mask = ops.broadcast_in_dim(mask, shape, list(range(d, d + mask.ndim)))
        v = ops.broadcast_to(ops.cast(ops.reshape(values, []), x.dtype), shape)
        return x + ops.where(mask, v, ops.zeros_like(v)) if accumulate else ops.where(mask, v, x)
    first, last, n, flat = _flat_index(shape, indices, "aten.index_put")
    lead, rest = shape[:first], shape[last + 1:]
    m = sz.product(flat.shape)
    v = ops.reshape(ops.broadcast_to(ops.cast(values, x.dtype), lead + list(flat.shape) + rest), lead + [m] + rest)
    if accumulate:
        added = ops.scatter_add(lead + [n] + rest, ops.reshape(flat, [-1]), v, first)
        return x + ops.reshape(ops.cast(added, x.dtype), shape)
    at = ops.broadcast_in_dim(ops.reshape(flat, [m]), lead + [m] + rest, [first])
    return ops.reshape(ops.scatter(ops.reshape(x, lead + [n] + rest), at, v, first), shape)


# indexing
ATEN[aten.gather.default] = lambda cx, x, dim, index, sparse_grad=False: ops.take_along_axis(x, index, dim)
ATEN[aten.index_select.default] = lambda cx, x, dim, index: ops.index_select(x, dim, index)
ATEN[aten.embedding.default] = lambda cx, w, index, *rest: ops.index_select(w, 0, index)


@_reg(aten.scatter_add.default)
def _scatter_add(cx, x, dim, index, src):
    return ops.scatter_combine(x, "sum", index, src, dim)


ATEN[aten.scatter.src] = lambda cx, x, dim, index, src: ops.scatter(x, index, src, dim)


@_reg(aten._assert_async.msg, aten._assert_async.default)
def _assert_async(cx, cond, msg="Expected a true condition (torch._assert_async)"):
    """A condition on values (one_hot's class range): the compiled graph
    returns it and the call raises where it is false, as eager does."""
    cx.asserts.append((ops.cast(cond, DataType.Bool), msg))


if hasattr(aten, "_assert_tensor_metadata"):  # torch.export's check of a value's dtype, device and layout before a
    # conversion (some torch versions): what the graph was traced with, and so what it compiles for
    ATEN[aten._assert_tensor_metadata.default] = lambda cx, *args, **kwargs: None


@_reg(aten.scatter_reduce.two)
def _scatter_reduce(cx, x, dim, index, src, reduce, include_self=True):
    """sum, prod, mean, amax, amin of src's values at each index, with x's
    own value (include_self) or in its place where an index hits."""
    op = {"sum": "sum", "mean": "sum", "prod": "prod", "amax": "max", "amin": "min"}[reduce]
    if include_self and reduce != "mean":
        return ops.scatter_combine(x, op, index, src, dim)
    got = ops.scatter_reduce(op, list(x.shape), index, src, dim, along=True)
    hits = ops.scatter_add(list(x.shape), index, ops.full_like(index, 1, DataType.Int), dim, along=True)
    if reduce == "mean":
        total, count = (got + x, hits + 1) if include_self else (got, ops.maximum(hits, ops.full_like(hits, 1)))
        got = total / ops.cast(count, x.dtype) if x.dtype.is_float else ops.floor_divide(total, ops.cast(count, x.dtype))
        if include_self:
            return got
    return ops.where(hits > 0, got, x)  # x where no index hits


@_reg(aten.scatter.value)
def _scatter_value(cx, x, dim, index, value):
    hits = ops.scatter_add(list(x.shape), index, ops.full_like(index, 1, DataType.Int32), dim, along=True)
    return ops.where(hits > 0, value, x)


@_reg(aten.index_add.default)
def _index_add(cx, x, dim, index, src, alpha=1):
    return x + ops.scatter_add(list(x.shape), index, src * alpha if alpha != 1 else src, dim)


# Composites AOTAutograd traces whole (left out of both tables of
# decompositions): lowered here in one step, where tracing torch's
# decompositions costs a node and a fake-tensor dispatch per part, and their
# parts fuse all the same. Layer norm and softmax are whole only without a
# backward: the min-cut partition recomputes none of these composites but
# GELU, so it would save a whole layer norm's output (a following product's
# weight gradient reads it) and a whole softmax's transpose beside the
# softmax, where it recomputes a decomposed one's from what it saves anyway.
# A product with a bias (addmm) is whole only without a backward, too: see
# _addmm_in_parts. Batch norm is whole in training as well: min-cut then
# saves its output beside its input for the activation after it, where it
# would recompute a decomposed one's, but its decompositions, forward and
# backward, were most of a CNN's joint graph.
WHOLE = (aten.native_layer_norm_backward, aten.gelu, aten.gelu_backward, aten.hardswish, aten.hardswish_backward,
         aten.hardsigmoid, aten.hardsigmoid_backward, aten._native_batch_norm_legit_no_training,
         aten._native_batch_norm_legit_functional, aten.native_batch_norm_backward)
WHOLE_IN_INFERENCE = (*WHOLE, aten.addmm, aten.native_layer_norm, aten._softmax, aten._log_softmax)


def _computed(x):
    """x in its compute type (the half types in float32, as torch's decompositions compute them)."""
    return ops.cast(x, x.dtype.compute)


@_reg(aten.addmm.default)
def _addmm(cx, bias, a, b, beta=1, alpha=1):
    out = ops.matmul(a, b) if alpha == 1 else ops.matmul(a, b) * alpha
    return out if beta == 0 else out + (bias if beta == 1 else bias * beta)  # (beta 0 ignores bias: NaN too)


@_reg(aten.native_layer_norm.default)
def _native_layer_norm(cx, x, normalized_shape, weight, bias, eps):
    """The normalized x, and the mean and 1/deviation torch returns with it
    (of the node's dtypes: the input's on the CPU for the half types)."""
    parts = ops.layer_norm_with_statistics(_computed(x), normalized_shape, weight, bias, eps)
    return tuple(ops.cast(v, cx.dtype(t.dtype)) for v, t in zip(parts, _node_val(cx.node)))


def _softmax_rule(softmax: Callable) -> Callable:
    """aten._softmax's or _log_softmax's rule: of the node's dtype, which
    half_to_float makes float32 for a half type's input."""
    def rule(cx, x, dim, half_to_float=False):
        xc = _computed(x)  # (a 0-dim tensor's softmax: over its one element)
        y = softmax(xc, dim % x.ndim) if x.ndim else softmax(ops.unsqueeze(xc, 0), 0)[0]
        return ops.cast(y, cx.dtype(_node_val(cx.node).dtype))
    return rule


@_reg(aten.native_layer_norm_backward.default)
def _native_layer_norm_backward(cx, grad, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    """The gradients of native_layer_norm's input, weight and bias that
    output_mask asks for, from the mean and 1/deviation its forward saved."""
    inner = list(range(x.ndim - len(normalized_shape), x.ndim))
    outer = list(range(x.ndim - len(normalized_shape)))
    g = _computed(grad)
    x_hat = (_computed(x) - _computed(mean)) * _computed(rstd)
    g_hat = g * _computed(weight) if weight is not None else g
    over_outer = (lambda v: ops.sum(v, outer)) if outer else (lambda v: v)  # (a weight's and a bias's)
    parts = (_computed(rstd) * (g_hat - ops.mean(g_hat, inner, keepdim=True)
                                - x_hat * ops.mean(x_hat * g_hat, inner, keepdim=True)),
             over_outer(g * x_hat) if weight is not None else None,
             over_outer(g) if bias is not None else None)
    return tuple(ops.cast(v, cx.dtype(t.dtype)) if wanted and v is not None else None
                 for v, t, wanted in zip(parts, _node_val(cx.node), output_mask))


@_reg(aten._weight_norm_interface_backward.default)
def _weight_norm_interface_backward(cx, grad, v, g, norms, dim):
    """The gradients of weight_norm's direction v and magnitude g (w = v g /
    |v|, the norm over every dim but dim; over all of them for dim -1), from
    the norms its forward saved, as ATen computes them."""
    others = list(range(v.ndim)) if dim == -1 else [d for d in range(v.ndim) if d != dim % v.ndim]
    grad, v, g, norms = (_computed(t) for t in (grad, v, g, norms))
    sums = ops.reshape(ops.sum(grad * v, others, keepdim=True), list(norms.shape))
    gv = g / norms * (grad - v * (sums / (norms * norms)))
    return tuple(ops.cast(t, cx.dtype(o.dtype)) for t, o in zip((gv, sums / norms), _node_val(cx.node)))


def _per_channel(v, x):
    """A vector of x's channels (dim 1), shaped to broadcast against x."""
    return ops.reshape(v, [v.shape[0]] + [1] * (x.ndim - 2))


def _per_channel_count(x):
    """How many of x's elements a channel has: a number, or a 0-dim tensor
    where a size is symbolic."""
    sizes = [x.shape[0], *x.shape[2:]]
    if all(sz.is_static(s) for s in sizes):
        return math.prod(int(s) for s in sizes)
    return functools.reduce(operator.mul, [ops.full([], s, x.dtype.compute, like=x) for s in sizes])


def _batch_norm(x, weight, bias, mean, invstd):
    """(x - mean) * invstd * weight + bias per channel, in x's compute type:
    the ops of torch's decompositions (fold_scales folds them into a
    convolution before them)."""
    y = (_computed(x) - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        y = y * _per_channel(_computed(weight), x)
    return y + _per_channel(_computed(bias), x) if bias is not None else y


@_reg(aten._native_batch_norm_legit_no_training.default)
def _batch_norm_by_running_statistics(cx, x, weight, bias, running_mean, running_var, momentum, eps):
    """Batch norm in eval mode. The node's other two values are empty on the
    CPU and the mean and 1/deviation elsewhere, as torch's are."""
    mean, invstd = _computed(running_mean), 1 / ops.sqrt(_computed(running_var) + eps)
    vals = _node_val(cx.node)
    saved = [ops.full([0], 0, cx.dtype(t.dtype), like=x) if t.shape[0] == 0 else ops.cast(v, cx.dtype(t.dtype))
             for v, t in zip((mean, invstd), vals[1:])]
    return (ops.cast(_batch_norm(x, weight, bias, mean, invstd), cx.dtype(vals[0].dtype)), *saved)


@_reg(aten._native_batch_norm_legit_functional.default)
def _batch_norm_in_training(cx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    """Batch norm by the batch's statistics: the normalized x, the batch's
    mean and 1/deviation, and the running statistics updated (the variance's
    with Bessel's correction)."""
    vals = _node_val(cx.node)
    if not training:
        return (*_batch_norm_by_running_statistics(cx, x, weight, bias, running_mean, running_var, momentum, eps),
                ops.cast(running_mean, cx.dtype(vals[3].dtype)), ops.cast(running_var, cx.dtype(vals[4].dtype)))
    dims = [0, *range(2, x.ndim)]
    var, mean = ops.var_mean(_computed(x), dims, 0)
    invstd = ops.rsqrt(var + eps)
    n = _per_channel_count(x)
    parts = (_batch_norm(x, weight, bias, mean, invstd), mean, invstd,
             momentum * mean + (1 - momentum) * _computed(running_mean),
             momentum * (var * (n / (n - 1))) + (1 - momentum) * _computed(running_var))
    return tuple(ops.cast(v, cx.dtype(t.dtype)) for v, t in zip(parts, vals))


@_reg(aten.native_batch_norm_backward.default)
def _batch_norm_backward(cx, grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                         output_mask):
    """The gradients of batch norm's input, weight and bias that output_mask
    asks for, as torch's decomposition computes them: in training from the
    batch's statistics its forward saved, in eval mode from the running
    ones."""
    g = _computed(grad)
    if train:
        mean, invstd = _computed(save_mean), _computed(save_invstd)
    else:
        mean, invstd = _computed(running_mean), ops.rsqrt(_computed(running_var) + eps)
    dims = [0, *range(2, x.ndim)]
    centered = _computed(x) - _per_channel(mean, x)
    grad_sum, dot_p = ops.sum(g, dims), ops.sum(g * centered, dims)
    scale = _per_channel(invstd * _computed(weight) if weight is not None else invstd, x)
    if train:
        norm = 1.0 / _per_channel_count(x)
        proj = centered * _per_channel(dot_p * norm * (invstd * invstd), x)
        grad_input = (g - proj - _per_channel(grad_sum * norm, x)) * scale
    else:
        grad_input = g * scale
    return tuple(ops.cast(v, cx.dtype(t.dtype)) if wanted else None
                 for v, t, wanted in zip((grad_input, dot_p * invstd, grad_sum), _node_val(cx.node), output_mask))


ATEN[aten.gelu.default] = lambda cx, x, approximate="none": ops.cast(ops.gelu(_computed(x), approximate), x.dtype)
ATEN[aten.gelu_backward.default] = lambda cx, grad, x, approximate="none": ops.cast(
    _computed(grad) * ops.gelu_grad(_computed(x), approximate), cx.dtype(_node_val(cx.node).dtype))
ATEN[aten._softmax.default] = _softmax_rule(ops.softmax)
ATEN[aten._log_softmax.default] = _softmax_rule(ops.log_softmax)


@_reg(aten._transformer_encoder_layer_fwd.default)
def _encoder_layer(cx, src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu, norm_first,
                   eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1,
                   ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    """nn.TransformerEncoderLayer's inference fast path (batch first, no
    grad) as the layer's own steps, translated here rather than decomposed
    in AOTAutograd's trace, which costs a traced dispatch per step. A mask
    is added to the scores (a float mask, -inf where masked) or masks them
    (a boolean one): mask_type 1, a key padding mask (batch, keys); 0, an
    attention mask (queries, keys); 2, both merged (batch, heads, queries, keys)."""
    if src.ndim != 3:
        raise UnsupportedOpError(f"{cx.target} of a {src.ndim}-d input")
    b, t, e = src.shape
    d = embed_dim // num_heads
    if mask is not None and mask_type == 1:
        mask = ops.reshape(mask, (b, 1, 1, t))

    def in_compute_type(fn, x, *args):
        return ops.cast(fn(_computed(x), *args), x.dtype)  # (the half types: as torch's kernels compute them)

    def attention(x):
        qkv = ops.permute(ops.reshape(ops.linear(x, qkv_weight, qkv_bias), (b, t, 3, num_heads, d)), (2, 0, 3, 1, 4))
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = ops.matmul(q, ops.transpose(k, -2, -1)) * d ** -0.5
        if mask is not None:
            scores = ops.where(mask, float("-inf"), scores) if mask.dtype == DataType.Bool else scores + mask
        a = ops.matmul(in_compute_type(ops.softmax, scores, -1), v)
        return ops.linear(ops.reshape(ops.transpose(a, 1, 2), (b, t, e)), proj_weight, proj_bias)

    def feed_forward(x):
        h = ops.linear(x, ffn_weight_1, ffn_bias_1)
        return ops.linear(in_compute_type(ops.gelu, h) if use_gelu else ops.relu(h), ffn_weight_2, ffn_bias_2)

    def norm(x, w, bias):
        return in_compute_type(ops.layer_norm, x, (e,), w, bias, eps)
    if norm_first:
        x = src + attention(norm(src, norm_weight_1, norm_bias_1))
        return x + feed_forward(norm(x, norm_weight_2, norm_bias_2))
    x = norm(src + attention(src), norm_weight_1, norm_bias_1)
    return norm(x + feed_forward(x), norm_weight_2, norm_bias_2)


def _attention_scale(query, scale, dtype):
    """The scores' scale: by default 1/sqrt(head size), which may be symbolic
    (then a scalar of dtype)."""
    if scale is not None:
        return scale
    size = query.shape[-1]
    return int(size) ** -0.5 if sz.is_static(size) else ops.rsqrt(ops.full([], size, dtype, like=query))


@_reg(torch.ops.polyjit.attention.default)
def _attention(cx, query, key, value, mask, causal, scale):
    """torch_attention's op: the output and the probabilities, the scores
    and their softmax in the compute type; a row whose keys are all masked
    gives zeros, found by the softmax's own row maximum."""
    s = _computed(ops.matmul(query, ops.transpose(key, -2, -1))) * _attention_scale(query, scale, query.dtype.compute)
    zero = ops.full([], 0.0, s.dtype, like=s)  # (masked out: -inf added, so that a NaN score stays NaN)
    if causal:
        rows, cols = s.shape[-2:]
        s = s + ops.where(ops.iota([rows, cols], 0, like=s) >= ops.iota([rows, cols], 1, like=s), zero, float("-inf"))
    if mask is not None:
        s = s + (ops.where(mask, zero, float("-inf")) if mask.dtype == DataType.Bool else _computed(mask))
    masked = ops.eq(ops.max(s, [-1], keepdim=True), float("-inf"))  # (the softmax's own maximum, deduplicated)
    p = ops.cast(ops.where(masked, 0.0, ops.softmax(s, -1)), query.dtype)
    return ops.matmul(p, value), p


@_reg(torch.ops.polyjit.attention_backward.default)
def _attention_backward(cx, grad, query, key, value, probs, scale):
    """The gradients of query, key and value, from the saved probabilities."""
    dp = _computed(ops.matmul(grad, ops.transpose(value, -2, -1)))
    p = _computed(probs)
    ds = ops.cast(p * (dp - ops.sum(dp * p, [-1], keepdim=True)), query.dtype)
    scale = _attention_scale(query, scale, query.dtype)
    return (ops.matmul(ds, key) * scale, ops.matmul(ops.transpose(ds, -2, -1), query) * scale,
            ops.matmul(ops.transpose(probs, -2, -1), grad))


# creation
def _full(cx, shape, value, dtype=None):
    dt = cx.dtype(dtype) if dtype is not None else (
        DataType.Float if isinstance(value, float) else DataType.Bool if isinstance(value, bool) else DataType.Int)
    return ops.full(cx.sizes(shape), value, dt, like=cx.anchor())


ATEN[aten.full.default] = lambda cx, shape, value, dtype=None, **kw: _full(cx, shape, value, dtype)
ATEN[aten.scalar_tensor.default] = lambda cx, value, dtype=None, **kw: _full(cx, [], value, dtype or torch.float32)
ATEN[aten.zeros.default] = lambda cx, shape, dtype=None, **kw: _full(cx, shape, 0, dtype or torch.float32)
ATEN[aten.ones.default] = lambda cx, shape, dtype=None, **kw: _full(cx, shape, 1, dtype or torch.float32)
ATEN[aten.full_like.default] = lambda cx, x, value, dtype=None, **kw: _full(cx, x.shape, value, dtype or _TORCH[x.dtype])
ATEN[aten.zeros_like.default] = lambda cx, x, dtype=None, **kw: _full(cx, x.shape, 0, dtype or _TORCH[x.dtype])
ATEN[aten.ones_like.default] = lambda cx, x, dtype=None, **kw: _full(cx, x.shape, 1, dtype or _TORCH[x.dtype])
ATEN[aten.empty_like.default] = ATEN[aten.zeros_like.default]
ATEN[aten.empty.memory_format] = ATEN[aten.zeros.default]
ATEN[aten.empty_permuted.default] = lambda cx, shape, perm, dtype=None, **kw: _full(cx, shape, 0, dtype or torch.float32)
ATEN[aten.empty_strided.default] = lambda cx, shape, stride, dtype=None, **kw: _full(cx, shape, 0, dtype or torch.float32)
ATEN[aten.new_empty.default] = lambda cx, x, shape, dtype=None, **kw: _full(cx, shape, 0, dtype or _TORCH[x.dtype])
ATEN[aten.new_empty_strided.default] = lambda cx, x, shape, stride, dtype=None, **kw: _full(
    cx, shape, 0, dtype or _TORCH[x.dtype])


@_reg(aten.arange.start_step, aten.arange.default, aten.arange.start)
def _arange(cx, *args, dtype=None, **kw):
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args + (1,))[:3]
    if isinstance(end, Lin) or isinstance(start, Lin):  # a symbolic count: unit steps (positions, a causal mask)
        if step not in (1, -1) or isinstance(start, float) or isinstance(end, float):
            raise UnsupportedOpError(f"{cx.target} over a symbolic size with step {step!r}")
        n = (end - start) * step
    elif any(isinstance(v, ops.Tensor) for v in (start, end, step)):  # bounds given at run time: the traced length
        n = cx.size(_node_val(cx.node).shape[0])
        if not isinstance(n, int):
            raise UnsupportedOpError(f"{cx.target} between integer arguments, of length {n}")
    else:
        n = max(0, math.ceil((end - start) / step))
    dt = cx.dtype(dtype) if dtype is not None else (
        DataType.Float if any(isinstance(v, float) for v in (start, end, step)) else DataType.Int)
    anchor = cx.anchor()
    i = ops.iota([n], 0, dt, like=anchor)
    i = i * step if not (isinstance(step, int) and step == 1) else i
    return i + start if not (isinstance(start, int) and start == 0) else i


@_reg(aten.bucketize.Tensor, aten.searchsorted.Tensor)
def _bucketize(cx, *args, out_int32=False, right=False, side=None, sorter=None):
    """The bucket of each value among sorted boundaries: how many of them
    lie below it (or at most it, right=True), one comparison with each; NaN
    goes past the last, as torch's binary search puts it. searchsorted's
    boundaries may be batched: a row of them for each row of values."""
    x, edges = args if cx.target is aten.bucketize.Tensor else args[::-1]
    if sorter is not None or (edges.ndim != 1 and (edges.ndim != x.ndim or edges.shape[:-1] != x.shape[:-1])):
        raise UnsupportedOpError(f"{cx.target} with boundaries of rank {edges.ndim} or a sorter")
    right = right or side == "right"
    wide = list(x.shape) + [edges.shape[-1]]
    e = ops.broadcast_in_dim(edges, wide, list(range(edges.ndim - 1)) + [x.ndim])
    v = ops.broadcast_in_dim(x, wide, list(range(x.ndim)))
    below = ops.logical_or(e <= v if right else e < v, ops.isnan(v))
    count = ops.sum(ops.cast(below, DataType.Int), [x.ndim])
    return ops.cast(count, DataType.Int32) if out_int32 else count


@_reg(aten.tril_indices.default, aten.triu_indices.default)
def _tri_indices(cx, row, col, offset=0, dtype=None, **kw):
    """A triangle's (row, column) positions: numbers known when tracing."""
    tri = np.tril_indices if cx.target is aten.tril_indices.default else np.triu_indices
    at = np.stack(tri(int(row), int(offset), int(col)))
    want = cx.dtype(dtype) if dtype is not None else DataType.Int
    return ops.Tensor(cx.graph, cx.graph.tensor_constant(at.astype(want.numpy)))


@_reg(aten.rand_like.default, aten.rand.default)
def _rand(cx, x_or_shape, dtype=None, **kw):
    shape = x_or_shape.shape if isinstance(x_or_shape, ops.Tensor) else cx.sizes(x_or_shape)
    u = ops.rand_uniform(shape, cx.seed(), cx.next_offset(shape))
    want = cx.dtype(dtype) if dtype is not None else (
        x_or_shape.dtype if isinstance(x_or_shape, ops.Tensor) else DataType.Float)
    return ops.cast(u, want) if want != DataType.Float else u


@_reg(aten.bernoulli.p)
def _bernoulli(cx, x, p=0.5, **kw):
    u = ops.rand_uniform(x.shape, cx.seed(), cx.next_offset(x.shape))
    return ops.cast(u < p, x.dtype)


ATEN[operator.getitem] = lambda cx, seq, i: seq[i]
ATEN[aten.sym_size.int] = lambda cx, x, dim: x.shape[dim]  # (a symbolic size, for the size arithmetic below)


def _size_op(fn):
    """Arithmetic on sizes (dynamic shapes' SymInts, e.g. ``-x.shape[0] // 2``),
    as affine sizes; on an integer argument's value (a cache's position, 0-d
    integer tensors), as tensor ops; anything else is an op polyjit leaves to
    PyTorch."""
    def rule(cx, *args):
        if any(isinstance(a, ops.Tensor) for a in args) and all(
                isinstance(a, (int, ops.Tensor)) and not isinstance(a, bool) for a in args):
            return fn(*args)
        if not all(isinstance(a, (int, Lin)) and not isinstance(a, bool) for a in args):
            raise UnsupportedOpError(f"{cx.target} of {[type(a).__name__ for a in args]}")
        try:
            return fn(*args)
        except TypeError as e:
            raise UnsupportedOpError(f"{cx.target} of sizes {[str(a) for a in args]} is not affine") from e
    return rule


for _op in (operator.add, operator.sub, operator.mul, operator.neg, operator.floordiv):
    ATEN[_op] = _size_op(_op)

# The decompositions AOTAutograd traces with. A training graph's: all but
# those of the composites lowered WHOLE. The partition then sees the ATen
# ops it knows how to recompute: a tanh's backward left whole, say, reads
# the tanh through aten.detach, which it would save rather than recompute.
# An inference graph's: none, either, for the other ops the table lowers
# itself, torch's chosen ones aside (their parts fuse).
def _addmm_in_parts(bias, a, b, beta=1, alpha=1):
    """addmm as its product and a bias added after it. The partition then
    saves the product (the library call writes it anyway) and recomputes the
    sum beside a GELU's gradient, where it would save addmm's result whole,
    which a following GELU's kernel would write beside its own."""
    out = aten.mm(a, b) if alpha == 1 else aten.mm(a, b) * alpha
    return out if beta == 0 else out + (bias if beta == 1 else bias * beta)  # (beta 0 ignores bias: NaN too)


TRAINING_DECOMPOSITIONS = {**{op: d for op, d in _TORCH_DECOMPOSITIONS.items()
                              if not (op.overloadpacket in WHOLE and op in ATEN)},
                           aten.addmm.default: _addmm_in_parts}
INFERENCE_DECOMPOSITIONS = {op: d for op, d in TRAINING_DECOMPOSITIONS.items()
                            if op not in ATEN or (op in _CHOSEN and op.overloadpacket not in WHOLE_IN_INFERENCE)}


def _known_negative(cx, position: int, name: str) -> bool:
    """Whether argument ``position`` (or ``name``) of the node being
    translated, a symbolic size, is negative as torch's shape environment
    knows it (a slice wraps a negative bound); UnsupportedOpError where
    torch cannot tell."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    a = cx.node.args[position] if len(cx.node.args) > position else cx.node.kwargs.get(name)
    val = _node_val(a) if isinstance(a, torch.fx.Node) else None
    if isinstance(val, torch.SymInt):
        if statically_known_true(val < 0):
            return True
        if statically_known_true(val >= 0):
            return False
    raise UnsupportedOpError(f"{cx.target}: the sign of its {name} {a} is unknown")


# --------------------------------------------------------------------------
# FX graph -> polyjit graph
# --------------------------------------------------------------------------
class _Context:
    """State of one graph translation: the polyjit graph, symbolic sizes, RNG."""

    def __init__(self) -> None:
        self.graph = Graph()
        self.symbols: dict[str, Lin] = {}
        self._seed: ops.Tensor | None = None
        self.seed_index: int | None = None
        self._offset = 0
        self._anchor: ops.Tensor | None = None
        self.target = None
        self.asserts: list[tuple[ops.Tensor, str]] = []  # conditions checked after each call, with their messages
        self.node: torch.fx.Node | None = None  # the FX node being translated
        self.int_inputs: list[int] = []  # graph inputs that are integer arguments
        self.size_inputs: list[int] = []  # argument positions of integers that size results
        self.mutations: list[tuple[int, int]] = []  # (argument position, graph output): copied in after a call
        self.placeholders: dict[torch.fx.Node, int] = {}  # tensor placeholders' argument positions

    def dtype(self, dt) -> DataType:
        if isinstance(dt, DataType):
            return dt
        if dt not in _DTYPES:
            raise UnsupportedOpError(f"dtype {dt}")
        return _DTYPES[dt]

    def size(self, s):
        if isinstance(s, torch.SymInt):
            return _sym_to_lin(s.node.expr, self)
        return s

    def sizes(self, shape):
        return [self.size(s) for s in shape]

    def seed(self) -> ops.Tensor:
        if self._seed is None:
            self.seed_index = len(self.graph.inputs)
            n = self.graph.input((), DataType.Int, "seed")
            n.attrs["declared_strided"] = False
            self._seed = ops.Tensor(self.graph, n)
        return self._seed

    def next_offset(self, shape) -> int:
        off = self._offset
        numel = 1
        for s in shape:
            numel = numel * s if isinstance(s, int) else numel * (1 << 20)
        self._offset += max(int(numel), 1)
        return off

    def anchor(self) -> ops.Tensor:
        if self._anchor is None:
            if self.graph.inputs:
                self._anchor = ops.Tensor(self.graph, self.graph.inputs[0])
            else:
                self._anchor = ops.Tensor(self.graph, self.graph.constant(0))
        return self._anchor


def _sym_to_lin(expr, cx: _Context):
    import sympy
    expr = sympy.expand(expr)
    if expr.is_Integer:
        return int(expr)
    const = 0
    out: Any = 0
    for term, coeff in expr.as_coefficients_dict().items():
        if term == 1:
            const += int(coeff)
        elif term.is_Symbol:
            name = str(term)
            cx.symbols.setdefault(name, Lin.param(name))
            out = out + cx.symbols[name] * int(coeff)
        elif type(term).__name__ == "FloorDiv" and term.args[1].is_Integer:  # a strided window's size
            out = out + (_sym_to_lin(term.args[0], cx) // int(term.args[1])) * int(coeff)
        elif term.is_Mul:  # a batch and a sequence merged: a parameter standing for the product
            out = out + sz.product(_sym_to_lin(f, cx) for f in term.args) * int(coeff)
        elif term.is_Pow and term.exp.is_Integer and int(term.exp) > 1:  # s**2: s*s
            out = out + sz.product([_sym_to_lin(term.base, cx)] * int(term.exp)) * int(coeff)
        else:
            raise UnsupportedOpError(f"the size expression {expr} is not affine")
    return out + const


def _constant(t: torch.Tensor) -> np.ndarray:
    """A tensor the graph holds (a model's buffer, a tensor the function
    built) as a host array. Backends run under AOTAutograd's fake mode,
    where even reading a real tensor would dispatch to fake kernels."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        return torch_host_array(t.detach().cpu()).copy()


def _node_val(node):
    v = node.meta.get("val", node.meta.get("example_value"))
    return v


def _placeholder_shape(val, cx: _Context):
    return [cx.size(s) for s in val.shape]


@dataclass
class _Translation:
    graph: Graph
    tensor_inputs: list[int]  # positions of FX placeholders that are tensors
    seed_index: int | None
    outputs: list  # ('tensor', k), ('transposed', (k, perm)), ('input', position), ('permuted', (position, perm)),
    # ('const', v), ('size', Lin)
    symbols: dict  # symbolic size name -> (argument position, dimension or None for an integer argument)
    asserts: list = field(default_factory=list)  # (graph output, message): torch._assert_async conditions
    int_inputs: list = field(default_factory=list)  # graph inputs that are integer arguments (0-d int64)
    input_orders: dict = field(default_factory=dict)  # position -> the order its tensor is read in (_dense_order)
    mutations: list = field(default_factory=list)  # (argument position, graph output): copied into it after a call
    size_inputs: list = field(default_factory=list)  # argument positions of integers that size results


def _solvable_symbol(expr) -> tuple[str, ...]:
    """The symbol of a size c * s + k (a tensor's dimension the runtime solves
    for s: a slice's gradient is [s - 1]); () for any other size."""
    import sympy
    terms = sympy.expand(expr).as_coefficients_dict()
    syms = [t for t in terms if t != 1]
    return (str(syms[0]),) if len(syms) == 1 and syms[0].is_Symbol else ()


def translate(gm: torch.fx.GraphModule, example_inputs: Sequence | None = None) -> _Translation:
    """An ATen graph as a polyjit graph, node by node through :data:`ATEN`.
    ``example_inputs``: the tensors the graph is compiled for, whose layouts
    may differ from those traced (a backward's saved activations, laid out
    as its forward stored them). A graph whose meta sets ``_AS_TRACED``
    lays every result out as traced (what a forward hands the user), not
    only what the backward alone reads (see _outputs)."""
    cx = _Context()
    env: dict[torch.fx.Node, Any] = {}
    tensor_inputs = []
    input_pos: dict[int, int] = {}
    input_orders: dict[int, tuple[int, ...]] = {}
    symbols: dict[str, tuple] = {}
    dims = {d for node in gm.graph.nodes if node.op == "placeholder"
            and isinstance(_node_val(node), torch.Tensor) for s in _node_val(node).shape
            if isinstance(s, torch.SymInt) for d in _solvable_symbol(s.node.expr)}
    sizing = {str(f) for node in gm.graph.nodes if node.op != "placeholder"
              and isinstance(_node_val(node), torch.Tensor) for s in _node_val(node).shape
              if isinstance(s, torch.SymInt) for f in s.node.expr.free_symbols}  # (sizes of results)
    if example_inputs is not None and len(example_inputs) != len(gm.graph.find_nodes(op="placeholder")):
        example_inputs = None
    pos = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = _node_val(node)
            if isinstance(val, torch.Tensor):
                if val.dtype not in _DTYPES:
                    raise UnsupportedOpError(f"input {node.name} of dtype {val.dtype}")
                for d, s in enumerate(val.shape):
                    if isinstance(s, torch.SymInt) and s.node.expr.is_Symbol:
                        symbols.setdefault(str(s.node.expr), (pos, d))
                example = example_inputs[pos] if example_inputs is not None else None
                shape = _placeholder_shape(val, cx)
                order = _dense_order(example if isinstance(example, torch.Tensor) else val)
                if order is not None:  # its memory order as the input, the logical order a transpose of it
                    shape = [shape[d] for d in order]
                    input_orders[pos] = order
                n = cx.graph.input(tuple(shape), _DTYPES[val.dtype], node.name)
                n.attrs["declared_strided"] = False
                input_pos[n.id] = pos
                if order is not None:
                    n = cx.graph.transpose(n, inverse(order))
                env[node] = ops.Tensor(cx.graph, n)
                tensor_inputs.append(pos)
                cx.placeholders[node] = pos
            elif isinstance(val, torch.SymInt) and val.node.expr.is_Symbol and str(val.node.expr) in sizing - dims:
                # an integer argument that sizes results (arange(n), x[:, :k]), given as an array of that
                # size, never read (_size_carriers): the runtime solves sizes from shapes
                name = str(val.node.expr)
                n = cx.graph.input((cx.size(val),), DataType.Int8, node.name)
                n.attrs["declared_strided"] = False
                symbols.setdefault(name, (pos, None))
                env[node] = cx.size(val)
                tensor_inputs.append(pos)
                cx.size_inputs.append(pos)
            elif isinstance(val, torch.SymInt) and val.node.expr.is_Symbol and str(val.node.expr) not in dims:
                # an integer argument no tensor's size carries: a value (x * k), never a size
                n = cx.graph.input((), DataType.Int, node.name)
                n.attrs["declared_strided"] = False
                env[node] = ops.Tensor(cx.graph, n)
                tensor_inputs.append(pos)
                cx.int_inputs.append(len(cx.graph.inputs) - 1)
            else:
                if isinstance(val, torch.SymInt) and val.node.expr.is_Symbol:
                    symbols.setdefault(str(val.node.expr), (pos, None))
                env[node] = cx.size(val) if isinstance(val, torch.SymInt) else val
            pos += 1
        elif node.op == "get_attr":
            value = getattr(gm, node.target)
            if isinstance(value, torch.Tensor):
                env[node] = ops.Tensor(cx.graph, cx.graph.tensor_constant(_constant(value)))
            else:
                env[node] = value
        elif node.op == "call_function":
            fn = ATEN.get(node.target)
            if fn is None:
                raise UnsupportedOpError(f"{node.target}")
            args = torch.fx.node.map_arg(node.args, lambda a: env[a])
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: env[a])
            kwargs = {k: v for k, v in kwargs.items() if k not in ("layout", "device", "pin_memory", "memory_format")}
            cx.target, cx.node = node.target, node
            env[node] = fn(cx, *args, **kwargs)
        elif node.op == "output":
            return _outputs(cx, node, env, tensor_inputs, input_pos, input_orders, symbols, gm.meta.get(_SAVED, ()),
                            gm.meta.get(_AS_TRACED, False))
        else:
            raise UnsupportedOpError(f"FX node kind {node.op}")
    raise UnsupportedOpError("graph without output")


def _outputs(cx: _Context, node: torch.fx.Node, env: dict, tensor_inputs: list[int], input_pos: dict[int, int],
             input_orders: dict[int, tuple[int, ...]], symbols: dict[str, tuple], saved,
             as_traced: bool) -> _Translation:
    """The translation of a graph whose output node is ``node``: each result
    a graph output, an input handed back, a size or a constant. What the
    backward alone reads and torch expects laid out as a permutation of
    row-major is stored in that order and handed out as a view, so that the
    backward's input has the layout its graph was traced with (_dense_order
    reads it in place): a transpose saved for a weight's gradient is its
    value, not a transposing copy; a channels-last activation is stored
    channels last. So is every result where ``as_traced`` (a forward's: the
    user gets eager's strides, a channels-last model's output without a
    copy to row-major). A backward's results stay row-major: autograd
    copies a gradient laid out otherwise than its parameter."""
    outs = []
    for o in _listed(node):
        v = env[o] if isinstance(o, torch.fx.Node) else o
        view = _input_view(v.node, input_pos, input_orders) if isinstance(v, ops.Tensor) else None
        backward_only = getattr(o, "name", None) in saved
        if view is not None and view[1] is None:
            outs.append(("input", view[0]))
        elif view is not None:
            outs.append(("permuted", view))
        elif isinstance(v, ops.Tensor) and (backward_only or as_traced) and \
                (order := _dense_order(_node_val(o))) is not None:
            outs.append(("transposed", (_graph_output(cx, _in_memory_order(cx.graph, v.node, order)), inverse(order))))
        elif isinstance(v, ops.Tensor):
            cx.graph.add_output(v.node)
            outs.append(("tensor", len(cx.graph.outputs) - 1))
        elif isinstance(v, Lin):  # a size saved for the backward graph
            missing = sorted(v.base_params() - set(symbols))
            if missing:
                raise UnsupportedOpError(f"the output size {v} depends on sizes {missing} of no input")
            outs.append(("size", v))
        else:
            outs.append(("const", v))
    asserts = []
    for cond, msg in cx.asserts:
        cx.graph.add_output(cond.node)
        asserts.append((len(cx.graph.outputs) - 1, msg))
    return _Translation(cx.graph, tensor_inputs, cx.seed_index, outs, symbols, asserts, cx.int_inputs, input_orders,
                        cx.mutations, cx.size_inputs)


def _in_memory_order(graph, node, order: tuple[int, ...]):
    """node's value stored with its dims in ``order``, outermost first, and
    handed out as a view of it: its transpose, composed with the transposes
    node is made of (a saved transpose is stored as its base, not copied)."""
    base, perm = _transposed(node)
    return graph.transpose(base, [perm[d] for d in order])


def _transposed(node) -> tuple:
    """(base, permutation): node as a chain of transposes of a value."""
    perm = list(range(node.rank))
    while node.is_index_transpose:
        perm = [node.attrs["perm"][p] for p in perm]
        node = node.inputs[0]
    return node, tuple(perm)


def _graph_output(cx: _Context, node) -> int:
    """The graph output that holds node: an earlier one, else a new one."""
    for k, out in enumerate(cx.graph.outputs):
        if out is node:
            return k
    cx.graph.add_output(node)
    return len(cx.graph.outputs) - 1


def _input_view(node, input_pos: dict[int, int],
                input_orders: dict[int, tuple[int, ...]]) -> tuple[int, tuple[int, ...] | None] | None:
    """(argument position, permutation or None) where node is an input, or a
    permutation of one (a training forward saves each Linear weight's
    transpose for the backward): handed back as a torch view, not copied."""
    base, perm = _transposed(node)
    if base.op != "input" or base.attrs.get("name") == "seed" or base.id not in input_pos:
        return None
    pos = input_pos[base.id]
    if pos in input_orders:  # the input is the argument's dims in memory order
        perm = tuple(input_orders[pos][p] for p in perm)
    return pos, None if perm == tuple(range(len(perm))) else perm


def _dense_order(val) -> tuple[int, ...] | None:
    """The order of a (fake) tensor's dims in memory, outermost first,
    where it is a permutation of a row-major array other than the identity;
    None otherwise, and for symbolic sizes or strides. A graph's input laid
    out so (a transpose its forward saved, a channels-last image) is read as
    that array through a transpose: in place, where a strided read would
    not know the order until the call."""
    if not isinstance(val, torch.Tensor):
        return None
    shape, strides = tuple(val.shape), tuple(val.stride())
    if len(shape) < 2 or not all(isinstance(x, int) for x in shape + strides) or val.is_contiguous():
        return None
    order = tuple(sorted(range(len(shape)), key=lambda d: -strides[d]))
    dense = sz.row_major(tuple(shape[d] for d in order))
    if any(shape[d] != 1 and strides[d] != dense[k] for k, d in enumerate(order)):
        return None
    return order


class CompiledGraph:
    """A translated ATen graph with its Executable; called with torch tensors."""

    def __init__(self, gm: torch.fx.GraphModule, options: CompileOptions, name: str, stats: "Stats",
                 example_inputs: Sequence | None = None) -> None:
        self.t = translate(gm, example_inputs)
        self.gm, self.failed = gm, False
        seed = [self.t.seed_index] if self.t.seed_index is not None else []
        self.exe = Executable(self.t.graph, options, name, scalar_inputs=seed + self.t.int_inputs)
        self.stats = stats
        self.name = name
        self.options = options
        self._bound = None  # (its inputs' pointers or None, run, program) for the last bound call's layouts
        self._saved = _saved_outputs(gm, self.t.outputs)
        self._devices = _output_devices(gm)
        self._moved: list | None = None  # (position, device) of the results made elsewhere than traced

    def saved_in_target_order(self, where: str) -> list | None:
        """Store the saved activations that the target computes in another
        order (Executable.output_orders: channels last between cuDNN's
        convolutions) in that order, handed to the backward as views, as
        Inductor's layout optimization does. Returns the strides of each
        result (None: as traced), or None where nothing changed."""
        orders = self.exe.output_orders(where) if self._saved else {}
        graph, strides = self.t.graph, []
        for i, (kind, v) in enumerate(self.t.outputs):
            p = orders.get(v) if kind == "tensor" and v in self._saved else None
            if p is None or not all(sz.is_static(d) for d in graph.outputs[v].shape):
                strides.append(None)
                continue
            graph.outputs[v] = _in_memory_order(graph, graph.outputs[v], p)
            self.t.outputs[i] = ("transposed", (v, inverse(p)))
            dense = sz.row_major(graph.outputs[v].shape)
            strides.append(tuple(dense[p.index(d)] for d in range(len(p))))
        return strides if any(s is not None for s in strides) else None

    def __call__(self, *args):
        if self._bound is not None and not self.failed:  # the last call's layouts again (a training loop)
            try:
                outs = self._call_bound(args)
            except Exception as err:  # polyjit's own failure: this graph runs in eager PyTorch
                return self._failed(err, args)
            if outs is not None:
                return self._results(outs, args)
        arrays, index = [], None
        given = _size_carriers(args, self.t.size_inputs) if self.t.size_inputs else args
        for k in self.t.tensor_inputs:
            a = given[k]
            if k in self.t.input_orders:  # its dims in memory order (contiguous where laid out as traced)
                a = a.permute(self.t.input_orders[k])
            if not isinstance(a, torch.Tensor):  # an integer argument (the executable's scalar input)
                arrays.append(a)
            elif a.is_cuda and takes_device_arrays(self.options.target):  # through its pointer: no detached tensor object
                arrays.append(_gpu_view(a))
                index = a.get_device()
            elif a.is_cpu:
                arrays.append(torch_host_array(a.detach()))
            else:
                raise InputError(f"{self.name}: argument {k} is on {a.device}, but compile option target="
                                 f"{self.options.target!r} runs on the CPU; move it to the CPU, or compile "
                                 f"with target 'nvgpu' or no target (where the tensors are)")
        if self.t.seed_index is not None:
            seed = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64).item())
            arrays.insert(self.t.seed_index, np.asarray(seed, np.int64))
        launch = {}
        if index is not None:
            launch = {"stream": _current_stream(index), "ordinal": index, "empty": _allocator(index)}
        if self.failed:
            return tuple(self.gm(*args))
        try:
            outs = self.exe(*arrays, **launch)
        except Exception as err:  # compiling a new layout or device failed inside polyjit
            return self._failed(err, args)
        self.stats.record(self.name, self.exe.stats)
        self._bind(args, arrays, index)
        return self._results(outs, args)

    def _failed(self, err: Exception, args) -> tuple:
        internal_failure(self.stats, f"graph {self.name}", err, "eager PyTorch", self.options.strict)
        self.failed, self._bound = True, None
        return tuple(self.gm(*args))

    def _bind(self, args, arrays, index: int | None) -> None:
        """Keep what calls on arguments of these layouts run with, and the
        layouts, for _call_bound: on one GPU, the plan its native launcher
        runs; on the host, the call's plan, whose outputs become torch
        tensors from the start. All tensor inputs, no host values."""
        self._bound = None
        prog = self.exe.last
        if self.t.seed_index is not None:
            return
        sig = []
        for k in self.t.tensor_inputs:
            a = args[k]
            if not isinstance(a, torch.Tensor) or (a.is_cuda if index is None else not a.is_cuda):
                return
            sig.append((k, a.shape, a.stride(), a.dtype))
        if index is None:
            plan = prog.bound_plan(arrays) if hasattr(prog, "bound_plan") else None
            if plan is not None:
                self._bound = (_bound_pointers(args, sig, -1),
                               lambda pointers: prog.run_bound(plan, pointers, _host_empty), prog)
            return
        plan = prog.native_plan(arrays) if hasattr(prog, "native_plan") else None
        if plan is not None:
            pooled = self._saved | {k for _, k in self.t.mutations}  # (a mutation's value dies after its copy)
            saved = {prog.output_arrays[v] for v in pooled}
            saved -= {n for v, n in enumerate(prog.output_arrays) if v not in pooled}
            outputs = _Outputs(index, frozenset(saved))
            self._bound = (_bound_pointers(args, sig, index), lambda pointers: prog.run_bound(
                plan, pointers, _current_stream(index), _allocator(index), outputs), prog)

    def _call_bound(self, args):
        """The outputs of a call through the bound plan where every tensor
        input has the shape, strides, dtype and device of the call that
        bound it; None otherwise (the full path then checks and plans)."""
        pointers_of, run, prog = self._bound
        pointers = pointers_of(args)
        if pointers is None:
            return None
        outs = run(pointers)
        self.stats.record(self.name, prog.stats)
        return outs

    def _results(self, outs, args) -> tuple:
        """The graph's results from the program's outputs (and its inputs, sizes and constants)."""
        for k, msg in self.t.asserts:  # value checks (one_hot's class range): the results are not handed out
            if not bool(outs[k]):
                raise RuntimeError(msg)
        if self.t.mutations:
            _copy_into([args[pos] for pos, _ in self.t.mutations], [_tensor(outs[k]) for _, k in self.t.mutations])
        result = []
        given: dict[int, int] = {}  # id of a tensor handed out -> the output it is
        for kind, v in self.t.outputs:
            if kind == "tensor":
                t = _tensor(outs[v])
                if given.setdefault(id(t), v) != v:  # two results the program computed once: eager's are two
                    t = t.clone()
                result.append(t)
            elif kind == "size":
                result.append(v.evaluate({n: int(args[k]) if d is None else args[k].shape[d]
                                          for n, (k, d) in self.t.symbols.items()}))
            elif kind == "permuted":
                result.append(args[v[0]].permute(v[1]))
            elif kind == "transposed":  # a transpose of a computed value: a view of it, as in eager
                result.append(_tensor(outs[v[0]]).permute(v[1]))
            else:
                result.append(args[v] if kind == "input" else v)
        if self._moved is None:  # (a graph of no GPU inputs whose results the trace puts on a GPU: a mask
            # built from sizes alone runs on the host; the graph after it finds it where the trace said)
            self._moved = [(i, d) for i, (r, d) in enumerate(zip(result, self._devices))
                           if isinstance(r, torch.Tensor) and d is not None and r.device != d]
        for i, d in self._moved:
            result[i] = result[i].to(d)
        return tuple(result)




def _size_carriers(args: Sequence, positions: list[int]) -> list:
    """``args`` with the integers at ``positions`` (they size results) as
    byte arrays of that size, never read, on the device of the tensor
    arguments: the program solves its sizes from shapes alone."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    args = list(args)
    for k in positions:
        n = int(args[k])
        block = _CARRIERS.get(device)
        if block is None or block.numel() < n:
            block = _CARRIERS[device] = torch.empty(max(n, 2 * (block.numel() if block is not None else 64)),
                                                     dtype=torch.int8, device=device)
        args[k] = block[:n]
    return args


_CARRIERS: dict = {}  # device -> the bytes that _size_carriers hands out prefixes of


def _tensor(o) -> torch.Tensor:
    return o if isinstance(o, torch.Tensor) else torch_from_host(o)


def _copy_into(arguments: list, values: list) -> None:
    """A graph's input mutations: each value copied into its argument, one
    foreach copy per dtype and device (a launch or two, not one a buffer)."""
    groups: dict = {}
    for a, v in zip(arguments, values):
        into, of = groups.setdefault((a.dtype, a.device), ([], []))
        into.append(a)
        of.append(v)
    with torch.no_grad():
        for into, of in groups.values():
            torch._foreach_copy_(into, of)


def _current_stream(index: int) -> int:
    """The handle of torch's current stream on a device (torch's raw accessor
    where it has one: the public Stream object costs more to build than a launch)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def _bound_pointers(args, sig: list, index: int) -> Callable[[Sequence], list[int] | None]:
    """``pointers(args)``: the data pointers of the tensor inputs in ``sig``
    ((position, shape, strides, dtype) of each, as in ``args``) where each
    has that layout on device ``index`` (-1: the host), else None. Checked
    in torch's native code, by dynamo's tensor check, where this torch has
    it (a training graph's hundred parameters in microseconds, before its
    first launch); else in Python."""
    at = [k for k, _, _, _ in sig]
    guards = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None), "TensorGuards", None)
    try:
        same = guards(*(args[k] for k in at), dynamic_dims_sizes=[list(shape) for _, shape, _, _ in sig],
                      dynamic_dims_strides=[list(stride) for _, _, stride, _ in sig]).check
    except Exception:  # not in this torch, or of another signature
        same = None

    def native(args) -> list[int] | None:
        tensors = [args[k] for k in at]
        return [a.data_ptr() for a in tensors] if same(*tensors) else None

    def python(args) -> list[int] | None:
        pointers = []
        for k, shape, stride, dtype in sig:
            a = args[k]
            if (not isinstance(a, torch.Tensor) or a.dtype is not dtype or a.shape != shape
                    or a.stride() != stride or a.get_device() != index):
                return None
            pointers.append(a.data_ptr())
        return pointers
    return python if same is None else native


def _host_empty(shape: tuple, dt: np.dtype) -> tuple:
    """(tensor, its address) for a host program's output (CompiledProgram.run_bound):
    torch's own; from polyjit's buffer cache where large (pages already faulted in)."""
    if math.prod(shape) * dt.itemsize >= BufferCache.MIN_BYTES:
        a = new_buffer(shape, dt)
        return torch_from_host(a), a.__array_interface__["data"][0]
    t = _cpu_empty(shape, _NUMPY_TO_TORCH[dt])
    return t, t.data_ptr()


def _fast_empty(name: str) -> Callable | None:
    """``torch._C._dynamo.guards.<name>(sizes, strides, dtype)``: the
    allocation Inductor's generated code calls, which skips the dispatcher
    (most of ``torch.empty``'s host time in a small graph's call), where
    this torch has it."""
    return getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None), name, None)


def _empty_through(fast: Callable) -> Callable[[tuple, torch.dtype], torch.Tensor]:
    """``empty(shape, dtype)``, contiguous, through ``fast`` (see _fast_empty),
    each shape's sizes and strides worked out once."""
    layouts: dict = {}  # shape -> (sizes, strides), tuples of ints as it takes them

    def empty(shape, dt):
        shape = shape if isinstance(shape, tuple) else tuple(shape)
        layout = layouts.get(shape)
        if layout is None:
            sizes = tuple(int(n) for n in shape)
            layout = layouts[shape] = (sizes, sz.row_major(sizes))
        return fast(*layout, dt)
    return empty


_cpu_empty = (_empty_through(_fast_empty("_empty_strided_cpu")) if _fast_empty("_empty_strided_cpu")
              else lambda shape, dt: torch.empty(shape, dtype=dt))


@functools.cache
def _allocator(index: int):
    """``empty(shape, dtype)`` for polyjit's outputs and temporaries: torch's
    caching allocator on GPU ``index``."""
    empty = _cuda_empty(index)
    return lambda shape, dt: empty(shape, _NUMPY_TO_TORCH[dt])


@functools.cache
def _cuda_empty(index: int) -> Callable[[tuple, torch.dtype], torch.Tensor]:
    """``empty(shape, torch dtype)``, contiguous, on GPU ``index``: through
    _fast_empty where ``index`` is the current device, as it allocates on
    that one (a graph's outputs, before its first launch); else
    ``torch.empty``."""
    dev = torch.device("cuda", index)
    fast = _fast_empty("_empty_strided_cuda")
    current = getattr(torch._C, "_cuda_getDevice", None)

    def plain(shape, dt):
        return torch.empty(shape, dtype=dt, device=dev)
    if fast is None or current is None:
        return plain
    on_current = _empty_through(fast)
    return lambda shape, dt: on_current(shape, dt) if current() == index else plain(shape, dt)


def _results_of(gm: torch.fx.GraphModule) -> tuple:
    """gm's results as its output node lists them."""
    return _listed(next(iter(gm.graph.find_nodes(op="output"))))


def _listed(output: torch.fx.Node) -> tuple:
    """An output node's results (one result: itself)."""
    out = output.args[0]
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _output_devices(gm: torch.fx.GraphModule) -> list:
    """The device of each of gm's results as traced (None: not a tensor)."""
    vals = [_node_val(n) if isinstance(n, torch.fx.Node) else None for n in _results_of(gm)]
    return [v.device if isinstance(v, torch.Tensor) else None for v in vals]


def _saved_outputs(gm: torch.fx.GraphModule, outputs: list) -> set[int]:
    """The program's outputs that only the backward reads: a forward graph's
    (``_partition`` names them) that it returns nowhere else."""
    saved = gm.meta.get(_SAVED)
    if not saved:
        return set()
    by_kind: dict[bool, set] = {True: set(), False: set()}
    for (kind, v), n in zip(outputs, _results_of(gm)):
        if kind in ("tensor", "transposed"):
            by_kind[getattr(n, "name", None) in saved].add(v if kind == "tensor" else v[0])
    return by_kind[True] - by_kind[False]


class _Outputs:
    """A call's outputs on GPU ``index``, allocated together: those saved
    for the backward only (``saved``, by name) are views of one block, one
    allocation in place of one each (the forward's host time
    before its first launch). They die together with the backward's
    inputs, and no caller modifies them in place (they share a version
    counter); outputs a caller sees get tensors of their own."""

    def __init__(self, index: int, saved: frozenset) -> None:
        self.empty, self.saved = _cuda_empty(index), saved
        self._layout: tuple | None = None  # (specs, *_place(specs)) for the last specs seen

    def __call__(self, specs: list) -> tuple[np.ndarray | list, Callable[[], list]]:
        """Memory for ``specs``, a plan's outputs as (name, shape, numpy
        dtype): their addresses (int64 array or list), and ``tensors()`` that makes the
        tensors at them, called after the launch (the saved outputs' views
        are built while the kernels run)."""
        if self._layout is None or self._layout[0] is not specs:
            self._layout = (specs, *self._place(specs))
        _, owned, block, places, offsets, base_of = self._layout
        empty = self.empty
        made = [empty(shape, dt) for shape, dt in owned]
        if not block:  # each output its own allocation, in order (numpy's arithmetic costs more here)
            return [t.data_ptr() for t in made], lambda: made
        made.append(empty((block,), torch.uint8))  # (last: the views' allocation is -1)
        addresses = offsets + np.array([t.data_ptr() for t in made], np.int64)[base_of]

        def tensors() -> list:
            typed: dict = {}  # the block as each dtype
            out = []
            for k, dt, shape, stride, at in places:
                if dt is None:
                    out.append(made[k])
                    continue
                if dt not in typed:
                    typed[dt] = made[-1].view(dt)
                out.append(typed[dt].as_strided(shape, stride, at))
            return out
        return addresses, tensors

    def _place(self, specs: list) -> tuple:
        """The outputs of their own (shape, dtype), then the bytes of the
        block of saved outputs (all dtypes), allocated in that order; each
        output's place: (its allocation, then dtype, shape, strides and
        element offset where it is a view of the block); each one's byte
        offset in its allocation, and that allocation's number, as arrays."""
        owned, places, offsets, block = [], [], [], 0
        for name, shape, dt in specs:
            tdt = _NUMPY_TO_TORCH[dt]
            if name not in self.saved or not math.prod(shape):
                places.append((len(owned), None, None, None, 0))
                owned.append((shape, tdt))
                offsets.append(0)
                continue
            places.append((-1, tdt, shape, sz.row_major(shape), block // dt.itemsize))
            offsets.append(block)
            block += -(-math.prod(shape) * dt.itemsize // 256) * 256  # 256-byte aligned starts
        base_of = np.array([p[0] for p in places], np.int64)
        return owned, block, places, np.array(offsets, np.int64), base_of


def _gpu_view(t: torch.Tensor):
    """A CUDA tensor as polyjit's GPU view, built directly: torch's
    ``__cuda_array_interface__`` costs tens of microseconds per call."""
    if t.dtype not in _DTYPES:
        raise InputError(f"a tensor of dtype {t.dtype} is not supported by target 'nvgpu'")
    return GpuView(t.data_ptr(), tuple(t.shape), None if t.is_contiguous() else tuple(t.stride()),
                   _NUMPY_DTYPES[t.dtype], t.get_device(), t)


class _Supported(OperatorSupport):
    """Nodes in the table on tensors of supported dtypes (any device: a call
    runs where its tensors are, or says why it cannot)."""

    def is_node_supported(self, submodules, node) -> bool:
        if node.op != "call_function" or node.target not in ATEN:
            return False
        if node.target is aten.copy_.default and not _mutates_input(node):
            return False
        if node.target in (aten._to_copy.default, prims.device_put.default) and _transfer(node):
            return False
        val = _node_val(node)
        vals = val if isinstance(val, (tuple, list)) else [val]
        return all(not isinstance(v, torch.Tensor) or (v.dtype in _DTYPES and v.device.type in ("cpu", "cuda"))
                   for v in vals)


def _where(node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File")]
    return lines[-1] if lines else "unknown location"


SCATTERED_PARTS, SCATTERED_SIZE = 8, 6  # more parts than this, of fewer nodes each on average: the graph runs whole


def compile_fx(gm: torch.fx.GraphModule, example_inputs, options: CompileOptions, stats: Stats,
               name: str) -> CompiledGraph | torch.fx.GraphModule:
    """Compile an ATen graph: whole if every node is supported, else by
    partitions."""
    support = _Supported()
    options = _as_eager(options)
    where = options.target or holding(any(isinstance(x, torch.Tensor) and x.is_cuda
                                          for x in example_inputs))  # the device the example tensors are on
    unsupported = [n for n in gm.graph.nodes if n.op == "call_function" and not support.is_node_supported({}, n)]
    if not unsupported:
        try:
            return _compiled(gm, options, name, stats, where, example_inputs)
        except USER_ERRORS:
            raise
        except Exception as e:
            if options.strict:
                raise
            log.debug("whole-graph translation failed (%s); partitioning", e)
    for n in unsupported:
        fallback(stats, str(n.target), "eager PyTorch", _where(n), options.strict)
    parts = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True).propose_partitions()
    if len(parts) > SCATTERED_PARTS and sum(len(p.nodes) for p in parts) < SCATTERED_SIZE * len(parts):
        log.info("%s: %d small parts between unsupported ops run in eager PyTorch with them", name, len(parts))
        return gm  # (each part's call costs more host time than the launches it would save)
    fused = CapabilityBasedPartitioner(gm, support).fuse_partitions(parts) if parts else gm
    for sub_name, sub in list(fused.named_children()):
        if isinstance(sub, torch.fx.GraphModule):
            try:
                setattr(fused, sub_name, _as_module(_compiled(sub, options, f"{name}_{sub_name}", stats, where)))
            except Exception as e:  # an op the table has, with arguments it refuses; or polyjit failed
                internal_failure(stats, f"partition {name}_{sub_name}", e, "eager PyTorch", options.strict)
    fused.recompile()
    return fused


def _as_eager(options: CompileOptions) -> CompileOptions:
    """options with TF32 where eager's would use it, unless they say."""
    if options.tf32 is None:  # convolutions as eager's: TF32 where torch allows cuDNN it
        options = dataclasses.replace(options, tf32=bool(torch.backends.cudnn.allow_tf32))
    if options.matmul_tf32 is None:  # products as eager's: TF32 where torch allows cuBLAS it
        options = dataclasses.replace(options, matmul_tf32=torch.get_float32_matmul_precision() != "highest")
    return options


def save_program(fn, options: CompileOptions, path, args: Sequence, dynamic_shapes=None,
                 kwargs: dict | None = None) -> None:
    """fn (a function or nn.Module) captured for ``args`` and ``kwargs`` by
    torch.export (one graph, as AOTInductor's packages are), its parameters
    and buffers frozen into constants, compiled and written to ``path``:
    ``polyjit.load(path)`` calls it in any process on a machine like this
    one, with neither tracing nor compiling, and returns torch tensors.
    ``dynamic_shapes``: torch.export's, for sizes that stay symbolic."""
    kwargs = dict(kwargs or {})
    from torch.export.graph_signature import InputKind, OutputKind
    name = getattr(fn, "__name__", type(fn).__name__)
    module = fn if isinstance(fn, torch.nn.Module) else _FunctionModule(fn)
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        try:
            ep = torch.export.export(module, tuple(args), kwargs, dynamic_shapes=dynamic_shapes).run_decompositions(
                _export_decompositions())
        except Exception as e:  # what torch.export refuses (data-dependent control flow, say)
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            raise SavedExecutableError(f"{name}: torch.export could not capture it as one graph "
                                       f"({type(e).__name__}: {first})") from None
    sig = ep.graph_signature
    changed = [o.target for o in sig.output_specs if o.kind != OutputKind.USER_OUTPUT]
    if changed:
        raise SavedExecutableError(f"{name}: it changes {', '.join(map(str, changed))}; a saved function keeps no "
                                   "state (save it in eval mode)")
    gm = ep.graph_module
    for k, (node, spec) in enumerate(zip(list(gm.graph.find_nodes(op="placeholder")), sig.input_specs)):
        if spec.kind == InputKind.USER_INPUT:
            continue
        value = ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
        gm.register_buffer(f"_frozen{k}", value.detach())
        with gm.graph.inserting_before(node):
            frozen = gm.graph.get_attr(f"_frozen{k}")
        frozen.meta.update(node.meta)
        node.replace_all_uses_with(frozen)
        gm.graph.erase_node(node)
    gm.recompile()
    example = torch.utils._pytree.tree_leaves((tuple(args), kwargs))
    prog = CompiledGraph(gm, _as_eager(options), name, Stats(), example)
    t = prog.t
    if t.input_orders or t.seed_index is not None or t.size_inputs or t.int_inputs or t.mutations or t.asserts \
            or any(kind not in ("tensor", "input", "const") for kind, _ in t.outputs):
        raise SavedExecutableError(f"{name}: its graph needs more than a saved function holds (random numbers, "
                                   "integer arguments, input layouts or results computed around the program)")
    prog.exe.variant((False,) * len(prog.exe.graph.inputs),
                     options.target or holding(any(isinstance(x, torch.Tensor) and x.is_cuda for x in example)))
    outputs, constants = [], []
    for kind, v in t.outputs:
        if kind == "const":
            outputs.append(["constant", len(constants)])
            constants.append(torch_host_array(v.detach().cpu()) if isinstance(v, torch.Tensor) else np.asarray(v))
        else:
            outputs.append(["output" if kind == "tensor" else "input", v])
    marker = object()
    results = torch.utils._pytree.tree_unflatten([marker] * len(t.outputs), ep.call_spec.out_spec)
    is_tensor = lambda x: isinstance(x, torch.Tensor)  # noqa: E731
    bounds = {str(sym): [_finite(r.lower), _finite(r.upper)]  # (torch.export's Dim min and max)
              for sym, r in ep.range_constraints.items()}
    saved.save(prog.exe, path, {"name": name, "args": structure((list(args), kwargs), is_tensor, sort_keys=False),
                                "results": structure(results, lambda x: x is marker, sort_keys=False),
                                "inputs": list(t.tensor_inputs), "outputs": outputs, "bounds": bounds}, constants)


def _finite(bound) -> int | None:
    """A range's end as an int, None where it is unbounded (sympy's or torch's infinities)."""
    try:
        return int(bound) if bool(bound.is_finite) else None
    except (AttributeError, TypeError, ValueError, OverflowError):
        return None


def _export_decompositions():
    """torch.export's decompositions (the core set, composites included) as
    AOTAutograd's inference graphs get them: the ops the table lowers whole
    kept, polyjit's own chosen ones added."""
    table = torch.export.default_decompositions()
    for op in list(table.keys()):
        if op in ATEN and op not in INFERENCE_DECOMPOSITIONS:
            table.pop(op)
    table.update(INFERENCE_DECOMPOSITIONS)
    return table


class _FunctionModule(torch.nn.Module):
    """A function as a module, for torch.export."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _compiled(gm, options: CompileOptions, name: str, stats: Stats, where: str,
              example_inputs: Sequence | None = None) -> CompiledGraph:
    """A graph translated and compiled for contiguous inputs on ``where`` now,
    so that what the compiler refuses (a size that is not affine) becomes a
    counted fallback here rather than an error at the first call. The
    layouts its saved activations take are reported to AOTAutograd, which
    compiles the backward for inputs laid out so."""
    from torch._guards import TracingContext
    compiled = CompiledGraph(gm, options, name, stats, example_inputs)
    strides = compiled.saved_in_target_order(where)
    compiled.exe.variant((False,) * len(compiled.exe.graph.inputs), where)
    context = TracingContext.try_get()
    if strides and context is not None and context.output_strides is not None:
        context.output_strides.extend(strides)  # AOTAutograd restrides the backward's inputs to match
    return compiled


def _as_module(compiled: CompiledGraph) -> torch.nn.Module:
    class Wrapped(torch.nn.Module):
        def forward(self, *args):
            out = compiled(*args)
            return out if len(out) != 1 else out[0]
    return Wrapped()


def _boxed(fn):
    from functorch.compile import make_boxed_func
    return make_boxed_func(fn)


class PolyjitBackend:
    """A torch.compile backend; keeps the stats of everything it compiled.
    Backends of equal options are equal: Dynamo then serves a frame compiled
    through one of them to the others (as it does Inductor's), so that many
    instances of one module class, each wrapped by jit_torch, share their
    compiled graphs instead of recompiling each (and running eagerly past
    Dynamo's recompile limit). Stats stay with the backend that compiled."""

    def __init__(self, options: CompileOptions | None = None, stats: Stats | None = None) -> None:
        self.options = options or CompileOptions()
        self.stats = stats if stats is not None else Stats()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PolyjitBackend) and self.options == other.options

    def __hash__(self) -> int:
        return hash(self.options)

    def _compiler(self, kind: str):
        def compile_graph(gm, example_inputs):
            name = f"{kind}{next(_graph_ids)}"
            gm.meta[_AS_TRACED] = kind != "backward"
            try:
                compiled = compile_fx(gm, example_inputs, self.options, self.stats, name)
            except Exception as err:  # polyjit's own failure: this graph runs in eager PyTorch
                internal_failure(self.stats, f"graph {name}", err, "eager PyTorch", self.options.strict)
                return _boxed(gm.forward)
            if isinstance(compiled, CompiledGraph):
                return _boxed(compiled)
            return _boxed(compiled.forward)
        return compile_graph

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        # the forward saves what the backward cannot cheaply recompute (Inductor's
        # min-cut partition): a GELU is recomputed from its input, fused into the backward
        # input mutations (batch norms' running statistics) stay in the graph: copied in after the call,
        # together, rather than one copy_ each by AOTAutograd's wrapper
        torch_attention.fuse_attention(gm)
        trace = _trace_text(gm, example_inputs, self.options)
        expect_compile(trace)  # (the workers' imports beside AOTAutograd's trace)
        # AOTAutograd's own test for a graph that needs no backward
        inference = not torch.is_grad_enabled() or not any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)
        backend = aot_autograd(fw_compiler=self._compiler("forward"), bw_compiler=self._compiler("backward"),
                               inference_compiler=self._compiler("inference"),
                               decompositions=INFERENCE_DECOMPOSITIONS if inference else TRAINING_DECOMPOSITIONS,
                               keep_inference_input_mutations=True,
                               partition_fn=functools.partial(_partition, use_cache=self.options.cache))
        # attention as matmuls and softmax, which fuse, rather than a device's fused kernel
        with sdpa_kernel([SDPBackend.MATH]):
            result = backend(gm, example_inputs)
        compiled(trace)
        return result


def _trace_text(gm: torch.fx.GraphModule, example_inputs, options: CompileOptions) -> str | None:
    """What compiling dynamo's graph depends on, as trace_text: its code;
    its inputs' shapes, strides, dtypes, devices and whether they need
    gradients; grad mode; the options."""
    inputs = [(tuple(x.shape), x.stride(), x.dtype, x.device.type, x.requires_grad)
              if isinstance(x, torch.Tensor) else x for x in example_inputs]
    return trace_text(options, ("torch", torch.__version__, torch.is_grad_enabled(), inputs), gm.code)


_SAVED = "polyjit_saved"  # a forward graph's meta: its outputs' node names that only the backward reads
_AS_TRACED = "polyjit_as_traced"  # a whole forward or inference graph's meta: its results laid out as traced


def _partition(joint: torch.fx.GraphModule, joint_inputs, *, use_cache: bool = True, **kwargs):
    """Inductor's min-cut partition (its decisions kept in the compile cache
    unless ``use_cache`` is off: see torch_partition), noting which of the
    forward's outputs are saved for the backward (they follow its first
    num_fwd_outputs)."""
    fw, bw = torch_partition.partition(joint, joint_inputs, use_cache=use_cache, **kwargs)
    outs = next(iter(fw.graph.find_nodes(op="output"))).args[0]
    k = kwargs.get("num_fwd_outputs", len(outs))
    shown = {getattr(n, "name", None) for n in outs[:k]}
    fw.meta[_SAVED] = frozenset(n.name for n in outs[k:] if isinstance(n, torch.fx.Node) and n.name not in shown)
    return fw, bw


_graph_ids = itertools.count(1)  # graph names are unique in the process: stats are kept by name
_BACKEND_STATS = Stats()


def polyjit_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
    """The ``torch.compile(backend="polyjit", options=...)`` entry point."""
    return PolyjitBackend(parse_options(options, extra=_FRONTEND_KEYS), _BACKEND_STATS)(gm, example_inputs)


def stats(reset: bool = False) -> Stats:
    """What ``torch.compile(..., backend="polyjit")`` compiled in this process
    (every graph of every model, graph breaks included), read as a dict;
    ``reset=True`` starts the count again."""
    global _BACKEND_STATS
    if reset:
        _BACKEND_STATS = Stats()
    return _BACKEND_STATS


_FRONTEND_KEYS = {"dynamic": "True, False or None"}


def jit_torch(fn=None, *, compile_options: dict | None = None, execution_backend: str = "polyjit",
              dynamic: bool | None = None):
    """Compile a function or nn.Module with polyjit (as torch.compile would).

    ``execution_backend="std"`` runs it eagerly and ``"inductor"`` through
    TorchInductor, so backends compare by changing one word. The result has
    ``.stats`` (what polyjit did; empty for the other backends).
    """
    check_execution_backend("torch", execution_backend)
    opts = dict(compile_options or {})
    dynamic = opts.pop("dynamic", dynamic)
    options = parse_options(opts)

    def wrap(f):
        if execution_backend == "std":
            compiled = f
            backend = None
        elif execution_backend == "inductor":
            compiled = torch.compile(f, backend="inductor", dynamic=dynamic)
            backend = None
        else:
            backend = PolyjitBackend(options)
            compiled = torch.compile(f, backend=backend, dynamic=dynamic)
        save = functools.partial(_save, f, options, execution_backend)
        if isinstance(f, torch.nn.Module):  # torch.compile's module wrapper, with our stats
            compiled.stats = backend.stats if backend else Stats()
            compiled.save = save
            return compiled

        return _StatsFunction(compiled, backend, save)
    return wrap(fn) if fn is not None else wrap


def _save(fn, options: CompileOptions, backend: str, path, *args, dynamic_shapes=None, **kwargs) -> None:
    """jit_torch's ``save(path, *args, dynamic_shapes=None, **kwargs)``: save_program."""
    if backend != "polyjit":
        raise CompileOptionError(f"execution_backend={backend!r} compiles nothing to save")
    save_program(fn, options, path, args, dynamic_shapes, kwargs)


class _StatsFunction:
    """A compiled callable with ``.stats``, and ``save(path, *args)``
    (save_program: the program for these arguments, for polyjit.load)."""

    def __init__(self, call, backend, save) -> None:
        self._call = call
        self._backend = backend
        self.save = save
        functools.update_wrapper(self, getattr(call, "_torchdynamo_orig_callable", call))

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    @property
    def stats(self) -> Stats:
        return self._backend.stats if self._backend else Stats()
