"""The affine program: arrays and statements with isl domains and accesses.

One statement per op instance set: an iteration domain over the size
parameters, one written element (an index expression per dimension, possibly
updated by a reduction combiner) and a scalar body that reads arrays through
index expressions. Access relations are derived from the index expressions.
"""
from __future__ import annotations

import enum

from dataclasses import dataclass, field
from typing import Any

import islpy as isl

from . import sizes as sz
from .dtypes import DataType
from .expr import Const, Expr, Load, Op, Var, clamp_parts, it, loads, to_isl
from .sizes import Size


@dataclass(frozen=True)
class Array:
    name: str
    shape: tuple[Size, ...]
    dtype: DataType
    kind: str  # 'input' | 'output' | 'temp' | 'const'
    strided: bool = False  # strides are runtime arguments, not derived from the shape
    index: int = -1  # position among the inputs / outputs / constants
    returned_as: tuple[Size, ...] | None = None  # an output handed out reshaped (a view, no copy)

    def __str__(self) -> str:
        shape = ", ".join(map(str, self.shape))
        view = f" as [{', '.join(map(str, self.returned_as))}]" if self.returned_as is not None else ""
        return f"{self.kind} {self.dtype} {self.name}[{shape}]{' strided' if self.strided else ''}{view}"


class Role(enum.Enum):
    """What the scheduler must know of a statement beyond its accesses."""

    ASSIGN = "assign"  # array[index] = body
    INIT = "init"  # a reduction's start: its identity, before the updates
    UPDATE = "update"  # array[index] = combine(array[index], body)
    TAPS = "taps"  # a copy of a convolution's input taps for its product (im2col, a padded copy)

    def __repr__(self) -> str:
        return f"Role.{self.name}"


TAPS = Role.TAPS


@dataclass(frozen=True)
class Statement:
    name: str
    iters: tuple[str, ...]
    bounds: tuple[tuple[Size, Size], ...]  # lo <= iter < hi
    array: str
    index: tuple[Expr, ...]
    body: Expr
    combine: str | None = None  # reduction: array[index] = combine(array[index], body)
    label: str = ""  # the graph op it comes from: a readable name, never a decision
    reduction_iters: tuple[str, ...] = ()
    extra: str = ""  # further isl constraints on the domain
    library: "Any" = None  # a vendor library call (polyjit.library.Gemm) over boxes of its arrays
    role: Role = Role.ASSIGN
    contraction: bool = False  # the init or update of a product (dot_general, conv)

    @property
    def points(self) -> int | None:
        """Its loops' iteration count where the sizes are static, else None."""
        return sz.static_product(hi - lo for lo, hi in self.bounds)

    def domain_constraints(self) -> str:
        cs = [f"{sz.isl_str(lo)} <= {i} < {sz.isl_str(hi)}" for i, (lo, hi) in zip(self.iters, self.bounds)]
        if self.extra:
            cs.append(self.extra)
        return " and ".join(cs)

    def __str__(self) -> str:
        lhs = f"{self.array}[{', '.join(map(str, self.index))}]"
        op = "=" if self.combine is None else f"{self.combine}="
        return f"{self.name}[{', '.join(self.iters)}] : {self.domain_constraints() or 'true'}\n    {lhs} {op} {self.body}"


def loop_nest(shape, prefix: str = "i") -> tuple[tuple[str, ...], tuple[Expr, ...], tuple[tuple[Size, Size], ...]]:
    """A statement's loops over every point of shape: its iterators
    (prefix0, prefix1, ...), their expressions and their bounds (0, size)."""
    iters = tuple(f"{prefix}{d}" for d in range(len(shape)))
    return iters, tuple(it(i) for i in iters), tuple((0, s) for s in shape)


