"""Random IR expressions built with `flexfa.ir.build`, for property tests of the IR's passes.

Float expressions stay inside every operation's domain (log of 1 + x*x, division by 1 + |x|, ...)
so that values and derivatives are finite; integer expressions use the index variables. Captured
tensors, by slot:

    0: `tab`   float32 (H, 5), learnable        1: `temp`  float32 0-dim, learnable
    2: `wide`  float64 (5,), learnable           3: `half`  float16 (H,), not learnable
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from flexfa.ir import Capture, DType, Node, Op
from flexfa.ir import build as irb

H, LQ, LKV = 2, 5, 6

CAPTURES = (
    Capture(0, "tab", DType.FLOAT32, 2),
    Capture(1, "temp", DType.FLOAT32, 0),
    Capture(2, "wide", DType.FLOAT64, 1),
    Capture(3, "half", DType.FLOAT16, 1),
)
LEARNABLE_SLOTS = frozenset({0, 1, 2})


def capture_tensors(seed: int = 0, float_dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """Values for CAPTURES (float32 ones in `float_dtype`, so a float64 evaluation is exact)."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(H, 5, generator=g).to(float_dtype),
        (torch.rand((), generator=g) + 0.5).to(float_dtype),
        torch.randn(5, generator=g, dtype=torch.float64),
        torch.randn(H, generator=g).to(torch.float16),
    ]


