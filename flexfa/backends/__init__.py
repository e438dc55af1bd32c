"""Attention backends. `auto` tries them in this order: triton (CUDA), then tiled (any device)."""

from flexfa.backends.base import Backend, Support, explain, names, register, register_lazy, select

register_lazy("triton", "flexfa.codegen.triton.backend")
register_lazy("tiled", "flexfa.backends.tiled")

__all__ = ["Backend", "Support", "explain", "names", "register", "register_lazy", "select"]
