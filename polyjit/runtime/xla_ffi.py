"""XLA's FFI (its C API for custom calls, ``xla/ffi/api/c_api.h``):
``handler`` builds the native function through which XLA calls a native
launch function as a custom-call target, so that a jitted JAX program runs
polyjit's kernels on XLA's own stream and buffers, with no DLPack exchange
per result and no Python per call (the handler, like the launch function,
is built with llvmlite). The JAX frontend registers it with JAX
(``jax.ffi.register_ffi_target``); this module imports no framework.

Only what a handler needs is declared: the call frame, its argument and
result buffers, the API table's first entries (errors, the stream) and the
metadata extension XLA queries once when the target is registered.

A handler reads the launch function's address from a global of its module,
set as it loads: its machine code depends only on the platform and the
buffer counts, and the compile cache keeps it, as it keeps launchers'.
"""
from __future__ import annotations

import ctypes

from llvmlite import ir

from ..collector import collector_paused
from ..codegen.program import LoadedProgram, cached_host_object
from .launch import string_constant

c = ctypes
METADATA_EXTENSION = 1  # XLA_FFI_Extension_Metadata
ERROR_UNKNOWN = 2  # XLA_FFI_Error_Code_UNKNOWN
API_VERSION = (0, 1)  # the FFI API version these declarations follow
COMMAND_BUFFER_COMPATIBLE = 1  # XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE


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


MESSAGE_BYTES = 1024
ENTRY = "polyjit_ffi_handler"  # the handler's name (a module of its own in an engine of its own)
LAUNCH = f"{ENTRY}.launch"  # the global holding the launch function's address
_handlers: list = []  # registered handlers stay alive with the process, as XLA's registry does


def handler(name: str, platform: str, launch: int, args: int, rets: int, owner=None, cached: bool = False) -> int:
    """The address of a native XLA FFI handler for the custom-call target
    ``name`` that calls the C function at address ``launch`` on ``platform``
    ("CUDA" or "cpu"), as

        int32_t launch(void **args, void **rets, void *stream, char *message, size_t size)

    with the ``args`` argument and ``rets`` result buffers' pointers in call
    order and XLA's CUDA stream (NULL on the CPU); a nonzero return becomes an
    XLA error carrying the message it wrote. The handler is native code too,
    so a call runs no Python. It lives, with ``owner``, as long as the process
    (XLA keeps every registered target). With ``cached``, its machine code is
    looked for in the compile cache first, and kept there."""
    with collector_paused():  # (a compile's work, in a process of many objects: collector.py)
        code, _ = cached_host_object("ffi_handler", (platform, args, rets) if cached else None,
                                     lambda: str(_handler_module(platform, args, rets)))
        loaded = LoadedProgram([code])
    ctypes.c_uint64.from_address(loaded.engine.get_global_value_address(LAUNCH)).value = launch
    _handlers.append((loaded, owner))
    return loaded.engine.get_function_address(ENTRY)


def _offset(struct, *fields: str) -> int:
    """The byte offset of a nested field: _offset(_CallFrame, "args", "items")."""
    total = 0
    for f in fields:
        total += getattr(struct, f).offset
        struct = dict(struct._fields_)[f]
    return total


I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
PTR = I8.as_pointer()
NULL = ir.Constant(PTR, None)


def _handler_module(platform: str, args: int, rets: int) -> ir.Module:
    """XLA_FFI_Error *ENTRY(XLA_FFI_CallFrame *frame): answers XLA's metadata
    query, checks the buffer counts, reads the buffers' pointers and the
    stream, calls the function at LAUNCH and turns its failure into an XLA
    error."""
    h = _Handler(ENTRY)
    b, frame = h.b, h.frame
    message = b.bitcast(b.alloca(ir.ArrayType(I8, MESSAGE_BYTES)), PTR)
    api = h.load(frame, _offset(_CallFrame, "api"))
    h.answer_metadata(COMMAND_BUFFER_COMPATIBLE if platform != "cpu" else 0)
    lists = [h.buffers(api, which, count) for which, count in (("args", args), ("rets", rets))]
    stream = h.stream(api) if platform != "cpu" else NULL
    run_type = ir.FunctionType(I32, [PTR.as_pointer(), PTR.as_pointer(), PTR, PTR, I64]).as_pointer()
    where = ir.GlobalVariable(h.mod, run_type, LAUNCH)
    where.initializer = ir.Constant(run_type, None)
    run = b.load(where)
    code = b.call(run, [*lists, stream, message, ir.Constant(I64, MESSAGE_BYTES)])
    with b.if_then(b.icmp_unsigned("!=", code, ir.Constant(I32, 0)), likely=False):
        h.error(api, message)
    b.ret(NULL)
    return h.mod


