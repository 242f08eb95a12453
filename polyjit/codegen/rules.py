"""LLVM spellings of the scalar ops, by op and operand class.

`RULES[op][cls]` emits op on operands of class ``float``, ``int`` (signed
integers and bools), ``uint`` or ``any``: a rule takes the emitter, the
operand values, the result type and the operands' type. Math functions go
through the emitter's `math` hook, where a target picks its native form
(a vectorizable kernel, an intrinsic, the C library) or falls back on the
op's decomposition in polyjit.scalar; an op without a rule for its class
has no native form at all and is decomposed the same way. What an op
means (its operand types, its cost) is polyjit.scalar's; this table only
says how it is written in LLVM.
"""
from __future__ import annotations

import math
from typing import Callable

from llvmlite import ir

from ..dtypes import DataType

I1 = ir.IntType(1)

Rule = Callable[..., ir.Value]  # (emitter, operand values, result dtype, operands' dtype)


def operand_class(dt: DataType) -> str:
    """Whose rules an operand of dt takes: bools are unsigned (True is 1,
    greater than False; signed, i1's 1 is -1), with rules of their own first."""
    return "float" if dt.is_float else "uint" if dt.is_unsigned or dt is DataType.Bool else "int"


def _const(v, like) -> ir.Constant:
    return ir.Constant(like.type, v)


# --------------------------------------------------------------- floats
def _sigmoid(e, a, dt, src):
    one = _const(1.0, a[0])
    return e.b.fdiv(one, e.b.fadd(one, e.math("exp", [e.b.fneg(a[0])])))


def _relu(e, a, dt, src):
    zero = _const(0.0, a[0])
    return e.b.select(e.b.fcmp_ordered("<", a[0], zero), zero, a[0])


def _sign(e, a, dt, src):
    b, t, zero = e.b, a[0].type, _const(0.0, a[0])
    pos = b.uitofp(b.fcmp_ordered(">", a[0], zero), t)
    neg = b.uitofp(b.fcmp_ordered("<", a[0], zero), t)
    r = b.fsub(pos, neg)
    return b.select(b.fcmp_unordered("uno", a[0], a[0]), a[0], r)


def _remainder(e, a, dt, src):
    b, zero = e.b, _const(0.0, a[0])
    r = e.frem(*a)
    fix = b.and_(b.fcmp_ordered("!=", r, zero),
                 b.xor(b.fcmp_ordered("<", r, zero), b.fcmp_ordered("<", a[1], zero)))
    return b.select(fix, b.fadd(r, a[1]), r)


def _signbit(e, a, dt, src):
    t = ir.IntType(64 if a[0].type == ir.DoubleType() else 32)
    return e.b.icmp_signed("<", e.b.bitcast(a[0], t), ir.Constant(t, 0))


def _isinf(e, a, dt, src):
    return e.b.fcmp_ordered("==", e.call("llvm.fabs", [a[0]]), _const(math.inf, a[0]))


def _isfinite(e, a, dt, src):
    return e.b.fcmp_ordered("<", e.call("llvm.fabs", [a[0]]), _const(math.inf, a[0]))


def _pow(e, a, dt, src):
    """x ** 2, 3 or 4 as products (GELU's tanh form cubes its input): a call
    to pow keeps a loop scalar, and the products round as exactly (within an
    ulp), with NaN and infinities as pow has them."""
    n = a[1].constant if isinstance(a[1], ir.Constant) else None
    if n in (2.0, 3.0, 4.0):
        sq = e.b.fmul(a[0], a[0])
        return sq if n == 2.0 else e.b.fmul(sq, a[0]) if n == 3.0 else e.b.fmul(sq, sq)
    return e.math("pow", a)


def _math(op: str) -> Rule:
    return lambda e, a, dt, src: e.math(op, a)


_MATH = ("exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "sin", "cos", "tan", "tanh", "erf", "atan2",
         "floor", "ceil", "round", "abs", "maximum", "minimum", "logaddexp")

# ------------------------------------------------------------- integers
def _int_max(e, a, dt, src):
    if a[0].type == I1:
        return e.b.or_(*a)
    return e.b.select(e.b.icmp_signed(">", a[0], a[1]), a[0], a[1])


def _int_min(e, a, dt, src):
    if a[0].type == I1:
        return e.b.and_(*a)
    return e.b.select(e.b.icmp_signed("<", a[0], a[1]), a[0], a[1])


def _int_abs(e, a, dt, src):
    return e.b.select(e.b.icmp_signed("<", a[0], _const(0, a[0])), e.b.neg(a[0]), a[0])


