"""A launch plan as host code, compiled once with llvmlite, so that a caller
outside Python (an XLA custom call) runs a program's kernels with no
interpreter in between (the Python that did these launches was a large
part of a small training step's time: bench/NOTES.md).

The function built is

    int32_t launch(void **inputs, void **outputs, CUstream stream, char *message, size_t size)

It places the input and output pointers in the kernels' argument block
(the integer arguments are fixed in the code), then runs the steps in
order. Every address it uses (kernels, constants, the driver's and
libraries' functions and handles) is read from a table the module holds,
filled as it loads: the code depends on the plan's structure alone, so
that the compile cache keeps its machine code and a process that loads a
program from the cache compiles no launcher either. A GPU plan first checks that ``stream`` belongs to
its context (the kernels were loaded there) and makes that context current;
on the first failing driver or library call it writes what failed into
``message`` and returns the error code (CUDA's, or cuBLAS's or cuDNN's status). A CPU plan (stream NULL) runs its kernels with
IEEE subnormals and restores the caller's floating-point mode. 0 when all
went well.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from llvmlite import ir

from ..collector import collector_paused
from ..codegen.cpu import ieee_floats
from ..codegen.program import LoadedProgram, cached_host_object
from .threads import REGION_DATA, regions

I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
ZERO = ir.Constant(I32, 0)
PTR = I8.as_pointer()
KERNEL_FN = ir.FunctionType(ir.VoidType(), [PTR, PTR, I64, I64])  # a CPU kernel: (buffers, ints, part, parts)
LAUNCH_T = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)  # the launch function's type
CUDA_ERROR_INVALID_CONTEXT = 201
SYMBOLS = ("cuStreamGetCtx", "cuCtxGetCurrent", "cuCtxSetCurrent", "cuMemsetD8Async", "cuMemsetD32Async",
           "cuLaunchKernel", "snprintf", "sched_yield")  # the functions a GPU launcher calls, by address
CPU_SYMBOLS = ("GOMP_parallel", "polyjit_omp_region", "omp_get_thread_num", "omp_get_num_threads", "sched_yield",
               "snprintf", "aligned_alloc", "free")  # a CPU launcher's (the first five where kernels run on
# the team, threads.REGION_DATA; the last two where it holds a workspace of its own)
WORKSPACE_ALIGN = 64
ENTRY = "polyjit_launch"  # the launch function's name (a module of its own in an engine of its own)
TABLE = f"{ENTRY}.addresses"  # the addresses it reads (relocated)


@dataclass(frozen=True)
class Memset:
    """Fill ``count`` elements of ``width`` bytes (1 or 4) at argument slot
    ``slot``: cuMemsetD8/D32Async on the GPU, a loop on the CPU."""
    slot: int
    value: int
    count: int
    width: int
    what: str


@dataclass(frozen=True)
class Launch:
    """cuLaunchKernel of ``function`` (a CUfunction's address) on a 1-D grid,
    with the arguments at ``params`` (indices into the slots then the
    integers; None: all of them)."""
    function: int
    grid: int
    block: int
    what: str
    params: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Arg:
    """An argument of a library call: an integer (``i32``, ``i64``), a fixed
    address (``ptr``), an argument slot's pointer advanced by ``offset``
    bytes (``slot``, value the slot), or the launch stream (``stream``)."""
    kind: str
    value: int = 0
    offset: int = 0


@dataclass(frozen=True)
class Call:
    """A library function at address ``function`` returning a status (0: all went well)."""
    function: int
    args: tuple[Arg, ...]
    what: str


@dataclass(frozen=True)
class LibraryStep:
    """A library's calls (cuBLAS, cuDNN): the first usually sets its handle's
    stream, shared state, so the calls run holding the launcher's lock.
    ``kind`` names a failure's code ("cuBLAS status")."""
    calls: tuple[Call, ...]
    kind: str


@dataclass(frozen=True)
class Run:
    """A CPU kernel ``kernel(buffers, ints, part, parts)`` at address ``kernel``:
    whole (threads 1), or its parts on libgomp's team: a run of these is one
    parallel region (GOMP_parallel of threads.py's polyjit_omp_region)."""
    kernel: int
    threads: int
    what: str


@dataclass(frozen=True)
class LaunchPlan:
    """What a native launcher does: ``slots`` kernel arguments that are
    pointers (then ``ints``, fixed), of which ``inputs`` and ``outputs`` (by
    position in the call) are set per call and ``fixed`` maps the others'
    slots to their addresses."""
    slots: int
    inputs: Sequence[int]
    outputs: Sequence[int]
    fixed: Mapping[int, int]
    ints: Sequence[int]
    steps: Sequence[Memset | Launch | Run | LibraryStep]
    context: int | None  # the CUDA context of a GPU plan; None on the CPU
    workspace: Sequence[tuple[int, int]] = ()  # (slot, byte offset) of the temporaries in the launcher's own
    workspace_bytes: int = 0  # workspace (a CPU plan): made at its first call and kept (see _Builder._workspace)


class NativeLauncher:
    """A LaunchPlan compiled for the host; ``address`` is the launch function's.
    ``symbols``: the address of each function in SYMBOLS (CPU_SYMBOLS for a
    CPU plan, whose kernels run with IEEE subnormals whatever the calling
    thread's floating-point mode: XLA's threads flush them). ``results``: what the
    caller passes as outputs, as (name, shape, numpy dtype). ``owner`` stays
    alive with it (the program whose modules hold the kernels). With
    ``cached``, its machine code is looked for in the compile cache first,
    and kept there."""

    def __init__(self, name: str, plan: LaunchPlan, symbols: Mapping[str, int], results: Sequence[tuple] = (),
                 owner=None, cached: bool = False) -> None:
        self.name, self.plan, self.results, self.owner = name, plan, list(results), owner
        self.shape, self.symbols, addresses = relocated(plan, symbols)
        self.count = len(addresses)
        with collector_paused():  # (a compile's work, in a process of many objects: collector.py)
            structure = (self.count, self.shape, sorted(self.symbols.items())) if cached else None
            code, self.compiled = cached_host_object("launcher", structure,
                                                     lambda: str(_module(self.shape, self.symbols, self.count)))
            self.engine = LoadedProgram([code]).engine
        table = self.engine.get_global_value_address(TABLE)
        if addresses:
            (ctypes.c_uint64 * len(addresses)).from_address(table)[:] = addresses
        self.address = self.engine.get_function_address(ENTRY)

    @property
    def ir(self) -> str:
        """The module its machine code was made from (a debugging stage)."""
        return str(_module(self.shape, self.symbols, self.count))

    def global_address(self, what: str) -> int:
        """Where the module's global ``what`` ("lock", "workspace") is."""
        return self.engine.get_global_value_address(f"{ENTRY}.{what}")


def relocated(plan: LaunchPlan, symbols: Mapping[str, int]) -> tuple[LaunchPlan, dict[str, int], list[int]]:
    """plan and symbols with each address in them replaced by its index in
    a table, and the table: the launch function's structure apart from
    where things are in this process."""
    table: dict[int, int] = {}

    def at(address: int) -> int:
        return table.setdefault(address, len(table))

    def moved(step):
        if isinstance(step, Launch):
            return replace(step, function=at(step.function))
        if isinstance(step, Run):
            return replace(step, kernel=at(step.kernel))
        if isinstance(step, LibraryStep):
            return replace(step, calls=tuple(
                replace(c, function=at(c.function),
                        args=tuple(replace(a, value=at(a.value)) if a.kind == "ptr" else a for a in c.args))
                for c in step.calls))
        return step
    where = {n: at(symbols[n]) for n in sorted(symbols)}
    shape = replace(plan, inputs=tuple(plan.inputs), outputs=tuple(plan.outputs),
                    fixed={k: at(v) for k, v in sorted(plan.fixed.items())}, ints=tuple(plan.ints),
                    steps=tuple(moved(s) for s in plan.steps),
                    context=None if plan.context is None else at(plan.context), workspace=tuple(plan.workspace))
    return shape, where, list(table)


def _module(plan: LaunchPlan, symbols: Mapping[str, int], count: int) -> ir.Module:
    """The launch function of a relocated plan and symbols (relocated), its table of count addresses."""
    return _Builder(plan, symbols, count).build()


class _Builder:
    """The launch function's IR: a prologue placing the pointers and integers
    in the argument block, one emitter per step kind, a shared failure exit.
    Its plan and symbols are relocated: where they hold an address, it is
    the address's index in the table (TABLE)."""

    def __init__(self, plan: LaunchPlan, symbols: Mapping[str, int], count: int) -> None:
        self.plan, self.symbols = plan, symbols
        self.mod = ir.Module(name=ENTRY)
        self.fn = ir.Function(self.mod, ir.FunctionType(I32, [PTR.as_pointer(), PTR.as_pointer(), PTR, PTR, I64]),
                              ENTRY)
        self.b = ir.IRBuilder(self.fn.append_basic_block("entry"))
        self.strings: dict[str, ir.GlobalVariable] = {}
        self.lock: ir.GlobalVariable | None = None
        self.cleanup: list = []  # what the failure exit undoes (emitters, called there with the builder)
        self.table = ir.GlobalVariable(self.mod, ir.ArrayType(I64, max(count, 1)), TABLE)
        self.table.initializer = ir.Constant(self.table.type.pointee, None)

    def build(self) -> ir.Module:
        b, plan = self.b, self.plan
        ins, outs, self.stream, message, size = self.fn.args
        self._failure_exit(message, size)
        cpu = plan.context is None
        restore = ieee_floats(b) if cpu else None
        if not cpu:
            self._enter_context()
        self.pointers = b.alloca(ir.ArrayType(PTR, max(plan.slots, 1)))
        if plan.workspace:
            self._workspace()
        self.ints = b.alloca(ir.ArrayType(I64, max(len(plan.ints), 1)))
        for given, slots in ((ins, plan.inputs), (outs, plan.outputs)):
            for k, s in enumerate(slots):
                b.store(b.load(b.gep(given, [ir.Constant(I32, k)])), self.slot(s))
        for s, address in plan.fixed.items():
            b.store(self.address(address), self.slot(s))
        for k, value in enumerate(plan.ints):
            b.store(ir.Constant(I64, value), b.gep(self.ints, [ZERO, ir.Constant(I32, k)]))
        if cpu:
            self._kernel_arguments()
        else:
            self.places = [self.slot(k) for k in range(plan.slots)] + [
                b.gep(self.ints, [ZERO, ir.Constant(I32, k)]) for k in range(len(plan.ints))]
            self.argvs = {}
        for group in regions(plan.steps, _team):
            step = group[0]
            if _team(step) is not None:
                self._region(group)
            elif isinstance(step, Run):
                self._run(step)
            elif isinstance(step, LibraryStep):
                self._library(step)
            elif cpu:  # a Memset
                _fill(b, b.load(self.slot(step.slot)), step)
            elif isinstance(step, Memset):
                self._memset(step)
            else:
                self._launch(step)
        if plan.workspace:
            self._workspace_done()
        if restore is not None:
            restore()
        b.ret(ir.Constant(I32, 0))
        b.position_at_end(self.fail_tail)
        for undo in self.cleanup:
            undo()
        b.ret(self.code)
        return self.mod

    # -------------------------------------------------------------- helpers
    def string(self, text: str) -> ir.Value:
        if text not in self.strings:
            self.strings[text] = string_constant(self.mod, f"{ENTRY}.s{len(self.strings)}", text)
        return self.strings[text].bitcast(PTR)

    def address(self, index: int, type_: ir.Type = PTR) -> ir.Value:
        """The table's address at index, as a pointer of type_."""
        b = self.b
        return b.inttoptr(b.load(b.gep(self.table, [ZERO, ir.Constant(I32, index)])), type_)

    def function(self, call: str, *types: ir.Type, result: ir.Type = I32) -> ir.Value:
        return self.address(self.symbols[call], ir.FunctionType(result, types).as_pointer())

    def slot(self, k: int) -> ir.Value:
        return self.b.gep(self.pointers, [ZERO, ir.Constant(I32, k)])

    def _failure_exit(self, message: ir.Value, size: ir.Value) -> None:
        """message <- "<what> failed: <kind> <code>"; return code."""
        b = self.b
        self.fail = self.fn.append_basic_block("fail")
        entry = b.block
        b.position_at_end(self.fail)
        self.what, self.kind, self.code = b.phi(PTR, "what"), b.phi(PTR, "kind"), b.phi(I32, "code")
        printf = self.address(self.symbols["snprintf"], ir.FunctionType(I32, [PTR, I64, PTR], var_arg=True).as_pointer())
        b.call(printf, [message, size, self.string("%s failed: %s %d"), self.what, self.kind, self.code])
        self.fail_tail = self.fn.append_basic_block("fail_tail")  # (build ends it: self.cleanup, then return)
        b.branch(self.fail_tail)
        b.position_at_end(entry)

    def checked(self, result: ir.Value, text: str, kind: str = "CUDA error", unlock: bool = False) -> None:
        """Go on where result is 0, else to the failure exit (releasing the lock first)."""
        b = self.b
        ok = self.fn.append_basic_block()
        exit_from = self.fn.append_basic_block() if unlock else b.block
        b.cbranch(b.icmp_unsigned("==", result, ir.Constant(I32, 0)), ok, exit_from if unlock else self.fail)
        if unlock:
            b.position_at_end(exit_from)
            self._release()
            b.branch(self.fail)
        for phi, value in ((self.what, self.string(text)), (self.kind, self.string(kind)), (self.code, result)):
            phi.add_incoming(value, exit_from)
        b.position_at_end(ok)

    def _enter_context(self) -> None:
        """The stream's context must be the plan's; make it current."""
        b = self.b
        ctx = b.alloca(PTR)
        self.checked(b.call(self.function("cuStreamGetCtx", PTR, PTR.as_pointer()), [self.stream, ctx]),
                     "cuStreamGetCtx")
        mine = self.address(self.plan.context)
        other = b.icmp_unsigned("!=", b.load(ctx), mine)
        result = b.select(other, ir.Constant(I32, CUDA_ERROR_INVALID_CONTEXT), ir.Constant(I32, 0))
        self.checked(result, "matching the stream's context to the one the kernels were loaded in")
        self.checked(b.call(self.function("cuCtxGetCurrent", PTR.as_pointer()), [ctx]), "cuCtxGetCurrent")
        with b.if_then(b.icmp_unsigned("!=", b.load(ctx), mine)):
            self.checked(b.call(self.function("cuCtxSetCurrent", PTR), [mine]), "cuCtxSetCurrent")

    # ---------------------------------------------------------------- steps
    def _memset(self, step: Memset) -> None:
        b = self.b
        width = I8 if step.width == 1 else I32
        call = self.function("cuMemsetD8Async" if step.width == 1 else "cuMemsetD32Async", I64, width, I64, PTR)
        target = b.ptrtoint(b.load(self.slot(step.slot)), I64)
        self.checked(b.call(call, [target, ir.Constant(width, step.value), ir.Constant(I64, step.count),
                                   self.stream]), step.what)

    def _argument_block(self, params: tuple[int, ...] | None) -> ir.Value:
        """The addresses of the arguments at params (None: all), built once per list."""
        if params not in self.argvs:
            b = self.b
            chosen = self.places if params is None else [self.places[p] for p in params]
            block = b.alloca(ir.ArrayType(PTR, max(len(chosen), 1)))
            for k, place in enumerate(chosen):
                b.store(b.bitcast(place, PTR), b.gep(block, [ZERO, ir.Constant(I32, k)]))
            self.argvs[params] = b.bitcast(block, PTR.as_pointer())
        return self.argvs[params]

    def _launch(self, step: Launch) -> None:
        b = self.b
        call = self.function("cuLaunchKernel", PTR, I32, I32, I32, I32, I32, I32, I32, PTR, PTR.as_pointer(),
                             PTR.as_pointer())
        dims = [ir.Constant(I32, x) for x in (step.grid, 1, 1, step.block, 1, 1, 0)]
        argv = self._argument_block(step.params)
        self.checked(b.call(call, [self.address(step.function), *dims, self.stream, argv,
                                   ir.Constant(PTR.as_pointer(), None)]), step.what)

    def _kernel_arguments(self) -> None:
        """What every CPU kernel call shares, made once: the argument block's
        two halves as pointers and, where kernels run on the team, the
        region's data (threads.REGION_DATA; each region stores its kernels,
        their count and a zero state)."""
        b, steps = self.b, self.plan.steps
        self.buffers, self.numbers = b.bitcast(self.pointers, PTR), b.bitcast(self.ints, PTR)
        if not any(isinstance(s, Run) and s.threads > 1 for s in steps):
            return
        data = b.alloca(ir.ArrayType(PTR, len(REGION_DATA)))
        self.region_state = b.alloca(ir.ArrayType(I64, 2))
        shared = {"buffers": self.buffers, "ints": self.numbers, "state": b.bitcast(self.region_state, PTR),
                  **{n: self.address(self.symbols[n]) for n in ("omp_get_thread_num", "omp_get_num_threads",
                                                              "sched_yield")}}
        self.region_field = {n: b.gep(data, [ZERO, ir.Constant(I32, k)]) for k, n in enumerate(REGION_DATA)}
        for n, v in shared.items():
            b.store(v, self.region_field[n])
        self.team_data = b.bitcast(data, PTR)
        self.parallel = self.function("GOMP_parallel", PTR, PTR, I32, I32, result=ir.VoidType())
        self.trampoline = self.address(self.symbols["polyjit_omp_region"])

    def _run(self, step: Run) -> None:
        """A CPU kernel run whole."""
        kernel = self.address(step.kernel, KERNEL_FN.as_pointer())
        self.b.call(kernel, [self.buffers, self.numbers, ir.Constant(I64, 0), ir.Constant(I64, 1)])

    def _region(self, runs: list[Run]) -> None:
        """Kernels on libgomp's team, one parallel region (GOMP_parallel
        returns once the team is done with them)."""
        b = self.b
        kernels = b.alloca(ir.ArrayType(PTR, len(runs)))
        for k, step in enumerate(runs):
            b.store(self.address(step.kernel), b.gep(kernels, [ZERO, ir.Constant(I32, k)]))
        b.store(b.bitcast(kernels, PTR), self.region_field["kernels"])
        b.store(ir.Constant(I64, len(runs)).inttoptr(PTR), self.region_field["count"])
        b.store(ir.Constant(self.region_state.type.pointee, None), self.region_state)
        b.call(self.parallel, [self.trampoline, self.team_data, ir.Constant(I32, runs[0].threads), ZERO])

    def _library(self, step: LibraryStep) -> None:
        """The calls in order, holding the launcher's lock (a handle's stream
        must not change between setting it and the calls): one
        compare-and-swap when free; a waiter yields its core (sched_yield)
        until the holder releases it."""
        b = self.b
        self._acquire()
        for call in step.calls:
            values = [self._arg(a) for a in call.args]
            fn = self.address(call.function, ir.FunctionType(I32, [v.type for v in values]).as_pointer())
            self.checked(b.call(fn, values), call.what, step.kind, unlock=True)
        self._release()

    def _arg(self, a: Arg) -> ir.Value:
        b = self.b
        if a.kind == "i32":
            return ir.Constant(I32, a.value)
        if a.kind == "i64":
            return ir.Constant(I64, a.value)
        if a.kind == "ptr":
            return self.address(a.value)
        if a.kind == "stream":
            return self.stream
        return b.gep(b.load(self.slot(a.value)), [ir.Constant(I64, a.offset)])

    def _workspace(self) -> None:
        """The temporaries' pointers into a workspace the launcher keeps:
        XLA's allocator gave them as results of the call, fresh memory each
        time, whose every page faulted in again (a CNN's training step spent
        as long in page faults as in its kernels). The workspace is made at
        the first call and kept; a call that finds it in use (another thread
        running the same program) makes one of its own and frees it after."""
        b, plan = self.b, self.plan
        size = ir.Constant(I64, -(-plan.workspace_bytes // WORKSPACE_ALIGN) * WORKSPACE_ALIGN)
        kept = ir.GlobalVariable(self.mod, PTR, f"{ENTRY}.workspace")
        busy = ir.GlobalVariable(self.mod, I32, f"{ENTRY}.workspace_busy")
        kept.linkage, kept.initializer = "internal", ir.Constant(PTR, None)
        busy.linkage, busy.initializer = "internal", ir.Constant(I32, 0)
        alloc = self.function("aligned_alloc", I64, I64, result=PTR)
        held = b.alloca(ir.IntType(1))  # (read by the failure exit: whether to give the kept one back)
        base = b.alloca(PTR)
        b.store(ir.Constant(ir.IntType(1), 0), held)
        b.store(ir.Constant(PTR, None), base)
        got = b.extract_value(b.cmpxchg(busy, ir.Constant(I32, 0), ir.Constant(I32, 1), "acquire", "monotonic"), 1)
        b.store(got, held)
        with b.if_else(got) as (mine, other):
            with mine:
                with b.if_then(b.icmp_unsigned("==", b.load(kept), ir.Constant(PTR, None))):
                    b.store(b.call(alloc, [ir.Constant(I64, WORKSPACE_ALIGN), size]), kept)
                b.store(b.load(kept), base)
            with other:
                b.store(b.call(alloc, [ir.Constant(I64, WORKSPACE_ALIGN), size]), base)
        self.workspace_state = (held, base, busy)
        self.cleanup.append(self._workspace_done)
        address = b.load(base)
        ok = b.icmp_unsigned("!=", address, ir.Constant(PTR, None))
        self.checked(b.select(ok, ir.Constant(I32, 0), ir.Constant(I32, 12)),  # (ENOMEM)
                     f"allocating a {plan.workspace_bytes}-byte workspace", "error")
        for slot, offset in plan.workspace:
            b.store(b.gep(address, [ir.Constant(I64, offset)]), self.slot(slot))

    def _workspace_done(self) -> None:
        """Give the kept workspace back, or free the call's own."""
        b = self.b
        held, base, busy = self.workspace_state
        with b.if_else(b.load(held)) as (mine, other):
            with mine:
                b.store_atomic(ir.Constant(I32, 0), busy, "release", 4)
            with other:
                address = b.load(base)
                with b.if_then(b.icmp_unsigned("!=", address, ir.Constant(PTR, None))):
                    b.call(self.function("free", PTR, result=ir.VoidType()), [address])

    def _acquire(self) -> None:
        b = self.b
        if self.lock is None:
            self.lock = ir.GlobalVariable(self.mod, I32, f"{ENTRY}.lock")
            self.lock.linkage, self.lock.initializer = "internal", ir.Constant(I32, 0)
        spin = self.fn.append_basic_block("spin")
        wait = self.fn.append_basic_block("wait")
        held = self.fn.append_basic_block("held")
        b.branch(spin)
        b.position_at_end(spin)
        pair = b.cmpxchg(self.lock, ir.Constant(I32, 0), ir.Constant(I32, 1), "acquire", "monotonic")
        b.cbranch(b.extract_value(pair, 1), held, wait)
        b.position_at_end(wait)  # taken: give the holder the core (more callers than cores), try again once free
        b.call(self.function("sched_yield"), [])
        free = b.icmp_unsigned("==", b.load_atomic(self.lock, "monotonic", 4), ir.Constant(I32, 0))
        b.cbranch(free, spin, wait)
        b.position_at_end(held)

    def _release(self) -> None:
        self.b.store_atomic(ir.Constant(I32, 0), self.lock, "release", 4)


def _team(step) -> int | None:
    """The threads a step's region has (threads.regions), None where it runs alone."""
    return step.threads if isinstance(step, Run) and step.threads > 1 else None


def _fill(b: ir.IRBuilder, base: ir.Value, step: Memset) -> None:
    """A loop storing step.value into step.count elements at base (a CPU memset)."""
    width = I8 if step.width == 1 else I32
    start, loop, done = b.block, b.append_basic_block("fill"), b.append_basic_block("filled")
    b.cbranch(b.icmp_unsigned("!=", ir.Constant(I64, step.count), ir.Constant(I64, 0)), loop, done)
    b.position_at_end(loop)
    i = b.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), start)
    b.store(ir.Constant(width, step.value), b.gep(b.bitcast(base, width.as_pointer()), [i]))
    nxt = b.add(i, ir.Constant(I64, 1))
    i.add_incoming(nxt, b.block)
    b.cbranch(b.icmp_unsigned("<", nxt, ir.Constant(I64, step.count)), loop, done)
    b.position_at_end(done)


def string_constant(mod: ir.Module, name: str, text: str) -> ir.GlobalVariable:
    """A private NUL-terminated string in mod."""
    data = bytearray(text.encode() + b"\0")
    g = ir.GlobalVariable(mod, ir.ArrayType(I8, len(data)), name)
    g.global_constant, g.linkage, g.initializer = True, "private", ir.Constant(g.type.pointee, data)
    return g
