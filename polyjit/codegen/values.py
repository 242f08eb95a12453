"""Scalar emission: an expression's value from its constants, loads and ops
(each op's rule, the target's math or its decomposition), casts, integer
division that never traps, reductions' combine, and the special functions
(erfinv, random bits) rules call."""
from __future__ import annotations

import math

from llvmlite import ir

from .. import scalar
from ..dtypes import DataType
from ..errors import UnsupportedOpError
from ..expr import Const, Expr, Load, Op, Var, loads, select_parts
from . import mathlib
from .folding import power_of_two
from .irtypes import COMPUTE, F32, F64, I1, I8, I32, I64, STORAGE
from .rules import rule_for

_INTRINSIC = {"exp": "llvm.exp", "log": "llvm.log", "sin": "llvm.sin", "cos": "llvm.cos",
              "sqrt": "llvm.sqrt", "floor": "llvm.floor", "ceil": "llvm.ceil",
              "round": "llvm.roundeven", "abs": "llvm.fabs", "pow": "llvm.pow",
              "maximum": "llvm.maximum", "minimum": "llvm.minimum"}


class ValueEmission:
    """Emitter's scalar half: values at the builder ``self.b`` of
    ``self.module``; loads go through the emitter's address and
    load_element, parameters come from ``self.params``."""

    def value(self, e: Expr, env, cache) -> ir.Value:
        # integer expressions by structure: a window's taps repeat their
        # index arithmetic (the same floor division per tap and bound)
        key = e if isinstance(e, Op) and not e.dtype.is_float else id(e)
        if key in cache:
            return cache[key][0]
        v = self._value(e, env, cache)
        cache[key] = (v, e)  # keep e alive so its id stays unique
        return v

    def _value(self, e: Expr, env, cache) -> ir.Value:
        if isinstance(e, Const):
            return self.constant(e.value, e.dtype)
        if isinstance(e, Var):
            return env[e.name] if e.kind == "iter" else self.params[e.name]
        if isinstance(e, Load):
            arr = self.prog.arrays[e.array]
            return self.load_element(arr, e.index, self.address(arr, e.index, env, cache))
        assert isinstance(e, Op)
        sel = select_parts(e)
        if sel is not None and isinstance(sel[1], Load) and isinstance(sel[2], Const) and not loads(sel[0]):
            return self.padded_load(*sel, env, cache)
        args = [self.value(a, env, cache) for a in e.args]
        return self.op(e.op, args, e.dtype, [a.dtype for a in e.args])

    def constant(self, value, dt: DataType) -> ir.Constant:
        t = COMPUTE[dt]
        if dt is DataType.Bool:
            return ir.Constant(I1, int(bool(value)))
        if dt.is_float:
            return ir.Constant(t, float(value))
        return ir.Constant(t, int(value))

    def op(self, op: str, a: list, dt: DataType, adts: list[DataType]) -> ir.Value:
        """op on values a of types adts, giving dt: its rule for the operands'
        class, or its decomposition (polyjit.scalar) where the target has none."""
        src = adts[0] if adts else dt
        rule = rule_for(op, src)
        if rule is not None:
            return rule(self, a, dt, src)
        if src.is_float and op in scalar.OPS:  # the target's math: a kernel, an intrinsic, libm, a decomposition
            return self.math(op, a)
        raise UnsupportedOpError(f"{op} on {src} has no lowering")

    def decomposed(self, op: str, a: list) -> ir.Value:
        """op's decomposition in polyjit.scalar, emitted op by op."""
        dt = DataType.Double if a[0].type == F64 else DataType.Float
        names = [f"%{k}" for k in range(len(a))]
        e = scalar.OPS[op].decompose(*(Var(dt, n) for n in names))
        return self.value(e, dict(zip(names, a)), {})

    def math(self, op: str, a: list) -> ir.Value:
        """Transcendental functions: vectorizable float32 kernels, LLVM
        intrinsics, the C math library, or the op's decomposition. In
        float32 a decomposition comes before the C library: it vectorizes
        (over the float32 kernels), where the library's scalar calls ran
        log1p and expm1 (softplus, ELU, mish) at 15 times eager's time."""
        if a[0].type == F32 and op in mathlib.KERNELS:
            return mathlib.KERNELS[op](self.b, self.module, *a)
        if op in _INTRINSIC:
            return self.call(_INTRINSIC[op], a)
        if op == "rsqrt":  # (a target with an instruction for it overrides math)
            return self.b.fdiv(ir.Constant(a[0].type, 1.0), self.call("llvm.sqrt", a))
        if scalar.OPS[op].libm and not (a[0].type == F32 and scalar.OPS[op].decompose is not None):
            name = op + ("f" if a[0].type == F32 else "")
            fn = self.module.globals.get(name) or ir.Function(
                self.module, ir.FunctionType(a[0].type, [x.type for x in a]), name)
            return self.b.call(fn, a)
        if scalar.OPS[op].decompose is not None:
            return self.decomposed(op, a)
        raise UnsupportedOpError(f"{op} has no lowering")

    def frem(self, x, y) -> ir.Value:
        """C's fmod: float32 exactly in vector arithmetic (mathlib.fmod), not
        LLVM's frem, a scalar call per lane (12-15x eager's time)."""
        if x.type == F32:
            return mathlib.fmod(self.b, self.module, x, y)
        return self.b.frem(x, y)

    def call(self, intrinsic: str, a: list) -> ir.Value:
        fn = self.module.declare_intrinsic(intrinsic, [a[0].type],
                                           ir.FunctionType(a[0].type, [x.type for x in a]))
        return self.b.call(fn, a)

    def cast(self, v, src: DataType, dst: DataType) -> ir.Value:
        b = self.b
        st, dt_ = COMPUTE[src], COMPUTE[dst]
        if dst in (DataType.Half, DataType.BFloat16):  # round to the narrow type
            f = self.cast(v, src, DataType.Float)
            return self.from_storage(self.to_storage(f, dst), dst)
        if dst is DataType.Bool:
            if src.is_float:
                return b.fcmp_unordered("!=", v, ir.Constant(st, 0.0))
            return b.icmp_signed("!=", v, ir.Constant(st, 0))
        if src is DataType.Bool:
            return b.uitofp(v, dt_) if dst.is_float else b.zext(v, dt_)
        if src.is_float and dst.is_float:
            if st == dt_:
                return v
            return b.fpext(v, dt_) if dt_ == F64 else b.fptrunc(v, dt_)
        if src.is_float:
            return b.fptoui(v, dt_) if dst.is_unsigned else b.fptosi(v, dt_)
        if dst.is_float:
            return b.uitofp(v, dt_) if src.is_unsigned else b.sitofp(v, dt_)
        if st.width == dt_.width:
            return v
        if dt_.width < st.width:
            return b.trunc(v, dt_)
        return b.zext(v, dt_) if src.is_unsigned else b.sext(v, dt_)

    def int_division(self, quotient: bool, floored: bool | None, x, y) -> ir.Value:
        """Signed quotient (floored, toward zero, or where floored is None,
        index arithmetic: floored for int64, else toward zero) or remainder
        (floored: with the divisor's sign; else the dividend's, as fmod). Division by zero gives 0, as in
        numpy, and MIN / -1 wraps: the machine's divide would trap on both and
        kill the process."""
        b = self.b
        t = y.type
        zero, one = ir.Constant(t, 0), ir.Constant(t, 1)
        k = power_of_two(y)
        if k is not None and (floored or (floored is None and t == I64)):  # y > 1: no guard; a shift, a mask
            return self.floordiv(x, y) if quotient else b.and_(x, ir.Constant(t, (1 << k) - 1))
        by_zero = b.icmp_signed("==", y, zero)
        by_minus_one = b.icmp_signed("==", y, ir.Constant(t, -1))
        safe = b.select(b.or_(by_zero, by_minus_one), one, y)
        if quotient:
            floor = floored or (floored is None and t == I64)
            q = self.floordiv(x, safe) if floor else b.sdiv(x, safe)
            q = b.select(by_minus_one, b.sub(zero, x), q)
            return b.select(by_zero, zero, q)
        r = b.srem(x, safe)  # 0 where y is -1
        if not floored:
            return b.select(by_zero, zero, r)
        fix = b.and_(b.icmp_signed("!=", r, zero),
                     b.xor(b.icmp_signed("<", r, zero), b.icmp_signed("<", y, zero)))
        return b.select(by_zero, zero, b.select(fix, b.add(r, y), r))

    def combine(self, how: str, old, new, dt: DataType) -> ir.Value:
        if how in ("max", "min") and dt.is_float:
            new = self.freeze(new)
        v = self.op(scalar.COMBINE[how], [old, new], dt, [dt, dt])
        if how in scalar.ARITHMETIC and dt.is_float:
            v.flags.append("reassoc")
            if v.opname == "fadd" and getattr(new, "opname", "") == "fmul":
                # a sum of products: one fused multiply-add per term, as BLAS does
                new.flags.append("contract")
                v.flags.append("contract")
        return v

    def freeze(self, v: ir.Value) -> ir.Value:
        """v, opaque to LLVM's folds (``freeze``: v itself, never poison here).
        A maximum's operand that selects -inf (a causal mask's
        ``masked_fill(mask, -inf)``) would otherwise fold into the maximum
        as a select around it, which the loop vectorizer does not take for
        a reduction: the row maxima ran scalar, 17 times slower."""
        frozen = ir.instructions.Instruction(self.b.block, v.type, "freeze", [v])
        self.b._insert(frozen)
        return frozen

    def from_storage(self, v, dt: DataType):
        if dt is DataType.Bool:
            return self.b.icmp_unsigned("!=", v, ir.Constant(I8, 0))
        if dt is DataType.BFloat16:  # the high half of a float32
            return self.b.bitcast(self.b.shl(self.b.zext(v, I32), ir.Constant(I32, 16)), F32)
        if dt is DataType.Half:
            return self.b.fpext(v, F32)
        return v

    def to_storage(self, v, dt: DataType):
        if dt is DataType.Bool:
            return self.b.zext(v, I8)
        if dt is DataType.BFloat16:
            return self.bfloat16_bits(v)
        if dt is DataType.Half:
            return self.b.fptrunc(v, STORAGE[dt])
        return v

    def bfloat16_bits(self, f) -> ir.Value:
        """float32 f rounded to bfloat16, to nearest with ties to even, as its
        16 bits (LLVM through llvmlite has no bfloat type); NaN is 0x7FC0,
        as PyTorch's and JAX's conversions give."""
        b = self.b
        c = lambda x: ir.Constant(I32, x)  # noqa: E731
        bits = b.bitcast(f, I32)
        even = b.and_(b.lshr(bits, c(16)), c(1))
        rounded = b.lshr(b.add(bits, b.add(c(0x7FFF), even)), c(16))
        return b.trunc(b.select(b.fcmp_unordered("uno", f, f), c(0x7FC0), rounded), STORAGE[DataType.BFloat16])

    def float_floor_divide(self, x, y) -> ir.Value:
        """floor(x / y) as numpy and torch compute it: from the exact
        remainder, so that a quotient rounded up to an integer is not off by
        one; y = 0 gives x / y (inf or nan)."""
        b = self.b
        t = x.type
        zero, one = ir.Constant(t, 0.0), ir.Constant(t, 1.0)
        mod = self.frem(x, y)
        div = b.fdiv(b.fsub(x, mod), y)
        fix = b.and_(b.fcmp_ordered("!=", mod, zero),
                     b.xor(b.fcmp_ordered("<", y, zero), b.fcmp_ordered("<", mod, zero)))
        div = b.select(fix, b.fsub(div, one), div)
        fl = self.call("llvm.floor", [div])
        fl = b.select(b.fcmp_ordered(">", b.fsub(div, fl), ir.Constant(t, 0.5)), b.fadd(fl, one), fl)
        fl = b.select(b.fcmp_ordered("==", div, zero), self.call("llvm.copysign", [zero, b.fdiv(x, y)]), fl)
        return b.select(b.fcmp_ordered("==", y, zero), b.fdiv(x, y), fl)

    def erf_inv(self, x) -> ir.Value:
        """Giles' single-precision inverse error function (the polynomials XLA
        uses): w = -log1p(-x^2), a polynomial in w - 2.5 below 5, else in
        sqrt(w) - 3; +-inf at +-1, NaN beyond."""
        b = self.b
        t = x.type
        k = lambda v: ir.Constant(t, v)  # noqa: E731
        w = b.fneg(self.math("log1p", [b.fneg(b.fmul(x, x))]))
        small = b.fcmp_ordered("<", w, k(5.0))
        z = b.select(small, b.fsub(w, k(2.5)), b.fsub(self.call("llvm.sqrt", [w]), k(3.0)))
        near = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
        far = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
               -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)
        p = b.select(small, k(near[0]), k(far[0]))
        for c0, c1 in zip(near[1:], far[1:]):
            p = self.call("llvm.fmuladd", [p, z, b.select(small, k(c0), k(c1))])
        r = b.fmul(p, x)
        one = b.fcmp_ordered("==", self.call("llvm.fabs", [x]), k(1.0))
        return b.select(one, b.fmul(x, k(math.inf)), r)

    def threefry_bits(self, k0, k1, count, word: int | None = None) -> ir.Value:
        """JAX's 32 random bits for element count under key (k0, k1): both
        words of Threefry-2x32 (20 rounds) of the 64-bit count, xor-ed; or
        one of the words (``word`` 0 or 1: a split key's halves)."""
        b = self.b
        c = lambda v: ir.Constant(I32, v)  # noqa: E731
        ks = [k0, k1, b.xor(b.xor(k0, k1), c(0x1BD11BDA))]
        x = [b.add(b.trunc(b.lshr(count, ir.Constant(I64, 32)), I32), ks[0]), b.add(b.trunc(count, I32), ks[1])]
        rotations = [(13, 15, 26, 6), (17, 29, 16, 24)]
        for i in range(5):
            for r in rotations[i % 2]:
                x[0] = b.add(x[0], x[1])
                x[1] = b.or_(b.shl(x[1], c(r)), b.lshr(x[1], c(32 - r)))
                x[1] = b.xor(x[0], x[1])
            x = [b.add(x[0], ks[(i + 1) % 3]), b.add(b.add(x[1], ks[(i + 2) % 3]), c(i + 1))]
        return b.xor(x[0], x[1]) if word is None else x[word]

    def _philox(self, counter: list, key: list) -> list:
        """Philox-4x32-10 of four 32-bit counter words under two key words."""
        b, c, k0, k1 = self.b, counter, key[0], key[1]
        I32c = lambda x: ir.Constant(I32, x)  # noqa: E731

        def mulhilo(m, x):
            p = b.mul(ir.Constant(I64, m), b.zext(x, I64))
            return b.trunc(b.lshr(p, ir.Constant(I64, 32)), I32), b.trunc(p, I32)
        for _ in range(10):
            hi0, lo0 = mulhilo(0xD2511F53, c[0])
            hi1, lo1 = mulhilo(0xCD9E8D57, c[2])
            c = [b.xor(b.xor(hi1, c[1]), k0), lo1, b.xor(b.xor(hi0, c[3]), k1), lo0]
            k0, k1 = b.add(k0, I32c(0x9E3779B9)), b.add(k1, I32c(0xBB67AE85))
        return c

    def _words(self, v) -> list:
        """A 64-bit value's low and high 32-bit words."""
        return [self.b.trunc(v, I32), self.b.trunc(self.b.lshr(v, ir.Constant(I64, 32)), I32)]

    def philox_uniform(self, seed, counter) -> ir.Value:
        """Philox 4x32-10 of (counter, seed); the first word, as a float in [0, 1)."""
        b = self.b
        c = self._philox(self._words(counter) + [ir.Constant(I32, 0)] * 2, self._words(seed))
        bits = b.lshr(c[0], ir.Constant(I32, 8))
        return b.fmul(b.uitofp(bits, F32), ir.Constant(F32, 2.0 ** -24))

    def philox_bits(self, key, lo, hi, position) -> ir.Value:
        """TensorFlow's 32 random bits at a position: word position mod 4 of
        Philox-4x32-10 under the 64-bit key, at the 128-bit counter (hi, lo)
        plus position div 4 (TensorFlow's PhiloxRandom.Skip)."""
        b, i64 = self.b, lambda x: ir.Constant(I64, x)
        group = b.lshr(position, i64(2))
        lo = b.add(lo, group)
        hi = b.add(hi, b.zext(b.icmp_unsigned("<", lo, group), I64))
        c = self._philox(self._words(lo) + self._words(hi), self._words(key))
        lane = b.trunc(b.and_(position, i64(3)), I32)
        pick = lambda k: b.icmp_unsigned("==", lane, ir.Constant(I32, k))  # noqa: E731
        return b.select(pick(0), c[0], b.select(pick(1), c[1], b.select(pick(2), c[2], c[3])))
