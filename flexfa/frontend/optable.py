"""The operation table: torch functions and tensor methods called on traced values, as IR.

`dispatch(tracer, func, args, kwargs)` is what `Proxy.__torch_function__` and the traced tensor
methods call: a registered lowering (`lowerings.py`) first, then vector values (`vector.py`), then
this table, keyed by torch function / method name. `TRACEABLE_NAMES` is every name it handles
(docs/semantics.md lists them; a test checks that the two agree).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from flexfa.frontend import proxy as px
from flexfa.frontend.activations import ACTIVATIONS
from flexfa.ir import build as irb
from flexfa.ir.build import IRTypeError
from flexfa.ir.dtypes import DType
from flexfa.ir.nodes import Node, Op

if TYPE_CHECKING:
    from flexfa.frontend.trace import Tracer


def _as_dtype(tracer: Tracer, value: Any) -> DType | None:
    if isinstance(value, torch.dtype):
        try:
            return DType.from_torch(value)
        except TypeError as e:
            tracer.fail(str(e))
    return None


# Keys are torch function / method names.
def _by_name(spellings: dict[Op, str]) -> dict[str, Op]:
    """{op: "name other_name ..."} as {name: op}."""
    return {name: op for op, names in spellings.items() for name in names.split()}


_BINARY_NAMES = _by_name(
    {
        Op.ADD: "add __add__ __iadd__",
        Op.SUB: "sub subtract __sub__ __isub__",
        Op.MUL: "mul multiply __mul__ __imul__",
        Op.TRUEDIV: "true_divide __truediv__ __itruediv__ __div__",
        Op.FLOORDIV: "floor_divide __floordiv__",
        Op.MOD: "remainder __mod__",
        Op.POW: "pow __pow__",
        Op.MIN: "minimum",
        Op.MAX: "maximum",
        Op.LT: "lt less __lt__",
        Op.LE: "le less_equal __le__",
        Op.EQ: "eq __eq__",
        Op.NE: "ne not_equal __ne__",
        Op.AND: "logical_and bitwise_and __and__ __iand__",
        Op.OR: "logical_or bitwise_or __or__ __ior__",
        Op.XOR: "logical_xor bitwise_xor __xor__ __ixor__",
        Op.SHL: "bitwise_left_shift __lshift__ __ilshift__",
        Op.SHR: "bitwise_right_shift __rshift__ __irshift__",
    }
)
_SWAPPED_COMPARE = {
    "gt": Op.LT,
    "greater": Op.LT,
    "__gt__": Op.LT,
    "ge": Op.LE,
    "greater_equal": Op.LE,
    "__ge__": Op.LE,
}
_REFLECTED = {
    "__radd__": Op.ADD,
    "__rsub__": Op.SUB,
    "__rmul__": Op.MUL,
    "__rtruediv__": Op.TRUEDIV,
    "__rdiv__": Op.TRUEDIV,
    "__rfloordiv__": Op.FLOORDIV,
    "__rmod__": Op.MOD,
    "__rpow__": Op.POW,
    "__rand__": Op.AND,
    "__ror__": Op.OR,
    "__rxor__": Op.XOR,
    "__rlshift__": Op.SHL,
    "__rrshift__": Op.SHR,
}
_UNARY_NAMES = _by_name(
    {
        Op.NEG: "neg negative __neg__",
        Op.ABS: "abs absolute __abs__",
        Op.SIGN: "sign sgn",
        Op.EXP: "exp",
        Op.EXP2: "exp2",
        Op.LOG: "log",
        Op.LOG2: "log2",
        Op.SQRT: "sqrt",
        Op.RSQRT: "rsqrt",
        Op.TANH: "tanh",
        Op.SIGMOID: "sigmoid expit special_expit",
        Op.ERF: "erf special_erf",
        Op.SIN: "sin",
        Op.COS: "cos",
        Op.FLOOR: "floor",
        Op.CEIL: "ceil",
        Op.NOT: "logical_not bitwise_not __invert__",
    }
)

_CAST_METHODS = {
    "float": DType.FLOAT32,
    "double": DType.FLOAT64,
    "half": DType.FLOAT16,
    "bfloat16": DType.BFLOAT16,
    "int": DType.INT32,
    "long": DType.INT64,
    "bool": DType.BOOL,
}


def _unwrap_name(func: Any) -> str:
    if isinstance(func, str):
        return func
    return getattr(func, "__name__", repr(func))


def dispatch(tracer: Tracer, func: Any, args: tuple, kwargs: dict) -> Any:
    """Turn one torch call on traced values into IR."""
    from flexfa.frontend import lowerings

    lowering = lowerings.lookup(func)
    if lowering is not None:
        return lowering(*args, **kwargs)
    if lowerings.op_name(func) is not None:
        return _trace_through(tracer, func, args, kwargs)
    name = _unwrap_name(func)
    if any(px._is_vector(a) for a in (*args, *kwargs.values())) and not (
        name == "__getitem__" and isinstance(args[0], torch.Tensor)
    ):
        from flexfa.frontend import vector  # Note [Unrolled reductions]

        return vector.dispatch(tracer, name, args, kwargs)
    try:
        return _dispatch(tracer, name, args, kwargs)
    except IRTypeError as e:
        tracer.fail(f"{name}: {e}")
        raise AssertionError from e


def _trace_through(tracer: Tracer, func: Any, args: tuple, kwargs: dict) -> Any:
    """A custom op without a lowering, traced through its Python implementation (Note [Custom
    ops traced through their Python implementation] in lowerings.py), or the error asking for a
    lowering, with the reason it could not be traced."""
    from flexfa.frontend import lowerings

    impl = lowerings.python_implementation(func, tracer.device.type)
    if impl is None:
        tracer.fail(lowerings.unregistered_op_hint(func, "and no Python implementation to trace"))
        raise AssertionError
    try:
        result = impl.fn(*args, **kwargs)
    except Exception as e:  # anything the implementation does that flexfa cannot trace
        message = str(e).split(": ", 1)[-1] if isinstance(e, px.ModTraceError) else str(e)
        why = f"tracing {impl.kernel} failed: {type(e).__name__}: {message}"
        tracer.fail(lowerings.unregistered_op_hint(func, why))
        raise AssertionError from e
    if not isinstance(result, px.Proxy) and not px._is_vector(result):
        why = f"{impl.kernel} returned a {type(result).__name__}, not one traced value"
        tracer.fail(lowerings.unregistered_op_hint(func, why))
    tracer.note_traced_through(impl.describe())
    return result


def _arg(args: tuple, kwargs: dict, i: int, key: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(key, default)


def _dispatch(tracer: Tracer, name: str, args: tuple, kwargs: dict) -> Any:
    L = lambda v: px.lift(tracer, v)
    W = lambda n: px._wrap(tracer, n)

    if name == "__getitem__":
        return tracer.index(args[0], args[1])
    if name in _BINARY_NAMES:
        other = _arg(args, kwargs, 1, "other")
        alpha = kwargs.get("alpha")
        if alpha is not None and name in ("add", "sub", "subtract"):
            other = px._binary(tracer, Op.MUL, other, alpha)
        return W(irb.binary(_BINARY_NAMES[name], L(args[0]), L(other)))
    if name in _SWAPPED_COMPARE:
        return W(irb.binary(_SWAPPED_COMPARE[name], L(_arg(args, kwargs, 1, "other")), L(args[0])))
    if name in _REFLECTED:
        return W(irb.binary(_REFLECTED[name], L(args[1]), L(args[0])))
    if name in ("div", "divide", "__truediv__"):
        mode = kwargs.get("rounding_mode", args[2] if len(args) > 2 else None)
        a, b = L(args[0]), L(_arg(args, kwargs, 1, "other"))
        if mode is None:
            return W(irb.binary(Op.TRUEDIV, a, b))
        if mode == "floor":
            return W(irb.binary(Op.FLOORDIV, a, b))
        if mode == "trunc":
            return W(_trunc_div(a, b))
        tracer.fail(f"torch.div with rounding_mode={mode!r} is not supported")
    if name in _UNARY_NAMES:
        return W(irb.unary(_UNARY_NAMES[name], L(args[0])))
    if name == "square":
        x = L(args[0])
        return W(irb.mul(x, x))
    if name == "reciprocal":
        x = L(args[0])
        return W(irb.div(irb.const(1.0), x))
    if name in ACTIVATIONS:
        return W(ACTIVATIONS[name](tracer, args, kwargs))
    if name == "log1p":
        return W(irb.unary(Op.LOG, irb.add(irb.const(1.0), L(args[0]))))
    if name == "expm1":
        return W(irb.sub(irb.unary(Op.EXP, L(args[0])), irb.const(1.0)))
    if name == "log10":
        return W(irb.mul(irb.unary(Op.LOG2, L(args[0])), irb.const(math.log10(2.0))))
    if name == "trunc":
        x = L(args[0])
        if not x.dtype.is_float:
            return W(x)
        return W(
            irb.where(
                irb.binary(Op.LT, x, irb.fconst(0.0, x)),
                irb.unary(Op.CEIL, x),
                irb.unary(Op.FLOOR, x),
            )
        )
    if name == "where":
        if len(args) + len(kwargs) < 3:
            tracer.fail("torch.where needs three arguments (cond, a, b) inside a mod")
        cond = L(_arg(args, kwargs, 0, "condition"))
        return W(
            irb.where(cond, L(_arg(args, kwargs, 1, "input")), L(_arg(args, kwargs, 2, "other")))
        )
    if name in ("clamp", "clip", "clamp_min", "clamp_max"):
        x = L(args[0])
        lo = _arg(args, kwargs, 1, "min") if name != "clamp_max" else None
        hi = _arg(args, kwargs, 2, "max") if name in ("clamp", "clip") else None
        if name == "clamp_max":
            hi = _arg(args, kwargs, 1, "max")
        if lo is None and hi is None:
            tracer.fail(f"{name} needs min or max")
        if lo is not None:
            x = irb.binary(Op.MAX, x, L(lo))
        if hi is not None:
            x = irb.binary(Op.MIN, x, L(hi))
        return W(x)
    if name in ("to", "type"):
        target = None
        for a in (*args[1:], kwargs.get("dtype"), kwargs.get("other")):
            if isinstance(a, px.Proxy):
                target = a.node.dtype  # x.to(other): other's dtype
            elif isinstance(a, torch.Tensor):
                target = _as_dtype(tracer, a.dtype)
            else:
                target = _as_dtype(tracer, a) or target
        if target is None:
            return args[0]  # .to(device) and friends: values are already where the kernel runs
        return W(irb.cast(L(args[0]), target))
    if name in _CAST_METHODS:
        return W(irb.cast(L(args[0]), _CAST_METHODS[name]))
    if name == "type_as":
        return W(irb.cast(L(args[0]), DType.from_torch(args[1].dtype)))
    if name in ("ones_like", "zeros_like", "full_like", "new_ones", "new_zeros", "new_full"):
        return W(_constant_like(tracer, name, args, kwargs))
    if name in ("contiguous", "clone", "detach", "squeeze", "unsqueeze_"):
        return args[0]
    from flexfa.frontend import vector

    if name in vector.SCALAR_SHAPE_METHODS:  # Note [Shape operations on traced values]
        return vector.dispatch(tracer, name, args, kwargs)
    tracer.fail(
        f"torch.{name} cannot be traced inside a mod; supported operations are listed in "
        "docs/semantics.md (arithmetic, comparisons, & | ~, torch.where, elementwise math, casts, "
        "and indexing captured tensors)"
    )
    raise AssertionError


def _constant_like(tracer: Tracer, name: str, args: tuple, kwargs: dict) -> Node:
    proto = px.lift(tracer, args[0])
    if name in ("ones_like", "new_ones"):
        value: Any = 1
    elif name in ("zeros_like", "new_zeros"):
        value = 0
    else:
        value = _arg(args, kwargs, 2 if name == "new_full" else 1, "fill_value")
    if name.startswith("new_"):
        size = _arg(args, kwargs, 1, "size", ())
        if tuple(size) not in ((), (1,)):
            tracer.fail(f"{name} inside a mod must make a scalar (size=()), got size={size}")
    dtype = _as_dtype(tracer, kwargs.get("dtype")) or proto.dtype
    return irb.const(value, dtype)


def _trunc_div(a: Node, b: Node) -> Node:
    if a.dtype.is_float or b.dtype.is_float:
        q = irb.div(a, b)
        neg = irb.binary(Op.LT, q, irb.fconst(0.0, q))
        return irb.where(neg, irb.unary(Op.CEIL, q), irb.unary(Op.FLOOR, q))
    floor_q = irb.binary(Op.FLOORDIV, a, b)
    rem = irb.binary(Op.MOD, a, b)
    zero = irb.const(0, rem.dtype)
    signs_differ = irb.binary(Op.NE, irb.binary(Op.LT, a, zero), irb.binary(Op.LT, b, zero))
    inexact = irb.binary(Op.NE, rem, zero)
    return irb.where(
        irb.binary(Op.AND, signs_differ, inexact),
        irb.add(floor_q, irb.const(1, floor_q.dtype)),
        floor_q,
    )


METHOD_NAMES = frozenset(
    set(_BINARY_NAMES)
    | set(_SWAPPED_COMPARE)
    | set(_UNARY_NAMES)
    | set(_CAST_METHODS)
    | {
        "div",
        "divide",
        "square",
        "reciprocal",
        *ACTIVATIONS,
        "log1p",
        "expm1",
        "log10",
        "trunc",
        "clamp",
        "clip",
        "clamp_min",
        "clamp_max",
        "to",
        "type",
        "type_as",
        "new_ones",
        "new_zeros",
        "new_full",
        "contiguous",
        "clone",
        "detach",
    }
)

# Every torch function and tensor method name the tracer handles (docs/semantics.md lists them; a
# test checks the two agree). Dunders (operators) are listed in the docs as operators.
TRACEABLE_NAMES = frozenset(
    n
    for n in METHOD_NAMES | {"where", "ones_like", "zeros_like", "full_like", "squeeze"}
    if not n.startswith("__")
)
