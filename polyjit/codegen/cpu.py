"""The cpu target: the host's triple and features, O3 with the loop and SLP
vectorizers, MCJIT; a kernel's parallel loop is split into parts, which
the runtime's thread team runs (runtime.threads).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import re
import threading
from dataclasses import dataclass

import islpy as isl
import llvmlite.binding as llvm
from llvmlite import ir

from .. import sizes as sz
from ..expr import Const, Var, walk
from .blas import emit_gemm
from .cpu_mapping import CpuMapper, CpuPlan, SplitStrips, VectorBlock
from .irtypes import I32, storage_constant
from .llvm import I64, STORAGE, Emitter

KERNEL_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
_lock = threading.Lock()


@functools.cache
def _llvm():
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    libm = ctypes.util.find_library("m")
    if libm:
        llvm.load_library_permanently(libm)
    return llvm.Target.from_default_triple()


@functools.cache
def _host_cpu() -> tuple[str, str]:
    return llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()


def target_machine(opt: int = 3):
    """A fresh target machine: an execution engine takes ownership of its own."""
    cpu, features = _host_cpu()
    return _llvm().create_target_machine(cpu=cpu, features=features, opt=opt, codemodel="jitdefault")


@functools.cache
def object_machine():
    """The target machine that makes kernels' object code (no engine owns
    it; use with _lock held). Every call into LLVM waits for Python's GIL on
    its way back, and the LLVM thread runs beside the compile's own Python:
    a machine made per kernel was a dozen more waits each."""
    return target_machine()


@functools.cache
def module_target() -> tuple[str, str]:
    """(triple, data layout) of this host's modules."""
    tm = object_machine()
    return tm.triple, str(tm.target_data)


STREAM_GROUP = 64  # elements per trip of a streamed loop: whole vector iterations, no remainder
STREAM_TAG = "polyjit.stream"


@dataclass
class CpuContext:
    """What the emitter tracks while it emits one kernel."""

    plan: CpuPlan
    streaming: str | None = None  # the array whose stores the loop being emitted streams
    streamed: bool = False  # the body being emitted has streaming stores
    blocked: bool = False  # the statement being emitted is a contraction's update (register blocks)
    vector: VectorBlock | None = None  # the unrolled loop being emitted in vectors
    width: int = 0  # the lanes of the vector being emitted (1: a scalar copy)
    along: str | None = None  # the iterator of the statement being emitted that moves with it


