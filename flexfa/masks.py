"""Common mask_mods and combinators.

Every mask here is a plain function `mask_mod(b, h, q_idx, kv_idx) -> bool` (True = attend), so it
also works with torch FlexAttention. Indices are absolute positions: `causal` is aligned to the top
left (query i sees keys 0..i), as in torch FlexAttention, also when Q_LEN != KV_LEN.

>>> import torch, flexfa
>>> q = k = v = torch.randn(1, 2, 300, 64)
>>> out = flexfa.attention(q, k, v, block_mask=flexfa.masks.sliding_window(128))
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MaskMod = Callable[..., object]


def causal(b, h, q_idx, kv_idx):
    """Query i attends to keys 0..i."""
    return q_idx >= kv_idx


def noop_mask(b, h, q_idx, kv_idx):
    """Every pair attends."""
    return q_idx.new_ones((), dtype=torch.bool)


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def sliding_window(window: int, *, causal: bool = True) -> MaskMod:
    """Attend to the `window` nearest keys.

    causal=True (default): query i sees keys i - window + 1 .. i (itself and window - 1 before it).
    causal=False: keys with |i - j| < window on both sides.
    """
    _check_positive("window", window)
    if causal:

        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    else:

        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx < window) & (kv_idx - q_idx < window)

    return sliding_window


def prefix_lm(prefix_length: int) -> MaskMod:
    """Bidirectional attention over the first `prefix_length` keys, causal after them."""
    _check_positive("prefix_length", prefix_length)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_length) | (q_idx >= kv_idx)

    return prefix_lm


def chunked(chunk_size: int) -> MaskMod:
    """Block-diagonal: query and key attend when they fall in the same chunk of `chunk_size`.

    Combine with `causal` for chunked causal attention (`and_masks(causal, chunked(8192))`).
    """
    _check_positive("chunk_size", chunk_size)

    def chunked(b, h, q_idx, kv_idx):
        return q_idx // chunk_size == kv_idx // chunk_size

    return chunked


def dilated_sliding_window(window: int, dilation: int) -> MaskMod:
    """Keys within `window` on either side whose distance is a multiple of `dilation`."""
    _check_positive("window", window)
    _check_positive("dilation", dilation)

    def dilated_sliding_window(b, h, q_idx, kv_idx):
        distance = torch.abs(q_idx - kv_idx)
        return (distance < window) & (distance % dilation == 0)

    return dilated_sliding_window


def document(doc_ids: torch.Tensor, kv_doc_ids: torch.Tensor | None = None) -> MaskMod:
    """Packed documents: a query attends to keys of the same document.

    Args:
        doc_ids: integer document id per query position, shape (Q_LEN,) or (B, Q_LEN).
        kv_doc_ids: the same for key positions, when it differs from `doc_ids` (Q_LEN != KV_LEN).

    Combine with `causal` for causal attention within each document.
    """
    q_ids = _check_doc_ids("doc_ids", doc_ids)
    kv_ids = q_ids if kv_doc_ids is None else _check_doc_ids("kv_doc_ids", kv_doc_ids)
    if kv_ids.ndim != q_ids.ndim:
        raise ValueError("doc_ids and kv_doc_ids must both be 1-D or both be 2-D (B, L)")
    if q_ids.ndim == 1:

        def document(b, h, q_idx, kv_idx):
            return q_ids[q_idx] == kv_ids[kv_idx]

    else:

        def document(b, h, q_idx, kv_idx):
            return q_ids[b, q_idx] == kv_ids[b, kv_idx]

    return document


def _check_doc_ids(name: str, ids: object) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of document ids, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise TypeError(f"{name} must hold integers, got {ids.dtype}")
    if ids.ndim not in (1, 2):
        raise ValueError(f"{name} must have shape (L,) or (B, L), got {tuple(ids.shape)}")
    return ids


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask that allows a pair when every one of `mask_mods` does."""
    if not mask_mods:
        raise ValueError("and_masks needs at least one mask_mod")
    mods = tuple(mask_mods)

    def and_masks(b, h, q_idx, kv_idx):
        result = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            result = result & m(b, h, q_idx, kv_idx)
        return result

    return and_masks


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask that allows a pair when any one of `mask_mods` does."""
    if not mask_mods:
        raise ValueError("or_masks needs at least one mask_mod")
    mods = tuple(mask_mods)

    def or_masks(b, h, q_idx, kv_idx):
        result = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            result = result | m(b, h, q_idx, kv_idx)
        return result

    return or_masks


__all__ = [
    "and_masks",
    "causal",
    "chunked",
    "dilated_sliding_window",
    "document",
    "noop_mask",
    "or_masks",
    "prefix_lm",
    "sliding_window",
]
