"""The examples of the documents polyjit is modelled on, as they write them
(names aside): the TorchDynamo/Inductor getting-started page, the PolyBlocks
JIT guide, nvFuser's Python frontend and NVIDIA Tripy's compiler guide.

On the CPU they run as written; the ``gpu`` variants pass CUDA tensors or
JAX GPU arrays and name no target: the code must run where the data is.
Each is compared with the framework's own result, with zero fallbacks.
"""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import polyjit
from polyjit import DataType, FusionDefinition, InputInfo, ops
from polyjit.errors import DefinitionError, InputError

F32 = np.float32


# =============================================================================
# FusionDefinition (nvFuser's Python frontend) and polyjit.compile (Tripy's
# programming model): the core API. Helpers here are local to this section.
# =============================================================================
def _nvfuser_first_example() -> FusionDefinition:
    """nvFuser's first example, as its README writes it."""
    with FusionDefinition() as fd:
        t0 = fd.define_tensor(shape=[-1, 1, -1], contiguity=[True, None, True], dtype=DataType.Float)
        t1 = fd.define_tensor(shape=[-1, -1, -1], contiguity=[True, True, True], dtype=DataType.Float)
        c0 = fd.define_scalar(3.0)
        t2 = fd.ops.add(t0, t1)
        t3 = fd.ops.mul(t2, c0)
        t4 = fd.ops.sum(t3, [-1], False, DataType.Float)
        fd.add_output(t4)
    return fd


def _first_example_reference(a, b):
    return ((np.asarray(a, np.float64) + np.asarray(b, np.float64)) * 3.0).sum(-1)


def test_nvfuser_first_example_numpy(rng):
    fd = _nvfuser_first_example()
    input1, input2 = rng.random((2, 1, 8), dtype=F32), rng.random((2, 4, 8), dtype=F32)
    nvf_out = fd.execute([input1, input2])[0]
    assert isinstance(nvf_out, np.ndarray) and nvf_out.dtype == F32  # the scalar takes the tensor's type
    np.testing.assert_allclose(nvf_out, _first_example_reference(input1, input2), rtol=1e-5)
    assert fd.stats["fallbacks"] == 0 and fd.stats["kernels"] == 1


def test_nvfuser_first_example_torch_cpu():
    torch = pytest.importorskip("torch")
    fd = _nvfuser_first_example()
    input1, input2 = torch.rand(2, 1, 8), torch.rand(2, 4, 8)
    nvf_out = fd.execute([input1, input2])[0]
    assert isinstance(nvf_out, torch.Tensor) and nvf_out.device.type == "cpu" and nvf_out.dtype == torch.float32
    want = ((input1.double() + input2.double()) * 3.0).sum(-1)
    torch.testing.assert_close(nvf_out.double(), want, rtol=1e-5, atol=0)
    x = torch.rand(3, 5, 8).transpose(0, 1)  # a strided tensor: no copy, a strided variant
    out = fd.execute([torch.rand(5, 1, 8), x])[0]
    assert out.shape == (5, 3) and fd.stats["fallbacks"] == 0


@pytest.mark.gpu
def test_nvfuser_first_example_cuda_no_target():
    torch = pytest.importorskip("torch")
    fd = _nvfuser_first_example()
    input1 = torch.rand(2, 1, 8, device="cuda")
    input2 = torch.rand(2, 4, 8, device="cuda")
    nvf_out = fd.execute([input1, input2])[0]
    assert isinstance(nvf_out, torch.Tensor) and nvf_out.is_cuda
    torch.testing.assert_close(nvf_out, (input1 + input2).mul(3.0).sum(-1), rtol=1e-5, atol=1e-5)
    assert fd.stats["fallbacks"] == 0 and fd.stats["kernels"] == 1