class _Handler:
    """A handler's IR being built: XLA's structs read and written at their
    ctypes declarations' offsets."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mod = ir.Module(name=name)
        fn = ir.Function(self.mod, ir.FunctionType(PTR, [PTR]), name)
        self.frame, = fn.args
        self.b = ir.IRBuilder(fn.append_basic_block("entry"))

    def at(self, base, offset: int, ty: ir.Type) -> ir.Value:
        """A typed pointer to base + offset bytes."""
        return self.b.bitcast(self.b.gep(base, [ir.Constant(I64, offset)]), ty.as_pointer())

    def load(self, base, offset: int, ty: ir.Type = PTR) -> ir.Value:
        return self.b.load(self.at(base, offset, ty))

    def struct(self, kind, *values: tuple[str, ir.Value]) -> ir.Value:
        """A zeroed struct on the stack, its size and these fields set."""
        b = self.b
        place = b.alloca(ir.ArrayType(I64, -(-c.sizeof(kind) // 8)))
        b.store(ir.Constant(place.type.pointee, None), place)
        raw = b.bitcast(place, PTR)
        b.store(ir.Constant(I64, c.sizeof(kind)), self.at(raw, 0, I64))
        for field, v in values:
            b.store(v, self.at(raw, _offset(kind, field), v.type))
        return raw

    def error(self, api: ir.Value, text: ir.Value) -> None:
        """Return XLA's error carrying text."""
        create = self.load(api, _offset(_Api, "error_create"))
        args = self.struct(_ErrorArgs, ("message", text), ("code", ir.Constant(I32, ERROR_UNKNOWN)))
        self.b.ret(self.b.call(self.b.bitcast(create, ir.FunctionType(PTR, [PTR]).as_pointer()), [args]))

    def text(self, value: str) -> ir.Value:
        return string_constant(self.mod, f"{self.name}.s{len(self.mod.global_values)}", value).bitcast(PTR)

    def answer_metadata(self, traits: int) -> None:
        """XLA asks once, at registration, which API version the handler
        speaks and its traits. A GPU handler may be captured into XLA's CUDA
        graphs (command buffers): its launcher only queues work on XLA's
        stream, with buffers fixed for the call."""
        b = self.b
        ext = self.load(self.frame, _offset(_CallFrame, "extension_start"))
        with b.if_then(b.icmp_unsigned("!=", ext, NULL), likely=False):
            with b.if_then(b.icmp_unsigned("==", self.load(ext, _offset(_Extension, "type"), I32),
                                           ir.Constant(I32, METADATA_EXTENSION))):
                meta = self.load(ext, _offset(_MetadataExtension, "metadata"))
                for field, v in zip(("major", "minor"), API_VERSION):
                    b.store(ir.Constant(I32, v), self.at(meta, _offset(_Metadata, "api_version", field), I32))
                b.store(ir.Constant(I32, traits), self.at(meta, _offset(_Metadata, "traits"), I32))
                b.ret(NULL)

    def buffers(self, api: ir.Value, which: str, count: int) -> ir.Value:
        """The data pointers of the call's ``which`` (args or rets) buffers, as
        an array on the stack, once their number is checked."""
        b = self.b
        size = self.load(self.frame, _offset(_CallFrame, which, "size"), I64)
        with b.if_then(b.icmp_unsigned("!=", size, ir.Constant(I64, count)), likely=False):
            self.error(api, self.text(f"polyjit custom call: XLA passed a number of {which} other than {count}"))
        items = self.load(self.frame, _offset(_CallFrame, which, "items"))
        pointers = b.alloca(PTR, max(count, 1))
        for k in range(count):
            buffer = self.load(items, 8 * k)
            b.store(self.load(buffer, _offset(_Buffer, "data")), b.gep(pointers, [ir.Constant(I32, k)]))
        return pointers

    def stream(self, api: ir.Value) -> ir.Value:
        """XLA's stream for this call (XLA's error returned if it has none)."""
        b = self.b
        query = self.struct(_StreamArgs, ("ctx", self.load(self.frame, _offset(_CallFrame, "ctx"))))
        get = b.bitcast(self.load(api, _offset(_Api, "stream_get")), ir.FunctionType(PTR, [PTR]).as_pointer())
        failed = b.call(get, [query])
        with b.if_then(b.icmp_unsigned("!=", failed, NULL), likely=False):
            b.ret(failed)
        return self.load(query, _offset(_StreamArgs, "stream"))
