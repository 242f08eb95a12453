"""Vectorizable float32 math: branch-free polynomial kernels (after Cephes,
and Eigen for erf) that LLVM's loop vectorizer can widen, where a call into
the C library would keep a loop scalar. Each is within a few ulp of the
correctly rounded result for |x| < 39000 (sin, cos) or everywhere (the rest);
NaN and infinities propagate as in C.
"""
from __future__ import annotations

import math

from llvmlite import ir

F32, I32 = ir.FloatType(), ir.IntType(32)


def c(v: float) -> ir.Constant:
    return ir.Constant(F32, v)


def _muladd(b: ir.IRBuilder, x, y, z):
    """x * y + z, fused where the target has FMA (llvm.fmuladd)."""
    fn = b.module.declare_intrinsic("llvm.fmuladd", [F32], ir.FunctionType(F32, [F32, F32, F32]))
    return b.call(fn, [x, y, z])


def _poly(b: ir.IRBuilder, x, coeffs):
    acc = c(coeffs[0])
    for k in coeffs[1:]:
        acc = _muladd(b, acc, x, c(k))
    return acc


def _fabs(b, m, x):
    return b.call(m.declare_intrinsic("llvm.fabs", [F32]), [x])


def _floor(b, m, x):
    return b.call(m.declare_intrinsic("llvm.floor", [F32]), [x])


def _pow2(b, n):
    """2**n for an int32 n in [-126, 127], built in the exponent bits."""
    return b.bitcast(b.shl(b.add(n, ir.Constant(I32, 127)), ir.Constant(I32, 23)), F32)


def _clamp(b, m, x, bound: float):
    """x limited to [-bound, bound]: one vector min and max (the nnan flag
    spares x86 the NaN fix-ups of minnum and maxnum). A NaN x gives poison,
    so callers pass one only where a final select replaces what follows
    (sin and cos of a non-finite x)."""
    two = ir.FunctionType(F32, [F32, F32])
    lo = b.call(m.declare_intrinsic("llvm.maxnum", [F32], two), [x, c(-bound)], fastmath=("nnan",))
    return b.call(m.declare_intrinsic("llvm.minnum", [F32], two), [lo, c(bound)], fastmath=("nnan",))


def _isnan(b, x):
    return b.fcmp_unordered("uno", x, x)


def exp(b: ir.IRBuilder, m: ir.Module, x):
    """Cody-Waite reduction by ln 2 and a degree-7 polynomial. The argument is
    clamped to at most 89, where the scaling by 2**n itself overflows to
    inf; below -104, where exp rounds to 0, it is 0 by a select, the lane
    computed at 0: scaling down to 0 there took a microcode assist per
    element (a causal mask's -inf: 2.3 times as long); NaN passes through."""
    low = b.fcmp_ordered("<", x, c(-104.0))
    xc = b.select(b.fcmp_ordered(">", x, c(89.0)), c(89.0), x)
    xc = b.select(low, c(0.0), xc)
    n = _floor(b, m, b.fadd(b.fmul(xc, c(1.44269504088896341)), c(0.5)))
    r = b.fsub(b.fsub(xc, b.fmul(n, c(0.693359375))), b.fmul(n, c(-2.12194440e-4)))
    z = b.fmul(r, r)
    p = _poly(b, r, [1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                     1.6666665459e-1, 5.0000001201e-1])
    p = b.fadd(b.fadd(b.fmul(p, z), r), c(1.0))
    ni = b.fptosi(n, I32)
    n1 = b.ashr(ni, ir.Constant(I32, 1))
    y = b.fmul(b.fmul(p, _pow2(b, n1)), _pow2(b, b.sub(ni, n1)))
    return b.select(_isnan(b, x), x, b.select(low, c(0.0), y))


