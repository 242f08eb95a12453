"""The code of a library statement (polyjit.library.Gemm): a call to BLAS's
sgemm, its work shared by the parts of a parallel kernel.

Each part multiplies its own strip of the split dimension (positions of the
image), calling a single-threaded sgemm on its own thread: the kernel runs
on polyjit's thread team like any other, and BLAS's own threads, which spin
after a call, never compete with the team for the cores.
"""
from __future__ import annotations

import threading

from llvmlite import binding as llvm
from llvmlite import ir

from ..errors import UnsupportedOpError
from ..library import NO_TRANS, ROW_MAJOR, TRANS, Gemm, blas

I8, I32, I64, F32, PTR = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType(), ir.PointerType()
SGEMM, THREADS = "polyjit_blas_sgemm", "polyjit_blas_threads_local"
ENTRY, ADAPTER = "polyjit_blas_entry", "polyjit_blas_adapter"  # the library's own sgemm; SGEMM's form of it

STRIP_ALIGN = 16  # a strip's width: whole vectors of columns


def cblas_args(size: ir.IntType) -> list:
    """cblas_sgemm's parameters, its sizes of the given width."""
    return [I32, I32, I32, size, size, size, F32, PTR, size, PTR, size, F32, PTR, size]


_adapter_lock = threading.Lock()
_adapter = None  # the JitModule of the entry adapting SGEMM's calls to the process's BLAS, kept with its code


def register_symbols() -> bool:
    """Bind the names generated code calls BLAS by to this process's BLAS:
    code refers to them by name only (object code from the compile cache,
    made by another process, loads here), through one form of call (cblas,
    row-major, 64-bit sizes) whichever BLAS answers. False without a BLAS."""
    global _adapter
    lib = blas()
    if lib is None:
        return False
    if lib.fortran or lib.int_bits != 64:
        with _adapter_lock:
            if _adapter is None:
                from .cpu import JitModule
                llvm.add_symbol(ENTRY, lib.sgemm)
                _adapter = JitModule(_adapter_ir(lib), optimize=False)
        llvm.add_symbol(SGEMM, _adapter.engine.get_function_address(ADAPTER))
    else:
        llvm.add_symbol(SGEMM, lib.sgemm)
    if lib.set_threads_local is not None:
        llvm.add_symbol(THREADS, lib.set_threads_local)
    return True


def _adapter_ir(lib) -> str:
    """A function of SGEMM's form calling lib's sgemm: a 32-bit cblas_sgemm,
    or a Fortran sgemm_ (column-major: the row-major product C = op(A) op(B)
    is C^T = op(B)^T op(A)^T, so B comes first; every argument by address)."""
    module = ir.Module("blas_adapter")
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), cblas_args(I64)), ADAPTER)
    b = ir.IRBuilder(fn.append_basic_block())
    order, ta, tb, m, n, k, alpha, a, lda, bb, ldb, beta, c, ldc = fn.args
    ints = {v: b.trunc(v, I32) for v in (m, n, k, lda, ldb, ldc)}
    if not lib.fortran:
        entry = ir.Function(module, ir.FunctionType(ir.VoidType(), cblas_args(I32)), ENTRY)
        b.call(entry, [order, ta, tb, *(ints[v] for v in (m, n, k)), alpha, a, ints[lda], bb, ints[ldb],
                       beta, c, ints[ldc]])
        b.ret_void()
        return str(module)

    def at(value):
        slot = b.alloca(value.type)
        b.store(value, slot)
        return slot

    def letter(trans):  # 'T' or 'N'
        return at(b.select(b.icmp_signed("==", trans, ir.Constant(I32, TRANS)),
                           ir.Constant(I8, ord("T")), ir.Constant(I8, ord("N"))))
    entry = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR] * 13), ENTRY)
    b.call(entry, [letter(tb), letter(ta), at(ints[n]), at(ints[m]), at(ints[k]), at(alpha), bb, at(ints[ldb]),
                   a, at(ints[lda]), at(beta), c, at(ints[ldc])])
    b.ret_void()
    return str(module)


def _extern(em, name: str, fnty: ir.FunctionType) -> ir.Function:
    """A declaration MCJIT resolves by name (register_symbols) when it loads the code."""
    register_symbols()
    return em.module.globals.get(name) or ir.Function(em.module, fnty, name)


def emit_gemm(em, g: Gemm, env, cache, split: bool) -> None:
    """The call of g; split: each part calls it on its own strip (else the
    kernel's parallel loop already shares the work)."""
    lib = blas()
    if lib is None:
        raise UnsupportedOpError("a library contraction without a BLAS library to call")
    b = em.b
    sgemm = _extern(em, SGEMM, ir.FunctionType(ir.VoidType(), cblas_args(I64)))
    ptrs = [em.address(em.prog.arrays[a], start, env, cache) for a, start, _ in (g.a, g.b, g.c)]
    m, n, k, lda, ldb, ldc = (em.size(v) for v in (g.m, g.n, g.k, g.lda, g.ldb, g.ldc))
    total = m if g.split == "m" else n
    lo, count = ir.Constant(I64, 0), total
    if split:  # each part its strip
        per = b.sdiv(b.add(total, b.sub(em.parts, ir.Constant(I64, 1))), em.parts)
        per = b.and_(b.add(per, ir.Constant(I64, STRIP_ALIGN - 1)), ir.Constant(I64, -STRIP_ALIGN))
        lo = b.mul(em.part, per)
        lo = b.select(b.icmp_signed("<", lo, total), lo, total)
        rest = b.sub(total, lo)
        count = b.select(b.icmp_signed("<", per, rest), per, rest)
    call = em.fn.append_basic_block("gemm.call")
    after = em.fn.append_basic_block("gemm.done")
    b.cbranch(b.icmp_signed(">", count, ir.Constant(I64, 0)), call, after)
    b.position_at_end(call)
    threads = _extern(em, THREADS, ir.FunctionType(I32, [I32])) if lib.set_threads_local is not None else None
    if threads is not None:  # one thread for this call, the caller's setting back after it (the caller's own
        before = b.call(threads, [ir.Constant(I32, 1)])  # calls of the library, a framework's, keep their threads)
    moved = [b.gep(p, [b.mul(lo, ir.Constant(I64, step) if isinstance(step, int) else em.size(step))],
                   source_etype=F32) for p, step in zip(ptrs, g.steps)]
    if g.split == "m":
        m = count
    else:
        n = count
    b.call(sgemm, [ir.Constant(I32, ROW_MAJOR), ir.Constant(I32, TRANS if g.trans_a else NO_TRANS),
                   ir.Constant(I32, TRANS if g.trans_b else NO_TRANS), m, n, k, ir.Constant(F32, 1.0),
                   moved[0], lda, moved[1], ldb, ir.Constant(F32, 0.0), moved[2], ldc])
    if threads is not None:
        b.call(threads, [before])
    b.branch(after)
    b.position_at_end(after)
