"""LLVM's work on kernels (a CPU kernel's object code, a GPU kernel's PTX),
and isl's scheduling of fusion groups, in worker processes.

llvmlite serializes every call into LLVM with one lock per process, and
each call waits for Python's GIL on its way back: on a thread beside the
compile's own Python (isl scheduling, emitting IR), every one of a
kernel's two dozen calls waits out the interpreter's switch interval
(bench/NOTES.md: several times the kernels' time alone). Workers here are
a plain subprocess (``main`` below, reading jobs on stdin; never a fork of
the caller, which may hold LLVM's or a framework's locks, nor
multiprocessing's spawn, which would run the caller's main script again)
and the forks it makes of itself once its imports are done (a worker's
imports take as long as a handful of kernels), each on pipes of its own,
each running the same ``program.compile_object`` or ``nvgpu.ptx`` as the
caller would, so the code is the same byte for byte. A thread per worker
in the caller hands it jobs from one queue. Where no worker starts, or one
dies, its jobs run on the caller's LLVM thread instead.

Scheduling jobs (``offer``) are queued even before a worker has started:
the caller takes back, in order, each one no worker has begun and
schedules it itself, so that no job waits for a worker's start.
"""
from __future__ import annotations

import atexit
import itertools
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Callable

OBJECT = "object"  # a job's kind: CPU object code (else the sm_XX of its PTX)
SCHEDULE = "schedule"  # a pickled fusion group scheduled (schedule.driver.schedule_job): bytes in, bytes out
_SIZE = struct.Struct("<Q")
_WORKER = "from polyjit.codegen.workers import main; main()"  # (not -m: the package imports this module)
_FORKS = "POLYJIT_WORKER_FORKS"  # the pipes of the workers the first forks: "r,w,r,w..."

OnThread = Callable[[str], Future]  # a job's text -> Future of (optimized IR, code, seconds) on the LLVM thread


def worker_count() -> int:
    """Workers to start: one per core the process may use, at most 4. Not
    one fewer for the caller's own Python: it waits for LLVM at the end of
    a compile, and the operating system shares the cores until then
    (bench/NOTES.md compares one and two workers on two cores)."""
    from ..options import usable_cores  # (options imports the targets, which import this)
    return min(4, usable_cores())


def _send(stream, *parts: bytes) -> None:
    for p in parts:
        stream.write(_SIZE.pack(len(p)) + p)
    stream.flush()


def _receive(stream, count: int) -> list[bytes] | None:
    out = []
    for _ in range(count):
        head = stream.read(_SIZE.size)
        if len(head) < _SIZE.size:
            return None
        (n,) = _SIZE.unpack(head)
        data = stream.read(n)
        if len(data) < n:
            return None
        out.append(data)
    return out


