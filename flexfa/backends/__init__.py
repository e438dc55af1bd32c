"""Attention backends. `auto` tries them in this order: fa4 (FlashAttention-4's kernels with
generated mods, where it measured fastest: Note [Which backend auto picks] in
flexfa/backends/fa4.py), triton (CUDA), then tiled (any device)."""

from flexfa.backends.base import Backend, Support, explain, names, register, register_lazy, select

register_lazy("fa4", "flexfa.backends.fa4")
register_lazy("triton", "flexfa.backends.triton")
register_lazy("tiled", "flexfa.backends.tiled")

__all__ = ["Backend", "Support", "explain", "names", "register", "register_lazy", "select"]
