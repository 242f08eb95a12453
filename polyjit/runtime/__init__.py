"""Running compiled programs on the caller's arrays.

- ``program``: CompiledProgram (argument checks, sizes bound from shapes, a
  call plan per shape signature), the executable of CPU code;
  ``buffers``: host memory for outputs and temporaries; ``threads``: the
  team that runs a kernel's parallel parts.
- ``cuda``: cuda-python's driver API; ``gpu_buffers``: device memory,
  views of callers' GPU arrays, DLPack export; ``gpu_program``: GpuProgram,
  the executable of PTX; ``cublas``, ``cudnn``: the vendor libraries, found
  at run time (``vendor``: how, and what their bindings share).
- ``launch``: a call plan as host code (native launchers) for callers
  outside Python; ``xla_ffi``: XLA's custom-call handler that runs one.
"""
from .buffers import BufferCache
from .program import CompiledProgram, RowMajor

__all__ = ["BufferCache", "CompiledProgram", "RowMajor"]
