"""Binding the `block_mask=` argument of `flexfa.attention` to a BlockMask for the call's shapes.

# Note [Block mask cache]
# A training loop calls attention with the same mask every step. When `block_mask=` is a mask_mod
# (a function from flexfa.masks or the user's), flexfa builds the BlockMask for the call's shapes and
# keeps it in a small LRU cache keyed by
#   - the mask's IR digest (its code, its Python-number closures, the dtypes/ranks of captures),
#   - each captured tensor's identity and `tensor._version` (bumped by every in-place write),
#   - B and H as the mask uses them, the sequence lengths, the device and the block size.
# Changing a captured doc-id tensor in place bumps its version, so the next call rebuilds; passing a
# new tensor changes the identity. The cache holds the tensors alive, so an identity cannot be reused
# by another tensor while its entry exists. On CUDA a miss is built outside CUDA graph pools
# (Note [Caches under CUDA graphs] in flexfa/runtime/persist.py).
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable

import torch

from flexfa.blockmask.block_mask import BlockMask, BlockSize
from flexfa.blockmask.build import column_states, create_block_mask, grown_column
from flexfa.blockmask.grid import TileGrid
from flexfa.frontend.trace import TracedMod, trace_mask_mod
from flexfa.runtime.persist import persistent

DEFAULT_BLOCK_SIZE = BlockSize(128, 128)
_CACHE_SIZE = 64
_cache: collections.OrderedDict[tuple, BlockMask] = collections.OrderedDict()


def _cache_key(
    traced: TracedMod, B: int, H: int, Lq: int, Lkv: int, device: torch.device, bs: BlockSize
) -> tuple:
    tensors = tuple((id(t), t._version) for t in traced.tensors)
    batch = B if "b" in traced.variables else None
    heads = H if "h" in traced.variables else None
    return (traced.key, tensors, batch, heads, Lq, Lkv, str(device), bs.q, bs.kv)


def cached_block_mask(
    traced: TracedMod,
    B: int,
    H: int,
    Lq: int,
    Lkv: int,
    device: torch.device,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
) -> BlockMask:
    """The BlockMask of `traced` for these shapes, built once and reused (Note [Block mask cache]),
    or derived from the one of the same number of kv blocks (Note [Block masks for growing key
    lengths])."""
    key = _cache_key(traced, B, H, Lq, Lkv, device, block_size)
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit
    bm = persistent(device, lambda: _same_tiles(traced, key, B, H, Lq, Lkv, device, block_size))
    _cache[key] = bm
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return bm


def uncached_block_mask(
    traced: TracedMod,
    B: int,
    H: int,
    Lq: int,
    Lkv: int,
    device: torch.device,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
) -> BlockMask:
    """The BlockMask of `traced` for one call, built and not kept: for a mask_mod whose tensors a
    compiled graph computes, new at every call (Note [Local mods under CUDA graphs] in
    flexfa/compiled.py). Kept, it would keep their memory alive, which under CUDA graphs is the
    graph's own pool."""
    return persistent(device, lambda: _build(traced, B, H, Lq, Lkv, device, block_size))


# Note [Block masks for growing key lengths]
# A decode loop calls attention with one more key at every step, so each step's lengths are new to
# the cache above, and `flexfa.api.build_spec` took 1.3 to 3.5 ms at 4k keys (one to 16 query
# rows, no mask or causal, on a loaded 2-core CPU) against 20 to 100 us for a cache hit, nearly
# all of it the build. But a tile's state depends only on the mask's values at its in-range
# pairs: for the same Lq, a kv-block column whose keys are complete at both lengths ((j + 1) *
# block_kv <= both) has the same pairs, so the same states, and at the same number of kv blocks
# only the last column can differ. So the cache also keeps, per number of kv blocks (the key
# with Lkv left out), the last BlockMask built and the states of its last column. A new length
# finds that column's states alone: for a longer one with few new pairs (decode),
# `grown_column` evaluates only the new keys' pairs against the kept column, read from the
# lists; otherwise `column_states` classifies the column's O(B * H * q-blocks) tiles. Where they
# are the kept ones, the new BlockMask is the kept one with the new kv_len: its list tensors
# shared, bit for bit what a build gives, since the lists are a function of the states. Where
# not (a column that changed, or a new number of kv blocks: once every block_kv steps of a
# decode loop) it is built in full. A mask that reads none of b, h, q_idx, kv_idx
# (block_mask=None's, where every pair attends) is the same on every tile and needs no column.
# A mask with its own builder (Note [Block mask builders]) is always built by it. Measured the
# same way, a new length then took 0.15 to 0.3 ms without a mask and 0.5 to 1.3 ms causal.
_by_tiles: collections.OrderedDict[tuple, tuple[BlockMask, torch.Tensor | None]] = (
    collections.OrderedDict()
)


