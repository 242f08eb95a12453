"""Matrix products on the CPU: the library (BLAS) against polyjit's generated
nest, one product per program, timed in turn in one process, and what
`contractions="auto"` decides without timing (the target's model,
targets.cpu._whole_blocks). A row marked `WRONG` is a shape where the model
picks the generated nest and the library measured faster: the model needs
mending on this machine.

    python bench/products.py [--threads 2] [--only xw]

Kinds: xw (x @ W), xwt (x @ W.T, as nn.Linear: W packed at each call),
xtw (x.T @ W, a weight gradient), bmm (batched, attention's shapes).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from polyjit import library
from polyjit.compiler import compile_graph
from polyjit.dtypes import DataType
from polyjit.graph import Graph
from polyjit.options import CompileOptions

LINEAR = [(512, 256, 256), (512, 256, 1024), (512, 1024, 256), (2048, 768, 768), (2048, 768, 3072),
          (2048, 3072, 768), (128, 768, 768), (64, 256, 256), (16, 1024, 1024), (8, 768, 3072),
          (4096, 512, 512), (100, 300, 77), (1000, 37, 500), (8192, 64, 64), (256, 4096, 256),
          (33, 4096, 4096), (1024, 1024, 1024), (197, 384, 1152), (50, 768, 6282),
          (8, 1280, 1000), (2, 512, 1000), (32, 512, 128)]  # (M, K, N)
BATCHED = [(16, 128, 64, 128), (16, 128, 128, 64), (48, 256, 64, 256), (48, 256, 256, 64),
           (96, 197, 64, 197), (8, 1024, 64, 1024), (64, 64, 32, 64)]  # (B, M, K, N)


def product(kind: str, b: int, m: int, k: int, n: int) -> tuple[Graph, list[tuple[int, ...]]]:
    g = Graph()
    f = DataType.Float
    if kind == "bmm":
        shapes = [(b, m, k), (b, k, n)]
        x, w = (g.input(s, f) for s in shapes)
        g.add_output(g.dot_general(x, w, ((2,), (1,)), ((0,), (0,))))
        return g, shapes
    shapes = {"xw": [(m, k), (k, n)], "xwt": [(m, k), (n, k)], "xtw": [(k, m), (k, n)]}[kind]
    x, w = (g.input(s, f) for s in shapes)
    dims = {"xw": ((1,), (0,)), "xwt": ((1,), (1,)), "xtw": ((0,), (0,))}[kind]
    g.add_output(g.dot_general(x, w, dims))
    return g, shapes


def against_the_model(g: Graph, shapes, threads: int, rng, slack: float = 1.0) -> tuple[float, float, str]:
    """g's one contraction compiled generated and in the library, timed in
    turn, and what contractions="auto" settles for it without a timing (the
    target's model): (library seconds, generated seconds, the model's choice
    or "timed", marked WRONG where the choice measured over slack times slower)."""
    exes = {mode: compile_graph(g, CompileOptions(target="cpu", num_threads=threads, contractions=mode, cache=False),
                                "contraction") for mode in ("library", "generated")}
    library._measured.clear()
    timings = library._time  # the model's choice alone: no timing
    library._time = lambda *_: [0.0, float("inf")]
    try:
        auto = compile_graph(g, CompileOptions(target="cpu", num_threads=threads, cache=False), "contraction")
    finally:
        library._time = timings
    choice = auto.stats["contractions"][0].split(": ", 1)[1]
    args = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    time.sleep(0.1)
    t_lib, t_gen = library._time([exes["library"], exes["generated"]], args)
    if " ms" in choice:
        return t_lib, t_gen, "timed"
    slower = t_gen > slack * t_lib if choice.startswith("generated") else t_lib > slack * t_gen
    return t_lib, t_gen, choice + ("  WRONG" if slower else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["xw", "xwt", "xtw", "bmm"])
    a = ap.parse_args()
    cases = [(kind, 1, m, k, n) for m, k, n in LINEAR for kind in ("xw", "xwt", "xtw")]
    cases += [("bmm", b, m, k, n) for b, m, k, n in BATCHED]
    rng = np.random.default_rng(0)
    print(f"{'kind':5s} {'B':>3s} {'M':>5s} {'K':>5s} {'N':>5s} {'library ms':>11s} {'generated':>10s} "
          f"{'gen/lib':>8s}  auto, untimed")
    for kind, b, m, k, n in cases:
        if a.only and kind != a.only:
            continue
        g, shapes = product(kind, b, m, k, n)
        t_lib, t_gen, note = against_the_model(g, shapes, a.threads, rng)
        print(f"{kind:5s} {b:3d} {m:5d} {k:5d} {n:5d} {t_lib * 1e3:11.3f} {t_gen * 1e3:10.3f} {t_gen / t_lib:8.2f}  "
              f"{note}", flush=True)


if __name__ == "__main__":
    main()
