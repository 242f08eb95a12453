"""JAX frontend: ``jit_jax`` from jaxprs.

The function is traced with ``jax.make_jaxpr`` for each signature (shapes,
dtypes, pytree structure, static arguments). Calls into other jaxprs
(``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``) are inlined
and ``scan`` over a short static length (``fori_loop``) is unrolled; then
each equation is translated through :data:`PRIMITIVES`, the one table from
JAX primitives to polyjit ops. Runs of supported equations compile into one
polyjit program; an equation outside the table runs through JAX between
them: counted in the stats, warned about once, refused under ``strict``.

Called with JAX arrays on the target's device, a program runs as an XLA
custom call (see ``register_custom_call``): native code runs its kernels
on XLA's buffers (and stream). Inside a JAX transformation (``jax.grad``,
``jax.jit``, ``vmap``) the program runs with a custom VJP whose backward,
the VJP of the same function, is compiled by polyjit too; each is such a
custom call, or a ``pure_callback`` where JAX's default device is not the
target's or the program has fallbacks.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import logging
import math
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from polyjit import ops, saved
from polyjit import sizes as sz
from polyjit.api import takes_device_arrays
from polyjit.compiler import compiled, expect_compile
from polyjit.dtypes import DataType
from polyjit.errors import CompileOptionError, InputError, UnsupportedOpError
from polyjit.options import CompileOptions, parse_options
from polyjit.runtime import RowMajor, cuda_graphs, xla_ffi
from polyjit.runtime.gpu_buffers import GpuView
from polyjit.saved import structure
from polyjit.sizes import Lin
from polyjit.targets import holding

from .common import (Const, Op, SegmentedProgram, Stats, Value, WhileLoop, check_execution_backend, core_dtype,
                     elementwise, function_text, identity, internal_failure, live, logical, static_value,
                     trace_text)

log = logging.getLogger("polyjit.jax")

SCAN_UNROLL_LIMIT = 64  # longest static scan (fori_loop) unrolled into the program
# Results up to this size come from glibc's heap, reused (its dynamic mmap threshold
# stops at 32 MB); XLA's larger CPU results are fresh pages whose faults cost more
# than the kernels (bench/NOTES.md).
CPU_CALL_RESULT_BYTES = 32 << 20
# A GPU call's module is its one custom call: XLA replays it as a CUDA graph
# (its launches captured once per set of buffers) only where a graph of one
# command is allowed.
ONE_CALL_GRAPH = {"xla_gpu_graph_min_graph_size": 1}


def _graph_options(where: int | str) -> dict | None:
    """The compiler options of a call from Python on ``where`` ("cpu" or a GPU's ordinal)."""
    return ONE_CALL_GRAPH if where != "cpu" and cuda_graphs.ENABLED else None


_target_ids = itertools.count()  # custom-call target names are unique in the process


# ====================================================================== table
def _to_jax(o, device):
    """A result as a JAX array: GPU results (polyjit's DeviceBuffer) by DLPack, no copy."""
    return jax.dlpack.from_dlpack(o) if _is_gpu_result(o) else jax.device_put(o, device)


def _is_gpu_result(o) -> bool:
    return hasattr(o, "__dlpack__") and not isinstance(o, (np.ndarray, jax.Array))


def _nextafter(p, x, y):
    """The next float after x towards y, on the bits: one step away from zero
    or towards it; from zero the smallest subnormal with y's sign."""
    if x.dtype not in (DataType.Float, DataType.Double):
        raise UnsupportedOpError(f"nextafter of {x.dtype}")
    it = DataType.Int32 if x.dtype == DataType.Float else DataType.Int
    bits, zero, one = ops.bitcast(x, it), ops.full([], 0, x.dtype, like=x), ops.full([], 1, it, like=x)
    step = ops.where((y > x) == (x > zero), bits + one, bits - one)
    smallest = ops.where(y > zero, one, ops.full([], -(2 ** (8 * it.itemsize - 1)) + 1, it, like=x))
    out = ops.bitcast(ops.where(x == zero, smallest, step), x.dtype)
    out = ops.where(x == y, y, out)
    return ops.where(ops.isnan(x) | ops.isnan(y), x + y, out)


def _partitionable(what: str) -> None:
    """polyjit computes JAX's partitionable threefry scheme (the default):
    the other one gives other bits."""
    if not jax.config.jax_threefry_partitionable:
        raise UnsupportedOpError(f"{what} with jax_threefry_partitionable off")


def _random_bits(p, key):
    if p["bit_width"] != 32 or key.ndim != 1:
        raise UnsupportedOpError(f"random_bits of {p['bit_width']} bits from a key of shape {list(key.shape[:-1])}")
    _partitionable("random_bits")
    return ops.random_bits(key, p["shape"])


def _random_seed(p, seed):
    """A threefry key from a 32-bit seed: its bits after a zero word, as
    threefry_seed pads it (a 64-bit seed's high word is not computed here)."""
    if getattr(p["impl"], "name", None) != "threefry2x32" or seed.dtype.itemsize != 4:
        raise UnsupportedOpError(f"random_seed of a {seed.dtype} seed for {getattr(p['impl'], 'name', p['impl'])}")
    bits = ops.reshape(ops.cast(seed, "uint32"), [1])
    return ops.cat([ops.full_like(bits, 0), bits], 0)


def _random_fold_in(p, key, data):
    if key.ndim != 1:
        raise UnsupportedOpError(f"random_fold_in of keys of shape {list(key.shape[:-1])}")
    return ops.random_fold_in(key, int(static_value(data)))


def _random_split(p, key):
    if key.ndim != 1:
        raise UnsupportedOpError(f"random_split of keys of shape {list(key.shape[:-1])}")
    _partitionable("random_split")
    return ops.random_split(key, p["shape"])


def _integer_pow(p, x):
    y = p["y"]
    acc, base, n = None, x, abs(y)
    while n:
        if n & 1:
            acc = base if acc is None else acc * base
        n >>= 1
        if n:
            base = base * base
    if acc is None:
        return ops.full_like(x, 1)
    return 1 / acc if y < 0 else acc


def _round(p, x):
    if int(p.get("rounding_method", 0)) == 1:  # to nearest even
        return ops.round(x)
    t = ops.trunc(x)  # halves away from zero; x - t is exact (floor(|x| + 0.5) rounds 0.49999997 up)
    return ops.where(abs(x - t) >= 0.5, t + ops.sign(x), t)


def _by_zero(b, value, q):
    """q, or value where the integer divisor b is 0 (XLA's results there)."""
    if isinstance(b, (int, np.integer)):
        return q if b else value + ops.zeros_like(q)
    return ops.where(b == 0, value, q)


def _div(p, a, b):
    """XLA's division: integers toward zero, by 0 all ones (-1, or the unsigned maximum)."""
    if a.dtype.is_float:
        return ops.div(a, b)
    return _by_zero(b, int(np.iinfo(a.dtype.numpy).max) if a.dtype.is_unsigned else -1, ops.trunc_divide(a, b))


def _rem(p, a, b):
    """XLA's remainder: the dividend's sign (fmod), and for integers by 0 the dividend."""
    return ops.fmod(a, b) if a.dtype.is_float else _by_zero(b, a, ops.fmod(a, b))


def _sign(p, x):
    """XLA's sign: signed zeros kept (the core op's, as NumPy's, is +0 for both)."""
    return ops.where(x == 0, x, ops.sign(x)) if x.dtype.is_float else ops.sign(x)


def _convert(p, x):
    """XLA's conversions: a float to an integer saturates at the type's
    bounds and NaN becomes 0 (where a machine's conversion is undefined
    past them)."""
    to = core_dtype(p["new_dtype"])
    y = ops.cast(x, to)
    if not (x.dtype.is_float and to.is_int):
        return y
    info = np.iinfo(to.numpy)
    y = ops.where(x >= float(info.max) + 1.0, info.max, ops.where(x < float(info.min), info.min, y))
    return ops.where(ops.isnan(x), 0, y)


def _select_n(p, pred, *cases):
    if pred.dtype == DataType.Bool:
        return ops.where(pred, cases[1], cases[0]) if len(cases) == 2 else cases[0]
    out = cases[0]
    for i, c in enumerate(cases[1:], 1):
        out = ops.where(pred == i, c, out)
    return out


def _reduce(reduce):
    return lambda p, x: reduce(x, p["axes"])


def _argreduce(argreduce):
    return lambda p, x: argreduce(x, p["axes"][0])


def _reshape(p, x):
    if p.get("dimensions") is not None:  # the operand transposed first (a grouped convolution's weight gradient)
        x = ops.permute(x, p["dimensions"])
    return ops.reshape(x, p["new_sizes"])


def _start(i: ops.Tensor, n, m):
    """A dynamic slice's start index clamped into [0, n - m], as XLA does: a
    number where it is known at compile time, else a scalar Tensor (an index
    computed at run time: x[i] in a loop's body, a cache's write position)."""
    try:
        return min(max(int(static_value(i)), 0), n - m)
    except UnsupportedOpError:
        _static_sizes("dynamic_slice at a start computed at run time", i)
        if isinstance(n, Lin) or isinstance(m, Lin):
            raise UnsupportedOpError("dynamic_slice at a start computed at run time over symbolic sizes") from None
        return ops.clamp(ops.cast(i, DataType.Int), 0, n - m)


def _dynamic_slice(p, x, *at):
    """lax.dynamic_slice: a slice at known starts, a take of the window's
    positions where a start is known only at run time."""
    sizes = p["slice_sizes"]
    starts = [_start(i, x.shape[d], sizes[d]) for d, i in enumerate(at)]
    known = [s if isinstance(s, int) else 0 for s in starts]
    x = ops.slice(x, known, [k + m if isinstance(s, int) else n for k, s, m, n in zip(known, starts, sizes, x.shape)])
    for d, s in enumerate(starts):
        if not isinstance(s, int):
            x = ops.take(x, s + ops.iota([sizes[d]], 0, like=x), d)
    return x


def _dynamic_update_slice(p, x, update, *at):
    """x with update written at its start indices (clamped, as XLA does):
    the update spread out to x's shape and selected where it lands; along a
    dim whose start is known only at run time, each position takes the
    update's element at its distance from the start."""
    _static_sizes("dynamic_update_slice", x, update)
    inside = ops.full_like(update, True, DataType.Bool)
    for d, (i, n, m) in enumerate(zip(at, x.shape, update.shape)):
        s = _start(i, int(n), int(m))
        if isinstance(s, int):
            lo, hi = [0] * x.ndim, [0] * x.ndim
            lo[d], hi[d] = s, int(n) - s - int(m)
            update, inside = ops.pad_edges(update, lo, hi, 0), ops.pad_edges(inside, lo, hi, False)
            continue
        far = ops.iota([int(n)], 0, like=x) - s
        at_d = ops.clamp(far, 0, int(m) - 1)
        update, inside = ops.take(update, at_d, d), ops.take(inside, at_d, d)
        lands = ops.logical_and(far >= 0, far < int(m))
        inside = ops.logical_and(inside, ops.broadcast_in_dim(lands, list(inside.shape), [d]))
    return ops.where(inside, update, x)


def _pad(p, x, value):
    """lax.pad: interior padding (the adjoint of a strided access, as in a
    strided pooling's gradient) dilates first; negative edges cut."""
    value, config = static_value(value).item(), p["padding_config"]
    if any(interior for _, _, interior in config):
        factors = [interior + 1 for _, _, interior in config]
        spread = ops.dilate(x, factors)
        if value != 0:  # dilate fills with zeros: the cells it adds take the value
            spread = ops.where(ops.dilate(ops.full_like(x, True, DataType.Bool), factors), spread, value)
        x = spread
    y = ops.pad_edges(x, [max(lo, 0) for lo, _, _ in config], [max(hi, 0) for _, hi, _ in config], value)
    if any(lo < 0 or hi < 0 for lo, hi, _ in config):
        start = [max(-lo, 0) for lo, _, _ in config]
        end = [n - max(-hi, 0) for n, (_, hi, _) in zip(y.shape, config)]
        y = ops.slice(y, start, end)
    return y


def _cumulative(op: str):
    return lambda p, x: ops.cumulative(op, x, p["axis"], bool(p.get("reverse")))


def _reduce_window(op: str):
    def rule(p, x):
        if any(d != 1 for d in p["base_dilation"]):
            raise UnsupportedOpError("reduce_window with base dilation")
        return ops.reduce_window(op, x, p["window_dimensions"], p["window_strides"], p["padding"],
                                 p["window_dilation"])
    return rule


def _select_and_scatter_add(p, src, x):
    """Max pooling's gradient: each window's source value is added at the
    position of the window's first maximum (select ge keeps the earlier of
    equal values). Windows unroll into strided slices of the operand padded
    with -inf; a running (maximum, flat position) picks each window's
    element, and each window's source value flows back to the cell whose
    position won (ops.window_adjoint)."""
    if getattr(p["select_prim"], "name", "") != "ge":
        raise UnsupportedOpError(f"select_and_scatter_add selecting with {p['select_prim']}")
    lo, hi = [a for a, _ in p["padding"]], [b for _, b in p["padding"]]
    _static_sizes("select_and_scatter_add", x, src)
    xp = ops.pad_edges(x, lo, hi, -math.inf) if any(lo) or any(hi) else x
    flat_strides = [math.prod(int(s) for s in xp.shape[d + 1:]) for d in range(x.ndim)]
    windows, strides = p["window_dimensions"], p["window_strides"]
    best = won = None
    cells = {}
    for offset in itertools.product(*[range(w) for w in windows]):
        end = [k + s * (n - 1) + 1 for k, s, n in zip(offset, strides, src.shape)]
        value = ops.slice(xp, list(offset), end, list(strides))
        at = ops.full([], sum(k * f for k, f in zip(offset, flat_strides)), DataType.Int, like=x)
        for d in range(x.ndim):
            if src.shape[d] != 1:
                at = at + ops.iota(src.shape, d, like=x) * ops.full([], strides[d] * flat_strides[d], DataType.Int,
                                                                     like=x)
        at = cells[offset] = ops.broadcast_in_dim(at, src.shape, []) if at.ndim == 0 else at
        if best is None:
            best, won = value, at
            continue
        keep = best >= value
        best, won = ops.where(keep, best, value), ops.where(keep, won, at)
    return ops.window_adjoint(lambda offset: ops.where(won == cells[offset], src, 0.0), list(x.shape),
                              windows, strides, list(zip(lo, hi)))


def _mode(p) -> str:
    """A gather's or scatter's out-of-bounds mode: "clip", "fill" or "promise"."""
    name = getattr(p.get("mode"), "name", str(p.get("mode"))).upper()
    return "fill" if "FILL" in name else "promise" if "PROMISE" in name else "clip"


def _fill_value(dtype: DataType, value):
    """FILL_OR_DROP's default: NaN for floats, the lowest signed, the highest unsigned, True."""
    if value is not None:
        return value
    np_dtype = np.dtype(dtype.numpy)
    if np_dtype.kind == "f":
        return math.nan
    if np_dtype.kind == "b":
        return True
    return int(np.iinfo(np_dtype).max if np_dtype.kind == "u" else np.iinfo(np_dtype).min)


def _static_sizes(what: str, *xs: ops.Tensor) -> None:
    if any(isinstance(s, Lin) for x in xs for s in x.shape):
        raise UnsupportedOpError(f"{what} over symbolic sizes")


def _window_positions(x_shape, indices, starts_to_operand, operand_batching, indices_batching,
                      window_sizes, out_shape, batch_at, window_at, window_dims, mode):
    """Flat positions in an operand of x_shape, of out_shape, for a gather's
    output or a scatter's updates (the two share their index arithmetic):
    the window of operand dims window_dims (sizes window_sizes) runs along
    out_shape's dims window_at, the indices' batch dims along batch_at; a
    window's start comes from the index vector (starts_to_operand), from a
    batch position (operand batching dims) or is 0. Starts are clamped so
    the window fits, as XLA does; also returns, for mode "fill", where the
    unclamped start was in bounds (None otherwise)."""
    start: dict = {}
    valid, zero = None, ops.full([], 0, DataType.Int, like=indices)
    for k, d in enumerate(starts_to_operand):
        idx = ops.slice(indices, [0] * (indices.ndim - 1) + [k], list(indices.shape[:-1]) + [k + 1])
        idx = ops.broadcast_in_dim(ops.cast(ops.reshape(idx, indices.shape[:-1]), DataType.Int), out_shape, batch_at)
        top = ops.full([], int(x_shape[d]) - int(window_sizes[d]), DataType.Int, like=indices)
        if mode == "fill":
            ok = (idx >= zero) & (idx <= top)
            valid = ok if valid is None else valid & ok
        start[d] = ops.clamp(idx, zero, top)
    for d, i in zip(operand_batching, indices_batching):
        start[d] = ops.iota(out_shape, batch_at[i], like=indices)
    for d, at in zip(window_dims, window_at):
        offset = ops.iota(out_shape, at, like=indices)
        start[d] = start[d] + offset if d in start else offset
    flat = None
    for d, pos in start.items():
        stride = math.prod(int(s) for s in x_shape[d + 1:])
        term = pos * ops.full([], stride, DataType.Int, like=indices) if stride != 1 else pos
        flat = term if flat is None else flat + term
    if flat is None:
        flat = zero
    return ops.broadcast_to(flat, out_shape) if flat.ndim == 0 else flat, valid


def _gather_dims(dn, sizes, x, indices):
    """A gather's result shape, where its batch dims go, and the operand's window dims."""
    batch = tuple(indices.shape[:-1])
    window_dims = [d for d in range(x.ndim) if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    out_rank = len(batch) + len(dn.offset_dims)
    batch_at = [q for q in range(out_rank) if q not in dn.offset_dims]
    out_shape = [0] * out_rank
    for q, d in zip(dn.offset_dims, window_dims):
        out_shape[q] = sizes[d]
    for q, n in zip(batch_at, batch):
        out_shape[q] = n
    return out_shape, batch_at, window_dims


def _take_along(x, indices, axis, dn, out_shape, batch_at, window_dims, mode):
    """A gather that takes along one axis (``x[idx]``, embeddings): one take,
    its dims put in place; also where an index was in bounds, for mode fill."""
    batch = tuple(indices.shape[:-1])
    idx = ops.cast(ops.reshape(indices, batch), DataType.Int)
    zero, n = ops.full([], 0, DataType.Int, like=x), ops.full([], int(x.shape[axis]) - 1, DataType.Int, like=x)
    out = ops.take(x, ops.clamp(idx, zero, n), axis)
    labels = [("w", d) for d in range(axis)] + [("b", i) for i in range(len(batch))] + \
             [("w", d) for d in range(axis + 1, x.ndim)]
    want = [None] * len(out_shape)
    for q, d in zip(dn.offset_dims, window_dims):
        want[q] = ("w", d)
    for i, q in enumerate(batch_at):
        want[q] = ("b", i)
    perm = [labels.index(w) for w in want]
    out = out if perm == list(range(len(out_shape))) else ops.permute(out, perm)
    if mode != "fill":
        return out, None
    return out, ops.broadcast_in_dim((idx >= zero) & (idx <= n), out_shape, batch_at)


def _gather(p, x, indices):
    """lax.gather in any dimension numbers: a take along one operand axis
    when that is what it is (``x[idx]``, embeddings), otherwise a take from
    the flattened operand at computed positions (``take_along_axis``);
    out-of-bounds starts clamp, or with mode fill give the fill value."""
    dn, sizes, mode = p["dimension_numbers"], tuple(p["slice_sizes"]), _mode(p)
    _static_sizes("gather", x, indices)
    out_shape, batch_at, window_dims = _gather_dims(dn, sizes, x, indices)
    axis = dn.start_index_map[0] if len(dn.start_index_map) == 1 else None
    if axis is not None and not dn.operand_batching_dims and axis in dn.collapsed_slice_dims \
            and all(sizes[d] == x.shape[d] for d in range(x.ndim) if d != axis):
        out, valid = _take_along(x, indices, axis, dn, out_shape, batch_at, window_dims, mode)
    else:
        flat, valid = _window_positions(x.shape, indices, dn.start_index_map, dn.operand_batching_dims,
                                        dn.start_indices_batching_dims, sizes, out_shape, batch_at,
                                        dn.offset_dims, window_dims, mode)
        out = ops.take(ops.reshape(x, [-1]), flat, 0)
    if valid is None:
        return out
    return ops.where(valid, out, ops.full([], _fill_value(x.dtype, p.get("fill_value")), x.dtype, like=x))


def _scatter(how: str):
    """lax.scatter_add / scatter_mul / scatter_min / scatter_max (how: sum,
    prod, min, max; with sum, a gather's adjoint), or lax.scatter (how: set,
    ``x.at[i].set(v)``, the last of repeated positions winning: XLA leaves
    the winner undefined): updates go into the operand at positions worked
    out as for a gather, over the flattened operand; with mode fill,
    out-of-bounds updates drop."""
    def rule(p, x, indices, updates):
        dn, mode = p["dimension_numbers"], _mode(p)
        _static_sizes("scatter", x, indices, updates)
        window_dims = [d for d in range(x.ndim) if d not in dn.inserted_window_dims
                       and d not in dn.operand_batching_dims]
        batch_at = [q for q in range(updates.ndim) if q not in dn.update_window_dims]
        sizes = [1] * x.ndim
        for q, d in zip(dn.update_window_dims, window_dims):
            sizes[d] = updates.shape[q]
        flat, valid = _window_positions(x.shape, indices, dn.scatter_dims_to_operand_dims,
                                        dn.operand_batching_dims, dn.scatter_indices_batching_dims, sizes,
                                        list(updates.shape), batch_at, dn.update_window_dims, window_dims, mode)
        total = math.prod(int(s) for s in x.shape)
        if valid is not None:  # a dropped update goes to a slot past the operand's end
            flat = ops.where(valid, flat, ops.full([], total, flat.dtype, like=flat))
        flat, values = ops.reshape(flat, [-1]), ops.reshape(updates, [-1])
        canvas = ops.pad(ops.reshape(x, [-1]), [0, 1])
        out = ops.scatter(canvas, flat, values) if how == "set" else ops.scatter_combine(canvas, how, flat, values)
        return ops.reshape(ops.slice(out, [0], [total]), list(x.shape))
    return rule


def _sort(p, *xs):
    """lax.sort by its first operand (num_keys=1), stable; the other
    operands (argsort's iota) follow the same permutation."""
    if p["num_keys"] != 1:
        raise UnsupportedOpError(f"sort with {p['num_keys']} keys")
    values, at = ops.sort(xs[0], p["dimension"])
    return [values] + [ops.take_along_axis(x, at, p["dimension"]) for x in xs[1:]]


def _top_k(p, x):
    values, at = ops.topk(x, p["k"], p.get("axis", -1))
    return [values, ops.cast(at, DataType.Int32)]


_SPATIAL = "HWDUVZ"


def _conv_operand(p, x, padding):
    """conv_general_dilated's operand and its padding: lhs dilation (the
    input gradient of a strided convolution) stays the convolution's own
    input dilation, whose expansion crops negative padding per phase
    (ops.spread_conv); without it negative padding crops the operand here.
    Returns the operand, the padding left and the input dilation (None: none)."""
    dn = p["dimension_numbers"]
    if any(d != 1 for d in p["lhs_dilation"]):
        return x, padding, list(p["lhs_dilation"])
    if all(lo >= 0 and hi >= 0 for lo, hi in padding):
        return x, padding, None
    start, end = [0] * x.ndim, list(x.shape)
    for k, (lo, hi) in enumerate(padding):
        d = dn.lhs_spec[2 + k]
        start[d], end[d] = max(-lo, 0), end[d] - max(-hi, 0)
    return ops.slice(x, start, end), [(max(lo, 0), max(hi, 0)) for lo, hi in padding], None


def _conv(p, x, w):
    """conv_general_dilated (see _conv_operand). Batch groups (a grouped
    convolution's weight gradient) move into the channels: group j's
    batch rows become channels j*C..(j+1)*C of one feature-grouped convolution."""
    dn, nsp = p["dimension_numbers"], x.ndim - 2
    x, padding, spread = _conv_operand(p, x, [tuple(pr) for pr in p["padding"]])

    def layout(spec, a, b):
        out = [""] * len(spec)
        out[spec[0]], out[spec[1]] = a, b
        for k in range(nsp):
            out[spec[2 + k]] = _SPATIAL[k]
        return "".join(out)
    lhs, rhs, want = layout(dn.lhs_spec, "N", "C"), layout(dn.rhs_spec, "O", "I"), layout(dn.out_spec, "N", "C")
    groups = p["feature_group_count"]
    if p["batch_group_count"] > 1:
        groups = p["batch_group_count"]
        canon = "NC" + _SPATIAL[:nsp]
        t = ops.permute(x, [lhs.index(c) for c in canon])
        n, c, sp = int(t.shape[0]) // groups, t.shape[1], list(t.shape[2:])
        t = ops.permute(ops.reshape(t, [groups, n, c] + sp), [1, 0, 2] + list(range(3, 3 + nsp)))
        x, lhs = ops.reshape(t, [n, groups * c] + sp), canon
    y = ops.conv(x, w, p["window_strides"], padding, p["rhs_dilation"], groups, lhs, rhs, spread)
    perm = [lhs.index(c) for c in want]
    return y if perm == list(range(len(perm))) else ops.permute(y, perm)


PRIMITIVES: dict[str, Callable] = {
    # elementwise
    **{name: elementwise(op) for name, op in [
        ("neg", "neg"), ("abs", "abs"), ("exp", "exp"), ("log", "log"), ("log1p", "log1p"),
        ("expm1", "expm1"), ("sqrt", "sqrt"), ("rsqrt", "rsqrt"), ("sin", "sin"), ("cos", "cos"),
        ("tan", "tan"), ("tanh", "tanh"), ("erf", "erf"), ("logistic", "sigmoid"), ("floor", "floor"),
        ("ceil", "ceil"), ("is_finite", "isfinite"), ("erf_inv", "erf_inv"),
        ("erfc", "erfc"), ("lgamma", "lgamma"), ("digamma", "digamma"),
        ("add", "add"), ("add_any", "add"), ("sub", "sub"), ("mul", "mul"), ("max", "maximum"),
        ("min", "minimum"), ("pow", "pow"), ("atan2", "atan2"), ("exp2", "exp2"), ("eq", "eq"), ("ne", "ne"),
        ("lt", "lt"), ("le", "le"), ("gt", "gt"), ("ge", "ge"), ("shift_left", "shift_left"),
        ("shift_right_logical", "shift_right_logical"), ("shift_right_arithmetic", "shift_right_arithmetic")]},
    "div": _div,
    "rem": _rem,
    **{name: logical(name) for name in ("and", "or", "xor", "not")},
    "integer_pow": _integer_pow,
    "square": lambda p, x: x * x,
    "one_minus_square": lambda p, x: 1 - x * x,
    "round": _round,
    "select_n": _select_n,
    "clamp": lambda p, lo, x, hi: ops.clamp(x, lo, hi),
    "sign": _sign,
    "convert_element_type": _convert,
    "bitcast_convert_type": lambda p, x: ops.bitcast(x, core_dtype(p["new_dtype"])),
    "nextafter": _nextafter,
    # random numbers: a threefry key is its uint32[2] data here
    "random_wrap": identity, "random_unwrap": identity, "random_bits": _random_bits, "random_split": _random_split,
    "random_seed": _random_seed,
    "random_fold_in": _random_fold_in,
    "stop_gradient": identity, "copy": identity, "copy_p": identity,
    "optimization_barrier": identity, "sharding_constraint": identity,
    # layout
    "broadcast_in_dim": lambda p, x: ops.broadcast_in_dim(x, p["shape"], p["broadcast_dimensions"]),
    "reshape": _reshape,
    "squeeze": lambda p, x: ops.squeeze(x, p["dimensions"]),
    "transpose": lambda p, x: ops.permute(x, p["permutation"]),
    "slice": lambda p, x: ops.slice(x, p["start_indices"], p["limit_indices"], p.get("strides")),
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "tile": lambda p, x: ops.tile(x, p["reps"]),
    "pad": _pad,
    "concatenate": lambda p, *xs: ops.cat(xs, p["dimension"]),
    "split": lambda p, x: ops.split(x, list(p["sizes"]), p["axis"]),
    "unstack": lambda p, x: [ops.squeeze(s, [p["axis"]]) for s in ops.split(x, x.shape[p["axis"]], p["axis"])],
    "rev": lambda p, x: ops.reverse(x, p["dimensions"]),
    "iota": lambda p, *, like: ops.iota(p["shape"], p["dimension"], core_dtype(p["dtype"]), like=like),
    "dim_as_value": lambda p, *, like: ops.full([], p["dim"], DataType.Int, like=like),
    # a scalar of no particular value: the residuals of the branch a cond's gradient does not take
    "empty2": lambda p, *, like: ops.full([], 0, core_dtype(p["dtype"]), like=like),
    # reductions and windows
    "reduce_sum": _reduce(ops.sum), "reduce_max": _reduce(ops.max), "reduce_min": _reduce(ops.min),
    "reduce_prod": _reduce(ops.prod), "reduce_and": _reduce(ops.reduce_all), "reduce_or": _reduce(ops.reduce_any),
    "argmax": _argreduce(ops.argmax), "argmin": _argreduce(ops.argmin),
    "cumsum": _cumulative("sum"), "cumprod": _cumulative("prod"), "cummax": _cumulative("max"),
    "cummin": _cumulative("min"), "cumlogsumexp": _cumulative("logsumexp"),
    "reduce_window_sum": _reduce_window("sum"), "reduce_window_max": _reduce_window("max"),
    "reduce_window_min": _reduce_window("min"),
    "select_and_scatter_add": _select_and_scatter_add,
    "sort": _sort, "top_k": _top_k,
    # indexing
    "gather": _gather, "scatter-add": _scatter("sum"), "scatter_add": _scatter("sum"), "scatter": _scatter("set"),
    "scatter-mul": _scatter("prod"), "scatter_mul": _scatter("prod"), "scatter-min": _scatter("min"),
    "scatter_min": _scatter("min"), "scatter-max": _scatter("max"), "scatter_max": _scatter("max"),
    # contractions
    "dot_general": lambda p, a, b: ops.dot_general(a, b, *p["dimension_numbers"]),
    "conv_general_dilated": _conv,
}


# primitives whose body is another jaxpr, inlined before translation: name -> param holding it
CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
         "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
         "custom_vjp_call_jaxpr": "fun_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr"}


# ============================================================ flat programs
def _is_key(x) -> bool:
    """A threefry PRNG key array (or its aval): the keys polyjit reads as their uint32[2] data."""
    return not isinstance(x.dtype, np.dtype) and str(x.dtype) == "key<fry>"  # (a numpy dtype's str is slow)


def _key_impl(aval):
    return "threefry2x32" if _is_key(aval) else None


_DIM_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_DIM_CALLS = {"floordiv": operator.floordiv, "mod": lambda a, k: a - a // k * k}


def _size(d):
    """A dimension of a jaxpr (an int, or a symbolic one of jax.export's
    shape polymorphism: ``b``, ``2*b*s + 1``, ``floordiv(b, 2)``) as a size:
    its text read back over polyjit's sizes, a parameter per symbol."""
    if isinstance(d, (int, np.integer)):
        return int(d)

    def read(e):
        if isinstance(e, ast.Constant) and isinstance(e.value, int):
            return e.value
        if isinstance(e, ast.Name):
            return Lin.param(e.id)
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
            return -read(e.operand)
        if isinstance(e, ast.BinOp) and type(e.op) in _DIM_OPS:
            return _DIM_OPS[type(e.op)](read(e.left), read(e.right))
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id in _DIM_CALLS:
            return _DIM_CALLS[e.func.id](*map(read, e.args))
        raise UnsupportedOpError(f"the symbolic size {d} (not a sum of products and floor quotients)")
    return read(ast.parse(str(d), mode="eval").body)


def _sized(v):
    """A param with each symbolic dimension in it as a size (plain tuples
    of them: shapes); any other value as it is."""
    if type(v) is tuple:
        out = tuple(_sized(x) for x in v)
        return v if all(a is b for a, b in zip(out, v)) else out
    return v if isinstance(v, (int, np.integer)) or not hasattr(v, "dimension_as_value") else _size(v)


def _value(aval) -> Value:
    """A jaxpr value; a threefry key array is its key data, uint32[..., 2]."""
    shape = tuple(map(_size, aval.shape))
    if _is_key(aval):
        return Value(shape + (2,), np.dtype(np.uint32))
    return Value(shape, aval.dtype)


def _eqn_op(prim, params: dict, ins: list, outs: list, where: str = "", eqn=None) -> Op:
    impls = [_key_impl(v.aval) for v in eqn.invars] if eqn is not None else [None] * len(ins)

    def run(args):  # GPU results by DLPack; keys cross as their data, wrapped again for JAX
        args = [jax.dlpack.from_dlpack(a) if _is_gpu_result(a) else a for a in args]
        args = [jax.random.wrap_key_data(a, impl=i) if i is not None else a for a, i in zip(args, impls)]
        out = prim.bind(*args, **params)
        out = out if prim.multiple_results else [out]
        return [jax.random.key_data(o) if _is_key(o) else o for o in out]
    return Op(prim.name, PRIMITIVES.get(prim.name), {k: _sized(v) for k, v in params.items()}, ins, outs, run, where,
              effects=bool(eqn is not None and eqn.effects))


def _where(eqn) -> str:
    info = getattr(eqn, "source_info", None)
    try:
        from jax._src import source_info_util  # a readable user frame, best effort
        return source_info_util.summarize(info)
    except Exception:
        return ""


def _flatten(closed, args: list, out: list[Op]) -> list:
    """Append closed's equations to out with calls inlined; returns its outputs."""
    env: dict = {}

    def read(v):
        if isinstance(v, jcore.Literal):
            return Const(np.asarray(v.val, dtype=v.aval.dtype))
        return env[v]

    jaxpr = closed.jaxpr
    for v, c in zip(jaxpr.constvars, closed.consts):
        env[v] = Const(np.asarray(c))
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [read(v) for v in eqn.invars]
        if name in CALLS and CALLS[name] in eqn.params:
            sub = eqn.params[CALLS[name]]
            if not hasattr(sub, "consts"):
                sub = jcore.ClosedJaxpr(sub, ())
            n_in = len(sub.jaxpr.invars)
            results = _flatten(sub, ins[len(ins) - n_in:], out)
        elif name == "scan" and eqn.params["length"] <= SCAN_UNROLL_LIMIT:
            results = _unroll_scan(eqn, ins, out)
        elif name == "cond" and not eqn.effects:
            results = _select_branch(eqn, ins, out)
        elif name == "while" and not eqn.effects:
            results = _while_loop(eqn, ins, out)
        elif (folded := _folded(eqn, ins)) is not None:
            results = folded
        else:
            results = [_value(v.aval) for v in eqn.outvars]
            out.append(_eqn_op(eqn.primitive, dict(eqn.params), ins, results, _where(eqn), eqn))
        for v, r in zip(eqn.outvars, results):
            env[v] = r
    return [read(v) for v in jaxpr.outvars]


FOLD_LIMIT = 1 << 12  # elements: an equation of constants with results up to this size is evaluated while tracing


def _folded(eqn, ins: list) -> list | None:
    """The results of an equation whose operands are all constants (index
    arithmetic on captured arrays, as ``x.at[np.array(...)]`` makes), as
    constants; None where it must stay an equation."""
    if not ins or not all(isinstance(x, Const) for x in ins) or eqn.effects:
        return None
    if any(_is_key(v.aval) or not all(isinstance(d, int) for d in v.aval.shape)
           or math.prod(v.aval.shape) > FOLD_LIMIT for v in eqn.outvars):
        return None
    with jax.ensure_compile_time_eval():
        out = eqn.primitive.bind(*[x.value for x in ins], **eqn.params)
    out = out if eqn.primitive.multiple_results else [out]
    return [Const(np.asarray(o)) for o in out]


def _select_branch(eqn, ins, out: list[Op]) -> list:
    """lax.cond and lax.switch: every branch computed, each result chosen by
    the branch index (what XLA does with small branches on GPUs), rather
    than a fallback through the host. Branches have no effects, and a value
    the other branch computes (a NaN, an integer division by zero, which
    gives 0 here) is never chosen. lax.switch clamps its index before."""
    index, operands = ins[0], ins[1:]
    branches = [_flatten(b, operands, out) for b in eqn.params["branches"]]
    results = []
    for v, *cases in zip(eqn.outvars, *branches):
        r = _value(v.aval)
        out.append(_eqn_op(jax.lax.select_n_p, {}, [index, *cases], [r], _where(eqn)))
        results.append(r)
    return results


def _while_loop(eqn, ins, out: list[Op]) -> list:
    """lax.while_loop (and fori_loop over bounds known only at run time):
    its condition and body compiled as programs of their own, the loop run
    by the host (common.WhileLoop), rather than the whole loop in JAX."""
    p = eqn.params

    def part(closed) -> tuple:
        closed = closed if hasattr(closed, "consts") else jcore.ClosedJaxpr(closed, ())
        invars = [_value(v.aval) for v in closed.jaxpr.invars]
        ops: list[Op] = []
        return invars, ops, _flatten(closed, invars, ops)
    results = [_value(v.aval) for v in eqn.outvars]
    op = _eqn_op(eqn.primitive, dict(p), ins, results, _where(eqn), eqn)
    out.append(dataclasses.replace(op, loop=WhileLoop(part(p["cond_jaxpr"]), part(p["body_jaxpr"]),
                                                      p["cond_nconsts"], p["body_nconsts"])))
    return results


def _unroll_scan(eqn, ins, out: list[Op]) -> list:
    p = eqn.params
    n = p["length"]
    body = p["jaxpr"] if hasattr(p["jaxpr"], "consts") else jcore.ClosedJaxpr(p["jaxpr"], ())
    if "num_consts" in p:
        nc, nk = p["num_consts"], p["num_carry"]
    else:  # newer JAX: carries keep their shape through the body, xs and ys have a leading `length` axis
        same = [tuple(a.aval.shape) == tuple(b.aval.shape) for a, b in zip(eqn.outvars, body.jaxpr.outvars)]
        nk = same.index(False) if False in same else len(same)
        ins_same = [tuple(a.aval.shape) == tuple(b.aval.shape) for a, b in zip(eqn.invars, body.jaxpr.invars)]
        nc = (ins_same.index(False) if False in ins_same else len(ins_same)) - nk
    consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
    ys: list[list] = []
    steps = range(n - 1, -1, -1) if p["reverse"] else range(n)
    for i in steps:
        xi = [_index(x, i, out) for x in xs]
        res = _flatten(body, consts + carry + xi, out)
        carry, y = res[:nk], res[nk:]
        ys.append(y)
    if p["reverse"]:
        ys.reverse()
    stacked = [_stack([y[k] for y in ys], v, out) for k, v in enumerate(eqn.outvars[nk:])]
    return carry + stacked


def _index(x, i: int, out: list[Op]):
    """x[i] along the leading axis, as equations."""
    if isinstance(x, Const):
        return Const(x.value[i])
    sl = Value((1,) + x.shape[1:], x.dtype)
    lo = [i] + [0] * (len(x.shape) - 1)
    hi = [i + 1] + list(x.shape[1:])
    out.append(_eqn_op(jax.lax.slice_p, {"start_indices": tuple(lo), "limit_indices": tuple(hi), "strides": None},
                    [x], [sl]))
    r = Value(x.shape[1:], x.dtype)
    out.append(_eqn_op(jax.lax.reshape_p, {"new_sizes": tuple(x.shape[1:]), "dimensions": None, "sharding": None},
                    [sl], [r]))
    return r


def _stack(items: list, var, out: list[Op]):
    shape, dtype = tuple(var.aval.shape), var.aval.dtype
    rows = []
    for y in items:
        r = Value((1,) + shape[1:], dtype)
        out.append(_eqn_op(jax.lax.broadcast_in_dim_p, {"shape": r.shape, "sharding": None,
                        "broadcast_dimensions": tuple(range(1, len(shape)))}, [y], [r]))
        rows.append(r)
    s = Value(shape, dtype)
    out.append(_eqn_op(jax.lax.concatenate_p, {"dimension": 0}, rows, [s]))
    return s


def program(closed, options: CompileOptions, stats: Stats, name: str) -> SegmentedProgram:
    default = _default_precision(closed.jaxpr)  # convolutions and products as XLA's: TF32 on the GPU
    options = dataclasses.replace(options, tf32=default if options.tf32 is None else options.tf32,
                                  matmul_tf32=default if options.matmul_tf32 is None else options.matmul_tf32)
    invars = [_value(v.aval) for v in closed.jaxpr.invars]
    ops: list[Op] = []
    outvars = _flatten(closed, list(invars), ops)
    return SegmentedProgram(invars, live(ops, outvars), outvars, options, stats, name, "JAX", gpu_view=_gpu_view)


_EXACT = ("highest", "float32", "high", "bfloat16_3x", "tensorfloat32_3x")  # precisions above TF32's


def _default_precision(jaxpr) -> bool:
    """Whether XLA would run this jaxpr's float32 convolutions and products
    at their default precision (TF32 on a GPU that has it): no precision
    config above it, for the process or for any convolution or product in
    it (sub-jaxprs too)."""
    default = jax.config.jax_default_matmul_precision
    if default is not None and str(default).lower() in _EXACT:
        return False
    for eqn in jaxpr.eqns:
        precision = eqn.params.get("precision")
        for p in precision if isinstance(precision, tuple) else (precision,):
            if p is not None and str(getattr(p, "name", p)).lower() in _EXACT:
                return False
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's
                if hasattr(sub, "eqns") and not _default_precision(sub):
                    return False
    return True


def _gpu_view(x) -> GpuView | None:
    """A JAX array on a GPU as polyjit's view, once JAX's work on it is done,
    read from the array directly: its CUDA array interface costs microseconds
    and a call would ask for it three times per argument."""
    pointer = getattr(x, "unsafe_buffer_pointer", None)
    if pointer is None:
        return None
    dev = next(iter(x.devices()))
    if dev.platform != "gpu":
        return None
    x.block_until_ready()
    return GpuView(pointer(), tuple(x.shape), None, np.dtype(x.dtype), dev.local_hardware_id, x)


# ================================================================= wrapper
_FRONTEND_KEYS = {"static_argnums": "an int or a tuple of ints", "static_argnames": "a str or a tuple of strs"}


def _listed(value, key: str, where: str, kind: type) -> tuple:
    """A static_argnums (ints) or static_argnames (strs) value as a tuple; CompileOptionError otherwise."""
    def one(v):
        return isinstance(v, kind) and not isinstance(v, bool)
    if value is None:
        return ()
    if one(value):
        return (value,)
    if isinstance(value, (tuple, list)) and all(one(v) for v in value):
        return tuple(value)
    raise CompileOptionError(f"{where} {key!r} is {value!r}; expected {_FRONTEND_KEYS[key]}")


def _path(tree, leaves, k: int) -> str:
    """How leaf k of the arguments is reached, as ``jax.tree_util.keystr`` writes it (for messages)."""
    path, _ = jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(tree, leaves))[0][k]
    return jax.tree_util.keystr(path)


def register_custom_call(name: str, platform: str, launch: int, args: int, rets: int, owner=None,
                         cached: bool = False) -> None:
    """Make the C function at address ``launch`` (a native launcher's
    signature, runtime.launch) the XLA custom-call target ``name`` on
    ``platform`` ("CUDA" or "cpu"), called through a native FFI handler
    (runtime.xla_ffi.handler; from the compile cache with ``cached``) with
    ``args`` arguments and ``rets`` results; ``owner`` is kept alive with
    the target."""
    address = xla_ffi.handler(name, platform, launch, args, rets, owner, cached)
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(address), platform=platform)