class CpuEmitter(Emitter):
    """Emits each kernel as its plan (codegen.cpu_mapping) says."""

    triple = llvm.get_process_triple()
    _stream_scope = None  # the tag's metadata, made once per module

    def __init__(self, prog, sched, name: str = "fn") -> None:
        super().__init__(prog, sched, name)
        self.plans: list[CpuPlan] = []  # per kernel emitted, its plan
        self.ctx: CpuContext | None = None  # the kernel being emitted

    def kernel(self, k: int, node: isl.AstNode, plan: CpuPlan | None = None) -> None:
        """Kernel k as plan says (mapped now where not given)."""
        plan = plan or CpuMapper(self.prog, self.sched, vector_bits()).kernel(k, node)
        self.plans.append(plan)
        self.ctx = CpuContext(plan)
        super().kernel(k, node)
        if not plan.strength_reduction:
            self.module.add_named_metadata(NO_STRENGTH_REDUCTION)
        if plan.plain_loops:
            self.module.add_named_metadata(PLAIN_LOOPS)

    def mark(self, n: isl.AstNode) -> None:
        """A parallel loop the plan splits: in chunks, or in strips with halos."""
        split = self.ctx.plan.splits.get(self.at)
        if split is None:
            return super().mark(n)
        self.parallel = True
        at = self.at
        self.at = at + (0,)
        if isinstance(split, SplitStrips):
            self.strip_parallel(n.mark_get_node(), split.strips)
        else:
            self.loop(n.mark_get_node(), split=True)
        self.at = at

    def loop(self, n: isl.AstNode, split: bool) -> None:
        """A loop whose stores the plan streams runs in three parts: up to the
        first 64-byte boundary, whole groups of STREAM_GROUP elements whose
        stores are tagged to become streaming (nontemporal) stores once
        vectorized, and the rest. Streaming stores neither read the written
        lines first nor push the private rows out of the cache: blur
        3x1024x1024 1.28 -> 1.0 ms on 2 cores. A plain elementwise pass
        keeps cached stores (x*0.2 went 0.48 -> 0.52 ms: its 12 MB output
        fits in this host's last-level cache)."""
        stream = None if split else self.ctx.plan.streams.get(self.at)
        if stream is None:
            return super().loop(n, split)
        arr, call = self.prog.arrays[stream.array], stream.call
        b = self.b
        slot = self.var(n.for_get_iterator().get_id().get_name())
        lo, one, hi = self.loop_range(n)
        b.store(lo, slot)
        s = self.stmts[call.get_op_arg(0).get_id().get_name()]
        env = {it: self.aexpr(call.get_op_arg(i + 1)) for i, it in enumerate(s.iters)}
        first = b.ptrtoint(self.address(arr, s.index, env, {}), I64)
        per = 64 // arr.dtype.itemsize
        skip = b.and_(b.lshr(b.sub(ir.Constant(I64, 0), first), ir.Constant(I64, int(math.log2(arr.dtype.itemsize)))),
                      ir.Constant(I64, per - 1))
        start = b.add(lo, skip)
        start = b.select(b.icmp_signed("<", start, hi), start, hi)
        end = b.add(start, b.and_(b.sub(hi, start), ir.Constant(I64, -STREAM_GROUP)))
        body = lambda: self.descend(n.for_get_body(), 0)  # noqa: E731
        self.range_loop(slot, lo, start, one, body)
        self.ctx.streaming = arr.name
        self.range_loop(slot, start, end, one, body)
        self.ctx.streaming = None
        self.range_loop(slot, end, hi, one, body)
        self.ctx.streamed = True

    def body(self, fn, node) -> None:
        """A body with streaming stores ends with a fence: they are weakly
        ordered, and the thread that joins this one reads what they wrote."""
        super().body(fn, node)
        if self.ctx.streamed:
            self.b.position_before(self.b.block.terminator)
            self.b.fence("seq_cst")

    def store_element(self, arr, index, ptr, val):
        if self.ctx.along is not None:  # a vector block's statement: a vector to its lanes' elements
            if not isinstance(val.type, ir.VectorType):
                val = self.splat(val)
            if not ptr.type.is_opaque:  # (a private buffer's alloca is typed)
                ptr = self.b.bitcast(ptr, val.type.as_pointer())
            return self.b.store(self.to_storage(val, arr.dtype), ptr, align=arr.dtype.itemsize)
        store = super().store_element(arr, index, ptr, val)
        if arr.name == self.ctx.streaming:
            store.set_metadata("alias.scope", self.stream_scope())
        return store

    def statement(self, call) -> None:
        name = call.get_op_arg(0).get_id().get_name()
        self.ctx.blocked = name in self.ctx.plan.blocked
        if self.ctx.vector is None or self.ctx.width == 1:
            return super().statement(call)
        it = self.ctx.vector.iterator
        iters = self.stmts[name].iters
        self.ctx.along = next(iters[k] for k in range(len(iters))
                              if call.get_op_arg(k + 1).get_type() == isl.ast_expr_type.id
                              and call.get_op_arg(k + 1).get_id().get_name() == it)
        super().statement(call)
        self.ctx.along = None

    def unrolled(self, n: isl.AstNode) -> None:
        """A loop the plan runs in vectors: one copy of its body per vector of
        iterations (VectorBlock.widths: whole ones, then narrower; the plan
        checked that the loop runs exactly its trips), the iterator at each
        vector's first."""
        vector = self.ctx.plan.vectors.get(self.at)
        if vector is None:
            return super().unrolled(n)
        b = self.b
        trips, rest = self.unroll[0], self.unroll[1:]
        slot = self.var(vector.iterator)
        lo = self.aexpr(n.for_get_init())
        outer, self.unroll, self.ctx.vector = self.unroll, rest, vector
        i = 0
        for width in vector.widths:
            b.store(b.add(lo, ir.Constant(I64, i)), slot)
            self.ctx.width = width
            self.descend(n.for_get_body(), 0)
            i += width
        self.unroll, self.ctx.vector, self.ctx.width = outer, None, 0

    def _vector_index(self, index) -> bool:
        along = self.ctx.along
        return along is not None and any(isinstance(x, Var) and x.name == along for e in index for x in walk(e))

    def load_element(self, arr, index, ptr):
        """In a vector block, a vector of the elements from ptr on where index moves with it."""
        if not self._vector_index(index):
            return super().load_element(arr, index, ptr)
        return self.b.load(ptr, typ=ir.VectorType(STORAGE[arr.dtype], self.ctx.width), align=arr.dtype.itemsize)

    def accumulated(self, arr, index, ptr):
        return self.load_element(arr, index, ptr)

    def splat(self, v) -> ir.Value:
        """Scalar v in every lane of the vector block's vectors."""
        vt = ir.VectorType(v.type, self.ctx.width)
        if isinstance(v, ir.Constant):
            return ir.Constant(vt, [v.constant] * vt.count)
        one = self.b.insert_element(ir.Constant(vt, ir.Undefined), v, ir.Constant(I32, 0))
        return self.b.shuffle_vector(one, ir.Constant(vt, ir.Undefined),
                                     ir.Constant(ir.VectorType(I32, vt.count), [0] * vt.count))

    def op(self, op, a, dt, adts):
        if self.ctx is not None and self.ctx.along is not None and any(isinstance(x.type, ir.VectorType) for x in a):
            a = [x if isinstance(x.type, ir.VectorType) else self.splat(x) for x in a]
        return super().op(op, a, dt, adts)

    def library_call(self, s, env, cache) -> None:
        """BLAS's sgemm, each part on its strip where the plan splits it."""
        split = self.ctx.plan.library[self.at].split
        self.parallel |= split
        emit_gemm(self, s.library, env, cache, split)

    def padded_load(self, cond, load, fill, env, cache):
        """In a contraction's register block, load from a cell holding fill
        where cond fails: the load then feeds a vector broadcast straight from
        memory, where a select of the loaded value needs a shuffle on the pipes
        the FMAs use (a padded convolution's register block: 16 FMAs and four
        such broadcasts per step). Elsewhere (an unrolled depthwise stencil,
        vectorized by LLVM along channels) a selected address is a gather per
        tap: the value is selected instead, loaded where guarded() clamped the
        index into the array."""
        arr = self.prog.arrays[load.array]
        if not self.ctx.blocked and all(not isinstance(i, Const) or sz.is_static(n) and 0 <= i.value < int(n)
                                    for i, n in zip(load.index, arr.shape)):
            return super().padded_load(cond, load, fill, env, cache)
        ptr = self.address(arr, load.index, env, cache)
        name = f"polyjit.fill.{arr.dtype.name}.{fill.value!r}"
        cell = self.module.globals.get(name)
        if cell is None:
            ty = STORAGE[arr.dtype]
            cell = ir.GlobalVariable(self.module, ty, name)
            cell.global_constant = True
            cell.linkage = "private"
            cell.initializer = storage_constant(arr.dtype, fill.value)
        return self.load_element(arr, load.index, self.b.select(self.value(cond, env, cache), ptr, cell))

    def stream_scope(self):
        """The tag of streamed stores: a scope list that LLVM's vectorizer keeps
        on the vector stores it makes from them (see streaming_stores)."""
        if self._stream_scope is None:
            m = self.module
            domain = m.add_metadata([ir.MetaDataString(m, STREAM_TAG)])
            scope = m.add_metadata([ir.MetaDataString(m, STREAM_TAG + ".scope"), domain])
            self._stream_scope = m.add_metadata([scope])
        return self._stream_scope


