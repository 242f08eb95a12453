"""JAX on the CPU: un-jitted, jax.jit (XLA) and polyjit side by side, as
ratios (un-jitted time / backend time) measured in the same run. `make bench-jax`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import polyjit
from cpu import side_by_side  # bench/ is the script's folder


def blur(img):
    k = jnp.full((1, 1, 1, 5), 0.2, jnp.float32)
    x = lax.conv_general_dilated(img, k, (1, 1), "VALID")
    return lax.conv_general_dilated(x, k.reshape(1, 1, 5, 1), (1, 1), "VALID")


def add_layernorm(x, r, w, b):
    y = x + r
    m = y.mean(-1, keepdims=True)
    v = ((y - m) ** 2).mean(-1, keepdims=True)
    return (y - m) / jnp.sqrt(v + 1e-5) * w + b


def mlp_loss(p, x, y):
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def main() -> None:
    rng = np.random.default_rng(0)

    def r(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    params = {"w1": r(256, 512), "b1": r(512), "w2": r(512, 64)}
    cases = [
        ("cos(x)+sin(y) 4M", lambda x, y: jnp.cos(x) + jnp.sin(y), [r(4 << 20), r(4 << 20)]),
        ("blur_x_blur_y 3x1024x1024", blur, [r(3, 1, 1024, 1024)]),
        ("add+layernorm 16x128x1024", add_layernorm, [r(16, 128, 1024), r(16, 128, 1024), r(1024), r(1024)]),
        ("softmax 4096x4096", lambda x: jax.nn.softmax(x, -1), [r(4096, 4096)]),
        ("gelu 4M", jax.nn.gelu, [r(4 << 20)]),
        ("mlp loss grad 256x256x512", jax.grad(mlp_loss), [params, r(256, 256), r(256, 64)]),
    ]
    side_by_side(cases, polyjit.jit_jax, ("std", "xla", "polyjit"), ("un-jitted", "jax.jit", "polyjit"),
                 jax.block_until_ready)

if __name__ == "__main__":
    main()
