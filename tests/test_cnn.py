"""Convolutions on the CPU both ways (generated loop nests and the BLAS floor),
against eager PyTorch and against each other; the choice is reported."""
import copy
import ctypes
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import polyjit  # noqa: E402
import refs  # noqa: E402
from polyjit import InputInfo, ops  # noqa: E402
from polyjit.errors import CompileOptionError  # noqa: E402
from polyjit.library import blas  # noqa: E402

F32 = np.float32
needs_blas = pytest.mark.skipif(blas() is None, reason="no BLAS to call")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


CONVS = {  # odd sizes and channel counts
    "1x1": (lambda: nn.Conv2d(13, 17, 1), (2, 13, 9, 7)),
    "3x3": (lambda: nn.Conv2d(11, 19, 3, padding=1), (3, 11, 9, 10)),
    "strided": (lambda: nn.Conv2d(7, 21, 3, stride=2, padding=1), (2, 7, 11, 13)),
    "strided_1x1": (lambda: nn.Conv2d(9, 20, 1, stride=2, bias=False), (2, 9, 11, 9)),
    "dilated": (lambda: nn.Conv2d(6, 18, 3, dilation=2, padding=2), (2, 6, 13, 9)),
    "grouped": (lambda: nn.Conv2d(12, 36, 3, padding=1, groups=3), (2, 12, 9, 11)),
    "depthwise": (lambda: nn.Conv2d(10, 10, 5, padding=2, groups=10), (2, 10, 11, 9)),
    "transposed": (lambda: nn.ConvTranspose2d(9, 20, 3, stride=2, padding=1, output_padding=1), (2, 9, 7, 5)),
    "strided_even": (lambda: nn.Conv2d(5, 7, 4, stride=3, padding=2), (2, 5, 14, 11)),  # phases without taps
    "strided_dilated": (lambda: nn.Conv2d(6, 8, 3, stride=2, padding=2, dilation=2), (1, 6, 13, 12)),
    "strided_grouped": (lambda: nn.Conv2d(6, 9, 5, stride=2, padding=2, groups=3), (2, 6, 11, 10)),
    "strided_rows": (lambda: nn.Conv2d(4, 6, 3, stride=(2, 1), padding=(1, 0)), (2, 4, 12, 9)),  # one dim spread
    "small_image": (lambda: nn.Conv2d(24, 72, 3, padding=1), (2, 24, 4, 3)),  # sgemm's parts take channels
}


def _train_step(mod, x, mode):
    """Forward and gradients of (out * r).sum() through polyjit and eager."""
    ref = copy.deepcopy(mod)
    jm = polyjit.jit_torch(mod, compile_options={"contractions": mode, "num_threads": 2, "strict": True})
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, want = jm(x1), ref(x2)
    r = torch.randn_like(want)
    (out * r).sum().backward()
    (want * r).sum().backward()
    grads = [x1.grad] + [p.grad for p in mod.parameters()]
    wants = [x2.grad] + [p.grad for p in ref.parameters()]
    return out, want, grads, wants, jm.stats.as_dict()


@needs_blas
@pytest.mark.parametrize("mode", ["generated", "library"])
@pytest.mark.parametrize("kind", list(CONVS))
def test_convolution_forward_and_gradients(kind, mode):
    """Each kind of convolution, computed by generated code or through the
    library (im2col and sgemm), equals eager, forward and gradients; strict
    allows the library (no fallback)."""
    make, shape = CONVS[kind]
    mod = make()
    out, want, grads, wants, stats = _train_step(mod, torch.randn(*shape), mode)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    for g, w in zip(grads, wants):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert stats["fallbacks"] == 0
    if mode == "generated" or kind == "depthwise":
        assert stats["library_calls"] == 0 or mode == "library"
    if mode == "library":
        assert stats["library_calls"] >= 1


@needs_blas
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("groups", [1, 3])
def test_forced_choice_gives_equal_results(layout, groups, rng):
    """contractions="library" and "generated" (and "auto") compute the same
    convolution + bias + relu; only the library's program makes a call."""
    n, h, w, cin, cout = 2, 10, 9, 3 * 7, 3 * 5
    nchw = layout == "NCHW"
    x = rng.standard_normal((n, cin, h, w) if nchw else (n, h, w, cin), dtype=F32)
    k = rng.standard_normal((cout, cin // groups, 3, 3) if nchw else (3, 3, cin // groups, cout), dtype=F32)
    b = rng.standard_normal(cout, dtype=F32)

    def f(x, k, b):
        y = ops.conv(x, k, (1, 1), ((1, 1), (1, 1)), groups=groups, layout=layout,
                     kernel_layout="OIHW" if nchw else "HWIO")
        return ops.relu(y + (ops.reshape(b, [1, cout, 1, 1]) if nchw else b))
    outs, calls = {}, {}
    for mode in ("generated", "library", "auto"):
        exe = polyjit.compile(f, [InputInfo(a.shape, F32) for a in (x, k, b)], {"contractions": mode, "strict": True})
        outs[mode], calls[mode] = exe(x, k, b), exe.compile_default().stats["library_calls"]
    np.testing.assert_allclose(outs["library"], outs["generated"], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(outs["auto"], outs["generated"], rtol=1e-5, atol=1e-4)
    assert calls["generated"] == 0 and calls["library"] == 1  # one statement: a call per image and group


@needs_blas
def test_library_call_counted_under_strict_and_ops_around_it_generated(rng):
    """Under strict, a library call is allowed (it is not a fallback) and
    counted; the batch norm and relu after it, and the padding before it,
    run in generated kernels; stats say which way each convolution went."""
    mod = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                        nn.Conv2d(32, 32, 3, padding=1)).eval()
    x = torch.randn(2, 16, 12, 12)
    jm = polyjit.jit_torch(mod, compile_options={"contractions": "library", "strict": True})
    with torch.no_grad():
        torch.testing.assert_close(jm(x), mod(x), rtol=1e-5, atol=1e-4)
    stats = jm.stats.as_dict()
    assert stats["library_calls"] == 2 and stats["fallbacks"] == 0
    graph = next(iter(jm.stats.graphs.values()))
    assert graph["kernels"] > 2 and all("library (forced)" in c for c in graph["contractions"])
    assert any("im2col" in why for why in graph["fusion_refusals"])  # the batch norm's pass stays its own


def _random_batch_norms(mod):
    for m in mod.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            if m.affine:
                m.weight.data.uniform_(0.5, 1.5)
                m.bias.data.uniform_(-1, 1)
    return mod


BN_NETS = {  # name: (network, input shape, batch norms that fold in eval)
    "conv": (lambda: nn.Sequential(nn.Conv2d(5, 12, 3, padding=1, bias=False), nn.BatchNorm2d(12), nn.ReLU(),
                                   nn.Conv2d(12, 6, 3, stride=2), nn.BatchNorm2d(6), nn.Flatten(),
                                   nn.Linear(6 * 9 * 8, 7), nn.BatchNorm1d(7)), (3, 5, 20, 18), 2),
    "linear": (lambda: nn.Sequential(nn.Linear(8, 5), nn.BatchNorm1d(5)), (64, 8), 1),
}


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("net", list(BN_NETS))
def test_batch_norm_folds_into_the_convolution_in_eval_only(net, training):
    """In eval mode a batch norm after a convolution (and after a Linear)
    folds into its weights and bias: equal to eager; not where the weights
    outnumber the outputs (the Linear of 7 outputs a row); in training mode
    its statistics come from the batch and nothing folds (a batch norm over
    three samples amplifies rounding, so outputs are held to float64's, as
    near as eager's are)."""
    make, shape, folds = BN_NETS[net]
    mod = _random_batch_norms(make()).train(training)
    ref, exact = copy.deepcopy(mod), copy.deepcopy(mod).double()
    jm = polyjit.jit_torch(mod, compile_options={"strict": True})
    x = torch.randn(*shape)
    with torch.no_grad():
        _as_close_as_eager(jm(x), ref(x), exact(x.double()), rtol=1e-5, atol=1e-5)
    assert jm.stats["folded"] == (0 if training else folds) and jm.stats["fallbacks"] == 0
    for a, b in zip(mod.buffers(), ref.buffers()):  # training updates the running statistics alike
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_training_batch_norms_statistics_over_many_values_are_as_near_as_eagers():
    """A training batch norm over 32 x 112 x 112 values a channel: its
    statistics' sums add them in steps (targets.cpu.cascaded_sums), so its
    outputs are as near float64's as eager's are, and within float32
    tolerances of eager's; summed in one running sum each, they were 1000
    times further off. Values all positive, as after a ReLU (the worst
    case for one running sum)."""
    x = torch.relu(torch.randn(32, 4, 112, 112)) + 1.0
    bn = nn.BatchNorm2d(4).train()
    ref = copy.deepcopy(bn)
    got, want = polyjit.jit_torch(bn, compile_options={"strict": True})(x), ref(x)
    exact = F.batch_norm(x.double(), None, None, training=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got.double() - exact).abs().max() <= 16 * (want.double() - exact).abs().max()  # (1.3-4x over 12 seeds)
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=1e-6, atol=1e-7)


def _as_close_as_eager(got, want, exact, rtol, atol):
    """`got` within tolerance of float64's `exact`, the tolerance widened by
    eager's own distance from it: a batch norm over four samples, and the
    gradients through it, amplify float32 rounding past a fixed tolerance in
    eager too (either can be the nearer one)."""
    exact = exact.double()
    slack = 4 * (want.double() - exact).abs().max().item()
    torch.testing.assert_close(got.double(), exact, rtol=rtol, atol=atol + slack)


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_and_hard_activations_are_one_node_each_way(monkeypatch, training):
    """A training step's batch norms, hardswish and hardsigmoid reach the
    joint graph whole, forward and backward (their decompositions were most
    of a CNN's graph); at symbolic batch sizes, compiled once (the running
    variance's correction, n/(n-1), from a symbolic n). Values, gradients
    and running statistics as eager's, as near float64's as eager's are; in
    eval mode, the running statistics are used and left as they were."""
    from polyjit.frontends import torch as frontend
    partition, joints = frontend.torch_partition.partition, []
    monkeypatch.setattr(frontend.torch_partition, "partition",
                        lambda joint, *a, **k: joints.append(joint) or partition(joint, *a, **k))
    mod = _random_batch_norms(nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Hardswish(), nn.Conv2d(8, 6, 1),
        nn.BatchNorm2d(6, affine=False), nn.Hardsigmoid(), nn.Flatten(), nn.Linear(6 * 7 * 5, 4),
        nn.BatchNorm1d(4))).train(training)
    ref, exact = copy.deepcopy(mod), copy.deepcopy(mod).double()
    jm = polyjit.jit_torch(mod, compile_options={"strict": True, "dynamic": True})
    for batch in (4, 10):
        x1 = torch.randn(batch, 3, 7, 5, requires_grad=True)
        x2, x3 = (x1.detach().to(dt).requires_grad_(True) for dt in (torch.float32, torch.float64))
        out, want, want64 = jm(x1), ref(x2), exact(x3)
        _as_close_as_eager(out, want, want64, rtol=1e-5, atol=1e-5)
        w = torch.randn_like(want)
        for y, scale in ((out, w), (want, w), (want64, w.double())):
            (y * scale).sum().backward()
        for a, b, c in zip([x1, *mod.parameters()], [x2, *ref.parameters()], [x3, *exact.parameters()]):
            _as_close_as_eager(a.grad, b.grad, c.grad, rtol=1e-5, atol=1e-4)
        for a, b, c in zip(mod.buffers(), ref.buffers(), exact.buffers()):
            _as_close_as_eager(a, b, c, rtol=1e-5, atol=1e-6)
    assert jm.stats["graphs"] == 2 and jm.stats["fallbacks"] == 0
    ops_in = [str(n.target) for n in joints[0].graph.nodes if n.op == "call_function"]
    norm = "_native_batch_norm_legit_functional" if training else "_native_batch_norm_legit_no_training"
    assert sum(norm in o for o in ops_in) == 3 and sum("native_batch_norm_backward" in o for o in ops_in) == 3
    for name in ("hardswish", "hardsigmoid"):
        assert sum(o == f"aten.{name}.default" for o in ops_in) == 1
        assert sum(o == f"aten.{name}_backward.default" for o in ops_in) == 1
    assert not any("var_mean" in o or "rsqrt" in o for o in ops_in)


