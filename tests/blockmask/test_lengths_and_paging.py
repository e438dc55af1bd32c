"""Block masks whose lists cover more than the call, sliced q-block rows, and paged attention.

torch's rule (Note [Block lists longer than the call] in flexfa/blockmask/interop.py): a call's
lengths equal the mask's `seq_lengths`, while the lists may cover more rows and KV blocks. Each
case is compared with torch's eager flex_attention in float64.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.experimental._paged_attention import PagedAttention
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import flexfa
from flexfa.reference import reference_attention


def _torch(q, k, v, **kw):
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # torch's "eager is slow, compile it" warning
        return flex_attention(q, k, v, return_lse=True, **kw)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("pos", [0, 70, 255])
def test_torch_decode_recipe_sliced_rows(pos):
    """Slice the row of a mask built for the whole sequence, set seq_lengths=(1, L) and a mask_mod
    shifted to the position: torch's decoding recipe."""
    L, bs = 256, 64
    tbm = create_block_mask(causal, 1, 1, L, L, device="cpu", BLOCK_SIZE=bs)
    step = tbm[:, :, pos // bs]
    step.mask_mod = lambda b, h, q_idx, kv_idx: causal(b, h, q_idx + pos, kv_idx)
    step.seq_lengths = (1, L)
    q, k, v = _randn(2, 2, 1, 16, seed=1), _randn(2, 2, L, 16, seed=2), _randn(2, 2, L, 16, seed=3)
    out_t, lse_t = _torch(q, k, v, block_mask=step)
    bm = flexfa.BlockMask.from_torch(step)
    assert bm.shape == (1, 1, 1, L)
    out, lse = flexfa.attention(q, k, v, block_mask=bm, return_lse=True, backend="tiled")
    torch.testing.assert_close(out, out_t)
    torch.testing.assert_close(lse, lse_t.to(lse.dtype))


def test_torch_mask_rows_and_columns_past_the_lengths():
    """seq_lengths set shorter than the lists: rows past Q_LEN and KV blocks past KV_LEN are
    ignored, as torch does."""
    tbm = create_block_mask(causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
    tbm.seq_lengths = (100, 150)  # the lists still describe 4 x 4 tiles
    q, k, v = _randn(1, 2, 100, 16, seed=4), _randn(1, 2, 150, 16, seed=5), _randn(1, 2, 150, 16)
    out_t, lse_t = _torch(q, k, v, block_mask=tbm)
    bm = flexfa.BlockMask.from_torch(tbm)
    assert (bm.num_q_blocks, bm.num_kv_blocks) == (2, 3)
    for backend, dtype in (("tiled", torch.float64), ("triton", torch.float32)):
        out, lse = flexfa.attention(
            q.to(dtype), k.to(dtype), v.to(dtype), block_mask=bm, return_lse=True, backend=backend
        )
        torch.testing.assert_close(out.double(), out_t, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), lse_t, atol=1e-5, rtol=1e-5)


def test_too_few_rows_is_an_error():
    tbm = create_block_mask(causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)[:, :, 1]
    with pytest.raises(ValueError, match="has 1 rows, but Q_LEN=256"):
        flexfa.BlockMask.from_torch(tbm, mask_mod=causal)


def test_flexfa_row_slices():
    """`bm[:, :, i]` is the BlockMask of the rows of q-block i, its query 0 being row i * block."""
    L, bs = 200, 64
    doc = torch.tensor([[0] * 90 + [1] * 110, [0] * 150 + [1] * 50])
    mask = flexfa.masks.and_masks(flexfa.masks.causal, flexfa.masks.document(doc))
    bm = flexfa.create_block_mask(mask, 2, None, L, L, BLOCK_SIZE=bs)
    q, k, v = _randn(2, 2, L, 16, seed=6), _randn(2, 2, L, 16, seed=7), _randn(2, 2, L, 16)
    out_full = reference_attention(q, k, v, mask_mod=mask)[0]
    for i, rows in ((0, slice(0, 64)), (3, slice(192, 200)), (-1, slice(192, 200))):
        part = bm[:, :, i]
        assert part.q_len == rows.stop - rows.start and part.kv_len == L
        out = flexfa.attention(q[:, :, rows], k, v, block_mask=part, backend="tiled")
        torch.testing.assert_close(out, out_full[:, :, rows])
    part = bm[:, :, 1:3]
    assert part.q_len == 128
    out = flexfa.attention(q[:, :, 64:192], k, v, block_mask=part, backend="tiled")
    torch.testing.assert_close(out, out_full[:, :, 64:192])
    # the same tiles as resize() with the same offset
    assert torch.equal(part.tile_states(), bm.resize(q_len=128, q_offset=64).tile_states())
    with pytest.raises(ValueError, match="step 1"):
        bm[:, :, 0:4:2]
    with pytest.raises(IndexError, match="out of range"):
        bm[:, :, 4]


def test_longer_mask_than_call_is_an_error_naming_resize():
    """torch 2.13 raises when the call is shorter than the mask; so does flexfa, saying what to do."""
    bm = flexfa.create_block_mask(flexfa.masks.causal, None, None, 256, 256)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 256, 16)
    with pytest.raises(ValueError, match=r"resize\(q_len=Lq, kv_len=L, q_offset=p\)"):
        flexfa.attention(q, k, k, block_mask=bm)
    step = bm.resize(q_len=1, kv_len=256, q_offset=255)
    out = flexfa.attention(q, k, k, block_mask=step)
    torch.testing.assert_close(out, reference_attention(q, k, k, dtype=torch.float32)[0])