def test_nvfuser_first_example_jax_and_dlpack(rng):
    jax = pytest.importorskip("jax")
    fd = _nvfuser_first_example()
    a, b = rng.random((2, 1, 8), dtype=F32), rng.random((2, 4, 8), dtype=F32)
    out = fd.execute([jax.numpy.asarray(a), jax.numpy.asarray(b)])[0]
    assert isinstance(out, jax.Array)
    np.testing.assert_allclose(np.asarray(out), _first_example_reference(a, b), rtol=1e-5)

    class Producer:  # any array with __dlpack__ (here on the host)
        def __init__(self, x):
            self.x = x

        def __dlpack__(self, **kw):
            return self.x.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.x.__dlpack_device__()
    out = fd.execute([Producer(a), Producer(b)])[0]
    np.testing.assert_allclose(out, _first_example_reference(a, b), rtol=1e-5)
    with pytest.raises(InputError, match="input 1 is a str"):
        fd.execute([a, "b"])


def test_fusion_definition_id_and_registry(rng):
    """nvFuser's second example: fd.id(), then FusionDefinition(fid).execute
    with no definition; equal definitions share one id and one program."""
    fd = _nvfuser_first_example()
    fid = fd.id()
    a, b = rng.random((3, 1, 5), dtype=F32), rng.random((3, 2, 5), dtype=F32)
    fd.execute([a, b])
    program = fd.executable().last
    again = FusionDefinition(fid)
    np.testing.assert_allclose(again.execute([a, b])[0], _first_example_reference(a, b), rtol=1e-5)
    assert again.executable().last is program  # one compiled program, not compiled again
    assert _nvfuser_first_example().id() == fid
    with FusionDefinition() as other:  # a different definition: another id
        t = other.define_tensor(shape=[-1], dtype=DataType.Float)
        other.add_output(other.ops.exp(t))
    assert other.id() != fid
    with pytest.raises(DefinitionError, match="registered definition"):
        again.define_tensor(shape=[-1])


def test_fusion_definition_unknown_id():
    with pytest.raises(DefinitionError, match="12345"):
        FusionDefinition(12345)
    with pytest.raises(DefinitionError, match="first argument"):
        FusionDefinition("12345")
    assert FusionDefinition({"num_threads": 1}).options.num_threads == 1  # options, as before


def _several_ops() -> tuple[FusionDefinition, np.ndarray, np.ndarray]:
    k = np.linspace(-1.5, 2.0, 24, dtype=F32).reshape(4, 6)
    big = np.arange(300, dtype=F32) / 7.0  # larger than a literal: printed as base64
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 4, 6], dtype=DataType.Float)
        n = fd.define_scalar(dtype=DataType.Float)
        c = fd.define_constant(k)
        y = fd.ops.mul(fd.ops.add(x, fd.ops.broadcast_in_dim(c, shape=x.shape, broadcast_dims=[1, 2])), n)
        r = fd.ops.reshape(y, new_shape=[x.shape[0], 24])
        s = fd.ops.slice(r, start_indices=[0, 2], end_indices=[x.shape[0], 20], strides=[1, 3])
        m = fd.ops.max(fd.ops.tanh(s), [1], True)
        e = fd.ops.sum(fd.ops.exp(fd.ops.sub(s, m)), [1], False)
        fd.add_output(e)
        fd.add_output(fd.ops.add(fd.ops.reshape(fd.define_constant(big), new_shape=[-1, 6])[0:2], 1.0))
        fd.add_output(fd.ops.where(fd.ops.gt(s, 0.5), s, float("-inf")))
    return fd, k, big


def test_print_round_trip(rng):
    fd, k, big = _several_ops()
    text = fd.to_python()
    assert "T0_" not in text and "np.array([[-1.5" in text and "base64.b64decode" in text
    ns: dict = {}
    exec(text, ns)  # as a user would run it: the script imports polyjit itself
    fd2 = ns["fd"]
    assert fd2.canonical() == fd.canonical() and fd2.id() == fd.id()
    x, n = rng.standard_normal((3, 4, 6), dtype=F32), 1.7
    got, again = fd.execute([x, n]), fd2.execute([x, n])
    for g, h in zip(got, again):
        np.testing.assert_array_equal(g, h)
    s = ((x.astype(np.float64) + k) * n).reshape(3, 24)[:, 2:20:3]
    m = np.tanh(s).max(1, keepdims=True)
    np.testing.assert_allclose(got[0], np.exp(s - m).sum(1), rtol=1e-5)
    np.testing.assert_allclose(got[1], big.reshape(-1, 6)[0:2] + 1.0, rtol=1e-6)
    np.testing.assert_allclose(got[2], np.where(s > 0.5, s, -np.inf), rtol=1e-6)
    assert fd.stats["fallbacks"] == 0


