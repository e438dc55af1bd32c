"""flexfa's BlockMask as FA4's block-sparse lists (Note [Block-sparse lists for FA4]): the lists
FA4 receives name exactly the BlockMask's partial and full tiles, for the forward (per q-block)
and the backward (per KV block), and the call plan uses them only where the rules allow."""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa.blockmask.block_mask import BlockList, BlockSize, TileState
from flexfa.codegen.cute import sparse
from flexfa.codegen.cute.backend import plan_call
from flexfa.frontend import trace_mask_mod


def _document_causal(length: int):
    ids = torch.repeat_interleave(torch.arange(8), 97)[:length]
    return flexfa.and_masks(flexfa.masks.causal, flexfa.masks.document(ids))


def _decode(count: torch.Tensor, index: torch.Tensor, cols: int) -> torch.Tensor:
    return BlockList(count, index).dense(cols)


def test_lists_name_the_partial_and_full_tiles():
    bm = flexfa.create_block_mask(_document_causal(700), 1, 1, 700, 700, BLOCK_SIZE=128)
    states = bm.tile_states()
    nq, nkv = bm.num_q_blocks, bm.num_kv_blocks
    fwd = sparse.forward_lists(bm)
    assert fwd.block_size == (128, 128)
    assert fwd.mask_idx.shape[-1] == nkv and fwd.mask_idx.dtype == torch.int32
    assert torch.equal(_decode(fwd.mask_cnt, fwd.mask_idx, nkv), states == TileState.PARTIAL)
    assert torch.equal(_decode(fwd.full_cnt, fwd.full_idx, nkv), states == TileState.FULL)
    bwd = sparse.backward_lists(bm)
    assert bwd.mask_idx.shape[-1] == nq
    transposed = states.transpose(-1, -2)
    assert torch.equal(_decode(bwd.mask_cnt, bwd.mask_idx, nq), transposed == TileState.PARTIAL)
    assert torch.equal(_decode(bwd.full_cnt, bwd.full_idx, nq), transposed == TileState.FULL)


def test_lists_decode_the_same_through_fa4s_own_helper():
    block_sparsity = pytest.importorskip("flash_attn.cute.block_sparsity")
    bm = flexfa.create_block_mask(_document_causal(700), 1, 1, 700, 700, BLOCK_SIZE=128)
    fwd = sparse.forward_lists(bm)
    dense = block_sparsity._ordered_to_dense_simple(fwd.mask_cnt, fwd.mask_idx, bm.num_kv_blocks)
    assert torch.equal(dense.bool(), bm.tile_states() == TileState.PARTIAL)


def test_why_not_sparse():
    bm = flexfa.create_block_mask(flexfa.masks.prefix_lm(64), 1, 1, 256, 256, BLOCK_SIZE=128)
    assert sparse.why_not_sparse(bm, 128, 128, 9) is None
    assert sparse.why_not_sparse(bm, 128, 128, 10) is None  # coarsened to 256 x 128
    assert "sm90 and sm100/sm110 only" in sparse.why_not_sparse(bm, 128, 128, 8)
    assert "head dims up to 128" in sparse.why_not_sparse(bm, 192, 128, 9)
    small = flexfa.create_block_mask(flexfa.masks.prefix_lm(64), 1, 1, 256, 256, BLOCK_SIZE=64)
    assert sparse.why_not_sparse(small, 128, 128, 9) is None  # coarsened to 128 x 128
    odd = flexfa.create_block_mask(flexfa.masks.prefix_lm(64), 1, 1, 256, 256, BLOCK_SIZE=96)
    assert "divide 128 x 128" in sparse.why_not_sparse(odd, 128, 128, 9)
    # Note [Coarsening a BlockMask]: the user's own block lists are authoritative.
    listed = flexfa.BlockMask.from_kv_blocks(
        small.kv_partial.count, small.kv_partial.index, small.kv_full.count, small.kv_full.index,
        BLOCK_SIZE=64, mask_mod=flexfa.masks.prefix_lm(64), seq_lengths=(256, 256),
    )  # fmt: skip
    assert "cannot be coarsened" in sparse.why_not_sparse(listed, 128, 128, 9)
    assert sparse.why_not_sparse(flexfa.BlockMask.from_kv_blocks(
        bm.kv_partial.count, bm.kv_partial.index, bm.kv_full.count, bm.kv_full.index,
        BLOCK_SIZE=128, mask_mod=flexfa.masks.prefix_lm(64), seq_lengths=(256, 256),
    ), 128, 128, 9) is None  # fmt: skip