def _int_sign(e, a, dt, src):
    b, z = e.b, _const(0, a[0])
    return b.sub(b.zext(b.icmp_signed(">", a[0], z), a[0].type), b.zext(b.icmp_signed("<", a[0], z), a[0].type))


def _int_relu(e, a, dt, src):
    z = _const(0, a[0])
    return e.b.select(e.b.icmp_signed("<", a[0], z), z, a[0])


def _int_pow(e, a, dt, src):
    f64 = ir.DoubleType()
    f = e.call("llvm.pow", [e.b.sitofp(a[0], f64), e.b.sitofp(a[1], f64)])
    return e.b.fptosi(f, a[0].type)


def _shift(how: str) -> Rule:
    """JAX's logical shifts: by the width or more gives 0."""
    def rule(e, a, dt, src):
        b, t = e.b, a[0].type
        over = b.icmp_unsigned(">=", a[1], ir.Constant(t, t.width))
        return b.select(over, ir.Constant(t, 0), getattr(b, how)(*a))
    return rule


def _shift_arithmetic(e, a, dt, src):
    """JAX's arithmetic right shift: by the width or more gives the sign."""
    b, t = e.b, a[0].type
    over = b.icmp_unsigned(">=", a[1], ir.Constant(t, t.width))
    return b.ashr(a[0], b.select(over, ir.Constant(t, t.width - 1), a[1]))


def _uint_division(quotient: bool) -> Rule:
    """Unsigned quotient or remainder; by zero gives 0, as in numpy."""
    def rule(e, a, dt, src):
        b, zero = e.b, ir.Constant(a[1].type, 0)
        by_zero = b.icmp_unsigned("==", a[1], zero)
        safe = b.select(by_zero, ir.Constant(a[1].type, 1), a[1])
        v = b.udiv(a[0], safe) if quotient else b.urem(a[0], safe)
        return b.select(by_zero, zero, v)
    return rule


def _uint_pick(pred: str) -> Rule:
    return lambda e, a, dt, src: e.b.select(e.b.icmp_unsigned(pred, a[0], a[1]), a[0], a[1])


def _same(e, a, dt, src):
    return a[0]


def _compare(how: str, sym: str) -> Rule:
    return lambda e, a, dt, src: getattr(e.b, how)(sym, *a)


def _bitcast(e, a, dt, src):
    from .llvm import COMPUTE
    return e.b.bitcast(a[0], COMPUTE[dt])


# integer divisions: (a quotient, not a remainder; floored: True, toward zero: False, None: floored
# for int64 index arithmetic, else toward zero); a floored remainder has the divisor's sign
_DIVISIONS = {"div": (True, None), "floordiv": (True, None), "mod": (False, True), "remainder": (False, True),
              "fmod": (False, False), "floor_divide": (True, True), "trunc_divide": (True, False)}
# comparisons: (symbol, float predicate: ordered, but != is true for NaN)
_COMPARE = {"eq": ("==", "fcmp_ordered"), "ne": ("!=", "fcmp_unordered"), "lt": ("<", "fcmp_ordered"),
            "le": ("<=", "fcmp_ordered"), "gt": (">", "fcmp_ordered"), "ge": (">=", "fcmp_ordered")}
_SHIFTS = {"shift_left": _shift("shl"), "shift_right_logical": _shift("lshr"),
           "shift_right_arithmetic": _shift_arithmetic}


RULES: dict[str, dict[str, Rule]] = {}


def rule(op: str, cls: str, fn: Rule) -> None:
    RULES.setdefault(op, {})[cls] = fn


def _any_type_rules() -> None:
    rule("cast", "any", lambda e, a, dt, src: e.cast(a[0], src, dt))
    rule("select", "any", lambda e, a, dt, src: e.b.select(*a))
    rule("rand", "any", lambda e, a, dt, src: e.philox_uniform(a[0], a[1]))
    rule("threefry", "any", lambda e, a, dt, src: e.threefry_bits(*a))
    rule("philox", "any", lambda e, a, dt, src: e.philox_bits(*a))
    for word in (0, 1):
        rule(f"threefry{word}", "any", lambda e, a, dt, src, word=word: e.threefry_bits(*a, word=word))
    rule("bitcast", "any", _bitcast)
    for op, (sym, fcmp) in _COMPARE.items():
        rule(op, "float", _compare(fcmp, sym))
        rule(op, "int", _compare("icmp_signed", sym))
        rule(op, "uint", _compare("icmp_unsigned", sym))
    rule("logical_and", "any", lambda e, a, dt, src: e.b.and_(*a))
    rule("logical_or", "any", lambda e, a, dt, src: e.b.or_(*a))
    rule("logical_xor", "any", lambda e, a, dt, src: e.b.xor(*a))
    rule("logical_not", "any", lambda e, a, dt, src: e.b.not_(a[0]))
    rule("isnan", "float", lambda e, a, dt, src: e.b.fcmp_unordered("uno", a[0], a[0]))
    rule("isnan", "any", lambda e, a, dt, src: ir.Constant(I1, 0))
    rule("isinf", "float", _isinf)
    rule("isinf", "any", lambda e, a, dt, src: ir.Constant(I1, 0))
    rule("isfinite", "float", _isfinite)
    rule("isfinite", "any", lambda e, a, dt, src: ir.Constant(I1, 1))


