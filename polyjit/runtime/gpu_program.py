"""Running nvgpu programs: a GpuProgram checks its arguments, plans each
shape signature once (sizes, allocations, grids, the kernels' argument
blocks) and runs the plan's launches and library steps on the caller's
stream, from Python or through a native launcher (runtime.launch).

Kernels run in the primary context of the device that holds the inputs (the
one PyTorch and JAX use), on the stream the caller names (PyTorch's current
stream), with no host synchronization unless results go back to the host.
Arrays cross by pointer: anything with ``__cuda_array_interface__`` (PyTorch,
JAX, CuPy, Numba), or numpy arrays, which are copied to the GPU and whose
results come back as numpy arrays.
"""
from __future__ import annotations

import ctypes
import math
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .. import sizes as sz
from ..codegen.nvgpu import BLOCK, ZEROING_ARRAYS, ZEROING_KERNEL, ptx, zeroing_kernel
from ..errors import DeviceError, InputError
from . import cuda, cuda_graphs, launch
from .buffers import POISON
from .cuda import Device, check, cu_stream, default_ordinal, device, driver, launch_symbols, poison, unload
from .gpu_buffers import DeviceBuffer, GpuView, as_device_array
from .program import CompiledProgram, RowMajor

ZEROING_BYTES = 1 << 20  # arrays up to this size are zeroed together (the larger, each by a memset)
WAVES = 2  # grids of this many times the blocks that fit on the device at once
NATIVE = os.environ.get("POLYJIT_NATIVE_LAUNCH", "1") != "0"  # calls run their steps from host code, not Python
_launchers = 0  # native launchers built (their names are unique)
_lock = threading.Lock()


def _data_ptr(a) -> int:
    return a.data_ptr() if hasattr(a, "data_ptr") else a.__cuda_array_interface__["data"][0]


