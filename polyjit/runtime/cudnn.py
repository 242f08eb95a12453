"""The vendor-library floor's convolutions on the GPU: a library statement
(polyjit.library.Convolution) as a step of the launch sequence, one
cudnnConvolutionForward (or, for a weight gradient, cudnnConvolutionBackwardFilter;
for a strided convolution's input gradient, cudnnConvolutionBackwardData)
on the caller's stream.

cuDNN is found at run time as cuBLAS is (runtime.vendor: the
``libcudnn`` of NVIDIA's wheels, or ``POLYJIT_CUDNN``), bound with ctypes.
The legacy convolution API takes descriptors of any strides, so channels
first or last read the arrays as they are. Its math is restricted to FMA
kernels (float32 convolutions match eager's within float32 rounding) unless
the statement allows TF32 (compile option ``tf32``: PyTorch's eager
convolutions use it where ``torch.backends.cudnn.allow_tf32``, its default). The algorithm is cuDNN's own heuristic choice for the shape; its
workspace belongs to the step.
"""
from __future__ import annotations

import ctypes
from typing import Any, Mapping

from .. import sizes as sz
from ..errors import DeviceError
from .launch import Arg, Call, LibraryStep
from .vendor import Found, VendorLibrary

FLOAT = 0  # cudnnDataType_t
NCHW, NHWC = 0, 1  # cudnnTensorFormat_t, of a filter
CROSS_CORRELATION = 1  # cudnnConvolutionMode_t
DEFAULT_MATH, FMA_MATH = 0, 3  # cudnnMathType_t: TF32 tensor cores allowed; float32 FMA kernels only
ALGORITHMS = 8  # algorithm values (cudnnConvolutionFwdAlgo_t, ...BwdFilterAlgo_t) the heuristic may rank
ENTRIES = {  # a Convolution's operation: cuDNN's heuristic, workspace size and call, each taking (x, the other
    # operand, the convolution, the result) in the same places
    "forward": ("cudnnGetConvolutionForwardAlgorithm_v7", "cudnnGetConvolutionForwardWorkspaceSize",
                "cudnnConvolutionForward"),
    "filter": ("cudnnGetConvolutionBackwardFilterAlgorithm_v7", "cudnnGetConvolutionBackwardFilterWorkspaceSize",
               "cudnnConvolutionBackwardFilter"),
    "data": ("cudnnGetConvolutionBackwardDataAlgorithm_v7", "cudnnGetConvolutionBackwardDataWorkspaceSize",
             "cudnnConvolutionBackwardData"),
}


class _AlgoPerf(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_int), ("status", ctypes.c_int), ("time", ctypes.c_float),
                ("memory", ctypes.c_size_t), ("determinism", ctypes.c_int), ("mathType", ctypes.c_int),
                ("reserved", ctypes.c_int * 3)]


class Cudnn(VendorLibrary):
    """The cuDNN entry points a convolution step calls; a handle per device."""

    NAMES = ("cudnnCreate", "cudnnDestroy", "cudnnSetStream", "cudnnGetErrorString",
             "cudnnCreateTensorDescriptor", "cudnnSetTensorNdDescriptor", "cudnnDestroyTensorDescriptor",
             "cudnnCreateFilterDescriptor", "cudnnSetFilterNdDescriptor", "cudnnDestroyFilterDescriptor",
             "cudnnCreateConvolutionDescriptor", "cudnnSetConvolutionNdDescriptor",
             "cudnnSetConvolutionGroupCount", "cudnnSetConvolutionMathType", "cudnnDestroyConvolutionDescriptor",
             *(name for entries in ENTRIES.values() for name in entries))

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        super().__init__(path)
        for name in self.NAMES:
            fn = getattr(lib, name)
            fn.restype = ctypes.c_char_p if name == "cudnnGetErrorString" else ctypes.c_int
            setattr(self, name[5:], fn)  # cudnnCreate -> self.Create
        v, c = ctypes.c_void_p, ctypes
        self.SetStream.argtypes = [v, v]
        for algorithms, workspace, call in ENTRIES.values():  # the same arguments in each direction
            getattr(self, algorithms[5:]).argtypes = [v] * 5 + [c.c_int, c.POINTER(c.c_int), v]
            getattr(self, workspace[5:]).argtypes = [v] * 5 + [c.c_int, c.POINTER(c.c_size_t)]
            getattr(self, call[5:]).argtypes = [v] * 7 + [c.c_int, v, c.c_size_t, v, v, v]
        self.destroy = lambda h: self.Destroy(ctypes.c_void_p(h))

    def check(self, status: int, what: str) -> None:
        if status:
            raise DeviceError(f"{what} failed: cuDNN status {status} {self.GetErrorString(status).decode()}")

    def init_handle(self, h: ctypes.c_void_p) -> None:
        self.check(self.Create(ctypes.byref(h)), "cudnnCreate")

    def _descriptor(self, kind: str) -> ctypes.c_void_p:
        d = ctypes.c_void_p()
        self.check(getattr(self, f"Create{kind}Descriptor")(ctypes.byref(d)), f"cudnnCreate{kind}Descriptor")
        return d


