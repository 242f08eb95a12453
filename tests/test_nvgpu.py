"""The nvgpu target: PTX generated and checked without a GPU; on a GPU, the
programs run on numpy, PyTorch and JAX arrays and match the references."""
import ctypes
import math
import os
import re
import shutil
import subprocess
import threading

import ml_dtypes
import numpy as np
import pytest

import polyjit
from polyjit import InputInfo, library, ops
from polyjit.errors import CompileOptionError, DeviceError, InputError

import refs

F32 = np.float32
PTX_ONLY = {"target": "nvgpu", "gpu_arch": "sm_90"}


def blur(img):
    bx = (img[:, :, 0:-4] + img[:, :, 1:-3] + img[:, :, 2:-2] + img[:, :, 3:-1] + img[:, :, 4:]) * 0.2
    return (bx[:, 0:-4] + bx[:, 1:-3] + bx[:, 2:-2] + bx[:, 3:-1] + bx[:, 4:]) * 0.2


def blur_ref(x):
    x = x.astype(np.float64)
    bx = (x[:, :, 0:-4] + x[:, :, 1:-3] + x[:, :, 2:-2] + x[:, :, 3:-1] + x[:, :, 4:]) * 0.2
    return (bx[:, 0:-4] + bx[:, 1:-3] + bx[:, 2:-2] + bx[:, 3:-1] + bx[:, 4:]) * 0.2


def layernorm(x, w, b):
    return ops.layer_norm(x, [x.shape[-1]], w, b, 1e-5)


def layernorm_ref(x, w, b):
    x = x.astype(np.float64)
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + 1e-5) * w + b


def softmax_ref(x):
    e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# (name, fn, reference, input shapes)
PROGRAMS = [
    ("blur", blur, blur_ref, lambda n, m: [(3, n + 4, m + 4)]),
    ("cos_sin", lambda x, y: ops.cos(x) + ops.sin(y), lambda x, y: np.cos(x) + np.sin(y),
     lambda n, m: [(n, m), (n, m)]),
    ("layernorm", layernorm, layernorm_ref, lambda n, m: [(n, m), (m,), (m,)]),
    ("softmax", lambda x: ops.softmax(x, -1), softmax_ref, lambda n, m: [(n, m)]),
    ("matmul", ops.matmul, lambda a, b: a.astype(np.float64) @ b, lambda n, m: [(n, 37), (37, m)]),
    ("sum_all", lambda x: ops.sum(x, [0, 1]), lambda x: x.astype(np.float64).sum(), lambda n, m: [(n, m)]),
    ("column_sum", lambda x: ops.sum(x, [0]), lambda x: x.astype(np.float64).sum(0), lambda n, m: [(n, m)]),
    ("nest_column_sum", lambda x: ops.sum(x, [0, 1]), lambda x: x.astype(np.float64).sum((0, 1)),
     lambda n, m: [(3, 2 * n + 60, m)]),  # strips of the inner loop, in each iteration of the outer
    ("row_then_column", lambda x: ops.sum(x * ops.rsqrt(ops.sum(x * x, [-1], True) + 1.0), [0]),
     lambda x: (x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).sum(-1, keepdims=True) + 1)).sum(0),
     lambda n, m: [(n, m)]),  # a layer norm's weight gradient: fusing both sums leaves no parallel loop
]


def _ptxas():
    found = shutil.which("ptxas")
    if found:
        return found
    try:
        import nvidia.cuda_nvcc as nvcc
        path = os.path.join(os.path.dirname(nvcc.__file__), "bin", "ptxas")
        return path if os.path.exists(path) else None
    except ImportError:
        return None


