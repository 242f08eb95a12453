"""Transformers called with a sequence length that changes from call to
call, as a user's batches of sentences are: `python bench/dynamic.py`
(CPU) or `--device cuda`.

Each backend gets the model fresh (every on-disk cache empty) and calls it at lengths L, 3L/4, L/2 and
5L/8 of bench/models.py's batch (torch.compile's default: the second length
makes the sequence symbolic, later lengths reuse that code). Printed per
backend: the seconds the four first calls took over four steps (the
compiles), dynamo's compiled frames, and the median step at each length
against eager's at that length, outputs checked against eager's.

    python bench/dynamic.py --only bert --mode train
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

from models import _torch_transformers

BACKENDS = ("eager", "inductor", "polyjit")


def _run(name: str, mode: str, backend: str, device: str, reps: int) -> dict:
    import torch
    torch.manual_seed(0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, (ids,), out = _torch_transformers(name, mode == "train", device)
    model.train(mode == "train")
    fn = model if backend == "eager" else torch.compile(model, backend=backend)
    seq = ids.shape[1]
    lengths = [seq, seq * 3 // 4, seq // 2, seq * 5 // 8]

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

    inputs = [ids[:, :n].contiguous() for n in lengths]
    t0 = time.perf_counter()
    first = [step(x).detach().float().cpu() for x in inputs]
    first_s = time.perf_counter() - t0
    steps = []
    for x in inputs:
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            step(x)
            ts.append(time.perf_counter() - t)
        steps.append(statistics.median(ts))
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"] if backend != "eager" else 0
    return {"lengths": lengths, "first_s": first_s, "steps": steps, "outputs": first, "frames": frames}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=["bert", "gpt2"])
    ap.add_argument("--mode", nargs="*", default=["fwd", "train"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    print(f"device {args.device}; lengths L, 3L/4, L/2, 5L/8 of each model's batch")
    print(f"{'model':<14}{'backend':<10}{'first calls s':>14}{'frames':>8}   step ms at each length (vs eager)   check")
    for name in args.only:
        for mode in args.mode:
            eager = None
            for backend in BACKENDS:
                r = _run(name, mode, backend, args.device, args.reps)
                eager = eager or r
                ratios = "  ".join(f"{s * 1e3:7.2f} ({e / s:4.2f}x)" for s, e in zip(r["steps"], eager["steps"]))
                err = max(float((a - b).abs().max()) for a, b in zip(r["outputs"], eager["outputs"]))
                first = r["first_s"] - sum(r["steps"])
                print(f"{name + ' ' + mode:<14}{backend:<10}{first:>14.1f}{r['frames']:>8}   {ratios}   "
                      f"{'ok' if err < 1e-3 else 'WRONG'} ({err:.0e})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
