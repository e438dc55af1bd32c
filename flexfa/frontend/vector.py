"""Small static tensors inside a mod: a captured tensor indexed along its leading dims only.

`means[q_idx]` of a captured (L, D) tensor is a vector of D traced scalars. Mods reduce such vectors
over their trailing dims: `(means[q_idx] - means[kv_idx]).pow(2).sum(-1)`,
`torch.dot(a[q_idx], b[kv_idx])`, `(topk[q_block].unsqueeze(0) == kv_block).any(-1)`.

# Note [Unrolled reductions]
# A kernel evaluates a mod on a tile of pairs, one scalar per pair, so a vector cannot live in the
# IR. Its size is static (the captured tensor's shape), so the tracer unrolls it: a `VectorProxy`
# holds one IR node per element (element j of `means[q_idx]` is the load `means[q_idx, j]`),
# elementwise operations map over the elements with numpy broadcasting, and a reduction folds them
# into one node (a sum is a balanced tree of adds). Every backend then sees ordinary scalar IR. The
# cost grows with the size, so a vector may have at most `UNROLL_LIMIT` elements; a larger one is an
# error naming the limit.

# Note [Shape operations on traced values]
# Model code makes broadcasts and trailing reductions readable with shape operations:
# `kv_block.unsqueeze(-1)` against a row of top-k indices, `(x.unsqueeze(-1) == table[q]).any(-1)`,
# `x[..., None]`, `means[q][:, None]`. They only rearrange elements, so on a vector they map its
# row-major element list to the new shape, with torch's rules: `unsqueeze(d)`, `squeeze(d)` (a dim
# of size 1 only; otherwise unchanged) and `squeeze()`, `view`/`reshape` to a shape of the same
# number of elements (one -1 inferred), and indexing with ints, `None`, `...` and slices. A traced
# scalar is a 0-d tensor here as in torch: it takes the same operations (`q_idx.unsqueeze(-1)` is
# a vector of one element, `x[None]`, `x[...]`, `x.view(1, 1)`), and the reductions of a 0-d
# tensor (`x.any(-1)`, `x.sum()`). A result of one element is used where a scalar is expected,
# as before.
"""

from __future__ import annotations

import collections
import itertools
import math
from typing import TYPE_CHECKING, Any

import torch

from flexfa.frontend import optable
from flexfa.frontend import proxy as px
from flexfa.ir import build as irb
from flexfa.ir.dtypes import DType
from flexfa.ir.nodes import Node, Op

if TYPE_CHECKING:
    from flexfa.frontend.trace import Tracer

#: The most elements a vector inside a mod may have (Note [Unrolled reductions]).
UNROLL_LIMIT = 64

MaxResult = collections.namedtuple("MaxResult", ["values", "indices"])

_REDUCTIONS = frozenset({"sum", "any", "all", "amax", "amin", "max", "min", "mean", "prod"})
_SHAPE_OPS = frozenset(
    {"unsqueeze", "squeeze", "view", "reshape", "__getitem__", "dot", "inner", "vdot", "numel"}
)
VECTOR_METHODS = _REDUCTIONS | _SHAPE_OPS | {"size", "dim"}
# The methods a traced scalar (a 0-d tensor) answers as a vector of shape () (Note [Shape
# operations on traced values]); `size` and `dim` it has already.
SCALAR_SHAPE_METHODS = (_REDUCTIONS - {"max", "min"}) | {
    "unsqueeze",
    "squeeze",
    "view",
    "reshape",
    "numel",
}


