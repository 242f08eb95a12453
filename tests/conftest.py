import atexit
import os
import shutil
import tempfile

# Outputs and temporaries start as NaN (-7777 for integers): an element a kernel
# forgets to write fails the comparison instead of passing by luck.
os.environ.setdefault("POLYJIT_POISON", "1")
# The compile cache goes to a folder of this run's (subprocesses inherit it), never the user's.
os.environ["POLYJIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="polyjit_cache_")
atexit.register(shutil.rmtree, os.environ["POLYJIT_CACHE_DIR"], True)

import numpy as np
import pytest


def pytest_collection_modifyitems(config, items):
    gpu = _gpu_visible()
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="no NVIDIA GPU visible"))


def _gpu_visible() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl"))


@pytest.fixture
def rng():
    """Fresh random data each run: a seed from the OS, printed on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def llvm_workers(monkeypatch):
    """install(count, kill=False): a pool of count LLVM worker processes as
    the process's own, started (until then jobs run on the caller's
    thread), its workers killed first with kill; closed after the test."""
    from polyjit.codegen import workers
    pools = []

    def install(count: int, kill: bool = False):
        pool = workers.LlvmWorkers(count)
        pools.append(pool)
        assert not count or pool.ready.wait(60)
        for proc in pool.procs if kill else ():
            proc.kill()
            proc.wait()
        monkeypatch.setattr(workers, "_workers", pool)
        return pool
    yield install
    for pool in pools:
        pool.close()
