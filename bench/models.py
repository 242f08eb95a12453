"""Real models against their frameworks' own compilers, in one run:
`make bench-models` (CPU) or `python bench/models.py --device cuda`.

For each model and backend, a fresh process builds the model (random
weights, fixed seed), compiles it on its first call (cold compile seconds:
the first call's time less a step's, every backend's own on-disk cache
empty) and times steps (median ms), alternating them with steps of the
framework's own run of the model (eager PyTorch, JAX without jit, a plain
tf.function): "vs eager" compares the two in one process, which a host
whose speed drifts from one process to the next cannot skew. polyjit's
process also compiles the peer (Inductor, XLA) and times the three in
turn: "vs peer" is the peer's step over polyjit's in that process. polyjit
then compiles the same model again in fresh processes: with its on-disk
cache warm, that compile is the framework's tracing plus a cache lookup,
set against the framework's own tracing (backend="aot_eager", a plain
tf.function; for JAX, jax.jit), each the median of --warm-samples fresh
processes run in turn (one sample of either differs between runs by about
as much as the two differ). Every backend's output is compared with
eager's, so a wrong result cannot pass for a fast one.

    python bench/models.py                      # every model on the CPU
    python bench/models.py --only bert gpt2     # some of them
    python bench/models.py --device cuda        # PyTorch and JAX models on a GPU
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

TORCH_BACKENDS = ("eager", "aot_eager", "inductor", "polyjit")
CNN_BACKENDS = ("eager", "inductor", "polyjit")  # aot_eager says nothing of convolutions' speed
JAX_BACKENDS = ("std", "xla", "polyjit")
TF_BACKENDS = ("std", "xla", "polyjit")
PEERS = {"torch": "inductor", "jax": "xla", "tf": "xla"}  # the compiler polyjit's process times beside it
OWN_TRACE = {"torch": "aot_eager", "jax": "xla", "tf": "std"}  # what a warm compile is set against


# ---------------------------------------------------------------- the models
def _torch_transformers(kind: str, train: bool, device: str):
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    big = device == "cuda"  # on the GPU: hidden 768, 2 layers, batch 16x256
    if kind == "bert":
        cfg = transformers.BertConfig(hidden_size=768 if big else 256, num_hidden_layers=2 if big else 4,
                                      num_attention_heads=12 if big else 4, intermediate_size=3072 if big else 1024,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model, out = transformers.BertModel(cfg), (lambda o: o.last_hidden_state)
    else:
        cfg = transformers.GPT2Config(n_embd=768 if big else 256, n_layer=2 if big else 4, n_head=12 if big else 4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model, out = transformers.GPT2LMHeadModel(cfg), (lambda o: o.logits)
    batch, seq = (16, 256) if big else (4, 128)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    return model.to(device), (ids,), out


def _torch_encoder(train: bool, device: str):
    import torch
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    return model.to(device), (torch.randn(4, 128, 256, device=device),), (lambda o: o)


def _torch_cnn(kind: str, train: bool, device: str):
    """bench/cnn.py's ResNet-18-class and MobileNetV3-small-class networks
    (batch norms with random statistics): 2x3x112x112 on the CPU, 32x3x224x224
    on a GPU."""
    import torch
    from cnn import mobilenet_v3_small, random_bn, resnet18  # bench/ is the script's folder
    model = random_bn(resnet18() if kind == "resnet18" else mobilenet_v3_small())
    shape = (32, 3, 224, 224) if device == "cuda" else (2, 3, 112, 112)
    return model.to(device), (torch.randn(*shape, device=device),), (lambda o: o)


TORCH_MODELS = {
    "bert": lambda train, device: _torch_transformers("bert", train, device),
    "gpt2": lambda train, device: _torch_transformers("gpt2", train, device),
    "encoder": _torch_encoder,
    "resnet18": lambda train, device: _torch_cnn("resnet18", train, device),
    "mobilenetv3": lambda train, device: _torch_cnn("mobilenetv3", train, device),
}


def _keras_model(kind: str):
    import tensorflow as tf
    tf.keras.utils.set_random_seed(0)
    if kind == "mobilenetv2":
        # logits, not their softmax: random weights give near-equal logits, whose
        # softmax is 1/1000 everywhere and would compare equal whatever ran
        model = tf.keras.applications.MobileNetV2(alpha=0.35, input_shape=(96, 96, 3), weights=None,
                                                  classifier_activation=None)
        x = np.random.default_rng(0).standard_normal((8, 96, 96, 3)).astype(np.float32)
    else:
        layers = tf.keras.layers
        model = tf.keras.Sequential([tf.keras.Input((32, 32, 3)), layers.Conv2D(32, 3, activation="relu"),
                                     layers.MaxPooling2D(), layers.Conv2D(64, 3, activation="relu"),
                                     layers.MaxPooling2D(), layers.Flatten(), layers.Dense(10)])
        x = np.random.default_rng(0).standard_normal((32, 32, 32, 3)).astype(np.float32)
    return model, tf.constant(x)


def _jax_block(train: bool):
    """A pre-norm transformer block in jax.numpy (and its gradient)."""
    import jax
    import jax.numpy as jnp
    d, h, f = 256, 4, 1024
    keys = jax.random.split(jax.random.key(0), 6)
    params = {"wqkv": jax.random.normal(keys[0], (d, 3 * d)) * d ** -0.5,
              "wo": jax.random.normal(keys[1], (d, d)) * d ** -0.5,
              "w1": jax.random.normal(keys[2], (d, f)) * d ** -0.5,
              "w2": jax.random.normal(keys[3], (f, d)) * f ** -0.5,
              "g1": jnp.ones(d), "g2": jnp.ones(d)}
    x = jax.random.normal(keys[4], (4, 128, d))

    def norm(x, g):
        m = x.mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g

    def block(p, x):
        b, t, _ = x.shape
        q, k, v = jnp.split(norm(x, p["g1"]) @ p["wqkv"], 3, -1)
        heads = lambda z: z.reshape(b, t, h, d // h).transpose(0, 2, 1, 3)  # noqa: E731
        a = jax.nn.softmax(heads(q) @ heads(k).transpose(0, 1, 3, 2) / (d // h) ** 0.5, -1) @ heads(v)
        x = x + a.transpose(0, 2, 1, 3).reshape(b, t, d) @ p["wo"]
        return x + jax.nn.gelu(norm(x, p["g2"]) @ p["w1"]) @ p["w2"]

    fn = jax.grad(lambda p, x: (block(p, x) ** 2).mean()) if train else block
    return fn, (params, x)


def _flax_cnn(train: bool):
    """A small flax.linen CNN: (3x3 conv, batch norm with running averages,
    relu, 2x2 average pooling) twice, a dense head; 8x32x32x3 (and the
    gradient of its parameters)."""
    import flax.linen as nn
    import jax

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            for c in (32, 64):
                x = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Conv(c, (3, 3))(x)))
                x = nn.avg_pool(x, (2, 2), (2, 2))
            return nn.Dense(10)(x.mean((1, 2)))
    keys = iter(jax.random.split(jax.random.key(0), 7))
    x, model = jax.random.normal(next(keys), (8, 32, 32, 3)), CNN()
    variables = model.init(next(keys), x)
    # running statistics away from 0 and 1, so that folding them into the convolutions counts
    stats = {name: {"mean": 0.5 * jax.random.normal(next(keys), s["mean"].shape),
                    "var": jax.random.uniform(next(keys), s["var"].shape, minval=0.5, maxval=2)}
             for name, s in variables["batch_stats"].items()}
    r = jax.random.normal(next(keys), (8, 10))

    def forward(params, stats, x):
        return model.apply({"params": params, "batch_stats": stats}, x)
    fn = jax.grad(lambda p, s, x: (forward(p, s, x) * r).sum()) if train else forward
    return fn, (variables["params"], stats, x)


JAX_MODELS = {"jax_block": _jax_block, "flax_cnn": _flax_cnn}


# ---------------------------------------------------------------- one measurement
WARMUP = 3  # untimed steps first: each backend's first runs after its compile fault in pages and caches
COMPILE_ONLY_STEPS = 3  # a compile-only process's timed steps (after one untimed)


def _median_ms(steps: dict, reps: int, sync=lambda: None, warmup: int = WARMUP) -> dict:
    """Median ms of each step, the steps timed in turn in the same process
    (so that a host whose speed drifts between processes moves them alike),
    each round starting one step later (so that none always follows the
    same one, and what it leaves behind): "ms" the backend's, "base_ms" the
    framework's own run of the model, "peer_ms" the peer's."""
    for s in steps.values():
        for _ in range(warmup):
            s()
    sync()
    times: dict = {k: [] for k in steps}
    order = list(steps.items())
    for i in range(reps):
        for k, s in order[i % len(order):] + order[:i % len(order)]:
            t = time.perf_counter()
            s()
            sync()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(spent) * 1e3 for k, spent in times.items()}


def _steps(step, base, peer) -> dict:
    """The steps to time: the backend's, the framework's own (None where it
    is the backend) and the peer's (polyjit's process only), by their keys."""
    return {k: f for k, f in (("base_ms", base), ("peer_ms", peer), ("ms", step)) if f is not None}


def _timed(step, base, peer, reps: int, compile_only: bool, sync=lambda: None) -> dict:
    """_median_ms of _steps; with ``compile_only`` the backend's step alone, a
    few times: what its first call's compile is reckoned less of."""
    if compile_only:
        return _median_ms({"ms": step}, COMPILE_ONLY_STEPS, sync, warmup=1)
    return _median_ms(_steps(step, base, peer), reps, sync)


