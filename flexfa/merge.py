"""Merging attention over disjoint key sets by their log-sum-exps.

If keys are split into two disjoint sets A and B, the attention of a query row over A ∪ B follows
from the two partial results alone: with lse = log(exp(lse_a) + exp(lse_b)),

    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b.

Cascade (shared-prefix) attention, split-KV decoding and context parallelism all reduce to this.

# Note [Stable merge]
# Both weights are computed relative to m = max(lse_a, lse_b), so no exp overflows, and m is
# detached: the merged values do not depend on m mathematically (it cancels), so its gradient is
# exactly zero and leaving it out of the graph avoids differentiating through `max` at ties. A side
# with lse = -inf (no allowed key) gets weight 0; when both are -inf the row stays empty (out 0, lse
# -inf) and every weight is 0 instead of exp(-inf - -inf) = NaN, so gradients stay finite too.
"""

from __future__ import annotations

import math

import torch


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets, from each set's output and LSE.

    Args:
        out_a, out_b: (..., Lq, Ev) outputs of attention over key sets A and B, one dtype.
        lse_a, lse_b: (..., Lq) their natural-log LSEs (as `flexfa.attention(..., return_lse=True)`
            returns them); `-inf` marks a row with no allowed key in that set.

    Returns:
        (out, lse): out in the dtype of `out_a`, lse in the dtype of `lse_a`. A row empty on both
        sides gets out 0 and lse -inf, never NaN. Differentiable with respect to all four inputs
        (Note [Stable merge]).

    >>> import torch, flexfa
    >>> q, k, v = (torch.randn(1, 2, 5, 16, dtype=torch.float64) for _ in range(3))
    >>> o1, l1 = flexfa.attention(q, k[:, :, :3], v[:, :, :3], return_lse=True)
    >>> o2, l2 = flexfa.attention(q, k[:, :, 3:], v[:, :, 3:], return_lse=True)
    >>> out, lse = flexfa.merge_attention(o1, l1, o2, l2)
    >>> torch.allclose(out, flexfa.attention(q, k, v))
    True
    """
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if out_a.shape != out_b.shape:
        raise ValueError(
            f"out_a and out_b must have one shape, got {tuple(out_a.shape)} and {tuple(out_b.shape)}"
        )
    if out_a.dtype != out_b.dtype:
        raise TypeError(f"out_a and out_b must share a dtype, got {out_a.dtype} and {out_b.dtype}")
    if out_a.ndim < 1:
        raise ValueError("out_a must have at least one dim (..., Ev)")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != out_a.shape[:-1]:
            raise ValueError(
                f"{name} must have shape {tuple(out_a.shape[:-1])} (out's shape without its last "
                f"dim), got {tuple(t.shape)}"
            )
    if lse_a.dtype != lse_b.dtype:
        raise TypeError(f"lse_a and lse_b must share a dtype, got {lse_a.dtype} and {lse_b.dtype}")
    compute = torch.float64 if torch.float64 in (out_a.dtype, lse_a.dtype) else torch.float32
    la, lb = lse_a.to(compute), lse_b.to(compute)
    m = torch.maximum(la, lb).detach()
    m = torch.where(torch.isneginf(m), 0.0, m)  # both sides empty: any finite m will do
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    empty = total == 0
    total_safe = torch.where(empty, 1.0, total)
    lse = torch.where(empty, -math.inf, m + torch.log(total_safe))
    wa, wb = (wa / total_safe).unsqueeze(-1), (wb / total_safe).unsqueeze(-1)
    out = wa * out_a.to(compute) + wb * out_b.to(compute)
    return out.to(out_a.dtype), lse.to(lse_a.dtype)
