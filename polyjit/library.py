"""A vendor-library floor under generated contractions (cpu; nvgpu in polyjit.runtime.cublas and .cudnn).

Where, for a convolution's shape, polyjit's generated loop nest loses to
BLAS, the convolution lowers to an im2col statement (generated, so that
the ops before it fuse into it) and one ``sgemm`` statement per image and
group, a call into the process's BLAS (bound by address, no framework
imported: MKL where a loaded library exports it or numpy's OpenBLAS,
whichever is faster on one thread of the host).
The statement reads and writes boxes of its arrays, so isl orders it with
the rest of the program like any statement; the ops after it read its
result in generated kernels.

``contractions`` in the compile options picks: ``"generated"``, ``"library"``
or ``"auto"`` (per shape, the library unless a quick timing of both finds
generated code faster by GENERATED_MARGIN, measured once per process).
"""
from __future__ import annotations

import ctypes
import dataclasses
import glob
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from . import expr as E
from . import sizes as sz
from .affine import TAPS, loop_nest
from .dtypes import DataType
from .errors import UnsupportedOpError
from .expr import Expr
from .graph import free_dims
from .sizes import Size

log = logging.getLogger("polyjit.library")

Box = tuple[str, tuple[Expr, ...], tuple[Size, ...]]  # array, first element, extents


class LibraryCall:
    """What the scheduler asks of a library call: the boxes of its arrays it
    reads (fields READS) and writes (field WRITES), and the call over renamed arrays."""

    READS: ClassVar[tuple[str, ...]] = ()
    WRITES: ClassVar[str] = ""

    def renamed(self, rename):
        """This call over the arrays rename(name) names (a group problem's own)."""
        return dataclasses.replace(self, **{f: (rename(getattr(self, f)[0]), *getattr(self, f)[1:])
                                            for f in (*self.READS, self.WRITES)})

    def written(self) -> Box:
        return getattr(self, self.WRITES)

    def read(self) -> list[Box]:
        return [getattr(self, f) for f in self.READS]


@dataclass(frozen=True)
class Gemm(LibraryCall):
    """C = op(A) @ op(B) over boxes of arrays (row-major sgemm). The parts of
    a parallel kernel share the dimension `split` ("m" or "n"): each calls
    sgemm on its strip, the operands advanced by `steps` elements per row or
    column of the strip."""

    a: Box
    b: Box
    c: Box
    m: Size
    n: Size
    k: Size
    lda: Size
    ldb: Size
    ldc: Size
    trans_a: bool
    trans_b: bool
    split: str
    steps: tuple[int | Size, int | Size, int | Size]
    what: str = dataclasses.field(default="", repr=False, compare=False)  # not structure: like calls share code
    tf32: bool = False  # operands may round to TF32 where the framework lets its convolutions or products (cuBLAS)
    dtype: str = "float32"  # the operands' DataType value (half types: cuBLAS's GemmEx, summing in float32)
    out_dtype: str = "float32"  # the result's
    READS: ClassVar[tuple[str, ...]] = ("a", "b")
    WRITES: ClassVar[str] = "c"

    def __str__(self) -> str:
        return (f"sgemm({'T' if self.trans_a else 'N'}{'T' if self.trans_b else 'N'}, m={self.m}, n={self.n}, "
                f"k={self.k}, {self.a[0]}, {self.b[0]}, {self.c[0]})")


@dataclass(frozen=True)
class Convolution(LibraryCall):
    """y = conv(x, w) in one library call on whole arrays (cuDNN on the GPU):
    x and y laid out as ``layout`` (N, C and spatial letters), w as
    ``kernel_layout`` ("OI" or "O...I" around the same spatial letters);
    symmetric ``padding`` per spatial dimension. ``operation`` "filter" is
    that convolution's backward filter instead: w holds the gradient of its
    output (laid out as ``gradient_layout``), y the weight's gradient (laid
    out as ``kernel_layout``); "data" its backward data: x holds the weight,
    w the gradient of the output, y the input's gradient."""

    x: Box
    w: Box
    y: Box
    layout: str
    kernel_layout: str
    strides: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    tf32: bool  # the library may round operands to TF32 (as the framework's eager convolutions do)
    what: str = dataclasses.field(default="", repr=False, compare=False)
    operation: str = "forward"  # or "filter", "data"
    gradient_layout: str = ""  # "filter" and "data": w's
    READS: ClassVar[tuple[str, ...]] = ("x", "w")
    WRITES: ClassVar[str] = "y"

    def __str__(self) -> str:
        op = ("convolution" if self.operation == "forward"
              else f"convolution_{self.operation}({self.gradient_layout}) of ")
        return (f"{op}({self.layout}/{self.kernel_layout}, strides {list(self.strides)}, padding "
                f"{list(self.padding)}, dilation {list(self.dilation)}, groups {self.groups}, "
                f"{'tf32' if self.tf32 else 'fp32'}, {self.x[0]}, "
                f"{self.w[0]}, {self.y[0]})")


CALLS = (Gemm, Convolution)  # the library calls a statement may hold: the compile cache writes and reads back these


# ------------------------------------------------------------------ BLAS
_blas: Any = False
_blas_lock = threading.Lock()


def blas() -> "Blas | None":
    """The process's BLAS, looked for once: MKL where a library already
    loaded exports it (PyTorch's CPU wheels link it into libtorch_cpu),
    numpy's OpenBLAS (ILP64, scipy_ prefixed symbols), or None. Where both
    are at hand, the faster on one thread at a product of BLAS_PROBE's
    sizes, timed once (neither wins on every host: MKL on an AVX-512 EPYC,
    OpenBLAS on an AVX2 one, bench/NOTES.md). ``POLYJIT_BLAS=openblas`` or
    ``mkl`` picks one."""
    global _blas
    with _blas_lock:  # (two threads compiling at once see one choice)
        if _blas is False:
            wanted = os.environ.get("POLYJIT_BLAS", "").lower()
            if wanted not in ("", "mkl", "openblas"):
                log.warning("POLYJIT_BLAS=%s: not 'mkl' or 'openblas'; ignored", wanted)
            found = [lib for lib in (None if wanted == "openblas" else _loaded_mkl(),
                                     None if wanted == "mkl" else _numpy_openblas()) if lib is not None]
            _blas = (found[0] if len(found) == 1 else _faster(*found)) if found else None
            log.debug("BLAS: %s", _blas)
    return _blas


ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112  # cblas's enums
BLAS_PROBE = (192, 256, 512)  # m, k, n of the product blas() times each library at
_clock = time.perf_counter  # (what _faster times with)