class _NotDispatched(Exception):
    """A call the dispatch's jit does not run (its checked call does)."""


@dataclass
class _Signature:
    tree: Any
    avals: tuple
    statics: tuple
    key: tuple = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.tree, self.avals, self.statics)


def _family(sig: "_Signature") -> tuple:
    """What a relaxed signature keeps of a call's: the pytree, the static
    values and each leaf's rank, dtype and weak type."""
    return sig.tree, sig.statics, tuple((len(shape), dtype, weak) for shape, dtype, weak in sig.avals)


@dataclass
class _Relaxed:
    """A signature whose sizes that differed between two calls are
    jax.export symbols (reduce_retracing): ``symbols`` places each (leaf,
    dim, name); sizes equal in pairs across the two calls share one."""

    sig: _Signature
    symbols: tuple[tuple[int, int, str], ...]

    @staticmethod
    def of(last: tuple, sig: _Signature) -> "_Relaxed | None":
        names: dict[tuple[int, int], str] = {}
        places = [(k, d, names.setdefault((a, b), f"d{len(names)}"))
                  for k, ((old, _, _), (new, _, _)) in enumerate(zip(last, sig.avals))
                  for d, (a, b) in enumerate(zip(old, new)) if a != b and min(a, b) > 1]
        if not places:
            return None
        dims = dict(zip(names.values(), jax.export.symbolic_shape(", ".join(names.values()))))
        avals = [list(shape) for shape, _, _ in sig.avals]
        for k, d, name in places:
            avals[k][d] = dims[name]
        return _Relaxed(_Signature(sig.tree, tuple((tuple(a), dt, w) for a, (_, dt, w) in zip(avals, sig.avals)),
                                   sig.statics), tuple(places))

    def bind(self, sig: _Signature) -> dict[str, int] | None:
        """The symbols' values for a call of this family, or None where its
        fixed sizes differ or a symbol's would be below 2 or take two values."""
        env: dict[str, int] = {}
        for k, d, name in self.symbols:
            n = sig.avals[k][0][d]
            if n < 2 or env.setdefault(name, n) != n:
                return None
        fixed = all(isinstance(a, int) and a == b for (rs, _, _), (cs, _, _) in zip(self.sig.avals, sig.avals)
                    for a, b in zip(rs, cs) if isinstance(a, int))
        return env if fixed else None


