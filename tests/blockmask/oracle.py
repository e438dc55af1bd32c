"""The dense oracle for block masks: evaluate a mask_mod on every pair, then reduce per tile.

It calls the user's function on broadcast index tensors (`flexfa.reference.allowed_pairs`), never
flexfa's tracer or IR, so it also checks those. Small sizes only: it builds B x H x Q x KV.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flexfa.blockmask.block_mask import BlockMask, BlockSize, TileState
from flexfa.reference import allowed_pairs

_CPU = torch.device("cpu")


def dense_allowed(fn: Callable[..., object], B: int, H: int, Q: int, KV: int) -> torch.Tensor:
    """bool [B, H, Q, KV]: where `fn` allows the pair."""
    return allowed_pairs(fn, None, B, H, Q, KV, _CPU)


def tile_states(allowed: torch.Tensor, block_size: BlockSize) -> torch.Tensor:
    """int8 [B, H, nq, nkv] of TileState over the in-range pairs of each tile."""
    B, H, Q, KV = allowed.shape
    bq, bkv = block_size.q, block_size.kv
    nq, nkv = -(-Q // bq), -(-KV // bkv)
    pad_any = torch.zeros(B, H, nq * bq, nkv * bkv, dtype=torch.bool)
    pad_all = torch.ones(B, H, nq * bq, nkv * bkv, dtype=torch.bool)
    pad_any[..., :Q, :KV] = allowed
    pad_all[..., :Q, :KV] = allowed
    shape = (B, H, nq, bq, nkv, bkv)
    any_ = pad_any.view(shape).any(5).any(3)
    all_ = pad_all.view(shape).all(5).all(3)
    out = torch.full((B, H, nq, nkv), int(TileState.PARTIAL), dtype=torch.int8)
    out[all_] = int(TileState.FULL)
    out[~any_] = int(TileState.EMPTY)
    return out


def expected_states(
    fn: Callable[..., object], B: int, H: int, Q: int, KV: int, block_size: BlockSize
) -> torch.Tensor:
    return tile_states(dense_allowed(fn, B, H, Q, KV), block_size)


def states_of(bm: BlockMask, B: int, H: int) -> torch.Tensor:
    """The BlockMask's tile states broadcast to [B, H, nq, nkv], on the CPU."""
    states = bm.tile_states().cpu()
    return states.expand(B, H, *states.shape[2:])


def check_invariants(bm: BlockMask) -> None:
    """The four lists agree: ascending, in range, q-side lists transpose the kv-side ones."""
    nq, nkv = bm.num_q_blocks, bm.num_kv_blocks
    for name, bl, cols in (
        ("kv_partial", bm.kv_partial, nkv),
        ("kv_full", bm.kv_full, nkv),
        ("q_partial", bm.q_partial, nq),
        ("q_full", bm.q_full, nq),
    ):
        assert bl.count.dtype == torch.int32 and bl.index.dtype == torch.int32, name
        width = bl.index.shape[-1]
        listed = torch.arange(width) < bl.count.cpu()[..., None]
        idx = bl.index.cpu()
        assert bool(((idx >= 0) & (idx < cols))[listed].all()), f"{name}: index out of range"
        ascending = idx[..., 1:] > idx[..., :-1]
        both = listed[..., 1:]
        assert bool(ascending[both].all()), f"{name}: indices not strictly ascending"
    assert torch.equal(bm.kv_partial.dense(nkv).transpose(-1, -2), bm.q_partial.dense(nq)), (
        "q_partial is not the transpose of kv_partial"
    )
    assert torch.equal(bm.kv_full.dense(nkv).transpose(-1, -2), bm.q_full.dense(nq)), (
        "q_full is not the transpose of kv_full"
    )
    assert not bool((bm.kv_partial.dense(nkv) & bm.kv_full.dense(nkv)).any()), (
        "a tile is listed as both partial and full"
    )


def describe_mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (got != want).nonzero().tolist()
    names = {0: "empty", 1: "partial", 2: "full"}
    lines = [
        f"tile {tuple(i)}: got {names[int(got[tuple(i)])]}, expected {names[int(want[tuple(i)])]}"
        for i in bad[:8]
    ]
    return f"{len(bad)} tiles differ:\n" + "\n".join(lines)
