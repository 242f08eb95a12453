"""Fusion, contraction and their legality, asserted through compile stats."""
import os
import re

import numpy as np
import pytest

import polyjit
from polyjit import DataType, FusionDefinition, InputInfo, ops

import refs

F32 = np.float32
GEN = {"contractions": "generated"}  # the generated loop nests these tests look at, not the library floor


def blur(img):
    k = ops.reshape(ops.full_like(img[0:1, 0:1, 0:5], 0.2), [1, 1, 1, 5])
    x = ops.reshape(img, [img.shape[0], 1, img.shape[1], img.shape[2]])
    y = ops.conv2d(ops.conv2d(x, k), ops.reshape(k, [1, 1, 5, 1]))
    return ops.reshape(y, [y.shape[0], y.shape[2], y.shape[3]])


@pytest.mark.parametrize("shape", [(3, 64, 80), (2, 37, 1001), (1, 9, 12), (3, 9, 300)])
def test_blur_is_one_nest_without_full_intermediate(shape, rng):
    img = rng.random(shape, dtype=F32)
    exe = polyjit.compile(blur, [InputInfo(list(shape), F32)], {"num_threads": 2})  # a buffer per thread
    out = exe(img)
    np.testing.assert_allclose(out, refs.blur(img.astype(np.float64)), rtol=1e-5, atol=1e-6)
    assert exe.stats["kernels"] == 1
    assert exe.stats["statements"] == 2 and exe.stats["fused"] == 1
    assert exe.stats["contracted_buffers"] == 1
    full_intermediate = shape[0] * shape[1] * (shape[2] - 4) * 4
    assert exe.stats["intermediate_bytes"] < full_intermediate / 2 or shape[1] < 12


def test_large_blur_streams_its_output(rng):
    """Rows of a large output are written with streaming stores from their first
    64-byte boundary (odd widths start each row elsewhere); small outputs are not."""
    img = rng.random((3, 1030, 1029), dtype=F32)
    exe = polyjit.compile(blur, [InputInfo(list(img.shape), F32)], {"num_threads": 2})
    np.testing.assert_allclose(exe(img), refs.blur(img.astype(np.float64)), rtol=1e-5, atol=1e-6)
    assert "!nontemporal" in exe.ir("llvm_opt")
    small = polyjit.compile(blur, [InputInfo([3, 64, 80], F32)])
    assert "!nontemporal" not in small.ir("llvm_opt")
    nhwc = polyjit.compile(lambda x: ops.reshape(blur(x), [3, 1026, 1025, 1]), [InputInfo(list(img.shape), F32)])
    np.testing.assert_allclose(nhwc(img)[..., 0], refs.blur(img.astype(np.float64)), rtol=1e-5, atol=1e-6)
    assert "!nontemporal" in nhwc.ir("llvm_opt")  # a unit channel after the row keeps it contiguous


@pytest.mark.parametrize("shape", [(1, 5, 5), (1, 6, 5), (2, 5, 40)])
def test_blur_tiny(shape, rng):
    img = rng.random(shape, dtype=F32)
    exe = polyjit.compile(blur, [InputInfo(list(shape), F32)])
    np.testing.assert_allclose(exe(img), refs.blur(img.astype(np.float64)), rtol=1e-5, atol=1e-6)


def test_blur_symbolic_sizes_one_program(rng):
    exe = polyjit.compile(blur, [InputInfo([3, -1, -1], F32)])
    for h, w in [(20, 30), (64, 257), (7, 9)]:
        img = rng.random((3, h, w), dtype=F32)
        np.testing.assert_allclose(exe(img), refs.blur(img.astype(np.float64)), rtol=1e-5, atol=1e-6)
    assert len(exe._variants) == 1 and exe.stats["kernels"] == 1


def test_blur_unfused_with_fusion_none(rng):
    img = rng.random((2, 40, 50), dtype=F32)
    exe = polyjit.compile(blur, [InputInfo(list(img.shape), F32)], {"fusion": "none"})
    np.testing.assert_allclose(exe(img), refs.blur(img.astype(np.float64)), rtol=1e-5, atol=1e-6)
    assert exe.stats["kernels"] == 2 and exe.stats["contracted_buffers"] == 0


def add_layernorm(x, r, w, b):
    return ops.layer_norm(x + r, [x.shape[-1]], w, b)


def test_layernorm_is_one_pass_per_row(rng):
    shape = (4, 33, 256)
    x, r = rng.standard_normal(shape, dtype=F32), rng.standard_normal(shape, dtype=F32)
    w, b = rng.standard_normal(256, dtype=F32), rng.standard_normal(256, dtype=F32)
    exe = polyjit.compile(add_layernorm, [InputInfo(list(shape), F32)] * 2 + [InputInfo([256], F32)] * 2)
    out = exe(x, r, w, b)
    want = refs.layer_norm((x + r).astype(np.float64)) * w + b
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    assert exe.stats["kernels"] == 1
    assert exe.stats["contracted_buffers"] >= 2  # mean and variance live in registers per row
    assert exe.stats["intermediate_bytes"] <= 256 * 4 * 3 * exe.variant((False,) * 4).num_threads


def test_softmax_one_nest(rng):
    x = rng.standard_normal((64, 300), dtype=F32)
    exe = polyjit.compile(ops.softmax, [InputInfo([-1, -1], F32)])
    np.testing.assert_allclose(exe(x), refs.softmax(x.astype(np.float64)), rtol=1e-5, atol=1e-7)
    assert exe.stats["kernels"] == 1


def test_fusion_that_must_not_happen(rng):
    """A full reduction feeds back into every element: it must complete first."""
    x = rng.standard_normal((50, 70), dtype=F32)
    exe = polyjit.compile(lambda t: t - ops.sum(t) / t.shape[0] / t.shape[1], [InputInfo([50, 70], F32)])
    np.testing.assert_allclose(exe(x), x - x.astype(np.float64).mean(), rtol=1e-5, atol=1e-5)
    assert exe.stats["kernels"] >= 2


def test_recurrence_then_reverse_use(rng):
    """cumsum read backwards: no fusion may reorder the recurrence."""
    x = rng.standard_normal((5, 64), dtype=F32)
    exe = polyjit.compile(lambda t: ops.reverse(ops.cumsum(t, 1), [1]) * 2.0, [InputInfo([5, 64], F32)])
    np.testing.assert_allclose(exe(x), np.cumsum(x.astype(np.float64), 1)[:, ::-1] * 2, rtol=1e-5, atol=1e-5)


