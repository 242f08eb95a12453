"""The nvgpu target: one PTX ``.entry`` per kernel, from llvmlite's NVPTX backend.

The scheduler puts a nest's coincident loops outermost and marks each; here
those loops collapse into one index space that a grid-stride loop shares
among all threads of the launch (consecutive threads take consecutive
iterations of the innermost parallel loop, so accesses along it coalesce);
the loops inside run sequentially in each thread, with contracted buffers
(a stencil's rolling rows) private to it. A kernel whose nest has no
parallel loop at its top runs on one thread.
"""
from __future__ import annotations

import functools
import math

import islpy as isl
import llvmlite.binding as llvm
from llvmlite import ir

from ..errors import UnsupportedOpError
from . import mathlib
from .llvm import F32, I32, I64, PTR, Emitter, KernelInfo

TRIPLE = "nvptx64-nvidia-cuda"
DEFAULT_ARCH = "sm_90"
_SREG = "llvm.nvvm.read.ptx.sreg."
_GPU_INTRINSIC = {"sqrt": "llvm.sqrt", "floor": "llvm.floor", "ceil": "llvm.ceil", "round": "llvm.roundeven",
                  "abs": "llvm.fabs", "maximum": "llvm.maximum", "minimum": "llvm.minimum"}


class GpuEmitter(Emitter):
    triple = TRIPLE

    def kernel(self, k: int, node: isl.AstNode) -> None:
        """``ptx_kernel void name(ptr buffers..., i64 ints...)``; the body gets
        the thread's global index as its part and the thread count as parts."""
        from ..schedule import statements_in
        names = statements_in(node)
        name = self.kernel_name(k, names)
        nb, ni = len(self.buffer_arrays), len(self.int_slots)
        body_fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [PTR] * nb + [I64] * (ni + 2)),
                              name + "_body")
        body_fn.linkage = "internal"
        body_fn.attributes.add("alwaysinline")
        for arg in body_fn.args[:nb]:
            arg.add_attribute("noalias")
        self.top = _parallel_top(node)
        self.body(body_fn, node)
        fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [PTR] * nb + [I64] * ni), name)
        fn.calling_convention = "ptx_kernel"
        for arg in fn.args[:nb]:
            arg.add_attribute("noalias")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        sreg = lambda r: b.zext(b.call(self.module.declare_intrinsic(  # noqa: E731
            _SREG + r, (), ir.FunctionType(I32, [])), []), I64)
        ntid = sreg("ntid.x")
        gid = b.add(b.mul(sreg("ctaid.x"), ntid), sreg("tid.x"))
        b.call(body_fn, list(fn.args) + [gid, b.mul(sreg("nctaid.x"), ntid)])
        b.ret_void()
        self.kernels.append(KernelInfo(name, self.parallel, tuple(sorted(names))))

    def node(self, n: isl.AstNode) -> None:
        if n.get_type() == isl.ast_node_type.mark and n.mark_get_id().get_name().startswith("parallel:"):
            if n.mark_get_id().get_name() == self.top and not self.in_parallel:
                self.in_parallel = self.parallel = True
                self.grid_loop(n)
            else:  # a parallel loop inside a sequential one runs in order
                self.node(n.mark_get_node())
            return
        super().node(n)

    def grid_loop(self, mark: isl.AstNode) -> None:
        """The chain of marked loops under mark as one collapsed loop, its
        iterations dealt out to threads: thread t runs t, t + parts, ..."""
        loops, rest, seen = [], mark, set()
        while rest.get_type() == isl.ast_node_type.mark and rest.mark_get_id().get_name().startswith("parallel:"):
            want = rest.mark_get_id().get_name()[len("parallel:"):]
            child = rest.mark_get_node()
            if child.get_type() == isl.ast_node_type.for_:
                if child.for_get_iterator().get_id().get_name() != want or not self.splittable(child) \
                        or _uses(child.for_get_init(), seen) or _uses(child.for_get_cond(), seen):
                    rest = child
                    break
                loops.append(child)
                seen.add(want)
                rest = child.for_get_body()
            else:
                rest = child
        b = self.b
        one, zero = ir.Constant(I64, 1), ir.Constant(I64, 0)
        bounds, total = [], one
        for loop in loops:
            lo, inc = self.aexpr(loop.for_get_init()), self.aexpr(loop.for_get_inc())
            cond = loop.for_get_cond()
            hi = self.aexpr(cond.get_op_arg(1))
            if cond.get_op_type() == isl.ast_expr_op_type.le:
                hi = b.add(hi, one)
            trips = b.sdiv(b.add(b.sub(hi, lo), b.sub(inc, one)), inc)
            trips = b.select(b.icmp_signed("<", trips, zero), zero, trips)
            bounds.append((loop.for_get_iterator().get_id().get_name(), lo, inc, trips))
            total = b.mul(total, trips)
        g = self.var("gpu.g")
        b.store(self.part, g)
        head = self.fn.append_basic_block("grid.head")
        body = self.fn.append_basic_block("grid.body")
        done = self.fn.append_basic_block("grid.done")
        b.branch(head)
        b.position_at_end(head)
        b.cbranch(b.icmp_signed("<", b.load(g, typ=I64), total), body, done)
        b.position_at_end(body)
        rem = b.load(g, typ=I64)
        for k, (it, lo, inc, trips) in enumerate(reversed(bounds)):
            idx = rem if k == len(bounds) - 1 else b.urem(rem, trips)
            if k < len(bounds) - 1:
                rem = b.udiv(rem, trips)
            b.store(b.add(lo, b.mul(idx, inc)), self.var(it))
        self.node(rest)
        b = self.b
        b.store(b.add(b.load(g, typ=I64), self.parts), g)
        b.branch(head)
        b.position_at_end(done)

    # ------------------------------------------------------ target hooks
    def math(self, op: str, a: list) -> ir.Value:
        """No C library on the device: float32 kernels from mathlib and
        compositions of them; NVPTX's own instructions for the rest."""
        t = a[0].type
        if t == F32 and op in mathlib.KERNELS:
            return mathlib.KERNELS[op](self.b, self.module, *a)
        if op in _GPU_INTRINSIC:
            return self.call(_GPU_INTRINSIC[op], a)
        if t == F32 and op in _COMPOSED:
            return _COMPOSED[op](self, *a)
        raise UnsupportedOpError(f"{op} on {'float32' if t == F32 else str(t)} is not supported by target 'nvgpu'")

    def malloc(self, nbytes):
        raise UnsupportedOpError("a buffer too large for a GPU thread")