@dataclass
class AffineProgram:
    params: list[str]
    arrays: dict[str, Array]
    statements: list[Statement]
    outputs: list[str]  # array names, one per graph output
    constraints: list[tuple[Size, Size]] = field(default_factory=list)
    inlined: int = 0

    def prefix(self) -> str:
        return f"[{', '.join(self.params)}] -> "

    def domain(self, ctx: isl.Context) -> isl.UnionSet:
        parts = []
        for s in self.statements:
            c = s.domain_constraints()
            parts.append(f"{s.name}[{', '.join(s.iters)}]" + (f" : {c}" if c else ""))
        text = self.prefix() + "{ " + "; ".join(parts) + " }"
        dom = isl.UnionSet.read_from_str(ctx, text)
        if self.params:
            ctxc = sz.param_context(self.params, derived=False)
            dom = dom.intersect_params(isl.Set.read_from_str(ctx, self.prefix() + "{ : " + ctxc + " }"))
        return dom

    def access(self, ctx: isl.Context, s: Statement, array: str, index) -> isl.UnionMap:
        """{ S[iters] -> A[index] }, each non-affine dimension widened to its
        extent; over every value of the iterators, not only s's domain (the
        caller intersects with the domains): parsing the domain's constraints
        with each access took longer than the rest of the parse, most with a
        window's clamped indices."""
        arr = self.arrays[array]
        outs, cons = [], []
        for d, e in enumerate(index):
            t = to_isl(e)
            v = f"a{d}"
            outs.append(v)
            if t is not None:
                cons.append(f"{v} = {t}")
            else:
                cons.append(f"0 <= {v} < {sz.isl_str(arr.shape[d])}")
        text = (self.prefix() + f"{{ {s.name}[{', '.join(s.iters)}] -> {array}[{', '.join(outs)}]"
                + (f" : {' and '.join(cons)}" if cons else "") + " }")
        return isl.UnionMap.read_from_str(ctx, text)

    def box_access(self, ctx: isl.Context, s: Statement, array: str, start, extents) -> isl.UnionMap:
        """{ S[iters] -> A[a] : start <= a < start + extents }: what a library call reads or writes."""
        outs = [f"a{d}" for d in range(len(start))]
        cons = [s.domain_constraints()] if s.domain_constraints() else []
        for v, e, n in zip(outs, start, extents):
            cons.append(f"{to_isl(e)} <= {v} < {to_isl(e)} + {sz.isl_str(n)}")
        text = (self.prefix() + f"{{ {s.name}[{', '.join(s.iters)}] -> {array}[{', '.join(outs)}]"
                + f" : {' and '.join(cons)} }}")
        return isl.UnionMap.read_from_str(ctx, text)

    def writes(self, ctx: isl.Context) -> tuple[isl.UnionMap, isl.UnionMap]:
        """(must-writes, may-writes): a non-affine written index is only a
        may-write; like ``access``, not yet within the statements' domains."""
        must = isl.UnionMap.empty(isl.Space.params_alloc(ctx, 0))
        may = must
        for s in self.statements:
            if s.library is not None:
                m = self.box_access(ctx, s, *s.library.written())
                must, may = must.union(m), may.union(m)
                continue
            m = self.access(ctx, s, s.array, s.index)
            if all(to_isl(e) is not None for e in s.index):
                must = must.union(m)
            may = may.union(m)
        return must, may

    def reads(self, ctx: isl.Context) -> isl.UnionMap:
        r = isl.UnionMap.empty(isl.Space.params_alloc(ctx, 0))
        for s in self.statements:
            if s.library is not None:
                for box in s.library.read():
                    r = r.union(self.box_access(ctx, s, *box))
                continue
            forms: dict[str, list[tuple[Expr, ...]]] = {}
            for ld in self.statement_loads(s):
                if ld.index not in forms.setdefault(ld.array, []):
                    forms[ld.array].append(ld.index)
            for array, indices in forms.items():
                window = _window(s, indices) if len(indices) > 1 else None
                if window is not None:
                    r = r.union(isl.UnionMap.read_from_str(ctx, self.prefix() + f"{{ {s.name}[{', '.join(s.iters)}] -> "
                                                           f"{array}[{', '.join(f'a{d}' for d in range(len(window)))}]"
                                                           f" : {' and '.join(window)} }}"))
                    continue
                seen = set()  # each access once as isl sees it
                for index in indices:
                    form = tuple(map(to_isl, index))
                    if form not in seen:
                        seen.add(form)
                        r = r.union(self.access(ctx, s, array, index))
        return r

    def statement_loads(self, s: Statement) -> list[Load]:
        """What s reads: its body's loads, those its write position reads (a
        scatter's index), and its own target when it accumulates."""
        if s.library is not None:
            return [Load(self.arrays[a].dtype, a, tuple(start)) for a, start, _ in s.library.read()]
        out = loads(s.body) + [ld for i in s.index for ld in loads(i)]
        if s.combine is not None:
            out.append(Load(self.arrays[s.array].dtype, s.array, s.index))
        return out

    def __str__(self) -> str:
        lines = [f"params: {', '.join(self.params) or '-'}"]
        lines += [f"  {a}" for a in self.arrays.values()]
        lines += [str(s) for s in self.statements]
        lines.append("outputs: " + ", ".join(self.outputs))
        return "\n".join(lines)


def _window(s: Statement, indices: list[tuple[Expr, ...]]) -> list[str] | None:
    """The constraints of one relation holding every tap of a window that
    s reads through clamped indices, min(max(x + k, lo), hi) for constant
    taps k, on each dimension: lo <= a <= hi and x + min k <= a <= x + max k,
    where the tap bounds hold over s's loops (isl's relation of the taps,
    each clamp in pieces, was most of a depthwise group's dependence
    analysis, and their union reaches no further). None where the indices
    are not such a window or its bounds are not proven."""
    ranges = {i: (int(lo), int(hi) - 1) for i, (lo, hi) in zip(s.iters, s.bounds)
              if sz.is_static(lo) and sz.is_static(hi)}
    out = []
    for d, dim in enumerate(zip(*indices)):
        if all(e == dim[0] for e in dim):
            t = to_isl(dim[0])
            if t is None:
                return None
            out.append(f"a{d} = {t}")
            continue
        clamps = [clamp_parts(e) for e in dim]
        if any(c is None for c in clamps) or len({(x, lo, hi) for x, _, lo, hi in clamps}) != 1:
            return None
        x, _, lo, hi = clamps[0]
        taps = [k for _, k, _, _ in clamps]
        span, t = _interval(x, ranges), to_isl(x)
        if span is None or t is None or span[1] + min(taps) > hi or span[0] + max(taps) < lo:
            return None
        out.append(f"{lo} <= a{d} <= {hi} and {t} + ({min(taps)}) <= a{d} <= {t} + ({max(taps)})")
    return out


def _interval(e: Expr, ranges: dict[str, tuple[int, int]]) -> tuple[int, int] | None:
    """The least and greatest values of an affine index over the iterators' ranges, or None."""
    if isinstance(e, Const):
        return (int(e.value), int(e.value)) if e.dtype.is_int else None
    if isinstance(e, Var):
        return ranges.get(e.name) if e.kind == "iter" else None
    if not isinstance(e, Op) or e.op not in ("add", "sub", "mul"):
        return None
    a, b = (_interval(x, ranges) for x in e.args)
    if a is None or b is None:
        return None
    if e.op == "add":
        return a[0] + b[0], a[1] + b[1]
    if e.op == "sub":
        return a[0] - b[1], a[1] - b[0]
    products = [p * q for p in a for q in b]
    return min(products), max(products)
