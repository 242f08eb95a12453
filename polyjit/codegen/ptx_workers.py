"""PTX made in worker processes, where the host has cores to spare.

llvmlite serializes every call into LLVM with one lock per process, so one
process makes one kernel's PTX at a time however many threads ask; a model
of a hundred kernels then waits for LLVM alone at the end of its compile.
Workers here are plain subprocesses (``main`` below, reading jobs on
stdin; never a fork of the caller, which may hold LLVM's or a framework's
locks, nor multiprocessing's spawn, which would run the caller's main
script again), each running the same ``nvgpu.ptx`` as the
caller would, so the PTX is the same byte for byte. A thread per worker in
the caller hands it jobs from one queue. Where no worker starts, or one
dies, its jobs run on the caller's LLVM thread instead.
"""
from __future__ import annotations

import atexit
import os
import queue
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

_SIZE = struct.Struct("<Q")
_WORKER = "from polyjit.codegen.ptx_workers import main; main()"  # (not -m: the package imports this module)


def worker_count() -> int:
    """Workers to start: the host's cores less one for the caller, at most 4
    (0 on a host of fewer than 3 cores: the caller's LLVM thread serves)."""
    from ..options import usable_cores  # (options imports the targets, which import this)
    cores = usable_cores()
    return min(4, cores - 1) if cores >= 3 else 0


def _send(stream, *parts: str) -> None:
    for p in parts:
        data = p.encode()
        stream.write(_SIZE.pack(len(data)) + data)
    stream.flush()


def _receive(stream, count: int) -> list[str] | None:
    out = []
    for _ in range(count):
        head = stream.read(_SIZE.size)
        if len(head) < _SIZE.size:
            return None
        (n,) = _SIZE.unpack(head)
        data = stream.read(n)
        if len(data) < n:
            return None
        out.append(data.decode())
    return out


class PtxWorkers:
    """Worker processes taking (LLVM IR text, sm_XX) jobs; submit returns a
    Future of what fallback(text, arch) would return."""

    def __init__(self, count: int, fallback) -> None:
        self.fallback = fallback  # (text, arch) -> Future, on the caller's LLVM thread
        self.jobs: queue.Queue = queue.Queue()
        self.procs = []
        self.served = 0  # jobs done by a worker
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # polyjit as the caller has it
        for _ in range(count):
            try:
                proc = subprocess.Popen([sys.executable, "-c", _WORKER], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            except OSError:
                break
            self.procs.append(proc)
            threading.Thread(target=self._serve, args=(proc,), daemon=True, name="polyjit-ptx").start()

    def submit(self, text: str, arch: str) -> Future:
        if not self.procs:
            return self.fallback(text, arch)
        future: Future = Future()
        self.jobs.put((text, arch, future))
        return future

    def _serve(self, proc) -> None:
        while True:
            text, arch, future = self.jobs.get()
            start = time.perf_counter()
            try:
                _send(proc.stdin, arch, text)
                reply = _receive(proc.stdout, 2)
            except OSError:
                reply = None
            if reply is None:  # the worker is gone: this job and the rest on the caller's thread
                self.procs.remove(proc)
                _chain(self.fallback(text, arch), future)
                if not self.procs:
                    self._drain()
                return
            self.served += 1
            future.set_result((reply[0], reply[1], time.perf_counter() - start))

    def _drain(self) -> None:
        while True:
            try:
                text, arch, future = self.jobs.get_nowait()
            except queue.Empty:
                return
            _chain(self.fallback(text, arch), future)

    def close(self) -> None:
        for proc in list(self.procs):
            try:
                proc.stdin.close()
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()


def _chain(source: Future, target: Future) -> None:
    source.add_done_callback(lambda f: target.set_exception(f.exception()) if f.exception()
                             else target.set_result(f.result()))


_workers: PtxWorkers | None = None
_lock = threading.Lock()


def workers(fallback) -> PtxWorkers:
    """The process's workers (started on first use)."""
    global _workers
    with _lock:
        if _workers is None:
            _workers = PtxWorkers(worker_count(), fallback)
            atexit.register(_workers.close)
        return _workers


def _forget() -> None:
    """A forked child has none of its parent's workers: start its own on demand."""
    global _workers, _lock
    _workers, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget)


def main() -> None:
    """A worker: (arch, LLVM IR) in, (optimized IR, PTX) out, until stdin closes."""
    from .nvgpu import ptx
    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else written to stdout goes to stderr, not into the replies
    while True:
        job = _receive(stdin, 2)
        if job is None:
            return
        _send(stdout, *ptx(job[1], job[0]))

