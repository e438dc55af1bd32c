"""Note [Repeated inference calls]: repeated calls with gradients disabled reuse their spec and
backend, and still see everything that can change between calls."""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa import api
from flexfa.reference import reference_attention


@pytest.fixture
def spec_builds(monkeypatch):
    """How many calls built their spec (the full path) rather than finding it."""
    api._memo.clear()
    calls = []
    real = api.build_spec

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "build_spec", counting)
    yield calls
    api._memo.clear()


def _close(out, q, k, v, score_mod=None, mask_mod=None):
    ref, _ = reference_attention(q.double(), k.double(), v.double(), score_mod, mask_mod)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_a_repeated_call_skips_the_spec_and_sees_new_values(spec_builds):
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    with torch.no_grad():
        for _ in range(3):
            q.normal_()  # new values in the same tensors: the same call, other results
            _close(flexfa.attention(q, k, v, block_mask=None), q, k, v)
    assert len(spec_builds) == 1


def test_what_changes_the_call_builds_it_again(spec_builds):
    table = torch.randn(2)
    scale = 0.5

    def bias(score, b, h, q_idx, kv_idx):
        return score + scale * table[h]

    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    with torch.no_grad():
        flexfa.attention(q, k, v, score_mod=bias)
        table = torch.randn(2)  # a new captured tensor (closure cell rebound)
        _close(flexfa.attention(q, k, v, score_mod=bias), q, k, v, bias)
        scale = 2.0  # a changed float
        _close(flexfa.attention(q, k, v, score_mod=bias), q, k, v, bias)
        qt = q.transpose(2, 3).contiguous().transpose(2, 3)  # other strides
        _close(flexfa.attention(qt, k, v, score_mod=bias), qt, k, v, bias)
        flexfa.attention(q, k, v, score_mod=bias, scale=0.3)  # another scale
        bm = flexfa.create_block_mask(flexfa.masks.causal, 1, 2, 5, 5)
        out = flexfa.attention(q, k, v, score_mod=bias, block_mask=bm)
        _close(out, q, k, v, bias, flexfa.masks.causal)
        flexfa.attention(q, k, v, score_mod=bias, block_mask=bm)  # found
    assert len(spec_builds) == 6


def test_calls_with_gradients_or_mask_mods_take_the_full_path(spec_builds):
    q, k, v = (torch.randn(1, 2, 5, 16, requires_grad=True) for _ in range(3))
    for _ in range(2):
        flexfa.attention(q, k, v).sum().backward()
    with torch.no_grad():
        for _ in range(2):
            flexfa.attention(q, k, v, block_mask=flexfa.masks.causal)
    assert len(spec_builds) == 4 and not api._memo


def test_bad_arguments_still_raise_after_a_good_call(spec_builds):
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    with torch.no_grad():
        flexfa.attention(q, k, v)
        with pytest.raises(ValueError, match="enable_gqa"):
            flexfa.attention(q, k[:, :1], v[:, :1])
        with pytest.raises(TypeError, match="scale"):
            flexfa.attention(q, k, v, scale="big")
        with pytest.raises(ValueError, match="4 dims"):
            flexfa.attention(q[0], k, v)


def test_the_memo_keeps_only_the_last_calls(spec_builds):
    """Per-step BlockMasks (a decoding loop's slices) are not kept alive past the memo's size."""
    import gc
    import weakref

    q, k, v = (torch.randn(1, 2, 1, 16) for _ in range(3))
    refs = []
    with torch.no_grad():
        for _ in range(api._MEMO_SIZE + 4):
            bm = flexfa.create_block_mask(flexfa.masks.noop_mask, 1, 2, 1, 1)
            flexfa.attention(q, k, v, block_mask=bm)
            refs.append(weakref.ref(bm))
    del bm
    gc.collect()
    assert len(api._memo) == api._MEMO_SIZE
    assert all(r() is None for r in refs[:4]), "the oldest BlockMasks are released"


def _paged_reference(q, pages_k, pages_v, table, lens):
    """Attention of q over each sequence's keys, gathered from the pools (float64)."""
    page = pages_k.shape[2]
    outs = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        ids = table[b, : -(-n // page)].long()
        k = pages_k[ids].permute(1, 0, 2, 3).reshape(pages_k.shape[1], -1, pages_k.shape[3])[:, :n]
        v = pages_v[ids].permute(1, 0, 2, 3).reshape(pages_v.shape[1], -1, pages_v.shape[3])[:, :n]
        ref, _ = reference_attention(q[b : b + 1].double(), k[None].double(), v[None].double())
        outs.append(ref)
    return torch.cat(outs)


def test_repeated_paged_calls_keep_their_spec_and_see_their_tables_change(spec_builds):
    """A serving loop's paged calls (the same page table and lengths, updated in place) find
    their spec; each call reads the tables' current values, and a table made invalid in place
    still raises (Note [Checking page tables])."""
    g = torch.Generator().manual_seed(0)
    pages_k, pages_v = (torch.randn(12, 2, 4, 16, generator=g) for _ in range(2))
    table = torch.randperm(12, generator=g).to(torch.int32).view(2, 6)
    lens = torch.tensor([9, 14], dtype=torch.int32)
    q = torch.randn(2, 2, 1, 16, generator=g)
    with torch.no_grad():
        for _ in range(3):
            out = flexfa.attention(q, pages_k, pages_v, page_table=table, kv_lens=lens)
            ref = _paged_reference(q, pages_k, pages_v, table, lens)
            torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
            lens += 1  # the next step's keys, in place
            table[0] = table[0].flip(0)  # pages remapped in place
        assert len(spec_builds) == 1
        table[1, 0] = 99  # not a page of the pools
        with pytest.raises(ValueError, match=r"page_table\[1, 0\] = 99"):
            flexfa.attention(q, pages_k, pages_v, page_table=table, kv_lens=lens)
        other = table.clone()
        other[1, 0] = 0
        flexfa.attention(q, pages_k, pages_v, page_table=other, kv_lens=lens)  # other tables
    assert len(spec_builds) == 2
