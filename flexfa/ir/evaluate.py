"""Evaluate IR over torch tensors with broadcasting.

The evaluator is the IR's executable meaning: the tiled backend runs mods through it, constant
folding uses it on 0-dim tensors, and tests compare it with calling the user's Python function.

# Note [Loads out of bounds]
# A kernel evaluates a mod for every pair of a tile it visits, including pairs the mask excludes and
# padding beyond the sequence. An index that is out of range for such a pair must not fault, so every
# load is *guarded*: an out-of-range index reads 0 instead. The value never reaches the output,
# because the pair is masked. For pairs the mask allows, an out-of-range index is a user error; the
# evaluator records where it happened (`Evaluator.out_of_bounds`) so a backend can report it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from flexfa.ir.dtypes import DType
from flexfa.ir.nodes import Capture, Node, Op

_UNARY = {
    Op.NEG: torch.neg,
    Op.ABS: torch.abs,
    Op.SIGN: torch.sign,
    Op.EXP: torch.exp,
    Op.EXP2: torch.exp2,
    Op.LOG: torch.log,
    Op.LOG2: torch.log2,
    Op.SQRT: torch.sqrt,
    Op.RSQRT: torch.rsqrt,
    Op.TANH: torch.tanh,
    Op.SIGMOID: torch.sigmoid,
    Op.ERF: torch.erf,
    Op.SIN: torch.sin,
    Op.COS: torch.cos,
    Op.FLOOR: torch.floor,
    Op.CEIL: torch.ceil,
}

_BINARY = {
    Op.ADD: torch.add,
    Op.SUB: torch.sub,
    Op.MUL: torch.mul,
    Op.TRUEDIV: torch.true_divide,
    Op.FLOORDIV: lambda a, b: torch.div(a, b, rounding_mode="floor"),
    Op.MOD: torch.remainder,
    Op.POW: torch.pow,
    Op.MIN: torch.minimum,
    Op.MAX: torch.maximum,
    Op.LT: torch.lt,
    Op.LE: torch.le,
    Op.EQ: torch.eq,
    Op.NE: torch.ne,
    Op.SHL: torch.bitwise_left_shift,
    Op.SHR: torch.bitwise_right_shift,
}


def _logic(op: Op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype == torch.bool:
        fn = {Op.AND: torch.logical_and, Op.OR: torch.logical_or, Op.XOR: torch.logical_xor}[op]
    else:
        fn = {Op.AND: torch.bitwise_and, Op.OR: torch.bitwise_or, Op.XOR: torch.bitwise_xor}[op]
    return fn(a, b)


class Evaluator:
    """Evaluates nodes on tensors, memoizing shared subexpressions.

    Args:
        env: tensors for the mod parameters (`score`, `b`, `h`, `q_idx`, `kv_idx`); they broadcast.
        captures: the captured tensors, indexed by `Capture.slot`.
        float_dtype: the dtype float32 nodes are computed in (torch.float64 for a reference).
        device: where constants are created (defaults to the device of the first env tensor).
        scalars: the values of lifted scalars, indexed by `Scalar.slot` (Note [Lifted scalars]).

    >>> import torch
    >>> from flexfa.ir import build as irb
    >>> e = Evaluator({"q_idx": torch.arange(3)[:, None], "kv_idx": torch.arange(3)[None]}, [])
    >>> e(irb.binary(irb.Op.LE, irb.var("kv_idx"), irb.var("q_idx"))).int().tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """

    def __init__(
        self,
        env: Mapping[str, torch.Tensor],
        captures: Sequence[torch.Tensor],
        *,
        float_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        scalars: Sequence[float] = (),
    ) -> None:
        self.env = dict(env)
        self.captures = list(captures)
        self.scalars = tuple(scalars)
        self.float_dtype = float_dtype
        if device is None:
            device = next(iter(self.env.values())).device if self.env else torch.device("cpu")
        self.device = torch.device(device)
        self.memo: dict[int, torch.Tensor] = {}
        self._keep: list[Node] = []  # keeps memo keys alive
        self.out_of_bounds: torch.Tensor | None = None

    def compute_dtype(self, dtype: DType) -> torch.dtype:
        if dtype is DType.FLOAT32:
            return self.float_dtype
        return dtype.torch

    def __call__(self, node: Node) -> torch.Tensor:
        from flexfa.ir.nodes import toposort

        hit = self.memo.get(id(node))
        if hit is not None:
            return hit
        for n in toposort([node]):
            if id(n) not in self.memo:
                self.memo[id(n)] = self._eval(n)
                self._keep.append(n)
        return self.memo[id(node)]

    def _eval(self, n: Node) -> torch.Tensor:
        op = n.op
        if op is Op.CONST:
            return torch.tensor(n.arg, dtype=self.compute_dtype(n.dtype), device=self.device)
        if op is Op.VAR:
            try:
                value = self.env[n.arg]
            except KeyError:
                raise ValueError(f"no value given for mod parameter {n.arg!r}") from None
            return value.to(self.compute_dtype(n.dtype))
        if op is Op.CAPTURE:
            return self.captures[n.arg.slot]
        if op is Op.SCALAR:
            try:
                value = self.scalars[n.arg.slot]
            except IndexError:
                raise ValueError(f"no value given for lifted scalar {n.arg.name!r}") from None
            return torch.tensor(value, dtype=self.compute_dtype(n.dtype), device=self.device)
        srcs = [self.memo[id(s)] for s in n.srcs]
        if op is Op.LOAD:
            return self._load(n.srcs[0].arg, srcs[0], srcs[1:])
        if op is Op.CAST:
            return srcs[0].to(self.compute_dtype(n.dtype))
        if op is Op.NOT:
            x = srcs[0]
            return torch.logical_not(x) if x.dtype == torch.bool else torch.bitwise_not(x)
        if op in _UNARY:
            return _UNARY[op](srcs[0])
        if op in (Op.AND, Op.OR, Op.XOR):
            return _logic(op, srcs[0], srcs[1])
        if op in _BINARY:
            return _BINARY[op](srcs[0], srcs[1])
        if op is Op.WHERE:
            return torch.where(srcs[0], srcs[1], srcs[2])
        raise NotImplementedError(op)  # pragma: no cover

    def _load(self, cap: Capture, tensor: torch.Tensor, idx: list[torch.Tensor]) -> torch.Tensor:
        if not idx:
            return tensor.to(self.compute_dtype(cap.dtype))
        shape = torch.broadcast_tensors(*idx)[0].shape  # broadcast_shapes would import sympy
        valid = torch.ones(shape, dtype=torch.bool, device=tensor.device)
        clamped = []
        for dim, i in enumerate(idx):
            size = tensor.shape[dim]
            valid = valid & (i >= 0) & (i < size)
            clamped.append(i.clamp(0, max(size - 1, 0)).long())
        value = tensor[tuple(clamped)].to(self.compute_dtype(cap.dtype))
        bad = ~valid
        self.out_of_bounds = bad if self.out_of_bounds is None else (self.out_of_bounds | bad)
        return torch.where(valid, value, torch.zeros((), dtype=value.dtype, device=value.device))


def evaluate(
    roots: Sequence[Node],
    env: Mapping[str, torch.Tensor],
    captures: Sequence[torch.Tensor] = (),
    *,
    float_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Evaluate several roots at once, sharing work."""
    ev = Evaluator(env, captures, float_dtype=float_dtype)
    return [ev(r) for r in roots]


def fold_constant(node: Node) -> float | int | bool | None:
    """The value of `node` if all its sources are constants and evaluation succeeds, else None."""
    if node.op in (Op.CONST, Op.VAR, Op.CAPTURE, Op.SCALAR, Op.LOAD):
        return None
    if not all(s.op is Op.CONST for s in node.srcs):
        return None
    try:
        value = Evaluator({}, [], device="cpu")(node)
    except (RuntimeError, ZeroDivisionError, OverflowError):
        return None
    if node.dtype.is_bool:
        return bool(value.item())
    if node.dtype.is_int:
        return int(value.item())
    if node.dtype in (DType.FLOAT16, DType.BFLOAT16):
        return None  # keep explicit narrow casts visible
    return float(value.item())
