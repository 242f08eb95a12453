"""blur_x_blur_y: two 5-tap stencils fused into one loop nest.

A convolution library runs the two passes separately and writes the
intermediate image to memory; polyjit's isl schedule runs blur_y right
behind blur_x and keeps only a five-row window of the intermediate.
"""
import time

import numpy as np

import polyjit
from polyjit import InputInfo, ops


def blur_x_blur_y(img):
    k = ops.reshape(ops.full_like(img[0:1, 0:1, 0:5], 0.2), [1, 1, 1, 5])
    x = ops.reshape(img, [img.shape[0], 1, img.shape[1], img.shape[2]])
    y = ops.conv2d(ops.conv2d(x, k), ops.reshape(k, [1, 1, 5, 1]))
    return ops.reshape(y, [y.shape[0], y.shape[2], y.shape[3]])


def blur_numpy(img):
    h, w = img.shape[-2:]
    bx = sum(img[..., :, k:w - 4 + k] for k in range(5)) * np.float32(0.2)
    return sum(bx[..., k:h - 4 + k, :] for k in range(5)) * np.float32(0.2)


if __name__ == "__main__":
    exe = polyjit.compile(blur_x_blur_y, [InputInfo([3, -1, -1], np.float32)])
    img = np.random.default_rng(0).random((3, 1024, 1024), dtype=np.float32)
    out = exe(img)
    assert np.allclose(out, blur_numpy(img), rtol=1e-5, atol=1e-6)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        exe(img)
        times.append(time.perf_counter() - t)
    print(f"blur_x_blur_y 3x1024x1024: {sorted(times)[5] * 1e3:.2f} ms (median of 10), stats {exe.stats}")
    print("the generated loop nest:")
    print(exe.ir("ast"))
