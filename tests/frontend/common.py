"""Evaluate a mod two ways: traced by flexfa and evaluated as IR, or called eagerly per pair."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flexfa.blockmask.exact import index_grids
from flexfa.frontend import TracedMod, trace_mask_mod, trace_score_mod
from flexfa.ir import Evaluator
from flexfa.reference import apply_per_pair

B, H, LQ, LKV = 2, 3, 7, 9


def scores(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, LQ, LKV, generator=g, dtype=torch.float64) * 2).to(dtype)


def traced_values(traced: TracedMod, score: torch.Tensor | None = None) -> torch.Tensor:
    """The traced IR evaluated on the [B, H, LQ, LKV] grid (float32 nodes in score's dtype)."""
    env = index_grids(B, H, torch.arange(LQ), torch.arange(LKV), torch.device("cpu"))
    float_dtype = torch.float32
    if score is not None:
        env["score"] = score
        float_dtype = score.dtype
    value = Evaluator(env, traced.tensors, float_dtype=float_dtype, scalars=traced.scalar_values)(
        traced.output
    )
    return value.expand(B, H, LQ, LKV)


def eager_values(fn: Callable[..., object], score: torch.Tensor | None = None) -> torch.Tensor:
    """The mod called per pair on ordinary tensors (flexfa.reference's way)."""
    return apply_per_pair(fn, B, H, LQ, LKV, torch.device("cpu"), score=score)


def trace(fn: Callable[..., object], kind: str) -> TracedMod:
    return trace_score_mod(fn) if kind == "score_mod" else trace_mask_mod(fn)
