"""The framework-neutral tensor graph: a small closed set of core ops.

Every frontend, the FusionDefinition builder and the tracing API build this
graph through :class:`Graph`'s methods, which infer shapes and dtypes and
reject bad operands with :class:`~polyjit.errors.DefinitionError`. Each core
op is lowered once, in :mod:`polyjit.lowering`.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from . import scalar
from . import sizes as sz
from .dtypes import DataType, promote, promote_weak, scalar_dtype, to_dtype
from .errors import DefinitionError
from .sizes import Lin, Size

UNARY_OPS, BINARY_OPS = scalar.UNARY, scalar.BINARY  # the elementwise ops: polyjit.scalar
ELEMENTWISE = (*UNARY_OPS, *BINARY_OPS, "where", "cast", "bitcast")  # each element from the same ones
REDUCTIONS = tuple(scalar.COMBINE)
SOURCES = ("input", "tensor_constant")  # leaves held in arrays: the caller's arguments, the program's constants
CONTRACTIONS = ("dot_general", "conv")  # products: a library (BLAS, cuDNN) may compute them

_ids = itertools.count()


@dataclass(frozen=True, eq=False)
class Node:
    """One tensor value: the op that makes it, its operands and attributes."""

    op: str
    inputs: tuple["Node", ...]
    attrs: dict
    shape: tuple[Size, ...]
    dtype: DataType
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_input(self) -> bool:
        return self.op == "input"

    @property
    def is_constant(self) -> bool:
        """A scalar constant (a tensor constant is a source)."""
        return self.op == "constant"

    @property
    def is_source(self) -> bool:
        """An input or a tensor constant: a leaf with an array of its own."""
        return self.op in SOURCES

    @property
    def is_index_transpose(self) -> bool:
        """A transpose read through its index function, not copied (packed)."""
        return self.op == "transpose" and not self.attrs.get("packed")

    def __str__(self) -> str:
        args = ", ".join(f"%{i.id}" for i in self.inputs)
        attrs = ", ".join(f"{k}={_fmt(v)}" for k, v in self.attrs.items())
        shape = "x".join(str(s) for s in self.shape) or "scalar"
        sep = ", " if args and attrs else ""
        return f"%{self.id}: {self.dtype}[{shape}] = {self.op}({args}{sep}{attrs})"


def _fmt(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return f"array{tuple(v.shape)}"
    return str(v)


def _freeze(v: Any) -> Any:
    """A hashable stand-in for an attribute value (arrays by identity)."""
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, np.ndarray):
        return ("array", id(v))
    return (type(v).__name__, repr(v))  # repr tells 0.0 from -0.0


def free_dims(n: Node) -> tuple[list[int], list[int]]:
    """dot_general n's free dims of each operand (neither contracted nor
    batch), in order: its result's dims after the batch ones."""
    a, b = n.inputs
    at = n.attrs
    return ([d for d in range(a.rank) if d not in at["lc"] and d not in at["lb"]],
            [d for d in range(b.rank) if d not in at["rc"] and d not in at["rb"]])


def _norm_axis(axis: int, rank: int, what: str = "axis") -> int:
    """axis in [0, rank); a 0-d tensor takes 0 and -1, as torch's scalars do
    (the ops over an axis then treat it as its one element)."""
    wrap = max(rank, 1)
    if not -wrap <= axis < wrap:
        raise DefinitionError(f"{what} {axis} is out of range for a tensor of rank {rank}")
    return axis % wrap


def _accumulated(op: str, dt: DataType) -> DataType:
    """The type a reduction by op accumulates dt in: sums and products of
    booleans and narrower integers in int64, as torch's do; a log-sum-exp
    of integers in float32."""
    if op == "logsumexp" and not dt.is_float:
        return DataType.Float
    return DataType.Int if op in scalar.WIDENING and (dt is DataType.Bool or dt.is_int) else dt


