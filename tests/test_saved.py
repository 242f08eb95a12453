"""Saved executables: a compiled program written to a file and run in a fresh
process without tracing or compiling; damaged, foreign and mismatched files
refused with errors that say why."""
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import polyjit
from polyjit import InputInfo, cache, ops, saved
from polyjit.errors import InputError, SavedExecutableError

F32 = np.float32


def _blur(img):
    k = ops.reshape(ops.full_like(img[0:1, 0:1, 0:5], 0.2), [1, 1, 1, 5])
    x = ops.reshape(img, [img.shape[0], 1, img.shape[1], img.shape[2]])
    return ops.conv2d(ops.conv2d(x, k), ops.reshape(k, [1, 1, 5, 1]))


class _Mlp:
    """Closes over its weights: they are the program's tensor constants."""

    def __init__(self, rng):
        self.w1 = rng.standard_normal((16, 32), dtype=F32)
        self.b = rng.standard_normal(32, dtype=F32)
        self.w2 = rng.standard_normal((32, 8), dtype=F32)

    def __call__(self, x, scale):
        h = ops.tanh(ops.matmul(x, self.w1) + self.b)
        return ops.matmul(h, self.w2) * scale, ops.sum(h, [1], False)


def _mlp_ref(m, x, scale):
    h = np.tanh(x.astype(np.float64) @ m.w1 + m.b)
    return (h @ m.w2) * scale, h.sum(1)


# run in a fresh process whose compile cache is empty, with compiling made to fail: what it runs was loaded
FRESH = """
import json, sys, numpy as np, polyjit, polyjit.api
def refuse(*a, **k):
    raise AssertionError("compiled in the loading process")
polyjit.api.compile_graph = refuse
exe = polyjit.load(sys.argv[1])
data = np.load(sys.argv[2])
outs = {}
for name in data.files:
    args = [data[name]] + [np.asarray(float(a), np.float32) for a in sys.argv[3:]]
    r = exe(*args)
    outs[name] = [np.asarray(v).tolist() for v in (r if isinstance(r, tuple) else [r])]
print(json.dumps({"outs": outs, "kernels_compiled": exe.stats["kernels_compiled"]}))
"""


