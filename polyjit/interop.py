"""Arrays of the caller's framework in, results of the same kind out, no copies.

The core imports no framework: an argument's kind is read from its type's
module (``torch``, ``jax``, ``jaxlib``) or its protocols (``__dlpack__``,
``__cuda_array_interface__``, ``__array__``), and a framework is imported
only to wrap results when the caller's arrays came from it (so it is loaded
already).
"""
from __future__ import annotations

import ctypes
import sys
from typing import Any, Sequence

import numpy as np

from .dtypes import DataType
from .errors import DefinitionError, InputError

_DLPACK_CPU, _DLPACK_CUDA = 1, 2


def kind(x: Any) -> str:
    """'torch', 'jax', 'tf', 'numpy' or 'other' (anything with __dlpack__,
    the CUDA array interface or __array__)."""
    if isinstance(x, np.ndarray):
        return "numpy"
    mod = type(x).__module__
    if mod.startswith("torch"):
        return "torch"
    if mod.startswith(("jax", "jaxlib")):
        return "jax"
    if mod.startswith("tensorflow"):
        return "tf"
    return "other"


def _torch_view(t, name: str):
    from .runtime.gpu_buffers import GpuView
    try:
        dt = np.dtype(str(t.dtype).removeprefix("torch."))
    except TypeError:
        raise InputError(f"{name} is a tensor of dtype {t.dtype}, which polyjit's GPU code does not take") from None
    strides = None if t.is_contiguous() else tuple(t.stride())
    return GpuView(t.data_ptr(), tuple(t.shape), strides, dt, t.get_device(), t)


def _jax_view(x):
    """A JAX array on a GPU as a view, once JAX's work on it is done; None on the host."""
    from .runtime.gpu_buffers import GpuView
    dev = next(iter(x.devices()))
    if dev.platform not in ("gpu", "cuda"):
        return None
    x.block_until_ready()
    return GpuView(x.unsafe_buffer_pointer(), tuple(x.shape), None, np.dtype(x.dtype), dev.local_hardware_id, x)


def _dlpack_view(x, name: str):
    """A CUDA DLPack producer's memory as a view (the capsule keeps it alive)."""
    from .runtime.gpu_buffers import GpuView, _dlpack
    capsule = x.__dlpack__()
    get = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_GetPointer",
                                                                                  ctypes.pythonapi))
    t = _dlpack.Managed.from_address(get(capsule, b"dltensor")).dl_tensor
    code = {v: k for k, v in _dlpack.CODES.items()}.get(t.dtype.code)
    if code is None or t.dtype.lanes != 1:
        raise InputError(f"{name}: DLPack dtype code {t.dtype.code} is not one polyjit takes")
    dt = np.dtype(f"{code}{t.dtype.bits // 8}") if code != "b" else np.dtype(bool)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None
    return GpuView(t.data + t.byte_offset, shape, strides, dt, t.device.device_id, (x, capsule))


def _dlpack_device(x) -> int:
    """The DLPack device type of an array with ``__dlpack__`` (no device said: the host)."""
    return x.__dlpack_device__()[0] if hasattr(x, "__dlpack_device__") else _DLPACK_CPU


def torch_host_array(t) -> np.ndarray:
    """A CPU torch tensor as a numpy array on its memory; bfloat16 through
    its 16 bits (torch hands numpy no bfloat16; ml_dtypes' is numpy's)."""
    torch = sys.modules["torch"]
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(DataType.BFloat16.numpy)
    return t.numpy()


def torch_from_host(a) -> Any:
    """A numpy array as a CPU torch tensor on its memory (bfloat16 too)."""
    torch = sys.modules["torch"]
    a = np.asarray(a)
    if a.dtype == DataType.BFloat16.numpy:  # (not dtype.name: numpy computes it in Python, at each output)
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def tf_from_host(a) -> Any:
    """A numpy array as a TensorFlow tensor: on its memory where DLPack takes
    it (writable, 64-byte aligned, not empty), else copied."""
    tf = sys.modules["tensorflow"]
    a = np.asarray(a)
    if a.flags.c_contiguous and a.flags.writeable and a.ctypes.data % 64 == 0 and a.size:
        return tf.experimental.dlpack.from_dlpack(a.__dlpack__())
    return tf.convert_to_tensor(a)


