"""Lazy binding of `block_mask=` to a BlockMask, and its cache (Note [Block mask cache])."""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa import masks as fm
from flexfa.blockmask import bind, build
from flexfa.blockmask.block_mask import BlockSize
from flexfa.reference import reference_attention
from tests.blockmask import oracle

_CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_cache():
    bind.clear_cache()
    yield
    bind.clear_cache()


def _resolve(mask, B=2, H=4, Lq=300, Lkv=300):
    return bind.resolve_block_mask(mask, B, H, Lq, Lkv, _CPU)


def test_same_mask_is_built_once() -> None:
    a = _resolve(fm.sliding_window(64))
    b = _resolve(fm.sliding_window(64))  # a new closure with the same code and constants
    assert a is b
    assert _resolve(fm.causal) is _resolve(fm.causal)
    assert _resolve(fm.sliding_window(65)) is not a  # another constant: another IR


def test_shapes_and_used_dims_are_part_of_the_key() -> None:
    a = _resolve(fm.causal, B=2, H=4)
    # causal reads neither b nor h: other B and H share the entry.
    assert _resolve(fm.causal, B=3, H=8) is a
    assert _resolve(fm.causal, Lq=301) is not a
    heads = torch.arange(4)

    def per_head(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < heads[h] * 50

    assert _resolve(per_head, H=4) is not _resolve(per_head, H=2)


def test_in_place_change_of_captured_doc_ids_rebuilds() -> None:
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([100, 100, 100]))
    mask = fm.document(doc)
    first = _resolve(mask)
    assert _resolve(mask) is first
    doc[150:] = 7  # bumps doc._version
    second = _resolve(mask)
    assert second is not first
    want = oracle.expected_states(mask, 1, 1, 300, 300, second.block_size)
    assert torch.equal(oracle.states_of(second, 1, 1), want)
    assert _resolve(mask) is second


def test_a_new_tensor_with_equal_values_rebuilds() -> None:
    doc = torch.zeros(300, dtype=torch.int32)
    first = _resolve(fm.document(doc))
    assert _resolve(fm.document(doc.clone())) is not first


def test_attention_sees_in_place_changes() -> None:
    doc = torch.repeat_interleave(torch.arange(2), torch.tensor([40, 60]))
    mask = fm.and_masks(fm.causal, fm.document(doc))
    q, k, v = (torch.randn(1, 2, 100, 16, dtype=torch.float64) for _ in range(3))
    before = flexfa.attention(q, k, v, block_mask=mask)
    doc[20:40] = 1
    after = flexfa.attention(q, k, v, block_mask=mask)
    ref, _ = reference_attention(q, k, v, mask_mod=mask)
    torch.testing.assert_close(after, ref)
    assert not torch.allclose(before, after)


def test_given_block_mask_is_checked() -> None:
    bm = flexfa.create_block_mask(fm.causal, None, None, 128, 128)
    assert _resolve(bm, Lq=128, Lkv=128) is bm
    with pytest.raises(ValueError, match="built for lengths"):
        _resolve(bm, Lq=64, Lkv=128)
    with pytest.raises(TypeError, match="block_mask must be"):
        _resolve(42)


def test_size_one_block_mask_of_a_mask_reading_b_does_not_broadcast() -> None:
    docs = torch.zeros(2, 128, dtype=torch.int32)
    bm = flexfa.create_block_mask(fm.document(docs), 1, None, 128, 128)
    assert _resolve(bm, B=1, Lq=128, Lkv=128) is bm
    with pytest.raises(ValueError, match="built for B=1, but its mask_mod 'document' reads 'b'"):
        _resolve(bm, B=2, Lq=128, Lkv=128)
    causal = flexfa.create_block_mask(fm.causal, 1, 1, 128, 128)
    assert _resolve(causal, B=2, H=4, Lq=128, Lkv=128) is causal


def test_cache_is_bounded() -> None:
    for w in range(bind._CACHE_SIZE + 10):
        _resolve(fm.sliding_window(w + 1), Lq=16, Lkv=16)
    assert len(bind._cache) == bind._CACHE_SIZE


def _lists(bm):
    return [(bl.count, bl.index) for bl in (bm.kv_partial, bm.kv_full, bm.q_partial, bm.q_full)]


def _doc_mask(H):
    # Documents whose bounds differ per head, so the mask reads h and a captured tensor.
    doc = (torch.arange(64).view(1, -1) // torch.arange(5, 5 + H).view(-1, 1)).to(torch.int32)

    def per_head_docs(b, h, q_idx, kv_idx):
        return (doc[h, q_idx] == doc[h, kv_idx]) & (q_idx >= kv_idx - 3)

    return per_head_docs


@pytest.mark.parametrize("exact_column", [True, False])
@pytest.mark.parametrize("Lq", [1, 5, 16, 37])
def test_growing_key_lengths_give_the_lists_of_a_build(monkeypatch, exact_column, Lq) -> None:
    """Note [Block masks for growing key lengths]: at every new length, bit for bit the block
    lists that a build for that length gives, from the new keys' pairs or the last column
    (classified exactly or by the analysis), and across block boundaries."""
    if not exact_column:
        monkeypatch.setattr(build, "_EXACT_COLUMN_PAIRS", 0)
    H, size = 3, BlockSize(8, 8)
    for mask in (None, fm.causal, fm.sliding_window(6), fm.prefix_lm(10), _doc_mask(H)):
        traced = flexfa.trace_mask_mod(mask if mask is not None else bind.allow_all)
        # Growing (new keys' pairs evaluated), then shrinking (the last column classified).
        for Lkv in [*range(14, 34), *range(33, 13, -1)]:
            if Lkv == 33:
                bind._cache.clear()  # keeps the BlockMasks kept per number of kv blocks
            got = bind.cached_block_mask(traced, 2, H, Lq, Lkv, _CPU, size)
            want = flexfa.create_block_mask(traced, 2, H, Lq, Lkv, device=_CPU, BLOCK_SIZE=8)
            assert (got.q_len, got.kv_len, got.block_size) == (Lq, Lkv, size)
            for (gc, gi), (wc, wi) in zip(_lists(got), _lists(want)):
                assert torch.equal(gc, wc), (traced.name, Lq, Lkv)
                assert torch.equal(gi, wi), (traced.name, Lq, Lkv)


def test_a_new_length_with_the_same_tiles_shares_the_lists() -> None:
    traced = flexfa.trace_mask_mod(fm.causal)
    a = bind.cached_block_mask(traced, 1, 1, 16, 300, _CPU)
    b = bind.cached_block_mask(traced, 1, 1, 16, 301, _CPU)  # the same 3 kv blocks
    assert b.kv_len == 301 and b.kv_partial.index is a.kv_partial.index
    c = bind.cached_block_mask(traced, 1, 1, 16, 385, _CPU)  # a fourth kv block: built
    assert c.num_kv_blocks == 4 and c.kv_partial.index is not a.kv_partial.index
