"""Each simplification rule (one test per rule, including what it must leave alone), constant
folding, and properties of `simplify` on random expressions."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flexfa.ir import DType, Evaluator, Op, format_expr, simplify, verify
from flexfa.ir import build as irb
from tests.e2e.strategies import examples
from tests.ir.exprgen import bool_exprs, capture_tensors, env, int_exprs, score_mod_exprs

# The package exports the function `simplify`, which hides the submodule of the same name.
rules = importlib.import_module("flexfa.ir.simplify")

s, q, kv, h = (irb.var(n) for n in ("score", "q_idx", "kv_idx", "h"))
lt = irb.binary(Op.LT, q, kv)
c = irb.const


def simp(node):
    (out,) = simplify([node])
    verify([out])
    return out


# -- constant folding -------------------------------------------------------------------------


def test_fold_integer_float_and_bool_constants():
    assert simp(irb.add(c(2), c(3))) is c(5)
    assert simp(irb.binary(Op.FLOORDIV, c(-7), c(2))) is c(-4)  # floor, like Python
    assert simp(irb.binary(Op.MOD, c(-7), c(3))) is c(2)  # the sign of the divisor
    assert simp(irb.mul(c(1.5), c(2.0))) is c(3.0)
    assert simp(irb.unary(Op.EXP2, c(3.0))) is c(8.0)
    assert simp(irb.binary(Op.LT, c(1), c(2))) is c(True)
    assert simp(irb.where(c(False), c(1.0), c(2.0))) is c(2.0)


def test_fold_computes_in_the_node_type():
    assert simp(irb.add(c(2**31 - 1), c(1))) is c(-(2**31))  # int32 wraps, as torch does
    third = simp(irb.div(c(1.0), c(3.0)))
    assert third.arg == torch.tensor(1 / 3, dtype=torch.float32).item() != 1 / 3
    assert simp(irb.unary(Op.LOG, c(0.0))) is c(float("-inf"))


def test_fold_leaves_errors_and_narrow_casts_alone():
    by_zero = irb.binary(Op.FLOORDIV, c(1), c(0))
    assert simp(by_zero) is by_zero  # evaluating it raises, so it stays for the kernel to decide
    half = irb.cast(c(0.1), DType.FLOAT16)
    assert simp(half) is half  # an explicit narrow cast stays visible


# -- one test per rule --------------------------------------------------------------------------


def test_constants_right():
    assert rules.constants_right(irb.add(c(2.0), s)) is irb.add(s, c(2.0))
    assert rules.constants_right(irb.sub(c(2.0), s)) is None  # not commutative
    assert rules.constants_right(irb.add(s, c(2.0))) is None


def test_additive_identity():
    assert rules.additive_identity(irb.add(q, c(0))) is q
    assert rules.additive_identity(irb.sub(s, c(0.0))) is s
    assert rules.additive_identity(irb.add(s, c(-0.0))) is s
    assert rules.additive_identity(irb.sub(c(0), q)) is irb.neg(q)
    assert rules.additive_identity(irb.add(s, c(1e-30))) is None


def test_multiplicative_identity():
    assert rules.multiplicative_identity(irb.mul(s, c(1.0))) is s
    assert rules.multiplicative_identity(irb.div(s, c(1.0))) is s
    assert rules.multiplicative_identity(irb.mul(q, c(-1))) is irb.neg(q)
    # x * 0 -> 0 also for floats: see Note [Multiplying by zero].
    assert rules.multiplicative_identity(irb.mul(s, c(0.0))) is c(0.0)
    assert rules.multiplicative_identity(irb.div(c(0.0), s)) is c(0.0)
    assert rules.multiplicative_identity(irb.div(s, c(-1.0))) is None
    assert rules.multiplicative_identity(irb.div(c(1.0), s)) is None


def test_double_negation():
    assert rules.double_negation(irb.neg(irb.neg(s))) is s
    assert rules.double_negation(irb.unary(Op.NOT, irb.unary(Op.NOT, lt))) is lt
    assert rules.double_negation(irb.neg(irb.sub(q, kv))) is irb.sub(kv, q)
    assert rules.double_negation(irb.neg(irb.add(q, kv))) is None


def test_cast_round_trip_only_through_a_wider_type():
    assert rules.cast_round_trip(irb.cast(irb.cast(q, DType.INT64), DType.INT32)) is q
    assert rules.cast_round_trip(irb.cast(irb.cast(s, DType.FLOAT64), DType.FLOAT32)) is s
    assert rules.cast_round_trip(irb.cast(irb.cast(lt, DType.INT32), DType.BOOL)) is lt
    # Narrowing first loses information: f32 -> f16 -> f32 and f64 -> f32 -> f64 must stay.
    assert rules.cast_round_trip(irb.cast(irb.cast(s, DType.FLOAT16), DType.FLOAT32)) is None
    wide = irb.cast(s, DType.FLOAT64)
    assert rules.cast_round_trip(irb.cast(irb.cast(wide, DType.FLOAT32), DType.FLOAT64)) is None
    assert rules.cast_round_trip(irb.cast(irb.cast(q, DType.BOOL), DType.INT32)) is None


def test_where_rules():
    assert rules.where_rules(irb.where(c(True), s, q)) is s
    assert rules.where_rules(irb.where(c(False), q, kv)) is kv
    assert rules.where_rules(irb.where(lt, s, s)) is s
    assert rules.where_rules(irb.where(irb.unary(Op.NOT, lt), q, kv)) is irb.where(lt, kv, q)
    assert rules.where_rules(irb.where(lt, c(True), c(False))) is lt
    assert rules.where_rules(irb.where(lt, c(1), c(0))) is None  # an int, not the bool itself


def test_boolean_identities():
    eq = irb.binary(Op.EQ, q, kv)
    assert rules.boolean_identities(irb.binary(Op.AND, lt, c(True))) is lt
    assert rules.boolean_identities(irb.binary(Op.AND, lt, c(False))) is c(False)
    assert rules.boolean_identities(irb.binary(Op.OR, lt, c(False))) is lt
    assert rules.boolean_identities(irb.binary(Op.OR, lt, c(True))) is c(True)
    assert rules.boolean_identities(irb.binary(Op.AND, lt, lt)) is lt
    assert rules.boolean_identities(irb.binary(Op.OR, lt, eq)) is None
    assert rules.boolean_identities(irb.binary(Op.AND, q, c(1))) is None  # bitwise on ints


def test_reflexive_compare_integers_only():
    d = irb.sub(q, kv)
    assert rules.reflexive_compare(irb.binary(Op.EQ, d, d)) is c(True)
    assert rules.reflexive_compare(irb.binary(Op.LE, d, d)) is c(True)
    assert rules.reflexive_compare(irb.binary(Op.LT, d, d)) is c(False)
    assert rules.reflexive_compare(irb.binary(Op.NE, d, d)) is c(False)
    # For floats x == x is False for NaN: not simplified.
    for op in (Op.EQ, Op.LE, Op.LT, Op.NE):
        assert rules.reflexive_compare(irb.binary(op, s, s)) is None


def test_reassociate_integer_constants():
    assert rules.reassociate_int_constants(irb.add(irb.add(q, c(3)), c(4))) is irb.add(q, c(7))
    assert rules.reassociate_int_constants(irb.add(irb.sub(q, c(3)), c(1))) is irb.sub(q, c(2))
    assert rules.reassociate_int_constants(irb.sub(irb.add(q, c(3)), c(3))) is irb.add(q, c(0))
    # Floats are not reassociated: (s + 0.1) + 0.2 != s + 0.3 in floating point.
    assert rules.reassociate_int_constants(irb.add(irb.add(s, c(0.1)), c(0.2))) is None


def test_reassociation_never_makes_an_unrepresentable_constant():
    big = irb.add(irb.add(q, c(2**31 - 1)), c(1))  # c1 + c2 = 2**31 does not fit in int32
    out = simp(big)
    grid = {"q_idx": torch.tensor([0, 5, -3], dtype=torch.int32)}
    assert torch.equal(Evaluator(grid, [])(out), Evaluator(grid, [])(big))
    low = simp(irb.sub(irb.sub(q, c(2**31 - 1)), c(1)))  # total -2**31 fits only as a sum
    assert torch.equal(Evaluator(grid, [])(low), grid["q_idx"] - 2**31)


def test_small_powers():
    assert rules.small_powers(irb.binary(Op.POW, s, c(1.0))) is s
    assert rules.small_powers(irb.binary(Op.POW, s, c(2.0))) is irb.mul(s, s)
    assert rules.small_powers(irb.binary(Op.POW, q, c(0))) is c(1)
    assert rules.small_powers(irb.binary(Op.POW, s, c(3.0))) is None
    assert rules.small_powers(irb.binary(Op.POW, s, s)) is None


def test_float_expressions_that_must_not_simplify():
    """x - x, x / x and x * x / x are not 0, 1 and x for floats (inf and NaN)."""
    for expr in (irb.sub(s, s), irb.div(s, s), irb.div(irb.mul(s, s), s)):
        assert simp(expr) is expr


def test_rules_reach_a_fixpoint_through_rebuilt_nodes():
    # ((score * 1) + 0) - -(-(0)) ... folds to score only after several rewrites of fresh nodes.
    expr = irb.sub(irb.add(irb.mul(s, c(1.0)), c(0.0)), irb.neg(irb.neg(c(0.0))))
    assert simp(expr) is s
    assert (
        format_expr(simp(irb.where(irb.unary(Op.NOT, c(False)), irb.add(q, c(0)), kv))) == "q_idx"
    )


# -- properties ----------------------------------------------------------------------------------


def _values(node, seed, float_dtype=torch.float64):
    return Evaluator(env(seed), capture_tensors(seed), float_dtype=float_dtype)(node)


_ULP_OF_A_LARGE_VALUE = irb.binary(
    Op.MOD, irb.binary(Op.POW, irb.add(irb.mul(s, s), c(1.0)), c(2.0)), c(0.75)
)


@settings(max_examples=examples(300), deadline=None)
@given(expr=score_mod_exprs(), seed=st.integers(0, 100))
@example(expr=_ULP_OF_A_LARGE_VALUE, seed=1)  # found by hypothesis at 30x its examples
def test_simplify_preserves_float_values(expr, seed):
    """Compared in float32, the IR's own arithmetic: folding computes constants in the node's type
    (a float64-widened evaluation of the unfolded expression differs by float32 rounding). A
    rewrite may round differently by an ulp (`pow(x, 2) -> x * x`), and a later `%` or `-` turns
    an ulp of a large intermediate into an absolute error of that size, so the tolerance follows
    the largest intermediate magnitude: `((score * score + 1) ** 2) % 0.75` at |score| ~ 10 differs
    by 2.4e-4, one ulp of 1e4."""
    f32 = torch.float32
    after, before = torch.broadcast_tensors(
        _values(simp(expr), seed, f32), _values(expr, seed, f32)
    )
    largest = 0.0
    for node in expr.toposort():
        if node.dtype.is_float:
            v = _values(node, seed, f32).abs()
            finite = v[torch.isfinite(v)]
            if finite.numel():
                largest = max(largest, float(finite.max()))
    atol = 1e-6 + 4 * torch.finfo(f32).eps * largest
    torch.testing.assert_close(after, before, rtol=1e-5, atol=atol)


@settings(max_examples=examples(300), deadline=None)
@given(expr=st.one_of(int_exprs(3), bool_exprs(2)), seed=st.integers(0, 100))
def test_simplify_preserves_int_and_bool_values_exactly(expr, seed):
    after, before = _values(simp(expr), seed), _values(expr, seed)
    assert after.dtype == before.dtype
    assert torch.equal(*torch.broadcast_tensors(after, before))


@settings(max_examples=examples(200), deadline=None)
@given(expr=st.one_of(score_mod_exprs(), int_exprs(3)))
def test_simplify_is_idempotent_and_never_grows(expr):
    """Never more operations: constants are literals in the generated code, and a rewrite may add
    one while the old one stays in use, e.g. `(q_idx - 1) - 1 -> q_idx - 2` where `q_idx - 1`
    also feeds a comparison."""
    once = simp(expr)
    assert simp(once) is once

    def operations(root):
        return [n for n in root.toposort() if n.op is not Op.CONST]

    assert len(operations(once)) <= len(operations(expr)), (once, expr)


def test_reassociation_may_add_a_constant_but_no_operation():
    """The case hypothesis found: `q_idx - 1` stays in use by the comparison when `(q_idx - 1) - 1`
    becomes `q_idx - 2`, so the new literal 2 is one node more, and no operation more."""
    less = irb.sub(q, c(1))
    expr = irb.where(irb.binary(Op.LT, q, less), q, irb.sub(less, c(1)))
    once = simp(expr)
    assert format_expr(once) == "where((q_idx < (q_idx - 1)), q_idx, (q_idx - 2))"
    test_simplify_is_idempotent_and_never_grows.hypothesis.inner_test(expr)


@pytest.mark.parametrize("rule", rules.RULES, ids=lambda r: r.__name__)
def test_every_rule_has_a_justification(rule):
    """Each rule carries its rewrite as a comment right above it (`# x * 1 -> x`)."""
    import inspect

    lines = inspect.getsource(rules).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {rule.__name__}("))
    comment = []
    for line in reversed(lines[:start]):
        if not line.startswith("#"):
            break
        comment.append(line)
    assert any("->" in line for line in comment), f"{rule.__name__} has no '# a -> b' comment"
