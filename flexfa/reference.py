"""The semantics of `flexfa.attention`, as dense code. Small sizes only (it builds Lq x Lkv).

This is the oracle every backend is tested against. It calls the user's mods directly (not through
flexfa's tracer), so it also checks the tracer. docs/semantics.md says the same in words.

# Note [Mods are applied per pair]
# A mod is a scalar function of one (score, b, h, q_idx, kv_idx). The reference applies it at every
# pair with `torch.func.vmap` over the four index dims, as torch FlexAttention's math path does, so
# the mod sees 0-dim values exactly as the tracer's proxies model them. Calling it once on broadcast
# index tensors instead would be faster but is not the same function: chained indexing
# `table[b][h]` indexes the wrong dims, and a 0-dim capture no longer takes part in type promotion.

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
from flexfa.mods import bind_heads

# vmap levels from the innermost (kv_idx) to the outermost (b): in_dims of (b, h, q_idx, kv_idx).
_LEVELS = (
    (None, None, None, 0),
    (None, None, 0, None),
    (None, 0, None, None),
    (0, None, None, None),
)


def apply_per_pair(
    fn: Callable[..., object],
    B: int,
    H: int,
    Lq: int,
    Lkv: int,
    device: torch.device,
    score: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fn` evaluated at every (b, h, q_idx, kv_idx) (Note [Mods are applied per pair]).

    With `score` ([B, H, Lq, Lkv]) `fn` is a score_mod, else a mask_mod. Index values are int32.
    Returns a [B, H, Lq, Lkv] tensor of whatever dtype `fn` returns; differentiable.
    """
    indices = [torch.arange(n, device=device, dtype=torch.int32) for n in (B, H, Lq, Lkv)]

    def scalar(*args: object) -> torch.Tensor:
        return torch.as_tensor(fn(*args), device=device)

    f = scalar
    prefix = () if score is None else (0,)
    for dims in _LEVELS:
        f = torch.func.vmap(f, in_dims=prefix + dims, out_dims=0)
    args = indices if score is None else [score, *indices]
    out = f(*args)
    if out.ndim > 4 and all(n == 1 for n in out.shape[4:]):  # a mod returning shape [1] (or [1, 1])
        out = out.reshape(out.shape[:4])
    return out.expand(B, H, Lq, Lkv)


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
    shape = torch.Size([B, H, Lq, Lkv])
    if mask_mod is None and block_mask is not None:
        mask_mod = block_mask.mask_mod
    if mask_mod is None:
        allowed = torch.ones(shape, dtype=torch.bool, device=device)
    else:
        allowed = apply_per_pair(mask_mod, B, H, Lq, Lkv, device)
        if allowed.dtype != torch.bool:
            raise TypeError(f"mask_mod must return bools, got {allowed.dtype}")
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

    k and v may be float8 (Note [fp8 K/V] in flexfa/spec.py): like every input they are converted
    to `dtype`, which is exact for float64, float32, float16 and bfloat16.

    1. s = (q @ k^T) * scale, with scale = 1/sqrt(E) by default; query head h uses KV head
       h // (Hq // Hkv); k and v of batch size 1 serve every query batch element.
    2. s = score_mod(s, b, h, q_idx, kv_idx) at every pair, with int32 indices (Note [Mods are
       applied per pair]); a `flexfa.mods.HeadsDependentMod` such as `alibi` is bound to Hq.
    3. Pairs the mask excludes get s = -inf.
    4. lse = logsumexp over keys (natural log); out = softmax(s) @ v. A row whose scores are all
       -inf has lse = -inf and out = 0.
    Gradients flow through torch autograd (to q, k, v and captured tensors that require grad).
    """
    B, Hq, Lq, E = q.shape
    Hkv, Lkv = k.shape[1], k.shape[2]
    k, v = k.to(dtype), v.to(dtype)  # before expanding: float8 K/V upcast once, exactly
    if k.shape[0] != B:  # K/V batch broadcast: autograd sums dk/dv over the batch
        k, v = k.expand(B, *k.shape[1:]), v.expand(B, *v.shape[1:])
    if Hq != Hkv:
        if not enable_gqa:
            raise ValueError("q and k/v have different head counts; pass enable_gqa=True")
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
    s = torch.matmul(qd, kd.transpose(-1, -2)) * scale
    device = q.device
    score_mod = bind_heads(score_mod, Hq)
    if score_mod is not None:
        s = apply_per_pair(score_mod, B, Hq, Lq, Lkv, device, score=s).to(dtype)
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