_MD = re.compile(r"^!(\d+) = (?:distinct )?!\{(.*)\}$", re.M)
_VECTOR_STORE = re.compile(r"^(\s*store <(\d+) x (float|double)> [^\n]*?), align \d+(, [^\n]*?!alias\.scope !(\d+)[^\n]*)$")


def streaming_stores(ir_text: str) -> str:
    """The optimized module with the tagged stores of vectorized loop bodies
    made nontemporal and aligned to their width. Those loops start on a
    64-byte boundary and run whole vector iterations (CpuEmitter.loop), so
    every vector store in them is aligned; LLVM's vectorizer would not make
    vector stores of nontemporal scalar ones it cannot prove aligned, hence
    the tag and this rewrite after it."""
    if STREAM_TAG not in ir_text:
        return ir_text
    nodes = {int(k): body for k, body in _MD.findall(ir_text)}
    domain = next((k for k, body in nodes.items() if body == f'!"{STREAM_TAG}"'), None)
    scope = next((k for k, body in nodes.items() if f'!"{STREAM_TAG}.scope"' in body and f"!{domain}" in body), None)
    if scope is None:  # the tagged stores were optimized away: nothing to stream
        return ir_text
    tagged = {k for k, body in nodes.items() if f"!{scope}" in re.split(r",\s*", body)}
    nt = max(nodes) + 1
    out, block = [], ""
    for line in ir_text.split("\n"):
        label = re.match(r"^([\w.]+):", line)
        if label:
            block = label.group(1)
        elif line.startswith("define"):
            block = ""
        m = _VECTOR_STORE.match(line)
        if m and block.startswith("vector.body") and int(m.group(5)) in tagged:
            width = int(m.group(2)) * (4 if m.group(3) == "float" else 8)
            line = f"{m.group(1)}, align {width}{m.group(4)}, !nontemporal !{nt}"
        out.append(line)
    return "\n".join(out) + f"\n!{nt} = !{{i32 1}}\n"


