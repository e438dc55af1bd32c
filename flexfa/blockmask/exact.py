"""Exact tile classification by evaluating the mask, a few block-rows at a time.

This is the tier used where analysis of the IR cannot decide a tile (masks that read tensors, such
as document ids). It evaluates `mask_mod` on every pair of the tiles it is given, in chunks sized so
that the temporary bool tensor stays small: memory is O(chunk), never O(B * H * Q * KV).
"""

from __future__ import annotations

import torch

from flexfa.blockmask.block_mask import BlockSize, TileState
from flexfa.frontend.trace import TracedMod
from flexfa.ir.evaluate import Evaluator

# Upper bound on the number of mask elements evaluated at once.
_CHUNK_ELEMENTS = 1 << 24


def index_grids(
    batch: int, heads: int, rows: torch.Tensor, cols: torch.Tensor, device: torch.device
) -> dict[str, torch.Tensor]:
    """Broadcastable int32 index tensors for (b, h, q_idx, kv_idx), shaped [B, H, rows, cols]."""
    return {
        "b": torch.arange(batch, device=device, dtype=torch.int32).view(-1, 1, 1, 1),
        "h": torch.arange(heads, device=device, dtype=torch.int32).view(1, -1, 1, 1),
        "q_idx": rows.to(device=device, dtype=torch.int32).view(1, 1, -1, 1),
        "kv_idx": cols.to(device=device, dtype=torch.int32).view(1, 1, 1, -1),
    }


def evaluate_mask(
    mask: TracedMod, env: dict[str, torch.Tensor], *, check_bounds: bool = True
) -> torch.Tensor:
    """mask_mod over broadcast index tensors; raises if an allowed pair read out of bounds."""
    ev = Evaluator(env, mask.tensors)
    allowed = ev(mask.output)
    if check_bounds and ev.out_of_bounds is not None and bool(ev.out_of_bounds.any()):
        raise IndexError(
            f"mask_mod {mask.name!r} indexes a captured tensor out of bounds for some (q_idx, kv_idx) "
            "in range; are the captured tensors sized for these sequence lengths?"
        )
    return allowed


def classify_exact(
    mask: TracedMod,
    *,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    block_size: BlockSize,
    device: torch.device,
) -> torch.Tensor:
    """Tile states int8 [batch, heads, q-blocks, kv-blocks] by evaluating every in-range pair."""
    bq, bkv = block_size.q, block_size.kv
    nq, nkv = -(-q_len // bq), -(-kv_len // bkv)
    states = torch.empty(batch, heads, nq, nkv, dtype=torch.int8, device=device)
    kv_pad = nkv * bkv
    cols = torch.arange(kv_pad, device=device)
    col_valid = cols < kv_len
    cols = torch.where(col_valid, cols, kv_len - 1)
    rows_per_chunk = max(bq, (_CHUNK_ELEMENTS // max(1, batch * heads * kv_pad)) // bq * bq)
    for r0 in range(0, nq * bq, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, nq * bq)
        rows = torch.arange(r0, r1, device=device)
        row_valid = rows < q_len
        rows = torch.where(row_valid, rows, q_len - 1)
        env = index_grids(batch, heads, rows, cols, device)
        allowed = evaluate_mask(mask, env).expand(batch, heads, r1 - r0, kv_pad)
        in_range = row_valid.view(1, 1, -1, 1) & col_valid.view(1, 1, 1, -1)
        # Padding pairs count as allowed for "all" and as not allowed for "any".
        tiles = (r1 - r0) // bq
        shape = (batch, heads, tiles, bq, nkv, bkv)
        any_ = (allowed & in_range).reshape(shape).any(dim=5).any(dim=3)
        all_ = (allowed | ~in_range).reshape(shape).all(dim=5).all(dim=3)
        chunk = torch.full_like(any_, int(TileState.PARTIAL), dtype=torch.int8)
        chunk[all_] = int(TileState.FULL)
        chunk[~any_] = int(TileState.EMPTY)
        states[:, :, r0 // bq : r0 // bq + tiles] = chunk
    return states
