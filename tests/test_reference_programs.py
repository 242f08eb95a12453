"""The examples of the documents polyjit is modelled on, as they write them
(names aside): the TorchDynamo/Inductor getting-started page, the PolyBlocks
JIT guide, nvFuser's Python frontend and NVIDIA Tripy's compiler guide.

On the CPU they run as written; the ``gpu`` variants pass CUDA tensors or
JAX GPU arrays and name no target: the code must run where the data is.
Each is compared with the framework's own result, with zero fallbacks.
"""
import numpy as np
import pytest

import polyjit

GPU = pytest.mark.gpu


# ============================================================== PyTorch
torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    polyjit.frontends.torch.stats(reset=True)
    yield


def _devices():
    return ["cpu", pytest.param("cuda", marks=GPU)]


@pytest.mark.parametrize("device", _devices())
def test_inductor_getting_started_cos_sin(device):
    def fn(x, y):
        a = torch.cos(x)
        b = torch.sin(y)
        return a + b
    new_fn = torch.compile(fn, backend="polyjit")
    input_tensor = torch.randn(10000).to(device=device)
    out = new_fn(input_tensor, input_tensor)
    torch.testing.assert_close(out, fn(input_tensor, input_tensor), rtol=1e-5, atol=1e-6)
    assert out.device == input_tensor.device
    stats = polyjit.frontends.torch.stats()
    assert stats["fallbacks"] == 0 and stats["kernels"] == 1


def _polyblocks_blur(img):
    """PolyBlocks' PyTorch blur: its kernel is built inside the function."""
    kernel = torch.tensor([0.0625, 0.25, 0.375, 0.25, 0.0625], device=img.device).float()
    blur_x = kernel.reshape(1, 1, 1, 5)
    blur_y = kernel.reshape(1, 1, 5, 1)
    img = img.reshape(img.shape[0], 1, img.shape[1], img.shape[2])
    return F.conv2d(F.conv2d(img, blur_x), blur_y)


@pytest.mark.parametrize("device", _devices())
def test_polyblocks_torch_blur_with_its_kernel_built_inside(device):
    target = "nvgpu" if device == "cuda" else "cpu"
    img = torch.rand(3, 96, 80, device=device)
    want = _polyblocks_blur(img)
    jf = polyjit.jit_torch(_polyblocks_blur, compile_options={"target": target, "strict": True})
    torch.testing.assert_close(jf(img), want, rtol=1e-5, atol=1e-6)
    assert jf.stats["fallbacks"] == 0 and jf.stats["kernels"] == 1
    torch._dynamo.reset()
    compiled = torch.compile(_polyblocks_blur, backend="polyjit", options={"strict": True})
    torch.testing.assert_close(compiled(img), want, rtol=1e-5, atol=1e-6)
    assert polyjit.frontends.torch.stats()["kernels"] == 1


def _nvfuser_layer_norm(x, weight, bias):
    """The nvFuser tutorial's layer norm, written in PyTorch."""
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) * torch.rsqrt(var + 1e-5) * weight + bias


@pytest.mark.parametrize("device", _devices())
def test_layer_norm_follows_its_tensors_forward_and_backward(device):
    x = torch.randn(16, 1024, device=device, requires_grad=True)
    w = torch.randn(1024, device=device, requires_grad=True)
    b = torch.randn(1024, device=device, requires_grad=True)
    compiled = torch.compile(_nvfuser_layer_norm, backend="polyjit", options={"strict": True})
    out = compiled(x, w, b)
    want = _nvfuser_layer_norm(x, w, b)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    r = torch.randn_like(want)
    got = torch.autograd.grad((out * r).sum(), (x, w, b))
    ref = torch.autograd.grad((want * r).sum(), (x, w, b))
    for g, h in zip(got, ref):
        torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-4)
    stats = polyjit.frontends.torch.stats()
    assert stats["fallbacks"] == 0 and stats["graphs"] == 2


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("masked_bias", torch.tensor(-1e4))  # a constant the model holds

    def forward(self, x):
        return torch.where(x > 0, torch.relu(self.lin(x)), self.masked_bias) + torch.tensor([])[:0].sum()


