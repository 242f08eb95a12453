"""Arrays on the GPU: memory polyjit allocates (DeviceBuffer, freed in
stream order), views of callers' arrays (GpuView, from anything with
``__cuda_array_interface__``) and DLPack export.
"""
from __future__ import annotations

import ctypes
import math
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from .cuda import Device, check, cu_stream, device_count, device_of, driver, order_before


class DeviceBuffer:
    """GPU memory polyjit allocated (from the device's pool), freed on the same stream
    when the last reference goes; exposes ``__cuda_array_interface__``."""

    def __init__(self, shape: tuple[int, ...], dtype, dev: Device, stream: int) -> None:
        cu = driver()
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.nbytes = max(int(math.prod(self.shape)) * self.dtype.itemsize, 1)
        dev.activate()
        self.ptr = int(check(cu.cuMemAllocFromPoolAsync(self.nbytes, dev.pool(), cu_stream(stream)),
                             "cuMemAllocFromPoolAsync"))
        self.device, self.stream = dev, stream
        self.consumers: list[int] = []  # streams of frameworks that took it by DLPack
        weakref.finalize(self, _free, self.ptr, dev, stream, self.consumers)

    def data_ptr(self) -> int:
        return self.ptr

    def reshape(self, shape: tuple[int, ...]) -> "DeviceBuffer":
        """The same memory in another shape of as many elements; it keeps this buffer alive."""
        view = object.__new__(DeviceBuffer)
        view.__dict__.update(self.__dict__, shape=tuple(shape), base=self)
        return view

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False),
                "version": 3, "strides": None}

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.device.ordinal)  # kDLCUDA

    def __dlpack__(self, stream=None, **kwargs):
        """A DLPack capsule that shares this memory (JAX and PyTorch take it
        with from_dlpack). The work queued on it is ordered before the
        consumer's ``stream`` (DLPack's protocol: a handle, 1 for the legacy
        stream, 2 per-thread, -1 for none) without waiting on the host; with
        no stream named, the host waits for it."""
        cu = driver()
        if stream is None:
            check(cu.cuStreamSynchronize(cu_stream(self.stream)), "cuStreamSynchronize")
        elif stream != -1 and int(stream) != self.stream:
            order_before(self.device, self.stream, int(stream))
            self.consumers.append(int(stream))
        return _dlpack.export(self)

    def numpy(self, stream: int = 0) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        cu = driver()
        check(cu.cuMemcpyDtoHAsync(out.ctypes.data, self.ptr, out.nbytes, cu_stream(stream)), "cuMemcpyDtoHAsync")
        check(cu.cuStreamSynchronize(cu_stream(stream)), "cuStreamSynchronize")
        return out


def library_workspace(nbytes: int, dev: Device) -> DeviceBuffer:
    """A library's scratch memory kept for the process: allocated on the
    legacy stream and waited for, so that any stream's calls may use it."""
    buf = DeviceBuffer((max(nbytes, 1),), "uint8", dev, 0)
    check(driver().cuStreamSynchronize(cu_stream(0)), "cuStreamSynchronize")
    return buf


class _DLPack:
    """DLPack export through ctypes: DLManagedTensor structs kept alive in a
    table until the consumer calls their deleter."""

    def __init__(self) -> None:
        c = ctypes

        class Device(c.Structure):
            _fields_ = [("device_type", c.c_int32), ("device_id", c.c_int32)]

        class DType(c.Structure):
            _fields_ = [("code", c.c_uint8), ("bits", c.c_uint8), ("lanes", c.c_uint16)]

        class Tensor(c.Structure):
            _fields_ = [("data", c.c_void_p), ("device", Device), ("ndim", c.c_int32), ("dtype", DType),
                        ("shape", c.POINTER(c.c_int64)), ("strides", c.POINTER(c.c_int64)),
                        ("byte_offset", c.c_uint64)]

        deleter_t = c.CFUNCTYPE(None, c.c_void_p)

        class Managed(c.Structure):
            _fields_ = [("dl_tensor", Tensor), ("manager_ctx", c.c_void_p), ("deleter", deleter_t)]

        self.Managed, self.Device, self.DType = Managed, Device, DType
        self.live: dict[int, tuple] = {}
        self.deleter = deleter_t(lambda addr: self.live.pop(addr, None))
        self.name = b"dltensor"
        # prototypes of our own: ctypes.pythonapi's function objects are shared,
        # and others (jax.ffi.pycapsule) set their argument types to theirs
        api = c.pythonapi
        self.capsule_new = c.PYFUNCTYPE(c.py_object, c.c_void_p, c.c_char_p, c.c_void_p)(("PyCapsule_New", api))
        is_valid = c.PYFUNCTYPE(c.c_int, c.c_void_p, c.c_char_p)(("PyCapsule_IsValid", api))
        get_ptr = c.PYFUNCTYPE(c.c_void_p, c.c_void_p, c.c_char_p)(("PyCapsule_GetPointer", api))

        def destroy(capsule):  # an unconsumed capsule still owns its tensor
            if is_valid(capsule, self.name):
                self.live.pop(get_ptr(capsule, self.name), None)
        self.destructor = c.CFUNCTYPE(None, c.c_void_p)(destroy)

    CODES = {"i": 0, "u": 1, "f": 2, "b": 6}

    def export(self, buf: "DeviceBuffer"):
        c = ctypes
        shape = (c.c_int64 * max(len(buf.shape), 1))(*buf.shape)
        m = self.Managed()
        m.dl_tensor.data = buf.ptr
        m.dl_tensor.device = self.Device(2, buf.device.ordinal)
        m.dl_tensor.ndim = len(buf.shape)
        m.dl_tensor.dtype = self.DType(self.CODES[buf.dtype.kind], buf.dtype.itemsize * 8, 1)
        m.dl_tensor.shape = shape
        m.deleter = self.deleter
        addr = c.addressof(m)
        self.live[addr] = (m, shape, buf)
        return self.capsule_new(addr, self.name, c.cast(self.destructor, c.c_void_p))


_dlpack = _DLPack()


def _free(ptr: int, dev: Device, stream: int, consumers: list[int]) -> None:
    """Free on stream, after the work consumers queued on their streams."""
    try:
        cu = driver()
        for c in consumers:
            order_before(dev, c, stream)
        cu.cuMemFreeAsync(ptr, cu_stream(stream))
    except Exception:  # interpreter shutdown
        pass


@dataclass
class GpuView:
    """A view of an argument on the GPU: pointer, shape and element strides
    (None when row-major). Frontends that know these build it directly;
    other arrays come through their ``__cuda_array_interface__``."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None
    dtype: np.dtype
    device: int
    owner: Any

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def __cuda_array_interface__(self) -> dict:
        strides = None if self.strides is None else tuple(x * self.dtype.itemsize for x in self.strides)
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False), "version": 3,
                "strides": strides}


def as_device_array(a, ordinal: int | None = None) -> GpuView | None:
    """The GPU view of a (CUDA array interface) argument; None for host arrays.
    ordinal: the device, when the caller knows it (saves a driver query)."""
    if isinstance(a, GpuView):
        return a
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is None:
        return None
    dtype = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    if strides is not None:
        strides = tuple(s // dtype.itemsize for s in strides)
    ptr = cai["data"][0]
    if ordinal is None:
        ordinal = 0 if not ptr or device_count() == 1 else device_of(ptr)
    return GpuView(ptr, shape, strides, dtype, ordinal, a)
