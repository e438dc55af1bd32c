"""The IR's invariants, checked.

`verify(roots)` raises `IRVerificationError` naming the first bad node. It runs after tracing and
after every pass when `flexfa.config.verify_ir` is on (always under pytest, or FLEXFA_VERIFY_IR=1).
"""

from __future__ import annotations

from flexfa.ir.dtypes import DType, arithmetic_type, fits
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
    Scalar,
    toposort,
)


class IRVerificationError(AssertionError):
    pass


def _fail(node: Node, why: str) -> None:
    from flexfa.ir.printer import format_expr

    raise IRVerificationError(f"{why}: {node.op.value} node {format_expr(node)} ({node.dtype!r})")


def _check_const(node: Node) -> None:
    v = node.arg
    ok = (
        (node.dtype.is_bool and isinstance(v, bool))
        or (
            node.dtype.is_int
            and isinstance(v, int)
            and not isinstance(v, bool)
            and fits(v, node.dtype)
        )
        or (node.dtype.is_float and isinstance(v, float))
    )
    if not ok or node.srcs:
        _fail(node, f"constant value {v!r} does not match its type")


def _check_node(node: Node) -> None:
    op, t, srcs = node.op, node.dtype, node.srcs
    if op is Op.CONST:
        _check_const(node)
    elif op is Op.VAR:
        if VAR_TYPES.get(node.arg) is not t or srcs:
            _fail(node, "unknown variable or wrong type")
    elif op is Op.CAPTURE:
        if not isinstance(node.arg, Capture) or node.arg.dtype is not t or srcs:
            _fail(node, "capture type mismatch")
    elif op is Op.SCALAR:
        if not isinstance(node.arg, Scalar) or node.arg.dtype is not t or srcs:
            _fail(node, "scalar type mismatch")
    elif op is Op.LOAD:
        if not srcs or srcs[0].op is not Op.CAPTURE:
            _fail(node, "load must read a CAPTURE")
        cap: Capture = srcs[0].arg
        if len(srcs) - 1 != cap.ndim or t is not cap.dtype:
            _fail(node, f"load of {cap.name!r} has the wrong number of indices or type")
        if not all(s.dtype.is_int for s in srcs[1:]):
            _fail(node, "load indices must be integers")
    elif op is Op.CAST:
        if node.arg is not t or len(srcs) != 1:
            _fail(node, "cast target mismatch")
    elif op in UNARY_FLOAT_OPS:
        if (
            len(srcs) != 1
            or srcs[0].dtype is not t
            or arithmetic_type(t) is not t
            or not t.is_float
        ):
            _fail(node, "float unary op needs one f32/f64 operand of its own type")
    elif op is Op.NOT:
        if len(srcs) != 1 or srcs[0].dtype is not t or t.is_float:
            _fail(node, "~ needs one bool/int operand of its own type")
    elif op in (Op.NEG, Op.ABS, Op.SIGN, Op.FLOOR, Op.CEIL):
        if len(srcs) != 1 or srcs[0].dtype is not t or t.is_bool or arithmetic_type(t) is not t:
            _fail(node, "unary arithmetic needs one operand of its own (arithmetic) type")
    elif op in ARITH_BINARY_OPS:
        if len(srcs) != 2 or any(s.dtype is not t for s in srcs):
            _fail(node, "binary arithmetic operands must have the result type")
        if t.is_bool or arithmetic_type(t) is not t:
            _fail(node, "binary arithmetic on a non-arithmetic type")
        if op is Op.TRUEDIV and not t.is_float:
            _fail(node, "true division must be floating point")
    elif op in COMPARE_OPS:
        if t is not DType.BOOL or len(srcs) != 2 or srcs[0].dtype is not srcs[1].dtype:
            _fail(node, "comparison needs two operands of one type and yields bool")
    elif op in LOGIC_OPS:
        if len(srcs) != 2 or any(s.dtype is not t for s in srcs) or t.is_float:
            _fail(node, "logic op needs two bool/int operands of its type")
    elif op in SHIFT_OPS:
        if len(srcs) != 2 or any(s.dtype is not t for s in srcs) or not t.is_int:
            _fail(node, "shift needs two integer operands of its type")
    elif op is Op.WHERE:
        if len(srcs) != 3 or not srcs[0].dtype.is_bool:
            _fail(node, "where needs a bool condition")
        if srcs[1].dtype is not t or srcs[2].dtype is not t:
            _fail(node, "where branches must have the result type")
    else:  # pragma: no cover - every Op is handled above
        _fail(node, "unknown op")


def verify(roots: list[Node] | tuple[Node, ...], *, allowed_vars: tuple[str, ...] | None = None):
    """Check every node below `roots`; optionally restrict which mod parameters may appear."""
    for node in toposort(list(roots)):
        _check_node(node)
        if allowed_vars is not None and node.op is Op.VAR and node.arg not in allowed_vars:
            _fail(node, f"variable {node.arg!r} is not a parameter here (allowed: {allowed_vars})")
