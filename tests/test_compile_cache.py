"""Compile time: per-stage timings, kernels compiled once per structure, the on-disk cache."""
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

import polyjit
from polyjit import InputInfo, cache, ops

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
    """Each group's kernels go to the LLVM thread as soon as it is
    scheduled: the first is handed over before the last group is scheduled."""
    import threading

    from polyjit.codegen import program
    from polyjit.schedule import driver as schedule
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
    a, b, c = (rng.standard_normal(s, dtype=F32) for s in ((128, 96), (96, 160), (160, 112)))
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


SCRIPT = """
import json, sys, numpy as np, polyjit
from polyjit import ops, InputInfo
x = np.random.default_rng().standard_normal((48, 200), dtype=np.float32)
exe = polyjit.compile(ops.softmax, [InputInfo(x.shape, np.float32)], {"num_threads": 2})
e = np.exp(x - x.max(1, keepdims=True))
np.testing.assert_allclose(exe(x), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
print(json.dumps({k: exe.stats[k] for k in ("cache_hits", "kernels_compiled", "kernels")}))
"""


def _run(folder, count: int = 1) -> list[tuple[dict, str]]:
    """Run SCRIPT in count processes at once with the compile cache in folder."""
    env = {**os.environ, "POLYJIT_CACHE_DIR": str(folder)}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
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
    assert len(list(tmp_path.glob("*.pjc"))) == 1 and not list(tmp_path.glob(".tmp-*"))
    [(second, _)] = _run(tmp_path)
    assert second == {"cache_hits": 1, "kernels_compiled": 0, "kernels": first["kernels"]}


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
    assert len(list(tmp_path.glob("*.pjc"))) == 1 and not list(tmp_path.glob(".tmp-*"))
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
    declares the program's whole argument list, and ptxas accepts the module."""
    import re
    import shutil
    n, rows, d = 5, 24, 56
    infos = [InputInfo((rows, d), F32)] + [InputInfo(s, F32) for _ in range(n) for s in ((d, d), (d,))]
    exe = polyjit.compile(_layers(n), infos, {**PTX_ONLY, "cache": False}).compile_default()
    assert exe.stats["kernels"] >= n and 0 < exe.stats["kernels_compiled"] * 2 < exe.stats["kernels"]
    count = len(exe.buffers) + len(exe.int_slots)
    entries = re.findall(r"^\.visible \.entry (\w+)\(([^)]*)\)", exe.ptx, re.M)
    assert [e for e, _ in entries] == [k.name for k in exe.kernels]
    assert all(params.count(".param") == count for _, params in entries)
    if shutil.which("ptxas"):
        (tmp_path / "p.ptx").write_text(exe.ptx)
        done = subprocess.run(["ptxas", "-arch=sm_90", str(tmp_path / "p.ptx"), "-o", str(tmp_path / "p.cubin")],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


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
