"""XLA's FFI (its C API for custom calls, ``xla/ffi/api/c_api.h``) for
handlers written in Python: ``register`` makes a ctypes callback an XLA
custom-call target, so that a jitted JAX program calls polyjit's kernels
on XLA's own stream and buffers, with no DLPack exchange per result.

Only what a handler needs is declared: the call frame, its argument and
result buffers, the API table's first entries (errors, the stream) and the
metadata extension XLA queries once when the target is registered.
"""
from __future__ import annotations

import ctypes
import traceback
from typing import Callable, Sequence

import jax

c = ctypes
METADATA_EXTENSION = 1  # XLA_FFI_Extension_Metadata
ERROR_UNKNOWN = 2  # XLA_FFI_Error_Code_UNKNOWN
API_VERSION = (0, 1)  # the FFI API version these declarations follow


class _Extension(c.Structure):
    pass


_Extension._fields_ = [("struct_size", c.c_size_t), ("type", c.c_int), ("next", c.POINTER(_Extension))]


class _Version(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("extension_start", c.c_void_p),
                ("major", c.c_int), ("minor", c.c_int)]


class _Metadata(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("api_version", _Version), ("traits", c.c_uint32)]


class _MetadataExtension(c.Structure):
    _fields_ = [("base", _Extension), ("metadata", c.POINTER(_Metadata))]


class _Buffer(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("extension_start", c.c_void_p), ("dtype", c.c_int),
                ("data", c.c_void_p), ("rank", c.c_int64), ("dims", c.POINTER(c.c_int64))]


class _List(c.Structure):  # XLA_FFI_Args and XLA_FFI_Rets
    _fields_ = [("struct_size", c.c_size_t), ("extension_start", c.c_void_p), ("size", c.c_int64),
                ("types", c.POINTER(c.c_int)), ("items", c.POINTER(c.POINTER(_Buffer)))]


class _Attrs(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("extension_start", c.c_void_p), ("size", c.c_int64),
                ("types", c.c_void_p), ("names", c.c_void_p), ("attrs", c.c_void_p)]


class _ErrorArgs(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("extension_start", c.c_void_p),
                ("message", c.c_char_p), ("code", c.c_int)]


class _StreamArgs(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("extension_start", c.c_void_p),
                ("ctx", c.c_void_p), ("stream", c.c_void_p)]


class _Api(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("extension_start", c.c_void_p), ("api_version", _Version),
                ("internal_api", c.c_void_p),
                ("error_create", c.CFUNCTYPE(c.c_void_p, c.POINTER(_ErrorArgs))),
                ("error_get_message", c.c_void_p), ("error_destroy", c.c_void_p), ("handler_register", c.c_void_p),
                ("stream_get", c.CFUNCTYPE(c.c_void_p, c.POINTER(_StreamArgs)))]


class _CallFrame(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("extension_start", c.POINTER(_Extension)), ("api", c.POINTER(_Api)),
                ("ctx", c.c_void_p), ("stage", c.c_int), ("args", _List), ("rets", _List), ("attrs", _Attrs),
                ("future", c.c_void_p)]


_HANDLER_T = c.CFUNCTYPE(c.c_void_p, c.POINTER(_CallFrame))
_handlers: list = []  # registered callbacks stay alive with the process, as XLA's registry does


def register(name: str, platform: str, run: Callable[[Sequence[int], Sequence[int], int | None], None]) -> None:
    """Make ``run(argument pointers, result pointers, stream)`` the custom-call
    target ``name`` on ``platform`` ("CUDA" or "cpu"); its exceptions become
    XLA errors carrying their message."""
    def handler(frame_ptr):
        frame = frame_ptr.contents
        ext = frame.extension_start
        if ext and ext.contents.type == METADATA_EXTENSION:  # XLA asks which API the handler speaks
            meta = c.cast(ext, c.POINTER(_MetadataExtension)).contents.metadata.contents
            meta.api_version.major, meta.api_version.minor = API_VERSION
            meta.traits = 0  # not for command buffers: each call is planned in Python
            return None
        try:
            args = [frame.args.items[i].contents.data or 0 for i in range(frame.args.size)]
            rets = [frame.rets.items[i].contents.data or 0 for i in range(frame.rets.size)]
            stream = None
            if platform != "cpu":
                query = _StreamArgs(c.sizeof(_StreamArgs), None, frame.ctx, None)
                if frame.api.contents.stream_get(c.byref(query)):
                    raise RuntimeError("XLA gave no stream for the call")
                stream = query.stream or 0
            run(args, rets, stream)
            return None
        except Exception as err:  # noqa: BLE001 (reported to XLA, which raises it in the caller)
            message = f"polyjit custom call {name}: {type(err).__name__}: {err}\n{traceback.format_exc()}"
            error = _ErrorArgs(c.sizeof(_ErrorArgs), None, message.encode(), ERROR_UNKNOWN)
            return frame.api.contents.error_create(c.byref(error))

    callback = _HANDLER_T(handler)
    _handlers.append(callback)
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(c.cast(callback, c.c_void_p).value), platform=platform)
