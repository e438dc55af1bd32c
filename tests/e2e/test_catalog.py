"""Every catalog mod through the tiled backend, forward and backward, against the reference.

Fixed shapes that always exercise the awkward cases together: GQA, odd lengths, Lq != Lkv,
E != Ev, several tiles per row and several steps per q-block.
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.harness import Problem, check_attention, maker
from tests.mods import MASK_MODS, SCORE_MODS, mask_mod, score_mod

SCORE_PROBLEM = Problem(
    batch=2, heads_q=4, heads_kv=2, len_q=37, len_kv=29, head_dim=16, head_dim_v=8
)
MASK_PROBLEM = Problem(
    batch=2, heads_q=2, heads_kv=2, len_q=33, len_kv=45, head_dim=8, head_dim_v=12
)


@pytest.mark.parametrize("entry", SCORE_MODS, ids=str)
def test_score_mod(entry):
    p = SCORE_PROBLEM
    check_attention(
        p,
        score_mod=maker(entry, p.shape),
        mask_mod=mask_mod("causal").build(p.shape).fn,
        block_size=(8, 8),
        kernel_options={"step_columns": 16},
        context=entry.name,
    )


@pytest.mark.parametrize("entry", MASK_MODS, ids=str)
def test_mask_mod(entry):
    p = MASK_PROBLEM
    check_attention(
        p,
        score_mod=maker(score_mod("relative_bias_per_head"), p.shape),
        mask_mod=entry.build(p.shape, seed=1).fn,
        block_size=(8, 16),
        kernel_options={"step_columns": 32},
        context=entry.name,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("score", ["alibi", "t5_buckets", "math_zoo", "temperature"])
def test_dtypes(dtype, score):
    p = Problem(
        batch=1, heads_q=3, heads_kv=1, len_q=40, len_kv=50, head_dim=16, head_dim_v=16, dtype=dtype
    )
    check_attention(
        p,
        score_mod=maker(score_mod(score), p.shape),
        mask_mod=mask_mod("prefix_or_window").build(p.shape).fn,
        block_size=16,
        context=f"{score} {dtype}",
    )
