"""The PyTorch frontend on the seed programs: forward and backward against
eager on fresh random data, with zero fallbacks."""
import copy
import math
import re
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import polyjit  # noqa: E402
import refs  # noqa: E402
from polyjit.errors import CompileOptionError, UnsupportedOpError  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(int.from_bytes(np.random.default_rng().bytes(4), "little"))
    yield


TARGET = os.environ.get("POLYJIT_TEST_TARGET", "cpu")  # nvgpu: the checks below run on the GPU
DEVICE = "cuda" if TARGET == "nvgpu" else "cpu"
torch.backends.cudnn.allow_tf32 = False  # eager's reference convolutions in full float32 (cuDNN may pick TF32)


def assert_close(a, b, rtol=1e-5, atol=1e-5):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)  # NaN where eager has NaN


def check(fn, *args, backward=False, rtol=1e-5, atol=1e-5):
    """Run fn compiled and eagerly on copies of args; compare outputs and input grads."""
    jf = polyjit.jit_torch(fn, compile_options={"target": TARGET})
    a1 = [a.detach().to(DEVICE).requires_grad_(a.requires_grad) for a in args]
    a2 = [a.detach().to(DEVICE).requires_grad_(a.requires_grad) for a in args]
    out, ref = jf(*a1), fn(*a2)
    assert_close(out, ref, rtol, atol)
    if backward:
        g = torch.randn_like(ref)
        out.backward(g)
        ref.backward(g)
        for x, y in zip(a1, a2):
            if x.requires_grad:
                assert_close(x.grad, y.grad, rtol, atol)
    assert jf.stats["fallbacks"] == 0 and jf.stats["graphs"] >= (2 if backward else 1)
    return jf


def check_module(mod, *inputs, backward=True, rtol=1e-5, atol=1e-5):
    mod = mod.to(DEVICE)
    ref = copy.deepcopy(mod)
    jm = polyjit.jit_torch(mod, compile_options={"target": TARGET})
    x1 = [x.to(DEVICE).requires_grad_(backward and x.is_floating_point()) for x in inputs]
    x2 = [x.to(DEVICE).requires_grad_(backward and x.is_floating_point()) for x in inputs]
    out, want = jm(*x1), ref(*x2)
    assert_close(out, want, rtol, atol)
    if backward:
        g = torch.randn_like(want)
        out.backward(g)
        want.backward(g)
        for p, q in zip(mod.parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, rtol, atol)
        for x, y in zip(x1, x2):
            if x.requires_grad:
                assert_close(x.grad, y.grad, rtol, atol)
    stats = jm.stats
    assert stats["fallbacks"] == 0
    return stats


def r(*shape, grad=False):
    return torch.randn(shape, requires_grad=grad)


def test_cos_sin():
    check(lambda x, y: torch.cos(x) + torch.sin(y), r(1000), r(1000), backward=False)
    check(lambda x, y: torch.cos(x) + torch.sin(y), r(64, 33, grad=True), r(64, 33, grad=True), backward=True)


def blur(img):
    kx = torch.full((1, 1, 1, 5), 0.2, device=img.device)
    ky = torch.full((1, 1, 5, 1), 0.2, device=img.device)
    return F.conv2d(F.conv2d(img, kx), ky)


def test_integer_and_float_division_modes():
    """Integer quotients are exact beyond float precision (2**40 // 3);
    floor and trunc division and fmod follow torch on both signs."""
    def f(a, b, x, y):
        return (a // b, torch.div(a, b, rounding_mode="trunc"), torch.fmod(a, b), a % b,
                torch.div(x, y, rounding_mode="floor"), torch.div(x, y, rounding_mode="trunc"), torch.fmod(x, y))
    a = torch.cat([torch.randint(-100, 100, (30,)), torch.tensor([2 ** 40 + 1, -(2 ** 40) - 7])])
    b = torch.cat([torch.randint(1, 9, (30,)) * (torch.randint(0, 2, (30,)) * 2 - 1), torch.tensor([3, 5])])
    check(f, a, b, r(32) * 10, r(32) + 3)


def test_bitwise_ops_on_integers_and_booleans():
    """~, &, |, ^ act on the bits of integers and logically on booleans; shifts."""
    def f(a, b, m):
        return ~a, a & b, a | 3, a ^ b, ~m, m & (a > 0), m ^ (b > 0), a << 2, a >> 1, b >> (a.abs() % 5)
    check(f, torch.randint(-100, 100, (20,)), torch.randint(-100, 100, (20,)), torch.rand(20) > 0.5)

    def g(u, m, n):  # unsigned shifts are logical; bools add as or, and False < True
        return u >> 1, u >> (u % 3), m + n, m * n, m > n, m < n, m >= n, torch.maximum(m, n)
    check(g, torch.randint(0, 256, (40,), dtype=torch.uint8), torch.rand(40) > 0.5, torch.rand(40) > 0.5)


EDGE_OPS = {  # ops whose NaN, infinities and signed zeros follow eager's own rules (not erf's GELU: eager's
    # vectorized erf makes gelu(inf) NaN on the CPU, where its scalar formula, and CUDA's, give inf)
    "sign": torch.sign, "sgn": torch.sgn, "relu": torch.relu, "abs": torch.abs, "floor": torch.floor,
    "round": torch.round, "trunc": torch.trunc, "frac": torch.frac, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "erf": torch.erf, "exp": torch.exp, "log1p": torch.log1p, "expm1": torch.expm1, "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal, "clamp": lambda x: x.clamp(-1, 1), "hardtanh": F.hardtanh,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "softplus": F.softplus, "elu": F.elu,
    "leaky_relu": F.leaky_relu, "hardswish": F.hardswish, "mish": F.mish, "logit": torch.logit,
    "nan_to_num": torch.nan_to_num, "signbit": torch.signbit, "isfinite": torch.isfinite,
    "maximum": lambda x: torch.maximum(x, x.flip(0)), "fmax": lambda x: torch.fmax(x, x.flip(0)),
    "max": lambda x: x.reshape(4, 4).max(1).values, "amin": lambda x: x.reshape(4, 4).amin(0),
    "argmax": lambda x: x.reshape(4, 4).argmax(1), "softmax": lambda x: torch.softmax(x.reshape(4, 4), 1),
    "logsumexp": lambda x: torch.logsumexp(x.reshape(4, 4), 1),
}  # (not relu6, whose -0 eager keeps, nor cumsum, which eager sums in float64 on the CPU)


@pytest.mark.parametrize("name", sorted(EDGE_OPS))
def test_elementwise_ops_meet_nan_infinities_and_signed_zeros_as_eager(name):
    x = torch.tensor(refs.EDGES, device=DEVICE)
    jf = polyjit.jit_torch(EDGE_OPS[name], compile_options={"target": TARGET})
    refs.assert_same_edges(jf(x).cpu().numpy(), EDGE_OPS[name](x).cpu().numpy())
    assert jf.stats["fallbacks"] == 0  # (compiled, not eager's own op)


def test_equal_results_of_two_ops_are_two_tensors():
    """Two `a + 1` that the program computes once are two tensors, as in
    eager: an in-place change to one leaves the other. One value returned
    twice stays one tensor, as eager's."""
    x = torch.randn(8, device=DEVICE)
    f = polyjit.jit_torch(lambda a: (a + 1, a * 3, a + 1), compile_options={"target": TARGET})
    for _ in range(2):  # (the second call takes the bound path)
        p, _, r = f(x)
    p.add_(1)
    assert_close(r, x + 1)
    y1, y2 = polyjit.jit_torch(lambda a: (lambda y: (y, y))(a + 1), compile_options={"target": TARGET})(x)
    assert y1 is y2


def test_blur_one_loop_nest():
    jf = check(blur, torch.rand(3, 1, 64, 80))
    assert jf.stats["kernels"] == 1 and jf.stats["contracted_buffers"] == 1
    assert jf.stats["intermediate_bytes"] < 3 * 64 * 76 * 4 / 2


class GEGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 128)

    def forward(self, x):
        a, g = self.proj(x).chunk(2, dim=-1)
        return a * F.gelu(g)


def test_geglu():
    check_module(GEGLU(), torch.randn(4, 7, 32))


def bdal(x, bias, res, w, b, p=0.0):
    return F.layer_norm(F.dropout(x + bias, p, True) + res, (x.shape[-1],), w, b)


def bdal_primitive(x, bias, res, w, b, p=0.0):
    y = F.dropout(x + bias, p, True) + res
    m = y.mean(-1, keepdim=True)
    v = ((y - m) ** 2).mean(-1, keepdim=True)
    return (y - m) / torch.sqrt(v + 1e-5) * w + b


@pytest.mark.parametrize("fn", [bdal, bdal_primitive])
def test_bias_dropout_add_layernorm(fn):
    args = [r(4, 16, 64, grad=True), r(64, grad=True), r(4, 16, 64), r(64, grad=True), r(64, grad=True)]
    jf = check(fn, *args, backward=True, atol=2e-5)
    assert jf.stats["graphs"] == 2