def test_modules_have_stats_both_ways():
    mod, x = _Block(), torch.randn(4, 16)
    jm = polyjit.jit_torch(mod, compile_options={"strict": True})
    torch.testing.assert_close(jm(x), mod(x))
    assert jm.stats["graphs"] == 1 and jm.stats["fallbacks"] == 0 and jm.stats["kernels"] >= 1
    torch._dynamo.reset()
    cm = torch.compile(mod, backend="polyjit")
    torch.testing.assert_close(cm(x), mod(x))
    assert polyjit.frontends.torch.stats()["graphs"] == 1


def test_an_explicit_cpu_target_refuses_cuda_tensors_by_name():
    from polyjit.errors import InputError
    pytest.importorskip("torch")
    f = polyjit.jit_torch(lambda x: x + 1, compile_options={"target": "cpu"})
    if not torch.cuda.is_available():  # the check itself, on a stand-in for a CUDA tensor
        from polyjit.api import Executable
        exe = polyjit.compile(lambda a: a + 1, [polyjit.InputInfo([4], np.float32)], {"target": "cpu"})
        assert isinstance(exe, Executable)

        class OnGpu:
            __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}
        with pytest.raises(InputError, match="input 0 is on a GPU, but compile option target='cpu'"):
            exe(OnGpu())
        return
    with pytest.raises(Exception, match="argument 0 is on cuda"):
        f(torch.randn(4, device="cuda"))


@GPU
def test_nvgpu_target_copies_host_tensors_and_returns_them_to_the_host():
    f = polyjit.jit_torch(lambda x: torch.exp(x) * 2, compile_options={"target": "nvgpu", "strict": True})
    x = torch.randn(1000)
    out = f(x)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, torch.exp(x) * 2)


# ------------------------------------------------ never crash a user's model
def _break_compiler(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("injected compiler failure")
    monkeypatch.setattr(polyjit.api, "compile_graph", broken)


def test_a_compiler_failure_is_a_counted_fallback_torch(monkeypatch):
    _break_compiler(monkeypatch)
    x = torch.randn(64, 32)
    f = polyjit.jit_torch(lambda x: torch.softmax(x, -1) * 3)
    with pytest.warns(UserWarning, match="injected compiler failure"):
        out = f(x)
    torch.testing.assert_close(out, torch.softmax(x, -1) * 3)
    assert f.stats["fallbacks"] == 1
    torch._dynamo.reset()
    g = polyjit.jit_torch(lambda x: torch.softmax(x, -1) * 3, compile_options={"strict": True})
    with pytest.raises(Exception, match="injected compiler failure"):
        g(x)


def test_a_compiler_failure_is_a_counted_fallback_jax(monkeypatch):
    jax = pytest.importorskip("jax")
    _break_compiler(monkeypatch)
    x = np.random.default_rng().standard_normal((8, 16)).astype(np.float32)
    f = polyjit.jit_jax(lambda x: jax.nn.softmax(x) * 3)
    with pytest.warns(UserWarning, match="injected compiler failure"):
        out = f(jax.numpy.asarray(x))
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.nn.softmax(x) * 3), rtol=1e-5, atol=1e-6)
    assert f.stats["fallbacks"] >= 1
    g = polyjit.jit_jax(lambda x: jax.nn.softmax(x) * 3, compile_options={"strict": True})
    with pytest.raises(RuntimeError, match="injected compiler failure"):
        g(jax.numpy.asarray(x))


def test_a_failing_rule_is_a_counted_fallback_of_its_op(monkeypatch):
    jax = pytest.importorskip("jax")
    from polyjit.frontends import jax as pj

    def broken(*a, **k):
        raise IndexError("tuple index out of range")
    monkeypatch.setitem(pj.PRIMITIVES, "exp", broken)
    x = jax.numpy.asarray(np.random.default_rng().standard_normal(32).astype(np.float32))
    f = polyjit.jit_jax(lambda x: jax.numpy.exp(x) + 1)
    with pytest.warns(UserWarning, match="IndexError"):
        out = f(x)
    np.testing.assert_allclose(np.asarray(out), np.exp(np.asarray(x)) + 1, rtol=1e-6)
    assert f.stats["fallbacks"] == 1 and any("exp" in op for op in f.stats["fallback_ops"])


