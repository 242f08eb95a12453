"""What each elementwise op means, said once.

One entry per scalar op: its arity, how it treats its operands' types, what
it costs, and, where a closed form in other ops exists, its decomposition.
Every layer reads this table and no other list of op names: the graph
checks operands and result types by the op's `kind`, lowering weighs
recomputation by its `cost`, polyjit.ops makes a function for each public
entry, and a target's emitter either has a native form for (op, dtype) or
emits the decomposition written here. Reductions' combining op and
identity live here too.

Kinds: ``same`` (the operands' promoted type), ``float`` (integers are
computed as float32), ``bits`` (integers only), ``predicate`` (a bool of
one operand of any type), ``logical`` (operands read as bools, a bool
result), ``compare`` (a bool from two promoted operands).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from .dtypes import DataType
from .expr import Const, Expr, Op


@dataclass(frozen=True)
class ScalarOp:
    name: str
    arity: int
    kind: str = "same"
    cost: int = 1  # rough work, against a load's 1: whether to recompute or store
    libm: bool = False  # the C math library has it (erf, erff): a host's native form
    decompose: Callable[..., Expr] | None = None  # the op in other ops, for targets without it
    public: bool = True  # a graph op (False: an emitter's building block for decompositions)

    @property
    def result_bool(self) -> bool:
        return self.kind in ("predicate", "logical", "compare")


def _op(name: str, *args: Expr) -> Op:
    return Op(DataType.Bool if OPS[name].result_bool else args[0].dtype, name, args)


def _c(v: float, like: Expr) -> Const:
    return Const(like.dtype, v)


def _select(cond: Expr, a: Expr, b: Expr) -> Op:
    return Op(a.dtype, "select", (cond, a, b))


def _poly(x: Expr, coeffs) -> Expr:
    acc: Expr = _c(coeffs[0], x)
    for k in coeffs[1:]:
        acc = _op("fma", acc, x, _c(k, x))
    return acc


# --------------------------------------------------------- decompositions
def _log1p(x: Expr) -> Expr:
    """log(1 + x) with Kahan's correction for the rounding of 1 + x."""
    u = _op("add", _c(1.0, x), x)
    r = _op("mul", _op("log", u), _op("div", x, _op("sub", u, _c(1.0, x))))
    r = _select(_op("eq", u, _c(1.0, x)), x, r)
    return _select(_op("eq", x, _c(math.inf, x)), x, r)


def _expm1(x: Expr) -> Expr:
    """exp(x) - 1, corrected by x / log(exp(x)) (Kahan) near zero."""
    u = _op("exp", x)
    um1 = _op("sub", u, _c(1.0, x))
    r = _op("div", _op("mul", um1, x), _op("log", u))
    r = _select(_op("eq", um1, _c(-1.0, x)), um1, r)
    r = _select(_op("eq", u, _c(math.inf, x)), u, r)
    return _select(_op("eq", u, _c(1.0, x)), x, r)


def _logaddexp(a: Expr, b: Expr) -> Expr:
    """log(e^a + e^b) from the larger: equal arguments (infinities too)
    give a + log 2, a NaN gives NaN."""
    big = _op("maximum", a, b)
    r = _op("add", big, _op("log1p", _op("exp", _op("neg", _op("abs", _op("sub", a, b))))))
    return _select(_op("eq", a, b), _op("add", a, _c(math.log(2.0), a)), r)


def _pow(x: Expr, y: Expr) -> Expr:
    """exp(y log|x|), with the sign of an odd integer power (of -0.0 too) and
    C's special cases: NaN for a finite negative base and a non-integer
    exponent, 1 for y = 0, x = 1 and x = -1 with y infinite."""
    mag = _op("exp", _op("mul", y, _op("log", _op("abs", x))))
    yint = _op("eq", _op("floor", y), y)
    half = _op("mul", y, _c(0.5, y))
    odd = _op("logical_and", yint, _op("ne", _op("floor", half), half))
    r = _select(_op("logical_and", _op("signbit", x), odd), _op("neg", mag), mag)
    finite_neg = _op("logical_and", _op("lt", x, _c(0.0, x)), _op("isfinite", x))
    r = _select(_op("logical_and", finite_neg, _op("logical_not", yint)), _c(math.nan, x), r)
    one = _op("logical_or", _op("eq", y, _c(0.0, y)), _op("eq", x, _c(1.0, x)))
    one = _op("logical_or", one, _op("logical_and", _op("eq", x, _c(-1.0, x)), _op("isinf", y)))
    return _select(one, _c(1.0, x), r)


