"""Scalar types of the IR and the promotion rule between them.

# Note [IR arithmetic types]
# The IR follows torch's type promotion for 0-dim tensors (what a mod sees when torch FlexAttention
# traces it), with one simplification: floating-point *arithmetic* never happens in float16 or
# bfloat16. Those types appear only as the type of a load from a captured tensor or as the target of
# an explicit `.to(...)`; any arithmetic on them yields float32 (the kernels compute in float32
# anyway). float64 stays float64. An evaluator may widen every float32 node to float64 to compute a
# high-precision reference; that is the only place where the computation dtype differs from the IR
# dtype.
"""

from __future__ import annotations

import enum

import torch


class DType(enum.Enum):
    BOOL = "bool"
    INT32 = "i32"
    INT64 = "i64"
    FLOAT16 = "f16"
    BFLOAT16 = "bf16"
    FLOAT32 = "f32"
    FLOAT64 = "f64"

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    @property
    def is_int(self) -> bool:
        return self in (DType.INT32, DType.INT64)

    @property
    def is_bool(self) -> bool:
        return self is DType.BOOL

    @property
    def torch(self) -> torch.dtype:
        return _TO_TORCH[self]

    @staticmethod
    def from_torch(dtype: torch.dtype) -> DType:
        try:
            return _FROM_TORCH[dtype]
        except KeyError:
            supported = ", ".join(str(d) for d in _FROM_TORCH)
            raise TypeError(
                f"flexfa cannot use values of dtype {dtype}; supported: {supported}"
            ) from None

    def __repr__(self) -> str:
        return self.value


_FLOATS = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})

_TO_TORCH = {
    DType.BOOL: torch.bool,
    DType.INT32: torch.int32,
    DType.INT64: torch.int64,
    DType.FLOAT16: torch.float16,
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT32: torch.float32,
    DType.FLOAT64: torch.float64,
}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
# Narrower integer types load fine and are widened to int32 on load.
for _t in (torch.int8, torch.uint8, torch.int16):
    _FROM_TORCH[_t] = DType.INT32

_RANK = {
    DType.BOOL: 0,
    DType.INT32: 1,
    DType.INT64: 2,
    DType.FLOAT16: 3,
    DType.BFLOAT16: 3,
    DType.FLOAT32: 4,
    DType.FLOAT64: 5,
}


def arithmetic_type(dtype: DType) -> DType:
    """The type arithmetic on `dtype` produces (see Note [IR arithmetic types])."""
    if dtype in (DType.FLOAT16, DType.BFLOAT16):
        return DType.FLOAT32
    return dtype


def promote(a: DType, b: DType) -> DType:
    """Result type of a binary arithmetic op between two IR values."""
    winner = a if _RANK[a] >= _RANK[b] else b
    if winner.is_bool:
        return DType.INT32  # bool + bool arithmetic -> int, as torch does for add
    return arithmetic_type(winner)


def promote_with_python(value_dtype: DType, scalar: bool | int | float) -> DType:
    """Result type of an op between an IR value and a Python scalar (torch's wrapped-number rule)."""
    if isinstance(scalar, bool):
        return arithmetic_type(value_dtype) if not value_dtype.is_bool else DType.BOOL
    if isinstance(scalar, int):
        return DType.INT32 if value_dtype.is_bool else arithmetic_type(value_dtype)
    # A Python float only widens integers and bools, to the default float type.
    if value_dtype.is_float:
        return arithmetic_type(value_dtype)
    return DType.FLOAT32


def python_scalar_type(value: bool | int | float) -> DType:
    """The IR type of a Python constant when it stands alone."""
    if isinstance(value, bool):
        return DType.BOOL
    if isinstance(value, int):
        return DType.INT32 if -(2**31) <= value < 2**31 else DType.INT64
    return DType.FLOAT32


_INT_RANGE = {DType.INT32: (-(2**31), 2**31 - 1), DType.INT64: (-(2**63), 2**63 - 1)}


def fits(value: int, dtype: DType) -> bool:
    """Whether the integer `value` is representable in the integer type `dtype`."""
    lo, hi = _INT_RANGE[dtype]
    return lo <= value <= hi
