"""Tensor sizes: integers, or affine expressions of symbolic size parameters.

Symbolic sizes become isl parameters, so one compiled program serves every
size. Sums and integer multiples stay affine; a product of two symbolic sizes
is a parameter of its own, derived from its factors at each call (a batch
and a sequence merged, [b, s, e] as [b*s, e]); so is the floor of a quotient
by a number (a strided window's output size, (s - 1) // 2 + 1), of which isl
learns how it bounds the others.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Union

_DERIVED: dict[str, tuple["Lin", int]] = {}  # parameter -> (numerator, divisor): floor(numerator / divisor)
_PRODUCTS: dict[str, tuple["Lin", "Lin"]] = {}  # parameter -> its two factors


@dataclass(frozen=True)
class Lin:
    """const + sum(coeff * param), with params as sorted (name, coeff) pairs."""

    terms: tuple[tuple[str, int], ...]
    const: int = 0

    @staticmethod
    def param(name: str) -> "Lin":
        return Lin(((name, 1),), 0)

    def __add__(self, other: "Size") -> "Size":
        o = as_lin(other)
        d = dict(self.terms)
        for n, c in o.terms:
            d[n] = d.get(n, 0) + c
        return _make(d, self.const + o.const)

    __radd__ = __add__

    def __neg__(self) -> "Size":
        return _make({n: -c for n, c in self.terms}, -self.const)

    def __sub__(self, other: "Size") -> "Size":
        return self + (-as_lin(other))

    def __rsub__(self, other: "Size") -> "Size":
        return as_lin(other) - self

    def __mul__(self, k: "Size") -> "Size":
        if isinstance(k, Lin):
            return _product_param(self, k)
        return _make({n: c * k for n, c in self.terms}, self.const * k)

    __rmul__ = __mul__

    def __floordiv__(self, k: "Size") -> "Size":
        """floor(self / k) for a positive number k: exact where every
        coefficient divides, else a derived parameter."""
        if isinstance(k, Lin) or int(k) <= 0:
            raise _not_affine(f"the size ({self}) // {k} is not affine in the symbolic sizes")
        k = int(k)
        if all(c < 0 for _, c in self.terms):  # a negative quotient: minus that of a size
            return -((-self + (k - 1)) // k)
        if all(c % k == 0 for _, c in self.terms):
            return _make({n: c // k for n, c in self.terms}, self.const // k)
        base = re.sub(r"[^A-Za-z0-9_]", "", str(self).replace(" - ", "_m").replace(" + ", "_p")
                      .replace("*", "x").replace("-", "m")) + f"_div{k}"
        name, n = base, 1
        while _DERIVED.setdefault(name, (self, k)) != (self, k):  # a name another quotient took
            name, n = f"{base}_{n}", n + 1
        return Lin.param(name)

    def params(self) -> set[str]:
        return {n for n, _ in self.terms}

    def base_params(self) -> set[str]:
        """The parameters this size depends on, derived ones replaced by theirs."""
        out: set[str] = set()
        for n, _ in self.terms:
            if n in _PRODUCTS:
                out |= _PRODUCTS[n][0].base_params() | _PRODUCTS[n][1].base_params()
            else:
                out |= _DERIVED[n][0].base_params() if n in _DERIVED else {n}
        return out

    def evaluate(self, env: Mapping[str, int]) -> int:
        return self.const + sum(c * _value(n, env) for n, c in self.terms)

    def rename(self, mapping: Mapping[str, str]) -> "Size":
        out: Size = self.const
        for n, c in self.terms:
            if n in _DERIVED:  # a quotient of renamed sizes
                num, k = _DERIVED[n]
                out = out + c * (num.rename(mapping) // k)
            elif n in _PRODUCTS:
                a, b = _PRODUCTS[n]
                out = out + c * (a.rename(mapping) * b.rename(mapping))
            else:
                out = out + c * Lin.param(mapping.get(n, n))
        return out

    def __str__(self) -> str:
        parts = [(f"{c}*{n}" if c != 1 else n) for n, c in self.terms]
        if self.const or not parts:
            parts.append(str(self.const))
        return " + ".join(parts).replace("+ -", "- ")

    __repr__ = __str__


Size = Union[int, Lin]


def _make(d: dict, const: int) -> Size:
    terms = tuple(sorted((n, c) for n, c in d.items() if c != 0))
    return Lin(terms, const) if terms else const


def _product_param(a: "Lin", b: "Lin") -> "Size":
    """a * b for two symbolic sizes: their static factors times a parameter
    standing for the product of the rest (4*s * t is 4 * p, p = s*t)."""
    (ca, a), (cb, b) = _content(a), _content(b)
    a, b = sorted((a, b), key=str)
    base = "x".join(re.sub(r"[^A-Za-z0-9_]", "", str(f).replace(" + ", "_p").replace(" - ", "_m")) for f in (a, b))
    name, n = f"{base}_mul", 1
    while _PRODUCTS.setdefault(name, (a, b)) != (a, b):  # a name another product took
        name, n = f"{base}_mul_{n}", n + 1
    return Lin(((name, ca * cb),), 0)


def static_factor(s: Size) -> int:
    """The largest number dividing s at every size (4*s + 8: 4; 6: 6)."""
    return int(s) if not isinstance(s, Lin) else _content(s)[0]


def _content(s: "Lin") -> tuple[int, "Lin"]:
    """(k, s / k) for the largest k dividing every coefficient of s and its constant."""
    import math
    k = math.gcd(s.const, *(c for _, c in s.terms))
    return k, _make({n: c // k for n, c in s.terms}, s.const // k)


def windows(span: Size, stride: int) -> Size:
    """How many windows a stride places where span = the padded extent minus
    the window's own (dilated) extent: span // stride + 1, at least 0 when known."""
    return span // stride + 1 if isinstance(span, Lin) else max(0, int(span) // stride + 1)