def host_array(x: Any, what: str) -> np.ndarray:
    """A framework's array (or anything with __dlpack__ or __array__) as a
    numpy array on the host: the value of a constant a traced program closes over."""
    k = kind(x)
    if k == "numpy":
        return x
    if k == "torch":
        return torch_host_array(x.detach().cpu())
    if k == "jax":
        return np.asarray(x)
    if hasattr(x, "__dlpack__"):
        device = _dlpack_device(x)
        if device == _DLPACK_CPU:
            return np.from_dlpack(x)
    if hasattr(x, "__array__"):
        return np.asarray(x)
    raise DefinitionError(f"{what} is a {type(x).__name__}; expected a Tensor, a Python number, a numpy "
                          "array or an array with __dlpack__ or __array__")


class Call:
    """One call's arguments as the compiled program takes them (numpy arrays,
    GPU views), the launch options for the caller's stream, and a way to
    return results of the caller's kind."""

    def __init__(self, args: Sequence, name: str) -> None:
        self.arrays: list = []
        self.launch: dict = {}
        kinds = {kind(a) for a in args if not isinstance(a, (bool, int, float, np.generic))}
        self.kind = next((k for k in ("torch", "jax", "tf") if k in kinds), "as_is")
        for k, a in enumerate(args):
            self.arrays.append(self._array(a, f"{name}: input {k}"))

    def _array(self, a, name: str):
        k = kind(a)
        if k == "torch":
            if a.is_cuda:
                self._on_gpu(a.get_device(), sys.modules["torch"].cuda.current_stream(a.device).cuda_stream)
                return _torch_view(a, name)
            try:
                return torch_host_array(a.detach())
            except TypeError as e:  # a dtype numpy has no counterpart of
                raise InputError(f"{name} is a CPU tensor of dtype {a.dtype}, which numpy cannot view: {e}") from None
        if k == "jax":
            view = _jax_view(a)
            return view if view is not None else np.asarray(a)
        if k == "tf":
            if a.device and "CPU" not in a.device.upper():
                raise InputError(f"{name} is a TensorFlow tensor on {a.device}; polyjit takes TensorFlow's host tensors")
            return np.from_dlpack(a)
        if k == "numpy" or isinstance(a, (bool, int, float, np.generic)) or hasattr(a, "__cuda_array_interface__"):
            return a
        if hasattr(a, "__dlpack__"):
            device = _dlpack_device(a)
            if device == _DLPACK_CPU:
                return np.from_dlpack(a)
            if device == _DLPACK_CUDA:
                return _dlpack_view(a, name)
            raise InputError(f"{name} is on DLPack device type {device}; polyjit takes host and CUDA arrays")
        if hasattr(a, "__array__"):
            return np.asarray(a)
        raise InputError(f"{name} is a {type(a).__name__}; expected a numpy array, a torch tensor, a JAX array, "
                         "or an array with __dlpack__ or __cuda_array_interface__")

    def _on_gpu(self, ordinal: int, stream: int) -> None:
        self.launch = {"ordinal": ordinal, "stream": stream}

    def results(self, outs: Sequence) -> list:
        """Results as the caller's arrays: torch tensors for torch inputs (from
        numpy or by DLPack), JAX arrays for JAX inputs, else as they are."""
        if self.kind == "torch":
            torch = sys.modules["torch"]
            return [torch_from_host(o) if isinstance(o, (np.ndarray, np.generic))
                    else torch.from_dlpack(o) for o in outs]
        if self.kind == "jax":
            jax = sys.modules["jax"]
            return [_jax_array(jax, o) for o in outs]
        if self.kind == "tf":
            return [tf_from_host(o) for o in outs]
        return list(outs)


def _jax_array(jax, o):
    """A result as a JAX array: shared by DLPack (host or GPU), copied only
    where JAX will not take the memory as it is (alignment)."""
    if isinstance(o, (np.ndarray, np.generic)):
        o = np.asarray(o)
        try:
            return jax.dlpack.from_dlpack(o)
        except Exception:  # noqa: BLE001 - JAX refuses some host buffers (alignment, read-only): a copy
            return jax.device_put(o)
    return jax.dlpack.from_dlpack(o)
