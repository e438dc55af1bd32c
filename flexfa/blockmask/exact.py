"""Exact tile classification by evaluating the mask at every in-range pair of the tiles asked for.

This is the tier used where neither analysis nor witnesses decide a tile (masks that read tensors
in ways the analysis cannot bound). It evaluates `mask_mod` on every pair of the tiles it is given,
in chunks sized so that the temporary bool tensor stays small: memory is O(chunk), never
O(B * H * Q * KV). On CUDA, `flexfa.codegen.triton.blockmask.exact_triton` does the same in one generated kernel.
"""

from __future__ import annotations

import torch

from flexfa.blockmask.block_mask import BlockSize, TileState
from flexfa.blockmask.grid import TileGrid, TileList
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
    if check_bounds and ev.out_of_bounds is not None and bool((ev.out_of_bounds & allowed).any()):
        raise IndexError(
            f"mask_mod {mask.name!r} indexes a captured tensor out of bounds at an allowed "
            "(q_idx, kv_idx) pair; are the captured tensors sized for these sequence lengths?"
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
    """Tile states int8 [batch, heads, q-blocks, kv-blocks] by evaluating every in-range pair.

    >>> import torch, flexfa
    >>> traced = flexfa.trace_mask_mod(flexfa.masks.causal)
    >>> classify_exact(traced, batch=1, heads=1, q_len=4, kv_len=4, block_size=BlockSize(2, 2),
    ...                device=torch.device("cpu")).tolist()
    [[[[1, 0], [2, 1]]]]
    """
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
        states[:, :, r0 // bq : r0 // bq + tiles] = _states(any_, all_)
    return states


def _states(any_: torch.Tensor, all_: torch.Tensor) -> torch.Tensor:
    out = torch.full(any_.shape, int(TileState.PARTIAL), dtype=torch.int8, device=any_.device)
    out[all_] = int(TileState.FULL)
    out[~any_] = int(TileState.EMPTY)
    return out


def classify_tiles(mask: TracedMod, grid: TileGrid, tiles: TileList) -> torch.Tensor:
    """Tile states int8 [T] of the listed tiles, by evaluating the mask at each in-range pair.

    Rows and columns past the sequence lengths are replaced by the last in-range ones, which
    repeats pairs but changes neither "some pair allowed" nor "every pair allowed".
    """
    bq, bkv = grid.block_size.q, grid.block_size.kv
    out = torch.empty(len(tiles), dtype=torch.int8, device=grid.device)
    q_lo_all, q_hi_all = grid.q_bounds
    kv_lo_all, kv_hi_all = grid.kv_bounds
    rows = torch.arange(bq, device=grid.device)
    cols = torch.arange(bkv, device=grid.device)
    start = 0
    for chunk in tiles.chunks(max(1, _CHUNK_ELEMENTS // (bq * bkv))):
        q = torch.minimum(q_lo_all[chunk.i, None] + rows, q_hi_all[chunk.i, None])
        kv = torch.minimum(kv_lo_all[chunk.j, None] + cols, kv_hi_all[chunk.j, None])
        env = {
            "b": chunk.b.to(torch.int32).view(-1, 1, 1),
            "h": chunk.h.to(torch.int32).view(-1, 1, 1),
            "q_idx": q.to(torch.int32).view(-1, bq, 1),
            "kv_idx": kv.to(torch.int32).view(-1, 1, bkv),
        }
        allowed = evaluate_mask(mask, env).expand(len(chunk), bq, bkv)
        out[start : start + len(chunk)] = _states(allowed.any(dim=(1, 2)), allowed.all(dim=(1, 2)))
        start += len(chunk)
    return out