class RMSNorm(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def test_rmsnorm():
    check_module(RMSNorm(), torch.randn(8, 64))


def test_softmax_and_log_softmax():
    check(lambda x: F.softmax(x, -1), r(16, 200, grad=True), backward=True)
    check(lambda x: F.log_softmax(x, -1), r(16, 200, grad=True), backward=True)


class Composites(nn.Module):
    """Layer norms with and without their affine parameters, both GELUs, softmax and log_softmax."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(32, 32), nn.LayerNorm(32)
        self.plain = nn.LayerNorm((4, 32), elementwise_affine=False)

    def forward(self, x):
        h = self.norm(F.gelu(self.lin(x)))
        h = self.plain(F.gelu(h, approximate="tanh"))
        return F.softmax(h, -1) + F.log_softmax(h, 1)


def test_norms_gelu_and_softmax_train_lowered_whole():
    """Both layer norms' forms, both GELUs, softmax and log_softmax, and
    the backward ops the table lowers whole: eager's gradients, also of a
    layer norm asked for some of its gradients only."""
    # (its gradients reach about 50, where an absolute 1e-5 is below float32 sums' rounding: eager itself
    # differs from float64 by 1e-6 of the largest, polyjit by about as much)
    check_module(Composites(), torch.randn(3, 4, 32), atol=1e-4)
    norm = lambda x, w, b: F.layer_norm(x, (16,), w, b)  # noqa: E731
    check(norm, r(4, 16), r(16, grad=True), r(16, grad=True), backward=True)
    check(norm, r(4, 16, grad=True), r(16), r(16, grad=True), backward=True)



def test_slices_train():
    """A slice's gradient (aten.slice_scatter): plain, stepped, negative and
    open bounds, and a start before the first element (clamped, as torch does).
    (Means, not sums, of the slices: a sum of thousands of values added to
    each element would compare summation orders, not slices.)"""
    check(lambda x: torch.tanh(x[:, :48]) * x[:, 1::3][:, :48].sin() + x[2:-1].mean() + x[..., -5:].mean()
          + x[:, -1000:48:2].exp().mean(), r(16, 200, grad=True), backward=True)


def _attention_mask(kind, rows, cols):
    if kind == "bool":  # a query whose keys are all masked: zeros, as eager's
        mask = torch.rand(rows, cols, device=DEVICE) > 0.3
        mask[1] = False
        return mask
    return r(2, 1, rows, cols).to(DEVICE) if kind == "float" else None


@pytest.mark.parametrize("mask_kind,causal,scale,rows", [
    ("none", False, None, 8), ("float", False, None, 8), ("bool", False, 0.3, 8), ("none", True, None, 8),
    ("none", True, None, 5), ("float", False, None, 5)])
def test_attention_is_one_op_each_way(monkeypatch, mask_kind, causal, scale, rows):
    """scaled_dot_product_attention reaches AOTAutograd's trace as
    polyjit::attention, its backward as polyjit::attention_backward (the
    math variant traced op by op costs more than the rest of a layer):
    values and gradients as eager's, with a float or boolean mask, causal
    (queries fewer than keys: the mask at the top left), a scale."""
    from polyjit.frontends import torch_attention
    fuse, replaced = torch_attention.fuse_attention, []
    monkeypatch.setattr(torch_attention, "fuse_attention", lambda gm: replaced.append(fuse(gm)) or replaced[-1])
    mask = _attention_mask(mask_kind, rows, 8)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    check(f, r(2, 3, rows, 16, grad=True), r(2, 3, 8, 16, grad=True), r(2, 3, 8, 12, grad=True), backward=True)
    assert replaced == [1]


def test_attention_at_symbolic_sizes_compiles_once():
    """Under dynamic shapes the head size is symbolic too, and so is the
    default scale, 1/sqrt(head size): causal attention of three lengths,
    forward and backward, compiled once, as eager's."""
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    jf = polyjit.jit_torch(f, compile_options={"target": TARGET, "dynamic": True})
    for t in (8, 12, 20):
        q, k, v = (r(2, 3, t, 16, grad=True).to(DEVICE) for _ in range(3))
        out, ref = jf(q, k, v), f(q, k, v)
        assert_close(out, ref)
        w = torch.randn_like(ref)
        got, want = (torch.autograd.grad((y * w).sum(), (q, k, v)) for y in (out, ref))
        for a, b in zip(got, want):
            assert_close(a, b)
    assert jf.stats["graphs"] == 2 and jf.stats["fallbacks"] == 0


class _SelfAttention(torch.nn.Module):
    """Projections split into heads, attention, the heads joined again (as
    DistilBERT's): the backward views the value's gradient back through the
    split."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (torch.nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).contiguous().view(b, s, d))


def _attention_grads(mod, jm, lengths) -> None:
    for t in lengths:
        x = r(3, t, 32, grad=True).to(DEVICE)
        out, ref = jm(x), mod(x)
        assert_close(out, ref)
        w = torch.randn_like(ref)
        params = [x, *mod.parameters()]
        got, want = (torch.autograd.grad((y * w).sum(), params) for y in (out, ref))
        for a, b in zip(got, want):
            assert_close(a, b, rtol=1e-4)


def test_self_attention_trains_at_symbolic_sizes():
    """Under dynamic shapes a product's weights can have sizes known only at
    run time (the attention backward's keys, computed): folding a scale into
    them is declined, not an internal failure; two lengths, compiled once."""
    mod = _SelfAttention().to(DEVICE)
    jm = polyjit.jit_torch(mod, compile_options={"target": TARGET}, dynamic=True)
    _attention_grads(mod, jm, (8, 12))
    assert jm.stats["fallbacks"] == 0 and jm.stats["graphs"] == 2


def test_self_attention_falling_back_trains_as_eager(monkeypatch):
    """A partition that fails to compile runs in PyTorch, attention's
    backward op included: its gradients come laid out as the trace has them
    (its fake's), so the split's views after it hold, under dynamic shapes."""
    from polyjit.targets import base

    def failing(*a, **k):
        raise RuntimeError("injected")
    monkeypatch.setattr(base, "fold_scales", failing)
    mod = _SelfAttention().to(DEVICE)
    jm = polyjit.jit_torch(mod, compile_options={"target": TARGET}, dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _attention_grads(mod, jm, (8, 12))
    assert jm.stats["fallbacks"] >= 2


def test_attention_mask_with_a_gradient_stays_sdpa(monkeypatch):
    """A learned mask (a position bias) needs the scores' gradient, which
    polyjit::attention does not give: such an attention is traced as
    before, and the mask's gradient is eager's."""
    from polyjit.frontends import torch_attention
    fuse, replaced = torch_attention.fuse_attention, []
    monkeypatch.setattr(torch_attention, "fuse_attention", lambda gm: replaced.append(fuse(gm)) or replaced[-1])
    check(lambda q, k, v, bias: F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
          r(2, 3, 8, 16, grad=True), r(2, 3, 8, 16, grad=True), r(2, 3, 8, 16, grad=True), r(1, 3, 8, 8, grad=True),
          backward=True)
    assert replaced == [0]


def test_attention_rows_masked_whole_are_zeros_and_nan_propagates(tmp_path):
    """Attention's softmax (aten._safe_softmax) gives a query whose keys are
    all masked zeros, as eager does, while a NaN score stays NaN; forward
    and backward. The masked rows come from the softmax's own row maximum:
    one reduction of the scores to their maximum, none of booleans; all of
    it in float32."""
    q, k, v = r(2, 3, 8, 16, grad=True), r(2, 3, 8, 16, grad=True), r(2, 3, 8, 16, grad=True)
    with torch.no_grad():
        q[1, 2, 5, 3] = float("nan")
    mask = torch.ones(8, 8, dtype=torch.bool, device=DEVICE)
    mask[2] = False

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    check(f, q, k, v, backward=True)
    jf = polyjit.jit_torch(f, compile_options={"target": TARGET, "debug": True, "dump_dir": str(tmp_path)})
    with torch.no_grad():
        jf(*(t.detach().to(DEVICE) for t in (q, k, v)))
    (graph,) = [p for p in tmp_path.rglob("*graph*") if p.is_file()]
    text = graph.read_text()
    assert text.count("op=max") == 1 and not re.search(r"bool\[[^]]*\] = reduce", text) and "float64" not in text, text
class ConvBiasRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        return F.relu(self.conv(x))


def test_conv_bias_relu():
    check_module(ConvBiasRelu(), torch.randn(2, 3, 12, 10), atol=1e-4)


@pytest.mark.parametrize("padding,stride", [("valid", 1), ("valid", 2), ("same", 1)])
@pytest.mark.parametrize("dims", [1, 2])
def test_convolution_padding_named(padding, stride, dims):
    """padding="valid" reaches ATen's convolution as a single entry ([0]),
    which it repeats for every spatial dim (EfficientNet's depthwise
    convolutions): forward and gradients as eager's."""
    conv = (nn.Conv1d if dims == 1 else nn.Conv2d)(4, 4, 3, stride, padding, groups=2)
    check_module(conv, torch.randn(2, 4, *[9] * dims), atol=1e-4)


@pytest.mark.parametrize("dim", [0, 2, None])
def test_weight_norm_trains(dim):
    """A weight-normed convolution (wav2vec2's positional embedding, dim 2):
    weight_norm's backward op, outside the table, fell back."""
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 6, 5, padding=2, groups=2), dim=dim)
    check_module(conv, torch.randn(2, 4, 11), atol=1e-4)


class PermutedDepthwise(nn.Module):
    """ConvNeXt's stem and first block: a layer norm of channels-last rows,
    permuted back to NCHW for a depthwise 7x7 convolution, whose result is
    permuted to channels last again for the next layer norm."""

    def __init__(self, c=16):
        super().__init__()
        self.norm1, self.dw, self.norm2 = nn.LayerNorm(c), nn.Conv2d(c, c, 7, padding=3, groups=c), nn.LayerNorm(c)

    def forward(self, x):
        y = self.norm1(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.norm2(self.dw(y).permute(0, 2, 3, 1))


def test_a_depthwise_convolution_between_permutes_runs_channels_last():
    """Its images read out of channels-last rows, the stencil computes
    channels last (a vector of channels per tap), as the permutes around it
    are read: forward and gradients as eager's."""
    stats = check_module(PermutedDepthwise(), torch.randn(2, 16, 9, 9), atol=1e-4)
    if TARGET == "cpu":
        assert any(c.startswith("conv [2, 9, 9, 16] * [7, 7, 1, 16] groups 16: generated")
                   for c in stats["contractions"]), stats["contractions"]


@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (3, 2, 1)])
def test_max_pool2d(k, s, p):
    check(lambda x: F.max_pool2d(x, k, s, p), r(2, 3, 11, 10, grad=True), backward=True)


