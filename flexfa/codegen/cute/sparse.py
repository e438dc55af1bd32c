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
# (64 or 128 here); on sm100 the q block must be a multiple of two 128-row tiles (FA4 runs two q
# tiles per CTA there, `q_stage`), and the KV block a multiple of tile_n. So flexfa passes lists
# of 128 x 128 blocks on sm90 and 256 x 128 on sm100/sm110 (`fa4_block_size`), head dims up to 128.
# A BlockMask of other blocks that divide those is coarsened (`coarsen`, Note [Coarsening a
# BlockMask]); blocks that do not divide them, and head dims above 128, are not wired.
# The sm90 backward with block sparsity picks 64-row tiles at head dims 65..128, where a score_mod
# gave wrong gradients (Note [Backward with a score_mod] in backend.py): with a score_mod at those
# head dims the backward passes the mask_mod alone, on every tile.
#
# On the H200 the four block-sparse cases of tests/codegen/cute/test_gpu.py (document-causal,
# prefix-LM with softcap, a dilated window, rows with no allowed key) matched the float64
# reference, forward and backward, so the lists are used by default wherever `why_not_sparse`
# allows them; `{"block_sparse": True}` insists (a call that cannot take them is refused) and
# `{"block_sparse": False}` evaluates the mask_mod on every tile instead. The sm100 lists (256-row
# q blocks) are compiled here (tests/codegen/cute/test_compile.py), never run: there is no
# Blackwell GPU in this workplace.
#
# The lists of a BlockMask are built once per BlockMask and arch and kept with it
# (`_per_mask`): a call that reuses its BlockMask launches no copy or padding kernels of its own
# before FA4's.

# Note [Coarsening a BlockMask]
# A tile of the coarse grid covers whole tiles of the fine one: it is empty when all of them are,
# full when all of them are, partial otherwise (sub-tiles past the sequence end count as neither).
# That is exact for a BlockMask whose tile states come from its mask_mod (`tiles_from_mask`):
# "empty" then means the mask_mod is False on every pair of the tile and "full" True, so running
# the mask_mod on a coarse partial tile gives each pair the answer the fine tiles gave. A
# BlockMask built from the user's own block lists is authoritative instead (docs/semantics.md):
# its empty tiles may hold pairs the mask_mod allows. Coarsened, such pairs would attend, so these
# masks are not coarsened (`why_not_sparse` says so and the mask_mod runs on every tile).
"""

from __future__ import annotations

import dataclasses

import torch

from flexfa.blockmask.block_mask import BlockList, BlockMask, BlockSize, TileState
from flexfa.layout import row_major

FA4_SPARSE_BLOCK = BlockSize(128, 128)  # sm90
FA4_SPARSE_BLOCK_SM100 = BlockSize(256, 128)  # sm100 / sm110: two 128-row q tiles per CTA


@dataclasses.dataclass(frozen=True, eq=False)
class SparseLists:
    """One pass's lists in FA4's form (int32, index padded to the full number of blocks)."""

    mask_cnt: torch.Tensor
    mask_idx: torch.Tensor
    full_cnt: torch.Tensor
    full_idx: torch.Tensor
    block_size: tuple[int, int]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The lists by FA4's names."""
        return {
            "mask_block_cnt": self.mask_cnt,
            "mask_block_idx": self.mask_idx,
            "full_block_cnt": self.full_cnt,
            "full_block_idx": self.full_idx,
        }

    def to_fa4(self, tensors: dict[str, torch.Tensor] | None = None):
        """FA4's BlockSparseTensorsTorch of these lists (those of `tensors`, by FA4's names, where
        given)."""
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        lists = self.tensors() if tensors is None else tensors
        return BlockSparseTensorsTorch(
            **{name: lists[name] for name in self.tensors()}, block_size=self.block_size
        )


def fa4_block_size(arch_major: int) -> BlockSize:
    """The block size of the lists flexfa passes FA4 on this arch (Note [Block-sparse lists for
    FA4])."""
    return FA4_SPARSE_BLOCK_SM100 if arch_major in (10, 11) else FA4_SPARSE_BLOCK


