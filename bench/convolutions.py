"""Channels-last convolutions on the CPU (NHWC, as JAX and Keras hold
them): the library (im2col and BLAS) against polyjit's generated nest, one
convolution per program, timed in turn in one process, and what
`contractions="auto"` decides without timing (the CPU target's model,
targets.cpu._channels_last). A row marked `WRONG` is a shape where the
model's choice measured slower by more than 10%: the model needs mending on
this machine.

    python bench/convolutions.py [--threads 2] [--only forward]

Kinds, as JAX's gradients write them: forward (HWIO kernel), input
gradient (the flipped kernel read as HWOI), weight gradient (images and
positions reduced: the input as CHWN, the output gradient as IHWO).
"""
from __future__ import annotations

import argparse

import numpy as np
from products import against_the_model

from polyjit.dtypes import DataType
from polyjit.graph import Graph

CASES = [  # (N, H, W, C in), kernel size, C out, stride, padding
    ((8, 32, 32, 3), 3, 32, 1, 1), ((8, 16, 16, 32), 3, 64, 1, 1), ((8, 96, 96, 3), 3, 16, 2, 1),
    ((32, 30, 30, 32), 3, 64, 1, 0), ((8, 56, 56, 64), 3, 64, 1, 1), ((8, 28, 28, 128), 3, 128, 1, 1),
    ((8, 14, 14, 256), 3, 256, 1, 1), ((8, 56, 56, 64), 3, 128, 2, 1), ((8, 7, 7, 512), 3, 512, 1, 1),
    ((8, 32, 32, 16), 3, 8, 1, 1), ((8, 32, 32, 16), 3, 24, 1, 1), ((8, 28, 28, 64), 3, 24, 1, 0),
    ((8, 32, 32, 32), 3, 48, 1, 1), ((8, 32, 32, 16), 5, 32, 1, 2), ((8, 28, 28, 64), 1, 128, 1, 0),
    ((8, 56, 56, 32), 1, 32, 1, 0), ((8, 12, 12, 40), 1, 240, 1, 0), ((8, 3, 3, 336), 1, 56, 1, 0),
    ((8, 24, 24, 48), 1, 8, 1, 0), ((8, 28, 28, 32), 3, 40, 1, 1), ((8, 48, 48, 16), 3, 24, 2, 1),
    ((8, 28, 28, 64), 3, 64, 2, 1), ((8, 56, 56, 32), 1, 64, 2, 0), ((8, 112, 112, 3), 3, 32, 2, 1),
]


def convolution(kind: str, xs, k: int, co: int, stride: int, pad: int) -> tuple[Graph, list[tuple[int, ...]]]:
    g = Graph()
    f = DataType.Float
    n, h, w, ci = xs
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    pads = [(pad, pad)] * 2
    if kind == "forward":
        shapes = [xs, (k, k, ci, co)]
        x, kern = (g.input(s, f) for s in shapes)
        g.add_output(g.conv(x, kern, [stride] * 2, pads, layout="NHWC", kernel_layout="HWIO"))
    elif kind == "input gradient":  # stride 1 only: a strided one spreads the gradient first
        shapes = [(n, h, w, co), (k, k, ci, co)]
        dy, kern = (g.input(s, f) for s in shapes)
        g.add_output(g.conv(dy, g.reverse(kern, [0, 1]), [1, 1], [(k - 1 - pad,) * 2] * 2, layout="NHWC",
                            kernel_layout="HWOI"))
    else:
        shapes = [xs, (n, oh, ow, co)]
        x, dy = (g.input(s, f) for s in shapes)
        taps = [(pad, (o - 1) * stride + k - size - pad) for o, size in ((oh, h), (ow, w))]  # k taps out
        g.add_output(g.conv(x, dy, [1, 1], taps, dilation=[stride] * 2, layout="CHWN", kernel_layout="IHWO"))
    return g, shapes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["forward", "input", "weight"])
    a = ap.parse_args()
    kinds = [kind for kind in ("forward", "input gradient", "weight gradient")
             if not a.only or kind.startswith(a.only)]
    rng = np.random.default_rng(0)
    print(f"{'kind':15s} {'input':>18s} {'k':>2s} {'out':>4s} {'s':>2s} {'library ms':>11s} {'generated':>10s} "
          f"{'gen/lib':>8s}  auto, untimed")
    for kind in kinds:
        for xs, k, co, stride, pad in CASES:
            if kind == "input gradient" and stride != 1:
                continue
            g, shapes = convolution(kind, xs, k, co, stride, pad)
            t_lib, t_gen, note = against_the_model(g, shapes, a.threads, rng, slack=1.1)
            print(f"{kind:15s} {str(xs):>18s} {k:2d} {co:4d} {stride:2d} {t_lib * 1e3:11.3f} {t_gen * 1e3:10.3f} "
                  f"{t_gen / t_lib:8.2f}  {note}", flush=True)


if __name__ == "__main__":
    main()
