"""The IR: immutable, interned expression nodes.

A traced mod is a DAG of `Node`s. Nodes are interned: building the same (op, dtype, srcs, arg) twice
returns the same object, so structural equality is identity, common subexpressions are shared for
free, and a node can be a dict key.

Leaves are `CONST` (a Python value), `VAR` (one of the mod's parameters, see `VAR_TYPES`),
`CAPTURE` (a tensor the mod closes over, see `Capture`) and `SCALAR` (a Python number passed at run
time, see `Scalar`). `LOAD(capture, *indices)` reads one element
of a captured tensor. Everything else is elementwise arithmetic.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar

from flexfa.ir.dtypes import DType


class Op(enum.Enum):
    # Leaves.
    CONST = "const"
    VAR = "var"
    CAPTURE = "capture"
    SCALAR = "scalar"  # a lifted Python number, passed at run time (Note [Lifted scalars])
    # Memory: LOAD(capture, *indices).
    LOAD = "load"
    # Unary.
    NEG = "neg"
    NOT = "not"
    ABS = "abs"
    SIGN = "sign"
    EXP = "exp"
    EXP2 = "exp2"
    LOG = "log"
    LOG2 = "log2"
    SQRT = "sqrt"
    RSQRT = "rsqrt"
    TANH = "tanh"
    SIGMOID = "sigmoid"
    ERF = "erf"
    SIN = "sin"
    COS = "cos"
    FLOOR = "floor"
    CEIL = "ceil"
    CAST = "cast"
    # Binary.
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    TRUEDIV = "truediv"
    FLOORDIV = "floordiv"
    MOD = "mod"  # floor modulo (Python / torch.remainder): the result has the sign of the divisor
    POW = "pow"
    MIN = "min"
    MAX = "max"
    LT = "lt"
    LE = "le"
    EQ = "eq"
    NE = "ne"
    AND = "and"
    OR = "or"
    XOR = "xor"
    SHL = "shl"  # integer shifts; >> is arithmetic (sign-filling), as torch's
    SHR = "shr"
    # Ternary.
    WHERE = "where"


UNARY_FLOAT_OPS = frozenset(
    {
        Op.EXP,
        Op.EXP2,
        Op.LOG,
        Op.LOG2,
        Op.SQRT,
        Op.RSQRT,
        Op.TANH,
        Op.SIGMOID,
        Op.ERF,
        Op.SIN,
        Op.COS,
    }
)
UNARY_OPS = UNARY_FLOAT_OPS | {Op.NEG, Op.NOT, Op.ABS, Op.SIGN, Op.FLOOR, Op.CEIL, Op.CAST}
ARITH_BINARY_OPS = frozenset(
    {Op.ADD, Op.SUB, Op.MUL, Op.TRUEDIV, Op.FLOORDIV, Op.MOD, Op.POW, Op.MIN, Op.MAX}
)
COMPARE_OPS = frozenset({Op.LT, Op.LE, Op.EQ, Op.NE})
LOGIC_OPS = frozenset({Op.AND, Op.OR, Op.XOR})
SHIFT_OPS = frozenset({Op.SHL, Op.SHR})
BINARY_OPS = ARITH_BINARY_OPS | COMPARE_OPS | LOGIC_OPS | SHIFT_OPS
COMMUTATIVE_OPS = frozenset({Op.ADD, Op.MUL, Op.MIN, Op.MAX, Op.EQ, Op.NE, Op.AND, Op.OR, Op.XOR})

# The parameters a mod receives. `score` exists only in score_mods.
VAR_TYPES: dict[str, DType] = {
    "score": DType.FLOAT32,
    "b": DType.INT32,
    "h": DType.INT32,
    "q_idx": DType.INT32,
    "kv_idx": DType.INT32,
}
SCORE_MOD_PARAMS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_MOD_PARAMS = ("b", "h", "q_idx", "kv_idx")


@dataclasses.dataclass(frozen=True)
class Capture:
    """A tensor a mod reads, as the IR sees it: a slot number, a readable name, a dtype and a rank.

    The tensor itself is not part of the IR (see `flexfa.frontend.TracedMod.captures`): two calls
    with different tensors of the same dtype and rank share IR, compiled kernels and cache entries.
    """

    slot: int
    name: str
    dtype: DType
    ndim: int

    def __post_init__(self) -> None:
        if self.slot < 0 or self.ndim < 0:
            raise ValueError(f"bad capture {self}")


# Note [Lifted scalars]
# Twenty score_mods that differ only in a Python float (`lambda s, b, h, q, kv, c=c: s + c * q`)
# have one structure; compiling twenty kernels for them wastes seconds each. So the tracer replaces
# the floats a mod reaches through its own closure cells and default arguments by SCALAR leaves,
# and the IR holds only a `Scalar` descriptor (slot, name, dtype); the values travel beside the IR
# like captured tensors do (`TracedMod.scalar_values[slot]`). A code generator passes each SCALAR as
# one runtime argument of its kernels (a float32 value), so mods equal up to these values share
# the IR key, the generated source and the compiled kernels.
# What is lifted, and what is not:
#   - floats (type float exactly, not bool/int) in the closure cells, `__defaults__` and
#     `__kwdefaults__` of the score_mod itself, and in a `functools.partial`'s arguments;
#   - not ints: they index, bound and size things, and Triton specializes integer arguments (on 1 and
#     on divisibility by 16) so a lifted int would not give one compile anyway;
#   - not mask_mods: block-mask analysis reasons about constant values;
#   - not globals, attributes of callable objects, or numbers computed inside the mod.
# If a mod uses a lifted value where Python needs a number (`if c > 0:`, `math.exp(c)`), tracing
# with SCALARs fails and the mod is traced again with its floats as constants (one kernel per
# value, as before).
# A SCALAR is a leaf like CONST for every pass: no derivative flows into it, it is never folded.
# For a code generator: a SCALAR node's `arg` is its `Scalar`; declare one runtime parameter per
# entry of `TracedMod.scalars` (slot order, float32; the Triton emitter names it `<name>_value`,
# after the capture parameters) and pass `TracedMod.scalar_values` at launch. Nothing else about
# lifting concerns a backend: the values never appear in the IR, its digest or the key.


@dataclasses.dataclass(frozen=True)
class Scalar:
    """A lifted Python number, as the IR sees it: slot, readable name and dtype (Note [Lifted
    scalars]). Its value for a call is `TracedMod.scalar_values[slot]`."""

    slot: int
    name: str
    dtype: DType

    def __post_init__(self) -> None:
        if self.slot < 0 or not self.dtype.is_float:
            raise ValueError(f"bad scalar {self}")


def _arg_key(arg: Any) -> Any:
    # Floats are keyed by their exact bits so that 0.0 / -0.0 and NaN intern correctly.
    if isinstance(arg, float):
        return ("f", float.hex(arg))
    if isinstance(arg, bool):
        return ("b", arg)
    if isinstance(arg, int):
        return ("i", arg)
    return arg


class Node:
    """One interned IR node. Build nodes with the helpers in `flexfa.ir.build`, not directly."""

    __slots__ = ("__weakref__", "_digest", "arg", "dtype", "op", "srcs")

    _interned: ClassVar[weakref.WeakValueDictionary[tuple, Node]] = weakref.WeakValueDictionary()

    op: Op
    dtype: DType
    srcs: tuple[Node, ...]
    arg: Any

    def __new__(cls, op: Op, dtype: DType, srcs: tuple[Node, ...] = (), arg: Any = None) -> Node:
        key = (op, dtype, srcs, _arg_key(arg))
        node = cls._interned.get(key)
        if node is None:
            node = object.__new__(cls)
            object.__setattr__(node, "op", op)
            object.__setattr__(node, "dtype", dtype)
            object.__setattr__(node, "srcs", srcs)
            object.__setattr__(node, "arg", arg)
            object.__setattr__(node, "_digest", None)
            cls._interned[key] = node
        return node

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("IR nodes are immutable")

    def __reduce__(self):
        return (Node, (self.op, self.dtype, self.srcs, self.arg))

    def __repr__(self) -> str:
        from flexfa.ir.printer import format_expr

        return f"Node({format_expr(self)}: {self.dtype!r})"

    # Nodes are values in Python containers; arithmetic lives in flexfa.ir.build, not in operators,
    # so that `==` keeps meaning identity.

    @property
    def is_const(self) -> bool:
        return self.op is Op.CONST

    def const_value(self) -> Any:
        assert self.op is Op.CONST
        return self.arg

    def toposort(self) -> list[Node]:
        """All nodes reachable from `self`, each after its sources."""
        return toposort([self])

    def walk(self) -> Iterator[Node]:
        yield from self.toposort()

    @property
    def digest(self) -> str:
        """A stable hex digest of the expression's structure (same across processes)."""
        if self._digest is None:
            object.__setattr__(self, "_digest", digest_of([self]))
        return self._digest


