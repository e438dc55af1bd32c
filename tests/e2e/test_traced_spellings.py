"""The mods people write with torch spellings: activations, integer bit tricks, small reductions.

Each runs end to end on the tiled backend (float64, with gradients, three-way against the float64
reference) and on the Triton backend (float32, under the interpreter on CPU), and where torch's eager
flex_attention has the feature, against it in float64.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

import flexfa
from flexfa.reference import reference_attention
from tests.e2e.harness import Problem, check_attention
from tests.mods import BuiltMod

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "softplus": lambda x: F.softplus(x, beta=2.0, threshold=3.0),
    "mish": F.mish,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.1),
    "elu": F.elu,
    "logsigmoid": F.logsigmoid,
    "hardswish": F.hardswish,
}


def _torch_eager(q, k, v, **kw):
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, **kw)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_score_mods(name):
    act = ACTIVATIONS[name]

    def make(dtype):
        # A learnable per-head scale inside the activation: gradients flow through it.
        scale = torch.linspace(0.5, 1.5, 2, dtype=dtype).requires_grad_(True)

        def score_mod(score, b, h, q_idx, kv_idx):
            return 2.0 * act(score * scale[h]) - 1.0

        return BuiltMod(score_mod, (scale,))

    p = Problem(heads_q=2, heads_kv=2, len_q=13, len_kv=21, dtype=torch.float64)
    check_attention(p, score_mod=make, backend="tiled")
    p32 = Problem(heads_q=2, heads_kv=2, len_q=13, len_kv=21, dtype=torch.float32)
    check_attention(p32, score_mod=make, backend="triton", grad=name in ("gelu", "silu"))
    # torch eager, float64, forward
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    mod = make(torch.float64).fn
    out = flexfa.attention(q, k, v, score_mod=mod, backend="tiled")
    torch.testing.assert_close(out, _torch_eager(q, k, v, score_mod=mod))


def morton_neighbourhood(b, h, q_idx, kv_idx):
    """A Z-order (Morton) neighbourhood on an 8 x 8 grid: de-interleave the bits of each index and
    keep keys within distance 1 in both coordinates."""

    def coords(i):
        x = (i & 1) | ((i >> 1) & 2) | ((i >> 2) & 4)
        y = ((i >> 1) & 1) | ((i >> 2) & 2) | ((i >> 3) & 4)
        return x, y

    qx, qy = coords(q_idx)
    kx, ky = coords(kv_idx)
    return ((qx - kx).abs() <= 1) & ((qy - ky).abs() <= 1) & (((q_idx ^ kv_idx) << 1) >= 0)


def negative_operands(b, h, q_idx, kv_idx):
    d = q_idx - kv_idx  # negative above the diagonal
    return ((d % 5) == (-d) % 3) | ((d // 4) == -(kv_idx // 7)) | ((d >> 2) == -1)


@pytest.mark.parametrize("mask", [morton_neighbourhood, negative_operands])
@pytest.mark.parametrize("backend", ["tiled", "triton"])
def test_integer_bit_masks(mask, backend):
    dtype = torch.float64 if backend == "tiled" else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g, dtype=torch.float64) for _ in range(3))
    bm = flexfa.create_block_mask(mask, None, None, 64, 64, BLOCK_SIZE=16)
    out = flexfa.attention(q.to(dtype), k.to(dtype), v.to(dtype), block_mask=bm, backend=backend)
    ref, _ = reference_attention(q, k, v, mask_mod=mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    if backend == "tiled":
        from torch.nn.attention.flex_attention import create_block_mask

        tbm = create_block_mask(mask, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
        torch.testing.assert_close(out, _torch_eager(q, k, v, block_mask=tbm))


L, D = 40, 6


def _reduction_mods(dtype):
    g = torch.Generator().manual_seed(1)
    means = torch.randn(L, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    a = torch.randn(L, 4, generator=g, dtype=torch.float64).to(dtype)
    c = torch.randn(L, 4, generator=g, dtype=torch.float64).to(dtype)

    def distance(score, b, h, q_idx, kv_idx):
        return score - 0.5 * (means[q_idx] - means[kv_idx]).pow(2).sum(-1)

    def dot_max(score, b, h, q_idx, kv_idx):
        return score + 0.5 * torch.dot(a[q_idx], c[kv_idx]) - c[kv_idx].max(-1).values

    return {"distance": BuiltMod(distance, (means,)), "dot_max": BuiltMod(dot_max)}


@pytest.mark.parametrize("name", ["distance", "dot_max"])
@pytest.mark.parametrize("backend", ["tiled", "triton"])
def test_reductions_over_captured_trailing_dims(name, backend):
    dtype = torch.float64 if backend == "tiled" else torch.float32
    p = Problem(heads_q=2, heads_kv=2, len_q=L, len_kv=L, dtype=dtype)
    check_attention(
        p, score_mod=lambda dt: _reduction_mods(dt)[name], backend=backend, mask_mod=None
    )


def test_topk_block_list_mask():
    """Video-style sparse top-k: each q-block attends to the KV blocks its row of `topk` lists."""
    g = torch.Generator().manual_seed(2)
    topk = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(4)])

    def mask_mod(b, h, q_idx, kv_idx):
        return (topk[q_idx // 16].unsqueeze(0) == kv_idx // 16).any(-1)

    q, k, v = (torch.randn(1, 2, 64, 16, generator=g, dtype=torch.float64) for _ in range(3))
    bm = flexfa.create_block_mask(mask_mod, None, None, 64, 64, BLOCK_SIZE=16)
    # every tile is decided exactly: listed blocks full, others empty
    assert int((bm.tile_states() == 1).sum()) == 0
    for backend, dtype in (("tiled", torch.float64), ("triton", torch.float32)):
        out = flexfa.attention(
            q.to(dtype), k.to(dtype), v.to(dtype), block_mask=bm, backend=backend
        )
        ref, _ = reference_attention(q, k, v, mask_mod=mask_mod)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def _shape_spelling_mods():
    """Mods written with shape operations on traced values (Note [Shape operations on traced
    values]), as model code spells broadcasts and trailing reductions."""
    g = torch.Generator().manual_seed(3)
    # (B, H, q-blocks, k) top-k KV blocks per q-block, as the video-sparse masks keep them
    topk = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(2 * 2 * 4)]).view(
        2, 2, 4, 2
    )
    means = torch.randn(64, 3, generator=g, dtype=torch.float64)

    def video_topk(b, h, q_idx, kv_idx):
        kv_block = kv_idx // 16
        return (topk[b, h, q_idx // 16] == kv_block.unsqueeze(-1)).any(-1) | (
            (q_idx >= kv_idx).unsqueeze(-1).any(-1) & (kv_block == q_idx // 16)[None].all()
        )

    def broadcast_bias(score, b, h, q_idx, kv_idx):
        d = means[q_idx][:, None] - means[kv_idx, :].reshape(1, 3)  # (3, 3)
        s = score[..., None].unsqueeze(0).view(1, 1)  # (1, 1)
        return (s + 0.1 * d.pow(2)).sum(-1).amin(-1) + means[kv_idx][1:].sum() * 0.5

    return video_topk, broadcast_bias


@pytest.mark.parametrize("backend", ["tiled", pytest.param("triton", marks=pytest.mark.slow)])
def test_shape_operations_on_traced_values_match_the_reference(backend):
    mask, score_mod = _shape_spelling_mods()
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 64, 8, generator=g, dtype=torch.float64) for _ in range(3))
    bm = flexfa.create_block_mask(mask, 2, 2, 64, 64, BLOCK_SIZE=16)
    dtype = torch.float64 if backend == "tiled" else torch.float32
    out = flexfa.attention(
        *(t.to(dtype) for t in (q, k, v)), score_mod=score_mod, block_mask=bm, backend=backend
    )
    ref, _ = reference_attention(q, k, v, score_mod, mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    if backend == "tiled":
        return
    from torch.nn.attention.flex_attention import create_block_mask

    # torch's eager flex_attention takes the mask (its score_mod's gather by kv_idx it cannot);
    # checked beside the slow Triton run, as torch's block mask takes seconds to build.
    tbm = create_block_mask(mask, 2, 2, 64, 64, device="cpu", BLOCK_SIZE=16)
    out = flexfa.attention(q, k, v, block_mask=bm, backend="tiled")
    torch.testing.assert_close(out, _torch_eager(q, k, v, block_mask=tbm))


def test_unroll_limit_is_named():
    big = torch.randn(8, 65)
    with pytest.raises(flexfa.ModTraceError, match=r"at most 64 elements .*UNROLL_LIMIT"):
        flexfa.attention(
            *(torch.randn(1, 1, 8, 8) for _ in range(3)),
            score_mod=lambda s, b, h, q, kv: s + big[q].sum(-1),
        )
