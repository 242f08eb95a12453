"""cuda-python's driver API (``cuda.bindings.driver``): initialization and
errors, devices and their primary contexts (the ones PyTorch and JAX use),
streams, events ordering one stream after another, and the memsets and
function addresses that programs and native launchers need; a program's
PTX made machine code by nvJitLink on several threads where it loads.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from ..errors import DeviceError
from . import launch
from .buffers import poison_fill

log = logging.getLogger("polyjit")
SUCCESS: Any = None  # CUresult.CUDA_SUCCESS, once the driver is loaded


@functools.cache
def driver():
    """cuda.bindings.driver, initialized; DeviceError when there is no driver or GPU."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:
        raise DeviceError("target 'nvgpu' needs cuda-python: pip install 'polyjit[cuda]'") from e
    try:
        err, = cu.cuInit(0)
    except Exception as e:  # the bindings raise when libcuda is missing
        raise DeviceError(f"no NVIDIA driver found ({e}); target 'nvgpu' needs an NVIDIA GPU and driver") from e
    if err != cu.CUresult.CUDA_SUCCESS:
        raise DeviceError(f"no NVIDIA driver found (cuInit: {err.name}); target 'nvgpu' needs an NVIDIA GPU and driver")
    err, n = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS or n == 0:
        raise DeviceError("no NVIDIA GPU visible (check CUDA_VISIBLE_DEVICES); target 'nvgpu' needs one")
    global SUCCESS
    SUCCESS = cu.CUresult.CUDA_SUCCESS
    return cu


def check(result, what: str = "CUDA"):
    """The values of a driver call's result tuple; DeviceError on failure."""
    cu = driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, msg = cu.cuGetErrorString(err)
        raise DeviceError(f"{what} failed: {err.name}: {msg.decode() if msg else ''}")
    return rest[0] if len(rest) == 1 else rest


@functools.cache
def _ctx_get_current():
    """cuCtxGetCurrent through ctypes (the bindings' wrapper costs more than the call)."""
    fn = ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent
    fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int
    return fn


def default_ordinal() -> int:
    """The GPU used when no argument is on one: POLYJIT_DEVICE, else 0."""
    return int(os.environ.get("POLYJIT_DEVICE", "0"))


@functools.cache
def device(ordinal: int = 0) -> "Device":
    return Device(ordinal)


class Device:
    """One GPU: its primary context and the properties launches need."""

    def __init__(self, ordinal: int) -> None:
        cu = driver()
        self.ordinal = ordinal
        self.handle = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        attr = cu.CUdevice_attribute
        get = lambda a: check(cu.cuDeviceGetAttribute(a, self.handle), "cuDeviceGetAttribute")  # noqa: E731
        self.arch = f"sm_{get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)}" \
                    f"{get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)}"
        self.multiprocessors = get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        self._context = int(self.context)
        self._pool = None
        self._cubins_refused = False  # the driver would not load nvJitLink's cubins: PTX from then on

    def activate(self) -> None:
        """Make this device's context current where it is not (the check is
        on every call's path: through libcuda directly, as the bindings'
        wrapper costs several times the call)."""
        current = ctypes.c_void_p()
        if _ctx_get_current()(ctypes.byref(current)) or current.value != self._context:
            check(driver().cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def pool(self):
        """polyjit's memory pool on this device. It keeps what is freed (no
        release threshold): the default pool hands freed memory back to the
        driver at each synchronization, and mapping 32 MB again cost more than
        the kernel that used it."""
        if self._pool is None:
            cu = driver()
            props = cu.CUmemPoolProps()
            props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            props.handleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
            props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            props.location.id = self.ordinal
            pool = check(cu.cuMemPoolCreate(props), "cuMemPoolCreate")
            check(cu.cuMemPoolSetAttribute(pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                           cu.cuuint64_t(2 ** 64 - 1)), "cuMemPoolSetAttribute")
            self._pool = pool
        return self._pool

    def load(self, ptx: str, names: Sequence[str], keep: bool = True) -> tuple[list, dict[str, Any]]:
        """A program's PTX as modules, and its kernels by name. Where
        nvJitLink loads, each distinct entry (kernels that differ only in
        name share one) is linked once, in groups on up to LINK_THREADS
        threads, the cubins kept in the compile cache (keep); the driver's
        own JIT takes a module whole, on one thread."""
        cu = driver()
        linked = self._linked(ptx, keep) if jitlink() is not None and not self._cubins_refused else None
        self.activate()
        if linked is not None:
            mods, fns = [], {}
            alias, groups = linked
            try:
                for group, code in groups:
                    mods.append(check(cu.cuModuleLoadData(code), "loading a cubin (cuModuleLoadData)"))
                    fns.update({x: check(cu.cuModuleGetFunction(mods[-1], x.encode()), "cuModuleGetFunction")
                                for x in group})
                return mods, {n: fns[alias[n]] for n in names}
            except DeviceError as e:  # (a driver older than the nvJitLink that made them)
                unload(mods)
                self._cubins_refused = True
                log.warning("polyjit: %s; the driver compiles the PTX instead", e)
        mod = check(cu.cuModuleLoadData(ptx.encode() + b"\0"), "loading the PTX (cuModuleLoadData)")
        return [mod], {n: check(cu.cuModuleGetFunction(mod, n.encode()), "cuModuleGetFunction") for n in names}

    def _linked(self, ptx: str, keep: bool) -> tuple[dict, list] | None:
        """(each entry's name -> the entry whose code it shares, [(entries,
        cubin)]); None where the PTX is not entries after a header or a link
        fails (the driver's JIT then takes it whole)."""
        starts = [m for m in _ENTRY.finditer(ptx)]
        if len(starts) < 2:
            return None
        header = ptx[:starts[0].start()]
        texts = {m.group(1): ptx[m.start():end] for m, end in zip(starts, [x.start() for x in starts[1:]] + [len(ptx)])}
        first: dict[str, str] = {}
        alias = {name: first.setdefault(text.replace(name, "@"), name) for name, text in texts.items()}
        distinct = sorted(set(alias.values()))
        n = min(LINK_THREADS, os.cpu_count() or 1, len(distinct))
        groups = [distinct[i::n] for i in range(n)]
        sources = [header + "".join(texts[x] for x in g) for g in groups]
        try:
            with ThreadPoolExecutor(n, thread_name_prefix="polyjit-link") as pool:
                cubins = list(pool.map(lambda src: cubin(src, self.arch, keep), sources))
        except DeviceError as e:
            log.warning("polyjit: %s; the driver compiles the PTX instead", e)
            return None
        return alias, list(zip(groups, cubins))

    def resident_blocks(self, fn, block: int) -> int:
        """How many blocks of block threads of kernel fn a multiprocessor runs at once."""
        n = check(driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, block, 0),
                  "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return max(1, int(n))


_events: dict[int, list] = {}  # idle events by device ordinal


def order_before(dev: "Device", producer: int, consumer: int) -> None:
    """Make stream consumer wait for the work queued so far on stream producer.
    The event is taken from the device's idle ones for the two calls and then
    given back (a wait keeps the state the event had when it was queued), so
    a finalizer that runs in between takes another."""
    cu = driver()
    dev.activate()
    idle = _events.setdefault(dev.ordinal, [])
    event = idle.pop() if idle else check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING),
                                          "cuEventCreate")
    try:
        check(cu.cuEventRecord(event, cu_stream(producer)), "cuEventRecord")
        check(cu.cuStreamWaitEvent(cu_stream(consumer), event, 0), "cuStreamWaitEvent")
    finally:
        idle.append(event)