@pytest.mark.parametrize("name,fn,ref,shapes", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_ptx_without_a_gpu(name, fn, ref, shapes, tmp_path):
    exe = polyjit.compile(fn, [InputInfo(s, F32) for s in shapes(8, 8)], PTX_ONLY)
    ptx = exe.ir("ptx")
    assert ".target sm_90" in ptx and ".address_size 64" in ptx
    entries = [ln for ln in ptx.splitlines() if ln.startswith(".visible .entry")]
    assert len(entries) == exe.stats["kernels"] >= 1
    assert all("polyjit_" in e and "_kernel(" in e for e in entries)
    if name == "blur":  # the two stencils in one kernel, blur_x's rolling rows in each thread's registers
        assert len(entries) == 1 and "ld.local" not in ptx and "ld.global.nc" in ptx
    if _ptxas():
        path = tmp_path / f"{name}.ptx"
        path.write_text(ptx)
        subprocess.run([_ptxas(), "-arch=sm_90", str(path), "-o", str(tmp_path / "out.cubin")], check=True)


@pytest.mark.parametrize("inverse", [lambda r: ops.reciprocal(r), lambda r: 1.0 / r], ids=["reciprocal", "division"])
def test_an_nhwc_batch_norm_reads_whole_vectors_and_one_rsqrt(rng, inverse):
    """relu((x - mean) / sqrt(var + eps) * g + b) over NHWC rows (a batch
    norm after a library convolution): in the vector groups every array goes
    as one read-only vector load (x's four elements were four scalar loads,
    each address rebuilt from the grid index with 64-bit divisions; a grid
    this small divides in 32 bits), and the inverse deviation is one
    rsqrt.approx, not a square root and a division, whether the graph has a
    reciprocal or 1 / sqrt (PyTorch's decomposition of batch norm)."""
    def bn(x, mean, var, g, b):
        return ops.maximum((x - mean) * (inverse(ops.sqrt(var + 1e-5)) * g) + b, 0.0)
    shapes = [(2, 6, 6, 16)] + [(16,)] * 4
    exe = polyjit.compile(bn, [InputInfo(s, F32) for s in shapes], PTX_ONLY)
    ptx = exe.ir("ptx")
    assert ptx.count("ld.global.nc.v4.b32") >= 5 and ptx.count("st.global.v4.b32") >= 1, ptx
    assert "rsqrt.approx.f32" in ptx and "div.rn" not in ptx and "rcp.rn" not in ptx and "mul.hi.u64" not in ptx, ptx
    moved = polyjit.compile(lambda x: ops.permute(x, (0, 2, 3, 1)) * 2.0, [InputInfo((2, 3, 6, 10), F32)], PTX_ONLY)
    assert "mul.hi.u32" in moved.ir("ptx") and "mul.hi.u64" not in moved.ir("ptx")  # the grid index, divided
    x = rng.standard_normal(shapes[0]).astype(F32)
    mean, g, b = (rng.standard_normal(16).astype(F32) for _ in range(3))
    var = rng.random(16).astype(F32)
    ref = np.maximum((x - mean) / np.sqrt(var + 1e-5) * g + b, 0.0)
    np.testing.assert_allclose(run_threads_on_cpu(exe, [x, mean, var, g, b])[0], ref, rtol=1e-5, atol=1e-6)
    f64 = polyjit.compile(lambda v: ops.reciprocal(ops.sqrt(v)) + ops.rsqrt(v), [InputInfo((37,), np.float64)],
                          PTX_ONLY)  # (no instruction: a square root and a division)
    v = rng.random(37) + 0.5
    np.testing.assert_allclose(run_threads_on_cpu(f64, [v])[0], 2 / np.sqrt(v), rtol=1e-12)


def test_parallel_loops_map_to_threads():
    exe = polyjit.compile(blur, [InputInfo([3, -1, -1], F32)], PTX_ONLY)
    assert exe.stats["parallel_kernels"] == 1
    name, fn, *_ = next(p for p in PROGRAMS if p[0] == "row_then_column")
    split = polyjit.compile(fn, [InputInfo([256, 512], F32)], PTX_ONLY)
    assert split.stats["parallel_kernels"] == split.stats["kernels"]  # not one kernel on one thread
    assert "%ctaid.x" in exe.ir("ptx") and "%nctaid.x" in exe.ir("ptx")


def test_row_reductions_use_warp_shuffles_and_stencils_use_strips():
    sm = polyjit.compile(lambda x: ops.softmax(x, -1), [InputInfo([-1, -1], F32)], PTX_ONLY)
    assert "shfl.sync.bfly" in sm.ir("ptx")  # a warp per row, not a thread
    long = polyjit.compile(lambda x: ops.softmax(x, -1), [InputInfo([4, 8192], F32)], PTX_ONLY)
    assert "bar.sync" in long.ir("ptx") and ".shared" in long.ir("ptx")  # long rows: a block each
    col = polyjit.compile(lambda x: ops.sum(x, [0]), [InputInfo([-1, -1], F32)], PTX_ONLY)
    assert "shfl.sync" not in col.ir("ptx")  # threads per column walk strips of rows, coalesced,
    assert "atom.global.add.f32" in col.ir("ptx")  # and add their partial sums atomically
    grad = polyjit.compile(lambda x: ops.reshape(ops.sum(x, [0, 1], True), [x.shape[2]]), [InputInfo([64, 128, 32], F32)],
                           PTX_ONLY)  # a bias gradient: sum with keepdim, then reshape
    assert grad.stats["kernels"] == 1 and "atom.global.add.f32" in grad.ir("ptx")
    bl = polyjit.compile(blur, [InputInfo([3, -1, -1], F32)], PTX_ONLY)
    assert "strip" in bl.ir("llvm")  # rows in parallel strips, each recomputing its halo


def _mapping(fn, shapes, **options):
    exe = polyjit.compile(fn, [InputInfo(list(s), F32) for s in shapes], {**PTX_ONLY, **options})
    lines = exe.ir("mapping").splitlines()
    assert len(lines) == exe.stats["kernels"]
    return [line.split(": ", 1)[1] for line in lines]


def test_channel_sums_run_along_rows_first():
    """A sum over NCHW's N, H and W (a batch norm's statistics) sums each
    image's channel as a row first (a block of lanes per row), then the
    images' partial sums: whole, it ran a thread per channel."""
    plans = _mapping(lambda x: ops.sum(x, [0, 2, 3]), [(32, 64, 20, 20)])
    assert any(p.startswith("warp rows: grid c0 x c1") for p in plans), plans
    assert not any(p.startswith(("nest per thread", "one thread")) for p in plans), plans


def test_channels_last_batch_norm_statistics_sum_parts_in_parallel(rng):
    """A batch norm's mean and variance over NHWC's N, H and W (the variance
    reads the mean) sum over W first, in parallel over the images, rows and
    channels, then over H and N: fused whole, the two ran a thread per
    channel over every row."""
    def stats(x):
        mean = ops.mean(x, [0, 1, 2], True)
        return ops.mean((x - mean) * (x - mean), [0, 1, 2])
    plans = _mapping(stats, [(32, 20, 20, 64)])
    assert sum(p.startswith("atomic strips: grid c0 x c1 x c2,") for p in plans) == 2, plans
    assert not any(p.startswith(("nest per thread: grid c0,", "one thread")) for p in plans), plans
    x = rng.standard_normal((8, 16, 16, 16)).astype(F32)
    exe = polyjit.compile(stats, [InputInfo(x.shape, F32)], PTX_ONLY)
    np.testing.assert_allclose(run_threads_on_cpu(exe, [x])[0], x.astype(np.float64).var((0, 1, 2)), rtol=1e-5)


def test_a_layer_norms_weight_and_bias_gradients_share_a_kernel(rng):
    """A layer norm's weight and bias gradients, column sums over the same
    rows of one gradient (two summed, as a transformer's residual gives
    it): one kernel whose threads add both sums, reading the gradient once,
    where isl gave each sum a kernel of its own."""
    def grads(g1, g2, x, mean, rstd):
        dy = g1 + g2  # (and a bias gradient beside them, over the rows flattened: a nest of its own)
        return ops.sum(dy * ((x - mean) * rstd), [0, 1]), ops.sum(dy, [0, 1]), ops.sum(ops.reshape(g1, [128, 64]), [0])
    shapes = [(4, 32, 64)] * 3 + [(4, 32, 1)] * 2
    plans = _mapping(grads, shapes)
    assert "atomic strips: grid c0, strips of 64 iterations of c2 in each iteration of c1, 2 sums added " \
           "atomically, 2 arrays zeroed first" in plans and len(plans) == 2, plans
    args = [rng.standard_normal(s).astype(F32) for s in shapes]
    exe = polyjit.compile(grads, [InputInfo(s, F32) for s in shapes], PTX_ONLY)
    g1, g2, x, mean, rstd = (a.astype(np.float64) for a in args)
    want = ((g1 + g2) * (x - mean) * rstd).sum((0, 1)), (g1 + g2).sum((0, 1)), g1.sum((0, 1))
    for got, ref in zip(run_threads_on_cpu(exe, args), want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_a_training_layer_norms_forward_is_one_pass_over_each_row():
    """A layer norm's forward as a training graph has it (the summed input,
    the mean and the inverse deviation saved beside the output): one warp
    per row, where counting its sums' zeroings against the run's size cut
    off the inverse deviation and the output, two more kernels that read
    the rows again."""
    def forward(x, bias, res, w, b):
        y = x + bias + res
        mean = ops.mean(y, [2], keepdim=True)
        rstd = ops.rsqrt(ops.mean((y - mean) * (y - mean), [2], keepdim=True) + 1e-5)
        return (y - mean) * rstd * w + b, y, mean, rstd
    plans = _mapping(forward, [(8, 16, 256), (256,), (8, 16, 256), (256,), (256,)])
    assert plans == ["warp rows: grid c0 x c1, 32 lanes, 3 lane loops (3 in groups of 4, 3 unrolled), "
                     "2 reductions"], plans


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("columns,lanes", [(256, 32), (4096, 256)])
def test_a_layer_norms_centred_row_stays_in_its_lanes(columns, lanes, aligned, rng):
    """An inference layer norm of a residual stream summed from its parts
    (GPT-2's): the centred row, read for the variance and again for the
    result, stays in the registers of the lanes that computed it, where it
    went to a temporary array and back. Thread by thread on the CPU, in
    16-byte groups and, on inputs not aligned to them, element by element."""
    def norm(a, b, c, w, bias):
        x = a + b + c
        d = x - ops.mean(x, [1], keepdim=True)
        return d * ops.rsqrt(ops.mean(d * d, [1], keepdim=True) + 1e-5) * w + bias
    shapes = [(5 if lanes == 32 else 3, columns)] * 3 + [(columns,)] * 2
    exe = polyjit.compile(norm, [InputInfo(s, F32) for s in shapes], PTX_ONLY)
    assert exe.ir("mapping").splitlines() == [f"polyjit_norm_sum_sub_add_0_kernel: warp rows: grid c0, {lanes} lanes, 3 "
                                              "lane loops (3 in groups of 4, 3 unrolled), 2 reductions, 1 row in registers"]
    assert not [b for b in exe.compile_default().buffers if b.kind == "temp"]
    args = []
    for s in shapes:  # (one element past an aligned start: no group is aligned)
        buf = np.empty(math.prod(s) + 1, F32)
        args.append(buf[0 if aligned else 1:][:math.prod(s)].reshape(s))
        args[-1][...] = rng.standard_normal(s)
    x = sum(a.astype(np.float64) for a in args[:3])
    d = x - x.mean(1, keepdims=True)
    want = d / np.sqrt((d * d).mean(1, keepdims=True) + 1e-5) * args[3] + args[4]
    np.testing.assert_allclose(run_threads_on_cpu(exe, args, block=max(64, lanes))[0], want, rtol=1e-5, atol=1e-5)


def test_a_small_batch_pooled_mean_keeps_its_images_parallel(rng, monkeypatch):
    """A convolution, its batch norm folded in (the scale into the weights,
    the shift a per-channel statement), relu, 2x2 average pooling and the
    mean over the pooled image (flax's CNN head, 8 images): fused whole
    with the per-channel statement, the sums ran a thread per channel (64
    threads, where alone they have 8 times as many and their strips more)."""
    from polyjit.targets.nvgpu import NvgpuTarget
    monkeypatch.setattr(NvgpuTarget, "library_available", lambda self: True)
    monkeypatch.setattr(NvgpuTarget, "direct_convolutions", lambda self: True)

    def head(x, w, cb, mean, var, g, b):
        y = ops.conv(x, w, [1, 1], [[1, 1], [1, 1]], [1, 1], 1, "NHWC", "HWIO") + cb
        y = ops.maximum((y - mean) * (ops.rsqrt(var + 1e-5) * g) + b, 0.0)
        pooled = ops.reduce_window("sum", y, [1, 2, 2, 1], [1, 2, 2, 1]) / 4.0
        return ops.mean(pooled, [1, 2])
    plans = _mapping(head, [(8, 16, 16, 32), (3, 3, 32, 64)] + [(64,)] * 5, contractions="library", tf32=True)
    assert any(p.startswith("library: convolution") for p in plans), plans
    assert "nest per thread: grid c0" not in [p.split(",")[0] for p in plans], plans


def test_padded_windows_of_a_layer_norm_keep_the_device_busy():
    """Swin's windows pad a layer norm's output, reading its variance at
    clamped rows: fused with the variance's sum, only the images made the
    grid (a thread each over 4x14x14x384 elements, 8.5 ms of a 14 ms
    forward); each part in its own kernel, every part keeps its rows."""
    def windows(x, w, b):
        return ops.pad(ops.layer_norm(x, [384], w, b), [0, 0, 0, 6, 0, 6])
    plans = _mapping(windows, [(4, 8, 8, 384), (384,), (384,)])
    assert not any(p.startswith(("nest per thread", "one thread")) for p in plans), plans
    assert any(p.startswith("warp rows: grid c0 x c1 x c2,") for p in plans), plans


def test_a_class_tokens_layer_norm_takes_a_warp_per_row():
    """A ViT's last layer norm, read for the class token alone: isl guards
    the normalized row (token 0) after the statistics of every token.
    The guard depends on the grid's iterators alone, so the row's lanes
    share it, rather than each thread walking a row of its own in turn
    (torchvision's vit_b_16 ran slower than eager on a GPU)."""
    def head(x, r, w, b):
        return ops.layer_norm(x + r, [768], w, b, 1e-6)[:, 0]
    plans = _mapping(head, [(8, 65, 768), (8, 65, 768), (768,), (768,)])
    assert plans[0].startswith("warp rows: grid c0 x c1, 32 lanes, 3 lane loops"), plans
    exe = polyjit.compile(head, [InputInfo(s, F32) for s in [(8, 65, 768), (8, 65, 768), (768,), (768,)]], PTX_ONLY)
    assert "shfl.sync.bfly" in exe.ir("ptx")


def _norm_and_class_token(x, r, w, b):
    y = ops.layer_norm(x + r, [768], w, b, 1e-12)
    return y, y[:, 0]


CLASS_TOKEN_SHAPES = [(4, 65, 768), (4, 65, 768), (768,), (768,)]


def test_a_layer_norm_and_its_class_token_take_a_warp_per_row():
    """BERT's last layer norm, its whole output and the class token's row
    (the pooler's input): the copy of token 0 is in the output's lane loop,
    under a guard on the grid's iterators, and reads the row where the
    output wrote it. It ran a thread per row, a third of BERT's forward on
    an H200."""
    assert _mapping(_norm_and_class_token, CLASS_TOKEN_SHAPES) == [
        "warp rows: grid c0 x c1, 32 lanes, 3 lane loops (3 in groups of 4, 3 unrolled), 2 reductions"]


@pytest.mark.gpu
def test_a_layer_norm_and_its_class_token_on_the_gpu(rng):
    x, r, w, b = (rng.standard_normal(s).astype(F32) for s in CLASS_TOKEN_SHAPES)
    y, cls = polyjit.compile(_norm_and_class_token, [InputInfo(s, F32) for s in CLASS_TOKEN_SHAPES],
                             {"target": "nvgpu"})(x, r, w, b)
    z = (x + r).astype(np.float64)
    want = (z - z.mean(-1, keepdims=True)) / np.sqrt(z.var(-1, keepdims=True) + 1e-12) * w + b
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cls, y[:, 0])


def test_a_library_convolutions_batch_norm_stays_in_its_epilogue(rng, monkeypatch):
    """On the GPU a batch norm after a library convolution is not folded into
    weights passed at each call (three weight kernels a convolution, where
    the pass over the result that the shift needs takes the scale too);
    constant weights still fold, at compile time. The host folds both."""
    from polyjit.targets.nvgpu import NvgpuTarget
    monkeypatch.setattr(NvgpuTarget, "library_available", lambda self: True)
    monkeypatch.setattr(NvgpuTarget, "direct_convolutions", lambda self: True)
    w, stats = rng.standard_normal((3, 3, 8, 16), dtype=F32), rng.random((4, 16), dtype=F32) + 0.5

    def bn(y, mean, var, g, b):
        return ops.maximum((y - mean) * (ops.rsqrt(var + 1e-5) * g) + b, 0.0)

    def passed(x, w, mean, var, g, b):
        return bn(ops.conv(x, w, [1, 1], [[1, 1], [1, 1]], [1, 1], 1, "NHWC", "HWIO"), mean, var, g, b)

    def constant(x):
        mean, var, g, b = stats
        y = ops.conv(x, w, [1, 1], [[1, 1], [1, 1]], [1, 1], 1, "NHWC", "HWIO")
        return ops.maximum((y - mean) * (g / np.sqrt(var + 1e-5)) + b, 0.0)
    shapes = [(4, 12, 12, 8), w.shape] + [(16,)] * 4
    infos = [InputInfo(s, F32) for s in shapes]
    options = {**PTX_ONLY, "contractions": "library", "tf32": True}
    assert polyjit.compile(passed, infos, options).stats["folded"] == 0
    assert polyjit.compile(constant, infos[:1], options).stats["folded"] == 1
    assert polyjit.compile(passed, infos, {"contractions": "library"}).stats["folded"] == 1


def test_mapping_stage_names_each_kernels_form(tmp_path, monkeypatch):
    """The mapping stage, decided before emission, prints a line per kernel:
    its name, its form and the form's parameters."""
    rows = _mapping(layernorm, [(64, 1024), (1024,), (1024,)])
    assert rows == ["warp rows: grid c0, 32 lanes, 3 lane loops (3 in groups of 4, 3 unrolled), 2 reductions"]
    assert _mapping(lambda x: ops.softmax(x, -1), [(4, 8192)])[0].startswith("warp rows: grid c0, 256 lanes")
    mm = _mapping(ops.matmul, [(70, 33), (33, 130)], contractions="generated")
    assert mm[-1] == ("tiled contraction: grid c0 x c1, tiles 64x64 of c0 x c1, k slices of 16 over 1 reduction loop, "
                      "2 stages copied asynchronously, 3xTF32 tensor cores")
    assert _mapping(ops.matmul, [(64, 64), (64, 64)], contractions="generated", tile_sizes=[32, 8])[-1] \
        .startswith("tiled contraction: grid c0 x c1, tiles 32x32 of c0 x c1, k slices of 8")
    for arch, mma in [("sm_75", False), ("sm_80", True), ("sm_90a", True)]:  # TF32 mma.sync from sm_80
        assert _mapping(ops.matmul, [(70, 33), (33, 130)], contractions="generated", gpu_arch=arch)[-1] \
            .endswith("2 stages copied asynchronously, 3xTF32 tensor cores") == mma
    pointwise = _mapping(lambda x: ops.exp(x) * 2.0, [(37, 44)])
    assert pointwise == ["point per thread: grid c0 x c1, groups of 4 where aligned (2 accesses), stores deferred"]
    assert _mapping(lambda x: ops.sum(x, [0]), [(4096, 64)])[0].startswith(
        "atomic strips: grid c0, strips of 64 iterations of c1, 1 sum added atomically, 1 array zeroed first")
    assert _mapping(lambda x: ops.sum(x, [0, 1]), [(16, 256, 64)])[0].startswith(  # a nest: its inner loop in strips
        "atomic strips: grid c0, strips of 64 iterations of c2 in each iteration of c1, 1 sum added atomically")
    assert _mapping(blur, [(3, 68, 68)])[0].startswith("halo strips: grid c0 x c1, strips of 64 iterations of c2")
    assert "nest per thread" in _mapping(lambda x: ops.softmax(x, -1), [(8, 8)])[0]
    exe = polyjit.compile(blur, [InputInfo([3, 12, 12], F32)], {**PTX_ONLY, "debug": True, "dump_dir": str(tmp_path)})
    dumped = [f for d in tmp_path.iterdir() for f in d.iterdir() if f.name.endswith("_mapping.txt")]
    assert len(dumped) == 1 and dumped[0].read_text() == exe.ir("mapping") + "\n"
    from polyjit.codegen import gpu_program
    monkeypatch.setattr(gpu_program, "build_program", lambda *args: None)  # the program emitted whole
    assert _mapping(ops.matmul, [(70, 33), (33, 130)], contractions="generated") == mm



def _sim_mma() -> str:
    """mma.m16n8k8.row.col.tf32 for run_threads_on_cpu: each lane posts its
    fragments to its warp's table (@sim_xchg, the warp of its thread id),
    waits at its warp's barrier (@sim_bar, pthread barriers of 32 that
    _on_host sets up), sums its four elements of A (16 x 8) x B (8 x 8)
    from the table, inputs cut to TF32, in float64, and waits again."""
    out = ["define {float, float, float, float} @sim_mma_m16n8k8_row_col_tf32(i32 %a0, i32 %a1, i32 %a2, i32 %a3, "
           "i32 %b0, i32 %b1, float %c0, float %c1, float %c2, float %c3) {",
           "  %tid = call i32 @sim_tid_x()", "  %w = lshr i32 %tid, 5", "  %l = and i32 %tid, 31",
           "  %g = lshr i32 %l, 2", "  %t = and i32 %l, 3", "  %t2 = shl i32 %t, 1", "  %g4 = shl i32 %g, 2",
           "  %bar = getelementptr [8 x [64 x i8]], ptr @sim_bar, i32 0, i32 %w"]
    for q, x in enumerate(["a0", "a1", "a2", "a3", "b0", "b1"]):
        out.append(f"  %in{q} = getelementptr [8 x [32 x [10 x i32]]], ptr @sim_xchg, i32 0, i32 %w, i32 %l, i32 {q}")
        out.append(f"  store i32 %{x}, ptr %in{q}")
    out.append("  %arrive = call i32 @pthread_barrier_wait(ptr %bar)")
    for o in range(4):  # C[g + 8 (o // 2), 2t + o % 2]
        out += [f"  %cd{o} = fpext float %c{o} to double", f"  %n{o} = add i32 %t2, {o % 2}", f"  %nl{o} = shl i32 %n{o}, 2"]
        acc = f"%cd{o}"
        for k in range(8):
            v = f"{o}_{k}"
            out += [f"  %al{v} = add i32 %g4, {k % 4}", f"  %bl{v} = add i32 %nl{o}, {k % 4}",
                    f"  %ap{v} = getelementptr [8 x [32 x [10 x i32]]], ptr @sim_xchg, i32 0, i32 %w, i32 %al{v}, "
                    f"i32 {o // 2 + 2 * (k // 4)}",
                    f"  %bp{v} = getelementptr [8 x [32 x [10 x i32]]], ptr @sim_xchg, i32 0, i32 %w, i32 %bl{v}, "
                    f"i32 {4 + k // 4}"]
            for x in "ab":
                out += [f"  %{x}i{v} = load i32, ptr %{x}p{v}", f"  %{x}m{v} = and i32 %{x}i{v}, -8192",
                        f"  %{x}f{v} = bitcast i32 %{x}m{v} to float", f"  %{x}d{v} = fpext float %{x}f{v} to double"]
            out += [f"  %p{v} = fmul double %ad{v}, %bd{v}", f"  %s{v} = fadd double {acc}, %p{v}"]
            acc = f"%s{v}"
        out.append(f"  %d{o} = fptrunc double {acc} to float")
    out.append("  %leave = call i32 @pthread_barrier_wait(ptr %bar)")
    out.append("  %r0 = insertvalue {float, float, float, float} undef, float %d0, 0")
    out += [f"  %r{q} = insertvalue {{float, float, float, float}} %r{q - 1}, float %d{q}, {q}" for q in (1, 2, 3)]
    out += ["  ret {float, float, float, float} %r3", "}"]
    return "\n" + "\n".join(out) + "\n"


_SIM_MMA = _sim_mma()

# A warp's exchange table and barrier (pthread barriers of 32 that _on_host
# sets up), for the simulations of warp-wide instructions; once per module.
_SIM_WARP = ("\ndeclare i32 @pthread_barrier_wait(ptr)\n"
             "@sim_bar = global [8 x [64 x i8]] zeroinitializer, align 16\n"
             "@sim_xchg = global [8 x [32 x [10 x i32]]] zeroinitializer, align 16\n")

# shfl.sync.bfly: each lane posts its value, the warp meets, each reads lane ^ mask's, the warp meets again
_SIM_SHFL = """
define i32 @sim_shfl_sync_bfly_i32(i32 %m, i32 %x, i32 %mask, i32 %c) {
  %tid = call i32 @sim_tid_x()
  %w = lshr i32 %tid, 5
  %l = and i32 %tid, 31
  %bar = getelementptr [8 x [64 x i8]], ptr @sim_bar, i32 0, i32 %w
  %mine = getelementptr [8 x [32 x [10 x i32]]], ptr @sim_xchg, i32 0, i32 %w, i32 %l, i32 0
  store i32 %x, ptr %mine
  %arrive = call i32 @pthread_barrier_wait(ptr %bar)
  %o = xor i32 %l, %mask
  %theirs = getelementptr [8 x [32 x [10 x i32]]], ptr @sim_xchg, i32 0, i32 %w, i32 %o, i32 0
  %v = load i32, ptr %theirs
  %leave = call i32 @pthread_barrier_wait(ptr %bar)
  ret i32 %v
}
"""

_SIM_WARP_SYNC = """
define void @sim_bar_warp_sync(i32 %m) {
  %tid = call i32 @sim_tid_x()
  %w = lshr i32 %tid, 5
  %bar = getelementptr [8 x [64 x i8]], ptr @sim_bar, i32 0, i32 %w
  %arrive = call i32 @pthread_barrier_wait(ptr %bar)
  ret void
}
"""

_SIM_MATH = {
    "ex2.approx.f": "\ndeclare float @llvm.exp2.f32(float)\n"
                    "define float @sim_ex2_approx_f(float %x) {\n  %r = call float @llvm.exp2.f32(float %x)\n  ret float %r\n}\n",
    "ex2.approx.f32": "\ndeclare float @llvm.exp2.f32(float)\n"  # (the name LLVM gives it on reading the IR back)
                      "define float @sim_ex2_approx_f32(float %x) {\n  %r = call float @llvm.exp2.f32(float %x)\n"
                      "  ret float %r\n}\n",
    "div.approx.f": "\ndefine float @sim_div_approx_f(float %p, float %q) {\n  %r = fdiv float %p, %q\n  ret float %r\n}\n",
    "mma.m16n8k8.row.col.tf32": _SIM_MMA,
    "shfl.sync.bfly.i32": _SIM_SHFL,
    "bar.warp.sync": _SIM_WARP_SYNC,
    "cp.async.ca.shared.global.4.s": "\ndefine void @sim_cp_async_ca_shared_global_4_s(ptr %d, ptr %s, i32 %n) {\n"
                                     "  %inside = icmp eq i32 %n, 4\n  br i1 %inside, label %copy, label %zero\n"
                                     "copy:\n  %v = load i32, ptr %s\n  store i32 %v, ptr %d\n  ret void\n"
                                     "zero:\n  store i32 0, ptr %d\n  ret void\n}\n",
    "cp.async.commit.group": "\ndefine void @sim_cp_async_commit_group() {\n  ret void\n}\n",
    "cp.async.wait.group": "\ndefine void @sim_cp_async_wait_group(i32 %n) {\n  ret void\n}\n",
    "rsqrt.approx.f": "\ndeclare float @llvm.sqrt.f32(float)\n"
                      "define float @sim_rsqrt_approx_f(float %x) {\n  %s = call float @llvm.sqrt.f32(float %x)\n"
                      "  %r = fdiv float 1.0, %s\n  ret float %r\n}\n",
}


def _on_host(text: str, local) -> tuple:
    """(an MCJIT engine, the IR it runs, the callbacks it calls, to be kept
    alive with it): nvgpu kernels' LLVM IR made to run on the CPU, their
    thread and block ids read from ``local`` (tid, ctaid, ntid, nctaid;
    barrier: a threading.Barrier)."""
    import ctypes

    import llvmlite.binding as llvm

    from polyjit.codegen.cpu import target_machine, _llvm
    ir = text.replace('target triple = "nvptx64-nvidia-cuda"', "").replace("define ptx_kernel", "define")
    ir = ir.replace(" addrspace(3)", "").replace(" addrspace(1)", "").replace("addrspacecast", "bitcast")
    i32 = ctypes.CFUNCTYPE(ctypes.c_int32)
    hooks = {"sim_tid_x": i32(lambda: local.tid), "sim_ctaid_x": i32(lambda: local.ctaid),
             "sim_ntid_x": i32(lambda: local.ntid), "sim_nctaid_x": i32(lambda: local.nctaid),
             "sim_barrier": ctypes.CFUNCTYPE(None)(lambda: local.barrier.wait())}
    ir = re.sub(r'@"(llvm\.nvvm\.[\w.]+)"', r"@\1", ir)  # (as llvmlite quotes them, or LLVM does not)
    for r in ("tid.x", "ctaid.x", "ntid.x", "nctaid.x"):
        ir = re.sub(rf"@llvm\.nvvm\.read\.ptx\.sreg\.{re.escape(r)}\b", "@sim_" + r.replace(".", "_"), ir)
    ir = re.sub(r"@llvm\.nvvm\.barrier0\b", "@sim_barrier", ir)
    ir = re.sub(r"@llvm\.nvvm\.barrier\.cta\.sync\.aligned\.all\(i32( 0)?\)", "@sim_barrier()", ir)  # (LLVM's name)
    for name, body in _SIM_MATH.items():  # the special function unit's approximations, as exact math
        if f"@llvm.nvvm.{name}(" in ir:
            ir = re.sub(rf"declare [^\n]*@llvm\.nvvm\.{re.escape(name)}\([^\n]*\n", "", ir)
            ir = ir.replace(f"@llvm.nvvm.{name}(", f"@sim_{name.replace('.', '_')}(") + body
    if "@sim_xchg" in ir or "@sim_bar," in ir:
        ir += _SIM_WARP
    kept, declared = [], set()
    for line in ir.split("\n"):  # (a declaration the simulations repeat, once)
        if line.startswith("declare "):
            if line in declared:
                continue
            declared.add(line)
        kept.append(line)
    ir = "\n".join(kept)
    assert "llvm.nvvm" not in ir, "warp intrinsics cannot run on the CPU"
    _llvm()
    for name, hook in hooks.items():
        llvm.add_symbol(name, ctypes.cast(hook, ctypes.c_void_p).value)
    tm = target_machine()
    mod = llvm.parse_assembly(ir)
    mod.triple = tm.triple
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    if "@sim_xchg" in ir:  # (warp barriers of 32 threads, for mma products)
        libc = ctypes.CDLL(None)
        for w in range(8):
            libc.pthread_barrier_init(ctypes.c_void_p(engine.get_global_value_address("sim_bar") + 64 * w), None, 32)
    return engine, ir, hooks


def run_threads_on_cpu(exe, arrays, grid=3, block=64):
    """Run an nvgpu program's kernels on the CPU to check the generated code
    without a GPU: blocks one after another; a block's threads one after
    another, or, for kernels with barriers, all at once as OS threads that
    meet at a threading.Barrier. Thread and block ids come from callbacks;
    shared memory is ordinary memory; a warp's shuffles and barriers meet
    its 32 threads at a barrier of their own."""
    import ctypes
    import threading

    from polyjit import sizes as sz

    prog = exe.compile_default()
    local = threading.local()
    engine, ir, hooks = _on_host(prog.ir["llvm"], local)
    env = prog.bind(arrays)
    bufs = {spec.name: np.ascontiguousarray(a) for spec, a in zip(prog.inputs, arrays)}
    for spec in prog.buffers:
        if spec.kind in ("output", "temp"):
            bufs[spec.name] = np.full([sz.evaluate(x, env) for x in spec.shape], np.nan, spec.dtype.numpy)
        elif spec.kind == "const":
            bufs[spec.name] = np.ascontiguousarray(prog.constants[spec.index])
    ints = [env[n] if d < 0 else int(np.prod(bufs[n].shape[d + 1:])) for n, d in prog.int_slots]
    args = [bufs[b.name].ctypes.data for b in prog.buffers] + ints
    together = "@sim_barrier" in ir or "@sim_bar " in ir  # (block or warp barriers: threads run at once)
    slots = {b.name: i for i, b in enumerate(prog.buffers)}
    for k in prog.kernels:
        if k.library is not None:  # a library step, cuBLAS's patched to one on host memory, cuDNN's in numpy
            from polyjit.runtime.cublas import GemmStep, cublas
            from polyjit.library import Convolution
            if isinstance(k.library.library, Convolution):
                _host_convolution(k.library.library, bufs)
            else:
                GemmStep(cublas(), None, k.library, env, {b.name: b for b in prog.buffers}, slots).run(args, 0)
            continue
        for a in k.zeroed:
            bufs[a][...] = 0
        taken = k.params if k.params is not None else range(len(args))  # the arguments its entry takes
        fn = ctypes.CFUNCTYPE(None, *(ctypes.c_void_p if p < len(prog.buffers) else ctypes.c_int64 for p in taken))(
            engine.get_function_address(k.name))
        blocks, threads = (grid, block) if k.parallel else (1, 1)
        kernel_args = [args[p] for p in taken]

        def thread(c, t, barrier=None):
            local.tid, local.ctaid, local.ntid, local.nctaid, local.barrier = t, c, threads, blocks, barrier
            fn(*kernel_args)
        for c in range(blocks):
            if together:
                barrier = threading.Barrier(threads)
                team = [threading.Thread(target=thread, args=(c, t, barrier)) for t in range(threads)]
                for th in team:
                    th.start()
                for th in team:
                    th.join()
            else:
                for t in range(threads):
                    thread(c, t)
    return [bufs[n] for n in prog.output_arrays]


THREAD_FORMS = ["blur", "cos_sin", "layernorm", "softmax", "matmul", "sum_all", "column_sum",
                "nest_column_sum"]  # strips, grid loop, warp rows, sums


@pytest.mark.parametrize("name,fn,ref,shapes", [p for p in PROGRAMS if p[0] in THREAD_FORMS],
                         ids=THREAD_FORMS)
def test_kernels_run_thread_by_thread_on_the_cpu(name, fn, ref, shapes, rng):
    arrays = [rng.standard_normal(s).astype(F32) for s in shapes(37, 41)]
    exe = polyjit.compile(fn, [InputInfo(a.shape, F32) for a in arrays], PTX_ONLY)
    got = run_threads_on_cpu(exe, arrays, block=256 if name == "matmul" else 64)[0]  # tiles need whole blocks
    np.testing.assert_allclose(got, ref(*arrays), rtol=1e-4, atol=1e-4)


def test_elementwise_loops_use_vector_accesses():
    cs = polyjit.compile(lambda x: ops.cos(x) + ops.sin(x), [InputInfo([-1, -1], F32)], PTX_ONLY).ir("ptx")
    assert "ld.global.nc.v4.b32" in cs and "st.global.v4.b32" in cs  # 16-byte groups where aligned
    assert "ld.global.nc.b32" in cs  # and one element at a time where not
    sm = polyjit.compile(lambda x: ops.softmax(x, -1), [InputInfo([-1, -1], F32)], PTX_ONLY).ir("ptx")
    assert sm.count("ld.global.nc.v4.b32") == 3  # each pass over a row
    rows = polyjit.compile(lambda x: ops.softmax(x, -1), [InputInfo([4, 8192], F32)], PTX_ONLY).ir("ptx")
    assert rows.count("ld.global.nc.v4.b32") == 8192 // 256 // 4  # a lane's share of a row, loaded once for 3 passes


def test_column_strips_are_shorter_where_the_device_would_idle():
    """A bias gradient's column sum (768 columns of 4096 rows) runs strips
    of 16 rows, four times the threads of 64-row strips; 8192 columns keep
    64 (the grid alone nearly fills the device), as do 64 columns (a batch
    norm's channels: more atomics on each) and sums with sizes known only
    at run time."""
    def strips(shape):
        plans = _mapping(lambda x: ops.sum(x, [0]), [shape])
        return [int(re.search(r"strips of (\d+)", p).group(1)) for p in plans if "atomic strips" in p]
    assert strips((4096, 768)) == [16]
    assert strips((4096, 8192)) == [64] and strips((4096, 64)) == [64]
    plans = _mapping(lambda x: ops.sum(x, [0]), [(-1, 768)])
    assert any("atomic strips" in p and "strips of 64" in p for p in plans), plans


def test_a_vector_groups_stores_are_vector_stores(rng):
    """A group's four stores go as one 16-byte store, as its loads do (a
    bias and an erf: LLVM merged the loads only, and a warp's scalar stores
    wrote every fourth element); the results are the same."""
    x, b = rng.standard_normal((32, 64)).astype(F32), rng.standard_normal(64).astype(F32)
    exe = polyjit.compile(lambda x, b: ops.erf(ops.reshape(x, [4, 8, 64]) + b), [InputInfo(x.shape, F32),
                                                                                InputInfo(b.shape, F32)], PTX_ONLY)
    ptx = exe.ir("ptx")
    assert ptx.count("ld.global.nc.v4.b32") >= 2 and ptx.count("st.global.v4.b32") >= 2, ptx
    want = polyjit.compile(lambda x, b: ops.erf(ops.reshape(x, [4, 8, 64]) + b),
                           [InputInfo(x.shape, F32), InputInfo(b.shape, F32)], {"target": "cpu"})(x, b)
    np.testing.assert_allclose(run_threads_on_cpu(exe, [x, b])[0], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape,offset", [((37, 44), 0), ((37, 44), 1), ((5, 8), 2), ((3, 6), 0)])
def test_vector_groups_thread_by_thread(shape, offset, rng):
    """Groups of four iterations where the rows are aligned (offset 0), one
    at a time where an input starts off a 16-byte boundary or rows are not a
    multiple of four long; with a row-broadcast, column-broadcast and
    elementwise access in one statement."""
    n, m = shape
    buf = rng.standard_normal(n * m + offset).astype(F32)
    x, b, c = buf[offset:].reshape(n, m), rng.standard_normal(m).astype(F32), rng.standard_normal((n, 1)).astype(F32)
    exe = polyjit.compile(lambda x, b, c: ops.cos(x) * b + c, [InputInfo(a.shape, F32) for a in (x, b, c)], PTX_ONLY)
    assert "vector.grouped" in exe.ir("llvm")  # both paths are there; the check at run time picks one
    got = run_threads_on_cpu(exe, [x, b, c])[0]
    np.testing.assert_allclose(got, np.cos(x) * b + c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m,k,n,transposed,arch", [(70, 33, 130, "", "sm_75"), (5, 37, 200, "b", "sm_75"),
                                                    (64, 40, 64, "", "sm_75"), (70, 33, 130, "a", "sm_75"),
                                                    (40, 20, 70, "ab", "sm_75"), (70, 33, 130, "", "sm_90"),
                                                    (40, 20, 70, "ab", "sm_90")])
def test_tiled_matmul_thread_by_thread(m, k, n, transposed, arch, rng):
    """C = A @ B as tiles of C staged through shared memory: several tiles per
    block (a grid of 2), edges that are not multiples of the tile, A or B read
    transposed (their lanes then stage along the other dimension); run with
    each block's 256 threads meeting at its barriers. FMAs on sm_75, 3xTF32
    mma products on sm_90 (their warps' fragments simulated)."""
    a = rng.standard_normal((k, m) if "a" in transposed else (m, k)).astype(F32)
    b = rng.standard_normal((n, k) if "b" in transposed else (k, n)).astype(F32)
    t = lambda x, flip: ops.transpose(x, 0, 1) if flip else x  # noqa: E731
    exe = polyjit.compile(lambda x, y: ops.matmul(t(x, "a" in transposed), t(y, "b" in transposed)),
                          [InputInfo(a.shape, F32), InputInfo(b.shape, F32)], {**PTX_ONLY, "gpu_arch": arch})
    ptx = exe.ir("ptx")
    assert "bar.sync" in ptx and "ld.shared" in ptx and ("mma.sync" in ptx) == (arch == "sm_90")
    got = run_threads_on_cpu(exe, [a, b], grid=2, block=256)[0]
    want = (a.T if "a" in transposed else a).astype(np.float64) @ (b.T if "b" in transposed else b)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_tensor_core_products_propagate_inf_and_nan_thread_by_thread(rng):
    """Infinities and NaN through 3xTF32 mma products as through float32
    FMAs: an infinite factor times a finite one (exact in TF32, its small
    part 0) stays infinite, times 0 is NaN, and inf - inf is NaN."""
    a = rng.standard_normal((37, 20)).astype(F32)
    b = rng.standard_normal((20, 33)).astype(F32)
    a[3, 5], a[7, 2], a[9, 0] = np.inf, -np.inf, np.nan
    b[5] = 1.0  # (no TF32 rest)
    b[5, 4], b[2, 10], b[6, 20] = 0.0, np.inf, np.inf
    a[12, 6] = -1e30  # (row 12, column 20: -inf + a finite rest)
    exe = polyjit.compile(ops.matmul, [InputInfo(a.shape, F32), InputInfo(b.shape, F32)],
                          {**PTX_ONLY, "tile_sizes": [32, 8]})
    assert "mma.sync" in exe.ir("ptx")
    with np.errstate(invalid="ignore", over="ignore"):
        want = a.astype(np.float64) @ b.astype(np.float64)
    got = run_threads_on_cpu(exe, [a, b], grid=2, block=256)[0]
    assert np.isinf(want).sum() > 30 and np.isnan(want).sum() > 30
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("tiles", [[128], [32, 8], [128, 32]])
def test_tile_sizes_option_thread_by_thread(tiles, rng):
    """tile_sizes picks the contraction tile (a warp's 4 x 4 mma products at
    128, 1 at 32) and the staged slice; edges not tile multiples."""
    a, b = rng.standard_normal((150, 37)).astype(F32), rng.standard_normal((37, 133)).astype(F32)
    exe = polyjit.compile(ops.matmul, [InputInfo(a.shape, F32), InputInfo(b.shape, F32)],
                          {**PTX_ONLY, "tile_sizes": tiles})
    side, depth = tiles[0], (tiles[1:] or [16])[0]
    stages = 2 if 4 * (side + 8) * depth * 2 * 2 <= 48 * 1024 else 1  # (the slices copied asynchronously)
    name = f"polyjit_mma_a{side}x{depth}{'x2' if stages > 1 else ''}"
    assert f".shared .align 16 .b8 {name}[{4 * (side + 8) * depth * stages}]" in exe.ir("ptx")
    assert ("cp.async" in exe.ir("ptx")) == (stages > 1)
    got = run_threads_on_cpu(exe, [a, b], grid=2, block=256)[0]
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def test_contraction_tiles_follow_the_device(monkeypatch):
    """128 x 128 tiles where i and j are that long and there is a tile for each
    multiprocessor; 64 x 64 for smaller products and where i is short (a
    convolution over 64-wide images)."""
    from polyjit.targets import nvgpu
    monkeypatch.setattr(nvgpu, "_multiprocessors", lambda: 132)

    def tile_of(fn, *shapes):  # generated code (where cuBLAS loads, auto would call it)
        ptx = polyjit.compile(fn, [InputInfo(list(s), F32) for s in shapes],
                              {**PTX_ONLY, "contractions": "generated"}).ir("ptx")
        return [side for side in (32, 64, 128) if f"polyjit_mma_a{side}x16" in ptx]
    assert tile_of(ops.matmul, (1536, 64), (64, 1536)) == [128]
    assert tile_of(ops.matmul, (1024, 64), (64, 1024)) == [64]  # 64 tiles of 128 for 132 multiprocessors
    assert tile_of(lambda a, b: ops.conv(a, b, (1, 1), ((1, 1), (1, 1)), layout="NHWC", kernel_layout="HWIO"),
                   (8, 64, 64, 64), (3, 3, 64, 256)) == [64]


def test_tiled_batched_matmul_thread_by_thread(rng):
    """A batch of contractions, one operand shared by the batch (attention's
    scores and a broadcast weight), as tiles with real barriers."""
    q, kt = rng.standard_normal((3, 70, 24)).astype(F32), rng.standard_normal((3, 24, 66)).astype(F32)
    w = rng.standard_normal((24, 40)).astype(F32)
    exe = polyjit.compile(lambda q, k, w: (ops.matmul(q, k), ops.matmul(q, w)),
                          [InputInfo(a.shape, F32) for a in (q, kt, w)], PTX_ONLY)
    assert exe.ir("ptx").count("bar.sync") >= 4
    scores, proj = run_threads_on_cpu(exe, [q, kt, w], grid=4, block=256)
    np.testing.assert_allclose(scores, q.astype(np.float64) @ kt, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(proj, q.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_tiled_convolution_thread_by_thread(layout, rng):
    """A convolution as a product whose k runs over the window and the input
    channels, its input read through the padding guard while staging; NHWC
    (rows: output columns, columns: output channels) and NCHW with stride and
    dilation (rows: output channels, columns: output columns)."""
    if layout == "NHWC":
        x, w = rng.standard_normal((2, 9, 10, 3)).astype(F32), rng.standard_normal((3, 3, 3, 70)).astype(F32)
        cfg = dict(stride=(1, 1), padding=((1, 1), (1, 1)), dilation=(1, 1))
        fn = lambda a, b: ops.conv(a, b, cfg["stride"], cfg["padding"], layout="NHWC", kernel_layout="HWIO")  # noqa: E731
        want = refs.conv2d(x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1), **cfg).transpose(0, 2, 3, 1)
    else:
        x, w = rng.standard_normal((2, 4, 11, 13)).astype(F32), rng.standard_normal((8, 4, 3, 3)).astype(F32)
        cfg = dict(stride=(1, 2), padding=((2, 2), (0, 0)), dilation=(2, 1))
        fn = lambda a, b: ops.conv(a, b, cfg["stride"], cfg["padding"], cfg["dilation"])  # noqa: E731
        want = refs.conv2d(x, w, **cfg)
    exe = polyjit.compile(fn, [InputInfo(x.shape, F32), InputInfo(w.shape, F32)], PTX_ONLY)
    assert "bar.sync" in exe.ir("ptx") and "ld.shared" in exe.ir("ptx")
    assert "cp.async" not in exe.ir("ptx")  # (the guarded input is computed, not copied as it lies)
    got = run_threads_on_cpu(exe, [x, w], grid=2, block=256)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_gpu_options_are_checked():
    with pytest.raises(CompileOptionError, match="gpu_arch"):
        polyjit.compile(ops.exp, [InputInfo([3], F32)], {"target": "nvgpu", "gpu_arch": "ampere"})
    with pytest.raises(CompileOptionError, match=r"'tile_sizes' is \[48\] for target 'nvgpu'.*\[32, 64, 128\]"):
        polyjit.compile(ops.exp, [InputInfo([3], F32)], {**PTX_ONLY, "tile_sizes": [48]})
    with pytest.raises(CompileOptionError, match=r"ktile.*\[8, 16, 32\]"):
        polyjit.compile(ops.exp, [InputInfo([3], F32)], {**PTX_ONLY, "tile_sizes": [32, 12]})


def _callbacks(keep: list):
    """symbol(restype, *argtypes)(f): the address of a C callback running f (kept alive in keep)."""
    import ctypes as c

    def symbol(restype, *argtypes):
        def wrap(f):
            cb = c.CFUNCTYPE(restype, *argtypes)(f)
            keep.append(cb)
            return c.cast(cb, c.c_void_p).value
        return wrap
    return symbol


def test_native_launcher_fills_the_argument_block_and_reports_failures():
    """The launch plan as host code (what XLA's custom calls run), against
    a driver written in Python: the context is checked and made current,
    memsets and launches run in order on the caller's stream, every kernel
    sees inputs, fixed pointers, outputs and integers in their slots, and
    the first failure stops the steps and names what failed; a kernel that
    takes some of the arguments gets a block of just those."""
    import ctypes

    from polyjit.runtime import launch
    c = ctypes
    calls, keep, ctx = [], [], 0x1234
    symbol = _callbacks(keep)

    def put(out, value):
        c.cast(out, c.POINTER(c.c_void_p))[0] = value
        return 0

    def block(params, n):
        p = c.cast(params, c.POINTER(c.c_void_p))
        return [c.cast(p[i], c.POINTER(c.c_uint64))[0] for i in range(n)]
    symbols = {
        "cuStreamGetCtx": symbol(c.c_int, c.c_void_p, c.c_void_p)(lambda s, out: put(out, ctx)),
        "cuCtxGetCurrent": symbol(c.c_int, c.c_void_p)(lambda out: put(out, 0)),
        "cuCtxSetCurrent": symbol(c.c_int, c.c_void_p)(lambda x: calls.append(("current", x)) or 0),
        "cuMemsetD8Async": symbol(c.c_int, c.c_uint64, c.c_uint8, c.c_size_t, c.c_void_p)(
            lambda *a: calls.append(("memset8", *a)) or 0),
        "cuMemsetD32Async": symbol(c.c_int, c.c_uint64, c.c_uint32, c.c_size_t, c.c_void_p)(
            lambda *a: calls.append(("memset32", *a)) or 0),
        "cuLaunchKernel": symbol(c.c_int, c.c_void_p, *[c.c_uint] * 7, c.c_void_p, c.c_void_p, c.c_void_p)(
            lambda f, gx, gy, gz, bx, by, bz, shared, s, params, extra:
                calls.append(("launch", f, gx, bx, s, block(params, 2 if f == 0xF02 else 5)))
                or (700 if f == 0xBAD else 0)),
        "snprintf": c.cast(c.CDLL(None).snprintf, c.c_void_p).value,
    }
    steps = [launch.Memset(2, 0x7FC00000, 6, 4, "poisoning y"), launch.Launch(0xF00, 5, 256, "launching k1"),
             launch.Launch(0xF02, 2, 64, "launching k1b", (2, 4)),  # only y and the second integer
             launch.Memset(2, 0, 24, 1, "zeroing y"), launch.Launch(0xBAD, 1, 32, "launching k2"),
             launch.Launch(0xF01, 1, 32, "launching k3")]
    plan = launch.LaunchPlan(slots=3, inputs=[0], outputs=[2], fixed={1: 0xC0}, ints=[10, 20], steps=steps,
                             context=ctx)
    launcher = launch.NativeLauncher("polyjit_test_launch", plan, symbols)  # its code lives as long as it does
    run = launch.LAUNCH_T(launcher.address)
    message = c.create_string_buffer(100)
    code = run((c.c_void_p * 1)(0xA0), (c.c_void_p * 1)(0xB0), 0x55, message, 100)
    assert code == 700 and message.value == b"launching k2 failed: CUDA error 700"
    assert calls == [("current", ctx), ("memset32", 0xB0, 0x7FC00000, 6, 0x55),
                     ("launch", 0xF00, 5, 256, 0x55, [0xA0, 0xC0, 0xB0, 10, 20]),
                     ("launch", 0xF02, 2, 64, 0x55, [0xB0, 20]), ("memset8", 0xB0, 0, 24, 0x55),
                     ("launch", 0xBAD, 1, 32, 0x55, [0xA0, 0xC0, 0xB0, 10, 20])]
    ctx = 0x999  # a stream of another context: nothing runs
    calls.clear()
    assert run((c.c_void_p * 1)(0xA0), (c.c_void_p * 1)(0xB0), 0x55, message, 100) == 201
    assert b"context" in message.value and calls == []


def test_native_launcher_runs_library_steps_holding_its_lock():
    """A library step in host code (cuBLAS's, cuDNN's): its calls in order with
    integers, fixed addresses, the caller's stream and argument slots'
    pointers advanced by offsets; a failing call names itself and its status
    kind, stops the steps and leaves the launcher's lock free."""
    import ctypes as c

    from polyjit.runtime import launch
    calls, keep, fail = [], [], []
    symbol = _callbacks(keep)

    def library(h, n, a, stride, out):
        calls.append(("call", h, n, a, stride, out))
        return fail.pop() if fail else 0
    i, p, q = c.c_int, c.c_void_p, c.c_longlong
    symbols = {
        "cuStreamGetCtx": symbol(i, p, p)(lambda s, out: c.cast(out, c.POINTER(p)).__setitem__(0, 0x77) or 0),
        "cuCtxGetCurrent": symbol(i, p)(lambda out: c.cast(out, c.POINTER(p)).__setitem__(0, 0x77) or 0),
        "cuCtxSetCurrent": symbol(i, p)(lambda x: 0),
        "snprintf": c.cast(c.CDLL(None).snprintf, c.c_void_p).value,
        "sched_yield": symbol(i)(lambda: 0),
    }
    lock = []  # the launcher's lock word, read while a call runs: held
    set_stream = symbol(i, p, p)(lambda h, s: calls.append(("stream", h, s, c.c_int32.from_address(lock[0]).value))
                                 or 0)
    call = symbol(i, p, i, p, q, p)(library)
    A = launch.Arg
    step = launch.LibraryStep((
        launch.Call(set_stream, (A("ptr", 0xAB), A("stream")), "setting the stream"),
        launch.Call(call, (A("ptr", 0xAB), A("i32", 8), A("slot", 1), A("i64", 128), A("slot", 2)), "x @ w"),
        launch.Call(call, (A("ptr", 0xAB), A("i32", 4), A("slot", 0, 256), A("i64", 0), A("slot", 2, 384)), "x @ w")),
        "cuBLAS status")
    plan = launch.LaunchPlan(slots=3, inputs=[0, 1], outputs=[2], fixed={}, ints=[], steps=[step], context=0x77)
    launcher = launch.NativeLauncher("polyjit_test_library", plan, symbols)
    lock.append(launcher.global_address("lock"))
    run = launch.LAUNCH_T(launcher.address)
    message = c.create_string_buffer(100)
    assert run((c.c_void_p * 2)(0x1000, 0x2000), (c.c_void_p * 1)(0x3000,), 0x55, message, 100) == 0
    assert calls == [("stream", 0xAB, 0x55, 1), ("call", 0xAB, 8, 0x2000, 128, 0x3000),
                     ("call", 0xAB, 4, 0x1000 + 256, 0, 0x3000 + 384)]
    fail.append(13)
    calls.clear()
    assert run((c.c_void_p * 2)(0x1000, 0x2000), (c.c_void_p * 1)(0x3000,), 0x55, message, 100) == 13
    assert message.value == b"x @ w failed: cuBLAS status 13" and len(calls) == 2
    assert c.c_int32.from_address(lock[0]).value == 0


def test_a_native_launchers_lock_waiter_yields_its_core_until_the_holder_releases():
    """A library step finding the launcher's lock held (another caller's
    steps) gives its core up (sched_yield) while it waits, rather than
    spinning on it (with more callers than cores a spinning waiter starves
    the holder), and runs its calls once the lock is free; a free lock
    costs no yield."""
    import ctypes as c
    import threading

    from polyjit.runtime import launch
    calls, keep, lock, yields = [], [], [], []
    symbol = _callbacks(keep)
    i, p = c.c_int, c.c_void_p

    def yield_core():  # the holder finishes while the third waiter yields
        yields.append(c.c_int32.from_address(lock[0]).value)
        if len(yields) == 3:
            c.c_int32.from_address(lock[0]).value = 0
        return 0
    symbols = {
        "cuStreamGetCtx": symbol(i, p, p)(lambda s, out: c.cast(out, c.POINTER(p)).__setitem__(0, 0x77) or 0),
        "cuCtxGetCurrent": symbol(i, p)(lambda out: c.cast(out, c.POINTER(p)).__setitem__(0, 0x77) or 0),
        "cuCtxSetCurrent": symbol(i, p)(lambda x: 0),
        "snprintf": c.cast(c.CDLL(None).snprintf, p).value,
        "sched_yield": symbol(i)(yield_core),
    }
    call = symbol(i, p)(lambda s: calls.append(c.c_int32.from_address(lock[0]).value) or 0)
    step = launch.LibraryStep((launch.Call(call, (launch.Arg("stream"),), "setting the stream"),), "cuBLAS status")
    plan = launch.LaunchPlan(slots=1, inputs=[0], outputs=[], fixed={}, ints=[], steps=[step], context=0x77)
    launcher = launch.NativeLauncher("polyjit_test_contended", plan, symbols)
    lock.append(launcher.global_address("lock"))
    run = launch.LAUNCH_T(launcher.address)
    message = c.create_string_buffer(100)
    assert run((p * 1)(0x1000), (p * 1)(), 0x55, message, 100) == 0 and calls == [1] and yields == []
    c.c_int32.from_address(lock[0]).value = 1  # held by another caller
    codes = []
    waiter = threading.Thread(target=lambda: codes.append(run((p * 1)(0x1000), (p * 1)(), 0x55, message, 100)),
                              daemon=True)
    waiter.start()
    waiter.join(60)  # (a waiter that never yields spins on forever: the lock is released only by yielding)
    assert not waiter.is_alive() and codes == [0]
    assert yields == [1, 1, 1] and calls == [1, 1] and c.c_int32.from_address(lock[0]).value == 0


def test_a_gpu_programs_plan_becomes_its_native_launchers_steps(monkeypatch):
    """Without a GPU: a GpuProgram's plan for a signature (a cuBLAS step, its
    kernels, an atomic sum's zeroing) built into a native launcher, run
    against a driver and a cuBLAS written in Python: the steps in the
    program's order, the product on the input, constant and temporary, each
    kernel's argument block its parameters' pointers, the zeroing before the
    sum, one handle for the library freed with the launcher."""
    import gc
    from types import SimpleNamespace

    from polyjit.codegen.nvgpu import BLOCK
    from polyjit.runtime import cublas, cuda, gpu_program, launch
    from polyjit.runtime import program as runtime_program
    from polyjit.runtime.gpu_buffers import GpuView
    c = ctypes
    calls, keep, handles = [], [], []
    symbol = _callbacks(keep)
    i, p, q = c.c_int, c.c_void_p, c.c_longlong

    def block(params, n):
        return [c.cast(c.cast(params, c.POINTER(p))[k], c.POINTER(c.c_uint64))[0] for k in range(n)]

    class NativeHostCublas(_HostCublas):  # its entry points as C callbacks, as a native step calls them
        set_stream = symbol(i, p, p)(lambda h, s: calls.append(("cublas stream", h, s)) or 0)
        set_math = symbol(i, p, i)(lambda h, mode: calls.append(("cublas math", h, mode)) or 0)
        set_workspace = symbol(i, p, p, c.c_size_t)(lambda h, w, n: calls.append(("cublas workspace", h, w, n)) or 0)
        gemm = symbol(i, p, i, i, i, i, i, p, p, i, q, p, i, q, p, p, i, q, i)(
            lambda h, ta, tb, m, n, k, al, a, lda, sa, b, ldb, sb, be, out, ldc, sc, batch:
                calls.append(("gemm", h, m, n, k, a, b, out, batch)) or 0)

        def new_handle(self, dev):
            handles.append("made")
            return 0xAB

        def destroy(self, h):
            handles.append(("freed", h))
    monkeypatch.setattr(cublas, "cublas", lambda: NativeHostCublas())
    W = np.ones((64, 32), F32)
    exe = polyjit.compile(lambda x: (ops.relu(ops.matmul(x, W)), ops.sum(x, [0])), [InputInfo((4096, 64), F32)],
                          {**PTX_ONLY, "contractions": "library"})
    prog = exe.compile_default()
    assert [(k.library is not None, k.zeroed) for k in prog.kernels] == [(True, ()), (False, ()), (False, ("out1",))]
    dev = SimpleNamespace(ordinal=0, context=0x77, multiprocessors=4, activate=lambda: None)
    monkeypatch.setattr(prog, "_device", lambda views, args: dev)
    monkeypatch.setattr(prog, "_functions", lambda d: {k.name: (0xF00 + n, 2) for n, k in enumerate(prog.kernels)})
    monkeypatch.setattr(prog, "_const", lambda index, d, stream: SimpleNamespace(ptr=0xC0))
    monkeypatch.setattr(cuda, "used_devices", set())
    monkeypatch.setattr(runtime_program, "POISON", False)
    monkeypatch.setattr(gpu_program, "launch_symbols", lambda: {
        "cuStreamGetCtx": symbol(i, p, p)(lambda s, out: c.cast(out, c.POINTER(p)).__setitem__(0, 0x77) or 0),
        "cuCtxGetCurrent": symbol(i, p)(lambda out: c.cast(out, c.POINTER(p)).__setitem__(0, 0x77) or 0),
        "cuCtxSetCurrent": symbol(i, p)(lambda x: 0),
        "cuMemsetD8Async": symbol(i, c.c_uint64, c.c_uint8, c.c_size_t, p)(
            lambda *a: calls.append(("memset8", *a)) or 0),
        "cuMemsetD32Async": symbol(i, c.c_uint64, c.c_uint32, c.c_size_t, p)(lambda *a: 1),
        "cuLaunchKernel": symbol(i, p, *[c.c_uint] * 7, p, p, p)(
            lambda f, gx, gy, gz, bx, by, bz, shared, s, params, extra:
                calls.append(("launch", f, gx, bx, s, block(params, 4))) or 0),
        "snprintf": c.cast(c.CDLL(None).snprintf, p).value, "sched_yield": symbol(i)(lambda: 0)})
    launcher = prog.native_launcher([GpuView(0xA000, (4096, 64), None, np.dtype(F32), 0, None)], "polyjit_test_plan")
    assert [name for name, _, _ in launcher.results] == ["out0", "out1", prog.kernels[0].library.array]  # (the product)
    assert handles == ["made"] and exe.ir("launcher polyjit_test_plan") == launcher.ir
    message = c.create_string_buffer(100)
    code = launch.LAUNCH_T(launcher.address)((c.c_void_p * 1)(0xA000), (c.c_void_p * 3)(0xB000, 0xB100, 0xD000),
                                             0x55, message, 100)
    assert code == 0, message.value
    pointers = [0xA000, 0xB000, 0xB100, 0xD000]  # in0, out0, out1, the product: the kernels' parameters (c0 aside)
    assert calls == [("cublas stream", 0xAB, 0x55), ("cublas workspace", 0xAB, 0x5000, 1 << 20), ("cublas math", 0xAB, 0), ("gemm", 0xAB, 32, 4096, 64, 0xC0, 0xA000, 0xD000, 1),
                     ("launch", 0xF01, 16, BLOCK, 0x55, pointers),
                     ("memset8", 0xB100, 0, 64 * 4, 0x55), ("launch", 0xF02, 16, BLOCK, 0x55, pointers)]
    del launcher
    gc.collect()
    assert handles == ["made", ("freed", 0xAB)]


def test_zeroing_points_are_as_few_as_the_arrays_accesses_allow():
    """Each array an atomic sum zeroes first may be zeroed as early as just
    after the last launch that touches it (or any launch whose arrays are
    unknown): the fewest places that cover every array's span."""
    from polyjit.runtime.gpu_program import zeroing_points
    zeroed = [[], [], [(5, 64)], [], [(6, 128), (7, 64)], [(5, 32)], [(8, 16)]]
    accessed = [frozenset({1}), frozenset({2}), frozenset({5}), None, frozenset({6, 7, 8}), frozenset({5}),
                frozenset({8})]
    assert zeroing_points(zeroed, accessed) == {2: [(2, 5, 64)], 4: [(4, 6, 128), (4, 7, 64), (5, 5, 32)],
                                                6: [(6, 8, 16)]}
    # with nothing between them touching the arrays, the three sums zero theirs in one place
    assert zeroing_points([[(3, 4)], [(4, 4)], [(5, 4)]], [frozenset({3}), frozenset({4}), frozenset({5})]) \
        == {0: [(0, 3, 4), (1, 4, 4), (2, 5, 4)]}


def test_the_zeroing_kernel_zeroes_each_arrays_words_and_no_more():
    """nvgpu's zeroing kernel, thread by thread on the CPU: each array's n
    words become zero and the word after them stays; an array of 0 words
    is not touched (its pointer may be anything)."""
    import threading

    from polyjit.codegen.nvgpu import ZEROING_ARRAYS, ZEROING_KERNEL, zeroing_kernel
    local = threading.local()
    engine, _, hooks = _on_host(zeroing_kernel(), local)
    sizes = [7, 0, 300, 1] + [0] * (ZEROING_ARRAYS - 4)
    arrays = [np.full(n + 1, 3.0, np.float32) for n in sizes]
    args = []
    for a, n in zip(arrays, sizes):
        args += [a.ctypes.data if n else 0, n]
    fn = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p, ctypes.c_int64] * ZEROING_ARRAYS)(
        engine.get_function_address(ZEROING_KERNEL))
    for block in range(2):
        for t in range(64):
            local.tid, local.ctaid, local.ntid, local.nctaid = t, block, 64, 2
            fn(*args)
    for a, n in zip(arrays, sizes):
        assert (a[:n] == 0).all() and a[n] == 3.0


