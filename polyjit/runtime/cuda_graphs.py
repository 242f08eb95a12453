"""A native launcher's steps replayed as CUDA graphs: one cuGraphLaunch per
call in place of a driver or library call per kernel, memset and
convolution (a CNN's hundred launches cost more host time than its kernels
took on the device).

A graph holds the addresses it was captured with, so a call replays one
only where it hands the launcher the same pointers (inputs, outputs and
workspace): in a loop over one model, a caching allocator (PyTorch's, JAX's)
gives back the same blocks call after call. A call with new pointers runs
the launcher directly; the second call with the same ones captures it, on a
stream of polyjit's own (the legacy default stream cannot be captured), and
keeps the graph, a few per launcher. A capture that fails (a library that
allocates memory while captured) leaves the launcher running directly from
then on. ``POLYJIT_CUDA_GRAPHS=0`` turns replays off.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import weakref
from collections import OrderedDict
from typing import Any, Callable

from .cuda import driver

log = logging.getLogger("polyjit.runtime")

ENABLED = os.environ.get("POLYJIT_CUDA_GRAPHS", "1") != "0"
KEEP = 4  # graphs kept per launcher (a model's outputs alternate between two blocks: two graphs)


@functools.cache
def _graph_launch() -> Callable[[int, int], int]:
    """cuGraphLaunch through ctypes: the bindings' wrappers cost more than the call."""
    fn = ctypes.CDLL("libcuda.so.1").cuGraphLaunch
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    return fn


_capture_streams: dict[int, Any] = {}  # a non-blocking stream per device, to capture on


def _capture_stream(ordinal: int):
    cu = driver()
    s = _capture_streams.get(ordinal)
    if s is None:
        err, s = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        if err != cu.CUresult.CUDA_SUCCESS:
            return None
        _capture_streams[ordinal] = s
    return s


def _capturing(stream: int) -> bool:
    """Whether the caller's stream is being captured (its own graph takes our launches as they are)."""
    cu = driver()
    err, status = cu.cuStreamIsCapturing(cu.CUstream(stream))
    return err != cu.CUresult.CUDA_SUCCESS or status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


class GraphReplays:
    """A native launcher (``run(inputs, outputs, stream, message, size)``,
    its status; inputs and outputs ctypes arrays of pointers) called the
    same way: a call replays the graph captured for the pointers it passes,
    or runs the launcher itself."""

    def __init__(self, run: Callable, ordinal: int) -> None:
        self.run, self.ordinal = run, ordinal
        self.graphs: OrderedDict[tuple, Any] = OrderedDict()
        self.seen: OrderedDict[tuple, None] = OrderedDict()
        self.broken = False
        self.replays = 0
        weakref.finalize(self, _destroy, self.graphs)

    def __call__(self, inputs, outputs, stream: int, message, size: int) -> int:
        key = bytes(inputs) + bytes(outputs)  # (one copy each: a model's hundreds of pointers as ints cost more)
        graph = self.graphs.get(key)
        if graph is None and not self.broken and key in self.seen and not _capturing(stream):
            graph = self._capture(key, inputs, outputs, message, size)
        if graph is None:
            self.seen[key] = None
            while len(self.seen) > 2 * KEEP:
                self.seen.popitem(last=False)
            return self.run(inputs, outputs, stream, message, size)
        self.replays += 1
        return _graph_launch()(int(graph), stream)

    def _capture(self, key: tuple, inputs, outputs, message, size: int):
        """The launcher's steps captured for these pointers and instantiated; None where that failed."""
        cu = driver()
        ok = cu.CUresult.CUDA_SUCCESS
        s = _capture_stream(self.ordinal)
        if s is None or cu.cuStreamBeginCapture(s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)[0] != ok:
            self.broken = True
            return None
        code = self.run(inputs, outputs, int(s), message, size)
        err, graph = cu.cuStreamEndCapture(s)
        exe = None
        if code == 0 and err == ok:
            err, exe = cu.cuGraphInstantiate(graph, 0)
            exe = exe if err == ok else None
        if err == ok and graph is not None:
            cu.cuGraphDestroy(graph)
        if exe is None:
            log.info("CUDA graph capture failed (%s; launcher status %d): launching directly", err, code)
            self.broken = True
            return None
        self.graphs[key] = exe
        while len(self.graphs) > KEEP:
            cu.cuGraphExecDestroy(self.graphs.popitem(last=False)[1])
        return exe


def _destroy(graphs: dict) -> None:
    try:
        cu = driver()
        for exe in graphs.values():
            cu.cuGraphExecDestroy(exe)
    except Exception:  # interpreter shutdown
        pass
