"""The op set users write programs with: ``polyjit.ops`` and ``fd.ops``.

Each function takes :class:`Tensor` handles (or Python numbers) and adds core
ops to the tensor's graph. Composites (matmul, conv2d, softmax, layer_norm,
gelu, ...) are written here as core ops, so that fusion sees through them.
Names and signatures follow nvFuser's FusionDefinition where nvFuser has the
op.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

import numpy as np

from . import interop
from . import scalar
from . import sizes as sz
from .dtypes import DataType, promote, to_dtype
from .errors import DefinitionError, UnsupportedOpError
from .graph import Graph, Node


class Tensor:
    """A value of a program being traced or defined; supports Python operators."""

    __array_priority__ = 1000  # numpy defers to our reflected operators
    __hash__ = object.__hash__

    def __init__(self, graph: Graph, node: Node) -> None:
        self.graph, self.node = graph, node

    @property
    def shape(self) -> tuple:
        return tuple(self.graph.resolve(s) for s in self.node.shape)

    @property
    def ndim(self) -> int:
        return self.node.rank

    @property
    def dtype(self) -> DataType:
        return self.node.dtype

    def __repr__(self) -> str:
        return f"Tensor(%{self.node.id}, shape={list(self.shape)}, dtype={self.dtype})"

    # arithmetic
    def __add__(self, o): return add(self, o)
    def __radd__(self, o): return add(o, self)
    def __sub__(self, o): return sub(self, o)
    def __rsub__(self, o): return sub(o, self)
    def __mul__(self, o): return mul(self, o)
    def __rmul__(self, o): return mul(o, self)
    def __truediv__(self, o): return div(self, o)
    def __rtruediv__(self, o): return div(o, self)
    def __pow__(self, o): return pow(self, o)
    def __rpow__(self, o): return pow(o, self)
    def __mod__(self, o): return remainder(self, o)
    def __floordiv__(self, o): return floor_divide(self, o)
    def __rfloordiv__(self, o): return floor_divide(o, self)
    def __matmul__(self, o): return matmul(self, o)
    def __rmatmul__(self, o): return matmul(o, self)
    def __neg__(self): return neg(self)
    def __abs__(self): return abs(self)
    def __lt__(self, o): return lt(self, o)
    def __le__(self, o): return le(self, o)
    def __gt__(self, o): return gt(self, o)
    def __ge__(self, o): return ge(self, o)
    def __eq__(self, o): return eq(self, o)  # type: ignore[override]
    def __ne__(self, o): return ne(self, o)  # type: ignore[override]
    def __and__(self, o): return logical_and(self, o)
    def __or__(self, o): return logical_or(self, o)
    def __xor__(self, o): return logical_xor(self, o)
    def __invert__(self): return logical_not(self)

    def __bool__(self):
        raise DefinitionError("a traced Tensor has no truth value; use polyjit.ops.where")

    def __getitem__(self, key):
        return getitem(self, key)

    # methods
    def sum(self, axis=None, keepdim=False): return sum(self, axis, keepdim)
    def mean(self, axis=None, keepdim=False): return mean(self, axis, keepdim)
    def max(self, axis=None, keepdim=False): return max(self, axis, keepdim)
    def min(self, axis=None, keepdim=False): return min(self, axis, keepdim)
    def reshape(self, *shape): return reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], (list, tuple)) else shape)
    def transpose(self, *perm): return permute(self, perm[0] if len(perm) == 1 else perm)
    def astype(self, dtype): return cast(self, dtype)
    @property
    def T(self): return permute(self, list(reversed(range(self.ndim))))


def _graph(*xs) -> Graph:
    for x in xs:
        if isinstance(x, Tensor):
            return x.graph
        if isinstance(x, (list, tuple)):
            for y in x:
                if isinstance(y, Tensor):
                    return y.graph
    raise DefinitionError("an op needs at least one Tensor operand")


def _node(g: Graph, x) -> Node:
    if isinstance(x, Tensor):
        if x.graph is not g:
            raise DefinitionError("operands belong to different definitions")
        return x.node
    if isinstance(x, (bool, int, float)):
        return g.constant(x)
    if isinstance(x, sz.Lin):
        return g.size_value(x)
    if isinstance(x, np.generic):  # a numpy scalar keeps its dtype (numpy's rules)
        return g.constant(x.item(), to_dtype(x.dtype))
    if isinstance(x, (list, tuple, str)) or x is None:
        raise DefinitionError(f"expected a Tensor, a Python number or an array, got {type(x).__name__}")
    # an array the program closes over (numpy, or a framework's): a constant of the program
    return g.tensor_constant(interop.host_array(x, "an operand"))


def _wrap(g: Graph, n: Node) -> Tensor:
    return Tensor(g, n)


def _unary(op):
    def f(x: Tensor) -> Tensor:
        g = _graph(x)
        return _wrap(g, g.unary(op, _node(g, x)))
    f.__name__ = op
    f.__doc__ = f"Elementwise {op}."
    return f


def _binary(op):
    def f(a, b) -> Tensor:
        g = _graph(a, b)
        return _wrap(g, g.binary(op, _node(g, a), _node(g, b)))
    f.__name__ = op
    f.__doc__ = f"Elementwise {op}, with numpy broadcasting."
    return f


# One function per elementwise op of polyjit.scalar (neg, exp, add, maximum, fmod, ...).
globals().update({op: _unary(op) for op in scalar.UNARY})
globals().update({op: _binary(op) for op in scalar.BINARY})
truediv = div


def clamp(x, lo=None, hi=None) -> Tensor:
    """x held within [lo, hi] (either may be None: no bound): min(max(x, lo), hi)."""
    if lo is not None:
        x = maximum(x, lo)
    return minimum(x, hi) if hi is not None else x


def where(cond, a, b) -> Tensor:
    """Select a where cond holds, else b (with broadcasting)."""
    g = _graph(cond, a, b)
    return _wrap(g, g.where(_node(g, cond), _node(g, a), _node(g, b)))


def cast(x: Tensor, dtype) -> Tensor:
    g = _graph(x)
    return _wrap(g, g.cast(_node(g, x), to_dtype(dtype)))


def bitcast(x: Tensor, dtype) -> Tensor:
    """The same bits read as another type of the same size."""
    g = _graph(x)
    return _wrap(g, g.bitcast(_node(g, x), to_dtype(dtype)))


def iota(shape: Sequence, dim: int = 0, dtype=DataType.Int, *, like: Tensor | None = None) -> Tensor:
    """Indices along dim, broadcast to shape (needs `like` for its definition)."""
    if like is None:
        raise DefinitionError("iota needs like= (a Tensor of the same definition)")
    g = like.graph
    return _wrap(g, g.iota(shape, dim, dtype))


def full_like(x: Tensor, value, dtype=None) -> Tensor:
    g = _graph(x)
    c = g.constant(value, dtype or x.dtype)
    return _wrap(g, g.broadcast_in_dim(c, x.shape, []))


def zeros_like(x: Tensor) -> Tensor:
    return full_like(x, 0)


def full(shape: Sequence, value, dtype=None, *, like: Tensor) -> Tensor:
    """value broadcast to shape (``[]``: the scalar itself) in like's
    definition; without dtype, a Python number is weakly typed (it takes
    the type of the tensor it meets, as in ``x * 2``); so is a symbolic
    size's value (``x.size(-1) ** -0.5`` under dynamic shapes)."""
    g = like.graph
    if isinstance(value, sz.Lin):
        scalar = g.size_value(value) if dtype is None else g.cast(g.size_value(value), to_dtype(dtype))
    else:
        scalar = g.constant(value, to_dtype(dtype) if dtype is not None else None)
    return _wrap(g, g.broadcast_in_dim(scalar, tuple(shape), []))


# ---------------------------------------------------------------- layout
def broadcast_in_dim(x: Tensor, shape: Sequence, broadcast_dims: Sequence[int]) -> Tensor:
    g = _graph(x)
    return _wrap(g, g.broadcast_in_dim(_node(g, x), tuple(shape), broadcast_dims))


def broadcast_shapes(like: Tensor, *shapes: Sequence) -> tuple:
    """numpy's broadcast of shapes whose sizes may be symbolic (unified, as
    an elementwise op's operands are), in like's graph."""
    return like.graph._broadcast_shape([tuple(s) for s in shapes], "broadcast_shapes")


def broadcast_to(x: Tensor, shape: Sequence) -> Tensor:
    g = _graph(x)
    return _wrap(g, g.expand(_node(g, x), tuple(shape)))


def reshape(x: Tensor, new_shape: Sequence) -> Tensor:
    g = _graph(x)
    return _wrap(g, g.reshape(_node(g, x), tuple(new_shape)))


def permute(x: Tensor, dims: Sequence[int]) -> Tensor:
    g = _graph(x)
    return _wrap(g, g.transpose(_node(g, x), tuple(dims)))


def transpose(x: Tensor, dim0: int = -2, dim1: int = -1) -> Tensor:
    perm = list(range(x.ndim))
    perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
    return permute(x, perm)