def test_mlp_training_step_with_sgd():
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    ref = copy.deepcopy(mlp)
    jm = polyjit.jit_torch(mlp)
    opt, ref_opt = torch.optim.SGD(mlp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x, t = torch.randn(16, 32), torch.randint(0, 10, (16,))
        for model, o in ((jm, opt), (ref, ref_opt)):
            o.zero_grad()
            F.cross_entropy(model(x), t).backward()
            o.step()
    for p, q in zip(mlp.parameters(), ref.parameters()):
        assert_close(p, q)
    assert jm.stats["fallbacks"] == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_training_under_autocast(dtype):
    """torch.autocast: products and the activations between them in the half
    type, norms and the loss in float32; forward and gradients within the
    half type's rounding of eager's, no fallback."""
    dt = getattr(torch, dtype)
    if DEVICE == "cpu" and dt is torch.float16:
        pytest.skip("float16 autocast is a GPU practice")
    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).to(DEVICE)
    ref = copy.deepcopy(mlp)
    jm = polyjit.jit_torch(mlp, compile_options={"target": TARGET})
    x = torch.randn(16, 32, device=DEVICE)
    t = torch.randint(0, 8, (16,), device=DEVICE)
    with torch.autocast(DEVICE, dtype=dt):
        out, want = jm(x), ref(x)
        assert out.dtype == want.dtype == dt
        F.cross_entropy(out, t).backward()
        F.cross_entropy(want, t).backward()
    assert_close(out.float(), want.float(), 2e-2, 2e-2)
    for p, q in zip(mlp.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, 5e-2, 2e-2)
    assert jm.stats["fallbacks"] == 0


@pytest.mark.parametrize("foreach", [False, True], ids=["each", "foreach"])
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam", "adamw"])
def test_a_whole_training_step_with_its_optimizer_compiles(optimizer, foreach):
    """torch.compile of a step that calls the optimizer too: its updates
    (Adam's lerp decomposes to prims.fma) write the parameters in place;
    _foreach_ ops (torch.optim's default on the GPU) as one op per tensor."""
    make = {"sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=foreach),
            "adam": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=foreach),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=foreach)}[optimizer]
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)).to(DEVICE)
    ref = copy.deepcopy(mlp)

    def step(model, opt, x, t):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), t)
        loss.backward()
        opt.step()
        return loss
    polyjit.frontends.torch.stats(reset=True)
    compiled = torch.compile(step, backend="polyjit", options={"target": TARGET})
    opts = make(mlp.parameters()), make(ref.parameters())
    for _ in range(4):
        x, t = torch.randn(8, 16, device=DEVICE), torch.randint(0, 4, (8,), device=DEVICE)
        assert_close(compiled(mlp, opts[0], x, t), step(ref, opts[1], x, t), 1e-4, 1e-5)
    for p, q in zip(mlp.parameters(), ref.parameters()):
        assert_close(p, q, 1e-4, 1e-5)
    assert polyjit.frontends.torch.stats()["fallbacks"] == 0


def test_transformer_encoder_layer_eval():
    enc = nn.TransformerEncoderLayer(d_model=64, nhead=4).eval()
    with torch.no_grad():
        stats = check_module(enc, torch.randn(10, 2, 64), backward=False, atol=1e-4)
    assert stats["graphs"] >= 1


def test_transformer_encoder_layer_trains():
    """Its backward has a group (a transposed copy feeding a batched product
    with 8 terms) whose isl problem grows numbers without end: the scheduler
    gives up on it by time, not after millions of operations (it hung)."""
    enc = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    check_module(enc, torch.randn(8, 16, 32), atol=1e-4)


def test_dropout_statistics_and_masks():
    jf = polyjit.jit_torch(lambda x: F.dropout(x, 0.3, True))
    x = (torch.rand(256, 512) + 1).requires_grad_()
    y = jf(x)
    y.sum().backward()
    keep = y != 0
    assert abs(keep.float().mean().item() - 0.7) < 0.01
    assert_close(y[keep], x[keep] / 0.7)
    assert torch.equal(keep, x.grad != 0)  # backward used the forward's mask
    assert_close(x.grad[keep], torch.full_like(x.grad[keep], 1 / 0.7))
    assert jf.stats["fallbacks"] == 0
    torch.manual_seed(3)
    a = jf(x)
    torch.manual_seed(3)
    b = jf(x)
    assert torch.equal(a, b)  # seeded from torch's generator


def test_many_instances_of_one_module_class_share_their_compiled_graph(caplog):
    """Modules of one class, each wrapped by jit_torch with the same options
    (a model's layers, one by one), share the graph the first compiled, as
    torch.compile's do: none recompiles, and none runs eagerly once Dynamo's
    recompile limit would have been reached."""
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.lin(x))
    torch._dynamo.reset()
    layers = [Layer() for _ in range(torch._dynamo.config.recompile_limit + 3)]
    jitted = [polyjit.jit_torch(layer, compile_options={"strict": True}) for layer in layers]
    x = torch.randn(4, 8)
    for layer, jl in zip(layers, jitted):
        torch.testing.assert_close(jl(x), layer(x), rtol=1e-5, atol=1e-6)
    assert [jl.stats["graphs"] for jl in jitted] == [1] + [0] * (len(layers) - 1)
    assert not any("recompile_limit" in r.getMessage() for r in caplog.records)
    other = polyjit.jit_torch(layers[0], compile_options={"strict": True, "fusion": "none"})
    torch.testing.assert_close(other(x), layers[0](x), rtol=1e-5, atol=1e-6)
    assert other.stats["graphs"] == 1  # other options: a graph of its own


def test_dynamic_shapes_do_not_recompile():
    jf = polyjit.jit_torch(lambda x: F.softmax(x, -1) * 2, dynamic=True)
    for n in (5, 7, 9, 130):
        x = torch.randn(n, 33)
        assert_close(jf(x), F.softmax(x, -1) * 2)
    assert jf.stats["graphs"] == 1