class _Shapes:
    """Sizes and broadcasting: symbolic sizes that must be equal (operands
    of an elementwise op) are unified here; the runtime checks the
    equalities that remain."""

    aliases: dict[str, str]
    constraints: list[tuple[Size, Size]]

    def resolve(self, s: Size) -> Size:
        if not isinstance(s, Lin):
            return s
        return s.rename({n: self._root(n) for n in s.params() | s.base_params()})  # (a product's factors too)

    def _root(self, name: str) -> str:
        while name in self.aliases:
            name = self.aliases[name]
        return name

    def unify(self, a: Size, b: Size, what: str) -> Size:
        a, b = self.resolve(a), self.resolve(b)
        if a == b:
            return a
        if sz.is_static(a) and sz.is_static(b):
            raise DefinitionError(f"{what}: sizes {a} and {b} do not match")
        if isinstance(a, Lin) and isinstance(b, Lin) and len(a.terms) == 1 and a.const == 0 \
                and a.terms[0][1] == 1 and len(b.terms) == 1 and b.const == 0 and b.terms[0][1] == 1:
            self.aliases[b.terms[0][0]] = a.terms[0][0]
            return a
        self.constraints.append((a, b))
        return b if sz.is_static(b) else a

    def _broadcast_shape(self, shapes, what: str) -> tuple[Size, ...]:
        rank = max(len(s) for s in shapes)
        out: list[Size] = []
        for d in range(rank):
            size: Size = 1
            for s in shapes:
                k = d - (rank - len(s))
                if k < 0 or s[k] == 1:
                    continue
                size = s[k] if size == 1 else self.unify(size, s[k], f"{what}, dimension {d}")
            out.append(size)
        return tuple(out)

    def broadcast_pair(self, a: Node, b: Node, what: str) -> tuple[Node, Node]:
        shape = self._broadcast_shape([a.shape, b.shape], what)
        return self.expand(a, shape), self.expand(b, shape)

    def expand(self, x: Node, shape: Sequence[Size]) -> Node:
        """numpy-style broadcast of x to shape (right-aligned)."""
        shape = tuple(shape)
        if tuple(map(self.resolve, x.shape)) == tuple(map(self.resolve, shape)):
            return x
        off = len(shape) - x.rank
        return self.broadcast_in_dim(x, shape, list(range(off, len(shape))))


