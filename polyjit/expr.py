"""Scalar expressions: statement bodies and array index functions.

Index expressions are int64 trees of iterators, parameters and constants;
the affine (and quasi-affine: floor division and modulo by constants) ones
convert to isl syntax, the others (gathers) over-approximate to the whole
array dimension in access relations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from .dtypes import DataType
from .sizes import Lin, Size

I64 = DataType.Int


@dataclass(frozen=True)
class Expr:
    dtype: DataType


@dataclass(frozen=True)
class Const(Expr):
    value: object

    def __str__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True)
class Var(Expr):
    """A loop iterator (kind 'iter') or a size parameter (kind 'param')."""

    name: str
    kind: str = "iter"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Load(Expr):
    array: str
    index: tuple[Expr, ...]

    def __str__(self) -> str:
        return f"{self.array}[{', '.join(map(str, self.index))}]"


@dataclass(frozen=True)
class Op(Expr):
    """An operation: the graph's elementwise ops plus 'select', 'cast', 'rand',
    'floordiv', 'mod', 'min', 'max' on indices."""

    op: str
    args: tuple[Expr, ...]

    def __str__(self) -> str:
        if self.op in _INFIX and len(self.args) == 2:
            return f"({self.args[0]} {_INFIX[self.op]} {self.args[1]})"
        if self.op == "cast":
            return f"({self.dtype}){self.args[0]}"
        return f"{self.op}({', '.join(map(str, self.args))})"


_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%",
          "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "logical_and": "&&", "logical_or": "||"}


def const(v, dtype: DataType = I64) -> Const:
    return Const(dtype, v)


def it(name: str) -> Var:
    return Var(I64, name, "iter")


def size_expr(s: Size) -> Expr:
    """An index expression for a (possibly symbolic) size."""
    if not isinstance(s, Lin):
        return const(int(s))
    e: Expr = const(s.const)
    for n, c in s.terms:
        e = iadd(e, imul(Var(I64, n, "param"), c))
    return e


def _divmod_parts(a: Expr, b: Expr):
    """x when a = (x // k) * k and b = x % k (k a number or a symbolic size)."""
    if isinstance(a, Op) and a.op == "mul" and isinstance(b, Op) and b.op == "mod" and a.args[1] == b.args[1]:
        q = a.args[0]
        if isinstance(q, Op) and q.op == "floordiv" and q.args[1] == b.args[1] and q.args[0] == b.args[0]:
            return b.args[0]
    return None


def iadd(a: Expr, b: Expr) -> Expr:
    x = _divmod_parts(a, b)
    if x is not None:  # (x // k) * k + x % k == x: reshapes that undo each other
        return x
    if isinstance(a, Const) and isinstance(b, Const):
        return const(a.value + b.value)
    if isinstance(b, Const) and b.value == 0:
        return a
    if isinstance(a, Const) and a.value == 0:
        return b
    if isinstance(b, Const) and b.value < 0:
        return Op(I64, "sub", (a, const(-b.value)))
    return Op(I64, "add", (a, b))


def isub(a: Expr, b: Expr) -> Expr:
    if isinstance(b, Const):
        return iadd(a, const(-b.value))
    if isinstance(a, Const) and isinstance(b, Const):
        return const(a.value - b.value)
    return Op(I64, "sub", (a, b))


def imul(a: Expr, k) -> Expr:
    if isinstance(k, Expr):
        if isinstance(k, Const):
            k = k.value
        else:
            return Op(I64, "mul", (a, k))
    if k == 0:
        return const(0)
    if k == 1:
        return a
    if isinstance(a, Const):
        return const(a.value * k)
    return Op(I64, "mul", (a, const(k)))


def ifloordiv(a: Expr, k: int) -> Expr:
    if k == 1:
        return a
    if isinstance(a, Const):
        return const(a.value // k)
    return Op(I64, "floordiv", (a, const(k)))


def imod(a: Expr, k: int) -> Expr:
    if k == 1:
        return const(0)
    if isinstance(a, Const):
        return const(a.value % k)
    return Op(I64, "mod", (a, const(k)))


def merged_index(index, shape) -> list[tuple[Expr, int]]:
    """A row-major array's index as (expression, dimension whose stride it
    takes): where a position x was split over dimensions (..., m, k) as
    (x // k, x % k), or ((x // k) % m, x % k), the run is x, or x % (m k),
    again, at the inner dimension's stride, since (x // k) k + x % k = x
    for floored division (a product writing an image's flattened positions
    stores along memory)."""
    def divmod_of(e, name):
        return e.args if isinstance(e, Op) and e.op == name and isinstance(e.args[1], Const) else (None, None)

    if not index:
        return []
    out: list[tuple[Expr, int]] = []
    cur, at, span = index[-1], len(index) - 1, shape[-1]
    for d in range(len(index) - 2, -1, -1):
        e, ext = index[d], shape[d]
        x, k = divmod_of(cur, "mod")
        if x is not None and isinstance(span, int) and k.value == span:
            q, m = divmod_of(e, "mod")
            if e == Op(I64, "floordiv", (x, k)):
                cur, span = x, None
                continue
            if q == Op(I64, "floordiv", (x, k)) and isinstance(ext, int) and m.value == ext:
                cur, span = imod(x, span * ext), span * ext
                continue
        out.append((cur, at))
        cur, at, span = e, d, ext
    out.append((cur, at))
    return out


def iclamp(a: Expr, lo: Expr, hi: Expr) -> Expr:
    """min(max(a, lo), hi): keeps a guarded load inside its array."""
    return Op(I64, "min", (Op(I64, "max", (a, lo)), hi))


def clamp_parts(e: Expr) -> tuple[Expr, int, int, int] | None:
    """(x, k, lo, hi) where e is iclamp(x + k, lo, hi) for constants k and lo <= hi, else None."""
    if not (isinstance(e, Op) and e.op == "min" and isinstance(e.args[1], Const)):
        return None
    inner = e.args[0]
    if not (isinstance(inner, Op) and inner.op == "max" and isinstance(inner.args[1], Const)):
        return None
    lo, hi = int(inner.args[1].value), int(e.args[1].value)
    x, k = offset(inner.args[0])
    return (x, k, lo, hi) if lo <= hi else None


def walk(e: Expr) -> Iterator[Expr]:
    yield e
    if isinstance(e, Load):
        for i in e.index:
            yield from walk(i)
    elif isinstance(e, Op):
        for a in e.args:
            yield from walk(a)


def iter_vars(e: Expr) -> set[str]:
    """The statement iterators e reads."""
    return {x.name for x in walk(e) if isinstance(x, Var) and x.kind == "iter"}


def moves_by_one(e: Expr, name: str) -> bool:
    """Whether index e is iterator name plus or minus terms without it (it
    moves by one as the iterator does)."""
    if isinstance(e, Var):
        return e.name == name and e.kind == "iter"
    if not isinstance(e, Op) or e.op not in ("add", "sub"):
        return False
    a, b = e.args
    return (moves_by_one(a, name) and name not in iter_vars(b)) or \
        (e.op == "add" and moves_by_one(b, name) and name not in iter_vars(a))


def loads(e: Expr) -> list[Load]:
    return [x for x in walk(e) if isinstance(x, Load)]


def data_loads(e: Expr) -> list[Load]:
    """The loads of e but those inside another load's index (a gather's indices)."""
    if isinstance(e, Load):
        return [e]
    return [ld for a in e.args for ld in data_loads(a)] if isinstance(e, Op) else []


def substitute(e: Expr, f: Callable[[Expr], Expr | None]) -> Expr:
    """Rebuild e bottom-up, replacing the nodes for which f returns an Expr."""
    r = f(e)
    if r is not None:
        return r
    if isinstance(e, Load):
        return Load(e.dtype, e.array, tuple(substitute(i, f) for i in e.index))
    if isinstance(e, Op):
        return Op(e.dtype, e.op, tuple(substitute(a, f) for a in e.args))
    return e


def to_isl(e: Expr) -> str | None:
    """isl syntax for a quasi-affine index expression, or None."""
    if isinstance(e, Const):  # a float constant belongs to data (a computed scatter position), not to an index
        return str(int(e.value)) if e.dtype.is_int else None
    if isinstance(e, Var):
        return e.name
    if not isinstance(e, Op):
        return None
    a = [to_isl(x) for x in e.args]
    if any(x is None for x in a) or e.op not in _ISL:
        return None
    return _ISL[e.op](e, a)


def _isl_mul(e: Op, a: list[str]) -> str | None:
    if isinstance(e.args[1], Const):
        return f"({a[1]} * {a[0]})"
    if isinstance(e.args[0], Const):
        return f"({a[0]} * {a[1]})"
    return None


def _by_constant(fmt: str) -> Callable[[Op, list[str]], str | None]:
    return lambda e, a: fmt.format(*a) if isinstance(e.args[1], Const) else None


_ISL: dict[str, Callable[[Op, list[str]], str | None]] = {
    "add": lambda e, a: f"({a[0]} + {a[1]})", "sub": lambda e, a: f"({a[0]} - {a[1]})", "mul": _isl_mul,
    "floordiv": _by_constant("floor(({}) / {})"), "mod": _by_constant("(({}) mod {})"),
    "min": lambda e, a: f"min({a[0]}, {a[1]})", "max": lambda e, a: f"max({a[0]}, {a[1]})"}
QUASI_AFFINE = ("floordiv", "mod")  # division by a constant: a reshape's index arithmetic


def offset(e: Expr) -> tuple[Expr, int]:
    """(x, k) where e is x + k or x - k for a constant k, else (e, 0)."""
    if isinstance(e, Op) and e.op in _SIGN and isinstance(e.args[1], Const):
        return e.args[0], int(e.args[1].value) * _SIGN[e.op]
    return e, 0


_SIGN = {"add": 1, "sub": -1}


def select_parts(e: Expr) -> tuple[Expr, Expr, Expr] | None:
    """(condition, then, else) where e is a select, else None."""
    return e.args if isinstance(e, Op) and e.op == "select" else None