class LlvmWorkers:
    """Worker processes taking (kind, LLVM IR text) jobs; submit returns a
    Future of (optimized IR, code, seconds): object bytes for OBJECT, PTX
    text for an sm_XX. Until the first has started (its imports), jobs run
    on the caller's LLVM thread: a small program compiled first in a
    process waits for no worker. A code job goes ahead of the scheduling
    jobs queued before it: those come all at once at a compile's start, and
    the code of a group the caller scheduled itself (a network's weight
    preparation, one of its largest kernels) waited behind them, then ran
    alone on one worker at the end while the others had finished."""

    def __init__(self, count: int) -> None:
        self.jobs: queue.PriorityQueue = queue.PriorityQueue()  # (rank, order, job): code jobs first, then in order
        self._order = itertools.count()
        self.procs = []
        self.served = 0  # code jobs done by a worker
        self.scheduled = 0  # scheduling jobs done by a worker
        self.ready = threading.Event()  # a worker has started (until then jobs run on the caller's thread)
        self._lock = threading.Lock()  # a job is queued only while a worker is left to take it
        self.forked: list[_Forked] = []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # polyjit as the caller has it
        if count < 1:
            return
        pairs = [(os.pipe(), os.pipe()) for _ in range(count - 1)]  # the forked workers': (jobs, replies), each (r, w)
        theirs = [fd for jobs, replies in pairs for fd in (jobs[0], replies[1])]
        try:
            first = subprocess.Popen([sys.executable, "-c", _WORKER], env={**env, _FORKS: ",".join(map(str, theirs))},
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=theirs)
        except OSError:
            first = None
        for fd in theirs:
            os.close(fd)
        self.forked = [_Forked(os.fdopen(jobs[1], "wb"), os.fdopen(replies[0], "rb")) for jobs, replies in pairs]
        if first is None:
            for f in self.forked:
                f.stdin.close()
                f.stdout.close()
            return
        for proc in [first, *self.forked]:
            self.procs.append(proc)
            threading.Thread(target=self._serve, args=(proc,), daemon=True, name="polyjit-worker").start()

    def submit(self, kind: str, text: str, on_thread: OnThread) -> Future:
        """The job's Future; on_thread(text) makes the same on the caller's
        LLVM thread, where no worker takes it."""
        with self._lock:
            if self.procs and self.ready.is_set():
                future: Future = Future()
                self._put(kind, text, on_thread, future)
                return future
        return on_thread(text)

    def offer(self, kind: str, payload: bytes) -> Future | None:
        """A job the caller can do itself: queued for the workers (started or
        not), its Future's result (reply, seconds); the caller takes it back
        with ``future.cancel()`` while no worker has begun it. None where
        there are no workers; a Future of an exception where they died."""
        with self._lock:
            if not self.procs:
                return None
            future: Future = Future()
            self._put(kind, payload, _unserved, future)
            return future

    def _put(self, kind: str, text, on_thread, future: Future) -> None:
        self.jobs.put((kind == SCHEDULE, next(self._order), (kind, text, on_thread, future)))

    def _serve(self, proc) -> None:
        started = _receive(proc.stdout, 1)  # (its first reply says it has started; the first's, the forked pids)
        if started is None:
            self._gone(proc)
            return
        if not isinstance(proc, _Forked):
            for forked, pid in zip(self.forked, started[0].split()):
                forked.known(int(pid))
            self.ready.set()
        while True:
            kind, text, on_thread, future = self.jobs.get()[-1]
            if not future.set_running_or_notify_cancel():  # (taken back by the caller)
                continue
            start = time.perf_counter()
            try:
                _send(proc.stdin, kind.encode(), text if isinstance(text, bytes) else text.encode())
                reply = _receive(proc.stdout, 2)
                result = reply and _decoded(kind, reply)
            except Exception:  # (a closed pipe, a garbled reply: the worker is of no more use)
                result = None
            if result is None:  # the worker is gone: this job on the caller's thread
                self._gone(proc)
                _chain(on_thread(text), future)
                return
            with self._lock:
                if kind == SCHEDULE:
                    self.scheduled += 1
                else:
                    self.served += 1
            future.set_result((*result, time.perf_counter() - start))

    def _gone(self, proc) -> None:
        """proc no longer serves; where it was the last, the queued jobs go to the caller's thread."""
        with self._lock:
            self.procs.remove(proc)
            if self.procs:
                return
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                _, text, on_thread, future = self.jobs.get_nowait()[-1]
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                _chain(on_thread(text), future)

    def close(self) -> None:
        """Every worker's stdin closed first, so that they end together."""
        procs = list(self.procs)
        for proc in procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()


class _Forked:
    """A worker the first forked after its imports (main): its pipes, as a
    Popen's stdin and stdout; its pid once the first has said it (known).
    Not this process's child: once it has ended, the system reaps it and
    may give its pid to another process, so kill and wait go through a
    pidfd, which stays bound to the worker itself (Linux); through the
    bare pid only where the system has none."""

    def __init__(self, stdin, stdout) -> None:
        self.stdin, self.stdout, self.pid = stdin, stdout, None
        self._pidfd: int | None = None  # (closed with this object)
        self._ended = False  # (seen ended: its pid is no longer its own)

    def known(self, pid: int) -> None:
        """Its pid, said by the first: held by a pidfd at once."""
        self.pid = pid
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # (ended already: its pid may be another's by now)
            self._ended = True
            return
        except (AttributeError, OSError):  # (no pidfds here: the bare pid)
            return
        weakref.finalize(self, os.close, self._pidfd)

    def kill(self) -> None:
        """SIGKILL, where it has not ended (as Popen.kill)."""
        if self.pid is None or self._ended:
            return
        try:
            if self._pidfd is None:
                os.kill(self.pid, signal.SIGKILL)
            else:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        except ProcessLookupError:  # (ended meanwhile)
            pass

    def wait(self, timeout: float | None = None) -> None:
        """Until it has ended (the first has the system reap its children):
        its pidfd readable, or without one, its pid gone."""
        if self.pid is None or self._ended:
            return
        if self._pidfd is not None:
            poll = select.poll()
            poll.register(self._pidfd, select.POLLIN)
            if not poll.poll(None if timeout is None else max(0, int(timeout * 1000))):
                raise subprocess.TimeoutExpired("polyjit worker", timeout)
            self._ended = True
            return
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self._ended = True
                return
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired("polyjit worker", timeout)
            time.sleep(0.005)


