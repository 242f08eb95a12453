"""Compile time: per-stage timings, kernels compiled once per structure, the on-disk cache."""
import collections
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import polyjit
from polyjit import InputInfo, cache, library, ops

F32 = np.float32


def _softmax(x):
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def test_stage_seconds_in_stats_and_log(rng, caplog):
    x = rng.standard_normal((64, 96), dtype=F32)
    with caplog.at_level(logging.INFO, logger="polyjit"):
        exe = polyjit.compile(ops.softmax, [InputInfo(x.shape, F32)], {"cache": False})
    stages = exe.stats["compile_seconds_by_stage"]
    assert set(stages) == {"lower", "schedule", "mapping", "emit", "llvm"} and all(v >= 0 for v in stages.values())
    assert sum(stages.values()) <= exe.stats["compile_seconds"]
    assert any("schedule" in r.getMessage() and "llvm" in r.getMessage() for r in caplog.records)
    np.testing.assert_allclose(exe(x), _softmax(x), rtol=1e-5, atol=1e-7)


def test_a_nested_stage_is_taken_out_of_the_outer_one():
    import time

    from polyjit.compiler import StageTimer
    timer = StageTimer()
    with timer("schedule"):
        time.sleep(0.02)
        with timer("emit"):
            time.sleep(0.05)
        with timer("schedule/ast"):
            time.sleep(0.01)
    s = timer.seconds
    assert 0.05 <= s["emit"] < 0.08 and 0.03 <= s["schedule"] < 0.05 and timer.detail["schedule/ast"] >= 0.01


def test_llvm_runs_on_its_own_thread_while_groups_are_emitted(rng, monkeypatch):
    """Each group's kernels go to the LLVM thread (where no worker process
    serves) as soon as it is scheduled: the first is handed over before the
    last group is scheduled."""
    import threading

    from polyjit.codegen import program, workers
    from polyjit.schedule import driver as schedule
    monkeypatch.setattr(workers, "_workers", workers.LlvmWorkers(0))
    events, threads = [], set()
    compile_object, submit = program.compile_object, program._submit
    monkeypatch.setattr(program, "compile_object", lambda text: (
        threads.add(threading.current_thread().name), compile_object(text))[1])
    monkeypatch.setattr(program, "_submit", lambda *a: (events.append(("llvm", None)), submit(*a))[1])
    scheduled = schedule._schedule_problem
    monkeypatch.setattr(schedule, "_schedule_problem", lambda *a: (events.append(("schedule", None)),
                                                                   scheduled(*a))[1])
    args = [rng.standard_normal((24, 40), dtype=F32), rng.standard_normal((40, 40), dtype=F32) / 8,
            rng.standard_normal(40, dtype=F32)]
    exe = polyjit.compile(_layers(1), [InputInfo(a.shape, F32) for a in args], {"cache": False})
    kinds = [what for what, _ in events]
    assert kinds.count("schedule") >= 2, kinds  # (groups of different structure)
    assert kinds.index("llvm") < len(kinds) - 1 - kinds[::-1].index("schedule"), kinds
    assert threads and all(name.startswith("polyjit-llvm") for name in threads)
    np.testing.assert_allclose(exe(*args), _layers_ref(*args), rtol=1e-4, atol=1e-5)


def test_worker_processes_make_the_same_object_code(rng, monkeypatch, llvm_workers):
    """Worker processes make a CPU program's object code (an LLVM thread
    beside the compile's Python waits for the GIL after every LLVM call):
    the same code as the caller's LLVM thread; a worker that died hands its
    jobs back to it."""
    from polyjit.cache import ProcessCache
    from polyjit.codegen import program
    args = [rng.standard_normal((24, 40), dtype=F32), rng.standard_normal((40, 40), dtype=F32) / 8,
            rng.standard_normal(40, dtype=F32)]

    def build(count: int, kill: bool = False):
        monkeypatch.setattr(program, "_codes", ProcessCache(program.CODE_CACHE))  # nothing shared with earlier compiles
        pool = llvm_workers(count, kill)
        exe = polyjit.compile(_layers(2), [InputInfo(a.shape, F32) for a in args], {"cache": False})
        made = exe.compile_default()
        np.testing.assert_allclose(exe(*args), _layers_ref(*args), rtol=1e-4, atol=1e-5)
        return (made.keepalive.objects, made.ir["llvm_opt"], made.stats["kernels_compiled"]), pool
    local, none = build(0)
    remote, served = build(2)
    assert none.served == 0 and served.served == remote[2] > 1
    assert remote == local
    dead, pool = build(2, kill=True)  # (the first worker and its fork)
    assert dead == local and pool.served == 0 and not pool.procs