def log(b: ir.IRBuilder, m: ir.Module, x):
    tiny = b.fcmp_ordered("<", x, c(1.17549435e-38))
    xs = b.select(tiny, b.fmul(x, c(8388608.0)), x)  # lift denormals by 2**23
    bits = b.bitcast(xs, I32)
    e = b.sub(b.lshr(bits, ir.Constant(I32, 23)), ir.Constant(I32, 126))
    e = b.select(tiny, b.sub(e, ir.Constant(I32, 23)), e)
    mant = b.bitcast(b.or_(b.and_(bits, ir.Constant(I32, 0x807FFFFF)), ir.Constant(I32, 0x3F000000)), F32)
    small = b.fcmp_ordered("<", mant, c(0.707106781186547524))
    e = b.select(small, b.sub(e, ir.Constant(I32, 1)), e)
    mm = b.select(small, b.fsub(b.fadd(mant, mant), c(1.0)), b.fsub(mant, c(1.0)))
    ef = b.sitofp(e, F32)
    z = b.fmul(mm, mm)
    y = _poly(b, mm, [7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1,
                      1.4249322787e-1, -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1,
                      3.3333331174e-1])
    y = b.fmul(b.fmul(y, mm), z)
    y = b.fadd(y, b.fmul(ef, c(-2.12194440e-4)))
    y = b.fsub(y, b.fmul(z, c(0.5)))
    r = b.fadd(b.fadd(mm, y), b.fmul(ef, c(0.693359375)))
    r = b.select(b.fcmp_ordered("==", x, c(math.inf)), x, r)
    r = b.select(b.fcmp_ordered("==", x, c(0.0)), c(-math.inf), r)
    return b.select(b.fcmp_unordered("<", x, c(0.0)), c(math.nan), r)  # negative or NaN


# pi in four parts whose products with the quadrant count are exact (after SLEEF)
_PI4 = (3.140625, 0.0009670257568359375, 6.2771141529083251953e-07, 1.2154201256553420762e-10)


def _sincos(b, m, x, want_cos: bool):
    """One odd polynomial on [-pi/2, pi/2] (SLEEF's sinf_u35 / cosf_u35):
    sin x = (-1)^q sin(x - q pi) with q = rint(x / pi); cos x = sin(x + pi/2),
    reduced directly with odd multiples of pi/2."""
    finite = b.fcmp_ordered("<", _fabs(b, m, x), c(math.inf))
    x = b.select(finite, x, c(0.0))
    rint = m.declare_intrinsic("llvm.rint", [F32])
    if want_cos:
        q = b.fadd(b.fmul(b.call(rint, [b.fsub(b.fmul(x, c(1 / math.pi)), c(0.5))]), c(2.0)), c(1.0))
        parts = [p * 0.5 for p in _PI4]
    else:
        q = b.call(rint, [b.fmul(x, c(1 / math.pi))])
        parts = list(_PI4)
    q = _clamp(b, m, q, 16777216.0)
    d = x
    for part in parts:
        d = _muladd(b, q, c(-part), d)
    qi = b.fptosi(q, I32)
    bit = ir.Constant(I32, 2 if want_cos else 1)
    flip = b.icmp_signed("==" if want_cos else "!=", b.and_(qi, bit), ir.Constant(I32, 0))
    d = b.select(flip, b.fneg(d), d)
    s2 = b.fmul(d, d)
    u = _poly(b, s2, [2.6083159809786593541503e-06, -0.0001981069071916863322258,
                      0.00833307858556509017944336, -0.166666597127914428710938])
    v = _muladd(b, s2, b.fmul(u, d), d)
    v = _clamp(b, m, v, 1.0)  # bounded beyond the accurate range
    if not want_cos:
        v = b.select(b.fcmp_ordered("==", x, c(0.0)), x, v)  # sin(-0) = -0
    return b.select(finite, v, c(math.nan))


def sin(b, m, x):
    return _sincos(b, m, x, False)


def cos(b, m, x):
    return _sincos(b, m, x, True)


def tan(b, m, x):
    return b.fdiv(sin(b, m, x), cos(b, m, x))


def tanh(b: ir.IRBuilder, m: ir.Module, x, div=None):
    """Eigen's rational approximation (the one XLA uses): odd degree-13 over
    even degree-6 polynomials on x clamped to +-7.905, x itself below
    0.0004, +-1 beyond 9 (where float32's tanh is 1); one division, no exp.
    The denominator lies in [0.0048, 0.91]: a target may pass a faster
    div(b, p, q) that is exact to a few ulp there."""
    t = b.select(b.fcmp_ordered(">", x, c(7.90531110763549805)), c(7.90531110763549805), x)
    t = b.select(b.fcmp_ordered("<", t, c(-7.90531110763549805)), c(-7.90531110763549805), t)
    z = b.fmul(t, t)
    p = b.fmul(_poly(b, z, [-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
                            5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
                            4.89352455891786e-03]), t)
    q = _poly(b, z, [1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03])
    ax = _fabs(b, m, x)
    r = b.select(b.fcmp_ordered("<", ax, c(0.0004)), x, (div or _fdiv)(b, p, q))
    r = b.select(b.fcmp_ordered(">", ax, c(9.0)), b.select(b.fcmp_ordered(">", x, c(0.0)), c(1.0), c(-1.0)), r)
    return b.select(_isnan(b, x), x, r)