# Note [Paged attention and the last page]
# torch's PagedAttention helper rewrites a logical block mask to physical pages and wraps the mods
# to map physical key positions back to logical ones. A page is `page_size` slots; when a sequence
# length is not a multiple of it, the slots of its last page past the length hold zeros (or stale
# keys), and the wrapped mods count them as valid unless `kv_len=` is passed to
# `convert_logical_block_mask` and `get_score_mod`. Those slots then attend (score 0 for zero keys):
# the output and LSE differ from the unpaged call, by 1e-3 to 1e-1 depending on the length, in torch
# and in flexfa alike. With `kv_len=` (or page-aligned lengths) paged and unpaged agree.


def _paged_case(kv_len: int, pass_kv_len: bool, backend: str, dtype: torch.dtype):
    B, Hq, Hkv, Lq, D, page = 3, 4, 2, 8, 16, 32
    pages = B * -(-kv_len // page) + 2
    q, k, v = (
        _randn(B, Hq, Lq, D, seed=8),
        _randn(B, Hkv, kv_len, D, seed=9),
        _randn(B, Hkv, kv_len, D, seed=10),
    )

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + 0.05 * (kv_idx - q_idx).abs().neg()

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx + kv_idx) % 5 != 0  # no upper bound on kv_idx

    logical = create_block_mask(mask_mod, B, 1, Lq, kv_len, device="cpu", BLOCK_SIZE=(32, page))
    paged = PagedAttention(pages, page, B, device="cpu")
    # Grow the sequences in turns, so that their pages interleave.
    for lengths in ([kv_len // 3] * B, [kv_len] * B):
        for b in range(B):
            paged.reserve(torch.tensor(b), torch.tensor(lengths[b]))
    k_cache = torch.zeros(1, Hkv, pages * page, D, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    paged.assign(torch.arange(B), torch.arange(kv_len).expand(B, kv_len), k, v, k_cache, v_cache)
    lens = torch.full((B,), kv_len) if pass_kv_len else None
    physical = paged.convert_logical_block_mask(logical, kv_len=lens)
    physical_score = paged.get_score_mod(score_mod, kv_len=lens)
    unpaged_t = _torch(q, k, v, score_mod=score_mod, block_mask=logical, enable_gqa=True)
    paged_t = _torch(
        q, k_cache, v_cache, score_mod=physical_score, block_mask=physical, enable_gqa=True
    )
    out, lse = flexfa.attention(
        q.to(dtype),
        k_cache.to(dtype),  # batch 1: K/V batch broadcast
        v_cache.to(dtype),
        physical_score,
        flexfa.BlockMask.from_torch(physical),
        enable_gqa=True,
        return_lse=True,
        backend=backend,
    )
    return (out.double(), lse.double()), unpaged_t, paged_t


@pytest.mark.parametrize("backend, dtype", [("tiled", torch.float64), ("triton", torch.float32)])
@pytest.mark.parametrize("kv_len", [96, 90])
def test_paged_equals_unpaged(backend, dtype, kv_len):
    flexfa_paged, unpaged, _ = _paged_case(kv_len, True, backend, dtype)
    tol = 1e-6 if dtype == torch.float64 else 2e-5  # the bias is float32 (int * Python float)
    for got, want in zip(flexfa_paged, unpaged):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_paged_without_kv_len_attends_the_last_page_like_torch():
    """Note [Paged attention and the last page]: the difference is torch's helper's, not flexfa's."""
    flexfa_paged, unpaged, paged_t = _paged_case(90, False, "tiled", torch.float64)
    for got, want in zip(flexfa_paged, paged_t):
        torch.testing.assert_close(got, want)
    assert float((paged_t[1] - unpaged[1]).abs().max()) > 3e-3
