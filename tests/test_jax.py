"""The JAX frontend on the seed programs: results against un-jitted JAX on
fresh random data, with zero fallbacks."""
import os
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import polyjit  # noqa: E402
import refs  # noqa: E402
from polyjit.errors import CompileOptionError, InputError, UnsupportedOpError  # noqa: E402
from polyjit.library import blas  # noqa: E402


@pytest.fixture
def key(rng):
    return jax.random.PRNGKey(int(rng.integers(1 << 31)))


def rnd(rng, *shape, dtype=np.float32):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))


def assert_tree_close(out, ref, rtol=1e-5, atol=1e-5):
    a, b = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(ref)
    for x, y in zip(a, b):
        assert isinstance(x, jax.Array) and x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol)


TARGET = os.environ.get("POLYJIT_TEST_TARGET", "cpu")  # nvgpu: check() runs on the GPU
jax.config.update("jax_default_matmul_precision", "highest")  # references in float32, not GPUs' TF32
host_target = pytest.mark.skipif(TARGET != "cpu", reason="pins the cpu target or passes host arrays")


def check(fn, *args, rtol=1e-5, atol=1e-5, **kw):
    if TARGET != "cpu":
        kw["compile_options"] = {"target": TARGET, **(kw.get("compile_options") or {})}
    jf = polyjit.jit_jax(fn, **kw)
    out = jf(*args)
    assert_tree_close(out, fn(*args), rtol, atol)
    assert jf.stats["fallbacks"] == 0 and jf.stats["graphs"] >= 1
    return jf


def blur(img):
    k = jnp.full((1, 1, 1, 5), 0.2, jnp.float32)
    x = lax.conv_general_dilated(img, k, (1, 1), "VALID")
    return lax.conv_general_dilated(x, k.reshape(1, 1, 5, 1), (1, 1), "VALID")


def test_blur_one_loop_nest(rng):
    jf = check(blur, jnp.asarray(rng.random((3, 1, 64, 80), dtype=np.float32)))
    assert jf.stats["kernels"] == 1 and jf.stats["contracted_buffers"] == 1
    assert jf.stats["intermediate_bytes"] < 3 * 64 * 76 * 4 / 2


def conv_bias_relu(params, x):
    y = lax.conv_general_dilated(x, params["w"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.nn.relu(y + params["b"])


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.float16, 2e-2)])
def test_conv_bias_relu_nhwc(rng, dtype, tol):
    params = {"w": rnd(rng, 3, 3, 4, 8, dtype=dtype), "b": rnd(rng, 8, dtype=dtype)}
    check(conv_bias_relu, params, rnd(rng, 2, 10, 12, 4, dtype=dtype), rtol=tol, atol=tol)


