"""PyTorch on the CPU: eager, TorchInductor and polyjit side by side, as ratios
(eager time / backend time) measured in the same run. `make bench-torch`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import polyjit
from cpu import side_by_side  # bench/ is the script's folder


def blur(img):
    kx = torch.full((1, 1, 1, 5), 0.2)
    return F.conv2d(F.conv2d(img, kx), kx.reshape(1, 1, 5, 1))


def add_layernorm(x, r, w, b):
    return F.layer_norm(x + r, (x.shape[-1],), w, b)


CASES = [
    ("cos(x)+sin(y) 4M", lambda x, y: torch.cos(x) + torch.sin(y), lambda: [torch.randn(4 << 20), torch.randn(4 << 20)]),
    ("blur_x_blur_y 3x1024x1024", blur, lambda: [torch.rand(3, 1, 1024, 1024)]),
    ("add+layernorm 16x128x1024", add_layernorm,
     lambda: [torch.randn(16, 128, 1024), torch.randn(16, 128, 1024), torch.randn(1024), torch.randn(1024)]),
    ("softmax 4096x4096", lambda x: F.softmax(x, -1), lambda: [torch.randn(4096, 4096)]),
]


def main() -> None:
    with torch.no_grad():
        side_by_side([(name, fn, make()) for name, fn, make in CASES], polyjit.jit_torch,
                     ("std", "inductor", "polyjit"), ("eager", "inductor", "polyjit"))

if __name__ == "__main__":
    main()