def _peer_step(make, run):
    """The peer's step, ``run(make())``, compiled by a first call; None where
    the peer fails (polyjit's row is then timed without it)."""
    try:
        other = make()
        run(other)
    except Exception as e:  # (the peer's failure is the peer's row's to show)
        print(f"peer failed: {e!r}"[:200], file=sys.stderr)
        return None
    return lambda: run(other)


def _torch_run(name: str, backend: str, train: bool, device: str, reps: int, peer: str | None,
               compile_only: bool = False) -> dict:
    import torch
    import polyjit  # noqa: F401  (the "polyjit" backend is found without it, too)
    torch.manual_seed(0)
    model, args, out = TORCH_MODELS[name](train, device)
    model.train(train)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn = model if backend == "eager" else torch.compile(model, backend=backend)

    def run(f):
        if train:
            model.zero_grad(set_to_none=True)
            y = out(f(*args))
            y.float().pow(2).mean().backward()
            return y
        with torch.no_grad():
            return out(f(*args))
    t = time.perf_counter()
    y = run(fn)
    sync()
    first = time.perf_counter() - t
    other = _peer_step(lambda: torch.compile(model, backend=peer), run) if peer else None
    result = _timed(lambda: run(fn), None if fn is model else lambda: run(model), other, reps, compile_only, sync)
    result.update(first_s=first, out=y.detach().float().cpu().numpy())
    if backend == "polyjit":
        result.update(_polyjit_stats(polyjit.frontends.torch.stats()))
    return result


