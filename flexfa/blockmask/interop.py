"""Block lists in and out: user-built kv-side lists, and torch FlexAttention's `BlockMask`.

torch's BlockMask stores the same four pairs of lists as flexfa (kv-side partial and full blocks
per q-block, and their q-side transposes), with `kv_num_blocks`/`kv_indices` holding the partial
blocks when `full_kv_*` is given. One difference: torch counts the padding of the last row and
column of tiles as excluded pairs, so such a tile is never full there, while flexfa counts only
in-range pairs. Both are correct (kernels mask the padding); a round trip can only turn a tile
flexfa calls full into one torch calls partial, never the other way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from flexfa.blockmask.block_mask import BlockList, BlockMask, BlockSize, TileState
from flexfa.frontend.proxy import ModTraceError
from flexfa.frontend.trace import TracedMod, trace_mask_mod

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask


def _noop(b, h, q_idx, kv_idx):
    return q_idx.new_ones((), dtype=torch.bool)


def _as_list(count: object, index: object, what: str) -> BlockList:
    """A BlockList from [.., rows] counts and [.., rows, cols] indices (leading dims optional)."""
    for name, t in ((f"{what}_num_blocks", count), (f"{what}_indices", index)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    assert isinstance(count, torch.Tensor) and isinstance(index, torch.Tensor)
    if not 2 <= index.ndim <= 4 or count.ndim != index.ndim - 1:
        raise ValueError(
            f"{what}_indices must have shape [B, H, rows, cols] (leading dims optional) and "
            f"{what}_num_blocks [B, H, rows]; got {tuple(index.shape)} and {tuple(count.shape)}"
        )
    if count.shape != index.shape[:-1]:
        raise ValueError(
            f"{what}_num_blocks has shape {tuple(count.shape)} but {what}_indices has "
            f"{tuple(index.shape)}; expected {tuple(index.shape[:-1])}"
        )
    while index.ndim < 4:
        index, count = index.unsqueeze(0), count.unsqueeze(0)
    return BlockList(count.to(torch.int32), index.to(torch.int32))


# Note [Block lists longer than the call]
# torch's rule (flex_attention in torch 2.13): a call's (Q_LEN, KV_LEN) must equal the BlockMask's
# `seq_lengths`, but its lists may describe more: the usual decoding recipe slices the rows of a
# mask built for the whole sequence (`block_mask[:, :, i]`) and sets `seq_lengths = (1, KV_LEN)`, and
# a mask's lists may name KV blocks past KV_LEN (torch's kernels mask keys past KV_LEN). So the rows
# past the q-blocks of Q_LEN are ignored, and so are listed KV blocks at or past the KV-blocks of
# KV_LEN but within the lists' width; too few rows, or a block index that is negative or past both,
# is an error.


def _first_rows(bl: BlockList, rows: int) -> BlockList:
    if bl.count.shape[2] == rows:
        return bl
    return BlockList(bl.count[:, :, :rows], bl.index[:, :, :rows])


def _dense(bl: BlockList, num_kv_blocks: int, what: str) -> torch.Tensor:
    width = bl.index.shape[-1]
    if bool(((bl.count < 0) | (bl.count > width)).any()):
        raise ValueError(f"{what}_num_blocks must lie in [0, {width}] (the width of the indices)")
    listed = torch.arange(width, device=bl.index.device) < bl.count[..., None]
    limit = max(width, num_kv_blocks)
    if bool((listed & ((bl.index < 0) | (bl.index >= limit))).any()):
        raise ValueError(
            f"{what}_indices lists a KV block outside [0, {limit}) (the KV blocks of these lengths "
            "or the width of the lists)"
        )
    # Keys past KV_LEN never attend (Note [Block lists longer than the call]): such blocks and the
    # unused entries go to a spare column, dropped after.
    idx = torch.where(listed & (bl.index < num_kv_blocks), bl.index.long(), num_kv_blocks)
    out = torch.zeros(*idx.shape[:-1], num_kv_blocks + 1, dtype=torch.bool, device=idx.device)
    return out.scatter_(-1, idx, True)[..., :num_kv_blocks]


def _check_lengths(seq_lengths: object) -> tuple[int, int]:
    if (
        not isinstance(seq_lengths, (tuple, list))
        or len(seq_lengths) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in seq_lengths)
    ):
        raise ValueError(f"seq_lengths must be (Q_LEN, KV_LEN) positive ints, got {seq_lengths!r}")
    return int(seq_lengths[0]), int(seq_lengths[1])


def from_kv_blocks(
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    full_kv_num_blocks: torch.Tensor | None = None,
    full_kv_indices: torch.Tensor | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    mask_mod: Callable[..., object] | TracedMod | None = None,
    seq_lengths: tuple[int, int] | None = None,
) -> BlockMask:
    """See `BlockMask.from_kv_blocks`."""
    block_size = BlockSize.of(BLOCK_SIZE)
    partial = _as_list(kv_num_blocks, kv_indices, "kv")
    if (full_kv_num_blocks is None) != (full_kv_indices is None):
        raise ValueError("full_kv_num_blocks and full_kv_indices must be given together")
    full = (
        _as_list(full_kv_num_blocks, full_kv_indices, "full_kv")
        if full_kv_num_blocks is not None
        else None
    )
    rows, width = partial.index.shape[2], partial.index.shape[3]
    if seq_lengths is None:
        q_len, kv_len = rows * block_size.q, width * block_size.kv
    else:
        q_len, kv_len = _check_lengths(seq_lengths)
    nq, nkv = -(-q_len // block_size.q), -(-kv_len // block_size.kv)
    for name, bl in (("kv", partial), ("full_kv", full)):
        if bl is not None and bl.count.shape[2] < nq:
            raise ValueError(
                f"{name}_indices has {bl.count.shape[2]} rows, but Q_LEN={q_len} with q block "
                f"{block_size.q} needs {nq} q-blocks; give seq_lengths for the rows the lists "
                "cover (a mask sliced to rows i: (rows * q block, KV_LEN) or less)"
            )
    # Lists may cover more than seq_lengths (Note [Block lists longer than the call]).
    partial = _first_rows(partial, nq)
    full = _first_rows(full, nq) if full is not None else None
    partial_dense = _dense(partial, nkv, "kv")
    states = partial_dense.to(torch.int8) * int(TileState.PARTIAL)
    if full is not None:
        full_dense = _dense(full, nkv, "full_kv").to(partial_dense.device)
        full_dense, states = torch.broadcast_tensors(full_dense, states)
        states = torch.where(full_dense, int(TileState.FULL), states).to(torch.int8)
    if isinstance(mask_mod, TracedMod):
        traced = mask_mod
    else:
        traced = trace_mask_mod(mask_mod if mask_mod is not None else _noop)
    return BlockMask.from_tile_states(
        states.contiguous(),
        q_len=q_len,
        kv_len=kv_len,
        block_size=block_size,
        mask=traced,
        tiles_from_mask=False,
    )


def from_torch(block_mask: object, mask_mod: Callable[..., object] | None = None) -> BlockMask:
    """See `BlockMask.from_torch`."""
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    if not isinstance(block_mask, TorchBlockMask):
        raise TypeError(
            "from_torch expects a torch.nn.attention.flex_attention.BlockMask, got "
            f"{type(block_mask).__name__}"
        )
    fn = mask_mod if mask_mod is not None else block_mask.mask_mod
    try:
        traced = trace_mask_mod(fn)
    except ModTraceError as e:
        raise ValueError(
            f"cannot trace the torch BlockMask's mask_mod ({e}); pass mask_mod= explicitly"
        ) from e
    bq, bkv = block_mask.BLOCK_SIZE
    return from_kv_blocks(
        block_mask.kv_num_blocks,
        block_mask.kv_indices,
        block_mask.full_kv_num_blocks,
        block_mask.full_kv_indices,
        BLOCK_SIZE=(int(bq), int(bkv)),
        mask_mod=traced,
        seq_lengths=tuple(int(x) for x in block_mask.seq_lengths),  # type: ignore[arg-type]
    )


def to_torch(bm: BlockMask) -> TorchBlockMask:
    """See `BlockMask.to_torch`."""
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    return TorchBlockMask(
        seq_lengths=(bm.q_len, bm.kv_len),
        kv_num_blocks=bm.kv_partial.count,
        kv_indices=bm.kv_partial.index,
        full_kv_num_blocks=bm.kv_full.count,
        full_kv_indices=bm.kv_full.index,
        q_num_blocks=bm.q_partial.count,
        q_indices=bm.q_partial.index,
        full_q_num_blocks=bm.q_full.count,
        full_q_indices=bm.q_full.index,
        BLOCK_SIZE=(bm.block_size.q, bm.block_size.kv),
        mask_mod=bm.mask.fn,
    )