class _LayoutOps:
    """The core ops that move elements: broadcast, reshape, transpose, slice,
    pad, concatenate, reverse."""

    def broadcast_in_dim(self, x: Node, shape: Sequence[Size], dims: Sequence[int]) -> Node:
        shape, dims = tuple(shape), tuple(int(d) % max(len(shape), 1) for d in dims)
        if len(dims) != x.rank:
            raise DefinitionError(f"broadcast_in_dim: {len(dims)} broadcast_dims for a tensor of rank {x.rank}")
        if list(dims) != sorted(set(dims)):
            raise DefinitionError(f"broadcast_in_dim: broadcast_dims {list(dims)} must be increasing")
        for k, d in enumerate(dims):
            if x.shape[k] != 1:
                self.unify(shape[d], x.shape[k], f"broadcast_in_dim, dimension {d}")
        if x.rank == len(shape) and all(x.shape[k] == shape[k] for k in range(x.rank)):
            return x
        return Node("broadcast_in_dim", (x,), {"dims": dims}, shape, x.dtype)

    def reshape(self, x: Node, shape: Sequence[Size]) -> Node:
        shape = list(shape)
        if -1 in shape:
            k = shape.index(-1)
            inferred = sz.quotient(x.shape, [s for i, s in enumerate(shape) if i != k])
            if inferred is None:
                raise DefinitionError(f"reshape: cannot infer the -1 of {shape} from {list(x.shape)}")
            shape[k] = inferred
        a, b = sz.static_product(x.shape), sz.static_product(shape)
        if a is not None and b is not None and a != b:
            raise DefinitionError(f"reshape: cannot reshape {list(x.shape)} into {shape}")
        if tuple(shape) == x.shape:
            return x
        if x.op == "reshape":  # a reshape of a reshape reads the first one's operand
            return self.reshape(x.inputs[0], shape)
        return Node("reshape", (x,), {}, tuple(shape), x.dtype)

    def transpose(self, x: Node, perm: Sequence[int]) -> Node:
        perm = tuple(_norm_axis(p, x.rank, "permutation entry") for p in perm)
        if sorted(perm) != list(range(x.rank)):
            raise DefinitionError(f"transpose: {list(perm)} is not a permutation of {x.rank} axes")
        if perm == tuple(range(x.rank)):
            return x
        return Node("transpose", (x,), {"perm": perm}, tuple(x.shape[p] for p in perm), x.dtype)

    def slice(self, x: Node, start: Sequence[int], end: Sequence[Size],
              strides: Sequence[int] | None = None) -> Node:
        strides = list(strides) if strides is not None else [1] * x.rank
        if not len(start) == len(end) == len(strides) == x.rank:
            raise DefinitionError(f"slice: expected {x.rank} start, end and stride entries")
        shape = []
        for d, (s, e, st) in enumerate(zip(start, end, strides)):
            if st < 1:
                raise DefinitionError(f"slice: stride {st} in dimension {d} must be positive")
            if isinstance(e, Lin) or isinstance(s, Lin) or isinstance(x.shape[d], Lin):
                n = (e - s + st - 1) // st
            else:
                e = min(int(e), int(x.shape[d]))
                if not 0 <= s <= max(e, 0):
                    raise DefinitionError(f"slice: start {s} out of range in dimension {d}")
                n = max(0, -(-(e - s) // st))
            shape.append(n)
        if tuple(shape) == tuple(x.shape) and not any(start) and all(st == 1 for st in strides):
            return x  # the whole of x (a weight gradient cut to the kernel's sizes it has)
        return Node("slice", (x,), {"start": tuple(start), "strides": tuple(strides)},
                    tuple(shape), x.dtype)

    def pad(self, x: Node, lo: Sequence[int], hi: Sequence[int], value=0) -> Node:
        if not len(lo) == len(hi) == x.rank:
            raise DefinitionError(f"pad: expected {x.rank} low and high widths")
        shape = tuple(x.shape[d] + lo[d] + hi[d] for d in range(x.rank))
        v = _py(value, x.dtype)
        return Node("pad", (x,), {"lo": tuple(lo), "hi": tuple(hi), "value": v}, shape, x.dtype)

    def concatenate(self, xs: Sequence[Node], axis: int) -> Node:
        if not xs:
            raise DefinitionError("concatenate: no operands")
        axis = _norm_axis(axis, xs[0].rank)
        dt = xs[0].dtype
        for x in xs[1:]:
            dt = promote(dt, x.dtype)
        xs = [self.cast(x, dt) for x in xs]
        total: Size = 0
        for x in xs:
            if x.rank != xs[0].rank:
                raise DefinitionError("concatenate: operands differ in rank")
            for d in range(x.rank):
                if d != axis:
                    self.unify(xs[0].shape[d], x.shape[d], f"concatenate, dimension {d}")
            total = total + x.shape[axis]
        shape = list(xs[0].shape)
        shape[axis] = total
        return Node("concatenate", tuple(xs), {"axis": axis}, tuple(shape), dt)

    def reverse(self, x: Node, axes: Sequence[int]) -> Node:
        axes = tuple(sorted(_norm_axis(a, x.rank) for a in axes))
        if x.rank == 0:
            return x
        return Node("reverse", (x,), {"axes": axes}, x.shape, x.dtype)


class _StructuredOps:
    """The core ops with structure beyond one element per element:
    reductions, windows, contractions, gathers and scatters."""

    # ------------------------------------------------------------ reductions
    def reduce(self, op: str, x: Node, axes: Sequence[int] | None, keepdim: bool = False) -> Node:
        if op not in REDUCTIONS:
            raise DefinitionError(f"unknown reduction {op!r}")
        axes = tuple(range(x.rank)) if axes is None else \
            tuple(sorted({_norm_axis(a, x.rank) for a in axes} if x.rank else ()))  # a 0-d tensor: nothing to combine
        dt = _accumulated(op, x.dtype)
        if dt in (DataType.Half, DataType.BFloat16) and op in scalar.WIDENING:
            inner = self.reduce(op, self.cast(x, DataType.Float), axes, keepdim)
            return self.cast(inner, dt)
        x = self.cast(x, dt)
        shape = tuple((1 if d in axes else s) for d, s in enumerate(x.shape) if keepdim or d not in axes)
        if all(x.shape[d] == 1 for d in axes):
            return self.reshape(x, shape)  # nothing to combine (JAX sums a gradient's unit axes away)
        return Node("reduce", (x,), {"op": op, "axes": axes, "keepdim": keepdim}, shape, dt)

    def argreduce(self, op: str, x: Node, axis: int, keepdim: bool = False) -> Node:
        """Index of the first extreme value (of the first NaN, if any), as core ops."""
        if op not in scalar.ARG_REDUCTIONS:
            raise DefinitionError(f"unknown arg-reduction {op!r}")
        axis = _norm_axis(axis, x.rank)
        if x.rank == 0:  # the position of a 0-d tensor's one element
            return self.iota((), 0)
        ext = self.reduce(scalar.ARG_REDUCTIONS[op], x, [axis], keepdim=True)
        hit = self.binary("eq", x, ext)
        if x.dtype.is_float:
            hit = self.binary("logical_or", hit, self.unary("isnan", x))
        pos = self.iota(x.shape, axis)
        big = self.constant(2 ** 62, DataType.Int)
        return self.reduce("min", self.where(hit, pos, big), [axis], keepdim)

    def cumulative(self, op: str, x: Node, axis: int) -> Node:
        """Running sum, product, maximum, minimum or log-sum-exp along axis;
        sums and products of booleans and int32 accumulate in int64, as
        torch's do."""
        if op not in scalar.CUMULATIVE:
            raise DefinitionError(f"cumulative: op {op!r} is not one of {', '.join(scalar.CUMULATIVE)}")
        axis = _norm_axis(axis, x.rank)
        dt = _accumulated(op, x.dtype)
        if dt in (DataType.Half, DataType.BFloat16) and op in scalar.FLOAT_CARRIED:  # (as reductions widen them)
            return self.cast(self.cumulative(op, self.cast(x, DataType.Float), axis), dt)
        if x.rank == 0:  # a 0-d tensor's one element
            return self.cast(x, dt)
        return Node("cumulative", (self.cast(x, dt),), {"op": op, "axis": axis}, x.shape, dt)

    def cumsum(self, x: Node, axis: int) -> Node:
        return self.cumulative("sum", x, axis)

    def reduce_window(self, op: str, x: Node, window: Sequence[int], strides: Sequence[int],
                      padding: Sequence[tuple[int, int]] | None = None,
                      dilation: Sequence[int] | None = None) -> Node:
        """Windowed reduction (pooling); padded cells hold the op's identity."""
        if op not in scalar.WINDOW_REDUCTIONS:
            raise DefinitionError(f"reduce_window: unknown op {op!r}")
        r = x.rank
        padding = list(padding) if padding is not None else [(0, 0)] * r
        dilation = list(dilation) if dilation is not None else [1] * r
        if not len(window) == len(strides) == len(padding) == len(dilation) == r:
            raise DefinitionError(f"reduce_window: expected {r} window, stride, padding entries")
        shape = []
        for d in range(r):
            ext = x.shape[d] + padding[d][0] + padding[d][1] - dilation[d] * (window[d] - 1) - 1
            shape.append(sz.windows(ext, strides[d]))
        attrs = {"op": op, "window": tuple(window), "strides": tuple(strides),
                 "padding": tuple(map(tuple, padding)), "dilation": tuple(dilation)}
        return Node("reduce_window", (x,), attrs, tuple(shape), x.dtype)

    # ---------------------------------------------------------- contractions
    def dot_general(self, a: Node, b: Node, contracting: tuple[Sequence[int], Sequence[int]],
                    batch: tuple[Sequence[int], Sequence[int]] = ((), ())) -> Node:
        """XLA's DotGeneral: result dims are batch, a's free dims, b's free dims."""
        lc, rc = [tuple(_norm_axis(d, t.rank) for d in ds) for ds, t in zip(contracting, (a, b))]
        lb, rb = [tuple(_norm_axis(d, t.rank) for d in ds) for ds, t in zip(batch, (a, b))]
        if len(lc) != len(rc) or len(lb) != len(rb):
            raise DefinitionError("dot_general: contracting and batch dims must pair up")
        for i, j in zip(lc, rc):
            self.unify(a.shape[i], b.shape[j], "dot_general contracting dimension")
        for i, j in zip(lb, rb):
            self.unify(a.shape[i], b.shape[j], "dot_general batch dimension")
        dt = promote(a.dtype, b.dtype)
        a, b = self.cast(a, dt), self.cast(b, dt)
        lf = [d for d in range(a.rank) if d not in lc and d not in lb]
        rf = [d for d in range(b.rank) if d not in rc and d not in rb]
        shape = tuple([a.shape[d] for d in lb] + [a.shape[d] for d in lf] + [b.shape[d] for d in rf])
        attrs = {"lc": lc, "rc": rc, "lb": lb, "rb": rb}
        return Node("dot_general", (a, b), attrs, shape, dt)

    def conv(self, x: Node, w: Node, strides: Sequence[int], padding: Sequence[tuple[int, int]],
             dilation: Sequence[int] | None = None, groups: int = 1,
             layout: str = "NCHW", kernel_layout: str = "OIHW",
             input_dilation: Sequence[int] | None = None) -> Node:
        """N-d convolution (cross-correlation, as every framework computes it).

        `layout` names the input's and output's dims with N, C and spatial
        letters; `kernel_layout` names the kernel's with O, I and the same
        spatial letters, e.g. NHWC with HWIO. `input_dilation` (XLA's lhs
        dilation) spreads the input with factor - 1 zeros between
        neighbours first: a strided convolution's input gradient, which a
        target either calls as such (cuDNN's backward data) or expands
        (targets.base.expand_input_dilation).
        """
        nsp = x.rank - 2
        sp = [c for c in layout if c not in "NC"]
        if len(layout) != x.rank or len(kernel_layout) != w.rank or sorted(sp) != sorted(
                c for c in kernel_layout if c not in "OI"):
            raise DefinitionError(f"conv: layouts {layout}/{kernel_layout} do not fit ranks {x.rank}/{w.rank}")
        dilation = list(dilation) if dilation is not None else [1] * nsp
        spread = [operator.index(f) for f in input_dilation] if input_dilation is not None else [1] * nsp
        if not len(strides) == len(padding) == len(dilation) == len(spread) == nsp:
            raise DefinitionError(f"conv: expected {nsp} stride, padding, dilation and input dilation entries")
        if any(f < 1 for f in spread):
            raise DefinitionError(f"conv: input dilation {spread} must be positive integers")
        dt = promote(x.dtype, w.dtype)
        x, w = self.cast(x, dt), self.cast(w, dt)
        cin = x.shape[layout.index("C")]
        cin_g = w.shape[kernel_layout.index("I")]
        cout = w.shape[kernel_layout.index("O")]
        if sz.is_static(cin) and sz.is_static(cin_g) and cin != cin_g * groups:
            raise DefinitionError(f"conv: input has {cin} channels, kernel expects {cin_g}x{groups} groups")
        if sz.is_static(cout) and cout % groups:
            raise DefinitionError(f"conv: {cout} output channels do not divide into {groups} groups")
        shape: list[Size] = []
        for c in layout:
            if c == "N":
                shape.append(x.shape[layout.index("N")])
            elif c == "C":
                shape.append(cout)
            else:
                k = sp.index(c)
                ks = w.shape[kernel_layout.index(c)]  # symbolic in a weight gradient: the output's gradient
                n = x.shape[layout.index(c)]
                n = (n - 1) * spread[k] + 1 if spread[k] > 1 else n
                ext = n + padding[k][0] + padding[k][1] - dilation[k] * (ks - 1) - 1
                shape.append(sz.windows(ext, strides[k]))
        attrs = {"strides": tuple(strides), "padding": tuple(map(tuple, padding)),
                 "dilation": tuple(dilation), "groups": groups, "layout": layout,
                 "kernel_layout": kernel_layout}
        if any(f > 1 for f in spread):
            attrs["input_dilation"] = tuple(spread)
        return Node("conv", (x, w), attrs, tuple(shape), dt)

    # -------------------------------------------------------------- indexing
    def gather(self, x: Node, index: Node, axis: int, along: bool = False) -> Node:
        """x.take(index, axis) (index_select, embeddings), or with along=True
        take_along_axis (torch.gather): index has x's rank and the result's shape."""
        if not index.dtype.is_int:
            raise DefinitionError(f"gather: indices must be integers, not {index.dtype}")
        axis = _norm_axis(axis, x.rank)
        if x.rank == 0:  # torch's scalars: an index of one element picks the one element
            if sz.static_product(index.shape) != 1:
                raise DefinitionError(f"gather: a 0-d tensor takes one index, got shape {list(index.shape)}")
            one = self.gather(self.reshape(x, [1]), self.reshape(index, [1]), 0, along)
            return self.reshape(one, index.shape if along else ())
        if along:
            if index.rank != x.rank:
                raise DefinitionError(f"gather: index has rank {index.rank}, expected {x.rank}")
            shape = index.shape
        else:
            shape = x.shape[:axis] + index.shape + x.shape[axis + 1:]
        return Node("gather", (x, index), {"axis": axis, "along": along}, shape, x.dtype)

    def scatter(self, shape: Sequence[Size], index: Node, src: Node, axis: int,
                along: bool = False, op: str = "sum", base: Node | None = None) -> Node:
        """op's identity in shape (base, where given), with src combined in
        by op (sum, prod, max, min) at index along axis: with sum, gather's
        adjoint (index_add, or with along=True torch.scatter_add)."""
        if op not in REDUCTIONS:
            raise DefinitionError(f"scatter: unknown op {op!r}")
        shape = tuple(shape)
        axis = _norm_axis(axis, len(shape))
        if base is not None:
            if base.rank != len(shape) or base.dtype != src.dtype:
                raise DefinitionError(f"scatter: base of shape {list(base.shape)} and {base.dtype.value}, "
                                      f"expected {list(shape)} and {src.dtype.value}")
            for d, (a, b) in enumerate(zip(shape, base.shape)):
                self.unify(a, b, f"scatter, base dimension {d}")
        if not shape:  # into a 0-d tensor: as into its one element
            if sz.static_product(index.shape) != 1:
                raise DefinitionError(f"scatter: a 0-d tensor takes one index, got shape {list(index.shape)}")
            one = self.scatter((1,), self.reshape(index, [1]), self.reshape(src, [1]), 0, along, op,
                               None if base is None else self.reshape(base, [1]))
            return self.reshape(one, ())
        if along:
            if not index.rank == src.rank == len(shape):
                raise DefinitionError("scatter: index, src and the result must have one rank")
            want = index.shape
        else:
            want = shape[:axis] + index.shape + shape[axis + 1:]
        if len(want) != src.rank:
            raise DefinitionError(f"scatter: src has rank {src.rank}, expected {len(want)}")
        if not along:
            for d, (a, b) in enumerate(zip(want, src.shape)):
                self.unify(a, b, f"scatter, src dimension {d}")
        ins = (index, src) if base is None else (index, src, base)
        return Node("scatter", ins, {"axis": axis, "along": along, "op": op}, shape, src.dtype)


class Graph(_Shapes, _LayoutOps, _StructuredOps):
    """A tensor program under construction: inputs, nodes, outputs.

    Symbolic sizes that must be equal (operands of an elementwise op) are
    unified here; the runtime checks the equalities that remain.
    """

    def __init__(self) -> None:
        self.inputs: list[Node] = []
        self.outputs: list[Node] = []
        self.aliases: dict[str, str] = {}
        self.constraints: list[tuple[Size, Size]] = []

    # --------------------------------------------------------------- leaves
    def input(self, shape: Sequence[Size], dtype, name: str | None = None,
              strided: bool = False) -> Node:
        idx = len(self.inputs)
        n = Node("input", (), {"index": idx, "name": name or f"T{idx}", "strided": strided},
                 tuple(shape), to_dtype(dtype))
        self.inputs.append(n)
        return n

    def constant(self, value, dtype=None) -> Node:
        dt = to_dtype(dtype) if dtype is not None else scalar_dtype(value)
        return Node("constant", (), {"value": _py(value, dt), "weak": dtype is None}, (), dt)

    def size_value(self, s: Size) -> Node:
        """A size's value as an int64 scalar: a window's flat position in an
        image of any width multiplies by the width."""
        if sz.is_static(s):
            return self.constant(int(s))
        return Node("size", (), {"size": s}, (), DataType.Int)

    def tensor_constant(self, array) -> Node:
        arr = np.ascontiguousarray(array)
        return Node("tensor_constant", (), {"value": arr}, tuple(arr.shape), to_dtype(arr.dtype))

    def iota(self, shape: Sequence[Size], dim: int, dtype=DataType.Int) -> Node:
        dim = _norm_axis(dim, len(shape), "iota dimension")
        if not shape:  # a 0-d tensor's one position
            return self.constant(0, dtype)
        return Node("iota", (), {"dim": dim}, tuple(shape), to_dtype(dtype))

    def rand_uniform(self, shape: Sequence[Size], seed: Node, offset: int = 0,
                     dtype=DataType.Float) -> Node:
        """Counter-based (Philox 4x32-10) uniform numbers in [0, 1)."""
        if seed.rank != 0 or not seed.dtype.is_int:
            raise DefinitionError("rand_uniform: the seed must be an integer scalar")
        return Node("rand_uniform", (seed,), {"offset": int(offset)}, tuple(shape),
                    to_dtype(dtype))

    # ----------------------------------------------------------- elementwise
    def unary(self, op: str, x: Node) -> Node:
        if op not in UNARY_OPS:
            raise DefinitionError(f"unknown unary op {op!r}")
        kind = scalar.OPS[op].kind
        if kind == "bits" and not x.dtype.is_int:
            raise DefinitionError(f"{op} needs an integer operand, got {x.dtype}")
        if kind == "logical":
            x = self.cast(x, DataType.Bool)
        elif kind == "float" and not x.dtype.is_float:
            x = self.cast(x, DataType.Float)
        return Node(op, (x,), {}, x.shape, DataType.Bool if scalar.OPS[op].result_bool else x.dtype)

    def binary(self, op: str, a: Node, b: Node) -> Node:
        if op not in BINARY_OPS:
            raise DefinitionError(f"unknown binary op {op!r}")
        dt = self._result_dtype(a, b)
        kind = scalar.OPS[op].kind
        if kind == "bits" and not dt.is_int:
            raise DefinitionError(f"{op} needs integer operands, got {a.dtype} and {b.dtype}")
        if kind == "float" and not dt.is_float:
            dt = DataType.Float
        a, b = self.cast(a, dt), self.cast(b, dt)
        a, b = self.broadcast_pair(a, b, op)
        if kind == "logical":
            a, b = self.cast(a, DataType.Bool), self.cast(b, DataType.Bool)
        out_dtype = DataType.Bool if scalar.OPS[op].result_bool else dt
        if op == "div" and dt.is_float and _sum_of_shifted_exps(b, a):  # a softmax: one division a row
            return Node("mul", (a, Node("reciprocal", (b,), {}, b.shape, dt)), {}, a.shape, out_dtype)
        for t, c in ((a, b), (b, a)):
            if t.op == "transpose" and c.op == "broadcast_in_dim" and c.attrs["dims"] == ():
                # x.T * scale as (x * scale).T: computed in x's order, read
                # through a transpose a product takes in place (SDPA's keys)
                x = t.inputs[0]
                c = self.broadcast_in_dim(c.inputs[0], x.shape, ())
                inner = Node(op, (x, c) if t is a else (c, x), {}, x.shape, out_dtype)
                return self.transpose(inner, t.attrs["perm"])
        return Node(op, (a, b), {}, a.shape, out_dtype)

    def where(self, cond: Node, a: Node, b: Node) -> Node:
        dt = self._result_dtype(a, b)
        cond = self.cast(cond, DataType.Bool)
        a, b = self.cast(a, dt), self.cast(b, dt)
        shape = self._broadcast_shape([cond.shape, a.shape, b.shape], "where")
        cond, a, b = (self.expand(t, shape) for t in (cond, a, b))
        return Node("where", (cond, a, b), {}, shape, dt)

    def bitcast(self, x: Node, dtype) -> Node:
        """The same bits read as another type of the same size (float32 <-> uint32)."""
        dt = to_dtype(dtype)
        if dt.itemsize != x.dtype.itemsize or DataType.Bool in (dt, x.dtype) or dt.compute != dt \
                or x.dtype.compute != x.dtype:
            raise DefinitionError(f"bitcast from {x.dtype} to {dt}: only between 32- or 64-bit types")
        return x if dt == x.dtype else Node("bitcast", (x,), {}, x.shape, dt)

    def random_bits(self, key: Node, shape: Sequence[Size], word: int | None = None, offset: int = 0) -> Node:
        """JAX's threefry random bits: uint32 per element from a uint32[2] key,
        Threefry-2x32 of the element's row-major position plus ``offset``
        (the xor of its two words; ``word`` 0 or 1: that word alone)."""
        if key.dtype is not DataType.UInt32 or tuple(key.shape) != (2,):
            raise DefinitionError(f"random_bits: the key must be uint32[2], got {key.dtype}{list(key.shape)}")
        attrs: dict = {} if word is None else {"word": word}
        if offset:
            attrs["offset"] = offset
        return Node("random_bits", (key,), attrs, tuple(shape), DataType.UInt32)

    def philox_bits(self, key: Node, counter: Node, shape: Sequence[Size]) -> Node:
        """TensorFlow's Philox random bits: uint32 per element from a
        uint64[1] key and a uint64[2] (128-bit) counter, word p mod 4 of
        Philox-4x32-10 at the counter plus p div 4 for the element's
        row-major position p, as TensorFlow's stateless random ops draw them."""
        if key.dtype is not DataType.UInt64 or tuple(key.shape) != (1,) or \
                counter.dtype is not DataType.UInt64 or tuple(counter.shape) != (2,):
            raise DefinitionError(f"philox_bits: the key must be uint64[1] and the counter uint64[2], got "
                                  f"{key.dtype}{list(key.shape)} and {counter.dtype}{list(counter.shape)}")
        return Node("philox_bits", (key, counter), {}, tuple(shape), DataType.UInt32)

    def cast(self, x: Node, dtype) -> Node:
        dt = to_dtype(dtype)
        if dt == x.dtype:
            return x
        if x.is_constant:
            return self.constant(x.attrs["value"], dt)
        return Node("cast", (x,), {}, x.shape, dt)

    def _result_dtype(self, a: Node, b: Node) -> DataType:
        wa, wb = _weak(a), _weak(b)
        if wa and not wb:
            return promote_weak(b.dtype, a.dtype)
        if wb and not wa:
            return promote_weak(a.dtype, b.dtype)
        return promote(a.dtype, b.dtype)

    # ---------------------------------------------------------------- output
    def add_output(self, x: Node) -> None:
        self.outputs.append(x)

    def nodes(self) -> list[Node]:
        """All nodes reachable from the outputs, operands first."""
        seen: set[int] = set()
        order: list[Node] = []
        stack = [(n, False) for n in reversed(self.outputs)]
        while stack:
            n, done = stack.pop()
            if done:
                order.append(n)
                continue
            if n.id in seen:
                continue
            seen.add(n.id)
            stack.append((n, True))
            stack.extend((i, False) for i in reversed(n.inputs) if i.id not in seen)
        return order

    def drop_unread_inputs(self) -> list[int]:
        """Remove the inputs no output reads (but those of a symbolic size,
        which may give the size); the kept inputs' former positions."""
        reached = {n.id for n in self.nodes()}
        kept = [k for k, n in enumerate(self.inputs)
                if n.id in reached or not all(isinstance(s, int) for s in n.shape)]
        self.inputs[:] = [self.inputs[k] for k in kept]
        for k, n in enumerate(self.inputs):
            n.attrs["index"] = k
        return kept

    def constant_arrays(self) -> list:
        """The values of the tensor constants, in the order of their arrays c0, c1, ..."""
        return [n.attrs["value"] for n in self.nodes() if n.op == "tensor_constant"]

    def deduplicated(self) -> "Graph":
        """A copy in which nodes computing the same op of the same operands are one
        node: decompositions repeat work (layer_norm's mean), and a repeated
        reduction would otherwise be a second pass over memory. A reshape that
        only drops the kept axes of a reduction used nowhere else becomes the
        reduction without them, so that no copy follows the sum (a bias
        gradient summed with keepdim, then reshaped); a transpose that swaps a
        product's free dimensions becomes the product of swapped operands; zero
        plus a sum is the sum (an embedding's gradient added to zeros: a copy
        of the whole table), and a value plus a scatter into zeros that
        nothing else reads is the scatter into the value (a tied embedding's
        gradient, added to the output projection's: one pass fewer over the
        table, and no zeroed one)."""
        table: dict[tuple, Node] = {}
        users = collections.Counter([i.id for n in self.nodes() for i in n.inputs] + [o.id for o in self.outputs])

        def step(old: Node, n: Node, new: dict[int, Node]) -> Node:
            r = n.inputs[0] if n.op == "reshape" else None
            if r is not None and r.op == "reduce" and r.attrs["keepdim"] and users[old.inputs[0].id] == 1 \
                    and n.shape == tuple(s for d, s in enumerate(r.shape) if d not in r.attrs["axes"]):
                n = Node("reduce", r.inputs, {**r.attrs, "keepdim": False}, n.shape, n.dtype)
            if n.op == "transpose" and n.inputs[0].op == "dot_general" and users[old.inputs[0].id] == 1:
                n = _swapped_product(n.inputs[0], n.attrs["perm"]) or n
            if n.op == "add":
                n = _sum_plus_zero(n) or _scattered_into(n, [users[i.id] for i in old.inputs]) or n
            key = (n.op, tuple(i.id for i in n.inputs), _freeze(n.attrs), n.shape, n.dtype)
            return table.setdefault(key, n) if not n.is_input else n
        return self.rewritten(step)

    def rewritten(self, step: Callable[[Node, Node, dict[int, Node]], Node]) -> "Graph":
        """A copy in which each node old, operands first, becomes step(old, n,
        new): n is old on its operands' new nodes (old itself where none
        changed), new the new node of each old one by id so far (old's: n).
        The one shape of a graph pass."""
        new: dict[int, Node] = {}
        for old in self.nodes():
            ins = tuple(new[i.id] for i in old.inputs)
            new[old.id] = old if all(a is b for a, b in zip(ins, old.inputs)) else dataclasses.replace(old, inputs=ins)
            new[old.id] = step(old, new[old.id], new)
        g = copy.copy(self)
        g.outputs = [new[o.id] for o in self.outputs]
        return g

    def __str__(self) -> str:
        lines = [str(n) for n in self.nodes()]
        lines.append("return " + ", ".join(f"%{o.id}" for o in self.outputs))
        return "\n".join(lines)




def _weak(n: Node) -> bool:
    """Whether n is weakly typed (a size, a Python number): it takes the type of the operand it meets."""
    return n.op == "size" or n.is_constant and bool(n.attrs.get("weak"))


def _sum_plus_zero(n: Node) -> Node | None:
    """The sum n adds a zero to, where that is exact: a float sum (a
    reduction, or a scatter into zeros) starts from +0.0 and so is never
    -0.0, and +0.0 + s is s bit for bit (NaN and infinities too)."""
    for z, x in (n.inputs, n.inputs[::-1]):
        while z.op == "broadcast_in_dim":
            z = z.inputs[0]
        if (z.is_constant and np.ndim(z.attrs["value"]) == 0 and z.attrs["value"] == 0 and x.dtype == n.dtype
                and x.shape == n.shape and n.dtype.is_float and x.op in ("reduce", "scatter")
                and x.attrs["op"] == "sum"):
            return x
    return None


def _scattered_into(n: Node, users: list[int]) -> Node | None:
    """add n of a value and a sum scattered into zeros (of n's shape and
    dtype; users[k] counts the readers of operand k) as that scatter into
    the value, where n is the scatter's only reader."""
    for k, (s, x) in enumerate((n.inputs, n.inputs[::-1])):
        if s.op == "scatter" and s.attrs["op"] == "sum" and len(s.inputs) == 2 and users[k] == 1 \
                and s.shape == x.shape == n.shape and s.dtype == x.dtype == n.dtype:
            return Node("scatter", (*s.inputs, x), s.attrs, n.shape, n.dtype)
    return None


def _unexpanded(n: Node) -> Node:
    while n.op in ("broadcast_in_dim", "reshape"):
        n = n.inputs[0]
    return n


def _sum_of_shifted_exps(s: Node, e: Node) -> bool:
    """Whether s is e summed over some axes, e being exp(x - max(x)) over
    the same axes (a softmax as ops.softmax, torch's decomposition and
    jax.nn.softmax write it): s is then at least 1, the maximum's own
    term, or NaN, so e * (1 / s) is e / s to an ulp, one division a row.
    (Not for any divisor: 1 / s overflows where s is subnormal.)"""
    s = _unexpanded(s)
    if s.op != "reduce" or s.attrs["op"] != "sum" or s.inputs[0] is not e or e.op != "exp" \
            or e.inputs[0].op != "sub":
        return False
    x, m = e.inputs[0].inputs
    m = _unexpanded(m)
    if m.op == "maximum":  # JAX's max with an initial -inf
        low = [k for k, t in enumerate(m.inputs) if _unexpanded(t).is_constant
               and np.all(_unexpanded(t).attrs["value"] == -np.inf)]
        m = _unexpanded(m.inputs[1 - low[0]]) if low else m
    return m.op == "reduce" and m.attrs["op"] == "max" and m.attrs["axes"] == s.attrs["axes"] \
        and _unexpanded(m.inputs[0]) is _unexpanded(x)


def _swapped_product(d: Node, perm: tuple) -> Node | None:
    """dot_general(a, b) transposed to (batch, b's free dims, a's free dims)
    is dot_general(b, a): a gradient written as a product and a transpose
    (JAX's and AOTAutograd's weight gradients) needs no transposing pass."""
    a, b = d.inputs
    at = d.attrs
    nb = len(at["lb"])
    nf = a.rank - nb - len(at["lc"])
    mf = b.rank - nb - len(at["rc"])
    if tuple(perm) != tuple(range(nb)) + tuple(range(nb + nf, nb + nf + mf)) + tuple(range(nb, nb + nf)):
        return None
    attrs = {"lc": at["rc"], "rc": at["lc"], "lb": at["rb"], "rb": at["lb"]}
    return Node("dot_general", (b, a), attrs, tuple(d.shape[p] for p in perm), d.dtype)


def _py(value, dt: DataType):
    if dt is DataType.Bool:
        return bool(value)
    if dt.is_int:
        return int(value)
    return float(value)
