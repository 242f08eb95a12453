"""The code of a library statement (polyjit.library.Gemm): a call to BLAS's
sgemm, its work shared by the parts of a parallel kernel.

Each part multiplies its own strip of the split dimension (positions of the
image), calling a single-threaded sgemm on its own thread: the kernel runs
on polyjit's thread team like any other, and BLAS's own threads, which spin
after a call, never compete with the team for the cores.
"""
from __future__ import annotations

from llvmlite import binding as llvm
from llvmlite import ir

from ..errors import UnsupportedOpError
from ..library import Gemm, blas

I32, I64, F32, PTR = ir.IntType(32), ir.IntType(64), ir.FloatType(), ir.PointerType()
SGEMM, THREADS = "polyjit_blas_sgemm", "polyjit_blas_threads_local"
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
STRIP_ALIGN = 16  # a strip's width: whole vectors of columns


def register_symbols() -> bool:
    """Bind the names generated code calls BLAS by to this process's BLAS:
    code refers to them by name only (object code from the compile cache,
    made by another process, loads here). False without a BLAS."""
    lib = blas()
    if lib is None:
        return False
    llvm.add_symbol(SGEMM, lib.sgemm)
    if lib.set_threads_local is not None:
        llvm.add_symbol(THREADS, lib.set_threads_local)
    return True


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
    blas_int = ir.IntType(lib.int_bits)
    fnty = ir.FunctionType(ir.VoidType(), [I32, I32, I32, blas_int, blas_int, blas_int, F32, PTR, blas_int,
                                           PTR, blas_int, F32, PTR, blas_int])
    sgemm = _extern(em, SGEMM, fnty)
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
    if lib.set_threads_local is not None:
        b.call(_extern(em, THREADS, ir.FunctionType(I32, [I32])), [ir.Constant(I32, 1)])
    moved = [b.gep(p, [b.mul(lo, ir.Constant(I64, step) if isinstance(step, int) else em.size(step))],
                   source_etype=F32) for p, step in zip(ptrs, g.steps)]
    if g.split == "m":
        m = count
    else:
        n = count

    def i(v):
        return b.trunc(v, blas_int) if blas_int.width < 64 else v
    b.call(sgemm, [ir.Constant(I32, ROW_MAJOR), ir.Constant(I32, TRANS if g.trans_a else NO_TRANS),
                   ir.Constant(I32, TRANS if g.trans_b else NO_TRANS), i(m), i(n), i(k), ir.Constant(F32, 1.0),
                   moved[0], i(lda), moved[1], i(ldb), ir.Constant(F32, 0.0), moved[2], i(ldc)])
    b.branch(after)
    b.position_at_end(after)