def test_depthwise_conv_feature_groups(rng):
    def dw(x, w):
        return lax.conv_general_dilated(x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        feature_group_count=4)
    check(dw, rnd(rng, 2, 9, 11, 4), rnd(rng, 3, 3, 1, 8), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("groups", [2, 4])
def test_grouped_conv_gradients(rng, groups):
    """The kernel's gradient of a grouped convolution is a convolution with
    batch groups (and a reshape that transposes first)."""
    def loss(x, w):
        y = lax.conv_general_dilated(x, w, (2, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                     feature_group_count=groups)
        return (jnp.tanh(y) * jnp.linspace(-1.0, 1.0, y.size).reshape(y.shape)).sum()
    check(jax.grad(loss, argnums=(0, 1)), rnd(rng, 2, 9, 8, 4), rnd(rng, 3, 3, 4 // groups, 8), rtol=1e-4, atol=1e-4)


def gradient_descent(w, x, num_steps, lr):
    y = jnp.sum(x, 1)

    def loss(w):
        return jnp.mean((x @ w - y) ** 2)
    return lax.fori_loop(0, num_steps, lambda i, w: w - lr * jax.grad(loss)(w), w)


@host_target
def test_gradient_descent_static_argnums(rng):
    jf = check(gradient_descent, rnd(rng, 4), rnd(rng, 16, 4), 8, 0.05,
               compile_options={"target": "cpu", "static_argnums": (2, 3)}, rtol=1e-4, atol=1e-5)
    jf(rnd(rng, 4), rnd(rng, 16, 4), 8, 0.05)
    assert len(jf._programs) == 1  # same shapes and static values: no new compile
    out = jf(rnd(rng, 4), rnd(rng, 16, 4), 3, 0.05)
    assert len(jf._programs) == 2 and out.shape == (4,)


@host_target
def test_static_argnums_keyword_form(rng):
    scale = polyjit.jit_jax(lambda x, k: x * k, static_argnums=1)
    x = rnd(rng, 5)
    assert_tree_close(scale(x, 3.0), x * 3.0)


def layernorm(x, w, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / jnp.sqrt(v + 1e-5) * w + b


def test_layernorm_one_pass(rng):
    jf = check(layernorm, rnd(rng, 4, 16, 64), rnd(rng, 64), rnd(rng, 64), atol=2e-5)
    assert jf.stats["kernels"] == 1


@pytest.mark.parametrize("fn", [lambda x: jax.nn.softmax(x, -1), lambda x: jax.nn.log_softmax(x, -1),
                                lambda x: jax.nn.gelu(x), lambda x: jax.nn.gelu(x, approximate=False)],
                         ids=["softmax", "log_softmax", "gelu_tanh", "gelu_erf"])
def test_activations(rng, fn):
    check(fn, rnd(rng, 8, 100))


def mlp_loss(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def test_mlp_loss_and_grad_of_a_jit_jax_function(rng):
    params = {"w1": rnd(rng, 8, 16), "b1": rnd(rng, 16), "w2": rnd(rng, 16, 4)}
    x, y = rnd(rng, 5, 8), rnd(rng, 5, 4)
    jf = check(mlp_loss, params, x, y, rtol=1e-4)
    grads = jax.grad(jf)(params, x, y)
    assert_tree_close(grads, jax.grad(mlp_loss)(params, x, y), rtol=1e-4, atol=1e-5)
    assert jf.stats["graphs"] == 2 and jf.stats["fallbacks"] == 0  # forward and its VJP, both polyjit
    check(jax.grad(mlp_loss), params, x, y, rtol=1e-4)  # a gradient traced as one program
    assert_tree_close(jax.jit(jf)(params, x, y), mlp_loss(params, x, y), rtol=1e-4)


@host_target
def test_pytrees_in_and_out_numpy_inputs(rng):
    def f(d, t):
        return {"sum": d["a"] + t[0], "prod": (d["a"] * t[1], t[0].max())}
    a = rng.standard_normal((3, 4), dtype=np.float32)
    out = polyjit.jit_jax(f)({"a": a}, (np.ones((3, 4), np.float32), jnp.asarray(a)))
    assert_tree_close(out, f({"a": a}, (np.ones((3, 4), np.float32), jnp.asarray(a))))


@host_target
def test_captured_values_are_constants_arguments_stay_inputs(rng):
    w = rnd(rng, 8, 8)
    jf = polyjit.jit_jax(lambda x: jnp.tanh(x @ w))
    x = rnd(rng, 4, 8)
    assert_tree_close(jf(x), jnp.tanh(x @ w), rtol=1e-4)
    prog, _ = next(iter(jf._programs.values()))
    assert [n.op for n in prog.segments[0].graph.inputs] == ["input"]
    assert len(prog.segments[0].graph.inputs) == 1  # w was folded in, x stays an input


@host_target
def test_a_softmax_divides_once_a_row(rng):
    """jax.nn.softmax (its maximum taken with an initial -inf) scales by its
    sum's reciprocal, like ops.softmax and torch's decomposition; a sum of
    exps with no maximum taken first (which may be subnormal) stays a division."""
    x = rnd(rng, 6, 40)
    for fn, rewritten in ((lambda t: jax.nn.softmax(t, axis=-1), True),
                          (lambda t: jnp.exp(t) / jnp.exp(t).sum(-1, keepdims=True), False)):
        jf = polyjit.jit_jax(fn)
        assert_tree_close(jf(x), fn(x), rtol=1e-6)
        prog, _ = next(iter(jf._programs.values()))
        seen = {n.op for n in prog.segments[0].graph.nodes()}
        assert ("reciprocal" in seen and "div" not in seen) == rewritten, seen


@pytest.mark.parametrize("strides,padding", [((2, 2), "SAME"), ((2, 2), "VALID"), ((3, 2), ((1, 2), (0, 1)))])
def test_strided_convolution_gradients(rng, strides, padding):
    """The input gradient of a strided convolution is one with lhs dilation
    (and, for VALID, negative padding)."""
    def loss(x, w):
        y = lax.conv_general_dilated(x, w, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return (jnp.tanh(y) * jnp.arange(y.size).reshape(y.shape) / y.size).sum()
    check(jax.grad(loss, argnums=(0, 1)), rnd(rng, 2, 11, 10, 3), rnd(rng, 3, 3, 3, 4), rtol=1e-4, atol=1e-4)


def test_convolutions_and_products_take_xlas_precision_for_tf32():
    """tf32=None and matmul_tf32=None follow XLA: TF32 for float32
    convolutions and products on a GPU at the default precision; exact
    float32 where a convolution or product in the function, or the
    process's default, asks for a higher precision."""
    from polyjit.frontends.jax import program
    from polyjit.frontends.common import Stats
    from polyjit.options import parse_options

    def conv(x, w, precision=None):
        return lax.conv_general_dilated(x, w, (1, 1), "SAME", precision=precision)
    x, w = jnp.ones((1, 2, 5, 5)), jnp.ones((3, 2, 3, 3))

    def tf32(fn, **opts):
        return program(jax.make_jaxpr(fn)(x, w), parse_options(opts), Stats(), "t").options.tf32
    with jax.default_matmul_precision("default"):  # (this module's references ask for "highest")
        assert tf32(conv) is True
        assert tf32(jax.jit(lambda x, w: conv(x, w, lax.Precision.HIGHEST))) is False
        assert tf32(conv, tf32=False) is False and tf32(lambda x, w: conv(x, w, "highest"), tf32=True) is True
    with jax.default_matmul_precision("float32"):
        assert tf32(conv) is False

    def matmul_tf32(fn, *args, **opts):
        return program(jax.make_jaxpr(fn)(*args), parse_options(opts), Stats(), "t").options.matmul_tf32
    a = jnp.ones((4, 8))
    with jax.default_matmul_precision("default"):
        assert matmul_tf32(jnp.matmul, a, a.T) is True
        assert matmul_tf32(lambda a, b: jnp.matmul(a, b, precision="highest"), a, a.T) is False
        assert matmul_tf32(jnp.matmul, a, a.T, matmul_tf32=False) is False
    with jax.default_matmul_precision("highest"):
        assert matmul_tf32(jnp.matmul, a, a.T) is False


@pytest.mark.skipif(blas() is None, reason="no OpenBLAS from numpy to call")
@pytest.mark.parametrize("strides", [(1, 1), (2, 2)])
def test_weight_gradient_channels_last_is_a_library_call(rng, strides):
    """The kernel's gradient of an NHWC convolution (the images and
    positions contracted, channels last) runs as one sgemm, as the forward does."""
    def loss(w, x, r):
        y = lax.conv_general_dilated(x, w, strides, "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return (jax.nn.relu(y) * r).sum()
    x, w = rnd(rng, 2, 9, 11, 13), rnd(rng, 3, 3, 13, 17)
    r = rnd(rng, *lax.conv_general_dilated(x, w, strides, "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")).shape)
    jg = polyjit.jit_jax(jax.grad(loss), compile_options={"strict": True, "contractions": "library"})
    np.testing.assert_allclose(np.asarray(jg(w, x, r)), np.asarray(jax.grad(loss)(w, x, r)), rtol=1e-4, atol=1e-4)
    assert jg.stats["library_calls"] == 2  # the forward and the weight gradient


@pytest.mark.skipif(blas() is None, reason="no OpenBLAS from numpy to call")
def test_a_dense_layer_over_a_sequence_is_a_library_call(rng, monkeypatch):
    """x @ w on [b, t, d] and its weight's gradient (b and t contracted), as
    JAX writes them, are products of matrices (views) that sgemm takes,
    on a host whose products are timed against the library."""
    from polyjit.targets.cpu import CpuTarget
    monkeypatch.setattr(CpuTarget, "vector_bits", lambda self: 256)

    def loss(w, x, r):
        return (jnp.tanh(x @ w) * r).sum()
    x, w, r = rnd(rng, 3, 10, 24), rnd(rng, 24, 20), rnd(rng, 3, 10, 20)
    jg = polyjit.jit_jax(jax.value_and_grad(loss), compile_options={"strict": True, "contractions": "library",
                                                                    "cache": False})
    assert_tree_close(jg(w, x, r), jax.value_and_grad(loss)(w, x, r), rtol=1e-4, atol=1e-4)
    assert jg.stats["library_calls"] == 2  # the forward and the weight gradient


@pytest.mark.parametrize("fn", [
    jax.grad(lambda x: (lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") ** 2).sum()),
    jax.grad(lambda x: (lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 2, 3, 1), "SAME") * x[:, :4, :3]).sum()),
    lambda x: lax.pad(x, 1.5, ((1, 2, 1), (-1, 0, 2), (0, 0, 0), (2, -3, 1))),
], ids=["avg_pool_grad", "avg_pool_same_grad", "pad_interior_value"])
def test_pad_with_interior_padding(rng, fn):
    """A strided average pooling's gradient is lax.pad with interior padding
    (a dilation, with negative edges too); strict mode compiles it."""
    check(fn, rnd(rng, 2, 7, 9, 3), compile_options={"strict": True})


@pytest.mark.parametrize("fn", [
    lambda x: jnp.argmax(x, -1), lambda x: jnp.cumsum(x, 1), lambda x: lax.cumsum(x, 0, reverse=True),
    lambda x: (jnp.cumprod(x, 1), lax.cummax(x, 1), lax.cummin(x, 0, reverse=True)),
    lambda x: (lax.cumlogsumexp(x * 40, 1), lax.cumlogsumexp(x.at[0, 2].set(-jnp.inf), 0, reverse=True)),
    lambda x: (jnp.sort(x.at[1, 2].set(jnp.nan), 1), jnp.argsort(x, 0), lax.top_k(x, 3)),
    lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (2, 2), "VALID"),
    lambda x: jnp.clip(x, -0.5, 0.5) ** 3, lambda x: jnp.concatenate([x, x[:, ::-1]], 1),
    lambda x: jnp.pad(x, ((1, 2), (0, 3))), lambda x: jnp.where(x > 0, x, jnp.exp(x)),
    lambda x: x[1:3, 2:7:2], lambda x: lax.dynamic_slice(x, (1, 2), (2, 3)),
    lambda x: (lax.dynamic_update_slice(x, x[:2, :3] * 5, (1, 8)), jnp.tile(x, (2, 1, 3))),
    lambda x: jnp.split(x, 2, axis=1)[1], lambda x: ((x.astype(jnp.int32) * 3).sum(0), jnp.any(x > 1, 1), jnp.all(x > -1, 0)),
    lambda x: jnp.round(x * 3), lambda x: jax.nn.sigmoid(x) + jnp.exp2(x) + jnp.log1p(jnp.abs(x)),
    lambda x: (lax.lgamma(x * 3), lax.digamma(x * 2 + 0.1), jax.grad(lambda y: lax.lgamma(jnp.abs(y) + 0.5).sum())(x)),
    lambda x: (lax.rem(x * 5, 1.5), lax.rem((x * 9).astype(jnp.int32), 4), (x * 9).astype(jnp.int32) // -4,
               lax.div((x * 9).astype(jnp.int32), 4), (x * 9) // 2.5),
    jax.grad(lambda x: (lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (2, 2), "VALID") * jnp.arange(10.0)
                        .reshape(2, 5)).sum()),
    jax.grad(lambda x: (lax.reduce_window(x, -jnp.inf, lax.max, (3, 3), (2, 2), "SAME") ** 2).sum()),
    lambda x: jax.grad(lambda y: (lax.reduce_window(y, -jnp.inf, lax.max, (3, 3), (2, 2), "SAME") * 1.5).sum())(
        x.at[:2, :3].set(-jnp.inf)),  # XLA's padding wins a window of -inf: that gradient is dropped
    lambda x: tuple(a * k for k, a in enumerate(jnp.unstack(x, axis=1)[:4])) + jnp.unstack(x[:2] - 1),
], ids=["argmax", "cumsum", "cumsum_rev", "cumprod_cummax_cummin", "cumlogsumexp", "sort_argsort_top_k", "maxpool", "clip_pow", "concat_rev", "pad", "where", "slice",
        "dynamic_slice", "update_slice_tile", "split", "int_sum", "round", "misc", "gamma", "rem", "maxpool_grad", "maxpool_grad_overlap",
        "maxpool_grad_padding_wins", "unstack"])
def test_primitives(rng, fn):
    check(fn, rnd(rng, 4, 10))


@pytest.mark.parametrize("fn", [
    lambda x, i: x[i], lambda x, i: x[:, i], lambda x, i: x[i, i % 3], lambda x, i: x[i.reshape(2, 3)],
    lambda x, i: jnp.take(x, i + 4, axis=1), lambda x, i: jnp.take(x, i * 3, axis=1, mode="clip"),
    lambda x, i: jnp.take_along_axis(x, i[:4, None] % 10, axis=1),
    lambda x, i: jnp.take_along_axis(x.reshape(2, 2, 10), (i * 7 % 12).reshape(2, 1, 3), axis=2),
    lambda x, i: x.at[i].add(1.5), lambda x, i: x.at[:, i].add(x[:, :6] * 2, mode="drop"),
    lambda x, i: x.at[1:3].set(-x[:2] * 2).at[np.array([3, 0]), 9].set(jnp.nan),
    lambda x, i: x.at[i].multiply(2.0).at[:, i].min(x[:, :6] * 0.5).at[i % 4, i].max(0.3, mode="drop"),
    lambda x, i: x.at[:, i].set(jnp.broadcast_to(x[:, 3:4] * 3, (4, 6))),  # runtime indices that repeat
    jax.grad(lambda x, i: (jnp.tanh(x[i]) * jnp.arange(10.0)).sum()),
    jax.grad(lambda x, i: -jnp.take_along_axis(jax.nn.log_softmax(x), i[:4, None] % 10, axis=1).mean()),
], ids=["rows", "columns", "points", "embedding", "fill_nan", "clip", "along", "along_batched", "add_at",
        "add_drop", "set", "mul_min_max", "set_repeats", "embedding_grad", "cross_entropy_grad"])
def test_gather_and_scatter(rng, fn):
    """Indexing with integer arrays (negative and out-of-bounds indices
    too, as each mode treats them) and its gradient."""
    check(fn, rnd(rng, 4, 10), jnp.asarray([0, 3, -1, 2, 1, 3]))


@pytest.mark.parametrize("fn", [
    lambda x, i: x[i], lambda x, i: lax.dynamic_slice(x, (i, i + 3), (2, 4)),
    lambda x, i: lax.dynamic_slice(x, (i * 4 - 9, 1), (3, 5)),  # starts clamped into the array
    lambda x, i: lax.dynamic_update_slice(x, x[:2, :3] * 5, (i, 2 * i - 1)),
    lambda x, i: lax.dynamic_update_slice(x, jnp.ones((3, 4)), (7 - i, i * 9)),
    lambda x, i: jnp.zeros((4, 3, 10)).at[:, i].set(x),  # a cache's write at a position given at run time
    jax.grad(lambda x, i: (jnp.tanh(lax.dynamic_slice(x, (1, i), (2, 5))) ** 2).sum()),
], ids=["index", "slice", "slice_clamped", "update", "update_clamped", "cache_write", "slice_grad"])
@pytest.mark.parametrize("i", [0, 2, 5])
def test_slices_at_starts_given_at_run_time(rng, fn, i):
    """lax.dynamic_slice and dynamic_update_slice at start indices that are
    arguments (x[i] in a loop's body, a cache written at the current
    position), clamped as XLA clamps them; one program for every start."""
    check(fn, rnd(rng, 4, 10), jnp.int32(i))


def test_bfloat16_functions_and_gradients(rng):
    """bfloat16 arrays: a product, activations and a reduction, and their
    gradient, within bfloat16's rounding of XLA's (each computed in float32
    where it is fused, rounded where stored)."""
    x, w = rnd(rng, 16, 32, dtype=jnp.bfloat16), rnd(rng, 32, 8, dtype=jnp.bfloat16)

    def f(x, w):
        return jax.nn.gelu(x @ w) * 2 + jnp.sum(x, -1, keepdims=True)[:, :1]
    jf = polyjit.jit_jax(f)
    got = jf(x, w)
    assert got.dtype == jnp.bfloat16 and jf.stats["fallbacks"] == 0
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(f(x, w), np.float32), rtol=3e-2, atol=3e-1)
    g = jax.grad(lambda x, w: (f(x, w).astype(jnp.float32) ** 2).mean(), argnums=(0, 1))
    jg = polyjit.jit_jax(g)
    for a, b in zip(jg(x, w), g(x, w)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 3e-2 * np.abs(b).max()
    assert jg.stats["fallbacks"] == 0


@pytest.mark.parametrize("typed", [False, True], ids=["raw_key", "typed_key"])
def test_split_and_fold_in_keys_bit_for_bit(rng, typed):
    """jax.random.split and fold_in (by a number known when tracing: flax's
    named streams) inside the function give JAX's keys, bit for bit."""
    seed = int(rng.integers(1 << 31))
    k = jax.random.key(seed) if typed else jax.random.PRNGKey(seed)
    x = rnd(rng, 5, 7)

    def fn(key, x):
        a, b = jax.random.split(key)
        grid = jax.random.split(jax.random.fold_in(b, 2 ** 31 + 12345), (2, 3))
        data = jax.random.key_data if typed else (lambda z: z)
        return (x + jax.random.normal(a, x.shape), data(grid), data(jax.random.fold_in(key, 7)),
                jax.random.uniform(jax.random.fold_in(a, 3), (4,)))
    check(fn, k, x)


def test_keys_made_inside_the_function_and_unread_ones_dropped(rng):
    """A key made from a seed inside the function (PRNGKey of a number or of
    an argument, negative too) is threefry's, bit for bit; flax's RNN splits
    a key for a carry it fills with zeros: ops whose results nothing reads
    are neither compiled nor run (strict refused them)."""
    x = rnd(rng, 4, 5)

    def fn(seed, x):
        made = jax.random.split(jax.random.PRNGKey(seed))[1]
        return x * jax.random.uniform(made, x.shape) + jax.random.normal(jax.random.PRNGKey(-7), x.shape), made
    check(fn, jnp.int32(-123456), x, compile_options={"strict": True})

    def unread(x):
        jax.random.split(jax.random.PRNGKey(0))
        lax.bessel_i1e(x)  # (an op outside the table)
        return x * 2
    check(unread, x, compile_options={"strict": True})


def test_while_loops_compile(rng):
    """lax.while_loop with a run-time trip count, fori_loop over a bound
    passed in, and Newton's iteration until it converges: condition and
    body compiled (run by the host an iteration at a time), no fallback."""
    def counted(x, n):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1]) * 1.5 + 0.1), (0, x))[1]

    def fori(x, k):
        return jax.lax.fori_loop(0, k, lambda i, y: y * 0.9 + jnp.sin(y) * i, x)

    def newton(x):
        def cond(c):
            return (jnp.abs(c[0] * c[0] - x).max() > 1e-5) & (c[1] < 50)
        return jax.lax.while_loop(cond, lambda c: (0.5 * (c[0] + x / c[0]), c[1] + 1), (x, 0))
    x = rng.uniform(0.5, 2, (64,)).astype(np.float32)
    for fn, args in ((counted, (x, 7)), (counted, (x, 0)), (fori, (x, 5)), (newton, (x,))):
        jf = polyjit.jit_jax(fn, compile_options={"strict": True})
        for got, want in zip(jax.tree_util.tree_leaves(jf(*args)), jax.tree_util.tree_leaves(jax.jit(fn)(*args))):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        assert jf.stats["fallbacks"] == 0


def test_uint8_images(rng):
    """A uint8 batch of images scaled to floats, its maxima and quotients."""
    def prep(img):
        return (img.astype(jnp.float32) / 255.0 - 0.5) * 2.0, img.max(axis=(1, 2)), img // 3, img.astype(jnp.int8) * 2
    img = rng.integers(0, 256, (4, 8, 8, 3), dtype=np.uint8)
    f = polyjit.jit_jax(prep, compile_options={"strict": True})
    for got, want in zip(f(img), jax.jit(prep)(img)):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert f.stats["fallbacks"] == 0


def test_flax_dropout_forward_and_gradient(rng):
    """flax's Dropout draws from a key folded in by its stream's name."""
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.LayerNorm()(nn.Dropout(0.3, deterministic=False)(nn.Dense(16)(x)))
    m, x = Block(), rnd(rng, 4, 8)
    params = m.init(jax.random.key(1), x)
    f = lambda p, x, k: m.apply(p, x, rngs={"dropout": k})  # noqa: E731
    k = jax.random.key(int(rng.integers(1 << 31)))
    check(f, params, x, k, rtol=1e-4, atol=1e-5)
    check(jax.grad(lambda p, x, k: (f(p, x, k) * jnp.arange(16.0)).sum()), params, x, k, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("typed", [False, True], ids=["raw_key", "typed_key"])
def test_bernoulli_dropout_and_uniform_bit_for_bit(rng, typed):
    """jax.random's threefry bits, bit for bit: the same dropout mask and the
    same uniform numbers as JAX for a raw uint32[2] key or a typed key."""
    seed = int(rng.integers(1 << 31))
    k = jax.random.key(seed) if typed else jax.random.PRNGKey(seed)
    x = rnd(rng, 37, 65)

    def dropout(key, x):
        keep = jax.random.bernoulli(key, 0.8, x.shape)
        return jnp.where(keep, x / 0.8, 0.0), keep, jax.random.uniform(key, (3, 5), minval=-2.0, maxval=2.0)
    jf = check(dropout, k, x)
    out, keep, u = jf(k, x)
    want = dropout(k, x)
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(u), np.asarray(want[2]))
    assert 0.75 < float(np.mean(np.asarray(keep))) < 0.85


@host_target
def test_nextafter_bit_for_bit():
    x = np.array([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, np.inf, -np.inf, np.nan, 3.4028235e38, 2.0, 5.0], np.float32)
    y = np.array([1.0, -1.0, 2.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, np.inf, 2.0, np.nan], np.float32)
    jf = polyjit.jit_jax(lax.nextafter, compile_options={"target": TARGET})
    got = jf(jnp.asarray(x), jnp.asarray(y))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(lax.nextafter(x, y)).view(np.uint32))
    assert jf.stats["fallbacks"] == 0


def test_normal_samples(key):
    check(lambda k: jax.random.normal(k, (64, 300)), key)


def test_values_an_identity_passes_to_a_fallback(rng):
    """An identity op's result (stop_gradient of an input) reaching an op that
    runs in JAX, beside truncated_normal (its nextafter bounds, compiled)."""
    def f(x, k):
        return lax.bessel_i1e(lax.stop_gradient(x)) * 2 + x, jax.random.truncated_normal(k, -1.0, 2.0, (50,))
    x, k = rnd(rng, 3, 9), jax.random.PRNGKey(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jf = polyjit.jit_jax(f, compile_options={"target": TARGET})
        assert_tree_close(jf(x, k), f(x, k))
    assert jf.stats["fallback_ops"] == ["bessel_i1e"]


@host_target
def test_nan_and_inf_propagate():
    x = jnp.asarray([[0.5, np.nan, -np.inf, 2.0], [1.0, 2.0, np.inf, -1.0]], jnp.float32)
    for fn in (lambda x: jax.nn.softmax(x, -1), lambda x: jnp.max(x, 1), lambda x: jnp.exp(x) * 0 + x):
        out, ref = np.asarray(polyjit.jit_jax(fn)(x)), np.asarray(fn(x))
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        np.testing.assert_allclose(out[~np.isnan(out)], ref[~np.isnan(ref)], rtol=1e-6)


@host_target
def test_execution_backends_agree(rng):
    x = rnd(rng, 8, 32)
    outs = [polyjit.jit_jax(layernorm, execution_backend=b)(x, x[0], x[1]) for b in ("polyjit", "std", "xla")]
    for o in outs[1:]:
        assert_tree_close(outs[0], o, atol=2e-5)
    with pytest.raises(CompileOptionError, match="execution_backend"):
        polyjit.jit_jax(layernorm, execution_backend="tpu")


@host_target
def test_unsupported_primitive_falls_back_or_raises_under_strict(rng, monkeypatch):
    from polyjit.frontends import common
    monkeypatch.setattr(common, "_warned", set())  # (warned once a process: another test's may have been first)

    def f(x):
        return lax.bessel_i0e(x * x + 1) * 2 + 1
    x = rnd(rng, 3, 7)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        jf = polyjit.jit_jax(f)
        assert_tree_close(jf(x), f(x))
    assert jf.stats["fallbacks"] == 1 and jf.stats["fallback_ops"] == ["bessel_i0e"]
    assert any("bessel_i0e" in str(m.message) for m in w)
    with pytest.raises(UnsupportedOpError, match="bessel_i0e"):
        polyjit.jit_jax(f, compile_options={"strict": True})(x)


EDGE_FNS = {  # functions whose NaN, infinities, signed zeros and out-of-range conversions follow XLA's rules
    "sign": jnp.sign, "round_away": jax.lax.round, "round_even": jnp.round, "floor": jnp.floor, "trunc": jnp.trunc,
    "to_int32": lambda x: x.astype(jnp.int32), "to_uint8": lambda x: x.astype(jnp.uint8),
    "to_int64": lambda x: x.astype(jnp.int64), "clip": lambda x: jnp.clip(x, -1, 1), "relu": jax.nn.relu,
    "gelu": jax.nn.gelu, "max": lambda x: x.reshape(4, 4).max(1), "argmax": lambda x: x.reshape(4, 4).argmax(1),
    "softmax": lambda x: jax.nn.softmax(x.reshape(4, 4), -1), "logsumexp": lambda x: jax.nn.logsumexp(x.reshape(4, 4), 1),
    "maximum": lambda x: jnp.maximum(x, x[::-1]), "fmax": lambda x: jnp.fmax(x, x[::-1]),
    "cummax": lambda x: jax.lax.cummax(x.reshape(4, 4), axis=1),
    "nan_to_num": jnp.nan_to_num, "copysign": lambda x: jnp.copysign(1.0, x), "abs": jnp.abs,
}


@host_target
@pytest.mark.parametrize("name", sorted(EDGE_FNS))
def test_edge_values_follow_xlas_rules(name):
    x = jnp.array(refs.EDGES, jnp.float32)  # (no subnormals: XLA's CPU code flushes them to zero)
    fn = EDGE_FNS[name]
    jf = polyjit.jit_jax(fn, compile_options={"target": "cpu"})
    refs.assert_same_edges(jf(x), jax.jit(fn)(x))
    assert jf.stats["fallbacks"] == 0


@host_target
def test_static_argnames_as_jax_jit(rng):
    """Static arguments by name, by position given by name, or left at their
    default: Python control flow on them traces, as under jax.jit."""
    def f(x, n, training=False):
        return x * n + (1.0 if training else 0.0)
    x = rnd(rng, 4)
    g, ref = polyjit.jit_jax(f, static_argnames=("training", "n")), jax.jit(f, static_argnames=("training", "n"))
    for args, kw in [((x, 3), {}), ((x, 3), {"training": True}), ((x,), {"n": 2, "training": True}), ((x, 2, True), {})]:
        np.testing.assert_allclose(np.asarray(g(*args, **kw)), np.asarray(ref(*args, **kw)), rtol=1e-6)
    assert g.stats["fallbacks"] == 0
    h = polyjit.jit_jax(f, compile_options={"static_argnums": 1})
    np.testing.assert_allclose(np.asarray(h(x, n=5)), np.asarray(x) * 5, rtol=1e-6)  # (a static position by name)
    with pytest.raises(CompileOptionError, match="static_argnames"):
        polyjit.jit_jax(f, static_argnames=3)


@host_target
def test_one_value_returned_twice(rng):
    """Equal results computed once (one array in the program) are each returned, in place."""
    x = rnd(rng, 8)
    f = polyjit.jit_jax(lambda a: (a + 1, a * 3, a + 1, jax.lax.div(a, 2.0), a / 2.0))
    for _ in range(2):  # (the second call goes through XLA's dispatch)
        for got, want in zip(f(x), (x + 1, x * 3, x + 1, x / 2, x / 2)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    assert f.stats["fallbacks"] == 0


@host_target
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint32, jnp.int8])
def test_integer_division_by_zero_as_xla(dtype):
    """XLA's quotient by 0 is all ones and its remainder the dividend (jnp's // and % build on both)."""
    info = np.iinfo(dtype)
    a = jnp.array([1, 7, 0, int(info.min), int(info.max), 5, 9, 3], dtype)
    b = jnp.array([0, 0, 0, 0, 0, 2, -1 if info.min else 3, 0], dtype)

    def fn(a, b):
        return jax.lax.div(a, b), jax.lax.rem(a, b), a // b, a % b, jax.lax.div(a, jnp.zeros_like(b))
    jf = polyjit.jit_jax(fn, compile_options={"target": "cpu"})
    for got, want in zip(jf(a, b), jax.jit(fn)(a, b)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert jf.stats["fallbacks"] == 0


def _attention_block(p, x):
    """A pre-norm attention block whose sizes come from its input's shape."""
    bb, t, d = x.shape
    m = x - x.mean(-1, keepdims=True)
    h = m * lax.rsqrt((m * m).mean(-1, keepdims=True) + 1e-5) * p["g"]
    q, k, v = jnp.split(h.reshape(-1, d) @ p["wqkv"], 3, -1)
    heads = lambda z: z.reshape(bb, t, 4, d // 4).transpose(0, 2, 1, 3)  # noqa: E731
    a = jax.nn.softmax(heads(q) @ heads(k).transpose(0, 1, 3, 2) / (d // 4) ** 0.5, -1) @ heads(v)
    return x + a.transpose(0, 2, 1, 3).reshape(bb, t, d) @ p["wo"], x.shape[0] * x.shape[1] * 1.0


def _attention_params(rng, d=32):
    return {"wqkv": rnd(rng, d, 3 * d) * d ** -0.5, "wo": rnd(rng, d, d) * d ** -0.5, "g": rnd(rng, d)}


def test_lowered_with_symbolic_sizes_serves_every_size(rng):
    """lower() of ShapeDtypeStructs sized by jax.export.symbolic_shape: one
    program, no fallback (strict), for a pre-norm transformer block and
    its gradient at several (batch, sequence) sizes, reshapes of b*s and
    a size read as a value among them; a call whose sizes disagree with
    the symbols names them."""
    from jax import export
    b, s = export.symbolic_shape("b, s")
    params = _attention_params(rng)
    spec = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    for fn in (_attention_block, jax.grad(lambda p, x: (_attention_block(p, x)[0] ** 2).mean())):
        jf = polyjit.jit_jax(fn, compile_options={"strict": True})
        compiled = jf.lower(spec, jax.ShapeDtypeStruct((b, s, 32), jnp.float32)).compile()
        for shape in ((2, 5, 32), (3, 8, 32), (1, 1, 32)):
            x = rnd(rng, *shape)
            assert_tree_close(compiled(params, x), jax.jit(fn)(params, x), 1e-5, 1e-5)
        assert jf.stats["graphs"] == 1 and jf.stats["fallbacks"] == 0
        with pytest.raises(InputError, match=r"is float32\[2, 5, 16\], compiled for float32\[b, s, 32\] "
                                             r"with b=2, s=5"):
            compiled(params, rnd(rng, 2, 5, 16))


def test_reduce_retracing_compiles_a_second_shape_for_every_size(rng):
    """reduce_retracing=True: the second (batch, sequence) compiles once
    more with both symbolic, which serves every later size above 1, called
    directly and under jax.grad (its VJP relaxed as well); a size of 1
    compiles on its own. Results as jax.jit's, no fallback."""
    params = _attention_params(rng)
    jf = polyjit.jit_jax(_attention_block, reduce_retracing=True)
    grad = jax.jit(jax.grad(lambda p, x: (jf(p, x)[0] ** 2).mean()))
    ref_grad = jax.jit(jax.grad(lambda p, x: (_attention_block(p, x)[0] ** 2).mean()))
    for shape in ((2, 5), (3, 8), (4, 6), (2, 5), (1, 7), (5, 9)):
        x = rnd(rng, *shape, 32)
        assert_tree_close(jf(params, x), jax.jit(_attention_block)(params, x), 1e-5, 1e-5)
        assert_tree_close(grad(params, x), ref_grad(params, x), 1e-5, 1e-5)
    # (2, 5), (b, s) from (3, 8), (1, s) from (1, 7) against (2, 5); their gradients likewise
    assert jf.stats["graphs"] == 6 and jf.stats["fallbacks"] == 0
    for relaxations in jf._relaxations.values():
        assert [tuple(map(str, r.sig.avals[-1][0])) for r in relaxations] == [("d0", "d1", "32"), ("1", "d0", "32")]


def test_reduce_retracing_keeps_static_sizes_a_function_needs(rng):
    """A function that branches on a size while tracing (a comparison that
    jax.export's symbols leave inconclusive) stays compiled per shape, with
    no fallback and no warning."""
    def fn(x):
        return x * 2 if x.shape[0] > 4 else x + 1
    jf = polyjit.jit_jax(fn, reduce_retracing=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (3, 6, 8, 2):
            x = rnd(rng, n, 5)
            np.testing.assert_allclose(jf(x), fn(x), rtol=1e-6)
    assert len(jf._programs) == 4 and not jf._relaxations and jf.stats["fallbacks"] == 0


@host_target
def test_bad_inputs(rng):
    with pytest.raises(InputError, match="static argument 1 is a list"):
        polyjit.jit_jax(lambda x, s: x * len(s), static_argnums=(1,))(rnd(rng, 3), [1, 2])
    jf = polyjit.jit_jax(lambda x, y: x @ y)
    compiled = jf.lower(rnd(rng, 3, 4), rnd(rng, 4, 5)).compile()
    assert compiled(rnd(rng, 3, 4), rnd(rng, 4, 5)).shape == (3, 5)
    with pytest.raises(InputError, match=r"argument \[0\]\[1\] is float32\[4, 6\], compiled for float32\[4, 5\]"):
        compiled(rnd(rng, 3, 4), rnd(rng, 4, 6))
    with pytest.raises(InputError, match="argument .* is a str"):
        jf("a", rnd(rng, 4, 5))
    with pytest.raises(CompileOptionError, match="static_argnums"):
        polyjit.jit_jax(lambda x: x, compile_options={"static_argnums": "0"})
    with pytest.raises(CompileOptionError, match=r"static_argnums=\(5,\), but it takes only 2 positional"):
        polyjit.jit_jax(lambda x, n: x * n, static_argnums=5)  # (as jax.jit refuses it)
    varargs = polyjit.jit_jax(lambda *a: a[0] * a[1], static_argnums=(5,))  # any count: the call checks
    with pytest.raises(InputError, match="static_argnums names argument 5, but only 2 positional"):
        varargs(rnd(rng, 3), 2)
    x = rnd(rng, 3)
    np.testing.assert_allclose(polyjit.jit_jax(lambda x, n: x * n, static_argnums=-1)(x, 3), x * 3, rtol=1e-6)
    with pytest.raises(CompileOptionError, match="unknown compile option 'tile'"):
        polyjit.jit_jax(lambda x: x, compile_options={"tile": 3})


@pytest.mark.gpu
def test_mixed_host_and_device_inputs():
    gpu = jax.devices("gpu")[0]
    x = jax.device_put(jnp.ones(3), gpu)
    with pytest.raises(InputError, match="all on the host or all on one device"):
        polyjit.jit_jax(lambda a, b: a + b)(x, np.ones(3, np.float32))


def test_core_imports_no_framework():
    import subprocess
    import sys
    code = "import sys, polyjit; polyjit.compile; assert not {'jax', 'torch', 'tensorflow'} & set(sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ}).returncode == 0


def test_scan_with_xs_and_ys_is_unrolled(rng):
    def f(w, xs):
        return lax.scan(lambda c, x: (c + x * w, c * 2), jnp.zeros(3, jnp.float32), xs)
    check(f, rnd(rng, 3), rnd(rng, 4, 3))
    check(lambda w, xs: lax.scan(lambda c, x: (c * x + w, c), w, xs, reverse=True), rnd(rng, 3), rnd(rng, 5, 3))


def test_cond_and_switch_compile_every_branch_and_select(rng):
    """lax.cond, lax.switch and a gradient through cond run compiled (no
    fallback), on both sides of the predicate and with an index out of
    range; the branch not taken makes NaN and Inf, which never show."""
    def f(x, y):
        return lax.cond(jnp.sum(x) > 0, lambda a, b: jnp.log(a) * b, lambda a, b: a / 0.0 + b, x, y)

    def g(i, x):
        return lax.switch(i, [jnp.sin, lambda a: a * 2.0, lambda a: jnp.sqrt(-jnp.abs(a) - 1.0)], x)
    x, y = jnp.abs(rnd(rng, 5, 7)) + 0.5, rnd(rng, 5, 7)
    for sign in (1, -1):
        check(f, sign * x, y)
        check(jax.grad(lambda a, b: jnp.sum(f(a, b))), sign * x, y)
    for i in (0, 1, 5):
        out = check(g, np.int32(i), rnd(rng, 6))(np.int32(i), x)
        assert np.isnan(out).all() == (i == 5)


@host_target
def test_jax_arrays_run_as_xla_custom_calls_on_the_cpu(rng):
    """With JAX arrays on the CPU, a call, and a call staged under jax.jit and
    jax.grad, is an XLA custom call (native code, no callback through Python)
    and matches XLA. Subnormals stay IEEE although XLA's threads flush them:
    nextafter from 0 bit for bit, in a kernel whose parts run on the thread
    team (over 32k elements) and in one that runs on XLA's thread."""
    with jax.default_device(jax.devices("cpu")[0]):  # also where JAX's default device is a GPU
        def ln(x, w, b):
            m = x.mean(-1, keepdims=True)
            v = ((x - m) ** 2).mean(-1, keepdims=True)
            return (x - m) * jax.lax.rsqrt(v + 1e-5) * w + b
        f = polyjit.jit_jax(ln)
        x, w, b = rnd(rng, 64, 300), rnd(rng, 300), rnd(rng, 300)
        assert_tree_close(f(x, w, b), ln(x, w, b), 1e-5, 1e-5)
        assert [c for c in f._calls.values() if c is not None]
        x2 = rnd(rng, 64, 300)  # later calls skip the checks that held for the same shapes, dtypes, placement
        assert_tree_close(f(x2, w, b), ln(x2, w, b), 1e-5, 1e-5)
        assert_tree_close(f(np.asarray(x2), w, b), ln(x2, w, b), 1e-5, 1e-5)
        assert_tree_close(f(x2[:5], w, b), ln(x2[:5], w, b), 1e-5, 1e-5)
        grad = jax.jit(jax.grad(lambda *a: (f(*a) * x).sum(), argnums=(0, 1, 2)))
        text = grad.lower(x, w, b).as_text()
        assert "polyjit_" in text and "callback" not in text
        assert_tree_close(grad(x, w, b), jax.grad(lambda *a: (ln(*a) * x).sum(), argnums=(0, 1, 2))(x, w, b), 1e-4, 1e-4)
        step = polyjit.jit_jax(lambda a, t: lax.nextafter(a, t) * 3)
        for n in (7, 1 << 16):
            a, t = jnp.zeros(n, jnp.float32), jnp.ones(n, jnp.float32)
            got, want = step(a, t), np.nextafter(np.zeros(n, np.float32), np.float32(1)) * np.float32(3)  # IEEE
            np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
            assert np.asarray(got)[0] > 0
        assert len([c for c in step._calls.values() if c is not None]) == 2



def test_calls_after_the_first_go_through_jaxs_own_dispatch(rng):
    """Once a call from Python has run as a custom call on the default
    backend's only device, calls go through jax.jit of the staged call:
    none through polyjit's checked call again, new shapes included; a user's
    error is still the checked call's InputError, and the dispatch stays;
    a call the dispatch does not run (on the CPU, a result XLA's fresh
    buffers would fault in each time) runs checked, and later ones too."""
    device = jax.devices()[0]
    if jax.devices() != [device] or device.platform not in ("cpu", "gpu"):
        pytest.skip("the default backend has several devices")
    f = polyjit.jit_jax(lambda x, w, scale: jnp.tanh(x @ w) * scale, static_argnums=2)
    x, w = rnd(rng, 16, 32), rnd(rng, 32, 8)
    assert_tree_close(f(x, w, 2.0), jnp.tanh(x @ w) * 2.0, 1e-5, 1e-5)
    assert f._dispatch is not None
    checked = []
    run_checked = f._checked_call
    f._checked_call = lambda *a: checked.append(a) or run_checked(*a)
    for xs, s in ((rnd(rng, 16, 32), 2.0), (rnd(rng, 5, 32), 2.0), (rnd(rng, 16, 32), 3.0)):
        assert_tree_close(f(xs, w, s), jnp.tanh(xs @ w) * s, 1e-5, 1e-5)
    assert checked == []
    with pytest.raises(InputError, match="argument"):
        f(x, "w", 2.0)
    assert len(checked) == 1 and f._dispatch is not None
    if device.platform == "cpu":
        big = jnp.ones((1 << 23) + 1, jnp.float32)
        g = polyjit.jit_jax(lambda v: v * 2)
        assert float(g(big[:8])[0]) == 2.0 and g._dispatch is not None
        assert float(g(big)[-1]) == 2.0 and g._dispatch is None


def test_a_call_whose_graph_options_fail_runs_without_them(rng, monkeypatch):
    """Where XLA refuses the options that make a call from Python a CUDA
    graph (an XLA without them; here on the CPU, one it does not know), the
    call runs as a plain custom call, with a warning, and later calls too."""
    from polyjit.frontends import jax as fj
    monkeypatch.setattr(fj, "_graph_options", lambda where: {"xla_no_such_option": 1})
    with jax.default_device(jax.devices("cpu")[0]):
        f = polyjit.jit_jax(lambda x: jnp.tanh(x) * 2)
        x = rnd(rng, 8, 300)
        with pytest.warns(UserWarning, match="could not run its calls as CUDA graphs"):
            assert_tree_close(f(x), jnp.tanh(x) * 2, 1e-6, 1e-6)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert_tree_close(f(x * 3), jnp.tanh(x * 3) * 2, 1e-6, 1e-6)
        assert f.stats["fallbacks"] == 0 and all(c[0] is c[1] for c in f._calls.values() if c is not None)


@host_target
def test_constant_and_passed_through_results_stay_in_the_custom_call(rng):
    """A result known while tracing (a bias's gradient, where the loss weighs
    the output with a captured array) or an argument returned as it is (also
    through an identity) is added beside the XLA custom call, which still
    runs the rest: no path through Python."""
    with jax.default_device(jax.devices("cpu")[0]):
        r = rnd(rng, 4, 6)
        grad = jax.grad(lambda p, x: ((x @ p["w"] + p["b"]) * r).sum())
        three = lambda x, y: (x, lax.stop_gradient(y), x * y)  # noqa: E731
        for fn, args in [(grad, ({"w": rnd(rng, 5, 6), "b": rnd(rng, 6)}, rnd(rng, 4, 5))),
                         (three, (rnd(rng, 3, 7), rnd(rng, 3, 7)))]:
            f = check(fn, *args, compile_options={"strict": True})
            assert [c for c in f._calls.values() if c is not None]
            assert_tree_close(f(*args), fn(*args))  # the call from the fast path

def test_xla_custom_call_targets_see_buffers_and_report_errors(rng):
    """The native FFI handler that runs nvgpu programs inside XLA, exercised
    on the CPU with launch functions written in Python: argument and result
    buffers arrive as pointers in call order, and a failed launch becomes an
    XLA error carrying the message it wrote."""
    import ctypes

    from polyjit.runtime.launch import LAUNCH_T
    from polyjit.frontends.jax import register_custom_call

    def floats(ptr, n):
        return np.ctypeslib.as_array((ctypes.c_float * n).from_address(ptr))

    @LAUNCH_T
    def axpy(args, rets, stream, message, size):
        assert stream is None
        floats(rets[1], 6)[:] = 2 * floats(args[0], 6) + floats(args[1], 6)
        floats(rets[0], 6)[:] = floats(args[1], 6)
        return 0

    @LAUNCH_T
    def broken(args, rets, stream, message, size):
        ctypes.memmove(message, b"no kernel here\0", 15)
        return 7

    name = f"polyjit_test_{rng.integers(1 << 30)}"
    address = ctypes.cast(axpy, ctypes.c_void_p).value
    register_custom_call(name + "_axpy", "cpu", address, 2, 2, axpy)
    register_custom_call(name + "_broken", "cpu", ctypes.cast(broken, ctypes.c_void_p).value, 1, 1, broken)
    result = jax.ShapeDtypeStruct((6,), jnp.float32)
    cpu = jax.devices("cpu")[0]
    x, y = jax.device_put(rnd(rng, 6), cpu), jax.device_put(rnd(rng, 6), cpu)
    with jax.default_device(cpu):
        got = jax.jit(lambda a, b: jax.ffi.ffi_call(name + "_axpy", (result, result))(a, b))(x, y)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(y))
        np.testing.assert_allclose(np.asarray(got[1]), 2 * np.asarray(x) + np.asarray(y), rtol=1e-6)
        with pytest.raises(Exception, match="no kernel here"):
            jax.block_until_ready(jax.jit(lambda a: jax.ffi.ffi_call(name + "_broken", result)(a))(x))
        with pytest.raises(Exception, match="number of args other than 2"):
            jax.block_until_ready(jax.jit(lambda a: jax.ffi.ffi_call(name + "_axpy", (result, result))(a))(x))


@pytest.mark.parametrize("train", [False, True])
def test_flax_batch_norm_folds_in_eval_only(rng, train):
    """flax's BatchNorm with running averages after a Conv folds into the
    convolution's kernel and bias (as a computation of the parameters passed
    in); with batch statistics (train) nothing folds; both equal jax's."""
    fnn = pytest.importorskip("flax.linen")

    class ConvBN(fnn.Module):
        @fnn.compact
        def __call__(self, x, train):
            x = fnn.BatchNorm(use_running_average=not train)(fnn.Conv(12, (3, 3))(x))
            return fnn.relu(x)
    net, x = ConvBN(), rnd(rng, 2, 9, 7, 5)
    params = net.init(jax.random.PRNGKey(0), x, False)
    stats = {"mean": rnd(rng, 12), "var": jnp.abs(rnd(rng, 12)) + 0.5}
    params = {**params, "batch_stats": {"BatchNorm_0": stats}}

    def f(v, x):
        return net.apply(v, x, train, mutable=["batch_stats"]) if train else net.apply(v, x, train)
    jf = polyjit.jit_jax(f, compile_options={"strict": True})
    assert_tree_close(jf(params, x), f(params, x))
    assert jf.stats["folded"] == (0 if train else 1) and jf.stats["fallbacks"] == 0