def _faster(first: "Blas", second: "Blas", rounds: int = 5) -> "Blas":
    """Of two libraries, the one whose sgemm on one thread (as each part of
    a library statement calls it) takes less time, each timed at its best of
    rounds turns taken in alternation; first where the timing fails."""
    m, k, n = BLAS_PROBE
    a, b, c = ((ctypes.c_float * size)() for size in (m * k, k * n, m * n))
    best = {}
    try:
        for _ in range(rounds):
            for lib in (first, second):
                t = _clock()
                _sgemm(lib, m, n, k, a, b, c)
                best[lib] = min(best.get(lib, math.inf), _clock() - t)
    except Exception as e:  # (never a user's error: the library found first, as before the timing)
        log.warning("timing the BLAS libraries failed (%s: %s); calling %s", type(e).__name__, e, first.path)
        return first
    log.debug("BLAS on one thread: %s", {lib.path: f"{s * 1e3:.3f} ms" for lib, s in best.items()})
    return first if best[first] <= best[second] else second


def _sgemm(lib: "Blas", m: int, n: int, k: int, a, b, c) -> None:
    """c (m x n) = a (m x k) @ b (k x n), row-major float32 buffers, by lib's
    sgemm on the calling thread alone."""
    local = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(lib.set_threads_local) if lib.set_threads_local else None
    before = local(1) if local else None
    try:
        if lib.fortran:  # column-major: c^T = b^T a^T, every argument by address
            ref = ctypes.byref
            i, f, ch = ctypes.c_int32, ctypes.c_float, ctypes.c_char
            ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 13)(lib.sgemm)(
                ref(ch(b"N")), ref(ch(b"N")), ref(i(n)), ref(i(m)), ref(i(k)), ref(f(1.0)), ctypes.addressof(b),
                ref(i(n)), ctypes.addressof(a), ref(i(k)), ref(f(0.0)), ctypes.addressof(c), ref(i(n)))
        else:
            size = ctypes.c_int64 if lib.int_bits == 64 else ctypes.c_int32
            ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, size, size, size, ctypes.c_float,
                             ctypes.c_void_p, size, ctypes.c_void_p, size, ctypes.c_float, ctypes.c_void_p, size)(
                lib.sgemm)(ROW_MAJOR, NO_TRANS, NO_TRANS, m, n, k, 1.0, ctypes.addressof(a), k,
                           ctypes.addressof(b), n, 0.0, ctypes.addressof(c), n)
    finally:
        if local:
            local(before)


def _loaded_mkl() -> "Blas | None":
    """MKL's sgemm_ (Fortran, LP64) in a shared library this process has
    already loaded; never loads one."""
    spans: dict[str, list[tuple[int, int]]] = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                if len(fields) == 6 and ".so" in fields[5]:
                    lo, hi = (int(v, 16) for v in fields[0].split("-"))
                    spans.setdefault(fields[5], []).append((lo, hi))
    except OSError:
        return None
    for path, mapped in spans.items():
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
        except OSError:
            continue
        sgemm, local = (getattr(lib, name, None) for name in ("sgemm_", "MKL_Set_Num_Threads_Local"))
        # (a library's lookup also finds its dependencies' symbols: the one that holds them names it)
        if sgemm is not None and local is not None and any(lo <= _address(sgemm) < hi for lo, hi in mapped):
            return Blas(path, _address(sgemm), _address(local), 32, fortran=True)
    return None


def _numpy_openblas() -> "Blas | None":
    try:
        import numpy
        base = os.path.dirname(os.path.dirname(numpy.__file__))
        for path in sorted(glob.glob(os.path.join(base, "numpy.libs", "libscipy_openblas*.so*"))
                           + glob.glob(os.path.join(base, "scipy_openblas*", "lib", "lib*openblas*.so*"))):
            lib = ctypes.CDLL(path)
            for prefix, suffix in (("scipy_", "64_"), ("scipy_", ""), ("", "")):
                fn = getattr(lib, f"{prefix}cblas_sgemm{suffix}", None)
                if fn is not None:
                    local = getattr(lib, "openblas_set_num_threads_local", None)
                    return Blas(path, _address(fn), _address(local) if local else None,
                                64 if suffix == "64_" else 32)
    except (ImportError, OSError) as e:
        log.debug("no OpenBLAS: %s", e)
    return None


@dataclass(frozen=True)
class Blas:
    path: str
    sgemm: int  # address of cblas_sgemm, or of sgemm_ where fortran
    set_threads_local: int | None  # its C call setting this thread's thread count (1 per calling thread)
    int_bits: int  # 64 for an ILP64 build
    fortran: bool = False  # sgemm_: column-major, every argument by address (MKL's exported form)


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


# ---------------------------------------------------------------- choice
_measured: dict[tuple, tuple[bool, float, float]] = {}
_built: dict[tuple, object] = {}  # programs prefetch() compiled for measure(), by (key, mode)
MIN_REDUCTION = 16  # shorter reductions (depthwise, a few input channels) are stencils: generated
MIN_OUT_CHANNELS = 8
MIN_MACS = 1 << 20  # multiply-adds below which either way is quick: generated, not worth timing
# Generated code replaces the library where timed alone it takes at most this fraction of the library's
# time. Alone, an operand the model reads from memory stays in cache: a classifier's 5 MB weight, read
# twice by AVX2's register blocks, timed 0.46 ms generated against the library's 0.52, and took 1.47 ms
# against 0.68 in MobileNetV2. Ties also go to the library: a choice that flipped with the host's noise
# changed the program, and a second process missed the compile cache.
GENERATED_MARGIN = 0.8


