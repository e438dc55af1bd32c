"""Typed constructors for IR nodes.

Every constructor checks its operands and inserts explicit `CAST`s so that, after construction,
each arithmetic node's operands have exactly the node's own type (comparisons: a common type). The
verifier (`flexfa.ir.verify`) checks the same invariants; codegen can rely on them.
"""

from __future__ import annotations

import math

from flexfa.ir.dtypes import DType, arithmetic_type, fits, promote, python_scalar_type
from flexfa.ir.nodes import (
    ARITH_BINARY_OPS,
    COMPARE_OPS,
    LOGIC_OPS,
    SHIFT_OPS,
    UNARY_FLOAT_OPS,
    VAR_TYPES,
    Capture,
    Node,
    Op,
)
from flexfa.ir.nodes import Scalar as ScalarArg

Scalar = bool | int | float


class IRTypeError(TypeError):
    """An operation the IR cannot express with these operand types."""


def const(value: Scalar, dtype: DType | None = None) -> Node:
    if dtype is None:
        dtype = python_scalar_type(value)
    if dtype.is_bool:
        value = bool(value)
    elif dtype.is_int:
        if isinstance(value, float):
            if not math.isfinite(value):
                raise IRTypeError(f"cannot make an integer constant from {value}")
            value = int(value)
        value = int(value)
        if not fits(value, dtype):
            raise IRTypeError(f"the integer {value} does not fit in {dtype.value}")
    else:
        value = float(value)
    return Node(Op.CONST, dtype, (), value)


def var(name: str) -> Node:
    try:
        return Node(Op.VAR, VAR_TYPES[name], (), name)
    except KeyError:
        raise ValueError(
            f"unknown mod parameter {name!r}; expected one of {list(VAR_TYPES)}"
        ) from None


def capture(cap: Capture) -> Node:
    return Node(Op.CAPTURE, cap.dtype, (), cap)


def scalar(arg: ScalarArg) -> Node:
    """A lifted Python number (Note [Lifted scalars])."""
    return Node(Op.SCALAR, arg.dtype, (), arg)


def load(cap_node: Node, indices: tuple[Node, ...]) -> Node:
    if cap_node.op is not Op.CAPTURE:
        raise IRTypeError("load() needs a CAPTURE node")
    cap: Capture = cap_node.arg
    if len(indices) != cap.ndim:
        raise IRTypeError(
            f"captured tensor {cap.name!r} has {cap.ndim} dims but was indexed with {len(indices)}"
        )
    fixed = []
    for i, idx in enumerate(indices):
        if idx.dtype.is_bool:
            idx = cast(idx, DType.INT32)
        if not idx.dtype.is_int:
            raise IRTypeError(
                f"index {i} into captured tensor {cap.name!r} has type {idx.dtype!r}; "
                "indices must be integers (use .to(torch.int32) or torch.floor(...).to(torch.int32))"
            )
        fixed.append(idx)
    return Node(Op.LOAD, cap.dtype, (cap_node, *fixed))


def cast(x: Node, dtype: DType) -> Node:
    if x.dtype is dtype:
        return x
    return Node(Op.CAST, dtype, (x,), dtype)


def to_arith(x: Node) -> Node:
    """Widen f16/bf16 to the arithmetic type (see Note [IR arithmetic types])."""
    return cast(x, arithmetic_type(x.dtype))


def unary(op: Op, x: Node) -> Node:
    if op is Op.CAST:
        raise IRTypeError("use cast()")
    if op in UNARY_FLOAT_OPS:
        if x.dtype.is_float:
            x = to_arith(x)
        else:
            x = cast(x, DType.FLOAT32)
        return Node(op, x.dtype, (x,))
    if op is Op.NOT:
        if not (x.dtype.is_bool or x.dtype.is_int):
            raise IRTypeError(f"~ needs a bool or integer operand, got {x.dtype!r}")
        return Node(op, x.dtype, (x,))
    if x.dtype.is_bool:
        raise IRTypeError(f"{op.value} is not defined for bool operands; use ~ for logical not")
    x = to_arith(x)
    if op in (Op.FLOOR, Op.CEIL) and x.dtype.is_int:
        return x  # floor/ceil of an integer is the integer itself (torch returns it unchanged)
    return Node(op, x.dtype, (x,))


def binary(op: Op, a: Node, b: Node) -> Node:
    if op in LOGIC_OPS:
        if a.dtype.is_float or b.dtype.is_float:
            raise IRTypeError(
                f"{op.value} needs bool (or integer) operands, got {a.dtype!r} and {b.dtype!r}"
            )
        if a.dtype.is_bool and b.dtype.is_bool:
            return Node(op, DType.BOOL, (a, b))
        t = promote(a.dtype, b.dtype)
        return Node(op, t, (cast(a, t), cast(b, t)))
    if op in SHIFT_OPS:
        if not (a.dtype.is_int and b.dtype.is_int):
            raise IRTypeError(
                f"{'<<' if op is Op.SHL else '>>'} needs integer operands, got {a.dtype!r} and "
                f"{b.dtype!r}"
            )
        t = promote(a.dtype, b.dtype)
        return Node(op, t, (cast(a, t), cast(b, t)))
    if op in COMPARE_OPS:
        if a.dtype.is_bool and b.dtype.is_bool and op in (Op.EQ, Op.NE):
            return Node(op, DType.BOOL, (a, b))
        t = promote(a.dtype, b.dtype)
        return Node(op, DType.BOOL, (cast(a, t), cast(b, t)))
    if op not in ARITH_BINARY_OPS:
        raise IRTypeError(f"{op} is not a binary op")
    t = promote(a.dtype, b.dtype)
    if op is Op.TRUEDIV and not t.is_float:
        t = DType.FLOAT32
    if op is Op.POW and not t.is_float and b.op is Op.CONST and b.arg < 0:
        raise IRTypeError(
            f"an integer raised to the negative power {b.arg} is not an integer (torch raises); "
            "use a float base, e.g. 2.0 ** -x"
        )
    return Node(op, t, (cast(a, t), cast(b, t)))


def where(cond: Node, a: Node, b: Node) -> Node:
    if not cond.dtype.is_bool:
        raise IRTypeError(f"torch.where needs a bool condition, got {cond.dtype!r}")
    if a.dtype.is_bool and b.dtype.is_bool:
        return Node(Op.WHERE, DType.BOOL, (cond, a, b))
    t = promote(a.dtype, b.dtype)
    return Node(Op.WHERE, t, (cond, cast(a, t), cast(b, t)))


# Short spellings used by autodiff, simplification and tests.
def add(a: Node, b: Node) -> Node:
    return binary(Op.ADD, a, b)


def sub(a: Node, b: Node) -> Node:
    return binary(Op.SUB, a, b)


def mul(a: Node, b: Node) -> Node:
    return binary(Op.MUL, a, b)


def div(a: Node, b: Node) -> Node:
    return binary(Op.TRUEDIV, a, b)


def neg(a: Node) -> Node:
    return unary(Op.NEG, a)


def fconst(value: float, like: Node) -> Node:
    """A float constant of the arithmetic type of `like` (float32 unless `like` is float64)."""
    t = arithmetic_type(like.dtype) if like.dtype.is_float else DType.FLOAT32
    return const(float(value), t)