WIDE = 1000  # the attribute group number for the kernels' vector width


@functools.cache
def host_key() -> str:
    """What this host's machine code depends on: triple, CPU and its features."""
    return f"{llvm.get_process_triple()}|{llvm.get_host_cpu_name()}|{llvm.get_host_cpu_features().flatten()}"


@functools.cache
def vector_bits() -> int:
    """The width of the host's vectors: 512 with AVX-512, else 256."""
    return 512 if "+avx512f" in llvm.get_host_cpu_features().flatten() else 256


def prefer_wide_vectors(ir_text: str) -> str:
    """On an AVX-512 host, every function asks for 512-bit vectors: LLVM tunes
    Intel's cores to 256 bits, but register blocks of contractions are sized
    for 512 (4 x 64 floats in 16 registers; at 256 bits they spill). Emerald
    Rapids, matmul 1024^3: 47 -> 60 GFLOP/s on one core, 439 -> 615 on 16."""
    if vector_bits() < 512:
        return ir_text
    text = re.sub(r"^(define [^\n]*\))$", rf"\1 #{WIDE}", ir_text, flags=re.M)
    return text + f'\nattributes #{WIDE} = {{ "prefer-vector-width"="512" }}\n'


# LLVM's size limit for unrolling a loop whole at O3 (its option
# "unroll-threshold-aggressive", 300 by default), for CPU kernels: at 300,
# loops of vector code with constant trip counts (an elementwise kernel's
# 3 x 3 x 21 vector iterations) became straight lines of hundreds of vector
# stores, which LLVM's later passes and instruction selection took long over
# and which ran no faster (bench/NOTES.md); at 100 a flax CNN's convolutions
# ran slower. Other targets (NVPTX) keep LLVM's own.
CPU_UNROLL_THRESHOLD = 150
LLVM_UNROLL_THRESHOLD = 300


# A kernel module's named metadata: its machine code is made without LLVM's
# loop strength reduction, which rewrites loops' address arithmetic for the
# addressing modes (where its plan says so: CpuPlan.strength_reduction).
NO_STRENGTH_REDUCTION = "polyjit.no_lsr"
PLAIN_LOOPS = "polyjit.plain_loops"  # and without LLVM's loop unrolling and vectorizers (CpuPlan.plain_loops)