def test_slices_train_with_dynamic_shapes_without_recompiling():
    """A slice's gradient over a symbolic size (the zeros it scatters into
    are [b, s], the gradient [b, s - 1]: s is solved from that dimension)
    compiles once, with no fallback, for every size."""
    def f(x):
        return torch.exp(x[:, 1:-2] * 2)  # (the backward is handed exp's result, [b, s - 3], not x)
    jf = polyjit.jit_torch(f, compile_options={"target": TARGET}, dynamic=True)
    for n in (10, 13, 17):
        x = torch.randn(4, n, device=DEVICE, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        r = torch.randn(4, n - 3, device=DEVICE)
        (jf(x) * r).sum().backward()
        (f(x2) * r).sum().backward()
        assert_close(x.grad, x2.grad)
    assert jf.stats["fallbacks"] == 0 and jf.stats["graphs"] == 2


def _train_against_eager(f, jf, params, x, out_shape):
    """Outputs and the gradients of params and x, through a random projection, compiled against eager."""
    r = torch.randn(out_shape, device=DEVICE)
    x2 = x.detach().clone().requires_grad_()
    grads = []
    for fn, xx in ((jf, x), (f, x2)):
        y = fn(xx)
        (y * r).sum().backward()
        grads.append([p.grad for p in params] + [xx.grad])
        for p in params:
            p.grad = None
        if fn is jf:
            y_jit = y
    assert_close(y_jit, y)
    for a, b in zip(*grads):
        assert_close(a, b)


def test_a_transformer_layer_trains_with_dynamic_batch_and_sequence():
    """Linear layers merge batch and sequence ([b, s, e] as [b*s, e]): with
    both symbolic, b*s is a size of its own, the products run in the
    library at sizes known at run time, and the reshapes' indices divide
    by s. One forward and one backward graph serve every size, strict, and
    a scale computed from a size (2 / x.size(-1)) compiles too."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).to(DEVICE)
    head = nn.Linear(32, 8).to(DEVICE)

    def f(x):
        return head(layer(x)) * (2.0 / x.size(-1))
    params = list(layer.parameters()) + list(head.parameters())
    jf = polyjit.jit_torch(f, compile_options={"target": TARGET, "strict": True}, dynamic=True)
    for b, s in ((3, 7), (2, 11), (5, 4)):
        _train_against_eager(f, jf, params, torch.randn(b, s, 32, device=DEVICE, requires_grad=True), (b, s, 8))
    assert jf.stats["graphs"] == 2 and jf.stats["fallbacks"] == 0


def test_a_sequence_length_that_changes_compiles_once_more():
    """As torch.compile does by default, a second sequence length makes that
    size symbolic with the batch static ([4, s, e] as [4*s, e]); a third
    length runs the same code."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 16)).to(DEVICE)

    def f(x):
        return mlp(x) + x
    jf = polyjit.jit_torch(f, compile_options={"target": TARGET, "strict": True})
    for s in (7, 9, 12):
        _train_against_eager(f, jf, list(mlp.parameters()), torch.randn(4, s, 16, device=DEVICE, requires_grad=True),
                             (4, s, 16))
    assert jf.stats["graphs"] == 4 and jf.stats["fallbacks"] == 0


def test_arange_over_a_symbolic_size():
    """torch.arange to a symbolic size, up and down (positions, a causal
    mask) under dynamic shapes: compiled once, no fallback."""
    def f(x):
        n, d = x.shape[1], x.device
        return (x * torch.arange(n, dtype=torch.float32, device=d)
                + torch.arange(n - 1, -1, -1, device=d).float() * torch.arange(1, n + 1, device=d).float())
    jf = polyjit.jit_torch(f, compile_options={"target": TARGET}, dynamic=True)
    for n in (10, 13, 17):
        x = torch.randn(4, n, device=DEVICE)
        assert_close(jf(x), f(x))
    assert jf.stats["graphs"] == 1 and jf.stats["fallbacks"] == 0

def test_size_arithmetic_and_integer_arguments_of_dynamic_shapes():
    """Sizes computed in the graph (-n // 2: a negative quotient, the start
    of a slice that wraps) and an integer argument that changes between
    calls (a value, 0-d int64), its arithmetic and positions counted from it
    (a cache's ``arange(past, past + n)``) compile; so does an integer
    argument that sizes results (``x[:, :k]``, a mask of ``arange(n)``, in a
    graph with no tensor argument too), without a compile per value."""
    jf = polyjit.jit_torch(lambda x: x[-x.shape[0] // 2:].sum(0) * x.shape[0], compile_options={"target": TARGET},
                           dynamic=True)
    for n in (4, 6, 9):
        x = torch.randn(n, 8, device=DEVICE)
        assert_close(jf(x), x[-n // 2:].sum(0) * n)
    assert jf.stats["fallbacks"] == 0 and jf.stats["graphs"] == 1
    jk = polyjit.jit_torch(lambda x, k: x * k + 1, compile_options={"target": TARGET})
    x = torch.randn(7, 5, device=DEVICE)
    for k in (-1, -2, 3, 5):
        assert_close(jk(x, k), x * k + 1)
    assert jk.stats["fallbacks"] == 0
    def positions(x, past):
        return x * torch.arange(past, past + x.shape[1], device=x.device) + (past * 2 - 1) // 3
    jp = polyjit.jit_torch(positions, compile_options={"target": TARGET, "strict": True})
    for past in (3, 4, 8):
        assert_close(jp(x, past), positions(x, past))
    js = polyjit.jit_torch(lambda x, k: x[:, :k] * 2, compile_options={"target": TARGET, "strict": True},
                           dynamic=True)
    for k in (2, 3, 4):
        assert_close(js(x, k), x[:, :k] * 2)
    assert js.stats["graphs"] == 1

    def mask(n):
        return torch.arange(n, device=DEVICE)[:, None] >= torch.arange(n, device=DEVICE)
    jm = polyjit.jit_torch(mask, compile_options={"target": TARGET, "strict": True}, dynamic=True)
    for n in (3, 5, 8):
        got = jm(n)
        assert got.device == mask(n).device
        torch.testing.assert_close(got, mask(n))
    assert jm.stats["graphs"] == 1


def test_index_add_into_a_few_rows():
    """An embedding's gradient into two rows (BERT's token types: every
    token adds into one of them) is a reduction per row; negative indices
    wrap, NaN reaches only its own row."""
    jf = polyjit.jit_torch(lambda x, i, v: x.index_put((i,), v, accumulate=True), compile_options={"target": TARGET})
    for rows in (2, 5, 9):
        x, v = torch.randn(rows, 7, device=DEVICE), torch.randn(50, 7, device=DEVICE)
        v[3, 2] = float("nan")
        i = torch.randint(-rows, rows, (50,), device=DEVICE)
        torch.testing.assert_close(jf(x, i, v), x.index_put((i,), v, accumulate=True), rtol=1e-5, atol=1e-5,
                                   equal_nan=True)
    w = torch.randn(2, 16, device=DEVICE, requires_grad=True)
    tt = torch.randint(0, 2, (4, 33), device=DEVICE)
    check(lambda w, tt: F.embedding(tt, w) * 1.5, w, tt, backward=True)
    assert jf.stats["fallbacks"] == 0


def test_assignments_through_index_tensors_and_masks():
    """``x[i] = v`` (a cache written at positions given at run time, negative
    indices, two index tensors, a value broadcast) and ``x[mask] = c`` compile,
    forward and backward; a position named twice takes one of its values, as
    in eager, where the winner is undefined."""
    def cache(c, pos, k):
        c = c.clone()
        c[:, pos] = k
        return c * 1.5

    def pairs(x):
        y = x.clone()
        y[torch.tensor([0, -1], device=x.device), torch.tensor([2, 3], device=x.device)] = x[0, 0] * 2
        return y

    def masked(x):
        y = x * 1.0
        y[x[..., 0] > 0.5] = float("-inf")
        y[x < -1] = 3.0
        return y.softmax(-1)
    x = torch.randn(6, 5, 4, requires_grad=True)
    check(cache, x, torch.tensor([3, -1]), torch.randn(6, 2, 4, requires_grad=True), backward=True)
    check(pairs, x, backward=True)
    check(masked, x, backward=True)
    jf = polyjit.jit_torch(lambda x, i, v: x.index_put((i,), v), compile_options={"target": TARGET})
    x, i, v = torch.randn(6, 3, device=DEVICE), torch.tensor([4, 1, 4], device=DEVICE), torch.randn(3, 3, device=DEVICE)
    got = jf(x, i, v)
    assert_close(got[[0, 2, 3, 5]], x[[0, 2, 3, 5]]) and assert_close(got[1], v[1])
    assert any(torch.equal(got[4], v[k]) for k in (0, 2)) and jf.stats["fallbacks"] == 0


def test_buckets_and_triangle_indices():
    """bucketize and searchsorted (both sides, int32 results, repeated
    boundaries, NaN and infinities, boundaries batched by row),
    tril_indices and triu_indices."""
    x = torch.randn(8, 32, device=DEVICE)
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    b = torch.tensor([-1.0, 0.0, 0.0, 0.5, 2.0], device=DEVICE)
    check(lambda x: (torch.bucketize(x, b), torch.bucketize(x, b, right=True, out_int32=True),
                     torch.searchsorted(b, x.flatten()), torch.searchsorted(b, x, side="right")), x)
    rows = torch.sort(torch.randn(8, 6, device=DEVICE), 1).values  # (boundaries a row for each row of values)
    check(lambda x, r: (torch.searchsorted(r, x), torch.searchsorted(r, x, right=True)), x, rows)
    check(lambda x: (x[torch.tril_indices(8, 8, device=x.device)[0], :] * 2,
                     x[:, torch.triu_indices(8, 32, 1, device=x.device)[1]]), x)


def test_embedding_bag_sum_mean_and_max_train():
    """nn.EmbeddingBag's _embedding_bag (and _embedding_bag_forward_only
    without grad): sum, mean and max over bags given by offsets (an empty
    bag, the last offset included or not) and over the rows of a 2-d input,
    a padding index, per-sample weights; the gradients of the weight and of
    the per-sample weights."""
    idx = torch.randint(0, 10, (14,), device=DEVICE)
    idx[[1, 9]] = 4  # the padding row, in two bags
    offsets, last = torch.tensor([0, 3, 3, 8], device=DEVICE), torch.tensor([0, 3, 3, 8, 14])

    def bags(w, psw):
        return torch.cat([F.embedding_bag(idx, w, offsets, mode=mode, padding_idx=pad,
                                          per_sample_weights=psw if weighted else None)
                          for mode, pad, weighted in (("sum", None, False), ("sum", 4, True), ("mean", None, False),
                                                      ("mean", 4, False), ("max", None, False), ("max", 4, False))]
                         + [F.embedding_bag(idx.view(2, 7), w, mode=mode) for mode in ("sum", "max")])
    check(bags, r(10, 5, grad=True), r(14, grad=True), backward=True)
    check(lambda w, i, o: F.embedding_bag(i, w, o, mode="mean", include_last_offset=True), r(10, 5), idx, last)
    check_module(nn.EmbeddingBag(10, 5, mode="max"), idx, offsets)


def test_cdist_train():
    """torch.cdist: p = 2 by the matrix product (aten._euclidean_dist) and by
    differences (aten._cdist_forward), p = 1, 3, inf and 0, batched (batch
    dims broadcast) and not; gradients of the inputs, zero where two rows
    coincide (the product's distances are not exact there: other rows)."""
    def dists(a, b, c):
        return torch.cat([torch.cdist(c, b, 2.0, "use_mm_for_euclid_dist").flatten(),
                          torch.cdist(b, c[0, 0], 2.0, "use_mm_for_euclid_dist").flatten(),
                          torch.cdist(a, b, 2.0, "donot_use_mm_for_euclid_dist").flatten(),
                          torch.cdist(a, b).flatten(), torch.cdist(a, b, 1.0).flatten(),
                          torch.cdist(c, a, 2.0).flatten(), torch.cdist(c, a, 1.0).flatten(),
                          torch.cdist(a, b, 3.0).flatten(), torch.cdist(a, b, float("inf")).flatten(),
                          torch.cdist(a, b, 0.0).flatten()])
    a, b = r(6, 4), r(7, 4)
    a[1] = b[3]
    check(dists, a.requires_grad_(), b.requires_grad_(), r(2, 3, 5, 4, grad=True), backward=True, rtol=1e-4,
          atol=1e-5)


def test_grid_sample_and_affine_grid_train():
    """F.grid_sample in 2-d, bilinear and nearest, zeros, border and
    reflection padding, align_corners both ways, its grid reaching past the
    image (where the paddings differ); F.affine_grid feeding it. Gradients
    of the image and of the grid (of theta through affine_grid)."""
    def samples(img, grid):
        return torch.cat([F.grid_sample(img, grid, mode, pad, ac).flatten()
                          for mode in ("bilinear", "nearest") for pad in ("zeros", "border", "reflection")
                          for ac in (False, True)])
    check(samples, r(2, 3, 6, 7, grad=True), (torch.rand(2, 5, 4, 2) * 3 - 1.5).requires_grad_(), backward=True,
          rtol=1e-4, atol=1e-4)

    def warp(img, theta):
        return (F.grid_sample(img, F.affine_grid(theta, (2, 3, 5, 8), align_corners=False), align_corners=False)
                + F.grid_sample(img, F.affine_grid(theta, (2, 3, 4, 4), align_corners=True), "bilinear",
                                "reflection", align_corners=True).mean())
    theta = torch.tensor([[1.1, 0.2, 0.1], [-0.3, 0.9, 0.2]]).repeat(2, 1, 1) + 0.1 * torch.randn(2, 2, 3)
    check(warp, r(2, 3, 6, 7, grad=True), theta.requires_grad_(), backward=True, rtol=1e-4, atol=1e-4)


def test_training_with_a_new_size_compiles_once_more():
    """A second size recompiles with symbolic sizes (torch's automatic dynamic
    shapes); the forward graph hands sizes to the backward graph as ints, and a
    third size reuses the code."""
    jf = polyjit.jit_torch(bdal, compile_options={"target": TARGET})
    for n, m in ((4, 8), (2, 3), (5, 7)):
        args = [r(n, m, 64, grad=True), r(64, grad=True), r(n, m, 64), r(64, grad=True), r(64, grad=True)]
        a1 = [a.detach().to(DEVICE).requires_grad_(a.requires_grad) for a in args]
        a2 = [a.detach().to(DEVICE).requires_grad_(a.requires_grad) for a in args]
        out, ref = jf(*a1), bdal(*a2)
        g = torch.randn_like(ref)
        out.backward(g)
        ref.backward(g)
        assert_close(out, ref)
        for x, y in zip(a1, a2):
            if x.requires_grad:
                assert_close(x.grad, y.grad, atol=2e-5)
    assert jf.stats["graphs"] == 4 and jf.stats["fallbacks"] == 0


def test_cnn_training_with_a_new_batch_size():
    """A batch size that changes flows through conv, pooling and a flatten
    (the symbolic batch merged with static sizes) without fallbacks; with
    every size symbolic too, the flatten's product of sizes being a size of
    its own."""
    def net():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(8 * 4 * 4, 5)).to(DEVICE)
    mod = net()
    ref = copy.deepcopy(mod)
    jm = polyjit.jit_torch(mod, compile_options={"target": TARGET})
    for n in (2, 3, 4):
        x = torch.randn(n, 3, 8, 8, device=DEVICE)
        out, want = jm(x), ref(x)
        assert_close(out, want)
        out.sum().backward()
        want.sum().backward()
        for p, q in zip(mod.parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, 1e-4, 1e-4)
    assert jm.stats["fallbacks"] == 0
    mod = net()
    ref = copy.deepcopy(mod)
    jm = polyjit.jit_torch(mod, compile_options={"target": TARGET}, dynamic=True)
    for n in (2, 3):
        x = torch.randn(n, 3, 8, 8, device=DEVICE)
        out, want = jm(x), ref(x)
        assert_close(out, want)
        r = torch.randn_like(want)
        (out * r).sum().backward()
        (want * r).sum().backward()
        for p, q in zip(mod.parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, 1e-4, 1e-4)
            p.grad = q.grad = None
    assert jm.stats["fallbacks"] == 0


def test_strided_convolution_and_pooling_train_with_every_size_symbolic():
    """dynamic=True: strided conv, max and average pooling give sizes like
    (h - 1) // 2 + 1, parameters derived from h at each call; one forward
    and one backward program serve images of every size, odd and even."""
    mod = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, stride=2), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                        nn.Conv2d(8, 4, 1), nn.AvgPool2d(2)).to(DEVICE)
    ref = copy.deepcopy(mod)
    jm = polyjit.jit_torch(mod, compile_options={"target": TARGET}, dynamic=True)
    # sizes alike in the parities some torch versions guard on (their pooling shape functions)
    for shape in ((2, 3, 16, 24), (3, 3, 31, 16), (2, 3, 24, 32)):
        x = torch.randn(*shape, device=DEVICE)
        out, want = jm(x), ref(x)
        assert_close(out, want, 1e-4, 1e-5)
        g = torch.randn_like(want)
        out.backward(g)
        want.backward(g)
        for p, q in zip(mod.parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, 1e-4, 1e-4)
    stats = jm.stats
    assert stats["fallbacks"] == 0 and stats["graphs"] == 2


def test_vision_layers_train_without_fallbacks():
    """Layers whose ATen ops decompose into indexing (upsampling, reflection
    padding: aten.index and its backward index_put), average pooling and its
    backward, batch norm in training, ELU and repeat."""
    mod = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ELU(), nn.AvgPool2d(2), nn.BatchNorm2d(6),
                        nn.Upsample(scale_factor=2, mode="bilinear"), nn.ReflectionPad2d(1),
                        nn.AvgPool2d(3, 2, 1, count_include_pad=False), nn.Upsample(scale_factor=2),
                        nn.Conv2d(6, 2, 3))
    check_module(mod, torch.randn(2, 3, 8, 8), rtol=1e-4, atol=1e-4)
    check(lambda x: (F.group_norm(x, 3), x.repeat(1, 2, 1, 1), torch.linalg.vector_norm(x, dim=1)),
          torch.randn(2, 6, 4, 4), rtol=1e-4, atol=1e-4)


