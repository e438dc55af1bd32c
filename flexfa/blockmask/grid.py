"""`TileGrid`: the tiles of a block mask, and `TileList`: a selection of them.

Every tier of `create_block_mask` works on the same grid: `batch` x `heads` planes (1 where the mask
does not read `b` or `h`), each cut into `num_q_blocks` x `num_kv_blocks` tiles of
`block_size.q` x `block_size.kv` pairs. Tile (i, j) covers the *in-range* pairs
`q_idx in [q_lo[i], q_hi[i]]`, `kv_idx in [kv_lo[j], kv_hi[j]]` (the last row and column of tiles
are shorter when a length is not a multiple of the block size).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from flexfa.blockmask.block_mask import BlockSize


@dataclasses.dataclass(frozen=True)
class TileGrid:
    """The tile grid of one `create_block_mask` call."""

    batch: int
    heads: int
    q_len: int
    kv_len: int
    block_size: BlockSize
    device: torch.device

    def __post_init__(self) -> None:
        sizes = (self.batch, self.heads, self.q_len, self.kv_len)
        if all(type(n) is int for n in sizes) and min(sizes) >= 1:
            return
        for name in ("batch", "heads", "q_len", "kv_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TileGrid.{name} must be a positive int, got {value!r}")

    def __hash__(self) -> int:
        # Kept: grids key the caches of analyses and kernels, several lookups per BlockMask.
        found = self.__dict__.get("_hash")
        if found is None:
            found = self.__dict__["_hash"] = hash(
                (self.batch, self.heads, self.q_len, self.kv_len, self.block_size, self.device)
            )
        return found

    @property
    def num_q_blocks(self) -> int:
        return -(-self.q_len // self.block_size.q)

    @property
    def num_kv_blocks(self) -> int:
        return -(-self.kv_len // self.block_size.kv)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, heads, q-blocks, kv-blocks)."""
        return (self.batch, self.heads, self.num_q_blocks, self.num_kv_blocks)

    @property
    def num_tiles(self) -> int:
        b, h, nq, nkv = self.shape
        return b * h * nq * nkv

    def _bounds(self, n_blocks: int, size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = torch.arange(n_blocks, device=self.device, dtype=torch.int64) * size
        hi = torch.clamp(lo + size, max=length) - 1
        return lo, hi

    @functools.cached_property
    def q_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 [num_q_blocks]: first and last in-range q_idx of each q-block."""
        return self._bounds(self.num_q_blocks, self.block_size.q, self.q_len)

    @functools.cached_property
    def kv_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 [num_kv_blocks]: first and last in-range kv_idx of each kv-block."""
        return self._bounds(self.num_kv_blocks, self.block_size.kv, self.kv_len)


@dataclasses.dataclass(frozen=True, eq=False)
class TileList:
    """Some tiles of a grid, by coordinates: int64 tensors [T] of b, h, q-block and kv-block."""

    b: torch.Tensor
    h: torch.Tensor
    i: torch.Tensor
    j: torch.Tensor

    @staticmethod
    def where(selected: torch.Tensor) -> TileList:
        """The tiles where a bool [B, H, nq, nkv] tensor is True, in row-major order."""
        b, h, i, j = torch.nonzero(selected, as_tuple=True)
        return TileList(b, h, i, j)

    def __len__(self) -> int:
        return int(self.b.numel())

    def flat_index(self, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """Positions in a flattened [B, H, nq, nkv] tensor."""
        _, H, nq, nkv = shape
        return ((self.b * H + self.h) * nq + self.i) * nkv + self.j

    def chunks(self, size: int) -> list[TileList]:
        n = len(self)
        return [
            TileList(
                self.b[s : s + size],
                self.h[s : s + size],
                self.i[s : s + size],
                self.j[s : s + size],
            )
            for s in range(0, n, max(1, size))
        ]


@dataclasses.dataclass(frozen=True, eq=False)
class TileSet:
    """Rectangles of pairs the analysis bounds: per rectangle its b, h and in-range q_idx and kv_idx
    intervals, as int64 tensors that broadcast to `shape` (so a whole grid costs O(nq + nkv)).

    Every rectangle is non-empty (`q_lo <= q_hi`, `kv_lo <= kv_hi`). `grid` is set when the set
    is exactly the tiles of that grid, in its layout (which lets ranges along q_idx or kv_idx be
    computed block by block). `extent`, when set, bounds every rectangle's (rows, columns) on the
    host, so that range queries need not read the longest from the device.
    """

    b: torch.Tensor
    h: torch.Tensor
    q_lo: torch.Tensor
    q_hi: torch.Tensor
    kv_lo: torch.Tensor
    kv_hi: torch.Tensor
    shape: tuple[int, ...]
    grid: TileGrid | None = None
    extent: tuple[int, int] | None = None

    @staticmethod
    @functools.lru_cache(maxsize=32)
    def of_grid(grid: TileGrid) -> TileSet:
        """Every tile of the grid; shape (batch, heads, q-blocks, kv-blocks). Kept per grid (a GPU
        pays a launch for each of its small tensors); the tensors must not be written."""
        dev = grid.device
        q_lo, q_hi = (t.view(1, 1, -1, 1) for t in grid.q_bounds)
        kv_lo, kv_hi = (t.view(1, 1, 1, -1) for t in grid.kv_bounds)
        return TileSet(
            b=torch.arange(grid.batch, device=dev).view(-1, 1, 1, 1),
            h=torch.arange(grid.heads, device=dev).view(1, -1, 1, 1),
            q_lo=q_lo,
            q_hi=q_hi,
            kv_lo=kv_lo,
            kv_hi=kv_hi,
            shape=grid.shape,
            grid=grid,
        )

    @staticmethod
    def of_tiles(grid: TileGrid, tiles: TileList) -> TileSet:
        """The listed tiles of the grid, flat: shape (T,)."""
        q_lo, q_hi = (t[tiles.i] for t in grid.q_bounds)
        kv_lo, kv_hi = (t[tiles.j] for t in grid.kv_bounds)
        return TileSet(tiles.b, tiles.h, q_lo, q_hi, kv_lo, kv_hi, (len(tiles),))

    def select(self, keep: torch.Tensor) -> TileSet:
        """The rectangles of a flat set where `keep` is True."""
        fields = (self.b, self.h, self.q_lo, self.q_hi, self.kv_lo, self.kv_hi)
        kept = [f[keep] for f in fields]
        return TileSet(*kept, shape=(int(kept[0].numel()),))

    def split(self, parts: tuple[int, int], size: tuple[int, int]) -> TileSet:
        """Each rectangle of a flat set (nominally `size` = (rows, cols) pairs) cut into `parts`
        sub-rectangles, flat again: rectangle r becomes r * rows * cols ... (r + 1) * rows * cols - 1.

        Sub-rectangles past a rectangle's end (the last row or column of tiles is shorter) are
        clamped to its last pair: they repeat pairs, but every sub-rectangle lies inside its
        rectangle and together they cover it.
        """
        rows, cols = parts
        step_q, step_kv = -(-size[0] // rows), -(-size[1] // cols)
        dev = self.q_lo.device
        r = torch.arange(rows, device=dev).view(1, -1, 1) * step_q
        c = torch.arange(cols, device=dev).view(1, 1, -1) * step_kv
        q_lo, q_hi = self.q_lo.view(-1, 1, 1), self.q_hi.view(-1, 1, 1)
        kv_lo, kv_hi = self.kv_lo.view(-1, 1, 1), self.kv_hi.view(-1, 1, 1)
        sub_q_lo = torch.minimum(q_lo + r, q_hi)
        sub_kv_lo = torch.minimum(kv_lo + c, kv_hi)
        n = self.q_lo.numel() * rows * cols
        shape = (self.q_lo.numel(), rows, cols)
        return TileSet(
            b=self.b.view(-1, 1, 1).expand(shape).reshape(n),
            h=self.h.view(-1, 1, 1).expand(shape).reshape(n),
            q_lo=sub_q_lo.expand(shape).reshape(n),
            q_hi=torch.minimum(sub_q_lo + step_q - 1, q_hi).expand(shape).reshape(n),
            kv_lo=sub_kv_lo.expand(shape).reshape(n),
            kv_hi=torch.minimum(sub_kv_lo + step_kv - 1, kv_hi).expand(shape).reshape(n),
            shape=(n,),
        )
