"""`create_block_mask`: from a mask_mod to a `BlockMask`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flexfa.blockmask.block_mask import BlockMask, BlockSize
from flexfa.blockmask.exact import classify_exact
from flexfa.frontend.trace import TracedMod, trace_mask_mod


def _check_len(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_dim(name: str, value: object) -> int | None:
    if value is None:
        return None
    return _check_len(name, value)


def create_block_mask(
    mask_mod: Callable[..., object] | TracedMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
) -> BlockMask:
    """Classify every tile of `mask_mod` as full, partial or empty, without a dense mask.

    Args:
        mask_mod: `mask_mod(b, h, q_idx, kv_idx) -> bool` (True = attend).
        B, H: batch size and number of query heads, or None when the mask does not depend on them
            (stored once and broadcast). A mask that does not read `b` (or `h`) is stored once even
            when B (or H) is given.
        Q_LEN, KV_LEN: sequence lengths.
        device: where the block lists live (defaults to the device of the mask's captured tensors,
            else CPU).
        BLOCK_SIZE: tile size, an int or a (q, kv) pair.

    >>> import flexfa
    >>> bm = flexfa.create_block_mask(flexfa.masks.sliding_window(256), None, None, 1024, 1024)
    >>> print(bm.to_string())  # doctest: +NORMALIZE_WHITESPACE
    ░░
    ██░░
      ██░░
        ██░░
    """
    _check_dim("B", B)
    _check_dim("H", H)
    _check_len("Q_LEN", Q_LEN)
    _check_len("KV_LEN", KV_LEN)
    block_size = BlockSize.of(BLOCK_SIZE)
    traced = mask_mod if isinstance(mask_mod, TracedMod) else trace_mask_mod(mask_mod)
    if device is None:
        device = traced.tensors[0].device if traced.tensors else torch.device("cpu")
    device = torch.device(device)
    for cap, t in zip(traced.captures, traced.tensors):
        if t.device != device:
            raise ValueError(
                f"mask_mod {traced.name!r} captures {cap.name!r} on {t.device}, but the block mask "
                f"is built on {device}; move the tensor or pass device={t.device}"
            )
    for dim, value, var in (("B", B, "b"), ("H", H, "h")):
        if value is None and var in traced.variables:
            raise ValueError(
                f"mask_mod {traced.name!r} depends on {var!r}, so {dim} must be given "
                f"(None means the mask is the same for every {var})"
            )
    batch = B if (B is not None and "b" in traced.variables) else 1
    heads = H if (H is not None and "h" in traced.variables) else 1
    states = classify_exact(
        traced,
        batch=batch,
        heads=heads,
        q_len=Q_LEN,
        kv_len=KV_LEN,
        block_size=block_size,
        device=device,
    )
    return BlockMask.from_tile_states(
        states, q_len=Q_LEN, kv_len=KV_LEN, block_size=block_size, mask=traced
    )
