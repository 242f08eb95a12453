"""Compile time: per-stage timings, kernels compiled once per structure, the on-disk cache."""
import logging

import numpy as np

import polyjit
from polyjit import InputInfo, ops

F32 = np.float32


def test_stage_seconds_in_stats_and_log(rng, caplog):
    x = rng.standard_normal((64, 96), dtype=F32)
    with caplog.at_level(logging.INFO, logger="polyjit"):
        exe = polyjit.compile(ops.softmax, [InputInfo(x.shape, F32)])
    stages = exe.stats["compile_seconds_by_stage"]
    assert set(stages) == {"lower", "schedule", "emit", "llvm"} and all(v >= 0 for v in stages.values())
    assert sum(stages.values()) <= exe.stats["compile_seconds"]
    assert any("schedule" in r.getMessage() and "llvm" in r.getMessage() for r in caplog.records)
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(exe(x), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