class JaxFunction:
    """A function compiled with polyjit per signature; ``.stats`` says what it did."""

    def __init__(self, fn: Callable, options: CompileOptions, static_argnums: tuple[int, ...],
                 backend: str, static_argnames: tuple[str, ...] = (), named_positions: frozenset = frozenset(),
                 reduce_retracing: bool = False) -> None:
        self.fn, self.options, self.static_argnums, self.backend = fn, options, static_argnums, backend
        self.reduce_retracing = reduce_retracing
        # reduce_retracing: per family (_family), the avals of its last exact program, its relaxed
        # signatures, whether a relaxed one failed; each call signature's relaxed one; traces' out avals
        self._last_avals: dict[tuple, tuple] = {}
        self._relaxations: dict[tuple, list[_Relaxed]] = {}
        self._exact_only: set[tuple] = set()
        self._relaxed_of: dict[tuple, _Relaxed] = {}
        self._out_avals: dict[tuple, list] = {}
        self.static_argnames = static_argnames
        self._named_positions = named_positions  # static positions the signature names (by keyword, or a default)
        self._stats = Stats()
        self._programs: dict[tuple, tuple[SegmentedProgram, Any]] = {}
        self._vjps: dict[tuple, SegmentedProgram] = {}
        # (program, device) -> its XLA custom call, jitted to be staged and to be called
        # from Python, and the bytes of its largest result
        self._calls: dict[tuple, tuple[Callable, Callable, int] | None] = {}
        self._fast: dict[tuple, tuple] = {}  # (tree, statics, each array's shape, dtype, sharding) -> custom call
        self._dispatch: Callable | None = None  # _dispatcher's: jax.jit of the staged call
        self._dispatch_failed = False
        self._xla = (jax.jit(fn, static_argnums=static_argnums, static_argnames=static_argnames)
                     if backend == "xla" else None)
        self.__name__ = getattr(fn, "__name__", "fn")
        functools.update_wrapper(self, fn)

    @property
    def stats(self) -> dict:
        return self._stats.as_dict()

    # ------------------------------------------------------------- arguments
    def _split(self, args, kwargs):
        """(the static arguments as (position or name, value) pairs, the
        other arguments' leaves, their tree)."""
        static = {i + len(args) if i < 0 else i for i in self.static_argnums}  # (negative: from the end)
        named = [k for k in self.static_argnames if k in kwargs]
        static = {i for i in static if i < len(args) or i not in self._named_positions}  # (by keyword, or its default)
        for i in static:
            if not 0 <= i < len(args):
                raise InputError(f"{self.__name__}: static_argnums names argument {i - len(args) if i < 0 else i}, "
                                 f"but only {len(args)} positional arguments were given")
        statics = tuple((i, args[i]) for i in sorted(static)) + tuple((k, kwargs[k]) for k in sorted(named))
        for key, value in statics:
            try:
                hash(value)
            except TypeError:
                raise InputError(f"{self.__name__}: static argument {key} is a {type(value).__name__}, "
                                 f"which is not hashable; static arguments must be hashable "
                                 f"(e.g. a tuple instead of a list)") from None
        dyn = [a for i, a in enumerate(args) if i not in static]
        if named:
            kwargs = {k: v for k, v in kwargs.items() if k not in named}
        leaves, tree = jax.tree_util.tree_flatten((dyn, kwargs))
        return statics, leaves, tree

    def _check_leaves(self, leaves, tree) -> list:
        devices = {}  # leaf index -> device
        out = []
        scalars = 0  # Python and numpy numbers: they go wherever the arrays are
        for k, x in enumerate(leaves):
            if isinstance(x, (bool, int, float)):
                x = np.asarray(x, dtype=jnp.asarray(x).dtype)
                scalars += 1
            elif isinstance(x, jax.Array):
                devices[k] = next(iter(x.devices()))
                if _is_key(x):  # a typed key: its data, a raw key to jax.random
                    x = jax.random.key_data(x)
            elif isinstance(x, np.generic):  # a numpy scalar, as jax.jit takes them
                x = np.asarray(x)
                scalars += 1
            elif not isinstance(x, np.ndarray):
                raise InputError(f"{self.__name__}: argument {_path(tree, leaves, k)} is a {type(x).__name__}; "
                                 "expected a jax.Array, a numpy array or a scalar")
            out.append(x)
        platforms = {d.platform for d in devices.values()}
        host = len(leaves) - len(devices) - scalars
        if devices and (len(set(devices.values())) > 1 or (platforms != {"cpu"} and host)):
            where = ", ".join(f"{_path(tree, leaves, k)} on {d}" for k, d in devices.items())
            raise InputError(f"{self.__name__}: inputs must be all on the host or all on one device; got {where} "
                             f"and {host} host arrays")
        if platforms - {"cpu"} and not takes_device_arrays(self.options.target):
            raise InputError(f"{self.__name__}: arguments are on {platforms.pop()}, but target "
                             f"{self.options.target!r} runs on the host")
        return out

    # ------------------------------------------------------------- programs
    def _trace(self, sig: _Signature, fn: Callable, name: str, options: CompileOptions | None = None):
        out_tree = []

        def flat(*leaves):
            out = fn(*leaves)
            flat_out, t = jax.tree_util.tree_flatten(out)
            out_tree.append(t)
            return flat_out
        closed = jax.make_jaxpr(flat)(*[jax.ShapeDtypeStruct(s, d, weak_type=w) for s, d, w in sig.avals])
        self._out_avals[sig.key] = closed.out_avals
        return program(closed, options or self.options, self._stats, name), out_tree[0]

    def _call_fn(self, sig: _Signature):
        def call(*leaves):
            dyn, kwargs = jax.tree_util.tree_unflatten(sig.tree, leaves)
            args, it = [], iter(dyn)
            statics = dict(sig.statics)
            positional = sum(isinstance(k, int) for k in statics)
            for i in range(len(dyn) + positional):
                args.append(statics[i] if i in statics else next(it))
            return self.fn(*args, **kwargs, **{k: v for k, v in statics.items() if isinstance(k, str)})
        return call

    def program(self, sig: _Signature):
        if sig.key not in self._programs:
            relaxed = self._relaxed(sig) if self.reduce_retracing else None
            if relaxed is not None:
                self._relaxed_of[sig.key] = relaxed
                self._programs[sig.key] = self._programs[relaxed.sig.key]
                return self._programs[sig.key]
            self._programs[sig.key] = self._traced_program(sig)
            self._last_avals[_family(sig)] = sig.avals
        return self._programs[sig.key]

    def _traced_program(self, sig: _Signature, options: CompileOptions | None = None):
        trace = trace_text(self.options, ("jax", jax.__version__, sig.key), function_text(self.fn))
        expect_compile(trace)  # (the workers' imports beside the jaxpr's trace)
        traced = self._trace(sig, self._call_fn(sig), f"{self.__name__}{len(self._programs)}", options)
        compiled(trace)  # (its programs compile on the call that follows)
        return traced

    def _relaxed(self, sig: _Signature) -> _Relaxed | None:
        """reduce_retracing: the relaxed signature a call fits, or, at a
        second call of its family whose sizes differ, one traced with those
        sizes symbolic (jax.export's shape polymorphism), one program for
        every later value; sizes of 0 or 1 stay as they are. It is
        translated strictly: a function that needs a size while tracing (a
        comparison jax.export finds inconclusive), an op refused over
        symbolic sizes or any failure leaves the family compiled per shape."""
        family = _family(sig)
        for r in self._relaxations.get(family, ()):
            if r.bind(sig) is not None:
                return r
        last = self._last_avals.get(family)
        r = _Relaxed.of(last, sig) if last is not None and family not in self._exact_only else None
        if r is None:
            return None
        try:
            self._programs[r.sig.key] = self._traced_program(r.sig, dataclasses.replace(self.options, strict=True))
        except Exception as err:
            log.debug("%s: no relaxed program for %s (%s: %s)", self.__name__, r.sig.avals, type(err).__name__, err)
            self._exact_only.add(family)
            return None
        self._relaxations.setdefault(family, []).append(r)
        return r

    def _out_shapes(self, sig: _Signature, prog: SegmentedProgram) -> list:
        """The program's results for a call of this signature, as ShapeDtypeStructs."""
        r = self._relaxed_of.get(sig.key)
        env = r.bind(sig) if r is not None else {}
        return [jax.ShapeDtypeStruct(v.value.shape, v.value.dtype) if isinstance(v, Const)
                else jax.ShapeDtypeStruct(tuple(sz.evaluate(d, env) for d in v.shape), v.dtype)
                for v in prog.outvars]

    def vjp_program(self, sig: _Signature, out_avals) -> SegmentedProgram:
        """(primals..., cotangents of the float outputs...) -> cotangents of
        the float primals; a relaxed signature's, symbolic as its program,
        where it compiles strictly."""
        r = self._relaxed_of.get(sig.key)
        if r is not None and sig.key not in self._vjps:
            try:
                self._vjps[sig.key] = self._vjp(r.sig, self._out_avals[r.sig.key],
                                                dataclasses.replace(self.options, strict=True))
            except Exception as err:
                log.debug("%s: no relaxed gradient (%s: %s)", self.__name__, type(err).__name__, err)
        return self._vjp(sig, out_avals)

    def _vjp(self, sig: _Signature, out_avals, options: CompileOptions | None = None) -> SegmentedProgram:
        if sig.key not in self._vjps:
            call = self._call_fn(sig)
            n = len(sig.avals)
            floats = [i for i, (_, d, _) in enumerate(sig.avals) if jnp.issubdtype(d, jnp.floating)]
            fouts = [k for k, a in enumerate(out_avals) if jnp.issubdtype(a.dtype, jnp.floating)]

            def bwd(*a):
                primals, cts = a[:n], a[n:]

                def of_floats(*fx):
                    xs = list(primals)
                    for i, x in zip(floats, fx):
                        xs[i] = x
                    return [jax.tree_util.tree_leaves(call(*xs))[k] for k in fouts]
                _, pullback = jax.vjp(of_floats, *[primals[i] for i in floats])
                return list(pullback(list(cts)))
            avals = tuple(sig.avals) + tuple((out_avals[k].shape, out_avals[k].dtype, False) for k in fouts)
            bsig = _Signature(None, avals, ())
            self._vjps[sig.key] = self._trace(bsig, bwd, f"{self.__name__}_vjp{len(self._vjps)}", options)[0]
        return self._vjps[sig.key]

    # ------------------------------------------------------------------ call
    def __call__(self, *args, **kwargs):
        dispatch = self._dispatch
        if dispatch is None:
            return self._checked_call(args, kwargs)
        try:
            return dispatch(*args, **kwargs)
        except Exception:
            self._dispatch, self._dispatch_failed = None, True  # where the checked call runs, off from now on
            try:
                return self._checked_call(args, kwargs)
            except Exception:
                self._dispatch, self._dispatch_failed = dispatch, False  # the user's own error
                raise

    def _checked_call(self, args, kwargs):
        if self.backend == "std":
            return self.fn(*args, **kwargs)
        if self.backend == "xla":
            return self._xla(*args, **kwargs)
        statics, leaves, tree = self._split(args, kwargs)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return self._traced(statics, leaves, tree)
        try:  # arrays placed and typed as in an earlier custom call: its checks held, so they hold
            fast = (tree, statics, tuple((x.shape, x.dtype, x.sharding) for x in leaves))
            hit = self._fast.get(fast)
        except (AttributeError, TypeError):  # numbers and numpy arrays have no sharding
            fast = hit = None
        if hit is not None:
            outs = self._run(hit[0], leaves)
            return self(*args, **kwargs) if outs is None else jax.tree_util.tree_unflatten(hit[1], outs)
        sig, checked = self._signature(statics, leaves, tree)
        prog, out_tree = self.program(sig)
        call = None
        if all(isinstance(x, jax.Array) for x in checked):
            devices = {next(iter(x.devices())) for x in checked}
            where = self._custom_call_device(next(iter(devices))) if len(devices) == 1 else None
            call = self._custom_call(prog, where, [np.shape(x) for x in checked], direct=True) \
                if where is not None else None
        if call is not None:
            outs = self._run(call, checked)
            if outs is None:  # its graph failed: called again, plain
                return self(*args, **kwargs)
            if fast is not None and all(isinstance(x.dtype, np.dtype) for x in leaves):  # (keys: their data)
                self._fast[fast] = (call, out_tree)
                self._dispatcher(next(iter(devices)), self._call_key(prog, where, [np.shape(x) for x in checked]))
            return jax.tree_util.tree_unflatten(out_tree, outs)
        leaves = checked
        outs = prog(leaves)
        device = next((next(iter(x.devices())) for x in leaves if isinstance(x, jax.Array)), None)
        return jax.tree_util.tree_unflatten(out_tree, [_to_jax(o, device) for o in outs])

    def _run(self, call: Callable, xs) -> list | None:
        """call(*xs), or None where it ran as a CUDA graph that failed and
        calls were made plain (_drop_graphs): the caller calls again."""
        try:
            return call(*xs)
        except Exception as err:
            if not self._drop_graphs(err):
                raise
            return None

    def _drop_graphs(self, err: Exception) -> bool:
        """Where calls from Python run as XLA's CUDA graphs (ONE_CALL_GRAPH)
        and one failed, they run as plain custom calls from then on, with a
        warning: an XLA that refuses the option or cannot capture the
        launches must not fail the user's call. False where none ran so."""
        graphed = {k: c for k, c in self._calls.items() if c is not None and c[1] is not c[0]}
        if not graphed:
            return False
        for key, (nested, _, largest) in graphed.items():
            self._calls[key] = (nested, nested, largest)
        self._fast.clear()
        first = str(err).splitlines()[0][:200] if str(err) else ""
        warnings.warn(f"polyjit: {self.__name__}: XLA could not run its calls as CUDA graphs "
                      f"({type(err).__name__}: {first}); running them without", stacklevel=4)
        return True

    def _dispatcher(self, device, key: tuple) -> None:
        """After a call from Python ran as a custom call on the only device
        of JAX's default backend, calls go through jax.jit of the staged
        call (_traced, its XLA custom call): JAX's dispatch checks, keys and
        caches the arguments without Python per call, as it does for
        jax.jit's users, where the checked call took several times as long
        as XLA's whole dispatch (bench/NOTES.md). With more devices the
        trace could not know which one's kernels to call. A call the
        dispatch cannot run (where the checked call can) turns it off."""
        if (self._dispatch is not None or self._dispatch_failed or jax.devices() != [device]
                or any(i < 0 for i in self.static_argnums)):
            return
        nested, top, _ = self._calls[key]
        options = _graph_options(key[1]) if top is not nested else None  # (as the call from Python ran)
        self._dispatch = jax.jit(self._dispatched, static_argnums=self.static_argnums,
                                 static_argnames=self.static_argnames, compiler_options=options)

    def _dispatched(self, *args, **kwargs):
        """The call as jax.jit stages it: an XLA custom call, or _NotDispatched."""
        return self._traced(*self._split(args, kwargs), dispatched=True)

    def _custom_call_device(self, device) -> int | str | None:
        """Where this function's calls on JAX's ``device`` run as XLA custom
        calls: "cpu", a GPU's ordinal, or None (the target is the other one)."""
        gpu = device.platform == "gpu"
        if device.platform not in ("cpu", "gpu") or self.options.target not in (None, holding(gpu)):
            return None
        return device.local_hardware_id if gpu else "cpu"

    @staticmethod
    def _call_key(prog: SegmentedProgram, where: int | str, shapes) -> tuple:
        """A program's custom calls are one per device, and a symbolic
        program's one per shape of its arguments besides."""
        symbolic = any(isinstance(d, Lin) for v in prog.invars for d in (v.shape or ()))
        return (id(prog), where) + ((tuple(map(tuple, shapes)),) if symbolic else ())

    def _custom_call(self, prog: SegmentedProgram, where: int | str, shapes, direct: bool = False) -> Callable | None:
        """The program as a jitted JAX function whose one step is an XLA custom
        call (see register_custom_call): native code runs the kernels (on the GPU: launches
        them on XLA's stream) with XLA's result buffers, so a call costs a
        jitted dispatch instead of a DLPack import per result (four of those
        took longer than XLA's whole layer norm step) and runs no Python.
        ``where``: "cpu" or the GPU's ordinal. For programs one segment runs
        (results it does not compute are constants or arguments, added
        beside the call); None for other programs, and for calls
        from Python (``direct``) on the CPU with a result over
        CPU_CALL_RESULT_BYTES: XLA's fresh result buffers would fault their
        pages in at every call, where polyjit's buffer cache reuses them."""
        key = self._call_key(prog, where, shapes)  # programs live as long as this function
        if key not in self._calls:
            try:
                self._calls[key] = self._register(prog, where, shapes)
            except Exception as err:  # the program runs through its segments instead
                internal_failure(self._stats, f"custom call of {self.__name__}", err, "JAX", self.options.strict)
                self._calls[key] = None
        if self._calls[key] is None:
            return None
        nested, top, largest = self._calls[key]
        if not direct:
            return nested
        return None if where == "cpu" and largest > CPU_CALL_RESULT_BYTES else top

    def _register(self, prog: SegmentedProgram, where: int | str, shapes) -> tuple[Callable, Callable, int] | None:
        """Registers prog's native launcher with XLA: the jitted call, staged
        into a caller's jit and called from Python (on the GPU, a graph of
        one command: ONE_CALL_GRAPH), and the bytes of its largest result;
        None where a custom call cannot run it."""
        seg = prog.segments[0] if len(prog.steps) == 1 and prog.segments else None
        if seg is None:
            return None
        made = {id(v): k for k, v in enumerate(seg.outputs)}
        position = {id(v): k for k, v in enumerate(prog.invars)}
        same = {id(v): id(source) for v, source in seg.aliases}  # an identity's result is its operand

        def pick(v):  # (a result returned twice, as gradients of x and y in x + y are, is one array)
            if id(v) in made:
                return "out", made[id(v)]
            if same.get(id(v), id(v)) in position:  # an argument passed through
                return "arg", position[same.get(id(v), id(v))]
            return ("const", v.value) if isinstance(v, Const) else None  # a gradient of captured values only
        picks = [pick(v) for v in prog.outvars]
        if not made or len(made) != len(seg.outputs) or None in picks:
            return None
        exe = seg.exe.variant((False,) * len(seg.exe.graph.inputs),  # for row-major arrays, as XLA's are
                              holding(where != "cpu"))
        take = [position[id(v)] for v in seg.inputs]
        name = f"polyjit_{exe.name}_{next(_target_ids)}"  # XLA keeps every target for the process
        # each input's shape: its own where static, else the call's (a typed key's data adds a dim of 2)
        sizes = [tuple(v.shape) if all(isinstance(d, int) for d in v.shape)
                 else tuple(shapes[k]) + tuple(v.shape[len(shapes[k]):]) for k, v in zip(take, seg.inputs)]
        like = [GpuView(0, shape, None, np.dtype(v.dtype), where, None) if where != "cpu"
                else RowMajor(shape, v.dtype) for shape, v in zip(sizes, seg.inputs)]
        launcher = exe.native_launcher(like, name + "_launch")
        if launcher is None:
            return None
        # the results: the outputs, then the temporaries (dropped: XLA's allocator serves them)
        results = [jax.ShapeDtypeStruct(shape, dt) for _, shape, dt in launcher.results]
        register_custom_call(name, "cpu" if where == "cpu" else "CUDA", launcher.address, len(take), len(results),
                             launcher, exe.cached)

        distinct = list(dict.fromkeys(exe.output_arrays))  # the launcher's results: each output array once
        result_of = [distinct.index(a) for a in exe.output_arrays]

        def call(*xs):
            outs = jax.ffi.ffi_call(name, results, vmap_method="sequential")(*[xs[k] for k in take])
            return [outs[result_of[k]] if how == "out" else xs[k] if how == "arg" else jnp.asarray(k)
                    for how, k in picks]
        prog.stats.record(seg.exe.name, exe.stats)
        options = _graph_options(where)
        nested = jax.jit(call)
        largest = max((math.prod(r.shape) * r.dtype.itemsize for r in results), default=0)
        return nested, jax.jit(call, compiler_options=options) if options else nested, largest

    def save(self, path, *args, **kwargs) -> None:
        """The program for these arguments, compiled and written to ``path``
        (``lower(*args, **kwargs).compile().save(path)``)."""
        self.lower(*args, **kwargs).compile().save(path)

    def lower(self, *args, **kwargs) -> "Lowered":
        """Fix the signature of these arguments, as ``jax.jit(f).lower(...)``:
        arrays, or ``jax.ShapeDtypeStruct``s whose sizes may be symbolic
        (``jax.export.symbolic_shape("b, 128")``), one program for every
        value of them."""
        statics, leaves, tree = self._split(args, kwargs)
        specs = {k: x for k, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)}
        # (a spec checks as a number would: it places no array on the host or a device)
        sig, _ = self._signature(statics, [np.float32(0) if k in specs else x for k, x in enumerate(leaves)], tree)
        avals = tuple((tuple(specs[k].shape), np.dtype(specs[k].dtype), bool(specs[k].weak_type)) if k in specs
                      else a for k, a in enumerate(sig.avals))
        return Lowered(self, _Signature(tree, avals, statics))

    def _signature(self, statics, leaves, tree) -> tuple["_Signature", list]:
        """The checked arguments' signature; Python scalars are weakly typed, as in jax.jit."""
        weak = [isinstance(x, (bool, int, float)) for x in leaves]
        leaves = self._check_leaves(leaves, tree)
        avals = tuple((tuple(np.shape(x)), np.dtype(x.dtype), w) for x, w in zip(leaves, weak))
        return _Signature(tree, avals, statics), leaves

    def _traced(self, statics, leaves, tree, dispatched: bool = False):
        """The call staged into a trace (the caller's jit or grad, or the
        dispatch's jit: ``dispatched``, where a program that would not run
        as a custom call from Python raises _NotDispatched)."""
        sig = _Signature(tree, tuple((tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False)))
                                     for x in leaves), statics)
        prog, out_tree = self.program(sig)
        out_avals = self._out_shapes(sig, prog)
        floats = [i for i, (_, d, _) in enumerate(sig.avals) if jnp.issubdtype(d, jnp.floating)]
        fouts = [k for k, a in enumerate(out_avals) if jnp.issubdtype(a.dtype, jnp.floating)]

        # traced arrays have no device yet: the default one; a call placed on another GPU gets the
        # launcher's error (its stream is not in the context the kernels were loaded in)
        default = getattr(jax.config, "jax_default_device", None) or jax.devices()[0]  # set by jax.default_device
        where = self._custom_call_device(jax.devices(default)[0] if isinstance(default, str) else default)

        def run(p, *xs):
            return [np.asarray(o) for o in p([np.asarray(x) for x in xs])]

        def staged(p, avals, *xs):  # an XLA custom call where it can be, else a callback
            shapes = [x.shape for x in xs]
            call = self._custom_call(p, where, shapes) if where is not None else None
            if dispatched and (call is None or self._custom_call(p, where, shapes, direct=True) is None):
                raise _NotDispatched(self.__name__)
            if call is not None:
                return call(*xs)
            return jax.pure_callback(functools.partial(run, p), avals, *xs, vmap_method="sequential")

        @jax.custom_vjp
        def f(*xs):
            return staged(prog, out_avals, *xs)

        def f_fwd(*xs):
            return f(*xs), xs

        def f_bwd(xs, cts):
            bprog = self.vjp_program(sig, out_avals)
            shapes = [jax.ShapeDtypeStruct(sig.avals[i][0], sig.avals[i][1]) for i in floats]
            grads = staged(bprog, shapes, *xs, *[cts[k] for k in fouts])
            out = [None] * len(xs)
            for i, gr in zip(floats, grads):
                out[i] = gr
            return tuple(out)
        f.defvjp(f_fwd, f_bwd)
        return jax.tree_util.tree_unflatten(out_tree, list(f(*leaves)))


