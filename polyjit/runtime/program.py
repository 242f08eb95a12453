"""Running compiled kernels on the caller's arrays.

A :class:`CompiledProgram` checks every argument before any kernel runs, binds
the size parameters from the argument shapes, allocates outputs and the
temporaries that were not contracted, and calls each kernel; the parallel
loop of a kernel is split across the thread team (runtime.threads; ctypes
releases the GIL).
"""
from __future__ import annotations

import ctypes
import itertools
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .. import sizes as sz
from ..affine import Array
from ..codegen.llvm import KernelInfo
from ..errors import InputError
from ..sizes import Lin
from . import launch
from .buffers import POISON, new_buffer, poison, poison_fill, workspace_layout
from .threads import OmpTeam, regions, thread_team

PARALLEL_MIN_ELEMENTS = 1 << 15
_launchers = itertools.count(1)  # native launchers' names are unique
NATIVE_MIN_KERNELS = 8  # programs of this many kernels run a plan's calls from host code
PROFILE = os.environ.get("POLYJIT_PROFILE", "") not in ("", "0")  # kernel seconds in stats


class RowMajor:
    """What planning reads of a row-major argument: its shape and dtype."""

    def __init__(self, shape, dtype) -> None:
        self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)
        self.itemsize, self.size = self.dtype.itemsize, math.prod(self.shape)
        self.strides = tuple(s * self.itemsize for s in sz.row_major(self.shape))
        self.flags = {"C_CONTIGUOUS": True}


