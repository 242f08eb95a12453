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
