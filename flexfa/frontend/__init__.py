"""Tracing score_mods and mask_mods into IR (no torch.compile): see `trace.py`, `proxy.py` (the
traced values) and `optable.py` (the torch operations on them)."""

from flexfa.frontend.proxy import ModTraceError, Proxy
from flexfa.frontend.trace import TracedMod, trace, trace_mask_mod, trace_score_mod

__all__ = ["ModTraceError", "Proxy", "TracedMod", "trace", "trace_mask_mod", "trace_score_mod"]
