"""Regression tests for the tiled backend's accuracy where many pairs feed one gradient entry.

Both cases were found by the property tests; here they run every time."""

from __future__ import annotations

import torch

from tests.e2e.harness import Problem, check_attention, maker
from tests.mods import BuiltMod, score_mod


def test_zero_dim_capture_gradient_in_bfloat16():
    """Note [Delta from the unrounded output]: a score_mod `temp` (a constant score) has a
    gradient of exactly 0; with delta from the bf16-rounded output it was 10x eager's error."""
    p = Problem(
        batch=1,
        heads_q=2,
        heads_kv=1,
        len_q=27,
        len_kv=3,
        head_dim=8,
        head_dim_v=8,
        dtype=torch.bfloat16,
    )

    def make(dtype):
        temp = (torch.tensor(0.7) + 0.5).to(dtype).requires_grad_(True)

        def constant_score(score, b, h, q_idx, kv_idx):
            return temp

        return BuiltMod(constant_score, (temp,))

    for seed in range(4):
        check_attention(p, score_mod=make, seed=seed)


def test_per_head_entry_read_by_every_pair_in_float32():
    """Note [Accumulating captured-tensor gradients]: scale[h, -1] is read by B * Lq * Lkv pairs;
    accumulated one by one in float32 its gradient had 5x eager's error."""
    p = Problem(batch=2, heads_q=1, heads_kv=1, len_q=37, len_kv=40, head_dim=8, head_dim_v=8)
    check_attention(
        p,
        score_mod=maker(score_mod("logit_scale"), p.shape),
        kernel_options={"step_columns": 4},
        lse_grad=False,
    )
