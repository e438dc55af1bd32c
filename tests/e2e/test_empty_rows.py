"""Rows with no allowed key: output 0, LSE -inf, zero gradients, and never a NaN anywhere."""

from __future__ import annotations

import math

import pytest
import torch

import flexfa
from tests.e2e.harness import Problem, check_attention, finite_or_neg_inf, make_inputs, maker
from tests.mods import BuiltMod, mask_mod, score_mod

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _run(problem, mask, score=None, block_size=(8, 8)):
    data = make_inputs(problem, seed=3)
    q, k, v = (data[n].clone().requires_grad_(True) for n in "qkv")
    built = score.build(problem.shape) if score is not None else None
    bm = flexfa.create_block_mask(
        mask, problem.batch, problem.heads_q, problem.len_q, problem.len_kv, BLOCK_SIZE=block_size
    )
    out, lse = flexfa.attention(
        q,
        k,
        v,
        score_mod=built.fn if built else None,
        block_mask=bm,
        enable_gqa=problem.enable_gqa,
        return_lse=True,
    )
    params = list(built.params) if built else []
    grads = torch.autograd.grad((out, lse), [q, k, v, *params], (data["dout"], data["dlse"]))
    return out, lse, grads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strictly_causal_first_row(dtype):
    p = Problem(batch=2, heads_q=4, heads_kv=2, len_q=21, len_kv=21, dtype=dtype)
    out, lse, (dq, dk, dv, dtable) = _run(
        p, mask_mod("strictly_causal").build(p.shape).fn, score_mod("relative_bias_per_head")
    )
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert (lse[:, :, 0] == -math.inf).all() and torch.isfinite(lse[:, :, 1:]).all()
    assert torch.equal(dq[:, :, 0], torch.zeros_like(dq[:, :, 0]))
    for g in (dq, dk, dv, dtable):
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_third_row_empty(dtype):
    p = Problem(batch=1, heads_q=2, heads_kv=2, len_q=30, len_kv=17, dtype=dtype)
    out, lse, (dq, *rest) = _run(p, mask_mod("every_third_row_empty").build(p.shape).fn)
    rows = torch.arange(p.len_q) % 3 == 1
    assert (out[:, :, rows] == 0).all() and (lse[:, :, rows] == -math.inf).all()
    assert (dq[:, :, rows] == 0).all()
    assert torch.isfinite(lse[:, :, ~rows]).all() and (out[:, :, ~rows] != 0).any()
    assert all(torch.isfinite(g).all() for g in rest)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nothing_attends(dtype):
    p = Problem(batch=2, heads_q=2, heads_kv=1, len_q=9, len_kv=13, dtype=dtype)
    out, lse, grads = _run(p, mask_mod("empty").build(p.shape).fn, score_mod("t5_buckets"))
    assert torch.equal(out, torch.zeros_like(out))
    assert (lse == -math.inf).all()
    for g in grads:  # dq, dk, dv and the captured table
        assert torch.equal(g, torch.zeros_like(g))


def test_rows_emptied_by_the_score_mod():
    """-inf from the score_mod empties a row just like the mask (no NaN from exp(-inf - -inf))."""

    def odd_rows_vanish(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx % 2 == 0, score, float("-inf"))

    p = Problem(batch=1, heads_q=2, heads_kv=2, len_q=12, len_kv=10)
    data = make_inputs(p, seed=0)
    q, k, v = (data[n].clone().requires_grad_(True) for n in "qkv")
    out, lse = flexfa.attention(q, k, v, score_mod=odd_rows_vanish, return_lse=True)
    odd = torch.arange(p.len_q) % 2 == 1
    assert (out[:, :, odd] == 0).all() and (lse[:, :, odd] == -math.inf).all()
    assert finite_or_neg_inf(lse)
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (data["dout"], data["dlse"]))
    assert (dq[:, :, odd] == 0).all()
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    check_attention(p, score_mod=lambda dtype: BuiltMod(odd_rows_vanish))


def test_key_padding_with_empty_batch_elements_matches_reference():
    p = Problem(batch=2, heads_q=2, heads_kv=2, len_q=11, len_kv=14, dtype=torch.bfloat16)
    for seed in range(3):
        mask = mask_mod("key_padding").build(p.shape, seed=seed).fn
        check_attention(
            p, score_mod=maker(score_mod("temperature"), p.shape), mask_mod=mask, block_size=4
        )
