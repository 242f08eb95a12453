"""Element types, their numpy equivalents and promotion rules."""
from __future__ import annotations

import enum

import numpy as np


class DataType(enum.Enum):
    """Element types, named as nvFuser names them."""

    Bool = "bool"
    Int8 = "int8"
    UInt8 = "uint8"
    Int16 = "int16"
    Int32 = "int32"
    UInt32 = "uint32"
    UInt64 = "uint64"
    Int = "int64"
    Half = "float16"
    BFloat16 = "bfloat16"
    Float = "float32"
    Double = "float64"

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    @property
    def is_int(self) -> bool:
        return self in _INTS

    @property
    def is_unsigned(self) -> bool:
        return self in (DataType.UInt8, DataType.UInt32, DataType.UInt64)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def numpy(self) -> np.dtype:
        if self is DataType.BFloat16:
            return _bfloat16()
        return np.dtype(self.value)

    @property
    def compute(self) -> "DataType":
        """The type arithmetic happens in: half types compute in float32."""
        return DataType.Float if self in (DataType.Half, DataType.BFloat16) else self

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"DataType.{self.name}"


_FLOATS = (DataType.Half, DataType.BFloat16, DataType.Float, DataType.Double)
_INTS = (DataType.Int8, DataType.UInt8, DataType.Int16, DataType.Int32, DataType.UInt32, DataType.Int,
         DataType.UInt64)
_ITEMSIZE = {DataType.Bool: 1, DataType.Int8: 1, DataType.UInt8: 1, DataType.Int16: 2, DataType.Int32: 4,
             DataType.UInt32: 4, DataType.Int: 8, DataType.UInt64: 8, DataType.Half: 2, DataType.BFloat16: 2,
             DataType.Float: 4, DataType.Double: 8}
_RANK = {DataType.Bool: 0, DataType.Int8: 1, DataType.UInt8: 1, DataType.Int16: 2, DataType.Int32: 3,
         DataType.UInt32: 3, DataType.Int: 4, DataType.UInt64: 4, DataType.Half: 5, DataType.BFloat16: 5,
         DataType.Float: 6, DataType.Double: 7}
# holds both an unsigned type and a signed one (none holds uint64 and int64: float64, as numpy promotes them)
_WIDER_SIGNED = {1: DataType.Int16, 2: DataType.Int32, 4: DataType.Int, 8: DataType.Double}


def _bfloat16() -> np.dtype:
    """numpy's bfloat16, from ml_dtypes (numpy has none of its own)."""
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("bfloat16 arrays need the ml_dtypes package (pip install ml_dtypes)") from None
    return np.dtype(ml_dtypes.bfloat16)


def from_numpy(dt) -> DataType:
    """The DataType of a numpy dtype (or anything np.dtype accepts)."""
    name = np.dtype(dt).name
    for d in DataType:
        if d.value == name:
            return d
    raise TypeError(f"unsupported dtype {name!r}; supported: {[d.value for d in DataType]}")


def to_dtype(dt) -> DataType:
    """Accept a DataType, a numpy dtype, or a dtype name."""
    if isinstance(dt, DataType):
        return dt
    if isinstance(dt, str):
        for d in DataType:
            if dt in (d.value, d.name):
                return d
    return from_numpy(dt)


def promote(a: DataType, b: DataType) -> DataType:
    """Result type of a binary op on two tensors (torch/numpy category rules)."""
    if a == b:
        return a
    if {a, b} == {DataType.Half, DataType.BFloat16}:
        return DataType.Float
    if a.is_int and b.is_int and a.is_unsigned != b.is_unsigned:  # (uint8 and int8: int16, as numpy and torch)
        u, s = (a, b) if a.is_unsigned else (b, a)
        return s if s.itemsize > u.itemsize else _WIDER_SIGNED[u.itemsize]
    return a if _RANK[a] >= _RANK[b] else b


def scalar_dtype(value) -> DataType:
    """The type of a Python scalar."""
    if isinstance(value, (bool, np.bool_)):
        return DataType.Bool
    if isinstance(value, (int, np.integer)):
        return DataType.Int
    return DataType.Double


def promote_weak(tensor: DataType, scalar: DataType) -> DataType:
    """A Python scalar does not widen a tensor of its own category (torch rules)."""
    if scalar.is_float and not tensor.is_float:
        return DataType.Float
    if scalar.is_int and tensor is DataType.Bool:
        return DataType.Int
    return tensor