def test_group_norm_trains_and_as_strided():
    """Group norm's backward takes a row-major as_strided view; other strides take elements."""
    check_module(nn.GroupNorm(2, 4), torch.randn(2, 4, 3, 3), rtol=1e-4, atol=1e-4)
    check(lambda t: torch.as_strided(t, (3, 2), (1, 3), 1) * 2, r(4, 3))


def test_updates_through_as_strided_views_train():
    """An in-place update of an as_strided view (Swin's windows) is an
    as_strided_scatter in the graph, its backward a new_empty_strided."""
    def update(t, s):
        y = t.clone()
        y.as_strided((2, 3), (6, 2), 1).mul_(s)
        return y
    check(update, r(4, 6, grad=True), r(2, 3, grad=True), backward=True)
    check(lambda t, s: (torch.as_strided_scatter(t, s, (3, 4), (8, 2), 1),
                        torch.as_strided_scatter(t, s.reshape(4, 3) * 2, (4, 3), (3, 1), 0)), r(4, 6), r(3, 4))


def test_sort_topk_argsort():
    x = r(5, 9)
    check(lambda x: (torch.sort(x, -1).values, torch.sort(x, 0, descending=True).indices, torch.topk(x, 3).values,
                     torch.argsort(x, dim=1, stable=True)), x)


def test_a_top_k_over_a_vocabulary_runs_in_torch_counted():
    """A top-k over rows longer than ops.SORT_LIMIT (a sampler's over a
    vocabulary) is a counted fallback, where the pairwise ranking took 2000
    times eager's time; strict refuses it."""
    def sample(logits):
        values, at = torch.topk(torch.log_softmax(logits, -1), 5)
        return values * 2, at
    x = torch.randn(3, polyjit.ops.SORT_LIMIT + 1)
    jf = polyjit.jit_torch(sample)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = jf(x)
    assert_close(got, sample(x))
    assert jf.stats["fallbacks"] == 1 and "top-k along 513 elements" in jf.stats["fallback_ops"][0]
    with pytest.raises(Exception, match="top-k along 513 elements"):  # (torch.compile wraps it)
        polyjit.jit_torch(sample, compile_options={"strict": True})(x)


def test_scatter_and_scatter_reduce():
    """torch.scatter (which sort's backward writes through) and scatter_reduce
    in every reduction, with and without self, over repeated indices; NaN
    and inf pass as in eager."""
    x, src = r(4, 6), r(4, 9)
    src[0, 0], x[1, 2] = float("nan"), float("inf")
    perm = torch.argsort(torch.rand(4, 6), 1).to(DEVICE)
    idx = torch.randint(0, 6, (4, 9), device=DEVICE)
    check(lambda x, s: (x.scatter(1, perm, s), x.scatter(1, perm[:, :3], s * 2)), x, src)
    check(lambda x, s: tuple(x.scatter_reduce(1, idx, s, how, include_self=inc)
                             for how in ("sum", "prod", "mean", "amax", "amin") for inc in (True, False)), x, src)
    check(lambda v: (torch.sort(v, 1).values * torch.arange(9.0, device=v.device)).sum(), r(3, 9, grad=True),
          backward=True)


def test_any_all():
    check(lambda x: ((x > 1).any(1), (x > -1).all(0), torch.any(x > 0)), r(5, 7))


def test_one_hot_checks_its_classes_like_eager():
    """one_hot asserts its class range on the CPU (torch._assert_async; the
    graph torch traces on CUDA carries no check, eager relying on a device
    assert there): the compiled graph returns the condition and the call
    raises eager's error."""
    jf = check(lambda i: F.one_hot(i, 5).float() * 2, torch.randint(0, 5, (7,)))
    if DEVICE == "cpu":
        with pytest.raises(RuntimeError, match="Class values must be smaller than num_classes"):
            jf(torch.tensor([1, 7]))


def test_lgamma_digamma_train():
    """lgamma and digamma (lgamma's derivative) as core composites, poles and
    negative arguments included."""
    x = r(6, 7, grad=True)
    with torch.no_grad():
        x[0, :4] = torch.tensor([0.0, -1.0, -2.5, 1e-6])
    check(lambda x: torch.lgamma(x * 3) + torch.digamma(x * 2 + 0.1), x.detach())
    check(lambda x: torch.lgamma(x.abs() + 0.5) * 2, r(6, 7, grad=True), backward=True, rtol=1e-4, atol=1e-4)


def test_cumulative_products_train():
    check(lambda x: torch.cumprod(x, 1) + torch.cumsum(x, 0), r(4, 7, grad=True), backward=True, rtol=1e-4, atol=1e-4)


def test_half_running_sums_carry_float32():
    """A float16 running sum or log-sum-exp carries float32 between steps, as
    torch's does: carried in half, 3000 x 0.1 stopped growing at 256."""
    x = torch.full((3000,), 0.1, dtype=torch.float16)
    f = polyjit.jit_torch(lambda t: (torch.cumsum(t, 0), torch.logcumsumexp(t * 0, 0)))
    (s, lse), (s_ref, lse_ref) = f(x), (torch.cumsum(x, 0), torch.logcumsumexp(x * 0, 0))
    torch.testing.assert_close(s, s_ref, rtol=2e-3, atol=0)
    torch.testing.assert_close(lse, lse_ref, rtol=2e-3, atol=0)


def test_logcumsumexp_trains_and_keeps_infinities_and_nan():
    """A running log-sum-exp over values 300 apart (a global maximum would
    underflow the early terms to -inf), through -inf, inf and NaN as eager."""
    x = torch.randn(4, 37) * 50
    x[0, 3], x[1, 5], x[2, 7], x[3, :5] = -math.inf, math.inf, math.nan, -300.0
    for dim in (0, 1):
        check(lambda t: torch.logcumsumexp(t, dim), x)
    # (the gradient's reverse scans carry float32, where torch's CPU kernel carries double: as cumprod's, 1e-4)
    check(lambda t: torch.logcumsumexp(t * 5, 1), r(3, 20, grad=True), backward=True, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make", [lambda: nn.Conv2d(6, 9, 3, padding=1, groups=3),
                                  lambda: nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6),
                                  lambda: nn.Conv2d(4, 8, (3, 2), dilation=2, groups=2),
                                  lambda: nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1, groups=2)],
                         ids=["groups3", "depthwise_s2", "dilated", "transposed"])
