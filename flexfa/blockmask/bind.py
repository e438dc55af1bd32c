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
import weakref
from collections.abc import Callable

import torch

from flexfa.blockmask.block_mask import BlockMask, BlockSize
from flexfa.blockmask.build import create_block_mask
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
    """The BlockMask of `traced` for these shapes, built once and reused (Note [Block mask cache])."""
    key = _cache_key(traced, B, H, Lq, Lkv, device, block_size)
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit
    bm = persistent(
        device,
        lambda: create_block_mask(
            traced, B, H, Lq, Lkv, device=device, BLOCK_SIZE=(block_size.q, block_size.kv)
        ),
    )
    _cache[key] = bm
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return bm


def clear_cache() -> None:
    _cache.clear()
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
