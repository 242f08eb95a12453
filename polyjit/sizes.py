"""Tensor sizes: integers, or affine expressions of symbolic size parameters.

Symbolic sizes become isl parameters, so one compiled program serves every
size. Sums and integer multiples stay affine; a product of two symbolic sizes
does not, and is refused where it would arise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union


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
            raise ValueError(f"the product of symbolic sizes {self} and {k} is not affine")
        return _make({n: c * k for n, c in self.terms}, self.const * k)

    __rmul__ = __mul__

    def __floordiv__(self, k: "Size") -> "Size":
        """Exact division only: floor(s / 2) is not affine in s."""
        if not isinstance(k, Lin) and k and self.const % k == 0 and all(c % k == 0 for _, c in self.terms):
            return _make({n: c // k for n, c in self.terms}, self.const // k)
        from .errors import UnsupportedOpError
        raise UnsupportedOpError(f"the size ({self}) // {k} is not affine in the symbolic sizes; "
                                 "compile with static sizes")

    def params(self) -> set[str]:
        return {n for n, _ in self.terms}

    def evaluate(self, env: Mapping[str, int]) -> int:
        return self.const + sum(c * env[n] for n, c in self.terms)

    def rename(self, mapping: Mapping[str, str]) -> "Size":
        d: dict[str, int] = {}
        for n, c in self.terms:
            m = mapping.get(n, n)
            d[m] = d.get(m, 0) + c
        return _make(d, self.const)

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
        if isinstance(out, Lin) and isinstance(s, Lin):
            raise ValueError(f"the product of symbolic sizes {out} and {s} is not affine")
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
    try:
        return product(t_sym + [t_static // p_static])
    except ValueError:
        return None


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
