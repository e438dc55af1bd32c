"""Reverse-mode autodiff of score_mods against torch autograd.

torch autograd differentiates the evaluator's own computation (in float64); the IR gradient is
evaluated separately, and the captured-tensor part is applied as the backends apply it: scatter-adds
of (cotangent * d_load) at each load's indices."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from flexfa.frontend import trace_score_mod
from flexfa.ir import Capture, DType, Evaluator, Node, Op, format_expr, score_mod_gradient, verify
from flexfa.ir import build as irb
from tests.e2e.strategies import examples
from tests.ir.exprgen import LEARNABLE_SLOTS, capture_tensors, env, score_mod_exprs

s, q, kv, h = (irb.var(n) for n in ("score", "q_idx", "kv_idx", "h"))


def check_against_autograd(expr: Node, seed: int = 0, grad_slots=LEARNABLE_SLOTS) -> None:
    grid = env(seed)
    caps = capture_tensors(seed)
    score = grid["score"].clone().requires_grad_(True)
    learn = {slot: caps[slot].clone().requires_grad_(True) for slot in grad_slots}
    live = [learn.get(i, t) for i, t in enumerate(caps)]
    out = Evaluator({**grid, "score": score}, live, float_dtype=torch.float64)(expr)
    out = out.expand(score.shape)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    inputs = [score, *learn.values()]
    if out.requires_grad:
        expected = torch.autograd.grad(out, inputs, cot, allow_unused=True)
    else:  # the output depends on no differentiable input
        expected = [None] * len(inputs)
    expected = [torch.zeros_like(x) if g is None else g for g, x in zip(expected, inputs)]

    grad = score_mod_gradient(expr, grad_slots=frozenset(grad_slots))
    verify(grad.roots())
    e = Evaluator(grid, caps, float_dtype=torch.float64)
    d_score = (cot * e(grad.d_score)).expand(score.shape)
    buffers = {slot: torch.zeros_like(caps[slot], dtype=torch.float64) for slot in grad_slots}
    for lg in grad.loads:
        contribution = cot * e(lg.d_load)
        if not lg.indices:
            buffers[lg.slot] += contribution.sum()
            continue
        index = tuple(e(i).long().expand(contribution.shape) for i in lg.indices)
        buffers[lg.slot].index_put_(index, contribution.expand(cot.shape), accumulate=True)
    got = [d_score, *buffers.values()]
    # Both sides run in float64, but autodiff simplifies its result, and constants it folds are
    # computed in their IR type, float32 (Note [IR arithmetic types]): hence float32 tolerances.
    # A wrong derivative is off by far more.
    for name, g, x in zip(["score", *(f"slot {i}" for i in grad_slots)], got, expected):
        torch.testing.assert_close(
            g.to(torch.float64),
            x.to(torch.float64),
            rtol=1e-6,
            atol=1e-6,
            msg=lambda m, n=name: f"d/d {n}: {m}",
        )


@settings(max_examples=examples(300), deadline=None)
@given(expr=score_mod_exprs(), seed=st.integers(0, 1000))
def test_random_expressions_match_torch_autograd(expr, seed):
    note(format_expr(expr))
    check_against_autograd(expr, seed)


TAB = irb.capture(Capture(0, "tab", DType.FLOAT32, 2))
TEMP = irb.capture(Capture(1, "temp", DType.FLOAT32, 0))
WIDE = irb.capture(Capture(2, "wide", DType.FLOAT64, 1))
HALF = irb.capture(Capture(3, "half", DType.FLOAT16, 1))
MOD5 = irb.binary(Op.MOD, irb.sub(q, kv), irb.const(5))


@pytest.mark.parametrize(
    "expr",
    [
        pytest.param(irb.mul(s, s), id="square"),
        pytest.param(irb.div(s, irb.load(TEMP, ())), id="temperature"),
        pytest.param(irb.add(s, irb.load(TAB, (h, MOD5))), id="bias_table"),
        pytest.param(
            irb.add(irb.load(TAB, (h, MOD5)), irb.mul(irb.load(TAB, (h, irb.const(0))), s)),
            id="two_loads_of_one_table",
        ),
        pytest.param(
            irb.cast(irb.add(s, irb.load(WIDE, (MOD5,))), DType.FLOAT32), id="float64_load"
        ),
        pytest.param(irb.add(s, irb.load(HALF, (h,))), id="float16_load_not_learnable"),
        pytest.param(irb.unary(Op.ABS, irb.sub(s, s)), id="abs_at_zero"),
        pytest.param(irb.binary(Op.MAX, s, irb.neg(irb.neg(s))), id="max_tie"),
        pytest.param(irb.binary(Op.MIN, s, irb.const(0.5)), id="min_const"),
        pytest.param(
            irb.where(irb.binary(Op.LT, q, kv), s, irb.mul(s, irb.const(3.0))), id="where"
        ),
        pytest.param(
            irb.add(irb.unary(Op.FLOOR, s), irb.unary(Op.SIGN, s)), id="piecewise_constant"
        ),
        pytest.param(irb.binary(Op.MOD, s, irb.const(0.75)), id="float_mod"),
        pytest.param(
            irb.binary(Op.POW, irb.add(irb.mul(s, s), irb.const(1.0)), irb.unary(Op.SIGMOID, s)),
            id="pow_traced_exponent",
        ),
        pytest.param(irb.cast(irb.sub(q, kv), DType.FLOAT32), id="no_score"),
    ],
)
def test_named_cases_match_torch_autograd(expr):
    check_against_autograd(expr)


def test_conventions_at_kinks():
    """abs'(0) = 0; max splits a tie evenly; where routes the gradient; floor has none."""
    assert score_mod_gradient(irb.unary(Op.ABS, s)).d_score is irb.unary(Op.SIGN, s)
    tie = score_mod_gradient(irb.binary(Op.MAX, s, s)).d_score
    grid = {"score": torch.tensor([0.3])}
    assert Evaluator(grid, [])(tie).item() == 1.0  # 0.5 + 0.5
    assert score_mod_gradient(irb.unary(Op.FLOOR, s)).d_score is irb.const(0.0)
    routed = score_mod_gradient(irb.where(irb.binary(Op.LT, q, kv), s, irb.const(0.0))).d_score
    assert format_expr(routed) == "where((q_idx < kv_idx), 1.0, 0.0)"


