"""Convolutional networks on the CPU: eager PyTorch, TorchInductor and polyjit
(torch.compile backends) side by side, forward in eval mode, as ratios
measured in the same run. `python bench/cnn.py [--only NAME] [--threads 2] [--train]`
(`--train`: a training step instead, on the CPU);
on a GPU `--device cuda` (the networks at 32x3x224x224: eager with TF32 off
and on, Inductor and polyjit, CUDA-event medians; `--profile` lists
polyjit's kernels by GPU time).

The networks are written here (torchvision's CPU import fails on the CPU
torch): a ResNet-18-class network (3x3 convs, batch norm, residuals, strided
1x1 downsampling) and a MobileNetV3-small-class one (depthwise convs,
squeeze-excite, hardswish), both at 2x3x112x112, and single convolutions.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from cpu import compare  # bench/ is the script's folder


class Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


def resnet18(classes: int = 1000) -> nn.Module:
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Basic(cin, cout, stride), Basic(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


class SqueezeExcite(nn.Module):
    def __init__(self, c: int, squeeze: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, c, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, k: int, exp: int, cout: int, se: bool, hs: bool, stride: int) -> None:
        super().__init__()
        act = nn.Hardswish if hs else nn.ReLU
        layers = []
        if exp != cin:
            layers += [nn.Conv2d(cin, exp, 1, bias=False), nn.BatchNorm2d(exp), act()]
        layers += [nn.Conv2d(exp, exp, k, stride, k // 2, groups=exp, bias=False), nn.BatchNorm2d(exp), act()]
        if se:
            layers.append(SqueezeExcite(exp, max(8, (exp // 4 + 4) // 8 * 8)))
        layers += [nn.Conv2d(exp, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.block(x)
        return x + y if self.residual else y


MOBILENET_V3_SMALL = [  # kernel, expansion, out, squeeze-excite, hardswish, stride
    (3, 16, 16, True, False, 2), (3, 72, 24, False, False, 2), (3, 88, 24, False, False, 1),
    (5, 96, 40, True, True, 2), (5, 240, 40, True, True, 1), (5, 240, 40, True, True, 1),
    (5, 120, 48, True, True, 1), (5, 144, 48, True, True, 1), (5, 288, 96, True, True, 2),
    (5, 576, 96, True, True, 1), (5, 576, 96, True, True, 1)]


def mobilenet_v3_small(classes: int = 1000) -> nn.Module:
    layers = [nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish()]
    cin = 16
    for k, exp, cout, se, hs, stride in MOBILENET_V3_SMALL:
        layers.append(InvertedResidual(cin, k, exp, cout, se, hs, stride))
        cin = cout
    layers += [nn.Conv2d(cin, 576, 1, bias=False), nn.BatchNorm2d(576), nn.Hardswish(),
               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(576, 1024), nn.Hardswish(), nn.Linear(1024, classes)]
    return nn.Sequential(*layers)


class ConvReLU(nn.Module):
    def __init__(self, cin: int, cout: int, relu: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, 1, 1, bias=relu)
        self.relu = relu

    def forward(self, x):
        y = self.conv(x)
        return F.relu(y) if self.relu else y


def random_bn(model: nn.Module) -> nn.Module:
    """Batch norms with statistics and affine parameters that are not the identity."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model.eval()


CASES = {
    "resnet18 2x3x112x112": (lambda: random_bn(resnet18()), (2, 3, 112, 112)),
    "mobilenetv3s 2x3x112x112": (lambda: random_bn(mobilenet_v3_small()), (2, 3, 112, 112)),
    "conv3x3 64->64 2x64x28x28": (lambda: ConvReLU(64, 64, False).eval(), (2, 64, 28, 28)),
    "conv3x3 256->256 2x256x7x7": (lambda: ConvReLU(256, 256, False).eval(), (2, 256, 7, 7)),
    "conv3x3+bias+relu 8x64x56x56": (lambda: ConvReLU(64, 64, True).eval(), (8, 64, 56, 56)),
}