def env(seed: int = 0, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Broadcast index grids [1, H, LQ, LKV] and a random score."""
    g = torch.Generator().manual_seed(seed)
    return {
        "score": torch.randn(1, H, LQ, LKV, generator=g, dtype=torch.float64).to(dtype) * 2,
        "b": torch.zeros(1, 1, 1, 1, dtype=torch.int32),
        "h": torch.arange(H, dtype=torch.int32).view(1, H, 1, 1),
        "q_idx": torch.arange(LQ, dtype=torch.int32).view(1, 1, LQ, 1),
        "kv_idx": torch.arange(LKV, dtype=torch.int32).view(1, 1, 1, LKV),
    }


def _c(value) -> Node:
    return irb.const(value)


@st.composite
def int_exprs(draw, depth: int = 2) -> Node:
    if depth <= 0 or draw(st.integers(0, 3)) == 0:
        return irb.var(draw(st.sampled_from(["q_idx", "kv_idx", "h", "b"])))
    a = draw(int_exprs(depth - 1))
    form = draw(st.integers(0, 7))
    if form == 0:
        return irb.add(a, draw(int_exprs(depth - 1)))
    if form == 1:
        return irb.sub(a, draw(st.one_of(int_exprs(depth - 1), st.integers(-9, 9).map(_c))))
    if form == 2:
        return irb.mul(a, _c(draw(st.integers(-3, 3))))
    if form == 3:
        op = draw(st.sampled_from([Op.FLOORDIV, Op.MOD]))
        return irb.binary(op, a, _c(draw(st.sampled_from([-4, -3, 2, 5]))))
    if form == 4:
        return irb.unary(draw(st.sampled_from([Op.ABS, Op.NEG, Op.SIGN])), a)
    if form == 5:
        op = draw(st.sampled_from([Op.MIN, Op.MAX]))
        return irb.binary(op, a, draw(int_exprs(depth - 1)))
    if form == 6:
        return irb.where(draw(bool_exprs(depth - 1)), a, draw(int_exprs(depth - 1)))
    return irb.add(a, _c(draw(st.integers(-3, 3))))


@st.composite
def bool_exprs(draw, depth: int = 1) -> Node:
    form = draw(st.integers(0, 3)) if depth > 0 else 0
    if form == 0:
        op = draw(st.sampled_from([Op.LT, Op.LE, Op.EQ, Op.NE]))
        return irb.binary(op, draw(int_exprs(1)), draw(int_exprs(1)))
    if form == 1:
        op = draw(st.sampled_from([Op.AND, Op.OR, Op.XOR]))
        return irb.binary(op, draw(bool_exprs(depth - 1)), draw(bool_exprs(depth - 1)))
    if form == 2:
        return irb.unary(Op.NOT, draw(bool_exprs(depth - 1)))
    return irb.binary(Op.LT, draw(float_exprs(1)), _c(draw(st.sampled_from([-0.5, 0.0, 0.5]))))


def _load(slot: int, *indices: Node) -> Node:
    return irb.load(irb.capture(CAPTURES[slot]), indices)


@st.composite
def float_leaves(draw) -> Node:
    form = draw(st.integers(0, 6))
    if form <= 1:
        return irb.var("score")
    if form == 2:
        return _load(0, irb.var("h"), irb.binary(Op.MOD, draw(int_exprs(1)), _c(5)))
    if form == 3:
        return _load(1)
    if form == 4:
        return _load(2, irb.binary(Op.MOD, draw(int_exprs(1)), _c(5)))
    if form == 5:
        return _load(3, irb.var("h"))
    return irb.mul(irb.cast(draw(int_exprs(1)), DType.FLOAT32), _c(0.1))


def _positive(x: Node) -> Node:
    """1 + x * x, never below 1."""
    return irb.add(irb.mul(x, x), irb.fconst(1.0, x))


@st.composite
def float_exprs(draw, depth: int = 3) -> Node:
    """A float expression (float32, float64 where a float64 capture takes part)."""
    if depth <= 0 or draw(st.integers(0, 4)) == 0:
        return draw(float_leaves())
    a = draw(float_exprs(depth - 1))
    form = draw(st.integers(0, 13))
    if form == 0:
        op = draw(st.sampled_from([Op.TANH, Op.SIGMOID, Op.SIN, Op.COS, Op.NEG, Op.ABS]))
        return irb.unary(op, a)
    if form == 1:
        op = draw(st.sampled_from([Op.EXP, Op.EXP2]))
        return irb.unary(op, irb.unary(Op.TANH, a))
    if form == 2:
        op = draw(st.sampled_from([Op.LOG, Op.LOG2, Op.SQRT, Op.RSQRT]))
        return irb.unary(op, _positive(a))
    if form == 3:
        op = draw(st.sampled_from([Op.FLOOR, Op.CEIL, Op.SIGN]))
        return irb.add(irb.unary(op, a), a)
    if form in (4, 5):
        op = draw(st.sampled_from([Op.ADD, Op.SUB, Op.MUL, Op.MIN, Op.MAX]))
        return irb.binary(op, a, draw(float_exprs(depth - 1)))
    if form == 6:
        b = draw(float_exprs(depth - 1))
        return irb.div(a, irb.add(irb.unary(Op.ABS, b), irb.fconst(1.0, b)))
    if form == 7:
        e = draw(st.one_of(st.sampled_from([0.5, 1.5, 2.0, 3.0]).map(_c), float_exprs(depth - 1)))
        if e.op is not Op.CONST:
            e = irb.unary(Op.TANH, e)
        return irb.binary(Op.POW, _positive(a), e)
    if form == 8:
        b = draw(st.one_of(st.just(_c(0.75)), float_exprs(depth - 1).map(_positive)))
        return irb.binary(Op.MOD, a, b)
    if form == 9:
        return irb.add(irb.binary(Op.FLOORDIV, a, _c(0.5)), a)
    if form == 10:
        return irb.where(draw(bool_exprs()), a, draw(float_exprs(depth - 1)))
    if form == 11:
        return irb.cast(irb.cast(a, DType.FLOAT64), DType.FLOAT32)
    if form == 12:
        return irb.mul(a, irb.fconst(draw(st.sampled_from([0.0, 1.0, -1.0, 2.5])), a))
    return irb.add(a, irb.fconst(draw(st.sampled_from([0.0, -0.0, 0.25])), a))


@st.composite
def score_mod_exprs(draw) -> Node:
    """A float32 score_mod output (what the tracer produces: a float cast to float32)."""
    return irb.cast(draw(float_exprs()), DType.FLOAT32)
