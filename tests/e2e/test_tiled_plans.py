"""The tiled backend keeps its tile states and steps per BlockMask (Note [Tiled plans per
BlockMask] in flexfa/backends/tiled.py): repeated calls reuse them, and each key length has its
own."""

from __future__ import annotations

import torch

import flexfa
from flexfa.backends import tiled
from flexfa.reference import reference_attention


def _window(b, h, q_idx, kv_idx):
    return (q_idx + 200 >= kv_idx) & (kv_idx > q_idx + 200 - 96)


def test_repeated_calls_share_one_plan():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 8, 16)
    k, v = torch.randn(2, 1, 2, 300, 16).unbind(0)
    bm = flexfa.create_block_mask(flexfa.masks.causal, None, None, 8, 300)
    first = flexfa.attention(q, k, v, block_mask=bm, backend="tiled")
    plans = dict(tiled._plans[bm])
    second = flexfa.attention(q, k, v, block_mask=bm, backend="tiled")
    assert torch.equal(first, second)
    assert len(tiled._plans[bm]) == len(plans) == 1
    (shared,) = tiled._plans[bm].values()
    assert shared is next(iter(plans.values())) and shared.steps


def test_each_key_length_is_computed_over_its_own_columns():
    # A decode loop over a growing cache, and back: plans are kept per BlockMask and key length,
    # so no call reads the steps of another length.
    torch.manual_seed(1)
    k, v = torch.randn(2, 1, 2, 300, 16).unbind(0)
    for length in (260, 280, 300, 280):
        q = torch.randn(1, 2, 1, 16)
        kk, vv = k[:, :, :length], v[:, :, :length]
        got = flexfa.attention(q, kk, vv, block_mask=_window, backend="tiled")
        want, _ = reference_attention(q, kk, vv, mask_mod=_window, dtype=torch.float64)
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5, msg=f"length {length}")


def test_steps_are_kept_within_a_budget(monkeypatch):
    # Long calls build their steps again rather than keep them alive with the BlockMask.
    monkeypatch.setattr(tiled, "_KEPT_COLUMNS", 300)
    torch.manual_seed(2)
    q = torch.randn(1, 2, 512, 16)
    k, v = torch.randn(2, 1, 2, 512, 16).unbind(0)
    bm = flexfa.create_block_mask(flexfa.masks.causal, None, None, 512, 512)
    got = flexfa.attention(q, k, v, block_mask=bm, backend="tiled")
    (shared,) = tiled._plans[bm].values()
    assert 0 < shared.columns <= 300 and len(shared.steps) < 512 // bm.block_size.q
    want, _ = reference_attention(q, k, v, mask_mod=flexfa.masks.causal, dtype=torch.float64)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flexfa.attention(q, k, v, block_mask=bm, backend="tiled"), got)