def _same_tiles(
    traced: TracedMod,
    key: tuple,
    B: int,
    H: int,
    Lq: int,
    Lkv: int,
    device: torch.device,
    block_size: BlockSize,
) -> BlockMask:
    """The BlockMask for these lengths, from the kept one of the same number of kv blocks where
    its last column is unchanged, else built (Note [Block masks for growing key lengths])."""
    if getattr(traced.fn, "__flexfa_block_mask__", None) is not None:
        return _build(traced, B, H, Lq, Lkv, device, block_size)
    nkv = -(-Lkv // block_size.kv)
    tiles_key = (*key[:5], nkv, *key[6:])  # Lkv (key[5]) replaced by the number of kv blocks
    kept = _by_tiles.get(tiles_key)
    uniform = not traced.variables  # the same state on every tile, at every length
    if kept is not None:
        old, old_column = kept
        grown = Lkv > old.kv_len and _small(old, Lkv)
        if uniform:
            column = None
        elif grown:  # only the new keys' pairs evaluated
            old_column, column = grown_column(traced, old, Lkv)
        else:
            if old_column is None:
                old_column = _last_column(
                    traced, old.batch, old.heads, Lq, old.kv_len, device, block_size
                )
            column = _last_column(traced, old.batch, old.heads, Lq, Lkv, device, block_size)
        if uniform or torch.equal(column, old_column):
            _by_tiles.move_to_end(tiles_key)
            bm = dataclasses.replace(old, kv_len=Lkv)
            _by_tiles[tiles_key] = (bm, column)
            return bm
    bm = _build(traced, B, H, Lq, Lkv, device, block_size)
    if type(bm) is BlockMask:
        _by_tiles[tiles_key] = (bm, None)
        while len(_by_tiles) > _CACHE_SIZE:
            _by_tiles.popitem(last=False)
    return bm


def _small(old: BlockMask, Lkv: int) -> bool:
    """Whether the pairs of the new keys are few enough to evaluate (`grown_column`)."""
    return old.batch * old.heads * old.q_len * (Lkv - old.kv_len) <= _NEW_PAIRS


_NEW_PAIRS = 1 << 16


def _build(
    traced: TracedMod,
    B: int,
    H: int,
    Lq: int,
    Lkv: int,
    device: torch.device,
    block_size: BlockSize,
) -> BlockMask:
    return create_block_mask(
        traced, B, H, Lq, Lkv, device=device, BLOCK_SIZE=(block_size.q, block_size.kv)
    )


def _last_column(
    traced: TracedMod,
    batch: int,
    heads: int,
    Lq: int,
    Lkv: int,
    device: torch.device,
    block_size: BlockSize,
) -> torch.Tensor:
    grid = TileGrid(batch, heads, Lq, Lkv, block_size, device)
    return column_states(traced, grid, grid.num_kv_blocks - 1)


def clear_cache() -> None:
    _cache.clear()
    _by_tiles.clear()
    _noop_cache.clear()


# block_mask=None, the most common call, skips tracing and keying: one BlockMask per lengths.
_noop_cache: collections.OrderedDict[tuple, BlockMask] = collections.OrderedDict()


def allow_all(b, h, q_idx, kv_idx):
    """The mask_mod of no mask: every pair attends."""
    return q_idx.new_ones((), dtype=torch.bool)


def resolve_block_mask(
    block_mask: BlockMask | Callable[..., object] | None,
    B: int,
    H: int,
    Lq: int,
    Lkv: int,
    device: torch.device,
) -> BlockMask:
    """A BlockMask for the call: the given one (checked), or one built and cached from a mask_mod."""
    if block_mask is None:
        key = (Lq, Lkv, device)
        bm = _noop_cache.get(key)
        if bm is None:
            bm = cached_block_mask(trace_mask_mod(allow_all, device=device), B, H, Lq, Lkv, device)
            _noop_cache[key] = bm
            while len(_noop_cache) > _CACHE_SIZE:
                _noop_cache.popitem(last=False)
        return bm
    if isinstance(block_mask, BlockMask):
        return _check_given(block_mask, B, H, Lq, Lkv, device)
    if is_torch_block_mask(block_mask):
        return _check_given(converted(block_mask), B, H, Lq, Lkv, device)
    if callable(block_mask):
        return cached_block_mask(trace_mask_mod(block_mask, device=device), B, H, Lq, Lkv, device)
    raise TypeError(
        "block_mask must be a flexfa.BlockMask, a torch BlockMask, a mask_mod(b, h, q_idx, kv_idx) "
        f"or None, got {type(block_mask).__name__}"
    )


def is_torch_block_mask(obj: object) -> bool:
    """Whether `obj` is torch FlexAttention's BlockMask (without importing it for other objects)."""
    cls = type(obj)
    return cls.__name__ == "BlockMask" and cls.__module__.startswith("torch.nn.attention")


# Note [torch BlockMask conversion]
# `flexfa.attention(q, k, v, block_mask=torch_block_mask)` converts torch's BlockMask with
# `BlockMask.from_torch` (its block lists as given, its mask_mod traced) once, and keeps the result
# keyed by the torch object's identity and the `_version` of its index tensors, holding the torch
# object alive so that its identity cannot be reused while the entry exists. A training loop that
# builds its torch BlockMask once converts it once; an in-place edit of its tensors converts again.
_torch_masks: collections.OrderedDict[int, tuple[object, tuple, BlockMask]] = (
    collections.OrderedDict()
)


def converted(torch_mask: object) -> BlockMask:
    """The flexfa BlockMask of a torch BlockMask, converted once (Note [torch BlockMask conversion])."""
    from flexfa.blockmask.interop import from_torch

    tensors = (
        torch_mask.kv_num_blocks,  # type: ignore[attr-defined]
        torch_mask.kv_indices,  # type: ignore[attr-defined]
        torch_mask.full_kv_num_blocks,  # type: ignore[attr-defined]
        torch_mask.full_kv_indices,  # type: ignore[attr-defined]
    )
    versions = tuple(t._version if t is not None else None for t in tensors)
    hit = _torch_masks.get(id(torch_mask))
    if hit is not None and hit[0] is torch_mask and hit[1] == versions:
        _torch_masks.move_to_end(id(torch_mask))
        return hit[2]
    bm = from_torch(torch_mask)
    _torch_masks[id(torch_mask)] = (torch_mask, versions, bm)
    while len(_torch_masks) > _CACHE_SIZE:
        _torch_masks.popitem(last=False)
    return bm


def _check_given(
    bm: BlockMask, B: int, H: int, Lq: int, Lkv: int, device: torch.device
) -> BlockMask:
    if (bm.q_len, bm.kv_len) != (Lq, Lkv):
        # torch's rule: the lengths must match exactly (Note [Block lists longer than the call]).
        hint = (
            "; for a query at position p against L keys use block_mask.resize(q_len=Lq, kv_len=L, "
            "q_offset=p) (torch's block_mask._adjust crops to the top left: resize with q_offset=0)"
            if Lq <= bm.q_len and Lkv <= bm.kv_len
            else ""
        )
        raise ValueError(
            f"block_mask was built for lengths (Q_LEN={bm.q_len}, KV_LEN={bm.kv_len}) but q/k have "
            f"({Lq}, {Lkv}); build it for these lengths (or pass the mask_mod and let flexfa build "
            f"it){hint}"
        )
    if bm.batch not in (1, B):
        raise ValueError(f"block_mask has batch size {bm.batch}; expected 1 (broadcast) or {B}")
    if bm.heads not in (1, H):
        raise ValueError(
            f"block_mask has {bm.heads} heads; expected 1 (broadcast) or {H} (query heads)"
        )
    # A size of 1 broadcasts only when the mask does not depend on that index: otherwise the
    # tiles of batch element (head) 0 would stand for all of them.
    for dim, stored, wanted, var in (("B", bm.batch, B, "b"), ("H", bm.heads, H, "h")):
        if stored == 1 and wanted > 1 and var in bm.mask.variables:
            raise ValueError(
                f"block_mask was built for {dim}=1, but its mask_mod {bm.mask.name!r} reads {var!r} "
                f"and the inputs have {dim}={wanted}; build it with {dim}={wanted}"
            )
    for cap, t in zip(bm.mask.captures, bm.mask.tensors):
        if t.device != device:
            raise ValueError(
                f"block_mask's mask_mod {bm.mask.name!r} captures {cap.name!r} on {t.device}, but the "
                f"inputs are on {device}"
            )
    if bm.device != device:
        # Moved once per device and kept as long as `bm` lives, so that per-BlockMask caches
        # (kernel flags, decode lists) keep hitting when a CPU-built mask is passed every call.
        moved = _moved.setdefault(bm, {})
        if device not in moved:
            moved[device] = persistent(device, lambda: bm.to(device))
        bm = moved[device]
    return bm


_moved: weakref.WeakKeyDictionary[BlockMask, dict[torch.device, BlockMask]] = (
    weakref.WeakKeyDictionary()
)
