"""Every core op and composite, against numpy on fresh random data."""
import dataclasses
import math
import os

import ml_dtypes
import numpy as np
import pytest

import polyjit
from polyjit import InputInfo, ops, scalar
from polyjit.cache import ProcessCache
from polyjit.codegen import program, values
from polyjit.errors import UnsupportedOpError

import refs

F32 = np.float32


TARGET = os.environ.get("POLYJIT_TEST_TARGET", "cpu")  # nvgpu runs the same checks on a GPU


def run(fn, *arrays, symbolic=False, **opts):
    infos = [InputInfo([-1] * a.ndim if symbolic else list(a.shape), a.dtype) for a in arrays]
    exe = polyjit.compile(fn, infos, {"target": TARGET, **opts})
    out = exe(*arrays)
    assert exe.stats["fallbacks"] == 0
    return out, exe


def close(got, want, rtol=1e-5, atol=1e-6):
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    if got.dtype.kind == "f" or want.dtype.kind == "f":
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol,
                                   equal_nan=True)
    else:
        np.testing.assert_array_equal(got, want)


UNARY = [
    ("neg", ops.neg, np.negative, (-5, 5)),
    ("abs", ops.abs, np.abs, (-5, 5)),
    ("exp", ops.exp, np.exp, (-20, 20)),
    ("log", ops.log, np.log, (0.01, 100)),
    ("log1p", ops.log1p, np.log1p, (-0.9, 10)),
    ("expm1", ops.expm1, np.expm1, (-5, 5)),
    ("sqrt", ops.sqrt, np.sqrt, (0, 100)),
    ("rsqrt", ops.rsqrt, lambda x: 1 / np.sqrt(x), (0.01, 100)),
    ("sin", ops.sin, np.sin, (-20, 20)),
    ("cos", ops.cos, np.cos, (-20, 20)),
    ("tan", ops.tan, np.tan, (-1.5, 1.5)),
    ("tanh", ops.tanh, np.tanh, (-10, 10)),
    ("erf", ops.erf, refs.erf, (-4, 4)),
    ("erfc", ops.erfc, np.vectorize(math.erfc, otypes=[np.float64]), (-4, 10)),
    ("sigmoid", ops.sigmoid, lambda x: 1 / (1 + np.exp(-x)), (-20, 20)),
    ("floor", ops.floor, np.floor, (-5, 5)),
    ("ceil", ops.ceil, np.ceil, (-5, 5)),
    ("round", ops.round, np.round, (-5, 5)),
    ("sign", ops.sign, np.sign, (-5, 5)),
    ("reciprocal", ops.reciprocal, lambda x: 1 / x, (0.1, 10)),
    ("relu", ops.relu, lambda x: np.maximum(x, 0), (-5, 5)),
]


@pytest.mark.parametrize("name,op,ref,dom", UNARY, ids=[u[0] for u in UNARY])
def test_unary(name, op, ref, dom, rng):
    x = rng.uniform(*dom, size=(37, 129)).astype(F32)
    got, _ = run(op, x, symbolic=True)
    close(got, ref(x.astype(np.float64)), rtol=2e-5 if name in ("tan", "expm1") else 1e-5, atol=2e-6)


@pytest.mark.parametrize("name,op,ref,dom", UNARY, ids=[u[0] for u in UNARY])
def test_unary_nan_inf(name, op, ref, dom):
    x = np.array([np.nan, np.inf, -np.inf, 0.0, 1.0], F32)
    got, _ = run(op, x)
    with np.errstate(all="ignore"):
        want = ref(x.astype(np.float64))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5)



DECOMPOSED = sorted(n for n, o in scalar.OPS.items()  # those with a native form beside (logaddexp has none)
                    if o.public and o.decompose is not None and (o.libm or n == "pow"))


@pytest.mark.skipif(TARGET != "cpu", reason="compares with the host's native forms")
@pytest.mark.parametrize("name", DECOMPOSED)
def test_decompositions_agree_with_the_native_forms(name, rng, monkeypatch):
    """A target without a native form of an op (the GPU has no C library)
    emits its decomposition from polyjit.scalar, and the host does so in
    float32 where the C library's is a scalar call: it agrees with the C
    library, NaN and infinities included."""
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, 2.5, -3.0], F32)
    pairs = np.stack(np.meshgrid(*[special] * scalar.OPS[name].arity, indexing="ij")).reshape(scalar.OPS[name].arity, -1)
    args = [np.concatenate([rng.uniform(-8, 8, 1000 - p.size).astype(F32), p]).reshape(40, 25) for p in pairs]
    fn = getattr(ops, name)
    with monkeypatch.context() as m:  # the native form: the op's intrinsic, or the C library
        m.setattr(program, "_codes", ProcessCache(program.CODE_CACHE))
        m.setitem(scalar.OPS, name, dataclasses.replace(scalar.OPS[name], decompose=None))
        native, native_exe = run(fn, *args, cache=False)
    monkeypatch.setattr(program, "_codes", ProcessCache(program.CODE_CACHE))  # no code shared with the native build
    monkeypatch.setattr(values, "_INTRINSIC", {k: v for k, v in values._INTRINSIC.items() if k != name})
    monkeypatch.setitem(scalar.OPS, name, dataclasses.replace(scalar.OPS[name], libm=False))
    decomposed, exe = run(fn, *args, cache=False)
    assert exe.ir("llvm") != native_exe.ir("llvm")
    close(decomposed, native, rtol=3e-6, atol=1e-7)


BINARY = [
    ("add", ops.add, np.add), ("sub", ops.sub, np.subtract), ("mul", ops.mul, np.multiply),
    ("div", ops.div, np.divide), ("maximum", ops.maximum, np.maximum),
    ("minimum", ops.minimum, np.minimum), ("pow", ops.pow, lambda a, b: np.abs(a) ** b),
    ("remainder", ops.remainder, np.mod), ("fmod", ops.fmod, np.fmod), ("atan2", ops.atan2, np.arctan2),
    ("logaddexp", ops.logaddexp, np.logaddexp),
]


