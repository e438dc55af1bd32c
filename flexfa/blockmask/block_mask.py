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
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from flexfa.frontend.trace import TracedMod

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask


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
        if self.index.shape[-1] > 1 and self.index.stride(-1) != 1:
            # Kernels take strides for every dimension but the last of `index` (its entries are
            # read as a row); a transposed or stepped view from a user is copied once, here.
            object.__setattr__(self, "index", self.index.contiguous())

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
        """The lists of a bool tensor [B, H, rows, cols] (True = listed), ascending.

        Entries past a row's count are 0 (unspecified, but in range). O(B * H * rows * cols).
        """
        cols = selected.shape[-1]
        rank = torch.cumsum(selected, -1, dtype=torch.int32)  # 1 + position among the listed
        count = rank[..., -1].contiguous()
        # Each listed column goes to its rank - 1; the others to a spare column, dropped after.
        pos = torch.where(selected, rank - 1, cols).long()
        index = torch.zeros(
            *selected.shape[:-1], cols + 1, dtype=torch.int32, device=selected.device
        )
        ids = torch.arange(cols, dtype=torch.int32, device=selected.device).expand(selected.shape)
        index.scatter_(-1, pos, ids)
        return BlockList(count, index[..., :cols].contiguous())


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """The tile classification of a mask for given sequence lengths. See the module docstring.

    Build one with `flexfa.create_block_mask`, `BlockMask.from_kv_blocks` or
    `BlockMask.from_torch`; pass it to `flexfa.attention(..., block_mask=bm)`.

    `tiles_from_mask` is True when every tile state was computed from `mask` (so a full tile is
    one where `mask` allows every in-range pair, and the states can be recomputed for other
    lengths), False when the block lists were given by the user (`from_kv_blocks`, `from_torch`)
    and are authoritative on their own.

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
    tiles_from_mask: bool = True

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
        tiles_from_mask: bool = True,
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
            tiles_from_mask=tiles_from_mask,
        )

    @staticmethod
    def buffer_sizes(batch: int, heads: int, num_q_blocks: int, num_kv_blocks: int) -> tuple:
        """The sizes of the eight parts of a buffer of block lists (Note [Block lists in one
        buffer]): the counts of kv_partial, kv_full, q_partial, q_full, then their indices."""
        planes = batch * heads
        nq, nkv = num_q_blocks, num_kv_blocks
        return (planes * nq, planes * nq, planes * nkv, planes * nkv) + (planes * nq * nkv,) * 4

    @staticmethod
    def from_buffer(
        buffer: torch.Tensor,
        *,
        batch: int,
        heads: int,
        q_len: int,
        kv_len: int,
        block_size: BlockSize,
        mask: TracedMod,
    ) -> BlockMask:
        """The BlockMask of views into `buffer`, where one of flexfa's block-mask kernels wrote its
        four lists in the order of `buffer_sizes` (Note [Block lists in one buffer])."""
        nq, nkv = -(-q_len // block_size.q), -(-kv_len // block_size.kv)
        B, H = batch, heads
        shapes = (
            ((B, H, nq),) * 2 + ((B, H, nkv),) * 2 + ((B, H, nq, nkv),) * 2 + ((B, H, nkv, nq),) * 2
        )
        at = buffer.storage_offset()
        views = []
        for size, shape in zip(BlockMask.buffer_sizes(B, H, nq, nkv), shapes):
            views.append(buffer.as_strided(shape, _strides(shape), at))  # cheaper than a split
            at += size
        kv_partial, kv_full, q_partial, q_full = (
            _unchecked(BlockList, count=views[k], index=views[k + 4]) for k in range(4)
        )
        return _unchecked(
            BlockMask,
            q_len=q_len,
            kv_len=kv_len,
            block_size=block_size,
            kv_partial=kv_partial,
            kv_full=kv_full,
            q_partial=q_partial,
            q_full=q_full,
            mask=mask,
            tiles_from_mask=True,
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

    @functools.cached_property
    def partial_fraction(self) -> float:
        """The share of non-empty tiles that are partial (evaluate the mask_mod), over the stored
        (b, h); 0.0 for a mask without non-empty tiles. Computed once per BlockMask.

        >>> import flexfa
        >>> bm = flexfa.create_block_mask(flexfa.masks.causal, None, None, 512, 512, device="cpu")
        >>> bm.partial_fraction  # 4 diagonal tiles of 10 non-empty ones
        0.4
        """
        partial = int(self.kv_partial.count.sum())
        full = int(self.kv_full.count.sum())
        return partial / (partial + full) if partial + full else 0.0

    def sparsity(self) -> float:
        """Percentage of tiles that are skipped (empty), over all (b, h) of the stored dims."""
        return 100.0 * (1.0 - self._density)

    def __repr__(self) -> str:
        return (
            f"BlockMask(shape={self.shape}, block_size=({self.block_size.q}, {self.block_size.kv}), "
            f"sparsity={self.sparsity():.2f}%, mask_mod={self.mask.name})"
        )

    # -- other formats --------------------------------------------------------------------------
    @staticmethod
    def from_kv_blocks(
        kv_num_blocks: torch.Tensor,
        kv_indices: torch.Tensor,
        full_kv_num_blocks: torch.Tensor | None = None,
        full_kv_indices: torch.Tensor | None = None,
        BLOCK_SIZE: int | tuple[int, int] = 128,
        mask_mod: Callable[..., object] | TracedMod | None = None,
        seq_lengths: tuple[int, int] | None = None,
    ) -> BlockMask:
        """A BlockMask from kv-side block lists you built yourself (the q-side is computed).

        Args:
            kv_num_blocks, kv_indices: partial KV blocks per q-block, shapes [B, H, rows] and
                [B, H, rows, cols] (leading dims may be omitted); the first `kv_num_blocks` entries
                of each row of `kv_indices` are the blocks.
            full_kv_num_blocks, full_kv_indices: the same for full blocks (run without mask_mod);
                a block listed in both is full.
            BLOCK_SIZE: int or (q, kv).
            mask_mod: evaluated on partial blocks (default: every pair attends).
            seq_lengths: (Q_LEN, KV_LEN); default rows * q-block and cols * kv-block.

        The lists are authoritative: a listed full block attends at all its in-range pairs.

        >>> import torch, flexfa
        >>> bm = flexfa.BlockMask.from_kv_blocks(torch.tensor([1, 2]), torch.tensor([[0, 0], [0, 1]]),
        ...                                      BLOCK_SIZE=64, mask_mod=flexfa.masks.causal)
        >>> bm.q_partial.count.tolist(), bm.shape
        ([[[2, 1]]], (1, 1, 128, 128))
        """
        from flexfa.blockmask.interop import from_kv_blocks

        return from_kv_blocks(
            kv_num_blocks,
            kv_indices,
            full_kv_num_blocks,
            full_kv_indices,
            BLOCK_SIZE=BLOCK_SIZE,
            mask_mod=mask_mod,
            seq_lengths=seq_lengths,
        )

    @staticmethod
    def from_torch(block_mask: object, mask_mod: Callable[..., object] | None = None) -> BlockMask:
        """A flexfa BlockMask with the tiles of a `torch.nn.attention.flex_attention.BlockMask`.

        Its mask_mod is traced by flexfa; pass `mask_mod=` when torch's cannot be traced (e.g. the
        placeholder of a sliced torch BlockMask).

        >>> import torch, flexfa
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> tbm = create_block_mask(flexfa.masks.causal, None, None, 256, 256, device="cpu")
        >>> flexfa.BlockMask.from_torch(tbm).kv_full.count.tolist()
        [[[0, 1]]]
        """
        from flexfa.blockmask.interop import from_torch

        return from_torch(block_mask, mask_mod)

    def to_torch(self) -> TorchBlockMask:
        """The same tiles as a `torch.nn.attention.flex_attention.BlockMask` (lists are shared).

        >>> import flexfa
        >>> bm = flexfa.create_block_mask(flexfa.masks.causal, None, None, 256, 256)
        >>> bm.to_torch().full_kv_num_blocks.tolist()
        [[[0, 1]]]
        """
        from flexfa.blockmask.interop import to_torch

        return to_torch(self)

    # -- views ----------------------------------------------------------------------------------
    def __getitem__(self, index: int | slice | tuple[int | slice, ...]) -> BlockMask:
        """Some batch elements, heads and q-blocks: `bm[b]`, `bm[b, h]`, `bm[:, 2:4]`, `bm[:, :, i]`.

        Integer indices keep their dim (size 1). The mask is re-indexed too, so partial tiles
        still evaluate `mask_mod` at the original batch element and head. A third index selects
        q-block rows (an int or a slice of step 1): `bm[:, :, i]` is the BlockMask of query rows
        `i * block_size.q` onwards (as many as the block holds), whose query row 0 is row
        `i * block_size.q` of `bm`. For one decoding step at position p use
        `bm.resize(q_len=1, kv_len=L, q_offset=p)`.

        >>> import torch, flexfa
        >>> doc = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
        >>> bm = flexfa.create_block_mask(flexfa.masks.document(doc), 2, None, 4, 4, BLOCK_SIZE=2)
        >>> bm[1].shape, bm[1].tile_states().tolist()
        ((1, 1, 4, 4), [[[[1, 1], [1, 2]]]])
        >>> bm[:, :, 1].shape, bm[:, :, 1].tile_states().tolist()
        ((2, 1, 2, 4), [[[[0, 2]]], [[[1, 2]]]])
        """
        from flexfa.blockmask.transform import select

        return select(self, index)

    def resize(
        self, q_len: int | None = None, kv_len: int | None = None, *, q_offset: int = 0
    ) -> BlockMask:
        """The BlockMask for other lengths, where query row i is row `i + q_offset` of this mask.

        For decoding with a KV cache of length L: `bm.resize(q_len=1, kv_len=L, q_offset=L - 1)`.
        The new mask is `mask_mod(b, h, q_idx + q_offset, kv_idx)`. When the tiles came from the
        mask, they are reclassified, analytically where the mask allows (O(tiles), no per-pair
        work); BlockMasks from user block lists are sliced instead, which needs `q_offset` to be a
        multiple of the q block size and the new tiles to lie within the old ones.

        >>> import flexfa
        >>> bm = flexfa.create_block_mask(flexfa.masks.sliding_window(128), None, None, 1024, 1024)
        >>> step = bm.resize(q_len=1, kv_len=300, q_offset=299)  # query 299 sees keys 172..299
        >>> step.tile_states().tolist()
        [[[[0, 1, 2]]]]
        """
        from flexfa.blockmask.transform import resize

        return resize(self, q_len=q_len, kv_len=kv_len, q_offset=q_offset)

    def __and__(self, other: BlockMask) -> BlockMask:
        """Pairs both masks allow: tiles from the two tile grids, mask `and_masks(m1, m2)`.

        >>> import flexfa
        >>> a = flexfa.create_block_mask(flexfa.masks.causal, None, None, 512, 512)
        >>> b = flexfa.create_block_mask(flexfa.masks.sliding_window(128), None, None, 512, 512)
        >>> (a & b).sparsity()
        56.25
        """
        from flexfa.blockmask.transform import combine

        return combine(self, other, "and")

    def __or__(self, other: BlockMask) -> BlockMask:
        """Pairs either mask allows: tiles from the two tile grids, mask `or_masks(m1, m2)`."""
        from flexfa.blockmask.transform import combine

        return combine(self, other, "or")

    # -- display --------------------------------------------------------------------------------
    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """A drawing of the tiles: `██` full, `░░` partial, blank empty.

        Grids larger than `grid_size` (rows, cols; -1 for no limit) are summarized: a cell
        standing for several tiles is full or empty only if all of them are. At most `limit`
        (b, h) planes are drawn.

        >>> import flexfa
        >>> print(flexfa.create_block_mask(flexfa.masks.causal, None, None, 384, 384).to_string())
        ░░
        ██░░
        ████░░
        """
        from flexfa.blockmask.render import to_string

        return to_string(self, grid_size=grid_size, limit=limit)

    def __str__(self) -> str:
        return self.to_string()

    def plot(self, path: str | os.PathLike[str], *, b: int = 0, h: int = 0) -> None:
        """Write a PNG picture of the tiles of batch element `b` and head `h` to `path`.

        Needs matplotlib (`pip install flexfa[plot]`).
        """
        from flexfa.blockmask.render import plot

        plot(self, path, b=b, h=h)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`."""
    if len(shape) == 3:
        return (shape[1] * shape[2], shape[2], 1)
    return (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)


