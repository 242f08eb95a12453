"""The thread team that runs a kernel's parts (``fn(buffers, ints, part, parts)``).

The team is OpenMP's (libgomp) when one is at hand, preferring the copy the
process already loaded (PyTorch's): its threads spin between parallel
regions, so they start at once, and sharing them keeps polyjit's threads
from fighting the framework's for the cores. A copy polyjit loads itself
(under JAX or TensorFlow) spins briefly (SPIN_COUNT). Without libgomp a
Python thread pool runs the parts.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from concurrent.futures import ThreadPoolExecutor

from llvmlite import ir

from ..codegen.cpu import JitModule, ieee_floats
from ..codegen.llvm import I64


def _trampoline() -> str:
    """The function each OpenMP thread runs, polyjit_omp_part(data) with data
    = {kernel, buffers, ints, omp_get_thread_num, omp_get_num_threads}: part
    thread_num of num_threads, with IEEE subnormals (a team started from a
    thread that flushes them, as XLA's do, inherits that mode)."""
    ptr = ir.IntType(8).as_pointer()
    mod = ir.Module(name="polyjit_omp")
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [ptr]), "polyjit_omp_part")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    data = b.bitcast(fn.args[0], ptr.as_pointer())
    kernel, bufs, ints, num, count = (b.load(b.gep(data, [ir.Constant(I64, k)])) for k in range(5))
    index = ir.FunctionType(ir.IntType(32), [])
    part, parts = (b.sext(b.call(b.bitcast(f, index.as_pointer()), []), I64) for f in (num, count))
    restore = ieee_floats(b)
    run = ir.FunctionType(ir.VoidType(), [ptr, ptr, I64, I64])
    b.call(b.bitcast(kernel, run.as_pointer()), [bufs, ints, part, parts])
    restore()
    b.ret_void()
    return str(mod)


def _loaded_libgomp() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libgomp"):
                    return path
    except OSError:
        pass
    return None


class OmpTeam:
    """Runs a kernel's parts on libgomp's thread team (GOMP_parallel)."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self.path = path
        self._parallel = lib.GOMP_parallel
        self._parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        self._parallel.restype = None
        self._ids = [ctypes.cast(lib.omp_get_thread_num, ctypes.c_void_p).value,
                     ctypes.cast(lib.omp_get_num_threads, ctypes.c_void_p).value]
        self._jit = JitModule(_trampoline())
        self._entry = self._jit.engine.get_function_address("polyjit_omp_part")

    def symbols(self) -> dict[str, int]:
        """The addresses native code needs to run parts on this team (launch.CPU_SYMBOLS)."""
        return {"GOMP_parallel": ctypes.cast(self._parallel, ctypes.c_void_p).value, "polyjit_omp_part": self._entry,
                "omp_get_thread_num": self._ids[0], "omp_get_num_threads": self._ids[1]}

    def run(self, kernel, bufs, ints, threads: int) -> None:
        data = (ctypes.c_void_p * 5)(ctypes.cast(kernel, ctypes.c_void_p).value,
                                     ctypes.cast(bufs, ctypes.c_void_p).value,
                                     ctypes.cast(ints, ctypes.c_void_p).value, *self._ids)
        self._parallel(self._entry, data, threads, 0)


class PoolTeam:
    """Runs a kernel's parts on Python threads; the caller runs part 0."""

    def __init__(self) -> None:
        self._pools: dict[int, ThreadPoolExecutor] = {}

    def run(self, kernel, bufs, ints, threads: int) -> None:
        if threads - 1 not in self._pools:
            self._pools[threads - 1] = ThreadPoolExecutor(threads - 1, thread_name_prefix="polyjit")
        rest = [self._pools[threads - 1].submit(kernel, bufs, ints, t, threads) for t in range(1, threads)]
        kernel(bufs, ints, 0, threads)
        for f in rest:
            f.result()


SPIN_COUNT = 10000  # libgomp's GOMP_SPINCOUNT for a copy polyjit loads: its default is 300000


@functools.cache
def thread_team():
    """The team for parallel kernels, chosen at the first parallel call: the
    process's libgomp if one is loaded, else the system's, else a thread
    pool (POLYJIT_THREADS=pool forces it)."""
    path = None
    if os.environ.get("POLYJIT_THREADS", "") != "pool":
        path = _loaded_libgomp()
        if path is None:
            path = ctypes.util.find_library("gomp")
            if path:
                _load_spinning_briefly(path)
    try:
        return OmpTeam(path) if path else PoolTeam()
    except (OSError, AttributeError):
        return PoolTeam()


def _load_spinning_briefly(path: str) -> None:
    """Load libgomp with threads that spin SPIN_COUNT times before they
    sleep, unless the user set its wait policy or spin count: at libgomp's
    default a team whose cores other processes share spent its time slices
    spinning at barriers (a training step of many small kernels 10-60 times
    slower), while quiet steps take about as long either way (bench/NOTES.md).
    libgomp reads the setting once, as it loads; the environment is left as
    it was."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    try:
        ctypes.CDLL(path)
    except OSError:
        pass
    finally:
        del os.environ["GOMP_SPINCOUNT"]
