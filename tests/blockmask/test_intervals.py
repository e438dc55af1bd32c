"""Soundness of each transfer function of the analytic tier, against brute force.

Model: a tile is a set of pairs; an operand is the set of values it takes there. An abstract value
is built from that set (bounds, possibly widened; `tight` when not widened; `contiguous` when the
set is every integer of its bounds). A transfer function must then describe every value the
operation really produces (computed with the IR evaluator, so with flexfa's semantics), and its
extra claims (`tight`, `contiguous`, `both`, must-true/false) must hold.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexfa.blockmask import intervals as iv
from flexfa.blockmask.intervals import Interval, Truth
from flexfa.ir import build as irb
from flexfa.ir.dtypes import DType
from flexfa.ir.evaluate import Evaluator
from flexfa.ir.nodes import Op
from tests.blockmask.strategies import examples

_F64 = torch.float64
_SETTINGS = dict(deadline=None, max_examples=examples(300))

centers = st.sampled_from([0, 0, 0, 7, -7, 100, -100, 2**31 - 4, -(2**31) + 3, 2**40])


@st.composite
def int_sets(draw, max_size: int = 5, dtype: DType = DType.INT32) -> list[int]:
    c = draw(centers)
    vals = draw(st.lists(st.integers(-6, 6), min_size=1, max_size=max_size))
    lo, hi = (-(2**31), 2**31 - 1) if dtype is DType.INT32 else (-(2**62), 2**62)
    return sorted({min(max(c + v, lo), hi) for v in vals})


@st.composite
def abstracted(draw, values: list[int]) -> Interval:
    widen_lo, widen_hi = draw(st.sampled_from([0, 0, 0, 1, 5])), draw(st.sampled_from([0, 0, 0, 2]))
    lo, hi = min(values) - widen_lo, max(values) + widen_hi
    tight = widen_lo == 0 and widen_hi == 0
    contiguous = tight and set(values) == set(range(lo, hi + 1))
    return Interval(
        torch.tensor(float(lo), dtype=_F64),
        torch.tensor(float(hi), dtype=_F64),
        None,
        tight,
        torch.tensor(contiguous) if draw(st.booleans()) or contiguous else None,
    )


def _leaf(name: str, dtype: DType):
    """An IR node of type `dtype` whose value the test sets directly."""
    var = irb.var(name)
    return var if dtype is DType.INT32 else irb.cast(var, dtype)


def _apply(op: Op, dtype: DType, xs: list, ys: list | None, src: DType | None = None) -> list:
    """op over all (x, y) combinations, computed by flexfa's IR evaluator in `dtype`.

    For op CAST: xs (of type `src`) converted to `dtype`."""
    zero = torch.zeros((), dtype=torch.int32)
    ev = Evaluator({"q_idx": zero, "kv_idx": zero}, [])  # leaves are bound below

    def bind(node, values, shape):
        ev.memo[id(node)] = torch.tensor(values, dtype=node.dtype.torch).view(shape)
        ev._keep.append(node)

    a = _leaf("q_idx", src or dtype)
    if op is Op.CAST:
        node = irb.cast(a, dtype)
        bind(a, xs, (-1,))
    elif ys is None:
        node = irb.unary(op, a)
        bind(a, xs, (-1,))
    else:
        b = _leaf("kv_idx", dtype)
        node = irb.binary(op, a, b)
        bind(a, xs, (-1, 1))
        bind(b, ys, (1, -1))
    return ev(node).flatten().tolist()


def _check_interval(out: Interval, results: list, what: str) -> None:
    lo, hi = float(out.lo), float(out.hi)
    finite = [r for r in results if not (isinstance(r, float) and math.isnan(r))]
    for r in finite:
        assert lo <= r <= hi, f"{what}: value {r} outside [{lo}, {hi}]"
    if len(finite) < len(results):
        assert out.nan is not None and bool(out.nan), f"{what}: NaN produced but not flagged"
    if out.tight and finite:
        assert lo in finite and hi in finite, f"{what}: tight bounds [{lo}, {hi}] not attained"
    if out.contiguous is not None and bool(out.contiguous):
        missing = set(range(int(lo), int(hi) + 1)) - set(finite)
        assert not missing, f"{what}: claimed contiguous but misses {sorted(missing)[:5]}"


INT_BINARY = [Op.ADD, Op.SUB, Op.MUL, Op.FLOORDIV, Op.MOD, Op.MIN, Op.MAX, Op.AND, Op.OR, Op.XOR]
_FN = {
    Op.ADD: iv.add,
    Op.SUB: iv.sub,
    Op.MUL: iv.mul,
    Op.FLOORDIV: iv.floordiv,
    Op.MOD: iv.mod,
    Op.MIN: iv.minimum,
    Op.MAX: iv.maximum,
}


@settings(**_SETTINGS)
@given(st.data(), st.sampled_from(INT_BINARY), st.sampled_from([DType.INT32, DType.INT64]))
def test_integer_binary_ops(data, op, dtype) -> None:
    xs = data.draw(int_sets(dtype=dtype))
    ys = data.draw(int_sets(dtype=dtype))
    if op in (Op.FLOORDIV, Op.MOD):
        ys = [y for y in ys if y != 0] or [3]  # integer division by zero raises in torch
    a, b = data.draw(abstracted(xs)), data.draw(abstracted(ys))
    out = _FN[op](a, b, dtype) if op in _FN else iv.bitwise(op, a, b, dtype)
    _check_interval(out, _apply(op, dtype, xs, ys), f"{op.value} {xs} {ys}")


@settings(**_SETTINGS)
@given(st.data(), st.sampled_from([Op.NEG, Op.ABS, Op.SIGN, Op.NOT]))
def test_integer_unary_ops(data, op) -> None:
    xs = data.draw(int_sets())
    a = data.draw(abstracted(xs))
    fn = {Op.NEG: iv.neg, Op.ABS: iv.absolute, Op.SIGN: iv.sign, Op.NOT: iv.bitwise_not}[op]
    _check_interval(fn(a, DType.INT32), _apply(op, DType.INT32, xs, None), f"{op.value} {xs}")


@settings(**_SETTINGS)
@given(st.data(), st.sampled_from([(DType.INT64, DType.INT32), (DType.INT32, DType.INT64)]))
def test_integer_casts(data, types) -> None:
    src, dst = types
    xs = data.draw(int_sets(dtype=src))
    a = data.draw(abstracted(xs))
    out = iv.cast(a, src, dst)
    results = _apply(Op.CAST, dst, xs, None, src=src)
    assert isinstance(out, Interval)
    _check_interval(out, results, f"cast {xs} to {dst}")


def _truth_claims(out: Truth, results: list[bool], what: str) -> None:
    if any(results):
        assert bool(out.may_true), f"{what}: True occurs but may_true is False"
    if not all(results):
        assert bool(out.may_false), f"{what}: False occurs but may_false is False"
    if bool(out.both):
        assert any(results) and not all(results), f"{what}: claimed mixed, got {set(results)}"


@settings(**_SETTINGS)
@given(st.data(), st.sampled_from([Op.LT, Op.LE, Op.EQ, Op.NE]))
def test_comparisons_of_independent_operands(data, op) -> None:
    xs, ys = data.draw(int_sets()), data.draw(int_sets())
    a, b = data.draw(abstracted(xs)), data.draw(abstracted(ys))
    # Independent operands: every combination occurs in the tile.
    results = [bool(r) for r in _apply(op, DType.INT32, xs, ys)]
    _truth_claims(iv.independent_compare(op, a, b, True), results, f"{xs} {op.value} {ys}")


@settings(**_SETTINGS)
@given(st.data(), st.sampled_from([Op.LT, Op.LE, Op.EQ, Op.NE]))
def test_comparisons_of_correlated_operands(data, op) -> None:
    # Correlated operands: the tile holds only some combinations (here: the diagonal).
    pairs = data.draw(st.lists(st.tuples(st.integers(-9, 9), st.integers(-9, 9)), min_size=1))
    xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
    a, b = data.draw(abstracted(xs)), data.draw(abstracted(ys))
    results = [
        bool(_apply(op, DType.INT32, [x], [y])[0]) for x, y in pairs
    ]  # only the pairs that occur
    _truth_claims(iv.independent_compare(op, a, b, False), results, f"{pairs} {op.value}")


@settings(**_SETTINGS)
@given(st.data(), st.sampled_from([Op.LT, Op.LE, Op.EQ, Op.NE]))
def test_difference_sign(data, op) -> None:
    diffs = data.draw(int_sets())
    d = data.draw(abstracted(diffs))
    # a op b where d = b - a.
    results = [bool(_apply(op, DType.INT64, [0], [x])[0]) for x in diffs]
    _truth_claims(iv.difference_sign(op, d), results, f"0 {op.value} {diffs}")


@st.composite
def truth_functions(draw, n: int) -> tuple[list[bool], Truth]:
    """A bool over n pairs, and a sound (possibly weakened) abstraction of it."""
    values = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    may_true = any(values) or draw(st.booleans())
    may_false = (not all(values)) or draw(st.booleans())
    both = any(values) and not all(values) and draw(st.booleans())
    t = Truth(torch.tensor(may_true), torch.tensor(may_false), torch.tensor(both))
    return values, t


@settings(**_SETTINGS)
@given(st.data(), st.integers(1, 6), st.sampled_from(["and", "or", "xor", "not", "where"]))
def test_logic(data, n, how) -> None:
    a_vals, a = data.draw(truth_functions(n))
    b_vals, b = data.draw(truth_functions(n))
    c_vals, c = data.draw(truth_functions(n))
    if how == "and":
        out, results = iv.logical_and(a, b), [x and y for x, y in zip(a_vals, b_vals)]
    elif how == "or":
        out, results = iv.logical_or(a, b), [x or y for x, y in zip(a_vals, b_vals)]
    elif how == "xor":
        out, results = iv.logical_xor(a, b), [x != y for x, y in zip(a_vals, b_vals)]
    elif how == "not":
        out, results = iv.logical_not(a), [not x for x in a_vals]
    else:
        out = iv.where(c, a, b, DType.BOOL)
        results = [x if k else y for k, x, y in zip(c_vals, a_vals, b_vals)]
    assert isinstance(out, Truth)
    _truth_claims(out, results, f"{how} {a_vals} {b_vals} {c_vals}")


floats = st.one_of(
    st.floats(-1e3, 1e3, width=32),
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-38, 3e38, -3e38, math.inf, -math.inf]),
)


@st.composite
def float_sets(draw) -> list[float]:
    """float32 values (as the analysis sees them: every float32 node holds float32 values)."""
    vals = draw(st.lists(floats, min_size=1, max_size=4))
    if draw(st.integers(0, 9)) == 0:
        vals.append(math.nan)
    return torch.tensor(vals, dtype=torch.float32).tolist()


def float_interval(values: list[float]) -> Interval:
    finite = [v for v in values if not math.isnan(v)]
    lo, hi = (min(finite), max(finite)) if finite else (-math.inf, math.inf)
    nan = any(math.isnan(v) for v in values)
    return Interval(torch.tensor(lo, dtype=_F64), torch.tensor(hi, dtype=_F64), torch.tensor(nan))


def _apply_float(op: Op, xs: list[float], ys: list[float] | None) -> list[float]:
    x = torch.tensor(xs, dtype=torch.float32).view(-1, 1)
    if ys is None:
        node = irb.unary(op, irb.var("score"))
        return Evaluator({"score": x.flatten()}, [])(node).tolist()
    y = torch.tensor(ys, dtype=torch.float32).view(1, -1)
    a, b = irb.var("score"), irb.cast(irb.var("q_idx"), DType.FLOAT32)
    node = irb.binary(op, a, b)
    ev = Evaluator({"score": x, "q_idx": torch.zeros((), dtype=torch.int32)}, [])
    ev.memo[id(b)] = y
    ev._keep.append(b)
    return ev(node).flatten().tolist()


FLOAT_BINARY = {
    Op.ADD: iv.add,
    Op.SUB: iv.sub,
    Op.MUL: iv.mul,
    Op.TRUEDIV: iv.truediv,
    Op.MIN: iv.minimum,
    Op.MAX: iv.maximum,
    Op.FLOORDIV: iv.floordiv,
    Op.MOD: iv.mod,
}


@settings(**_SETTINGS)
@given(float_sets(), float_sets(), st.sampled_from(sorted(FLOAT_BINARY, key=lambda o: o.value)))
def test_float_binary_ops(xs, ys, op) -> None:
    out = FLOAT_BINARY[op](float_interval(xs), float_interval(ys), DType.FLOAT32)
    results = _apply_float(op, xs, ys)
    _check_interval(out, results, f"{op.value} {xs} {ys}")


UNARY_FLOAT = {
    Op.EXP: lambda a, t: iv.monotone(torch.exp, a, t),
    Op.TANH: lambda a, t: iv.monotone(torch.tanh, a, t),
    Op.SIGMOID: lambda a, t: iv.monotone(torch.sigmoid, a, t),
    Op.LOG: lambda a, t: iv.log_like(torch.log, a, t),
    Op.SQRT: lambda a, t: iv.log_like(torch.sqrt, a, t),
    Op.RSQRT: lambda a, t: iv.log_like(torch.rsqrt, a, t),
    Op.SIN: lambda a, t: iv.periodic(a, t),
    Op.FLOOR: lambda a, t: iv.floor_ceil(torch.floor, a, t),
    Op.ABS: iv.absolute,
    Op.NEG: iv.neg,
    Op.SIGN: iv.sign,
}


@settings(**_SETTINGS)
@given(float_sets(), st.sampled_from(sorted(UNARY_FLOAT, key=lambda o: o.value)))
def test_float_unary_ops(xs, op) -> None:
    out = UNARY_FLOAT[op](float_interval(xs), DType.FLOAT32)
    _check_interval(out, _apply_float(op, xs, None), f"{op.value} {xs}")


@settings(**_SETTINGS)
@given(float_sets(), float_sets(), st.sampled_from([Op.LT, Op.LE, Op.EQ, Op.NE]))
def test_float_comparisons(xs, ys, op) -> None:
    out = iv.independent_compare(op, float_interval(xs), float_interval(ys), True)
    _truth_claims(out, [bool(r) for r in _apply_float(op, xs, ys)], f"{xs} {op.value} {ys}")


@settings(**_SETTINGS)
@given(float_sets(), st.sampled_from([DType.INT32, DType.INT64, DType.BOOL]))
def test_float_to_int_and_bool_casts(xs, dst) -> None:
    a = float_interval(xs)
    out = iv.cast(a, DType.FLOAT32, dst)
    node = irb.cast(irb.var("score"), dst)
    x = torch.tensor(xs, dtype=torch.float32)
    results = Evaluator({"score": x}, [])(node).tolist()
    if isinstance(out, Truth):
        _truth_claims(out, [bool(r) for r in results], f"bool({xs})")
        return
    safe = all(math.isfinite(v) and abs(v) < 2**31 for v in xs)
    if safe:  # out-of-range float -> int conversions are undefined; only bounds are checked there
        _check_interval(out, results, f"{dst}({xs})")
    else:
        assert float(out.lo) <= -(2**31) and float(out.hi) >= 2**31 - 1


@settings(**_SETTINGS)
@given(st.data(), st.sampled_from([DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16]))
def test_int_to_float_casts(data, dst) -> None:
    xs = data.draw(int_sets())
    a = data.draw(abstracted(xs))
    out = iv.cast(a, DType.INT32, dst)
    node = irb.cast(irb.var("q_idx"), dst)
    results = Evaluator({"q_idx": torch.tensor(xs, dtype=torch.int32)}, [])(node).tolist()
    assert isinstance(out, Interval)
    _check_interval(out, results, f"{dst}({xs})")
