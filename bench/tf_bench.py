"""TensorFlow on the CPU: the standard runtime (tf.function), XLA
(jit_compile=True) and polyjit side by side, as ratios (standard time /
backend time) measured in the same run. `make bench-tf`."""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import polyjit  # noqa: E402
from cpu import side_by_side  # noqa: E402  (bench/ is the script's folder)


def blur(img):
    k = tf.fill((1, 5, 1, 1), 0.2)
    x = tf.nn.conv2d(img, k, 1, "VALID")
    return tf.nn.conv2d(x, tf.reshape(k, (5, 1, 1, 1)), 1, "VALID")


def add_layernorm(x, r, w, b):
    y = x + r
    m, v = tf.nn.moments(y, [-1], keepdims=True)
    return (y - m) * tf.math.rsqrt(v + 1e-5) * w + b


def main() -> None:
    rng = np.random.default_rng(0)

    def r(*shape):
        return tf.constant(rng.standard_normal(shape, dtype=np.float32))
    w, b = r(3, 3, 32, 64), r(64)
    cases = [
        ("cos(x)+sin(y) 4M", lambda x, y: tf.cos(x) + tf.sin(y), [r(4 << 20), r(4 << 20)]),
        ("blur_x_blur_y 3x1024x1024", blur, [r(3, 1024, 1024, 1)]),
        ("add+layernorm 16x128x1024", add_layernorm, [r(16, 128, 1024), r(16, 128, 1024), r(1024), r(1024)]),
        ("softmax 4096x4096", tf.nn.softmax, [r(4096, 4096)]),
        ("conv+bias+relu 8x64x64x32", lambda x: tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, w, 1, "SAME"), b)),
         [r(8, 64, 64, 32)]),
    ]
    # TF runs synchronously on the CPU: the call's return is the end of the work
    side_by_side(cases, polyjit.jit_tf, ("std", "xla", "polyjit"), ("tf std", "tf xla", "polyjit"))

if __name__ == "__main__":
    main()
