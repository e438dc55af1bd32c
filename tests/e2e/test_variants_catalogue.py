"""examples/variants.py: each variant gives what torch's eager flex_attention gives (float64), on
the tiled backend, and on the Triton backend (float32) for the masks."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import flexfa
from flexfa.reference import reference_attention

_PATH = Path(__file__).resolve().parents[2] / "examples" / "variants.py"
_spec = importlib.util.spec_from_file_location("flexfa_example_variants", _PATH)
variants = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = variants  # torch's tracing of the mods looks the module up by name
_spec.loader.exec_module(variants)

SIDE = 8
L = SIDE * SIDE


def _torch(q, k, v, **kw):
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, **kw)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, L, 16, generator=g, dtype=torch.float64) for _ in range(3)]


def _masks():
    g = torch.Generator().manual_seed(1)
    topk = torch.stack([torch.randperm(L // 16, generator=g)[:2] for _ in range(L // 16)])
    return {
        "natten": variants.natten(SIDE, SIDE, 3),
        "morton_natten": variants.morton_natten(SIDE, 3),
        "video_topk": variants.video_topk(topk, 16),
    }


@pytest.mark.parametrize("name", ["natten", "morton_natten", "video_topk"])
def test_mask_variants_match_torch(name):
    mask_mod = _masks()[name]
    q, k, v = _inputs()
    tbm = create_block_mask(mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=16)
    want = _torch(q, k, v, block_mask=tbm)
    bm = flexfa.create_block_mask(mask_mod, None, None, L, L, BLOCK_SIZE=16)
    if name != "morton_natten":  # at 8 x 8 every Morton quadrant touches the others
        assert bm.sparsity() > 0  # tiles are skipped
    torch.testing.assert_close(flexfa.attention(q, k, v, block_mask=bm, backend="tiled"), want)
    out32 = flexfa.attention(q.float(), k.float(), v.float(), block_mask=bm, backend="triton")
    torch.testing.assert_close(out32.double(), want, atol=1e-5, rtol=1e-5)


def test_morton_decode_inverts_the_interleaving():
    i = torch.arange(256)
    y, x = variants._morton_decode(i)
    z = torch.zeros_like(i)
    for bit in range(4):
        z |= ((x >> bit) & 1) << (2 * bit) | ((y >> bit) & 1) << (2 * bit + 1)
    assert torch.equal(z, i)


def test_mla_rope_matches_torch_with_gradients():
    q, k, v = _inputs(2)
    g = torch.Generator().manual_seed(3)
    q_rope = torch.randn(2, 2, L, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k_rope = torch.randn(2, L, 8, generator=g, dtype=torch.float64, requires_grad=True)
    score_mod = variants.mla_rope(q_rope, k_rope, 0.25)
    want = _torch(q, k, v, score_mod=variants.mla_rope(q_rope.detach(), k_rope.detach(), 0.25))
    out = flexfa.attention(q, k, v, score_mod=score_mod, backend="tiled")
    torch.testing.assert_close(out, want)
    grads = torch.autograd.grad(out.sum(), (q_rope, k_rope))
    ref, _ = reference_attention(q, k, v, score_mod)
    grads_r = torch.autograd.grad(ref.sum(), (q_rope, k_rope))
    for a, b in zip(grads, grads_r):
        torch.testing.assert_close(a, b)


def test_softcap_fast_tanh_custom_op():
    q, k, v = (t * 4 for t in _inputs(4))
    want = _torch(q, k, v, score_mod=lambda s, b, h, i, j: 20.0 * variants.fast_tanh_math(s / 20))
    out = flexfa.attention(q, k, v, score_mod=variants.softcap_fast_tanh(20.0), backend="tiled")
    torch.testing.assert_close(out, want)
