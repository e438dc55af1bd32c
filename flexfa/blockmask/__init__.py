"""Block masks: which tiles of the (q, kv) plane are full, partial or empty.

- `block_mask`: the `BlockMask` structure (block lists, tile states) and its methods.
- `build`: `create_block_mask` and `classify`, the tiers that decide tiles:
  `analysis` (with `intervals` and `lines`) proves tiles from the mask's IR, `witness` proves
  partial tiles with two pairs, refinement re-analyzes sub-rectangles, `exact` evaluates the
  rest. `grid` holds the tile geometry they share. On CUDA, generated kernels registered in
  `kernels` (flexfa/codegen/triton/blockmask, planned by `fused_plan`) do the analysis,
  witnesses and block lists in one kernel, and the exact tier's evaluation.
- `packed`: the BlockMask of a packed call's mask from its offsets (flexfa/varlen.py), which
  `create_block_mask` tries first (Note [Block mask builders]).
- `bind`: building and caching a BlockMask when `flexfa.attention` receives a mask_mod.
- `interop` (torch's BlockMask, user block lists), `transform` (indexing, resize, & and |) and
  `render` (text and PNG pictures).

docs/blockmask.md explains the tiers and the cache rule.
"""

from flexfa.blockmask.block_mask import BlockList, BlockMask, BlockSize, TileState
from flexfa.blockmask.build import Classification, classify, create_block_mask

__all__ = [
    "BlockList",
    "BlockMask",
    "BlockSize",
    "Classification",
    "TileState",
    "classify",
    "create_block_mask",
]