def test_atomic_sums_zero_their_arrays_in_one_launch(monkeypatch):
    """Without a GPU: a program whose sums are atomic strips in two kernels
    (three arrays zeroed first) and other kernels between them that do not
    touch those arrays. Its plan zeroes the three in one launch of the
    zeroing kernel before the first kernel, with their sizes in words,
    and no memset is left."""
    from types import SimpleNamespace

    from polyjit.codegen.nvgpu import BLOCK, ZEROING_ARRAYS
    from polyjit.runtime import cuda, gpu_program
    from polyjit.runtime import program as runtime_program
    from polyjit.runtime.gpu_buffers import GpuView
    W = np.ones((64, 32), np.float32)

    def f(x, y):
        return ops.sum(x, [0]), ops.relu(ops.matmul(x, W)), ops.sum(ops.exp(y), [0]), ops.sum(y * x, [0])
    spec = InputInfo((4096, 64), np.float32)
    prog = polyjit.compile(f, [spec, spec], PTX_ONLY).compile_default()
    zeroing = [k.zeroed for k in prog.kernels if k.zeroed]
    assert len(zeroing) == 2 and sum(map(len, zeroing)) == 3, [k.zeroed for k in prog.kernels]
    dev = SimpleNamespace(ordinal=0, context=0x77, multiprocessors=4, activate=lambda: None)
    monkeypatch.setattr(prog, "_device", lambda views, args: dev)
    monkeypatch.setattr(prog, "_functions", lambda d: {k.name: (0xF00 + n, 2) for n, k in enumerate(prog.kernels)})
    monkeypatch.setattr(cuda, "used_devices", set())
    monkeypatch.setattr(runtime_program, "POISON", False)
    monkeypatch.setattr(prog, "_const", lambda index, d, stream: SimpleNamespace(ptr=0xC0))
    monkeypatch.setattr(gpu_program, "_zeroing_function", lambda d: (0xE00, 2))
    views = [GpuView(0xA000, (4096, 64), None, np.dtype(np.float32), 0, None)] * 2
    plan = prog._plan(gpu_program._device_key(views), views, views, 0)
    first, *rest = plan.launches
    assert first[0] == 0xE00 and first[2] == BLOCK and not any(step[4] for step in plan.launches)
    assert [step[0] for step in rest] == [0xF00 + n for n in range(len(prog.kernels))]
    slot = {b.name: i for i, b in enumerate(prog.buffers)}
    params, ints = first[5], list(plan.ints)
    pairs = [(params[2 * k], params[2 * k + 1]) for k in range(ZEROING_ARRAYS)]
    zeroed = {s for k in prog.kernels for s in (slot[a] for a in k.zeroed)}
    assert {s for s, _ in pairs[:3]} == zeroed
    assert [ints[n - len(prog.buffers)] for _, n in pairs] == [64] * 3 + [0] * (ZEROING_ARRAYS - 3)