def test_later_workers_are_forks_of_the_first(llvm_workers):
    """The first worker process forks the others once its imports are done
    (each then imports nothing), each on pipes of its own: they are its
    children, and they serve on with the first gone."""
    from polyjit.codegen import program, workers
    pool = llvm_workers(3)
    first, *forked = pool.procs
    assert len(forked) == 2
    for proc in forked:
        with open(f"/proc/{proc.pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == first.pid
    first.kill()
    first.wait()
    text = "define void @polyjit_fork_test() {\n  ret void\n}\n"
    futures = [pool.submit(workers.OBJECT, text, program._on_thread) for _ in range(6)]
    local = program.compile_object(text)[1]
    assert all(f.result(60)[1] == local for f in futures)
    assert pool.served >= 5 and len(pool.procs) >= 2  # (the first's thread hands its one job back)


def test_a_code_job_goes_ahead_of_the_scheduling_jobs_queued_before_it():
    """A compile queues all its groups' scheduling jobs at once; a code job
    (the kernel of a group the caller scheduled itself) is taken before
    them, and each kind in the order it came."""
    from concurrent.futures import Future

    from polyjit.codegen import workers
    pool = workers.LlvmWorkers(0)  # (its queue alone: no process takes the jobs)
    for name in ("s0", "s1", "s2"):
        pool._put(workers.SCHEDULE, name, None, Future())
    for name in ("o0", "o1"):
        pool._put(workers.OBJECT, name, None, Future())
    pool._put(workers.SCHEDULE, "s3", None, Future())
    assert [pool.jobs.get_nowait()[-1][1] for _ in range(6)] == ["o0", "o1", "s0", "s1", "s2", "s3"]


def test_worker_processes_schedule_groups_as_the_caller_would(rng, monkeypatch, llvm_workers):
    """A program's fusion groups are scheduled in the worker processes too
    (the caller takes back, in order, those no worker has begun): the same
    program, kernel for kernel, as scheduled in the caller alone. A worker
    also emits and compiles the kernels of the groups it schedules, so the
    caller never builds their ASTs (only the isl texts come back), and the
    object code is byte for byte the caller's."""
    from polyjit.cache import ProcessCache
    from polyjit.codegen import program
    from polyjit.schedule import driver
    args = [rng.standard_normal((24, 40), dtype=F32), rng.standard_normal((40, 40), dtype=F32) / 8,
            rng.standard_normal(40, dtype=F32)]

    def build(count: int):
        monkeypatch.setattr(program, "_codes", ProcessCache(program.CODE_CACHE))
        monkeypatch.setattr(driver, "_groups", ProcessCache(driver.GROUP_CACHE))
        pool = llvm_workers(count)
        exe = polyjit.compile(_layers(2), [InputInfo(a.shape, F32) for a in args], {"cache": False})
        made = exe.compile_default()
        np.testing.assert_allclose(exe(*args), _layers_ref(*args), rtol=1e-4, atol=1e-5)
        remote = [s for s in driver._groups._items.values() if s._ast is None]
        ast = made.ir["ast"].split("contracted:")[0]  # (temporaries are numbered per process)
        return (made.ir["llvm_opt"], ast, made.ir["schedule"], made.keepalive.objects,
                made.stats["kernels_compiled"]), pool, remote
    local, none, _ = build(0)
    remote, pool, unbuilt = build(2)
    assert none.scheduled == 0 and pool.scheduled >= 1
    assert len(unbuilt) == pool.scheduled
    assert remote == local
    # a group whose code is made again (the process's kernel cache lost it) builds its AST then
    monkeypatch.setattr(program, "_codes", ProcessCache(program.CODE_CACHE))
    again = polyjit.compile(_layers(2), [InputInfo(a.shape, F32) for a in args], {"cache": False}).compile_default()
    assert again.keepalive.objects == local[3] and all(s._ast is not None for s in unbuilt)


FORK_SCRIPT = """
import os, numpy as np, polyjit
from polyjit import ops, InputInfo
x = np.random.default_rng().standard_normal((16, 40), dtype=np.float32)
polyjit.compile(ops.softmax, [InputInfo(x.shape, np.float32)], {"cache": False})(x)  # the LLVM thread runs
pid = os.fork()
if pid == 0:  # the child has no LLVM thread: compiling there starts its own
    e = polyjit.compile(lambda x: ops.exp(x) * 2, [InputInfo(x.shape, np.float32)], {"cache": False})
    os._exit(0 if np.allclose(e(x), np.exp(x) * 2, rtol=1e-5) else 3)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_compiles_with_a_thread_of_its_own():
    done = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "0", done.stderr


def test_contractions_to_time_are_compiled_together_before_any_is_timed(rng, monkeypatch):
    """contractions="auto" times both ways of each large product; their
    programs are built on two threads at once, all before the first timing."""
    import threading

    from polyjit import library
    monkeypatch.setattr(library, "_measured", {})
    events = []
    single, time_ = library._single, library._time
    monkeypatch.setattr(library, "_single", lambda *a: (
        events.append(("compile", threading.current_thread().name)), single(*a))[1])
    monkeypatch.setattr(library, "_time", lambda *a: (events.append(("time", None)), time_(*a))[1])
    a, b, c = (rng.standard_normal(s, dtype=F32) for s in ((128, 96), (96, 150), (150, 110)))  # partial blocks
    exe = polyjit.compile(lambda a, b, c: ops.matmul(ops.tanh(ops.matmul(a, b)), c),
                          [InputInfo(x.shape, F32) for x in (a, b, c)], {"cache": False})
    np.testing.assert_allclose(exe(a, b, c), np.tanh(a @ b) @ c, rtol=2e-5, atol=2e-5)
    kinds = [w for w, _ in events]
    assert kinds.count("compile") == 4 and "time" in kinds and kinds.index("time") == 4, events
    assert all(name.startswith("polyjit-measure") for w, name in events if w == "compile")
    assert len(exe.stats["contractions"]) == 2 and all("ms" in c for c in exe.stats["contractions"])


def _layers(n: int):
    """n identical layers: a linear map, bias, tanh and a row normalization."""
    def fn(x, *params):
        for w, b in zip(params[0::2], params[1::2]):
            h = ops.tanh(ops.matmul(x, w) + b)
            x = h - ops.sum(h, [1], True) / h.shape[1]
        return x
    return fn


def _layers_ref(x, *params):
    for w, b in zip(params[0::2], params[1::2]):
        h = np.tanh(x.astype(np.float64) @ w + b)
        x = h - h.mean(1, keepdims=True)
    return x


def test_identical_layers_compile_once(rng):
    n, rows, d = 6, 24, 40
    args = [rng.standard_normal((rows, d), dtype=F32)]
    for _ in range(n):
        args += [rng.standard_normal((d, d), dtype=F32) / 8, rng.standard_normal(d, dtype=F32)]
    infos = [InputInfo(a.shape, F32) for a in args]
    exe = polyjit.compile(_layers(n), infos, {"cache": False})
    assert exe.stats["kernels"] >= n and exe.stats["kernels_compiled"] * 2 < exe.stats["kernels"]
    np.testing.assert_allclose(exe(*args), _layers_ref(*args), rtol=1e-4, atol=1e-5)
    again = polyjit.compile(_layers(n), infos, {"cache": False})  # the same structure: all compiled already
    assert again.stats["kernels_compiled"] == 0 and again.stats["cache_hits"] == 0
    fresh = [a + 1 for a in args]
    np.testing.assert_allclose(again(*fresh), _layers_ref(*fresh), rtol=1e-4, atol=1e-5)


def test_a_kernel_of_the_same_ir_in_another_group_compiles_once(rng, monkeypatch):
    """A kernel is named by its IR: the transpose of a group that differs
    elsewhere (its other kernel) is the same IR, compiled once and loaded
    from the same object code."""
    from polyjit.cache import ProcessCache
    from polyjit.codegen import program
    x, z = rng.standard_normal((8, 16), dtype=F32), rng.standard_normal(5, dtype=F32)
    infos = [InputInfo(x.shape, F32), InputInfo(z.shape, F32)]
    monkeypatch.setattr(program, "_codes", ProcessCache(program.CODE_CACHE))
    plus = polyjit.compile(lambda x, z: (ops.transpose(x, 0, 1) * 2, z + 1), infos, {"cache": False})
    times = polyjit.compile(lambda x, z: (ops.transpose(x, 0, 1) * 2, z * 3), infos, {"cache": False})
    for exe, want in ((plus, z + 1), (times, z * 3)):
        t, y = exe(x, z)
        np.testing.assert_allclose(t, x.T * 2, rtol=1e-6)
        np.testing.assert_allclose(y, want, rtol=1e-6)
    assert plus.stats["kernels"] == times.stats["kernels"] == 2
    assert plus.stats["kernels_compiled"] == 2 and times.stats["kernels_compiled"] == 1
    shared = set(plus.compile_default().keepalive.objects) & set(times.compile_default().keepalive.objects)
    assert len(shared) == 1


SCRIPT = """
import json, sys, numpy as np, polyjit
from polyjit import ops, InputInfo
x = np.random.default_rng().standard_normal((48, 200), dtype=np.float32)
exe = polyjit.compile(ops.softmax, [InputInfo(x.shape, np.float32)], {"num_threads": 2})
e = np.exp(x - x.max(1, keepdims=True))
np.testing.assert_allclose(exe(x), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
print(json.dumps({k: exe.stats[k] for k in ("cache_hits", "kernels_compiled", "kernels")}))
"""


def _run(folder, count: int = 1, script: str = SCRIPT) -> list[tuple[dict, str]]:
    """Run script in count processes at once with the compile cache in folder."""
    env = {**os.environ, "POLYJIT_CACHE_DIR": str(folder)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(count)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        out.append((json.loads(stdout.strip().splitlines()[-1]), stderr))
    return out


def test_a_fresh_process_loads_the_program_from_the_cache(tmp_path):
    [(first, _)] = _run(tmp_path)
    assert first["cache_hits"] == 0 and first["kernels_compiled"] == first["kernels"] > 0
    assert len(list(tmp_path.glob("*.pjc"))) == 1 and not list(tmp_path.glob(".*.tmp"))
    [(second, _)] = _run(tmp_path)
    assert second == {"cache_hits": 1, "kernels_compiled": 0, "kernels": first["kernels"]}


PRODUCT_SCRIPT = """
import json, numpy as np, polyjit
from polyjit import ops, InputInfo
def f(t, u):  # u's sizes unified with t's while tracing: the product b*s is renamed to their roots
    return ops.reshape(u, [u.shape[0] * u.shape[1], 4]) * 2, t + u
exe = polyjit.compile(f, [InputInfo([-1, -1, 4], np.float32)] * 2)
x = np.random.default_rng().standard_normal((3, 5, 4), dtype=np.float32)
np.testing.assert_array_equal(exe(x, x)[0], x.reshape(15, 4) * 2)
print(json.dumps({k: exe.stats[k] for k in ("cache_hits", "kernels_compiled")}))
"""


LAUNCHER_SCRIPT = """
import json, numpy as np, polyjit
from polyjit import ops, InputInfo
def f(x):
    for _ in range(3):
        x = ops.softmax(ops.transpose(x, 0, 1), -1)
    return x
def softmax(x):
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)
x = np.random.default_rng().standard_normal((64, 32), dtype=np.float32)
exe = polyjit.compile(f, [InputInfo(x.shape, np.float32)], {"fusion": "none"})
want = softmax(softmax(softmax(x.T).T).T)
for _ in range(2):
    np.testing.assert_allclose(exe(x), want, rtol=1e-5, atol=1e-7)
print(json.dumps({k: exe.stats[k] for k in ("cache_hits", "kernels_compiled", "launchers_compiled")}))
"""


def test_a_fresh_process_loads_a_program_s_native_launcher_from_the_cache(tmp_path):
    """The host code that runs a program's kernels (runtime.launch) reads
    every address from a table filled as it loads, so its machine code is
    kept in the cache beside the program's: a second process compiles
    neither, and its calls still reach this process's kernels."""
    [(cold, _)] = _run(tmp_path, script=LAUNCHER_SCRIPT)
    [(warm, _)] = _run(tmp_path, script=LAUNCHER_SCRIPT)
    assert cold == {"cache_hits": 0, "kernels_compiled": cold["kernels_compiled"], "launchers_compiled": 1}
    assert warm == {"cache_hits": 1, "kernels_compiled": 0, "launchers_compiled": 0}
    assert len(list(tmp_path.glob("*.pjc"))) == 2


def test_a_fresh_process_loads_a_program_over_a_product_of_sizes(tmp_path):
    """A size that is a product of symbolic sizes (b*s), made while
    compiling, is defined in the cache entry: a fresh process loads it."""
    [(first, _)] = _run(tmp_path, script=PRODUCT_SCRIPT)
    [(second, _)] = _run(tmp_path, script=PRODUCT_SCRIPT)
    assert first["cache_hits"] == 0 and second == {"cache_hits": 1, "kernels_compiled": 0}


def test_the_cache_key_covers_the_frontends_sources(tmp_path, monkeypatch):
    """A frontend's code is polyjit's too: its decisions kept in the cache
    (torch.compile's partitions) must not outlive a change to it. The
    versions' digest reads every source root, the frontends' among them."""
    import importlib.util
    frontend = Path(importlib.util.find_spec("polyjit.frontends.common").origin).parent
    assert frontend in cache._source_roots() and Path(cache.__file__).parent in cache._source_roots()
    (tmp_path / "frontends").mkdir()
    source = tmp_path / "frontends" / "rules.py"
    source.write_text("RULES = 1\n")
    monkeypatch.setattr(cache, "_source_roots", lambda: [tmp_path / "frontends"])
    before = cache.source_version.__wrapped__()
    source.write_text("RULES = 2\n")
    assert cache.source_version.__wrapped__() != before


def test_a_damaged_entry_is_removed_recompiled_and_warned_about(tmp_path):
    _run(tmp_path)
    [entry] = tmp_path.glob("*.pjc")
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    [(stats, err)] = _run(tmp_path)
    assert "damaged" in err and stats["cache_hits"] == 0 and stats["kernels_compiled"] > 0
    entry.write_bytes(entry.read_bytes()[:100])  # (rewritten whole by that run; now truncated)
    [(stats, err)] = _run(tmp_path)
    assert "damaged" in err and stats["cache_hits"] == 0
    [(stats, err)] = _run(tmp_path)
    assert "damaged" not in err and stats["cache_hits"] == 1


def test_two_processes_writing_one_key_both_succeed(tmp_path):
    runs = _run(tmp_path, count=2)
    assert all(stats["kernels"] > 0 for stats, _ in runs)
    assert len(list(tmp_path.glob("*.pjc"))) == 1 and not list(tmp_path.glob(".*.tmp"))
    [(stats, _)] = _run(tmp_path)
    assert stats["cache_hits"] == 1


def test_cache_false_neither_reads_nor_writes(tmp_path, monkeypatch, rng):
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(tmp_path))
    x = rng.standard_normal((16, 72), dtype=F32)
    first = polyjit.compile(ops.softmax, [InputInfo(x.shape, F32)])
    assert first.stats["cache_hits"] == 0 and len(list(tmp_path.glob("*.pjc"))) == 1
    hit = polyjit.compile(ops.softmax, [InputInfo(x.shape, F32)])
    assert hit.stats["cache_hits"] == 1
    np.testing.assert_allclose(hit(x), _softmax(x), rtol=1e-5, atol=1e-7)
    for entry in tmp_path.glob("*.pjc"):
        entry.unlink()
    off = polyjit.compile(ops.softmax, [InputInfo(x.shape, F32)], {"cache": False})
    assert off.stats["cache_hits"] == 0 and not list(tmp_path.iterdir())
    np.testing.assert_allclose(off(x), _softmax(x), rtol=1e-5, atol=1e-7)
    with pytest.raises(polyjit.errors.CompileOptionError, match="cache"):
        polyjit.compile(ops.softmax, [InputInfo(x.shape, F32)], {"cache": "no"})


