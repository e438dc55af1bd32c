"""K/V batch broadcast: k and v of batch 1 against q of batch B (Note [K/V batch broadcast]).

Each case runs the three-way check (tests/tolerance.py) against flexfa.reference in float64, with
gradients: dK/dV must be the sums over the query batch. torch's eager flex_attention (float64) is
compared where torch has the feature (a block mask of batch B).
"""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa.reference import reference_attention
from tests.e2e.harness import Problem, check_attention, make_inputs, maker
from tests.mods import MASK_MODS_BY_NAME, SCORE_MODS_BY_NAME, Shape

BACKENDS = ["tiled", "triton"]


def _mask(name: str, p: Problem):
    return MASK_MODS_BY_NAME[name].build(Shape(p.batch, p.heads_q, p.len_q, p.len_kv)).fn


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "heads_q, heads_kv, mask, score, block_batch",
    [
        (2, 2, None, None, None),  # no mask at all
        (4, 2, "causal", "batch_head_bias", "B"),  # GQA, captured grads indexed by b
        (2, 1, "document_per_batch", None, "B"),  # a mask that reads b: block mask of batch B
        (2, 2, "sliding_window", "relative_bias_per_head", "1"),  # block mask of batch 1
    ],
)
def test_kv_broadcast_matches_reference(backend, heads_q, heads_kv, mask, score, block_batch):
    dtype = torch.float64 if backend == "tiled" else torch.float32
    p = Problem(
        batch=3, batch_kv=1, heads_q=heads_q, heads_kv=heads_kv, len_q=21, len_kv=29, dtype=dtype
    )
    mask_mod = _mask(mask, p) if mask else None
    score_mod = maker(SCORE_MODS_BY_NAME[score], p.shape) if score else None
    check_attention(
        p,
        score_mod=score_mod,
        mask_mod=mask_mod,
        block_size=16 if block_batch == "B" else None,  # BlockMask of batch B, else the mask_mod
        backend=backend,
        context=f"{backend} {p} mask={mask} score={score} block_batch={block_batch}",
    )
    if block_batch == "1":
        # A BlockMask of batch 1 (the mask does not read b) broadcasts over both.
        data = make_inputs(p, 0)
        bm = flexfa.create_block_mask(mask_mod, 1, None, p.len_q, p.len_kv, BLOCK_SIZE=16)
        out = flexfa.attention(data["q"], data["k"], data["v"], block_mask=bm, backend=backend)
        ref, _ = reference_attention(
            data["q"], data["k"], data["v"], mask_mod=mask_mod, dtype=torch.float64
        )
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_broadcast_equals_expanded_kv(backend):
    """Broadcasting gives what expanding K/V by hand gives; dK/dV are the batch sums."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 17, 16, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 20, 16, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 20, 16, generator=g, requires_grad=True)
    kw = dict(block_mask=flexfa.masks.causal, enable_gqa=True, backend=backend, return_lse=True)
    d_out, d_lse = torch.randn(2, 4, 17, 16, generator=g), torch.randn(2, 4, 17, generator=g)
    out, lse = flexfa.attention(q, k, v, **kw)
    grads = torch.autograd.grad((out, lse), (q, k, v), (d_out, d_lse))
    out_x, lse_x = flexfa.attention(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), **kw)
    grads_x = torch.autograd.grad((out_x, lse_x), (q, k, v), (d_out, d_lse))
    torch.testing.assert_close(out, out_x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_x, atol=1e-5, rtol=1e-5)
    for got, want, t in zip(grads, grads_x, (q, k, v)):
        assert got.shape == t.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_kv_broadcast_matches_torch_eager():
    """torch's eager flex_attention (float64) with a block mask of batch B, forward and backward."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, L = 3, 4, 2, 64
    q = torch.randn(B, Hq, L, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, Hkv, L, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, Hkv, L, 16, generator=g, dtype=torch.float64, requires_grad=True)
    doc = torch.randint(0, 3, (B, L), generator=g).sort(-1).values

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    def score_mod(s, b, h, q_idx, kv_idx):
        return s + 0.1 * b - 0.05 * h

    tbm = create_block_mask(mask_mod, B, 1, L, L, device="cpu", BLOCK_SIZE=32)
    with torch.no_grad():  # torch has no FlexAttention backward on the CPU
        out_t, lse_t = flex_attention(
            q.detach(),
            k.detach(),
            v.detach(),
            score_mod=score_mod,
            block_mask=tbm,
            enable_gqa=True,
            return_lse=True,
        )
    bm = flexfa.BlockMask.from_torch(tbm)
    out, lse = flexfa.attention(
        q, k, v, score_mod, bm, enable_gqa=True, return_lse=True, backend="tiled"
    )
    torch.testing.assert_close(out, out_t)
    torch.testing.assert_close(lse, lse_t.to(lse.dtype))
    # Gradients against the reference on K/V expanded by hand (torch's autograd sums them).
    ke, ve = k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)
    out_r, lse_r = reference_attention(q, ke, ve, score_mod, mask_mod, enable_gqa=True)
    cot = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out, lse), (q, k, v), (cot, torch.ones_like(lse)))
    grads_r = torch.autograd.grad((out_r, lse_r), (q, k, v), (cot, torch.ones_like(lse)))
    for a, b in zip(grads, grads_r):
        torch.testing.assert_close(a, b)


def test_kv_batch_must_be_one_or_q_batch():
    q = torch.randn(4, 1, 8, 8)
    k = v = torch.randn(2, 1, 8, 8)
    with pytest.raises(ValueError, match="equal to q's or 1"):
        flexfa.attention(q, k, v)