def test_batch_norm_of_constant_weights_folds_at_compile_time(rng):
    """With the weights and statistics constants, the folded kernel and bias
    are constants: the program multiplies nothing outside the convolution."""
    w, mean, var, gamma, beta = (rng.standard_normal(s, dtype=F32) for s in ((3, 3, 4, 6), 6, 6, 6, 6))
    inv = gamma / np.sqrt(np.abs(var) + 0.5)

    def f(x):
        y = ops.conv(x, w, (1, 1), ((1, 1), (1, 1)), layout="NHWC", kernel_layout="HWIO")
        return ops.relu((y - mean) * inv + beta)
    x = rng.standard_normal((2, 7, 5, 4), dtype=F32)
    exe = polyjit.compile(f, [InputInfo(x.shape, F32)], {"strict": True}).compile_default()
    y = torch.nn.functional.conv2d(torch.from_numpy(x).permute(0, 3, 1, 2), torch.from_numpy(w).permute(3, 2, 0, 1),
                                   padding=1).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(exe(x)[0], np.maximum((y - mean) * inv + beta, 0), rtol=1e-5, atol=1e-5)
    assert exe.stats["folded"] == 1
    assert not any(op in exe.ir["graph"] for op in ("= mul(", "= sub("))


def test_a_networks_preparation_runs_first_in_one_kernel_on_the_host(rng):
    """Folded into the convolutions each call, two batch norms leave small
    statements computed from the inputs alone (per-channel scales and
    shifts, the scaled weights). On the host they run first, in one kernel
    on one thread, not each in a kernel of its own (LLVM's time per kernel)
    nor among the activations' fusion groups; the results equal the
    network's."""
    shapes = [(2, 10, 9, 4), (3, 3, 4, 8)] + [(8,)] * 4 + [(3, 3, 8, 6)] + [(6,)] * 4

    def f(x, w1, g1, b1, m1, v1, w2, g2, b2, m2, v2):
        y = ops.conv(x, w1, (1, 1), ((1, 1), (1, 1)), layout="NHWC", kernel_layout="HWIO")
        y = ops.relu((y - m1) * (g1 * ops.rsqrt(v1 + 1e-5)) + b1)
        z = ops.conv(y, w2, (1, 1), ((1, 1), (1, 1)), layout="NHWC", kernel_layout="HWIO")
        return ops.relu((z - m2) * (g2 * ops.rsqrt(v2 + 1e-5)) + b2)
    args = [rng.standard_normal(sh, dtype=F32) for sh in shapes]
    for v in (args[5], args[10]):
        v[:] = np.abs(v) + 0.5
    for w in (args[1], args[6]):  # (a network's scale: outputs of order one, whichever way the products sum)
        w /= np.sqrt(np.prod(w.shape[:3]))
    exe = polyjit.compile(f, [InputInfo(a.shape, F32) for a in args], {"strict": True, "cache": False})
    exe = exe.compile_default()
    assert exe.stats["folded"] == 2
    nests = exe.ir["ast"].split("// in order")
    assert len(nests) == 2 and not nests[0].strip(), exe.ir["ast"]  # one preparation, ahead of everything
    first = exe.ir["mapping"].splitlines()[0]
    assert "one thread" in first, exe.ir["mapping"]
    assert exe.ir["llvm"].count("optsize") == 1  # (LLVM's time on it, without unrolling every short loop)
    t = torch.from_numpy
    x, w1, g1, b1, m1, v1, w2, g2, b2, m2, v2 = map(t, args)
    y = torch.nn.functional.batch_norm(torch.nn.functional.conv2d(x.permute(0, 3, 1, 2), w1.permute(3, 2, 0, 1),
                                                                  padding=1), m1, v1, g1, b1, eps=1e-5).relu()
    z = torch.nn.functional.batch_norm(torch.nn.functional.conv2d(y, w2.permute(3, 2, 0, 1), padding=1),
                                       m2, v2, g2, b2, eps=1e-5).relu()
    np.testing.assert_allclose(exe(*args)[0], z.permute(0, 2, 3, 1).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k,stride", [(3, 1), (5, 2), (7, 1)])
def test_depthwise_convolution_is_a_stencil_vectorized_along_channels(k, stride, rng):
    """A channels-last depthwise convolution up to 7x7 unrolls into one
    statement with its bias and relu (no contraction), whose padded taps are
    vector loads along channels, not gathers; equal to torch's."""
    c = 37
    x = rng.standard_normal((2, 11, 9, c), dtype=F32)
    w = rng.standard_normal((k, k, 1, c), dtype=F32)
    b = rng.standard_normal(c, dtype=F32)

    def f(x, w, b):
        y = ops.conv(x, w, (stride, stride), ((k // 2, k // 2),) * 2, groups=c, layout="NHWC", kernel_layout="HWIO")
        return ops.relu(y + b)
    exe = polyjit.compile(f, [InputInfo(a.shape, F32) for a in (x, w, b)], {"strict": True}).compile_default()
    want = torch.relu(torch.nn.functional.conv2d(torch.from_numpy(x).permute(0, 3, 1, 2),
                                                 torch.from_numpy(w).permute(3, 2, 0, 1), torch.from_numpy(b),
                                                 stride, k // 2, groups=c)).permute(0, 2, 3, 1)
    np.testing.assert_allclose(exe(x, w, b)[0], want.numpy(), rtol=1e-5, atol=1e-5)
    assert exe.stats["statements"] == 1 and exe.stats["kernels"] == 1
    assert "gather" not in exe.ir["llvm_opt"]


def test_contractions_option_is_checked():
    with pytest.raises(CompileOptionError, match="contractions"):
        polyjit.compile(lambda x: x + 1, [InputInfo([4], F32)], {"contractions": "blas"})


DOTS = {
    "matmul": (lambda a, b: ops.matmul(a, b), [(5, 7), (7, 9)]),
    "linear": (lambda a, b: ops.linear(a, b), [(2, 33), (20, 33)]),
    "linear_packed": (lambda a, b: ops.linear(a, b), [(17, 33), (20, 33)]),
    "batched": (lambda a, b: ops.matmul(a, b), [(3, 5, 7), (3, 7, 9)]),
    "batched_transposed": (lambda a, b: ops.matmul(a, ops.transpose(b, 1, 2)), [(3, 5, 7), (3, 9, 7)]),
    "first_transposed": (lambda a, b: ops.matmul(ops.transpose(a, 0, 1), b), [(7, 5), (7, 9)]),
    "computed_operand": (lambda a, b: ops.matmul(ops.relu(a), b), [(5, 7), (7, 9)]),
    "computed_keys": (lambda a, b: ops.matmul(a, ops.transpose(ops.relu(b), 1, 2)), [(3, 5, 7), (3, 9, 7)]),
}


@needs_blas
@pytest.mark.parametrize("kind", list(DOTS))
def test_products_both_ways(kind, rng):
    """Matrix products through sgemm (operands read in place, transposed in
    the call, or copied first where computed) equal the generated ones."""
    f, shapes = DOTS[kind]
    args = [rng.standard_normal(s, dtype=F32) for s in shapes]
    outs, calls, kernels = {}, {}, {}
    for mode in ("generated", "library"):
        exe = polyjit.compile(f, [InputInfo(s, F32) for s in shapes], {"contractions": mode})
        outs[mode], calls[mode] = exe(*args), exe.compile_default().stats["library_calls"]
        kernels[mode] = exe.compile_default().kernels
    np.testing.assert_allclose(outs["library"], outs["generated"], rtol=1e-5, atol=1e-5)
    assert (calls["generated"], calls["library"]) == (0, 1)
    if kind == "computed_keys":  # the copy of relu(b) keeps b's layout (no transposing copy); sgemm transposes
        assert re.search(r"t\w+\[i0, i1, i2\] = relu\(in1\[i0, i1, i2\]\)", exe.ir("affine"))
    if kind == "linear_packed":  # generated blocks read a packed copy of the weight; sgemm reads it transposed
        assert [k.name.split("_")[2] for k in kernels["generated"]] == ["transpose", "dot"]
        assert [k.name.split("_")[2] for k in kernels["library"]] == ["sgemm"]


COLUMN_CONVS = {  # input, weight, stride, padding, dilation, groups, returned whole; the taps' copy
    "3x3": ((2, 11, 13, 14), (19, 11, 3, 3), 1, 1, 1, 1, False, "pad"),
    "dilated_grouped": ((3, 12, 9, 30), (24, 4, 3, 3), 1, 2, 2, 3, False, "pad"),
    "returned": ((2, 11, 13, 14), (19, 11, 3, 3), 1, 1, 1, 1, True, "pad"),  # (copied out of its wide rows)
    "narrow": ((2, 16, 5, 5), (32, 16, 3, 3), 1, 1, 1, 1, False, "col"),
    "strided": ((2, 9, 15, 11), (20, 9, 3, 3), 2, 1, 1, 1, False, "col"),
    "1x1": ((2, 24, 7, 9), (40, 24, 1, 1), 1, 0, 1, 1, False, "in place"),  # its input's rows are its columns
    "squeeze": ((2, 16, 1, 1), (24, 16, 1, 1), 1, 0, 1, 1, False, None),  # short enough to inline: no copy
}


@pytest.mark.parametrize("kind", list(COLUMN_CONVS))
def test_generated_nchw_convolution_runs_along_its_positions(kind, rng):
    """A generated float32 NCHW convolution is a product along its output's
    flattened positions (polyjit.columns): the padded input read at a shift
    per tap (stride 1, rows at most 15% wider than the output's; a result
    handed out is copied from those rows), else its im2col copy, or its
    input itself (1x1, an array); its register blocks' columns divide the
    positions. A NaN in
    the input reaches the outputs whose windows hold it."""
    xs, ws, stride, pad, dil, groups, returned, copy_label = COLUMN_CONVS[kind]
    x, w = rng.standard_normal(xs, dtype=F32), rng.standard_normal(ws, dtype=F32)
    x[1, 2, min(3, xs[2] - 1), min(4, xs[3] - 1)] = np.nan

    def f(a, b):
        y = ops.conv2d(a, b, stride=stride, padding=pad, dilation=dil, groups=groups)
        return y if returned else ops.relu(y)
    exe = polyjit.compile(f, [InputInfo([-1, *xs[1:]], F32), InputInfo(ws, F32)],
                          {"contractions": "generated", "target": "cpu", "cache": False})
    want = refs.conv2d(x, w, (stride, stride), ((pad, pad), (pad, pad)), (dil, dil), groups)
    want = want if returned else np.maximum(want, 0, where=~np.isnan(want), out=want.copy())
    np.testing.assert_allclose(exe(x, w), want, rtol=1e-5, atol=1e-4)
    assert exe.stats["library_calls"] == 0
    copies = set(re.findall(r"temp float32 t\d+_(pad|col)\[", exe.ir("affine")))
    assert copies == ({copy_label} if copy_label in ("pad", "col") else set())
    assert bool(re.search(r"register blocks of \d+ products", exe.ir("mapping"))) == bool(copy_label)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_fusion_into_a_convolution_is_refused_where_it_loses(layout, rng):
    """A generated convolution shares its nest with its bias and relu only
    where the cost model expects a gain: an NCHW convolution computed in
    place (float64: float32 runs along its flattened positions,
    polyjit.columns) has register blocks along image columns, whose padding
    guard differs in every lane, so that fusion is refused, counted, and
    said why; NHWC's (channels) fuses."""
    nchw = layout == "NCHW"
    dt = np.float64 if nchw else F32
    x = rng.standard_normal((2, 16, 12, 12) if nchw else (2, 12, 12, 16)).astype(dt)
    k = rng.standard_normal((32, 16, 3, 3) if nchw else (3, 3, 16, 32)).astype(dt)
    b = rng.standard_normal(32).astype(dt)

    def f(x, k, b):
        y = ops.conv(x, k, (1, 1), ((1, 1), (1, 1)), layout=layout, kernel_layout="OIHW" if nchw else "HWIO")
        return ops.relu(y + (ops.reshape(b, [1, 32, 1, 1]) if nchw else b))
    infos = [InputInfo(a.shape, dt) for a in (x, k, b)]
    exe = polyjit.compile(f, infos, {"contractions": "generated"}).compile_default()
    unfused = polyjit.compile(f, infos, {"contractions": "generated", "fusion": "none"})
    np.testing.assert_allclose(exe(x, k, b)[0], unfused(x, k, b), rtol=1e-5, atol=1e-4)
    if nchw:
        assert exe.stats["fusions_refused"] == 1 and exe.stats["kernels"] > 1
        assert "padding guard" in exe.stats["fusion_refusals"][0]
    else:
        assert exe.stats["fusions_refused"] == 0 and exe.stats["kernels"] == 1


CACHED_CONV = """
import json, numpy as np, polyjit
from polyjit import ops, InputInfo
rng = np.random.default_rng()
x, k = rng.standard_normal((2, 16, 10, 9), dtype=np.float32), rng.standard_normal((24, 16, 3, 3), dtype=np.float32)
f = lambda a, b: ops.conv(a, b, (1, 1), ((1, 1), (1, 1)), layout="NCHW", kernel_layout="OIHW")
exe = polyjit.compile(f, [InputInfo(x.shape, np.float32), InputInfo(k.shape, np.float32)],
                      {"contractions": "library", "num_threads": 2, "strict": True}).compile_default()
win = np.lib.stride_tricks.sliding_window_view(np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3), (2, 3))
ref = np.einsum("nchwij,ocij->nohw", win.astype(np.float64), k)
np.testing.assert_allclose(exe(x, k)[0], ref, rtol=1e-5, atol=1e-4)
print(json.dumps({key: exe.stats[key] for key in ("cache_hits", "kernels_compiled", "library_calls")}))
"""


@needs_blas
def test_library_calls_survive_the_compile_cache(tmp_path):
    """Code calling BLAS names its functions, bound in each process that
    loads it: a program from the on-disk cache, made by another process
    (where the library sits elsewhere), runs and gives the right result."""
    env = {**os.environ, "POLYJIT_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", CACHED_CONV], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["cache_hits"] == 0 and first["kernels_compiled"] > 0 and first["library_calls"] == 1
    assert second == {"cache_hits": 1, "kernels_compiled": 0, "library_calls": 1}


@needs_blas
def test_library_calls_bind_to_either_blas_through_one_form_of_call(tmp_path):
    """With PyTorch loaded, POLYJIT_BLAS=mkl picks the MKL its library exports
    (Fortran form, through an adapter); POLYJIT_BLAS=openblas numpy's OpenBLAS.
    Code calls one form either way: made under one, loaded from the cache
    under the other, it gives the right result."""
    if subprocess.run([sys.executable, "-c", "import torch, polyjit.library as l; assert l._loaded_mkl()"],
                      capture_output=True).returncode:
        pytest.skip("no MKL in this PyTorch")
    code = "import torch, polyjit.library as l\n" + CACHED_CONV + "print(l.blas().fortran)\n"
    runs = []
    for choice in ("mkl", "openblas"):
        env = {**os.environ, "POLYJIT_CACHE_DIR": str(tmp_path), "POLYJIT_BLAS": choice}
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        runs.append(p.stdout.split())
    assert [fortran for *_, fortran in runs] == ["True", "False"]
    assert '"cache_hits": 1' in " ".join(runs[1])


def test_the_faster_blas_on_one_thread_is_the_one_called(monkeypatch, rng):
    """Where MKL and OpenBLAS are both at hand, blas() takes the one whose
    sgemm, each called on one thread, runs faster; each library's call
    gives numpy's product. The clock is a stand-in, advanced by each call:
    no timing decides the test. A probe that fails leaves MKL, as before."""
    from polyjit import library
    libs = [lib for lib in (library._loaded_mkl(), library._numpy_openblas()) if lib is not None]
    if len(libs) < 2:
        pytest.skip("one BLAS at hand")
    m, k, n = 5, 7, 3
    a, b = rng.standard_normal((m, k), dtype=F32), rng.standard_normal((k, n), dtype=F32)
    for lib in libs:
        c = (ctypes.c_float * (m * n))()
        library._sgemm(lib, m, n, k, (ctypes.c_float * (m * k))(*a.ravel()), (ctypes.c_float * (k * n))(*b.ravel()), c)
        np.testing.assert_allclose(np.array(c).reshape(m, n), a @ b, rtol=1e-5, atol=1e-5)
    now = [0.0]
    monkeypatch.setattr(library, "_clock", lambda: now[0])
    monkeypatch.delenv("POLYJIT_BLAS", raising=False)
    mkl, openblas = libs
    for seconds, chosen in (({mkl: 1.0, openblas: 0.5}, openblas), ({mkl: 0.5, openblas: 1.0}, mkl)):
        def sgemm(lib, *args, seconds=seconds):
            now[0] += seconds[lib]
        monkeypatch.setattr(library, "_sgemm", sgemm)
        monkeypatch.setattr(library, "_blas", False)
        assert library.blas() == chosen, seconds
    monkeypatch.setattr(library, "_sgemm", lambda *args: 1 / 0)
    monkeypatch.setattr(library, "_blas", False)
    assert library.blas() == mkl


@needs_blas
@pytest.mark.parametrize("timed,choice", [((1.0, 0.9), "library"), ((1.0, 0.7), "generated")])
def test_generated_code_replaces_the_library_only_timed_a_fifth_faster(timed, choice, rng, monkeypatch):
    """A timed contraction (a channels-last weight gradient) calls the
    library unless its generated code took at most GENERATED_MARGIN of the
    library's time: a timing alone flatters generated code, and a tie that
    flips with the host's noise would make another program."""
    from polyjit import library
    monkeypatch.setattr(library, "_measured", {})
    monkeypatch.setattr(library, "_time", lambda exes, args: list(timed))
    x, g = rng.standard_normal((2, 12, 12, 16), dtype=F32), rng.standard_normal((2, 12, 12, 32), dtype=F32)
    exe = polyjit.compile(lambda x, g: ops.conv(x, g, [1, 1], [(1, 1)] * 2, layout="CHWN", kernel_layout="IHWO"),
                          [InputInfo(a.shape, F32) for a in (x, g)], {"cache": False})
    (why,) = exe.stats["contractions"]
    assert why.split(": ", 1)[1].startswith(choice), why


@needs_blas
def test_a_computed_input_of_a_library_convolution_is_made_once_not_per_tap(rng):
    """im2col reads each input element once per tap: a computed input (relu(2x))
    is made into an array first, not recomputed nine times in the columns."""
    x, k = rng.standard_normal((2, 16, 10, 9), dtype=F32), rng.standard_normal((24, 16, 3, 3), dtype=F32)
    f = lambda a, b: ops.conv(ops.relu(ops.mul(a, 2.0)), b, (1, 1), ((1, 1), (1, 1)),  # noqa: E731
                              layout="NCHW", kernel_layout="OIHW")
    exe = polyjit.compile(f, [InputInfo(x.shape, F32), InputInfo(k.shape, F32)], {"contractions": "library"})
    columns = [line for line in exe.ir("affine").splitlines() if "_col[" in line and "=" in line]
    assert columns and not any("relu" in line for line in columns)
    want = polyjit.compile(f, [InputInfo(x.shape, F32), InputInfo(k.shape, F32)], {"contractions": "generated"})
    np.testing.assert_allclose(exe(x, k), want(x, k), rtol=1e-4, atol=1e-4)


@needs_blas
def test_a_library_call_leaves_the_callers_blas_threads_as_they_were(rng):
    """Each part's sgemm runs on one thread and sets the caller's thread-local
    count back after it: a framework's own products, on the thread that ran
    the program, keep their threads."""
    if blas().set_threads_local is None:
        pytest.skip("this BLAS has no thread-local count")
    setter = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(blas().set_threads_local)
    before = setter(3)
    a, b = rng.standard_normal((30, 20), dtype=F32), rng.standard_normal((20, 13), dtype=F32)
    exe = polyjit.compile(ops.matmul, [InputInfo(a.shape, F32), InputInfo(b.shape, F32)],
                          {"contractions": "library", "num_threads": 1, "cache": False})
    np.testing.assert_allclose(exe(a, b), a @ b, rtol=1e-5, atol=1e-5)
    assert setter(before) == 3


@needs_blas
def test_a_library_product_reads_an_operand_reshaped_from_an_array_in_place(rng):
    """A product's operand that reshapes a computed array ([4, 32, 64] as
    [128, 64]: BERT's hidden states into a Linear; [4, 32, 3, 16] as
    [128, 48], or its transpose: attention's packed projections) is the
    same memory: the library call reads it in place, with no copy first."""
    def f(x, w, z, v):
        t, u = ops.tanh(x), ops.tanh(z)  # (values of their own, read again: a transformer layer's residual)
        return (ops.matmul(ops.reshape(t, [128, 64]), w), ops.sum(t, [2]),
                ops.matmul(ops.permute(ops.reshape(u, [128, 48]), [1, 0]), v), ops.sum(u, [3]))
    x, w = rng.standard_normal((4, 32, 64), dtype=F32), rng.standard_normal((64, 48), dtype=F32)
    z, v = rng.standard_normal((4, 32, 3, 16), dtype=F32), rng.standard_normal((128, 40), dtype=F32)
    exe = polyjit.compile(f, [InputInfo(a.shape, F32) for a in (x, w, z, v)],
                          {"contractions": "library", "strict": True, "cache": False})
    t, u = np.tanh(x.astype(np.float64)), np.tanh(z.astype(np.float64))
    for got, ref in zip(exe(x, w, z, v), (t.reshape(128, 64) @ w, t.sum(2), u.reshape(128, 48).T @ v, u.sum(3))):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert exe.stats["library_calls"] == 2 and not re.search(r"t\d+_[ab]\[", exe.ir("affine")), exe.ir("affine")


@needs_blas
def test_a_library_product_reads_attention_heads_in_place(rng):
    """Attention's operands are views of arrays: the heads of a [b, s, h, d]
    projection transposed to [b, h, s, d] (two batch dims, each with its own
    stride), and saved probabilities [b, h, s, s] merged to [b*h, s, s] and
    transposed (one batch dim running across two of the array's dims). The
    library reads each in place, with no copy first."""
    def f(x, y, p, v):
        q, k = ops.tanh(x), ops.tanh(y)  # [b, s, h, d]
        scores = ops.matmul(ops.permute(q, [0, 2, 1, 3]), ops.permute(k, [0, 2, 3, 1]))
        pt = ops.permute(ops.reshape(ops.exp(p), [12, 16, 16]), [0, 2, 1])
        return scores, ops.matmul(pt, v), ops.sum(q, [3]), ops.sum(k, [3]), ops.sum(ops.exp(p), [3])
    x, y = rng.standard_normal((4, 16, 3, 8), dtype=F32), rng.standard_normal((4, 16, 3, 8), dtype=F32)
    p, v = rng.standard_normal((4, 3, 16, 16), dtype=F32), rng.standard_normal((12, 16, 8), dtype=F32)
    exe = polyjit.compile(f, [InputInfo(a.shape, F32) for a in (x, y, p, v)],
                          {"contractions": "library", "strict": True, "cache": False})
    q, k, e = (np.tanh(x.astype(np.float64)), np.tanh(y.astype(np.float64)), np.exp(p.astype(np.float64)))
    scores, pv = exe(x, y, p, v)[:2]
    np.testing.assert_allclose(scores, q.transpose(0, 2, 1, 3) @ k.transpose(0, 2, 3, 1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pv, e.reshape(12, 16, 16).transpose(0, 2, 1) @ v, rtol=1e-5, atol=1e-4)
    assert exe.stats["library_calls"] == 2 and not re.search(r"t\d+_[ab]\[", exe.ir("affine")), exe.ir("affine")


@needs_blas
def test_a_computed_operand_is_copied_in_its_own_shape_beside_its_producer(rng):
    """Attention's probabilities, merged from [b, h, s, s] to [b*h, s, s]
    for the product with the values, are copied in their own shape (the
    product reads the copy as a view): the copy reads the softmax's row
    statistics at plain indices and shares the softmax's kernel."""
    def f(s, v):
        return ops.matmul(ops.reshape(ops.softmax(s, -1), [12, 16, 16]), v)
    s, v = rng.standard_normal((4, 3, 16, 16), dtype=F32), rng.standard_normal((12, 16, 8), dtype=F32)
    exe = polyjit.compile(f, [InputInfo(a.shape, F32) for a in (s, v)],
                          {"contractions": "library", "strict": True, "cache": False}).compile_default()
    e = np.exp(s.astype(np.float64) - s.max(-1, keepdims=True))
    np.testing.assert_allclose(exe(s, v)[0], (e / e.sum(-1, keepdims=True)).reshape(12, 16, 16) @ v,
                               rtol=1e-5, atol=1e-5)
    (copy,) = re.findall(r"temp float32 (t\d+_a)\[4, 3, 16, 16\]", exe.ir["affine"])
    writer = re.search(rf"(S\d+)\[[^\n]*\n\s+{copy}\[", exe.ir["affine"]).group(1)
    assert [len(k.statements) > 1 for k in exe.kernels if writer in k.statements] == [True], exe.ir["affine"]


@needs_blas
def test_a_copy_joins_its_producer_across_another_product(rng):
    """A product's copied operand (a softmax, row-normalized into the copy)
    whose product comes after another library call in program order (the
    values' projection, in attention) is made just after its producer, in
    the producer's kernel."""
    def f(s, x, w):
        return ops.matmul(ops.softmax(s, -1), ops.matmul(x, w))
    s, x, w = (rng.standard_normal(sh, dtype=F32) for sh in ((16, 16), (16, 8), (8, 8)))
    exe = polyjit.compile(f, [InputInfo(a.shape, F32) for a in (s, x, w)],
                          {"contractions": "library", "strict": True, "cache": False}).compile_default()
    e = np.exp(s.astype(np.float64) - s.max(-1, keepdims=True))
    np.testing.assert_allclose(exe(s, x, w)[0], (e / e.sum(-1, keepdims=True)) @ (x @ w.astype(np.float64)),
                               rtol=1e-5, atol=1e-5)
    writer = re.search(r"(S\d+)\[[^\n]*\n\s+t\d+_a\[", exe.ir["affine"]).group(1)
    assert [len(k.statements) > 1 for k in exe.kernels if writer in k.statements] == [True], exe.ir["affine"]


@needs_blas
def test_a_reshaped_operand_of_products_is_made_in_its_own_shape(rng):
    """A normalization over [b, s, e] that three products read reshaped to
    [b*s, e] (a transformer's layer norm into its projections) is made in
    its own shape, at plain indices, in one kernel with its statistics; the
    products read it in place as [b*s, e]."""
    def f(x, w1, w2, w3):
        c = x - ops.mean(x, [2], keepdim=True)
        y = ops.reshape(c * ops.rsqrt(ops.mean(c * c, [2], keepdim=True) + 1e-5), [64, 32])
        return ops.matmul(y, w1), ops.matmul(y, w2), ops.matmul(y, w3)
    x = rng.standard_normal((4, 16, 32), dtype=F32)
    ws = [rng.standard_normal((32, 8), dtype=F32) for _ in range(3)]
    exe = polyjit.compile(f, [InputInfo(a.shape, F32) for a in (x, *ws)],
                          {"contractions": "library", "strict": True, "cache": False}).compile_default()
    c = x.astype(np.float64) - x.mean(2, keepdims=True)
    y = (c / np.sqrt((c * c).mean(2, keepdims=True) + 1e-5)).reshape(64, 32)
    for got, w in zip(exe(x, *ws), ws):
        np.testing.assert_allclose(got, y @ w, rtol=1e-5, atol=1e-5)
    affine = exe.ir["affine"]
    assert not re.search(r"float32 t\d+(_a)?\[64, 32\]", affine) and "//" not in affine, affine
    assert len([k for k in exe.kernels if "sgemm" not in k.name]) == 1, [k.name for k in exe.kernels]


@needs_blas
def test_an_operand_two_products_copy_is_made_once(rng):
    """Heads merged back ([b, h, s, d] to [b*s, h*d]: not a view, so copied)
    feed two products, one through a transpose (a projection's input
    gradient and its weight gradient): one copy serves both."""
    def f(x, w, v):
        g = ops.reshape(ops.permute(ops.tanh(x), [0, 2, 1, 3]), [64, 24])
        return ops.matmul(g, w), ops.matmul(ops.permute(g, [1, 0]), v), ops.sum(ops.tanh(x), [3])
    x = rng.standard_normal((4, 3, 16, 8), dtype=F32)
    w, v = rng.standard_normal((24, 5), dtype=F32), rng.standard_normal((64, 7), dtype=F32)
    exe = polyjit.compile(f, [InputInfo(a.shape, F32) for a in (x, w, v)],
                          {"contractions": "library", "strict": True, "cache": False})
    g = np.tanh(x.astype(np.float64)).transpose(0, 2, 1, 3).reshape(64, 24)
    for got, ref in zip(exe(x, w, v), (g @ w, g.T @ v)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert len(re.findall(r"t\d+_[ab]\[", exe.ir("affine"))) == 2, exe.ir("affine")  # declared, then written


@needs_blas
def test_the_library_timing_counts_the_weight_the_generated_nest_packs(rng, monkeypatch):
    """contractions="auto" times x @ W.T from W itself: the generated nest's
    program then packs W.T at each call, as it would in the model, while the
    library reads it in place."""
    from polyjit import library
    monkeypatch.setattr(library, "_measured", {})
    x, w = rng.standard_normal((96, 256), dtype=F32), rng.standard_normal((64, 256), dtype=F32)  # (few rows: timed)
    exe = polyjit.compile(lambda x, w: ops.matmul(x, ops.permute(w, [1, 0])), [InputInfo(x.shape, F32),
                                                                              InputInfo(w.shape, F32)], {"cache": False})
    np.testing.assert_allclose(exe(x, w), x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-4)
    (key,) = library._measured
    assert key[1][1][0] == (64, 256) and key[2][1] == ((1, 0),), key


@needs_blas
def test_a_weight_read_across_too_few_rows_to_pack_calls_the_library(rng, monkeypatch):
    """x @ W.T at 2 rows (a classifier's head at batch 2): below the size
    where products are timed, but its generated nest would gather W a
    column at a time (too few rows to pack it), so the library is called,
    untimed; a batched product of the same kind (attention's) stays
    generated."""
    from polyjit import library
    monkeypatch.setattr(library, "_measured", {})
    x, w, b = (rng.standard_normal(s, dtype=F32) for s in ((2, 512), (1000, 512), (1000,)))
    exe = polyjit.compile(lambda x, w, b: ops.matmul(x, ops.transpose(w, 0, 1)) + b,
                          [InputInfo(a.shape, F32) for a in (x, w, b)], {"cache": False})
    np.testing.assert_allclose(exe(x, w, b), x.astype(np.float64) @ w.T + b, rtol=1e-4, atol=1e-4)
    assert exe.stats["contractions"] == ["dot_general [2, 512] * [512, 1000]: library "
                                         "(its weight read across rows: too few rows to pack it)"]
    assert exe.stats["library_calls"] == 1 and not library._measured
    q, k = rng.standard_normal((4, 2, 64), dtype=F32), rng.standard_normal((4, 100, 64), dtype=F32)
    heads = polyjit.compile(lambda q, k: ops.matmul(q, ops.transpose(k, 1, 2)), [InputInfo(q.shape, F32),
                                                                                  InputInfo(k.shape, F32)],
                            {"cache": False})
    np.testing.assert_allclose(heads(q, k), q @ k.transpose(0, 2, 1), rtol=1e-4, atol=1e-4)
    assert heads.stats["library_calls"] == 0


@needs_blas
@pytest.mark.parametrize("shape,untimed", [((128, 256, 192), "register blocks"), ((100, 300, 77), None),
                                           ((64, 256, 256), "register blocks")])
def test_products_in_whole_register_blocks_run_generated_untimed(shape, untimed, rng, monkeypatch):
    """contractions="auto" settles a float32 product whose register blocks
    are whole on a 512-bit host without timing it (the CPU target's model,
    checked per shape by bench/products.py); partial blocks are timed."""
    from polyjit.codegen.cpu import vector_bits
    timings = _timings_faked(monkeypatch, generated_wins=True)
    exe = _checked_product(shape, rng)
    modeled = bool(untimed) and vector_bits() >= 512
    assert bool(timings) != modeled and exe.stats["library_calls"] == 0, exe.stats["contractions"]
    assert (bool(untimed) and untimed in exe.stats["contractions"][0]) == modeled, exe.stats["contractions"]


@needs_blas
@pytest.mark.parametrize("bits,rows,choice", [(512, 8, "generated"), (256, 8, "library"), (256, 16, "library"),
                                              (256, 4, None)])
def test_a_classifier_head_is_settled_untimed_by_the_hosts_register_blocks(bits, rows, choice, rng, monkeypatch):
    """A classifier head (rows x 1280 -> 1000, the weight read in place) is
    settled without a timing: generated with 512-bit vectors, where it
    streams the weight once; the library with 256-bit ones where its rows
    take more than one register block of 4, each of which would stream the
    whole weight again. Within one block it is timed."""
    from polyjit.targets.cpu import CpuTarget
    monkeypatch.setattr(CpuTarget, "vector_bits", lambda self: bits)
    timings = _timings_faked(monkeypatch, generated_wins=True)
    exe = _checked_product((rows, 1280, 1000), rng)
    (said,) = exe.stats["contractions"]
    assert bool(timings) == (choice is None), said
    assert said.startswith(f"dot_general [{rows}, 1280] * [1280, 1000]: {choice or 'generated'}"), said
    assert exe.stats["library_calls"] == (choice == "library"), said


@needs_blas
@pytest.mark.parametrize("shape,untimed", [((512, 256, 768), True), ((256, 1024, 256), True),
                                           ((128, 256, 1024), False), ((512, 192, 512), False)])
def test_large_products_call_the_library_untimed_with_256_bit_vectors(shape, untimed, rng, monkeypatch):
    """With 256-bit vectors (AVX2), an unbatched float32 product of 256 or
    more rows, depth and columns calls the library without a timing (the
    CPU target's model); a shorter side leaves it timed, and so does a
    batched product (attention's)."""
    from polyjit.targets.cpu import CpuTarget
    monkeypatch.setattr(CpuTarget, "vector_bits", lambda self: 256)
    timings = _timings_faked(monkeypatch, generated_wins=False)
    exe = _checked_product(shape, rng)
    assert bool(timings) != untimed and exe.stats["library_calls"] == 1, exe.stats["contractions"]
    assert ("large on every side" in exe.stats["contractions"][0]) == untimed, exe.stats["contractions"]
    timings.clear()
    batched = _checked_product((256, 256, 256), rng, batch=4)
    assert timings, batched.stats["contractions"]


@needs_blas
@pytest.mark.parametrize("side,untimed", [(7, True), (5, True), (4, False), (14, False), (1, False)])
def test_pointwise_convolutions_of_rows_narrower_than_a_vector_call_the_library(side, untimed, monkeypatch):
    """With 256-bit vectors, a 1x1 convolution of NCHW images whose rows are
    narrower than a vector and fill no vector block of 4 (7x7: its generated
    code was scalar, several times the library's time) calls the library
    untimed, below the size where nothing else is timed; rows of 4 or 14
    positions, and 1x1 images, stay with the usual choice."""
    from polyjit.targets.cpu import CpuTarget
    monkeypatch.setattr(CpuTarget, "vector_bits", lambda self: 256)
    mod = nn.Conv2d(48, 40, 1).eval()
    x = torch.randn(2, 48, side, side)
    jm = polyjit.jit_torch(mod, compile_options={"strict": True, "cache": False})
    with torch.no_grad():
        torch.testing.assert_close(jm(x), mod(x), rtol=1e-5, atol=1e-5)
    choice = next(iter(jm.stats.graphs.values()))["contractions"][0]
    assert ("fill no vector" in choice) == untimed, choice
    assert jm.stats["library_calls"] == 1 or not untimed, choice


def _timings_faked(monkeypatch, generated_wins: bool) -> list:
    """The library's timings replaced by a fixed answer; the list records each one asked for."""
    from polyjit import library
    monkeypatch.setattr(library, "_measured", {})
    timings: list = []
    answer = [1.0, 0.0] if generated_wins else [0.0, 1.0]
    monkeypatch.setattr(library, "_time", lambda exes, args: timings.append(len(exes)) or answer)
    return timings


def _checked_product(shape: tuple, rng, batch: int | None = None):
    """A compiled (m x k) @ (k x n) product, batched where asked, checked against numpy."""
    m, k, n = shape
    lead = (batch,) if batch else ()
    a, b = rng.standard_normal((*lead, m, k), dtype=F32), rng.standard_normal((*lead, k, n), dtype=F32)
    exe = polyjit.compile(ops.matmul, [InputInfo(a.shape, F32), InputInfo(b.shape, F32)], {"cache": False})
    np.testing.assert_allclose(exe(a, b), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    return exe


@needs_blas
def test_a_product_over_merged_symbolic_sizes_reads_its_operand_made_once(rng):
    """A Linear over [b, s, 256] with b and s symbolic: its rows b*s are
    whole register blocks but the last (checked), so on a 512-bit host it
    runs generated, and reads the merged operand made once at plain
    indices, not through the reshape's run-time divisions per product."""
    from polyjit.codegen.cpu import vector_bits
    exe = polyjit.compile(lambda x, w: ops.matmul(ops.reshape(x, [x.shape[0] * x.shape[1], 256]), w),
                          [InputInfo([-1, -1, 256], F32), InputInfo([256, 256], F32)], {"cache": False})
    w = rng.standard_normal((256, 256), dtype=F32)
    for b, s in ((2, 33), (3, 5)):
        x = rng.standard_normal((b, s, 256), dtype=F32)
        np.testing.assert_allclose(exe(x, w), x.reshape(-1, 256).astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
    if vector_bits() >= 512:
        assert exe.stats["library_calls"] == 0, exe.stats["contractions"]
        product = [line for line in exe.ir("affine").splitlines() if " sum= " in line]
        assert product and not any("//" in line for line in product), product


def test_first_calls_far_apart_settle_a_timing():
    """A library-or-generated timing stops after the first call of each
    where those are CLEAR_RATIO apart and long enough (a slow generated
    product is not run again and again); close ones are timed in turns."""
    import time

    from polyjit import library
    calls = []

    def program(k: int, seconds: float):
        return lambda: (calls.append(k), time.sleep(seconds))
    far = library._time([program(0, 0.012), program(1, 0.1)], [])
    assert calls == [0, 1] and far[1] > far[0]
    calls.clear()
    library._time([program(0, 0.012), program(1, 0.02)], [])
    assert calls[:2] == [0, 1] and len(calls) >= 6  # the first calls, then at least two turns each
    calls.clear()
    library._time([program(0, 0.0), program(1, 0.005)], [])  # short ones: cold costs could be all of it
    assert len(calls) >= 6


def _nhwc_conv_reference(x, k, pad: int):
    """conv of NHWC x by an HWIO kernel, stride 1, in float64."""
    xp = np.pad(x.astype(np.float64), ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    kh, kw = k.shape[:2]
    oh, ow = xp.shape[1] - kh + 1, xp.shape[2] - kw + 1
    return sum(np.einsum("nhwc,co->nhwo", xp[:, i:i + oh, j:j + ow], k[i, j]) for i in range(kh) for j in range(kw))


@needs_blas
@pytest.mark.parametrize("case,shape,kernel,pad,choice", [
    ("forward", (4, 24, 24, 64), (1, 1, 64, 32), 0, "generated"),
    ("forward", (4, 32, 32, 64), (1, 1, 64, 8), 0, "generated"),  # 8 output channels: half a vector
    ("forward", (4, 32, 32, 64), (1, 1, 64, 10), 0, None),  # 10: a pair of columns scalar, timed
    ("forward", (1, 7, 9, 512), (1, 1, 512, 512), 0, None),  # 63 positions: timed
    ("forward", (2, 12, 12, 16), (3, 3, 16, 32), 1, ("generated", None)),  # (AVX2: 1x1 kernels only)
    ("forward", (2, 16, 16, 16), (3, 3, 16, 24), 1, ("generated", None)),  # a vector and half of one
    ("strided forward", (2, 24, 24, 16), (3, 3, 16, 32), 1, ("generated", None)),
    ("strided forward", (4, 96, 96, 3), (3, 3, 3, 16), 1, "generated"),  # an image's 3 channels, rows of 48
    ("forward", (2, 32, 32, 3), (3, 3, 3, 32), 1, "generated"),
    ("strided forward", (4, 96, 96, 3), (3, 3, 3, 16), 0, None),  # rows of 47: partial blocks, timed
    ("input gradient", (2, 12, 12, 32), (3, 3, 32, 32), 1, ("library", None)),  # the kernel read as HWOI
    ("input gradient", (2, 16, 16, 32), (3, 3, 16, 32), 1, None),  # 16 output channels: timed
    ("weight gradient", (2, 12, 12, 16), (3, 3, 16, 32), 1, None),  # timed
    ("weight gradient", (2, 8, 8, 64), (3, 3, 64, 64), 1, "library"),  # 64 channels and more
])
def test_channels_last_convolutions_settled_by_the_model(case, shape, kernel, pad, choice, rng, monkeypatch):
    """contractions="auto" settles a channels-last convolution without a
    timing where the CPU target's model knows the answer (checked per shape
    by bench/convolutions.py; the last choice of a pair is a 256-bit host's,
    where the model settles 1x1 kernels and an image's few channels only):
    output channels in vectors (8 channels and up, in fours) along the
    kernel's rows generate (strided too, from a vector of input channels or
    more, or where the result's rows fill the register blocks); an input
    gradient's kernel (two vectors of output channels or more, strided)
    calls the library, and so does a weight gradient of 64 channels and
    more on both sides. The rest, fewer channels' weight gradients among
    them, are timed."""
    from polyjit import library
    from polyjit.codegen.cpu import vector_bits
    monkeypatch.setattr(library, "_measured", {})
    timings = []
    monkeypatch.setattr(library, "_time", lambda exes, args: timings.append(len(exes)) or [1.0, 0.0])
    x, k = rng.standard_normal(shape, dtype=F32), rng.standard_normal(kernel, dtype=F32)
    pads = [(pad, pad)] * 2
    if case.endswith("forward"):
        s = 2 if case.startswith("strided") else 1
        fn, args, want = (lambda x, k: ops.conv(x, k, [s, s], pads, layout="NHWC", kernel_layout="HWIO"),
                          (x, k), _nhwc_conv_reference(x, k, pad)[:, ::s, ::s])
    elif case == "input gradient":  # the gradient g of a conv by k, as JAX writes it: k flipped, read as HWOI
        fn, args = (lambda g, k: ops.conv(g, ops.reverse(k, [0, 1]), [1, 1], pads, layout="NHWC",
                                          kernel_layout="HWOI")), (x, k)
        want = _nhwc_conv_reference(x, np.ascontiguousarray(k[::-1, ::-1].transpose(0, 1, 3, 2)), pad)
    else:  # the weight gradient against g, images and positions reduced: x as CHWN, g as IHWO
        g = rng.standard_normal((*shape[:3], kernel[3]), dtype=F32)
        fn, args = (lambda x, g: ops.conv(x, g, [1, 1], pads, layout="CHWN", kernel_layout="IHWO")), (x, g)
        xp = np.pad(x.astype(np.float64), ((0, 0), (pad, pad), (pad, pad), (0, 0)))
        h, w = shape[1:3]
        want = np.stack([np.stack([np.einsum("nhwo,nhwi->oi", g, xp[:, i:i + h, j:j + w]) for j in range(3)], 1)
                         for i in range(3)], 1)
    exe = polyjit.compile(fn, [InputInfo(a.shape, F32) for a in args], {"cache": False})
    np.testing.assert_allclose(exe(*args), want, rtol=1e-4, atol=1e-3)
    modeled = choice[vector_bits() < 512] if isinstance(choice, tuple) else choice
    (why,) = exe.stats["contractions"]
    assert bool(timings) == (modeled is None), why
    if modeled:
        assert why.split(": ", 1)[1].startswith(modeled) and " ms" not in why, why
        assert exe.stats["library_calls"] == (modeled == "library"), why


WEIGHT_GRADIENTS = {  # x, g, stride, padding, dilation, the form
    "kernel's dims": ((2, 8, 4, 4), (2, 32, 4, 4), 1, 1, 1, r"t\d+_col\[2, 4, 4, 72\]"),  # (images, rows, cols, 8 x 9)
    "out channels": ((3, 8, 10, 9), (3, 16, 10, 9), 1, 1, 1, r"t\d+_across\[72, 16\]"),
    "out channels, strided": ((2, 8, 13, 11), (2, 16, 7, 6), 2, 1, 1, r"t\d+_across\[72, 16\]"),
    "out channels, dilated": ((2, 8, 12, 12), (2, 16, 12, 12), 1, 2, 2, r"t\d+_across\[72, 16\]"),
    "out channels, NHWC": ((3, 8, 10, 9), (3, 16, 10, 9), 1, 1, 1, r"t\d+_across\[72, 16\]"),  # (its gradient in place)
}


@needs_blas
@pytest.mark.parametrize("kind", list(WEIGHT_GRADIENTS))
def test_generated_weight_gradient_runs_along_the_kernels_dims_or_its_out_channels(kind, rng):
    """A generated weight gradient is a product whose columns are the
    kernel's dims after its output channels (in channels x window,
    flattened), over the input's taps stored with them innermost; or,
    where that copy of the taps would outweigh copies of the gradient (its
    channels innermost) and of the result, a product along whole vectors of
    output channels over the padded input read in place. Either is eager's."""
    xs, gs, stride, pad, dil, form = WEIGHT_GRADIENTS[kind]
    x, g = rng.standard_normal(xs, dtype=F32), rng.standard_normal(gs, dtype=F32)
    nhwc = kind.endswith("NHWC")
    layouts = ("NHWC", "HWIO") if nhwc else ("NCHW", "OIHW")
    args = [a.transpose(0, 2, 3, 1).copy() if nhwc else a for a in (x, g)]
    exe = polyjit.compile(lambda x, g: ops.conv_weight_grad(x, g, [3, 3], [stride] * 2, [(pad, pad)] * 2, [dil] * 2,
                                                            *layouts),
                          [InputInfo(a.shape, F32) for a in args],
                          {"contractions": "generated", "target": "cpu", "cache": False})
    assert re.search(form, exe.ir("affine")), exe.ir("affine")
    assert ("_gT[" in exe.ir("affine")) == (form.find("across") > 0 and not nhwc)  # (NHWC's gradient read in place)
    assert re.search(r"register blocks of \d+ products", exe.ir("mapping"))
    want = torch.nn.grad.conv2d_weight(torch.from_numpy(x), (gs[1], xs[1], 3, 3), torch.from_numpy(g),
                                       stride=stride, padding=pad, dilation=dil).numpy()
    np.testing.assert_allclose(exe(*args), want.transpose(2, 3, 1, 0) if nhwc else want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["library", "generated"])
def test_weight_gradient_is_one_product_over_all_images(mode):
    """A convolution's weight gradient (the images are its contraction, its
    output channels outermost) is one library call (sgemm), or generated, a
    product along the kernel's dims after its output channels, flattened;
    either equals eager's."""
    mod = nn.Conv2d(32, 64, 3, padding=1)
    ref = copy.deepcopy(mod)
    opts = {"num_threads": 2, "strict": True, "contractions": mode}
    jm = polyjit.jit_torch(mod, compile_options=opts)
    x = torch.randn(3, 32, 12, 11)
    out, want = jm(x), ref(x)
    r = torch.randn_like(want)
    (out * r).sum().backward()
    (want * r).sum().backward()
    torch.testing.assert_close(mod.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)
    assert jm.stats["library_calls"] == (2 if mode == "library" else 0)  # the forward and the weight gradient


@pytest.mark.parametrize("k,stride,padding,size", [(3, 2, 1, 14), (3, 2, 1, 13), (1, 2, 0, 14), (7, 2, 3, 23),
                                                   (4, 3, 1, 17)])
def test_strided_input_gradient_multiplies_no_spread_zeros(k, stride, padding, size, rng):
    """A strided convolution's input gradient (a transposed convolution) is a
    convolution of its output's gradient spread with zeros; each phase of
    the result (its positions modulo the stride) is a convolution by a
    strided slice of the kernel instead, at most stride**2 of them, each
    kernel at most ceil(k / stride) taps a side, and the result is eager's."""
    out = (size + 2 * padding - k) // stride + 1
    g, w = rng.standard_normal((2, 6, out, out)).astype(F32), rng.standard_normal((6, 5, k, k)).astype(F32)
    exe = polyjit.compile(lambda g, w: ops.conv_input_grad(g, w, [size, size], [stride, stride],
                                                            [(padding, padding)] * 2),
                          [InputInfo(g.shape, F32), InputInfo(w.shape, F32)], {"contractions": "generated"})
    lines = exe.ir("graph").splitlines()
    shapes = {m.group(1): [int(d) for d in m.group(2).split("x")]
              for m in (re.match(r"(%\d+): \w+\[([\dx]+)\]", line) for line in lines) if m}
    convs = [re.search(r"= conv\(%\d+, (%\d+),.*dilation=\(([\d, ]+)\)", line) for line in lines if "= conv(" in line]
    assert 1 <= len(convs) <= stride ** 2
    assert all(max(shapes[c.group(1)][2:]) <= -(-k // stride) and "0" not in c.group(2).split(", ") for c in convs)
    want = torch.nn.functional.conv_transpose2d(torch.from_numpy(g), torch.from_numpy(w), None, stride, padding,
                                                size - ((out - 1) * stride - 2 * padding + k))
    np.testing.assert_allclose(exe(g, w), want.numpy(), rtol=1e-4, atol=1e-4)


def test_a_reduction_over_taps_of_two_is_scheduled_in_parallel(rng):
    """isl could not carry the update of a 2x2 convolution (a strided input
    gradient's phase) under outer coincidence, and the update ran in its
    domain's order on one thread; alone in its group it is scheduled again
    without it: parallel, in register blocks, and right."""
    x, w = rng.standard_normal((2, 32, 7, 7)).astype(F32), rng.standard_normal((16, 32, 2, 2)).astype(F32)
    exe = polyjit.compile(lambda x, w: ops.conv(x, w, [1, 1], [(0, 0), (0, 0)]),
                          [InputInfo(x.shape, F32), InputInfo(w.shape, F32)], {"contractions": "generated"})
    conv = [line for line in exe.ir("mapping").splitlines() if "_conv_" in line]
    assert conv and all("thread team" in line and "register blocks of 0" not in line for line in conv)
    want = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w)).numpy()
    np.testing.assert_allclose(exe(x, w), want, rtol=1e-4, atol=1e-4)


def test_average_pool_gradient_of_tiling_windows_is_a_broadcast(rng):
    """Windows that tile the image (strides as the window) spread each
    window's gradient as one broadcast, padded over the cells in no window,
    not a pad and an add per window offset; the same values as that."""
    grad = rng.standard_normal((2, 3, 4, 3)).astype(F32)
    args = ([2, 3, 9, 7], [2, 2], [2, 2], [(0, 0), (0, 0)])
    exe = polyjit.compile(lambda g: ops.window_sum_adjoint(g, *args), [InputInfo(grad.shape, F32)])
    graph = exe.ir("graph")
    assert graph.count("broadcast") == 1 and graph.count("pad") == 1, graph
    want = polyjit.compile(lambda g: ops.window_adjoint(lambda offset: g, *args), [InputInfo(grad.shape, F32)])
    np.testing.assert_array_equal(exe(grad), want(grad))


def test_max_pool_gradient_adds_at_positions_and_drops_windows_without_a_cell(rng):
    """A max pool's gradient is added at each window's position (windows may
    share one); a position outside the image (a window wholly in padding,
    which the frameworks never give) adds nowhere rather than out of bounds."""
    pos = rng.integers(0, 64, (2, 3, 4, 4))
    pos[0, 0, 0, 0], pos[1, 2, 3, 3] = -1, 64
    grad = rng.standard_normal((2, 3, 4, 4)).astype(F32)
    exe = polyjit.compile(lambda g, p: ops.max_pool_grad(g, p, [2, 3, 8, 8], [3, 3], [2, 2], [1, 1]),
                          [InputInfo(grad.shape, F32), InputInfo(pos.shape, "int64")])
    assert "scatter" in exe.ir("graph")
    want = np.zeros((2, 3, 64))
    for i in range(2):
        for j in range(3):
            ok = (pos[i, j] >= 0) & (pos[i, j] < 64)
            np.add.at(want[i, j], pos[i, j][ok], grad[i, j][ok])
    np.testing.assert_allclose(exe(grad, pos), want.reshape(2, 3, 8, 8), rtol=1e-6, atol=1e-6)
