"""The semantics of `flexfa.attention`, as dense code. Small sizes only (it builds Lq x Lkv).

This is the oracle every backend is tested against. It calls the user's mods directly on broadcast
index tensors (not through flexfa's tracer), so it also checks the tracer. docs/semantics.md says
the same in words.

>>> import torch
>>> from flexfa.reference import reference_attention
>>> q = k = v = torch.randn(1, 1, 5, 8, dtype=torch.float64)
>>> out, lse = reference_attention(q, k, v, mask_mod=lambda b, h, i, j: i >= j)
>>> out.shape, lse.shape
(torch.Size([1, 1, 5, 8]), torch.Size([1, 1, 5]))
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from flexfa.blockmask.block_mask import BlockMask, TileState


def _broadcast_bool(value: object, shape: torch.Size, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(value, device=device)
    if t.dtype != torch.bool:
        raise TypeError(f"mask_mod must return bools, got {t.dtype}")
    return t.expand(shape)


def allowed_pairs(
    mask_mod: Callable[..., object] | None,
    block_mask: BlockMask | None,
    B: int,
    H: int,
    Lq: int,
    Lkv: int,
    device: torch.device,
) -> torch.Tensor:
    """Dense bool [B, H, Lq, Lkv]: which pairs attend.

    With a BlockMask, its tiles are authoritative: empty tiles exclude all pairs, full tiles allow
    all pairs, partial tiles use the mask_mod (the BlockMask's own when `mask_mod` is None).
    """
    b = torch.arange(B, device=device, dtype=torch.int32).view(-1, 1, 1, 1)
    h = torch.arange(H, device=device, dtype=torch.int32).view(1, -1, 1, 1)
    qi = torch.arange(Lq, device=device, dtype=torch.int32).view(1, 1, -1, 1)
    kv = torch.arange(Lkv, device=device, dtype=torch.int32).view(1, 1, 1, -1)
    shape = torch.Size([B, H, Lq, Lkv])
    if mask_mod is None and block_mask is not None:
        mask_mod = block_mask.mask_mod
    allowed = (
        _broadcast_bool(mask_mod(b, h, qi, kv), shape, device)
        if mask_mod is not None
        else torch.ones(shape, dtype=torch.bool, device=device)
    )
    if block_mask is None:
        return allowed
    states = block_mask.tile_states().to(device)
    states = states.expand(B, H, *states.shape[2:])
    rows = torch.arange(Lq, device=device) // block_mask.block_size.q
    cols = torch.arange(Lkv, device=device) // block_mask.block_size.kv
    per_pair = states[:, :, rows][:, :, :, cols]
    return torch.where(
        per_pair == int(TileState.FULL), True, (per_pair == int(TileState.PARTIAL)) & allowed
    )


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Callable[..., object] | None = None,
    mask_mod: Callable[..., object] | None = None,
    *,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention with mods, computed in `dtype`. Returns (out in `dtype`, lse in `dtype`).

    1. s = (q @ k^T) * scale, with scale = 1/sqrt(E) by default; query head h uses KV head
       h // (Hq // Hkv).
    2. s = score_mod(s, b, h, q_idx, kv_idx), with int32 index tensors broadcast over [B, H, Lq, Lkv].
    3. Pairs the mask excludes get s = -inf.
    4. lse = logsumexp over keys (natural log); out = softmax(s) @ v. A row whose scores are all
       -inf has lse = -inf and out = 0.
    Gradients flow through torch autograd (to q, k, v and captured tensors that require grad).
    """
    B, Hq, Lq, E = q.shape
    Hkv, Lkv = k.shape[1], k.shape[2]
    if Hq != Hkv:
        if not enable_gqa:
            raise ValueError("q and k/v have different head counts; pass enable_gqa=True")
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
    s = torch.matmul(qd, kd.transpose(-1, -2)) * scale
    device = q.device
    if score_mod is not None:
        b = torch.arange(B, device=device, dtype=torch.int32).view(-1, 1, 1, 1)
        h = torch.arange(Hq, device=device, dtype=torch.int32).view(1, -1, 1, 1)
        qi = torch.arange(Lq, device=device, dtype=torch.int32).view(1, 1, -1, 1)
        kv = torch.arange(Lkv, device=device, dtype=torch.int32).view(1, 1, 1, -1)
        s = (
            torch.as_tensor(score_mod(s, b, h, qi, kv), device=device)
            .to(dtype)
            .expand(B, Hq, Lq, Lkv)
        )
    if mask_mod is not None or block_mask is not None:
        allowed = allowed_pairs(mask_mod, block_mask, B, Hq, Lq, Lkv, device)
        s = s.masked_fill(~allowed, -math.inf)
    # A numerically safe softmax whose gradient is also finite for rows with no allowed key.
    m = s.amax(dim=-1, keepdim=True)
    empty = torch.isneginf(m)
    e = torch.exp(s - torch.where(empty, 0.0, m))
    l = e.sum(dim=-1, keepdim=True)
    l_safe = torch.where(empty, 1.0, l)
    out = torch.matmul(e / l_safe, vd)
    lse = torch.where(empty, -math.inf, m + torch.log(l_safe)).squeeze(-1)
    return out, lse