def toposort(roots: list[Node] | tuple[Node, ...]) -> list[Node]:
    order: list[Node] = []
    seen: set[int] = set()
    stack: list[tuple[Node, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for s in reversed(node.srcs):
            if id(s) not in seen:
                stack.append((s, False))
    return order


def _canonical_arg(arg: Any) -> str:
    if isinstance(arg, float):
        return "f" + float.hex(arg) if math.isfinite(arg) else "f" + repr(arg)
    if isinstance(arg, Capture):
        return f"cap{arg.slot}:{arg.dtype.value}:{arg.ndim}:{arg.name}"
    if isinstance(arg, Scalar):
        return f"scalar{arg.slot}:{arg.dtype.value}:{arg.name}"
    if isinstance(arg, DType):
        return arg.value
    return repr(arg)


def digest_of(roots: list[Node] | tuple[Node, ...]) -> str:
    """sha256 over a canonical serialization of the DAG below `roots` (in order)."""
    index: dict[int, int] = {}
    h = hashlib.sha256()
    for i, node in enumerate(toposort(list(roots))):
        index[id(node)] = i
        srcs = ",".join(str(index[id(s)]) for s in node.srcs)
        h.update(f"{node.op.value}|{node.dtype.value}|{_canonical_arg(node.arg)}|{srcs}\n".encode())
    h.update(("roots:" + ",".join(str(index[id(r)]) for r in roots)).encode())
    return h.hexdigest()
