"""The runtime: cached output memory, shared work, thread teams."""
import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import polyjit
from polyjit import InputInfo, ops
from polyjit.runtime import BufferCache

F32 = np.float32


def test_outputs_alive_are_never_reused(rng):
    exe = polyjit.compile(lambda x: ops.exp(x) * 2, [InputInfo([512, 1024], F32)])
    x1, x2 = rng.standard_normal((2, 512, 1024), dtype=F32)
    y1 = exe(x1)
    view = exe(x2)[1:]  # a view alone keeps its block
    y3 = exe(x1)
    np.testing.assert_allclose(y1, np.exp(x1) * 2, rtol=1e-6)
    np.testing.assert_allclose(view, (np.exp(x2) * 2)[1:], rtol=1e-6)
    assert not np.shares_memory(y1, y3) and not np.shares_memory(view, y3)


def test_buffer_cache_reuses_dropped_blocks():
    cache = BufferCache()
    a = cache.empty((1024, 1024), F32)
    p = a.ctypes.data
    assert p % 64 == 0 and a.shape == (1024, 1024) and a.dtype == F32
    del a
    gc.collect()
    b = cache.empty((512, 2048), F32)
    assert b.ctypes.data == p and cache.held == 0
    small = [cache.empty((n,), F32) for n in (1, 3, 5, 17, 33, 100, 257, 1000)]  # (numpy aligns to 16 bytes)
    assert all(s.ctypes.data % 64 == 0 for s in small) and cache.held == 0  # aligned as DLPack's consumers want
    assert [s.shape for s in small] == [(n,) for n in (1, 3, 5, 17, 33, 100, 257, 1000)]


def test_repeated_subexpressions_are_computed_once(rng):
    def twice(x):
        m1 = ops.sum(x, [1], True) / x.shape[1]
        m2 = ops.sum(x, [1], True) / x.shape[1]  # as a decomposition might repeat it
        return (x - m1) * (x - m2)
    x = rng.standard_normal((64, 300), dtype=F32)
    exe = polyjit.compile(twice, [InputInfo(x.shape, F32)])
    m = x.mean(1, keepdims=True)
    np.testing.assert_allclose(exe(x), (x - m) ** 2, rtol=1e-4, atol=1e-5)
    assert exe.stats["statements"] == 3  # one sum (init, update), one output