class LibraryPolicy:
    """Decides, per convolution, generated code or the library; records why."""

    def __init__(self, mode: str, threads: int, target, tf32: bool = False, matmul_tf32: bool = False) -> None:
        self.mode, self.threads, self.target = mode, threads, target  # a polyjit.targets.Target
        self.tf32 = tf32  # convolutions may use TF32 tensor cores
        self.matmul_tf32 = matmul_tf32  # products (dot_general) may too
        self.choices: list[str] = []
        self._wanted: dict | None = None  # while prefetching: the timings use() asks for

    def prefetch(self, L, nodes) -> None:
        """Compile, all at once, the programs that use() will time for nodes:
        two threads build them, so that LLVM (on its own thread) works on one
        while isl and Python build the next; nothing runs while they compile."""
        self._wanted, choices, self.choices = {}, self.choices, []
        try:
            for n in nodes:
                self.use(L, n)
        finally:
            wanted, self._wanted, self.choices = self._wanted, None, choices
        jobs = [(key, mode, spec) for key, spec in wanted.items() for mode in ("library", "generated")]
        if len(jobs) > 2:
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(2, thread_name_prefix="polyjit-measure") as pool:
                built = list(pool.map(lambda j: _single(*j[2], j[1], self.threads), jobs))
            for (key, mode, _), exe in zip(jobs, built):
                _built[key, mode] = exe

    def available(self) -> bool:
        """Whether the target's library loads: cuBLAS on nvgpu, BLAS on the cpu."""
        return self.target.library_available()

    def use(self, L, n) -> bool:
        """Whether contraction n (a conv or dot_general) runs in the library."""
        if "input_dilation" in n.attrs:  # (kept whole by the target only where its library takes it)
            if backward_data(n) is None or self.mode == "generated":
                raise UnsupportedOpError(f"conv {n.id}: an input dilation no library call takes (targets expand it)")
            self.choices.append(f"{n.op} {list(L.shape(n.inputs[0]))} spread: library (backward data)")
            return True
        ok = FORM[n.op](L, n) is not None
        if not ok or self.mode == "generated" or not self.available():
            return False
        xs, ws = L.shape(n.inputs[0]), L.shape(n.inputs[1])
        what = f"{n.op} {list(xs)} * {list(ws)}" + (f" groups {n.attrs['groups']}" if "groups" in n.attrs else "")
        if self.mode == "library":
            self.choices.append(f"{what}: library (forced)")
            return True
        red, stencil = REDUCTION[n.op](n, xs, ws)
        if stencil:
            self.choices.append(f"{what}: generated ({stencil})")
            return False
        known = self.target.known_choice(L, n) if self.target.times_library else None
        if not all(map(sz.is_static, xs + L.shape(n))):
            lib, why = known or (True, "symbolic sizes")
            self.choices.append(f"{what}: {'library' if lib else 'generated'} ({why})")
            return lib
        macs = math.prod(int(s) for s in L.shape(n)) * red
        if macs < MIN_MACS and not (known and known[0]):  # (the target's model may know the library wins)
            self.choices.append(f"{what}: generated ({macs} multiply-adds)")
            return False
        if not self.target.times_library:  # a model: timing would compile each shape's kernel (seconds) on a GPU
            self.choices.append(f"{what}: library ({self.target.library}: {macs} multiply-adds, reduction {red})")
            return True
        if known is not None:  # the target's model: no timing
            self.choices.append(f"{what}: {'library' if known[0] else 'generated'} ({known[1]})")
            return known[0]
        lib, t_lib, t_gen = self.measure(L, n)
        self.choices.append(f"{what}: {'library' if lib else 'generated'} "
                            f"(library {t_lib * 1e3:.3f} ms, generated {t_gen * 1e3:.3f} ms)")
        return lib

    def measure(self, L, n) -> tuple[bool, float, float]:
        """Time the contraction alone both ways (once per shape, operand
        layout and thread count): its operands as the program holds them,
        arrays read through the transposes n reads them by, the copies
        packed for generated register blocks among them (the library reads
        through those in place: a Linear's weight, packed at each call for
        the generated nest, cost it 0.24 ms of 1.8 at 256x1024)."""
        bases, ins = [], []
        for i in n.inputs:
            chain = []
            while (i.is_index_transpose or i.attrs.get("packed")) and i.id not in L.array_of:
                chain.append(i.attrs["perm"])
                i = i.inputs[0]
            bases.append((tuple(int(s) for s in L.shape(i)), i.dtype))
            ins.append(tuple(chain))
        key = (n.op, tuple(bases), tuple(ins), tuple(sorted((k, str(v)) for k, v in n.attrs.items())), self.threads)
        if self._wanted is not None:  # (prefetching: what to compile, no decision yet)
            if key not in _measured:
                self._wanted[key] = (n, bases, ins, tuple(L.shape(n)))
            return False, 0.0, 0.0
        if key not in _measured:
            import numpy as np
            rng = np.random.default_rng(0)
            args = [rng.standard_normal(shape).astype(dt.numpy) for shape, dt in bases]
            exes = [_built.pop((key, mode), None) or _single(n, bases, ins, tuple(L.shape(n)), mode, self.threads)
                    for mode in ("library", "generated")]
            t_lib, t_gen = _time(exes, args)
            _measured[key] = (t_gen > GENERATED_MARGIN * t_lib, t_lib, t_gen)
        return _measured[key]


def _single(n, bases, chains, shape, mode: str, threads: int):
    """A program of contraction n alone, on inputs of the given shapes read
    through the given transposes."""
    from .compiler import compile_graph
    from .graph import Graph
    from .options import CompileOptions
    g = Graph()
    ins = []
    for (s, dt), chain in zip(bases, chains):
        node = g.input(s, dt)
        for perm in reversed(chain):
            node = g.transpose(node, perm)
        ins.append(node)
    g.add_output(dataclasses.replace(n, inputs=tuple(ins), shape=shape))
    return compile_graph(g, CompileOptions(target="cpu", num_threads=threads, contractions=mode, cache=False),
                         "measure")


CLEAR_RATIO = 4.0  # first calls this far apart, each of CLEAR_SECONDS or more, decide without more
CLEAR_SECONDS = 0.01


def _time(exes, args, reps: int = 5, budget: float = 0.4) -> list[float]:
    """Each program's best time over calls taken in turn: the fastest call is
    the one least disturbed by other work on the machine, and alternating
    exposes both to the same conditions. Where the first calls (cold: pages
    touched, threads started) already differ by CLEAR_RATIO and both are
    long enough that cold costs are a small part, they decide: GPT-2's
    vocabulary product (partial register blocks over 50257 columns) took 18
    times the library's time generated, and timing it again only cost
    compile time."""
    first = []
    for exe in exes:
        t = time.perf_counter()
        exe(*args)
        first.append(time.perf_counter() - t)
    if first[0] >= CLEAR_SECONDS and first[1] >= CLEAR_RATIO * first[0]:  # (the first ran coldest: it won anyway)
        return first
    best = [math.inf] * len(exes)
    start = time.perf_counter()
    for r in range(reps):
        for k, exe in enumerate(exes):
            t = time.perf_counter()
            exe(*args)
            best[k] = min(best[k], time.perf_counter() - t)
        if r >= 1 and time.perf_counter() - start > budget:
            break
    return best


# ------------------------------------------------------------- lowering
def gemm_form(L, n) -> str | None:
    """"nchw" (channels before the image: C = W @ col), "nhwc" (channels
    last: C = col @ W) or "cfirst" (output channels outermost, the batch
    among the rest: a weight gradient, C = W @ col over all images at once)
    where the library can compute the convolution n; None where it cannot
    (another dtype or layout, a symbolic group size)."""
    if n.dtype != DataType.Float or n.inputs[1].dtype != DataType.Float or n.inputs[0].dtype != DataType.Float:
        return None
    lay = n.attrs["layout"]
    sp = "".join(c for c in lay if c not in "NC")
    out = L.shape(n)
    if not all(map(sz.is_static, L.shape(n.inputs[1]))) or not all(sz.is_static(out[lay.index(c)]) for c in sp):
        return None  # the kernel and the image positions make the matrices: their sizes must be numbers
    if lay == "NC" + sp:
        return "nchw"
    if lay == "N" + sp + "C":
        return "nhwc"
    if lay[0] == "C" and n.attrs["groups"] == 1 and all(map(sz.is_static, L.shape(n.inputs[0]))):
        return "cfirst"
    return None