def _decoded(kind: str, reply: list[bytes]) -> tuple:
    """A worker's reply as its kind's Future holds it (before the seconds):
    (pickled result,) for SCHEDULE, else (optimized IR, object bytes or PTX text)."""
    if kind == SCHEDULE:
        return (reply[0],)
    return reply[0].decode(), reply[1] if kind == OBJECT else reply[1].decode()


def _unserved(payload: bytes) -> Future:
    """An offered job's outcome where the last worker died: the caller does it."""
    future: Future = Future()
    future.set_exception(RuntimeError("no worker left"))
    return future


def _chain(source: Future, target: Future) -> None:
    source.add_done_callback(lambda f: target.set_exception(f.exception()) if f.exception()
                             else target.set_result(f.result()))


_workers: LlvmWorkers | None = None
_lock = threading.Lock()


def workers() -> LlvmWorkers:
    """The process's workers (started on first use)."""
    global _workers
    with _lock:
        if _workers is None:
            _workers = LlvmWorkers(worker_count())
            atexit.register(_workers.close)
        return _workers


def _forget() -> None:
    """A forked child has none of its parent's workers: start its own on demand."""
    global _workers, _lock
    _workers, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget)


def main() -> None:
    """The first worker: its imports, then a fork for each further worker
    (the pipes named in POLYJIT_WORKER_FORKS), which thus imports nothing;
    then each serves its own pipes. Forked before any thread or LLVM call
    of its own, so no lock is held in a child."""
    run = _job_functions()  # (before the forks)
    stdin = sys.stdin.buffer
    with os.fdopen(os.dup(1), "wb") as stdout:  # (closed when the jobs end)
        os.dup2(2, 1)  # anything else written to stdout goes to stderr, not into the replies
        fds = [int(fd) for fd in os.environ.pop(_FORKS, "").split(",") if fd]
        if fds:
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # (the system reaps the forked workers)
        pids = []
        for k in range(0, len(fds), 2):
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in [0, stdout.fileno(), *fds[k + 2:]]:  # (the first's pipes and the later workers')
                    os.close(fd)
                try:
                    with os.fdopen(fds[k], "rb") as jobs, os.fdopen(fds[k + 1], "wb") as replies:
                        _serve_jobs(jobs, replies, b"", run)
                finally:
                    os._exit(0)
            pids.append(pid)
            os.close(fds[k])
            os.close(fds[k + 1])
        _serve_jobs(stdin, stdout, " ".join(map(str, pids)).encode(), run)


def _job_functions() -> tuple[Callable, Callable, Callable]:
    """What a worker's jobs run: (schedule_job, compile_object, ptx), and
    every other import a job needs; the first worker's, before its forks,
    so that these import nothing."""
    from ..schedule.driver import schedule_job
    from ..targets import cpu  # noqa: F401  (a scheduling job's target)
    from .nvgpu import ptx
    from .program import compile_object
    return schedule_job, compile_object, ptx


def _serve_jobs(stdin, stdout, started: bytes, run: tuple[Callable, Callable, Callable]) -> None:
    """(kind, LLVM IR or a pickled group) in, (optimized IR, code) or (a
    pickled schedule, b"") out, until stdin closes; run: _job_functions()."""
    schedule_job, compile_object, ptx = run
    _send(stdout, started)
    while True:
        job = _receive(stdin, 2)
        if job is None:
            return
        kind = job[0].decode()
        if kind == SCHEDULE:
            _send(stdout, schedule_job(job[1]), b"")
            continue
        text = job[1].decode()
        if kind == OBJECT:
            optimized, obj = compile_object(text)
            _send(stdout, optimized.encode(), obj)
        else:
            optimized, ptx_text = ptx(text, kind)
            _send(stdout, optimized.encode(), ptx_text.encode())