def test_convolution_products_follow_the_tf32_option(monkeypatch):
    """A convolution computed as im2col and a cuBLAS product (a weight
    gradient) rounds to TF32 where the tf32 option allows it, as cuDNN's
    convolutions do; a product of the program's own (a matmul) where
    matmul_tf32 does, whatever tf32 says."""
    from polyjit.targets.nvgpu import NvgpuTarget
    monkeypatch.setattr(NvgpuTarget, "library_available", lambda self: True)
    monkeypatch.setattr(NvgpuTarget, "direct_convolutions", lambda self: False)

    def wgrad(x, g):
        return ops.conv_weight_grad(x, g, [3, 3], [1, 1], [(1, 1), (1, 1)])
    shapes = [InputInfo([4, 16, 12, 12], F32), InputInfo([4, 32, 12, 12], F32)]
    for tf32 in (True, False):
        exe = polyjit.compile(wgrad, shapes, {**PTX_ONLY, "contractions": "library", "tf32": tf32, "cache": False})
        gemms = [k.library.library for k in exe.compile_default().kernels if k.library is not None]
        assert gemms and all(g.tf32 == tf32 for g in gemms), (tf32, gemms)
    for tf32, matmul_tf32 in ((True, False), (False, True)):
        exe = polyjit.compile(ops.matmul, [InputInfo([256, 128], F32), InputInfo([128, 512], F32)],
                              {**PTX_ONLY, "contractions": "library", "tf32": tf32, "matmul_tf32": matmul_tf32,
                               "cache": False})
        gemms = [k.library.library for k in exe.compile_default().kernels if k.library is not None]
        assert gemms and all(g.tf32 == matmul_tf32 for g in gemms), (matmul_tf32, gemms)


def test_cuda_graph_replays_follow_the_pointers(monkeypatch):
    """A launcher's steps run directly for pointers seen once, are captured
    on the second call with them and replayed from then on; a failed
    capture, or a caller's stream that is itself being captured, leaves the
    launcher running directly. (A driver written in Python: no GPU.)"""
    from types import SimpleNamespace

    from polyjit.runtime import cuda_graphs
    ok = SimpleNamespace(name="CUDA_SUCCESS")
    events = []

    class Driver:
        CUresult = SimpleNamespace(CUDA_SUCCESS=ok)
        CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
        CUstreamCaptureMode = SimpleNamespace(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=2)
        CUstreamCaptureStatus = SimpleNamespace(CU_STREAM_CAPTURE_STATUS_NONE="none")
        capturing_caller = False

        def CUstream(self, handle):
            return handle

        def cuStreamIsCapturing(self, s):
            return ok, "active" if self.capturing_caller and s == 0x55 else "none"

        def cuStreamCreate(self, flags):
            return ok, 0xCA

        def cuStreamBeginCapture(self, s, mode):
            events.append(("begin", s))
            return (ok,)

        def cuStreamEndCapture(self, s):
            events.append(("end", s))
            return ok, "graph"

        def cuGraphInstantiate(self, graph, flags):
            return ok, 0xE0 + len([e for e in events if e[0] == "begin"])

        def cuGraphDestroy(self, graph):
            return (ok,)

        def cuGraphExecDestroy(self, exe):
            return (ok,)
    drv = Driver()
    monkeypatch.setattr(cuda_graphs, "driver", lambda: drv)
    monkeypatch.setattr(cuda_graphs, "_capture_streams", {})
    monkeypatch.setattr(cuda_graphs, "_graph_launch", lambda: lambda exe, s: events.append(("replay", exe, s)) or 0)
    status = {"code": 0}

    def run(inputs, outputs, stream, message, size):
        events.append(("run", stream))
        return status["code"]
    replays = cuda_graphs.GraphReplays(run, 0)
    none = (ctypes.c_void_p * 1)()

    def call(pointers):  # the inputs' pointers, no outputs
        return replays((ctypes.c_void_p * len(pointers))(*pointers), none, 0x55, None, 0)
    assert [call((1, 2)) for _ in range(3)] == [0, 0, 0]
    assert events == [("run", 0x55), ("begin", 0xCA), ("run", 0xCA), ("end", 0xCA), ("replay", 0xE1, 0x55),
                      ("replay", 0xE1, 0x55)] and replays.replays == 2
    events.clear()
    drv.capturing_caller = True  # the caller's own capture takes the launches as they are
    call((3, 4)), call((3, 4))
    assert events == [("run", 0x55), ("run", 0x55)]
    events.clear()
    drv.capturing_caller, status["code"] = False, 700  # a capture that fails: direct from then on
    call((5, 6)), call((5, 6))
    assert replays.broken and events[-1] == ("run", 0x55) and not any(e[0] == "replay" for e in events)


def _gpu():
    from conftest import _gpu_visible
    return _gpu_visible()


@pytest.mark.skipif("_gpu()")
def test_no_driver_is_a_device_error():
    with pytest.raises(DeviceError, match="NVIDIA|cuda-python"):
        polyjit.compile(ops.exp, [InputInfo([3], F32)], {"target": "nvgpu"})
    exe = polyjit.compile(ops.exp, [InputInfo([3], F32)], PTX_ONLY)  # cross-compiled: runs nowhere
    with pytest.raises(DeviceError, match="NVIDIA|cuda-python"):
        exe(np.ones(3, F32))


# ------------------------------------------------- the library floor (cuBLAS)
def _conv_case(x, w, stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1), groups=1, nhwc=False):
    """(fn, input shapes, reference) of a convolution; nhwc: NHWC x HWIO."""
    if nhwc:
        def fn(a, b):
            return ops.conv(a, b, stride, padding, dilation, groups, layout="NHWC", kernel_layout="HWIO")

        def ref(a, b):
            return refs.conv2d(a.transpose(0, 3, 1, 2), b.transpose(3, 2, 0, 1), stride, padding, dilation,
                               groups).transpose(0, 2, 3, 1)
        return fn, [x, w], ref
    return (lambda a, b: ops.conv(a, b, stride, padding, dilation, groups), [x, w],
            lambda a, b: refs.conv2d(a, b, stride, padding, dilation, groups))


LIBRARY_CASES = {  # name: (fn, input shapes, float64 reference)
    "1x1": _conv_case((2, 16, 9, 11), (24, 16, 1, 1)),  # the input read in place, no im2col
    "3x3_padded": _conv_case((2, 8, 10, 9), (20, 8, 3, 3), padding=((1, 1), (1, 1))),
    "1x1_strided": _conv_case((3, 16, 9, 9), (12, 16, 1, 1), stride=(2, 2)),
    "grouped_dilated": _conv_case((2, 12, 9, 8), (18, 6, 3, 3), (2, 1), ((1, 2), (1, 1)), (2, 1), groups=2),
    "depthwise": _conv_case((2, 16, 8, 8), (16, 1, 3, 3), padding=((1, 1), (1, 1)), groups=16),
    "nhwc": _conv_case((2, 9, 10, 16), (3, 3, 16, 24), padding=((1, 1), (0, 0)), nhwc=True),
    "batched_matmul_bt": (lambda a, b: ops.matmul(a, ops.transpose(b, 1, 2)), [(3, 40, 24), (3, 50, 24)],
                          lambda a, b: a.astype(np.float64) @ b.transpose(0, 2, 1)),
    "matmul_broadcast": (ops.matmul, [(2, 33, 17), (17, 45)], lambda a, b: a.astype(np.float64) @ b),
    "attention_heads": (lambda a, b: ops.matmul(a, ops.transpose(b, 2, 3)), [(2, 3, 20, 16), (2, 3, 24, 16)],
                        lambda a, b: a.astype(np.float64) @ b.transpose(0, 1, 3, 2)),
}


class _HostCublas:
    """cuBLAS's column-major sgemm on host memory (numpy), so that the library
    steps a GPU program plans run with its kernels on the CPU."""

    lock = threading.Lock()
    alpha = beta = 0

    def handle(self, dev):
        return 0

    def set_stream(self, handle, stream):
        return 0

    def set_math(self, handle, mode):
        return 0

    def set_workspace(self, handle, space, nbytes):
        return 0

    def workspace(self, dev):
        return 0x5000, 1 << 20

    def check(self, status, what):
        assert status == 0, what

    @staticmethod
    def _matrix(ptr, rows, cols, ld):
        from numpy.lib.stride_tricks import as_strided
        flat = np.ctypeslib.as_array((ctypes.c_float * ((cols - 1) * ld + rows)).from_address(ptr))
        return as_strided(flat, (rows, cols), (4, 4 * ld))

    def gemm(self, h, ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc, sc, batch):
        for i in range(batch):
            x = self._matrix(a + 4 * i * sa, *((k, m) if ta else (m, k)), lda)
            y = self._matrix(b + 4 * i * sb, *((n, k) if tb else (k, n)), ldb)
            self._matrix(c + 4 * i * sc, m, n, ldc)[...] = (x.T if ta else x) @ (y.T if tb else y)
        return 0


