"""Running compiled kernels on the caller's arrays.

An :class:`Executable` checks every argument before any kernel runs, binds
the size parameters from the argument shapes, allocates outputs and the
temporaries that were not contracted, and calls each kernel; the parallel
loop of a kernel is split across the target's thread team (ctypes releases the GIL).
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from . import sizes as sz
from .affine import Array
from .codegen.cpu import thread_team
from .codegen.llvm import KernelInfo
from .errors import InputError
from .sizes import Lin

log = logging.getLogger("polyjit.runtime")
PARALLEL_MIN_ELEMENTS = 1 << 15


POISON = os.environ.get("POLYJIT_POISON", "") not in ("", "0")


class _Lease:
    """Owner of a cached block while arrays made from it live: numpy makes it
    their base, and when the last one is dropped the block goes back."""

    def __init__(self, raw: np.ndarray, nbytes: int, cache: "BufferCache") -> None:
        self.raw = raw
        self.__array_interface__ = {"data": (raw.ctypes.data, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}
        weakref.finalize(self, cache.give_back, raw)


class BufferCache:
    """Memory for outputs and temporaries, reused once the caller drops them.

    Fresh multi-megabyte arrays fault every page in again on each call,
    which can cost more than the kernels; like a framework's caching
    allocator, this keeps freed blocks by size (up to ``limit`` bytes).
    """

    MIN_BYTES = 1 << 20

    def __init__(self, limit: int = 1 << 30) -> None:
        self.free: dict[int, list[np.ndarray]] = {}
        self.held = 0
        self.limit = limit
        self.lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < self.MIN_BYTES:
            return np.empty(shape, dtype)
        size = -(-nbytes // 4096) * 4096
        with self.lock:
            blocks = self.free.get(size)
            raw = blocks.pop() if blocks else None
            if raw is not None:
                self.held -= size
        if raw is None:
            raw = np.empty(size + 64, np.uint8)
            raw = raw[-raw.ctypes.data % 64:][:size]  # 64-byte aligned
        return np.asarray(_Lease(raw, nbytes, self)).view(dtype).reshape(shape)

    def give_back(self, raw: np.ndarray) -> None:
        with self.lock:
            if self.held + raw.nbytes <= self.limit:
                self.free.setdefault(raw.nbytes, []).append(raw)
                self.held += raw.nbytes


_cache = BufferCache()


def _new_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized buffer; with POLYJIT_POISON=1 filled with NaN (-7777 for
    signed integers, all ones for unsigned) so that an element a kernel forgets
    to write shows up instead of passing by luck."""
    a = _cache.empty(shape, dtype)
    if POISON:
        kind = np.dtype(dtype).kind
        a.fill(np.nan if kind == "f" else np.iinfo(dtype).max if kind == "u" else -7777)
    return a


@dataclass
class Executable:
    """A compiled program for one target and one layout of its inputs."""

    name: str
    inputs: list[Array]
    outputs: list[Array]
    output_arrays: list[str]
    buffers: list[Array]
    int_slots: list[tuple[str, int]]
    params: list[str]
    constraints: list
    constants: list[np.ndarray]
    kernels: list[KernelInfo]
    num_threads: int
    stats: dict = field(default_factory=dict)
    contracted_bytes: Any = None
    keepalive: Any = None

    def bind(self, args: Sequence[np.ndarray]) -> dict[str, int]:
        """Size parameters from the arguments; raises InputError on any mismatch."""
        if len(args) != len(self.inputs):
            raise InputError(f"{self.name}: expected {len(self.inputs)} inputs, got {len(args)}")
        env: dict[str, int] = {}
        for k, (a, spec) in enumerate(zip(args, self.inputs)):
            if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                raise InputError(f"{self.name}: input {k} is a {type(a).__name__}, expected an array")
            if a.ndim != len(spec.shape):
                raise InputError(f"{self.name}: input {k} has rank {a.ndim}, expected rank {len(spec.shape)} "
                                 f"(shape {list(spec.shape)})")
            if a.dtype != spec.dtype.numpy:
                raise InputError(f"{self.name}: input {k} has dtype {a.dtype}, expected {spec.dtype}")
            for d, (n, s) in enumerate(zip(a.shape, spec.shape)):
                if isinstance(s, Lin) and len(s.terms) == 1 and s.const == 0 and s.terms[0][1] == 1:
                    p = s.terms[0][0]
                    if p in env and env[p] != n:
                        raise InputError(f"{self.name}: input {k} dimension {d} is {n}, but another input "
                                         f"fixes that size to {env[p]}")
                    env[p] = n
                elif sz.is_static(s) and s != n:
                    raise InputError(f"{self.name}: input {k} has shape {list(a.shape)}, expected size {s} "
                                     f"in dimension {d} (shape {list(spec.shape)})")
        for k, (a, spec) in enumerate(zip(args, self.inputs)):
            for d, (n, s) in enumerate(zip(a.shape, spec.shape)):
                if isinstance(s, Lin) and sz.evaluate(s, env) != n:
                    raise InputError(f"{self.name}: input {k} dimension {d} is {n}, expected {s} = "
                                     f"{sz.evaluate(s, env)}")
        for a, b in self.constraints:
            try:
                va, vb = sz.evaluate(a, env), sz.evaluate(b, env)
            except KeyError:
                continue
            if va != vb:
                raise InputError(f"{self.name}: sizes {a} = {va} and {b} = {vb} must be equal")
        return env

    def __call__(self, *args: np.ndarray) -> list[np.ndarray]:
        env = self.bind(args)
        arrays: dict[str, np.ndarray] = {}
        for spec, a in zip(self.inputs, args):
            arrays[spec.name] = a if spec.strided or a.flags.c_contiguous else np.ascontiguousarray(a)
        outs = []
        for spec in self.outputs:
            shape = tuple(sz.evaluate(s, env) for s in spec.shape)
            arrays[spec.name] = _new_buffer(shape, spec.dtype.numpy)
        temp_bytes = 0
        for spec in self.buffers:
            if spec.kind == "temp":
                shape = tuple(sz.evaluate(s, env) for s in spec.shape)
                arrays[spec.name] = _new_buffer(shape, spec.dtype.numpy)
                temp_bytes += arrays[spec.name].nbytes
            elif spec.kind == "const":
                arrays[spec.name] = self.constants[spec.index]
        ptrs = (ctypes.c_void_p * max(len(self.buffers), 1))(
            *[arrays[b.name].ctypes.data for b in self.buffers])
        ints = []
        for name, d in self.int_slots:
            if d < 0:
                ints.append(env[name])
            else:
                a = arrays[name]
                ints.append(a.strides[d] // a.itemsize)
        ivec = (ctypes.c_int64 * max(len(ints), 1))(*ints)
        work = sum(a.size for a in arrays.values())
        threads = self.num_threads if work >= PARALLEL_MIN_ELEMENTS else 1
        team = thread_team() if threads > 1 else None
        for k in self.kernels:
            if k.parallel and threads > 1:
                team.run(k.fn, ptrs, ivec, threads)
            else:
                k.fn(ptrs, ivec, 0, 1)
        self.stats["intermediate_bytes"] = temp_bytes + (self.contracted_bytes(env) if self.contracted_bytes else 0)
        outs = [arrays[n] for n in self.output_arrays]
        return outs