def _polyjit_stats(stats) -> dict:
    """What the warm process's row says: fallbacks, and graphs that did not come from the cache."""
    return {"fallbacks": stats["fallbacks"], "graphs": stats["graphs"], "cache_hits": stats["cache_hits"]}


def _jax_run(name: str, backend: str, train: bool, device: str, reps: int, peer: str | None,
             compile_only: bool = False) -> dict:
    import jax
    import polyjit
    fn, args = JAX_MODELS[name](train)
    f = {"std": fn, "xla": jax.jit(fn), "polyjit": polyjit.jit_jax(fn)}[backend]
    args = jax.device_put(args, jax.devices("gpu" if device == "cuda" else "cpu")[0])

    t = time.perf_counter()
    y = jax.block_until_ready(f(*args))
    first = time.perf_counter() - t
    other = _peer_step(lambda: jax.jit(fn), lambda g: jax.block_until_ready(g(*args))) if peer else None
    result = _timed(lambda: jax.block_until_ready(f(*args)),
                    None if f is fn else lambda: jax.block_until_ready(fn(*args)), other, reps, compile_only)
    leaves = jax.tree_util.tree_leaves(y)
    result.update(first_s=first, out=np.concatenate([np.ravel(np.asarray(v)) for v in leaves]))
    if backend == "polyjit":
        result.update(_polyjit_stats(f.stats))
    return result


