"""The evaluator: each op against the torch computation it stands for, broadcasting, the float64
widening, and guarded loads (Note [Loads out of bounds])."""

from __future__ import annotations

import pytest
import torch

from flexfa.ir import Capture, DType, Evaluator, Op, evaluate
from flexfa.ir import build as irb

s, q, kv, h = (irb.var(n) for n in ("score", "q_idx", "kv_idx", "h"))
GRID = {
    "score": torch.linspace(-3, 3, 35, dtype=torch.float32).view(1, 1, 5, 7),
    "h": torch.arange(2, dtype=torch.int32).view(1, 2, 1, 1),
    "q_idx": torch.arange(5, dtype=torch.int32).view(1, 1, 5, 1) - 2,
    "kv_idx": torch.arange(7, dtype=torch.int32).view(1, 1, 1, 7) - 3,
}
S, Q, KV = GRID["score"], GRID["q_idx"], GRID["kv_idx"]


def ev(node, captures=(), **kwargs):
    return Evaluator(GRID, list(captures), **kwargs)(node)


UNARY = [
    (Op.NEG, torch.neg),
    (Op.ABS, torch.abs),
    (Op.SIGN, torch.sign),
    (Op.EXP, torch.exp),
    (Op.EXP2, torch.exp2),
    (Op.LOG, torch.log),
    (Op.LOG2, torch.log2),
    (Op.SQRT, torch.sqrt),
    (Op.RSQRT, torch.rsqrt),
    (Op.TANH, torch.tanh),
    (Op.SIGMOID, torch.sigmoid),
    (Op.SIN, torch.sin),
    (Op.COS, torch.cos),
    (Op.FLOOR, torch.floor),
    (Op.CEIL, torch.ceil),
]


@pytest.mark.parametrize("op, fn", UNARY, ids=lambda x: getattr(x, "value", ""))
def test_unary_float_ops(op, fn):
    torch.testing.assert_close(ev(irb.unary(op, s)), fn(S), equal_nan=True)


BINARY = [
    (Op.ADD, torch.add),
    (Op.SUB, torch.sub),
    (Op.MUL, torch.mul),
    (Op.MIN, torch.minimum),
    (Op.MAX, torch.maximum),
    (Op.LT, torch.lt),
    (Op.LE, torch.le),
    (Op.EQ, torch.eq),
    (Op.NE, torch.ne),
]


@pytest.mark.parametrize("op, fn", BINARY, ids=lambda x: getattr(x, "value", ""))
def test_binary_ops_on_ints_and_floats(op, fn):
    assert torch.equal(ev(irb.binary(op, q, kv)), fn(Q, KV))
    half = irb.mul(irb.cast(kv, DType.FLOAT32), irb.const(0.5))
    assert torch.equal(ev(irb.binary(op, s, half)), fn(S, KV * 0.5))


