"""numpy references for the ops numpy lacks."""
import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

erf = np.vectorize(math.erf, otypes=[np.float64])


def conv2d(x, w, stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1), groups=1):
    """NCHW x OIHW cross-correlation in float64."""
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0)) + tuple(padding))
    n, c, h, wd = x.shape
    o, ig, kh, kw = w.shape
    oh = (h - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((n, o, oh, ow))
    og = o // groups
    for g in range(groups):
        for i in range(kh):
            for j in range(kw):
                xs = x[:, g * ig:(g + 1) * ig,
                       i * dilation[0]: i * dilation[0] + stride[0] * (oh - 1) + 1: stride[0],
                       j * dilation[1]: j * dilation[1] + stride[1] * (ow - 1) + 1: stride[1]]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", xs, w[g * og:(g + 1) * og, :, i, j])
    return out


def pool2d(x, k, s, p, op):
    fill = -np.inf if op == "max" else 0.0
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (p, p), (p, p)), constant_values=fill)
    v = sliding_window_view(x, (k, k), axis=(2, 3))[:, :, ::s, ::s]
    return v.max(axis=(-1, -2)) if op == "max" else v.sum(axis=(-1, -2))


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def layer_norm(x, eps=1e-5):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps)


def gelu(x):
    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


def blur(img):
    """Two 5-tap box stencils, in x then in y (valid region)."""
    h, w = img.shape[-2:]
    bx = sum(img[..., :, k:w - 4 + k] for k in range(5)) / 5
    return sum(bx[..., k:h - 4 + k, :] for k in range(5)) / 5


EDGES = [float("nan"), 1.5, -float("inf"), float("inf"), 0.0, -0.0, 0.49999997, -2.5, -0.3, 3e9, -3e9, 2.5, 3.0,
         float("nan"), 0.25, 300.0]  # NaN, infinities, signed zeros, a near half, values past int32 (no subnormals)


def assert_same_edges(got, want) -> None:
    """got as want: its dtype, its values within float32 rounding, NaN at
    want's NaN and the sign of every other element (zeros too)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype
    if want.dtype.kind != "f":
        np.testing.assert_array_equal(got, want)
        return
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    numbers = ~np.isnan(want)
    np.testing.assert_array_equal(np.signbit(got[numbers]), np.signbit(want[numbers]))