def _run_reproducer(script, inputs, tmp_path) -> list:
    """Run a dumped script in a fresh interpreter on these inputs; its results."""
    np.savez(tmp_path / "inputs.npz", *inputs)
    code = ("import runpy, sys, numpy as np\n"
            "ns = runpy.run_path(sys.argv[1])\n"
            "d = np.load(sys.argv[2])\n"
            "outs = ns['fd'].execute([d[k] for k in d.files])\n"
            "np.savez(sys.argv[3], *[np.asarray(o) for o in outs])\n")
    subprocess.run([sys.executable, "-c", code, str(script), str(tmp_path / "inputs.npz"),
                    str(tmp_path / "outputs.npz")], check=True, cwd=tmp_path, timeout=300,
                   env={**os.environ, "POLYJIT_DUMP": ""})
    d = np.load(tmp_path / "outputs.npz")
    return [d[k] for k in d.files]


def test_print_round_trip_of_a_traced_graph(rng):
    """Sizes shared between dimensions (one input's, two inputs') and sizes
    derived from them (a strided convolution's output) print as names and
    expressions, and the script rebuilds the same structure."""
    from polyjit import printing

    def fn(img, w):
        y = ops.conv2d(img, w, stride=2, padding=1)
        return ops.pad(ops.relu(y), [1, 0, 0, 1]) + ops.sum(img, [2], keepdim=True)[:, :2, :, 0:1]
    exe = polyjit.compile(fn, [InputInfo(["n", 3, "h", "h"], F32), InputInfo([2, 3, 3, 3], F32)])
    text = printing.python_definition(exe.graph)
    assert "shape=[-1, 3, 's0', 's0']" in text and "// 2" in text
    _rebuilds(exe, text, rng.standard_normal((2, 3, 9, 9)).astype(F32), rng.standard_normal((2, 3, 3, 3)).astype(F32))


def _rebuilds(exe, text: str, *arrays) -> None:
    """The printed definition text, run, builds exe's graph, and its result on arrays is exe's."""
    from polyjit import printing
    ns: dict = {}
    exec(text, ns)
    assert ns["fd"].canonical() == printing.canonical(exe.graph)
    np.testing.assert_array_equal(ns["fd"].execute(list(arrays))[0], exe(*arrays))


def test_print_round_trip_of_an_input_dilated_convolution(rng):
    """A strided convolution's input gradient (a conv node spreading its
    input with zeros) prints with its input dilation and rebuilds the same."""
    from polyjit import printing
    exe = polyjit.compile(lambda g, w: ops.conv_input_grad(g, w, [9, 9], [2, 2], [(1, 1), (1, 1)]),
                          [InputInfo([2, 4, 5, 5], F32), InputInfo([4, 3, 3, 3], F32)])
    text = printing.python_definition(exe.graph)
    assert "input_dilation=[2, 2]" in text or "input_dilation=(2, 2)" in text
    _rebuilds(exe, text, rng.standard_normal((2, 4, 5, 5)).astype(F32), rng.standard_normal((4, 3, 3, 3)).astype(F32))


def test_print_round_trip_of_a_scatter_into_a_base(rng):
    """A scatter into a value rather than zeros (a tied embedding's
    gradient) prints with its base and rebuilds the same."""
    from polyjit import printing
    w, g = rng.standard_normal((30, 4)).astype(F32), rng.standard_normal((12, 4)).astype(F32)
    i = rng.integers(0, 30, 12)
    exe = polyjit.compile(lambda w, i, g: ops.scatter_reduce("sum", [30, 4], i, g, 0, base=w * 2.0),
                          [InputInfo(w.shape, F32), InputInfo(i.shape, i.dtype), InputInfo(g.shape, F32)])
    text = printing.python_definition(exe.graph)
    assert "base=" in text, text
    _rebuilds(exe, text, w, i, g)