def test_integer_division_and_modulo_floor_like_python():
    floordiv = ev(irb.binary(Op.FLOORDIV, q, irb.const(-2)))
    mod = ev(irb.binary(Op.MOD, kv, irb.const(3)))
    assert floordiv.flatten().tolist() == [v // -2 for v in Q.flatten().tolist()]
    assert mod.flatten().tolist() == [v % 3 for v in KV.flatten().tolist()]
    assert (ev(irb.binary(Op.MOD, kv, irb.const(-3))) <= 0).all()  # sign of the divisor


def test_true_division_pow_and_float_floor_ops():
    torch.testing.assert_close(ev(irb.div(q, irb.const(4))), Q / 4)
    torch.testing.assert_close(ev(irb.binary(Op.POW, s, irb.const(3.0))), S**3)
    torch.testing.assert_close(ev(irb.binary(Op.FLOORDIV, s, irb.const(0.7))), S // 0.7)
    torch.testing.assert_close(ev(irb.binary(Op.MOD, s, irb.const(0.7))), torch.remainder(S, 0.7))


def test_integer_arithmetic_wraps_like_torch_int32():
    big = irb.add(q, irb.const(2**31 - 1))
    assert torch.equal(ev(big), Q + (2**31 - 1))


def test_logic_on_bools_and_bits_on_ints():
    a, b = irb.binary(Op.LT, q, irb.const(0)), irb.binary(Op.LT, kv, irb.const(0))
    assert torch.equal(ev(irb.binary(Op.AND, a, b)), (Q < 0) & (KV < 0))
    assert torch.equal(ev(irb.binary(Op.XOR, a, b)), (Q < 0) ^ (KV < 0))
    assert torch.equal(ev(irb.unary(Op.NOT, a)), ~(Q < 0))
    assert torch.equal(ev(irb.binary(Op.OR, q, kv)), Q | KV)
    assert torch.equal(ev(irb.unary(Op.NOT, q)), ~Q)


def test_where_and_casts():
    cond = irb.binary(Op.LE, kv, q)
    torch.testing.assert_close(
        ev(irb.where(cond, s, irb.const(-1.0))), torch.where(KV <= Q, S, -1.0)
    )
    trunc = ev(irb.cast(irb.mul(s, irb.const(2.0)), DType.INT32))
    assert trunc.dtype == torch.int32 and torch.equal(trunc, (S * 2).to(torch.int32))
    half = ev(irb.cast(s, DType.FLOAT16))
    assert half.dtype == torch.float16


def test_results_broadcast_over_the_grid():
    out = ev(irb.add(irb.cast(irb.add(q, h), DType.FLOAT32), s))
    assert out.shape == (1, 2, 5, 7)
    assert ev(irb.const(2.5)).shape == ()


def test_float64_evaluation_widens_float32_nodes_only():
    half = Capture(0, "half", DType.FLOAT16, 1)
    tab = torch.tensor([0.1, 0.2], dtype=torch.float16)
    load = irb.load(irb.capture(half), (h,))
    e = Evaluator(GRID, [tab], float_dtype=torch.float64)
    assert e(load).dtype == torch.float16  # a float16 load stays float16...
    assert e(irb.add(s, load)).dtype == torch.float64  # ...its float32 arithmetic is widened
    third = e(irb.div(irb.const(1.0), irb.const(3.0)))
    assert third.item() == 1 / 3


def test_shared_subexpressions_are_evaluated_once():
    d = irb.cast(irb.sub(q, kv), DType.FLOAT32)
    e = Evaluator(GRID, [])
    e(irb.add(irb.mul(d, d), d))
    assert len(e.memo) == len(irb.add(irb.mul(d, d), d).toposort())
    first = e(d)
    assert e(d) is first


def test_evaluate_several_roots():
    a, b = evaluate([irb.sub(q, kv), irb.add(q, kv)], GRID)
    assert torch.equal(a, Q - KV) and torch.equal(b, Q + KV)


def test_missing_variable_is_a_clear_error():
    with pytest.raises(ValueError, match="no value given for mod parameter 'b'"):
        ev(irb.var("b"))


def test_loads_out_of_bounds_read_zero_and_are_recorded():
    table = torch.tensor([10.0, 20.0, 30.0])
    load = irb.load(irb.capture(Capture(0, "t", DType.FLOAT32, 1)), (q,))  # q_idx in -2..2
    e = Evaluator(GRID, [table])
    values = e(load).flatten().tolist()
    assert values == [0.0, 0.0, 10.0, 20.0, 30.0]
    assert e.out_of_bounds.flatten().tolist() == [True, True, False, False, False]


def test_zero_dim_and_multi_dim_loads():
    temp = torch.tensor(2.0)
    grid2 = torch.arange(12.0).view(3, 4)
    e = Evaluator(GRID, [temp, grid2])
    assert e(irb.load(irb.capture(Capture(0, "temp", DType.FLOAT32, 0)), ())).item() == 2.0
    kv_mod = irb.binary(Op.MOD, kv, irb.const(4))
    out = e(irb.load(irb.capture(Capture(1, "g", DType.FLOAT32, 2)), (h, kv_mod)))
    assert torch.equal(out, grid2[GRID["h"].long(), (KV % 4).long()])
    assert e.out_of_bounds is not None and not e.out_of_bounds.any()
