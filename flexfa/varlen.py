"""Packed variable-length batches: several sequences concatenated along the length dim.

`flexfa.attention(q, k, v, ..., cu_seqlens_q=..., cu_seqlens_kv=...)` takes q (1, Hq, total_q, E),
k and v (1, Hkv, total_kv, E|Ev) and (B + 1,) int32 offsets: sequence s holds queries
`cu_seqlens_q[s] : cu_seqlens_q[s + 1]` and keys `cu_seqlens_kv[s] : cu_seqlens_kv[s + 1]`.

# Note [Packed batches as mods]
# A packed call is an ordinary call on the concatenation whose mods are rewritten: with seq[t] the
# sequence of token t and pos[t] = t - (its sequence's start),
#     mask'(b, h, q, kv)         = seq_q[q] == seq_kv[kv] & mask_mod(seq_q[q], h, pos_q[q], pos_kv[kv])
#     score'(s, b, h, q, kv)     = score_mod(s, seq_q[q], h, pos_q[q], pos_kv[kv])
# so the user's mods see `b` = sequence index and positions relative to their sequence, exactly as
# for a padded batch, and every backend (forward and backward) runs packed calls unchanged. The
# BlockMask of mask' is built by flexfa's analysis, which bounds seq/pos lines tile by tile (the
# document-mask case). The four index tensors are derived once per (cu_seqlens_q, cu_seqlens_kv)
# state and cached with weak references (as page tables are, Note [Checking page tables]), so the
# rewritten mods keep hitting the trace and block-mask caches across calls.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch

from flexfa.blockmask.block_mask import BlockMask
from flexfa.mods import bind_heads


@dataclasses.dataclass(frozen=True, eq=False)
class Packing:
    """Per token: its sequence (`seq_*`) and its position in that sequence (`pos_*`), int32."""

    seq_q: torch.Tensor
    pos_q: torch.Tensor
    seq_kv: torch.Tensor
    pos_kv: torch.Tensor
    num_seqs: int


_MAX_CACHED = 32
_packings: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()


def _positions(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = (cu[1:] - cu[:-1]).long()
    seqs = torch.arange(cu.numel() - 1, device=cu.device, dtype=torch.int32)
    seq = torch.repeat_interleave(seqs, lengths, output_size=total)
    pos = torch.arange(total, device=cu.device, dtype=torch.int32) - cu[seq.long()]
    return seq.to(torch.int32), pos.to(torch.int32)


def _check(name: str, cu: object, total: int, device: torch.device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32 or cu.ndim != 1 or cu.numel() < 2:
        raise ValueError(
            f"{name} must be an int32 tensor of shape (B + 1,) with B >= 1, got {cu.dtype} of "
            f"shape {tuple(cu.shape)}"
        )
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device}, but q is on {device}")
    return cu


def _check_values(name: str, cu: torch.Tensor, total: int) -> None:
    steps = cu[1:] - cu[:-1]
    first, last, decreasing = torch.stack([cu[0], cu[-1], (steps < 0).sum()]).tolist()
    if first != 0 or last != total:
        raise ValueError(
            f"{name} must start at 0 and end at the packed length {total}, got {first} and {last}"
        )
    if decreasing:
        raise ValueError(f"{name} must be non-decreasing (sequence lengths are >= 0)")


def packing(
    cu_seqlens_q: object, cu_seqlens_kv: object, total_q: int, total_kv: int, device: torch.device
) -> Packing:
    """The validated `Packing` of these offsets (cached per tensor state, Note [Packed ...])."""
    cu_q = _check("cu_seqlens_q", cu_seqlens_q, total_q, device)
    cu_kv = _check("cu_seqlens_kv", cu_seqlens_kv, total_kv, device)
    if cu_q.numel() != cu_kv.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_kv must describe the same number of sequences, got "
            f"{cu_q.numel() - 1} and {cu_kv.numel() - 1}"
        )
    key = (id(cu_q), cu_q._version, id(cu_kv), cu_kv._version, total_q, total_kv)
    hit = _packings.get(key)
    if hit is not None and hit[0]() is cu_q and hit[1]() is cu_kv:
        _packings.move_to_end(key)
        return hit[2]
    _check_values("cu_seqlens_q", cu_q, total_q)
    _check_values("cu_seqlens_kv", cu_kv, total_kv)
    seq_q, pos_q = _positions(cu_q, total_q)
    seq_kv, pos_kv = _positions(cu_kv, total_kv)
    found = Packing(seq_q, pos_q, seq_kv, pos_kv, cu_q.numel() - 1)
    _packings[key] = (weakref.ref(cu_q), weakref.ref(cu_kv), found)
    while len(_packings) > _MAX_CACHED:
        _packings.popitem(last=False)
    return found


def packed_mods(
    score_mod: Callable[..., Any] | None,
    block_mask: object,
    pack: Packing,
    num_heads: int,
) -> tuple[Callable[..., Any] | None, Callable[..., Any]]:
    """The score_mod and mask_mod of the concatenated call (Note [Packed batches as mods])."""
    if isinstance(block_mask, BlockMask):
        raise ValueError(
            "a packed call (cu_seqlens_q/cu_seqlens_kv) takes block_mask as a mask_mod or None: "
            "its mods see positions within each sequence, which a prebuilt BlockMask cannot"
        )
    if block_mask is not None and not callable(block_mask):
        raise TypeError(
            f"block_mask must be a mask_mod(b, h, q_idx, kv_idx) or None, got {type(block_mask).__name__}"
        )
    return _packed_score(bind_heads(score_mod, num_heads), pack), _packed_mask(block_mask, pack)


def _packed_score(score_mod, pack: Packing):
    if score_mod is None:
        return None
    seq_q, pos_q, pos_kv = pack.seq_q, pack.pos_q, pack.pos_kv

    def packed(score, b, h, q_idx, kv_idx):
        return score_mod(score, seq_q[q_idx], h, pos_q[q_idx], pos_kv[kv_idx])

    packed.__name__ = f"packed_{getattr(score_mod, '__name__', 'score_mod')}"
    return packed


def _packed_mask(mask_mod, pack: Packing):
    seq_q, pos_q, seq_kv, pos_kv = pack.seq_q, pack.pos_q, pack.seq_kv, pack.pos_kv
    if mask_mod is None:

        def packed(b, h, q_idx, kv_idx):
            return seq_q[q_idx] == seq_kv[kv_idx]

    else:

        def packed(b, h, q_idx, kv_idx):
            same = seq_q[q_idx] == seq_kv[kv_idx]
            return same & mask_mod(seq_q[q_idx], h, pos_q[q_idx], pos_kv[kv_idx])

    packed.__name__ = f"packed_{getattr(mask_mod, '__name__', 'sequences')}"
    return packed
