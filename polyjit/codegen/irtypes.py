"""The LLVM types of polyjit's values: each dtype's type in registers
(COMPUTE: half-width floats computed in float32) and in memory (STORAGE)."""
from __future__ import annotations

import numpy as np
from llvmlite import ir

from ..dtypes import DataType

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32, F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()
PTR = ir.PointerType()
BF16 = ir.BFloatType() if hasattr(ir, "BFloatType") else ir.IntType(16)

def storage_constant(dt: DataType, value) -> ir.Constant:
    """value as dt holds it in memory (bfloat16: its 16 bits, as ml_dtypes rounds)."""
    if dt is DataType.BFloat16:
        return ir.Constant(BF16, int(np.asarray(value, dt.numpy).view(np.uint16)))
    return ir.Constant(STORAGE[dt], float(value) if dt.is_float else int(value))


_INTS = {DataType.Int8: I8, DataType.UInt8: I8, DataType.Int16: I16, DataType.Int32: I32, DataType.UInt32: I32,
         DataType.Int: I64, DataType.UInt64: I64}  # (signedness is in the ops, as LLVM's)
COMPUTE = {DataType.Bool: I1, **_INTS, DataType.Half: F32, DataType.BFloat16: F32, DataType.Float: F32,
           DataType.Double: F64}
STORAGE = {DataType.Bool: I8, **_INTS, DataType.Half: F16, DataType.BFloat16: BF16, DataType.Float: F32,
           DataType.Double: F64}