def test_dump_python_definition_torch(tmp_path, monkeypatch, rng, caplog):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("POLYJIT_DUMP", "python_definition")
    dump = tmp_path / "dump"

    def fn(x, y):
        return torch.softmax(torch.cos(x) @ y, -1) * 2 + x.sum()
    f = polyjit.jit_torch(fn, compile_options={"dump_dir": str(dump)}, dynamic=True)
    x, y = rng.standard_normal((5, 7), dtype=F32), rng.standard_normal((7, 3), dtype=F32)
    want = f(torch.from_numpy(x), torch.from_numpy(y))
    torch.testing.assert_close(want, fn(torch.from_numpy(x), torch.from_numpy(y)), rtol=1e-5, atol=1e-5)
    scripts = list(dump.glob("*.py"))
    assert len(scripts) == 1, scripts
    assert str(scripts[0]) in caplog.text  # where it is, on the polyjit.dump logger
    assert "define_tensor(shape=[-1," in scripts[0].read_text()  # symbolic sizes
    got = _run_reproducer(scripts[0], [x, y], tmp_path)
    np.testing.assert_allclose(got[0], want.numpy(), rtol=1e-6, atol=1e-6)


def test_dump_python_definition_jax(tmp_path, monkeypatch, rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    monkeypatch.setenv("POLYJIT_DUMP", "python_definition")
    dump = tmp_path / "dump"
    small = rng.standard_normal(3).astype(F32)
    big = rng.standard_normal((30, 3)).astype(F32)  # closed over: constants that must carry their values

    def fn(x):
        return jnp.tanh(x @ big + small) * jnp.float32(0.5)
    f = polyjit.jit_jax(fn, compile_options={"dump_dir": str(dump)})
    x = rng.standard_normal((4, 30)).astype(F32)
    want = np.asarray(f(x))
    np.testing.assert_allclose(want, np.asarray(fn(x)), rtol=1e-5, atol=1e-6)
    scripts = list(dump.glob("*.py"))
    assert len(scripts) == 1, scripts
    assert "base64.b64decode" in scripts[0].read_text() and "np.array([" in scripts[0].read_text()
    got = _run_reproducer(scripts[0], [x], tmp_path)
    np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-7)


class GEGLU:
    """Tripy's GEGLU, in polyjit's terms: the weights are numpy arrays the
    layer holds, constants of the compiled program."""

    def __init__(self, dim_in, dim_out):
        self.proj_w = np.random.randn(dim_out * 2, dim_in).astype(np.float32)
        self.proj_b = np.random.randn(dim_out * 2).astype(np.float32)
        self.dim_out = dim_out

    def __call__(self, x):
        proj = polyjit.ops.linear(x, self.proj_w, self.proj_b)
        x, gate = polyjit.ops.split(proj, 2, proj.ndim - 1)
        return x * polyjit.ops.gelu(gate)


def _geglu_reference(layer, x):
    proj = x.astype(np.float64) @ layer.proj_w.T.astype(np.float64) + layer.proj_b
    a, gate = proj[:, :layer.dim_out], proj[:, layer.dim_out:]
    return a * 0.5 * gate * (1 + np.vectorize(math.erf)(gate / math.sqrt(2)))


def test_tripy_geglu_symbolic_batch(rng):
    layer = GEGLU(2, 8)
    exe = polyjit.compile(layer, args=[polyjit.InputInfo([-1, 2], np.float32)])
    assert exe.name == "GEGLU"
    for batch in (3, 41):
        x = rng.standard_normal((batch, 2)).astype(F32)
        out = exe(x)
        assert out.shape == (batch, 8)
        np.testing.assert_allclose(out, _geglu_reference(layer, x), rtol=1e-5, atol=1e-5)  # float32 rounding of proj
        assert exe.stats["fallbacks"] == 0
    assert len(exe._variants) == 1  # one program for both batch sizes
    exe2 = polyjit.compile(layer, args=[polyjit.InputInfo([-1, 2], np.float32)], compile_options={"strict": True})
    np.testing.assert_allclose(exe2(x), _geglu_reference(layer, x), rtol=1e-5, atol=1e-5)


