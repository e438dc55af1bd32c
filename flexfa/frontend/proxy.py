"""Symbolic stand-ins for the values a mod receives, and how Python values enter the IR.

A `Proxy` wraps an IR node. Python operators on proxies, torch functions called with proxies (through
`__torch_function__`) and tensor methods called on them all build IR instead of computing; the
torch functions and methods go through the operation table (`optable.py`). Indexing a captured
tensor with proxies builds a LOAD.

# Note [Why proxies, not torch.compile]
# torch FlexAttention needs Dynamo to trace mods, which costs seconds per new mod and guards that
# recompile or fall back. A mod is a scalar function of five values; calling it once on proxies is
# enough to see all of it, takes microseconds, and needs no bytecode analysis. What this cannot see is
# Python control flow on traced values, which is why `__bool__` raises with a pointer to
# `torch.where`.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from flexfa.frontend import optable
from flexfa.ir import build as irb
from flexfa.ir.build import IRTypeError
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
        return optable.dispatch(tracer, func, args, kwargs or {})

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # Tensor methods (score.tanh(), q_idx.to(torch.float32), score.clamp(min=0), ...).
        from flexfa.frontend import vector

        if name in vector.SCALAR_SHAPE_METHODS:  # Note [Shape operations on traced values]
            return lambda *args, **kwargs: vector.dispatch(
                self._tracer, name, (self, *args), kwargs
            )
        if name.startswith("_") or name not in optable.METHOD_NAMES:
            raise AttributeError(
                f"traced values have no attribute {name!r}"
                + (
                    f" (flexfa cannot trace the tensor method .{name}())"
                    if not name.startswith("_")
                    else ""
                )
            )
        return lambda *args, **kwargs: optable.dispatch(self._tracer, name, (self, *args), kwargs)

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
        # A 0-d tensor takes `x[None]`, `x[...]`, `x[..., None]` (Note [Shape operations on traced
        # values]); anything that indexes a dim does not exist.
        parts = index if isinstance(index, tuple) else (index,)
        if all(p is None or p is Ellipsis for p in parts):
            from flexfa.frontend import vector

            return vector.dispatch(self._tracer, "__getitem__", (self, index), {})
        self._tracer.fail(
            "a traced value is a scalar (a 0-d tensor) and cannot be indexed; it takes x[None], "
            "x[...] and x[..., None]"
        )


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
        return optable.dispatch(tracer, func, args, kwargs or {})

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

        if (
            name in vector.VECTOR_METHODS or name in optable.METHOD_NAMES
        ):  # Note [Unrolled reductions]
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