def test_thread_pool_team_matches(rng):
    """Without libgomp the parts run on Python threads; the results are the same."""
    code = ("import numpy as np, polyjit; from polyjit import ops, InputInfo;"
            "from polyjit.runtime.threads import thread_team, PoolTeam;"
            "x = np.random.default_rng(0).standard_normal((256, 4096), dtype=np.float32);"
            "exe = polyjit.compile(ops.softmax, [InputInfo(x.shape, np.float32)], {'num_threads': 2});"
            "e = np.exp(x - x.max(1, keepdims=True));"
            "np.testing.assert_allclose(exe(x), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7);"
            "assert isinstance(thread_team(), PoolTeam) and exe.stats['parallel_kernels'] >= 1")
    env = {**os.environ, "POLYJIT_THREADS": "pool"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_profile_counts_each_kernels_seconds(rng, monkeypatch):
    """POLYJIT_PROFILE=1: stats["kernel_seconds"] adds up each kernel's time per call."""
    from polyjit.runtime import program
    monkeypatch.setattr(program, "PROFILE", True)
    exe = polyjit.compile(lambda x: ops.sum(ops.exp(x), 1) + ops.sum(x * x), [InputInfo([64, 300], F32)],
                          {"target": "cpu", "fusion": "none"})
    x = rng.standard_normal((64, 300), dtype=F32)
    exe(x)
    prog = exe.last
    first = dict(prog.stats["kernel_seconds"])
    exe(x)
    assert sorted(first) == sorted(k.name for k in prog.kernels) and len(first) >= 2
    assert all(prog.stats["kernel_seconds"][k] > v > 0 for k, v in first.items())


def test_an_output_reshaping_a_temporary_is_that_array(rng):
    """A result that reshapes a temporary (here a library product's, on
    BLAS) is not copied: the product writes the output array, handed out in
    the result's shape; a result returned as is stays as it was."""
    def fn(x, w):
        y = ops.matmul(ops.reshape(x, [8, 16]), w)
        return ops.reshape(y, [2, 4, 32]), ops.exp(y)
    exe = polyjit.compile(fn, [InputInfo([2, 4, 16], F32), InputInfo([16, 32], F32)], {"contractions": "library"})
    x, w = rng.standard_normal((2, 4, 16)).astype(F32), rng.standard_normal((16, 32)).astype(F32)
    got, e = exe(x, w)
    ref = x.reshape(8, 16).astype(np.float64) @ w
    assert got.shape == (2, 4, 32) and e.shape == (8, 32)
    np.testing.assert_allclose(got, ref.reshape(2, 4, 32), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(e, np.exp(ref), rtol=1e-4)
    affine = exe.ir("affine")
    assert "out0[8, 32] as [2, 4, 32]" in affine and "out0[i0, i1, i2] =" not in affine  # (no copy into it)
    assert exe.stats["library_calls"] == 1


def _layered(x):
    for _ in range(6):
        x = ops.tanh(x - ops.sum(x, [1], True) / 300.0) + ops.max(x, [1], True)
    return x


def _layered_ref(x):
    x = x.astype(np.float64)
    for _ in range(6):
        x = np.tanh(x - x.sum(1, keepdims=True) / 300.0) + x.max(1, keepdims=True)
    return x


def test_workspace_layout_shares_bytes_of_disjoint_lifetimes():
    from polyjit.runtime.buffers import workspace_layout
    offsets, total = workspace_layout({"a": 100, "b": 100, "c": 100, "d": 10},
                                      {"a": (0, 1), "b": (2, 3), "c": (1, 2)})
    assert offsets["a"] == offsets["b"] == 0 and offsets["c"] == 128  # c meets both; b follows a
    assert offsets["d"] == 256 and total == 320  # d: no span, its own bytes
    assert all(o % 64 == 0 for o in offsets.values())


def test_temporaries_share_one_workspace_and_calls_run_from_host_code(rng, monkeypatch):
    """Temporaries whose kernels do not overlap share the bytes of one
    workspace, the same block from call to call (no fresh pages); from a
    plan's first call its kernels run from host code (runtime.launch), built
    then: a second call is no second compile. The results are the same each
    way, and with POLYJIT_POISON each temporary has bytes of its own, NaN
    before its kernel writes it."""
    from polyjit.runtime import program
    x = rng.standard_normal((64, 300)).astype(F32)
    ref = _layered_ref(x)
    for poison in (False, True):
        monkeypatch.setattr(program, "POISON", poison)
        exe = polyjit.compile(_layered, [InputInfo(x.shape, F32)], {"target": "cpu", "fusion": "none"})
        outs = [exe(x)]
        plan = next(iter(exe.last._plans.values()))
        assert len(exe.last.kernels) >= program.NATIVE_MIN_KERNELS and plan.native and plan.calls == 1
        outs += [exe(x) for _ in range(2)]
        for y in outs:
            np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
        assert plan.native is next(iter(exe.last._plans.values())).native  # (built once)
        shared = exe.stats["workspace_bytes"] < exe.stats["intermediate_bytes"] / 2
        assert shared != poison


def test_the_first_plans_launcher_is_ready_at_its_first_call_a_later_ones_at_its_second(rng):
    """The call that compiled a program builds its plan's launcher, so that
    the second call is no second compile; a later signature (a symbolic
    size at a new value) builds its own at its second call, one seen once
    not being worth it. The first runs its kernels on the thread team, the
    smaller second each kernel whole (too little work to share)."""
    from polyjit.runtime import program
    exe = polyjit.compile(_layered, [InputInfo((-1, 300), F32)], {"target": "cpu", "fusion": "none"})
    threads = set()
    for rows, first in ((64, True), (4, False)):
        x = rng.standard_normal((rows, 300)).astype(F32)
        for call in (1, 2):
            np.testing.assert_allclose(exe(x), _layered_ref(x), rtol=1e-5, atol=1e-5)
            plan = next(p for key, p in exe.last._plans.items() if key[0][0] == x.shape)
            assert plan.calls == call and bool(plan.native) == (first or call == 2)
        threads.add(plan.threads)
    assert len(exe.last._plans) == 2 and len(exe.last.kernels) >= program.NATIVE_MIN_KERNELS
    assert threads == {1, exe.last.num_threads} or exe.last.num_threads == 1


def test_an_output_handed_out_twice_still_runs_from_host_code(rng):
    """A result returned twice (a training forward's output that it also
    saves for the backward) is one result of the native call."""
    x = rng.standard_normal((64, 300)).astype(F32)
    exe = polyjit.compile(lambda x: (_layered(x), _layered(x)), [InputInfo(x.shape, F32)],
                          {"target": "cpu", "fusion": "none"})
    for _ in range(3):
        a, b = exe(x)
        np.testing.assert_allclose(a, _layered_ref(x), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(a, b)
    prog = exe.last
    assert len(prog.output_arrays) == 2 > len(set(prog.output_arrays)) and next(iter(prog._plans.values())).native


@pytest.mark.parametrize("poison", [False, True])
def test_an_xla_calls_cpu_launcher_keeps_a_workspace_for_its_temporaries(poison, rng, monkeypatch):
    """A launcher for XLA's custom calls (native_launcher) takes only the
    outputs as results and places the temporaries in a workspace of its
    own, kept from call to call (XLA allocated them fresh at each call, and
    every page faulted in again). Calls from two threads at once stay right:
    the one that finds the workspace in use makes one of its own."""
    import ctypes
    import threading

    from polyjit.runtime import launch, program
    monkeypatch.setattr(program, "POISON", poison)
    x = rng.standard_normal((64, 300)).astype(F32)
    exe = polyjit.compile(_layered, [InputInfo(x.shape, F32)], {"target": "cpu", "fusion": "none"})
    exe(x)
    prog = exe.last
    launcher = prog.native_launcher([x], f"polyjit_test_workspace_{int(poison)}")
    assert [name for name, _, _ in launcher.results] == prog.output_arrays and launcher.plan.workspace_bytes > 0
    assert len(launcher.plan.workspace) == len(next(iter(prog._plans.values())).temps) > 0
    run = launch.LAUNCH_T(launcher.address)
    ref, failures = _layered_ref(x), []
    start = threading.Barrier(2)

    def calls():
        start.wait()
        for _ in range(20):
            y = np.empty_like(x)
            message = ctypes.create_string_buffer(256)
            code = run((ctypes.c_void_p * 1)(x.ctypes.data), (ctypes.c_void_p * 1)(y.ctypes.data), None, message, 256)
            if code or not np.allclose(y, ref, rtol=1e-5, atol=1e-5):
                failures.append((code, message.value))
    threads = [threading.Thread(target=calls) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]


def test_libgomp_loaded_by_polyjit_spins_briefly(monkeypatch):
    """A libgomp that polyjit loads itself reads a short spin count as it
    loads (its default spins away the time slices of a loaded host); one
    the user configured keeps the user's setting; the environment is left
    as it was."""
    import ctypes

    from polyjit.runtime import threads
    seen = []
    monkeypatch.setattr(ctypes, "CDLL", lambda path: seen.append(
        (os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"))))
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    threads._load_spinning_briefly("libgomp.so.1")
    assert seen == [(str(threads.SPIN_COUNT), None)] and "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    threads._load_spinning_briefly("libgomp.so.1")
    assert len(seen) == 1 and "GOMP_SPINCOUNT" not in os.environ


def test_xla_handlers_answer_command_buffer_traits():
    """XLA's metadata query at registration: a GPU handler says it may be
    captured into XLA's CUDA graphs (its launches then replay without the
    host), a CPU handler does not; neither calls its launcher then."""
    import ctypes as c

    from polyjit.runtime import xla_ffi as X
    for platform, traits in (("CUDA", X.COMMAND_BUFFER_COMPATIBLE), ("cpu", 0)):
        address = X.handler(f"polyjit_test_traits_{platform}", platform, 0, 0, 0)  # launch at 0: never called
        meta = X._Metadata(struct_size=c.sizeof(X._Metadata), traits=0xFF)
        ext = X._MetadataExtension(X._Extension(c.sizeof(X._MetadataExtension), X.METADATA_EXTENSION, None),
                                   c.pointer(meta))
        frame = X._CallFrame(struct_size=c.sizeof(X._CallFrame),
                             extension_start=c.cast(c.pointer(ext), c.POINTER(X._Extension)))
        assert c.CFUNCTYPE(c.c_void_p, c.c_void_p)(address)(c.addressof(frame)) is None  # no error
        assert (meta.traits, meta.api_version.major, meta.api_version.minor) == (traits, *X.API_VERSION)


def test_xla_handlers_come_from_the_compile_cache_and_call_their_own_launcher(monkeypatch, tmp_path):
    """A handler's machine code is kept in the compile cache and shared by
    handlers of the same platform and buffer counts; each calls the launcher
    it was made for (its address set as the code loads), with the buffers'
    pointers in order, and turns a launcher's failure into XLA's error."""
    import ctypes as c

    from polyjit.codegen import program
    from polyjit.runtime import launch as L
    from polyjit.runtime import xla_ffi as X
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(tmp_path))
    calls = []

    def launcher(tag, code):
        def run(args, rets, stream, message, size):
            calls.append((tag, [args[k] for k in range(2)], rets[0], stream))
            c.memmove(message, b"failed\0", 7)
            return code
        return L.LAUNCH_T(run)
    first, second = launcher("first", 0), launcher("second", 7)
    a = X.handler("polyjit_test_cached_a", "cpu", c.cast(first, c.c_void_p).value, 2, 1, first, cached=True)
    assert len(list(tmp_path.glob("*.pjc"))) == 1
    monkeypatch.setattr(program, "host_object", lambda *_: pytest.fail("a cached handler compiled again"))
    b = X.handler("polyjit_test_cached_b", "cpu", c.cast(second, c.c_void_p).value, 2, 1, second, cached=True)

    buffers = [X._Buffer(struct_size=c.sizeof(X._Buffer), data=0x1000 * (k + 1)) for k in range(3)]

    def frame(errors: list):
        def error_create(args):
            errors.append(args.contents.message)
            return 0xE
        api = X._Api(error_create=X._Api._fields_[4][1](error_create))
        items = [(c.POINTER(X._Buffer) * n)(*[c.pointer(x) for x in bs]) for n, bs in ((2, buffers[:2]), (1, buffers[2:]))]
        f = X._CallFrame(struct_size=c.sizeof(X._CallFrame), api=c.pointer(api),
                         args=X._List(size=2, items=items[0]), rets=X._List(size=1, items=items[1]))
        return f, (api, items, error_create)
    call = c.CFUNCTYPE(c.c_void_p, c.c_void_p)
    errors: list = []
    f, keep = frame(errors)
    assert call(a)(c.addressof(f)) is None and not errors
    assert call(b)(c.addressof(f)) == 0xE and errors == [b"failed"]
    assert calls == [("first", [0x1000, 0x2000], 0x3000, None), ("second", [0x1000, 0x2000], 0x3000, None)]


def test_a_run_of_parallel_kernels_is_one_region_in_kernel_order():
    """A native launcher runs consecutive parallel kernels in one parallel
    region of the thread team (one GOMP_parallel): every part of each kernel
    runs once, and none before every part of the kernel ahead of it is done;
    a serial kernel between them ends the region."""
    import ctypes
    import threading

    from polyjit.runtime import launch
    from polyjit.runtime.threads import OmpTeam, thread_team
    team = thread_team()
    if not isinstance(team, OmpTeam):
        pytest.skip("no libgomp")
    events, lock = [], threading.Lock()
    kernel_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)

    def kernel(name):
        def run(bufs, ints, part, parts):
            with lock:
                events.append((name, part, parts, "start"))
            with lock:
                events.append((name, part, parts, "end"))
        return kernel_t(run)
    kernels = {n: kernel(n) for n in ("a", "b", "serial", "c")}
    address = {n: ctypes.cast(k, ctypes.c_void_p).value for n, k in kernels.items()}
    steps = [launch.Run(address["a"], 3, "a"), launch.Run(address["b"], 3, "b"),
             launch.Run(address["serial"], 1, "serial"), launch.Run(address["c"], 3, "c")]
    plan = launch.LaunchPlan(slots=1, inputs=[0], outputs=[], fixed={}, ints=[1], steps=steps, context=None)
    libc = ctypes.CDLL(None)
    symbols = {**team.symbols(), **{f: ctypes.cast(getattr(libc, f), ctypes.c_void_p).value
                                    for f in ("snprintf", "aligned_alloc", "free")}}
    parallel_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)
    gomp_parallel, regions = parallel_t(symbols["GOMP_parallel"]), []

    def counted(fn, data, threads, flags):
        regions.append(threads)
        gomp_parallel(fn, data, threads, flags)
    counting = parallel_t(counted)
    symbols["GOMP_parallel"] = ctypes.cast(counting, ctypes.c_void_p).value
    launcher = launch.NativeLauncher("polyjit_test_region", plan, symbols)
    message = ctypes.create_string_buffer(100)
    for _ in range(20):
        events.clear()
        regions.clear()
        code = launch.LAUNCH_T(launcher.address)((ctypes.c_void_p * 1)(0), (ctypes.c_void_p * 1)(), None,
                                                 message, 100)
        assert code == 0, message.value
        assert regions == [3, 3]
        order = [e[0] for e in events]
        runs = {n: sorted(e[1] for e in events if e[0] == n and e[3] == "start") for n in kernels}
        assert runs == {"a": [0, 1, 2], "b": [0, 1, 2], "serial": [0], "c": [0, 1, 2]}
        assert {e[2] for e in events if e[0] != "serial"} == {3}
        first = {n: order.index(n) for n in kernels}
        last = {n: len(order) - 1 - order[::-1].index(n) for n in kernels}
        assert last["a"] < first["b"] and last["b"] < first["serial"] and last["serial"] < first["c"], events