def _tf_run(name: str, backend: str, train: bool, device: str, reps: int, peer: str | None,
            compile_only: bool = False) -> dict:
    import tensorflow as tf
    import polyjit
    model, x = _keras_model(name)
    fn = lambda x: model(x, training=False)  # noqa: E731
    std = tf.function(fn)
    f = {"std": std, "xla": tf.function(fn, jit_compile=True), "polyjit": polyjit.jit_tf(fn)}[backend]
    t = time.perf_counter()
    y = f(x).numpy()
    first = time.perf_counter() - t
    other = _peer_step(lambda: tf.function(fn, jit_compile=True), lambda g: g(x).numpy()) if peer else None
    result = _timed(lambda: f(x).numpy(), None if f is std else lambda: std(x).numpy(), other, reps, compile_only)
    result.update(first_s=first, out=y)
    if backend == "polyjit":
        result.update(_polyjit_stats(f.stats))
    return result


MODELS = {  # name: (framework, runner, training step too, backends)
    "bert": ("torch", _torch_run, True, TORCH_BACKENDS),
    "gpt2": ("torch", _torch_run, True, TORCH_BACKENDS),
    "encoder": ("torch", _torch_run, True, TORCH_BACKENDS),
    "resnet18": ("torch", _torch_run, True, CNN_BACKENDS),
    "mobilenetv3": ("torch", _torch_run, True, CNN_BACKENDS),
    "jax_block": ("jax", _jax_run, True, JAX_BACKENDS),
    "flax_cnn": ("jax", _jax_run, True, JAX_BACKENDS),
    "mobilenetv2": ("tf", _tf_run, False, TF_BACKENDS),
    "keras_cnn": ("tf", _tf_run, False, TF_BACKENDS),
}


def _one(args) -> None:
    """Child process: one (model, backend, mode) measurement, as JSON on the
    last line. ``--compile-only``: the first call and a few steps alone (no
    peer, no framework's run beside it)."""
    framework, run, _, _ = MODELS[args.one]
    r = run(args.one, args.backend, args.train, args.device, args.reps, args.peer, args.compile_only)
    out = r.pop("out")
    np.save(args.save, out)
    print(json.dumps(r))


