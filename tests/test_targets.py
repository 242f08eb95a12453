"""Targets own their passes: the driver and the scheduler ask the target, never test its name."""
import gc
import weakref

import numpy as np
import pytest

import polyjit
from polyjit import InputInfo, ops, targets
from polyjit.errors import CompileOptionError
from polyjit.targets import CpuTarget

F32 = np.float32


class _Probe(CpuTarget):
    """The CPU's code, with a graph pass and scheduling rewrites of its own:
    none (isl's schedule as it is, no loop marked parallel)."""

    name = "probe"

    def __init__(self) -> None:
        self.seen: list[str] = []

    def graph_passes(self, graph, options):
        self.seen.append("graph")
        return super().graph_passes(graph, options)

    def schedule_rewrites(self, sched, prog, validity, tile_sizes):
        self.seen.append("schedule")
        return sched


def test_a_registered_target_compiles_with_its_own_passes_and_rewrites(rng, monkeypatch):
    probe = _Probe()
    monkeypatch.setitem(targets.TARGETS, "probe", probe)
    x = rng.standard_normal((512, 256), dtype=F32)
    fn = lambda x: ops.exp(x) * 2  # noqa: E731
    host = polyjit.compile(fn, [InputInfo(x.shape, F32)], {"cache": False})
    mine = polyjit.compile(fn, [InputInfo(x.shape, F32)], {"target": "probe", "cache": False})
    assert host.stats["parallel_kernels"] == 1 and mine.stats["parallel_kernels"] == 0
    assert probe.seen == ["graph", "schedule"]
    np.testing.assert_allclose(mine(x), np.exp(x) * 2, rtol=1e-6)
    assert "parallel" in host.ir("ast") and "parallel" not in mine.ir("ast")


def test_options_take_the_registry_and_each_target_checks_its_tiles():
    with pytest.raises(CompileOptionError, match=r"allowed values: \['cpu', 'nvgpu'\]"):
        polyjit.compile(ops.exp, [InputInfo((4,), F32)], {"target": "probe"})
    with pytest.raises(CompileOptionError, match="for target 'nvgpu'"):
        polyjit.compile(ops.exp, [InputInfo((4,), F32)], {"target": "nvgpu", "tile_sizes": [48]})
    exe = polyjit.compile(lambda a, b: ops.matmul(a, b), [InputInfo((64, 64), F32)] * 2,
                          {"tile_sizes": [48], "cache": False, "contractions": "generated"})
    assert exe.stats["kernels"] >= 1  # (any tile size on the CPU)


def test_kernels_shared_by_structure_follow_the_options_that_scheduled_them(rng):
    """A program of the structure of one compiled before in the process, with
    other tile sizes, gets code of its own schedule (it took the first one's)."""
    a, b = (rng.standard_normal((256, 256), dtype=F32) for _ in range(2))
    opts = {"cache": False, "contractions": "generated"}
    first = polyjit.compile(ops.matmul, [InputInfo(a.shape, F32)] * 2, opts)
    other = polyjit.compile(ops.matmul, [InputInfo(a.shape, F32)] * 2, {**opts, "tile_sizes": [8]})
    assert first.ir("ast") != other.ir("ast") and first.ir("llvm") != other.ir("llvm")
    assert other.stats["kernels_compiled"] >= 1
    np.testing.assert_allclose(other(a, b), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


class _Watcher(CpuTarget):
    """The CPU's code, noting whether Python's collector is on as it
    compiles; its graph passes raise where asked."""

    name = "watcher"

    def __init__(self, fail: bool) -> None:
        self.fail, self.collecting = fail, []

    def graph_passes(self, graph, options):
        self.collecting.append(gc.isenabled())
        if self.fail:
            raise RuntimeError("the watcher's compile fails")
        return super().graph_passes(graph, options)


def test_the_collector_is_off_while_compiling_and_as_it_was_after(monkeypatch):
    """Python's cyclic collector is held back while a program compiles and
    is on again after, also after a compile that raises; one the caller
    turned off stays off."""
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            for fail in (False, True):
                watcher = _Watcher(fail)
                monkeypatch.setitem(targets.TARGETS, "watcher", watcher)
                compile_ = lambda: polyjit.compile(ops.exp, [InputInfo((4,), F32)],  # noqa: E731
                                                   {"target": "watcher", "cache": False})
                if fail:
                    with pytest.raises(RuntimeError, match="watcher"):
                        compile_()
                else:
                    np.testing.assert_allclose(compile_()(np.ones(4, F32)), np.exp(np.ones(4, F32)), rtol=1e-6)
                assert watcher.collecting == [False] and gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_a_held_back_collector_still_frees_young_cycles_and_resumes_after_the_last_block(monkeypatch):
    """Blocks that overlap (compiles on several threads) turn the collector
    back on when the last ends; inside, collect_young frees the cycles made
    since the last collection (a compile's printed IR), not where the
    caller had turned the collector off."""
    from polyjit import collector

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    monkeypatch.setattr(collector, "YOUNG_LIMIT", 0)
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            with collector.collector_paused():
                with collector.collector_paused():
                    cycle = weakref.ref(Cycle())
                assert not gc.isenabled() and cycle() is not None
                collector.collect_young()
                assert (cycle() is None) == enabled
            assert gc.isenabled() == enabled
            gc.collect()
    finally:
        (gc.enable if was else gc.disable)()