def pipeline_options(unroll: int, strength_reduction: bool = True) -> None:
    """LLVM's O3 full-unroll limit and whether code generation reduces loops'
    strength, for the pipelines run next: process-wide options, so every
    pipeline sets its own first (with _lock held)."""
    llvm.set_option("polyjit", f"-unroll-threshold-aggressive={unroll}")
    llvm.set_option("polyjit", f"-disable-lsr={'false' if strength_reduction else 'true'}")


def optimize(mod: "llvm.ModuleRef", tm, strength_reduction: bool = True, plain_loops: bool = False) -> None:
    """LLVM's O3 pipeline for the host (call with _lock held), with its loop
    unrolling and vectorizers unless ``plain_loops``; the options of the
    code generation that follows it."""
    pipeline_options(CPU_UNROLL_THRESHOLD, strength_reduction)
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pto.loop_vectorization = not plain_loops
    pto.slp_vectorization = not plain_loops
    pto.loop_unrolling = not plain_loops
    pb = llvm.create_pass_builder(tm, pto)
    pm = pb.getModulePassManager()
    pm.run(mod, pb)


def optimized_module(ir_text: str, tm) -> tuple["llvm.ModuleRef", str]:
    """The module of ir_text after O3 for tm's host, and its text (with
    streaming stores); call with _lock held."""
    mod = llvm.parse_assembly(prefer_wide_vectors(ir_text))
    mod.verify()
    mod.triple, mod.data_layout = module_target()
    optimize(mod, tm, f"!{NO_STRENGTH_REDUCTION} =" not in ir_text, f"!{PLAIN_LOOPS} =" in ir_text)
    text = str(mod)
    optimized = streaming_stores(text)
    if optimized != text:
        mod = llvm.parse_assembly(optimized)
        mod.verify()
    return mod, optimized


class JitModule:
    """A JIT-compiled LLVM module; keeps the engine alive with its code."""

    def __init__(self, ir_text: str, optimize: bool = True) -> None:
        """optimize=False: straight-line host code (a native launcher) that
        LLVM's passes would only take time over."""
        tm = target_machine(3 if optimize else 0)
        with _lock:
            if optimize:
                mod, self.optimized_ir = optimized_module(ir_text, tm)
            else:
                mod, self.optimized_ir = llvm.parse_assembly(ir_text), ir_text
                mod.verify()
            self.engine = llvm.create_mcjit_compiler(mod, tm)
            self.engine.finalize_object()
            self.assembly = None
            self._tm = tm
            self._mod = mod

    def function(self, name: str):
        return KERNEL_T(self.engine.get_function_address(name))

    def asm(self) -> str:
        if self.assembly is None:
            self.assembly = self._tm.emit_assembly(self._mod)
        return self.assembly


MXCSR_FLUSH = 0x8040  # x86 flush-to-zero (bit 15) and denormals-are-zero (bit 6)
X86 = llvm.get_process_triple().startswith("x86_64")


def ieee_floats(b: ir.IRBuilder):
    """Emit (in the entry block): clear the x86 MXCSR's flush-to-zero and
    denormals-are-zero bits, so that subnormals round and compare as IEEE
    says whoever calls; returns a function that emits the restore of the
    caller's mode. No-op elsewhere."""
    if not X86:
        return lambda: None
    mod = b.module
    ptr = ir.IntType(8).as_pointer()
    mxcsr = {n: mod.globals.get(f"llvm.x86.sse.{n}") or ir.Function(
        mod, ir.FunctionType(ir.VoidType(), [ptr]), f"llvm.x86.sse.{n}") for n in ("stmxcsr", "ldmxcsr")}
    saved, ieee = b.alloca(ir.IntType(32)), b.alloca(ir.IntType(32))
    b.call(mxcsr["stmxcsr"], [b.bitcast(saved, ptr)])
    b.store(b.and_(b.load(saved), ir.Constant(ir.IntType(32), ~MXCSR_FLUSH)), ieee)
    b.call(mxcsr["ldmxcsr"], [b.bitcast(ieee, ptr)])
    return lambda: b.call(mxcsr["ldmxcsr"], [b.bitcast(saved, ptr)])
