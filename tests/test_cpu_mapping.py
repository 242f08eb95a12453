"""The CPU's mapping stage (codegen.cpu_mapping): each kernel's plan,
decided before emission, printed as exe.ir("mapping") and followed by the
emitter."""
import math
import re

import numpy as np
import pytest

import polyjit
from polyjit import InputInfo, ops
from polyjit.cache import ProcessCache
from polyjit.codegen import cpu_mapping, program
from polyjit.codegen.cpu import vector_bits
from polyjit.codegen.cpu_mapping import NARROWEST_VECTOR
from polyjit.library import blas
from polyjit.schedule.cpu_rewrites import block_shape

import refs

F32 = np.float32


def blur(img):
    k = ops.reshape(ops.full_like(img[0:1, 0:1, 0:5], 0.2), [1, 1, 1, 5])
    x = ops.reshape(img, [img.shape[0], 1, img.shape[1], img.shape[2]])
    y = ops.conv2d(ops.conv2d(x, k), ops.reshape(k, [1, 1, 5, 1]))
    return ops.reshape(y, [y.shape[0], y.shape[2], y.shape[3]])


def _mapping(fn, shapes, **options):
    exe = polyjit.compile(fn, [InputInfo(list(s), F32) for s in shapes], options)
    lines = exe.ir("mapping").splitlines()
    assert len(lines) == exe.stats["kernels"]
    return [line.split(": ", 1)[1] for line in lines]


def test_mapping_names_each_kernels_decisions():
    """A line per kernel: on the thread team or one thread, then its parallel
    loops, library calls, register blocks, streamed stores, private buffers."""
    [small_blur] = _mapping(blur, [(3, 64, 80)])  # three images for more threads: strips with halos
    assert small_blur.startswith("thread team; parallel c0 x strips of c1 (halo 4, ring 5)")
    assert "streaming" not in small_blur and "(stack)" in small_blur
    [large_blur] = _mapping(blur, [(3, 1030, 1029)])
    assert "streaming stores to" in large_blur
    lanes = vector_bits() // 32
    products = math.prod(block_shape(128, 256, lanes))
    mm = _mapping(ops.matmul, [(128, 256), (256, 256)], contractions="generated")
    want = rf"thread team; parallel c0; register blocks of {products} products; c\d+ in vectors of {lanes}"
    assert re.fullmatch(want, mm[-1]), mm
    assert _mapping(lambda x: ops.sum(x), [(5,)]) == ["one thread; plain loops"]  # no parallel loop
    assert _mapping(lambda x: x * 2.0, [(256, 256)]) == ["thread team; parallel c0"]
    if blas() is not None:
        [gemm] = _mapping(ops.matmul, [(128, 256), (256, 256)], contractions="library")
        assert gemm.startswith("thread team; BLAS sgemm of ") and gemm.endswith("per part")


