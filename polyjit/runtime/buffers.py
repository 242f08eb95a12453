"""Host memory for programs' outputs and temporaries: blocks reused once the
caller drops them (BufferCache), temporaries packed into one workspace by
their lifetimes (workspace_layout), poisoned on request (POLYJIT_POISON=1)
so that an element a kernel forgets to write shows up.
"""
from __future__ import annotations

import math
import os
import threading
import weakref

import numpy as np

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
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.MIN_BYTES:  # (aligned as a framework's tensors: TensorFlow takes them by DLPack only so)
            return _aligned(nbytes).view(dtype).reshape(shape)
        size = -(-nbytes // 4096) * 4096
        with self.lock:
            blocks = self.free.get(size)
            raw = blocks.pop() if blocks else None
            if raw is not None:
                self.held -= size
        if raw is None:
            raw = _aligned(size)
        return np.asarray(_Lease(raw, nbytes, self)).view(dtype).reshape(shape)

    def give_back(self, raw: np.ndarray) -> None:
        with self.lock:
            if self.held + raw.nbytes <= self.limit:
                self.free.setdefault(raw.nbytes, []).append(raw)
                self.held += raw.nbytes


def _aligned(nbytes: int) -> np.ndarray:
    """nbytes of new memory at a multiple of 64 bytes."""
    raw = np.empty(nbytes + 64, np.uint8)
    return raw[-raw.ctypes.data % 64:][:nbytes]


_cache = BufferCache()


def new_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized buffer; with POLYJIT_POISON=1 filled with NaN (-7777 for
    signed integers, all ones for unsigned) so that an element a kernel forgets
    to write shows up instead of passing by luck."""
    a = _cache.empty(shape, dtype)
    if POISON:
        poison(a)
    return a


def poison(a: np.ndarray) -> None:
    """Fill a with what POLYJIT_POISON writes (see new_buffer)."""
    kind = a.dtype.kind
    a.fill(np.nan if kind == "f" else np.iinfo(a.dtype).max if kind == "u" else
           max(-7777, np.iinfo(a.dtype).min) if kind == "i" else True)


ALIGN = 64  # bytes: a cache line, an AVX-512 vector


def workspace_layout(sizes: dict[str, int], spans: dict[str, tuple[int, int]]) -> tuple[dict[str, int], int]:
    """Byte offsets of temporaries (name -> bytes) in one workspace, and its
    size. Two share bytes only where both have a span (the first and last
    kernel that touch them; kernels run one after another) and the spans are
    disjoint: a model's temporaries then take a few of its layers' worth of
    memory, which stays in cache from one kernel to the next, instead of
    fresh pages for each (tens of megabytes a call for a small BERT).
    Largest first, each at the lowest offset clear of the placed ones whose
    spans meet its own."""
    placed: list[tuple[int, int, tuple[int, int] | None]] = []
    offsets: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: -sizes[n]):
        size = -(-sizes[name] // ALIGN) * ALIGN
        span = spans.get(name)
        at = 0
        for start, end in sorted((o, e) for o, e, sp in placed
                                 if span is None or sp is None or (sp[0] <= span[1] and span[0] <= sp[1])):
            if at + size <= start:
                break
            at = max(at, end)
        offsets[name] = at
        placed.append((at, at + size, span))
    return offsets, max((e for _, e, _ in placed), default=0)


def poison_fill(nbytes: int, kind: str) -> tuple[int, int, int]:
    """(value, count, width in bytes) of a memset that poisons nbytes of a
    native launcher's result: NaN for 4-byte floats, else 0xFF bytes (NaN for
    every float width, all ones for integers)."""
    return (0x7FC00000, nbytes // 4, 4) if kind == "f" and nbytes % 4 == 0 else (0xFF, nbytes, 1)