def test_gradient_of_captures_outside_grad_slots_is_not_computed():
    expr = irb.add(s, irb.load(TAB, (h, MOD5)))
    assert score_mod_gradient(expr).loads == ()
    (lg,) = score_mod_gradient(expr, grad_slots=frozenset({0})).loads
    assert lg.slot == 0 and lg.indices == (h, MOD5) and lg.d_load is irb.const(1.0)


def test_integer_loads_have_no_gradient():
    ids = irb.capture(Capture(0, "ids", DType.INT32, 1))
    expr = irb.add(s, irb.cast(irb.load(ids, (q,)), DType.FLOAT32))
    assert score_mod_gradient(expr, grad_slots=frozenset({0})).loads == ()


def test_d_score_is_float32_and_simplified():
    grad = score_mod_gradient(irb.add(irb.mul(s, irb.const(2.0)), irb.const(1.0)))
    assert grad.d_score is irb.const(2.0)
    wide = irb.cast(irb.mul(irb.cast(s, DType.FLOAT64), irb.load(WIDE, (MOD5,))), DType.FLOAT32)
    assert score_mod_gradient(wide).d_score.dtype is DType.FLOAT32


def test_non_float_output_is_refused():
    with pytest.raises(TypeError, match="floating-point"):
        score_mod_gradient(irb.sub(q, kv))


def test_traced_mod_gradient_is_cached():
    table = torch.randn(2, 5, requires_grad=True)
    traced = trace_score_mod(lambda s_, b, h_, q_, k_: s_ * table[h_, (q_ - k_) % 5])
    slots = traced.grad_slots()
    assert traced.gradient(slots) is traced.gradient(slots)
    assert len(traced.gradient(slots).loads) == 1