def test_the_size_limit_evicts_the_least_recently_used(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("POLYJIT_CACHE_BYTES", "250000")
    for k in range(4):
        cache.store(f"k{k}", {"n": k}, [bytes(100000)])
        os.utime(tmp_path / f"k{k}.pjc", (k, k))  # k0 oldest
        if k == 1:
            assert cache.load("k0")[0] == {"n": 0}  # used: now the most recent
    assert sorted(p.stem for p in tmp_path.glob("*.pjc")) == ["k0", "k3"]


# ------------------------------------------------------------- GPU programs (PTX, no GPU needed)
PTX_ONLY = {"target": "nvgpu", "gpu_arch": "sm_90"}


def _attention(q, k):
    return ops.matmul(ops.softmax(ops.matmul(q, ops.transpose(k, 0, 1))), k)


def test_a_gpu_program_compiles_once_per_process_and_per_arch():
    infos = [InputInfo((32, 16), F32), InputInfo((24, 16), F32)]
    first = polyjit.compile(_attention, infos, {**PTX_ONLY, "cache": False}).compile_default()
    again = polyjit.compile(_attention, infos, {**PTX_ONLY, "cache": False}).compile_default()
    assert len(first.kernels) > 0 and again.stats["kernels_compiled"] == 0
    assert again.ptx == first.ptx and again.kernels == first.kernels and again.writes == first.writes
    other = polyjit.compile(_attention, infos, {"target": "nvgpu", "gpu_arch": "sm_80", "cache": False})
    other = other.compile_default()
    assert other.stats["kernels_compiled"] > 0 and ".target sm_80" in other.ptx and ".target sm_90" in first.ptx
    bigger = polyjit.compile(_attention, [InputInfo((48, 16), F32), infos[1]], {**PTX_ONLY, "cache": False})
    assert bigger.compile_default().stats["kernels_compiled"] > 0


def test_identical_gpu_kernels_compile_once_and_take_the_programs_arguments(tmp_path):
    """Identical layers share each kernel's PTX; every entry of the program
    declares the arguments it takes (KernelInfo.params: the program's slots it
    reads and writes, a few of the whole list), and ptxas accepts the module."""
    import re
    import shutil
    n, rows, d = 5, 24, 56
    infos = [InputInfo((rows, d), F32)] + [InputInfo(s, F32) for _ in range(n) for s in ((d, d), (d,))]
    exe = polyjit.compile(_layers(n), infos, {**PTX_ONLY, "cache": False}).compile_default()
    assert exe.stats["kernels"] >= n and 0 < exe.stats["kernels_compiled"] * 2 < exe.stats["kernels"]
    count = len(exe.buffers) + len(exe.int_slots)
    entries = re.findall(r"^\.visible \.entry (\w+)\(([^)]*)\)", exe.ptx, re.M)
    assert [e for e, _ in entries] == [k.name for k in exe.kernels]
    assert all(params.count(".param") == len(k.params) < count for (_, params), k in zip(entries, exe.kernels))
    assert all(p < count for k in exe.kernels for p in k.params)
    if shutil.which("ptxas"):
        (tmp_path / "p.ptx").write_text(exe.ptx)
        done = subprocess.run(["ptxas", "-arch=sm_90", str(tmp_path / "p.ptx"), "-o", str(tmp_path / "p.cubin")],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


TORCH_SCRIPT = """
import json, torch, polyjit
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.LayerNorm(48), torch.nn.Linear(48, 48),
                            torch.nn.Tanh(), torch.nn.LayerNorm(48), torch.nn.Softmax(-1), torch.nn.Linear(48, 8))
x = torch.randn(16, 24)
y = torch.compile(model, backend="polyjit")(x)
(y * torch.randn_like(y)).sum().backward()
stats = polyjit.frontends.torch.stats()
workers = polyjit.codegen.workers._workers is not None
print(json.dumps({**{k: stats[k] for k in ("graphs", "cache_hits", "kernels_compiled", "launchers_compiled", "fallbacks")},
                  "workers": workers}))
"""


def test_a_fresh_process_loads_a_torch_training_step_from_the_cache(tmp_path):
    """Both graphs of torch.compile's training step (forward, backward) come
    from the cache in a second process, as the frontend's stats say, and so
    does the backward's native launcher: that process compiles nothing. It
    starts no worker either: the cache marks dynamo's graph as compiled
    (compiler.expect_compile)."""
    pytest.importorskip("torch")
    [(cold, _)] = _run(tmp_path, script=TORCH_SCRIPT)
    [(warm, _)] = _run(tmp_path, script=TORCH_SCRIPT)
    assert cold["graphs"] == 2 and cold["cache_hits"] == 0 and cold["kernels_compiled"] > 0 and cold["fallbacks"] == 0
    assert cold["workers"] and cold["launchers_compiled"] > 0
    assert warm == {"graphs": 2, "cache_hits": 2, "kernels_compiled": 0, "launchers_compiled": 0, "fallbacks": 0,
                    "workers": False}


FRONTEND_SCRIPTS = {
    "jax": """
import json, jax.numpy as jnp, polyjit
f = polyjit.jit_jax(lambda x: jnp.tanh(x) * 2.0 + x.sum())
f(jnp.ones((4, 5)))
stats = f.stats
""",
    "tf": """
import json, tensorflow as tf, polyjit
f = polyjit.jit_tf(lambda x: tf.tanh(x) * 2.0 + tf.reduce_sum(x))
f(tf.ones((4, 5)))
stats = f.stats
"""}


@pytest.mark.parametrize("framework", sorted(FRONTEND_SCRIPTS))
def test_a_fresh_process_starts_no_worker_for_a_function_compiled_before(framework, tmp_path):
    """jit_jax and jit_tf mark what they traced in the compile cache (the
    function's code, the signature, the options): a second process, whose
    programs load from the cache, starts no worker process."""
    pytest.importorskip({"jax": "jax", "tf": "tensorflow"}[framework])
    script = FRONTEND_SCRIPTS[framework] + (
        "print(json.dumps({'hits': stats['cache_hits'], 'workers': polyjit.codegen.workers._workers is not None}))")
    [(cold, _)] = _run(tmp_path, script=script)
    [(warm, _)] = _run(tmp_path, script=script)
    assert cold == {"hits": 0, "workers": True} and warm == {"hits": 1, "workers": False}


PARTITION_SCRIPT = """
import copy, json, sys, torch, polyjit
import torch._functorch.partitioners as partitioners
from polyjit.frontends import torch_partition
if sys.argv[1] == "hit":  # a fresh process that finds the partition in the cache runs neither CSE nor solver
    def refused(*a, **k):
        raise AssertionError("min-cut ran")
    partitioners.fx_graph_cse = partitioners.choose_saved_values_set = partitioners.solve_min_cut = refused
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.LayerNorm(48), torch.nn.Linear(48, 8))
eager = copy.deepcopy(model)
x = torch.randn(16, 24)
y = torch.compile(model, backend="polyjit")(x)
r = torch.randn_like(y)  # gradients compared through a random projection of the output
(y * r).sum().backward()
(eager(x) * r).sum().backward()
err = max(float((p.grad - q.grad).abs().max() / q.grad.abs().max())
          for p, q in zip(model.parameters(), eager.parameters()))
stats = polyjit.frontends.torch.stats()
print(json.dumps({"counts": dict(torch_partition.counts), "err": err,
                  **{k: stats[k] for k in ("graphs", "cache_hits", "fallbacks")}}))
"""


def test_a_fresh_process_replays_the_training_steps_partition(tmp_path):
    """min-cut's decisions (its CSE's replacements, the values the forward
    saves) come from the cache in a second process: neither its CSE nor
    its solver runs there, and the gradients are eager's."""
    pytest.importorskip("torch")
    [(cold, _)] = _run(tmp_path, script=PARTITION_SCRIPT.replace("sys.argv[1]", "'miss'"))
    [(warm, err)] = _run(tmp_path, script=PARTITION_SCRIPT.replace("sys.argv[1]", "'hit'"))
    assert cold["counts"] == {"solved": 1} and warm["counts"] == {"replayed": 1}, (cold, warm, err)
    assert warm["graphs"] == 2 and warm["cache_hits"] == 2 and warm["fallbacks"] == 0
    assert cold["err"] < 1e-4 and warm["err"] < 1e-4, (cold, warm)


def _joint_graph():
    """A small encoder layer's joint forward-backward graph as AOTAutograd
    hands it to the partition (with the frontend's decompositions), and
    the partition's arguments."""
    import torch
    from functorch.compile import nop
    from torch._dynamo.backends.common import aot_autograd

    from polyjit.frontends.torch import TRAINING_DECOMPOSITIONS
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    seen = []

    def capture(joint, joint_inputs, **kwargs):
        seen.append((_graph_copy(joint), joint_inputs, kwargs))
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=nop, bw_compiler=nop, decompositions=TRAINING_DECOMPOSITIONS, partition_fn=capture)
    torch.compile(layer, backend=backend)(torch.randn(2, 5, 16)).sum().backward()
    [found] = seen
    return found


def _graph_copy(gm):
    """gm with a graph of its own, each node with its own meta dict (min-cut
    writes to both)."""
    import torch.fx as fx
    graph, env = fx.Graph(), {}
    for n in gm.graph.nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    return fx.GraphModule(gm, graph)


def _nodes(gm) -> list:
    """A graph node by node: name, op, target, arguments, value's shape, strides and dtype."""
    import torch

    def value(v):
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), v.stride(), v.dtype)
        return tuple(value(x) for x in v) if isinstance(v, (list, tuple)) else repr(v)
    return [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs), value(n.meta.get("val")))
            for n in gm.graph.nodes]