@dataclass
class GpuProgram(CompiledProgram):
    """A compiled program whose kernels are PTX; called with GPU or host arrays."""

    ptx: str = ""
    arch: str = ""
    writes: list = field(default_factory=list)  # per kernel: the arrays its statements write
    _loaded: dict = field(default_factory=dict, repr=False)  # kernels by device ordinal
    _consts: dict = field(default_factory=dict, repr=False)  # constants on each device

    def _grid(self, k: int, env: dict, dev: Device, resident: int) -> int:
        """Blocks for kernel k: one per BLOCK elements it writes (or lanes' worth), at
        most WAVES times as many as fit on the device at once (grid-stride loops
        take the rest)."""
        if not self.kernels[k].parallel:
            return 1
        full = dev.multiprocessors * resident * WAVES
        if self.kernels[k].strips:  # strips of a sum: more iterations than elements written
            return full
        work = 0
        for a in self.writes[k]:
            work += math.prod(sz.evaluate(s, env) for s in a.shape)
        work *= max(self.kernels[k].lanes, 1)
        return max(1, min(-(-work // BLOCK), full))

    def __call__(self, *args, stream: int | None = None,
                 empty: Callable[[tuple, np.dtype], Any] | None = None, ordinal: int | None = None) -> list:
        """Run on the GPU. ``stream``: a CUstream handle (default: the legacy
        stream); ``empty(shape, dtype)`` allocates outputs and temporaries
        (a framework's caching allocator; default: polyjit's DeviceBuffer);
        ``ordinal``: the device of the GPU arrays, when the caller knows it.
        Host inputs come back as numpy arrays."""
        cu = driver()
        views = [a if type(a) is GpuView else as_device_array(a, ordinal) for a in args]
        stream = int(stream or 0)
        try:  # all on the GPU: the plan for these shapes, layouts and device
            key = _device_key(views)
        except AttributeError:  # some on the host
            key = (False, default_ordinal()) + tuple((v.shape, v.strides, v.dtype, v.device) if v is not None else
                                   (np.shape(a), None, np.asarray(a).dtype) for v, a in zip(views, args))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(key, views, args, stream)
        dev = plan.device
        dev.activate()
        if plan.native is None:
            plan.native = NATIVE and all(v is not None for v in views) and self._native(plan)
        if plan.native:
            return self._run_native(plan, plan.native, [v.ptr for v in views], stream, empty)
        s = cu_stream(stream)
        host = plan.host
        keep: list = []
        made: dict[str, Any] = {}
        with plan.lock:  # the plan's argument block is filled, then copied by each launch
            pointers = plan.pointers
            for slot, spec, v, a in zip(plan.input_slots, self.inputs, views, args):
                if v is None:  # host data: copy to the GPU
                    h = np.ascontiguousarray(a, dtype=spec.dtype.numpy)
                    buf = DeviceBuffer(h.shape, h.dtype, dev, stream)
                    if h.nbytes:
                        check(cu.cuMemcpyHtoDAsync(buf.ptr, h.ctypes.data, h.nbytes, s), "cuMemcpyHtoDAsync")
                    keep += [buf, h]
                    pointers[slot] = buf.ptr
                else:
                    pointers[slot] = v.ptr
            for slot, name, shape, dt in plan.fresh:
                buf = made[name] = empty(shape, dt) if (empty and not host) else DeviceBuffer(shape, dt, dev, stream)
                pointers[slot] = _data_ptr(buf)
                if POISON and shape:
                    poison(pointers[slot], math.prod(shape) * dt.itemsize, dt.kind, stream)
            for (fn, grid, block, what, zeroed, _), argv in zip(plan.launches, plan.argv):
                if not block:  # a library call
                    fn.run(pointers, stream)
                    continue
                for slot, nbytes in zeroed:
                    check(cu.cuMemsetD8Async(pointers[slot], 0, nbytes, s), "cuMemsetD8Async")
                result = cu.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, s, argv, 0)
                if result[0] is not cuda.SUCCESS:
                    check(result, what)
        self.stats["intermediate_bytes"] = plan.temp_bytes
        outs = self._hand_out(made, plan.returned)
        if host:
            return [o.numpy(stream) for o in outs]
        del keep, made  # stream-ordered frees: the kernels above still see the memory
        return outs

    def native_launcher(self, views: Sequence[GpuView], name: str) -> launch.NativeLauncher | None:
        """This program's launches for arguments like ``views`` (their shapes,
        strides, dtypes and device; not their pointers) as host code named
        ``name`` (see CompiledProgram._native_launcher), for callers outside Python
        (XLA's custom calls). Raises InputError as a call would."""
        key = _device_key(views)
        plan = self._plans.get(key) or self._plan(key, views, views, 0)
        self.stats["intermediate_bytes"] = plan.temp_bytes
        return self._shown(self._launcher(plan, name))

    def _launcher(self, plan: "_Plan", name: str) -> launch.NativeLauncher | None:
        """A plan's steps as host code; its library steps get handles of their own
        (one per library), freed with it."""
        steps: list = []
        handles: dict = {}  # library -> its handle for this launcher
        for fn, grid, block, what, zeroed, params in plan.launches:
            if not block:  # a library call
                if fn.lib not in handles:
                    handles[fn.lib] = fn.lib.new_handle(plan.device)
                steps.append(fn.native(handles[fn.lib]))
                continue
            steps += [launch.Memset(slot, 0, nbytes, 1, f"zeroing for {what}") for slot, nbytes in zeroed]
            steps.append(launch.Launch(int(fn), grid, block, what, params))
        launcher = self._native_launcher(name, {n: (slot, shape, dt) for slot, n, shape, dt in plan.fresh},
                                         plan.input_slots, plan.pointers, plan.ints, steps,
                                         int(plan.device.context), launch_symbols(), plan.returned)
        for lib, handle in handles.items():
            if launcher is None:
                lib.destroy(handle)
            else:
                weakref.finalize(launcher, lib.destroy, handle)
        if launcher is not None:
            launcher.owner = (self, plan)  # its code holds the plan's library steps' descriptors and workspaces
        return launcher

    def _native(self, plan: "_Plan") -> "_Native | bool":
        """How calls with this plan run through a native launcher (one ctypes
        call for all the steps; temporaries in one workspace), or False where
        none can be built."""
        global _launchers
        _launchers += 1
        launcher = self._launcher(plan, f"{self.name}_host{_launchers}")
        if launcher is None:
            return False
        outs = len(set(self.output_arrays))
        offsets, total = [], 0
        for _, shape, dt in launcher.results[outs:]:
            offsets.append(total)
            total += -(-math.prod(shape) * dt.itemsize // 256) * 256
        run = launch.LAUNCH_T(launcher.address)
        replays = cuda_graphs.GraphReplays(run, plan.device.ordinal) if cuda_graphs.ENABLED else None
        return _Native(launcher, replays or run, launcher.results[:outs], np.array(offsets, np.int64), total,
                       (ctypes.c_void_p * max(len(self.inputs), 1))(),
                       (ctypes.c_void_p * max(len(launcher.results), 1))(), ctypes.create_string_buffer(256),
                       replays)

    def native_plan(self, views: Sequence[GpuView]) -> "_Plan | None":
        """The plan that calls on GPU arrays of these views' layouts run
        through a native launcher (an earlier call made it), or None."""
        plan = self._plans.get(_device_key(views))
        return plan if plan is not None and plan.native else None

    def run_bound(self, plan: "_Plan", pointers: Sequence[int], stream: int, empty,
                  outputs: Callable[[list], tuple] | None = None) -> list:
        """A call through plan's native launcher (native_plan) on these input
        pointers, skipping the checks and the plan's lookup: a frontend's
        repeated call whose arguments it has compared with those the plan
        is for. ``outputs(specs)``, where given, allocates all the outputs
        at once from their (name, shape, dtype), the same list object at
        every call of a plan (a frontend may place several in one block):
        it returns their addresses (int64s) and a function, called
        after the launch, that returns them."""
        plan.device.activate()
        return self._run_native(plan, plan.native, pointers, stream, empty, outputs)

    def _run_native(self, plan: "_Plan", native: "_Native", pointers: Sequence[int], stream: int, empty,
                    outputs: Callable[[list], tuple] | None = None) -> list:
        dev = plan.device
        with plan.lock:  # the pointer arrays are the plan's
            results, n = native.addresses, len(native.outputs)
            if outputs:
                addresses, handed = outputs(native.outputs)
                results[:n] = addresses
            else:
                made = [empty(shape, dt) if empty else DeviceBuffer(shape, dt, dev, stream)
                        for _, shape, dt in native.outputs]
                results[:n] = [_data_ptr(buf) for buf in made]
            if native.workspace:
                work = (empty((native.workspace // 4,), np.dtype(np.float32)) if empty else
                        DeviceBuffer((native.workspace // 4,), np.dtype(np.float32), dev, stream))
                np.add(native.temps, _data_ptr(work), out=results[n:n + len(native.temps)])
            native.inputs[:len(pointers)] = pointers
            code = native.run(native.inputs, native.results, stream, native.message, len(native.message))
            if outputs:
                made = handed()
            if native.replays is not None:
                self.stats["cuda_graph_replays"] = native.replays.replays
            if code:
                raise DeviceError(f"{self.name}: {native.message.value.decode(errors='replace')}")
        self.stats["intermediate_bytes"] = plan.temp_bytes
        if len(made) == len(self.output_arrays):
            return made
        by_name = dict(zip((n for n, _, _ in native.outputs), made))
        return [by_name[n] for n in self.output_arrays]

    def _device(self, views, args) -> Device:
        """The one device all GPU arguments are on (InputError for mixed placements)."""
        gpu = [v for v in views if v is not None]
        if len(gpu) < len(views):
            on_host = [k for k, v in enumerate(views) if v is None and np.ndim(args[k]) > 0]
            if on_host and gpu:
                on_gpu = [k for k, v in enumerate(views) if v is not None]
                raise InputError(f"{self.name}: inputs {on_gpu} are on the GPU but inputs {on_host} are on the "
                                 "host; pass all inputs on one device")
        if any(v.device != gpu[0].device for v in gpu):
            devices = sorted({v.device for v in gpu})
            where = {d: [k for k, v in enumerate(views) if v is not None and v.device == d] for d in devices}
            raise InputError(f"{self.name}: inputs are on several GPUs ({where}); pass all inputs on one device")
        dev = device(gpu[0].device if gpu else default_ordinal())
        if dev.arch != self.arch and int(dev.arch[3:]) < int(self.arch[3:]):
            raise DeviceError(f"{self.name} was compiled for {self.arch}, but the GPU is {dev.arch}")
        return dev

    def _plan(self, key, views, args, stream: int) -> "_Plan":
        """What a call with these shapes, layouts and device needs, worked out
        once: sizes, the integer arguments, allocations, launch configurations
        and the kernels' argument block (constants' pointers filled in).
        Raises InputError before anything runs."""
        dev = self._device(views, args)
        cuda.used_devices.add(dev.ordinal)
        dev.activate()
        shapes = [v.shape if v is not None else np.shape(a) for v, a in zip(views, args)]
        env = self.bind([RowMajor(sh, v.dtype if v is not None else np.asarray(a).dtype)
                         for sh, v, a in zip(shapes, views, args)])
        strides: dict[str, tuple] = {}
        for spec, v, sh in zip(self.inputs, views, shapes):
            if v is not None and v.strides is not None and not spec.strided and v.strides != sz.row_major(v.shape):
                raise InputError(f"{self.name}: input {spec.index} is not contiguous; "
                                 "this program was compiled for contiguous inputs")
            strides[spec.name] = (v.strides if v is not None else None) or sz.row_major(sh)
        slot = {b.name: i for i, b in enumerate(self.buffers)}
        fresh = []
        temp_bytes = 0
        pointers = (ctypes.c_void_p * max(len(self.buffers), 1))()
        for spec in self.buffers:
            if spec.kind in ("output", "temp"):
                shape = tuple(sz.evaluate(x, env) for x in spec.shape)
                fresh.append((slot[spec.name], spec.name, shape, np.dtype(spec.dtype.numpy)))
                strides[spec.name] = sz.row_major(shape)
                if spec.kind == "temp":
                    temp_bytes += math.prod(shape) * spec.dtype.itemsize
            elif spec.kind == "const":
                strides[spec.name] = sz.row_major(self.constants[spec.index].shape)
                pointers[slot[spec.name]] = self._const(spec.index, dev, stream).ptr
        ints = [env[name] if d < 0 else strides[name][d] for name, d in self.int_slots]
        fns = self._functions(dev)
        nbytes = {name: math.prod(shape) * dt.itemsize for _, name, shape, dt in fresh}
        launches = [(fns[k.name][0], self._grid(i, env, dev, fns[k.name][1]), BLOCK if k.parallel else 1,
                     f"launching {k.name}", [(slot[a], nbytes[a]) for a in k.zeroed if nbytes[a]], k.params)
                    if k.library is None else (self._library_step(k, env, dev, slot), 0, 0, k.name, [], None)
                    for i, k in enumerate(self.kernels)]
        launches = self._zeroing_together(launches, [self._accessed(k, slot) for k in self.kernels], ints, dev)
        plan = _Plan(dev, not any(v is not None for v in views), fresh, launches, temp_bytes,
                     [slot[spec.name] for spec in self.inputs], pointers, (ctypes.c_int64 * len(ints))(*ints),
                     self.returned_shapes(env))
        places = [ctypes.addressof(plan.pointers) + 8 * i for i in range(len(self.buffers))]
        places += [ctypes.addressof(plan.ints) + 8 * i for i in range(len(ints))]
        blocks = {None: (ctypes.c_void_p * max(len(places), 1))(*places)}  # a kernel's arguments, by its params
        for *_, params in launches:
            if params is not None and params not in blocks:
                blocks[params] = (ctypes.c_void_p * max(len(params), 1))(*(places[p] for p in params))
        plan.blocks = blocks
        plan.argv = [ctypes.addressof(blocks[params]) for *_, params in launches]
        self._remember(key, plan)
        return plan

    def _accessed(self, k, slot: dict) -> frozenset | None:
        """The argument slots of the arrays kernel k may read or write (None: any of them)."""
        if k.library is not None:
            call = k.library.library
            names = [box[0] for box in (*call.read(), call.written())]
            return frozenset(slot[a] for a in names) if all(a in slot for a in names) else None
        return None if k.params is None else frozenset(p for p in k.params if p < len(self.buffers))

    def _zeroing_together(self, launches: list, accessed: list, ints: list, dev: Device) -> list:
        """launches with the arrays that several atomic strips zero first
        (zeroing_points) zeroed by one launch of nvgpu's ZEROING_KERNEL, its
        sizes appended to ints."""
        zeroed = [[(s, n) for s, n in step[4] if n % 4 == 0 and n <= ZEROING_BYTES] for step in launches]
        points = zeroing_points(zeroed, accessed)
        if all(len(arrays) < 2 for arrays in points.values()):
            return launches
        fn, resident = _zeroing_function(dev)
        together = {i: arrays for i, arrays in points.items() if len(arrays) > 1}  # (one array: its memset)
        moved = {(i, s) for arrays in together.values() for i, s, _ in arrays}
        out = []
        for i, step in enumerate(launches):
            arrays = together.get(i, [])
            for k in range(0, len(arrays), ZEROING_ARRAYS):
                part = arrays[k:k + ZEROING_ARRAYS]
                params = []
                for _, s, n in part:
                    params += [s, len(self.buffers) + len(ints)]
                    ints.append(n // 4)
                params += [len(self.buffers) + len(ints)] * 2 * (ZEROING_ARRAYS - len(part))
                ints.append(0)  # (the unused arrays' pointers and sizes)
                words = max(n // 4 for _, _, n in part)
                grid = max(1, min(-(-words // BLOCK), dev.multiprocessors * resident * WAVES))
                out.append((fn, grid, BLOCK, f"zeroing for {step[3]}", [], tuple(params)))
            out.append((*step[:4], [(s, n) for s, n in step[4] if (i, s) not in moved], step[5]))
        return out

    def _library_step(self, k, env: dict, dev: Device, slot: dict):
        """Kernel k's library call (cuBLAS's product, cuDNN's convolution) at
        these sizes, run on the caller's stream."""
        from ..library import Convolution
        from .cublas import GemmStep, cublas
        from .cudnn import ConvStep, cudnn
        direct = isinstance(k.library.library, Convolution)
        lib = cudnn() if direct else cublas()
        if lib is None:
            raise DeviceError(f"{self.name} calls {'cuDNN' if direct else 'cuBLAS'} ({k.name}), which no longer "
                              "loads here")
        if direct:
            return ConvStep(lib, dev, k.library, env, slot)
        return GemmStep(lib, dev, k.library, env, {b.name: b for b in self.buffers}, slot)

    def _functions(self, dev: Device) -> dict:
        """This program's kernels on dev, loaded on first use and unloaded with it,
        each with how many of its blocks fit on a multiprocessor."""
        with _lock:
            if dev.ordinal not in self._loaded:
                names = [k.name for k in self.kernels if k.library is None]
                if not names:  # only library steps: no module (the driver refuses an empty one)
                    self._loaded[dev.ordinal] = {}
                    return {}
                mods, fns = dev.load(self.ptx, names, self.cached)
                self._loaded[dev.ordinal] = {n: (f, dev.resident_blocks(f, BLOCK)) for n, f in fns.items()}
                weakref.finalize(self, unload, mods)
            return self._loaded[dev.ordinal]

    def _const(self, index: int, dev: Device, stream: int) -> DeviceBuffer:
        key = (index, dev.ordinal)
        if key not in self._consts:
            cu = driver()
            h = np.ascontiguousarray(self.constants[index])
            buf = DeviceBuffer(h.shape, h.dtype, dev, stream)
            if h.nbytes:
                check(cu.cuMemcpyHtoDAsync(buf.ptr, h.ctypes.data, h.nbytes, cu_stream(stream)), "cuMemcpyHtoDAsync")
            check(cu.cuStreamSynchronize(cu_stream(stream)), "cuStreamSynchronize")
            self._consts[key] = buf
        return self._consts[key]


def zeroing_points(zeroed: list[list[tuple[int, int]]], accessed: list[frozenset | None]) -> dict[int, list]:
    """Where to zero the arrays each launch zeroes first (``zeroed[i]``:
    (slot, bytes) before launch i), as few places as there can be: launch i
    -> the (launch, slot, bytes) zeroed just before it. An array may be zeroed as
    early as just after the last launch before its own that touches it
    (``accessed[j]``: launch j's slots, None: any); the greedy choice of
    the latest place for the first interval not yet covered is the least
    number of places. Atomic strips of a model's parameter gradients, late
    in a backward, then zero theirs in one launch at its start."""
    spans = []
    for i, arrays in enumerate(zeroed):
        for s, n in arrays:
            p = i
            while p and accessed[p - 1] is not None and s not in accessed[p - 1]:
                p -= 1
            spans.append((i, p, s, n))
    points: dict[int, list] = {}
    at = None
    for i, p, s, n in sorted(spans, key=lambda x: x[0]):
        if at is None or p > at:
            at = i
        points.setdefault(at, []).append((i, s, n))
    return points


_zeroing: dict[int, tuple] = {}  # device ordinal -> (ZEROING_KERNEL there, its resident blocks)


def _zeroing_function(dev: Device) -> tuple:
    with _lock:
        if dev.ordinal not in _zeroing:
            mods, fns = dev.load(ptx(zeroing_kernel(), dev.arch)[1], [ZEROING_KERNEL], False)
            fn = fns[ZEROING_KERNEL]
            _zeroing[dev.ordinal] = (fn, dev.resident_blocks(fn, BLOCK), mods)  # (loaded for the process)
        return _zeroing[dev.ordinal][:2]


def _device_key(views) -> tuple:
    """A call's plan key where every argument is a GPU array."""
    return tuple((v.shape, v.strides, v.dtype, v.device) for v in views)


@dataclass
class _Plan:
    device: Device
    host: bool  # every argument on the host: copied in, results copied back
    fresh: list  # (argument slot, array, shape, dtype) of outputs and temporaries to allocate
    launches: list  # (function, grid, block, what it is (for errors), (slot, bytes) to zero, params)
    temp_bytes: int
    input_slots: list  # the argument slot of each input
    pointers: Any  # the kernels' arguments: buffer pointers (inputs and fresh set at each call),
    ints: Any  # and integers (sizes, strides), fixed for the plan
    returned: dict  # outputs handed out reshaped: name -> shape
    blocks: Any = None  # the address of each argument, as cuLaunchKernel takes them: per parameter list
    argv: list = field(default_factory=list)  # each kernel's (its block's address)
    lock: Any = field(default_factory=threading.Lock)
    native: "_Native | bool | None" = None  # the native launcher's call (None: not built yet; False: none)


@dataclass
class _Native:
    """A plan's native launcher and what a call hands it: the outputs' (name,
    shape, dtype), the temporaries' byte offsets in one workspace of
    ``workspace`` bytes (int64), and the pointer arrays and message buffer
    it fills."""
    launcher: launch.NativeLauncher
    run: Any
    outputs: list
    temps: np.ndarray
    workspace: int
    inputs: Any
    results: Any
    message: Any
    replays: "cuda_graphs.GraphReplays | None" = None  # where graphs are on: it is run

    def __post_init__(self) -> None:
        # results as int64, written in place: numpy's ctypes accessor and a
        # memmove cost more than the assignment
        self.addresses = np.frombuffer(self.results, np.int64)
