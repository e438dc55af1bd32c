"""`BlockMask`: which tiles of the (q, kv) plane are full, partial or empty.

The plane of one (batch, head) is cut into tiles of `block_size.q` query rows by `block_size.kv`
key columns. A tile is
- *empty* when the mask allows none of its pairs: kernels skip it;
- *full* when the mask allows all of its in-range pairs: kernels run it without evaluating the mask;
- *partial* otherwise: kernels evaluate `mask_mod` on every pair.

Pairs beyond the sequence lengths (the padding of the last row or column of tiles) never count:
kernels mask them separately. The BlockMask is authoritative: a kernel trusts it, so a hand-built
BlockMask that calls a tile full makes all of that tile's pairs attend.

Stored as block lists, the format torch FlexAttention uses and kernels read:
- kv-side lists, one row per q-block: `kv_partial` and `kv_full` give, for each (b, h, q-block),
  how many KV blocks of that kind there are and their indices in ascending order (forward and dQ);
- q-side lists, one row per KV-block: `q_partial` and `q_full`, the transposes (dK/dV).

Leading dims are (B, H); a size of 1 means the mask does not depend on that dim and broadcasts.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import torch

from flexfa.frontend.trace import TracedMod


class TileState(enum.IntEnum):
    EMPTY = 0
    PARTIAL = 1
    FULL = 2


@dataclasses.dataclass(frozen=True)
class BlockSize:
    """Tile shape: `q` query rows by `kv` key columns."""

    q: int
    kv: int

    def __post_init__(self) -> None:
        for name in ("q", "kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BLOCK_SIZE {name} must be a positive int, got {value!r}")

    @staticmethod
    def of(value: int | tuple[int, int] | BlockSize) -> BlockSize:
        """Accepts an int (square tiles), a (q, kv) tuple or a BlockSize."""
        if isinstance(value, BlockSize):
            return value
        if isinstance(value, int):
            return BlockSize(value, value)
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return BlockSize(int(value[0]), int(value[1]))
        raise ValueError(f"BLOCK_SIZE must be an int or a (q, kv) pair, got {value!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class BlockList:
    """For each (b, h, row): `count[b, h, row]` blocks, listed ascending in `index[b, h, row, :count]`.

    Entries of `index` past `count` are unspecified. Both tensors are int32.
    """

    count: torch.Tensor  # [B, H, rows]
    index: torch.Tensor  # [B, H, rows, cols]

    def __post_init__(self) -> None:
        if self.count.dtype != torch.int32 or self.index.dtype != torch.int32:
            raise TypeError("BlockList count and index must be int32 tensors")
        if self.count.ndim != 3 or self.index.ndim != 4 or self.index.shape[:3] != self.count.shape:
            raise ValueError(
                f"BlockList shapes must be count [B, H, rows] and index [B, H, rows, cols], got "
                f"{tuple(self.count.shape)} and {tuple(self.index.shape)}"
            )

    def to(self, device: torch.device | str) -> BlockList:
        return BlockList(self.count.to(device), self.index.to(device))

    def dense(self, cols: int) -> torch.Tensor:
        """A bool tensor [B, H, rows, cols]: True where a block is listed."""
        B, H, rows = self.count.shape
        out = torch.zeros(B, H, rows, cols + 1, dtype=torch.bool, device=self.count.device)
        width = self.index.shape[-1]
        valid = torch.arange(width, device=self.count.device) < self.count[..., None]
        idx = torch.where(
            valid, self.index.long(), cols
        )  # spill unused entries into a dummy column
        out.scatter_(-1, idx, True)
        return out[..., :cols]

    @staticmethod
    def from_dense(selected: torch.Tensor) -> BlockList:
        """The lists of a bool tensor [B, H, rows, cols] (True = listed), ascending."""
        count = selected.sum(-1, dtype=torch.int32)
        # A stable descending sort of the 0/1 flags puts the listed columns first, in index order.
        index = torch.sort(selected.to(torch.int8), dim=-1, descending=True, stable=True).indices
        return BlockList(count.contiguous(), index.to(torch.int32).contiguous())


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """The tile classification of a mask for given sequence lengths. See the module docstring.

    Build one with `flexfa.create_block_mask`, `BlockMask.from_kv_blocks` or
    `BlockMask.from_torch`; pass it to `flexfa.attention(..., block_mask=bm)`.

    >>> import flexfa
    >>> bm = flexfa.create_block_mask(flexfa.masks.causal, None, None, 256, 256, BLOCK_SIZE=128)
    >>> bm.kv_full.count.tolist(), bm.kv_partial.count.tolist()
    ([[[0, 1]]], [[[1, 1]]])
    """

    q_len: int
    kv_len: int
    block_size: BlockSize
    kv_partial: BlockList
    kv_full: BlockList
    q_partial: BlockList
    q_full: BlockList
    mask: TracedMod

    def __post_init__(self) -> None:
        if self.q_len < 1 or self.kv_len < 1:
            raise ValueError(
                f"sequence lengths must be positive, got ({self.q_len}, {self.kv_len})"
            )
        nq, nkv = self.num_q_blocks, self.num_kv_blocks
        for name, bl, rows in (
            ("kv_partial", self.kv_partial, nq),
            ("kv_full", self.kv_full, nq),
            ("q_partial", self.q_partial, nkv),
            ("q_full", self.q_full, nkv),
        ):
            if bl.count.shape[2] != rows:
                raise ValueError(
                    f"BlockMask.{name} has {bl.count.shape[2]} rows; expected {rows} for lengths "
                    f"({self.q_len}, {self.kv_len}) and block size ({self.block_size.q}, {self.block_size.kv})"
                )
            if bl.count.shape[:2] != self.kv_partial.count.shape[:2]:
                raise ValueError("all block lists of a BlockMask must share their (B, H) dims")
        if self.mask.kind != "mask_mod":
            raise TypeError("BlockMask.mask must be a traced mask_mod")

    # -- shape ----------------------------------------------------------------------------------
    @property
    def num_q_blocks(self) -> int:
        return -(-self.q_len // self.block_size.q)

    @property
    def num_kv_blocks(self) -> int:
        return -(-self.kv_len // self.block_size.kv)

    @property
    def batch(self) -> int:
        """Size of the batch dim (1 = same for every batch element)."""
        return self.kv_partial.count.shape[0]

    @property
    def heads(self) -> int:
        """Size of the head dim (1 = same for every head)."""
        return self.kv_partial.count.shape[1]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.q_len, self.kv_len)

    @property
    def device(self) -> torch.device:
        return self.kv_partial.count.device

    @property
    def mask_mod(self):
        """The user's mask_mod function."""
        return self.mask.fn

    # -- dense views (O(B * H * tiles)) ---------------------------------------------------------
    def tile_states(self) -> torch.Tensor:
        """int8 [B, H, q-blocks, kv-blocks] of `TileState` values, built from the kv-side lists."""
        nkv = self.num_kv_blocks
        states = self.kv_partial.dense(nkv).to(torch.int8) * int(TileState.PARTIAL)
        full = self.kv_full.dense(nkv)
        return torch.where(full, torch.tensor(int(TileState.FULL), dtype=torch.int8), states)

    @staticmethod
    def from_tile_states(
        states: torch.Tensor,
        *,
        q_len: int,
        kv_len: int,
        block_size: BlockSize,
        mask: TracedMod,
    ) -> BlockMask:
        """Builds all four block lists from a dense tile-state grid [B, H, q-blocks, kv-blocks]."""
        if states.ndim != 4:
            raise ValueError(
                f"tile states must be [B, H, q-blocks, kv-blocks], got {tuple(states.shape)}"
            )
        partial = states == int(TileState.PARTIAL)
        full = states == int(TileState.FULL)
        return BlockMask(
            q_len=q_len,
            kv_len=kv_len,
            block_size=block_size,
            kv_partial=BlockList.from_dense(partial),
            kv_full=BlockList.from_dense(full),
            q_partial=BlockList.from_dense(partial.transpose(-1, -2)),
            q_full=BlockList.from_dense(full.transpose(-1, -2)),
            mask=mask,
        )

    def to(self, device: torch.device | str) -> BlockMask:
        """The same BlockMask with its lists (not the mask's captured tensors) on `device`."""
        return dataclasses.replace(
            self,
            kv_partial=self.kv_partial.to(device),
            kv_full=self.kv_full.to(device),
            q_partial=self.q_partial.to(device),
            q_full=self.q_full.to(device),
        )

    @functools.cached_property
    def _density(self) -> float:
        states = self.tile_states()
        return float((states != int(TileState.EMPTY)).float().mean())

    def sparsity(self) -> float:
        """Percentage of tiles that are skipped (empty), over all (b, h) of the stored dims."""
        return 100.0 * (1.0 - self._density)

    def __repr__(self) -> str:
        return (
            f"BlockMask(shape={self.shape}, block_size=({self.block_size.q}, {self.block_size.kv}), "
            f"sparsity={self.sparsity():.2f}%, mask_mod={self.mask.name})"
        )