def test_the_replayed_partition_is_min_cuts(tmp_path, monkeypatch):
    """The partition made from the cached decisions is min-cut's own, node by
    node: the forward's outputs (saved values among them), the backward's
    placeholders and every node between. With the cache off, a decision
    that does not fit the graph or a key that cannot be made, min-cut runs
    as it is."""
    pytest.importorskip("torch")
    import torch._functorch.partitioners as partitioners
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from polyjit.frontends import torch_partition
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(tmp_path))
    joint, joint_inputs, kwargs = _joint_graph()
    fw, bw = min_cut_rematerialization_partition(_graph_copy(joint), joint_inputs, **kwargs)
    expected = (_nodes(fw), _nodes(bw))
    assert fw.code and len(expected[0]) > 20
    off = torch_partition.partition(_graph_copy(joint), joint_inputs, use_cache=False, **kwargs)
    assert (_nodes(off[0]), _nodes(off[1])) == expected and not list(tmp_path.iterdir())
    monkeypatch.setattr(torch_partition, "counts", collections.Counter())
    made = torch_partition.partition(_graph_copy(joint), joint_inputs, **kwargs)
    [entry] = tmp_path.glob("*.pjc")
    decision = cache.load(entry.stem)[0]
    assert decision["cse"] and decision["saved"], decision  # (both steps have something to replay)

    def refused(*a, **k):
        raise AssertionError("min-cut ran")
    with monkeypatch.context() as m:
        m.setattr(partitioners, "solve_min_cut", refused)
        m.setattr(partitioners, "fx_graph_cse", refused)
        replayed = torch_partition.partition(_graph_copy(joint), joint_inputs, **kwargs)
    assert torch_partition.counts == {"solved": 1, "replayed": 1}
    for got in (made, replayed):
        assert (_nodes(got[0]), _nodes(got[1])) == expected
        assert (got[0].code, got[1].code) == (fw.code, bw.code)
    # decisions that do not fit the graph, a key that cannot be made: min-cut as it is, silently
    cache.store(entry.stem, {"partition": torch_partition.FORMAT, "cse": [["nowhere", "addmm"]], "saved": ["x"]}, [])
    unfit = torch_partition.partition(_graph_copy(joint), joint_inputs, **kwargs)
    monkeypatch.setattr(torch_partition, "_config_text", lambda: 1 / 0)
    unkeyed = torch_partition.partition(_graph_copy(joint), joint_inputs, **kwargs)
    for got in (unfit, unkeyed):
        assert (_nodes(got[0]), _nodes(got[1])) == expected
    assert torch_partition.counts == {"solved": 2, "replayed": 1}

