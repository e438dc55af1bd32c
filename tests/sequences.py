"""The reference of a packed call (`cu_seqlens_q=`, `cu_seqlens_kv=`): each sequence alone through
flexfa's reference, its mods seeing `b` = the sequence's index, the results concatenated."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from flexfa.mods import bind_heads
from flexfa.reference import reference_attention


def offsets(lens: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """The (B + 1,) int32 offsets of sequences of these lengths."""
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).to(device)


def per_sequence_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Callable[..., object] | None,
    mask_mod: Callable[..., object] | None,
    lens_q: Sequence[int],
    lens_kv: Sequence[int],
    *,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the packed call on q (1, Hq, sum(lens_q), E), k and v (1, Hkv, sum(lens_kv),
    *), computed in `dtype` (the eager error of a kernel dtype, or the float64 reference), returned
    in q's dtype and differentiable. A sequence without keys has empty rows: output 0, LSE -inf."""
    cq, ck = offsets(lens_q).tolist(), offsets(lens_kv).tolist()
    score_mod = bind_heads(score_mod, q.shape[1])
    outs, lses = [], []
    for s in range(len(lens_q)):
        qs = q[:, :, cq[s] : cq[s + 1]]
        ks, vs = k[:, :, ck[s] : ck[s + 1]], v[:, :, ck[s] : ck[s + 1]]
        if qs.shape[2] == 0:
            continue
        if ks.shape[2] == 0:  # no keys: empty rows
            outs.append(qs.new_zeros(*qs.shape[:3], v.shape[3]) * qs.sum())
            lses.append(torch.full(qs.shape[:3], -math.inf, dtype=qs.dtype))
            continue
        sm = (lambda sc, b, h, i, j, s=s: score_mod(sc, b + s, h, i, j)) if score_mod else None
        mm = (lambda b, h, i, j, s=s: mask_mod(b + s, h, i, j)) if mask_mod else None
        o, lse = reference_attention(qs, ks, vs, sm, mm, enable_gqa=True, dtype=dtype)
        outs.append(o.to(qs.dtype))
        lses.append(lse.to(qs.dtype))
    return torch.cat(outs, 2), torch.cat(lses, 2)