def _host_convolution(c, bufs) -> None:
    """What cudnnConvolutionForward (or BackwardFilter, BackwardData) computes for a Convolution statement, in
    numpy (float64)."""
    sp = "".join(ch for ch in c.layout if ch not in "NC")
    (p0, p1), (s0, s1), (d0, d1) = c.padding, c.strides, c.dilation
    if c.operation == "data":  # x the weight, w the output's gradient, y the input's
        w = np.transpose(bufs[c.x[0]], [c.kernel_layout.index(ch) for ch in "OI" + sp]).astype(np.float64)
        dy = np.transpose(bufs[c.w[0]], [c.gradient_layout.index(ch) for ch in "NC" + sp]).astype(np.float64)
        n, _, h, wd = (bufs[c.y[0]].shape[c.layout.index(ch)] for ch in "NC" + sp)
        dx = np.zeros((n, w.shape[1], h + 2 * p0, wd + 2 * p1))
        oh, ow = dy.shape[2:]
        for i in range(w.shape[2]):
            for j in range(w.shape[3]):
                dx[:, :, i * d0:i * d0 + s0 * (oh - 1) + 1:s0, j * d1:j * d1 + s1 * (ow - 1) + 1:s1] += np.einsum(
                    "nohw,oc->nchw", dy, w[:, :, i, j])
        bufs[c.y[0]][...] = np.transpose(dx[:, :, p0:p0 + h, p1:p1 + wd], [("NC" + sp).index(ch) for ch in c.layout])
        return
    x = np.transpose(bufs[c.x[0]], [c.layout.index(ch) for ch in "NC" + sp]).astype(np.float64)
    x = np.pad(x, ((0, 0), (0, 0), (p0, p0), (p1, p1)))
    if c.operation == "filter":
        dy = np.transpose(bufs[c.w[0]], [c.gradient_layout.index(ch) for ch in "NC" + sp]).astype(np.float64)
        dw = np.zeros([bufs[c.y[0]].shape[c.kernel_layout.index(ch)] for ch in "OI" + sp])
        oh, ow = dy.shape[2:]
        for i in range(dw.shape[2]):
            for j in range(dw.shape[3]):
                taps = x[:, :, i * d0:i * d0 + s0 * (oh - 1) + 1:s0, j * d1:j * d1 + s1 * (ow - 1) + 1:s1]
                dw[:, :, i, j] = np.einsum("nchw,nohw->oc", taps, dy)
        bufs[c.y[0]][...] = np.transpose(dw, [("OI" + sp).index(ch) for ch in c.kernel_layout])
        return
    w = np.transpose(bufs[c.w[0]], [c.kernel_layout.index(ch) for ch in "OI" + sp]).astype(np.float64)
    cout, cin_g, kh, kw = w.shape
    oh, ow = (x.shape[2] - d0 * (kh - 1) - 1) // s0 + 1, (x.shape[3] - d1 * (kw - 1) - 1) // s1 + 1
    y = np.zeros((x.shape[0], cout, oh, ow))
    cg = cout // c.groups
    for g in range(c.groups):
        xs = x[:, g * cin_g:(g + 1) * cin_g]
        for i in range(kh):
            for j in range(kw):
                taps = xs[:, :, i * d0:i * d0 + s0 * (oh - 1) + 1:s0, j * d1:j * d1 + s1 * (ow - 1) + 1:s1]
                y[:, g * cg:(g + 1) * cg] += np.einsum("nchw,oc->nohw", taps, w[g * cg:(g + 1) * cg, :, i, j])
    bufs[c.y[0]][...] = np.transpose(y, [("NC" + sp).index(ch) for ch in c.layout])


@pytest.mark.parametrize("case", ["1x1", "3x3_padded", "1x1_strided", "nhwc"])
def test_direct_convolutions_thread_by_thread(case, rng, monkeypatch):
    """Where the target's library has convolutions (cuDNN), a library
    convolution is one call on whole arrays: no im2col; a kernel in neither
    of its layouts (HWIO) packed first; an input computed inline (x * 2)
    made an array by a kernel of its own; the epilogue a kernel after it."""
    from polyjit.runtime import cublas, cudnn
    monkeypatch.setattr(cublas, "cublas", lambda: _HostCublas())  # (the floor needs its library present)
    monkeypatch.setattr(cudnn, "cudnn", lambda: True)
    fn, shapes, ref = LIBRARY_CASES[case]
    arrays = [rng.standard_normal(s).astype(F32) for s in shapes]
    exe = polyjit.compile(lambda x, w: ops.relu(fn(ops.mul(x, 2.0), w)), [InputInfo(s, F32) for s in shapes],
                          {**PTX_ONLY, "contractions": "library"})
    prog = exe.compile_default()
    assert [type(k.library.library).__name__ for k in prog.kernels if k.library is not None] == ["Convolution"]
    affine = exe.ir("affine")
    assert "_col[" not in affine and ("_w[" in affine) == (case == "nhwc")  # (the im2col, the packed kernel)
    got = run_threads_on_cpu(exe, arrays)[0]
    np.testing.assert_allclose(got, np.maximum(ref(arrays[0] * 2, arrays[1]), 0), rtol=1e-5, atol=1e-5)


def test_products_over_runs_of_dims_call_cublas_as_matrices_thread_by_thread(rng, monkeypatch):
    """A dense layer over a sequence as JAX writes it ([b, t, d] x [d, n])
    and its weight's gradient (contracting b and t) are products of
    matrices on nvgpu (matrix_products): cuBLAS calls on views of the
    operands, no generated nest; the results are numpy's."""
    from polyjit.runtime import cublas
    monkeypatch.setattr(cublas, "cublas", lambda: _HostCublas())
    x, w, g = rng.standard_normal((3, 10, 12)), rng.standard_normal((12, 7)), rng.standard_normal((3, 10, 7))
    x, w, g = (a.astype(F32) for a in (x, w, g))

    def f(x, w, g):
        return ops.dot_general(x, w, ((2,), (0,))), ops.dot_general(x, g, ((0, 1), (0, 1)))
    exe = polyjit.compile(f, [InputInfo(a.shape, F32) for a in (x, w, g)], {**PTX_ONLY, "contractions": "library"})
    plans = exe.ir("mapping").splitlines()
    assert sum("library: sgemm" in p for p in plans) == 2 and not any("tiled" in p for p in plans), plans
    got = run_threads_on_cpu(exe, [x, w, g])
    np.testing.assert_allclose(got[0].reshape(3, 10, 7), np.einsum("btd,dn->btn", x, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], np.einsum("btd,btn->dn", x, g), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [40, 1])
def test_sibling_products_are_one_cublas_call_thread_by_thread(tokens, rng, monkeypatch):
    """Query, key and value projections of the same hidden states (torch's
    Linear: [b, t, d] x [n, d] transposed, then a bias) are one cuBLAS call
    on nvgpu (sibling_products), the weights copied side by side, each
    projection a slice of the joined result; for a single token, where the
    copy would cost more than the calls it saves, three calls. The results
    are numpy's."""
    from polyjit.runtime import cublas
    monkeypatch.setattr(cublas, "cublas", lambda: _HostCublas())
    shapes = [(2, tokens, 16), (16, 16), (8, 16), (8, 16), (16,)]
    arrays = [rng.standard_normal(s).astype(F32) for s in shapes]

    def qkv(x, wq, wk, wv, b):
        return [ops.add(ops.dot_general(x, ops.transpose(w), ((2,), (0,))), b) if w is wq
                else ops.dot_general(x, ops.transpose(w), ((2,), (0,))) for w in (wq, wk, wv)]
    exe = polyjit.compile(qkv, [InputInfo(s, F32) for s in shapes], {**PTX_ONLY, "contractions": "library"})
    calls = [p for p in exe.ir("mapping").splitlines() if "library: sgemm" in p]
    assert len(calls) == (1 if tokens > 1 else 3), calls
    assert tokens == 1 or "n=32" in calls[0], calls  # (16 + 8 + 8 columns)
    got = run_threads_on_cpu(exe, arrays)
    x, wq, wk, wv, b = arrays
    for y, want in zip(got, (x @ wq.T + b, x @ wk.T, x @ wv.T)):
        np.testing.assert_allclose(y.reshape(want.shape), want, rtol=1e-5, atol=1e-5)


def test_activations_between_cudnn_convolutions_are_channels_last_thread_by_thread(rng, monkeypatch):
    """Where cuDNN loads, NCHW convolutions read and write channels-last
    arrays (its tensor-core kernels take NHWC; handed NCHW, it converts
    around each call): a residual block's convolutions, relu, max pool and
    add all keep channels last, the image transposed only where it enters
    and leaves; the result is the CPU's. cuDNN's FMA kernels (no TF32)
    take NCHW as it is."""
    from polyjit.runtime import cublas, cudnn
    monkeypatch.setattr(cublas, "cublas", lambda: _HostCublas())
    monkeypatch.setattr(cudnn, "cudnn", lambda: True)

    def block(x, w1, w2):
        y = ops.relu(ops.conv(x, w1, (1, 1), ((1, 1), (1, 1))))
        y = ops.max_pool_with_positions(y, (3, 3), (2, 2), (1, 1))[0]
        return ops.relu(ops.add(ops.conv(y, w2, (1, 1), ((1, 1), (1, 1))), y))
    shapes = [(2, 5, 11, 9), (12, 5, 3, 3), (12, 12, 3, 3)]
    arrays = [rng.standard_normal(s).astype(F32) for s in shapes]
    infos = [InputInfo(s, F32) for s in shapes]
    exe = polyjit.compile(block, infos, {**PTX_ONLY, "contractions": "library", "tf32": True})
    calls = [k.library.library for k in exe.compile_default().kernels if k.library is not None]
    assert [(c.layout, c.kernel_layout) for c in calls] == [("NHWC", "OHWI")] * 2
    fma = polyjit.compile(block, infos, {**PTX_ONLY, "contractions": "library", "tf32": False})
    assert {k.library.library.layout for k in fma.compile_default().kernels if k.library is not None} == {"NCHW"}
    images = re.findall(r"temp float32 t\d+\[(\d+), (\d+), (\d+), (\d+)\]", exe.ir("affine"))
    images = [(h, w, c) for n, h, w, c in images if n == "2"]  # (not the weights)
    assert len(images) >= 3 and all(c == "12" or (h, w, c) == ("11", "9", "5") for h, w, c in images)
    want = polyjit.compile(block, infos, {"target": "cpu"})(*arrays)
    np.testing.assert_allclose(run_threads_on_cpu(exe, arrays)[0], want, rtol=1e-4, atol=1e-4)


def test_channels_last_inputs_and_saved_activations_thread_by_thread(rng, monkeypatch):
    """An input laid out channels last and read as NCHW (a backward's saved
    activation) keeps its order through the ops that read it: their image
    arrays are channels last, into cuDNN's TF32 convolution and the channel
    sums (in strips along the channels). A result made channels last is one
    the executable offers in that order (``output_orders``); asked for so,
    it costs no kernel more. The results are the CPU's."""
    from polyjit.runtime import cublas, cudnn
    monkeypatch.setattr(cublas, "cublas", lambda: _HostCublas())
    monkeypatch.setattr(cudnn, "cudnn", lambda: True)

    def step(x_nhwc, w):
        y = ops.relu(ops.mul(ops.permute(x_nhwc, [0, 3, 1, 2]), 2.0) - 1.0)
        z = ops.relu(ops.conv(y, w, (1, 1), ((1, 1), (1, 1))))
        return z, ops.sum(y, [0, 2, 3]), ops.conv(z, ops.permute(w, [1, 0, 2, 3]), (1, 1), ((1, 1), (1, 1)))
    shapes = [(2, 11, 9, 5), (12, 5, 3, 3)]
    arrays = [rng.standard_normal(s).astype(F32) for s in shapes]
    infos = [InputInfo(s, F32) for s in shapes]
    options = {**PTX_ONLY, "contractions": "library", "tf32": True}
    exe = polyjit.compile(step, infos, options)
    assert exe.output_orders() == {0: (0, 2, 3, 1), 2: (0, 2, 3, 1)}
    assert polyjit.compile(step, infos, {**options, "tf32": False}).output_orders() == {}
    images = re.findall(r"temp float32 t\d+\[2, (\d+(?:, \d+)*)\]", exe.ir("affine"))  # (not the kernel's)
    assert images and all(s in ("11, 9, 5", "11, 9, 12") for s in images), images
    assert "atomic strips" in exe.ir("mapping"), exe.ir("mapping")
    want = polyjit.compile(step, infos, {"target": "cpu"})(*arrays)
    for got, ref in zip(run_threads_on_cpu(exe, arrays), want):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)

    def stored(x_nhwc, w):
        z, s, c = step(x_nhwc, w)
        return ops.permute(z, [0, 2, 3, 1]), s, c
    exe = polyjit.compile(stored, infos, options)
    copies = re.findall(r"out0\[[^]]*\] = t\d+\[[^]]*\]$", exe.ir("affine"), re.M)
    assert not copies and "out0[" in exe.ir("affine"), exe.ir("affine")  # (the relu stores it)
    np.testing.assert_allclose(run_threads_on_cpu(exe, arrays)[0], want[0].transpose(0, 2, 3, 1), rtol=1e-4, atol=1e-4)


def test_a_depthwise_convolution_between_cudnn_convolutions_reads_its_taps_along_the_channels(rng, monkeypatch):
    """A depthwise convolution among channels-last ones is a stencil that
    generated code computes: its kernel is copied window, I, O, so that a
    tap's weights for a vector of channels are one load, as its input's
    are (read OIHW or OHWI, they were 4 loads 9 floats apart). Where the
    options send every convolution to cuDNN, it reads OHWI. The results
    are the CPU's."""
    from polyjit.runtime import cublas, cudnn
    monkeypatch.setattr(cublas, "cublas", lambda: _HostCublas())
    monkeypatch.setattr(cudnn, "cudnn", lambda: True)
    monkeypatch.setattr(library, "MIN_MACS", 0)  # (small 1x1 convolutions in cuDNN all the same)

    def block(x, w1, wd, w3):
        y = ops.relu(ops.conv(x, w1, (1, 1), ((0, 0), (0, 0))))
        z = ops.relu(ops.conv(y, wd, (1, 1), ((1, 1), (1, 1)), groups=64))
        return ops.conv(z, w3, (1, 1), ((0, 0), (0, 0)))
    shapes = [(2, 64, 7, 5), (64, 64, 1, 1), (64, 1, 3, 3), (64, 64, 1, 1)]
    arrays = [rng.standard_normal(s).astype(F32) for s in shapes]
    infos = [InputInfo(s, F32) for s in shapes]
    hwio = re.compile(r"^ *(t\d+)\[i0, i1, i2, i3\] = in2\[i3, i2, i0, i1\]$", re.M)
    exe = polyjit.compile(block, infos, {**PTX_ONLY, "tf32": True})
    copy = hwio.search(exe.ir("affine"))
    assert copy and re.search(rf"relu\(.*\* {copy[1]}\[0, 0, 0, i3\]", exe.ir("affine")), exe.ir("affine")
    depthwise = [m for m in exe.ir("mapping").splitlines() if "_relu_" in m]
    assert len(depthwise) == 1 and "groups of 4" in depthwise[0], exe.ir("mapping")
    forced = polyjit.compile(block, infos, {**PTX_ONLY, "contractions": "library", "tf32": True})
    assert not hwio.search(forced.ir("affine"))
    want = polyjit.compile(block, infos, {"target": "cpu"})(*arrays)
    np.testing.assert_allclose(run_threads_on_cpu(exe, arrays)[0], want, rtol=1e-4, atol=1e-4)


def test_copies_of_the_inputs_run_side_by_side_in_one_kernel(rng):
    """Statements computed from the program's inputs alone (a model's
    weights laid out for its convolutions) are one kernel whose threads
    are dealt out among them, not a launch each; with every thread count
    the results are the CPU's. Without fusion each is a kernel."""
    def f(x, w1, w2, b):
        y = ops.add(ops.relu(x), ops.add(ops.abs(b), 1.0))
        return ops.mul(ops.permute(w1, [2, 3, 1, 0]), 2.0), ops.mul(ops.permute(w2, [1, 0]), 3.0), y
    shapes = [(2, 50, 60, 8), (8, 4, 3, 3), (33, 17), (8,)]
    arrays = [rng.standard_normal(s).astype(F32) for s in shapes]
    infos = [InputInfo(s, F32) for s in shapes]
    exe = polyjit.compile(f, infos, PTX_ONLY)
    mapping = exe.ir("mapping").splitlines()
    assert len(mapping) == 2 and "side by side, 2 nests" in mapping[0], mapping
    assert len(polyjit.compile(f, infos, {**PTX_ONLY, "fusion": "none"}).ir("mapping").splitlines()) == 3
    want = polyjit.compile(f, infos, {"target": "cpu"})(*arrays)
    for grid in (1, 3, 7):
        for got, ref in zip(run_threads_on_cpu(exe, arrays, grid=grid), want):
            np.testing.assert_allclose(got, ref, rtol=1e-6)


@pytest.mark.gpu
def test_a_cnn_training_step_keeps_activations_channels_last(monkeypatch):
    """With TF32 convolutions on the GPU, a training forward stores the
    activations its backward reads channels last, as cuDNN's tensor-core
    kernels take them (Inductor's layout optimization does the same), and
    the backward reads them in place. Gradients as eager's (TF32 in both)."""
    torch = pytest.importorskip("torch")
    import polyjit.frontends.torch as frontend
    from test_torch import training_step_saving
    from polyjit.targets import target
    if not target("nvgpu").direct_convolutions():
        pytest.skip("no cuDNN here")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    orders, translate = [], frontend.translate

    def recording(gm, *example):
        t = translate(gm, *example)
        orders.append(t.input_orders)
        return t
    monkeypatch.setattr(frontend, "translate", recording)
    torch.manual_seed(0)
    nn = torch.nn
    m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.MaxPool2d(3, 2, 1), nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).cuda()
    torch._dynamo.reset()
    grads, saved = training_step_saving(m, torch.randn(4, 3, 20, 18, device="cuda"))
    for got, want in grads:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    images = [t for t in saved if t.dim() == 4 and t.shape[:2] == (4, 16) and t.shape[2] > 1]  # (not the weights)
    assert images and all(t.is_contiguous(memory_format=torch.channels_last) for t in images), \
        [(tuple(t.shape), t.stride()) for t in saved]
    assert any((0, 2, 3, 1) in o.values() for o in orders), orders  # (the backward reads them in place)


@pytest.mark.parametrize("kind", ["weight", "input"])
def test_channels_last_gradient_convolutions_thread_by_thread(kind, rng, monkeypatch):
    """A strided NCHW convolution's weight and input gradients, channels
    last around cuDNN's TF32 kernels: the backward filter reads the image
    and the output gradient as NHWC and makes an OHWI gradient; the backward
    data reads an OHWI kernel; both equal the CPU's."""
    from polyjit.runtime import cublas, cudnn
    monkeypatch.setattr(cublas, "cublas", lambda: _HostCublas())
    monkeypatch.setattr(cudnn, "cudnn", lambda: True)
    xs, ws, gs = (2, 6, 11, 10), (8, 6, 3, 3), (2, 8, 6, 5)

    def f(x, g):  # (x the image or the kernel)
        if kind == "weight":
            return ops.mul(ops.conv_weight_grad(x, g, [3, 3], [2, 2], [(1, 1), (1, 1)]), 2.0)
        return ops.mul(ops.conv_input_grad(g, x, [11, 10], [2, 2], [(1, 1), (1, 1)]), 2.0)
    shapes = (xs if kind == "weight" else ws, gs)
    arrays = [rng.standard_normal(s).astype(F32) for s in shapes]
    infos = [InputInfo(s, F32) for s in shapes]
    exe = polyjit.compile(f, infos, {**PTX_ONLY, "contractions": "library", "tf32": True})
    calls = [k.library.library for k in exe.compile_default().kernels if k.library is not None]
    want = {"weight": ("filter", "NHWC", "OHWI"), "input": ("data", "NHWC", "OHWI")}[kind]
    assert [(c.operation, c.layout if kind == "input" else c.gradient_layout, c.kernel_layout) for c in calls] == [want]
    expected = polyjit.compile(f, infos, {"target": "cpu"})(*arrays)
    np.testing.assert_allclose(run_threads_on_cpu(exe, arrays)[0], expected, rtol=1e-4, atol=1e-4)