def _spawn(name: str, backend: str, train: bool, device: str, reps: int, cache: str, peer: str = "",
           compile_only: bool = False) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".npy", delete=False) as f:
        path = f.name
    env = dict(os.environ, POLYJIT_CACHE_DIR=cache, PYTHONWARNINGS="ignore")
    peer_cache = tempfile.mkdtemp(prefix="peer-cache-")  # cold for every backend: Inductor's and Triton's too
    env.update(TORCHINDUCTOR_CACHE_DIR=peer_cache, TRITON_CACHE_DIR=os.path.join(peer_cache, "triton"))
    cmd = [sys.executable, __file__, "--one", name, "--backend", backend, "--device", device,
           "--reps", str(reps), "--save", path] + (["--train"] if train else []) + (["--peer", peer] if peer else []) + (
           ["--compile-only"] if compile_only else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    shutil.rmtree(peer_cache, ignore_errors=True)
    if proc.returncode:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return {"error": tail[0][:160]}
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["out"] = np.load(path)
    os.unlink(path)
    return r


def _check(out: np.ndarray, ref: np.ndarray) -> str:
    """The largest difference relative to the output's scale (which random
    weights can make tiny): float32 rounding in another order is ~1e-6, the
    GPU's TF32 convolutions in eager PyTorch ~1e-3."""
    err = float(np.abs(out.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))
    return f"{'ok' if err < 5e-3 else 'DIFFERS'} ({err:.0e})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--only", nargs="*", default=None, help=f"models: {', '.join(MODELS)}")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)
    p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--warm-samples", type=int, default=3,
                   help="fresh processes timed for a warm compile and for the framework's own tracing, each")
    args = p.parse_args()
    if args.one:
        return _one(args)
    names = args.only or [n for n, m in MODELS.items() if args.device == "cpu" or m[0] != "tf"]
    cache = tempfile.mkdtemp(prefix="polyjit-bench-cache-")
    print(f"device {args.device}; polyjit's cache in {cache} (cold, then warm in a fresh process)")
    print(f"{'model':<20}{'backend':<11}{'compile s':>10}{'warm s':>8}{'step ms':>10}{'vs eager':>9}{'vs peer':>9}"
          "  check")
    for name in names:
        framework, _, trains, backends = MODELS[name]
        for train in (False, True) if trains else (False,):
            label = f"{name} {'train' if train else 'fwd'}"
            peer = PEERS[framework]
            rows = {b: _spawn(name, b, train, args.device, args.reps, cache, peer if b == "polyjit" else "")
                    for b in backends}
            warm, own = _warm_samples(name, framework, train, args, cache) if "polyjit" in rows else ([], [])
            base = rows[backends[0]]
            for b, r in rows.items():
                if "error" in r:
                    print(f"{label:<20}{b:<11}  error: {r['error']}")
                    continue
                compile_s = max(r["first_s"] - r["ms"] / 1e3, 0.0)
                warm_s = f"{_median_compile(warm):8.2f}" if b == "polyjit" and warm else " " * 8
                # (the first backend's step timed in this backend's process, in alternation with its own)
                ratio = (r.get("base_ms") or base.get("ms", float("nan"))) / r["ms"]
                vs_peer = f"{r['peer_ms'] / r['ms']:8.2f}x" if "peer_ms" in r else " " * 9
                ok = _check(r["out"], base["out"]) if "out" in base else "?"
                extra = f", {r['fallbacks']} fallbacks" if r.get("fallbacks") else ""
                missed = max((w["graphs"] - w["cache_hits"] for w in warm), default=0) if b == "polyjit" else 0
                if missed:
                    extra += f", warm: {missed} graphs missed the cache"
                print(f"{label:<20}{b:<11}{compile_s:10.2f}{warm_s}{r['ms']:10.2f}{ratio:8.2f}x{vs_peer}  {ok}{extra}")
            if warm and own:
                w, o = _median_compile(warm), _median_compile(own)
                print(f"{label:<20}warm compile {w:.2f} s against {OWN_TRACE[framework]}'s {o:.2f} s ({w - o:+.2f}; "
                      f"medians of {len(warm)} and {len(own)} fresh processes)")


def _warm_samples(name: str, framework: str, train: bool, args, cache: str) -> tuple[list, list]:
    """Compile-only fresh processes, in turn: polyjit's with its cache warm,
    and the framework's own tracing (OWN_TRACE); those that ran."""
    warm, own = [], []
    for _ in range(args.warm_samples):
        warm.append(_spawn(name, "polyjit", train, args.device, args.reps, cache, compile_only=True))
        own.append(_spawn(name, OWN_TRACE[framework], train, args.device, args.reps, cache, compile_only=True))
    return [r for r in warm if "first_s" in r], [r for r in own if "first_s" in r]


def _median_compile(samples: list) -> float:
    """The median of the samples' first calls less a step."""
    return statistics.median(max(r["first_s"] - r["ms"] / 1e3, 0.0) for r in samples)


if __name__ == "__main__":
    main()