def _atan2(y: Expr, x: Expr) -> Expr:
    """Cephes' atanf on min/max of |y|, |x| (in [0, 1], reduced by pi/4 when
    over tan(pi/8)), then moved to its quadrant."""
    ax, ay = _op("abs", x), _op("abs", y)
    hi, lo = _op("maximum", ax, ay), _op("minimum", ax, ay)
    a = _op("div", lo, hi)
    a = _select(_op("eq", hi, _c(0.0, x)), _c(0.0, x), a)
    a = _select(_op("eq", lo, _c(math.inf, x)), _c(1.0, x), a)
    big = _op("gt", a, _c(0.4142135623730950, x))
    r = _select(big, _op("div", _op("sub", a, _c(1.0, x)), _op("add", a, _c(1.0, x))), a)
    z = _op("mul", r, r)
    p = _poly(z, [8.05374449538e-2, -1.38776856032e-1, 1.99777106478e-1, -3.33329491539e-1])
    r = _op("fma", _op("mul", p, z), r, r)
    r = _select(big, _op("add", r, _c(math.pi / 4, x)), r)
    r = _select(_op("gt", ay, ax), _op("sub", _c(math.pi / 2, x), r), r)
    r = _select(_op("signbit", x), _op("sub", _c(math.pi, x), r), r)
    r = _op("copysign", r, y)
    return _select(_op("logical_or", _op("isnan", x), _op("isnan", y)), _op("add", x, y), r)


def _erfc(x: Expr) -> Expr:
    """1 - erf(x) with relative accuracy in the tail (Numerical Recipes'
    erfcc, a Chebyshev fit with fractional error under 1.2e-7): t = 1/(1 +
    z/2), z = |x|, erfc(z) = t exp(-z^2 + P(t)); erfc(-z) = 2 - erfc(z)."""
    z = _op("abs", x)
    t = _op("div", _c(1.0, x), _op("fma", z, _c(0.5, x), _c(1.0, x)))
    p = _poly(t, [0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806,
                  0.09678418, 0.37409196, 1.00002368, -1.26551223])
    r = _op("mul", t, _op("exp", _op("sub", p, _op("mul", z, z))))
    return _select(_op("lt", x, _c(0.0, x)), _op("sub", _c(2.0, x), r), r)