def slice(x: Tensor, start_indices: Sequence[int], end_indices: Sequence, strides: Sequence[int] | None = None) -> Tensor:
    g = _graph(x)
    return _wrap(g, g.slice(_node(g, x), list(start_indices), list(end_indices), strides))


def pad(x: Tensor, pad_widths: Sequence[int], value=0) -> Tensor:
    """torch.nn.functional.pad's order: (lo, hi) of the last dim first."""
    g = _graph(x)
    lo, hi = [0] * x.ndim, [0] * x.ndim
    for k in range(len(pad_widths) // 2):
        lo[x.ndim - 1 - k], hi[x.ndim - 1 - k] = pad_widths[2 * k], pad_widths[2 * k + 1]
    return _wrap(g, g.pad(_node(g, x), lo, hi, value))


def pad_edges(x: Tensor, low: Sequence[int], high: Sequence[int], value=0) -> Tensor:
    """x padded with value by low and high cells per dimension (XLA's and
    TensorFlow's order; :func:`pad` takes torch's)."""
    g = _graph(x)
    return _wrap(g, g.pad(_node(g, x), list(low), list(high), value))


def tile(x: Tensor, reps: Sequence[int]) -> Tensor:
    """numpy's tile: x repeated reps[d] times along each dimension (reps
    shorter than x's rank is padded with ones on the left), as one broadcast
    and a reshape."""
    reps = [1] * (x.ndim - len(reps)) + list(reps)
    shape = [s for r, n in zip(reps, x.shape) for s in (r, n)]
    y = broadcast_in_dim(x, shape, [2 * d + 1 for d in range(x.ndim)])
    return reshape(y, [r * n for r, n in zip(reps, x.shape)])


def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    g = _graph(tensors)
    return _wrap(g, g.concatenate([_node(g, t) for t in tensors], dim))


concatenate = cat


def reverse(x: Tensor, dims: Sequence[int]) -> Tensor:
    g = _graph(x)
    return _wrap(g, g.reverse(_node(g, x), dims))


flip = reverse


def split(x: Tensor, num_or_sizes: int | Sequence, dim: int = 0) -> list[Tensor]:
    """x cut along dim into num_or_sizes equal pieces (an int, as Tripy's
    split: it must divide the size; a symbolic size is checked at each
    call) or into pieces of the listed sizes (which must add up to it)."""
    g = _graph(x)
    dim = dim % _pymax(x.ndim, 1)
    n = x.shape[dim]
    if isinstance(num_or_sizes, int):
        k = num_or_sizes
        if k < 1:
            raise DefinitionError(f"split: {k} pieces; expected a positive number")
        if sz.is_static(n) and int(n) % k:
            raise DefinitionError(f"split: dimension {dim} of size {n} does not divide into {k} equal pieces")
        sizes = [n // k] * k
    else:
        sizes = list(num_or_sizes)
    total = 0
    for s in sizes:
        total = total + s
    g.unify(n, total, f"split: the pieces' sizes {sizes} against dimension {dim} of size {n}")
    return _pieces(x, sizes, dim)


def chunk(x: Tensor, chunks: int, dim: int = 0) -> list[Tensor]:
    """torch.chunk: pieces of ceil(size / chunks) along dim, the last one
    smaller, and fewer than chunks pieces where they run out."""
    dim = dim % _pymax(x.ndim, 1)
    n = x.shape[dim]
    if chunks < 1:
        raise DefinitionError(f"chunk: {chunks} chunks; expected a positive number")
    if not sz.is_static(n):
        raise DefinitionError(f"chunk: dimension {dim} has symbolic size {n}, so the number of pieces is not "
                              "known; use split with a number of pieces that divides it")
    step = -(-int(n) // chunks)
    sizes = [_b.min(step, int(n) - a) for a in range(0, int(n), step)] if n else [0]
    return _pieces(x, sizes, dim)


def _pieces(x: Tensor, sizes: Sequence, dim: int) -> list[Tensor]:
    out, at = [], 0
    for s in sizes:
        start, end = [0] * x.ndim, list(x.shape)
        start[dim], end[dim] = at, at + s
        out.append(slice(x, start, end))
        at = at + s
    return out


def squeeze(x: Tensor, dims: Sequence[int]) -> Tensor:
    dims = {d % x.ndim for d in dims} if x.ndim else set()
    return reshape(x, [s for d, s in enumerate(x.shape) if d not in dims])


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    shape = list(x.shape)
    shape.insert(dim % (x.ndim + 1), 1)
    return reshape(x, shape)


def dilate(x: Tensor, factors: Sequence[int]) -> Tensor:
    """x with factor - 1 zeros between neighbours along each dimension (XLA's
    lhs_dilation; the adjoint of a strided access): each element gets a
    padded axis of its own, merged back, and the trailing zeros cut."""
    for d, f in enumerate(factors):
        if f > 1:
            shape = list(x.shape)
            y = pad(unsqueeze(x, d + 1), [0, 0] * (x.ndim - d - 1) + [0, f - 1])
            shape[d] = shape[d] * f
            x = reshape(y, shape)
            end = list(x.shape)
            end[d] = end[d] - (f - 1)
            x = slice(x, [0] * x.ndim, end)
    return x


def getitem(x: Tensor, key) -> Tensor:
    """Basic indexing: ints, slices with positive steps, None and Ellipsis."""
    if not isinstance(key, tuple):
        key = (key,)
    if Ellipsis in key:
        k = key.index(Ellipsis)
        fill = x.ndim - (len(key) - 1 - sum(e is None for e in key))
        key = key[:k] + (builtins_slice(None),) * fill + key[k + 1:]
    start, end, step, drop, newaxes = [], [], [], [], []
    d = 0
    out_pos = 0
    for e in key:
        if e is None:
            newaxes.append(out_pos)
            out_pos += 1
            continue
        if d >= x.ndim:
            raise DefinitionError(f"too many indices for a tensor of rank {x.ndim}")
        n = x.shape[d]
        if isinstance(e, int):
            i = n + e if e < 0 else e
            start.append(i); end.append(i + 1); step.append(1); drop.append(d)
        elif isinstance(e, builtins_slice):
            st = e.step or 1
            if st < 1:
                raise DefinitionError("slices with negative steps: use polyjit.ops.reverse")
            s0, s1 = e.start or 0, e.stop
            if sz.is_static(n):
                s0, s1, st = builtins_slice(e.start, e.stop, st).indices(int(n))
            else:  # symbolic size: negative bounds count from the end
                s0 = n + s0 if s0 < 0 else s0
                s1 = n if s1 is None else (n + s1 if not isinstance(s1, sz.Lin) and s1 < 0 else s1)
            start.append(s0); end.append(s1); step.append(st)
            out_pos += 1
        else:
            raise DefinitionError(f"unsupported index {e!r}")
        d += 1
    while d < x.ndim:
        start.append(0); end.append(x.shape[d]); step.append(1); d += 1
    y = slice(x, start, end, step)
    if drop or newaxes:
        shape = [s for k, s in enumerate(y.shape) if k not in drop]
        for p in newaxes:
            shape.insert(p, 1)
        y = reshape(y, shape)
    return y


import builtins as _b  # noqa: E402

builtins_slice = _b.slice


# ------------------------------------------------------------ reductions
def _reduce(op):
    def f(x: Tensor, dims=None, keepdim: bool = False, dtype=None) -> Tensor:
        g = _graph(x)
        if isinstance(dims, int):
            dims = [dims]
        n = _node(g, x)
        if dtype is not None:
            n = g.cast(n, to_dtype(dtype))
        return _wrap(g, g.reduce(op, n, dims, keepdim))
    f.__name__ = op
    f.__doc__ = f"{op} over dims (all if None); nvFuser's (tensor, dims, keepdim, dtype)."
    return f


sum, max, min, prod = map(_reduce, ("sum", "max", "min", "prod"))
_REDUCE = {"sum": sum, "max": max, "min": min, "prod": prod}
_pymax = _b.max


def reduce_any(x: Tensor, dims=None, keepdim: bool = False) -> Tensor:
    """Whether any element over dims is nonzero (a max of booleans)."""
    return max(cast(x, DataType.Bool), dims, keepdim)


def reduce_all(x: Tensor, dims=None, keepdim: bool = False) -> Tensor:
    """Whether every element over dims is nonzero (a min of booleans)."""
    return min(cast(x, DataType.Bool), dims, keepdim)


def _count(x: Tensor, dims):
    """How many elements of x the reduction over dims takes: a number, or an
    int64 scalar tensor when a size is symbolic (a product of sizes is not
    affine, but as a value it is only a product)."""
    dims = range(x.ndim) if dims is None or x.ndim == 0 else [dims] if isinstance(dims, int) else dims
    g = _graph(x)
    n, symbolic = 1, None
    for d in dims:
        s = x.shape[d]
        if sz.is_static(s):
            n *= int(s)
        else:
            v = _wrap(g, g.size_value(s))
            symbolic = v if symbolic is None else symbolic * v
    return float(n) if symbolic is None else symbolic * n


def _per(total: Tensor, count) -> Tensor:
    """total / count in total's dtype (a symbolic count in its compute type)."""
    if isinstance(count, float):
        return total / count
    dt = total.dtype.compute
    return cast(cast(total, dt) / cast(count, dt), total.dtype)


def mean(x: Tensor, dims=None, keepdim: bool = False) -> Tensor:
    return _per(sum(x, dims, keepdim), _count(x, dims))


def var(x: Tensor, dims=None, correction: int = 1, keepdim: bool = False) -> Tensor:
    m = mean(x, dims, keepdim=True)
    d = x - m
    return _per(sum(d * d, dims, keepdim), _count(x, dims) - correction)


def var_mean(x: Tensor, dims=None, correction: int = 1, keepdim: bool = False):
    return var(x, dims, correction, keepdim), mean(x, dims, keepdim)


def argmax(x: Tensor, dim: int, keepdim: bool = False) -> Tensor:
    g = _graph(x)
    return _wrap(g, g.argreduce("argmax", _node(g, x), dim, keepdim))


def argmin(x: Tensor, dim: int, keepdim: bool = False) -> Tensor:
    g = _graph(x)
    return _wrap(g, g.argreduce("argmin", _node(g, x), dim, keepdim))


def cumulative(op: str, x: Tensor, dim: int, reverse: bool = False, exclusive: bool = False) -> Tensor:
    """Running op ("sum", "prod", "max", "min", "logsumexp") along dim; reverse runs from
    the end, exclusive shifts the running values by one (the first is op's
    identity)."""
    g = _graph(x)
    if x.ndim == 0:  # its one element (torch takes dim 0 and -1 of a 0-d tensor)
        return _wrap(g, g.cumulative(op, _node(g, x), dim))
    dim = dim % x.ndim
    if reverse:
        x = flip(x, [dim])
    y = _wrap(g, g.cumulative(op, _node(g, x), dim))
    if exclusive and not (sz.is_static(y.shape[dim]) and int(y.shape[dim]) == 0):  # (none to shift out)
        end, lo = list(y.shape), [0] * y.ndim
        end[dim], lo[dim] = y.shape[dim] - 1, 1
        y = _wrap(g, g.pad(_node(g, slice(y, [0] * y.ndim, end)), lo, [0] * y.ndim,
                           scalar.identity(op, y.dtype)))
    return flip(y, [dim]) if reverse else y


def cumsum(x: Tensor, dim: int) -> Tensor:
    return cumulative("sum", x, dim)


def cumprod(x: Tensor, dim: int) -> Tensor:
    return cumulative("prod", x, dim)


def cummax(x: Tensor, dim: int) -> Tensor:
    return cumulative("max", x, dim)


def cummin(x: Tensor, dim: int) -> Tensor:
    return cumulative("min", x, dim)


def window_cells(x: Tensor, window: Sequence[int], strides: Sequence[int], padding, counted=None) -> Tensor:
    """Per window of reduce_window("sum", x, window, strides, padding), how
    many of its cells lie inside x, or inside x padded by counted ((lo, hi)
    per dimension, within padding): what average pooling divides by when
    padding is not counted (TF, torch's count_include_pad=False), or only
    the declared padding is (torch's, never what ceil_mode adds)."""
    ones = full_like(x, 1.0)
    padding = [tuple(p) for p in padding]
    if counted is not None:
        ones = pad(ones, [w for lo, hi in reversed(list(counted)) for w in (lo, hi)], 1.0)
        padding = [(p[0] - c[0], p[1] - c[1]) for p, c in zip(padding, counted)]
    return reduce_window("sum", ones, window, strides, padding)


def reduce_window(op: str, x: Tensor, window: Sequence[int], strides: Sequence[int],
                  padding=None, dilation=None) -> Tensor:
    g = _graph(x)
    return _wrap(g, g.reduce_window(op, _node(g, x), window, strides, padding, dilation))


# ---------------------------------------------------------- contractions
def dot_general(a: Tensor, b: Tensor, contracting, batch=((), ())) -> Tensor:
    g = _graph(a, b)
    return _wrap(g, g.dot_general(_node(g, a), _node(g, b), contracting, batch))


def einsum(equation: str, *operands: Tensor) -> Tensor:
    """numpy's einsum for one or two operands (``...`` and the implicit
    output included): labels only one operand has and the output lacks are
    summed first, the rest is one dot_general (batch labels shared and kept,
    contracted labels shared and dropped) and a permutation."""
    eq = equation.replace(" ", "")
    lhs, out = eq.split("->") if "->" in eq else (eq, None)
    specs = lhs.split(",")
    if len(specs) != len(operands) or len(specs) not in (1, 2):
        raise DefinitionError(f"einsum {equation!r}: {len(operands)} operands (one or two are supported)")
    ell_rank = _b.max([x.ndim - len(sp) + 3 for sp, x in zip(specs, operands) if "..." in sp] or [0])
    ell = "0123456789"[:ell_rank]  # labels for the dims ... stands for
    specs = [sp.replace("...", ell[ell_rank - (x.ndim - len(sp) + 3):]) for sp, x in zip(specs, operands)]
    if out is None:
        counts = "".join(specs)
        out = ell + "".join(sorted(c for c in set(counts) if counts.count(c) == 1 and c not in ell))
    out = out.replace("...", ell)
    for sp, x in zip(specs, operands):
        if len(sp) != x.ndim or len(set(sp)) != len(sp):
            raise DefinitionError(f"einsum {equation!r}: subscripts {sp!r} for an operand of rank {x.ndim} "
                                  "(repeated labels are not supported)")
    xs = list(operands)
    for k, (sp, x) in enumerate(zip(specs, xs)):  # labels nothing else needs are summed first
        others = out + "".join(o for j, o in enumerate(specs) if j != k)
        gone = [d for d, c in enumerate(sp) if c not in others]
        if gone:
            xs[k] = sum(x, gone)
            specs[k] = "".join(c for c in sp if c in others)
    if len(xs) == 1:
        return permute(xs[0], [specs[0].index(c) for c in out])
    (a, b), (sa, sb) = xs, specs
    batch = [c for c in sa if c in sb and c in out]
    contract = [c for c in sa if c in sb and c not in out]
    y = dot_general(a, b, ([sa.index(c) for c in contract], [sb.index(c) for c in contract]),
                    ([sa.index(c) for c in batch], [sb.index(c) for c in batch]))
    have = "".join(batch) + "".join(c for c in sa if c not in sb) + "".join(c for c in sb if c not in sa)
    return permute(y, [have.index(c) for c in out])


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """numpy matmul: batched over leading dims, which broadcast."""
    if a.ndim == 1:
        return squeeze(matmul(unsqueeze(a, 0), b), [-2])
    if b.ndim == 1:
        return squeeze(matmul(a, unsqueeze(b, 1)), [-1])
    if a.ndim == 2 and b.ndim == 2:
        return dot_general(a, b, ([1], [0]))
    batch = _pymax(a.ndim, b.ndim) - 2
    g = _graph(a, b)
    lead = g._broadcast_shape([a.shape[:-2], b.shape[:-2]], "matmul batch")
    a = broadcast_to(a, tuple(lead) + a.shape[-2:])
    b = broadcast_to(b, tuple(lead) + b.shape[-2:])
    bd = list(range(batch))
    return dot_general(a, b, ([batch + 1], [batch]), (bd, bd))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, weight as (out_features, in_features)."""
    y = dot_general(x, weight, ([x.ndim - 1], [1]))
    return y + bias if bias is not None else y


def conv(x: Tensor, w: Tensor, strides, padding, dilation=None, groups: int = 1,
         layout: str = "NCHW", kernel_layout: str = "OIHW", input_dilation=None) -> Tensor:
    g = _graph(x, w)
    return _wrap(g, g.conv(_node(g, x), _node(g, w), strides, padding, dilation, groups, layout, kernel_layout,
                           input_dilation))


def spread_conv(x: Tensor, w: Tensor, strides, padding, dilation, groups: int, layout: str, kernel_layout: str,
                input_dilation) -> Tensor:
    """A stride-1 convolution of x spread by input_dilation (factor - 1
    zeros between neighbours) without the zeros: each phase of the output
    (its positions modulo the factors) meets x's own cells through only some
    of the kernel's taps, a strided slice of the kernel, so the phases are
    convolutions of x whose products together are the unspread
    convolution's, interleaved into the result. Spread out, every zero was
    multiplied: 4x the work of a stride-2 input gradient in 2-d. With
    symbolic sizes, or strides, the zeros are spread out still."""
    sp = [d for d, c in enumerate(layout) if c not in "NC"]
    ksp = [kernel_layout.index(layout[d]) for d in sp]
    if not all(sz.is_static(x.shape[d]) for d in sp) or any(s != 1 for s in strides):
        return _spread_out_conv(x, w, strides, padding, dilation, groups, layout, kernel_layout, input_dilation)
    dims = [_phases(int(x.shape[d]), int(w.shape[kd]), input_dilation[k], dilation[k], padding[k])
            for k, (d, kd) in enumerate(zip(sp, ksp))]
    parts = {phase: _phase_conv(x, w, [dims[k][2][p] for k, p in enumerate(phase)], sp, ksp, groups, layout,
                                kernel_layout)
             for phase in itertools.product(*[range(s) for s, _, _ in dims])}
    for k in reversed(range(len(sp))):  # the phases interleaved, the last spatial dim first
        if dims[k][0] != 1:
            parts = _interleave(parts, k, sp[k], *dims[k][:2])
    return parts[(0,) * len(sp)]


def _spread_out_conv(x: Tensor, w: Tensor, strides, padding, dilation, groups: int, layout: str,
                     kernel_layout: str, input_dilation) -> Tensor:
    """spread_conv with the zeros written out: x dilated, then convolved."""
    sp = [d for d, c in enumerate(layout) if c not in "NC"]
    factors, start = [1] * x.ndim, [0] * x.ndim
    for d, f in zip(sp, input_dilation):
        factors[d] = f
    x = dilate(x, factors)
    end = list(x.shape)
    for d, (lo, hi) in zip(sp, padding):  # a negative pad crops
        start[d], end[d] = _b.max(-lo, 0), end[d] - _b.max(-hi, 0)
    if any(start) or end != list(x.shape):
        x = slice(x, start, end)
    return conv(x, w, strides, [(_b.max(lo, 0), _b.max(hi, 0)) for lo, hi in padding], dilation, groups,
                layout, kernel_layout)


def _phases(n: int, taps: int, s: int, step: int, padding) -> tuple:
    """One spatial dim of spread_conv: its factor s, the result's size, and
    per phase the kernel taps it meets (first, stop, taps apart, cells of x
    apart), its padding of x and its size; (None, None, size) for a phase no
    tap meets."""
    lo, hi = padding
    size = (n - 1) * s + 1 + lo + hi - step * (taps - 1)
    phases = []
    for phase in range(s):
        hit = [t for t in range(taps) if (phase + t * step - lo) % s == 0]
        count = _b.max(0, -(-(size - phase) // s))
        if not hit or not count:
            phases.append((None, None, count))
            continue
        first = (phase + hit[0] * step - lo) // s  # the cell of x the phase's first tap meets
        every = hit[1] - hit[0] if len(hit) > 1 else 1  # taps apart
        apart = every * step // s if len(hit) > 1 else 1  # cells of x apart: the phase's dilation
        last = first + (len(hit) - 1) * apart
        phases.append(((hit[0], hit[-1] + 1, every, apart), (-first, count - 1 + last - (n - 1)), count))
    return s, size, phases


def _phase_conv(x: Tensor, w: Tensor, each: list, sp: list, ksp: list, groups: int, layout: str,
                kernel_layout: str) -> Tensor:
    """One phase of spread_conv (each: its _phases entry per spatial dim):
    x convolved with the kernel's taps that meet it, or zeros."""
    if any(taps is None for taps, _, _ in each):
        shape = list(x.shape)
        shape[layout.index("C")] = w.shape[kernel_layout.index("O")]
        for d, (_, _, count) in zip(sp, each):
            shape[d] = count
        return full(shape, 0.0, promote(x.dtype, w.dtype), like=x)
    kstart, kend, kstep = [0] * w.ndim, list(w.shape), [1] * w.ndim
    xstart, xend = [0] * x.ndim, list(x.shape)
    pads, steps = [], []
    for d, kd, ((start, stop, every, apart), (lo, hi), _) in zip(sp, ksp, each):
        kstart[kd], kend[kd], kstep[kd] = start, stop, every
        xstart[d], xend[d] = _b.max(-lo, 0), int(x.shape[d]) - _b.max(-hi, 0)  # a negative pad crops
        pads.append((_b.max(lo, 0), _b.max(hi, 0)))
        steps.append(apart)
    cropped = slice(x, xstart, xend) if xstart != [0] * x.ndim or xend != list(x.shape) else x
    return conv(cropped, slice(w, kstart, kend, kstep), [1] * len(sp), pads, steps, groups, layout, kernel_layout)


def _interleave(parts: dict, k: int, d: int, s: int, size: int) -> dict:
    """spread_conv's phases along its k-th spatial dim (d of the result)
    interleaved into one, cut to size: {phase with k-th entry 0: merged}."""
    rows = -(-size // s)
    merged = {}
    for phase in [p for p in parts if p[k] == 0]:
        cols = []
        for j in range(s):
            part = parts[phase[:k] + (j,) + phase[k + 1:]]
            short = [rows - int(part.shape[d]) if a == d else 0 for a in range(part.ndim)]
            cols.append(unsqueeze(pad_edges(part, [0] * part.ndim, short) if any(short) else part, d + 1))
        whole = cat(cols, d + 1)
        whole = reshape(whole, list(whole.shape[:d]) + [rows * s] + list(whole.shape[d + 2:]))
        end = list(whole.shape)
        end[d] = size
        merged[phase] = slice(whole, [0] * whole.ndim, end) if size != rows * s else whole
    return merged


def group_transpose(w: Tensor, groups: int) -> Tensor:
    """A grouped kernel's two channel dims exchanged within each group:
    (groups * a, b, ...) -> (groups * b, a, ...). A grouped convolution's
    adjoint (its input gradient, or a grouped transposed convolution) is the
    grouped convolution by this kernel, flipped."""
    a, b, rest = w.shape[0] // groups, w.shape[1], list(w.shape[2:])
    w = permute(reshape(w, [groups, a, b] + rest), [0, 2, 1] + list(range(3, 3 + len(rest))))
    return reshape(w, [groups * b, a] + rest)


def conv_input_grad(grad: Tensor, w: Tensor, input_sizes: Sequence, strides, padding, dilation=None,
                    groups: int = 1, layout: str = "NCHW", kernel_layout: str = "OIHW") -> Tensor:
    """The gradient of conv(x, w, ...)'s input x, whose spatial sizes are
    input_sizes, given the gradient of its output: a transposed convolution.
    The gradient is spread by the strides (stride - 1 zeros between
    neighbours), padded so that the result has x's sizes, and convolved at
    stride 1 with w flipped, its channel roles swapped within each group."""
    sp = [d for d, c in enumerate(layout) if c not in "NC"]
    ksp = [d for d, c in enumerate(kernel_layout) if c not in "OI"]
    dilation = list(dilation) if dilation is not None else [1] * len(sp)
    pads = []
    for i, d in enumerate(sp):
        span = dilation[i] * (w.shape[ksp[i]] - 1)
        lo = span - padding[i][0]
        spread_size = (grad.shape[d] - 1) * strides[i] + 1
        pads.append((lo, input_sizes[i] - spread_size - lo + span))
    if any(isinstance(v, int) and v < 0 for pr in pads for v in pr):
        raise UnsupportedOpError("a transposed convolution (or convolution's input gradient) with padding "
                                 "larger than the kernel")
    wf = reverse(w, ksp)
    spread = list(strides) if any(s > 1 for s in strides) else None
    if groups == 1:
        return conv(grad, wf, [1] * len(sp), pads, dilation, 1, layout,
                    kernel_layout.translate(str.maketrans("OI", "IO")), spread)
    canon = "OI" + "".join(kernel_layout[d] for d in ksp)
    wf = group_transpose(permute(wf, [kernel_layout.index(c) for c in canon]), groups)
    return conv(grad, wf, [1] * len(sp), pads, dilation, groups, layout, canon, spread)


def conv_weight_grad(x: Tensor, grad: Tensor, kernel_sizes: Sequence[int], strides, padding, dilation=None,
                     layout: str = "NCHW", kernel_layout: str = "OIHW", groups: int = 1) -> Tensor:
    """The gradient of conv(x, w, ...)'s kernel, given the gradient of its
    output (in layout): a convolution of x by the gradient, with the batch
    contracted (x's N and C swap roles), strides and dilation exchanged,
    cut to the kernel's sizes, in kernel_layout.
    dW[o, i, k] = sum_{n, p} x[n, i, p * stride + k * dilation - pad] * grad[n, o, p].
    With groups, x's channels of group j move next to the batch as channels
    j*N..(j+1)*N, so that a convolution of groups groups pairs each output
    channel with its own group's inputs only."""
    nsp = x.ndim - 2
    dilation = list(dilation) if dilation is not None else [1] * nsp
    as_kernel = layout.translate(str.maketrans("NC", "IO"))  # the gradient read as the kernel
    if groups > 1:
        if not sz.is_static(x.shape[layout.index("N")]):  # group j's channels j*N.. would not be affine
            raise UnsupportedOpError("the weight gradient of a grouped convolution over a symbolic batch")
        canon = "NC" + "".join(c for c in layout if c not in "NC")
        to = [layout.index(c) for c in canon]
        x, grad, layout, as_kernel = permute(x, to), permute(grad, to), canon, "IO" + canon[2:]
        n, c, sp = x.shape[0], x.shape[1] // groups, list(x.shape[2:])
        x = permute(reshape(x, [n, groups, c] + sp), [2, 1, 0] + list(range(3, 3 + nsp)))
        gw = conv(reshape(x, [c, groups * n] + sp), grad, list(dilation), padding, list(strides), groups,
                  layout, as_kernel)
        letters = as_kernel  # gw: (channels per group, output channels, window)
    else:
        swapped = layout.translate(str.maketrans("NC", "CN"))
        gw = conv(x, grad, list(dilation), padding, list(strides), 1, swapped, as_kernel)
        letters = swapped.translate(str.maketrans("CN", "OI"))  # what each of gw's dims holds
    gw = permute(gw, [letters.index(c) for c in kernel_layout])
    spatial = [c for c in layout if c not in "NC"]
    sizes = [kernel_sizes[spatial.index(c)] if c in spatial else n for c, n in zip(kernel_layout, gw.shape)]
    return slice(gw, [0] * gw.ndim, sizes)


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0,
           dilation=1, groups: int = 1) -> Tensor:
    """torch.nn.functional.conv2d: NCHW input, OIHW weight."""
    pair = lambda v: tuple(v) if isinstance(v, (list, tuple)) else (v, v)  # noqa: E731
    ph, pw = pair(padding)
    y = conv(x, weight, pair(stride), ((ph, ph), (pw, pw)), pair(dilation), groups)
    if bias is not None:
        y = y + reshape(bias, [1, -1, 1, 1]) if sz.is_static(bias.shape[0]) else \
            y + broadcast_in_dim(bias, y.shape, [1])
    return y


def max_pool2d(x: Tensor, kernel_size, stride=None, padding=0) -> Tensor:
    pair = lambda v: tuple(v) if isinstance(v, (list, tuple)) else (v, v)  # noqa: E731
    k = pair(kernel_size)
    s = pair(stride) if stride is not None else k
    p = pair(padding)
    return reduce_window("max", x, (1, 1) + k, (1, 1) + s, ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1])))