def _log1p(e: GpuEmitter, x):
    b, t = e.b, x.type
    u = b.fadd(ir.Constant(t, 1.0), x)
    r = b.fmul(e.math("log", [u]), b.fdiv(x, b.fsub(u, ir.Constant(t, 1.0))))  # Kahan's correction
    r = b.select(b.fcmp_ordered("==", u, ir.Constant(t, 1.0)), x, r)
    return b.select(b.fcmp_ordered("==", x, ir.Constant(t, math.inf)), x, r)


def _expm1(e: GpuEmitter, x):
    b, t = e.b, x.type
    u = e.math("exp", [x])
    um1 = b.fsub(u, ir.Constant(t, 1.0))
    r = b.fdiv(b.fmul(um1, x), e.math("log", [u]))
    r = b.select(b.fcmp_ordered("==", um1, ir.Constant(t, -1.0)), um1, r)
    r = b.select(b.fcmp_ordered("==", u, ir.Constant(t, math.inf)), u, r)
    return b.select(b.fcmp_ordered("==", u, ir.Constant(t, 1.0)), x, r)


def _pow(e: GpuEmitter, x, y):
    """exp(y log|x|), with the sign of an odd integer power and C's special cases."""
    b, t = e.b, x.type
    zero, one = ir.Constant(t, 0.0), ir.Constant(t, 1.0)
    mag = e.math("exp", [b.fmul(y, e.math("log", [e.call("llvm.fabs", [x])]))])
    yint = b.fcmp_ordered("==", e.call("llvm.floor", [y]), y)
    half = b.fmul(y, ir.Constant(t, 0.5))
    odd = b.and_(yint, b.fcmp_ordered("!=", e.call("llvm.floor", [half]), half))
    neg = b.fcmp_ordered("<", x, zero)
    r = b.select(b.and_(neg, odd), b.fneg(mag), mag)
    r = b.select(b.and_(neg, b.not_(yint)), ir.Constant(t, math.nan), r)
    return b.select(b.or_(b.fcmp_ordered("==", y, zero), b.fcmp_ordered("==", x, one)), one, r)


