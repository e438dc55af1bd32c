"""flexfa: a programmable attention compiler for PyTorch.

Write an attention variant as two small functions, `score_mod(score, b, h, q_idx, kv_idx)` and
`mask_mod(b, h, q_idx, kv_idx)`; flexfa traces them (no torch.compile), classifies tiles as full,
partial or empty, and runs fused forward and backward kernels (Triton on GPU, a tiled PyTorch
backend anywhere).

>>> import torch, flexfa
>>> q, k, v = (torch.randn(2, 4, 256, 64) for _ in range(3))
>>> out = flexfa.attention(q, k, v, score_mod=flexfa.mods.alibi, block_mask=flexfa.masks.causal)
"""

from flexfa import masks, mods
from flexfa.api import AuxOutput, AuxRequest, attention, build_spec, explain_backend
from flexfa.blockmask.block_mask import BlockList, BlockMask, BlockSize, TileState
from flexfa.blockmask.build import create_block_mask

# Registers the Triton block-mask kernels with flexfa.blockmask (Note [Block-mask kernels by
# registration] in flexfa/blockmask/kernels.py).
from flexfa.codegen.triton import blockmask as _triton_block_masks  # noqa: F401
from flexfa.config import config
from flexfa.export import export_source
from flexfa.frontend import ModTraceError, trace_mask_mod, trace_score_mod
from flexfa.frontend.lowerings import register_lowering
from flexfa.masks import and_masks, noop_mask, or_masks
from flexfa.merge import merge_attention
from flexfa.paged import PagedKVCache
from flexfa.runtime import diskcache
from flexfa.version import __version__

__all__ = [
    "AuxOutput",
    "AuxRequest",
    "BlockList",
    "BlockMask",
    "BlockSize",
    "ModTraceError",
    "PagedKVCache",
    "TileState",
    "__version__",
    "and_masks",
    "attention",
    "build_spec",
    "config",
    "create_block_mask",
    "diskcache",
    "explain_backend",
    "export_source",
    "masks",
    "merge_attention",
    "mods",
    "noop_mask",
    "or_masks",
    "register_lowering",
    "trace_mask_mod",
    "trace_score_mod",
]
