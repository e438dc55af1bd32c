"""Context parallelism: one attention over a sequence sharded across the ranks of a process group.

>>> from flexfa.distributed import shard_sequence, unshard_sequence, context_parallel_attention
>>> q_l, k_l, v_l = shard_sequence((q, k, v), balance="head_tail")  # doctest: +SKIP
>>> out_l = context_parallel_attention(q_l, k_l, v_l, mask_mod=flexfa.masks.causal,
...                                    balance="head_tail", method="ring")  # doctest: +SKIP
>>> out = unshard_sequence(out_l, balance="head_tail")  # doctest: +SKIP

Built on torch.distributed alone (NCCL on GPUs, gloo on the CPU). Modules: `layout` (the
balancers), `comm` (groups, ring exchange, gather/reduce-scatter), `blocks` (one block's forward and
backward with global positions), `ring`, `cost` (`method="auto"`), `api`. docs/distributed.md has
the methods, the balancers, the gradient rule for captured tensors and measured figures.
"""

from flexfa.distributed.api import context_parallel_attention, shard_sequence, unshard_sequence
from flexfa.distributed.layout import Document, Layout, resolve_layout

__all__ = [
    "Document",
    "Layout",
    "context_parallel_attention",
    "resolve_layout",
    "shard_sequence",
    "unshard_sequence",
]