# ------------------------------------------------------------------ table
_TABLE = [
    # arithmetic
    ScalarOp("add", 2), ScalarOp("sub", 2), ScalarOp("mul", 2),
    ScalarOp("div", 2, "float", cost=4),
    ScalarOp("neg", 1), ScalarOp("abs", 1), ScalarOp("sign", 1), ScalarOp("relu", 1),
    ScalarOp("maximum", 2), ScalarOp("minimum", 2),
    ScalarOp("remainder", 2, cost=4), ScalarOp("fmod", 2, cost=4),
    ScalarOp("floor_divide", 2, cost=8), ScalarOp("trunc_divide", 2, cost=4),
    ScalarOp("floor", 1), ScalarOp("ceil", 1), ScalarOp("round", 1),
    ScalarOp("pow", 2, cost=16, decompose=_pow),
    # transcendental
    ScalarOp("exp", 1, "float", cost=8), ScalarOp("log", 1, "float", cost=8),
    ScalarOp("log1p", 1, "float", cost=10, libm=True, decompose=_log1p),
    ScalarOp("expm1", 1, "float", cost=10, libm=True, decompose=_expm1),
    ScalarOp("sqrt", 1, "float", cost=4), ScalarOp("rsqrt", 1, "float", cost=4),
    ScalarOp("reciprocal", 1, "float"),
    ScalarOp("sin", 1, "float", cost=10), ScalarOp("cos", 1, "float", cost=10),
    ScalarOp("tan", 1, "float", cost=14, libm=True), ScalarOp("tanh", 1, "float", cost=12, libm=True),
    ScalarOp("atan2", 2, "float", cost=20, libm=True, decompose=_atan2),
    ScalarOp("logaddexp", 2, "float", cost=20, decompose=_logaddexp),
    ScalarOp("erf", 1, "float", cost=12, libm=True),
    ScalarOp("erfc", 1, "float", cost=14, libm=True, decompose=_erfc),
    ScalarOp("erf_inv", 1, "float"),
    ScalarOp("sigmoid", 1, "float", cost=10),
    # predicates, comparisons, logic
    ScalarOp("isnan", 1, "predicate"), ScalarOp("isinf", 1, "predicate"), ScalarOp("isfinite", 1, "predicate"),
    *(ScalarOp(c, 2, "compare") for c in ("eq", "ne", "lt", "le", "gt", "ge")),
    ScalarOp("logical_and", 2, "logical"), ScalarOp("logical_or", 2, "logical"),
    ScalarOp("logical_xor", 2, "logical"), ScalarOp("logical_not", 1, "logical"),
    # bits
    ScalarOp("bitwise_and", 2, "bits"), ScalarOp("bitwise_or", 2, "bits"), ScalarOp("bitwise_xor", 2, "bits"),
    ScalarOp("bitwise_not", 1, "bits"), ScalarOp("shift_left", 2, "bits"),
    ScalarOp("shift_right_logical", 2, "bits"), ScalarOp("shift_right_arithmetic", 2, "bits"),
    # building blocks of decompositions (every LLVM target has them)
    ScalarOp("fma", 3, "float", public=False), ScalarOp("copysign", 2, "float", public=False),
    ScalarOp("signbit", 1, "predicate", public=False),
]
OPS: dict[str, ScalarOp] = {op.name: op for op in _TABLE}

UNARY = tuple(o.name for o in _TABLE if o.public and o.arity == 1)
BINARY = tuple(o.name for o in _TABLE if o.public and o.arity == 2)


def cost(op: str) -> int:
    return OPS[op].cost


# ------------------------------------------------------------- reductions
COMBINE = {"sum": "add", "prod": "mul", "max": "maximum", "min": "minimum"}
CUMULATIVE = {**COMBINE, "logsumexp": "logaddexp"}  # running ops (a scan's combine need not be a reduction's)
ARITHMETIC = ("sum", "prod")  # by + and *: a float result depends on the terms' order, an integer grows
WIDENING = ARITHMETIC  # so bool and int32 operands accumulate in int64, halves in float32
FLOAT_CARRIED = (*WIDENING, "logsumexp")  # running ops that carry halves in float32: in half, a long
# running sum stops growing once each term is under half its ulp (3000 x 0.1 summed to 256)
WINDOW_REDUCTIONS = ("sum", "max", "min")  # those reduce_window takes (padding holds their identity)
ARG_REDUCTIONS = {"argmax": "max", "argmin": "min"}  # the first position of the extreme by this reduction


def product_factors(combine: str, body: Expr) -> tuple[Expr, Expr] | None:
    """(x, y) where a reduction by combine of body is a sum of products x * y
    (a contraction), else None."""
    if combine == "sum" and isinstance(body, Op) and body.op == "mul" and len(body.args) == 2:
        return body.args
    return None


def identity(combine: str, dt: DataType):
    """The value a reduction by combine starts from (0, 1, the lowest or highest of dt)."""
    if combine == "sum":
        return 0 if not dt.is_float else 0.0
    if combine == "prod":
        return 1 if not dt.is_float else 1.0
    if combine == "logsumexp":
        return -math.inf
    if dt is DataType.Bool:
        return combine == "min"
    if dt.is_float:
        return -math.inf if combine == "max" else math.inf
    if dt.is_unsigned:
        return 0 if combine == "max" else 2 ** (8 * dt.itemsize) - 1
    bits = 8 * dt.itemsize - 1
    return -(2 ** bits) if combine == "max" else 2 ** bits - 1