@pytest.mark.parametrize("name,op,ref", BINARY, ids=[b[0] for b in BINARY])
def test_binary_broadcast(name, op, ref, rng):
    a = rng.uniform(0.5, 4, size=(5, 1, 33)).astype(F32)
    b = rng.uniform(0.5, 4, size=(7, 1)).astype(F32)
    if name == "pow":
        got, _ = run(lambda x, y: ops.pow(ops.abs(x), y), a, b)
    else:
        got, _ = run(op, a, b)
    close(got, ref(a.astype(np.float64), b.astype(np.float64)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dt", [np.int32, np.int64, F32])
def test_signed_remainders_and_integer_division_by_zero(dt):
    """remainder takes the divisor's sign (np.mod), fmod the dividend's
    (np.fmod); an integer divisor of 0 gives 0 as numpy does, and MIN % -1 is
    0, where the machine's divide would trap and kill the process."""
    a = np.array([7, -7, 7, -7, 5, -5, 0, 3], dt)
    b = np.array([3, 3, -3, -3, 2, -2, 4, 7], dt)
    got, _ = run(lambda x, y: (ops.remainder(x, y), ops.fmod(x, y)), a, b)
    np.testing.assert_array_equal(got[0], np.mod(a, b))
    np.testing.assert_array_equal(got[1], np.fmod(a, b))
    if dt != F32:
        lo = np.iinfo(dt).min
        a = np.array([7, -7, lo, lo], dt)
        b = np.array([0, 0, -1, 0], dt)
        got, _ = run(lambda x, y: (ops.remainder(x, y), ops.fmod(x, y)), a, b)
        np.testing.assert_array_equal(got[0], [0, 0, 0, 0])
        np.testing.assert_array_equal(got[1], [0, 0, 0, 0])


@pytest.mark.parametrize("dt", [np.int32, np.int64])
def test_integer_division_by_constants(dt, rng):
    """Constant divisors are folded as they are emitted: a power of two's
    floored quotient is an arithmetic shift and its floored remainder a mask
    (exact for negative dividends), other constants keep the division."""
    lo, hi = np.iinfo(dt).min, np.iinfo(dt).max
    a = np.concatenate([rng.integers(-1000, 1000, 60), [lo, lo + 1, hi, -1, 0, 1, -8, 8]]).astype(dt)
    fn = lambda x: (x // 8, ops.remainder(x, 8), x // 2, ops.remainder(x, 2), x // -4, ops.remainder(x, -4),  # noqa: E731
                    x // 7, ops.remainder(x, 7), ops.trunc_divide(x, 8), ops.fmod(x, 8))
    got, exe = run(fn, a)
    want = (a // 8, np.mod(a, 8), a // 2, np.mod(a, 2), a // -4, np.mod(a, -4), a // 7, np.mod(a, 7),
            np.fix(a / 8).astype(dt) if dt == np.int32 else np.sign(a) * (np.abs(a.astype(object)) // 8),
            np.fmod(a, 8))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, np.asarray(w).astype(dt))
    if TARGET == "cpu":
        assert " ashr " in exe.ir("llvm") and "mul i64 1," not in exe.ir("llvm")


def test_emission_reuses_a_slots_load_until_a_store():
    """Emission loads a slot (an iterator's) once per block: a later load is
    the same value, a store's value is what loads after it read, and a store
    put before the block's end makes the next load read memory again. An
    array's alloca is no slot, and a slot read at another type is loaded."""
    from llvmlite import ir
    from polyjit.codegen.folding import FoldingBuilder
    i64 = ir.IntType(64)
    fn = ir.Function(ir.Module(), ir.FunctionType(i64, [i64]), "f")
    b = FoldingBuilder(fn.append_basic_block("entry"))
    slot = b.alloca(i64)
    b.store(fn.args[0], slot)
    assert b.load(slot) is fn.args[0]
    other = fn.append_basic_block("next")
    b.branch(other)
    b.position_at_end(other)
    first = b.load(slot)
    assert isinstance(first, ir.LoadInstr)  # (nothing known across blocks: a loop's head loads again)
    assert b.load(slot) is first and b.mul(b.load(slot), ir.Constant(i64, 3)) is b.mul(first, ir.Constant(i64, 3))
    b.store(ir.Constant(i64, 7), slot)
    assert b.load(slot).constant == 7
    b.position_before(other.instructions[-1])
    b.store(ir.Constant(i64, 9), slot)  # (before the block's last store)
    b.position_at_end(other)
    again = b.load(slot)
    assert again is not first and isinstance(again, ir.LoadInstr)
    assert isinstance(b.load(slot, typ=ir.IntType(32)), ir.LoadInstr)
    row = b.alloca(i64, size=4)
    b.store(again, row)
    assert isinstance(b.load(row), ir.LoadInstr)
    b.ret(again)


def test_float32_fmod_and_remainder_are_exact_at_every_magnitude(rng, monkeypatch):
    """float32 fmod is exact (as C's) for any pair of floats, quotients up
    to 2^277, subnormals, exact and near multiples, signed zeros and the
    special values; remainder takes the divisor's sign. With a constant
    divisor too (which needs fewer steps), and in vector code on the host,
    not a C library call per element (for a kernel of any size: one this
    small would otherwise have plain loops)."""
    from polyjit.codegen import cpu_mapping
    monkeypatch.setattr(cpu_mapping, "PLAIN_WORK", 0)
    bits = rng.integers(0, 2 ** 32, 50000, dtype=np.uint64).astype(np.uint32).view(F32)
    a, b = bits[:25000].copy(), bits[25000:].copy()
    y = rng.uniform(0.1, 10, 2000).astype(F32)
    k = rng.integers(1, 1 << 20, 2000).astype(F32)
    near = np.nextafter(k * y, np.where(rng.random(2000) < 0.5, np.inf, -np.inf).astype(F32))
    special = np.array([0, -0.0, np.inf, -np.inf, np.nan, 2 ** -149, 3.4e38, -1, 7], F32)
    sx, sy = (m.ravel() for m in np.meshgrid(special, special))
    x = np.concatenate([a, k * y, near, sx])
    d = np.concatenate([b, y, y, sy])
    got, exe = run(lambda u, v: (ops.fmod(u, v), ops.remainder(u, v), ops.fmod(u, 6.2831855)), x, d)
    with np.errstate(all="ignore"):
        want = (np.fmod(x, d), np.mod(x, d), np.fmod(x, np.float32(6.2831855)))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)  # (NaN where NaN)
    for g, w in (got[0], want[0]), (got[2], want[2]):  # (a zero remainder keeps x's sign, as torch's and JAX's)
        assert (np.signbit(g) == np.signbit(w))[~np.isnan(w)].all()
    if TARGET == "cpu":
        assert "frem" not in exe.ir("llvm") and "x double>" in exe.ir("llvm_opt")


@pytest.mark.parametrize("dt", [np.int32, np.int64, F32, np.float64])
def test_floor_and_trunc_divide(dt, rng):
    """Integer quotients are exact at any magnitude (not through floats);
    float floor division follows numpy's remainder-based rounding."""
    if dt in (np.int32, np.int64):
        big = np.iinfo(dt).max // 3
        a = np.concatenate([rng.integers(-50, 50, 40), [big, -big, big - 1, 7, -7]]).astype(dt)
        b = np.concatenate([rng.choice([-7, -3, -1, 1, 2, 5], 40), [3, 7, -5, 0, 0]]).astype(dt)
        want_floor = np.where(b == 0, 0, np.floor_divide(a, np.where(b == 0, 1, b)))
        want_trunc = np.where(b == 0, 0, np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(np.where(b == 0, 1, b))))
    else:
        a = (rng.standard_normal(64) * 10).astype(dt)
        b = np.where(rng.random(64) < 0.5, -1, 1) * rng.uniform(0.1, 3, 64).astype(dt)
        want_floor, want_trunc = np.floor_divide(a, b), np.trunc(a / b)
    got, _ = run(lambda x, y: (x // y, ops.trunc_divide(x, y)), a, b)
    np.testing.assert_array_equal(got[0], want_floor.astype(dt))
    np.testing.assert_array_equal(got[1], want_trunc.astype(dt))


def test_maximum_propagates_nan():
    a = np.array([np.nan, 1.0, 2.0], F32)
    b = np.array([0.0, np.nan, 1.0], F32)
    got, _ = run(ops.maximum, a, b)
    np.testing.assert_array_equal(got, np.maximum(a, b))


@pytest.mark.parametrize("name", ["eq", "ne", "lt", "le", "gt", "ge"])
def test_comparisons(name, rng):
    a = rng.integers(0, 3, size=(4, 50)).astype(F32)
    b = rng.integers(0, 3, size=(50,)).astype(F32)
    a[0, 0] = np.nan
    got, _ = run(getattr(ops, name), a, b)
    close(got, getattr(np, {"eq": "equal", "ne": "not_equal", "lt": "less", "le": "less_equal",
                            "gt": "greater", "ge": "greater_equal"}[name])(a, b))


def test_logical_and_where(rng):
    a, b = rng.random((3, 40)) > 0.5, rng.random((3, 40)) > 0.5
    x, y = rng.standard_normal((3, 40)).astype(F32), rng.standard_normal((40,)).astype(F32)
    got, _ = run(lambda p, q, u, v: (ops.logical_and(p, q), ops.logical_or(p, q), ops.logical_xor(p, q),
                                     ops.logical_not(p), ops.where(p, u, v)), a, b, x, y)
    close(got[0], a & b); close(got[1], a | b); close(got[2], a ^ b); close(got[3], ~a)
    close(got[4], np.where(a, x, y))


@pytest.mark.parametrize("dtype", [np.uint32, np.int32, np.int64, np.uint64])
def test_bitwise_and_shifts(dtype, rng):
    """Integers' bits as numpy's; a shift by the width or more gives 0 (the
    sign for an arithmetic one), as in JAX; unsigned compare, divide, widen."""
    info = np.iinfo(dtype)
    a = rng.integers(info.min, info.max, (5, 40), dtype=dtype, endpoint=True)
    b = rng.integers(info.min, info.max, (5, 40), dtype=dtype, endpoint=True)
    bits = 8 * a.itemsize
    s = rng.integers(0, bits + 8, (5, 40)).astype(dtype)
    got, _ = run(lambda x, y, k: (ops.bitwise_and(x, y), ops.bitwise_or(x, y), ops.bitwise_xor(x, y),
                                  ops.bitwise_not(x), ops.shift_left(x, k), ops.shift_right_logical(x, k),
                                  ops.shift_right_arithmetic(x, k), ops.lt(x, y), ops.maximum(x, y)), a, b, s)
    u, i = a.view(np.dtype(f"u{a.itemsize}")), a.view(np.dtype(f"i{a.itemsize}"))
    small = s < bits
    sk = np.where(small, s, 0).astype(u.dtype)
    want = [a & b, a | b, a ^ b, ~a, np.where(small, (u << sk).view(dtype), 0),
            np.where(small, (u >> sk).view(dtype), 0),
            (i >> np.where(small, s, bits - 1).astype(i.dtype)).view(dtype),  # on the bits, signed
            a < b, np.maximum(a, b)]
    for g, w in zip(got, want):
        close(g, np.asarray(w).astype(g.dtype))


def _philox(counter: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Philox-4x32-10 (Salmon et al.) of uint32 counters [..., 4] under a key [2], in numpy."""
    c, k = [counter[..., i].astype(np.uint64) for i in range(4)], [np.uint64(x) for x in key]
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k[0], p1 & np.uint64(0xFFFFFFFF),
             (p0 >> np.uint64(32)) ^ c[3] ^ k[1], p0 & np.uint64(0xFFFFFFFF)]
        k = [(k[0] + np.uint64(0x9E3779B9)) & np.uint64(0xFFFFFFFF),
             (k[1] + np.uint64(0xBB67AE85)) & np.uint64(0xFFFFFFFF)]
    return np.stack(c, -1).astype(np.uint32)


@pytest.mark.parametrize("low", [5, 2 ** 64 - 3])  # (near 2**64: the 128-bit counter carries)
def test_philox_bits_are_tensorflows_draws(low):
    """Element p: word p mod 4 of Philox at the counter plus p div 4."""
    key, counter = np.array([0x1234567890ABCDEF], np.uint64), np.array([low, 7], np.uint64)
    got, _ = run(lambda k, c: ops.philox_bits(k, c, [3, 9]), key, counter)
    groups = [7 * 2 ** 64 + low + g for g in range(7)]  # the 128-bit counter of each group of four
    words = np.array([[(v >> (32 * i)) & 0xFFFFFFFF for i in range(4)] for v in groups], np.uint32)
    k = int(key[0])
    want = _philox(words, [k & 0xFFFFFFFF, k >> 32]).reshape(-1)[:27].reshape(3, 9)
    close(got, want)


def test_erf_inv(rng):
    special = pytest.importorskip("scipy.special")
    x = np.concatenate([rng.uniform(-0.9999, 0.9999, 3000), [-1, 1, 1.5, -2, 0, np.nan]]).astype(F32)
    got, _ = run(ops.erf_inv, x)
    close(got, special.erfinv(x.astype(np.float64)), rtol=2e-5, atol=1e-6)


def test_unsigned_and_bitcast(rng):
    a = rng.integers(0, 2 ** 32, (4, 9), dtype=np.uint32)
    b = rng.integers(1, 2 ** 32, (4, 9), dtype=np.uint32)
    f = rng.standard_normal((4, 9)).astype(F32)
    got, _ = run(lambda x, y, z: (ops.div(ops.cast(x, "int64"), 1) * 0 + ops.cast(x, "int64"),
                                  ops.cast(x, "float32"), ops.bitcast(z, "uint32"), ops.bitcast(x, "float32"),
                                  ops.remainder(x, y)), a, b, f)
    close(got[0], a.astype(np.int64))
    close(got[1], a.astype(F32), rtol=0, atol=0)
    close(got[2], f.view(np.uint32))
    np.testing.assert_array_equal(got[3].view(np.uint32), a)  # NaN payloads too
    close(got[4], a % b)


@pytest.mark.parametrize("src,dst", [(np.float32, np.int32), (np.float32, np.int64), (np.int32, np.float32),
                                     (np.float64, np.float32), (np.float32, np.float16), (np.float16, np.float64),
                                     (np.int64, np.int32), (np.float32, np.bool_), (np.bool_, np.float32),
                                     (np.uint32, np.float64), (np.uint32, np.int64),
                                     (np.int32, np.uint64)])  # (sign-extended, as numpy and C++)
def test_cast(src, dst, rng):
    x = (rng.standard_normal((9, 17)) * 100).astype(src)
    got, _ = run(lambda t: ops.cast(t, dst), x)
    close(got, x.astype(dst), rtol=0, atol=0)


def test_bfloat16_rounds_to_nearest_even_and_computes_in_float32(rng):
    """bfloat16 held as its 16 bits: a float32 rounds to the nearest, ties to
    even (ties, overflow to inf, subnormals, inf and NaN among the inputs),
    as ml_dtypes rounds; arithmetic on bfloat16 computes in float32 and
    rounds where it stores."""
    bf16 = ml_dtypes.bfloat16
    bits = rng.integers(0, 1 << 32, 4000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 1 << 16, 64, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000
    edge = np.array([0x7F7FFFFF, 0x7F7F8000, 0x00008000, 0x00000001, 0x7F800000, 0xFF800000, 0x7FC00000, 0],
                    np.uint32)
    x = np.concatenate([bits, ties, edge]).view(F32)
    x = np.where(np.isnan(x), np.float32(np.nan), x)  # (a NaN rounds to 0x7FC0 whatever its sign and payload)
    got, _ = run(lambda t: ops.cast(t, "bfloat16"), x)
    assert got.dtype == np.dtype(bf16)
    np.testing.assert_array_equal(got.view(np.uint16), x.astype(bf16).view(np.uint16))
    a = (rng.standard_normal((6, 70)) * 10).astype(bf16)
    b = (rng.standard_normal((6, 70)) * 10).astype(bf16)
    got, _ = run(lambda x, y: x * y + x - y, a, b)
    want = (a.astype(F32) * b.astype(F32) + a.astype(F32) - b.astype(F32)).astype(bf16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64])
def test_dtypes_arithmetic(dtype, rng):
    a = (rng.standard_normal((6, 70)) * 10).astype(dtype)
    b = (rng.standard_normal((6, 70)) * 10).astype(dtype)
    got, _ = run(lambda x, y: x * y + x - y, a, b)
    tol = 1e-3 if dtype == np.float16 else 1e-6
    want = (a.astype(np.float64) * b + a - b)
    assert got.dtype == np.dtype(dtype)
    close(got, want.astype(dtype) if dtype in (np.int32, np.int64) else want, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16])
def test_narrow_integers_wrap_promote_and_reduce_as_numpy(dtype, rng):
    """8- and 16-bit integers (images as uint8): arithmetic wraps around;
    uint8 with int8 gives int16; max and min start from the type's own
    extremes (uint8's lowest is 0); sums accumulate in int64, as torch's."""
    info = np.iinfo(dtype)
    a, b = (rng.integers(info.min, info.max, (6, 70), endpoint=True).astype(dtype) for _ in range(2))
    got, _ = run(lambda x, y: x * y + x - y, a, b)
    with np.errstate(over="ignore"):
        close(got, a * b + a - b)
    (hi, lo, total), _ = run(lambda x: (ops.max(x, [1]), ops.min(x, [1]), ops.sum(x)), a)
    close(hi, a.max(1))
    close(lo, a.min(1))
    small = (a % 16).astype(dtype)  # (below the middle of uint8's range, where a signed start would sit)
    (hi, lo), _ = run(lambda x: (ops.max(x, [1]), ops.min(x, [1])), small)
    close(hi, small.max(1))
    close(lo, small.min(1))
    assert total.dtype == np.int64 and total == a.astype(np.int64).sum()
    other = np.int8 if dtype == np.uint8 else np.uint8
    c = rng.integers(0, 100, (6, 70)).astype(other)
    mixed, _ = run(lambda x, y: x + y, a, c)
    assert mixed.dtype == np.result_type(dtype, other)
    close(mixed, a.astype(mixed.dtype) + c)
    f, _ = run(lambda x: ops.cast(x, F32) / 255.0, a)
    close(f, a.astype(F32) / 255.0)


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("axes,keep", [((1,), False), ((0, 2), True), (None, False), ((-1,), True)])
def test_reductions(op, axes, keep, rng):
    x = rng.uniform(0.5, 1.5, size=(6, 33, 19)).astype(F32)
    got, _ = run(lambda t: getattr(ops, op)(t, list(axes) if axes else None, keep), x, symbolic=True)
    want = getattr(np, {"sum": "sum", "max": "max", "min": "min", "prod": "prod"}[op])(
        x.astype(np.float64), axis=axes, keepdims=keep)
    close(got, want, rtol=1e-5, atol=1e-5)


def test_reduction_large_and_nan(rng):
    x = rng.standard_normal((3, 5000)).astype(F32)
    x[1, 17] = np.nan
    got, _ = run(lambda t: (ops.sum(t, [1]), ops.max(t, [1])), x)
    close(got[0], x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-4)
    close(got[1], x.max(1))


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape,axes", [((64, 3, 128, 128), [0, 2, 3]), ((32, 56, 56, 64), [0, 1, 2])],
                         ids=["nchw", "nhwc"])
def test_sums_of_many_values_a_result_are_near_exact(shape, axes, symbolic, rng):
    """A batch norm's per-channel sums over 100000 positive values or more
    (NCHW and NHWC, sizes known or not): near float64's, as numpy's
    pairwise sums are; added in one running sum a channel, the NCHW ones
    were 1.7e-4 off, the NHWC ones 5e-6 (1.2e-5 with symbolic sizes)."""
    x = (0.1 + 0.001 * rng.standard_normal(shape)).astype(F32)
    got, _ = run(lambda t: ops.sum(t, axes), x, symbolic=symbolic)
    close(got, x.astype(np.float64).sum(tuple(axes)), rtol=2e-6, atol=0)


def test_a_sum_of_broadcast_products_is_not_cascaded_through_a_larger_array(rng):
    """A sum of 8192 broadcast products into each result (a product written
    as one): cascading it would first store a 256 x 128 x 256 array, larger
    than either factor, so it is summed whole, with no temporary."""
    a, b = rng.standard_normal((256, 128, 64)).astype(F32), rng.standard_normal((128, 64, 256)).astype(F32)
    got, exe = run(lambda a, b: ops.sum(ops.reshape(a, [256, 128, 64, 1]) * ops.reshape(b, [1, 128, 64, 256]),
                                        [1, 2]), a, b)
    assert exe.stats["intermediate_bytes"] == 0
    close(got, np.einsum("ikl,klj->ij", a.astype(np.float64), b), rtol=1e-4, atol=1e-2)  # (sums of scale 90)


@pytest.mark.parametrize("op", ["argmax", "argmin"])
def test_argreduce(op, rng):
    x = rng.integers(0, 5, size=(7, 40)).astype(F32)
    x[3, 9] = np.nan
    got, _ = run(lambda t: getattr(ops, op)(t, 1), x)
    close(got, getattr(np, op)(x, axis=1))


def test_int_and_bool_reductions(rng):
    x = rng.integers(-50, 50, size=(5, 21)).astype(np.int32)
    b = x > 0
    got, _ = run(lambda t, m: (ops.sum(t, [1]), ops.max(t, [0]), ops.sum(m, [1])), x, b)
    close(got[0], x.sum(1)); close(got[1], x.max(0)); close(got[2], b.sum(1))


def test_bools_add_and_compare_as_numpy(rng):
    """True + True is True (an or), and True > False (bools compare unsigned)."""
    m, n = rng.random(40) > 0.5, rng.random(40) > 0.5
    got, _ = run(lambda a, b: (a + b, a * b, a > b, a <= b, ops.maximum(a, b), ops.max(ops.cat([ops.reshape(a, [1, 40]), ops.reshape(b, [1, 40])]), [0])), m, n)
    for g, want in zip(got, (m + n, m * n, m > n, m <= n, np.maximum(m, n), np.maximum(m, n))):
        np.testing.assert_array_equal(g, want)


def test_layout_ops(rng):
    x = rng.standard_normal((4, 6, 10)).astype(F32)
    y = rng.standard_normal((4, 6, 3)).astype(F32)
    got, _ = run(lambda t, u: (
        ops.permute(t, [2, 0, 1]),
        ops.reshape(t, [24, 10]),
        ops.reshape(t, [4, 60]),
        ops.slice(t, [1, 0, 2], [4, 6, 10], [2, 1, 3]),
        ops.pad(t, [1, 2, 0, 0, 3, 0], 7.0),
        ops.cat([t, u], 2),
        ops.reverse(t, [0, 2]),
        ops.broadcast_in_dim(ops.sum(t, [1]), [4, 5, 10], [0, 2]),
        t[1:, ::2, -1],
    ), x, y)
    close(got[0], x.transpose(2, 0, 1)); close(got[1], x.reshape(24, 10)); close(got[2], x.reshape(4, 60))
    close(got[3], x[1:4:2, :, 2::3])
    close(got[4], np.pad(x, ((3, 0), (0, 0), (1, 2)), constant_values=7.0))
    close(got[5], np.concatenate([x, y], 2)); close(got[6], x[::-1, :, ::-1])
    close(got[7], np.broadcast_to(x.sum(1)[:, None, :], (4, 5, 10)), rtol=1e-5, atol=1e-5)
    close(got[8], x[1:, ::2, -1])


def test_symbolic_reshape_and_concat(rng):
    x = rng.standard_normal((5, 3, 4)).astype(F32)
    got, exe = run(lambda t: (ops.reshape(t, [t.shape[0], 12]), ops.cat([t, t * 2], 0)), x, symbolic=False)
    infos = [InputInfo([-1, 3, 4], F32)]
    exe = polyjit.compile(lambda t: (ops.reshape(t, [t.shape[0], 12]), ops.cat([t, t * 2], 0)), infos)
    for n in (1, 5, 9):
        a = rng.standard_normal((n, 3, 4)).astype(F32)
        r = exe(a)
        close(r[0], a.reshape(n, 12)); close(r[1], np.concatenate([a, 2 * a], 0))


def test_symbolic_leading_size_merges_and_splits(rng):
    """A symbolic leading size merges with static ones and splits off again
    (a flatten and its inverse, -1 inferred); a reshape whose -1 would be
    4s / floor(s / 2) is refused, not miscompiled."""
    def fn(t):
        flat = ops.reshape(t, [t.shape[0] * 3, -1])
        return flat * 2, ops.reshape(flat, [-1, 12]) + 1, ops.reshape(t, [-1])
    exe = polyjit.compile(fn, [InputInfo([-1, 3, 4], F32)])
    for n in (1, 5, 9):
        a = rng.standard_normal((n, 3, 4)).astype(F32)
        r = exe(a)
        close(r[0], a.reshape(n * 3, 4) * 2)
        close(r[1], a.reshape(n, 12) + 1)
        close(r[2], a.reshape(-1))
    with pytest.raises(polyjit.errors.DefinitionError, match="cannot infer"):
        polyjit.compile(lambda t: ops.reshape(t, [t.shape[0] // 2, -1]), [InputInfo([-1, 4], F32)])


def test_symbolic_sizes_merge_into_a_product(rng):
    """Two symbolic sizes merged ([b, s, 4] as [b*s, 4]: b*s a size of its
    own, the reshapes' indices divided by s at run time) through a product
    (the library's, at sizes known at run time) and back, a sum over the
    merged dim and a flatten; one program for every size, NaN kept."""
    def fn(t, w):
        flat = ops.reshape(t, [t.shape[0] * t.shape[1], 4])
        y = ops.matmul(flat, w)
        return ops.reshape(y, [t.shape[0], t.shape[1], 3]) + 1, ops.sum(flat, [0]), ops.reshape(t * 2, [-1])
    exe = polyjit.compile(fn, [InputInfo([-1, -1, 4], F32), InputInfo([4, 3], F32)], {"target": TARGET})
    w = rng.standard_normal((4, 3)).astype(F32)
    for b, n in ((1, 1), (2, 5), (3, 4), (7, 2)):
        a = rng.standard_normal((b, n, 4)).astype(F32)
        a[-1, -1, 0] = np.nan
        y, total, flat = exe(a, w)
        close(y, a @ w + 1)
        close(total, a.reshape(-1, 4).sum(0))
        close(flat, a.reshape(-1) * 2)
    assert exe.stats["library_calls"] == 1
    total = polyjit.compile(lambda t: ops.sum(ops.reshape(t, [t.shape[0] * t.shape[1], 4]), [0]),
                            [InputInfo([-1, -1, 4], F32)], {"target": TARGET})  # (b*s bounds a loop only)
    close(total(a), a.reshape(-1, 4).sum(0))


def test_scatter_last_of_repeated_indices_wins(rng):
    """ops.scatter writes src[i] at index[i] along an axis; of repeated
    indices the last along the axis wins, as numpy's fancy assignment does
    (the frameworks leave it undefined); NaN, -0.0 and inf pass unchanged;
    scatter_reduce combines repeats by each op."""
    x = rng.standard_normal((3, 7)).astype(F32)
    src = rng.standard_normal((3, 9)).astype(F32)
    src[0, 4], src[1, 0], src[2, 8] = np.nan, -0.0, np.inf
    index = rng.integers(0, 7, (3, 9))
    exe = polyjit.compile(lambda x, i, s: (ops.scatter(x, i, s, 1), ops.scatter_reduce("max", [3, 7], i, s, 1, True),
                                           ops.scatter_reduce("prod", [3, 7], i, s, 1, True)),
                          [InputInfo(x.shape, F32), InputInfo(index.shape, np.int64), InputInfo(src.shape, F32)])
    got, top, prod = exe(x, index, src)
    want, wtop, wprod = x.copy(), np.full((3, 7), -np.inf, F32), np.ones((3, 7), F32)
    for r in range(3):
        want[r, index[r]] = src[r]
        for k in range(9):
            wtop[r, index[r, k]] = np.maximum(wtop[r, index[r, k]], src[r, k])
            wprod[r, index[r, k]] *= src[r, k]
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))
    np.testing.assert_array_equal(top, wtop)
    close(prod, wprod)


def test_strided_windows_over_symbolic_sizes(rng):
    """Strides over a symbolic size give floor-quotient sizes ((s - 3) // 2 + 1),
    parameters derived from s at each call: strided slices, pooling windows
    (whose flat positions multiply by the symbolic width) and a mean over
    symbolic sizes, one program for every size, odd and even."""
    def fn(t):
        pooled, where = ops.max_pool_with_positions(t, [3, 3], [2, 2], [1, 1])
        return t[:, 1::2, ::3] * 2.0, pooled, where, ops.mean(pooled, [1, 2])
    exe = polyjit.compile(fn, [InputInfo([2, -1, -1], F32)])
    for h, w in ((1, 1), (5, 8), (9, 7), (16, 13)):
        a = rng.standard_normal((2, h, w)).astype(F32)
        a[0, 0, 0] = np.nan
        sl, pooled, where, mean = exe(a)
        close(sl, a[:, 1::2, ::3] * 2)
        ap = np.pad(a, ((0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
        oh, ow = (h - 1) // 2 + 1, (w - 1) // 2 + 1
        wins = np.stack([ap[:, i:i + 2 * oh - 1:2, j:j + 2 * ow - 1:2] for i in range(3) for j in range(3)], -1)
        want = np.where(np.isnan(wins).any(-1), np.nan, wins.max(-1))
        close(pooled, want)
        assert pooled.shape == (2, oh, ow) and where.shape == (2, oh, ow)
        flat = a.reshape(2, -1)
        np.testing.assert_array_equal(flat[np.arange(2)[:, None], where.reshape(2, -1)], want.reshape(2, -1))
        close(mean, want.mean((1, 2)))


def test_a_max_pools_maximum_is_one_window_computed_where_it_is_read(rng):
    """Without its positions, a max pool is one window reduction computed
    inline in its consumer (no running maxima or masks stored); padding
    never wins over negative values, and NaN is the maximum."""
    def fn(t):
        return ops.max_pool_with_positions(t, [3, 3], [2, 2], [1, 1])[0] * 2.0
    exe = polyjit.compile(fn, [InputInfo([2, 3, 9, 8], F32)])
    assert exe.stats["kernels"] == 1 and "temp " not in exe.ir("affine"), exe.ir("affine")
    a = -np.abs(rng.standard_normal((2, 3, 9, 8))).astype(F32) - 1
    a[1, 2, 4, 5] = np.nan
    ap = np.pad(a, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    wins = np.stack([ap[:, :, i:i + 9:2, j:j + 8:2] for i in range(3) for j in range(3)], -1)
    close(exe(a), np.where(np.isnan(wins).any(-1), np.nan, wins.max(-1)) * 2)


@pytest.mark.parametrize("shape_a,shape_b", [((33, 70), (70, 45)), ((3, 20, 30), (3, 30, 7)),
                                             ((2, 1, 5, 8), (4, 8, 3)), ((16,), (16, 9))])
def test_matmul(shape_a, shape_b, rng):
    a = rng.standard_normal(shape_a).astype(F32)
    b = rng.standard_normal(shape_b).astype(F32)
    got, _ = run(ops.matmul, a, b)
    close(got, np.matmul(a.astype(np.float64), b), rtol=1e-5, atol=1e-4)


def test_linear_and_dot_general(rng):
    x = rng.standard_normal((4, 5, 24)).astype(F32)
    w = rng.standard_normal((10, 24)).astype(F32)
    bias = rng.standard_normal((10,)).astype(F32)
    got, _ = run(lambda a, b, c: ops.linear(a, b, c), x, w, bias)
    close(got, x.astype(np.float64) @ w.T + bias, rtol=1e-5, atol=1e-4)


CONVS = [
    dict(stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1), groups=1),
    dict(stride=(2, 2), padding=((1, 1), (1, 1)), dilation=(1, 1), groups=1),
    dict(stride=(1, 2), padding=((2, 2), (0, 0)), dilation=(2, 1), groups=1),
    dict(stride=(1, 1), padding=((1, 1), (1, 1)), dilation=(1, 1), groups=2),
    dict(stride=(1, 1), padding=((1, 1), (1, 1)), dilation=(1, 1), groups=4),
]


@pytest.mark.parametrize("cfg", CONVS)
def test_conv2d(cfg, rng):
    x = rng.standard_normal((2, 4, 11, 13)).astype(F32)
    w = rng.standard_normal((8, 4 // cfg["groups"], 3, 3)).astype(F32)
    got, _ = run(lambda a, b: ops.conv(a, b, cfg["stride"], cfg["padding"], cfg["dilation"], cfg["groups"]), x, w)
    close(got, refs.conv2d(x, w, **cfg), rtol=1e-5, atol=1e-4)


def test_conv_nhwc(rng):
    x = rng.standard_normal((2, 9, 10, 3)).astype(F32)
    w = rng.standard_normal((3, 3, 3, 5)).astype(F32)  # HWIO
    got, _ = run(lambda a, b: ops.conv(a, b, (1, 1), ((1, 1), (1, 1)), layout="NHWC", kernel_layout="HWIO"), x, w)
    want = refs.conv2d(x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1), padding=((1, 1), (1, 1)))
    close(got, want.transpose(0, 2, 3, 1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (3, 2, 1), (3, 1, 1)])
def test_pooling(k, s, p, rng):
    x = rng.standard_normal((2, 3, 12, 9)).astype(F32)
    got, _ = run(lambda t: (ops.max_pool2d(t, k, s, p), ops.avg_pool2d(t, k, s, p)), x)
    close(got[0], refs.pool2d(x, k, s, p, "max"))
    close(got[1], refs.pool2d(x, k, s, p, "sum") / (k * k), rtol=1e-5, atol=1e-5)


def test_an_exclusive_scan_over_an_empty_axis_is_empty(rng):
    x = rng.standard_normal((3, 0)).astype(F32)
    got, _ = run(lambda t: ops.cumulative("sum", t, 1, exclusive=True), x)
    assert got.shape == (3, 0)


def test_cumsum(rng):
    x = rng.standard_normal((6, 50)).astype(F32)
    got, _ = run(lambda t: (ops.cumsum(t, 1), ops.cumsum(t, 0)), x, symbolic=True)
    close(got[0], np.cumsum(x.astype(np.float64), 1), rtol=1e-5, atol=1e-4)
    close(got[1], np.cumsum(x.astype(np.float64), 0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("eq,shapes", [
    ("bij,bjk->bik", [(3, 4, 5), (3, 5, 2)]), ("ij,jk", [(4, 5), (5, 6)]),
    ("bqhd,bkhd->bhqk", [(2, 3, 4, 5), (2, 6, 4, 5)]), ("...ij,...jk->...ik", [(2, 3, 4, 5), (2, 3, 5, 2)]),
    ("ijk->ki", [(2, 3, 4)]), ("ij,ij->i", [(3, 4), (3, 4)]), ("i,j->ij", [(3,), (4,)]),
    ("abc,b->ac", [(2, 3, 4), (3,)]), ("ab,bc->", [(2, 3), (3, 4)])])
def test_einsum(eq, shapes, rng):
    xs = [rng.standard_normal(s).astype(F32) for s in shapes]
    got, _ = run(lambda *t: ops.einsum(eq, *t), *xs)
    close(got, np.einsum(eq, *[x.astype(np.float64) for x in xs]), rtol=1e-5, atol=1e-5)


def test_sort_and_topk(rng):
    """Stable sorts both ways with NaN as the largest value, ties in their
    original order, integers."""
    x = rng.standard_normal((4, 9)).astype(F32)
    x[0, 2], x[1, :3], x[2, 1], x[2, 4] = np.nan, 1.0, np.inf, -np.inf
    n = rng.integers(0, 4, (5, 7)).astype(np.int32)
    got, _ = run(lambda t, i: ops.sort(t, 1) + ops.sort(t, 0, descending=True) + ops.topk(t, 3, 1)
                 + ops.sort(i, 1), x, n)
    close(got[0], np.sort(x, 1))
    close(got[1], np.argsort(x, 1, kind="stable"))
    order = np.argsort(-np.where(np.isnan(x), np.inf, x), 0, kind="stable")
    close(got[3], order)
    close(got[2], np.take_along_axis(x, order, 0))
    best = np.argsort(-np.where(np.isnan(x), np.inf, x), 1, kind="stable")[:, :3]
    close(got[5], best)
    close(got[4], np.take_along_axis(x, best, 1))
    close(got[6], np.sort(n, 1))
    close(got[7], np.argsort(n, 1, kind="stable"))


def test_cumulative_products_maxima_minima(rng):
    """Running products, maxima and minima; a NaN carries on from where it
    appears (as numpy's fmax would not: np.maximum.accumulate does)."""
    x = (rng.standard_normal((4, 30)) * 0.3 + 1).astype(F32)
    x[1, 7], x[2, 0] = np.nan, -np.inf
    n = rng.integers(-3, 4, (4, 30)).astype(np.int32)
    got, _ = run(lambda t, i: (ops.cumprod(t, 1), ops.cummax(t, 1), ops.cummin(t, 0), ops.cummax(i, 1),
                               ops.cumprod(i, 1)), x, n)
    close(got[0], np.cumprod(x.astype(np.float64), 1), rtol=1e-5, atol=1e-6)
    close(got[1], np.maximum.accumulate(x, 1))
    close(got[2], np.minimum.accumulate(x, 0))
    close(got[3], np.maximum.accumulate(n, 1))
    assert got[4].dtype == np.int64
    close(got[4], np.cumprod(n.astype(np.int64), 1))


def test_gather_and_scatter_add(rng):
    table = rng.standard_normal((20, 8)).astype(F32)
    idx = rng.integers(0, 20, size=(5, 3)).astype(np.int64)
    src = rng.standard_normal((15, 8)).astype(F32)
    flat = idx.reshape(-1)
    got, _ = run(lambda t, i, s, f: (ops.index_select(t, 0, i), ops.embedding(i, t),
                                     ops.scatter_add([20, 8], f, s, 0)), table, idx, src, flat)
    close(got[0], table[idx]); close(got[1], table[idx])
    want = np.zeros((20, 8)); np.add.at(want, flat, src)
    close(got[2], want, rtol=1e-5, atol=1e-5)


def test_scatter_into_a_few_slices_is_a_reduction_per_slice(rng):
    """Many updates into at most FEW_TARGETS slices (BERT's token types)
    reduce per slice instead of scattering: no update waits on another.
    Indices wrap and clamp as a scatter's; NaN stays in its slice; max and
    min start from their identity."""
    src = rng.standard_normal((3, 40, 5)).astype(F32)
    src[1, 7, 2] = np.nan
    idx = rng.integers(-3, 3, size=(40,)).astype(np.int64)
    got, exe = run(lambda i, s: (ops.scatter_add([3, 3, 5], i, s, 1), ops.scatter_reduce("max", [3, 3, 5], i, s, 1)),
                   idx, src)
    assert "scatter" not in exe.ir("graph")
    pos = np.where(idx < 0, idx + 3, idx)
    want_sum, want_max = np.zeros((3, 3, 5)), np.full((3, 3, 5), -np.inf)
    for j, p in enumerate(pos):
        want_sum[:, p] += src[:, j]
        want_max[:, p] = np.fmax(want_max[:, p], src[:, j])
    want_max[1, pos[7], 2] = np.nan
    close(got[0], want_sum, rtol=1e-5, atol=1e-5)
    close(got[1], want_max)
    sym = polyjit.compile(lambda i, s: ops.scatter_add([3, 3, 5], i, s, 1),
                          [InputInfo([-1], np.int64), InputInfo([3, -1, 5], F32)], {"target": TARGET})
    assert "scatter" not in sym.ir("graph")  # (a symbolic count of updates: many, at its estimate)
    close(sym(idx, src), want_sum, rtol=1e-5, atol=1e-5)


def test_take_and_scatter_along_axis(rng):
    x = rng.standard_normal((6, 9)).astype(F32)
    idx = rng.integers(0, 9, size=(6, 4)).astype(np.int64)
    src = rng.standard_normal((6, 4)).astype(F32)
    got, _ = run(lambda t, i, s: (ops.take_along_axis(t, i, 1), ops.scatter_add([6, 9], i, s, 1, along=True)),
                 x, idx, src)
    close(got[0], np.take_along_axis(x, idx, 1))
    want = np.zeros((6, 9))
    for r in range(6):
        np.add.at(want[r], idx[r], src[r])
    close(got[1], want, rtol=1e-5, atol=1e-5)


def test_scatter_to_positions_computed_from_data(rng):
    """A scatter position computed inline from float data (constants such as
    inf included) is a data-dependent write, not an affine index."""
    x = rng.uniform(0, 2.99, size=40).astype(F32)
    src = rng.standard_normal(40).astype(F32)
    got, _ = run(lambda t, s: ops.scatter_add([3], ops.cast(ops.minimum(ops.floor(t), float("inf")), "int64"), s, 0,
                                              along=True), x, src)
    want = np.zeros(3)
    np.add.at(want, np.floor(x).astype(np.int64), src)
    close(got, want, rtol=1e-5, atol=1e-5)


def test_iota_and_random(rng):
    x = rng.standard_normal((64, 1000)).astype(F32)
    seed = np.asarray(1234, np.int64)
    got, _ = run(lambda t, s: (ops.iota(t.shape, 1, like=t), ops.rand_uniform(t.shape, s, like=t),
                               ops.rand_uniform(t.shape, s, like=t), ops.rand_uniform(t.shape, s, 7, like=t)), x, seed)
    close(got[0], np.broadcast_to(np.arange(1000), (64, 1000)))
    u = got[1]
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01 and abs(u.std() - math.sqrt(1 / 12)) < 0.01
    np.testing.assert_array_equal(got[1], got[2])
    assert not np.array_equal(got[1], got[3])


def test_dropout_statistics(rng):
    x = rng.uniform(1, 2, size=(256, 512)).astype(F32)
    got, _ = run(lambda t, s: ops.dropout(t, 0.3, s), x, np.asarray(7, np.int64))
    kept = got != 0
    assert abs(kept.mean() - 0.7) < 0.01
    np.testing.assert_allclose(got[kept], x[kept] / 0.7, rtol=1e-6)


def test_composites(rng):
    x = rng.standard_normal((8, 300)).astype(F32)
    got, _ = run(lambda t: (ops.softmax(t), ops.log_softmax(t), ops.layer_norm(t, [300]), ops.gelu(t),
                            ops.gelu(t, "tanh"), ops.silu(t), ops.rms_norm(t, [300])), x)
    xd = x.astype(np.float64)
    close(got[0], refs.softmax(xd)); close(got[1], np.log(refs.softmax(xd)), atol=1e-5)
    close(got[2], refs.layer_norm(xd), rtol=1e-4, atol=1e-5); close(got[3], refs.gelu(xd), atol=1e-6)
    tanh_gelu = 0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    close(got[4], tanh_gelu, atol=1e-6); close(got[5], xd / (1 + np.exp(-xd)), atol=1e-6)
    close(got[6], xd / np.sqrt((xd ** 2).mean(-1, keepdims=True) + 1e-6), rtol=1e-4, atol=1e-5)


def test_zero_size_dimensions(rng):
    x = np.zeros((0, 7), F32)
    got, _ = run(lambda t: (t * 2, ops.sum(t, [0]), ops.max(t, [1])), x, symbolic=True)
    assert got[0].shape == (0, 7)
    close(got[1], np.zeros(7)); assert got[2].shape == (0,)


def test_strided_inputs(rng):
    base = rng.standard_normal((20, 30)).astype(F32)
    exe = polyjit.compile(lambda a, b: a * 2 + b, [InputInfo([-1, -1], F32)] * 2)
    for a, b in [(base[::2, 1::3], base[1::2, ::3]), (base.T[:9, :7], base[:9, :7]), (base[:, ::-1], base)]:
        close(exe(a, b), a.astype(np.float64) * 2 + b)


def test_scalar_output_and_input(rng):
    x = rng.standard_normal((10,)).astype(F32)
    got, _ = run(lambda t: ops.sum(t), x)
    assert got.shape == ()
    close(got, x.astype(np.float64).sum(), atol=1e-5)


def test_same_value_returned_twice(rng):
    x = rng.standard_normal((3, 7)).astype(F32)
    got, _ = run(lambda t: (lambda e: (e, t, e + 1, e))(ops.exp(t)), x)
    close(got[0], np.exp(x.astype(np.float64))); close(got[1], x); close(got[2], np.exp(x.astype(np.float64)) + 1)
    close(got[3], np.exp(x.astype(np.float64)))


def test_outputs_that_are_constants():
    """A graph may return a value never materialized otherwise (a folded scalar)."""
    from polyjit.api import Executable
    from polyjit.graph import Graph
    from polyjit.options import parse_options
    g = Graph()
    x = g.input([4], "float32")
    for out in (g.binary("add", x, x), g.constant(2.0, "float32"), g.broadcast_in_dim(g.constant(3, "int32"), (2, 3), [])):
        g.add_output(out)
    a, b, c = Executable(g, parse_options({"target": TARGET}), "consts")(np.ones(4, F32))
    close(a, np.full(4, 2.0, F32)); close(b, np.float32(2.0)); close(c, np.full((2, 3), 3, np.int32))


def test_a_scalar_op_of_a_transpose_runs_in_the_operands_order(rng):
    """k.T * scale (SDPA's scaled keys) is (k * scale).T: computed in k's
    order, the transpose left for its reader; values as before."""
    from polyjit.graph import Graph
    g = Graph()
    k = g.input([4, 6], "float32")
    out = g.binary("mul", g.transpose(k, (1, 0)), g.broadcast_in_dim(g.constant(0.5, "float32"), (6, 4), []))
    assert out.op == "transpose" and out.inputs[0].op == "mul" and out.inputs[0].inputs[0] is k
    x = rng.standard_normal((4, 6)).astype(F32)
    got, _ = run(lambda t: 2.0 - ops.transpose(t, 0, 1), x)
    close(got, 2.0 - x.T)


@pytest.mark.parametrize("n", [2.0, 3.0, 4.0, 2.5])
def test_small_integer_powers_are_products(n, rng):
    """x ** 2, 3, 4 (GELU's tanh form cubes its input) are products, not
    calls to pow, with pow's values, NaN and infinities included."""
    x = np.concatenate([rng.uniform(-10, 10, 500), [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e20, -1e20]]).astype(F32)
    got, exe = run(lambda t: ops.pow(t, n), x)
    with np.errstate(all="ignore"):
        want = np.power(x.astype(np.float64), n).astype(F32)  # (overflows to inf as float32 does)
    close(got, want, rtol=2e-6 if n != 2.5 else 1e-5, atol=0)  # (2.5: pow itself, the GPU's composed one)
    if TARGET == "cpu":
        assert ("llvm.pow" in exe.ir("llvm")) == (n == 2.5)


def test_a_softmax_divides_once_a_row(rng):
    """ops.softmax and torch's decomposition of it (exp(x - max) over its
    sum) scale by the sum's reciprocal: one division a row, within an ulp."""
    x = rng.standard_normal((6, 40)).astype(np.float32) * 10
    exe = polyjit.compile(lambda t: ops.softmax(t, -1), [InputInfo(x.shape, np.float32)], {"target": "cpu", "cache": False})
    seen = {n.op for n in exe.graph.nodes()}
    assert "reciprocal" in seen and "div" not in seen, seen
    e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    np.testing.assert_allclose(exe(x), e / e.sum(-1, keepdims=True), rtol=1e-6, atol=1e-9)