@pytest.mark.parametrize("length", [1, 130, 384, 700, 1000])
@pytest.mark.parametrize("fine, coarse", [((128, 128), (256, 128)), ((64, 32), (128, 128))])
def test_coarsened_tiles_equal_the_tiles_of_the_coarse_grid(length, fine, coarse):
    """Note [Coarsening a BlockMask]: coarsening a BlockMask gives the tile states that
    classifying the mask on the coarse grid gives, and the lists FA4 receives name them."""
    ids = torch.arange(length + 33) // 97
    masks = [
        flexfa.and_masks(flexfa.masks.causal, flexfa.masks.document(ids)),
        flexfa.masks.prefix_lm(100),
        flexfa.masks.sliding_window(150),
        lambda b, h, q, kv: (q // 7 + kv // 11) % 3 != 0,
    ]
    for mask_mod in masks:
        bm = flexfa.create_block_mask(mask_mod, 1, 1, length, length + 33, BLOCK_SIZE=fine)
        got = sparse.coarsen(bm, BlockSize(*coarse))
        want = flexfa.create_block_mask(mask_mod, 1, 1, length, length + 33, BLOCK_SIZE=coarse)
        assert got.block_size == BlockSize(*coarse)
        assert torch.equal(got.tile_states(), want.tile_states()), (mask_mod, length)
        for got_list, want_list in ((got.q_partial, want.q_partial), (got.q_full, want.q_full)):
            n = want.num_q_blocks
            assert torch.equal(got_list.dense(n), want_list.dense(n))


def test_sm100_lists_have_256_row_q_blocks_and_are_kept_with_the_mask():
    bm = flexfa.create_block_mask(_document_causal(700), 1, 1, 700, 700, BLOCK_SIZE=128)
    fwd = sparse.forward_lists(bm, 10)
    assert fwd.block_size == (256, 128) and fwd.mask_cnt.shape[-1] == 3  # ceil(700 / 256)
    states = sparse.coarsen(bm, BlockSize(256, 128)).tile_states()
    assert torch.equal(_decode(fwd.mask_cnt, fwd.mask_idx, 6), states == TileState.PARTIAL)
    bwd = sparse.backward_lists(bm, 10)
    assert bwd.block_size == (256, 128) and bwd.mask_idx.shape[-1] == 3
    # Built once per BlockMask and arch: a repeated call launches no copies of its own.
    assert sparse.forward_lists(bm, 10) is fwd and sparse.backward_lists(bm, 10) is bwd
    assert sparse.forward_lists(bm, 9) is sparse.forward_lists(bm) is not fwd


def _plan(score, mask_mod, monkeypatch, **kw):
    from flexfa.codegen.cute import backend, launch

    monkeypatch.setattr(backend, "hooks_for", lambda s, m, g: launch.Hooks(None, None, None, None))
    bm = flexfa.create_block_mask(mask_mod, 1, 1, 512, 512, BLOCK_SIZE=128)
    return plan_call(
        score,
        trace_mask_mod(mask_mod),
        len_q=512,
        len_kv=512,
        needs_grad=True,
        scale=1.0,
        block_mask=bm,
        **kw,
    )


def test_plan_uses_lists_where_the_rules_allow(monkeypatch):
    from flexfa.frontend import trace_score_mod

    def prefix(b, h, q_idx, kv_idx):  # a prefix and a sliding window: no native split
        return (kv_idx < 100) | ((kv_idx <= q_idx) & (q_idx - kv_idx < 64))

    call = _plan(None, prefix, monkeypatch)
    assert call.lowering.kind == "mask_mod"
    assert call.fwd_sparse is not None and call.bwd_sparse is not None
    # With a score_mod too (Note [Backward with a score_mod]).
    softcap = trace_score_mod(flexfa.mods.softcap(20.0))
    call = _plan(softcap, prefix, monkeypatch)
    assert call.fwd_sparse is not None and call.bwd_sparse is not None
    # deterministic=True: FA4's deterministic block-sparse backward needs write orders we do not
    # build, so the backward walks every tile.
    assert _plan(None, prefix, monkeypatch, deterministic=True).bwd_sparse is None
    # Native masks need no lists, nor do masks split into native ones (Note [Prefix masks as
    # two native calls]), unless the split is declined.
    call = _plan(None, flexfa.masks.causal, monkeypatch)
    assert call.lowering.native and call.fwd_sparse is None and call.bwd_sparse is None
    call = _plan(None, flexfa.masks.prefix_lm(100), monkeypatch)
    assert call.lowering.kind == "rows" and call.fwd_sparse is None and call.bwd_sparse is None
    call = _plan(None, flexfa.masks.prefix_lm(100), monkeypatch, split=False)
    assert call.lowering.kind == "mask_mod" and call.fwd_sparse is not None


def test_lists_have_row_major_strides_with_one_block():
    # Note [Aux tensor layouts]: one KV block (len_kv 2) and one q-block (len_q 100) gave lists
    # of size-1 dims with other strides, which FA4's stride check rejected after broadcasting.
    for len_q, len_kv in ((175, 2), (100, 300), (100, 2)):
        bm = flexfa.create_block_mask(
            lambda b, h, q, kv: (q + kv) % 2 == 0, 2, 2, len_q, len_kv, BLOCK_SIZE=128
        )
        for lists in (sparse.forward_lists(bm), sparse.backward_lists(bm)):
            for t in (lists.mask_cnt, lists.mask_idx, lists.full_cnt, lists.full_idx):
                row_major = torch.empty(t.shape).stride()
                assert t.stride() == row_major, (len_q, len_kv, t.shape, t.stride())