def test_grouped_convolution_trains(make):
    """Grouped and depthwise convolutions: the input gradient convolves by the
    kernel transposed within each group, the weight gradient pairs each output
    channel with its own group's inputs."""
    mod = make()
    check_module(mod, torch.randn(2, mod.in_channels, 9, 8), rtol=1e-4, atol=1e-4)


def test_grouped_convolution_with_a_new_batch_size():
    """With a symbolic batch, a grouped convolution's weight gradient would
    need channels j*N + n (not affine): that graph runs in eager, counted,
    and the gradients still match; the forward compiles."""
    mod = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1, groups=3), nn.ReLU(), nn.Conv2d(6, 4, 1)).to(DEVICE)
    ref = copy.deepcopy(mod)
    jm = polyjit.jit_torch(mod, compile_options={"target": TARGET})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in (2, 3, 5):
            x = torch.randn(n, 6, 8, 8, device=DEVICE)
            out, want = jm(x), ref(x)
            assert_close(out, want, 1e-4, 1e-5)
            out.sum().backward()
            want.sum().backward()
            for p, q in zip(mod.parameters(), ref.parameters()):
                assert_close(p.grad, q.grad, 1e-4, 1e-4)
    stats = jm.stats
    assert stats["fallback_ops"] == ["the weight gradient of a grouped convolution over a symbolic batch"]


@pytest.mark.parametrize("kw", [dict(stride=2), dict(stride=2, padding=1, output_padding=1),
                                dict(stride=3, dilation=2, padding=2)], ids=["s2", "s2_p1_op1", "s3_d2_p2"])
def test_transposed_convolution_trains(kw):
    check_module(nn.ConvTranspose2d(3, 4, 3, **kw), torch.randn(2, 3, 5, 6), rtol=1e-4, atol=1e-4)


def test_new_dtype_recompiles():
    jf = polyjit.jit_torch(lambda x: torch.exp(x) + 1)
    for dt in (torch.float32, torch.float64):
        x = torch.randn(10, dtype=dt)
        out = jf(x)
        assert out.dtype == dt
        assert_close(out, torch.exp(x) + 1)


def test_uint8_images_and_int8_arithmetic():
    """uint8 images scaled to floats, their sums and maxima (torch sums
    integers in int64), int8 with uint8 (int16), and int8 products that
    wrap around: the dtypes and values eager gives, nothing in eager."""
    def prep(img, m):
        x = (img.float() / 255.0 - 0.5) * 2.0
        return x, img.sum(), img.amax(dim=(2, 3)), img.amin(dim=1), img + m, (img // 7) % 5, img > 100

    def wrap(x, y):
        return x * y, x - y, torch.maximum(x, y), x.sum(0), x.abs(), x.to(torch.int16) * 300
    img = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8, device=DEVICE)
    m = torch.randint(-128, 128, (8,), dtype=torch.int8, device=DEVICE)
    x, y = (torch.randint(-128, 128, (16, 9), dtype=torch.int8, device=DEVICE) for _ in range(2))
    for fn, args in ((prep, (img, m)), (wrap, (x, y))):
        jf = polyjit.jit_torch(fn, compile_options={"target": TARGET, "strict": True})
        for got, want in zip(jf(*args), fn(*args)):
            assert got.dtype == want.dtype, (got.dtype, want.dtype)
            assert_close(got, want)
        assert jf.stats["fallbacks"] == 0


def test_fallback_counted_warned_and_correct():
    def fn(x):
        return torch.special.bessel_j0(torch.sin(x) + 2) * 2
    jf = polyjit.jit_torch(fn)
    x = torch.randn(4, 9)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = jf(x)
    assert_close(out, fn(x))
    # the op itself, and nothing else: the parts around it (one result each) compile
    assert jf.stats["fallbacks"] == 1 and "bessel_j0" in jf.stats["fallback_ops"][0], jf.stats["fallback_ops"]
    assert any("eager" in str(m.message) for m in w)


def test_a_graph_scattered_between_unsupported_ops_runs_whole_in_eager():
    """Supported ops in many small parts between unsupported ones run in
    eager PyTorch with them (a compiled part's call costs more than it
    saves); a few large parts compile."""
    def scattered(x):
        for _ in range(10):
            x = torch.special.bessel_j0(x) * 2
        return x

    def few(x):
        y = torch.special.bessel_j0(x)
        for _ in range(8):
            y = torch.tanh(y * 1.5 + x) - x * y
        return y
    x = torch.randn(4, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fn, compiled in ((scattered, False), (few, True)):
            jf = polyjit.jit_torch(fn)
            assert_close(jf(x), fn(x), rtol=1e-4)  # (eight steps of a map amplify a rounding's difference)
            assert jf.stats["fallbacks"] >= 1 and (jf.stats["graphs"] > 0) == compiled


def test_strict_refuses_fallback():
    def fn(x):
        return torch.special.bessel_j0(x)
    jf = polyjit.jit_torch(fn, compile_options={"strict": True})
    with pytest.raises(Exception, match="bessel_j0.*not supported by polyjit") as e:
        jf(torch.randn(3, 4))
    assert "test_torch.py" in str(e.value)
    assert isinstance(e.value, UnsupportedOpError) or isinstance(e.value.__cause__, UnsupportedOpError) \
        or "UnsupportedOpError" in str(e.value)


def test_execution_backends_and_option_errors():
    fn = lambda x: torch.tanh(x) * 3  # noqa: E731
    x = torch.randn(5)
    assert_close(polyjit.jit_torch(fn, execution_backend="std")(x), fn(x))
    with pytest.raises(CompileOptionError, match="execution_backend"):
        polyjit.jit_torch(fn, execution_backend="xla")
    with pytest.raises(CompileOptionError, match="unknown compile option 'tile'"):
        polyjit.jit_torch(fn, compile_options={"tile": 3})


def test_torch_compile_finds_backend_without_import():
    code = ("import torch\n"
            "f = torch.compile(lambda x: torch.cos(x) + torch.sin(x), backend='polyjit', options={'num_threads': 1})\n"
            "x = torch.randn(100)\n"
            "assert torch.allclose(f(x), torch.cos(x) + torch.sin(x), atol=1e-6)\n"
            "import sys; assert 'polyjit' in sys.modules\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(__file__))  # not the source tree's root: polyjit as installed
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ok" in out.stdout


ZERO_DIM_DIFFERENTIABLE = [torch.sum, torch.mean, torch.amax, torch.amin, torch.prod, torch.logsumexp, torch.cumsum,
                           torch.cumprod, torch.softmax, torch.log_softmax, torch.nansum,
                           lambda x, d: torch.var(x, d, correction=0), lambda x, d: torch.max(x, d).values,
                           lambda x, d: torch.min(x, d).values, lambda x, d: torch.sort(x, d).values,
                           lambda x, d: torch.flip(x, [d]), lambda x, d: torch.mean(x, d, keepdim=True)]
ZERO_DIM_OTHER = [torch.argmax, torch.argmin, lambda x, d: torch.any(x > 0, d), lambda x, d: torch.all(x > 0, d),
                  lambda x, d: torch.max(x, d).indices, lambda x, d: torch.sort(x, d).indices,
                  lambda x, d: torch.cumsum(x > 0, d), lambda x, d: torch.sum(x > 0, d),
                  lambda x, d: torch.std(x, d), lambda x, d: torch.var(x, d),
                  torch.softmax, torch.log_softmax]  # (without a backward: the inference graph's own rules)


@pytest.mark.filterwarnings("ignore:.*degrees of freedom")
@pytest.mark.parametrize("dim", [0, -1])
def test_zero_dim_tensors_reduce_scan_and_index_like_eager(dim):
    """torch takes dim 0 and -1 of a 0-d tensor as its one element: every
    reduction and scan over it, forward and backward, and indexing into it
    (the compiler raised IndexError)."""
    check(lambda x: torch.stack([f(x, dim).reshape(()) for f in ZERO_DIM_DIFFERENTIABLE]), r(grad=True), backward=True)
    check(lambda x: tuple(f(x, dim) for f in ZERO_DIM_OTHER), r())
    check(lambda x, i: (torch.index_select(x, dim, i), torch.gather(x, dim, i.reshape(())), x.scatter_add(dim, i[0], x),
                        x.index_add(dim, i, x * 2)), r(grad=True), torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("fn,shape", [
    (lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True), (2, 3, 10, 9)),
    (lambda x: F.max_pool2d(x, (3, 2), (2, 3), (1, 1), dilation=(1, 2), ceil_mode=True), (1, 2, 9, 11)),
    (lambda x: F.max_pool1d(x, 3, 2, ceil_mode=True), (2, 3, 10)),
    (lambda x: F.max_pool3d(x, 2, 2, (1, 0, 0), ceil_mode=True), (1, 2, 5, 6, 7)),  # a window dropped, one added
    (lambda x: F.max_pool2d(x, 48, ceil_mode=True), (2, 3, 5, 4)),  # one window, cut to the image
    (lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True), (2, 3, 10, 9)),
    (lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False), (3, 10, 9)),
    (lambda x: F.avg_pool1d(x, 2, 2, ceil_mode=True), (2, 3, 7)),
    (lambda x: F.avg_pool3d(x, (3, 2, 2), 2, (1, 0, 0), ceil_mode=True, count_include_pad=False), (1, 2, 6, 7, 4)),
    (lambda x: F.adaptive_avg_pool2d(x, (3, 4)), (2, 3, 7, 10)),
    (lambda x: F.adaptive_avg_pool2d(x, (5, 7)), (2, 3, 3, 4)),
    (lambda x: F.adaptive_avg_pool1d(x, 4), (2, 3, 10)),
    (lambda x: F.adaptive_avg_pool3d(x, (2, 3, 4)), (1, 2, 3, 5, 4)),
    (lambda x: F.adaptive_max_pool2d(x, (3, 4)), (2, 3, 7, 10)),
    (lambda x: F.adaptive_max_pool1d(x, 3), (2, 3, 10)),
    (lambda x: F.adaptive_max_pool3d(x, (2, 3, 2)), (2, 5, 7, 9)),
], ids=["max2d_ceil", "max2d_ceil_dilated", "max1d_ceil", "max3d_ceil", "max2d_window_past_the_image", "avg2d_ceil",
        "avg2d_ceil_exclude_pad", "avg1d_ceil", "avg3d_ceil", "adaptive_avg2d", "adaptive_avg2d_up", "adaptive_avg1d", "adaptive_avg3d",
        "adaptive_max2d", "adaptive_max1d", "adaptive_max3d"])