def synchronize() -> None:
    """Wait for all work polyjit queued on every device it used."""
    for i in sorted(used_devices):
        device(i).activate()
        check(driver().cuCtxSynchronize(), "cuCtxSynchronize")


used_devices: set[int] = set()
_streams: dict[int, Any] = {}  # CUstream wrappers by handle


def cu_stream(handle: int):
    """The driver's CUstream for a stream handle (wrappers kept: building one costs per call)."""
    s = _streams.get(handle)
    if s is None:
        s = _streams[handle] = driver().CUstream(handle)
    return s


def unload(mods: list) -> None:
    try:
        for mod in mods:
            driver().cuModuleUnload(mod)
    except Exception:  # interpreter shutdown
        pass


LINK_THREADS = 16  # the most threads linking one program's PTX at once
_ENTRY = re.compile(r"^\.visible \.entry (\w+)", re.M)


@functools.cache
def jitlink():
    """cuda.bindings' nvJitLink where its library loads, else None. The
    driver's JIT compiles a module's kernels one after another, and modules
    loaded from several threads no faster; nvJitLink's links run side by
    side (bench/NOTES.md)."""
    try:
        from cuda.bindings import nvjitlink
        nvjitlink.version()
    except Exception:  # no bindings, or no libnvJitLink
        return None
    return nvjitlink


def cubin(ptx: str, arch: str, keep: bool = True) -> bytes:
    """ptx linked for arch by nvJitLink, from the compile cache where an
    earlier link kept it (keep: look there, and keep this one)."""
    from .. import cache
    nv = jitlink()
    key = hashlib.sha256(f"cubin|{arch}|{nv.version()}|{ptx}".encode()).hexdigest()
    if keep:
        hit = cache.load(key)
        if hit is not None and hit[1]:
            return hit[1][0]
    options = [f"-arch={arch}"]
    handle = nv.create(len(options), options)
    try:
        data = ptx.encode()
        nv.add_data(handle, nv.InputType.PTX, data, len(data), "polyjit")
        nv.complete(handle)
        out = bytearray(nv.get_linked_cubin_size(handle))
        nv.get_linked_cubin(handle, out)
    except nv.nvJitLinkError as e:
        raise DeviceError(f"nvJitLink could not link the PTX ({e})") from None
    finally:
        nv.destroy(handle)
    if keep:
        cache.store(key, {"cubin": arch}, [bytes(out)])
    return bytes(out)


@functools.cache
def device_count() -> int:
    return int(check(driver().cuDeviceGetCount(), "cuDeviceGetCount"))


def device_of(ptr: int) -> int:
    """The ordinal of the device whose context allocated ptr (the driver's
    DEVICE_ORDINAL attribute read 0 for memory on a second GPU)."""
    cu = driver()
    ctx = check(cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT, ptr),
                "cuPointerGetAttribute")
    if not int(ctx):
        return default_ordinal()
    check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        return int(check(cu.cuCtxGetDevice(), "cuCtxGetDevice"))
    finally:
        check(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")


def poison(ptr: int, nbytes: int, kind: str, stream: int) -> None:
    """Fill memory with NaN (floats) or 0xFF bytes, as POLYJIT_POISON asks."""
    cu = driver()
    value, count, width = poison_fill(nbytes, kind)
    memset = cu.cuMemsetD32Async if width == 4 else cu.cuMemsetD8Async
    check(memset(ptr, value, count, cu_stream(stream)), "poisoning (cuMemsetAsync)")


@functools.cache
def launch_symbols() -> dict[str, int]:
    """The addresses of the functions native launchers call (launch.SYMBOLS)."""
    driver()
    libs = [ctypes.CDLL("libcuda.so.1"), ctypes.CDLL(None)]
    return {n: ctypes.cast(getattr(next(lib for lib in libs if hasattr(lib, n)), n), ctypes.c_void_p).value
            for n in launch.SYMBOLS}
