"""float64 `torch.autograd.gradcheck` of the tiled backend at tiny sizes: finite differences
agree with its backward for q, k, v and captured tensors, across tiles and steps."""

from __future__ import annotations

import torch
from torch.autograd import gradcheck

import flexfa
from flexfa.masks import sliding_window

F64 = {"dtype": torch.float64}


def _rand(*size, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, generator=g, **F64).requires_grad_(True)


def test_gradcheck_gqa_captured_table_and_temperature():
    q, k, v = _rand(1, 2, 5, 8, seed=0), _rand(1, 1, 7, 8, seed=1), _rand(1, 1, 7, 8, seed=2)
    table = _rand(2, 9, seed=3)
    temp = (torch.rand((), **F64) + 1.0).requires_grad_(True)
    bm = flexfa.create_block_mask(sliding_window(4), None, None, 5, 7, BLOCK_SIZE=(2, 4))

    def f(q, k, v, table, temp):
        def mod(score, b, h, q_idx, kv_idx):
            d = torch.clamp(q_idx - kv_idx, -4, 4)
            return score / temp + table[h, d + 4]

        return flexfa.attention(
            q,
            k,
            v,
            score_mod=mod,
            block_mask=bm,
            enable_gqa=True,
            return_lse=True,
            kernel_options={"step_columns": 4},
        )

    assert gradcheck(f, (q, k, v, table, temp), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_with_empty_rows_and_unequal_lengths():
    q, k, v = _rand(2, 1, 6, 8, seed=4), _rand(2, 1, 3, 8, seed=5), _rand(2, 1, 3, 12, seed=6)
    q_bias, kv_bias = _rand(6, seed=7), _rand(3, seed=8)
    bm = flexfa.create_block_mask(lambda b, h, i, j: j < i, None, None, 6, 3, BLOCK_SIZE=2)

    def f(q, k, v, q_bias, kv_bias):
        def mod(score, b, h, q_idx, kv_idx):
            return score + q_bias[q_idx] * kv_bias[kv_idx]

        out, lse = flexfa.attention(q, k, v, score_mod=mod, block_mask=bm, return_lse=True)
        return out, torch.where(torch.isinf(lse), 0.0, lse)  # row 0 has LSE -inf

    assert gradcheck(f, (q, k, v, q_bias, kv_bias), eps=1e-6, atol=1e-7, rtol=1e-5)
