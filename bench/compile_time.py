"""Cold (and warm-cache) compile seconds of real models, per stage, against
the same model through other torch.compile backends in the same run.

Each measurement is a fresh process: the model's first training step
(forward and backward; with `--fwd` its forward under `no_grad`) through
`torch.compile(model, backend=...)`, less the median of three later steps,
in wall seconds and in the main thread's CPU seconds (`cpu`: what the
tracing and compiling cost, little moved by other processes on a shared
machine, where a step's wall time can swing by seconds; a cold compile
also works on other threads and processes, which it leaves out). For
polyjit the seconds of each compile stage, summed over the model's graphs
(`stats["compile_seconds_by_stage"]`), and the kernels compiled. Backends
run interleaved, `--rounds` times, so that a loaded machine's drift falls
on all of them. Cold means cold for every backend: polyjit's compile cache
and Inductor's (TORCHINDUCTOR_CACHE_DIR) start empty; `inductor-warm`
keeps Inductor's own cache folder as earlier runs left it (kernels of
other models, and of this one if it ran before).

    python bench/compile_time.py                       # bert and encoder, cold
    python bench/compile_time.py --only bert --warm    # also polyjit from a warm cache
    python bench/compile_time.py --only bert --backends aot_eager polyjit --rounds 3 --cache DIR  # warm, interleaved
    python bench/compile_time.py --only bert --fwd --backends inductor polyjit --warm   # the forward alone
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _one(name: str, backend: str, train: bool) -> dict:
    import torch

    import polyjit  # noqa: F401
    from models import TORCH_MODELS
    torch.manual_seed(0)
    model, args, out = TORCH_MODELS[name](train, "cpu")
    model.train(train)
    fn = torch.compile(model, backend=backend)

    def step():
        if train:
            model.zero_grad(set_to_none=True)
            out(fn(*args)).pow(2).mean().backward()
        else:
            with torch.no_grad():
                out(fn(*args))

    def timed():
        t, c = time.perf_counter(), time.thread_time()
        step()
        return time.perf_counter() - t, time.thread_time() - c
    first, first_cpu = timed()
    later = [timed() for _ in range(3)]
    r = {"compile_s": max(first - statistics.median(w for w, _ in later), 0.0),
         "cpu_s": max(first_cpu - statistics.median(c for _, c in later), 0.0)}
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


def _spawn(name: str, backend: str, cache: str, train: bool) -> dict:
    env = dict(os.environ, POLYJIT_CACHE_DIR=cache, PYTHONWARNINGS="ignore")
    if backend == "inductor":
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
    proc = subprocess.run([sys.executable, __file__, "--one", name, "--backend", backend.split("-")[0]]
                          + ([] if train else ["--fwd"]),
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
    p.add_argument("--fwd", action="store_true", help="the forward under no_grad, not a training step")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(_one(a.one, a.backend, not a.fwd)))
        return
    print("load average %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    for name in a.only:
        for _ in range(a.rounds):
            cache = a.cache or tempfile.mkdtemp(prefix="polyjit-compile-time-")
            runs = [(b, _spawn(name, b, cache, not a.fwd)) for b in a.backends]
            if a.warm:
                runs.append(("polyjit warm", _spawn(name, "polyjit", cache, not a.fwd)))
            for b, r in runs:
                if "error" in r:
                    print(f"{name:<9}{b:<14} error: {r['error']}")
                    continue
                line = f"{name:<9}{b:<14}{r['compile_s']:8.2f} s (cpu {r['cpu_s']:6.2f} s)"
                if "stages" in r:
                    line += (f"  ({r['compiled']} of {r['kernels']} kernels compiled; "
                             + ", ".join(f"{k} {v:.2f}" for k, v in r["stages"].items()) + ")")
                print(line, flush=True)
    print("load average %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
