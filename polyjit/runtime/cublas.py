"""The vendor-library floor on the GPU: a library statement (polyjit.library.Gemm)
as a step of the launch sequence, calling cuBLAS's sgemm on the caller's stream.

cuBLAS is found at run time (runtime.vendor), with no framework imported:
the ``libcublas`` of NVIDIA's wheels (site-packages ``nvidia/*/lib*``) or of
the loader's path, bound with ctypes. Without it the floor is unavailable and every contraction
runs generated code. Its default math (no TF32) is kept for products, whose
results match eager's within float32 rounding; a convolution's products use
TF32 where the framework lets its convolutions do so (``Gemm.tf32``).

Row-major through the column-major library by the transposition trick: a
row-major C = op(A) @ op(B) is, read column-major, C^T = op(B)^T @ op(A)^T,
so the call takes B's operand first. The statement's loops (images, groups,
batch dimensions) become one strided batched call along the longest loop,
repeated on the host for the others (those whose strides continue the
batch's, a [b, h] batch of attention heads, join it).
"""
from __future__ import annotations

import ctypes
import glob
import itertools
import os
from dataclasses import dataclass
from typing import Any, Mapping

from .. import sizes as sz
from ..dtypes import DataType
from ..errors import DeviceError
from ..expr import Const, Expr, Op, Var
from .launch import Arg, Call, LibraryStep
from .vendor import Found, VendorLibrary

OP_N, OP_T = 0, 1  # cublasOperation_t
DEFAULT_MATH = 0  # cublasMath_t: float32 arithmetic, no TF32
TF32_MATH = 3  # CUBLAS_TF32_TENSOR_OP_MATH: a convolution's products where the framework allows TF32
CUDA_TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}  # cudaDataType_t of GemmEx's operands and result
COMPUTE_32F = 68  # cublasComputeType_t: half operands summed in float32 (on tensor cores), as eager's products
GEMM_DEFAULT = -1  # cublasGemmAlgo_t: cuBLAS's heuristic


def workspace_bytes(arch: str) -> int:
    """cuBLAS's recommended workspace: 32 MiB from Hopper on, 4 MiB before."""
    return (32 if int(arch[3:]) >= 90 else 4) << 20


class Cublas(VendorLibrary):
    """The few cuBLAS entry points the floor calls; a handle per device."""

    def __init__(self, path: str) -> None:
        folder = os.path.dirname(path)
        for lt in sorted(glob.glob(os.path.join(folder, "libcublasLt.so*")))[:1]:
            ctypes.CDLL(lt, mode=ctypes.RTLD_GLOBAL)  # where the wheel's RPATH does not name it
        lib = ctypes.CDLL(path)
        super().__init__(path)
        c = ctypes
        self.create = lib.cublasCreate_v2
        self.create.argtypes = [c.POINTER(c.c_void_p)]
        self.set_stream = lib.cublasSetStream_v2
        self.set_stream.argtypes = [c.c_void_p, c.c_void_p]
        self.set_math = lib.cublasSetMathMode
        self.set_math.argtypes = [c.c_void_p, c.c_int]
        self.gemm = lib.cublasSgemmStridedBatched
        self.gemm.argtypes = [c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int, c.c_void_p,
                              c.c_void_p, c.c_int, c.c_longlong, c.c_void_p, c.c_int, c.c_longlong,
                              c.c_void_p, c.c_void_p, c.c_int, c.c_longlong, c.c_int]
        self.gemm_ex = lib.cublasGemmStridedBatchedEx
        self.gemm_ex.argtypes = [c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int, c.c_void_p,
                                 c.c_void_p, c.c_int, c.c_int, c.c_longlong, c.c_void_p, c.c_int, c.c_int, c.c_longlong,
                                 c.c_void_p, c.c_void_p, c.c_int, c.c_int, c.c_longlong, c.c_int, c.c_int, c.c_int]
        self.set_workspace = lib.cublasSetWorkspace_v2
        self.set_workspace.argtypes = [c.c_void_p, c.c_void_p, c.c_size_t]
        self.status = getattr(lib, "cublasGetStatusString", None)
        if self.status is not None:
            self.status.restype = c.c_char_p
        self.workspaces: dict[int, Any] = {}  # device ordinal -> the workspace every call there is given
        for fn in (self.create, self.set_stream, self.set_math, self.set_workspace, self.gemm, self.gemm_ex):
            fn.restype = c.c_int
        self.destroy = lib.cublasDestroy_v2
        self.destroy.argtypes = [c.c_void_p]

    def check(self, status: int, what: str) -> None:
        if status:
            text = self.status(status).decode() if self.status is not None else ""
            raise DeviceError(f"{what} failed: cuBLAS status {status} {text}".rstrip())

    def init_handle(self, h: ctypes.c_void_p) -> None:
        """A handle of default math."""
        self.check(self.create(ctypes.byref(h)), "cublasCreate")
        self.check(self.set_math(h, DEFAULT_MATH), "cublasSetMathMode")

    def workspace(self, dev) -> tuple[int, int]:
        """The address and bytes of dev's workspace, made at first use. Every
        call is given it after its stream is set (which drops the handle's
        workspace): without one, cuBLAS allocates memory on a stream it
        first sees, which a CUDA graph being captured (XLA's command
        buffers take a custom call into a child graph) cannot hold. Calls
        on one stream take turns with it, as cuDNN's steps do with theirs."""
        with self.lock:
            if dev.ordinal not in self.workspaces:
                from .gpu_buffers import library_workspace
                self.workspaces[dev.ordinal] = library_workspace(workspace_bytes(dev.arch), dev)
            buf = self.workspaces[dev.ordinal]
            return buf.ptr, buf.nbytes


