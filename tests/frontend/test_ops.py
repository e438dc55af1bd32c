"""Every operation the tracer supports: it produces the expected IR op, and the traced IR computes
what the same Python function computes eagerly (called per pair, as the reference does)."""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa.ir import Op
from tests.frontend.common import eager_values, scores, trace, traced_values
from tests.mods import ALL_MODS, Shape


def _ops(traced) -> set[Op]:
    return {n.op for n in traced.output.walk()}


def case(fn, *ops: Op, id: str):
    return pytest.param(fn, frozenset(ops), id=id)


# Score mods: each exercises one operation (and the IR op it must produce).
SCORE_CASES = [
    # Python operators.
    case(lambda s, b, h, q, k: s + q, Op.ADD, id="add"),
    case(lambda s, b, h, q, k: 1.5 + s, Op.ADD, id="radd"),
    case(lambda s, b, h, q, k: s - k, Op.SUB, id="sub"),
    case(lambda s, b, h, q, k: 2 - s, Op.SUB, id="rsub"),
    case(lambda s, b, h, q, k: s * h, Op.MUL, id="mul"),
    case(lambda s, b, h, q, k: 0.5 * s, Op.MUL, id="rmul"),
    case(lambda s, b, h, q, k: s / (k + 1), Op.TRUEDIV, id="truediv"),
    case(lambda s, b, h, q, k: 1.0 / (s * s + 1), Op.TRUEDIV, id="rtruediv"),
    case(lambda s, b, h, q, k: (q - k) / 3, Op.TRUEDIV, id="int_truediv"),
    case(lambda s, b, h, q, k: s + (q - k) // 3, Op.FLOORDIV, id="floordiv"),
    case(lambda s, b, h, q, k: s + (q - k) // -4, Op.FLOORDIV, id="floordiv_neg_divisor"),
    case(lambda s, b, h, q, k: s + 100 // (k + 1), Op.FLOORDIV, id="rfloordiv"),
    case(lambda s, b, h, q, k: s // 0.5, Op.FLOORDIV, id="float_floordiv"),
    case(lambda s, b, h, q, k: s + (q - k) % 5, Op.MOD, id="mod"),
    case(lambda s, b, h, q, k: s + (q - k) % -3, Op.MOD, id="mod_neg_divisor"),
    case(lambda s, b, h, q, k: s + 17 % (k + 1), Op.MOD, id="rmod"),
    case(lambda s, b, h, q, k: s % 0.75, Op.MOD, id="float_mod"),
    case(lambda s, b, h, q, k: s**3, Op.POW, id="pow"),
    case(lambda s, b, h, q, k: (torch.abs(s) + 1) ** 1.5, Op.POW, id="pow_float"),
    case(lambda s, b, h, q, k: s + 2.0 ** (-h), Op.POW, id="rpow"),
    case(lambda s, b, h, q, k: s + q**2, Op.MUL, id="int_square"),
    case(lambda s, b, h, q, k: s + (q + 1) ** 3, Op.POW, id="int_pow"),
    case(lambda s, b, h, q, k: (torch.abs(s) + 1) ** torch.sigmoid(s), Op.POW, id="pow_traced"),
    case(lambda s, b, h, q, k: -s, Op.NEG, id="neg"),
    case(lambda s, b, h, q, k: +s + abs(q - k), Op.ABS, id="pos_and_builtin_abs"),
    # Comparisons and logic (inside torch.where).
    case(lambda s, b, h, q, k: torch.where(q < k, s, 0.0), Op.LT, Op.WHERE, id="lt"),
    case(lambda s, b, h, q, k: torch.where(q <= k, s, 0.0), Op.LE, id="le"),
    case(lambda s, b, h, q, k: torch.where(q > k, s, 0.0), Op.LT, id="gt"),
    case(lambda s, b, h, q, k: torch.where(q >= k, s, 0.0), Op.LE, id="ge"),
    case(lambda s, b, h, q, k: torch.where(q == k, s, 0.0), Op.EQ, id="eq"),
    case(lambda s, b, h, q, k: torch.where(q != k, s, 0.0), Op.NE, id="ne"),
    case(lambda s, b, h, q, k: torch.where(s > 0.5, s, -s), Op.LT, id="float_compare"),
    case(lambda s, b, h, q, k: torch.where((q > k) & (h == 1), s, 1.0), Op.AND, id="and"),
    case(lambda s, b, h, q, k: torch.where((q > k) | (h == 1), s, 1.0), Op.OR, id="or"),
    case(lambda s, b, h, q, k: torch.where(~(q > k), s, 1.0), Op.WHERE, id="invert"),
    case(lambda s, b, h, q, k: torch.where((q > k) ^ (h == 1), s, 1.0), Op.XOR, id="xor"),
    case(lambda s, b, h, q, k: torch.where(q > k, 1.0, -1.0) + s, Op.WHERE, id="where_scalars"),
    case(lambda s, b, h, q, k: s + torch.where(q > k, q, k), Op.WHERE, id="where_ints"),
    # Elementwise math.
    case(lambda s, b, h, q, k: torch.tanh(s), Op.TANH, id="tanh"),
    case(lambda s, b, h, q, k: torch.exp(s), Op.EXP, id="exp"),
    case(lambda s, b, h, q, k: torch.exp2(s), Op.EXP2, id="exp2"),
    case(lambda s, b, h, q, k: torch.log(torch.abs(s) + 0.1), Op.LOG, id="log"),
    case(lambda s, b, h, q, k: torch.log2(torch.abs(s) + 0.1), Op.LOG2, id="log2"),
    case(lambda s, b, h, q, k: torch.sqrt(torch.abs(s)), Op.SQRT, id="sqrt"),
    case(lambda s, b, h, q, k: torch.rsqrt(torch.abs(s) + 0.1), Op.RSQRT, id="rsqrt"),
    case(lambda s, b, h, q, k: torch.abs(s), Op.ABS, id="abs"),
    case(lambda s, b, h, q, k: s + torch.sign(q - k) + torch.sign(s), Op.SIGN, id="sign"),
    case(lambda s, b, h, q, k: torch.sigmoid(s), Op.SIGMOID, id="sigmoid"),
    case(lambda s, b, h, q, k: torch.sin(s), Op.SIN, id="sin"),
    case(lambda s, b, h, q, k: torch.cos(s), Op.COS, id="cos"),
    case(lambda s, b, h, q, k: torch.floor(s), Op.FLOOR, id="floor"),
    case(lambda s, b, h, q, k: torch.ceil(s), Op.CEIL, id="ceil"),
    case(lambda s, b, h, q, k: s + torch.floor(q / 2), Op.FLOOR, id="floor_of_int_division"),
    case(lambda s, b, h, q, k: torch.exp(q * 0.1), Op.EXP, id="unary_on_int"),
    case(lambda s, b, h, q, k: torch.clamp(s, -0.5, 0.5), Op.MIN, Op.MAX, id="clamp"),
    case(lambda s, b, h, q, k: torch.clamp(s, min=0.1), Op.MAX, id="clamp_min_kw"),
    case(lambda s, b, h, q, k: torch.clamp(s, max=0.1), Op.MIN, id="clamp_max_kw"),
    case(lambda s, b, h, q, k: torch.clamp(s, min=q * 0.1), Op.MAX, id="clamp_traced_bound"),
    case(lambda s, b, h, q, k: s + torch.clamp(q - k, -2, 3), Op.MIN, id="clamp_int"),
    case(lambda s, b, h, q, k: torch.minimum(s, q * 0.1), Op.MIN, id="minimum"),
    case(lambda s, b, h, q, k: torch.maximum(s, k * 0.1), Op.MAX, id="maximum"),
    # Casts.
    case(lambda s, b, h, q, k: s.to(torch.float64) * (q - k), Op.CAST, id="to_float64"),
    case(lambda s, b, h, q, k: (s * 4).to(torch.int32), Op.CAST, id="to_int32_truncates"),
    case(lambda s, b, h, q, k: s.to(dtype=torch.float16) * 1.0, Op.CAST, id="to_dtype_kw"),
    case(lambda s, b, h, q, k: s.half() + s.bfloat16(), Op.CAST, id="half_bfloat16"),
    case(lambda s, b, h, q, k: s.double() + q.float() + k.long(), Op.CAST, id="cast_methods"),
    case(lambda s, b, h, q, k: s + (s * 3).int(), Op.CAST, id="int_method"),
    case(lambda s, b, h, q, k: s + (q > k).to(torch.float32), Op.CAST, id="bool_to_float"),
    case(lambda s, b, h, q, k: s + (s * 4).to(q), Op.CAST, id="to_other_truncates"),
    case(lambda s, b, h, q, k: s + q.type_as(s), Op.CAST, id="type_as"),
    # Method spellings and torch function spellings.
    case(lambda s, b, h, q, k: s.exp() + s.abs() + s.sigmoid(), Op.EXP, id="methods"),
    case(lambda s, b, h, q, k: s.clamp(min=-1.0).tanh().mul(2), Op.TANH, id="method_chain"),
    case(lambda s, b, h, q, k: torch.add(s, q, alpha=2), Op.ADD, id="torch_add_alpha"),
    case(lambda s, b, h, q, k: torch.sub(s, k, alpha=0.5), Op.SUB, id="torch_sub_alpha"),
    case(
        lambda s, b, h, q, k: torch.mul(s, torch.true_divide(q, 3)), Op.TRUEDIV, id="torch_mul_div"
    ),
    case(lambda s, b, h, q, k: s + torch.remainder(q - k, 4), Op.MOD, id="torch_remainder"),
    case(lambda s, b, h, q, k: s + torch.floor_divide(q - k, 4), Op.FLOORDIV, id="floor_divide"),
    case(lambda s, b, h, q, k: torch.pow(torch.abs(s), 0.5), Op.POW, id="torch_pow"),
    case(
        lambda s, b, h, q, k: s + torch.div(q - k, 3, rounding_mode="trunc"),
        Op.FLOORDIV,
        id="div_trunc_int",
    ),
    case(
        lambda s, b, h, q, k: s + torch.div(q - k, 3, rounding_mode="floor"),
        Op.FLOORDIV,
        id="div_floor_int",
    ),
    case(lambda s, b, h, q, k: torch.div(s, 0.3, rounding_mode="trunc"), Op.CEIL, id="div_trunc"),
    case(lambda s, b, h, q, k: torch.trunc(s * 3), Op.FLOOR, id="trunc"),
    case(lambda s, b, h, q, k: torch.square(s) + torch.reciprocal(s * s + 1), Op.MUL, id="square"),
    case(lambda s, b, h, q, k: torch.relu(s), Op.MAX, id="relu"),
    case(lambda s, b, h, q, k: torch.log1p(s * s) + torch.expm1(s), Op.LOG, id="log1p_expm1"),
    case(lambda s, b, h, q, k: torch.log10(torch.abs(s) + 1), Op.LOG2, id="log10"),
    case(lambda s, b, h, q, k: torch.clip(s, -1, 1) + torch.clamp_min(s, 0), Op.MAX, id="clip"),
    case(lambda s, b, h, q, k: torch.clamp_max(s, 0.2), Op.MIN, id="clamp_max_fn"),
    case(
        lambda s, b, h, q, k: torch.full_like(s, 2.5) * s + torch.ones_like(q),
        Op.MUL,
        id="full_like",
    ),
    case(lambda s, b, h, q, k: s + torch.zeros_like(q) + k, Op.ADD, id="zeros_like"),
    case(lambda s, b, h, q, k: s + ((q & 3) | (k ^ 1)) + ~h, Op.AND, Op.NOT, id="bitwise_ints"),
    case(
        lambda s, b, h, q, k: torch.where(torch.logical_and(q > 1, k > 1), s, 0.0),
        Op.AND,
        id="logical_and",
    ),
    case(
        lambda s, b, h, q, k: torch.where(torch.logical_not(q > 1), s, 0.0),
        Op.WHERE,
        id="logical_not",
    ),
    case(lambda s, b, h, q, k: s.contiguous().detach().clone(), id="no_op_methods"),
    case(
        lambda s, b, h, q, k: s + torch.gt(q, k) * 1.0 + torch.ge(q, 2) * 0.5,
        Op.LE,
        id="torch_gt_ge",
    ),
]


@pytest.mark.parametrize("fn, ops", SCORE_CASES)
def test_score_mod_op(fn, ops):
    traced = trace(fn, "score_mod")
    assert ops <= _ops(traced), f"expected {ops} in\n{traced.format()}"
    s = scores()
    expected = eager_values(fn, s).to(torch.float32)
    torch.testing.assert_close(traced_values(traced, s), expected, rtol=1e-6, atol=1e-6)


MASK_CASES = [
    case(lambda b, h, q, k: q >= k, Op.LE, id="ge"),
    case(lambda b, h, q, k: q > 3, Op.LT, id="reflected_lt"),
    case(lambda b, h, q, k: (q - k < 3) & (k <= q), Op.AND, id="and"),
    case(lambda b, h, q, k: (q == k) | (h == 2), Op.OR, Op.EQ, id="or"),
    case(lambda b, h, q, k: ~(k > q) ^ (b == 1), Op.XOR, id="not_xor"),
    case(lambda b, h, q, k: (q - k) % 3 != 0, Op.MOD, Op.NE, id="mod"),
    case(lambda b, h, q, k: (k - q) // 4 == -1, Op.FLOORDIV, id="floordiv_negative"),
    case(lambda b, h, q, k: torch.abs(q - k) * 0.5 < 2.2, Op.ABS, id="float_compare"),
    case(lambda b, h, q, k: torch.where(h > 0, q >= k, q <= k), Op.WHERE, id="where_bools"),
    case(
        lambda b, h, q, k: torch.logical_or(q < 2, torch.logical_xor(k < 3, h < 1)),
        Op.OR,
        id="logical_fns",
    ),
    case(lambda b, h, q, k: torch.minimum(q, k) > 2, Op.MIN, id="minimum"),
    case(lambda b, h, q, k: torch.ne(q, k) & torch.lt(k, 5), Op.NE, id="torch_ne_lt"),
    case(lambda b, h, q, k: (q + k).to(torch.bool), Op.CAST, id="int_to_bool"),
    case(lambda b, h, q, k: q.new_ones((), dtype=torch.bool), id="new_ones"),
]


@pytest.mark.parametrize("fn, ops", MASK_CASES)
def test_mask_mod_op(fn, ops):
    traced = trace(fn, "mask_mod")
    assert ops <= _ops(traced), f"expected {ops} in\n{traced.format()}"
    assert torch.equal(traced_values(traced), eager_values(fn))


@pytest.mark.parametrize("entry", ALL_MODS, ids=str)
def test_catalog_traces_like_eager(entry):
    """Every catalog mod: the traced IR equals the eager function at every pair."""
    from tests.frontend.common import LKV, LQ, B, H

    built = entry.build(Shape(B, H, LQ, LKV))
    traced = trace(built.fn, entry.kind)
    if entry.kind == "mask_mod":
        assert torch.equal(traced_values(traced), eager_values(built.fn))
    else:
        s = scores()
        expected = eager_values(built.fn, s).to(torch.float32)
        torch.testing.assert_close(traced_values(traced, s), expected, rtol=1e-6, atol=1e-6)
    assert bool(traced.grad_slots()) == entry.learnable


def test_closures_over_python_numbers():
    """A closed-over float is lifted (one IR and key, values beside it); an int stays a constant
    (Note [Lifted scalars])."""

    def make(scale):
        def mod(score, b, h, q_idx, kv_idx):
            return score * scale + (q_idx - kv_idx) * (scale / 2)

        return mod

    a, a_again, other = (
        trace(make(0.5), "score_mod"),
        trace(make(0.5), "score_mod"),
        trace(make(2.0), "score_mod"),
    )
    assert a.output is a_again.output is other.output and a.key == other.key
    assert (a.scalar_values, other.scalar_values) == ((0.5,), (2.0,))
    assert [s.name for s in a.scalars] == ["scale"] and "(score * scale)" in a.format()
    ints = trace(make(2), "score_mod"), trace(make(3), "score_mod")
    assert ints[0].key != ints[1].key and not ints[0].scalars
    assert "(score * 2.0)" in ints[0].format() or "(score * 2)" in ints[0].format()


def test_python_control_flow_on_a_float_bakes_it():
    """A float used as a Python number (here in an `if`) cannot be lifted: it is a constant and
    each value has its own trace."""

    def make(c):
        def mod(score, b, h, q_idx, kv_idx):
            return score * c if c > 1.0 else score - c

        return mod

    two, three, half = (trace(make(c), "score_mod") for c in (2.0, 3.0, 0.5))
    assert not two.scalars and two.key != three.key
    assert "(score * 3.0)" in three.format() and "(score - 0.5)" in half.format()
    assert trace(make(3.0), "score_mod").output is three.output


def test_flexfa_mods_are_plain_closures():
    """softcap(cap) lifts `cap` (one IR for every cap); alibi binds the head count, whose slope
    exponent is a lifted float too."""
    twenty, thirty = (trace(flexfa.mods.softcap(c), "score_mod") for c in (20, 30))
    assert twenty.key == thirty.key
    assert (twenty.scalar_values, thirty.scalar_values) == ((20.0,), (30.0,))
    four, eight = (trace(flexfa.mods.alibi.bind(n), "score_mod") for n in (4, 8))
    assert four.output is eight.output and four.scalar_values != eight.scalar_values
    assert Op.EXP2 in _ops(four)


_ROWS = torch.randn(16, 3)
_IDS = torch.randint(0, 4, (16, 2))

# Note [Shape operations on traced values]: the spellings model code uses for broadcasts and
# trailing reductions, each equal to the eager function at every pair.
SHAPE_CASES = [
    pytest.param(lambda s, b, h, q, k: s + s.unsqueeze(-1).sum(-1), id="scalar_unsqueeze"),
    pytest.param(lambda s, b, h, q, k: s + s[None][..., None].view(1).sum(), id="scalar_none"),
    pytest.param(lambda s, b, h, q, k: s + torch.unsqueeze(s, 0).amax(0), id="torch_unsqueeze"),
    pytest.param(lambda s, b, h, q, k: s * s.reshape(1, 1).squeeze(), id="scalar_reshape"),
    pytest.param(lambda s, b, h, q, k: s + _ROWS[q][:, None].sum(1).view(-1)[2], id="col"),
    pytest.param(lambda s, b, h, q, k: s + _ROWS[q, :][1:].prod(-1), id="slice"),
    pytest.param(lambda s, b, h, q, k: s + _ROWS[q][::2].sum() - _ROWS[k][-2:].mean(), id="step"),
    pytest.param(
        lambda s, b, h, q, k: s + (_ROWS[q][:, None] * _ROWS[k][None, :]).amax(-1).sum(-1),
        id="outer",
    ),
    pytest.param(lambda s, b, h, q, k: s + _ROWS[q].reshape(3, 1)[..., 0].sum(), id="ellipsis"),
]


@pytest.mark.parametrize("fn", SHAPE_CASES)
def test_shape_operations_trace_like_eager(fn):
    traced = trace(fn, "score_mod")
    s = scores()
    expected = eager_values(fn, s).to(torch.float32)
    torch.testing.assert_close(traced_values(traced, s), expected, rtol=1e-6, atol=1e-6)


def test_topk_mask_with_unsqueeze_traces_like_eager():
    def video_topk(b, h, q_idx, kv_idx):
        return (_IDS[q_idx] == (kv_idx % 4).unsqueeze(-1)).any(-1) & (q_idx >= kv_idx)[None].all()

    assert torch.equal(traced_values(trace(video_topk, "mask_mod")), eager_values(video_topk))