def test_matmul_chain_and_epilogue(rng):
    a, b, c = (rng.standard_normal(s, dtype=F32) for s in [(70, 90), (90, 50), (50, 30)])
    bias = rng.standard_normal(50, dtype=F32)
    exe = polyjit.compile(lambda p, q, r, s: ops.relu(p @ q + s) @ r,
                          [InputInfo(list(t.shape), F32) for t in (a, b, c, bias)])
    want = np.maximum(a.astype(np.float64) @ b + bias, 0) @ c
    np.testing.assert_allclose(exe(a, b, c, bias), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tiles", [[8], [4, 16], [3, 5, 7]])
def test_tile_sizes_option(tiles, rng):
    x = rng.standard_normal((30, 41), dtype=F32)
    y = rng.standard_normal((41, 23), dtype=F32)
    exe = polyjit.compile(lambda a, b: (a @ b, ops.exp(a) * 2), [InputInfo([30, 41], F32), InputInfo([41, 23], F32)],
                          {"tile_sizes": tiles})
    got = exe(x, y)
    np.testing.assert_allclose(got[0], x.astype(np.float64) @ y, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got[1], np.exp(x.astype(np.float64)) * 2, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_num_threads(threads, rng):
    x = rng.standard_normal((300, 200), dtype=F32)
    exe = polyjit.compile(ops.softmax, [InputInfo([300, 200], F32)], {"num_threads": threads})
    np.testing.assert_allclose(exe(x), refs.softmax(x.astype(np.float64)), rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_default_threads_are_the_cores_the_process_may_use(monkeypatch):
    """Under taskset or a container's cpuset, as many threads as usable cores,
    not the machine's: more would spin against each other."""
    from polyjit.options import CompileOptions
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3})
    assert CompileOptions().num_threads == 2


def test_fusion_definition_example():
    with FusionDefinition() as fd:
        t0 = fd.define_tensor(symbolic_sizes=[-1, 1, -1], contiguous=[True] * 3, dtype=DataType.Float)
        t1 = fd.define_tensor(3)
        c0 = fd.define_constant(3.0)
        t4 = fd.ops.sum(fd.ops.mul(fd.ops.add(t0, t1), c0), [-1], False, DataType.Float)
        fd.add_output(t4)
    rng = np.random.default_rng()
    for shape in [(2, 4, 8), (5, 3, 100)]:
        a = rng.random((shape[0], 1, shape[2]), dtype=F32)
        b = rng.random(shape, dtype=F32)
        out = fd.execute([a, b])[0]
        np.testing.assert_allclose(out, ((a.astype(np.float64) + b) * 3).sum(-1), rtol=1e-5)
    assert fd.stats["fallbacks"] == 0 and fd.stats["kernels"] == 1
    text = fd.to_python()
    assert "fd.define_tensor(shape=[-1, 1, -1]" in text and "fd.ops.sum(" in text
    assert "sum" in dir(FusionDefinition.Operators) and "broadcast_in_dim" in dir(FusionDefinition.Operators)


def test_fusion_definition_scalar_and_strided(rng):
    with FusionDefinition() as fd:
        t = fd.define_tensor(sizes=[6, 8], strides=[1, 6])
        s = fd.define_scalar(dtype=DataType.Float)
        fd.add_output(fd.ops.mul(t, s))
    a = rng.random((8, 6), dtype=F32).T
    np.testing.assert_allclose(fd.execute([a, 2.5])[0], a * 2.5, rtol=1e-6)


def test_print_ir_and_debug_dump(tmp_path, capsys):
    exe = polyjit.compile(blur, [InputInfo([3, 32, 32], F32)], {"debug": True, "dump_dir": str(tmp_path)})
    exe.print_ir()
    text = capsys.readouterr().out
    assert "for (" in text and "S0" in text and "contracted" in text
    files = sorted(p.name for p in tmp_path.rglob("*.txt"))
    assert any("graph" in f for f in files) and any("llvm_opt" in f for f in files) and any("ast" in f for f in files)


def test_parallel_loop_never_carries_a_reduction(rng):
    """A long contraction over small outputs: the tile loops of the outputs have one
    iteration, so the first loop in the AST is the reduction's; splitting it across
    threads would race on the accumulators."""
    a, b = rng.standard_normal((20, 2048), dtype=F32), rng.standard_normal((2048, 64), dtype=F32)
    exe = polyjit.compile(ops.matmul, [InputInfo(a.shape, F32), InputInfo(b.shape, F32)], {"num_threads": 2, **GEN})
    lines = exe.ir("ast").splitlines()
    for i, line in enumerate(lines):
        if "// parallel:" in line:
            it = line.split("parallel:")[1].strip()
            assert lines[i + 1].strip().startswith(f"for (int {it} ="), lines[i:i + 2]
    want = a.astype(np.float64) @ b
    for _ in range(20):  # a race loses whole partial sums; float32 rounding over 2048 terms is up to ~2e-4
        np.testing.assert_allclose(exe(a, b), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("shape", [(3, 256, 64), (3, 2, 4096)])
def test_short_outer_loop_shares_strips_between_threads(rng, shape):
    """Three images for two threads would leave one idle a third of the time:
    the parallel loop runs over strips of rows (or, with few rows, of columns)."""
    x = rng.standard_normal(shape, dtype=F32)
    exe = polyjit.compile(lambda a: ops.exp(a) * 2.0, [InputInfo(x.shape, F32)], {"num_threads": 2})
    lines = exe.ir("ast").splitlines()
    at = next(i for i, line in enumerate(lines) if "// parallel:" in line)
    m = re.match(r"\s*for \(int c0 = 0; c0 <= (\d+);", lines[at + 1])
    assert m and int(m.group(1)) + 1 >= 8, lines[at:at + 3]
    np.testing.assert_allclose(exe(x), np.exp(x.astype(np.float64)) * 2, rtol=1e-5)


def test_column_sum_runs_in_parallel_strips_of_columns(rng):
    """A sum over rows (a bias or weight gradient) carries its reduction on the
    outer loop: strips of columns, two or more, run in parallel instead."""
    x = rng.standard_normal((300, 1024), dtype=F32)
    exe = polyjit.compile(lambda a: ops.sum(a, [0]), [InputInfo(x.shape, F32)], {"num_threads": 2})
    assert exe.stats["parallel_kernels"] == exe.stats["kernels"] == 1
    np.testing.assert_allclose(exe(x), x.astype(np.float64).sum(0), rtol=1e-4, atol=1e-4)


def test_reshape_dropping_kept_axes_of_a_sum_is_no_copy(rng):
    """A bias gradient as AOTAutograd writes it: sum with keepdim, then reshape;
    the sum writes the reshaped result itself (an init and an update, no copy),
    unless the kept-axes sum is used elsewhere too."""
    x = rng.standard_normal((6, 7, 33)).astype(F32)
    want = (2 * x.astype(np.float64)).sum((0, 1))
    exe = polyjit.compile(lambda x: ops.reshape(ops.sum(x * 2.0, [0, 1], True), [33]), [InputInfo(x.shape, F32)])
    np.testing.assert_allclose(exe(x), want, rtol=1e-5, atol=1e-5)
    assert exe.stats["statements"] == 2
    both = polyjit.compile(lambda x: (ops.reshape(ops.sum(x, [0, 1], True), [33]), ops.sum(x, [0, 1], True) + 1.0),
                           [InputInfo(x.shape, F32)])
    flat, kept = both(x)
    np.testing.assert_allclose(kept - 1.0, flat.reshape(1, 1, 33), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(flat, x.astype(np.float64).sum((0, 1)), rtol=1e-5, atol=1e-5)


def test_sum_over_unit_axes_is_no_copy(rng):
    """A bias gradient as JAX writes it: the sum, reshaped to (1, 1, n), then
    summed over the unit axes; that last sum combines nothing and costs no statement."""
    x = rng.standard_normal((6, 7, 33)).astype(F32)
    exe = polyjit.compile(lambda x: ops.sum(ops.reshape(ops.sum(x * 2.0, [0, 1]), [1, 1, 33]), [0, 1]),
                          [InputInfo(x.shape, F32)])
    np.testing.assert_allclose(exe(x), (2 * x.astype(np.float64)).sum((0, 1)), rtol=1e-5, atol=1e-5)
    assert exe.stats["statements"] == 2
    kept = polyjit.compile(lambda x: ops.max(ops.reshape(x, [6, 1, 7, 33]), [1], True), [InputInfo(x.shape, F32)])
    np.testing.assert_array_equal(kept(x), x.reshape(6, 1, 7, 33))


def test_linear_reads_a_packed_copy_of_its_weight(rng):
    """x @ W.T (nn.Linear's form): register blocks load vectors along the
    output's columns, which W holds with a stride, so W is copied once into
    (contracting, free) order and the contraction reads the copy."""
    x, w = rng.standard_normal((70, 90), dtype=F32), rng.standard_normal((50, 90), dtype=F32)
    exe = polyjit.compile(lambda a, b: ops.linear(a, b), [InputInfo(x.shape, F32), InputInfo(w.shape, F32)], GEN)
    assert "packed=True" in exe.ir("graph")
    assert "= in1[i1, i0]" in exe.ir("affine")
    np.testing.assert_allclose(exe(x, w), x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("cin,cout", [(3, 70), (160, 64)])
def test_convolution_register_block_inside_its_whole_reduction(cin, cout, rng):
    """isl gives a convolution's later reduction loops (window, channels) bands
    of their own; they join the contraction's band, so the unrolled block of
    outputs sits inside every reduction loop, and the output loops stay parallel.
    Only the outermost reduction loop may be tiled (more than 128 channels must
    not reorder the sum, which would leave the whole program untiled)."""
    from polyjit.codegen.cpu import vector_bits
    x, w = rng.standard_normal((2, 9, 10, cin), dtype=F32), rng.standard_normal((3, 3, cin, cout), dtype=F32)
    exe = polyjit.compile(lambda a, b: ops.conv(a, b, (1, 1), ((1, 1), (1, 1)), layout="NHWC", kernel_layout="HWIO"),
                          [InputInfo(x.shape, F32), InputInfo(w.shape, F32)], GEN)
    lines = exe.ir("ast").splitlines()
    at = next(i for i, line in enumerate(lines) if "S1(" in line)  # under the block's two loops, unrolled
    rows, cols = map(int, lines[at - 3].split("// unroll:")[1].split(","))
    assert rows * cols >= vector_bits() // 8  # (four vectors)
    assert all("for (" in line for line in lines[at - 4:at] if "unroll" not in line)
    assert f"register blocks of {rows * cols} products" in exe.ir("mapping")
    assert sum("// parallel:" in line for line in lines) == 1  # the initialization shares the convolution's nest
    want = refs.conv2d(x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1), padding=((1, 1), (1, 1)))
    # sums of up to 1440 products, of size ~40: float32 rounding reaches 1e-4 where they cancel
    np.testing.assert_allclose(exe(x, w), want.transpose(0, 2, 3, 1), rtol=1e-5, atol=1e-3)


def _conv_nhwc(a, b):
    return ops.conv(a, b, (1, 1), ((1, 1), (1, 1)), layout="NHWC", kernel_layout="HWIO")


@pytest.mark.parametrize("shape", [(2, 9, 10, 32), (2, 128, 129, 32)])
def test_contraction_epilogue_runs_inside_its_register_blocks(shape, rng):
    """conv + bias + relu is one nest: each block of outputs is zeroed, takes
    its whole reduction, then a loop over the block adds the bias and applies
    relu, so the convolution's result lives in a private block, never in
    memory. Padding is read through a cell of zeros (a broadcast from memory).
    A large output is not streamed from inside the block (tagging those
    stores kept LLVM from holding the accumulators in registers: 4x slower).
    Rows that do not fill a block, and a NaN, come out as the reference has them."""
    x, w = rng.standard_normal(shape, dtype=F32), rng.standard_normal((3, 3, 32, 64), dtype=F32)
    bias = rng.standard_normal(64, dtype=F32)
    x[1, 4, 6, 20] = np.nan
    exe = polyjit.compile(lambda a, b, c: ops.relu(_conv_nhwc(a, b) + c),
                          [InputInfo(x.shape, F32), InputInfo(w.shape, F32), InputInfo(bias.shape, F32)], GEN)
    assert exe.stats["kernels"] == 1 and exe.stats["fused"] == 2 and exe.stats["contracted_buffers"] == 1
    assert "polyjit.fill" in exe.ir("llvm") and "nontemporal" not in exe.ir("llvm_opt")
    conv = refs.conv2d(x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1), padding=((1, 1), (1, 1)))
    want = np.maximum(conv.transpose(0, 2, 3, 1) + bias, 0)
    got = exe(x, w, bias)
    assert np.isnan(got[1, 3:6, 5:8]).all() and np.isnan(got).sum() == 9 * 64
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_contraction_result_that_is_also_an_output_is_stored_once(rng):
    """A convolution returned and also fed to its epilogue: one nest, whose
    blocks write the returned result (not a private block) and the tanh."""
    x, w = rng.standard_normal((1, 6, 7, 4), dtype=F32), rng.standard_normal((3, 3, 4, 8), dtype=F32)
    exe = polyjit.compile(lambda a, b: (_conv_nhwc(a, b), ops.tanh(_conv_nhwc(a, b))),
                          [InputInfo(x.shape, F32), InputInfo(w.shape, F32)], GEN)
    assert exe.stats["kernels"] == 1 and exe.stats["contracted_buffers"] == 0
    conv = refs.conv2d(x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1), padding=((1, 1), (1, 1))).transpose(0, 2, 3, 1)
    got, act = exe(x, w)
    np.testing.assert_allclose(got, conv, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(act, np.tanh(conv), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k,fused", [(96, True), (300, False)])
def test_matmul_bias_fuses_while_its_reduction_fits_one_tile(k, fused, rng):
    """A reduction longer than a tile (128) is tiled for the cache, outside the
    register blocks: its accumulators go back to memory between tiles, so its
    initialization and epilogue stay passes of their own."""
    a, b, c = (rng.standard_normal(s, dtype=F32) for s in ((70, k), (k, 130), (130,)))
    exe = polyjit.compile(lambda x, y, z: ops.matmul(x, y) + z,
                          [InputInfo(a.shape, F32), InputInfo(b.shape, F32), InputInfo(c.shape, F32)], GEN)
    assert (exe.stats["kernels"] == 1) == fused
    assert exe.stats["fusions_refused"] == (not fused)  # and says why: a reduction longer than a tile
    np.testing.assert_allclose(exe(a, b, c), a.astype(np.float64) @ b + c, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_few_images_share_threads_by_row_strips(threads, rng):
    """Three images cannot keep more threads busy: each image's rows are cut
    into one strip per thread, and every strip first recomputes the blur_x
    rows of its halo in its own rolling buffer."""
    img = rng.random((3, 37, 70), dtype=F32)
    exe = polyjit.compile(blur, [InputInfo(list(img.shape), F32)], {"num_threads": threads})
    assert "strip.item" in exe.ir("llvm") and exe.stats["contracted_buffers"] == 1
    np.testing.assert_allclose(exe(img), refs.blur(img.astype(np.float64)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape_a,shape_b", [((30, 41), (41, 23)), ((3, 30, 41), (3, 41, 23))])
def test_transposed_product_is_the_product_of_swapped_operands(shape_a, shape_b, rng):
    """(A @ B).T, as JAX writes a weight gradient, is computed as B.T @ A.T
    straight into the output: no transposing pass over the result."""
    a, b = rng.standard_normal(shape_a, dtype=F32), rng.standard_normal(shape_b, dtype=F32)
    last = len(shape_a) - 1
    exe = polyjit.compile(lambda x, y: ops.transpose(ops.matmul(x, y), last - 1, last),
                          [InputInfo(list(shape_a), F32), InputInfo(list(shape_b), F32)], GEN)
    writes = [line for line in exe.ir("affine").splitlines() if line.strip().startswith("out0[")]
    assert len(writes) == 2 and "sum=" in writes[1]  # initialization and update only
    np.testing.assert_allclose(exe(a, b), np.swapaxes(a.astype(np.float64) @ b, -1, -2), rtol=1e-5, atol=1e-4)


def test_kernels_ask_for_wide_vectors_on_avx512_hosts(rng):
    """LLVM tunes Intel's AVX-512 cores to 256-bit vectors, where the 4 x 64
    register blocks of contractions spill; kernels ask for 512 bits."""
    import llvmlite.binding as llvm
    if "+avx512f" not in llvm.get_host_cpu_features().flatten():
        pytest.skip("the host has no AVX-512")
    a, b = rng.standard_normal((70, 90), dtype=F32), rng.standard_normal((90, 130), dtype=F32)
    exe = polyjit.compile(ops.matmul, [InputInfo(a.shape, F32), InputInfo(b.shape, F32)], GEN)
    opt = exe.ir("llvm_opt")
    assert '"prefer-vector-width"="512"' in opt and "<16 x float>" in opt
    np.testing.assert_allclose(exe(a, b), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)


def test_register_blocks_are_unrolled_by_the_emitter(rng):
    """The block's loops reach code generation plain, under an unroll mark,
    and the emitter copies their bodies: the block's accumulators are
    vectors carried in registers through the reduction (LLVM's own
    unrolling of the plain loops kept them in memory: 3x slower)."""
    from polyjit.codegen.cpu import vector_bits
    from polyjit.schedule.cpu_rewrites import block_shape
    lanes = vector_bits() // 32
    rows, cols = block_shape(64, 256, lanes)
    a, b = rng.standard_normal((64, 128), dtype=F32), rng.standard_normal((128, 256), dtype=F32)
    exe = polyjit.compile(ops.matmul, [InputInfo(a.shape, F32), InputInfo(b.shape, F32)],
                          {**GEN, "target": "cpu", "cache": False})
    np.testing.assert_allclose(exe(a, b), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)
    assert f"// unroll:{rows},{cols}" in exe.ir("ast")
    kernel = re.search(r"define[^\n]*dot_general.*?\n}\n", exe.ir("llvm_opt"), re.S).group(0)
    assert len(re.findall(rf"phi <{lanes} x float>", kernel)) >= rows * cols // lanes


@pytest.mark.parametrize("rows,cols,lanes,shape", [
    (512, 512, 16, (4, 64)),  # four rows of four vectors
    (64, 784, 16, (16, 16)),  # 784 = 49 x 16: sixteen rows of one vector, no partial block
    (256, 49, 16, (4, 49)),  # a 7x7 image: its 49 positions in one block
    (512, 16, 16, (16, 16)),  # a 4x4 image: one vector, sixteen rows to hide the FMAs' latency
    (None, None, 16, (4, 64)),  # symbolic sizes
    (384, 512, 8, (3, 32)),  # AVX2: twelve accumulators of its sixteen registers
    (96, 48, 8, (4, 24)),  # (48 columns: four rows of three vectors)
    (None, None, 8, (3, 32)),
])
def test_register_block_shape_divides_the_result(rows, cols, lanes, shape):
    """A contraction's register block divides its result where a block of
    whole vectors can, and keeps every accumulator busy: sixteen with
    AVX-512's 32 registers, twelve with AVX2's 16."""
    from polyjit.schedule.cpu_rewrites import block_shape
    assert block_shape(rows, cols, lanes) == shape


@pytest.mark.parametrize("bits,block", [(512, "4,64"), (256, "2,32")])
def test_register_blocks_follow_the_vector_width(bits, block):
    """Four rows of four vectors (64 float32 columns) with AVX-512; with
    AVX2, four vectors of 32 columns in at most twelve accumulators, whole
    blocks of 256 rows: two rows. Their loops sit under a mark the emitter
    unrolls."""
    from polyjit.lowering import lower
    from polyjit.schedule import schedule_program
    from polyjit.targets import CpuTarget

    class Host(CpuTarget):
        def vector_bits(self) -> int:
            return bits
    graph = polyjit.compile(ops.matmul, [InputInfo([256, 256], F32)] * 2).graph
    ast = schedule_program(lower(graph.deduplicated()), target=Host()).ast_text()
    assert f"// unroll:{block}" in ast


def test_a_kernel_copied_with_its_channels_exchanged_walks_square_tiles_of_them(rng):
    """A copy that exchanges a kernel's two channel dims and flips its window
    (a convolution's input gradient's kernel) walks 32x32 tiles of the
    channels, the window inside: the dims after the exchanged ones move
    with the same loops in the store and the load."""
    w = rng.standard_normal((64, 96, 3, 3), dtype=F32)
    exe = polyjit.compile(lambda w: ops.permute(ops.reverse(w, [2, 3]), [1, 0, 2, 3]), [InputInfo(w.shape, F32)],
                          {"target": "cpu", "cache": False})
    np.testing.assert_array_equal(exe(w), w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3))
    assert len(re.findall(r"32 \* c\d", exe.ir("ast"))) >= 2


def test_an_input_gradients_product_runs_its_reduction_inside_its_rows(rng):
    """A convolution's input gradient reads its kernel's reduction channels
    outermost; its product still runs on the thread team: the reduction
    moves inside the rows, which a batch of two images does not cover."""
    g, w = rng.standard_normal((2, 256, 4, 4), dtype=F32), rng.standard_normal((256, 128, 3, 3), dtype=F32)
    exe = polyjit.compile(lambda g, w: ops.conv_input_grad(g, w, [4, 4], [1, 1], [(1, 1), (1, 1)]),
                          [InputInfo(g.shape, F32), InputInfo(w.shape, F32)], {**GEN, "target": "cpu", "cache": False})
    product = [line for line in exe.ir("mapping").splitlines() if "register blocks" in line]
    assert product and product[0].split(": ")[1].startswith("thread team")
    want = refs.conv2d(g, w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3), padding=((1, 1), (1, 1)))
    # sums of 2304 products of size ~1 (results ~50): float32 rounding reached 1.2e-4 over 60 seeds
    np.testing.assert_allclose(exe(g, w), want, rtol=1e-5, atol=5e-4)


def test_a_strided_window_shares_its_nest_with_its_direct_producer_only(rng):
    """A strided depthwise convolution is fused with the op that makes its
    input, not with a chain of them (a batch norm, then hardswish: isl's
    scheduler took seconds to shift both under a stride-2 window)."""
    from polyjit.lowering import lower
    from polyjit.schedule import fusion_groups
    x, w = rng.standard_normal((2, 8, 13, 13), dtype=F32), rng.standard_normal((8, 1, 5, 5), dtype=F32)

    def f(x, w):  # (the batch norm and hardswish are returned too: statements of their own)
        y = x * 1.5 + 0.25
        h = y * ops.clamp(y + 3.0, 0.0, 6.0) / 6.0
        return ops.conv(h, w, (2, 2), ((2, 2), (2, 2)), groups=8), y, h
    exe = polyjit.compile(f, [InputInfo(x.shape, F32), InputInfo(w.shape, F32)], {"target": "cpu", "cache": False})
    prog = lower(exe.graph.deduplicated())
    labels = {s.name: s.label for s in prog.statements}
    window = next(g for g in fusion_groups(prog) if any(labels[n] == "conv" for n in g))
    assert len(window) == 2, [labels[n] for n in window]
    y = x * 1.5 + 0.25
    h = y * np.clip(y + 3.0, 0.0, 6.0) / 6.0
    np.testing.assert_allclose(exe(x, w)[0], refs.conv2d(h, w, (2, 2), ((2, 2), (2, 2)), groups=8),
                               rtol=1e-5, atol=1e-5)


def test_only_runs_along_rows_hold_sums_initializations_beyond_the_cap():
    """A run's sums' initializations count towards MAX_GROUP unless all its
    statements read and write along their own loops: a row statistic's
    statements do; a transposed read or a shifted one (a padded window)
    does not, where the larger runs took isl seconds."""
    from polyjit.lowering import lower
    from polyjit.schedule import fusion

    def f(x, y):
        m = ops.mean(x, [1], keepdim=True)
        return x - m, ops.transpose(y) * 2.0, ops.pad(x, [1, 1]) * 3.0
    exe = polyjit.compile(f, [InputInfo((4, 8), F32), InputInfo((8, 4), F32)], {"target": "cpu", "cache": False})
    prog = lower(exe.graph.deduplicated())
    along = {str(s): fusion._along_rows(s, prog) for s in prog.statements}
    rows = [k for k, v in along.items() if "in1" not in k and "pad" not in k and "3.0" not in k]
    crossed = [k for k in along if k not in rows]
    assert rows and crossed and all(along[k] for k in rows) and not any(along[k] for k in crossed), along


def test_a_large_window_starts_a_group_on_every_target(rng):
    """A 7x7 depthwise convolution padded to its input's size (ConvNeXt's),
    its input made in the same run (a residual sum): the window goes with
    its producer only and its readers (a layer norm's statistics) start the
    next group, on the host too. With them, isl took 1-4 s over each such
    group of ConvNeXt-Tiny (its first call 13 s, now 4)."""
    from polyjit.lowering import lower
    from polyjit.schedule import fusion_groups

    def block(x, r, w):
        y = ops.conv(x + r, w, (1, 1), ((3, 3), (3, 3)), groups=8, layout="NHWC", kernel_layout="HWIO")
        m = ops.mean(y, [3])
        return y - ops.unsqueeze(m, 3), m
    shapes = [(2, 9, 9, 8), (2, 9, 9, 8), (7, 7, 1, 8)]
    exe = polyjit.compile(block, [InputInfo(s, F32) for s in shapes], {"target": "cpu", "cache": False})
    prog = lower(exe.graph.deduplicated())
    labels = {st.name: st.label for st in prog.statements}
    groups = [[labels[n] for n in g] for g in fusion_groups(prog)]
    window = next(g for g in groups if "conv" in g)
    assert len(window) == 2 and "reduce_init" not in window, groups
    x, r, w = (rng.standard_normal(sh, dtype=F32) for sh in shapes)
    y = refs.conv2d((x + r).transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1), (1, 1), ((3, 3), (3, 3)), groups=8)
    y = y.transpose(0, 2, 3, 1)
    got_y, got_m = exe(x, r, w)
    np.testing.assert_allclose(got_m, y.mean(3), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_y, y - y.mean(3, keepdims=True), rtol=1e-5, atol=1e-5)


def test_small_unrelated_statements_and_window_readers_leave_the_run_on_the_gpu(rng):
    """With the nvgpu target's choices, a depthwise weight's transposed copy
    (a few hundred iterations, no array shared) goes into a group before
    the activations' run, and the readers of a depthwise window (its batch
    norm and squeeze-excite's pooled sum) start a group of their own: in
    one group with the window and its producer, isl took 13-18 s
    (MobileNetV3's training step). The host's groups keep both."""
    from polyjit.lowering import lower
    from polyjit.schedule import fusion_groups
    from polyjit.targets.nvgpu import NvgpuTarget

    def block(x, w, s):
        h = ops.relu(x * s)
        y = ops.conv(h, ops.permute(w, (2, 3, 1, 0)), (1, 1), ((2, 2), (2, 2)), groups=16,
                     layout="NHWC", kernel_layout="HWIO")
        z = ops.relu(y * s)
        return ops.mean(z, [1, 2]), z
    shapes = [(2, 28, 28, 16), (16, 1, 5, 5), (16,)]
    exe = polyjit.compile(block, [InputInfo(s, F32) for s in shapes], {"target": "cpu", "cache": False})
    prog = lower(exe.graph.deduplicated(), NvgpuTarget.recompute_limit, None, NvgpuTarget.load_work)
    labels = {st.name: st.label for st in prog.statements}
    gpu = [[labels[n] for n in g] for g in fusion_groups(prog, small_apart=True, windows_apart=True)]
    host = [[labels[n] for n in g] for g in fusion_groups(prog)]
    assert gpu == [["transpose"], ["relu", "relu"], ["reduce_init", "sum", "div"]], gpu
    assert len(host) == 1, host
    x, w, s = (rng.standard_normal(sh, dtype=F32) for sh in shapes)
    z = refs.conv2d(np.maximum(x * s, 0).transpose(0, 3, 1, 2), w, (1, 1), ((2, 2), (2, 2)), groups=16)
    z = np.maximum(z.transpose(0, 2, 3, 1) * s, 0)
    mean, zz = exe(x, w, s)
    np.testing.assert_allclose(zz, z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mean, z.mean((1, 2)), rtol=1e-5, atol=1e-5)


def test_a_batch_norms_statistics_leave_the_activations_run_on_the_gpu(rng):
    """With the nvgpu target's choices, a batch norm's mean (divided from
    sums an earlier group made) and its running mean's update go before the
    run that reads the mean at every point, and per-channel sums over NHWC's
    leading dimensions start a group after the values they sum: in one
    group with them, isl took 0.5-8 s a group of ResNet-18's and
    MobileNetV3's training steps, then gave each a kernel of its own. The
    host's groups keep them."""
    from polyjit.lowering import lower
    from polyjit.schedule import fusion_groups
    from polyjit.targets.nvgpu import NvgpuTarget

    def stats(x, total, running):
        mean = total / 392.0
        d = x - mean
        return mean * 0.1 + running * 0.9, ops.mean(d * d, [0, 1, 2]), mean  # (the mean saved for the backward)

    def sums(x, g):
        dy = ops.relu(g * x) * 0.5
        return dy, ops.sum(dy, [0, 1, 2]), ops.sum(dy * x, [0, 1, 2])
    x, g, total, running = (rng.standard_normal(s, dtype=F32) for s in [(8, 7, 7, 32), (8, 7, 7, 32), (32,), (32,)])
    want = {"stats": [total / 392 * 0.1 + running * 0.9, ((x - total / 392) ** 2).mean((0, 1, 2)), total / 392],
            "sums": [np.maximum(g * x, 0) * 0.5, (np.maximum(g * x, 0) * 0.5).sum((0, 1, 2)),
                     (np.maximum(g * x, 0) * 0.5 * x).sum((0, 1, 2))]}
    gpu_groups = {"stats": [["div", "add"], ["reduce_init", "sum", "div"]],
                  "sums": [["mul"], ["reduce_init", "sum", "reduce_init", "sum"]]}
    for f, args in ((stats, (x, total, running)), (sums, (x, g))):
        exe = polyjit.compile(f, [InputInfo(a.shape, F32) for a in args], {"target": "cpu", "cache": False})
        prog = lower(exe.graph.deduplicated(), NvgpuTarget.recompute_limit, None, NvgpuTarget.load_work)
        labels = {st.name: st.label for st in prog.statements}
        gpu = [[labels[n] for n in gr] for gr in fusion_groups(prog, small_apart=True, windows_apart=True,
                                                                column_sums_apart=True)]
        host = [[labels[n] for n in gr] for gr in fusion_groups(prog)]
        assert gpu == gpu_groups[f.__name__], gpu
        assert len(host) == 1, host
        for got, ref in zip(exe(*args), want[f.__name__]):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


def test_a_value_read_twice_counts_the_arrays_its_recomputation_loads(rng):
    """A value that a column sum and an elementwise consumer both read is
    inlined where only its arithmetic is counted, and made once where each
    whole array its recomputation loads counts too (the nvgpu target: a
    sum in a kernel of its own read all four again); the results agree."""
    from polyjit.lowering import lower
    arrays = [rng.standard_normal((64, 32), dtype=F32) for _ in range(5)]

    def f(a, b, c, d, e):
        v = a * b - c * d
        return ops.sum(v, [0]), v + e
    exe = polyjit.compile(f, [InputInfo(x.shape, F32) for x in arrays], {"target": "cpu", "cache": False})
    graph = exe.graph.deduplicated()
    made = [{s.label for s in lower(graph, 6, None, load_work).statements} for load_work in (0, 1)]
    assert "sub" not in made[0] and "sub" in made[1], made
    a, b, c, d, e = arrays
    v = a * b - c * d
    got = exe(*arrays)
    np.testing.assert_allclose(got[0], v.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], v + e, rtol=1e-6)


@pytest.mark.parametrize("window,stride,made", [(2, 2, False), (3, 2, True), (2, 1, True)])
def test_a_window_that_reads_each_element_once_computes_its_producer(window, stride, made, rng):
    """A batch norm and relu under a pooling window that does not overlap
    itself (2x2 at stride 2) are computed in the window's terms, not stored
    for them; under an overlapping window (3x3 at stride 2, 2x2 at stride
    1) each element would be computed several times, so it is stored. The
    results agree with numpy either way, NaN included."""
    x = rng.standard_normal((2, 12, 12, 8), dtype=F32)
    x[0, 3, 5, 2] = np.nan
    scale, shift = rng.standard_normal(8, dtype=F32), rng.standard_normal(8, dtype=F32)

    def f(x, s, b):
        return ops.reduce_window("sum", ops.maximum(x * s + b, 0.0), [1, window, window, 1], [1, stride, stride, 1])
    exe = polyjit.compile(f, [InputInfo(a.shape, F32) for a in (x, scale, shift)], {"cache": False})
    assert any(" = maximum(" in line for line in exe.ir("affine").splitlines()) == made, exe.ir("affine")
    y = np.maximum(x * scale + shift, 0)
    n = (12 - window) // stride + 1
    want = np.stack([np.stack([y[:, i * stride:i * stride + window, j * stride:j * stride + window].sum((1, 2))
                               for j in range(n)], 1) for i in range(n)], 1)
    np.testing.assert_allclose(exe(x, scale, shift), want, rtol=1e-5, atol=1e-5)


def test_an_address_of_a_split_position_is_the_position():
    """A row-major address of (x // 7, x % 7) over a dim of 7 is x's, at the
    inner dim's stride; a three-way split merges the same way; a split that
    does not match the array's dims is left as it is."""
    from polyjit import expr as E
    x, i = E.it("x"), E.it("i")
    two = E.merged_index((i, E.ifloordiv(x, 7), E.imod(x, 7)), (4, 5, 7))
    assert two == [(x, 2), (i, 0)]
    three = E.merged_index((E.ifloordiv(x, 35), E.imod(E.ifloordiv(x, 7), 5), E.imod(x, 7)), (3, 5, 7))
    assert three == [(x, 2)]
    assert len(E.merged_index((E.ifloordiv(x, 7), E.imod(x, 7)), (5, 8))) == 2


def test_a_sums_initialization_stays_with_its_update_where_a_group_is_cut(rng):
    """Where the statements before a sum fill a fusion group, the group is cut
    before the sum's initialization, not between it and its update."""
    from polyjit.lowering import lower
    from polyjit.schedule import fusion_groups
    x = rng.standard_normal((8, 64), dtype=F32)

    def f(x):  # five elementwise results of their own, then a row sum
        a = ops.exp(x)
        b, c = a * 2.0, ops.sin(x)
        d, e = b + c, ops.cos(x)
        return a, b, c, d, e, ops.sum(d * e, [1])
    exe = polyjit.compile(f, [InputInfo(x.shape, F32)], {"target": "cpu", "cache": False})
    prog = lower(exe.graph.deduplicated())
    role = {s.name: s.role.name for s in prog.statements}
    for g in fusion_groups(prog):
        assert role[g[-1]] != "INIT", [role[n] for n in g]
    d = np.exp(x) * 2 + np.sin(x)
    np.testing.assert_allclose(exe(x)[5], (d * np.cos(x)).sum(1), rtol=1e-5, atol=1e-4)


def test_a_layer_norms_affine_step_joins_the_full_group_of_the_x_hat_it_reads(rng):
    """A training layer norm's forward has seven statements, one past a
    group's limit: its last, `x_hat * w + b`, read only x_hat at its own
    point, and joins x_hat's group rather than reading x_hat back alone."""
    from polyjit.lowering import lower
    from polyjit.schedule import fusion_groups
    from polyjit.schedule.fusion import MAX_GROUP

    def f(x, w, b):
        m = ops.mean(x, [1], keepdim=True)
        c = x - m
        xh = c * ops.rsqrt(ops.mean(c * c, [1], keepdim=True) + 1e-5)
        return xh * w + b, xh
    shapes = [(16, 64), (64,), (64,)]
    exe = polyjit.compile(f, [InputInfo(s, F32) for s in shapes], {"target": "cpu", "cache": False})
    prog = lower(exe.graph.deduplicated())
    groups = fusion_groups(prog)
    assert len(groups[0]) == MAX_GROUP + 1 and len(groups) == 1, groups
    x, w, b = (rng.standard_normal(sh, dtype=F32) for sh in shapes)
    c = x - x.mean(1, keepdims=True)
    xh = c / np.sqrt((c * c).mean(1, keepdims=True) + 1e-5)
    got, got_xh = exe(x, w, b)
    np.testing.assert_allclose(got_xh, xh, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, xh * w + b, rtol=1e-5, atol=1e-5)


def test_a_slice_of_the_whole_is_its_operand():
    """Slicing every element (a weight gradient cut to the sizes it has) adds no node: no copy."""
    g = polyjit.compile(lambda x: ops.slice(x, [0, 0], [4, 5]) * 2, [InputInfo([4, 5], F32)]).graph
    assert "slice" not in [n.op for n in g.nodes()]


def test_a_transposing_copy_that_reads_in_order_walks_square_tiles_too(rng):
    """A copy whose loads run along the innermost loop and whose store does
    not (two loads against one store: attention's keys laid out transposed
    with their bias) walks the same square tiles."""
    exe = polyjit.compile(lambda x, b: ops.permute(x + b, [1, 0]), [InputInfo([128, 256], F32), InputInfo([256], F32)],
                          {"target": "cpu", "cache": False})
    x, b = rng.standard_normal((128, 256), dtype=F32), rng.standard_normal(256, dtype=F32)
    np.testing.assert_array_equal(exe(x, b), (x + b).T)
    assert len(re.findall(r"32 \* c\d", exe.ir("ast"))) >= 2


def test_gathered_rows_run_along_the_innermost_loop(rng):
    """Embeddings summed and normalized (BERT's first layer norm, its
    positions gathered from a buffer): the loop over a gathered row's
    elements runs innermost, not the token loop that the indices' loads run
    along (which walked the tables down their columns)."""
    def embed(ids, types, buf, table, ttable, ptable):
        x = ops.embedding(ids, table) + ops.embedding(types, ttable) + ops.embedding(ops.take(buf, types[0], 0), ptable)
        return ops.layer_norm(x, [x.shape[-1]])
    ids, types, buf = rng.integers(0, 1000, (4, 128)), rng.integers(0, 2, (4, 128)), np.arange(512)
    tables = [rng.standard_normal((n, 256), dtype=F32) for n in (1000, 2, 512)]
    args = (ids, types, buf, *tables)
    exe = polyjit.compile(embed, [InputInfo(a.shape, a.dtype) for a in args], {"target": "cpu", "cache": False})
    x = tables[0][ids].astype(np.float64) + tables[1][types] + tables[2][buf[types[0]]]
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(exe(*args), ref, rtol=1e-4, atol=1e-4)
    lines = exe.ir("ast").splitlines()
    inner = [a for a, b in zip(lines, lines[1:]) if "for (" in a and b.strip().startswith("S")
             and not a.rstrip().endswith("{")]  # loops around one statement: over a row's elements
    assert len(inner) >= 2 and all(re.search(r"<= (255|510|765);", a) for a in inner), exe.ir("ast")


@pytest.mark.parametrize("shape", [(70, 33), (3, 256, 100)])
def test_transposing_copies_walk_square_tiles(shape, rng):
    """A copy that reads along another dimension than it writes (a weight's
    transpose) walks 32x32 tiles, so its strided reads reuse cache lines."""
    perm = list(range(len(shape) - 2)) + [len(shape) - 1, len(shape) - 2]
    exe = polyjit.compile(lambda x: ops.permute(x, perm) * 2.0, [InputInfo(list(shape), F32)],
                          {"target": "cpu", "cache": False})
    x = rng.standard_normal(shape, dtype=F32)
    np.testing.assert_array_equal(exe(x), np.transpose(x, perm) * 2)
    assert len(re.findall(r"32 \* c\d", exe.ir("ast"))) >= 2
    plain = polyjit.compile(lambda x: x * 2.0, [InputInfo(list(shape), F32)], {"target": "cpu", "cache": False})
    assert "32 *" not in plain.ir("ast")  # a copy in memory order keeps its loops


def test_a_scatter_runs_alone_and_zero_plus_its_sum_is_the_sum(rng):
    """An embedding's gradient (rows added into a zeroed table, then added
    to zeros, as AOTAutograd writes it): the scatter, whose colliding writes
    keep its loop on one thread, is a kernel of its own, so zeroing the
    table runs on the thread team; and +0.0 plus a sum is the sum exactly
    (no copy of the table)."""
    idx, g = rng.integers(0, 3000, 512), rng.standard_normal((512, 64), dtype=F32)
    g[0, 0] = np.nan
    exe = polyjit.compile(lambda idx, g: ops.scatter_add([3000, 64], idx, g, 0) + 0.0,
                          [InputInfo(idx.shape, idx.dtype), InputInfo(g.shape, F32)],
                          {"target": "cpu", "cache": False, "num_threads": 2})
    ref = np.zeros((3000, 64))
    np.add.at(ref, idx, g.astype(np.float64))
    np.testing.assert_allclose(exe(idx, g), ref, rtol=1e-5, atol=1e-6)
    assert "add(" not in exe.ir("graph") and exe.stats["kernels"] == 2
    assert exe.ir("mapping").splitlines()[0].split(": ")[1].startswith("thread team"), exe.ir("mapping")


def test_a_value_plus_a_scatter_is_the_scatter_into_the_value(rng):
    """A tied embedding's gradient: the output projection's weight gradient
    plus the embedding's rows scattered into zeros is the rows scattered
    into the projection's gradient (one pass over the table, none zeroed,
    no sum of two tables); the NaN an index adds propagates."""
    idx, g = rng.integers(0, 300, 512), rng.standard_normal((512, 64), dtype=F32)
    w = rng.standard_normal((300, 64), dtype=F32)
    g[0, 0] = np.nan
    exe = polyjit.compile(lambda w, idx, g: w * 2.0 + ops.scatter_add([300, 64], idx, g, 0),
                          [InputInfo(w.shape, F32), InputInfo(idx.shape, idx.dtype), InputInfo(g.shape, F32)],
                          {"target": "cpu", "cache": False})
    ref = w.astype(np.float64) * 2.0
    np.add.at(ref, idx, g.astype(np.float64))
    np.testing.assert_allclose(exe(w, idx, g), ref, rtol=1e-5, atol=1e-6)
    graph = exe.ir("graph")
    assert "add(" not in graph and graph.count("scatter") == 1, graph


@pytest.mark.parametrize("contractions", ["library", "generated"])
def test_a_scatter_into_a_product_adds_into_the_products_array(rng, contractions):
    """The output projection's weight gradient, a product, is made in the
    array the embedding's rows are then scattered into: no copy of the
    table starts the scatter."""
    a, b = rng.standard_normal((300, 32), dtype=F32), rng.standard_normal((32, 64), dtype=F32)
    idx, g = rng.integers(0, 300, 512), rng.standard_normal((512, 64), dtype=F32)
    exe = polyjit.compile(lambda a, b, idx, g: ops.matmul(a, b) + ops.scatter_add([300, 64], idx, g, 0),
                          [InputInfo(a.shape, F32), InputInfo(b.shape, F32), InputInfo(idx.shape, idx.dtype),
                           InputInfo(g.shape, F32)], {"target": "cpu", "cache": False, "contractions": contractions})
    ref = a.astype(np.float64) @ b
    np.add.at(ref, idx, g.astype(np.float64))
    np.testing.assert_allclose(exe(a, b, idx, g), ref, rtol=1e-4, atol=1e-4)
    program = exe.ir("affine")
    assert "temp" not in program and program.count("out0[i0, i1] =") == (contractions == "generated"), program


def test_a_weight_gradients_zeroing_shares_its_register_blocks(rng):
    """A weight gradient writes its kernel's channels x window flattened
    (out[o, c // 9, (c // 3) % 3, c % 3]); its zeroing still joins the
    product's nest, the accumulators starting at zero in registers, rather
    than a pass of its own over the (fresh, page-faulting) output first."""
    x, g = rng.standard_normal((2, 64, 4, 4), dtype=F32), rng.standard_normal((2, 32, 4, 4), dtype=F32)
    exe = polyjit.compile(lambda x, g: ops.conv_weight_grad(x, g, [3, 3], [1, 1], [(1, 1), (1, 1)]),
                          [InputInfo(x.shape, F32), InputInfo(g.shape, F32)], {**GEN, "cache": False})
    lines = exe.ir("mapping").splitlines()
    assert not any("_nest_" in line for line in lines) and sum("register blocks" in line for line in lines) == 1, lines
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = np.stack([np.stack([np.einsum("noyx,niyx->oi", g, xp[:, :, ky:ky + 4, kx:kx + 4]) for kx in range(3)], -1)
                     for ky in range(3)], -2)
    np.testing.assert_allclose(exe(x, g), want, rtol=1e-5, atol=1e-4)


def test_cpu_groups_take_isls_clustering_schedule_where_it_joins_them(rng, monkeypatch):
    """On the CPU, isl's clustering scheduler goes first: a depthwise
    convolution of a scaled relu (joined in one outer band, shifted) never
    asks the whole-component scheduler, whose integer programs took seconds
    on such groups in MobileNetV2; a blur, whose stencil clustering leaves
    apart from its producer, still gets one fused nest from the
    whole-component one; where that one gives up, the clustering schedule
    stands (two nests)."""
    import islpy as isl

    from polyjit.cache import ProcessCache
    from polyjit.codegen import program
    from polyjit.schedule import driver
    solves = []
    real = driver._solve

    def spy(ctx, sc):
        solves.append(ctx.get_schedule_whole_component())
        if solves[-1] and give_up:
            raise isl.Error("maximal number of operations exceeded")
        return real(ctx, sc)
    monkeypatch.setattr(driver, "_solve", spy)
    give_up = False
    x, w, s = (rng.standard_normal((2, 9, 9, 12), dtype=F32), rng.standard_normal((3, 3, 1, 12), dtype=F32),
               rng.standard_normal(12, dtype=F32))
    dw = lambda x, w, s: ops.conv(ops.relu(x * (s + 1.0)), w, (1, 1), ((1, 1), (1, 1)), groups=12,  # noqa: E731
                                  layout="NHWC", kernel_layout="HWIO")
    exe = polyjit.compile(dw, [InputInfo(a.shape, F32) for a in (x, w, s)], {"cache": False})
    y = np.pad(np.maximum(x * (s + 1), 0), ((0, 0), (1, 1), (1, 1), (0, 0)))
    want = sum(y[:, i:i + 9, j:j + 9] * w[i, j, 0] for i in range(3) for j in range(3))
    np.testing.assert_allclose(exe(x, w, s), want, rtol=1e-5, atol=1e-5)
    assert exe.stats["kernels"] == 1 and exe.stats["statements"] == 2
    assert solves and not any(solves), solves
    img = rng.random((2, 32, 40), dtype=F32)
    for give_up in (False, True):
        solves.clear()
        monkeypatch.setattr(driver, "_groups", ProcessCache(driver.GROUP_CACHE))  # scheduled and emitted anew
        monkeypatch.setattr(program, "_codes", ProcessCache(program.CODE_CACHE))
        exe = polyjit.compile(blur, [InputInfo(img.shape, F32)], {"cache": False})
        np.testing.assert_allclose(exe(img), refs.blur(img.astype(np.float64)), rtol=1e-5, atol=1e-6)
        assert solves[:2] == [0, 1]
        assert exe.stats["kernels"] == (2 if give_up else 1)


def test_a_softmax_over_the_leading_dimension_is_not_fused_into_guarded_phases(rng):
    """A softmax over the leading dimension: fused, isl interleaved its three
    passes' phases inside the innermost loop behind branches on outer loops,
    which LLVM left scalar (15x the unfused time); the host schedules that
    group again without fusion (fusion.guarded_inner_loop)."""
    x = rng.standard_normal((64, 32, 64), dtype=F32)

    def sm(x):
        e = ops.exp(x - ops.unsqueeze(ops.max(x, [0]), 0))
        return e / ops.unsqueeze(ops.sum(e, [0]), 0)
    exe = polyjit.compile(sm, [InputInfo(x.shape, F32)], {"target": "cpu", "cache": False})
    assert exe.stats["kernels"] > 1
    e = np.exp(x - x.max(0))
    np.testing.assert_allclose(exe(x), e / e.sum(0), rtol=1e-5, atol=1e-6)


def test_output_and_anti_dependences_come_from_the_arrays_that_can_have_them():
    """The dataflow analysis runs its output and anti dependences only over
    arrays written twice or read before they are written (a sum's, a
    scatter's, a scan's): the validity it gives equals the three analyses
    over every access, on programs of sums, scans, scatters and windows."""
    import islpy as isl

    from polyjit.lowering import lower
    from polyjit.schedule.dependences import _rewritten, accesses, dependences, make_context, program_order

    def full(ctx, prog, dom, must, may, reads):
        order = program_order(ctx, prog).intersect_domain(dom)

        def flow(sink, must_src, may_src):
            info = isl.UnionAccessInfo.from_sink(sink).set_must_source(must_src).set_may_source(may_src)
            return info.set_schedule_map(order).compute_flow().get_may_dependence()
        none = isl.UnionMap.empty(isl.Space.params_alloc(ctx, 0))
        return flow(reads, must, may).union(flow(may, must, may)).union(flow(may, none, reads))

    cases = [(lambda x: ops.softmax(x, -1) * 2.0, [(6, 40)]),
             (lambda x, w: ops.relu(ops.matmul(x, w)) + 1.0, [(8, 12), (12, 5)]),
             (lambda x: ops.cumsum(ops.exp(x), 1), [(4, 9)]),
             (lambda x, i: ops.scatter_add([7, 3], i, ops.exp(x)), [(5, 3), ((5,), DataType.Int)]),
             (lambda x: ops.reduce_window("max", ops.relu(x), [1, 3, 3], [1, 2, 2]), [(2, 9, 9)])]
    rewritten = written = 0
    for fn, shapes in cases:
        infos = [InputInfo(list(s[0]), s[1]) if isinstance(s[1], DataType) else InputInfo(list(s), F32) for s in shapes]
        prog = lower(polyjit.compile(fn, infos, {"cache": False}).graph.deduplicated())
        ctx = make_context()
        dom = prog.domain(ctx)
        access = accesses(ctx, prog, dom)
        validity, _ = dependences(ctx, prog, dom, access)
        assert validity.is_equal(full(ctx, prog, dom, *access)), fn
        rewritten += len(_rewritten(prog, *access))
        written += len({s.array for s in prog.statements})
    assert rewritten < written / 2, (rewritten, written)  # (most arrays are written once, then read)


@pytest.mark.parametrize("k, stride, dilation", [(3, 1, 1), (5, 2, 1), (3, 2, 2)])
def test_a_padded_windows_taps_are_read_through_one_box(k, stride, dilation):
    """A padded depthwise window reads its input through clamped indices,
    each tap's access a relation of isl pieces; the program's reads give
    the taps one box instead, a single basic map, that holds every tap and,
    where the taps are adjacent, is their union."""
    import islpy as isl

    from polyjit.expr import to_isl
    from polyjit.lowering import lower
    from polyjit.schedule.dependences import make_context

    def f(x, w):
        return ops.relu(ops.conv(x, w, (stride, stride), ((k // 2, k // 2),) * 2, (dilation, dilation), groups=6,
                                 layout="NHWC", kernel_layout="HWIO"))
    prog = lower(polyjit.compile(f, [InputInfo([2, 13, 11, 6], F32), InputInfo([k, k, 1, 6], F32)],
                                 {"cache": False}).graph.deduplicated())
    ctx = make_context()
    dom = prog.domain(ctx)
    window = [(s, ld.array) for s in prog.statements for ld in prog.statement_loads(s)
              if any(to_isl(i) is not None and "min(" in to_isl(i) for i in ld.index)]
    assert window
    s, array = window[0]
    taps = isl.UnionMap.empty(isl.Space.params_alloc(ctx, 0))
    for ld in prog.statement_loads(s):
        if ld.array == array:
            taps = taps.union(prog.access(ctx, s, array, ld.index))
    taps = isl.Map.from_union_map(taps.intersect_domain(dom))
    box = prog.reads(ctx).intersect_domain(dom).extract_map(taps.get_space())
    assert box.n_basic_map() == 1 and taps.is_subset(box)
    assert box.is_equal(taps) == (dilation == 1)  # (dilated taps leave gaps that the box holds)


def test_a_rewrite_that_changed_nothing_keeps_its_schedule_unchecked(monkeypatch):
    """legal_or_kept compares the trees first: an unchanged one keeps its
    schedule without the dependence check; a changed one is checked, and an
    illegal one (a loop reversed against its dependence) is refused."""
    import importlib

    import islpy as isl
    deps = importlib.import_module("polyjit.schedule.dependences")  # (the package exports a function of its name)
    checks = []
    is_legal = deps.is_legal
    monkeypatch.setattr(deps, "is_legal", lambda s, v: checks.append(1) or is_legal(s, v))
    ctx = isl.Context()
    dom = isl.UnionSet.read_from_str(ctx, "{ S[i] : 0 <= i < 8 }")

    def loop(text):
        return isl.Schedule.from_domain(dom).insert_partial_schedule(isl.MultiUnionPwAff.read_from_str(ctx, text))
    forward, validity = loop("[{ S[i] -> [(i)] }]"), isl.UnionMap.read_from_str(ctx, "{ S[i] -> S[i + 1] : 0 <= i < 7 }")
    assert deps.legal_or_kept(loop("[{ S[i] -> [(i)] }]"), forward, validity) is forward and not checks
    assert deps.legal_or_kept(loop("[{ S[i] -> [(-i)] }]"), forward, validity) is forward and len(checks) == 1
    shifted = loop("[{ S[i] -> [(i + 1)] }]")
    assert deps.legal_or_kept(shifted, forward, validity) is shifted and len(checks) == 2


def test_nests_apart_are_scheduled_without_access_relations(monkeypatch):
    """A group of nests apart (in order, side by side) builds no access
    relations and contracts nothing: each temporary is written by one nest
    and read by later ones. A fused group of the same statements does both."""
    from polyjit.compiler import StageTimer
    from polyjit.lowering import lower
    from polyjit.schedule import driver
    from polyjit.schedule.groups import group_problem
    from polyjit.targets import target

    def f(x, s, b):
        scale = s * 2.0
        return ops.relu(x * scale + b * scale)
    prog = lower(polyjit.compile(f, [InputInfo([6, 16], F32), InputInfo([16], F32), InputInfo([16], F32)],
                                 {"cache": False}).graph.deduplicated())
    names = [s.name for s in prog.statements]
    built = []
    accesses = driver.accesses
    monkeypatch.setattr(driver, "accesses", lambda *a: built.append(1) or accesses(*a))
    config = ("max", None, target("cpu"), False)
    for kind in ("in_order", "side_by_side"):
        done = driver._schedule_problem(group_problem(prog, names, set(), **{kind: True}), config, StageTimer())
        assert done.contracted == {} and not built, kind
    driver._schedule_problem(group_problem(prog, names, set()), config, StageTimer())
    assert built


def test_a_register_blocks_trip_counts_are_its_tiles_widths():
    """member_trips, which sizes the copies of an unrolled register block:
    a tiled band's point loop takes its tile's width (4 of 10, under a
    sequence's filter too), a band with no loops outside takes its extent,
    and no bound where that extent is a symbolic size."""
    import islpy as isl
    from polyjit.schedule.tree import member_trips
    ctx = isl.Context()
    tiled = '{ schedule: "[{ S[i, j] -> [(floor(i/4))] }, { S[i, j] -> [(j)] }]", child: ' \
            '{ schedule: "[{ S[i, j] -> [(i)] }]" } }'
    for tree in (f'{{ domain: "{{ S[i, j] : 0 <= i < 10 and 0 <= j < 3 }}", child: {tiled} }}',
                 f'{{ domain: "{{ S[i, j] : 0 <= i < 10 and 0 <= j < 3; T[k] : 0 <= k < 5 }}", child: '
                 f'{{ sequence: [ {{ filter: "{{ T[k] }}" }}, {{ filter: "{{ S[i, j] }}", child: {tiled} }} ] }} }}'):
        band = isl.Schedule.read_from_str(ctx, tree).get_root().child(0)
        if band.get_type() == isl.schedule_node_type.sequence:
            band = band.child(1).child(0)
        assert (member_trips(band, 0), member_trips(band, 1), member_trips(band.child(0), 0)) == (3, 3, 4)
    symbolic = isl.Schedule.read_from_str(ctx, '{ domain: "[n] -> { S[i] : 0 <= i < n }", child: '
                                               '{ schedule: "[n] -> [{ S[i] -> [(i)] }]" } }')
    assert member_trips(symbolic.get_root().child(0), 0) is None