def direct_form(L, n) -> bool:
    """Whether convolution n, a library call, is one call on whole arrays
    (the target's library has convolutions, cuDNN): float32, 2-d or 3-d,
    channels first or last, symmetric padding, input not strided; or a
    weight gradient that is the backward filter of such a convolution."""
    if "input_dilation" in n.attrs:
        return backward_data(n) is not None  # (else use() refused it)
    lay = n.attrs["layout"]
    sp = "".join(c for c in lay if c not in "NC")
    form = gemm_form(L, n)
    if (L.library is None or not L.library.target.direct_convolutions() or not 2 <= len(sp) <= 3  # (cuDNN: 4-d, 5-d)
            or any(i.is_constant for i in n.inputs)):
        return False
    if form == "cfirst":
        return (backward_filter(L, n) is not None
                and not any(i.is_input and i.attrs.get("strided") for i in n.inputs))
    x = n.inputs[0]
    return (form in ("nchw", "nhwc") and all(lo == hi >= 0 for lo, hi in n.attrs["padding"])
            and not (x.is_input and x.attrs.get("strided")))


def backward_filter(L, n) -> tuple | None:
    """Weight gradient n (gemm_form "cfirst": the images are its contraction,
    the forward's output positions its taps) as the backward filter of the
    forward convolution it comes from: (the input's, the output gradient's
    and the weight's layouts, strides, padding, dilation), all in the
    forward's terms; None where cuDNN cannot take it (a weight layout it has
    no filter format for, sizes the forward's padding does not give)."""
    at, lay, klay = n.attrs, n.attrs["layout"], n.attrs["kernel_layout"]
    sp = "".join(c for c in lay if c not in "NC")
    x_layout, dy_layout = lay.translate(str.maketrans("NC", "CN")), klay.translate(str.maketrans("IO", "NC"))
    w_layout = lay.translate(str.maketrans("CN", "OI"))
    if w_layout not in ("OI" + sp, "O" + sp + "I"):
        return None
    strides, dilation = tuple(at.get("dilation") or [1] * len(sp)), tuple(at["strides"])
    padding = tuple(lo for lo, _ in at["padding"])
    xs, dys, ws = L.shape(n.inputs[0]), L.shape(n.inputs[1]), L.shape(n)
    for k, c in enumerate(sp):
        h, taps = int(xs[lay.index(c)]), int(ws[lay.index(c)])
        if padding[k] < 0 or (h + 2 * padding[k] - dilation[k] * (taps - 1) - 1) // strides[k] + 1 != int(
                dys[klay.index(c)]):
            return None
    return x_layout, dy_layout, w_layout, strides, padding, dilation


def backward_data(n) -> tuple | None:
    """Convolution n of an input spread with zeros (ops.conv_input_grad: the
    gradient of a strided convolution's output, by its kernel flipped) as
    cuDNN's backward data of that forward convolution: (its kernel, the
    kernel's layout, strides, padding), or None where cuDNN cannot take it
    (another dtype, groups, a kernel not read flipped whole, padding the
    forward's symmetric padding does not give, symbolic or strided input)."""
    at = n.attrs
    if n.op != "conv" or "input_dilation" not in at or n.dtype != DataType.Float or at["groups"] != 1:
        return None
    lay, klay, (dy, wf) = at["layout"], at["kernel_layout"], n.inputs
    sp = "".join(c for c in lay if c not in "NC")
    forward = klay.translate(str.maketrans("OI", "IO"))
    if (not 2 <= len(sp) <= 3 or lay not in ("NC" + sp, "N" + sp + "C") or forward not in ("OI" + sp, "O" + sp + "I")
            or any(s != 1 for s in at["strides"]) or wf.op != "reverse"
            or wf.attrs["axes"] != tuple(sorted(klay.index(c) for c in sp))
            or any(i.is_input and i.attrs.get("strided") for i in (dy, wf.inputs[0]))):
        return None
    padding = []
    for k, c in enumerate(sp):
        size, out, taps = n.shape[lay.index(c)], dy.shape[lay.index(c)], wf.shape[klay.index(c)]
        if not all(map(sz.is_static, (size, out, taps))):
            return None
        d, s = at["dilation"][k], at["input_dilation"][k]
        p = d * (int(taps) - 1) - at["padding"][k][0]
        if p < 0 or (int(size) + 2 * p - d * (int(taps) - 1) - 1) // s + 1 != int(out):
            return None
        padding.append(p)
    return wf.inputs[0], forward, tuple(at["input_dilation"]), tuple(padding)


def _direct_inputs(n) -> tuple:
    """What a direct library convolution reads as arrays: its operands, the
    unflipped kernel for backward data."""
    data = backward_data(n)
    return (n.inputs[0], data[0]) if data is not None else n.inputs


def direct_operands(L, library: set[int]) -> set[int]:
    """The operands the direct library convolutions read as arrays: made where computed inline."""
    return {i.id for n in L.nodes if n.id in library and DIRECT.get(n.op, _never)(L, n) for i in _direct_inputs(n)}


def _lower_direct(L, n, out: str) -> None:
    """n as one library call; a kernel not laid out as the data (OI.. for
    channels first, O..I for channels last) is packed so first."""
    x, w = n.inputs
    data = backward_data(n)
    if data is not None:
        kernel, klay, strides, padding = data
        call = Convolution(_box(L.array_of[kernel.id], L.shape(kernel), {}), _box(L.array_of[x.id], L.shape(x), {}),
                           _box(out, L.shape(n), {}), n.attrs["layout"], klay, strides, padding,
                           tuple(n.attrs["dilation"]), 1, L.library.tf32, f"conv {n.id}", "data", n.attrs["layout"])
        L.add(out, ("i0",), ((0, 1),), tuple(E.const(0) for _ in L.shape(n)), E.const(0.0, n.dtype),
              "convolution_data", library=call)
        return
    if gemm_form(L, n) == "cfirst":
        x_layout, dy_layout, w_layout, strides, padding, dilation = backward_filter(L, n)
        call = Convolution(_box(L.array_of[x.id], L.shape(x), {}), _box(L.array_of[w.id], L.shape(w), {}),
                           _box(out, L.shape(n), {}), x_layout, w_layout, strides, padding, dilation, 1,
                           L.library.tf32, f"conv {n.id}", "filter", dy_layout)
        L.add(out, ("i0",), ((0, 1),), tuple(E.const(0) for _ in L.shape(n)), E.const(0.0, n.dtype),
              "convolution_filter", library=call)
        return
    lay, klay = n.attrs["layout"], n.attrs["kernel_layout"]
    sp = "".join(c for c in lay if c not in "NC")
    want = "OI" + sp if lay == "NC" + sp else "O" + sp + "I"
    wname = L.array_of[w.id]
    if klay != want:
        wname, klay = _packed_kernel(L, n, want), want
    at = n.attrs
    call = Convolution(_box(L.array_of[x.id], L.shape(x), {}), _box(wname, L.arrays[wname].shape, {}),
                       _box(out, L.shape(n), {}), lay, klay, tuple(at["strides"]),
                       tuple(lo for lo, _ in at["padding"]), tuple(at.get("dilation") or [1] * len(sp)),
                       at["groups"], L.library.tf32, f"conv {n.id}")
    L.add(out, ("i0",), ((0, 1),), tuple(E.const(0) for _ in L.shape(n)), E.const(0.0, n.dtype), "convolution",
          library=call)