def _not_affine(what: str) -> Exception:
    """The error for a size outside affine expressions: frontends run such a
    graph in the framework (a counted fallback) unless strict."""
    from .errors import UnsupportedOpError
    return UnsupportedOpError(what + "; compile with static sizes")


def _value(name: str, env: Mapping[str, int]) -> int:
    if name in env or not is_derived(name):
        return env[name]
    if name in _PRODUCTS:
        a, b = _PRODUCTS[name]
        return a.evaluate(env) * b.evaluate(env)
    num, k = _DERIVED[name]
    return num.evaluate(env) // k


def definitions(params) -> dict[str, tuple]:
    """What the derived parameters among params (and those their
    definitions name) stand for: name -> ("div", numerator, k) or ("mul",
    a, b), so that another process can define them (define)."""
    out: dict[str, tuple] = {}
    todo = list(params)
    while todo:
        p = todo.pop()
        if p in out or not is_derived(p):
            continue
        out[p] = ("div", *_DERIVED[p]) if p in _DERIVED else ("mul", *_PRODUCTS[p])
        todo.extend(n for part in out[p][1:] if isinstance(part, Lin) for n in part.params())
    return out


def define(name: str, kind: str, a: "Size", b: "Size") -> bool:
    """Define derived parameter name as definitions() gave it; False where
    this process already has that name standing for something else."""
    table, other, value = (_DERIVED, _PRODUCTS, (a, int(b))) if kind == "div" else (_PRODUCTS, _DERIVED, (a, b))
    return name not in other and table.setdefault(name, value) == value


def is_derived(name: str) -> bool:
    """Whether parameter name stands for a quotient or a product of others (computed, never solved for)."""
    return name in _DERIVED or name in _PRODUCTS


def with_derived(env: dict[str, int], params) -> dict[str, int]:
    """env with the values of the derived parameters among params."""
    for p in params:
        if is_derived(p) and p not in env:
            try:
                env[p] = _value(p, env)
            except KeyError:  # (a term no input gives: the caller's check names the dimension)
                pass
    return env


NOMINAL = 64  # a symbolic size's value for cost models (a batch, a sequence): never for code


def estimate(s: Size) -> int:
    """s at NOMINAL for every base parameter, products and quotients
    derived from those: what a cost model weighs where sizes are symbolic."""
    return evaluate(s, {p: NOMINAL for p in as_lin(s).base_params()})


def unsolved(shapes) -> set[str]:
    """The parameters that shapes (the inputs') use but that no dimension
    gives alone, as c * p + k (a product's factors, where only the product
    is a dimension): a call could not tell their values."""
    used, alone = set(), set()
    for shape in shapes:
        for s in shape:
            if isinstance(s, Lin):
                used |= s.base_params()
                if len(s.terms) == 1 and not is_derived(s.terms[0][0]):
                    alone.add(s.terms[0][0])
    return used - alone


def param_context(params, derived: bool = True) -> str:
    """isl constraints on params: sizes are not negative, and (derived) a
    derived parameter q = floor(n / k) satisfies k*q <= n <= k*q + k - 1
    (a quotient's own sign follows from n's: ``(-n) // 2`` is negative)."""
    out = [f"{p} >= 0" for p in params if p not in _DERIVED]  # (a product of sizes is one too)
    for p in params if derived else ():
        if p in _DERIVED:
            num, k = _DERIVED[p]
            if num.base_params() <= set(params) and num.params() <= set(params):
                out.append(f"{k}*{p} <= {num} <= {k}*{p} + {k - 1}")
    return " and ".join(out) or "1 = 1"


def as_lin(s: Size) -> Lin:
    return s if isinstance(s, Lin) else Lin((), int(s))


def is_static(s: Size) -> bool:
    return not isinstance(s, Lin)


def evaluate(s: Size, env: Mapping[str, int]) -> int:
    return s.evaluate(env) if isinstance(s, Lin) else int(s)


def rename(s: Size, mapping: Mapping[str, str]) -> Size:
    return s.rename(mapping) if isinstance(s, Lin) else s


def product(sizes) -> Size:
    out: Size = 1
    for s in sizes:
        out = s * out if isinstance(s, Lin) else out * s
    return out


def quotient(total, part) -> Size | None:
    """The size q with product(part) * q == product(total) (a reshape's -1),
    or None if there is none that is affine. Each size splits into a static
    factor and a symbolic one (8*s -> 8, s); the symbolic factors of part
    cancel against those of total, and the static factors divide."""
    def split(sizes):
        static, symbolic = 1, []
        for s in sizes:
            if not isinstance(s, Lin):
                static *= int(s)
            elif len(s.terms) == 1 and s.const == 0:
                static *= s.terms[0][1]
                symbolic.append(Lin.param(s.terms[0][0]))
            else:
                symbolic.append(s)
        return static, symbolic
    t_static, t_sym = split(total)
    p_static, p_sym = split(part)
    for s in p_sym:
        if s not in t_sym:
            return None
        t_sym.remove(s)
    if p_static == 0 or t_static % p_static:
        return None
    return product(t_sym + [t_static // p_static])


def static_product(sizes) -> int | None:
    """The product of sizes if all are static, else None."""
    out = 1
    for s in sizes:
        if isinstance(s, Lin):
            return None
        out *= int(s)
    return out


def isl_str(s: Size) -> str:
    return str(s) if isinstance(s, Lin) else str(int(s))


def row_major(shape) -> tuple[int, ...]:
    """Element strides of a row-major array of this (concrete) shape."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(out[::-1])
