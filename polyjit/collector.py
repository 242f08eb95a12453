"""Python's cyclic garbage collector held back while polyjit compiles.

A framework's process holds hundreds of thousands of objects, and a
compile's allocations (LLVM IR built in Python, each kernel's module
dropped once printed) set off full collections that walk them all, several
a compile; the objects that lived through a part of the compile and were
promoted bring the next full collection closer after it. Held back, the
compile's cycles are freed by young collections (collect_young, then the
first automatic one after it), and only what the compile keeps grows the
old generation.
"""
from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

_pause_lock = threading.Lock()
_pauses = 0  # collector_paused blocks under way, in any thread
_resume = False  # whether the collector was on when the first of them began
YOUNG_LIMIT = 100_000  # objects allocated (net) with the collector paused before collect_young frees their cycles


@contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off for the block. It is turned back on when the last
    of the blocks under way (compiles overlap across threads) ends, where
    it was on when the first began, also where the block raises; other
    threads allocate without it meanwhile."""
    global _pauses, _resume
    with _pause_lock:
        if _pauses == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _resume:
                gc.enable()


def collect_young() -> None:
    """Free the cycles of the objects allocated since the last collection
    (the youngest generation, not the process's old objects) where
    collector_paused holds the collector back and they have grown past
    YOUNG_LIMIT: a paused compile's garbage stays bounded. Called where a
    compile drops what it built (a kernel's IR once printed)."""
    if _pauses and _resume and gc.get_count()[0] > YOUNG_LIMIT:
        gc.collect(0)
