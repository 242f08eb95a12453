"""The cpu target: the host's triple and features, O3 with the loop and SLP
vectorizers, MCJIT; a kernel's parallel loop is split across a thread pool."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading

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
            mod = llvm.parse_assembly(ir_text)
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
