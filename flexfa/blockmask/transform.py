"""New BlockMasks from old ones: selecting batch elements and heads, resizing, and/or.

# Note [Remapped masks]
# Selecting `bm[3]` or resizing with a q-offset changes what index a kernel passes to mask_mod on
# partial tiles: the new BlockMask's batch element 0 is the old element 3, its query row 0 the old
# row q_offset. The new BlockMask therefore carries a new mask, `mask_mod(b * step + start, ...,
# q_idx + q_offset, kv_idx)`, built as a Python wrapper around the old mask_mod and traced like any
# other, so its IR, its kernels, the reference and `to_torch()` all agree on it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flexfa.blockmask.block_mask import BlockList, BlockMask, TileState
from flexfa.blockmask.build import classify, decide
from flexfa.blockmask.grid import TileGrid, TileList
from flexfa.frontend.trace import TracedMod, trace_mask_mod
from flexfa.masks import and_masks, or_masks


@dataclasses.dataclass(frozen=True)
class _Affine1:
    """index -> start + step * index."""

    start: int = 0
    step: int = 1

    @property
    def identity(self) -> bool:
        return self.start == 0 and self.step == 1

    def apply(self, x):
        if self.step != 1:
            x = x * self.step
        return x + self.start if self.start else x


def remap(
    mask: TracedMod,
    *,
    b: _Affine1 = _Affine1(),
    h: _Affine1 = _Affine1(),
    q_offset: int = 0,
) -> TracedMod:
    """The mask with its indices remapped (Note [Remapped masks])."""
    b = b if "b" in mask.variables else _Affine1()
    h = h if "h" in mask.variables else _Affine1()
    if b.identity and h.identity and (q_offset == 0 or "q_idx" not in mask.variables):
        return mask
    fn = mask.fn

    def remapped(b_, h_, q_idx, kv_idx):
        q = q_idx + q_offset if q_offset else q_idx
        return fn(b.apply(b_), h.apply(h_), q, kv_idx)

    remapped.__name__ = mask.name
    remapped.__qualname__ = mask.name
    return trace_mask_mod(remapped)


def _capture_device(bm: BlockMask) -> torch.device:
    return bm.mask.tensors[0].device if bm.mask.tensors else bm.device


def _dim_index(index: object, stored: int, var: str, reads: bool) -> tuple[slice, _Affine1]:
    dim = {"b": "batch", "h": "head"}[var]
    if isinstance(index, bool) or not isinstance(index, (int, slice)):
        raise TypeError(
            f"a BlockMask is indexed by batch and head with ints or slices, got {type(index).__name__}"
        )
    if stored == 1 and not reads:
        return slice(None), _Affine1()  # the same for every index: stays broadcast
    if isinstance(index, int):
        k = index + stored if index < 0 else index
        if not 0 <= k < stored:
            raise IndexError(f"{dim} index {index} is out of range for size {stored}")
        return slice(k, k + 1), _Affine1(k, 1)
    start, stop, step = index.indices(stored)
    if step <= 0:
        raise ValueError(f"{dim} slices of a BlockMask need a positive step, got {step}")
    if len(range(start, stop, step)) == 0:
        raise IndexError(f"{dim} slice {index} selects nothing from size {stored}")
    return slice(start, stop, step), _Affine1(start, step)


def select(bm: BlockMask, index: object) -> BlockMask:
    """See `BlockMask.__getitem__`."""
    parts = index if isinstance(index, tuple) else (index,)
    if len(parts) > 3:
        raise IndexError(
            "a BlockMask is indexed by batch, head and q-block: bm[b], bm[b, h] or bm[b, h, i]"
        )
    parts = (*parts, slice(None), slice(None), slice(None))[:3]
    variables = bm.mask.variables
    sel_b, map_b = _dim_index(parts[0], bm.batch, "b", "b" in variables)
    sel_h, map_h = _dim_index(parts[1], bm.heads, "h", "h" in variables)

    def cut(bl: BlockList) -> BlockList:
        return BlockList(bl.count[sel_b, sel_h].contiguous(), bl.index[sel_b, sel_h].contiguous())

    selected = dataclasses.replace(
        bm,
        kv_partial=cut(bm.kv_partial),
        kv_full=cut(bm.kv_full),
        q_partial=cut(bm.q_partial),
        q_full=cut(bm.q_full),
        mask=remap(bm.mask, b=map_b, h=map_h),
    )
    if parts[2] == slice(None):
        return selected
    return _select_rows(selected, parts[2])


def _select_rows(bm: BlockMask, index: object) -> BlockMask:
    """The q-block rows `index` (an int or a slice of step 1) of `bm`, as a BlockMask of their query
    rows: query row 0 of the result is row `first * block_size.q` of `bm` (Note [Remapped masks])."""
    n = bm.num_q_blocks
    if isinstance(index, bool) or not isinstance(index, (int, slice)):
        raise TypeError(
            f"a BlockMask's q-blocks are selected with an int or a slice, got {index!r}"
        )
    if isinstance(index, int):
        first = index + n if index < 0 else index
        if not 0 <= first < n:
            raise IndexError(f"q-block index {index} is out of range for {n} q-blocks")
        stop = first + 1
    else:
        first, stop, step = index.indices(n)
        if step != 1 or stop <= first:
            raise ValueError(f"q-block slices must be non-empty with step 1, got {index}")
    bq = bm.block_size.q
    q_len = min(bm.q_len, stop * bq) - first * bq
    states = bm.tile_states()[:, :, first:stop].contiguous()
    return BlockMask.from_tile_states(
        states,
        q_len=q_len,
        kv_len=bm.kv_len,
        block_size=bm.block_size,
        mask=remap(bm.mask, q_offset=first * bq),
        tiles_from_mask=bm.tiles_from_mask,
    )


def _check_len(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def resize(bm: BlockMask, *, q_len: int | None, kv_len: int | None, q_offset: int) -> BlockMask:
    """See `BlockMask.resize`."""
    q_len = _check_len("q_len", bm.q_len if q_len is None else q_len)
    kv_len = _check_len("kv_len", bm.kv_len if kv_len is None else kv_len)
    if isinstance(q_offset, bool) or not isinstance(q_offset, int) or q_offset < 0:
        raise ValueError(f"q_offset must be a non-negative int, got {q_offset!r}")
    mask = remap(bm.mask, q_offset=q_offset)
    bs = bm.block_size
    if bm.tiles_from_mask:
        grid = TileGrid(bm.batch, bm.heads, q_len, kv_len, bs, _capture_device(bm))
        states = classify(mask, grid).states
        new = BlockMask.from_tile_states(
            states, q_len=q_len, kv_len=kv_len, block_size=bs, mask=mask
        )
        return new.to(bm.device)
    # Lists given by the user are authoritative: keep their tiles (Note [Remapped masks]).
    if q_offset % bs.q:
        raise ValueError(
            f"this BlockMask was built from block lists, so resize() can only shift it by whole "
            f"q-blocks: q_offset={q_offset} is not a multiple of {bs.q}"
        )
    first = q_offset // bs.q
    nq, nkv = -(-q_len // bs.q), -(-kv_len // bs.kv)
    if first + nq > bm.num_q_blocks or nkv > bm.num_kv_blocks:
        raise ValueError(
            f"this BlockMask was built from block lists for {bm.num_q_blocks} x "
            f"{bm.num_kv_blocks} tiles; q_len={q_len}, kv_len={kv_len}, q_offset={q_offset} "
            "reaches beyond them. Build the lists for the largest lengths you need."
        )
    states = bm.tile_states()[:, :, first : first + nq, :nkv]
    return BlockMask.from_tile_states(
        states.contiguous(),
        q_len=q_len,
        kv_len=kv_len,
        block_size=bs,
        mask=mask,
        tiles_from_mask=False,
    )


def combine(a: BlockMask, b: BlockMask, how: Literal["and", "or"]) -> BlockMask:
    """`a & b` or `a | b`: tile states combined, tiles partial in both decided again."""
    if not isinstance(b, BlockMask):
        return NotImplemented
    if (a.q_len, a.kv_len, a.block_size) != (b.q_len, b.kv_len, b.block_size):
        raise ValueError(
            "BlockMasks combined with & or | need the same lengths and block size, got "
            f"({a.q_len}, {a.kv_len}, {a.block_size}) and ({b.q_len}, {b.kv_len}, {b.block_size})"
        )
    for name, x, y in (("batch", a.batch, b.batch), ("heads", a.heads, b.heads)):
        if x != y and 1 not in (x, y):
            raise ValueError(f"BlockMasks with {name} sizes {x} and {y} cannot be combined")
    if not (a.tiles_from_mask and b.tiles_from_mask):
        raise ValueError(
            "& and | need BlockMasks whose tiles come from their masks (create_block_mask); for "
            "BlockMasks built from block lists, combine the lists yourself"
        )
    combinator = and_masks if how == "and" else or_masks
    mask = trace_mask_mod(combinator(a.mask.fn, b.mask.fn))
    device = mask.tensors[0].device if mask.tensors else a.device
    sa, sb = a.tile_states().to(device), b.tile_states().to(device)
    sa, sb = torch.broadcast_tensors(sa, sb)  # (torch.broadcast_shapes imports sympy)
    shape = sa.shape
    full, empty, partial = int(TileState.FULL), int(TileState.EMPTY), int(TileState.PARTIAL)
    if how == "and":
        states = torch.where((sa == empty) | (sb == empty), empty, partial)
        states = torch.where((sa == full) & (sb == full), full, states)
    else:
        states = torch.where((sa == full) | (sb == full), full, partial)
        states = torch.where((sa == empty) & (sb == empty), empty, states)
    states = states.to(torch.int8).contiguous()
    # A tile partial in both may be anything in the combination: decide it like create_block_mask.
    grid = TileGrid(shape[0], shape[1], a.q_len, a.kv_len, a.block_size, device)
    decide(mask, grid, states, TileList.where((sa == partial) & (sb == partial)))
    return BlockMask.from_tile_states(
        states, q_len=a.q_len, kv_len=a.kv_len, block_size=a.block_size, mask=mask
    ).to(a.device)
