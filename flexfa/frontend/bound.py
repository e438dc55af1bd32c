"""A call's score_mod traced as a call traces it: its head count bound, the identity dropped.

`flexfa.attention`, `flexfa.build_spec` and the offline compiles (`python -m flexfa export`) all
trace a user's score_mod this way, so they compile the same kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from flexfa.frontend.trace import TracedMod, trace_score_mod
from flexfa.mods import bind_heads


def trace_call_score_mod(score_mod: Any, num_heads: int, device: torch.device) -> TracedMod | None:
    """Trace `score_mod` for a call with `num_heads` query heads on `device`
    (`flexfa.mods.bind_heads` first); None for no score_mod or one that returns the score as it
    is. A captured tensor on another device than the call's is an error that names it.

    >>> import torch, flexfa
    >>> trace_call_score_mod(flexfa.mods.alibi, 8, torch.device("cpu")).name
    'alibi'
    >>> trace_call_score_mod(flexfa.mods.identity, 8, torch.device("cpu")) is None
    True
    """
    if score_mod is None:
        return None
    traced = trace_score_mod(bind_heads(score_mod, num_heads), device=device)
    if traced.is_identity:
        return None
    for cap, t in zip(traced.captures, traced.tensors):
        if t.device != device:
            raise ValueError(
                f"score_mod {traced.name!r} captures {cap.name!r} on {t.device}, but q is on {device}; "
                "move the captured tensor to the inputs' device"
            )
    return traced