def test_pooling_with_ceil_mode_and_uneven_windows_trains(fn, shape):
    """ceil_mode's last partial window (torch's rule: none starts in the high
    padding; average pooling counts the declared padding, not the cells past
    it), 1-d and 3-d pooling, and adaptive pooling whose windows overlap or
    differ in size where the output size does not divide the input's."""
    check(fn, r(*shape, grad=True), backward=True)


@pytest.mark.parametrize("fn,shape", [
    (lambda x: F.avg_pool2d(x, 48, ceil_mode=True), (2, 3, 5, 4)),  # EfficientNet's pooler: one window, mostly padding
    (lambda x: F.avg_pool2d(x, 2), (2, 3, 9, 7)),  # the last row and column in no window
    (lambda x: F.avg_pool2d(x, 3, padding=1, count_include_pad=False), (1, 2, 7, 8)),
    (lambda x: F.adaptive_avg_pool3d(x, (1, 2, 3)), (1, 2, 4, 6, 9)),
], ids=["ceil_mode_window_past_the_image", "cells_left_over", "padded", "3d"])
def test_average_pooling_of_windows_that_tile_the_image_trains(fn, shape):
    """Windows that tile the padded image (stride as the window): their
    gradient is each window's, broadcast and cut to the image. Spread a
    window offset at a time, EfficientNet's 1280x1280 pooler window was
    1.6M pads and adds, and its backward fell back."""
    check(fn, r(*shape, grad=True), backward=True)


def test_adaptive_max_pool_indices():
    check(lambda x: F.adaptive_max_pool2d(x, (3, 4), return_indices=True)[1], r(2, 3, 7, 10))
    check(lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True, return_indices=True)[1], r(2, 3, 10, 9))


def test_log2_exp2_log10_prod_and_full_reductions():
    """log2, exp2 and log10; prod over everything (aten.prod.default) and with
    a dtype; amax over dims=() reduces everything (it compiled as a copy)."""
    x = r(4, 5, grad=True)
    check(lambda x: torch.log2(x.abs() + 0.1) + torch.exp2(x) + torch.log10(x.abs() + 0.5), x, backward=True)
    check(lambda x: torch.prod(x * 0.5 + 1), r(3, 4, grad=True), backward=True)
    check(lambda x: (torch.prod(x, dtype=torch.float64), torch.prod(x, 1, dtype=torch.float64), torch.aminmax(x),
                     torch.amax(x, ())), r(3, 4))


def test_inverse_trig_hyperbolic_and_sign_ops():
    """Composites for ops torch keeps whole (asin ... atanh, trunc, signbit,
    copysign, hypot, logaddexp2, erfinv, round to decimals, fmax, fmin):
    forward on edge values (signed zeros, infinities, NaN, |x| > 1), and
    backward; instance norm (its running stats written back by aten.copy)."""
    x, y, u = r(6, 7) * 3, r(6, 7), torch.rand(6, 7) * 1.9 - 0.95
    x[0, :5] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    y[0, :3] = torch.tensor([-0.0, 0.0, float("-inf")])
    check(lambda x, u, y: (torch.trunc(x), torch.frac(x), torch.signbit(x), torch.signbit(y), torch.copysign(x, y),
                           torch.copysign(x, -2.0), torch.hypot(x, y), torch.logaddexp2(x, y), torch.asin(x),
                           torch.acos(u), torch.atan(x), torch.sinh(u * 3), torch.cosh(u * 3), torch.asinh(x),
                           torch.acosh(x.abs() + 1), torch.atanh(x), torch.erfinv(u), torch.round(x, decimals=2),
                           torch.round(x * 100, decimals=-1), torch.fmax(x, y), torch.fmin(y, x)), x, u, y)

    def f(x, u, y):
        return (torch.trunc(x) + torch.frac(x) + torch.copysign(x, y) + torch.hypot(x, y) + torch.logaddexp2(x, y)
                + torch.asin(u) + torch.acos(u) + torch.atan(x) + torch.sinh(u * 3) + torch.cosh(u * 3) + torch.asinh(x)
                + torch.acosh(x.abs() + 1.5) + torch.atanh(u) + torch.erfinv(u))
    check(f, r(6, 7, grad=True), u.requires_grad_(), r(6, 7, grad=True), backward=True, rtol=1e-4, atol=1e-4)
    check(lambda x, m, v: F.instance_norm(x, m, v, use_input_stats=True), r(2, 3, 5, grad=True), r(3), r(3).abs(),
          backward=True, rtol=1e-4, atol=1e-4)


def test_cummax_diagonal_and_negative_padding_train():
    """cummax/cummin with their positions (ties: the latest; NaN stays),
    diagonals (offsets past the matrix too) and their scatter (the
    backward), constant padding with negative widths."""
    x = r(5, 7)
    x[1, 3], x[2, 2] = float("nan"), x[2, 0]
    check(lambda x: (torch.cummax(x, 1), torch.cummin(x, 0), torch.diagonal(x), torch.diagonal(x, 2),
                     torch.diagonal(x, -3), torch.diag(x, 40), torch.cummax(torch.round(x * 2), 1),
                     torch.diagonal(x.reshape(5, 7, 1).expand(5, 7, 3), 1, 0, 1)), x)
    check(lambda x: torch.cummax(x, 1).values * 2 + torch.cummin(x, 1).values + torch.diagonal(x, 1).reshape(5, 1) ** 2
          + F.pad(x, (-1, 1, 1, -1)), r(5, 7, grad=True), backward=True)


def test_the_forward_saves_what_the_backward_cannot_recompute():
    """GPT-2's GELU, written out: the forward saves its input alone (the
    min-cut partition), not the four intermediates the backward can
    recompute; gradients as eager's."""
    def mlp(x, w1, w2):
        h = x @ w1
        return (0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))) @ w2
    torch._dynamo.reset()
    f = torch.compile(mlp, backend="polyjit", options={"strict": True})
    args = [torch.randn(5, 16), torch.randn(16, 32, requires_grad=True), torch.randn(32, 8, requires_grad=True)]
    ref = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = f(*args)
    assert sum(tuple(t.shape) == (5, 32) for t in saved) == 1, [tuple(t.shape) for t in saved]
    r = torch.randn(5, 8)
    (out * r).sum().backward()
    (mlp(*ref) * r).sum().backward()
    for a, b in zip(args[1:], ref[1:]):  # (sums of terms up to ~50 that cancel: the error scales with them)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5 * b.grad.abs().max().item())


