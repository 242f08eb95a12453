"""Cold (and warm-cache) compile seconds of real models, per stage, against
the same model through other torch.compile backends in the same run.

Each measurement is a fresh process: the model's first training step
(forward and backward) through `torch.compile(model, backend=...)`, less a
step's time. For polyjit the seconds of each compile stage, summed over the
model's graphs (`stats["compile_seconds_by_stage"]`), and the kernels
compiled. Backends run interleaved, `--rounds` times, so that a loaded
machine's drift falls on all of them. Cold means cold for every backend:
polyjit's compile cache and Inductor's (TORCHINDUCTOR_CACHE_DIR) start
empty; `inductor-warm` keeps Inductor's own cache folder as earlier runs
left it (kernels of other models, and of this one if it ran before).

    python bench/compile_time.py                       # bert and encoder, cold
    python bench/compile_time.py --only bert --warm    # also polyjit from a warm cache
    python bench/compile_time.py --only bert --backends aot_eager polyjit --rounds 3 --cache DIR  # warm, interleaved
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _one(name: str, backend: str) -> dict:
    import torch

    import polyjit  # noqa: F401
    from models import TORCH_MODELS
    torch.manual_seed(0)
    model, args, out = TORCH_MODELS[name](True, "cpu")
    model.train(True)
    fn = torch.compile(model, backend=backend)

    def step():
        model.zero_grad(set_to_none=True)
        out(fn(*args)).pow(2).mean().backward()
    t = time.perf_counter()
    step()
    first = time.perf_counter() - t
    t = time.perf_counter()
    step()
    r = {"compile_s": max(first - (time.perf_counter() - t), 0.0)}
    if backend == "polyjit":
        from polyjit.frontends.torch import stats
        graphs = stats().graphs.values()
        stages: dict = {}
        for s in graphs:
            for k, v in s.get("compile_seconds_by_stage", {}).items():
                stages[k] = stages.get(k, 0.0) + v
        r["stages"] = stages
        r["kernels"] = sum(s.get("kernels", 0) for s in graphs)
        r["compiled"] = sum(s.get("kernels_compiled", 0) for s in graphs)
        r["fallbacks"] = stats()["fallbacks"]
    return r


def _spawn(name: str, backend: str, cache: str) -> dict:
    env = dict(os.environ, POLYJIT_CACHE_DIR=cache, PYTHONWARNINGS="ignore")
    if backend == "inductor":
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
    proc = subprocess.run([sys.executable, __file__, "--one", name, "--backend", backend.split("-")[0]],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", default=["bert", "encoder"])
    p.add_argument("--backends", nargs="*", default=["aot_eager", "inductor", "polyjit"],
                   help="aot_eager, inductor (cold), inductor-warm, polyjit")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--warm", action="store_true", help="then polyjit again in a fresh process, its cache warm")
    p.add_argument("--cache", help="polyjit's cache folder for every round (default: a fresh one per round)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(_one(a.one, a.backend)))
        return
    print("load average %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    for name in a.only:
        for _ in range(a.rounds):
            cache = a.cache or tempfile.mkdtemp(prefix="polyjit-compile-time-")
            runs = [(b, _spawn(name, b, cache)) for b in a.backends]
            if a.warm:
                runs.append(("polyjit warm", _spawn(name, "polyjit", cache)))
            for b, r in runs:
                if "error" in r:
                    print(f"{name:<9}{b:<14} error: {r['error']}")
                    continue
                line = f"{name:<9}{b:<14}{r['compile_s']:8.2f} s"
                if "stages" in r:
                    line += (f"  ({r['compiled']} of {r['kernels']} kernels compiled; "
                             + ", ".join(f"{k} {v:.2f}" for k, v in r["stages"].items()) + ")")
                print(line, flush=True)
    print("load average %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