def why_not_sparse(bm: BlockMask, head_dim: int, head_dim_v: int, arch_major: int) -> str | None:
    """Why this call cannot use FA4's block-sparse lists, or None."""
    if arch_major not in (9, 10, 11):
        return "block-sparse lists are wired for sm90 and sm100/sm110 only"
    if head_dim > 128 or head_dim_v > 128:
        return "block-sparse lists need head dims up to 128 (FA4's 128-wide KV tiles)"
    target, have = fa4_block_size(arch_major), bm.block_size
    if target.q % have.q or target.kv % have.kv:
        return (
            f"block-sparse lists need BlockMask blocks that divide {target.q} x {target.kv} on "
            f"sm{arch_major}0, got {have.q} x {have.kv}"
        )
    if have != target and not bm.tiles_from_mask:
        return (
            f"a BlockMask built from block lists of {have.q} x {have.kv} blocks cannot be "
            f"coarsened to FA4's {target.q} x {target.kv} exactly (Note [Coarsening a BlockMask])"
        )
    return None


def coarsen(bm: BlockMask, target: BlockSize) -> BlockMask:
    """`bm` at a coarser block size whose sides are multiples of its own (Note [Coarsening a
    BlockMask]); `bm` itself when the sizes are equal.

    >>> import flexfa
    >>> bm = flexfa.create_block_mask(flexfa.masks.causal, None, None, 384, 384, device="cpu")
    >>> coarsen(bm, BlockSize(256, 128)).tile_states().tolist()  # 2 x 3 tiles of 256 x 128
    [[[[1, 1, 0], [2, 2, 1]]]]
    """
    have = bm.block_size
    if target == have:
        return bm
    if target.q % have.q or target.kv % have.kv:
        raise ValueError(f"cannot coarsen {have.q} x {have.kv} blocks to {target.q} x {target.kv}")
    fq, fk = target.q // have.q, target.kv // have.kv
    states = bm.tile_states().to(torch.int16)
    B, H, nq, nk = states.shape
    pad = (0, -nk % fk, 0, -nq % fq)
    states = torch.nn.functional.pad(states, pad, value=-1)  # -1: past the sequence end
    tiles = states.view(B, H, states.shape[2] // fq, fq, states.shape[3] // fk, fk)
    outside = tiles == -1
    empty = ((tiles == int(TileState.EMPTY)) | outside).all(5).all(3)
    full = ((tiles == int(TileState.FULL)) | outside).all(5).all(3)
    coarse = torch.full(empty.shape, int(TileState.PARTIAL), dtype=torch.int8, device=empty.device)
    coarse[empty] = int(TileState.EMPTY)
    coarse[full] = int(TileState.FULL)
    return BlockMask.from_tile_states(
        coarse,
        q_len=bm.q_len,
        kv_len=bm.kv_len,
        block_size=target,
        mask=bm.mask,
        tiles_from_mask=bm.tiles_from_mask,
    )


def _padded(bl: BlockList, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = bl.index
    if idx.shape[-1] < width:
        idx = torch.nn.functional.pad(idx, (0, width - idx.shape[-1]))
    # Row-major strides even for size-1 dims: FA4 checks the unit stride of the last dim after
    # broadcasting (Note [Aux tensor layouts] in launch.py).
    return row_major(bl.count), row_major(idx[..., :width])


def _per_mask(bm: BlockMask, key: tuple, build):
    """`build()`, kept with `bm` under `key` (the BlockMask is immutable; its lists live as long
    as it does)."""
    cache = bm.__dict__.setdefault("_fa4_sparse_lists", {})
    if key not in cache:
        cache[key] = build()
    return cache[key]


def _lists(bm: BlockMask, arch_major: int, side: str) -> SparseLists:
    def build():
        c = coarsen(bm, fa4_block_size(arch_major))
        if side == "forward":
            n, partial, full = c.num_kv_blocks, c.kv_partial, c.kv_full
        else:
            n, partial, full = c.num_q_blocks, c.q_partial, c.q_full
        block = (c.block_size.q, c.block_size.kv)
        return SparseLists(*_padded(partial, n), *_padded(full, n), block)

    return _per_mask(bm, (side, arch_major), build)


def forward_lists(bm: BlockMask, arch_major: int = 9) -> SparseLists:
    """Per q-block, its KV blocks (mask = partial, full = full), at FA4's block size."""
    return _lists(bm, arch_major, "forward")


def backward_lists(bm: BlockMask, arch_major: int = 9) -> SparseLists:
    """Per KV block, its q-blocks (FA4's backward walks q-blocks for each KV block), at FA4's
    block size."""
    return _lists(bm, arch_major, "backward")