def lower_conv(L, n, out: str) -> None:
    """n (a convolution) as one library call (direct_form), else as im2col
    (or the input itself: a 1x1 convolution without stride or padding) and
    an sgemm statement per image and group."""
    if direct_form(L, n):
        return _lower_direct(L, n, out)
    form = gemm_form(L, n)
    if form == "cfirst":
        return _lower_cfirst(L, n, out)
    lay, klay, groups = n.attrs["layout"], n.attrs["kernel_layout"], n.attrs["groups"]
    ws, os_ = L.shape(n.inputs[1]), L.shape(n)
    cout = int(ws[klay.index("O")])
    cg = cout // groups
    kdims = [c for c in klay if c != "O"]  # the reduction in the kernel's memory order
    red = math.prod(int(ws[klay.index(c)]) for c in kdims)
    pos = math.prod(int(os_[lay.index(c)]) for c in lay if c not in "NC")
    col, ld_col = _conv_columns(L, n, form, kdims)
    wbox, w_rows = _conv_kernel(L, n, kdims)
    ld_w = red if w_rows else cout
    group_rows = E.imul(E.it("i1"), cg) if groups > 1 else E.const(0)
    cbox = _box(out, os_, {lay.index("N"): (E.it("i0"), 1), lay.index("C"): (group_rows, cg)})
    what = f"conv {n.id}"
    if form == "nchw":  # C (cg x pos) = W (cg x red) @ col (red x pos); the parts share positions, or
        # output channels where an image has fewer (a 4x4 of 512 channels)
        split, steps = ("n", (0, 1, 1)) if pos >= cg else ("m", (ld_w if w_rows else 1, 0, pos))
        call = Gemm(wbox, col, cbox, cg, pos, red, ld_w, ld_col, pos, not w_rows, False, split, steps, what,
                    _tf32(L))
    else:  # C (pos x cg, rows cout apart) = col (pos x red) @ W (red x cg)
        call = Gemm(col, wbox, cbox, pos, cg, red, ld_col, ld_w, cout, False, w_rows, "m", (ld_col, 0, cout), what,
                    _tf32(L))
    bounds = ((0, os_[lay.index("N")]), (0, groups))
    L.add(out, ("i0", "i1"), bounds, cbox[1], E.const(0.0, n.dtype), "sgemm", library=call)


def _lower_cfirst(L, n, out: str) -> None:
    """n, its output channels outermost (a weight gradient: the images are
    the contraction), as one sgemm over the whole output:
    C (cout x rest) = W (cout x red) @ col (red x rest), rest being the
    output's other dims in order. The columns are stored with the input's
    innermost dim innermost, so that filling them reads the input in rows."""
    ws, os_ = L.shape(n.inputs[1]), L.shape(n)
    kdims = [c for c in n.attrs["kernel_layout"] if c != "O"]
    kext = [int(ws[n.attrs["kernel_layout"].index(c)]) for c in kdims]
    rest = [int(s) for s in os_[1:]]
    cout, red, cols = int(os_[0]), math.prod(kext), math.prod(rest)
    wbox, w_rows = _conv_kernel(L, n, kdims)
    by_rows = n.attrs["layout"][-1] != "N"  # col stored (rest x red): the input's rows run along the kernel's last dim
    name, shape = filter_taps(L, n, by_rows)
    col = _box(name, shape, {})
    lda, ldb = red if w_rows else cout, red if by_rows else cols
    if cols >= cout:  # the parts share the longer side
        split, steps = "n", (0, ldb if by_rows else 1, 1)
    else:
        split, steps = "m", (lda if w_rows else 1, 0, cols)
    call = Gemm(wbox, col, _box(out, os_, {}), cout, cols, red, lda, ldb, cols, not w_rows, by_rows, split, steps,
                f"conv {n.id}", _tf32(L))
    L.add(out, ("i0",), ((0, 1),), tuple(E.const(0) for _ in os_), E.const(0.0, n.dtype), "sgemm", library=call)


def _tf32(L) -> bool:
    """Whether a convolution's library products may round to TF32 (as the framework's convolutions do)."""
    return bool(L.library is not None and L.library.tf32)


def _box(array: str, shape, fixed: dict) -> Box:
    """The whole of an array but along the dimensions in fixed: d -> (start, extent)."""
    start, ext = [E.const(0)] * len(shape), list(shape)
    for d, (first, extent) in fixed.items():
        start[d], ext[d] = first, extent
    return array, tuple(start), tuple(ext)


def _conv_columns(L, n, form: str, kdims) -> tuple[Box, int]:
    """The matrix of input taps per image and group, and its leading
    dimension: (reduction x positions) for nchw, (positions x reduction) for
    nhwc, reduction in kdims' order. A 1x1 convolution without stride or
    padding reads its input in place; others fill an im2col temporary."""
    x, w = n.inputs
    lay, klay, groups = n.attrs["layout"], n.attrs["kernel_layout"], n.attrs["groups"]
    xs, ws = L.shape(x), L.shape(w)
    red = math.prod(int(ws[klay.index(c)]) for c in kdims)
    pos = math.prod(int(L.shape(n)[lay.index(c)]) for c in lay if c not in "NC")
    if in_place_taps(L, n):
        channels = (E.imul(E.it("i1"), red) if groups > 1 else E.const(0), red)
        box = _box(L.array_of[x.id], xs, {lay.index("N"): (E.it("i0"), 1), lay.index("C"): channels})
        return box, pos if form == "nchw" else int(xs[lay.index("C")])
    name, shape = conv_taps(L, n, kdims, form == "nchw")
    fixed = {0: (E.it("i0"), 1), 1: (E.it("i1"), 1)} if groups > 1 else {0: (E.it("i0"), 1)}
    return _box(name, shape, fixed), pos if form == "nchw" else red


def in_place_taps(L, n) -> bool:
    """Whether convolution n's columns are its input itself: a 1x1
    convolution, stride 1, no padding, of a row-major array (its rows run
    along the positions)."""
    at, klay = n.attrs, n.attrs["kernel_layout"]
    return (all(int(L.shape(n.inputs[1])[d]) == 1 for d, c in enumerate(klay) if c not in "OI")
            and all(s == 1 for s in at["strides"]) and not any(any(p) for p in at["padding"])
            and _row_major(L, n.inputs[0]))