class VectorProxy:
    """A traced tensor of static `shape`: one IR node per element, row-major."""

    __slots__ = ("_items", "_shape", "_tracer")
    __hash__ = None  # type: ignore[assignment]
    _flexfa_vector = True

    def __init__(self, tracer: Tracer, shape: tuple[int, ...], items: list[Node]) -> None:
        assert len(items) == math.prod(shape)
        self._tracer = tracer
        self._shape = shape
        self._items = items

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._shape)

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._items[0].dtype.torch

    def dim(self) -> int:
        return len(self._shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self._shape[dim]

    def scalar_node(self) -> Node:
        """The one element of a vector of one element (used where a scalar is expected)."""
        if len(self._items) != 1:
            self._tracer.fail(
                f"a value of shape {self._shape} was used where a scalar is needed; a mod returns "
                "one value per pair: reduce it, e.g. .sum(-1) or .any(-1)"
            )
        return self._items[0]

    def __bool__(self) -> bool:
        self._tracer.fail(px._CONTROL_FLOW_HINT)
        raise AssertionError

    def __iter__(self):
        for i in range(self._shape[0] if self._shape else 0):
            yield self[i]

    def __len__(self) -> int:
        return self._shape[0]

    def __repr__(self) -> str:
        return f"VectorProxy(shape={self._shape})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        tracer = px._find_tracer(args, kwargs or {})
        return optable.dispatch(tracer, func, args, kwargs or {})

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in VECTOR_METHODS and name not in optable.METHOD_NAMES:
            raise AttributeError(f"traced tensors have no method {name!r} flexfa can trace")
        return lambda *args, **kwargs: dispatch(self._tracer, name, (self, *args), kwargs)

    def __getitem__(self, index):
        return dispatch(self._tracer, "__getitem__", (self, index), {})


for _name in px.ELEMENTWISE_DUNDERS:
    setattr(VectorProxy, _name, px.vector_dunder(_name))
VectorProxy.__pos__ = lambda self: self  # type: ignore[attr-defined]


def from_indexed(tracer: Tracer, tensor: torch.Tensor, prefix: tuple[Node, ...]) -> VectorProxy:
    """The vector `tensor[prefix]` (prefix shorter than tensor.ndim): one load per element."""
    shape = tuple(int(s) for s in tensor.shape[len(prefix) :])
    n = math.prod(shape)
    if n > UNROLL_LIMIT:
        name = tracer.name_of(tensor)
        tracer.fail(
            f"captured tensor {name!r} indexed along {len(prefix)} of its {tensor.ndim} dims leaves "
            f"shape {shape} ({n} elements); flexfa unrolls operations on such values at trace time "
            f"and allows at most {UNROLL_LIMIT} elements (flexfa.frontend.vector.UNROLL_LIMIT)"
        )
    cap = tracer.capture(tensor)
    items = [
        irb.load(cap, (*prefix, *(irb.const(i) for i in idx)))
        for idx in itertools.product(*(range(s) for s in shape))
    ]
    return VectorProxy(tracer, shape, items)


def is_vector_like(value: Any) -> bool:
    return isinstance(value, (VectorProxy, px.IndexedTensor))


def _as_vector(tracer: Tracer, value: Any) -> VectorProxy:
    if isinstance(value, VectorProxy):
        return value
    if isinstance(value, px.IndexedTensor):
        return from_indexed(tracer, value._tensor, value._indices)
    node = px.lift(tracer, value)
    return VectorProxy(tracer, (), [node])


def _result(tracer: Tracer, shape: tuple[int, ...], items: list[Node]) -> VectorProxy | px.Proxy:
    if not shape:
        return px.Proxy(tracer, items[0])
    return VectorProxy(tracer, shape, items)


def _broadcast_shape(tracer: Tracer, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    ndim = max(len(s) for s in shapes)
    out = []
    for d in range(ndim):
        sizes = {s[d - ndim + len(s)] for s in shapes if d - ndim + len(s) >= 0} - {1}
        if len(sizes) > 1:
            tracer.fail(f"shapes {shapes} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _element(v: VectorProxy, shape: tuple[int, ...], idx: tuple[int, ...]) -> Node:
    """v's element at `idx` of the broadcast `shape`."""
    own = v._shape
    offset = len(shape) - len(own)
    flat = 0
    for d, size in enumerate(own):
        flat = flat * size + (idx[offset + d] if size > 1 else 0)
    return v._items[flat]


def _norm_dim(tracer: Tracer, dim: Any, ndim: int) -> int:
    if isinstance(dim, (tuple, list)):
        if len(dim) != 1:
            tracer.fail("reductions over several dims at once are not supported; reduce one by one")
        dim = dim[0]
    if not isinstance(dim, int) or isinstance(dim, bool) or not -ndim <= dim < max(ndim, 1):
        tracer.fail(f"dim must be an int in [{-ndim}, {ndim}), got {dim!r}")
    return dim % ndim


def _tree(nodes: list[Node], combine) -> Node:
    while len(nodes) > 1:
        nodes = [
            combine(nodes[i], nodes[i + 1]) if i + 1 < len(nodes) else nodes[i]
            for i in range(0, len(nodes), 2)
        ]
    return nodes[0]


def _reduce_groups(v: VectorProxy, dim: int | None) -> tuple[tuple[int, ...], list[list[Node]]]:
    """The groups of elements a reduction over `dim` (None: all) combines, and the result shape."""
    if dim is None:
        return (), [list(v._items)]
    shape = v._shape
    out_shape = shape[:dim] + shape[dim + 1 :]
    groups = []
    for out_idx in itertools.product(*(range(s) for s in out_shape)):
        group = []
        for j in range(shape[dim]):
            full = (*out_idx[:dim], j, *out_idx[dim:])
            group.append(_element(v, shape, full))
        groups.append(group)
    return out_shape, groups


def _combine(op: Op):
    return lambda a, b: irb.binary(op, a, b)


def _reduce(tracer: Tracer, name: str, args: tuple, kwargs: dict):
    v = _as_vector(tracer, args[0])
    dim = optable._arg(args, kwargs, 1, "dim")
    keepdim = bool(optable._arg(args, kwargs, 2, "keepdim", False))
    if name in ("max", "min") and isinstance(dim, (px.Proxy, VectorProxy, px.IndexedTensor)):
        return dispatch(tracer, "maximum" if name == "max" else "minimum", args, kwargs)
    d = None if dim is None else _norm_dim(tracer, dim, max(v.ndim, 1))
    if not v._shape:
        d = None
    out_shape, groups = _reduce_groups(v, d)
    items: list[Node] = []
    indices: list[Node] = []
    for group in groups:
        if name in ("any", "all"):
            bools = [
                g if g.dtype.is_bool else irb.binary(Op.NE, g, irb.const(0, g.dtype)) for g in group
            ]
            items.append(_tree(bools, _combine(Op.OR if name == "any" else Op.AND)))
        elif name in ("sum", "mean", "prod"):
            if group[0].dtype.is_float:
                vals = [irb.to_arith(g) for g in group]
            else:  # torch sums integers and bools as int64
                vals = [irb.cast(g, DType.INT64) for g in group]
            total = _tree(vals, _combine(Op.ADD if name != "prod" else Op.MUL))
            if name == "mean":
                if not total.dtype.is_float:
                    tracer.fail(
                        "mean of an integer tensor is not defined (torch raises); cast first"
                    )
                total = irb.div(total, irb.fconst(float(len(group)), total))
            items.append(total)
        else:  # amax, amin, max, min
            better = Op.LT
            best, best_i = group[0], irb.const(0, DType.INT64)
            for j, g in enumerate(group[1:], start=1):
                wins = (
                    irb.binary(better, best, g)
                    if name in ("amax", "max")
                    else irb.binary(better, g, best)
                )
                if g.dtype.is_float:  # NaN propagates, as in torch
                    wins = irb.binary(Op.OR, wins, irb.binary(Op.NE, g, g))
                best = irb.where(wins, g, best)
                best_i = irb.where(wins, irb.const(j, DType.INT64), best_i)
            items.append(best)
            indices.append(best_i)
    if keepdim and d is not None:
        out_shape = (*v._shape[:d], 1, *v._shape[d + 1 :])
    values = _result(tracer, out_shape, items)
    if name in ("max", "min") and dim is not None:
        return MaxResult(values, _result(tracer, out_shape, indices))
    return values


def _getitem(tracer: Tracer, v: VectorProxy, index: Any):
    """`v[index]` with Python ints, slices, `None` and `...` (Note [Shape operations on traced
    values])."""
    parts = list(index) if isinstance(index, tuple) else [index]
    shape = v._shape
    for part in parts:
        if part is None or part is Ellipsis or isinstance(part, slice):
            continue
        if isinstance(part, bool) or not isinstance(part, int):
            tracer.fail(
                "a traced tensor is indexed with Python ints, slices, None and ... inside a mod (an "
                "index that depends on the pair would need a gather: index the captured tensor "
                "itself instead)"
            )
    if parts.count(Ellipsis) > 1:
        tracer.fail("an index can only have a single ellipsis ('...')")
    consumed = sum(1 for p in parts if p is not None and p is not Ellipsis)
    if consumed > len(shape):
        tracer.fail(
            f"too many indices for a traced tensor of shape {shape}: {consumed} dims indexed"
        )
    fill = [slice(None)] * (len(shape) - consumed)
    if Ellipsis in parts:
        at = parts.index(Ellipsis)
        parts[at : at + 1] = fill
    else:
        parts += fill
    out_shape: list[int] = []
    per_dim: list[Any] = []  # for each dim of v: a fixed index, or the out dim and its range
    for part in parts:
        if part is None:
            out_shape.append(1)
            continue
        size = shape[len(per_dim)]
        if isinstance(part, slice):
            positions = range(*part.indices(size))
            per_dim.append((len(out_shape), positions))
            out_shape.append(len(positions))
            continue
        k = part + size if part < 0 else part
        if not 0 <= k < size:
            tracer.fail(f"index {part} is out of range for size {size}")
        per_dim.append(k)
    if math.prod(out_shape) == 0:
        tracer.fail(f"indexing a traced tensor of shape {shape} with {index!r} leaves no elements")
    items = []
    for out_idx in itertools.product(*(range(s) for s in out_shape)):
        flat = 0
        for size, d in zip(shape, per_dim):
            k = d if isinstance(d, int) else d[1][out_idx[d[0]]]
            flat = flat * size + k
        items.append(v._items[flat])
    return _result(tracer, tuple(out_shape), items)


def _new_shape(tracer: Tracer, name: str, v: VectorProxy, args: tuple, kwargs: dict):
    """The shape `v.view(...)` / `v.reshape(...)` asks for, with one -1 inferred."""
    sizes = args[1:] if len(args) > 1 else (kwargs.get("shape", kwargs.get("size")),)
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = tuple(sizes[0])
    if len(sizes) == 1 and isinstance(sizes[0], torch.dtype):
        tracer.fail(f".{name}(dtype) reinterprets bits, which a mod cannot do; use .to(dtype)")
    if any(isinstance(s, bool) or not isinstance(s, int) for s in sizes):
        tracer.fail(f".{name} of a traced tensor takes Python ints as sizes, got {sizes!r}")
    n = len(v._items)
    known = math.prod(s for s in sizes if s != -1)
    if sizes.count(-1) > 1 or any(s < -1 for s in sizes):
        tracer.fail(f".{name}{tuple(sizes)}: only one size may be -1, and none below it")
    if -1 in sizes and known and n % known == 0:
        sizes = tuple(n // known if s == -1 else s for s in sizes)
    if -1 in sizes or math.prod(sizes) != n:
        tracer.fail(f"shape {tuple(sizes)} is invalid for a traced tensor of {n} elements")
    return tuple(sizes)


def dispatch(tracer: Tracer, name: Any, args: tuple, kwargs: dict) -> Any:
    """A torch call with at least one vector argument (Note [Unrolled reductions])."""
    name = optable._unwrap_name(name)
    if name in _REDUCTIONS:
        return _reduce(tracer, name, args, kwargs)
    if name in ("dot", "inner", "vdot"):
        a, b = _as_vector(tracer, args[0]), _as_vector(tracer, args[1])
        if a.ndim != 1 or b.ndim != 1 or a._shape != b._shape:
            tracer.fail(
                f"torch.{name} needs two 1-D tensors of one size, got {a._shape} and {b._shape}"
            )
        return _reduce(tracer, "sum", (dispatch(tracer, "mul", (a, b), {}),), {})
    if name == "unsqueeze":
        v = _as_vector(tracer, args[0])
        d = optable._arg(args, kwargs, 1, "dim")
        d = _norm_dim(tracer, d, v.ndim + 1)
        return VectorProxy(tracer, (*v._shape[:d], 1, *v._shape[d:]), v._items)
    if name == "squeeze":
        v = _as_vector(tracer, args[0])
        d = optable._arg(args, kwargs, 1, "dim")
        if d is None:
            shape = tuple(s for s in v._shape if s != 1)
        elif not v._shape:  # a 0-d value squeezes to itself (dim 0 or -1, as in torch)
            _norm_dim(tracer, d, 1)
            shape = ()
        else:
            d = _norm_dim(tracer, d, v.ndim)
            shape = v._shape[:d] + v._shape[d + 1 :] if v._shape[d] == 1 else v._shape
        return _result(tracer, shape, v._items)
    if name in ("view", "reshape"):
        v = _as_vector(tracer, args[0])
        return _result(tracer, _new_shape(tracer, name, v, args, kwargs), v._items)
    if name == "__getitem__":
        return _getitem(tracer, _as_vector(tracer, args[0]), args[1])
    if name == "numel":
        return len(_as_vector(tracer, args[0])._items)
    if name in ("size", "dim"):
        v = _as_vector(tracer, args[0])
        return v.size(*args[1:]) if name == "size" else v.ndim
    return _elementwise(tracer, name, args, kwargs)


def _elementwise(tracer: Tracer, name: str, args: tuple, kwargs: dict):
    """Apply the scalar operation `name` to every element (numpy broadcasting)."""
    positions = [i for i, a in enumerate(args) if is_vector_like(a)]
    keys = [k for k, a in kwargs.items() if is_vector_like(a)]
    vectors = {("a", i): _as_vector(tracer, args[i]) for i in positions}
    vectors.update({("k", k): _as_vector(tracer, kwargs[k]) for k in keys})
    shape = _broadcast_shape(tracer, [v._shape for v in vectors.values()])
    items: list[Node] = []
    for idx in itertools.product(*(range(s) for s in shape)):
        elem_args = list(args)
        elem_kwargs = dict(kwargs)
        for (kind, key), v in vectors.items():
            p = px.Proxy(tracer, _element(v, shape, idx))
            if kind == "a":
                elem_args[key] = p
            else:
                elem_kwargs[key] = p
        out = optable.dispatch(tracer, name, tuple(elem_args), elem_kwargs)
        if not isinstance(out, px.Proxy):
            tracer.fail(f"{name} of a traced tensor did not give one value per element")
        items.append(out.node)
    return _result(tracer, shape, items)