def _fresh(tmp_path, path, arrays: dict, *extra) -> dict:
    np.savez(tmp_path / "inputs.npz", **arrays)
    empty = tmp_path / "cache"
    empty.mkdir(exist_ok=True)
    p = subprocess.run([sys.executable, "-c", FRESH, str(path), str(tmp_path / "inputs.npz"), *map(str, extra)],
                       env={**os.environ, "POLYJIT_CACHE_DIR": str(empty)}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_fresh_process_runs_a_saved_program_at_new_sizes_without_compiling(tmp_path, rng):
    """The symbolic sizes stay symbolic: one saved program serves every size."""
    exe = polyjit.compile(_blur, [InputInfo([3, -1, -1], F32)], {"target": "cpu"})
    arrays = {"a": rng.standard_normal((3, 40, 52), dtype=F32), "b": rng.standard_normal((3, 17, 9), dtype=F32)}
    want = {k: exe(v) for k, v in arrays.items()}
    exe.save(tmp_path / "blur.pjx")
    got = _fresh(tmp_path, tmp_path / "blur.pjx", arrays)
    assert got["kernels_compiled"] == 0
    for k, v in want.items():
        np.testing.assert_array_equal(np.array(got["outs"][k][0], F32), v)


def test_constants_scalars_and_several_outputs_are_saved(tmp_path, rng):
    m = _Mlp(rng)
    exe = polyjit.compile(m, [InputInfo([-1, 16], F32), InputInfo([], F32)], {"target": "cpu"})
    assert exe.graph.constant_arrays()  # (the weights are in the program, not arguments)
    x = rng.standard_normal((5, 16), dtype=F32)
    exe.save(tmp_path / "mlp.pjx")
    got = _fresh(tmp_path, tmp_path / "mlp.pjx", {"x": x}, 1.5)
    for g, w in zip(got["outs"]["x"], _mlp_ref(m, x, 1.5)):
        np.testing.assert_allclose(np.array(g), w, rtol=1e-5, atol=1e-5)


def test_a_loaded_executable_checks_its_inputs_before_running(tmp_path, rng):
    exe = polyjit.compile(_blur, [InputInfo([3, -1, -1], F32)], {"target": "cpu"})
    exe.save(tmp_path / "blur.pjx")
    loaded = polyjit.load(tmp_path / "blur.pjx")
    with pytest.raises(InputError, match="dtype float64"):
        loaded(np.zeros((3, 8, 8)))
    with pytest.raises(InputError, match="expected 1 inputs, got 2"):
        loaded(np.zeros((3, 8, 8), F32), np.zeros((3, 8, 8), F32))
    with pytest.raises(InputError, match=r"shape \[2, 8, 8\], expected size 3 in dimension 0"):
        loaded(np.zeros((2, 8, 8), F32))
    # a layout it was not compiled for: strided inputs, or another target
    strided = rng.standard_normal((3, 8, 16), dtype=F32)[:, :, ::2]
    with pytest.raises(InputError, match=r"needs cpu with inputs \[0\] strided, and the file holds cpu with "
                                         r"contiguous inputs"):
        loaded(strided)
    np.testing.assert_array_equal(loaded(np.ascontiguousarray(strided)), exe(np.ascontiguousarray(strided)))


def test_a_damaged_or_foreign_file_is_refused_with_the_reason(tmp_path):
    exe = polyjit.compile(_blur, [InputInfo([3, -1, -1], F32)], {"target": "cpu"})
    path = tmp_path / "blur.pjx"
    exe.save(path)
    data = path.read_bytes()
    for name, bad in (("flipped", data[:-9] + bytes([data[-9] ^ 1]) + data[-8:]), ("truncated", data[:len(data) // 2])):
        (tmp_path / name).write_bytes(bad)
        with pytest.raises(SavedExecutableError, match="damaged"):
            polyjit.load(tmp_path / name)
    (tmp_path / "entry.pjc").write_bytes(cache.encode({}, []))  # a compile cache entry is not a saved executable
    with pytest.raises(SavedExecutableError, match="not a polyjit saved executable"):
        polyjit.load(tmp_path / "entry.pjc")
    with pytest.raises(SavedExecutableError, match="cannot read"):
        polyjit.load(tmp_path / "missing.pjx")


def _rewritten(path, change) -> None:
    head, objects = cache.decode(path.read_bytes(), saved.MAGIC)
    change(head)
    path.write_bytes(cache.encode(head, objects, saved.MAGIC))


def test_another_version_s_file_or_another_cpu_s_code_is_refused(tmp_path, rng):
    exe = polyjit.compile(_blur, [InputInfo([3, -1, -1], F32)], {"target": "cpu"})
    path = tmp_path / "blur.pjx"
    exe.save(path)
    _rewritten(path, lambda h: h.update(polyjit="polyjit 0.0.1 0123456789abcdef"))
    with pytest.raises(SavedExecutableError, match=r"saved by polyjit 0\.0\.1 0123456789abcdef .* save it again"):
        polyjit.load(path)
    exe.save(path)
    _rewritten(path, lambda h: h.update(polyjit=h["polyjit"].rsplit(" ", 1)[0] + " 0123456789abcdef"))
    with pytest.raises(SavedExecutableError, match="save it again"):  # same version, other sources
        polyjit.load(path)
    exe.save(path)
    _rewritten(path, lambda h: h.update(format=saved.FORMAT + 1))
    with pytest.raises(SavedExecutableError, match="saved by a newer polyjit .* upgrade polyjit"):
        polyjit.load(path)
    exe.save(path)
    _rewritten(path, lambda h: h["programs"][0].pop("objects"))
    with pytest.raises(SavedExecutableError, match=r"not a well-formed polyjit saved executable \(KeyError"):
        polyjit.load(path)
    exe.save(path)

    def foreign(h):
        p = h["programs"][0]
        triple, cpu, features = p["machine"].split("|", 2)
        p["machine"] = f"{triple}|futurecpu|{features},+avx1024"
    _rewritten(path, foreign)
    loaded = polyjit.load(path)  # (read at once; its machine checked when a call needs the program)
    with pytest.raises(SavedExecutableError, match="futurecpu CPU, and this host's .* lacks avx1024"):
        loaded(rng.standard_normal((3, 8, 8), dtype=F32))


def test_nothing_compiled_is_nothing_to_save(tmp_path):
    from polyjit.api import Executable
    exe = polyjit.compile(_blur, [InputInfo([3, -1, -1], F32)], {"target": "cpu"})
    empty = Executable(exe.graph, exe.options, "blur")
    with pytest.raises(InputError, match="has compiled nothing yet"):
        empty.save(tmp_path / "x.pjx")
    assert not list(tmp_path.iterdir())


def test_a_loaded_program_takes_and_returns_torch_tensors(tmp_path, rng):
    torch = pytest.importorskip("torch")
    m = _Mlp(rng)
    exe = polyjit.compile(m, [InputInfo([-1, 16], F32), InputInfo([], F32)], {"target": "cpu"})
    exe.save(tmp_path / "mlp.pjx")
    loaded = polyjit.load(tmp_path / "mlp.pjx")
    x = torch.from_numpy(rng.standard_normal((4, 16), dtype=F32))
    y, s = loaded(x, torch.tensor(2.0))
    assert isinstance(y, torch.Tensor) and isinstance(s, torch.Tensor)
    for g, w in zip((y, s), _mlp_ref(m, x.numpy(), 2.0)):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5)


GPU_FRESH = """
import json, sys, numpy as np, torch, polyjit, polyjit.api
polyjit.api.compile_graph = None  # (nothing may compile here)
exe = polyjit.load(sys.argv[1])
x = torch.from_numpy(np.load(sys.argv[2])).cuda()
y = exe(x)
print(json.dumps({"out": y.cpu().numpy().tolist(), "cuda": y.is_cuda, "kernels_compiled": exe.stats["kernels_compiled"]}))
"""


@pytest.mark.gpu
def test_a_fresh_process_runs_a_saved_gpu_program_on_cuda_tensors(tmp_path, rng):
    pytest.importorskip("torch")
    exe = polyjit.compile(_blur, [InputInfo([3, -1, -1], F32)], {"target": "nvgpu"})
    x = rng.standard_normal((3, 64, 48), dtype=F32)
    want = exe(x)
    exe.save(tmp_path / "blur.pjx")
    assert b".target sm_" in (tmp_path / "blur.pjx").read_bytes()  # the PTX, as text
    np.save(tmp_path / "x.npy", x)
    empty = tmp_path / "cache"
    empty.mkdir()
    p = subprocess.run([sys.executable, "-c", GPU_FRESH, str(tmp_path / "blur.pjx"), str(tmp_path / "x.npy")],
                       env={**os.environ, "POLYJIT_CACHE_DIR": str(empty)}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["cuda"] and got["kernels_compiled"] == 0
    np.testing.assert_allclose(np.array(got["out"], F32), want, rtol=1e-5, atol=1e-6)


JAX_FRESH = """
import json, sys, numpy as np, jax, jax.numpy as jnp, polyjit, polyjit.api
polyjit.api.compile_graph = None  # (nothing may compile here)
f = polyjit.load(sys.argv[1])
d = np.load(sys.argv[2])
params = {"w1": jnp.asarray(d["w1"]), "b": jnp.asarray(d["b"]), "w2": jnp.asarray(d["w2"])}
out, skip, scale = f(params, jnp.asarray(d["x"]))
assert isinstance(out["y"], jax.Array) and scale.shape == () and float(scale) == 2.0
np.savez(sys.argv[3], y=np.asarray(out["y"]), mean=np.asarray(out["mean"]), skip=np.asarray(skip))
print(json.dumps({"kernels_compiled": f.stats["kernels_compiled"],
                  "frontend": "polyjit.frontends.jax" in sys.modules}))
"""


def _jax_block(params, x, training=True):
    import jax
    import jax.numpy as jnp
    h = jax.nn.gelu(x @ params["w1"] + params["b"]) * (0.5 if training else 1.0)
    return {"y": h @ params["w2"], "mean": h.mean(0)}, x, 2.0


def test_a_jax_function_saved_runs_in_a_fresh_process_without_tracing(tmp_path, rng):
    """Its arguments less the static ones, in the same structure; results in
    the function's structure, JAX arrays; an input and a constant returned
    as they were; no compile and no frontend in the loading process."""
    jax = pytest.importorskip("jax")
    arrays = {"w1": rng.standard_normal((16, 32), dtype=F32), "b": rng.standard_normal(32, dtype=F32),
              "w2": rng.standard_normal((32, 8), dtype=F32), "x": rng.standard_normal((6, 16), dtype=F32)}
    params = {k: jax.numpy.asarray(arrays[k]) for k in ("w1", "b", "w2")}
    f = polyjit.jit_jax(_jax_block, static_argnames="training")
    f.save(tmp_path / "block.pjx", params, jax.numpy.asarray(arrays["x"]), training=False)
    np.savez(tmp_path / "in.npz", **arrays)
    p = subprocess.run([sys.executable, "-c", JAX_FRESH, str(tmp_path / "block.pjx"), str(tmp_path / "in.npz"),
                        str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "POLYJIT_CACHE_DIR": str(tmp_path), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"kernels_compiled": 0, "frontend": False}
    got = np.load(tmp_path / "out.npz")
    (want, skip, _) = f(params, jax.numpy.asarray(arrays["x"]), training=False)  # (the same program here: on a GPU, TF32 products
    # as jax.jit's default precision, whose rounding differs from XLA's own)
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["mean"], want["mean"], rtol=1e-6, atol=1e-6)
    if jax.default_backend() == "cpu":
        ref, _, _ = jax.jit(_jax_block, static_argnames="training")(params, arrays["x"], training=False)
        np.testing.assert_allclose(got["y"], ref["y"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got["skip"], arrays["x"])

    loaded = polyjit.load(tmp_path / "block.pjx")
    with pytest.raises(InputError, match=r"_jax_block: arguments\[0\]: got keys \['b', 'w1'\], expected a dict of "
                                         r"keys \['b', 'w1', 'w2'\]"):
        loaded({"w1": params["w1"], "b": params["b"]}, arrays["x"])
    with pytest.raises(InputError, match="arguments: got a list of 3, expected a list of 2"):
        loaded(params, arrays["x"], False)


def test_a_jax_function_saved_with_symbolic_sizes_runs_at_every_size(tmp_path, rng):
    """Saved from ShapeDtypeStructs of jax.export's symbolic sizes: one
    program, loaded and run at other batch sizes with nothing compiled."""
    jax = pytest.importorskip("jax")
    from jax import export
    arrays = {"w1": rng.standard_normal((16, 32), dtype=F32), "b": rng.standard_normal(32, dtype=F32),
              "w2": rng.standard_normal((32, 8), dtype=F32)}
    params = {k: jax.numpy.asarray(v) for k, v in arrays.items()}
    spec = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in arrays.items()}
    f = polyjit.jit_jax(_jax_block, static_argnames="training")
    f.save(tmp_path / "block.pjx", spec, jax.ShapeDtypeStruct(export.symbolic_shape("b, 16"), F32), training=False)
    loaded = polyjit.load(tmp_path / "block.pjx")
    for n in (6, 1, 11):
        x = jax.numpy.asarray(rng.standard_normal((n, 16), dtype=F32))
        (got, _, _), (want, _, _) = loaded(params, x), jax.jit(_jax_block, static_argnames="training")(
            params, x, training=False)
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-5, atol=1e-5)
    assert loaded.stats["kernels_compiled"] == 0


def test_a_saved_function_checks_its_arguments_by_name(tmp_path, rng):
    """Shapes, dtypes and Python numbers are checked against what it was
    saved with, each error naming the argument's path, before any kernel
    runs; a constant it returns is a copy each call (changing one changes
    no later call); the file takes the umask's mode, not mkstemp's 0600."""
    jax = pytest.importorskip("jax")
    from jax import export
    jnp = jax.numpy

    def fn(params, x, n):
        return {"y": x @ params["w"] * n, "ones": jnp.ones(3)}
    w = rng.standard_normal((16, 8), dtype=F32)
    f = polyjit.jit_jax(fn)
    f.save(tmp_path / "f.pjx", {"w": jnp.asarray(w)}, jax.ShapeDtypeStruct(export.symbolic_shape("b, 16"), F32), 3)
    assert (os.stat(tmp_path / "f.pjx").st_mode & 0o777) == 0o666 & ~_umask()
    loaded = polyjit.load(tmp_path / "f.pjx")
    x = rng.standard_normal((5, 16), dtype=F32)
    out = loaded({"w": jnp.asarray(w)}, jnp.asarray(x), 2)  # (JAX's arrays: where it was saved for)
    tol = 1e-5 if jax.default_backend() == "cpu" else 3e-3  # (on a GPU, TF32 products: JAX's default precision)
    np.testing.assert_allclose(out["y"], jax.jit(fn)({"w": w}, x, 2)["y"], rtol=tol, atol=tol)
    if jax.default_backend() == "cpu":  # numpy results, which a caller may change in place
        out = loaded({"w": w}, x, 2)
        out["ones"] += 100
        np.testing.assert_array_equal(loaded({"w": w}, x, 2)["ones"], np.ones(3))
    w, x = jnp.asarray(w), jnp.asarray(x)
    with pytest.raises(InputError, match=r"arguments\[2\]: got the Python float 2\.5, expected int32"):
        loaded({"w": w}, x, 2.5)
    with pytest.raises(InputError, match=r"arguments\[2\]: got the Python int 1099511627776, expected int32"):
        loaded({"w": w}, x, 2 ** 40)
    with pytest.raises(InputError, match=r"arguments\[1\]: got float32\[5, 12\], expected float32\[b, 16\]"):
        loaded({"w": w}, x[:, :12], 2)
    with pytest.raises(InputError, match=r"arguments\[0\]\['w'\]: got float64\[16, 8\], expected float32\[16, 8\]"):
        loaded({"w": np.asarray(w, np.float64)}, x, 2)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_jax_function_the_framework_runs_part_of_is_not_saved(tmp_path, rng):
    jax = pytest.importorskip("jax")

    def f(x):
        return jax.lax.bessel_i0e(x * x + 1) * 2 + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (its fallback's: warned once in the process)
        jf = polyjit.jit_jax(f)
        with pytest.raises(SavedExecutableError, match=r"f: the framework runs part of it \(bessel_i0e\)"):
            jf.save(tmp_path / "f.pjx", jax.numpy.ones((3, 4)))
    assert not (tmp_path / "f.pjx").exists()


TF_FRESH = """
import json, sys, numpy as np, tensorflow as tf, polyjit, polyjit.api
polyjit.api.compile_graph = None  # (nothing may compile here)
f = polyjit.load(sys.argv[1])
y = f(tf.constant(np.load(sys.argv[2])))
assert isinstance(y["logits"], tf.Tensor)
np.save(sys.argv[3], y["logits"].numpy())
print(json.dumps({"kernels_compiled": f.stats["kernels_compiled"], "frontend": "polyjit.frontends.tf" in sys.modules}))
"""


def test_a_keras_model_saved_runs_in_a_fresh_process_with_its_weights(tmp_path, rng):
    """The variables the function reads are saved with their values then;
    the loading process builds no model, traces and compiles nothing."""
    tf = pytest.importorskip("tensorflow")
    layers = tf.keras.layers
    model = tf.keras.Sequential([tf.keras.Input((16, 16, 3)), layers.Conv2D(8, 3, activation="relu"),
                                 layers.MaxPooling2D(), layers.Flatten(), layers.Dense(10)])
    f = polyjit.jit_tf(lambda x: {"logits": model(x, training=False)})
    x = rng.standard_normal((4, 16, 16, 3), dtype=F32)
    f.save(tmp_path / "cnn.pjx", tf.constant(x))
    want = f(tf.constant(x))["logits"].numpy()
    np.testing.assert_allclose(want, model(x, training=False).numpy(), rtol=1e-5, atol=1e-5)
    np.save(tmp_path / "x.npy", x)
    p = subprocess.run([sys.executable, "-c", TF_FRESH, str(tmp_path / "cnn.pjx"), str(tmp_path / "x.npy"),
                        str(tmp_path / "y.npy")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "POLYJIT_CACHE_DIR": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"kernels_compiled": 0, "frontend": False}
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-6, atol=1e-6)

    v = tf.Variable(tf.zeros(4))

    def step(x):
        v.assign_add(tf.reduce_sum(x, 0))
        return v * 2.0
    with pytest.raises(SavedExecutableError, match="it assigns variables .* keeps no state"):
        polyjit.jit_tf(step).save(tmp_path / "step.pjx", tf.ones((3, 4)))


TORCH_FRESH = """
import json, sys, torch, polyjit, polyjit.api
polyjit.api.compile_graph = None  # (nothing may compile here)
f = polyjit.load(sys.argv[1])
x = torch.load(sys.argv[2]).to(sys.argv[4])
out, same = f(x)
assert out["logits"].device == x.device
assert same is x and isinstance(out["logits"], torch.Tensor)
torch.save({k: v.cpu() for k, v in out.items()}, sys.argv[3])
print(json.dumps({"kernels_compiled": f.stats["kernels_compiled"], "frontend": "polyjit.frontends.torch" in sys.modules}))
"""


def _torch_net():
    """A convolution, a batch norm in eval mode, a buffer, a dict of results and an input handed back."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
            self.fc = torch.nn.Linear(8, 4)
            self.register_buffer("scale", torch.tensor(2.0))

        def forward(self, x):
            h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
            return {"logits": self.fc(h) * self.scale, "features": h}, x
    return Net()


def _torch_module_round_trip(tmp_path, device: str):
    """net saved on ``device``, run in a fresh process on fresh data there: its results and eager's."""
    import torch
    net = _torch_net()
    with torch.no_grad():  # batch statistics of their own, so that folding them in counts
        net.bn.running_mean.normal_(), net.bn.running_var.uniform_(0.5, 2)
    net = net.eval().to(device)
    polyjit.jit_torch(net).save(tmp_path / "net.pjx", torch.randn(2, 3, 12, 12, device=device))
    x = torch.randn(2, 3, 12, 12)  # (fresh data, the same shape)
    torch.save(x, tmp_path / "x.pt")
    p = subprocess.run([sys.executable, "-c", TORCH_FRESH, str(tmp_path / "net.pjx"), str(tmp_path / "x.pt"),
                        str(tmp_path / "y.pt"), device], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "POLYJIT_CACHE_DIR": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"kernels_compiled": 0, "frontend": False}
    with torch.no_grad():
        want, _ = net(x.to(device))
    return net, torch.load(tmp_path / "y.pt"), {k: v.cpu() for k, v in want.items()}


def test_a_torch_module_saved_runs_in_a_fresh_process_with_its_weights(tmp_path):
    """Captured by torch.export, its parameters and buffers frozen into
    constants; the loading process traces and compiles nothing and does not
    import the frontend; a module that changes its buffers is refused."""
    torch = pytest.importorskip("torch")
    net, got, want = _torch_module_round_trip(tmp_path, "cpu")
    for k in ("logits", "features"):
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 3, 12, 12)

    net.train()  # its running statistics change at each call
    with pytest.raises(SavedExecutableError, match="it changes .*running_mean.* keeps no state"):
        polyjit.jit_torch(net).save(tmp_path / "train.pjx", x)

    def branchy(x):
        return x * 2 if x.sum() > 0 else x - 1  # (data-dependent: no one graph)
    with pytest.raises(SavedExecutableError, match="torch.export could not capture it as one graph"):
        polyjit.jit_torch(branchy).save(tmp_path / "branchy.pjx", x)


@pytest.mark.gpu
def test_a_torch_module_saved_on_a_gpu_runs_there_in_a_fresh_process(tmp_path):
    torch = pytest.importorskip("torch")
    _, got, want = _torch_module_round_trip(tmp_path, "cuda")
    for k in ("logits", "features"):  # (cuDNN's convolution in TF32 in both, as eager's default)
        torch.testing.assert_close(got[k], want[k], rtol=2e-3, atol=2e-3)


def test_a_torch_module_saved_with_dynamic_shapes_runs_at_other_sizes(tmp_path):
    """torch.export's dynamic_shapes keep the batch and sequence symbolic: one saved program for every size."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4)).eval()
    batch, seq = torch.export.Dim("batch", min=2), torch.export.Dim("seq", min=2)
    polyjit.jit_torch(model).save(tmp_path / "mlp.pjx", torch.randn(3, 5, 16), dynamic_shapes=({0: batch, 1: seq},))
    loaded = polyjit.load(tmp_path / "mlp.pjx")
    for shape in [(3, 5, 16), (7, 2, 16), (4, 11, 16)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-5)
    assert loaded.stats["kernels_compiled"] == 0
    with pytest.raises(InputError, match=r"arguments\[0\]: got float32\[3, 5, 8\], expected float32\[\w+, \w+, 16\]"):
        loaded(torch.randn(3, 5, 8))
    with pytest.raises(InputError, match=r"arguments\[0\]: got float32\[1, 5, 16\]: its size \w+ is 1, "
                                         r"saved for 2 to"):  # (torch.export's Dim bounds)
        loaded(torch.randn(1, 5, 16))


def test_a_transformers_model_s_output_comes_back_read_by_name_key_and_position(tmp_path):
    """A ModelOutput (a mapping of a class of its own) is a Record when loaded."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=100)
    model = transformers.BertModel(cfg).eval()
    polyjit.jit_torch(model).save(tmp_path / "bert.pjx", torch.randint(0, 100, (2, 8)))
    ids = torch.randint(0, 100, (2, 8))
    out = polyjit.load(tmp_path / "bert.pjx")(ids)
    with torch.no_grad():
        want = model(ids)
    assert list(out) == ["last_hidden_state", "pooler_output"]
    torch.testing.assert_close(out.last_hidden_state, want.last_hidden_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["pooler_output"], want.pooler_output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1], want[1], rtol=1e-5, atol=1e-5)
    assert isinstance(out[:2], tuple) and isinstance(want[:2], tuple)

    # keyword arguments, as transformers' models are called: the loaded function takes them by name
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    polyjit.jit_torch(model).save(tmp_path / "kw.pjx", input_ids=ids, attention_mask=mask)
    loaded = polyjit.load(tmp_path / "kw.pjx")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask)
    got = loaded(attention_mask=mask, input_ids=ids)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match=r"keyword arguments: got keys \['input_ids'\], expected a dict of keys"):
        loaded(input_ids=ids)


def test_a_tf_function_s_none_sizes_stay_symbolic_when_saved(tmp_path):
    tf = pytest.importorskip("tensorflow")
    dense = tf.keras.layers.Dense(4)
    f = polyjit.jit_tf(lambda x: tf.nn.gelu(dense(x)), input_signature=[tf.TensorSpec([None, 16], tf.float32)])
    f.save(tmp_path / "f.pjx", tf.ones((3, 16)))
    loaded = polyjit.load(tmp_path / "f.pjx")
    for batch in (3, 7, 1):
        x = tf.random.normal((batch, 16))
        np.testing.assert_allclose(loaded(x).numpy(), tf.nn.gelu(dense(x)).numpy(), rtol=1e-5, atol=1e-6)
    assert loaded.stats["kernels_compiled"] == 0