def conv_taps(L, n, kdims, reduction_first: bool) -> tuple[str, tuple]:
    """Convolution n's input taps copied to a temporary (im2col), what feeds
    n computed into it: per image [and group], the reduction (kdims' order)
    then the output's positions flattened, or the positions then the
    reduction. Its name and shape."""
    from .lowering import _linear, conv_input_index, guarded
    x, w = n.inputs
    at, lay, klay, groups = n.attrs, n.attrs["layout"], n.attrs["kernel_layout"], n.attrs["groups"]
    sp = [c for c in lay if c not in "NC"]
    ws = L.shape(w)
    kext = [int(ws[klay.index(c)]) for c in kdims]
    osz = [int(L.shape(n)[lay.index(c)]) for c in sp]
    lead = (L.shape(n)[lay.index("N")], *((groups,) if groups > 1 else ()))
    name = f"t{n.id}_col"
    shape = (*lead, *kext, math.prod(osz)) if reduction_first else (*lead, math.prod(osz), *kext)
    L.declare_array(name, shape, n.dtype)
    iters, idx, bounds = loop_nest((*lead, *kext, *osz) if reduction_first else (*lead, *osz, *kext))
    taps, positions = (idx[len(lead):len(lead) + len(kext)], idx[len(lead) + len(kext):]) if reduction_first \
        else (idx[len(lead) + len(osz):], idx[len(lead):len(lead) + len(osz)])
    kv = dict(zip(kdims, taps))
    channel = E.iadd(E.imul(idx[1], int(ws[klay.index("I")])), kv["I"]) if groups > 1 else kv["I"]
    xi = conv_input_index(L, n, idx[0], channel, positions, [kv[c] for c in sp])
    body = guarded(L, x, xi, E.const(0.0, n.dtype), [lay.index(c) for k, c in enumerate(sp) if any(at["padding"][k])])
    flat = _linear(osz, positions)
    index = (*idx[:len(lead)], *taps, flat) if reduction_first else (*idx[:len(lead)], flat, *taps)
    L.add(name, iters, bounds, index, body, "im2col", role=TAPS)
    return name, shape


def filter_taps(L, n, rest_first: bool) -> tuple[str, tuple]:
    """A weight gradient's (gemm_form "cfirst") input taps copied to a
    temporary: (rest x reduction) or (reduction x rest), rest its output's
    dims after the output channels, flattened, the reduction the dims of the
    gradient it reads as its kernel (images, positions). Its name and shape."""
    from .lowering import _linear, conv_input_index, guarded
    x, w = n.inputs
    at, lay, klay = n.attrs, n.attrs["layout"], n.attrs["kernel_layout"]
    sp = [c for c in lay if c not in "NC"]
    ws = L.shape(w)
    kdims = [c for c in klay if c != "O"]
    kext = [int(ws[klay.index(c)]) for c in kdims]
    rest = [int(s) for s in L.shape(n)[1:]]
    name = f"t{n.id}_col"
    shape = (math.prod(rest), *kext) if rest_first else (*kext, math.prod(rest))
    L.declare_array(name, shape, n.dtype)
    iters, idx, bounds = loop_nest((*rest, *kext) if rest_first else (*kext, *rest))
    outs, taps = (idx[:len(rest)], idx[len(rest):]) if rest_first else (idx[len(kext):], idx[:len(kext)])
    ov, kv = dict(zip(lay[1:], outs)), dict(zip(kdims, taps))
    xi = conv_input_index(L, n, ov["N"], kv["I"], [ov[c] for c in sp], [kv[c] for c in sp])
    body = guarded(L, x, xi, E.const(0.0, n.dtype), [lay.index(c) for k, c in enumerate(sp) if any(at["padding"][k])])
    index = (_linear(rest, outs), *taps) if rest_first else (*taps, _linear(rest, outs))
    L.add(name, iters, bounds, index, body, "im2col", role=TAPS)
    return name, shape


def _conv_kernel(L, n, kdims) -> tuple[Box, bool]:
    """The kernel's box per group, and whether it is stored (out channels x
    reduction) rather than (reduction x out channels); read in place where
    it is a row-major array with O outermost or innermost, else packed (a
    kernel computed inline, flipped or transposed) by a statement."""
    w, klay, groups = n.inputs[1], n.attrs["kernel_layout"], n.attrs["groups"]
    ws = L.shape(w)
    cout = int(ws[klay.index("O")])
    if _row_major(L, w) and "O" in (klay[0], klay[-1]):
        wname, wlay = L.array_of[w.id], klay
    else:
        wlay = "O" + "".join(kdims)
        wname = _packed_kernel(L, n, wlay)
    shape = L.arrays[wname].shape
    o = 0 if wlay[0] == "O" else len(shape) - 1
    cg = cout // groups
    first = E.imul(E.it("i1"), cg) if groups > 1 else E.const(0)
    return _box(wname, shape, {o: (first, cg)}), wlay[0] == "O"


def _packed_kernel(L, n, letters: str) -> str:
    """Convolution n's kernel copied to a temporary whose dims are letters (of its kernel_layout), in order."""
    w, klay = n.inputs[1], n.attrs["kernel_layout"]
    name, shape = f"t{n.id}_w", tuple(L.shape(w)[klay.index(c)] for c in letters)
    L.declare_array(name, shape, n.dtype)
    iters, idx, bounds = loop_nest(shape)
    src = [None] * w.rank
    for c, i in zip(letters, idx):
        src[klay.index(c)] = i
    L.add(name, iters, bounds, idx, L.value(w, src), "pack")
    return name


def _row_major(L, node) -> bool:
    """Whether node is an array of its own, laid out row-major in its shape."""
    name = L.array_of.get(node.id)
    return (name is not None and name in L.arrays and not L.arrays[name].strided
            and L.arrays[name].shape == L.shape(node))


# ------------------------------------------------------------ matrices
def _matrix(L, node, whole: bool = False):
    """(array, node dim -> view dim, the view's row length) where node reads
    a row-major array in place (itself, or a transpose of it; the view is
    the array); None otherwise. With ``whole`` (an operand read whole, no
    batch dims) also a reshape of a row-major array, which is the same
    memory in the reshape's shape, the view ([4, 128, 256] as [512, 256],
    [128, 4, 3, 256] as [512, 768])."""
    perm = list(range(node.rank))
    while node.op == "transpose" and not L.packed(node) and node.id not in L.array_of:
        perm = [node.attrs["perm"][p] for p in perm]
        node = node.inputs[0]
    if whole and node.op == "reshape" and node.id not in L.array_of and _row_major(L, node.inputs[0]):
        return L.array_of[node.inputs[0].id], perm, L.shape(node)[-1]
    return (L.array_of[node.id], perm, L.shape(node)[-1]) if _row_major(L, node) else None


