"""The thread team that runs kernels' parts (``fn(buffers, ints, part, parts)``).

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
from typing import Any, Callable, Hashable, Sequence

from llvmlite import ir

from ..codegen.cpu import X86, JitModule, ieee_floats
from ..codegen.llvm import I64


REGION_SPIN = 2000  # pauses a thread waits for a region's earlier kernels before it yields its core each time

# The region's data block, slot by slot (pointers): the kernels' addresses
# (an array), their count, the argument block's halves, libgomp's
# omp_get_thread_num and omp_get_num_threads, sched_yield, and the
# schedule's state (16 bytes, zero at the start: int32 parts taken, parts
# done, threads finished).
REGION_DATA = ("kernels", "count", "buffers", "ints", "omp_get_thread_num", "omp_get_num_threads", "sched_yield",
               "state")


def _trampoline() -> str:
    """The function each OpenMP thread runs, polyjit_omp_region(data) (data:
    REGION_DATA): the kernels' parts in order, num_threads parts to a
    kernel, with IEEE subnormals (a team started from a thread that flushes
    them, as XLA's do, inherits that mode).

    Each thread takes the next part from a shared count and runs it once
    every part of the earlier kernels is done, waiting REGION_SPIN pauses
    and then yielding its core, never sleeping. So a thread late to the
    region (a core woken from idle) holds nobody up: the others take its
    parts. The first thread returns once every thread has finished, waiting
    the same way, rather than sleep in libgomp's closing barrier. A team
    that slept between a call's kernels paid a wake at each one, and on a
    virtual machine a core woken after idle time came back about a
    millisecond later (bench/NOTES.md). Between calls the threads sleep in
    libgomp as before."""
    i32, ptr = ir.IntType(32), ir.IntType(8).as_pointer()
    mod = ir.Module(name="polyjit_omp")
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [ptr]), "polyjit_omp_region")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    data = b.bitcast(fn.args[0], ptr.as_pointer())
    field = {name: b.load(b.gep(data, [ir.Constant(I64, k)])) for k, name in enumerate(REGION_DATA)}
    kernels = b.bitcast(field["kernels"], ptr.as_pointer())
    index = ir.FunctionType(i32, [])
    parts = b.call(b.bitcast(field["omp_get_num_threads"], index.as_pointer()), [])
    total = b.mul(b.trunc(b.ptrtoint(field["count"], I64), i32), parts)
    state = b.bitcast(field["state"], i32.as_pointer())
    taken, done, left = (b.gep(state, [ir.Constant(I64, k)]) for k in range(3))
    yield_ = b.bitcast(field["sched_yield"], index.as_pointer())
    pause = ir.Function(mod, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause") if X86 else None
    restore = ieee_floats(b)
    run = ir.FunctionType(ir.VoidType(), [ptr, ptr, I64, I64])
    take, ready, finish = (fn.append_basic_block(n) for n in ("take", "ready", "finish"))
    b.branch(take)
    b.position_at_end(take)
    part = b.atomic_rmw("add", taken, ir.Constant(i32, 1), "monotonic")
    b.cbranch(b.icmp_unsigned("<", part, total), ready, finish)
    b.position_at_end(ready)
    kernel = b.udiv(part, parts)
    _wait_until(b, done, b.mul(kernel, parts), pause, yield_)
    address = b.load(b.gep(kernels, [b.zext(kernel, I64)]))
    b.call(b.bitcast(address, run.as_pointer()),
           [field["buffers"], field["ints"], b.zext(b.urem(part, parts), I64), b.zext(parts, I64)])
    b.atomic_rmw("add", done, ir.Constant(i32, 1), "release")
    b.branch(take)
    b.position_at_end(finish)
    b.atomic_rmw("add", left, ir.Constant(i32, 1), "release")
    first = b.icmp_unsigned("==", b.call(b.bitcast(field["omp_get_thread_num"], index.as_pointer()), []),
                            ir.Constant(i32, 0))
    with b.if_then(first):
        _wait_until(b, left, parts, pause, yield_)
    restore()
    b.ret_void()
    return str(mod)


def _wait_until(b: ir.IRBuilder, done: ir.Value, needed: ir.Value, pause, yield_) -> None:
    """Wait until ``done`` reaches ``needed``: REGION_SPIN pauses, then yielding each time."""
    i32 = ir.IntType(32)
    fn = b.function
    start = b.block
    wait, idle, spin, turn, met = (fn.append_basic_block(n) for n in ("wait", "idle", "spin", "turn", "met"))
    b.branch(wait)
    b.position_at_end(wait)
    turns = b.phi(i32, "turns")
    b.cbranch(b.icmp_unsigned(">=", b.load_atomic(done, "acquire", 4), needed), met, idle)
    b.position_at_end(idle)
    b.cbranch(b.icmp_unsigned("<", turns, ir.Constant(i32, REGION_SPIN)), spin, turn)
    b.position_at_end(spin)
    if pause is not None:
        b.call(pause, [])
    turns.add_incoming(b.add(turns, ir.Constant(i32, 1)), spin)
    b.branch(wait)
    b.position_at_end(turn)
    b.call(yield_, [])
    turns.add_incoming(turns, turn)
    b.branch(wait)
    turns.add_incoming(ir.Constant(i32, 0), start)
    b.position_at_end(met)


def regions(items: Sequence, team: Callable[[Any], Hashable | None]) -> list[list]:
    """items in order, in groups: each run of consecutive items with the same
    ``team(item)`` (not None) is one group, one parallel region; any other
    item is a group of its own."""
    groups: list[list] = []
    last = None
    for item in items:
        key = team(item)
        if key is not None and key == last:
            groups[-1].append(item)
        else:
            groups.append([item])
        last = key
    return groups


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
    """Runs kernels' parts on libgomp's thread team, one parallel region
    (GOMP_parallel) for a run of kernels."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self.path = path
        self._parallel = lib.GOMP_parallel
        self._parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        self._parallel.restype = None
        libc = ctypes.CDLL(None)
        self._shared = {f: ctypes.cast(getattr(h, f), ctypes.c_void_p).value
                        for h, f in ((lib, "omp_get_thread_num"), (lib, "omp_get_num_threads"),
                                     (libc, "sched_yield"))}
        self._jit = JitModule(_trampoline())
        self._entry = self._jit.engine.get_function_address("polyjit_omp_region")

    def symbols(self) -> dict[str, int]:
        """The addresses native code needs to run parts on this team (launch.CPU_SYMBOLS)."""
        return {"GOMP_parallel": ctypes.cast(self._parallel, ctypes.c_void_p).value,
                "polyjit_omp_region": self._entry, **self._shared}

    def run(self, kernels: Sequence, bufs, ints, threads: int) -> None:
        """Each of kernels (ctypes functions or addresses) in turn, split in
        ``threads`` parts, in one region."""
        array = (ctypes.c_void_p * len(kernels))(*(ctypes.cast(k, ctypes.c_void_p).value for k in kernels))
        state = (ctypes.c_int32 * 4)()
        fields = {"kernels": ctypes.addressof(array), "count": len(kernels),
                  "buffers": ctypes.cast(bufs, ctypes.c_void_p).value, "ints": ctypes.cast(ints, ctypes.c_void_p).value,
                  "state": ctypes.addressof(state), **self._shared}
        data = (ctypes.c_void_p * len(REGION_DATA))(*(fields[f] for f in REGION_DATA))
        self._parallel(self._entry, data, threads, 0)


class PoolTeam:
    """Runs kernels' parts on Python threads; the caller runs part 0."""

    def __init__(self) -> None:
        self._pools: dict[int, ThreadPoolExecutor] = {}

    def run(self, kernels: Sequence, bufs, ints, threads: int) -> None:
        if threads - 1 not in self._pools:
            self._pools[threads - 1] = ThreadPoolExecutor(threads - 1, thread_name_prefix="polyjit")
        for kernel in kernels:
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
