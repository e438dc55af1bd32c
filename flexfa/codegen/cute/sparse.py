"""flexfa's BlockMask as FA4's block-sparse tile lists (by default where they are wired;
`kernel_options={"block_sparse": False}` with `backend="fa4"` turns them off).

# Note [Block-sparse lists for FA4]
# FA4's kernels take, per q-block, the KV blocks to visit with the mask_mod ("mask" blocks) and
# without it ("full" blocks), and for the backward the transposed lists (per KV block, its
# q-blocks). flexfa's BlockMask holds exactly these four lists (kv_partial, kv_full, q_partial,
# q_full); FA4 names them mask_block_cnt / mask_block_idx / full_block_cnt / full_block_idx, with
# the block size, and broadcasts batch or head dims of size 1 as flexfa does. Empty tiles are in
# no list and are skipped.
# FA4 constrains the block size per arch and pass: on sm90 its KV block must equal the kernel's
# tile_n (128 for head dims up to 128) and its q block must be a multiple of the kernel's tile_m
# (64 or 128 here), so a BlockMask of 128 x 128 blocks is used as it is. Other block sizes, head
# dims above 128 and sm100 (whose q blocks are 256 rows) are not wired yet.
# The sm90 backward with block sparsity picks 64-row tiles at head dims 65..128, where a score_mod
# gave wrong gradients (Note [Backward with a score_mod] in backend.py): with a score_mod at those
# head dims the backward passes the mask_mod alone, on every tile.
#
# On the H200 the four block-sparse cases of tests/codegen/cute/test_gpu.py (document-causal,
# prefix-LM with softcap, a dilated window, rows with no allowed key) matched the float64
# reference, forward and backward, so the lists are used by default wherever `why_not_sparse`
# allows them; `{"block_sparse": True}` insists (a call that cannot take them is refused) and
# `{"block_sparse": False}` evaluates the mask_mod on every tile instead. Their speed against
# that mask_mod-everywhere path has not been measured yet.
"""

from __future__ import annotations

import dataclasses

import torch

from flexfa.blockmask.block_mask import BlockList, BlockMask, BlockSize
from flexfa.layout import row_major

FA4_SPARSE_BLOCK = BlockSize(128, 128)


@dataclasses.dataclass(frozen=True, eq=False)
class SparseLists:
    """One pass's lists in FA4's form (int32, index padded to the full number of blocks)."""

    mask_cnt: torch.Tensor
    mask_idx: torch.Tensor
    full_cnt: torch.Tensor
    full_idx: torch.Tensor
    block_size: tuple[int, int]

    def to_fa4(self):
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        return BlockSparseTensorsTorch(
            mask_block_cnt=self.mask_cnt,
            mask_block_idx=self.mask_idx,
            full_block_cnt=self.full_cnt,
            full_block_idx=self.full_idx,
            block_size=self.block_size,
        )


def why_not_sparse(bm: BlockMask, head_dim: int, head_dim_v: int, arch_major: int) -> str | None:
    """Why this call cannot use FA4's block-sparse lists, or None."""
    if arch_major != 9:
        return "block-sparse lists are wired for sm90 only"
    if head_dim > 128 or head_dim_v > 128:
        return "block-sparse lists need head dims up to 128 (FA4's 128-wide KV tiles)"
    if bm.block_size != FA4_SPARSE_BLOCK:
        return (
            f"block-sparse lists need a BlockMask of {FA4_SPARSE_BLOCK.q} x {FA4_SPARSE_BLOCK.kv} "
            f"blocks, got {bm.block_size.q} x {bm.block_size.kv}"
        )
    return None


def _padded(bl: BlockList, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = bl.index
    if idx.shape[-1] < width:
        idx = torch.nn.functional.pad(idx, (0, width - idx.shape[-1]))
    # Row-major strides even for size-1 dims: FA4 checks the unit stride of the last dim after
    # broadcasting (Note [Aux tensor layouts] in launch.py).
    return row_major(bl.count), row_major(idx[..., :width])


def forward_lists(bm: BlockMask) -> SparseLists:
    """Per q-block, its KV blocks (mask = partial, full = full)."""
    n = bm.num_kv_blocks
    mask_cnt, mask_idx = _padded(bm.kv_partial, n)
    full_cnt, full_idx = _padded(bm.kv_full, n)
    return SparseLists(mask_cnt, mask_idx, full_cnt, full_idx, (bm.block_size.q, bm.block_size.kv))


def backward_lists(bm: BlockMask) -> SparseLists:
    """Per KV block, its q-blocks (FA4's backward walks q-blocks for each KV block)."""
    n = bm.num_q_blocks
    mask_cnt, mask_idx = _padded(bm.q_partial, n)
    full_cnt, full_idx = _padded(bm.q_full, n)
    return SparseLists(mask_cnt, mask_idx, full_cnt, full_idx, (bm.block_size.q, bm.block_size.kv))