WEIGHT_GRADIENTS = {  # name: (input shape, output channels, kernel, strides, padding, layout)
    "3x3": ((2, 8, 10, 9), 12, (3, 3), (1, 1), ((1, 1), (1, 1)), "NCHW"),
    "strided": ((2, 6, 10, 10), 8, (3, 3), (2, 2), ((1, 1), (1, 1)), "NCHW"),  # a tap more, cut after the call
    "1x1_strided": ((3, 16, 9, 9), 12, (1, 1), (2, 2), ((0, 0), (0, 0)), "NCHW"),
    "nhwc": ((2, 10, 9, 16), 24, (3, 3), (1, 1), ((1, 1), (0, 0)), "NHWC"),
}


@pytest.mark.parametrize("case", list(WEIGHT_GRADIENTS))
def test_weight_gradients_are_cudnns_backward_filter_thread_by_thread(case, rng, monkeypatch):
    """Where cuDNN loads, a weight gradient (a convolution whose images are the
    contraction) is one backward-filter call of the forward convolution,
    no im2col: equal to the CPU's weight gradient."""
    from polyjit.runtime import cublas, cudnn
    monkeypatch.setattr(cublas, "cublas", lambda: _HostCublas())
    monkeypatch.setattr(cudnn, "cudnn", lambda: True)
    xs, cout, k, strides, padding, layout = WEIGHT_GRADIENTS[case]
    sp = [xs[layout.index(c)] for c in "HW"]
    out = [(n + lo + hi - kk) // s + 1 for n, kk, s, (lo, hi) in zip(sp, k, strides, padding)]
    gs = (xs[0], cout, *out) if layout == "NCHW" else (xs[0], *out, cout)
    kernel_layout = "OIHW" if layout == "NCHW" else "HWIO"

    def f(x, g):
        return ops.mul(ops.conv_weight_grad(x, g, k, strides, padding, layout=layout, kernel_layout=kernel_layout), 2.0)
    arrays = [rng.standard_normal(s).astype(F32) for s in (xs, gs)]
    infos = [InputInfo(s, F32) for s in (xs, gs)]
    exe = polyjit.compile(f, infos, {**PTX_ONLY, "contractions": "library"})
    calls = [k.library.library for k in exe.compile_default().kernels if k.library is not None]
    assert [c.operation for c in calls] == ["filter"] and "_col[" not in exe.ir("affine")
    want = polyjit.compile(f, infos, {"target": "cpu"})(*arrays)
    np.testing.assert_allclose(run_threads_on_cpu(exe, arrays)[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", list(LIBRARY_CASES))
def test_library_steps_thread_by_thread(case, rng, monkeypatch):
    """The floor's plan without a GPU: im2col and epilogues as kernels, each
    contraction a library step (no PTX entry) whose cuBLAS calls (row-major
    through column-major, batched along the longest loop) run on host
    memory; the result is the convolution's or product's (cuDNN, where it
    loads, taken away: its convolutions are one call, tested above)."""
    from polyjit.runtime import cublas, cudnn
    monkeypatch.setattr(cublas, "cublas", lambda: _HostCublas())
    monkeypatch.setattr(cudnn, "cudnn", lambda: None)
    fn, shapes, ref = LIBRARY_CASES[case]
    arrays = [rng.standard_normal(s).astype(F32) for s in shapes]
    exe = polyjit.compile(lambda *a: ops.relu(fn(*a)), [InputInfo(s, F32) for s in shapes],
                          {**PTX_ONLY, "contractions": "library"})
    prog = exe.compile_default()
    steps = [k for k in prog.kernels if k.library is not None]
    assert exe.stats["library_calls"] == len(steps) >= 1
    assert all(f".entry {k.name}" not in exe.ir("ptx") for k in steps)
    assert any("library (forced)" in c for c in exe.stats["contractions"])
    got = run_threads_on_cpu(exe, arrays)[0]
    np.testing.assert_allclose(got, np.maximum(ref(*arrays), 0), rtol=1e-4, atol=1e-4)


def test_small_products_are_sums_fused_with_their_neighbours_thread_by_thread(rng):
    """A classifier head's product ([8, 64] x [64, 10] after a pooled mean)
    is a sum of products in the kernel that adds its bias (a thread per
    result), not a tiled kernel of its own; a relu under a 2x2 pooling at
    stride 2, which reads each element once, is computed in the pooling's
    sums. Small products batched, transposed, of one operand by itself and
    over two dims give numpy's results."""
    def head(x, w, b):
        pooled = ops.reduce_window("sum", ops.maximum(x, 0.0), [1, 2, 2, 1], [1, 2, 2, 1]) / 4.0
        return ops.matmul(ops.mean(pooled, [1, 2]), w) + b

    def products(a, b, c, d):
        return (ops.dot_general(a, b, ((2,), (1,)), ((0,), (0,))), ops.dot_general(c, c, ((1,), (1,))),
                ops.dot_general(c, d, ((0,), (0,))), ops.dot_general(a, a, ((0, 2), (0, 2))))
    x, w, b = (rng.standard_normal(s).astype(F32) for s in [(8, 16, 16, 64), (64, 10), (10,)])
    exe = polyjit.compile(head, [InputInfo(a.shape, F32) for a in (x, w, b)], PTX_ONLY)
    plans = exe.ir("mapping").splitlines()
    assert len(plans) == 2 and "sum_add" in plans[1] and "nest per thread" in plans[1], plans
    np.testing.assert_allclose(run_threads_on_cpu(exe, [x, w, b])[0], np.maximum(x, 0).mean((1, 2)) @ w + b,
                               rtol=1e-5, atol=1e-5)
    arrays = [rng.standard_normal(s).astype(F32) for s in [(3, 5, 7), (3, 7, 4), (6, 9), (6, 11)]]
    exe = polyjit.compile(products, [InputInfo(a.shape, F32) for a in arrays], PTX_ONLY)
    assert not any("tiled" in p for p in exe.ir("mapping").splitlines())
    a, b, c, d = arrays
    wants = (np.einsum("bij,bjk->bik", a, b), c @ c.T, c.T @ d, np.einsum("bij,bkj->ik", a, a))
    for got, want in zip(run_threads_on_cpu(exe, arrays), wants):
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-5, atol=1e-5)


def test_a_batch_of_heads_is_one_library_call(monkeypatch):
    """A product batched over images and heads ([b, h, t, d] @ [b, h, d, t])
    is one strided batched call of b * h matrices, the two loops' strides
    continuing each other, rather than a call per image; a batch whose
    operand is shared (a weight: stride 0 along both loops) joins too."""
    from polyjit.runtime import cublas
    monkeypatch.setattr(cublas, "cublas", lambda: _HostCublas())
    cases = [(LIBRARY_CASES["attention_heads"][0], [(2, 3, 20, 16), (2, 3, 24, 16)], 6),
             (ops.matmul, [(4, 5, 20, 16), (16, 24)], 20)]
    for fn, shapes, batch in cases:
        exe = polyjit.compile(fn, [InputInfo(s, F32) for s in shapes], {**PTX_ONLY, "contractions": "library"})
        prog = exe.compile_default()
        env = prog.bind([np.zeros(s, F32) for s in shapes])
        slots = {b.name: i for i, b in enumerate(prog.buffers)}
        steps = [cublas.GemmStep(cublas.cublas(), None, k.library, env, {b.name: b for b in prog.buffers}, slots)
                 for k in prog.kernels if k.library is not None]
        assert [[c.batch for c in st.calls] for st in steps] == [[batch]], steps


INPUT_GRADIENTS = {  # name: (input shape, output channels, kernel, strides, padding, layout)
    "3x3": ((2, 8, 14, 13), 12, (3, 3), (2, 2), (1, 1), "NCHW"),
    "1x1": ((3, 16, 9, 9), 12, (1, 1), (2, 2), (0, 0), "NCHW"),
    "5x5_stride3": ((2, 6, 17, 16), 8, (5, 5), (3, 3), (2, 2), "NCHW"),
    "nhwc": ((2, 10, 9, 16), 24, (3, 3), (2, 2), (1, 1), "NHWC"),
}


@pytest.mark.parametrize("case", list(INPUT_GRADIENTS))
def test_strided_input_gradients_are_cudnns_backward_data_thread_by_thread(case, rng, monkeypatch):
    """Where cuDNN loads, a strided convolution's input gradient is one
    backward-data call of the forward convolution on its kernel as it is
    (no flipped copy, no spread gradient, no im2col): equal to the CPU's,
    which convolves each phase of the result."""
    from polyjit.runtime import cublas, cudnn
    monkeypatch.setattr(cublas, "cublas", lambda: _HostCublas())
    monkeypatch.setattr(cudnn, "cudnn", lambda: True)
    xs, cout, k, strides, padding, layout = INPUT_GRADIENTS[case]
    sp = [xs[layout.index(c)] for c in "HW"]
    out = [(n + 2 * p - kk) // s + 1 for n, kk, s, p in zip(sp, k, strides, padding)]
    gs = (xs[0], cout, *out) if layout == "NCHW" else (xs[0], *out, cout)
    kernel_layout = "OIHW" if layout == "NCHW" else "OHWI"  # (cuDNN's filter formats)
    ws = (cout, xs[1], *k) if layout == "NCHW" else (cout, *k, xs[3])

    def f(g, w):
        return ops.mul(ops.conv_input_grad(g, w, sp, strides, [(p, p) for p in padding], layout=layout,
                                           kernel_layout=kernel_layout), 2.0)
    arrays = [rng.standard_normal(s).astype(F32) for s in (gs, ws)]
    infos = [InputInfo(s, F32) for s in (gs, ws)]
    exe = polyjit.compile(f, infos, PTX_ONLY)
    calls = [k.library.library for k in exe.compile_default().kernels if k.library is not None]
    affine = exe.ir("affine")
    assert [c.operation for c in calls] == ["data"] and calls[0].x[0] == "in1"
    assert "_col[" not in affine and "reverse" not in affine and exe.stats["kernels"] == 2
    want = polyjit.compile(f, infos, {"target": "cpu"})(*arrays)
    np.testing.assert_allclose(run_threads_on_cpu(exe, arrays)[0], want, rtol=1e-4, atol=1e-4)


def test_a_scatter_add_runs_a_thread_per_value_adding_atomically(rng):
    """A scatter-add (a max pool's gradient at its positions) has every loop
    in the grid, each value added where its position says with an atomic,
    rather than a thread per image and channel walking its values in order."""
    n, c, h, w = 2, 3, 8, 10
    pos = rng.integers(0, h * w, (n, c, 4, 5))
    grad = rng.standard_normal((n, c, 4, 5)).astype(F32)
    exe = polyjit.compile(lambda g, p: ops.positions_grad(g, p, [n, c, h, w], 2),
                          [InputInfo(grad.shape, F32), InputInfo(pos.shape, "int64")], PTX_ONLY)
    assert "scatter points: grid c0 x c1 x c2" in exe.ir("mapping") and "atom.global.add.f32" in exe.ir("ptx")
    want = np.zeros((n, c, h * w))
    for i in range(n):
        for j in range(c):
            np.add.at(want[i, j], pos[i, j].ravel(), grad[i, j].ravel())
    np.testing.assert_allclose(run_threads_on_cpu(exe, [grad, pos])[0].reshape(want.shape), want, rtol=1e-5,
                               atol=1e-5)


def test_an_embedding_gradient_adds_a_row_with_consecutive_threads(rng):
    """The rows of an embedding's gradient (index_add of a token's gradient
    row at its id) take consecutive threads along the row, whichever loop
    isl put innermost: a warp's atomics then fall in one row, where a
    thread per token walked down a column (the word embedding's gradient,
    4096 tokens into 30522 rows, took 124 us on an H200)."""
    ids = rng.integers(0, 50, 300)
    grad = rng.standard_normal((300, 96)).astype(F32)
    exe = polyjit.compile(lambda g, i: ops.scatter_add([50, 96], i, g), [InputInfo(grad.shape, F32),
                                                                       InputInfo(ids.shape, "int64")], PTX_ONLY)
    plan = next(line for line in exe.ir("mapping").splitlines() if "scatter points" in line)
    inner = re.search(r"grid (?:c\d x )*(c\d),", plan).group(1)
    ast = exe.ir("ast")  # (the target's zeroing, then the scatter over 300 tokens' rows of 96)
    assert re.search(rf"{inner} <= 95;", ast) and not re.search(rf"{inner} <= 299;", ast), (plan, ast)
    want = np.zeros((50, 96))
    np.add.at(want, ids, grad)
    np.testing.assert_allclose(run_threads_on_cpu(exe, [grad, ids])[0], want, rtol=1e-5, atol=1e-5)


def test_without_cublas_contractions_are_generated(monkeypatch):
    """No libcublas (POLYJIT_CUBLAS names none): the lookup is None, and even
    a forced library contraction compiles to generated kernels."""
    from polyjit.runtime import cublas
    monkeypatch.setenv("POLYJIT_CUBLAS", "/nonexistent/libcublas.so.13")
    cublas.reset()
    try:
        assert cublas.cublas() is None
        fn, shapes, _ = LIBRARY_CASES["3x3_padded"]
        exe = polyjit.compile(fn, [InputInfo(s, F32) for s in shapes], {**PTX_ONLY, "contractions": "library"})
        assert exe.stats["library_calls"] == 0 and all(k.library is None for k in exe.compile_default().kernels)
    finally:
        monkeypatch.delenv("POLYJIT_CUBLAS")
        cublas.reset()


def test_large_grids_sum_in_one_thread_each():
    """A depthwise convolution with an output for every quarter of the
    device's threads sums each window in one thread; a small grid (a column
    sum) still adds strips atomically."""
    big = polyjit.compile(lambda x, w: ops.conv(x, w, (1, 1), ((2, 2), (2, 2)), groups=576),
                          [InputInfo((32, 576, 7, 7), F32), InputInfo((576, 1, 5, 5), F32)], PTX_ONLY)
    assert "atom.global" not in big.ir("ptx") and not any(k.strips for k in big.compile_default().kernels)
    small = polyjit.compile(lambda x: ops.sum(x, [0]), [InputInfo((4096, 64), F32)], PTX_ONLY)
    assert "atom.global.add.f32" in small.ir("ptx")


def test_a_sum_into_a_few_rows_runs_along_the_columns(rng):
    """A scatter into two rows (BERT's token-type gradient), a sum per row
    whose terms are read along the columns: threads take the columns
    (coalesced), strips of the summed rows added atomically. The row ids,
    read alike by every column, do not make it a row per warp (whose lanes
    would read a column each, 3 KB apart)."""
    idx, src = rng.integers(0, 2, size=(300,)).astype(np.int64), rng.standard_normal((300, 40)).astype(F32)
    w = rng.standard_normal(300).astype(F32)  # (one more read along the rows alone)
    exe = polyjit.compile(lambda i, s, w: ops.scatter_add([2, 40], i, s * ops.reshape(w, [300, 1]), 0),
                          [InputInfo(a.shape, a.dtype) for a in (idx, src, w)], PTX_ONLY)
    assert exe.ir("mapping").splitlines()[-1].split(": ", 1)[1].startswith("atomic strips: grid c0 x c1"), \
        exe.ir("mapping")
    want = np.stack([(src * w[:, None])[idx == k].astype(np.float64).sum(0) for k in range(2)])
    np.testing.assert_allclose(run_threads_on_cpu(exe, [idx, src, w])[0], want, rtol=1e-4, atol=1e-4)


def test_a_windows_repeated_reads_reach_the_dataflow_analysis_once(monkeypatch):
    """A padded 5x5 depthwise window reads its input through 25 copies of one
    widened access (a clamped index is not affine); isl's dataflow analysis
    of the copies took 2 s a group in MobileNetV3, of one 0.05 s."""
    from polyjit.schedule import driver
    from polyjit.schedule.tree import isl_items
    pieces = []

    def spy(ctx, prog, dom):
        access = accesses(ctx, prog, dom)
        pieces.append(sum(m.n_basic_map() for m in isl_items(access[2].get_map_list())))
        return access
    accesses = driver.accesses
    monkeypatch.setattr(driver, "accesses", spy)
    fn = lambda x, w: ops.relu(ops.conv(ops.relu(x), w, (1, 1), ((2, 2), (2, 2)), groups=8))  # noqa: E731
    exe = polyjit.compile(fn, [InputInfo((2, 8, 9, 11), F32), InputInfo((8, 1, 5, 5), F32)],
                          {**PTX_ONLY, "cache": False})
    assert exe.ir("ptx") and pieces and max(pieces) < 25


def test_gpu_kernels_get_their_ptx_on_the_llvm_thread(monkeypatch):
    """Python emits the next kernels while LLVM makes each one's PTX on a thread of its own."""
    from polyjit.codegen import gpu_program, workers
    threads = []

    def spy(text, arch):
        threads.append(threading.current_thread().name)
        return ptx(text, arch)
    ptx = gpu_program.ptx
    monkeypatch.setattr(gpu_program, "ptx", spy)
    monkeypatch.setattr(workers, "_workers", workers.LlvmWorkers(0))  # no workers
    exe = polyjit.compile(lambda x: ops.softmax(ops.exp(x) * 3.0, -1) + 1.0, [InputInfo((40, 24), F32)],
                          {**PTX_ONLY, "cache": False, "fusion": "none"}).compile_default()
    assert exe.stats["kernels_compiled"] == len(threads) > 1
    assert all(t.startswith("polyjit-llvm") for t in threads)
    assert exe.ptx.count(".visible .entry") == len(exe.kernels)


def test_worker_processes_make_the_same_ptx(monkeypatch, llvm_workers):
    """Worker processes make the kernels' PTX (llvmlite runs one LLVM call
    at a time per process): the same PTX as the caller's LLVM thread; a
    worker that died hands its jobs back to it."""
    from polyjit.cache import ProcessCache
    from polyjit.codegen import gpu_program
    from polyjit.targets import nvgpu

    def build(count: int, kill: bool = False):
        # nothing shared with earlier compiles
        monkeypatch.setattr(gpu_program, "_codes", ProcessCache(gpu_program.CODE_CACHE))
        monkeypatch.setattr(nvgpu, "_programs", ProcessCache(nvgpu.GPU_PROGRAMS))
        pool = llvm_workers(count, kill)
        exe = polyjit.compile(lambda x, w: ops.softmax(ops.matmul(ops.exp(x), w), -1) * 2.0,
                              [InputInfo((40, 24), F32), InputInfo((24, 30), F32)],
                              {**PTX_ONLY, "cache": False, "contractions": "generated"}).compile_default()
        return exe, pool
    local, none = build(0)
    remote, served = build(2)
    assert none.served == 0 and served.served == remote.stats["kernels_compiled"] > 1
    assert remote.ptx == local.ptx and remote.ir["llvm_opt"] == local.ir["llvm_opt"]
    dead, pool = build(1, kill=True)
    assert dead.ptx == local.ptx and pool.served == 0 and not pool.procs


# ------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("n,m", [(1000, 1001), (1, 1), (33, 4097), (64, 1024)])
@pytest.mark.parametrize("name,fn,ref,shapes", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_numpy_on_the_gpu(name, fn, ref, shapes, n, m, rng):
    arrays = [rng.standard_normal(s).astype(F32) for s in shapes(n, m)]
    exe = polyjit.compile(fn, [InputInfo(a.shape, F32) for a in arrays], {"target": "nvgpu"})
    got = exe(*arrays)
    assert isinstance(got, np.ndarray)
    tol = 1e-4 if name in ("matmul", "sum_all", "column_sum", "nest_column_sum") else 1e-5
    np.testing.assert_allclose(got, ref(*arrays), rtol=tol, atol=tol * max(1, np.sqrt(n * m) / 30))


@pytest.mark.gpu
def test_a_programs_ptx_is_linked_on_threads_and_kept(rng, monkeypatch, tmp_path):
    """Where nvJitLink loads, a program's entries are linked in groups on
    several threads; the cubins go to the compile cache, so the same
    program loaded again links nothing. Results as numpy's either way."""
    from polyjit.runtime import cuda
    nv = cuda.jitlink()
    if nv is None:
        pytest.skip("no nvJitLink library")
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(tmp_path))
    links = []
    complete = nv.complete
    monkeypatch.setattr(nv, "complete", lambda h: links.append(h) or complete(h))

    def f(x, y):
        return ops.exp(x / ops.sum(x, [1], True)) @ ops.exp(y / ops.sum(y, [1], True)), ops.tanh(x) * 2.0
    x, y = rng.random((64, 48), dtype=F32) + 0.5, rng.random((48, 40), dtype=F32) + 0.5
    want = (np.exp(x / x.sum(1, keepdims=True)).astype(np.float64) @ np.exp(y / y.sum(1, keepdims=True)),
            np.tanh(x) * 2)
    made = []
    for _ in range(2):
        exe = polyjit.compile(f, [InputInfo(x.shape, F32), InputInfo(y.shape, F32)], {"target": "nvgpu"})
        for g, w in zip(exe(x, y), want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        made.append(len(links))
        assert exe.stats["kernels"] > 1
    assert made[0] > 1 and made[1] == made[0], made  # (linked in groups; the second time from the cache)


def _heads(k, b, s, h, d):
    """Attention's keys, heads split and transposed: [b*s, h*d] -> [b*h, d, s], scaled."""
    return ops.reshape(ops.permute(ops.reshape(k, [b, s, h, d]), [0, 2, 3, 1]) * 0.5, [b * h, d, s])


def test_transposing_copies_map_warps_to_tiles():
    """A copy whose stores and loads walk memory along different loops has
    each warp take a tile of both (whole sectors stored, half sectors
    loaded); sizes the tile does not divide keep a thread per point."""
    tiled = _mapping(lambda k: _heads(k, 2, 64, 3, 16), [(128, 48)])
    assert tiled == ["point per thread: grid c0 x c1 x c2, groups of 4 where aligned (1 access), "
                     "warps in 8x4 tiles of c2 x c1, stores deferred"]
    assert "tiles" not in _mapping(lambda k: _heads(k, 2, 60, 3, 6), [(120, 18)])[0]
    assert "tiles" not in _mapping(lambda x: ops.exp(x) * 2.0, [(64, 64)])[0]  # loads and stores agree


def test_stores_across_vector_loads_take_the_transposing_tile(rng):
    """A kernel whose loads could go in vector groups along one loop (NCHW
    operands) and whose stores walk another (an NHWC result) takes the
    warp tile instead: strided stores wrote a sector for each 4 bytes."""
    def f(a, b):
        return ops.permute(ops.relu(a) * b, [0, 2, 3, 1])
    shapes = [(4, 64, 16, 16)] * 2
    assert _mapping(f, shapes) == ["point per thread: grid c0 x c1 x c2 x c3, warps in 8x4 tiles of c2 x c3, "
                                   "stores deferred"]
    arrays = [rng.standard_normal(s).astype(F32) for s in shapes]
    exe = polyjit.compile(f, [InputInfo(s, F32) for s in shapes], PTX_ONLY)
    np.testing.assert_array_equal(run_threads_on_cpu(exe, arrays)[0],
                                  (np.maximum(arrays[0], 0) * arrays[1]).transpose(0, 2, 3, 1))


SMALL_SIDE_COPIES = {  # a transposing copy of a small contiguous block: a 3x3 filter's taps, an image's channels
    "weights_to_ohwi": ((24, 40, 3, 3), [0, 2, 3, 1], "c1 x c3"),
    "weights_to_oihw": ((24, 3, 3, 40), [0, 3, 1, 2], "c1 x c3"),
    "image_to_nhwc": ((2, 3, 20, 36), [0, 2, 3, 1], "c2"),
    "image_to_nchw": ((2, 20, 36, 3), [0, 3, 1, 2], "c2"),
}


@pytest.mark.parametrize("case", sorted(SMALL_SIDE_COPIES))
def test_a_transposing_copys_small_side_runs_whole_in_each_thread(case, rng):
    """Where one side of a transposing copy holds a small block contiguous
    (OIHW weights to OHWI, an RGB image to NHWC) and the other moves along
    a long loop, each thread copies the block whole, so that consecutive
    threads move along the long loop on both sides."""
    shape, order, whole = SMALL_SIDE_COPIES[case]
    f = lambda x: ops.permute(x, order)  # noqa: E731
    assert _mapping(f, [shape]) == [f"point per thread: grid c0 x c1 x c2 x c3, {whole} whole in each thread, "
                                    "stores deferred"]
    a = rng.standard_normal(shape).astype(F32)
    exe = polyjit.compile(f, [InputInfo(shape, F32)], PTX_ONLY)
    np.testing.assert_array_equal(run_threads_on_cpu(exe, [a])[0], a.transpose(order))
    assert "whole" not in _mapping(f, [(24, 16, 3, 3)])[0]  # (the other side is short too: no long loop)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(SMALL_SIDE_COPIES))
def test_small_side_copies_on_the_gpu(case, rng):
    shape, order, _ = SMALL_SIDE_COPIES[case]
    a = rng.standard_normal(shape).astype(F32)
    got = polyjit.compile(lambda x: ops.permute(x, order), [InputInfo(shape, F32)], {"target": "nvgpu"})(a)
    np.testing.assert_array_equal(got, a.transpose(order))


@pytest.mark.gpu
@pytest.mark.parametrize("b,s,h,d", [(2, 64, 3, 16), (2, 60, 3, 6), (3, 32, 2, 8), (1, 256, 12, 64)])
def test_transposing_copies_on_the_gpu(b, s, h, d, rng):
    k = rng.standard_normal((b * s, h * d)).astype(F32)
    got = polyjit.compile(lambda t: _heads(t, b, s, h, d), [InputInfo(k.shape, F32)], {"target": "nvgpu"})(k)
    want = (k.reshape(b, s, h, d).transpose(0, 2, 3, 1) * 0.5).reshape(b * h, d, s)
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["library", "generated"])
@pytest.mark.parametrize("case", list(LIBRARY_CASES))
def test_library_floor_on_the_gpu(case, mode, rng):
    """Each contraction forced to cuBLAS or to generated code gives the
    float64 reference's result within float32 rounding (cuBLAS's default
    math: no TF32); library calls are counted and allowed under strict."""
    fn, shapes, ref = LIBRARY_CASES[case]
    arrays = [rng.standard_normal(s).astype(F32) for s in shapes]
    exe = polyjit.compile(fn, [InputInfo(s, F32) for s in shapes],
                          {"target": "nvgpu", "contractions": mode, "strict": True})
    got = exe(*arrays)
    assert (exe.stats["library_calls"] >= 1) == (mode == "library") and exe.stats["fallbacks"] == 0
    np.testing.assert_allclose(got, ref(*arrays), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_generated_products_on_tensor_cores_keep_float32_precision(rng):
    """A generated product over 3072 terms, on tensor cores (3xTF32), within
    3e-6 of float64's largest output, as cuBLAS's float32 products are: TF32
    alone would be about 1e-3 off, and an mma chain summed whole drifted to 2e-5."""
    a = rng.standard_normal((512, 3072)).astype(F32)
    b = (rng.standard_normal((3072, 256)) * 0.05).astype(F32)
    exe = polyjit.compile(ops.matmul, [InputInfo(a.shape, F32), InputInfo(b.shape, F32)],
                          {"target": "nvgpu", "contractions": "generated"})
    if int(exe.compile_default().arch[3:].rstrip("a")) >= 80:
        assert "3xTF32 tensor cores" in exe.ir("mapping")
    want = a.astype(np.float64) @ b
    assert np.abs(exe(a, b) - want).max() <= 3e-6 * np.abs(want).max()


@pytest.mark.gpu
def test_torch_convolutions_and_products_through_the_gpu_libraries(monkeypatch):
    """On the GPU a convolution is one cuDNN call: equal to eager's in float32
    (TF32 off in both), near it with TF32 where torch allows eager's; a
    product reshaped on its way out is handed out as a view of its result."""
    torch = pytest.importorskip("torch")
    from polyjit.targets import target
    if not target("nvgpu").direct_convolutions():
        pytest.skip("no cuDNN here")
    x, w = torch.randn(4, 16, 20, 18, device="cuda"), torch.randn(24, 16, 3, 3, device="cuda")

    def f(x, w):
        return torch.relu(torch.nn.functional.conv2d(x, w, padding=1))
    for tf32, tol in ((False, 1e-5), (True, 5e-2)):  # (TF32: 10-bit products; cuDNN's algorithms differ by ~1e-2)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", tf32)
        torch._dynamo.reset()
        jf = polyjit.jit_torch(f, compile_options={"target": "nvgpu", "strict": True, "dynamic": False})
        got = jf(x, w)
        assert jf.stats["library_calls"] == 1 and jf.stats["fallbacks"] == 0
        torch.testing.assert_close(got, f(x, w), rtol=tol, atol=tol)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    a, b = torch.randn(8, 64, 96, device="cuda"), torch.randn(96, 80, device="cuda")

    def g(a, b):
        return (a.reshape(-1, 96) @ b).reshape(8, 64, 80)
    jg = polyjit.jit_torch(g, compile_options={"target": "nvgpu", "strict": True, "dynamic": False})
    got = jg(a, b)
    assert got.shape == (8, 64, 80) and jg.stats["library_calls"] == 1
    torch.testing.assert_close(got, g(a, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_column_sums_run_in_strips(dtype):
    """A half-precision bias gradient (a column sum, in float32, rounded
    after): rounding it in the sum's nest would keep a thread per column,
    so the sum runs in atomic strips and the rounding after it."""
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    exe = polyjit.compile(lambda x: ops.sum(x, [0]), [InputInfo([4096, 768], dt)], PTX_ONLY)
    plans = [line.split(": ", 1)[1] for line in exe.ir("mapping").splitlines()]
    assert any(p.startswith("atomic strips") for p in plans), plans


def test_half_products_are_cublas_calls(monkeypatch):
    """float16 products (autocast's) run in cuBLAS on the GPU (GemmEx on
    tensor cores, summed in float32); on the CPU they stay generated."""
    from polyjit.targets import nvgpu
    monkeypatch.setattr(nvgpu.NvgpuTarget, "library_available", lambda self: True)
    half = [InputInfo([256, 512], np.float16), InputInfo([512, 384], np.float16)]
    widened = lambda x: ops.cast(x, "float32")  # noqa: E731  (PyTorch's addmm and attention math compute so)
    for fn in (lambda a, b: ops.matmul(a, b), lambda a, b: ops.cast(ops.matmul(a, b), "float32") * 2.0,
               lambda a, b: ops.matmul(widened(a), widened(b)),
               lambda a, b: ops.matmul(widened(a) * 0.5, ops.permute(widened(ops.permute(b, [1, 0])) * 0.25, [1, 0]))):
        exe = polyjit.compile(fn, half, PTX_ONLY)
        calls = [k.library.library for k in exe.compile_default().kernels if k.library is not None]
        assert len(calls) == 1 and calls[0].dtype == "float16", exe.ir("mapping")
    assert polyjit.compile(lambda a, b: ops.matmul(a, b), half, {"target": "cpu"}).stats["library_calls"] == 0


def test_widened_half_products_read_the_halves_thread_by_thread(rng):
    """Layout ops and scalings by constants between half values' widening and
    a product (attention's math path scales q and k) move: the product reads
    the halves, the scale multiplies its result."""
    a = rng.standard_normal((2, 8, 16)).astype(np.float16)
    b = rng.standard_normal((2, 12, 16)).astype(np.float16)

    def f(a, b):
        return ops.matmul(ops.cast(a, "float32") * 0.5, ops.permute(ops.cast(b, "float32") * 0.75, [0, 2, 1]))
    exe = polyjit.compile(f, [InputInfo(a.shape, np.float16), InputInfo(b.shape, np.float16)],
                          {**PTX_ONLY, "contractions": "generated"})
    got = run_threads_on_cpu(exe, [a, b])[0]
    want = (a.astype(np.float64) * 0.5) @ (b.astype(np.float64) * 0.75).transpose(0, 2, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_products_under_autocast_on_the_gpu(dtype):
    """A network under torch.autocast: its products are cuBLAS calls in the
    half type, the rest fused around them, results within that type's
    rounding of eager's."""
    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                              torch.nn.Linear(256, 32)).cuda()
    x = torch.randn(128, 64, device="cuda")
    torch._dynamo.reset()
    jf = polyjit.jit_torch(net, compile_options={"target": "nvgpu", "dynamic": False})
    with torch.autocast("cuda", dtype=dt):
        got, want = jf(x), net(x)
    assert got.dtype == want.dtype == dt
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert jf.stats["fallbacks"] == 0 and jf.stats["library_calls"] >= 2
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda") for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ja = polyjit.jit_torch(sdpa, compile_options={"target": "nvgpu", "dynamic": False})
    with torch.autocast("cuda", dtype=dt):  # q k^T from the halves, the scale after it
        torch.testing.assert_close(ja(q, k, v).float(), sdpa(q, k, v).float(), rtol=2e-2, atol=2e-2)
    assert ja.stats["fallbacks"] == 0


@pytest.mark.gpu
def test_strided_convolution_and_max_pool_gradients_on_the_gpu(monkeypatch):
    """A strided convolution's input gradient (cuDNN's backward data) and a
    max pool's (atomic adds at its positions) equal eager's (TF32 off)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    x = torch.randn(4, 8, 29, 30, device="cuda", requires_grad=True)
    w = torch.randn(16, 8, 3, 3, device="cuda", requires_grad=True)

    def f(x, w):
        y = torch.nn.functional.conv2d(x, w, stride=2, padding=1)
        return torch.nn.functional.max_pool2d(y, 3, 2, 1)
    torch._dynamo.reset()
    jf = polyjit.jit_torch(f, compile_options={"target": "nvgpu", "strict": True, "dynamic": False})
    out = jf(x, w)
    r = torch.randn_like(out)
    got = torch.autograd.grad((out * r).sum(), (x, w))
    want = torch.autograd.grad((f(x, w) * r).sum(), (x, w))
    assert jf.stats["fallbacks"] == 0
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_library_floor_in_a_torch_network():
    """A small network of convolutions (3x3, strided 1x1, grouped, depthwise),
    batch norm, hardswish, a squeeze-excite pool and a classifier through
    torch.compile under strict: every contraction in the library (forced) or
    as auto chooses, results as eager's (TF32 off), on the caller's stream."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(3, 32, 3, 1, 1), nn.BatchNorm2d(32), nn.ReLU(),
                nn.Conv2d(32, 48, 1, 2), nn.BatchNorm2d(48), nn.Hardswish(),
                nn.Conv2d(48, 48, 3, 1, 1, groups=4), nn.ReLU(),
                nn.Conv2d(48, 48, 5, 1, 2, groups=48), nn.BatchNorm2d(48), nn.Hardswish())
            self.fc = nn.Linear(48, 37)

        def forward(self, x):
            y = self.body(x)
            return self.fc(y.mean((2, 3))), y

    net = Net().cuda().eval()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    x = torch.randn(4, 3, 23, 19, device="cuda")
    with torch.no_grad():
        want = net(x)
        for mode in ("library", "auto"):
            torch._dynamo.reset()
            stats = polyjit.frontends.torch.stats(reset=True)
            got = torch.compile(net, backend="polyjit", options={"contractions": mode, "strict": True})(x)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            assert stats["fallbacks"] == 0 and stats["library_calls"] >= (4 if mode == "library" else 1)
    polyjit.cuda_synchronize()


@pytest.mark.gpu
def test_repeated_calls_replay_a_cuda_graph_with_new_data():
    """Calls handing the launcher the same pointers replay a captured CUDA
    graph (from the second such call on); each computes from the data the
    arrays hold now, and new arrays run the steps directly, as correctly.
    A result returned twice (as training graphs return activations) is one
    array, and does not keep the program off the native launcher."""
    torch = pytest.importorskip("torch")
    torch.backends.cuda.matmul.allow_tf32 = False

    def f(x, w):
        y = ops.softmax(ops.relu(ops.matmul(x, w)) * 0.5)
        return y, y
    exe = polyjit.compile(f, [InputInfo([64, 96], F32), InputInfo([96, 80], F32)],
                          {"target": "nvgpu", "contractions": "library", "strict": True})
    x, w = torch.empty(64, 96, device="cuda"), torch.randn(96, 80, device="cuda")
    for _ in range(5):
        x.copy_(torch.randn(64, 96, device="cuda"))
        got, again = exe(x, w)
        assert got is again
        got = torch.as_tensor(got, device="cuda")
        torch.testing.assert_close(got, torch.softmax(torch.relu(x @ w) * 0.5, -1), rtol=1e-5, atol=1e-6)
        del got, again
    stats = exe.compile_default().stats
    assert stats["library_calls"] == 1 and stats.get("cuda_graph_replays", 0) >= 2
    y = torch.randn(64, 96, device="cuda")
    torch.testing.assert_close(torch.as_tensor(exe(y, w)[0], device="cuda"),
                               torch.softmax(torch.relu(y @ w) * 0.5, -1), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["exp", "erf", "tanh", "sigmoid"])
def test_special_function_unit_math_is_within_a_few_ulp(name):
    """exp (ex2.approx after an exact reduction by ln 2) and sigmoid stay
    within 4 ulp of float64 over their whole range, erf and tanh (their
    denominators divided approximately) within 8; NaN, infinities and
    zeros as numpy's."""
    import math
    refs_ = {"exp": np.exp, "erf": np.vectorize(math.erf), "tanh": np.tanh, "sigmoid": lambda v: 1 / (1 + np.exp(-v))}
    special = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, 3e-4, 88.72, 88.73, -87.3, -103.9, -104.5]
    x = np.concatenate([np.linspace(-110, 95, 200001), special]).astype(F32)
    got = polyjit.compile(getattr(ops, name), [InputInfo(x.shape, F32)], {"target": "nvgpu"})(x)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = refs_[name](x.astype(np.float64))
    ref32 = ref.astype(F32)
    normal = np.isfinite(ref32) & (np.abs(ref32) >= np.finfo(F32).tiny)
    ulps = np.abs(got[normal] - ref[normal]) / np.spacing(np.abs(ref32[normal]))
    assert ulps.max() <= (8 if name in ("erf", "tanh") else 4), (name, ulps.max(), x[normal][np.argmax(ulps)])
    kept = ~((ref32 != 0) & (np.abs(ref32) < np.finfo(F32).tiny))  # (1 / (1 + inf) is 0 where eager's is too)
    for test in (np.isnan, np.isposinf, np.isneginf, lambda v: v == 0):
        np.testing.assert_array_equal(test(got)[kept], test(ref32)[kept])


@pytest.mark.gpu
def test_nan_and_inf_propagate():
    x = np.array([[1.0, np.nan, 2.0], [np.inf, -np.inf, 0.5]], F32)
    exe = polyjit.compile(lambda x: ops.exp(x) + ops.sum(x, [1], True), [InputInfo([2, 3], F32)], {"target": "nvgpu"})
    with np.errstate(invalid="ignore"):
        want = np.exp(x) + x.sum(1, keepdims=True)
    np.testing.assert_array_equal(exe(x), want)


@pytest.mark.gpu
def test_torch_tensors_stay_on_the_gpu():
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 517, 301, device="cuda")
    jf = polyjit.jit_torch(_torch_blur, compile_options={"target": "nvgpu"})
    out = jf(x)
    assert out.device == x.device
    torch.testing.assert_close(out, _torch_blur(x), rtol=1e-5, atol=1e-5)
    assert jf.stats["fallbacks"] == 0 and jf.stats["kernels"] == 1
    polyjit.cuda_synchronize()


@pytest.mark.gpu
def test_torch_strided_views_are_read_in_place():
    """A view with strides (a vector's every other element, a matrix's
    columns) runs as it is on the GPU: eager's values, no error, nothing
    falls back."""
    torch = pytest.importorskip("torch")
    x = torch.randn(12, 10, device="cuda")
    for view in (x[0, ::2], x[:, ::3], x.t()):
        jf = polyjit.jit_torch(lambda a: a * 2 + 1, compile_options={"target": "nvgpu", "strict": True})
        torch.testing.assert_close(jf(view), view * 2 + 1, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_torch_results_are_where_the_trace_puts_them():
    """A graph of no GPU inputs whose results the trace puts on the GPU (a
    mask built from sizes, before a graph break) hands them out there; a
    host scalar moved to the GPU inside a graph (a model's
    ``torch.tensor(window).to(device)``) compiles: 0 fallbacks, eager's values."""
    torch = pytest.importorskip("torch")

    class Masked(torch.nn.Module):
        def __init__(self, window):
            super().__init__()
            self.window = window  # (on the host: not a buffer, .cuda() leaves it)

        def forward(self, x):
            n = x.shape[-1]
            mask = torch.ones(n, n, device=x.device, dtype=torch.bool).tril()
            torch._dynamo.graph_break()
            return x.masked_fill(~mask, 0.0) * self.window.to(x.device)
    x = torch.randn(2, 5, 5, device="cuda")
    polyjit.frontends.torch.stats(reset=True)
    model = Masked(torch.tensor(3.0)).cuda()
    out = torch.compile(model, backend="polyjit")(x)
    assert out.device == x.device
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
    assert polyjit.frontends.torch.stats()["fallbacks"] == 0


def _training_steps(torch, steps: int = 3, device: str = "cuda"):
    """Three steps' (x, w, eager's copies of them, a random projection r):
    w kept across steps (its .grad reset after each), x fresh."""
    w = torch.randn(64, 48, device=device, requires_grad=True)
    for _ in range(steps):
        x = torch.randn(16, 64, device=device, requires_grad=True)
        yield x, w, x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_(), \
            torch.randn(16, 48, device=device)
        w.grad = None


@pytest.mark.gpu
def test_torch_calls_with_the_same_layouts_run_the_bound_plan(monkeypatch):
    """A graph called again with inputs of the last call's shapes, strides,
    dtypes and device (a training loop) runs the plan that call chose,
    without checks or lookups, on the new tensors: forward and backward."""
    torch = pytest.importorskip("torch")
    from polyjit.runtime.gpu_program import GpuProgram
    bound, run_bound = [], GpuProgram.run_bound
    monkeypatch.setattr(GpuProgram, "run_bound", lambda self, *a: bound.append(1) or run_bound(self, *a))

    def f(x, w):
        return torch.softmax(x @ w, -1) * torch.tanh(x[:, :48])
    jf = polyjit.jit_torch(f, compile_options={"target": "nvgpu", "dynamic": False, "strict": True})
    for x, w, x2, w2, r in _training_steps(torch):
        (jf(x, w) * r).sum().backward()
        want = f(x2, w2)
        (want * r).sum().backward()
        torch.testing.assert_close(jf(x, w), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)
    assert len(bound) >= 4 and jf.stats["fallbacks"] == 0


@pytest.mark.gpu
def test_tensors_saved_for_the_backward_share_one_allocation(monkeypatch):
    """A training graph's outputs that only its backward reads are views of
    one block; what the caller sees is its own tensor, which it may modify in
    place before the backward as in eager."""
    torch = pytest.importorskip("torch")
    import polyjit.frontends.torch as pt
    shared, call = [], pt._Outputs.__call__

    def counted(self, specs):
        addresses, tensors = call(self, specs)

        def made():  # after the launch: the tensors lie where the kernels wrote
            out = tensors()
            assert [t.data_ptr() for t in out] == list(addresses)
            bases = [t.untyped_storage().data_ptr() for t in out]
            shared.append(max(bases.count(b) for b in bases))
            return out
        return addresses, made
    monkeypatch.setattr(pt._Outputs, "__call__", counted)

    def f(x, w):
        return torch.softmax(x @ w, -1) * torch.tanh(x[:, :48]) + torch.sigmoid(x[:, 16:]).exp()
    jf = polyjit.jit_torch(f, compile_options={"target": "nvgpu", "dynamic": False, "strict": True})
    for x, w, x2, w2, r in _training_steps(torch):
        got, want = jf(x, w), f(x2, w2)
        got.mul_(r)
        want.mul_(r)
        got.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)
    assert shared and max(shared) >= 2 and jf.stats["fallbacks"] == 0


def _torch_blur(img):
    bx = (img[:, :, 0:-4] + img[:, :, 1:-3] + img[:, :, 2:-2] + img[:, :, 3:-1] + img[:, :, 4:]) * 0.2
    return (bx[:, 0:-4] + bx[:, 1:-3] + bx[:, 2:-2] + bx[:, 3:-1] + bx[:, 4:]) * 0.2


@pytest.mark.gpu
def test_mixed_placement_names_the_arguments():
    torch = pytest.importorskip("torch")
    exe = polyjit.compile(lambda a, b: a + b, [InputInfo([4], F32)] * 2, {"target": "nvgpu"})
    with pytest.raises(InputError, match=r"inputs \[0\] are on the GPU but inputs \[1\]"):
        exe(torch.ones(4, device="cuda"), np.ones(4, F32))


@pytest.mark.gpu
def test_jax_arrays_on_the_gpu():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU here")
    f = polyjit.jit_jax(lambda x, w, b: (jax.nn.softmax(x, -1) * w + b, jnp.cos(x).sum(0)),
                        compile_options={"target": "nvgpu"})
    x = jax.random.normal(jax.random.key(int.from_bytes(os.urandom(2), "little")), (64, 300))
    w, b = jnp.linspace(0, 1, 300), jnp.ones(300)
    out = f(x, w, b)
    want = (jax.nn.softmax(x, -1) * w + b, jnp.cos(x).sum(0))
    for o, r in zip(out, want):
        assert isinstance(o, jax.Array) and o.devices() == x.devices()
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-5, atol=1e-5)
    assert f.stats["fallbacks"] == 0


@pytest.mark.gpu
def test_results_handed_to_jax_stay_valid_while_memory_is_reused():
    """JAX reads results on its own stream, ordered after the kernels that wrote
    them; polyjit frees them after JAX's reads, not before."""
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU here")
    f = polyjit.jit_jax(lambda x, k: jax.numpy.cos(x) * k, compile_options={"target": "nvgpu"})
    x = jax.random.normal(jax.random.key(int.from_bytes(os.urandom(2), "little")), (4096, 4096))
    sums = [jax.numpy.sum(f(x, float(k)) + 1.0) for k in range(12)]  # each result dropped after one use
    base = float(jax.numpy.sum(jax.numpy.cos(x)))
    for k, got in enumerate(sums):
        np.testing.assert_allclose(float(got), base * k + 4096 * 4096, rtol=1e-4)
    assert f.stats["fallbacks"] == 0


@pytest.mark.gpu
def test_jax_programs_run_as_xla_custom_calls():
    """With every argument a JAX array on the GPU, a program runs as an XLA
    custom call inside a jitted function: its kernels on XLA's stream, its
    results written into XLA's buffers (which the suite poisons first).
    Several results (a layer norm's gradients), and results of earlier calls
    read after later ones, match XLA's. A call with a Python number still
    hands its result over by DLPack (registering the target once changed
    the argument types of ctypes' shared PyCapsule_New under it); a call
    with host arrays first does not keep a later GPU call of the same
    signature from the custom call."""
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU here")
    jnp = jax.numpy

    def ln(x, w, b):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(v + 1e-5) * w + b
    grad = jax.grad(lambda *a: ln(*a).sum(), argnums=(0, 1, 2))
    f = polyjit.jit_jax(grad, compile_options={"target": "nvgpu"})
    keys = jax.random.split(jax.random.key(int.from_bytes(os.urandom(2), "little")), 3)
    x, w, b = jax.random.normal(keys[0], (64, 1000)), jax.random.normal(keys[1], (1000,)), \
        jax.random.normal(keys[2], (1000,))
    outs = [f(x * k, w, b) for k in (1.0, 2.0, 3.0)]
    assert [c for c in f._calls.values() if c is not None]
    for k, got in zip((1.0, 2.0, 3.0), outs):
        for g, r in zip(got, jax.jit(grad)(x * k, w, b)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)
    assert f.stats["fallbacks"] == 0
    scaled = polyjit.jit_jax(lambda a, k: a * k, compile_options={"target": "nvgpu"})
    np.testing.assert_allclose(np.asarray(scaled(x, 2.0)), np.asarray(x) * 2, rtol=1e-6)
    tripled = polyjit.jit_jax(lambda a: a * 3, compile_options={"target": "nvgpu"})
    np.testing.assert_allclose(np.asarray(tripled(np.asarray(x))), np.asarray(x) * 3, rtol=1e-6)  # host: no custom call
    np.testing.assert_allclose(np.asarray(tripled(x)), np.asarray(x) * 3, rtol=1e-6)  # same signature, on the GPU
    assert [c for c in tripled._calls.values() if c is not None]


@pytest.mark.gpu
def test_jax_custom_calls_with_library_products_replay_as_graphs():
    """A call from Python is a graph of one command that XLA captures and
    replays; cuBLAS is given a workspace (its own allocation cannot be held
    in a graph: XLA fails the call). Fresh arrays at each call, so graphs
    are captured again, and the call inside a caller's jit beside other
    work: all match float64."""
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU here")

    def mlp(x, w1, w2):
        return jax.nn.gelu(x @ w1) @ w2

    def reference(x, w1, w2):
        h = np.asarray(x, np.float64) @ np.asarray(w1, np.float64)
        return 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3))) @ np.asarray(w2, np.float64)
    f = polyjit.jit_jax(mlp, compile_options={"target": "nvgpu", "matmul_tf32": False})  # (float64's tolerance)
    keys = jax.random.split(jax.random.key(int.from_bytes(os.urandom(2), "little")), 3)
    x, w1, w2 = (jax.random.normal(k, s) / s[0] ** 0.5 for k, s in zip(keys, ((256, 192), (192, 384), (384, 192))))
    for k in (1.0, -2.0, 0.5, 1.0):
        np.testing.assert_allclose(np.asarray(f(x * k, w1, w2)), reference(x * k, w1, w2), rtol=1e-4, atol=1e-5)
    assert f.stats["fallbacks"] == 0 and f.stats["library_calls"] >= 2
    outer = jax.jit(lambda x, w1, w2: jax.numpy.tanh(f(x, w1, w2)).sum(0) * 2 + 1)
    for _ in range(3):
        np.testing.assert_allclose(np.asarray(outer(x, w1, w2)), np.tanh(reference(x, w1, w2)).sum(0) * 2 + 1,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_jax_transformations_stage_custom_calls_on_the_gpu():
    """Under jax.jit, jax.grad and vmap on the GPU, a polyjit function and its
    compiled VJP are XLA custom calls (no callback through the host) and
    match XLA's gradients, also where two gradients are one array (x and r
    in x + r)."""
    jax = pytest.importorskip("jax")
    if jax.devices()[0].platform != "gpu":
        pytest.skip("JAX has no GPU here")

    def ln(x, r, w, b):
        y = x + r
        m = y.mean(-1, keepdims=True)
        v = ((y - m) ** 2).mean(-1, keepdims=True)
        return (y - m) * jax.lax.rsqrt(v + 1e-5) * w + b
    f = polyjit.jit_jax(ln, compile_options={"target": "nvgpu"})
    keys = jax.random.split(jax.random.key(int.from_bytes(os.urandom(2), "little")), 5)
    x, r, ct = (jax.random.normal(k, (64, 300)) for k in keys[:3])
    w, b = jax.random.normal(keys[3], (300,)), jax.random.normal(keys[4], (300,))
    grad = jax.jit(jax.value_and_grad(lambda *a: (f(*a) * ct).sum(), argnums=(0, 1, 2, 3)))
    text = grad.lower(x, r, w, b).as_text()
    assert text.count("polyjit_") >= 2 and "callback" not in text  # the function's call and its VJP's
    want = jax.jit(jax.value_and_grad(lambda *a: (ln(*a) * ct).sum(), argnums=(0, 1, 2, 3)))(x, r, w, b)
    got = grad(x, r, w, b)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-2)
    for g, ref in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-4, atol=1e-4)
    batched = jax.jit(jax.vmap(f, in_axes=(0, 0, None, None)))(x.reshape(4, 16, 300), r.reshape(4, 16, 300), w, b)
    np.testing.assert_allclose(np.asarray(batched).reshape(64, 300), np.asarray(ln(x, r, w, b)), rtol=1e-5,
                               atol=1e-5)
    assert f.stats["fallbacks"] == 0


