"""Common score_mods.

A score_mod is `score_mod(score, b, h, q_idx, kv_idx) -> new score`; `score` is already scaled.
Some mods need a size known only at call time (ALiBi's slopes depend on the number of heads); they
are `HeadsDependentMod`s, which `flexfa.attention` binds to the call's shapes before tracing.

>>> import torch, flexfa
>>> from flexfa.mods import alibi
>>> from flexfa.masks import sliding_window
>>> q = k = v = torch.randn(1, 4, 256, 64)
>>> out = flexfa.attention(q, k, v, score_mod=alibi, block_mask=sliding_window(128))
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

ScoreMod = Callable[..., object]


class HeadsDependentMod:
    """A score_mod family indexed by the number of query heads; `bind(num_heads)` gives the mod.

    Calling it directly (outside `flexfa.attention`) raises, since the head count is unknown.
    """

    def __init__(self, name: str, make: Callable[[int], ScoreMod], doc: str) -> None:
        self.__name__ = name
        self._make = make
        self._bound: dict[int, ScoreMod] = {}  # one function per head count, so traces are reused
        self.__doc__ = doc

    def bind(self, num_heads: int) -> ScoreMod:
        bound = self._bound.get(num_heads)
        if bound is not None:
            return bound
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(
                f"{self.__name__}: num_heads must be a positive int, got {num_heads!r}"
            )
        bound = self._bound[num_heads] = self._make(num_heads)
        return bound

    def __call__(self, score, b, h, q_idx, kv_idx):
        raise TypeError(
            f"{self.__name__} depends on the number of heads; flexfa.attention binds it "
            f"automatically, elsewhere use {self.__name__}.bind(num_heads)"
        )

    def __repr__(self) -> str:
        return f"<flexfa score_mod {self.__name__} (bound to the number of heads at call time)>"


def _alibi(num_heads: int) -> ScoreMod:
    # Slope of head h is 2 ** (-8 (h + 1) / H) (Press et al.; the closed form for every H). It is
    # computed from h inside the mod, so no slope table is captured.
    exponent = -8.0 / num_heads

    def alibi(score, b, h, q_idx, kv_idx):
        slope = torch.exp2((h + 1) * exponent)
        return score + slope * (kv_idx - q_idx)

    return alibi


alibi = HeadsDependentMod(
    "alibi",
    _alibi,
    """ALiBi: adds slope_h * (kv_idx - q_idx), slope_h = 2 ** (-8 (h + 1) / H) for H query heads.

    Pass it as `score_mod=flexfa.mods.alibi`; the number of heads is taken from the call.
    """,
)


def identity(score, b, h, q_idx, kv_idx):
    """The score unchanged (plain softmax attention)."""
    return score


def softcap(cap: float) -> ScoreMod:
    """Soft-capping (Gemma 2, Grok): `cap * tanh(score / cap)` keeps scores in (-cap, cap)."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0 or math.isinf(cap):
        raise ValueError(f"cap must be a positive finite number, got {cap!r}")
    cap = float(cap)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return softcap


def relative_bias(table: torch.Tensor, max_distance: int | None = None) -> ScoreMod:
    """Adds a learned bias per clipped relative distance (T5-style, without log buckets).

    Args:
        table: shape (2 * max_distance + 1,) shared by all heads, or (H, 2 * max_distance + 1)
            per query head. Entry `d + max_distance` is the bias for q_idx - kv_idx = d, with d
            clipped to [-max_distance, max_distance]. It may require grad: flexfa computes its
            gradient.
        max_distance: defaults to (table.shape[-1] - 1) // 2.
    """
    if not isinstance(table, torch.Tensor) or not table.dtype.is_floating_point:
        raise TypeError("table must be a floating-point tensor")
    if table.ndim not in (1, 2) or table.shape[-1] % 2 != 1:
        raise ValueError(
            f"table must have shape (2*D+1,) or (H, 2*D+1) with an odd last dim, got {tuple(table.shape)}"
        )
    if max_distance is None:
        max_distance = (table.shape[-1] - 1) // 2
    if (
        not isinstance(max_distance, int)
        or max_distance < 0
        or 2 * max_distance + 1 > table.shape[-1]
    ):
        raise ValueError(
            f"max_distance {max_distance!r} does not fit a table of {table.shape[-1]} entries"
        )
    bias = table
    if table.ndim == 1:

        def relative_bias(score, b, h, q_idx, kv_idx):
            d = torch.clamp(q_idx - kv_idx, -max_distance, max_distance)
            return score + bias[d + max_distance]

    else:

        def relative_bias(score, b, h, q_idx, kv_idx):
            d = torch.clamp(q_idx - kv_idx, -max_distance, max_distance)
            return score + bias[h, d + max_distance]

    return relative_bias


def bind_heads(score_mod: ScoreMod | None, num_heads: int) -> ScoreMod | None:
    """Resolve a `HeadsDependentMod` for a call with `num_heads` query heads."""
    if isinstance(score_mod, HeadsDependentMod):
        return score_mod.bind(num_heads)
    return score_mod


__all__ = ["HeadsDependentMod", "alibi", "bind_heads", "identity", "relative_bias", "softcap"]