def test_saved_weight_transposes_are_views_of_the_weights():
    """A training forward saves what the backward needs of each Linear
    weight (the weight, or its transpose) as the weight's own memory (as
    eager saves it), never a copy; gradients as eager's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    ref = copy.deepcopy(m)
    f = torch.compile(m, backend="polyjit", options={"strict": True})
    x, r = torch.randn(5, 16), torch.randn(5, 8)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = f(x)
    (out * r).sum().backward()
    (ref(x) * r).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    weights = {m[0].weight.data_ptr(), m[2].weight.data_ptr()}
    shapes = {(32, 16), (16, 32), (8, 32), (32, 8)}
    kept = [t for t in saved if tuple(t.shape) in shapes]
    assert kept and all(t.data_ptr() in weights for t in kept), [(tuple(t.shape), t.stride()) for t in saved]


def test_saved_activation_transposes_are_views_read_in_place(monkeypatch):
    """What a training forward saves of an activation for a weight's
    gradient (addmm saves its first operand's transpose) is a view of the
    activation, laid out as eager lays it out, not a transposed copy; the
    backward reads it in place (its graph's input is the array in memory
    order). Gradients as eager's, and row-major like their parameters."""
    def f(x, w1, w2, b):
        return torch.addmm(b, F.gelu(x @ w1), w2)
    orders = []

    def translate(gm, *example):
        t = translate.real(gm, *example)
        orders.append(t.input_orders)
        return t
    translate.real = polyjit.frontends.torch.translate
    monkeypatch.setattr(polyjit.frontends.torch, "translate", translate)
    args = [torch.randn(5, 16), r(16, 32, grad=True), r(32, 8, grad=True), r(8, grad=True)]
    ref = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = torch.compile(f, backend="polyjit", options={"strict": True})(*args)
    g = torch.randn(5, 8)
    (out * g).sum().backward()
    (f(*ref) * g).sum().backward()
    for a, want in zip(args[1:], ref[1:]):
        torch.testing.assert_close(a.grad, want.grad, rtol=1e-5, atol=1e-5)
        assert a.grad.is_contiguous()
    hidden = [t for t in saved if tuple(t.shape) == (32, 5)]  # the GELU's output, transposed
    assert hidden and all(t.stride() == (1, 32) for t in hidden), [(tuple(t.shape), t.stride()) for t in saved]
    assert any((1, 0) in o.values() for o in orders), orders  # the backward's input: the GELU's output as stored


def training_step_saving(m, x) -> tuple[list, list]:
    """A training step of module m on x, compiled under strict and in eager
    on a copy of m, through a random projection of the output: the pairs of
    gradients (compiled, eager) and the tensors the compiled step saved for
    its backward."""
    ref = copy.deepcopy(m)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = torch.compile(m, backend="polyjit", options={"strict": True})(x)
    r = torch.randn_like(out)
    (out * r).sum().backward()
    (ref(x) * r).sum().backward()
    return [(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters())], saved


def test_channels_last_activations_saved_for_the_backward_keep_their_layout():
    """A channels-last network's forward stores what its backward alone
    reads in the layout torch traced the backward with (channels last, as
    eager saves it), so the backward reads it in place: gradients as eager's."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
    m = m.to(memory_format=torch.channels_last)
    grads, saved = training_step_saving(m, torch.randn(2, 4, 8, 8).to(memory_format=torch.channels_last))
    for got, want in grads:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    activations = [t for t in saved if t.dim() == 4 and t.shape[1] == 8]
    assert activations and all(t.is_contiguous(memory_format=torch.channels_last) for t in activations), \
        [(tuple(t.shape), t.stride()) for t in saved]


@pytest.mark.parametrize("train", [False, True])
def test_layer_norm_gelu_softmax_and_addmm_reach_the_table_whole(train, monkeypatch):
    """These composites, and in training their backward ops, reach the
    translator whole: tracing torch's decompositions of them cost the
    compile a node each of their parts. A training graph's layer norm,
    softmax and addmm are decomposed, for the partition to recompute their
    outputs."""
    import polyjit.frontends.torch as torch_frontend
    seen = []
    compile_fx = torch_frontend.compile_fx
    monkeypatch.setattr(torch_frontend, "compile_fx", lambda gm, *a, **k: seen.append(
        {n.target for n in gm.graph.nodes}) or compile_fx(gm, *a, **k))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4), nn.Softmax(-1))
    x = torch.randn(3, 8)
    with torch.set_grad_enabled(train):
        out = torch.compile(m, backend="polyjit", options={"strict": True})(x)
        torch.testing.assert_close(out, m(x))
    aten = torch.ops.aten
    assert aten.gelu.default in seen[0]
    for op in (aten.addmm.default, aten.native_layer_norm.default, aten._softmax.default):  # (in training:
        assert (op in seen[0]) is not train, op  # recomputed, not saved)
    if train:
        out.sum().backward()
        assert {aten.native_layer_norm_backward.default, aten.gelu_backward.default} <= seen[1], seen[1]


def test_a_training_forward_saves_a_product_before_its_bias():
    """A Linear and GELU's forward saves the product, which the library
    call writes anyway, and not the product plus its bias (which the GELU's
    kernel would write beside its own output): the backward adds the bias
    again. Gradients as eager's."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    grads, saved = training_step_saving(m, x)
    for got, want in grads:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        product = x @ m[0].weight.T
    hidden = [t for t in saved if tuple(t.shape) == (3, 16)]
    assert any(torch.allclose(t, product) for t in hidden), [(tuple(t.shape), t.stride()) for t in saved]
    assert not any(torch.allclose(t, product + m[0].bias) for t in hidden)


class _Permuting(nn.Module):
    """ConvNeXt's block: channels last for a norm and a product, then back."""
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.fc = nn.Conv2d(6, 6, 3, padding=1, groups=6), nn.LayerNorm(6), nn.Linear(6, 6)

    def forward(self, x):
        y = self.fc(self.norm(self.conv(x).permute(0, 2, 3, 1)))
        return x + y.permute(0, 3, 1, 2), torch.relu(y).transpose(1, 2)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_results_have_eager_strides(train, channels_last):
    """A result laid out as a permutation of row-major in eager (a permuted
    block's output; a channels-last model's) comes out with eager's
    strides, as a view of the array computed in that order."""
    torch.manual_seed(0)
    m, x = _Permuting().to(DEVICE).train(train), torch.randn(2, 6, 5, 7, device=DEVICE)
    if channels_last:
        m, x = m.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    with torch.set_grad_enabled(train):
        out, ref = torch.compile(m, backend="polyjit")(x), m(x)
    for o, e in zip(out, ref):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)
        assert o.stride() == e.stride()
    assert ref[0].is_contiguous(memory_format=torch.channels_last) == channels_last and not ref[1].is_contiguous()


@pytest.mark.parametrize("mode", ["bilinear", "bilinear_corners", "nearest", "bicubic"])
def test_interpolation_takes_rows_then_columns(mode, monkeypatch):
    """Upsampling indexes an image by a row index and a column index (torch's
    decompositions): taken along each dimension in turn, never as one
    position over the flattened image divided back into its row and column
    for each element. The column indices, computed from positions, are a
    table made once, wrapped and clamped into the image there, and no
    per-column value is made at the image's size. Forward and gradient as
    eager's."""
    from polyjit.api import Executable
    variant, made = Executable.variant, []
    monkeypatch.setattr(Executable, "variant", lambda self, *a, **k: made.append(self) or variant(self, *a, **k))
    kind, corners = mode.split("_")[0], mode.endswith("corners")

    def f(x):
        return F.interpolate(x, size=(23, 17), mode=kind, **({} if kind == "nearest" else {"align_corners": corners}))
    check(f, r(2, 3, 9, 11, grad=True), backward=True)
    for exe in made:
        assert not re.search(r"// (?:11|9)\)", exe.ir("affine")), exe.ir("affine")
    made.clear()
    torch._dynamo.reset()
    check(f, r(2, 3, 9, 11))  # (inference: nothing saved for a backward)
    forward = made[0].ir("affine")
    assert re.search(r"temp int64 t\d+\[17\]", forward), forward
    if TARGET == "cpu":  # (nvgpu keeps a row pair's blend read twice as a statement, fused into the same kernel)
        assert not re.search(r"temp float32 t\d+\[2, 3, 23, 17\]", forward), forward
    lines = forward.splitlines()  # the index tables hold wrapped, clamped positions: none wraps one per element
    assert not [body for head, body in zip(lines, lines[1:])
                if re.match(r"S\d+\[", head) and head.count(" <= i") >= 3 and "< 0)" in body], forward


def test_batch_norm_running_statistics_update_in_the_compiled_graph(monkeypatch):
    """A training step's input mutations (batch norms' running statistics
    and counts) stay in the compiled graph: their new values are copied into
    the module's buffers after the call, all of a dtype in one foreach copy.
    Buffers and gradients as eager's after several steps."""
    copies = []
    foreach_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda a, b: copies.append(len(a)) or foreach_copy(a, b))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                      nn.BatchNorm2d(8, momentum=0.3))
    ref = copy.deepcopy(m)
    f = torch.compile(m, backend="polyjit", options={"strict": True})
    for _ in range(3):
        x, r = torch.randn(2, 3, 10, 9), torch.randn(2, 8, 6, 5)
        (f(x) * r).sum().backward()
        (ref(x) * r).sum().backward()
    for (name, a), b in zip(m.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    assert sorted(copies) == [2] * 3 + [4] * 3, copies  # (the counts; the statistics)


def test_a_copy_into_an_input_read_after_it_is_left_to_torch():
    """``copy_`` into a graph input compiles as an input mutation only where
    nothing reads the input after it (the read would see the value before
    the copy): the support check and the translation agree, so such a copy
    runs in torch while its neighbours compile."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from polyjit.frontends.torch import _Supported, translate

    def kept(x, buf):
        buf.copy_(x * 2.0)
        return x + 1.0

    def read_after(x, buf):
        buf.copy_(x * 2.0)
        return buf + 1.0
    args = (torch.randn(5), torch.zeros(5))
    for fn, supported in ((kept, True), (read_after, False)):
        gm = make_fx(fn)(*args)
        copy_ = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default)
        assert _Supported().is_node_supported({}, copy_) is supported
        if supported:
            assert len(translate(gm).mutations) == 1
        else:
            with pytest.raises(UnsupportedOpError, match="copy_"):
                translate(gm)
    buf = torch.zeros(5)
    out = torch.compile(read_after, backend="polyjit")(args[0], buf)
    torch.testing.assert_close(out, args[0] * 2.0 + 1.0)
    torch.testing.assert_close(buf, args[0] * 2.0)


@pytest.mark.parametrize("native_check", [True, False], ids=["torch's check", "python check"])
def test_host_calls_with_the_same_layouts_run_the_bound_plan(monkeypatch, native_check):
    """On the host, a graph called again with inputs of the last call's
    shapes, strides and dtypes (a training loop) runs the plan that call
    chose on the new tensors, its outputs torch tensors from the start,
    fresh at each call (an earlier call's results stay as they were); a
    call with other strides takes the full path, whether torch's native
    tensor check compares the layouts or Python does. Forward and backward
    equal eager's, a large output (from polyjit's buffer cache) too."""
    from polyjit.runtime.program import CompiledProgram
    guards, native = torch._C._dynamo.guards, []
    made = guards.TensorGuards
    monkeypatch.setattr(guards, "TensorGuards", (lambda *a, **k: native.append(1) or made(*a, **k))
                        if native_check else None)  # (None: a torch without it)
    bound, run_bound = [], CompiledProgram.run_bound
    monkeypatch.setattr(CompiledProgram, "run_bound", lambda self, *a: bound.append(1) or run_bound(self, *a))

    def f(x, w, big):
        return torch.softmax(x @ w, -1) * torch.tanh(x[:, :48]), big * 2 + 1
    jf = polyjit.jit_torch(f, compile_options={"dynamic": False, "strict": True})
    w = torch.randn(64, 48, requires_grad=True)
    big = torch.randn(512, 1024)  # 2 MB
    earlier = None
    for step in range(4):
        x = torch.randn(16, 64, requires_grad=True) if step < 3 else torch.randn(64, 16).t().requires_grad_()
        x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        r = torch.randn(16, 48)
        y, b = jf(x, w, big)
        (y * r).sum().backward()
        want, want_b = f(x2, w2, big)
        (want * r).sum().backward()
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b, want_b)
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)
        if earlier is not None:
            torch.testing.assert_close(earlier[0], earlier[1])
        earlier = (y, y.detach().clone())
        w.grad = None
        if step == 1:
            assert len(bound) >= 2  # the second step: forward and backward through their bound plans
            seen = len(bound)
    assert len(bound) >= seen + 2 and jf.stats["fallbacks"] == 0
    assert bool(native) == native_check  # (the check each call ran: torch's where it has it)