GPU_SCRIPT = """
import hashlib, json, sys, numpy as np, polyjit
from polyjit import ops, InputInfo
from polyjit.codegen import nvgpu
if sys.argv[1] == "hit":  # a fresh process that finds the program in the cache generates no PTX
    def no_ptx(*a):
        raise AssertionError("PTX generated")
    nvgpu.ptx = no_ptx
fn = lambda q, k: ops.matmul(ops.softmax(ops.matmul(q, ops.transpose(k, 0, 1))), k)
exe = polyjit.compile(fn, [InputInfo((32, 16), np.float32), InputInfo((24, 16), np.float32)],
                      {"target": "nvgpu", "gpu_arch": "sm_90"}).compile_default()
print(json.dumps({**{k: exe.stats[k] for k in ("cache_hits", "kernels_compiled", "kernels")},
                  "ptx": hashlib.sha256(exe.ptx.encode()).hexdigest(), "arch": exe.arch,
                  "kernel_info": [[k.name, k.lanes, list(k.zeroed), k.strips] for k in exe.kernels]}))
"""


def test_a_fresh_process_loads_a_gpu_program_from_the_cache(tmp_path):
    env = {**os.environ, "POLYJIT_CACHE_DIR": str(tmp_path)}
    runs = []
    for mode in ("cold", "hit"):
        p = subprocess.run([sys.executable, "-c", GPU_SCRIPT, mode], env=env, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    cold, hit = runs
    assert cold["cache_hits"] == 0 and cold["kernels_compiled"] == cold["kernels"] > 0
    assert hit["cache_hits"] == 1 and hit["kernels_compiled"] == 0
    assert {k: v for k, v in hit.items() if k not in ("cache_hits", "kernels_compiled")} == \
        {k: v for k, v in cold.items() if k not in ("cache_hits", "kernels_compiled")}
    [entry] = tmp_path.glob("*.pjc")
    assert b".target sm_90" in entry.read_bytes()  # PTX as text, no pickles


# ------------------------------------------------------------- library steps (cuBLAS, BLAS) in the cache
def _block(x, wq, wk, w1, g):
    """A transformer block's shape: layer norm, attention, an MLP with tanh."""
    h = x - ops.sum(x, [1], True) / x.shape[1]
    h = h * g / ops.sqrt(ops.sum(h * h, [1], True) / x.shape[1] + 1e-5)
    q, k = ops.matmul(h, wq), ops.matmul(h, wk)
    a = ops.matmul(ops.softmax(ops.matmul(q, ops.transpose(k, 0, 1))), k)
    return ops.tanh(ops.matmul(a, w1)) + a[:, :1]


def _block_ref(x, wq, wk, w1, g):
    x = x.astype(np.float64)
    h = x - x.mean(1, keepdims=True)
    h = h * g / np.sqrt((h * h).mean(1, keepdims=True) + 1e-5)
    q, k = h @ wq, h @ wk
    a = _softmax(q @ k.T) @ k
    return np.tanh(a @ w1) + a[:, :1]


BLOCK_SHAPES = [(128, 64), (64, 64), (64, 64), (64, 128), (64,)]


def _mlp(x, w1, b, w2, k):
    """Products around elementwise kernels (no row reductions: their warp
    shuffles do not run thread by thread on the CPU)."""
    h = ops.tanh(ops.matmul(x, w1) + b)
    return ops.matmul(ops.relu(ops.matmul(h, w2)), ops.transpose(k, 0, 1)) * 0.5


def _mlp_ref(x, w1, b, w2, k):
    h = np.tanh(x.astype(np.float64) @ w1 + b)
    return np.maximum(h @ w2, 0) @ k.T * 0.5


# products of 2^20 multiply-adds and more, in partial register blocks on the CPU (its model then times them)
MLP_SHAPES = [(256, 64), (64, 100), (100,), (100, 72), (66, 72)]


def _grouped_conv(x, w):
    return ops.relu(ops.conv(x, w, (2, 1), ((1, 1), (1, 1)), (2, 1), 2))


def test_statements_of_a_program_go_through_json_and_back(monkeypatch):
    """Every statement lowering makes for a transformer block and a grouped,
    strided, dilated convolution, library steps among them (cuBLAS products and
    cuDNN convolutions; a cuBLAS floor
    on host memory stands in for the GPU's), is written as JSON and read
    back equal, field by field and type by type."""
    import dataclasses

    from polyjit.runtime import cublas
    from polyjit.dtypes import DataType
    from polyjit.graph import Graph
    from polyjit.library import LibraryPolicy
    from polyjit.lowering import lower
    from polyjit.targets import target
    from test_nvgpu import _HostCublas
    from polyjit.runtime import cudnn
    monkeypatch.setattr(cublas, "cublas", lambda: _HostCublas())
    programs = [(_block, BLOCK_SHAPES), (_grouped_conv, [(2, 12, 9, 8), (18, 6, 3, 3)])]
    calls = set()
    for fn, shapes, mode, direct in [(f, s, m, d) for f, s in programs for m in ("library", "generated")
                                     for d in (False, True)]:
        monkeypatch.setattr(cudnn, "cudnn", lambda: direct or None)  # convolutions as cuDNN's one call, or not
        graph = Graph()
        graph.add_output(fn(*(ops.Tensor(graph, graph.input(s, DataType.Float)) for s in shapes)).node)
        for s in lower(graph, 16, LibraryPolicy(mode, 1, target("nvgpu"))).statements:
            text = json.dumps(cache.statement_json(s))
            back = cache.statement_from(json.loads(text))
            assert back == s and json.dumps(cache.statement_json(back)) == text  # (0, 0.0, False apart)
            if s.library is not None:
                assert back.library.what == s.library.what != ""  # (not compared by ==)
                calls.add((fn.__name__, mode, type(back.library).__name__))
                assert dataclasses.astuple(back.library) == dataclasses.astuple(s.library)
    assert calls == {("_block", "library", "Gemm"), ("_grouped_conv", "library", "Gemm"),
                     ("_grouped_conv", "library", "Convolution")}
    with pytest.raises(TypeError, match="cannot write"):
        cache.statement_json(dataclasses.replace(s, library=object()))


LIBRARY_SCRIPT = """
import json, os, sys, numpy as np, polyjit
sys.path.insert(0, sys.argv[2])
from polyjit import library, InputInfo
from polyjit.runtime import cublas
from polyjit.codegen import nvgpu, program
from test_compile_cache import _mlp, _mlp_ref, MLP_SHAPES
from test_nvgpu import _HostCublas, run_threads_on_cpu
gpu = sys.argv[3] == "nvgpu"
cublas.cublas = lambda: _HostCublas()  # cuBLAS's sgemm on host memory: the GPU's steps run on the CPU
if sys.argv[1] == "hit":  # a fresh process that finds the program in the cache compiles, chooses, times nothing
    from polyjit.codegen import workers
    workers._workers = workers.LlvmWorkers(0)  # (LLVM on this process's thread, where refuse() sees it)
    def refuse(*a, **k):
        raise AssertionError("compiled again")
    nvgpu.ptx = program.compile_object = library.LibraryPolicy.use = library._time = library._single = refuse
rng = np.random.default_rng(7)
args = [rng.standard_normal(s, dtype=np.float32) / 8 for s in MLP_SHAPES]
fn = polyjit.compile(_mlp, [InputInfo(a.shape, np.float32) for a in args],
                     {"target": "nvgpu", "gpu_arch": "sm_90"} if gpu else {"contractions": "auto", "num_threads": 2})
exe = fn.compile_default()
out = run_threads_on_cpu(fn, args)[0] if gpu else fn(*args)
np.testing.assert_allclose(out, _mlp_ref(*args), rtol=1e-4, atol=1e-5)
print(json.dumps({**{k: exe.stats[k] for k in ("cache_hits", "kernels_compiled", "kernels", "library_calls",
                                              "contractions")},
                  "steps": [str(k.library) for k in exe.kernels if k.library is not None]}))
np.save(os.path.join(os.environ["POLYJIT_CACHE_DIR"], sys.argv[1] + ".npy"), out)
"""


def _cold_and_hit(folder, target: str) -> tuple[dict, dict]:
    """LIBRARY_SCRIPT's stats in two fresh processes, one after the other, sharing the cache in folder."""
    env = {**os.environ, "POLYJIT_CACHE_DIR": str(folder)}
    runs = []
    for mode in ("cold", "hit"):
        p = subprocess.run([sys.executable, "-c", LIBRARY_SCRIPT, mode, os.path.dirname(__file__), target], env=env,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    cold, hit = runs
    assert cold["cache_hits"] == 0 and cold["kernels_compiled"] > 0
    assert hit["cache_hits"] == 1 and hit["kernels_compiled"] == 0
    assert {k: v for k, v in hit.items() if k not in ("cache_hits", "kernels_compiled")} == \
        {k: v for k, v in cold.items() if k not in ("cache_hits", "kernels_compiled")}
    # the same program: equal results, up to rounding (on an AVX-512 host the library products' last bits
    # differed between processes, as a BLAS may pick its kernels by its buffers' alignment)
    np.testing.assert_allclose(np.load(folder / "hit.npy"), np.load(folder / "cold.npy"), rtol=1e-6, atol=1e-7)
    return cold, hit


def test_a_fresh_process_loads_a_gpu_program_with_library_steps(tmp_path):
    """A GPU program whose products run cuBLAS (chosen by the auto mode's
    model) is kept with its library steps: a second process compiles
    nothing, decides nothing again, and its results are the first's."""
    cold, _ = _cold_and_hit(tmp_path, "nvgpu")
    assert cold["library_calls"] == len(cold["steps"]) == 3 and len(cold["contractions"]) == 3
    assert all("library (cuBLAS" in c for c in cold["contractions"]), cold["contractions"]
    assert cold["kernels_compiled"] < cold["kernels"]  # (library steps have no PTX)


@pytest.mark.skipif(library.blas() is None, reason="no OpenBLAS from numpy to call")
def test_a_fresh_process_keeps_the_timed_choice_of_the_library(tmp_path):
    """contractions="auto" on the CPU times each product both ways; the
    program compiled from that choice is what the cache holds, so a second
    process neither times nor compiles, and computes what the first did."""
    cold, _ = _cold_and_hit(tmp_path, "cpu")
    assert len(cold["contractions"]) == 3 and all(" ms" in c for c in cold["contractions"]), cold["contractions"]
    assert cold["library_calls"] == sum(": library" in c for c in cold["contractions"])  # as the timing chose


def test_gpu_library_steps_are_shared_in_process_and_compiled_again_without_cublas(monkeypatch):
    """Within a process a GPU program with library steps is kept too (the
    second compile reads its steps back from JSON); where cuBLAS no longer
    loads, the kept program is not used: compiled again, generated."""
    from polyjit.runtime import cublas
    from test_nvgpu import _HostCublas
    monkeypatch.setattr(cublas, "cublas", lambda: _HostCublas())
    infos = [InputInfo(s, F32) for s in MLP_SHAPES]
    first = polyjit.compile(_mlp, infos, {**PTX_ONLY, "cache": False}).compile_default()
    again = polyjit.compile(_mlp, infos, {**PTX_ONLY, "cache": False}).compile_default()
    steps = [k.library for k in first.kernels if k.library is not None]
    assert first.stats["kernels_compiled"] > 0 and again.stats["kernels_compiled"] == 0 and len(steps) == 3
    assert [k.library for k in again.kernels if k.library is not None] == steps
    assert all(k.library is not s for k, s in zip([k for k in again.kernels if k.library], steps))  # (read back)
    monkeypatch.setattr(cublas, "cublas", lambda: None)
    bare = polyjit.compile(_mlp, infos, {**PTX_ONLY, "cache": False}).compile_default()
    assert bare.stats["kernels_compiled"] > 0 and bare.stats["library_calls"] == 0


def test_a_structure_isl_gave_up_on_is_split_at_once_at_other_sizes(rng, monkeypatch):
    """A group whose schedule isl gave up on (its budget) is split in two;
    a group of the same structure at other sizes (a model's blocks repeat
    one) is split without asking isl for the whole again."""
    import islpy as isl

    from polyjit.schedule import driver
    whole_tries = []
    real = driver._schedule_one_group

    def over_budget(ctx, prog, dom, validity, raw, names, *rest):
        if len(names) == len(prog.statements) > 1:
            whole_tries.append(len(names))
            raise isl.Error("maximal number of operations exceeded")
        return real(ctx, prog, dom, validity, raw, names, *rest)
    monkeypatch.setattr(driver, "_schedule_one_group", over_budget)
    x, y = rng.standard_normal((7, 45), dtype=F32), rng.standard_normal((5, 61), dtype=F32)
    exe = polyjit.compile(lambda x, y: (ops.softmax(x), ops.softmax(y)),
                          [InputInfo(x.shape, F32), InputInfo(y.shape, F32)], {"cache": False})
    assert len(whole_tries) == 1  # the second softmax's group, the same structure, was split at once
    for got, a in zip(exe(x, y), (x, y)):
        np.testing.assert_allclose(got, _softmax(a), rtol=1e-5, atol=1e-7)


def test_an_unread_input_is_part_of_the_key():
    """A program takes every input as an argument, read or not: a graph with
    an unread input after its read one has a key of its own (it had shared
    the key of the graph without it, whose entry expects one argument)."""
    with_unread = polyjit.compile(lambda x, y: x * 2.0, [InputInfo([4], np.float32), InputInfo([3], np.float32)],
                                  {"cache": False})
    alone = polyjit.compile(lambda x: x * 2.0, [InputInfo([4], np.float32)], {"cache": False})
    assert cache.graph_text(with_unread.graph) != cache.graph_text(alone.graph)
    np.testing.assert_array_equal(with_unread(np.ones(4, np.float32), np.ones(3, np.float32)), np.full(4, 2.0))


@pytest.mark.parametrize("framework", ["torch", "jax", "tf"])
def test_each_frontend_starts_the_workers_before_it_traces(framework, monkeypatch):
    """A frontend starts the compile's worker processes as it begins tracing
    a program it has not compiled (compiler.expect_compile), so that their
    imports run beside the framework's trace, not after it: before any
    compile asks for them."""
    from polyjit.codegen import workers
    from polyjit.targets.base import Target
    events = []
    start, compile_ = workers.workers, Target.compile
    monkeypatch.setattr(workers, "workers", lambda: events.append("workers") or start())
    monkeypatch.setattr(Target, "compile", lambda self, *a, **k: events.append("compile") or compile_(self, *a, **k))
    options = {"cache": False, "strict": True}
    if framework == "torch":
        torch = pytest.importorskip("torch")
        torch._dynamo.reset()
        out = torch.compile(lambda x: torch.tanh(x) * 2.0, backend="polyjit", options=options)(torch.ones(5))
    elif framework == "jax":
        jnp = pytest.importorskip("jax.numpy")
        out = polyjit.jit_jax(lambda x: jnp.tanh(x) * 2.0, compile_options=options)(jnp.ones(5))
    else:
        tf = pytest.importorskip("tensorflow")
        out = polyjit.jit_tf(lambda x: tf.tanh(x) * 2.0, compile_options=options)(tf.ones(5))
    np.testing.assert_allclose(np.asarray(out), np.tanh(np.ones(5)) * 2.0, rtol=1e-6)
    assert "compile" in events and events[0] == "workers", events
