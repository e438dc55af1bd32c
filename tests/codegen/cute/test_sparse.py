"""flexfa's BlockMask as FA4's block-sparse lists (Note [Block-sparse lists for FA4]): the lists
FA4 receives name exactly the BlockMask's partial and full tiles, for the forward (per q-block)
and the backward (per KV block), and the call plan uses them only where the rules allow."""

from __future__ import annotations

import torch

import flexfa
from flexfa.blockmask.block_mask import BlockList, TileState
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
    import pytest

    block_sparsity = pytest.importorskip("flash_attn.cute.block_sparsity")
    bm = flexfa.create_block_mask(_document_causal(700), 1, 1, 700, 700, BLOCK_SIZE=128)
    fwd = sparse.forward_lists(bm)
    dense = block_sparsity._ordered_to_dense_simple(fwd.mask_cnt, fwd.mask_idx, bm.num_kv_blocks)
    assert torch.equal(dense.bool(), bm.tile_states() == TileState.PARTIAL)


def test_why_not_sparse():
    bm = flexfa.create_block_mask(flexfa.masks.prefix_lm(64), 1, 1, 256, 256, BLOCK_SIZE=128)
    assert sparse.why_not_sparse(bm, 128, 128, 9) is None
    assert "sm90 only" in sparse.why_not_sparse(bm, 128, 128, 10)
    assert "head dims up to 128" in sparse.why_not_sparse(bm, 192, 128, 9)
    other = flexfa.create_block_mask(flexfa.masks.prefix_lm(64), 1, 1, 256, 256, BLOCK_SIZE=64)
    assert "128 x 128" in sparse.why_not_sparse(other, 128, 128, 9)


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

    prefix = flexfa.masks.prefix_lm(100)
    call = _plan(None, prefix, monkeypatch)
    assert call.fwd_sparse is not None and call.bwd_sparse is not None
    # With a score_mod too (Note [Backward with a score_mod]).
    softcap = trace_score_mod(flexfa.mods.softcap(20.0))
    call = _plan(softcap, prefix, monkeypatch)
    assert call.fwd_sparse is not None and call.bwd_sparse is not None
    # deterministic=True: FA4's deterministic block-sparse backward needs write orders we do not
    # build, so the backward walks every tile.
    assert _plan(None, prefix, monkeypatch, deterministic=True).bwd_sparse is None
    # Native masks need no lists.
    call = _plan(None, flexfa.masks.causal, monkeypatch)
    assert call.lowering.native and call.fwd_sparse is None and call.bwd_sparse is None


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