class Lowered:
    """A signature fixed ahead of time; ``compile()`` gives its executable."""

    def __init__(self, fn: JaxFunction, sig: _Signature) -> None:
        self.fn, self.sig = fn, sig

    def compile(self) -> "Compiled":
        self.fn.program(self.sig)
        return Compiled(self.fn, self.sig)


class Compiled:
    """A compiled signature: calls with other shapes or dtypes raise InputError."""

    def __init__(self, fn: JaxFunction, sig: _Signature) -> None:
        self.fn, self.sig = fn, sig

    def __call__(self, *args, **kwargs):
        statics, leaves, tree = self.fn._split(args, kwargs)
        leaves = self.fn._check_leaves(leaves, tree)
        if tree != self.sig.tree or statics != self.sig.statics:
            raise InputError(f"{self.fn.__name__}: arguments have structure {tree} and static values {statics}, "
                             f"compiled for {self.sig.tree} and {self.sig.statics}")
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
            jax.tree_util.tree_unflatten(tree, leaves))[0]]
        symbols: dict[str, int] = {}  # a symbolic size's value, from the first argument it sizes alone
        for path, x, (shape, dtype, _) in zip(paths, leaves, self.sig.avals):
            got = tuple(np.shape(x))
            sizes = [_size(d) for d in shape]
            for d, n in zip(sizes, got):
                if isinstance(d, Lin) and d.terms == ((d.terms[0][0], 1),) and d.base_params() == {d.terms[0][0]} \
                        and not d.const and n >= 1:  # (jax.export's symbols stand for sizes of at least 1)
                    symbols.setdefault(d.terms[0][0], n)
            expected = [d if isinstance(d, int) else d.evaluate(symbols) if d.base_params() <= symbols.keys()
                        else None for d in sizes]
            if (len(got) != len(shape) or np.dtype(x.dtype) != np.dtype(dtype)
                    or any(e is not None and e != n for e, n in zip(expected, got))):
                raise InputError(f"{self.fn.__name__}: argument {path} is {np.dtype(x.dtype).name}{list(got)}, "
                                 f"compiled for {np.dtype(dtype).name}[{', '.join(map(str, shape))}]"
                                 + (f" with {', '.join(f'{k}={v}' for k, v in symbols.items())}" if symbols else ""))
        if all(isinstance(d, int) for a in self.sig.avals for d in a[0]):
            return self.fn(*args, **kwargs)
        prog, out_tree = self.fn.program(self.sig)  # symbolic sizes: the one program, from Python
        device = next((next(iter(x.devices())) for x in leaves if isinstance(x, jax.Array)), None)
        return jax.tree_util.tree_unflatten(out_tree, [_to_jax(o, device) for o in prog(leaves)])

    @property
    def stats(self) -> dict:
        return self.fn.stats

    def save(self, path) -> None:
        """Write this signature's program to ``path``: ``polyjit.load(path)``
        calls it in any process on a machine like this one, with neither JAX
        tracing nor polyjit compiling, on the arguments less the static
        ones (as ``jax.export``'s call), and returns JAX arrays for JAX
        arrays. Compiled for the compile options' target, else JAX's
        default device."""
        prog, out_tree = self.fn.program(self.sig)
        exe, call, constants = prog.saved_call(self.fn.__name__,
                                               self.fn.options.target or holding(jax.default_backend() == "gpu"))
        leaf = object()
        shapes = [structure(jax.tree_util.tree_unflatten(t, [leaf] * t.num_leaves), lambda x: x is leaf)
                  for t in (self.sig.tree, out_tree)]
        saved.save(exe, path, {"name": self.fn.__name__, "args": shapes[0], "results": shapes[1], **call}, constants)