def test_traced_programs_close_over_arrays(rng):
    torch = pytest.importorskip("torch")
    w = rng.standard_normal((4, 4)).astype(F32)
    v = rng.standard_normal(4).astype(F32)
    p = torch.nn.Parameter(torch.from_numpy(rng.standard_normal(4).astype(F32)))  # needs grad: read as a value

    def fn(x):
        return (w @ x + x @ w) * v - ops.where(x > 0, v, x) + np.float32(2) * x + p
    exe = polyjit.compile(fn, [InputInfo([4, 4], F32)])
    x = rng.standard_normal((4, 4)).astype(F32)
    x64, v64 = x.astype(np.float64), v.astype(np.float64)
    want = (w @ x64 + x64 @ w) * v64 - np.where(x > 0, v64, x64) + 2 * x64 + p.detach().numpy()
    out = exe(x)
    assert out.dtype == F32
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(DefinitionError, match="got list"):
        polyjit.compile(lambda x: x + [1.0], [InputInfo([4], F32)])


def test_split_and_chunk(rng):
    x = rng.standard_normal((3, 10)).astype(F32)
    exe = polyjit.compile(lambda t: ops.split(t, [2, 5, 3], 1) + ops.chunk(t, 4, 1) + ops.split(t, 2, -1),
                          [InputInfo([3, 10], F32)])
    got = exe(x)
    want = [x[:, :2], x[:, 2:7], x[:, 7:]] + [x[:, 0:3], x[:, 3:6], x[:, 6:9], x[:, 9:]] + [x[:, :5], x[:, 5:]]
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    for n, chunks, sizes in [(5, 4, [2, 2, 1]), (6, 4, [2, 2, 2]), (2, 5, [1, 1]), (7, 1, [7])]:  # torch.chunk's
        exe = polyjit.compile(lambda t: ops.chunk(t, chunks, 0), [InputInfo([n], F32)])
        y = rng.standard_normal(n).astype(F32)
        got = exe(y)
        assert [g.shape[0] for g in got] == sizes
        np.testing.assert_array_equal(np.concatenate(got), y)
    sym = polyjit.compile(lambda t: ops.split(t, 2, 0), [InputInfo([-1, 3], F32)])
    y = rng.standard_normal((6, 3)).astype(F32)
    a, b = sym(y)
    np.testing.assert_array_equal(a, y[:3]) and np.testing.assert_array_equal(b, y[3:])
    with pytest.raises(InputError, match="must be equal"):
        sym(rng.standard_normal((5, 3)).astype(F32))
    with pytest.raises(DefinitionError, match="does not divide"):
        polyjit.compile(lambda t: ops.split(t, 3, 1), [InputInfo([3, 10], F32)])
    with pytest.raises(DefinitionError, match="do not match"):
        polyjit.compile(lambda t: ops.split(t, [4, 4], 1), [InputInfo([3, 10], F32)])
    with pytest.raises(DefinitionError, match="symbolic"):
        polyjit.compile(lambda t: ops.chunk(t, 2, 0), [InputInfo([-1], F32)])



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
    torch._dynamo.reset()
    polyjit.frontends.torch.stats(reset=True)
    with torch.no_grad():  # inference: the whole layer norm is one kernel
        torch.testing.assert_close(compiled(x, w, b), want, rtol=1e-5, atol=1e-5)
    assert polyjit.frontends.torch.stats()["kernels"] == 1


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
    f = polyjit.jit_jax(model.apply, compile_options={"strict": True, "tf32": False})  # float32, as the reference
    with jax.default_matmul_precision("highest"):  # the reference in float32, not TF32 on a GPU
        want = model.apply(params, x)
    np.testing.assert_allclose(np.asarray(f(params, x)), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert f.stats["fallbacks"] == 0 and f.stats["kernels"] >= 1


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
