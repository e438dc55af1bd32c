"""The printer: one-line expressions and SSA listings a person can read."""

from __future__ import annotations

import torch

from flexfa.frontend import trace_score_mod
from flexfa.ir import Capture, DType, Op, format_expr, format_graph
from flexfa.ir import build as irb

s, q, kv, h = (irb.var(n) for n in ("score", "q_idx", "kv_idx", "h"))


def test_format_expr_infix_calls_casts_and_loads():
    tab = irb.capture(Capture(0, "tab", DType.FLOAT32, 2))
    d = irb.sub(q, kv)
    expr = irb.where(
        irb.binary(Op.LE, kv, q),
        irb.add(s, irb.load(tab, (h, irb.binary(Op.MOD, d, irb.const(8))))),
        irb.unary(Op.NEG, irb.unary(Op.TANH, s)),
    )
    assert format_expr(expr) == (
        "where((kv_idx <= q_idx), (score + tab[h, ((q_idx - kv_idx) % 8)]), -tanh(score))"
    )
    assert format_expr(irb.cast(d, DType.FLOAT64)) == "(q_idx - kv_idx).to(f64)"
    assert format_expr(irb.unary(Op.NOT, irb.binary(Op.EQ, q, kv))) == "~(q_idx == kv_idx)"
    assert format_expr(irb.const(float("-inf"))) == "-inf"
    assert format_expr(irb.load(irb.capture(Capture(1, "temp", DType.FLOAT32, 0)), ())) == "temp[]"


def test_format_graph_numbers_interior_nodes_once():
    d = irb.sub(q, kv)
    root = irb.mul(irb.cast(irb.mul(d, d), DType.FLOAT32), s)
    assert format_graph({"out": root}, title="t") == "\n".join(
        [
            "t",
            "  %0 = (q_idx - kv_idx)  : i32",
            "  %1 = (%0 * %0)  : i32",
            "  %2 = %1.to(f32)  : f32",
            "  %3 = (%2 * score)  : f32",
            "  out = %3",
        ]
    )


def test_format_graph_several_outputs_and_a_leaf_output():
    text = format_graph([irb.add(s, s), s])
    assert text.splitlines() == ["  %0 = (score + score)  : f32", "  out0 = %0", "  out1 = score"]


def test_traced_mod_format_has_signature_and_captures():
    slopes = torch.rand(4)
    traced = trace_score_mod(lambda score, b, h, q_idx, kv_idx: score * slopes[h])
    lines = traced.format().splitlines()
    assert lines[0] == "score_mod score_mod(score, b, h, q_idx, kv_idx) captures slopes: f32[1d]"
    assert lines[1:] == ["  %0 = slopes[h]  : f32", "  %1 = (score * %0)  : f32", "  out = %1"]
