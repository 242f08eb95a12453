"""The nvgpu target on one GPU: eager PyTorch, TorchInductor, jax.jit (XLA) and
polyjit side by side in one run, as ratios against eager, with achieved
GB/s against the measured copy bandwidth. `python bench/gpu.py` on a GPU.

Times are medians of CUDA-event timings of back-to-back launches; each
contender's outputs are checked against eager first.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import polyjit


def blur(img):
    bx = (img[:, :, 0:-4] + img[:, :, 1:-3] + img[:, :, 2:-2] + img[:, :, 3:-1] + img[:, :, 4:]) * 0.2
    return (bx[:, 0:-4] + bx[:, 1:-3] + bx[:, 2:-2] + bx[:, 3:-1] + bx[:, 4:]) * 0.2


def bdal(x, bias, res, w, b):
    return F.layer_norm(F.dropout(x + bias, 0.0, True) + res, (x.shape[-1],), w, b)


def bdal_train(x, bias, res, w, b):
    out = bdal(x, bias, res, w, b)
    out.backward(torch.ones_like(out))
    return out


def cos_sin(x):
    return torch.cos(x) + torch.sin(x)


def softmax(x):
    return F.softmax(x, -1)


def _jax_versions():
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return {}

    def jblur(img):
        bx = (img[:, :, 0:-4] + img[:, :, 1:-3] + img[:, :, 2:-2] + img[:, :, 3:-1] + img[:, :, 4:]) * 0.2
        return (bx[:, 0:-4] + bx[:, 1:-3] + bx[:, 2:-2] + bx[:, 3:-1] + bx[:, 4:]) * 0.2

    def jln(x, bias, res, w, b):
        y = x + bias + res
        m = y.mean(-1, keepdims=True)
        v = ((y - m) ** 2).mean(-1, keepdims=True)
        return (y - m) * jax.lax.rsqrt(v + 1e-5) * w + b

    def jln_train(x, bias, res, w, b):
        return jax.grad(lambda *a: jln(*a).sum(), argnums=(0, 1, 3, 4))(x, bias, res, w, b)
    return {"tiny": lambda x: x * 2 + 1, "cos_sin": lambda x: jnp.cos(x) + jnp.sin(x), "blur": jblur, "bdal": jln,
            "bdal_train": jln_train, "softmax": lambda x: jax.nn.softmax(x, -1)}


def cuda_time(fn, reps: int, rounds: int = 7) -> float:
    """Median seconds per call over rounds of reps back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def wall_time(fn, wait, reps: int, rounds: int = 7) -> float:
    """As cuda_time, for work on streams torch does not see (XLA's): host
    clock around reps calls and one wait for the last."""
    wait(fn())
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn()
        wait(out)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    x = torch.empty(nbytes // 4, device="cuda")
    y = torch.empty_like(x)
    return 2 * nbytes / cuda_time(lambda: y.copy_(x), 20)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--only", default="")
    args = p.parse_args()
    dev = "cuda"
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e9:.0f} GB/s")
    cases = [
        ("tiny", "x*2+1 on 1024 floats (per-call overhead)", lambda x: x * 2 + 1,
         lambda: [torch.randn(1024, device=dev)], 8 * 1024),
        ("cos_sin", "cos(x)+sin(x) 64M", cos_sin, lambda: [torch.randn(64 << 20, device=dev)], 8 * (64 << 20)),
        ("blur", "blur_x_blur_y 3x4096x4096", blur, lambda: [torch.rand(3, 4096, 4096, device=dev)],
         8 * 3 * 4096 * 4096),
        ("bdal", "bias-dropout-add-layernorm 64x128x1024 fwd", bdal,
         lambda: [torch.randn(64, 128, 1024, device=dev), torch.randn(1024, device=dev),
                  torch.randn(64, 128, 1024, device=dev), torch.randn(1024, device=dev),
                  torch.randn(1024, device=dev)], 3 * 4 * 64 * 128 * 1024),
        ("bdal_train", "bias-dropout-add-layernorm fwd+bwd", bdal_train,
         lambda: [torch.randn(64, 128, 1024, device=dev, requires_grad=True),
                  torch.randn(1024, device=dev, requires_grad=True), torch.randn(64, 128, 1024, device=dev),
                  torch.randn(1024, device=dev, requires_grad=True),
                  torch.randn(1024, device=dev, requires_grad=True)], None),
        ("softmax", "softmax 8192x8192", softmax, lambda: [torch.randn(8192, 8192, device=dev)], 8 * 8192 * 8192),
    ]
    jaxfns = _jax_versions()
    labels = ("eager", "inductor", "jax.jit", "polyjit", "polyjit (jax)")
    print(f"{'case':45s} " + " ".join(f"{k:>13s}" for k in labels) + "   ratios vs eager   polyjit GB/s (% of copy)")
    for key, name, fn, make, nbytes in cases:
        if args.only and key not in args.only.split(","):
            continue
        inputs = make()
        train = key == "bdal_train"
        contenders = {"eager": fn, "inductor": torch.compile(fn, backend="inductor"),
                      "polyjit": polyjit.jit_torch(fn, compile_options={"target": "nvgpu"})}
        times = {}
        want = fn(*inputs)
        for label, f in contenders.items():
            out = f(*inputs)
            if not train:
                torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
            times[label] = cuda_time(lambda f=f: f(*inputs), args.reps)
        if key in jaxfns:
            import jax
            jx = [jax.dlpack.from_dlpack(t.detach()) for t in inputs]
            jf, pf = jax.jit(jaxfns[key]), polyjit.jit_jax(jaxfns[key], compile_options={"target": "nvgpu"})
            for a, b in zip(jax.tree_util.tree_leaves(jf(*jx)), jax.tree_util.tree_leaves(pf(*jx))):
                np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-4)
            times["jax.jit"] = wall_time(lambda: jf(*jx), jax.block_until_ready, args.reps)
            times["polyjit (jax)"] = wall_time(lambda: pf(*jx), jax.block_until_ready, args.reps)
        stats = contenders["polyjit"].stats
        row = " ".join(f"{times.get(k, float('nan')) * 1e3:11.3f}ms" for k in labels)
        ratios = " ".join(f"{times['eager'] / times[k]:5.2f}x" for k in labels[1:] if k in times)
        extra = f"{nbytes / times['polyjit'] / 1e9:7.0f} ({100 * nbytes / times['polyjit'] / bw:3.0f}%)" if nbytes \
            else f"{1 / times['polyjit']:7.0f} it/s (eager {1 / times['eager']:.0f}, inductor " \
                 f"{1 / times['inductor']:.0f}" + (f", XLA {1 / times['jax.jit']:.0f}, polyjit through JAX "
                                                   f"{1 / times['polyjit (jax)']:.0f})" if "jax.jit" in times else ")")
        print(f"{name:45s} {row}   {ratios}   {extra}   [kernels {stats.get('kernels')}, "
              f"fallbacks {stats.get('fallbacks')}]")


if __name__ == "__main__":
    np.random.seed(0)
    main()
