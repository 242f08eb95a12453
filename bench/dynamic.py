"""Transformers called with a sequence length that changes from call to
call, as a user's batches of sentences are: `python bench/dynamic.py`
(CPU) or `--device cuda`.

Each backend gets the model fresh (every on-disk cache empty) and calls it at lengths L, 3L/4, L/2 and
5L/8 of bench/models.py's batch (torch.compile's default: the second length
makes the sequence symbolic, later lengths reuse that code). Printed per
backend: the seconds the four first calls took over four steps (the
compiles), dynamo's compiled frames (JAX and TF: programs traced), and
the median step at each length against the framework's own at that
length (eager, un-jitted JAX, tf.function), outputs checked against it.
jax_block (bench/models.py's, sequence lengths) and keras_cnn (batch
sizes) run per shape and with reduce_retracing, beside jax.jit and
tf.function (with and without reduce_retracing).

    python bench/dynamic.py --only bert jax_block keras_cnn --mode train
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

_CACHES = tempfile.mkdtemp(prefix="polyjit-bench-dynamic-")  # every backend's on-disk cache cold
os.environ.update(POLYJIT_CACHE_DIR=os.path.join(_CACHES, "polyjit"),
                  TORCHINDUCTOR_CACHE_DIR=os.path.join(_CACHES, "inductor"),
                  TRITON_CACHE_DIR=os.path.join(_CACHES, "triton"))

from models import _jax_block, _keras_model, _torch_transformers

BACKENDS = ("eager", "inductor", "polyjit")
JAX_BACKENDS = ("jax", "jax.jit", "polyjit", "polyjit relaxed")
TF_BACKENDS = ("tf.function", "tf.f. relaxed", "polyjit", "polyjit relaxed")


def _lengths(n: int) -> list[int]:
    return [n, n * 3 // 4, n // 2, n * 5 // 8]


def _calls(step, inputs: list, reps: int) -> tuple[float, list, list]:
    """The four first calls' seconds, their outputs, and each input's median step."""
    t0 = time.perf_counter()
    first = [step(x) for x in inputs]
    first_s = time.perf_counter() - t0
    steps = []
    for x in inputs:
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            step(x)
            ts.append(time.perf_counter() - t)
        steps.append(statistics.median(ts))
    return first_s, first, steps


def _run(name: str, mode: str, backend: str, device: str, reps: int) -> dict:
    import torch
    torch.manual_seed(0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, (ids,), out = _torch_transformers(name, mode == "train", device)
    model.train(mode == "train")
    fn = model if backend == "eager" else torch.compile(model, backend=backend)
    lengths = _lengths(ids.shape[1])

    def step(x):
        if mode == "train":
            model.zero_grad(set_to_none=True)
            y = out(fn(x))
            y.float().pow(2).mean().backward()
        else:
            with torch.no_grad():
                y = out(fn(x))
        if device == "cuda":
            torch.cuda.synchronize()
        return y

    first_s, first, steps = _calls(step, [ids[:, :n].contiguous() for n in lengths], reps)
    first = [y.detach().float().cpu() for y in first]
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"] if backend != "eager" else 0
    return {"lengths": lengths, "first_s": first_s, "steps": steps, "outputs": first, "frames": frames}


def _run_jax(mode: str, backend: str, device: str, reps: int) -> dict:
    import jax
    import numpy as np
    import polyjit
    fn, (params, x) = _jax_block(mode == "train")
    where = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    params, x = jax.device_put((params, x), where)
    f = {"jax": fn, "jax.jit": jax.jit(fn), "polyjit": polyjit.jit_jax(fn),
         "polyjit relaxed": polyjit.jit_jax(fn, reduce_retracing=True)}[backend]
    lengths = _lengths(x.shape[1])
    first_s, first, steps = _calls(lambda x: np.concatenate(
        [np.ravel(np.asarray(v)) for v in jax.tree_util.tree_leaves(jax.block_until_ready(f(params, x)))]),
        [x[:, :n] for n in lengths], reps)
    frames = f.stats["graphs"] if backend.startswith("polyjit") else f._cache_size() if backend == "jax.jit" else 0
    return {"lengths": lengths, "first_s": first_s, "steps": steps, "outputs": first, "frames": frames}


def _run_tf(mode: str, backend: str, device: str, reps: int) -> dict:
    import polyjit
    import tensorflow as tf
    model, x = _keras_model("keras_cnn")
    fn = lambda x: model(x, training=False)  # noqa: E731
    f = {"tf.function": tf.function(fn), "tf.f. relaxed": tf.function(fn, reduce_retracing=True),
         "polyjit": polyjit.jit_tf(fn), "polyjit relaxed": polyjit.jit_tf(fn, reduce_retracing=True)}[backend]
    lengths = _lengths(x.shape[0])
    first_s, first, steps = _calls(lambda x: f(x).numpy(), [x[:n] for n in lengths], reps)
    frames = f.stats["graphs"] if backend.startswith("polyjit") else f.experimental_get_tracing_count()
    return {"lengths": lengths, "first_s": first_s, "steps": steps, "outputs": first, "frames": frames}


RUNNERS = {"jax_block": (_run_jax, JAX_BACKENDS), "keras_cnn": (_run_tf, TF_BACKENDS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=["bert", "gpt2"])
    ap.add_argument("--mode", nargs="*", default=["fwd", "train"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    print(f"device {args.device}; lengths L, 3L/4, L/2, 5L/8 of each model's batch")
    print(f"{'model':<17}{'backend':<16}{'first calls s':>14}{'frames':>8}   step ms at each length (vs eager)   check")
    for name in args.only:
        runner, backends = RUNNERS.get(name, (lambda *a: _run(name, *a), BACKENDS))
        for mode in args.mode if name != "keras_cnn" else ["fwd"]:
            eager = None
            for backend in backends:
                r = runner(mode, backend, args.device, args.reps)
                eager = eager or r
                ratios = "  ".join(f"{s * 1e3:7.2f} ({e / s:4.2f}x)" for s, e in zip(r["steps"], eager["steps"]))
                err = max(float(abs(a - b).max()) for a, b in zip(r["outputs"], eager["outputs"]))
                first = r["first_s"] - sum(r["steps"])
                print(f"{name + ' ' + mode:<17}{backend:<16}{first:>14.2f}{r['frames']:>8}   {ratios}   "
                      f"{'ok' if err < 1e-3 else 'WRONG'} ({err:.0e})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