def _float_rules() -> None:
    for op, name in (("add", "fadd"), ("sub", "fsub"), ("mul", "fmul"), ("div", "fdiv")):
        rule(op, "float", (lambda n: lambda e, a, dt, src: getattr(e.b, n)(*a))(name))
    rule("fmod", "float", lambda e, a, dt, src: e.frem(*a))
    rule("neg", "float", lambda e, a, dt, src: e.b.fneg(a[0]))
    rule("reciprocal", "float", lambda e, a, dt, src: e.b.fdiv(_const(1.0, a[0]), a[0]))
    rule("sigmoid", "float", _sigmoid)
    rule("relu", "float", _relu)
    rule("sign", "float", _sign)
    rule("erf_inv", "float", lambda e, a, dt, src: e.erf_inv(a[0]))
    rule("trunc_divide", "float", lambda e, a, dt, src: e.call("llvm.trunc", [e.b.fdiv(*a)]))
    rule("floor_divide", "float", lambda e, a, dt, src: e.float_floor_divide(*a))
    rule("remainder", "float", _remainder)
    rule("fma", "float", lambda e, a, dt, src: e.call("llvm.fmuladd", a))
    rule("copysign", "float", lambda e, a, dt, src: e.call("llvm.copysign", a))
    rule("signbit", "float", _signbit)
    for op in _MATH:
        rule(op, "float", _math(op))
    rule("pow", "float", _pow)


def _integer_rules() -> None:
    """Signed integers, unsigned ones (bools among them, with an add of their own), and bits of either."""
    rule("add", "int", lambda e, a, dt, src: e.b.add(*a))
    rule("sub", "int", lambda e, a, dt, src: e.b.sub(*a))
    rule("mul", "int", lambda e, a, dt, src: e.b.mul(*a))
    rule("neg", "int", lambda e, a, dt, src: e.b.neg(a[0]))
    for op, (quotient, floored) in _DIVISIONS.items():
        rule(op, "int", (lambda q, f: lambda e, a, dt, src: e.int_division(q, f, *a))(quotient, floored))
        rule(op, "uint", _uint_division(quotient))
    for op in ("max", "maximum"):
        rule(op, "int", _int_max)
        rule(op, "uint", _uint_pick(">"))
    for op in ("min", "minimum"):
        rule(op, "int", _int_min)
        rule(op, "uint", _uint_pick("<"))
    rule("abs", "int", _int_abs)
    rule("sign", "int", _int_sign)
    rule("relu", "int", _int_relu)
    rule("pow", "int", _int_pow)
    for op in ("floor", "ceil", "round"):
        rule(op, "int", _same)
        rule(op, "uint", _same)
    for op, name in (("bitwise_and", "and_"), ("bitwise_or", "or_"), ("bitwise_xor", "xor")):
        for cls in ("int", "uint"):
            rule(op, cls, (lambda n: lambda e, a, dt, src: getattr(e.b, n)(*a))(name))
    for cls in ("int", "uint"):
        rule("bitwise_not", cls, lambda e, a, dt, src: e.b.not_(a[0]))
        for op, fn in _SHIFTS.items():
            rule(op, cls, fn)
    for op in ("add", "sub", "mul", "neg"):
        rule(op, "uint", RULES[op]["int"])
    rule("abs", "uint", _same)
    rule("relu", "uint", _same)
    rule("add", "bool", lambda e, a, dt, src: e.b.or_(*a))  # (numpy's, PyTorch's and JAX's: True + True is True)
    rule("sign", "uint", lambda e, a, dt, src: e.b.zext(e.b.icmp_unsigned("!=", a[0], _const(0, a[0])), a[0].type))


_any_type_rules()
_float_rules()
_integer_rules()


def rule_for(op: str, src: DataType) -> Rule | None:
    by_class = RULES.get(op, {})
    return ((src is DataType.Bool and by_class.get("bool")) or by_class.get(operand_class(src))
            or by_class.get("any"))