def _two_gpus():
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    return torch


@pytest.mark.gpu
def test_tensors_on_the_second_gpu_run_there():
    torch = _two_gpus()
    x = torch.randn(3, 300, 257, device="cuda:1")
    jf = polyjit.jit_torch(_torch_blur, compile_options={"target": "nvgpu"})
    out = jf(x)
    assert out.device == x.device
    torch.testing.assert_close(out, _torch_blur(x), rtol=1e-5, atol=1e-5)
    exe = polyjit.compile(lambda a: ops.softmax(a, -1), [InputInfo([64, 1024], F32)], {"target": "nvgpu"})
    for dev in ("cuda:1", "cuda:0", "cuda:1"):  # the device found from each call's pointers
        y = torch.randn(64, 1024, device=dev)
        got = torch.as_tensor(exe(y))  # a DeviceBuffer, seen through its CUDA array interface
        assert got.device == y.device
        torch.testing.assert_close(got, torch.softmax(y, -1), rtol=1e-5, atol=1e-6)
    polyjit.cuda_synchronize()


@pytest.mark.gpu
def test_inputs_on_two_gpus_name_the_arguments():
    torch = _two_gpus()
    exe = polyjit.compile(lambda a, b: a + b, [InputInfo([4], F32)] * 2, {"target": "nvgpu"})
    with pytest.raises(InputError, match=r"several GPUs \(\{0: \[0\], 1: \[1\]\}\)"):
        exe(torch.ones(4, device="cuda:0"), torch.ones(4, device="cuda:1"))