def product_dtypes(L, n) -> bool:
    """Whether the library multiplies n's operands: float32, or half types
    where the target's library takes them (cuBLAS's tensor cores, a float32
    sum), with a result of theirs or float32 (targets.nvgpu.narrow_products)."""
    a, b = n.inputs
    kinds = L.library.target.library_products if L.library is not None else (DataType.Float,)
    return a.dtype == b.dtype and a.dtype in kinds and n.dtype in (a.dtype, DataType.Float)


def dot_form(L, n) -> tuple | None:
    """(batch dims, a's free dim, b's free dim) of a dot_general with
    leading batch dims, one contracting and one free dim per operand; None
    for others (they stay generated). Sizes may be symbolic: the call's
    sizes are then computed at run time."""
    at = n.attrs
    nb = len(at["lb"])
    if not product_dtypes(L, n):
        return None
    if tuple(at["lb"]) != tuple(range(nb)) or tuple(at["rb"]) != tuple(range(nb)) or len(at["lc"]) != 1:
        return None
    lf, rf = free_dims(n)
    if len(lf) != 1 or len(rf) != 1:
        return None
    return nb, lf[0], rf[0]


def _operand(L, node, name: str, nb: int, batch_iters, free: int, contract: int):
    """A dot operand as (box, transposed, leading dimension): read in place
    where it is a row-major array or a transpose of one with its batch dims
    outermost, or a view of one whose matrices have a dense row (the heads
    of attention, reshaped and transposed out of a projection); else copied
    to a temporary first: what the view chain starts from, in its own
    shape, where the chain is then a view of the copy (a softmax's result
    merged to [b*h, s, s]: the copy's statement reads the softmax's row
    statistics at plain indices, and fuses with them), else the operand.
    Where each call is a launch (cuBLAS), a view whose batch dims do not
    continue each other's strides (heads out of a [b, t, h*d] projection)
    is copied too, so that the batch is one strided call: read in place, it
    is a call per head or per image, each too small to fill the GPU (BERT's
    attention and its gradients took twice the time as 12 calls a product)."""
    m = _matrix(L, node, whole=nb == 0)
    if m is None or m[1][:nb] != list(range(nb)):
        base, chain = _view_chain(L, node)
        if chain and _static(L, base):
            view = _view(L.shape(base), chain, L)
            if view is not None and _launched(L) and not _continuing(view, nb):
                view = None
            if view is not None:
                strided = _strided(L, base, view, nb, batch_iters, free, contract, name)
                if strided is not None:
                    return strided
        m = _pack(L, node, name, natural=node.op == "concatenate")  # (joined weights: sibling_products)
    array, perm, ld = m
    shape = L.arrays[array].shape
    start = [E.const(0)] * len(shape)
    ext = list(shape)
    for k in range(nb):
        start[perm[k]], ext[perm[k]] = batch_iters[k], 1
    transposed = perm[contract] < perm[free]  # stored (contracting x free)
    return (array, tuple(start), tuple(ext)), transposed, ld


def _continuing(view: tuple[list[int], list[int]], nb: int) -> bool:
    """Whether the batch dims of view (_view's shape and strides) step as
    one: each stride the next one's times its count (dims of one skipped)."""
    dims = [(s, st) for s, st in zip(view[0][:nb], view[1][:nb]) if s > 1]
    return all(st == nst * ns for (_, st), (ns, nst) in zip(dims, dims[1:]))


def _launched(L) -> bool:
    """Whether each library call is a launch of its own (cuBLAS)."""
    return L.library is not None and L.library.target.launched_library_calls


def _view_chain(L, node):
    """(the node a chain of transposes and reshapes starts from, the chain outermost first)."""
    chain = []
    while node.op in ("transpose", "reshape") and node.id not in L.array_of and not L.packed(node):
        chain.append(node)
        node = node.inputs[0]
    return node, chain


def _static(L, node) -> bool:
    return all(sz.is_static(s) for s in L.shape(node))


def _view(base_shape, chain, L) -> tuple[list[int], list[int]] | None:
    """(shape, element strides) of the chain's result over a row-major array
    of base_shape, each reshape one that keeps the elements where they lie
    (as ``Tensor.view``); None where one would have to copy."""
    shape = [int(s) for s in base_shape]
    strides = list(sz.row_major(shape))
    for v in reversed(chain):
        if v.op == "transpose":
            shape, strides = [shape[p] for p in v.attrs["perm"]], [strides[p] for p in v.attrs["perm"]]
            continue
        new = [int(s) for s in L.shape(v)]
        strides = _view_strides(shape, strides, new)
        if strides is None:
            return None
        shape = new
    return shape, strides