def erf(b: ir.IRBuilder, m: ir.Module, x, div=None):
    """Eigen's odd degree-13 over even degree-8 rational form on x clamped to
    +-4 (where float32's erf is +-1); its denominator lies in [-2.4, -0.014],
    so a target may pass a faster div(b, p, q), as for tanh."""
    xc = b.select(b.fcmp_ordered(">", x, c(4.0)), c(4.0), x)
    xc = b.select(b.fcmp_ordered("<", xc, c(-4.0)), c(-4.0), xc)
    x2 = b.fmul(xc, xc)
    p = b.fmul(xc, _poly(b, x2, [-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
                                 -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
                                 -1.60960333262415e-02]))
    q = _poly(b, x2, [-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
                      -7.37332916720468e-03, -1.42647390514189e-02])
    return b.select(_isnan(b, x), x, (div or _fdiv)(b, p, q))


def _fdiv(b: ir.IRBuilder, p, q):
    return b.fdiv(p, q)


FMOD_STEP = 29  # quotient bits one exact step in double takes off: a float's 24-bit significand times it fits 53
FMOD_STEPS = 10  # float32 quotients reach 2^277 (2^128 over 2^-149)


def fmod(b: ir.IRBuilder, m: ir.Module, x, y):
    """C's fmodf, exactly, in straight-line double arithmetic that
    vectorizes (LLVM's frem is a C library call per lane). |x| is reduced by
    |y| * 2^(29k), k = 9 down to 0: the step before left r under 2^29 times
    the step's divisor d, so q is under 2^29; r is a float (the exact
    remainder of floats), so q * d and r - q * d are exact in double. q
    comes from a reciprocal rounded below 1/|y| (by 2^-49, more than three
    roundings' error), so it is the quotient's integer part or one less,
    which one compare and subtraction puts right. A constant y needs only
    the steps its quotients reach. NaN for a NaN, an infinite x or a zero
    y; x for an infinite y, as in C."""
    f64 = ir.DoubleType()
    ax, ay = _fabs(b, m, x), _fabs(b, m, y)
    r, dy = b.fpext(ax, f64), b.fpext(ay, f64)
    inv = b.fmul(b.fdiv(ir.Constant(f64, 1.0), dy), ir.Constant(f64, 1.0 - 2.0 ** -49))  # (below 1/|y|)
    trunc = m.declare_intrinsic("llvm.trunc", [f64])
    fma = m.declare_intrinsic("llvm.fmuladd", [f64], ir.FunctionType(f64, [f64, f64, f64]))
    steps = FMOD_STEPS
    if isinstance(y, ir.Constant) and 0 < abs(float(y.constant)) < math.inf:  # (x % 1.0): quotients under 2^128/|y|
        steps = max(1, math.ceil((128 - math.log2(abs(float(y.constant)))) / FMOD_STEP))
    for k in range(steps - 1, -1, -1):
        d = b.fmul(dy, ir.Constant(f64, 2.0 ** (FMOD_STEP * k)))
        q = b.call(trunc, [b.fmul(r, b.fmul(inv, ir.Constant(f64, 2.0 ** (-FMOD_STEP * k))))])
        r = b.call(fma, [b.fneg(q), d, r])
        r = b.select(b.fcmp_ordered(">=", r, d), b.fsub(r, d), r)
    copysign = m.declare_intrinsic("llvm.copysign", [F32], ir.FunctionType(F32, [F32, F32]))
    res = b.call(copysign, [b.fptrunc(r, F32), x])
    res = b.select(b.fcmp_ordered("==", ay, c(math.inf)), x, res)
    bad = b.or_(b.or_(b.fcmp_unordered("uno", x, y), b.fcmp_ordered("==", ay, c(0.0))),
                b.fcmp_ordered("==", ax, c(math.inf)))
    return b.select(bad, c(math.nan), res)


KERNELS = {"exp": exp, "log": log, "sin": sin, "cos": cos, "tan": tan, "tanh": tanh, "erf": erf}