def _unchecked(cls: type, **fields: object):
    """An instance of the frozen dataclass `cls` from all its `fields`, without `__post_init__`
    (Note [Block lists in one buffer])."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)  # the frozen dataclasses here have no slots
    return obj


# Note [Block lists in one buffer]
# flexfa's block-mask kernels (flexfa/codegen/triton/blockmask/fused.py, packed_fused.py) write the four lists of
# a BlockMask into one int32 buffer, one allocation: the counts of kv_partial, kv_full, q_partial
# and q_full ([B, H, rows] each), then their indices ([B, H, rows, cols] each), with the sizes of
# `BlockMask.buffer_sizes`; `BlockMask.from_buffer` makes the BlockMask of views into it. Those
# views are int32, contiguous and of consistent shapes by construction, so it skips the checks of
# BlockList and BlockMask (their `__post_init__`) and makes each view with one `as_strided`: a
# packed batch builds its BlockMask anew at every batch, and on a 2-core CPU the checks, a split
# and eight views took 30 us of the kernel path's 79 us per packed BlockMask (from_buffer: 17).


# Note [Block masks built on first read]
# A packed call (cu_seqlens_q, cu_seqlens_kv) needs the BlockMask of its concatenation only where
# a backend runs the concatenation (Note [Packed batches as mods] in flexfa/varlen.py); FA4's
# varlen kernels take the offsets and the user's own mods instead (Note [Packed calls on FA4's
# varlen path] in flexfa/codegen/cute/backend.py), and read neither its block lists nor the
# packed positions that the block-list kernel writes. Building them anyway was most of a packed
# call's host work before the kernels. So `flexfa.attention` gives a packed call's spec a
# `DeferredBlockMask`: what is known without building (lengths, block size, the traced mask, its
# (B, H) dims and device) is set, and the four lists are built by the first read of any of them
# (its `build` then also writes the positions), or by `attention` itself once the chosen backend
# says it runs the concatenation (`Backend.reads_packed_mods`), before anything runs: no backend
# ever reads positions that were not written. `dataclasses.replace`, a copy or a pickle builds the
# lists first (the last two give a plain BlockMask).
_LISTS = frozenset({"kv_partial", "kv_full", "q_partial", "q_full"})


class DeferredBlockMask(BlockMask):
    """A BlockMask whose block lists are built when first read (Note [Block masks built on first
    read]). Make one with `DeferredBlockMask.of`; `build` is called at most once and must return
    the BlockMask of the same lengths, block size, (B, H) dims and device."""

    @staticmethod
    def of(
        *,
        q_len: int,
        kv_len: int,
        block_size: BlockSize,
        mask: TracedMod,
        batch: int,
        heads: int,
        device: torch.device,
        build: Callable[[], BlockMask],
    ) -> DeferredBlockMask:
        obj = object.__new__(DeferredBlockMask)
        obj.__dict__.update(
            q_len=q_len,
            kv_len=kv_len,
            block_size=block_size,
            mask=mask,
            tiles_from_mask=True,
            _pending=(batch, heads, device, build, threading.Lock()),
        )
        return obj

    @property
    def built(self) -> bool:
        """Whether the block lists exist yet."""
        return "kv_partial" in self.__dict__

    def materialize(self) -> None:
        """Build the block lists now, if not yet."""
        if self.built:
            return
        batch, heads, device, build, lock = self.__dict__["_pending"]
        with lock:
            if self.built:
                return
            bm = build()
            got = (bm.q_len, bm.kv_len, bm.block_size, bm.batch, bm.heads, bm.device)
            want = (self.q_len, self.kv_len, self.block_size, batch, heads, device)
            if got != want:
                raise AssertionError(f"deferred BlockMask built as {got}, announced as {want}")
            self.__dict__.update({name: getattr(bm, name) for name in _LISTS})

    def __getattr__(self, name: str):  # only for attributes not set: the lists before a build
        if name in _LISTS and "_pending" in self.__dict__:
            self.materialize()
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # (B, H) and device without a build; from the lists once built (or when made by
    # `dataclasses.replace`, which passes every field and no `_pending`).
    @property
    def batch(self) -> int:
        return self.kv_partial.count.shape[0] if self.built else self._pending[0]

    @property
    def heads(self) -> int:
        return self.kv_partial.count.shape[1] if self.built else self._pending[1]

    @property
    def device(self) -> torch.device:
        return self.kv_partial.count.device if self.built else self._pending[2]

    def __reduce__(self):
        self.materialize()
        return (BlockMask, tuple(getattr(self, f.name) for f in dataclasses.fields(BlockMask)))
