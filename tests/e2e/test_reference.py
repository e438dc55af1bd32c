"""flexfa.reference itself: plain attention matches torch SDPA, and the written semantics
(scaling, GQA mapping, LSE, empty rows, authoritative BlockMask, per-pair mods) hold."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import flexfa
from flexfa.blockmask.block_mask import BlockMask, BlockSize, TileState
from flexfa.frontend import trace_mask_mod
from flexfa.reference import allowed_pairs, apply_per_pair, reference_attention

F64 = torch.float64


def _qkv(B=2, Hq=4, Hkv=2, Lq=9, Lkv=11, E=8, Ev=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, Hq, Lq, E, generator=g, dtype=F64),
        torch.randn(B, Hkv, Lkv, E, generator=g, dtype=F64),
        torch.randn(B, Hkv, Lkv, Ev, generator=g, dtype=F64),
    )


def test_matches_sdpa_with_gqa_scale_and_causal_mask():
    q, k, v = _qkv()
    out, lse = reference_attention(
        q, k, v, mask_mod=flexfa.masks.causal, scale=0.3, enable_gqa=True
    )
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, expected)
    # GQA: query head h reads KV head h // (Hq // Hkv), i.e. heads 0, 1 -> 0 and 2, 3 -> 1.
    k_rep, v_rep = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = (q @ k_rep.transpose(-1, -2)) * 0.3
    s = s.masked_fill(torch.ones(9, 11, dtype=torch.bool).tril().logical_not(), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v_rep)


def test_default_scale_is_inverse_sqrt_head_dim_and_score_mod_sees_scaled_scores():
    q, k, v = _qkv(Hq=2, Hkv=2)
    doubled, _ = reference_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 2)
    expected = F.scaled_dot_product_attention(q, k, v, scale=2 / math.sqrt(8))
    torch.testing.assert_close(doubled, expected)


def test_empty_rows_are_zero_with_lse_minus_inf_and_zero_gradient():
    q, k, v = (t.requires_grad_(True) for t in _qkv(Hq=2, Hkv=2))
    out, lse = reference_attention(q, k, v, mask_mod=lambda b, h, i, j: (i > 2) & (j < i))
    assert (out[:, :, :3] == 0).all() and (lse[:, :, :3] == -math.inf).all()
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert (dq[:, :, :3] == 0).all() and torch.isfinite(dq).all()


def test_mods_are_applied_per_pair():
    """Note [Mods are applied per pair]: chained indexing means what it means for one pair."""
    bias = torch.randn(2, 3, dtype=F64)
    values = apply_per_pair(lambda b, h, i, j: bias[b][h] + i - j, 2, 3, 4, 5, torch.device("cpu"))
    expected = bias.view(2, 3, 1, 1) + torch.arange(4).view(4, 1) - torch.arange(5)
    torch.testing.assert_close(values, expected)
    constant = apply_per_pair(lambda b, h, i, j: True, 1, 2, 3, 4, torch.device("cpu"))
    assert constant.shape == (1, 2, 3, 4) and constant.all()


def test_heads_dependent_mods_are_bound():
    q, k, v = _qkv(Hq=4, Hkv=4)
    a, _ = reference_attention(q, k, v, score_mod=flexfa.mods.alibi)
    b, _ = reference_attention(q, k, v, score_mod=flexfa.mods.alibi.bind(4))
    torch.testing.assert_close(a, b)


def test_block_mask_is_authoritative():
    """Full tiles attend whatever the mask says, empty tiles never; partial tiles ask the mask."""
    traced = trace_mask_mod(flexfa.masks.causal)
    states = torch.tensor(
        [[[[TileState.FULL, TileState.FULL], [TileState.EMPTY, TileState.PARTIAL]]]],
        dtype=torch.int8,
    )
    bm = BlockMask.from_tile_states(
        states, q_len=8, kv_len=7, block_size=BlockSize(4, 4), mask=traced
    )
    allowed = allowed_pairs(None, bm, 1, 1, 8, 7, torch.device("cpu"))
    assert allowed[0, 0, :4].all()  # tile (0, 1) is called full: keys above the diagonal attend
    assert not allowed[0, 0, 4:, :4].any()  # tile (1, 0) is called empty: causal keys do not
    causal = torch.ones(8, 7, dtype=torch.bool).tril()
    assert torch.equal(allowed[0, 0, 4:, 4:], causal[4:, 4:])
    q, k, v = _qkv(B=1, Hq=1, Hkv=1, Lq=8, Lkv=7)
    out, lse = flexfa.attention(q, k, v, block_mask=bm, return_lse=True)
    ref_out, ref_lse = reference_attention(q, k, v, block_mask=bm)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