def avg_pool2d(x: Tensor, kernel_size, stride=None, padding=0) -> Tensor:
    """Average over each window, padded cells counted (torch's count_include_pad)."""
    pair = lambda v: tuple(v) if isinstance(v, (list, tuple)) else (v, v)  # noqa: E731
    k = pair(kernel_size)
    s = pair(stride) if stride is not None else k
    p = pair(padding)
    total = reduce_window("sum", x, (1, 1) + k, (1, 1) + s, ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1])))
    return total / float(k[0] * k[1])


def _pairs(padding) -> list[tuple]:
    """Per-dim padding as (low, high): a number pads both sides alike."""
    return [(p, p) if isinstance(p, int) else tuple(p) for p in padding]


def max_pool_with_positions(x: Tensor, window: Sequence[int], strides: Sequence[int],
                            padding: Sequence, dilation: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
    """Max over windows of x's trailing len(window) dims (padding per dim: a
    number, or (low, high), the high side longer for torch's ceil_mode) and,
    as torch's max_pool returns them, the row-major position within those
    dims of each window's first maximum; NaN counts as the maximum and
    padding never wins (XLA's select_and_scatter lets padding win: JAX's
    gradient keeps its own). The maximum is one window reduction (computed
    inline where its consumer reads it, with no positions asked for); the
    position is the first cell inside the image that equals it, or the
    first NaN, one select per cell of the window."""
    nsp = len(window)
    lead = list(x.shape[:-nsp])
    dilation = list(dilation) if dilation is not None else [1] * nsp
    pads = _pairs(padding)
    spatial = list(x.shape[-nsp:])
    out = [sz.windows(n + a + b - d * (k - 1) - 1, s) for n, k, s, (a, b), d in zip(spatial, window, strides, pads, dilation)]
    best = reduce_window("max", x, [1] * len(lead) + list(window), [1] * len(lead) + list(strides),
                         [(0, 0)] * len(lead) + [tuple(p) for p in pads], [1] * len(lead) + dilation)
    padded = any(a or b for a, b in pads)
    xp = pad(x, [w for p in reversed(pads) for w in p], -math.inf) if padded else x
    cell = _window_cells(x, lead + out, strides, [a for a, _ in pads], dilation)
    pos = None
    for offset in reversed(list(itertools.product(*[range(k) for k in window]))):
        start = [0] * len(lead) + [o * d for o, d in zip(offset, dilation)]
        end = lead + [o * d + s * (n - 1) + 1 for o, d, s, n in zip(offset, dilation, strides, out)]
        v = slice(xp, start, end, [1] * len(lead) + list(strides))
        coords = cell(offset)
        here = _flat_position(coords, spatial)
        if pos is None:  # the last cell: where no earlier one holds the maximum
            pos = here
            continue
        hit = logical_or(v == best, isnan(v))
        if padded:
            for c, n in zip(coords, spatial):
                hit = logical_and(hit, logical_and(c >= 0, c < n))
        pos = where(hit, here, pos)
    return best, pos


def _window_cells(like: Tensor, shape: Sequence, strides, lows, dilation):
    """offset -> for each window (over shape's trailing dims), the
    coordinates of its cell at offset in the unpadded image (lows: the
    padding before each dim)."""
    lead = len(shape) - len(strides)
    at = [iota(list(shape), lead + k, like=like) * s - p for k, (s, p) in enumerate(zip(strides, lows))]
    return lambda offset: [a + o * d for a, o, d in zip(at, offset, dilation)]


def _flat_position(coords, spatial) -> Tensor:
    """The row-major position of coords in an image of sizes spatial."""
    here = coords[0]
    for c, n in zip(coords[1:], spatial[1:]):
        here = here * n + c
    return here


def window_adjoint(per_offset: Callable, shape: Sequence, window: Sequence[int], strides: Sequence[int],
                   padding: Sequence[int], dilation: Sequence[int] | None = None) -> Tensor:
    """The adjoint of reading the windows of an image (shape's trailing
    len(window) dims; padding per dim: a number, or (low, high)): per_offset(offset) gives, at the
    windows' resolution, what flows back to each window's cell at offset; it
    is spread by the strides, shifted by the offset into the padded image and
    added, and the padding is cut. Elementwise throughout (every offset fuses
    into one pass, no scatter), and affine in symbolic sizes."""
    nsp = len(window)
    lead = len(shape) - nsp
    dilation = list(dilation) if dilation is not None else [1] * nsp
    padding = _pairs(padding)
    canvas = [n + a + b for n, (a, b) in zip(shape[lead:], padding)]
    out = None
    for offset in itertools.product(*[range(k) for k in window]):
        spread = dilate(per_offset(offset), [1] * lead + list(strides))
        lo = [o * d for o, d in zip(offset, dilation)]
        hi = [c - b - e for c, b, e in zip(canvas, lo, spread.shape[lead:])]
        part = pad(spread, [w for b, e in zip(reversed(lo), reversed(hi)) for w in (b, e)])
        out = part if out is None else out + part
    if any(a or b for a, b in padding):
        out = slice(out, [0] * lead + [a for a, _ in padding],
                    list(shape[:lead]) + [a + n for (a, _), n in zip(padding, shape[lead:])])
    return out


def window_sum_adjoint(grad: Tensor, shape: Sequence, window: Sequence[int], strides: Sequence[int],
                       padding: Sequence) -> Tensor:
    """The adjoint of summing each window (average pooling's gradient): each
    window's grad added to every cell of it, in a tensor of shape. Windows
    that tile the padded image (strides as the window: adaptive pooling's,
    EfficientNet's pooler of a 1280-cell window in ceil_mode) take a
    broadcast, cut to the image: window_adjoint's pass per offset made
    that window 1.6M pads and adds."""
    nsp = len(window)
    lead = len(shape) - nsp
    if list(strides) != list(window) or not all(sz.is_static(n) for n in [*shape[lead:], *grad.shape[lead:]]):
        return window_adjoint(lambda offset: grad, shape, window, strides, padding)
    low = [a for a, _ in _pairs(padding)]
    sizes, outs = [int(n) for n in shape[lead:]], [int(n) for n in grad.shape[lead:]]
    spread = list(grad.shape[:lead]) + [v for o, k in zip(outs, window) for v in (o, k)]
    x = broadcast_in_dim(grad, spread, list(range(lead)) + [lead + 2 * i for i in range(nsp)])
    x = reshape(x, list(grad.shape[:lead]) + [o * k for o, k in zip(outs, window)])
    past = [a + n - o * k if a + n > o * k else 0 for a, n, o, k in zip(low, sizes, outs, window)]  # (in no window)
    if any(past):
        x = pad(x, [w for c in reversed(past) for w in (0, c)])
    if list(x.shape[lead:]) != sizes:
        x = slice(x, [0] * lead + low, list(shape[:lead]) + [a + n for a, n in zip(low, sizes)])
    return x


def max_pool_grad(grad: Tensor, positions: Tensor, shape: Sequence, window: Sequence[int], strides: Sequence[int],
                  padding: Sequence, dilation: Sequence[int] | None = None) -> Tensor:
    """The adjoint of max_pool_with_positions: each window's gradient flows
    to the cell at its position, in a tensor of shape: added there (a
    scatter, as the frameworks do), or with symbolic sizes, where a flat
    position is not affine, selected per window tap and spread back
    (window_adjoint: a pass per tap over the input, 25x the scatter's time
    on a CPU at 2x64x56x56)."""
    nsp = len(window)
    cells = sz.static_product(shape[-nsp:])
    if cells is not None:  # (a window wholly in padding has no cell: its gradient goes nowhere)
        inside = logical_and(positions >= 0, positions < cells)
        return positions_grad(where(inside, grad, 0.0), where(inside, positions, 0), shape, nsp)
    dilation = list(dilation) if dilation is not None else [1] * nsp
    cell = _window_cells(grad, grad.shape, strides, [a for a, _ in _pairs(padding)], dilation)
    spatial = list(shape[-nsp:])
    return window_adjoint(lambda offset: where(positions == _flat_position(cell(offset), spatial), grad, 0.0),
                          shape, window, strides, padding, dilation)


def _static_sizes(x: Tensor, dims, what: str) -> list[int]:
    sizes = [x.shape[d] for d in dims]
    if not all(sz.is_static(n) for n in sizes):
        raise UnsupportedOpError(f"{what} over symbolic sizes")
    return [int(n) for n in sizes]


def _adaptive_cells(like: Tensor, n: int, o: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Adaptive pooling's windows along a dim of n cells pooled to o: window
    i covers [floor(i n / o), ceil((i + 1) n / o)), uneven where o does not
    divide n. (cells (o, k): each window's cells, the last repeated past its
    end; inside (o, k): whether a cell is the window's own; start and count (o,))."""
    k = _b.max(-(-((i + 1) * n) // o) - (i * n) // o for i in range(o))
    i, j = iota([o, k], 0, like=like), iota([o, k], 1, like=like)
    start, end = floor_divide(i * n, o), floor_divide((i + 1) * n + (o - 1), o)
    w = iota([o], 0, like=like)
    first = floor_divide(w * n, o)
    return minimum(start + j, end - 1), start + j < end, first, floor_divide((w + 1) * n + (o - 1), o) - first


def _along(v: Tensor, like: Tensor, axis: int, dtype=None) -> Tensor:
    """A vector v laid along axis of like's shape, in like's dtype (or dtype)."""
    return broadcast_in_dim(cast(v, dtype or like.dtype), like.shape, [axis])


def adaptive_avg_pool(x: Tensor, output_size: Sequence[int]) -> Tensor:
    """Mean over torch's adaptive windows of x's trailing len(output_size)
    dims, one dim at a time (a rectangle's mean is the mean of its rows'
    means): a window sum where the windows tile the dim evenly, else each
    window's cells gathered and summed with those past its end masked."""
    lead = x.ndim - len(output_size)
    for axis, n, o in zip(range(lead, x.ndim), _static_sizes(x, range(lead, x.ndim), "adaptive pooling"), output_size):
        if n == o:
            continue
        if n % o == 0:
            w = [1] * x.ndim
            w[axis] = n // o
            x = reduce_window("sum", x, w, w) / float(n // o)
            continue
        cells, inside, _, count = _adaptive_cells(x, n, o)
        got = take(x, cells, axis)
        total = sum(where(broadcast_in_dim(inside, got.shape, [axis, axis + 1]), got, 0.0), [axis + 1])
        x = total / _along(count, total, axis)
    return x


def adaptive_avg_pool_grad(grad: Tensor, shape: Sequence) -> Tensor:
    """The adjoint of adaptive_avg_pool to a tensor of shape: each window's
    gradient, divided by its cells, to each of them (a repeat where the
    windows tile the dim evenly, else a scatter-add)."""
    for axis in [d for d in range(len(shape)) if shape[d] != grad.shape[d]]:
        n, o = int(shape[axis]), int(grad.shape[axis])
        rest = list(grad.shape[:axis]), list(grad.shape[axis + 1:])
        if n % o == 0:
            spread = broadcast_in_dim(grad / float(n // o), rest[0] + [o, n // o] + rest[1],
                                      [d if d <= axis else d + 1 for d in range(grad.ndim)])
            grad = reshape(spread, rest[0] + [n] + rest[1])
            continue
        cells, inside, _, count = _adaptive_cells(grad, n, o)
        per = grad / _along(count, grad, axis)
        wide = rest[0] + [o, cells.shape[1]] + rest[1]
        spread = where(broadcast_in_dim(inside, wide, [axis, axis + 1]),
                       broadcast_in_dim(per, wide, [d if d <= axis else d + 1 for d in range(grad.ndim)]), 0.0)
        grad = scatter_add(rest[0] + [n] + rest[1], cells, spread, axis)
    return grad


def adaptive_max_pool_with_positions(x: Tensor, output_size: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Max over torch's adaptive windows of x's trailing len(output_size)
    dims and each window's row-major position of its first maximum within
    those dims (first NaN, if any). One dim at a time from the last: each
    window's cells gathered, the first maximum's offset taken, and the
    positions found along later dims carried with it."""
    nsp = len(output_size)
    lead = x.ndim - nsp
    spatial = _static_sizes(x, range(lead, x.ndim), "adaptive pooling")
    vals, pos = x, None
    for k in reversed(range(nsp)):
        axis, n, o = lead + k, spatial[k], output_size[k]
        cells, _, start, _ = _adaptive_cells(x, n, o)
        got = take(vals, cells, axis)
        at = argmax(got, axis + 1, keepdim=True)
        vals = squeeze(take_along_axis(got, at, axis + 1), [axis + 1])
        here = (_along(start, vals, axis, DataType.Int) + squeeze(at, [axis + 1])) * math.prod(spatial[k + 1:])
        pos = here if pos is None else here + squeeze(take_along_axis(take(pos, cells, axis), at, axis + 1), [axis + 1])
    return vals, pos


def positions_grad(grad: Tensor, positions: Tensor, shape: Sequence, nsp: int) -> Tensor:
    """The adjoint of picking each window's cell at its row-major position
    over shape's trailing nsp dims: each window's gradient added at its
    position (adaptive max pooling's backward)."""
    lead, cells = list(shape[:-nsp]), sz.static_product(shape[-nsp:])
    if cells is None:
        raise UnsupportedOpError("the gradient of adaptive max pooling over symbolic sizes")
    k = len(lead)
    out = scatter_add(lead + [cells], reshape(positions, lead + [-1]), reshape(grad, lead + [-1]), k, along=True)
    return reshape(out, list(shape))


# -------------------------------------------------------------- indexing
def index_select(x: Tensor, dim: int, index: Tensor) -> Tensor:
    g = _graph(x, index)
    return _wrap(g, g.gather(_node(g, x), _node(g, index), dim))


def take(x: Tensor, index: Tensor, axis: int = 0) -> Tensor:
    return index_select(x, axis, index)


def take_along_axis(x: Tensor, index: Tensor, axis: int) -> Tensor:
    """torch.gather(x, axis, index)."""
    g = _graph(x, index)
    return _wrap(g, g.gather(_node(g, x), _node(g, index), axis, along=True))


def embedding(index: Tensor, weight: Tensor) -> Tensor:
    return index_select(weight, 0, index)


def scatter_reduce(op: str, shape: Sequence, index: Tensor, src: Tensor, axis: int = 0,
                   along: bool = False, base: Tensor | None = None) -> Tensor:
    """op's identity (0, 1, -inf, inf) in shape, or base where given, with
    src's slices combined by op ("sum", "prod", "max", "min") at index along
    axis; with along=True, src[i] goes to index[i] (torch.scatter_reduce
    without self, or with base as self)."""
    g = _graph(index, src) if base is None else _graph(index, src, base)
    shape = tuple(shape)
    if not along and shape and _few_targets(shape[axis % len(shape)], index, src):
        scattered = _masked_scatter(op, shape, index, src, axis % len(shape))
        return scattered if base is None else _COMBINE[op](base, scattered)
    return _wrap(g, g.scatter(shape, _node(g, index), _node(g, src), axis, along, op,
                              None if base is None else _node(g, base)))


FEW_TARGETS = 8  # a scatter into at most this many slices is a reduction per slice


def _few_targets(size, index: Tensor, src: Tensor) -> bool:
    """Whether a scatter's many updates go to few slices (BERT's token types:
    every token into one of two rows), where a scatter's updates would wait
    on each other and a reduction per slice reads src a few times instead
    (symbolic sizes of the index at their estimates)."""
    n = math.prod(sz.estimate(s) for s in index.shape)
    return sz.is_static(size) and int(size) <= FEW_TARGETS and n > int(size) and src.dtype != DataType.Bool


def _masked_scatter(op: str, shape: Sequence, index: Tensor, src: Tensor, axis: int) -> Tensor:
    """scatter_reduce (along=False) as op's reduction, for each slice r of
    the result, of src's slices whose index names r (others give op's
    identity); an index wraps and clamps as the scatter's does."""
    r, k = int(shape[axis]), index.ndim
    wide = list(src.shape[:axis]) + [r] + list(src.shape[axis:])
    taken = list(range(axis + 1, axis + 1 + k))
    pos = clamp(where(index < 0, index + r, index), 0, r - 1)
    mine = broadcast_in_dim(pos, wide, taken) == iota(wide, axis, like=index)
    values = broadcast_in_dim(src, wide, [d for d in range(len(wide)) if d != axis])
    return _REDUCE[op](where(mine, values, full_like(values, scalar.identity(op, src.dtype))), taken)


def scatter_add(shape: Sequence, index: Tensor, src: Tensor, axis: int = 0, along: bool = False) -> Tensor:
    """zeros(shape) with src's slices added at index along axis (index_add);
    with along=True, src[i] is added at index[i] (torch.scatter_add)."""
    return scatter_reduce("sum", shape, index, src, axis, along)


_COMBINE = {"sum": add, "prod": mul, "max": maximum, "min": minimum}


def scatter_combine(x: Tensor, op: str, index: Tensor, src: Tensor, axis: int = 0) -> Tensor:
    """x with src[i] combined into it by op at index[i] along axis
    (torch.scatter_add / scatter_reduce with self, JAX's scatter_add, _mul,
    _min and _max)."""
    return scatter_reduce(op, x.shape, index, src, axis, along=True, base=x)


def scatter(x: Tensor, index: Tensor, src: Tensor, axis: int = 0) -> Tensor:
    """x with src[i] written at index[i] along axis (torch.scatter, JAX's
    x.at[i].set); where indices repeat, the last of them along axis wins (the
    frameworks leave the winner undefined). The winner's position is a max
    scatter; a second one takes the winner's value and the lowest value of
    the dtype from every other (so -0.0, NaN and inf pass unchanged)."""
    src = slice(src, [0] * src.ndim, list(index.shape)) if list(src.shape) != list(index.shape) else src
    k = iota(list(index.shape), axis, like=index)
    winner = scatter_reduce("max", x.shape, index, k, axis, along=True)
    mine = take_along_axis(winner, index, axis) == k
    lowest = -math.inf if src.dtype.is_float else False if src.dtype == DataType.Bool else \
        int(np.iinfo(src.dtype.numpy).min)
    written = scatter_reduce("max", x.shape, index, where(mine, src, full_like(src, lowest)), axis, along=True)
    return where(winner >= 0, written, x)


SORT_LIMIT = 512  # longest row sort() ranks pairwise: at 1024, 5 times eager PyTorch's sort (bench/NOTES.md)


def sort(x: Tensor, axis: int = -1, descending: bool = False) -> tuple[Tensor, Tensor]:
    """Values sorted along axis and their original positions, stable, NaN
    ordered as the largest value (numpy's, torch's and JAX's order). Each
    element's rank counts the elements that come before it (all pairs of a
    row compared: n^2 work), and one scatter per result puts each element
    at its rank. Rows longer than SORT_LIMIT are refused (UnsupportedOpError:
    the framework's sort runs them, as a counted fallback): a top-k over a
    vocabulary of 32000 took 2000 times eager's time."""
    if x.ndim == 0:  # one element, in its place
        return x, zeros_like(cast(x, DataType.Int))
    axis = axis % x.ndim
    n = x.shape[axis]
    if isinstance(n, int) and n > SORT_LIMIT:
        raise UnsupportedOpError(f"a sort or top-k along {n} elements: rows of at most {SORT_LIMIT} are ranked "
                                 "pairwise, longer ones run in the framework")
    key = cast(x, DataType.Int32) if x.dtype == DataType.Bool else x
    pairs = list(x.shape[:axis]) + [n, n] + list(x.shape[axis + 1:])
    rest = list(range(axis)), list(range(axis + 2, x.ndim + 1))
    mine = broadcast_in_dim(key, pairs, rest[0] + [axis] + rest[1])  # element i along axis
    other = broadcast_in_dim(key, pairs, rest[0] + [axis + 1] + rest[1])  # element j along axis + 1
    first, tie = (other > mine) if descending else (other < mine), other == mine
    if key.dtype.is_float:
        o_nan, m_nan = isnan(other), isnan(mine)
        first = logical_or(first, logical_and(o_nan, logical_not(m_nan)) if descending
                           else logical_and(m_nan, logical_not(o_nan)))
        tie = logical_or(tie, logical_and(o_nan, m_nan))
    earlier = iota(pairs, axis + 1, like=x) < iota(pairs, axis, like=x)
    rank = sum(cast(logical_or(first, logical_and(tie, earlier)), DataType.Int), [axis + 1])
    values = scatter_add(x.shape, rank, x, axis, along=True)
    return values, scatter_add(x.shape, rank, iota(x.shape, axis, like=x), axis, along=True)


def topk(x: Tensor, k: int, axis: int = -1, largest: bool = True) -> tuple[Tensor, Tensor]:
    """The k largest (or smallest) values along axis, in order, and their positions."""
    if x.ndim == 0:
        return sort(x)
    axis = axis % x.ndim
    values, positions = sort(x, axis, largest)
    end = list(x.shape)
    end[axis] = k
    return slice(values, [0] * x.ndim, end), slice(positions, [0] * x.ndim, end)


# ---------------------------------------------------------------- random
def rand_uniform(shape: Sequence, seed, offset: int = 0, *, like: Tensor | None = None) -> Tensor:
    """Counter-based uniform numbers in [0, 1): the same (seed, offset) give the same numbers."""
    g = _graph(seed, like)
    s = _node(g, seed) if isinstance(seed, Tensor) else g.constant(int(seed), DataType.Int)
    return _wrap(g, g.rand_uniform(tuple(shape), s, offset))


def random_bits(key: Tensor, shape: Sequence, word: int | None = None, offset: int = 0) -> Tensor:
    """JAX's threefry random bits (``jax.random.bits`` of a raw uint32[2] key),
    bit for bit; ``word`` and ``offset`` as Graph.random_bits takes them."""
    g = _graph(key)
    return _wrap(g, g.random_bits(_node(g, key), tuple(shape), word, offset))


def philox_bits(key: Tensor, counter: Tensor, shape: Sequence) -> Tensor:
    """TensorFlow's Philox random bits (a stateless random op's, from the
    uint64 key and counter of StatelessRandomGetKeyCounter), bit for bit."""
    g = _graph(key, counter)
    return _wrap(g, g.philox_bits(_node(g, key), _node(g, counter), tuple(shape)))


def random_split(key: Tensor, shape: Sequence) -> Tensor:
    """JAX's ``jax.random.split`` of a raw uint32[2] key into keys of shape
    (uint32[*shape, 2]), bit for bit: each new key is the two words of
    Threefry-2x32 at its position."""
    words = [random_bits(key, shape, word) for word in (0, 1)]
    return concatenate([unsqueeze(w, len(shape)) for w in words], len(shape))


def random_fold_in(key: Tensor, data: int) -> Tensor:
    """JAX's ``jax.random.fold_in`` of a raw uint32[2] key and a number known
    at compile time (flax's named streams), bit for bit: the two words of
    Threefry-2x32 at position ``data``."""
    return concatenate([random_bits(key, (1,), word, int(data) & 0xFFFFFFFF) for word in (0, 1)], 0)


def uniform(minval, maxval, shape: Sequence, dtype=DataType.Float, rng_seed=0, rng_offset: int = 0,
            *, like: Tensor | None = None) -> Tensor:
    u = rand_uniform(shape, rng_seed, rng_offset, like=like)
    return cast(u * (maxval - minval) + minval, dtype) if dtype != DataType.Float else u * (maxval - minval) + minval


def bernoulli(p: float, shape: Sequence, seed, offset: int = 0, *, like: Tensor | None = None) -> Tensor:
    return lt(rand_uniform(shape, seed, offset, like=like), p)


def dropout(x: Tensor, p: float, seed, offset: int = 0) -> Tensor:
    """Zero each element with probability p and scale the rest by 1/(1-p)."""
    if p <= 0:
        return x
    keep = ge(rand_uniform(x.shape, seed, offset, like=x), p)
    return where(keep, x * (1.0 / (1.0 - p)), 0.0)


# ------------------------------------------------------------ composites
def softmax(x: Tensor, dim: int = -1) -> Tensor:
    m = max(x, [dim], keepdim=True)
    e = exp(x - m)
    return e / sum(e, [dim], keepdim=True)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    m = max(x, [dim], keepdim=True)
    s = x - m
    return s - log(sum(exp(s), [dim], keepdim=True))


def layer_norm(x: Tensor, normalized_shape=None, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    return layer_norm_with_statistics(x, normalized_shape, weight, bias, eps)[0]


def layer_norm_with_statistics(x: Tensor, normalized_shape=None, weight: Tensor | None = None,
                               bias: Tensor | None = None, eps: float = 1e-5) -> tuple[Tensor, Tensor, Tensor]:
    """layer_norm, with the mean and 1/deviation it normalized by (the
    normalized dims kept, of size 1): what torch's native_layer_norm
    returns for its backward to reuse."""
    nd = len(normalized_shape) if normalized_shape is not None else 1
    dims = list(range(x.ndim - nd, x.ndim))
    m = mean(x, dims, keepdim=True)
    d = x - m
    rstd = rsqrt(mean(d * d, dims, keepdim=True) + eps)
    y = d * rstd
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y, m, rstd


def rms_norm(x: Tensor, normalized_shape=None, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    nd = len(normalized_shape) if normalized_shape is not None else 1
    dims = list(range(x.ndim - nd, x.ndim))
    y = x * rsqrt(mean(x * x, dims, keepdim=True) + eps)
    return y * weight if weight is not None else y


_GELU_BETA, _GELU_KAPPA = math.sqrt(2.0 / math.pi), 0.044715  # the tanh form's constants
_SQRT1_2 = 1.0 / math.sqrt(2.0)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    if approximate == "tanh":
        return 0.5 * x * (1.0 + tanh(_GELU_BETA * (x + _GELU_KAPPA * x * x * x)))
    return 0.5 * x * (1.0 + erf(x * _SQRT1_2))


def gelu_grad(x: Tensor, approximate: str = "none") -> Tensor:
    """The derivative of gelu(x, approximate), as torch's gelu_backward computes it."""
    if approximate == "tanh":
        t = tanh(_GELU_BETA * (x + _GELU_KAPPA * x * x * x))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * (_GELU_BETA * (1.0 + 3.0 * _GELU_KAPPA * x * x))
    cdf = 0.5 * (1.0 + erf(x * _SQRT1_2))
    return cdf + x * (exp(-0.5 * x * x) * (0.5 * _GELU_BETA))


_SHIFT = 8  # lgamma and digamma step small arguments up this far, where their asymptotic series converge


def _special(x: Tensor, fn) -> Tensor:
    """fn(x) computed in x's compute type (integers as float32)."""
    out = x.dtype if x.dtype.is_float else DataType.Float
    return cast(fn(cast(x, out.compute)), out)


def _stepped(z: Tensor) -> tuple[Tensor, Tensor]:
    """(whether z < 8, z or z + 8): where the asymptotic series is evaluated."""
    small = z < _SHIFT
    return small, where(small, z + float(_SHIFT), z)


def _reflected(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(z, sin(pi x), cos(pi x), whether x is a pole), z = x for x >= 0.5,
    else 1 - x (the reflection formulas' argument). The sine and cosine take
    x - 2 round(x / 2) folded into [0, 1/2] (exact steps), so they stay
    accurate near integers, where the reflection needs them most."""
    r = x - 2.0 * round(x * 0.5)
    a = abs(r)
    flip = a > 0.5
    t = math.pi * where(flip, 1.0 - a, a)
    s = where(r < 0.0, -sin(t), sin(t))
    c = where(flip, -cos(t), cos(t))
    return where(x < 0.5, 1.0 - x, x), s, c, logical_and(x <= 0.0, x == floor(x))


def lgamma(x: Tensor) -> Tensor:
    """log|Gamma(x)|: for z >= 8 Stirling's series, smaller z stepped up by
    the recurrence Gamma(z + 8) = z (z + 1) ... (z + 7) Gamma(z), and x < 0.5
    reflected (Gamma(x) Gamma(1 - x) = pi / sin(pi x)); inf at the poles
    (0, -1, -2, ...) and at +-inf."""
    def f(x):
        z, s, _, pole = _reflected(x)
        small, zz = _stepped(z)
        prod = z
        for k in range(1, _SHIFT):
            prod = prod * (z + float(k))
        r = reciprocal(zz)
        r2 = r * r
        series = r * (1 / 12 + r2 * (-1 / 360 + r2 * (1 / 1260 + r2 * (-1 / 1680 + r2 * (1 / 1188)))))
        big = (zz - 0.5) * log(zz) - zz + 0.5 * math.log(2 * math.pi) + series
        lg = where(small, big - log(where(small, prod, full_like(prod, 1.0))), big)
        out = where(x < 0.5, math.log(math.pi) - log(abs(s)) - lg, lg)
        return where(logical_or(pole, isinf(x)), full_like(x, math.inf), out)
    return _special(x, f)


def digamma(x: Tensor) -> Tensor:
    """d/dx log Gamma(x): the asymptotic series for z >= 8, smaller z by
    psi(z) = psi(z + 8) - sum 1/(z + k), x < 0.5 reflected (psi(1 - x) -
    psi(x) = pi cot(pi x)); -inf at 0 and NaN at the negative integers, as
    torch and SciPy give."""
    def f(x):
        z, s, c, pole = _reflected(x)
        small, zz = _stepped(z)
        steps = None
        for k in range(_SHIFT):
            t = reciprocal(z + float(k))
            steps = t if steps is None else steps + t
        r = reciprocal(zz)
        r2 = r * r
        series = r2 * (1 / 12 + r2 * (-1 / 120 + r2 * (1 / 252 + r2 * (-1 / 240 + r2 * (1 / 132)))))
        psi = log(zz) - 0.5 * r - series
        psi = where(small, psi - steps, psi)
        out = where(x < 0.5, psi - math.pi * c / s, psi)
        return where(pole, where(x == 0.0, full_like(x, -math.inf), full_like(x, math.nan)), out)
    return _special(x, f)


def exp2(x: Tensor) -> Tensor:
    """2 ** x, as exp(x ln 2): exp's polynomial vectorizes."""
    return exp(x * math.log(2.0))


def log2(x: Tensor) -> Tensor:
    return log(x) * (1.0 / math.log(2.0))


def log10(x: Tensor) -> Tensor:
    return log(x) * (1.0 / math.log(10.0))


def trunc(x: Tensor) -> Tensor:
    """Rounded toward zero."""
    return where(x < 0, ceil(x), floor(x)) if x.dtype.is_float else x


def signbit(x: Tensor) -> Tensor:
    """Whether the sign bit is set (-0.0 and negative NaN too)."""
    if not x.dtype.is_float:
        return x < 0
    f = x if x.dtype in (DataType.Float, DataType.Double) else cast(x, DataType.Float)
    return bitcast(f, DataType.Int32 if f.dtype == DataType.Float else DataType.Int) < 0


def _floating(x):
    """x as a float tensor (integers as float32), a Python number as it is."""
    return x if not isinstance(x, Tensor) or x.dtype.is_float else cast(x, DataType.Float)


def copysign(a, b) -> Tensor:
    """|a| with b's sign bit."""
    a, b = _floating(a), _floating(b)
    neg = signbit(b) if isinstance(b, Tensor) else math.copysign(1.0, b) < 0
    return where(neg, -abs(a), abs(a)) if isinstance(neg, Tensor) else (-abs(a) if neg else abs(a))


def hypot(a, b) -> Tensor:
    return sqrt(a * a + b * b)


def logaddexp2(a, b) -> Tensor:
    """log2(2^a + 2^b), from the larger; equal arguments (infinities too) give a + 1."""
    a, b = _floating(a), _floating(b)
    big = maximum(a, b)
    return where(a == b, a + 1.0, big + log1p(exp2(-abs(a - b))) * (1.0 / math.log(2.0)))


def _ignoring_nan(m: Tensor, a, b) -> Tensor:
    """m (a's and b's combination) where neither is NaN, else the other operand."""
    return where(isnan(b), a, where(isnan(a), b, m)) if m.dtype.is_float else m


def fmax(a, b) -> Tensor:
    """maximum ignoring NaN: the other operand where one is NaN (C's fmax)."""
    return _ignoring_nan(maximum(a, b), a, b)


def fmin(a, b) -> Tensor:
    """minimum ignoring NaN (C's fmin)."""
    return _ignoring_nan(minimum(a, b), a, b)


_HUGE = 2.0 ** 28  # past it, x*x in the inverse hyperbolic functions could overflow: log(2x) is exact enough


def atan(x: Tensor) -> Tensor:
    return atan2(x, 1.0)


def asin(x: Tensor) -> Tensor:
    x = _floating(x)
    return atan2(x, sqrt((1.0 - x) * (1.0 + x)))


def acos(x: Tensor) -> Tensor:
    x = _floating(x)
    return atan2(sqrt((1.0 - x) * (1.0 + x)), x)


def sinh(x: Tensor) -> Tensor:
    """(e^x - e^-x) / 2 through expm1, exact near zero."""
    x = _floating(x)
    return (expm1(x) - expm1(-x)) * 0.5


def cosh(x: Tensor) -> Tensor:
    x = _floating(x)
    return (exp(x) + exp(-x)) * 0.5


def asinh(x: Tensor) -> Tensor:
    """sign(x) log1p(|x| + x^2 / (1 + sqrt(1 + x^2))), exact near zero."""
    a = abs(_floating(x))
    y = where(a > _HUGE, log(a) + math.log(2.0), log1p(a + a * a / (1.0 + sqrt(1.0 + a * a))))
    return where(x < 0, -y, y)


def acosh(x: Tensor) -> Tensor:
    """log1p(t + sqrt(t (x + 1))), t = x - 1: exact near 1."""
    x = _floating(x)
    t = x - 1.0
    return where(x > _HUGE, log(x) + math.log(2.0), log1p(t + sqrt(t * (x + 1.0))))


def atanh(x: Tensor) -> Tensor:
    x = _floating(x)
    return log1p(2.0 * x / (1.0 - x)) * 0.5


def silu(x: Tensor) -> Tensor:
    return x * sigmoid(x)


def leaky_relu(x: Tensor, negative_slope: float = 0.01) -> Tensor:
    return where(x > 0, x, x * negative_slope)


# What polyjit.ops and FusionDefinition.Operators export.
__all__ = sorted({n for n, v in list(globals().items())
                  if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == __name__
                  and n not in ("Tensor", "builtins_slice")})