def test_squeeze_excite_is_not_one_thread_per_image():
    """A squeeze-excite block (a global sum, two small products, a scale of
    the whole input) fused into one nest left a thread per image (32 threads
    for 1.6M elements, 4.9 ms on the H100): the sum and the scale run as
    kernels of their own."""
    def se(x, w1, w2):
        s = ops.sum(x, [2, 3], keepdim=True) / 3136.0
        h = ops.relu(ops.conv(s, w1, [1, 1], [(0, 0), (0, 0)]))
        return x * ops.sigmoid(ops.conv(h, w2, [1, 1], [(0, 0), (0, 0)]))
    exe = polyjit.compile(se, [InputInfo([32, 16, 56, 56], F32), InputInfo([8, 16, 1, 1], F32),
                               InputInfo([16, 8, 1, 1], F32)], PTX_ONLY)
    prog = exe.compile_default()
    sums = [k for k in prog.kernels if any(s in k.statements for s in ("S1",))]
    assert prog.stats["kernels"] >= 3 and len(sums) == 1 and len(sums[0].statements) <= 3, \
        [k.statements for k in prog.kernels]


def test_a_depthwise_gradient_fused_with_its_producer_keeps_the_grid():
    """A 5x5 depthwise convolution's input gradient between a batch norm's
    gradient and a hardswish's (MobileNetV3-small's backward, 32x240x14x14):
    fused through a buffer contracted to a thread's rows, it ran a thread
    per image and channel, 7680 threads for 1.5 million points, the largest
    kernels of the training step. Kept apart, each runs a thread per point."""
    def grad(g, x, m, w, y):
        a = (g - (x - m) * 0.5) * m  # a batch norm's gradient
        c = ops.conv(a, w, [1, 1], [[2, 2], [2, 2]], [1, 1], 240)
        return ops.where(y < 3.0, c * (y / 3.0 + 0.5), c)
    plans = _mapping(grad, [(32, 240, 14, 14), (32, 240, 14, 14), (1, 240, 1, 1), (240, 1, 5, 5), (32, 240, 14, 14)])
    assert not any(p.startswith(("nest per thread", "one thread")) for p in plans), plans


def test_a_channels_last_image_mean_read_in_its_kernel_sums_in_strips():
    """A squeeze-excite's mean over channels-last 14x14 images, scaled in
    the same nest, ran a thread per image and channel, 196 values each: the
    sum runs in strips of its own kernel, the scaling after it."""
    plans = _mapping(lambda x: x * ops.sigmoid(ops.mean(x, [1, 2], True)), [(32, 14, 14, 240)])
    assert any(p.startswith("atomic strips") for p in plans), plans
    assert not any(p.startswith(("nest per thread", "one thread")) for p in plans), plans


def test_a_first_token_read_beside_its_producer_keeps_the_grid_over_symbolic_sizes():
    """A layer norm over [b, s, e] whose first token is also read (BERT's
    pooler), under symbolic sizes: fused into one nest, the token's copy
    left a thread per sequence position, the batch walked in each. The
    cost model weighs symbolic sizes at their estimates and undoes the
    fusion."""
    def norm_and_first(x, w, b):
        y = ops.layer_norm(x, [256], w, b, 1e-12)
        return y, ops.reshape(y[:, :1], [x.shape[0], 256])
    plans = _mapping(norm_and_first, [(-1, -1, 256), (256,), (256,)])
    assert not any(p.startswith(("nest per thread", "one thread")) for p in plans), plans


def test_rows_read_through_gathers_take_a_warp_each():
    """An embedding's rows normalized (BERT's first layer norm) reduce over
    768 values a row: a warp per row, whatever the gather indices' loads
    (counted once each, they outnumbered the row's own accesses: one thread
    per row, 0.43 ms on the H100 against 0.07 for eager's whole layer norm)."""
    def embed_norm(ids, pos, table, ptable, w, b):
        x = ops.index_select(table, 0, ops.reshape(ids, [-1])) + ops.index_select(ptable, 0, ops.reshape(pos, [-1]))
        return ops.layer_norm(x, [768], w, b, 1e-12)
    exe = polyjit.compile(embed_norm, [InputInfo([4096], np.int64), InputInfo([4096], np.int64),
                                       InputInfo([3000, 768], F32), InputInfo([512, 768], F32),
                                       InputInfo([768], F32), InputInfo([768], F32)], PTX_ONLY)
    prog = exe.compile_default()
    rows = [k for k in prog.kernels if "sum" in k.name]
    assert rows and all(k.lanes >= 32 for k in rows), [(k.name, k.lanes) for k in prog.kernels]


@pytest.mark.parametrize("tokens,computed", [(16, False), (512, False), (512, True)])
def test_attention_over_a_projections_heads_is_one_library_call(tokens, computed, monkeypatch):
    """Heads viewed out of [b, t, h*d] projections (as they are, or with a
    bias added) have batch strides that do not continue each other: read
    in place, a call per image or per head. The operands are copied so
    that the batch is one call of b*h matrices, small or large (BERT's
    attention and its gradients as 12 calls a product took twice the time)."""
    from polyjit.runtime import cublas
    monkeypatch.setattr(cublas, "cublas", lambda: _HostCublas())
    b, h, d = 2, 4, 32

    def heads(x):
        return ops.permute(ops.reshape(x * 2.0 if computed else x, [b, tokens, h, d]), [0, 2, 1, 3])
    shapes = [(b, tokens, h * d)] * 2
    exe = polyjit.compile(lambda q, k: ops.matmul(heads(q), ops.transpose(heads(k), 2, 3)),
                          [InputInfo(s, F32) for s in shapes], {**PTX_ONLY, "contractions": "library"})
    prog = exe.compile_default()
    env = prog.bind([np.zeros(s, F32) for s in shapes])
    slots = {x.name: i for i, x in enumerate(prog.buffers)}
    steps = [cublas.GemmStep(cublas.cublas(), None, k.library, env, {x.name: x for x in prog.buffers}, slots)
             for k in prog.kernels if k.library is not None]
    assert [[c.batch for c in st.calls] for st in steps] == [[b * h]], steps
    q, k = (np.random.default_rng(0).standard_normal(s).astype(F32) for s in shapes)
    qh, kh = ((x * (2 if computed else 1)).reshape(b, tokens, h, d).transpose(0, 2, 1, 3).astype(np.float64)
              for x in (q, k))
    np.testing.assert_allclose(run_threads_on_cpu(exe, [q, k])[0], qh @ kh.transpose(0, 1, 3, 2), rtol=1e-4,
                               atol=1e-4)
