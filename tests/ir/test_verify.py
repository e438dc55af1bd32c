"""The verifier accepts what the builders make and rejects each kind of malformed node.

Malformed nodes are made with `Node(...)` directly, bypassing the typed builders."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from flexfa.frontend import trace_mask_mod, trace_score_mod
from flexfa.ir import Capture, DType, IRVerificationError, Node, Op, verify
from flexfa.ir import build as irb
from tests.e2e.strategies import examples
from tests.ir.exprgen import bool_exprs, int_exprs, score_mod_exprs
from tests.mods import ALL_MODS, Shape

F32, F64, F16, I32, I64, BOOL = (
    DType.FLOAT32,
    DType.FLOAT64,
    DType.FLOAT16,
    DType.INT32,
    DType.INT64,
    DType.BOOL,
)
s, q, kv = irb.var("score"), irb.var("q_idx"), irb.var("kv_idx")
TAB = irb.capture(Capture(0, "tab", F32, 2))


@settings(max_examples=examples(100), deadline=None)
@given(expr=score_mod_exprs())
def test_builders_make_valid_float_ir(expr):
    verify([expr])


@settings(max_examples=examples(60), deadline=None)
@given(i=int_exprs(3), c=bool_exprs(2))
def test_builders_make_valid_int_and_bool_ir(i, c):
    verify([i, c])


@pytest.mark.parametrize("entry", ALL_MODS, ids=str)
def test_traced_catalog_verifies(entry):
    built = entry.build(Shape(2, 3, 11, 13))
    traced = (trace_score_mod if entry.kind == "score_mod" else trace_mask_mod)(built.fn)
    verify([traced.output], allowed_vars=traced.params)
    if entry.kind == "score_mod":
        verify(traced.gradient(traced.grad_slots()).roots())


MALFORMED = [
    pytest.param(
        Node(Op.CONST, I32, (), 1.5), "does not match its type", id="float_value_in_int_const"
    ),
    pytest.param(
        Node(Op.CONST, F32, (), 2), "does not match its type", id="int_value_in_float_const"
    ),
    pytest.param(
        Node(Op.CONST, BOOL, (), 1), "does not match its type", id="int_value_in_bool_const"
    ),
    pytest.param(Node(Op.CONST, I32, (), 2**31), "does not match its type", id="int32_overflow"),
    pytest.param(Node(Op.VAR, I32, (), "x_idx"), "unknown variable", id="unknown_var"),
    pytest.param(Node(Op.VAR, F32, (), "q_idx"), "wrong type", id="var_wrong_type"),
    pytest.param(
        Node(Op.CAPTURE, F16, (), Capture(0, "tab", F32, 2)), "capture type", id="capture_type"
    ),
    pytest.param(Node(Op.LOAD, F32, (TAB, q)), "wrong number of indices", id="load_arity"),
    pytest.param(Node(Op.LOAD, F32, (TAB, q, s)), "integers", id="load_float_index"),
    pytest.param(Node(Op.LOAD, F32, (s, q)), "must read a CAPTURE", id="load_not_capture"),
    pytest.param(
        Node(Op.LOAD, F64, (TAB, q, kv)), "wrong number of indices or type", id="load_type"
    ),
    pytest.param(Node(Op.CAST, F64, (s,), F32), "cast target", id="cast_arg"),
    pytest.param(Node(Op.EXP, I32, (q,)), "float unary", id="exp_of_int"),
    pytest.param(
        Node(Op.EXP, F16, (Node(Op.CAST, F16, (s,), F16),)), "float unary", id="exp_in_f16"
    ),
    pytest.param(Node(Op.EXP, F64, (s,)), "float unary", id="exp_type_mismatch"),
    pytest.param(
        Node(Op.NEG, BOOL, (irb.binary(Op.LT, q, kv),)), "unary arithmetic", id="neg_bool"
    ),
    pytest.param(Node(Op.NOT, F32, (s,)), "~ needs", id="not_float"),
    pytest.param(Node(Op.ADD, F32, (s, q)), "operands must have the result type", id="add_mixed"),
    pytest.param(Node(Op.TRUEDIV, I32, (q, kv)), "true division", id="int_truediv"),
    pytest.param(
        Node(Op.ADD, BOOL, (irb.binary(Op.LT, q, kv),) * 2), "non-arithmetic", id="add_bools"
    ),
    pytest.param(Node(Op.LT, BOOL, (s, q)), "one type", id="compare_mixed"),
    pytest.param(Node(Op.LT, I32, (q, kv)), "yields bool", id="compare_not_bool"),
    pytest.param(Node(Op.AND, F32, (s, s)), "logic op", id="and_floats"),
    pytest.param(Node(Op.WHERE, F32, (q, s, s)), "bool condition", id="where_int_cond"),
    pytest.param(
        Node(Op.WHERE, F32, (irb.binary(Op.LT, q, kv), s, q)), "branches", id="where_branch"
    ),
]


@pytest.mark.parametrize("node, message", MALFORMED)
def test_malformed_nodes_are_rejected(node, message):
    with pytest.raises(IRVerificationError, match=message):
        verify([node])


def test_malformed_node_deep_inside_is_found():
    bad = Node(Op.ADD, F32, (s, q))
    with pytest.raises(IRVerificationError, match="add node"):
        verify([irb.unary(Op.TANH, irb.mul(bad, s))])


def test_allowed_vars_keep_score_out_of_mask_mods():
    mask_like = irb.binary(Op.LT, s, irb.const(0.0))
    verify([mask_like])
    with pytest.raises(IRVerificationError, match="'score' is not a parameter here"):
        verify([mask_like], allowed_vars=("b", "h", "q_idx", "kv_idx"))


def test_verification_error_is_an_assertion_error():
    assert issubclass(IRVerificationError, AssertionError)
    assert torch  # the module is used by the catalog builds above
