"""Attention backends. `auto` tries them in this order: triton (CUDA), then tiled (any device).
"fa4" (FlashAttention-4 kernels with generated mods) runs only when asked for by name."""

from flexfa.backends.base import Backend, Support, explain, names, register, register_lazy, select

register_lazy("triton", "flexfa.codegen.triton.backend")
register_lazy("fa4", "flexfa.backends.fa4")
register_lazy("tiled", "flexfa.backends.tiled")

__all__ = ["Backend", "Support", "explain", "names", "register", "register_lazy", "select"]