@dataclass
class CompiledProgram:
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
    lifetimes: dict = field(default_factory=dict)  # temporary -> (first, last) kernel touching it: shared memory
    cached: bool = True  # machine code made at its calls (launchers, a GPU's linked cubins) goes to the compile
    # cache too (its "cache" option)
    _plans: dict = field(default_factory=dict, repr=False)  # call (or launch) plans by shape signature

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
                if isinstance(s, Lin) and len(s.terms) == 1 and s.const == 0 and s.terms[0][1] == 1 \
                        and not sz.is_derived(s.terms[0][0]):
                    p = s.terms[0][0]
                    if p in env and env[p] != n:
                        raise InputError(f"{self.name}: input {k} dimension {d} is {n}, but another input "
                                         f"fixes that size to {env[p]}")
                    env[p] = n
                elif sz.is_static(s) and s != n:
                    raise InputError(f"{self.name}: input {k} has shape {list(a.shape)}, expected size {s} "
                                     f"in dimension {d} (shape {list(spec.shape)})")
        for a, spec in zip(args, self.inputs):  # a size no dimension is alone: c * p + k (a slice's gradient, p - 1)
            for n, s in zip(a.shape, spec.shape):
                if isinstance(s, Lin) and len(s.terms) == 1 and s.terms[0][0] not in env \
                        and not sz.is_derived(s.terms[0][0]):  # (a product or quotient is computed from its terms)
                    p, c = s.terms[0]
                    if c and (n - s.const) % c == 0:
                        env[p] = (n - s.const) // c
        sz.with_derived(env, self.params)
        for k, (a, spec) in enumerate(zip(args, self.inputs)):
            for d, (n, s) in enumerate(zip(a.shape, spec.shape)):
                if not isinstance(s, Lin):
                    continue
                try:
                    want = sz.evaluate(s, env)
                except KeyError:  # (c * p + k with n - k not a multiple of c)
                    raise InputError(f"{self.name}: input {k} dimension {d} is {n}, which no size fits as {s}")
                if want != n:
                    raise InputError(f"{self.name}: input {k} dimension {d} is {n}, expected {s} = {want}")
        for a, b in self.constraints:
            try:
                va, vb = sz.evaluate(a, env), sz.evaluate(b, env)
            except KeyError:
                continue
            if va != vb:
                raise InputError(f"{self.name}: sizes {a} = {va} and {b} = {vb} must be equal")
        return env

    PLANS = 64  # call plans kept per program (one per shape signature)

    def __call__(self, *args: np.ndarray) -> list[np.ndarray]:
        try:
            key = tuple((a.shape, a.strides, a.dtype) for a in args)
        except AttributeError:
            key = None
        plan = self._plan(args, key) if key not in self._plans else self._plans[key]
        keep = [np.ascontiguousarray(args[k]) for k in plan.copied]
        inputs = [a.__array_interface__["data"][0] for a in args]
        for k, a in zip(plan.copied, keep):
            inputs[k] = a.__array_interface__["data"][0]
        made = {name: new_buffer(shape, dt) for name, _, shape, dt in plan.fresh}
        self._run(plan, inputs, {n: a.__array_interface__["data"][0] for n, a in made.items()})
        return self._hand_out(made, plan.returned)

    def bound_plan(self, args: Sequence[np.ndarray]) -> "_CallPlan | None":
        """The plan an earlier call made for arrays of these layouts, which
        a frontend may call again through run_bound (its inputs read in
        place); None otherwise."""
        plan = self._plans.get(tuple((a.shape, a.strides, a.dtype) for a in args))
        return plan if plan is not None and not plan.copied else None

    def run_bound(self, plan: "_CallPlan", inputs: Sequence[int], empty: Callable[[tuple, np.dtype], tuple]) -> list:
        """A call through plan (bound_plan) on inputs at these addresses,
        skipping the checks and the plan's lookup: a frontend's repeated call
        whose arguments it has compared with those the plan is for. Its
        outputs come from ``empty(shape, dtype)``, as (array, address): the
        frontend's own arrays, where converting ours cost more than the
        kernels of a small graph."""
        made = {name: empty(shape, dt) for name, _, shape, dt in plan.fresh}
        if POISON:
            for name, _, shape, dt in plan.fresh:  # (the frontend's arrays, as numpy's)
                size = math.prod(shape) * dt.itemsize
                if size:
                    poison(np.frombuffer((ctypes.c_char * size).from_address(made[name][1]), dt))
        self._run(plan, list(inputs), {n: address for n, (_, address) in made.items()})
        return self._hand_out({n: a for n, (a, _) in made.items()}, plan.returned)

    def _run(self, plan: "_CallPlan", inputs: list[int], made: dict[str, int]) -> None:
        """plan's kernels on inputs and outputs at these addresses (made: by array name)."""
        work = new_buffer((plan.workspace,), np.dtype(np.uint8)) if plan.workspace else None
        base = work.__array_interface__["data"][0] if work is not None else 0
        if POISON:
            for _, offset, shape, dt in plan.temps:
                poison(work[offset:offset + math.prod(shape) * dt.itemsize].view(dt))
        if plan.native is None and plan.calls >= plan.launch_after:
            plan.native = self._native_call(plan)
        plan.calls += 1
        if plan.native:
            results = [made[n] for n in dict.fromkeys(self.output_arrays)]
            results += [base + offset for _, offset, _, _ in plan.temps]
            self._run_native(plan.native, inputs, results)
        else:
            pointers = list(plan.pointers)
            for slot, p in zip(plan.input_slots, inputs):
                pointers[slot] = p
            for name, slot, _, _ in plan.fresh:
                pointers[slot] = made[name]
            for slot, offset, _, _ in plan.temps:
                pointers[slot] = base + offset
            self._run_kernels(plan, plan.pointer_type(*pointers))
        self.stats["intermediate_bytes"] = plan.intermediate_bytes
        self.stats["workspace_bytes"] = plan.workspace

    def _run_kernels(self, plan: "_CallPlan", ptrs) -> None:
        """Each kernel called from Python, a run of parallel ones in one
        region of the thread team; with POLYJIT_PROFILE, each kernel on its
        own and its seconds summed in stats."""
        team = thread_team() if plan.threads > 1 else None
        joined = team is not None and not PROFILE
        for group in regions(self.kernels, lambda k: True if joined and k.parallel else None):
            t0 = time.perf_counter() if PROFILE else 0.0
            if group[0].parallel and team is not None:
                team.run([k.fn for k in group], ptrs, plan.ints, plan.threads)
            else:
                group[0].fn(ptrs, plan.ints, 0, 1)
            if PROFILE:
                spent = self.stats.setdefault("kernel_seconds", {})
                spent[group[0].name] = spent.get(group[0].name, 0.0) + time.perf_counter() - t0

    def _native_call(self, plan: "_CallPlan"):
        """The plan's kernels as one host-code call (runtime.launch), which
        saves a model of a hundred kernels the Python and ctypes work around
        each; False where that does not pay or cannot be built (few kernels,
        POLYJIT_PROFILE timing each kernel, a Python thread pool). The
        program's first plan builds it at once: its call compiled the
        program, and a second call that builds it would be a second, smaller
        compile. A later signature's plan (symbolic sizes at new values)
        builds it at its second call: one seen once is not worth it."""
        if PROFILE or len(self.kernels) < NATIVE_MIN_KERNELS:
            return False
        launcher = self._launcher(plan, f"{self.name}_call{next(_launchers)}")
        return False if launcher is None else (launcher, launch.LAUNCH_T(launcher.address))

    def _run_native(self, native, inputs: list[int], results: list[int]) -> None:
        launcher, run = native
        message = ctypes.create_string_buffer(256)
        code = run((ctypes.c_void_p * max(len(inputs), 1))(*inputs),
                   (ctypes.c_void_p * max(len(results), 1))(*results), None, message, len(message))
        if code:
            raise RuntimeError(f"{self.name}: {message.value.decode(errors='replace')}")

    def native_launcher(self, args: Sequence, name: str) -> "launch.NativeLauncher | None":
        """This program's kernel calls for row-major arguments like ``args``
        (their shapes and dtypes) as host code named ``name`` (see
        _native_launcher), for callers outside Python (XLA's custom calls).
        None where parallel kernels would run on a Python thread pool."""
        like = [RowMajor(a.shape, a.dtype) for a in args]
        key = tuple((a.shape, a.strides, a.dtype) for a in like)
        plan = self._plans.get(key) or self._plan(like, key)
        self.stats["intermediate_bytes"] = plan.intermediate_bytes
        return self._shown(self._launcher(plan, name, own_workspace=True))

    def _launcher(self, plan: "_CallPlan", name: str, own_workspace: bool = False) -> "launch.NativeLauncher | None":
        """A plan's kernel calls as host code: its results are the outputs
        (each once), then the temporaries (which a caller may place in one
        workspace at the plan's offsets), unless ``own_workspace``: then the
        launcher places them in a workspace it keeps (LaunchPlan.workspace)."""
        team = thread_team() if plan.threads > 1 else None
        if team is not None and not isinstance(team, OmpTeam):
            return None
        steps = [launch.Run(ctypes.cast(k.fn, ctypes.c_void_p).value,
                            plan.threads if k.parallel and team is not None else 1, f"running {k.name}")
                 for k in self.kernels]
        libc = ctypes.CDLL(None)
        symbols = {f: ctypes.cast(getattr(libc, f), ctypes.c_void_p).value
                   for f in ("snprintf", "aligned_alloc", "free")}
        if team is not None:
            symbols.update(team.symbols())
        fresh = {n: (slot, shape, dt) for n, slot, shape, dt in plan.fresh}
        temps = dict(zip(plan.temp_names, plan.temps))  # name -> (slot, byte offset, shape, dtype)
        if not own_workspace:
            fresh.update({n: (slot, shape, dt) for n, (slot, _, shape, dt) in temps.items()})
        return self._native_launcher(name, fresh, plan.input_slots, plan.pointers,
                                     plan.ints[:len(self.int_slots)], steps, None, symbols,
                                     plan.returned, temps if own_workspace else {}, plan.workspace)

    def returned_shapes(self, env: dict) -> dict[str, tuple]:
        """The outputs handed out in another shape than their array's (views
        of it: a reshaped library product), at these sizes."""
        return {a.name: tuple(sz.evaluate(s, env) for s in a.returned_as)
                for a in self.outputs if a.returned_as is not None}

    def _hand_out(self, made: dict, returned: dict) -> list:
        """The outputs as the caller gets them: made[name], reshaped where returned says."""
        return [made[n] if n not in returned else made[n].reshape(returned[n]) for n in self.output_arrays]

    def _native_launcher(self, name: str, fresh: dict, input_slots, pointers, ints, steps: list,
                         context: int | None, symbols: dict, returned: dict, kept: dict | None = None,
                         workspace_bytes: int = 0) -> "launch.NativeLauncher | None":
        """A plan's launcher (runtime.launch): its call takes the inputs'
        pointers and one for each of its ``results``, the outputs, then the
        temporaries (``fresh``: name -> (argument slot, shape, dtype)), which
        it poisons first where POLYJIT_POISON asks, then runs ``steps``.
        An array returned twice (a training graph's activation, saved and
        passed on) is one result. ``kept``: temporaries (name -> slot, byte
        offset, shape, dtype) placed in a workspace of ``workspace_bytes``
        that the launcher keeps, not passed. None where an output is not a buffer of
        its own (an input, a constant)."""
        outs = list(dict.fromkeys(self.output_arrays))
        if any(n not in fresh for n in outs):
            return None
        kept = kept or {}
        names = outs + [n for n in fresh if n not in outs]
        placed = {**{n: fresh[n] for n in names}, **{n: (slot, shape, dt) for n, (slot, _, shape, dt) in kept.items()}}
        poisons = [launch.Memset(slot, *poison_fill(math.prod(shape) * dt.itemsize, dt.kind), f"poisoning {n}")
                   for n, (slot, shape, dt) in placed.items() if POISON and shape]
        given = set(input_slots) | {slot for slot, _, _ in placed.values()}
        fixed = {k: p or 0 for k, p in enumerate(pointers) if k not in given}
        plan = launch.LaunchPlan(len(self.buffers), input_slots, [fresh[n][0] for n in names], fixed,
                                 list(ints), poisons + steps, context,
                                 [(slot, offset) for slot, offset, _, _ in kept.values()],
                                 workspace_bytes if kept else 0)
        launcher = launch.NativeLauncher(name, plan, symbols, [(n, returned.get(n, fresh[n][1]), fresh[n][2])
                                                               for n in names], self, self.cached)
        self.stats["launchers_compiled"] = self.stats.get("launchers_compiled", 0) + launcher.compiled
        return launcher

    def _shown(self, launcher: "launch.NativeLauncher | None") -> "launch.NativeLauncher | None":
        """An XLA custom call's launcher, its IR kept as a stage (exe.ir, debugging)."""
        if launcher is not None:
            self.ir[f"launcher {launcher.name}"] = launcher.ir
        return launcher

    def _plan(self, args: Sequence[np.ndarray], key) -> "_CallPlan":
        """What a call with these shapes, strides and dtypes needs, worked out
        once: sizes, integer arguments, allocations, the thread count.
        Raises InputError before anything runs."""
        env = self.bind(args)
        slot = {b.name: i for i, b in enumerate(self.buffers)}
        strides: dict[str, tuple] = {}
        copied = []
        for k, (spec, a) in enumerate(zip(self.inputs, args)):
            if not spec.strided and not a.flags["C_CONTIGUOUS"]:
                copied.append(k)
            strides[spec.name] = tuple(s // a.itemsize for s in a.strides)
        pointers: list = [None] * len(self.buffers)
        fresh, temps = [], {}
        temp_bytes, work = 0, sum(a.size for a in args)
        for spec in self.buffers:
            if spec.kind in ("output", "temp"):
                shape = tuple(sz.evaluate(s, env) for s in spec.shape)
                made = (spec.name, slot[spec.name], shape, np.dtype(spec.dtype.numpy))
                if spec.kind == "temp":
                    temps[spec.name] = made
                    temp_bytes += math.prod(shape) * spec.dtype.itemsize
                else:
                    fresh.append(made)
                work += math.prod(shape)
            elif spec.kind == "const":
                c = self.constants[spec.index]
                pointers[slot[spec.name]] = c.ctypes.data
                work += c.size
        ints = [env[name] if d < 0 else strides[name][d] for name, d in self.int_slots]
        offsets, workspace = workspace_layout({n: math.prod(t[2]) * t[3].itemsize for n, t in temps.items()},
                                              {} if POISON else self.lifetimes)  # poison: each its own bytes
        plan = _CallPlan(
            input_slots=[slot[spec.name] for spec in self.inputs], copied=copied, fresh=fresh,
            temps=[(t[1], offsets[n], t[2], t[3]) for n, t in temps.items()], temp_names=list(temps),
            workspace=workspace, pointers=pointers,
            pointer_type=ctypes.c_void_p * max(len(self.buffers), 1),
            ints=(ctypes.c_int64 * max(len(ints), 1))(*ints),
            threads=self.num_threads if work >= PARALLEL_MIN_ELEMENTS else 1,
            intermediate_bytes=temp_bytes + (self.contracted_bytes(env) if self.contracted_bytes else 0),
            returned=self.returned_shapes(env), launch_after=1 if self._plans or key is None else 0)
        if key is not None:
            self._remember(key, plan)
        return plan

    def _remember(self, key, plan) -> None:
        """Keep a plan for its signature; past PLANS signatures, start over."""
        if len(self._plans) >= self.PLANS:
            self._plans.clear()
        self._plans[key] = plan


@dataclass
class _CallPlan:
    input_slots: list[int]  # the buffer slot of each input
    copied: list[int]  # inputs passed with strides a row-major program cannot read: copied first
    fresh: list  # (array, slot, shape, dtype) of the outputs to allocate
    temps: list  # (slot, byte offset in the workspace, shape, dtype) of each temporary
    temp_names: list  # their arrays
    workspace: int  # bytes, allocated at each call (reused: buffers.BufferCache)
    pointers: list  # buffer pointers, constants filled in
    pointer_type: Any
    ints: Any  # sizes and strides, fixed for the plan
    threads: int
    intermediate_bytes: int
    returned: dict  # outputs handed out reshaped: name -> shape
    native: Any = None  # (launcher, its function) running the kernels; False: none; None: not tried
    calls: int = 0
    launch_after: int = 1  # calls before the native launcher is built (see CompiledProgram._native_call)