def jit_jax(fn: Callable | None = None, *, compile_options: dict | None = None,
            static_argnums: int | Sequence[int] | None = None, static_argnames: str | Sequence[str] | None = None,
            reduce_retracing: bool = False, execution_backend: str = "polyjit"):
    """Compile a JAX function with polyjit (as ``jax.jit`` would).

    ``static_argnums`` and ``static_argnames`` (also accepted in
    ``compile_options``) mark arguments that are compile-time constants, by
    position or by name, each found from the other through the signature as
    jax.jit does. Each signature compiles once, as in jax.jit; with
    ``reduce_retracing=True`` (as jit_tf's, tf.function's) a second call
    whose sizes differ compiles once more with those sizes symbolic, one
    program for every later size. ``execution_backend="std"`` runs the
    function un-jitted and ``"xla"`` through ``jax.jit``, for comparison.
    """
    check_execution_backend("jax", execution_backend)
    opts = dict(compile_options or {})
    given = {}
    for key, value, kind in (("static_argnums", static_argnums, int), ("static_argnames", static_argnames, str)):
        listed = _listed(opts.pop(key, None), key, "compile option", kind)
        given[key] = listed + tuple(v for v in _listed(value, key, "argument", kind) if v not in listed)
    options = parse_options(opts, extra=_FRONTEND_KEYS)

    def wrap(f):
        return JaxFunction(f, options, backend=execution_backend, reduce_retracing=reduce_retracing,
                           **_static_arguments(f, given["static_argnums"], given["static_argnames"]))
    return wrap(fn) if fn is not None else wrap


def _static_arguments(fn: Callable, nums: tuple[int, ...], names: tuple[str, ...]) -> dict:
    """JaxFunction's static_argnums and static_argnames, each completed from
    the other through fn's signature (a name's position, a position's name),
    and the static positions the signature names, as jax.jit reads them.
    CompileOptionError where a position has no parameter (``*args`` takes any)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # (no signature to read: the call checks)
        return {"static_argnums": nums, "static_argnames": names}
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    n = len(positional)
    bad = [i for i in nums if not -n <= i < n]
    if bad and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise CompileOptionError(f"{getattr(fn, '__name__', 'the function')} has static_argnums={nums}, but it "
                                 f"takes only {n} positional arguments (argument {bad[0]} does not exist)")
    nums = nums + tuple(positional.index(k) for k in names if k in positional and positional.index(k) not in nums)
    names = names + tuple(positional[i] for i in nums if 0 <= i < n and positional[i] not in names)
    return {"static_argnums": nums, "static_argnames": names,
            "named_positions": frozenset(i for i in nums if 0 <= i < n)}