def run(name: str, threads: int, options: dict, backends=("eager", "inductor", "polyjit"),
        train: bool = False) -> dict:
    """Forward in eval mode, or with train a training step (batch norms on
    batch statistics, gradients of the output's mean square)."""
    torch.manual_seed(0)
    make, shape = CASES[name]
    model = make().train(train)
    x = torch.randn(*shape)
    fns, compile_s = {}, {}
    with torch.set_grad_enabled(train):
        ref = _step(model, x, train)
        for b in backends:
            torch._dynamo.reset()
            if b == "eager":
                f = model
            elif b == "inductor":
                f = torch.compile(model, backend="inductor")
            else:
                f = torch.compile(model, backend="polyjit", options={"num_threads": threads, **options})
            t = time.perf_counter()
            out = _step(f, x, train, model)
            compile_s[b] = time.perf_counter() - t
            err = (out - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
            if err > 1e-4:
                print(f"  {b}: relative error {err:.2e}", file=sys.stderr)
            fns[b] = lambda f=f: _step(f, x, train, model)
        t = compare(fns, reps=12)
        best = best_of(fns)
    base = t["eager"]
    cells = "".join(f" {b} {t[b] * 1e3:7.2f} ms ({base / t[b]:5.2f}x; best {best[b] * 1e3:7.2f} ms, "
                    f"{best['eager'] / best[b]:5.2f}x; compile {compile_s[b]:5.1f} s)" for b in backends)
    print(f"{name:30s}{cells}", flush=True)
    return t


def _step(f, x, train: bool, model=None):
    if not train:
        return f(x)
    (model or f).zero_grad(set_to_none=True)
    y = f(x)
    y.pow(2).mean().backward()
    return y.detach()


def run_cuda(name: str, options: dict, batch: int, size: int, profile: bool) -> None:
    """One network on the GPU: eager (TF32 off, the float32 reference; and
    on, PyTorch's default for cuDNN), Inductor (TF32 off) and polyjit."""
    from gpu import cuda_time  # bench/ is the script's folder
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    make, shape = CASES[name]
    model = make().cuda()
    x = torch.randn(batch, 3, size, size, device="cuda") if shape[1] == 3 else torch.randn(*shape, device="cuda")
    times, compile_s, errs = {}, {}, {}
    with torch.no_grad():
        torch.backends.cudnn.allow_tf32 = False
        ref = model(x)
        for b in ("eager", "eager_tf32", "inductor", "polyjit"):
            torch.backends.cudnn.allow_tf32 = b == "eager_tf32"
            torch._dynamo.reset()
            f = {"inductor": lambda: torch.compile(model, backend="inductor"),
                 "polyjit": lambda: torch.compile(model, backend="polyjit", options=options)}.get(b, lambda: model)()
            t = time.perf_counter()
            out = f(x)
            torch.cuda.synchronize()
            compile_s[b] = time.perf_counter() - t
            errs[b] = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            times[b] = cuda_time(lambda: f(x), 10)
            if b == "polyjit" and profile:
                _profile(lambda: f(x))
    cells = "  ".join(f"{b} {times[b] * 1e3:.2f} ms (err {errs[b]:.1e}, compile {compile_s[b]:.1f} s)" for b in times)
    print(f"{name} {batch}x3x{size}x{size} cuda: {cells}", flush=True)


def _profile(fn, top: int = 25) -> None:
    """GPU time by kernel name over 3 calls (CUPTI sees polyjit's driver launches and cuBLAS's)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top), flush=True)


def best_of(fns: dict, rounds: int = 20) -> dict:
    """Fastest call of each, called in turn: on a VM shared with other work,
    medians move with the neighbours' load; the fastest of many calls less."""
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="", help="run the cases whose name contains this")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fusion", default=None, help="polyjit's fusion option")
    p.add_argument("--contractions", default=None, help="polyjit's contractions option")
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--train", action="store_true", help="cpu: a training step instead of the forward")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the networks at --batch x 3 x --size^2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--profile", action="store_true", help="cuda: polyjit's kernels by GPU time")
    a = p.parse_args()
    if a.device == "cuda":
        options = {k: v for k, v in (("fusion", a.fusion), ("contractions", a.contractions)) if v}
        for name in CASES:
            if a.only in name:
                run_cuda(name, options, a.batch, a.size, a.profile)
        return
    torch.set_num_threads(a.threads)
    options = {k: v for k, v in (("fusion", a.fusion), ("contractions", a.contractions)) if v}
    backends = ("eager", "polyjit") if a.no_inductor else ("eager", "inductor", "polyjit")
    print(f"eager/backend time ratios (>1: faster than eager), {a.threads} threads, polyjit options {options}"
          + (", training steps" if a.train else ""))
    for name in CASES:
        if a.only in name:
            run(name, a.threads, options, backends, a.train)


if __name__ == "__main__":
    main()