def _view_strides(shape: list[int], strides: list[int], new: list[int]) -> list[int] | None:
    """The strides of a reshape of (shape, strides) to new that moves no
    element (PyTorch's computeStride), or None where it would have to copy."""
    if math.prod(shape) == 0:
        return None
    out = [0] * len(new)
    view_d = len(new) - 1
    base = strides[-1] if strides else 1
    tensor_numel = view_numel = 1
    for d in reversed(range(len(shape))):
        tensor_numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and strides[d - 1] != tensor_numel * base):
            while view_d >= 0 and (view_numel < tensor_numel or new[view_d] == 1):
                out[view_d] = view_numel * base
                view_numel *= new[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                base, tensor_numel, view_numel = strides[d - 1], 1, 1
    return out if view_d == -1 else None


def _strided(L, base, view, nb: int, batch_iters, free: int, contract: int, name: str):
    """_operand's triple for a view of base (_view) whose two matrix dims
    lie along two dims of base, one of them dense: each batch element's
    matrix is then a box of base's array, its first element where the batch
    strides lead (quasi-affine in the batch iterators where they run across
    several of the array's dims). A base computed inline is copied to an
    array of its own (name) first. None where the view's matrices are not
    such boxes."""
    shape, strides = view
    arr = [int(s) for s in L.shape(base)]
    row = sz.row_major(arr)
    (fs, fst), (ks, kst) = (shape[free], strides[free]), (shape[contract], strides[contract])
    if fs < 2 or ks < 2 or 1 not in (fst, kst) or fst == kst:
        return None
    inner, outer = (free, contract) if fst == 1 else (contract, free)
    at: dict[int, int] = {}  # array dim -> the matrix dim's extent along it
    for d in (inner, outer):
        lands = _lands(arr, row, strides[d], shape[d])
        if lands is None or set(lands) & set(at):
            return None
        at.update(lands)
    terms = [(batch_iters[k], strides[k], shape[k]) for k in range(nb) if shape[k] > 1]
    start = _batch_start(terms, arr, row, at)
    if start is None:
        return None
    array = L.array_of[base.id] if _row_major(L, base) else _pack(L, base, name, natural=True)[0]
    ext = tuple(at.get(a, 1) for a in range(len(arr)))
    return (array, tuple(start), ext), inner == free, strides[outer]


def _lands(arr: list[int], row, stride: int, extent: int) -> dict[int, int] | None:
    """The array dims a matrix dim of this stride and extent runs along, with
    its extent on each: part of one dim, or several consecutive dims whole
    (a [b, s, e] array read as [b*s, e]); None where it runs along neither."""
    first = [a for a in range(len(arr)) if arr[a] > 1 and row[a] == stride]
    if len(first) != 1:
        return None
    a = first[0]
    if extent <= arr[a]:
        return {a: extent}
    out, covered = {}, 1
    while a >= 0 and covered < extent:
        out[a], covered = arr[a], covered * arr[a]
        a -= 1
    return out if covered == extent else None


BATCH_CHECKED = 1 << 14  # batch elements a strided operand's boxes are checked at, at most


def _batch_start(terms, arr: list[int], row, at: dict[int, int]) -> list | None:
    """The array coordinates of the first element of a batch element's
    matrix, the batch terms (iterator, stride, count) running over the
    array's elements: each along one dim where its steps stay inside it,
    else the linear offset unravelled (floor divisions), checked at every
    batch element to keep the matrix inside its dims."""
    span = [0] * len(arr)
    start = [E.const(0) for _ in arr]
    for it, stride, count in terms:
        d = next((a for a in range(len(arr)) if stride % row[a] == 0 and stride // row[a] * (count - 1) < arr[a]),
                 None)
        if d is None:
            break
        span[d] += stride // row[d] * (count - 1)
        start[d] = E.iadd(start[d], E.imul(it, stride // row[d]))
    else:
        if all(span[a] + at.get(a, 1) <= arr[a] for a in range(len(arr))):
            return start
    if math.prod(count for _, _, count in terms) > BATCH_CHECKED:
        return None
    offsets = [0]
    for _, stride, count in terms:
        offsets = [o + stride * c for o in offsets for c in range(count)]
    if any((o // row[a]) % arr[a] + extent > arr[a] for a, extent in at.items() for o in offsets):
        return None
    linear = E.const(0)
    for it, stride, _ in terms:
        linear = E.iadd(linear, E.imul(it, stride))
    return [E.ifloordiv(linear, row[a]) if a == 0 else E.imod(E.ifloordiv(linear, row[a]), arr[a])
            for a in range(len(arr))]


def _pack(L, node, name: str, natural: bool = False):
    """node copied to a temporary (as _matrix's triple), its last two dims
    stored exchanged where what it reads moves along the second last (the
    keys of attention, transposed on their way to the product): the copy
    then walks memory in order, and the call reads the matrix transposed.
    ``natural`` keeps node's own order: joined weights ([d, 3n], of
    transposed Linear weights) run 10% faster as cuBLAS's NN product than
    stored exchanged (bench/NOTES.md). A copy of the same values in the
    same order is made once (a gradient that two products read, one of them
    through a transpose)."""
    shape = L.shape(node)
    iters, idx, bounds = loop_nest(shape)
    value = L.value(node, idx)
    order = list(range(node.rank))
    if node.rank >= 2 and not natural:
        last, second = (sum(1 for ld in E.data_loads(value) if ld.index and any(
            isinstance(x, E.Var) and x.name == idx[d].name for x in E.walk(ld.index[-1]))) for d in (-1, -2))
        if second > last:
            order[-2:] = order[-1], order[-2]
    stored = tuple(shape[d] for d in order)
    iters, idx, bounds = loop_nest(stored)
    at = [None] * node.rank
    for j, d in enumerate(order):
        at[d] = idx[j]
    value = L.value(node, at)
    perm = [order.index(d) for d in range(node.rank)]
    key = (stored, node.dtype, value)
    if key in L.packs:
        return L.packs[key], perm, stored[-1]
    L.packs[key] = name
    L.declare_array(name, stored, node.dtype)
    L.add(name, iters, bounds, idx, value, "pack")
    return name, perm, stored[-1]


def lower_dot(L, n, out: str) -> None:
    """n (a dot_general) as one sgemm statement per batch element."""
    nb, lf, rf = dot_form(L, n)
    a, b = n.inputs
    at = n.attrs
    shape = L.shape(n)
    iters, idx, bounds = loop_nest(shape[:nb] or (1,))  # (one call, where there is no batch)
    batch = list(idx[:nb])
    abox, ta, lda = _operand(L, a, f"t{n.id}_a", nb, batch, lf, at["lc"][0])
    bbox, tb, ldb = _operand(L, b, f"t{n.id}_b", nb, batch, rf, at["rc"][0])
    tb = not tb  # b is wanted as (contracting x free): stored so unless its free dim comes first
    m, nn, k = shape[nb], shape[nb + 1], L.shape(a)[at["lc"][0]]
    cbox = (out, tuple(batch) + (E.const(0), E.const(0)), (1,) * nb + (m, nn))
    types = {"dtype": a.dtype.value, "out_dtype": n.dtype.value,
             "tf32": bool(L.library is not None and L.library.matmul_tf32 and a.dtype == DataType.Float)}
    if _longer(nn, m):  # the parts share the longer side
        call = Gemm(abox, bbox, cbox, m, nn, k, lda, ldb, nn, ta, tb, "n", (0, ldb if tb else 1, 1), f"dot {n.id}",
                    **types)
    else:
        call = Gemm(abox, bbox, cbox, m, nn, k, lda, ldb, nn, ta, tb, "m", (1 if ta else lda, 0, nn), f"dot {n.id}",
                    **types)
    L.add(out, iters, bounds, cbox[1], E.const(0.0, n.dtype), "sgemm", library=call)


def _longer(x: Size, y: Size) -> bool:
    """Whether side x is at least as long as y (symbolic sizes at their estimates)."""
    return sz.estimate(x) >= sz.estimate(y)


def _conv_reduction(n, xs, ws) -> tuple[int, str | None]:
    """(the reduction's length, why the library is not worth calling or None) for a convolution."""
    klay, groups = n.attrs["kernel_layout"], n.attrs["groups"]
    red = math.prod(int(ws[d]) for d, c in enumerate(klay) if c != "O")
    cout_g = int(ws[klay.index("O")]) // groups
    if red < MIN_REDUCTION or cout_g < MIN_OUT_CHANNELS:
        return red, f"reduction {red}, {cout_g} output channels per group: a stencil"
    return red, None


def _dot_reduction(n, xs, ws) -> tuple[Size, str | None]:
    return sz.product(xs[d] for d in n.attrs["lc"]), None


def _never(L, n) -> bool:
    return False


# per contraction op: the library's form of it (None: not one it computes), its
# reduction's length, the lowering to library calls, and a direct form (cuDNN's)
FORM = {"conv": gemm_form, "dot_general": dot_form}
REDUCTION = {"conv": _conv_reduction, "dot_general": _dot_reduction}
LOWER = {"conv": lower_conv, "dot_general": lower_dot}
DIRECT = {"conv": direct_form}
READS_ONCE = {"dot_general"}  # library calls that read each operand element once (in place, or one copy);
# a convolution's im2col reads each input element once per tap