# ================================================================== JAX
@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=GPU)])
def test_jax_numpy_function_runs_where_its_arrays_are(platform):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def predict(w, b, x):
        return jnp.tanh(x @ w + b)
    dev = jax.devices(platform)[0]
    rng = np.random.default_rng()
    args = [jax.device_put(rng.standard_normal(s).astype(np.float32), dev) for s in ((32, 8), (8,), (16, 32))]
    f = polyjit.jit_jax(predict, compile_options={"strict": True})
    out = f(*args)
    assert next(iter(out.devices())) == dev
    with jax.default_matmul_precision("highest"):  # the reference in float32, not TF32 on a GPU
        want = predict(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert f.stats["fallbacks"] == 0


def test_flax_conv_bias_relu():
    jax = pytest.importorskip("jax")
    nn = pytest.importorskip("flax.linen")
    jnp = jax.numpy

    class ConvBiasRelu(nn.Module):
        features: int = 16

        @nn.compact
        def __call__(self, x):
            x = nn.Conv(self.features, kernel_size=(3, 3), use_bias=True, dtype=jnp.float32)(x)
            return nn.relu(x)

    model = ConvBiasRelu()
    x = jax.random.normal(jax.random.key(np.random.default_rng().integers(1 << 30)), (2, 12, 12, 8))
    params = model.init(jax.random.key(0), x)
    f = polyjit.jit_jax(model.apply, compile_options={"strict": True})
    with jax.default_matmul_precision("highest"):  # the reference in float32, not TF32 on a GPU
        want = model.apply(params, x)
    np.testing.assert_allclose(np.asarray(f(params, x)), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert f.stats["fallbacks"] == 0 and f.stats["kernels"] == 1


# =========================================================== TensorFlow
def _tf_blur(tf, height, width):
    def blur_x_blur_y(img):
        kernel = tf.constant([0.0625, 0.25, 0.375, 0.25, 0.0625], dtype=tf.float32)
        blur_kernel = tf.reshape(kernel, [1, 5, 1, 1])
        img_reshaped = tf.reshape(img, [3, height, width, 1])
        blurx = tf.nn.conv2d(img_reshaped, blur_kernel, [1, 1, 1, 1], "VALID")
        return tf.nn.conv2d(blurx, tf.reshape(kernel, [5, 1, 1, 1]), [1, 1, 1, 1], "VALID")
    return blur_x_blur_y


def test_polyblocks_tf_decorator_forms():
    tf = pytest.importorskip("tensorflow")
    height, width = 40, 56
    spec = [tf.TensorSpec([3, height, width], tf.float32)]
    fn = _tf_blur(tf, height, width)
    img = tf.random.uniform([3, height, width])
    want = fn(img).numpy()
    forms = [
        polyjit.jit_tf(spec, {"target": "cpu", "strict": True})(fn),               # as the guide writes it
        polyjit.jit_tf(spec, compile_options={"target": "cpu", "strict": True})(fn),
        polyjit.jit_tf(input_signature=spec, compile_options={"strict": True})(fn),
        polyjit.jit_tf(compile_options={"strict": True})(fn),
        polyjit.jit_tf(fn),
    ]
    for f in forms:
        np.testing.assert_allclose(f(img).numpy(), want, rtol=1e-5, atol=1e-6)
        assert f.stats["fallbacks"] == 0 and f.stats["kernels"] == 1
    xla = polyjit.jit_tf(spec, execution_backend="xla", compile_options={"target": "cpu"})(fn)
    np.testing.assert_allclose(xla(img).numpy(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(polyjit.errors.CompileOptionError, match="input_signature given twice"):
        polyjit.jit_tf(spec, input_signature=spec)
