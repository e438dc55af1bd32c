"""Symbolic stand-ins for the values a mod receives, and the table of operations they support.

A `Proxy` wraps an IR node. Python operators on proxies, torch functions called with proxies (through
`__torch_function__`) and tensor methods called on them all build IR instead of computing. Indexing a
captured tensor with proxies builds a LOAD.

# Note [Why proxies, not torch.compile]
# torch FlexAttention needs Dynamo to trace mods, which costs seconds per new mod and guards that
# recompile or fall back. A mod is a scalar function of five values; calling it once on proxies is
# enough to see all of it, takes microseconds, and needs no bytecode analysis. What this cannot see is
# Python control flow on traced values, which is why `__bool__` raises with a pointer to
# `torch.where`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from flexfa.frontend.activations import ACTIVATIONS
from flexfa.ir import build as irb
from flexfa.ir.build import IRTypeError
from flexfa.ir.dtypes import DType
from flexfa.ir.nodes import Node, Op

if TYPE_CHECKING:
    from flexfa.frontend.trace import Tracer


class ModTraceError(TypeError):
    """A mod uses something flexfa cannot trace. The message names the mod and the fix."""


_CONTROL_FLOW_HINT = (
    "a traced value cannot be used as a Python bool (if/while/and/or/not, min()/max(), chained "
    "comparisons such as a < b < c). flexfa calls the mod once on symbolic values; write the "
    "branch with torch.where(cond, a, b), combine conditions with & | ~, and use torch.minimum / "
    "torch.maximum"
)


class Proxy:
    """A traced scalar value: one IR node plus the tracer that owns it."""

    __slots__ = ("_node", "_tracer")
    __hash__ = None  # type: ignore[assignment]  # == builds IR, so proxies cannot be dict keys

    def __init__(self, tracer: Tracer, node: Node) -> None:
        self._tracer = tracer
        self._node = node

    @property
    def node(self) -> Node:
        return self._node

    # -- torch-like attributes ----------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self._node.dtype.torch

    @property
    def shape(self) -> torch.Size:
        return torch.Size([])

    @property
    def ndim(self) -> int:
        return 0

    @property
    def device(self) -> torch.device:
        return self._tracer.device

    def dim(self) -> int:
        return 0

    def size(self, dim: int | None = None):
        return torch.Size([]) if dim is None else self._tracer.fail("a traced value is a scalar")

    def __repr__(self) -> str:
        from flexfa.ir.printer import format_expr

        return f"Proxy({format_expr(self._node)}: {self._node.dtype.value})"

    # -- Python control flow is not traceable -------------------------------------------------
    def __bool__(self) -> bool:
        self._tracer.fail(_CONTROL_FLOW_HINT)
        raise AssertionError  # unreachable

    def __int__(self) -> int:
        self._tracer.fail(
            "int() of a traced value: keep it symbolic, e.g. x.to(torch.int32) or x // 1"
        )
        raise AssertionError

    def __float__(self) -> float:
        self._tracer.fail(
            "float() of a traced value (math.* functions call it): use the torch function, e.g. "
            "torch.tanh instead of math.tanh"
        )
        raise AssertionError

    def __index__(self) -> int:
        self._tracer.fail(
            "a traced value was used as a Python index (into a list, tuple or numpy array); "
            "put the data in a torch tensor and index that"
        )
        raise AssertionError

    def __iter__(self):
        self._tracer.fail("a traced value is a scalar and cannot be iterated")

    def __len__(self) -> int:
        self._tracer.fail("a traced value is a scalar and has no len()")
        raise AssertionError

    def item(self):
        self._tracer.fail(".item() of a traced value: keep it symbolic")

    def tolist(self):
        self._tracer.fail(".tolist() of a traced value: keep it symbolic")

    # -- torch dispatch -----------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        tracer = _find_tracer(args, kwargs or {})
        return dispatch(tracer, func, args, kwargs or {})

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # Tensor methods (score.tanh(), q_idx.to(torch.float32), score.clamp(min=0), ...).
        if name.startswith("_") or name not in METHOD_NAMES:
            raise AttributeError(
                f"traced values have no attribute {name!r}"
                + (
                    f" (flexfa cannot trace the tensor method .{name}())"
                    if not name.startswith("_")
                    else ""
                )
            )
        return lambda *args, **kwargs: dispatch(self._tracer, name, (self, *args), kwargs)

    # -- operators ----------------------------------------------------------------------------
    def __add__(self, o):
        return _binary(self._tracer, Op.ADD, self, o)

    def __radd__(self, o):
        return _binary(self._tracer, Op.ADD, o, self)

    def __sub__(self, o):
        return _binary(self._tracer, Op.SUB, self, o)

    def __rsub__(self, o):
        return _binary(self._tracer, Op.SUB, o, self)

    def __mul__(self, o):
        return _binary(self._tracer, Op.MUL, self, o)

    def __rmul__(self, o):
        return _binary(self._tracer, Op.MUL, o, self)

    def __truediv__(self, o):
        return _binary(self._tracer, Op.TRUEDIV, self, o)

    def __rtruediv__(self, o):
        return _binary(self._tracer, Op.TRUEDIV, o, self)

    def __floordiv__(self, o):
        return _binary(self._tracer, Op.FLOORDIV, self, o)

    def __rfloordiv__(self, o):
        return _binary(self._tracer, Op.FLOORDIV, o, self)

    def __mod__(self, o):
        return _binary(self._tracer, Op.MOD, self, o)

    def __rmod__(self, o):
        return _binary(self._tracer, Op.MOD, o, self)

    def __pow__(self, o):
        return _binary(self._tracer, Op.POW, self, o)

    def __rpow__(self, o):
        return _binary(self._tracer, Op.POW, o, self)

    def __and__(self, o):
        return _binary(self._tracer, Op.AND, self, o)

    def __rand__(self, o):
        return _binary(self._tracer, Op.AND, o, self)

    def __or__(self, o):
        return _binary(self._tracer, Op.OR, self, o)

    def __ror__(self, o):
        return _binary(self._tracer, Op.OR, o, self)

    def __xor__(self, o):
        return _binary(self._tracer, Op.XOR, self, o)

    def __rxor__(self, o):
        return _binary(self._tracer, Op.XOR, o, self)

    def __lshift__(self, o):
        return _binary(self._tracer, Op.SHL, self, o)

    def __rlshift__(self, o):
        return _binary(self._tracer, Op.SHL, o, self)

    def __rshift__(self, o):
        return _binary(self._tracer, Op.SHR, self, o)

    def __rrshift__(self, o):
        return _binary(self._tracer, Op.SHR, o, self)

    def __lt__(self, o):
        return _binary(self._tracer, Op.LT, self, o)

    def __le__(self, o):
        return _binary(self._tracer, Op.LE, self, o)

    def __gt__(self, o):
        return _binary(self._tracer, Op.LT, o, self)

    def __ge__(self, o):
        return _binary(self._tracer, Op.LE, o, self)

    def __eq__(self, o):  # type: ignore[override]
        return _binary(self._tracer, Op.EQ, self, o)

    def __ne__(self, o):  # type: ignore[override]
        return _binary(self._tracer, Op.NE, self, o)

    def __neg__(self):
        return _unary(self._tracer, Op.NEG, self)

    def __pos__(self):
        return self

    def __abs__(self):
        return _unary(self._tracer, Op.ABS, self)

    def __invert__(self):
        return _unary(self._tracer, Op.NOT, self)

    def __getitem__(self, index):
        self._tracer.fail("a traced value is a scalar and cannot be indexed")


class IndexedTensor:
    """A captured tensor indexed along its leading dims only (`table[h]` of a 2-D table).

    Further indexing (`table[h][bucket]`) completes the load; using it in arithmetic first is an
    error that names the tensor and how many indices it needs.
    """

    __slots__ = ("_indices", "_tensor", "_tracer")

    def __init__(self, tracer: Tracer, tensor: torch.Tensor, indices: tuple[Node, ...]) -> None:
        self._tracer = tracer
        self._tensor = tensor
        self._indices = indices

    def __getitem__(self, index):
        return self._tracer.index(self._tensor, index, prefix=self._indices)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        tracer = _find_tracer(args, kwargs or {})
        return dispatch(tracer, func, args, kwargs or {})

    def _incomplete(self):
        name = self._tracer.name_of(self._tensor)
        self._tracer.fail(
            f"captured tensor {name!r} has {self._tensor.ndim} dims but was used after indexing "
            f"only {len(self._indices)}; index every dim, e.g. {name}[{', '.join(['i'] * self._tensor.ndim)}]"
        )

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        from flexfa.frontend import vector

        if name in vector.VECTOR_METHODS or name in METHOD_NAMES:  # Note [Unrolled reductions]
            return lambda *args, **kwargs: vector.dispatch(
                self._tracer, name, (self, *args), kwargs
            )
        self._incomplete()

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._tensor.shape[len(self._indices) :])


# The operator dunders a vector value (VectorProxy, or a partly indexed IndexedTensor) answers by
# working on its elements (Note [Unrolled reductions]).
ELEMENTWISE_DUNDERS = (
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__floordiv__",
    "__rfloordiv__",
    "__mod__",
    "__rmod__",
    "__pow__",
    "__rpow__",
    "__and__",
    "__rand__",
    "__or__",
    "__ror__",
    "__xor__",
    "__rxor__",
    "__lshift__",
    "__rlshift__",
    "__rshift__",
    "__rrshift__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__eq__",
    "__ne__",
    "__neg__",
    "__abs__",
    "__invert__",
)


def vector_dunder(name: str):
    """The method `name` of a vector value: flexfa.frontend.vector.dispatch on its elements."""

    def method(self, *args):
        from flexfa.frontend import vector

        return vector.dispatch(self._tracer, name, (self, *args), {})

    return method


for _dunder in ELEMENTWISE_DUNDERS:
    # Arithmetic on a partly indexed tensor works on its elements (Note [Unrolled reductions]).
    setattr(IndexedTensor, _dunder, vector_dunder(_dunder))
for _dunder in ["__bool__", "__float__", "__int__", "__index__"]:
    setattr(IndexedTensor, _dunder, lambda self, *a, **k: self._incomplete())


def _find_tracer(args, kwargs) -> Tracer:
    stack = list(args) + list(kwargs.values())
    while stack:
        a = stack.pop()
        if isinstance(a, (Proxy, IndexedTensor)) or getattr(type(a), "_flexfa_vector", False):
            return a._tracer
        if isinstance(a, (tuple, list)):
            stack.extend(a)
    raise AssertionError("no traced value among the arguments")  # pragma: no cover


# ------------------------------------------------------------------------------------------------
# Lifting Python values into the IR.
# ------------------------------------------------------------------------------------------------


def lift(tracer: Tracer, value: Any) -> Node:
    if isinstance(value, Proxy):
        return value._node
    if isinstance(value, IndexedTensor):
        value._incomplete()
    if getattr(type(value), "_flexfa_vector", False):
        return value.scalar_node()  # a vector of one element
    if isinstance(value, bool):
        return irb.const(value)
    if isinstance(value, numbers.Integral):
        return irb.const(int(value))
    if isinstance(value, numbers.Real):
        return irb.const(float(value))
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            return tracer.load_scalar(value)
        name = tracer.name_of(value)
        tracer.fail(
            f"captured tensor {name!r} of shape {tuple(value.shape)} was used without indexing; a "
            f"mod computes one scalar per (b, h, q_idx, kv_idx), so index it, e.g. {name}[h]"
        )
    tracer.fail(f"cannot use a value of type {type(value).__name__} in a mod")
    raise AssertionError  # unreachable


def _wrap(tracer: Tracer, node: Node) -> Proxy:
    return Proxy(tracer, node)


def _is_vector(value: Any) -> bool:
    return isinstance(value, IndexedTensor) or getattr(type(value), "_flexfa_vector", False)


_OP_NAMES = {
    Op.ADD: "add",
    Op.SUB: "sub",
    Op.MUL: "mul",
    Op.TRUEDIV: "true_divide",
    Op.FLOORDIV: "floor_divide",
    Op.MOD: "remainder",
    Op.POW: "pow",
    Op.AND: "bitwise_and",
    Op.OR: "bitwise_or",
    Op.XOR: "bitwise_xor",
    Op.SHL: "bitwise_left_shift",
    Op.SHR: "bitwise_right_shift",
    Op.LT: "lt",
    Op.LE: "le",
    Op.EQ: "eq",
    Op.NE: "ne",
}


def _binary(tracer: Tracer, op: Op, a: Any, b: Any) -> Proxy:
    if _is_vector(a) or _is_vector(b):  # Note [Unrolled reductions]
        from flexfa.frontend import vector

        return vector.dispatch(tracer, _OP_NAMES[op], (a, b), {})
    try:
        return _wrap(tracer, irb.binary(op, lift(tracer, a), lift(tracer, b)))
    except IRTypeError as e:
        tracer.fail(str(e))
        raise AssertionError from e


def _unary(tracer: Tracer, op: Op, a: Any) -> Proxy:
    try:
        return _wrap(tracer, irb.unary(op, lift(tracer, a)))
    except IRTypeError as e:
        tracer.fail(str(e))
        raise AssertionError from e


def _as_dtype(tracer: Tracer, value: Any) -> DType | None:
    if isinstance(value, torch.dtype):
        try:
            return DType.from_torch(value)
        except TypeError as e:
            tracer.fail(str(e))
    return None


# ------------------------------------------------------------------------------------------------
# The operation table. Keys are torch function / method names.
# ------------------------------------------------------------------------------------------------

_BINARY_NAMES: dict[str, Op] = {}
for _op, _names in {
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
}.items():
    for _n in _names.split():
        _BINARY_NAMES[_n] = _op
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
_UNARY_NAMES: dict[str, Op] = {}
for _op, _names in {
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
}.items():
    for _n in _names.split():
        _UNARY_NAMES[_n] = _op

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
    hint = lowerings.unregistered_op_hint(func)
    if hint is not None:
        tracer.fail(hint)
    name = _unwrap_name(func)
    if any(_is_vector(a) for a in (*args, *kwargs.values())) and not (
        name == "__getitem__" and isinstance(args[0], torch.Tensor)
    ):
        from flexfa.frontend import vector  # Note [Unrolled reductions]

        return vector.dispatch(tracer, name, args, kwargs)
    try:
        return _dispatch(tracer, name, args, kwargs)
    except IRTypeError as e:
        tracer.fail(f"{name}: {e}")
        raise AssertionError from e


def _arg(args: tuple, kwargs: dict, i: int, key: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(key, default)


def _dispatch(tracer: Tracer, name: str, args: tuple, kwargs: dict) -> Any:
    L = lambda v: lift(tracer, v)
    W = lambda n: _wrap(tracer, n)

    if name == "__getitem__":
        return tracer.index(args[0], args[1])
    if name in _BINARY_NAMES:
        other = _arg(args, kwargs, 1, "other")
        alpha = kwargs.get("alpha")
        if alpha is not None and name in ("add", "sub", "subtract"):
            other = _binary(tracer, Op.MUL, other, alpha)
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
            if isinstance(a, Proxy):
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
    tracer.fail(
        f"torch.{name} cannot be traced inside a mod; supported operations are listed in "
        "docs/semantics.md (arithmetic, comparisons, & | ~, torch.where, elementwise math, casts, "
        "and indexing captured tensors)"
    )
    raise AssertionError


def _constant_like(tracer: Tracer, name: str, args: tuple, kwargs: dict) -> Node:
    proto = lift(tracer, args[0])
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