def _atan2(e: GpuEmitter, y, x):
    """Cephes' atanf on min/max of |y|, |x| (in [0, 1], reduced by pi/4 when
    over tan(pi/8)), then moved to its quadrant."""
    b, t = e.b, x.type
    c = lambda v: ir.Constant(t, v)  # noqa: E731
    fabs = lambda v: e.call("llvm.fabs", [v])  # noqa: E731
    ax, ay = fabs(x), fabs(y)
    hi = e.call("llvm.maxnum", [ax, ay])
    lo = e.call("llvm.minnum", [ax, ay])
    a = b.fdiv(lo, hi)
    a = b.select(b.fcmp_ordered("==", hi, c(0.0)), c(0.0), a)
    a = b.select(b.fcmp_ordered("==", lo, c(math.inf)), c(1.0), a)
    big = b.fcmp_ordered(">", a, c(0.4142135623730950))
    r = b.select(big, b.fdiv(b.fsub(a, c(1.0)), b.fadd(a, c(1.0))), a)
    z = b.fmul(r, r)
    p = mathlib._poly(b, z, [8.05374449538e-2, -1.38776856032e-1, 1.99777106478e-1, -3.33329491539e-1])
    r = mathlib._muladd(b, b.fmul(p, z), r, r)
    r = b.select(big, b.fadd(r, c(math.pi / 4)), r)
    r = b.select(b.fcmp_ordered(">", ay, ax), b.fsub(c(math.pi / 2), r), r)
    r = b.select(b.icmp_signed("<", b.bitcast(x, I32), ir.Constant(I32, 0)), b.fsub(c(math.pi), r), r)
    r = e.call("llvm.copysign", [r, y])
    return b.select(b.fcmp_unordered("uno", x, y), b.fadd(x, y), r)


_COMPOSED = {"log1p": _log1p, "expm1": _expm1, "pow": _pow, "atan2": _atan2}


def _uses(e: isl.AstExpr, names: set[str]) -> bool:
    if not names:
        return False
    t = e.get_type()
    if t == isl.ast_expr_type.id:
        return e.get_id().get_name() in names
    if t == isl.ast_expr_type.op:
        return any(_uses(e.get_op_arg(i), names) for i in range(e.get_op_n_arg()))
    return False


def _parallel_top(node: isl.AstNode) -> str | None:
    """The name of the parallel mark that encloses all of the kernel (below
    guards on sizes only), or None: only such a loop may be dealt to threads
    without a barrier between its iterations and the rest of the nest."""
    while True:
        t = node.get_type()
        if t == isl.ast_node_type.if_ and not node.if_has_else_node():
            node = node.if_get_then_node()
        elif t == isl.ast_node_type.mark:
            if node.mark_get_id().get_name().startswith("parallel:"):
                return node.mark_get_id().get_name()
            node = node.mark_get_node()
        else:
            return None


@functools.cache
def _nvptx_target():
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    return llvm.Target.from_triple(TRIPLE)


def ptx(ir_text: str, arch: str = DEFAULT_ARCH) -> tuple[str, str]:
    """(optimized LLVM IR, PTX) for a GPU of the given sm_XX."""
    from .cpu import _lock
    tm = _nvptx_target().create_target_machine(cpu=arch, opt=3)
    with _lock:
        mod = llvm.parse_assembly(ir_text)
        mod.verify()
        mod.triple = TRIPLE
        mod.data_layout = str(tm.target_data)
        pto = llvm.create_pipeline_tuning_options(speed_level=3)
        pto.loop_unrolling = True
        pb = llvm.create_pass_builder(tm, pto)
        pb.getModulePassManager().run(mod, pb)
        return str(mod), tm.emit_assembly(mod)