cudnn = Found("cuDNN", "cudnn", "POLYJIT_CUDNN", ("9", "8"), Cudnn)  # () -> Cudnn | None
reset = cudnn.reset


def _ints(values) -> Any:
    return (ctypes.c_int * len(values))(*values)


class ConvStep:
    """A Convolution statement for one plan (sizes fixed): descriptors, the
    algorithm and its workspace; run(pointers, stream) queues the call."""

    def __init__(self, lib: Cudnn, dev, statement, env: Mapping[str, int], slot: Mapping[str, int]) -> None:
        from .gpu_buffers import library_workspace
        c = statement.library
        self.entries = [name[5:] for name in ENTRIES[c.operation]]  # cudnnConvolutionForward -> ConvolutionForward
        self.lib, self.device, self.what = lib, dev, f"cudnn{self.entries[2]} ({c.what or statement.name})"
        size = lambda box: [sz.evaluate(s, env) for s in box[2]]  # noqa: E731
        sp = [ch for ch in c.layout if ch not in "NC"]
        self.descriptors: list = []
        if c.operation == "forward":  # x the input, w the weight, y the output
            self.x, self.w, self.y = (self._tensor(size(c.x), c.layout, sp),
                                      self._filter(size(c.w), c.kernel_layout, sp),
                                      self._tensor(size(c.y), c.layout, sp))
        elif c.operation == "filter":  # x the input, w the output's gradient, y the weight's
            self.x, self.w, self.y = (self._tensor(size(c.x), c.layout, sp),
                                      self._tensor(size(c.w), c.gradient_layout, sp),
                                      self._filter(size(c.y), c.kernel_layout, sp))
        else:  # x the weight, w the output's gradient, y the input's
            self.x, self.w, self.y = (self._filter(size(c.x), c.kernel_layout, sp),
                                      self._tensor(size(c.w), c.gradient_layout, sp),
                                      self._tensor(size(c.y), c.layout, sp))
        n = len(sp)
        self.conv = self._made("Convolution", lib.SetConvolutionNdDescriptor, n, _ints(c.padding),
                               _ints(c.strides), _ints(c.dilation), CROSS_CORRELATION, FLOAT)
        lib.check(lib.SetConvolutionGroupCount(self.conv, c.groups), "cudnnSetConvolutionGroupCount")
        lib.check(lib.SetConvolutionMathType(self.conv, DEFAULT_MATH if c.tf32 else FMA_MATH),
                  "cudnnSetConvolutionMathType")
        self.slots = (slot[c.x[0]], slot[c.w[0]], slot[c.y[0]])
        self.algo, nbytes = self._algorithm(lib.handle(dev))
        self.workspace = library_workspace(nbytes, dev) if nbytes else None
        self.workspace_bytes = nbytes

    def _made(self, kind: str, setter, *args) -> ctypes.c_void_p:
        d = self.lib._descriptor(kind)
        self.descriptors.append((kind, d))
        self.lib.check(setter(d, *args), f"cudnnSet{kind}NdDescriptor ({self.what})")
        return d

    def _filter(self, shape: list[int], layout: str, sp: list[str]) -> ctypes.c_void_p:
        """A filter descriptor: (out channels, in channels, spatial), stored as layout ("OI..." or "O...I")."""
        return self._made("Filter", self.lib.SetFilterNdDescriptor, FLOAT, NCHW if layout[1] == "I" else NHWC,
                          len(shape), _ints([shape[layout.index(ch)] for ch in "OI" + "".join(sp)]))

    def _tensor(self, shape: list[int], layout: str, sp: list[str]) -> ctypes.c_void_p:
        """A tensor descriptor in cuDNN's dimension order (N, C, spatial) with
        the strides of the row-major array laid out as layout."""
        strides = sz.row_major(tuple(shape))
        order = ["N", "C"] + sp
        return self._made("Tensor", self.lib.SetTensorNdDescriptor, FLOAT, len(shape),
                          _ints([shape[layout.index(ch)] for ch in order]),
                          _ints([strides[layout.index(ch)] for ch in order]))

    def _algorithm(self, handle: int) -> tuple[int, int]:
        """cuDNN's first-ranked algorithm that runs, and its workspace bytes."""
        lib = self.lib
        algorithms, workspace = (getattr(lib, name) for name in self.entries[:2])
        perf, count = (_AlgoPerf * ALGORITHMS)(), ctypes.c_int()
        lib.check(algorithms(ctypes.c_void_p(handle), self.x, self.w, self.conv, self.y, ALGORITHMS,
                             ctypes.byref(count), perf), f"cudnn{self.entries[0]} ({self.what})")
        for p in perf[:count.value]:
            if p.status == 0:
                nbytes = ctypes.c_size_t()
                if workspace(ctypes.c_void_p(handle), self.x, self.w, self.conv, self.y, p.algo,
                             ctypes.byref(nbytes)) == 0:
                    return p.algo, nbytes.value
        raise DeviceError(f"{self.what}: cuDNN has no algorithm for this convolution")

    def _arguments(self, handle, x, w, y) -> tuple:
        ws = self.workspace.ptr if self.workspace is not None else None
        return (handle, self.lib.alpha, self.x, x, self.w, w, self.conv, self.algo, ws, self.workspace_bytes,
                self.lib.beta, self.y, y)

    def run(self, pointers, stream: int) -> None:
        lib = self.lib
        with lib.lock:  # the shared handle's stream
            h = ctypes.c_void_p(lib.handle(self.device))
            lib.check(lib.SetStream(h, ctypes.c_void_p(stream or None)), "cudnnSetStream")
            x, w, y = (pointers[s] for s in self.slots)
            lib.check(getattr(lib, self.entries[2])(*self._arguments(h, x, w, y)), self.what)

    def native(self, handle: int) -> LibraryStep:
        """This call as a native launcher's step, through ``handle``."""
        lib = self.lib
        address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
        ptr = lambda v: Arg("ptr", v.value if isinstance(v, ctypes.c_void_p) else (v or 0))  # noqa: E731
        h = ptr(handle)
        x, w, y = (Arg("slot", s) for s in self.slots)
        ws = self.workspace.ptr if self.workspace is not None else 0
        call = (h, ptr(lib.alpha), ptr(self.x), x, ptr(self.w), w, ptr(self.conv), Arg("i32", self.algo), ptr(ws),
                Arg("i64", self.workspace_bytes), ptr(lib.beta), ptr(self.y), y)
        return LibraryStep((Call(address(lib.SetStream), (h, Arg("stream")), f"cudnnSetStream ({self.what})"),
                            Call(address(getattr(lib, self.entries[2])), call, self.what)), "cuDNN status")

    def __del__(self) -> None:
        for kind, d in getattr(self, "descriptors", ()):
            getattr(self.lib, f"Destroy{kind}Descriptor")(d)

    def __repr__(self) -> str:
        return f"ConvStep({self.what}, algorithm {self.algo})"