cublas = Found("cuBLAS", "cublas", "POLYJIT_CUBLAS", ("13", "12", "11"), Cublas)  # () -> Cublas | None
reset = cublas.reset


# ------------------------------------------------------------------ steps
def _value(e: Expr, env: Mapping[str, int]) -> int:
    """An index expression's value at integer iterators and sizes."""
    if isinstance(e, Const):
        return int(e.value)
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Op):
        a = [_value(x, env) for x in e.args]
        ops = {"add": lambda: a[0] + a[1], "sub": lambda: a[0] - a[1], "mul": lambda: a[0] * a[1],
               "floordiv": lambda: a[0] // a[1], "mod": lambda: a[0] % a[1], "min": lambda: min(a),
               "max": lambda: max(a)}
        if e.op in ops:
            return ops[e.op]()
    raise ValueError(f"not an integer index expression: {e}")


@dataclass(frozen=True)
class GemmCall:
    """One cublasSgemmStridedBatched of a GemmStep: the argument slots and
    element offsets of its three matrices (in the column-major call's order),
    their batch strides and the batch count."""
    slots: tuple[int, int, int]
    offsets: tuple[int, int, int]
    strides: tuple[int, int, int]
    batch: int


class GemmStep:
    """A library statement's calls for one plan (sizes fixed): run(pointers,
    stream) queues them on stream, pointers being the plan's argument slots."""

    def __init__(self, lib: Cublas, dev, statement, env: Mapping[str, int], arrays: Mapping[str, Any],
                 slot: Mapping[str, int]) -> None:
        g = statement.library
        # half operands: GemmEx with their types, a float32 sum (None: sgemm)
        self.types = None if g.dtype == g.out_dtype == "float32" else (CUDA_TYPES[g.dtype], CUDA_TYPES[g.out_dtype])
        call = "cublasGemmStridedBatchedEx" if self.types else "cublasSgemmStridedBatched"
        self.lib, self.device, self.what = lib, dev, f"{call} ({g.what or statement.name})"
        self.itemsizes = (DataType(g.dtype).itemsize,) * 2 + (DataType(g.out_dtype).itemsize,)  # (b, a, c)
        size = lambda s: sz.evaluate(s, env)  # noqa: E731
        m, n, k = size(g.m), size(g.n), size(g.k)
        self.shape = (OP_T if g.trans_b else OP_N, OP_T if g.trans_a else OP_N, n, m, k)
        self.math = TF32_MATH if g.tf32 else DEFAULT_MATH
        self.lds = (size(g.ldb), size(g.lda), size(g.ldc))
        boxes = (g.b, g.a, g.c)
        strides = [sz.row_major(tuple(size(s) for s in arrays[box[0]].shape)) for box in boxes]
        iters = list(statement.iters)
        trips = [(size(lo), size(hi)) for lo, hi in statement.bounds]

        def offsets(point: dict) -> tuple[int, ...]:
            full = {**env, **point}
            return tuple(sum(_value(x, full) * st for x, st in zip(box[1], stride))
                         for box, stride in zip(boxes, strides))
        first = {it: lo for it, (lo, _) in zip(iters, trips)}
        base = offsets(first)
        steps = {it: tuple(b - a for a, b in zip(base, offsets({**first, it: lo + 1})))
                 for it, (lo, _) in zip(iters, trips)}  # the offsets are affine in the iterators
        counts = {it: max(hi - lo, 0) for it, (lo, hi) in zip(iters, trips)}
        along = max(iters, key=lambda it: counts[it]) if iters else None
        others = [it for it in iters if it != along]
        while along is not None:  # loops that continue the batch's strides join it (a [b, h] batch of heads)
            outer = next((it for it in others if steps[it] == tuple(x * counts[along] for x in steps[along])), None)
            inner = next((it for it in others if steps[along] == tuple(x * counts[it] for x in steps[it])), None)
            if outer is None and inner is None:
                break
            joined = outer if outer is not None else inner
            others.remove(joined)
            counts[along] *= counts[joined]
            if joined == inner:
                steps[along] = steps[inner]
        self.calls: list[GemmCall] = []
        if not all(counts.values()) or min(m, n) <= 0:
            return
        for point in itertools.product(*(range(counts[it]) for it in others)):
            off = [b + sum(p * steps[it][q] for it, p in zip(others, point)) for q, b in enumerate(base)]
            self.calls.append(GemmCall(tuple(slot[box[0]] for box in boxes), tuple(off),
                                    steps[along] if along else (0, 0, 0), counts[along] if along else 1))

    def run(self, pointers, stream: int) -> None:
        lib = self.lib
        ta, tb, m, n, k = self.shape
        lda, ldb, ldc = self.lds
        space, nbytes = lib.workspace(self.device)
        with lib.lock:  # the handles (made once) and their stream are shared state
            h = lib.handle(self.device)
            lib.check(lib.set_stream(h, stream or None), "cublasSetStream")
            lib.check(lib.set_workspace(h, space, nbytes), "cublasSetWorkspace")
            lib.check(lib.set_math(h, self.math), "cublasSetMathMode")
            for c in self.calls:
                a, b, out = (pointers[s] + size * o for s, o, size in zip(c.slots, c.offsets, self.itemsizes))
                if self.types:
                    ab, ct = self.types
                    lib.check(lib.gemm_ex(h, ta, tb, m, n, k, lib.alpha, a, ab, lda, c.strides[0], b, ab, ldb,
                                          c.strides[1], lib.beta, out, ct, ldc, c.strides[2], c.batch, COMPUTE_32F,
                                          GEMM_DEFAULT), self.what)
                    continue
                lib.check(lib.gemm(h, ta, tb, m, n, k, lib.alpha, a, lda, c.strides[0], b, ldb, c.strides[1],
                                   lib.beta, out, ldc, c.strides[2], c.batch), self.what)

    def native(self, handle: int) -> LibraryStep:
        """These calls as a native launcher's step, through ``handle``."""
        lib = self.lib
        address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
        i32 = lambda v: Arg("i32", v)  # noqa: E731
        ta, tb, m, n, k = self.shape
        lda, ldb, ldc = self.lds
        h, alpha, beta = Arg("ptr", handle), Arg("ptr", lib.alpha), Arg("ptr", lib.beta)
        space, nbytes = lib.workspace(self.device)
        calls = [Call(address(lib.set_stream), (h, Arg("stream")), f"cublasSetStream ({self.what})"),
                 Call(address(lib.set_workspace), (h, Arg("ptr", space), Arg("i64", nbytes)),
                      f"cublasSetWorkspace ({self.what})"),
                 Call(address(lib.set_math), (h, i32(self.math)), f"cublasSetMathMode ({self.what})")]
        for c in self.calls:
            a, b, out = (Arg("slot", s, size * o) for s, o, size in zip(c.slots, c.offsets, self.itemsizes))
            sa, sb, sc = (Arg("i64", x) for x in c.strides)
            if self.types:
                ab, ct = (i32(t) for t in self.types)
                args = (h, i32(ta), i32(tb), i32(m), i32(n), i32(k), alpha, a, ab, i32(lda), sa, b, ab, i32(ldb), sb,
                        beta, out, ct, i32(ldc), sc, i32(c.batch), i32(COMPUTE_32F), i32(GEMM_DEFAULT))
                calls.append(Call(address(lib.gemm_ex), args, self.what))
                continue
            calls.append(Call(address(lib.gemm), (h, i32(ta), i32(tb), i32(m), i32(n), i32(k), alpha, a, i32(lda), sa,
                                                  b, i32(ldb), sb, beta, out, i32(ldc), sc, i32(c.batch)), self.what))
        return LibraryStep(tuple(calls), "cuBLAS status")

    def __repr__(self) -> str:
        return f"GemmStep({self.what}, {len(self.calls)} calls)"

