"""The cpu target: the host's triple and features, O3 with the loop and SLP
vectorizers, MCJIT; a kernel's parallel loop is split across a thread team.

The team is OpenMP's (libgomp) when one is at hand, preferring the copy the
process already loaded (PyTorch's): its threads spin between parallel
regions, so they start at once, and sharing them keeps polyjit's threads
from fighting the framework's for the cores. Without libgomp a Python
thread pool runs the parts.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import llvmlite.binding as llvm

from .llvm import Emitter

KERNEL_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
_lock = threading.Lock()


@functools.cache
def _llvm():
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    libm = ctypes.util.find_library("m")
    if libm:
        llvm.load_library_permanently(libm)
    return llvm.Target.from_default_triple()


def target_machine():
    """A fresh target machine: an execution engine takes ownership of its own."""
    return _llvm().create_target_machine(cpu=llvm.get_host_cpu_name(),
                                         features=llvm.get_host_cpu_features().flatten(),
                                         opt=3, codemodel="jitdefault")


class CpuEmitter(Emitter):
    triple = llvm.get_process_triple()


WIDE = 1000  # the attribute group number for the kernels' vector width


def vector_bits() -> int:
    """The width of the host's vectors: 512 with AVX-512, else 256."""
    return 512 if "+avx512f" in llvm.get_host_cpu_features().flatten() else 256


def prefer_wide_vectors(ir_text: str) -> str:
    """On an AVX-512 host, every function asks for 512-bit vectors: LLVM tunes
    Intel's cores to 256 bits, but register blocks of contractions are sized
    for 512 (4 x 64 floats in 16 registers; at 256 bits they spill). Emerald
    Rapids, matmul 1024^3: 47 -> 60 GFLOP/s on one core, 439 -> 615 on 16."""
    if vector_bits() < 512:
        return ir_text
    text = re.sub(r"^(define [^\n]*\))$", rf"\1 #{WIDE}", ir_text, flags=re.M)
    return text + f'\nattributes #{WIDE} = {{ "prefer-vector-width"="512" }}\n'


def optimize(mod: "llvm.ModuleRef", tm) -> None:
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pto.loop_vectorization = True
    pto.slp_vectorization = True
    pto.loop_unrolling = True
    pb = llvm.create_pass_builder(tm, pto)
    pm = pb.getModulePassManager()
    pm.run(mod, pb)


class JitModule:
    """A JIT-compiled LLVM module; keeps the engine alive with its code."""

    def __init__(self, ir_text: str) -> None:
        tm = target_machine()
        with _lock:
            mod = llvm.parse_assembly(prefer_wide_vectors(ir_text))
            mod.verify()
            mod.triple = tm.triple
            mod.data_layout = str(tm.target_data)
            optimize(mod, tm)
            self.optimized_ir = str(mod)
            self.engine = llvm.create_mcjit_compiler(mod, tm)
            self.engine.finalize_object()
            self.assembly = None
            self._tm = tm
            self._mod = mod

    def function(self, name: str):
        return KERNEL_T(self.engine.get_function_address(name))

    def asm(self) -> str:
        if self.assembly is None:
            self.assembly = self._tm.emit_assembly(self._mod)
        return self.assembly


# The trampoline each OpenMP thread runs: data = {kernel, buffers, ints,
# omp_get_thread_num, omp_get_num_threads}; it runs part thread_num of num_threads.
_TRAMPOLINE = """
define void @polyjit_omp_part(ptr %data) {
  %kp = getelementptr ptr, ptr %data, i64 0
  %k = load ptr, ptr %kp
  %bp = getelementptr ptr, ptr %data, i64 1
  %b = load ptr, ptr %bp
  %ip = getelementptr ptr, ptr %data, i64 2
  %i = load ptr, ptr %ip
  %tp = getelementptr ptr, ptr %data, i64 3
  %tf = load ptr, ptr %tp
  %np = getelementptr ptr, ptr %data, i64 4
  %nf = load ptr, ptr %np
  %t = call i32 %tf()
  %n = call i32 %nf()
  %t64 = sext i32 %t to i64
  %n64 = sext i32 %n to i64
  call void %k(ptr %b, ptr %i, i64 %t64, i64 %n64)
  ret void
}
"""


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
        self._jit = JitModule(_TRAMPOLINE)
        self._entry = self._jit.engine.get_function_address("polyjit_omp_part")

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


@functools.cache
def thread_team():
    """The team for parallel kernels, chosen at the first parallel call: the
    process's libgomp if one is loaded, else the system's, else a thread
    pool (POLYJIT_THREADS=pool forces it)."""
    path = None
    if os.environ.get("POLYJIT_THREADS", "") != "pool":
        path = _loaded_libgomp() or ctypes.util.find_library("gomp")
    try:
        return OmpTeam(path) if path else PoolTeam()
    except (OSError, AttributeError):
        return PoolTeam()