def test_a_small_kernel_runs_on_one_thread():
    """Fewer than ONE_THREAD_WORK statement instances (a batch norm's
    per-channel scale folded into a convolution's weights) are not shared
    with the thread team: its loop keeps constant bounds."""
    small = (16, cpu_mapping.ONE_THREAD_WORK // 16 - 1)
    assert _mapping(lambda x: ops.exp(x) * 2.0, [small]) == ["one thread; plain loops"]
    assert _mapping(lambda x: ops.exp(x) * 2.0, [(16, cpu_mapping.ONE_THREAD_WORK // 16)]) == \
        ["thread team; parallel c0; plain loops"]
    x = np.random.default_rng(0).standard_normal(small).astype(F32)
    exe = polyjit.compile(lambda x: ops.exp(x) * 2.0, [InputInfo(list(small), F32)])
    np.testing.assert_allclose(exe(x), np.exp(x) * 2.0, rtol=1e-6)


def test_a_kernel_of_little_work_is_compiled_with_plain_loops(rng):
    """Under PLAIN_WORK statement instances (a small network's last layers,
    its weight preparation) LLVM neither unrolls nor vectorizes the
    kernel's loops, which took most of such kernels' compile time for
    microseconds a call; a larger kernel keeps both."""
    def fn(x):
        return x * 2.0 + 1.0
    few, many = (8, 6, 6, 32), (8, 48, 48, 32)
    for shape, plain in ((few, True), (many, False)):
        exe = polyjit.compile(fn, [InputInfo(list(shape), F32)])
        assert ("plain loops" in exe.ir("mapping")) == plain
        assert ("x float>" in exe.ir("llvm_opt")) == (not plain), shape
        x = rng.standard_normal(shape).astype(F32)
        np.testing.assert_allclose(exe(x), x * 2.0 + 1.0, rtol=1e-6)


def test_work_counts_each_element_a_statement_reads(rng):
    """A depthwise 7x7 convolution of few positions reads 49 elements an
    instance: its work is past PLAIN_WORK, so LLVM vectorizes it (counted
    by instances, it ran as scalar code)."""
    def fn(x, w):
        return ops.conv2d(x, w, padding=3, groups=32)
    shapes = [(2, 32, 16, 16), (32, 1, 7, 7)]
    assert 2 * 32 * 16 * 16 < cpu_mapping.PLAIN_WORK <= 2 * 32 * 16 * 16 * 49
    exe = polyjit.compile(fn, [InputInfo(list(s), F32) for s in shapes])
    assert "plain loops" not in exe.ir("mapping") and "x float>" in exe.ir("llvm_opt")
    x, w = (rng.standard_normal(s).astype(F32) for s in shapes)
    np.testing.assert_allclose(exe(x, w), refs.conv2d(x, w, padding=((3, 3), (3, 3)), groups=32), rtol=1e-5, atol=1e-5)


def test_a_fused_group_keeps_its_parallel_loops(monkeypatch, llvm_workers):
    """A dense layer's input gradient broadcast over pooled cells (flax's
    average pooling): isl's clustering scheduler put the weight's transpose
    under the outer loops of the product that reads it, which then carried
    the dependence, and both kernels ran on one thread. Scheduled again
    without fusion, each keeps its parallel loop (the transpose, small,
    counted as large enough to share)."""
    llvm_workers(0)  # (mapped in this process, where the patch below holds, not in worker processes)
    monkeypatch.setattr(cpu_mapping, "ONE_THREAD_WORK", 0)

    def grad(r, w, x):
        d = ops.matmul(r, ops.transpose(w, 0, 1))
        return ops.reshape(d, [8, 1, 1, 64]) * x / 256.0
    plans = _mapping(grad, [(8, 10), (64, 10), (8, 17, 17, 64)], cache=False)
    assert all(p.startswith("thread team") for p in plans), plans


def test_mapping_is_dumped_and_cached(tmp_path, monkeypatch):
    """The stage is in the debug folder, and in a program loaded from the compile cache."""
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(tmp_path / "cache"))
    exe = polyjit.compile(blur, [InputInfo([3, 12, 12], F32)], {"debug": True, "dump_dir": str(tmp_path / "dump")})
    dumped = [f for d in (tmp_path / "dump").iterdir() for f in d.iterdir() if f.name.endswith("_mapping.txt")]
    assert len(dumped) == 1 and dumped[0].read_text() == exe.ir("mapping") + "\n"
    hit = polyjit.compile(blur, [InputInfo([3, 12, 12], F32)])
    assert hit.stats["cache_hits"] == 1 and hit.ir("mapping") == exe.ir("mapping")


def test_emitter_follows_the_plan(monkeypatch, rng):
    """A plan without strips is emitted without them (and still computes the blur)."""
    monkeypatch.setattr(cpu_mapping.CpuMapper, "row_strips", lambda self, loop: None)
    monkeypatch.setattr(program, "_codes", ProcessCache(program.CODE_CACHE))  # no code shared from earlier compiles
    img = rng.random((3, 40, 50), dtype=F32)
    exe = polyjit.compile(blur, [InputInfo(list(img.shape), F32)], {"cache": False, "num_threads": 2})
    assert exe.ir("mapping").split(": ", 1)[1].startswith("thread team; parallel c0; private")
    assert "strip.item" not in exe.ir("llvm")
    np.testing.assert_allclose(exe(img), refs.blur(img.astype(np.float64)), rtol=1e-5, atol=1e-6)


def test_batch_norm_backward_in_nchw_runs_on_the_thread_team(rng):
    """A batch norm's backward in NCHW: two per-channel sums over the batch
    and image, and the elementwise pass that needs them, fused. isl puts the
    batch loop outermost (shifted: the pass needs both images' sums), which
    carries the sums; the channel loop, parallel, goes outside it."""
    def bn_backward(a, gy, x, m):
        g = ops.where(a <= 0.0, ops.zeros_like(gy), gy)
        xm = x - ops.reshape(m, [1, 16, 1, 1])
        s1 = ops.sum(g * xm, [0, 2, 3])
        s2 = ops.sum(g, [0, 2, 3])
        return g - xm * ops.reshape(s1 * 1e-3, [1, 16, 1, 1]) - ops.reshape(s2 * 1e-3, [1, 16, 1, 1]), s1, s2
    shapes = [(2, 16, 40, 40)] * 3 + [(16,)]
    plans = _mapping(bn_backward, shapes, num_threads=2)
    assert all(p.startswith("thread team; parallel") for p in plans), plans
    args = [rng.standard_normal(s).astype(F32) for s in shapes]
    exe = polyjit.compile(bn_backward, [InputInfo(list(s), F32) for s in shapes], {"num_threads": 2})
    g = np.where(args[0] <= 0, 0, args[1])
    xm = args[2] - args[3].reshape(1, 16, 1, 1)
    s1, s2 = (g * xm).sum((0, 2, 3)), g.sum((0, 2, 3))
    want = g - xm * (s1 * 1e-3).reshape(1, 16, 1, 1) - (s2 * 1e-3).reshape(1, 16, 1, 1)
    for got, ref in zip(exe(*args), (want, s1, s2)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_channels_last_sums_run_in_strips_on_the_thread_team(rng):
    """A batch norm's per-channel sums over NHWC's N, H and W (a flax CNN's
    gradient), where the channels are too few to share: cut into a strip
    of images per thread (targets.cpu.column_strips), the strips summed on
    the team with the channels innermost, then added in a kernel of their
    own (fused with the strips, the addition made their loop sequential),
    small enough for one thread."""
    def sums(g, x):
        gx = g * x
        return ops.sum(g, [0, 1, 2]), ops.sum(ops.maximum(gx, 0.0) * x, [0, 1, 2])
    shapes = [(8, 16, 16, 32)] * 2
    plans = _mapping(sums, shapes, num_threads=2, cache=False)
    assert plans == ["thread team; parallel c0", "one thread; plain loops"] * 2, plans
    exe = polyjit.compile(sums, [InputInfo(list(s), F32) for s in shapes], {"num_threads": 2, "cache": False})
    g, x = (rng.standard_normal(s).astype(F32) for s in shapes)
    s1, s2 = exe(g, x)
    np.testing.assert_allclose(s1, g.sum((0, 1, 2)), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s2, (np.maximum(g * x, 0) * x).sum((0, 1, 2)), rtol=1e-4, atol=1e-4)
    lines = exe.ir("ast").splitlines()
    update = next(k for k, line in enumerate(lines) if line.strip().startswith("S1("))
    channel = re.match(r"\s*S1\(c\d+, (c\d+)", lines[update]).group(1)
    assert f"for (int {channel} =" in lines[update - 1], exe.ir("ast")


@pytest.mark.parametrize("axes", [[0], [0, 1]])
def test_column_sums_keep_their_columns_innermost(axes, rng):
    """A bias gradient (sums down the rows of [512, 1024], or over the
    first two dims of [4, 128, 1024]): the columns stay the innermost loop,
    walking memory in order (the threads share strips of them where the
    sum is large enough), rather than each thread reading its columns down
    the rows."""
    x = rng.standard_normal((4, 128, 1024)).astype(F32)
    exe = polyjit.compile(lambda x: ops.sum(x if len(axes) == 2 else ops.reshape(x, [512, 1024]), axes),
                          [InputInfo(list(x.shape), F32)], {"num_threads": 2, "cache": False})
    np.testing.assert_allclose(exe(x), x.reshape(512, 1024).sum(0), rtol=1e-4, atol=1e-4)
    lines = exe.ir("ast").splitlines()
    update = next(k for k, line in enumerate(lines) if line.strip().startswith("S1("))
    column = re.match(r"\s*S1\((c\d)", lines[update]).group(1)
    assert f"for (int {column} =" in lines[update - 1], exe.ir("ast")


@pytest.mark.parametrize("m,k,n", [(64, 48, 128), (20, 33, 77), (3, 5, 7), (40, 24, 8)])
def test_whole_register_blocks_are_emitted_in_vectors(m, k, n, rng):
    """A product's register block is emitted as vector operations where its
    columns are whole vectors (one IR instruction per vector, not per
    element, for LLVM to take apart) or one narrower vector (8 columns),
    scalars elsewhere; the results agree with numpy either way, NaN and
    infinities included."""
    a, b = rng.standard_normal((m, k), dtype=F32), rng.standard_normal((k, n), dtype=F32)
    a[0, 0], b[1, 2] = np.nan, np.inf
    exe = polyjit.compile(lambda a, b: ops.matmul(a, b) * 2.0, [InputInfo(a.shape, F32), InputInfo(b.shape, F32)],
                          {"contractions": "generated", "cache": False})
    lanes = vector_bits() // 32
    cols = block_shape(m, n, lanes)[1]  # (a partial block of columns has a guard: scalars)
    width = None if n % cols else lanes if cols >= lanes else cols if cols % NARROWEST_VECTOR == 0 else None
    assert (f"in vectors of {lanes}" in exe.ir("mapping")) == bool(width), exe.ir("mapping")
    assert (f"<{width} x float>" in exe.ir("llvm")) if width else f"<{lanes} x float>" not in exe.ir("llvm")
    np.testing.assert_allclose(exe(a, b), (a.astype(np.float64) @ b) * 2, rtol=1e-5, atol=1e-5)


def test_register_blocks_over_symbolic_rows_have_a_whole_copy(rng):
    """Rows over a symbolic size end in a partial register block (min(n -
    1, 4t + 3)): whole blocks run a copy of their own without a check per
    row, the last one the checked copy; every row count agrees with numpy."""
    exe = polyjit.compile(lambda a, b: ops.matmul(a, b), [InputInfo([-1, 32], F32), InputInfo([32, 64], F32)],
                          {"contractions": "generated", "cache": False})
    assert "block.whole" in exe.ir("llvm") and "block.part" in exe.ir("llvm")
    b = rng.standard_normal((32, 64), dtype=F32)
    for m in (1, 3, 4, 9, 130):
        a = rng.standard_normal((m, 32), dtype=F32)
        np.testing.assert_allclose(exe(a, b), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


def test_products_over_runs_of_symbolic_dims_are_products_of_matrices(rng):
    """A dense layer over a symbolic batch and sequence as JAX writes it
    ([b, s, d] x [d, n]) and its weight's gradient (contracting b and s)
    are products of [b*s, ...] matrices on every CPU: the gradient had
    been a nest over both symbolic dims, forty times slower."""
    f = lambda x, w, g: (ops.dot_general(x, w, ((2,), (0,))), ops.dot_general(x, g, ((0, 1), (0, 1))))  # noqa: E731
    exe = polyjit.compile(f, [InputInfo([-1, -1, 12], F32), InputInfo([12, 7], F32), InputInfo([-1, -1, 7], F32)],
                          {"cache": False})
    products = exe.stats["contractions"]
    assert len(products) == 2 and all(re.match(r"dot_general \[\w+, \d+\] \* \[\w+, \d+\]", p) for p in products), \
        products
    w = rng.standard_normal((12, 7), dtype=F32)
    for b, s in ((3, 10), (1, 5)):
        x, g = rng.standard_normal((b, s, 12), dtype=F32), rng.standard_normal((b, s, 7), dtype=F32)
        y, dw = exe(x, w, g)
        np.testing.assert_allclose(y, np.einsum("bsd,dn->bsn", x, w), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dw, np.einsum("bsd,bsn->dn", x, g), rtol=1e-5, atol=1e-5)


def test_a_padded_convolution_keeps_its_guarded_loads_scalar(rng):
    """A float64 NCHW convolution's register block runs along image
    columns, where the padding guard differs from lane to lane: no vectors
    there (the fill cell holds one element), and the result is eager's."""
    x, w = rng.standard_normal((2, 16, 12, 12)), rng.standard_normal((32, 16, 3, 3))
    exe = polyjit.compile(lambda x, w: ops.conv(x, w, (1, 1), ((1, 1), (1, 1))),
                          [InputInfo(x.shape, np.float64), InputInfo(w.shape, np.float64)],
                          {"contractions": "generated", "cache": False})
    assert "register blocks" in exe.ir("mapping") and "vectors of" not in exe.ir("mapping")
    np.testing.assert_allclose(exe(x, w), refs.conv2d(x, w, padding=((1, 1), (1, 1))), rtol=1e-10, atol=1e-10)


_PTX_LOOP = """
define ptx_kernel void @k(ptr addrspace(1) %a) {
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%n, %loop]
  %p = getelementptr float, ptr addrspace(1) %a, i64 %i
  %x = load float, ptr addrspace(1) %p
  %y = fmul float %x, 2.0
  %z = fadd float %y, 1.0
  %w = fmul float %z, %x
  store float %w, ptr addrspace(1) %p
  %n = add i64 %i, 1
  %c = icmp slt i64 %n, 40
  br i1 %c, label %loop, label %done
done:
  ret void
}
"""


def test_cpu_kernels_unroll_whole_loops_less_than_llvm_would(monkeypatch, rng):
    """CPU kernels run LLVM's O3 under a smaller limit for unrolling loops
    whole (codegen.cpu.CPU_UNROLL_THRESHOLD): an elementwise kernel over 3 x
    3 x some vectors a row is no longer one straight line of vector stores
    (LLVM's costs depend on the host's CPU: the rows where the limits part
    differ, so several are compiled). The limit is a process-wide LLVM
    option: the PTX pipeline sets LLVM's own back (a 40-trip loop unrolled
    by 8 there, by 4 under the CPU's limit). (Kernels of any size: the
    small ones compiled here would otherwise have plain loops.)"""
    from polyjit.codegen import cpu, nvgpu, workers
    monkeypatch.setattr(workers, "_workers", workers.LlvmWorkers(0))  # (LLVM in this process, which sees the patch)
    monkeypatch.setattr(cpu_mapping, "PLAIN_WORK", 0)
    stores = {}
    for vectors in (12, 16, 21, 32):
        row = vectors * (vector_bits() // 32)
        x, b = rng.standard_normal((8, 3, 3, row), dtype=F32), rng.standard_normal(row, dtype=F32)
        for limit in (cpu.LLVM_UNROLL_THRESHOLD, cpu.CPU_UNROLL_THRESHOLD):
            monkeypatch.setattr(cpu, "CPU_UNROLL_THRESHOLD", limit)
            monkeypatch.setattr(program, "_codes", ProcessCache(program.CODE_CACHE))
            exe = polyjit.compile(lambda x, b: ops.minimum(ops.maximum(x + b, 0.0), 6.0),
                                  [InputInfo(x.shape, F32), InputInfo(b.shape, F32)], {"cache": False})
            np.testing.assert_allclose(exe(x, b), np.clip(x + b, 0, 6))
            stores[vectors, limit] = len(re.findall(r"store <", exe.compile_default().ir["llvm_opt"]))
    fewer = [stores[v, cpu.CPU_UNROLL_THRESHOLD] < stores[v, cpu.LLVM_UNROLL_THRESHOLD] for v in (12, 16, 21, 32)]
    assert any(fewer) and all(stores[v, cpu.CPU_UNROLL_THRESHOLD] <= stores[v, cpu.LLVM_UNROLL_THRESHOLD]
                              for v in (12, 16, 21, 32)), stores
    assert len(re.findall(r"ld\.global", nvgpu.ptx(_PTX_LOOP, "sm_90")[1])) == 8


def test_a_kernels_body_stays_a_function_its_entry_calls(rng):
    """Each kernel's loops are a noinline function of their own, with noalias
    arrays, which the entry calls once it has unpacked its arguments: inlined,
    LLVM's O3 simplified the loops twice and turned each noalias pointer
    into alias scopes on every access (codegen.llvm.Emitter.kernel)."""
    x, b = rng.standard_normal((8, 6, 6, 32), dtype=F32), rng.standard_normal(32, dtype=F32)
    exe = polyjit.compile(lambda x, b: ops.minimum(ops.maximum(x + b, 0.0), 6.0),
                          [InputInfo(x.shape, F32), InputInfo(b.shape, F32)], {"cache": False})
    np.testing.assert_allclose(exe(x, b), np.clip(x + b, 0, 6))
    opt = exe.compile_default().ir["llvm_opt"]
    bodies = re.findall(r"^define internal (?:\w+ )*void @\"?(\w+_body)\"?\(ptr noalias", opt, re.M)
    assert len(bodies) == exe.stats["kernels"], opt[:2000]
    for name in bodies:
        assert re.search(rf"call (?:\w+ )*void @\"?{name}\"?\(", opt), name
    assert "noalias.scope" not in opt  # (the scopes the inliner declares for noalias arguments)


def test_only_register_blocks_keep_llvms_loop_strength_reduction(rng):
    """A kernel's module without register blocks (a product's epilogue
    apart, an elementwise or a window's nest) is tagged for code without
    loop strength reduction; a product's blocks keep it (their address
    streams need it: codegen.cpu.NO_STRENGTH_REDUCTION)."""
    from polyjit.codegen.cpu import NO_STRENGTH_REDUCTION
    from polyjit.codegen.program import compile_object
    a, b = rng.standard_normal((128, 256), dtype=F32), rng.standard_normal((256, 256), dtype=F32)
    exe = polyjit.compile(lambda a, b: ops.exp(ops.matmul(a, b) * 0.01) + ops.sum(a, 1)[:, None],
                          [InputInfo(a.shape, F32), InputInfo(b.shape, F32)],
                          {"contractions": "generated", "fusion": "none", "cache": False})
    want = np.exp((a.astype(np.float64) @ b) * 0.01) + a.astype(np.float64).sum(1)[:, None]
    np.testing.assert_allclose(exe(a, b), want, rtol=1e-5, atol=1e-5)
    modules = exe.ir("llvm").split("; ModuleID")[2:]  # (the first: the program's entries)
    plans = exe.ir("mapping").splitlines()
    assert len(modules) == len(plans) == exe.stats["kernels"] > 2, plans
    differs = []
    for text, plan in zip(modules, plans):
        tagged = f"!{NO_STRENGTH_REDUCTION} =" in text
        assert tagged == ("register blocks" not in plan), plan
        if tagged:  # the tag reaches code generation: without it, other code
            text = "; ModuleID" + text
            differs.append(compile_object(text)[1] != compile_object(text.split(f"!{NO_STRENGTH_REDUCTION} =")[0])[1])
    assert any(differs), differs


@pytest.mark.parametrize("fill", [float("-inf"), -1e9])
def test_a_masked_row_maximum_is_vectorized(fill, rng, monkeypatch, llvm_workers):
    """A causal mask's ``masked_fill(mask, -inf)`` then the row's maximum (a
    softmax's first pass): the maximum runs in vectors, as with a finite
    fill. LLVM had folded the -inf into the maximum as a select around it,
    a reduction its loop vectorizer does not take: scalar, 17 times slower.
    (A kernel of any size: this small one would otherwise have plain loops.)"""
    llvm_workers(0)
    monkeypatch.setattr(cpu_mapping, "PLAIN_WORK", 0)
    x = rng.standard_normal((4, 256), dtype=F32)
    mask = np.triu(np.ones((4, 256), bool), 1)
    exe = polyjit.compile(lambda x, m: ops.max(ops.where(m, fill, x), [1]),
                          [InputInfo(x.shape, F32), InputInfo(mask.shape, np.bool_)], {"cache": False})
    np.testing.assert_array_equal(exe(x, mask), np.where(mask, fill, x).max(1))
    assert re.search(r"@llvm\.(vector\.reduce\.fmaximum|maximum)\.v\d+f32", exe.compile_default().ir["llvm_opt"])


@pytest.mark.parametrize("unsqueezed", [False, True])
def test_attention_keys_transposed_through_a_reshape_are_packed(unsqueezed, rng):
    """q @ k.transpose(-1, -2) as PyTorch hands it over: the keys transposed,
    then batch and heads merged by a reshape (einsum's form adds a dimension
    of one). The reshape keeps the transposed dimensions, so the product's
    second operand runs across its last dimension and is packed first; read
    in place, the register blocks gathered it a column at a time (five times
    eager's time)."""
    q, k = rng.standard_normal((2, 3, 128, 64), dtype=F32), rng.standard_normal((2, 3, 128, 64), dtype=F32)

    def scores(q, k):
        kt = ops.permute(ops.reshape(k, [2, 3, 128, 64, 1]), [0, 1, 4, 3, 2]) if unsqueezed else ops.permute(k, [0, 1, 3, 2])
        b = ops.reshape(kt, [6, 64, 128])
        return ops.dot_general(ops.reshape(q, [6, 128, 64]), b, ((2,), (1,)), ((0,), (0,)))
    plans = _mapping(scores, [q.shape, k.shape], cache=False, contractions="generated")
    assert len(plans) == 2 and "register blocks" in plans[1], plans  # (the keys' copy, then the product)
    exe = polyjit.compile(scores, [InputInfo(q.shape, F32), InputInfo(k.shape, F32)],
                          {"cache": False, "contractions": "generated"})
    np.testing.assert_allclose(exe(q, k), np.einsum("bhqd,bhkd->bhqk", q, k).reshape(6, 128, 128),
                               rtol=1e-4, atol=1e-4)


def test_a_per_channel_value_is_not_a_transposition(rng):
    """A group norm's affine step reads its bias by channel, a loop outside
    the innermost that leaves the bias alone: not a transposing copy. It
    keeps the array's own loop order, parallel over images; tiled as one,
    its channels ran inside the rows at a stride of a whole plane (1.7x
    eager's time)."""
    x, s, b = (rng.standard_normal(sh, dtype=F32) for sh in ((16, 8, 64, 64), (16, 4), (8,)))

    def affine(x, s, b):
        scale = ops.reshape(ops.broadcast_in_dim(s, [16, 4, 2], [0, 1]), [16, 8])
        return x * ops.broadcast_in_dim(scale, x.shape, [0, 1]) + ops.broadcast_in_dim(b, x.shape, [1])
    plans = _mapping(affine, [x.shape, s.shape, b.shape], cache=False)
    assert plans == ["thread team; parallel c0"], plans
    exe = polyjit.compile(affine, [InputInfo(a.shape, F32) for a in (x, s, b)], {"cache": False})
    want = x * np.repeat(s, 2, 1)[:, :, None, None] + b[:, None, None]
    np.testing.assert_allclose(exe(x, s, b), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [77, 50 * 64 + 17])
def test_partial_register_blocks_leave_whole_blocks_unchecked(n, rng):
    """A product whose columns end in a partial register block: whole blocks
    run their copies without checks, the partial one checked copies.
    Copies checked against the range in every block had kept the sums in
    memory (bench/NOTES.md)."""
    a, b = rng.standard_normal((64, 32), dtype=F32), rng.standard_normal((32, n), dtype=F32)
    exe = polyjit.compile(ops.matmul, [InputInfo(a.shape, F32), InputInfo(b.shape, F32)],
                          {"target": "cpu", "contractions": "generated", "cache": False})
    text = exe.ir("llvm")
    assert "block.whole" in text and "block.part" in text
    np.testing.assert_allclose(exe(a, b), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
