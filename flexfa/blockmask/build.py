"""`create_block_mask`: from a mask_mod to a `BlockMask`, in three tiers.

1. Analysis of the mask's IR (`flexfa.blockmask.analysis`) proves tiles full, empty or partial for
   all tiles at once, in O(tiles) plus O(Q_LEN + KV_LEN) exact evaluations per (b, h).
2. Witnesses (`flexfa.blockmask.witness`) prove undecided tiles partial with two actual pairs.
3. Refinement: the same analysis on 8 x 8 sub-rectangles of each tile still undecided (bounds are
   tighter on smaller rectangles); the tile is full or empty if all its parts are, partial if one
   part is, or if one part is full and another empty.
4. Exact evaluation (`flexfa.blockmask.exact`, or a generated Triton kernel on CUDA) decides the
   rest, tile by tile, with memory O(chunk).

Memory is O(B * H * tiles) throughout; the dense B x H x Q_LEN x KV_LEN mask is never built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from flexfa.blockmask.analysis import Analyzer
from flexfa.blockmask.block_mask import BlockList, BlockMask, BlockSize, TileState
from flexfa.blockmask.exact import classify_exact, classify_tiles, evaluate_mask, index_grids
from flexfa.blockmask.grid import TileGrid, TileList, TileSet
from flexfa.blockmask.kernels import registered
from flexfa.blockmask.witness import prove_partial
from flexfa.config import config
from flexfa.frontend.trace import TracedMod, trace_mask_mod


@dataclasses.dataclass(frozen=True, eq=False)
class Classification:
    """Tile states of a grid, and how many tiles each tier decided."""

    states: torch.Tensor  # int8 [B, H, nq, nkv] of TileState
    analytic: int  # decided by the analysis of whole tiles
    witnessed: int  # proven partial by witnesses
    refined: int  # decided by the analysis of sub-rectangles
    evaluated: int  # decided by exact evaluation

    @property
    def tiles(self) -> int:
        return int(self.states.numel())


def _exact_tiles(mask: TracedMod, grid: TileGrid, tiles: TileList) -> torch.Tensor:
    if grid.device.type == "cuda":
        kernels = registered()  # Note [Block-mask kernels by registration]
        if kernels is not None and kernels.exact_available():
            return kernels.classify_tiles(mask, grid, tiles)
    return classify_tiles(mask, grid, tiles)


# Refinement: sub-rectangles per side at each level, and rectangles analyzed at once. A level is
# run only if it analyzes at most 1/_REFINE_RATIO as many rectangles as the open tiles have pairs,
# so refinement that does not pay off costs a few percent of the exact evaluation that follows.
_SPLIT = 8
_REFINE_CHUNK = 1 << 18
_REFINE_RATIO = 16


@dataclasses.dataclass(frozen=True)
class Decided:
    """How many pending tiles `decide` settled by each tier."""

    witnessed: int
    refined: int
    evaluated: int


def _take(tiles: TileList, keep: torch.Tensor) -> TileList:
    return TileList(tiles.b[keep], tiles.h[keep], tiles.i[keep], tiles.j[keep])


def _refine(
    analyzer: Analyzer, grid: TileGrid, tiles: TileList
) -> tuple[torch.Tensor, torch.Tensor]:
    """(decided, state) per listed tile, from the analysis of ever smaller sub-rectangles.

    A tile is full when all its sub-rectangles are, empty when all are, partial when one is
    partial or one is full and another empty. Sub-rectangles left undecided are split again
    (8 x 8) while that is much cheaper than evaluating their tiles exactly.
    """
    dev = grid.device
    T = len(tiles)
    some_true = torch.zeros(T, dtype=torch.bool, device=dev)
    some_false = torch.zeros(T, dtype=torch.bool, device=dev)
    risky = torch.zeros(T, dtype=torch.bool, device=dev)
    rects = TileSet.of_tiles(grid, tiles)
    owner = torch.arange(T, device=dev)
    size = (grid.block_size.q, grid.block_size.kv)
    pairs_per_tile = size[0] * size[1]
    while rects.shape[0] and size != (1, 1):
        parts = (min(_SPLIT, size[0]), min(_SPLIT, size[1]))
        n_sub = rects.shape[0] * parts[0] * parts[1]
        open_tiles = int(torch.unique(owner).numel())
        if n_sub * _REFINE_RATIO > open_tiles * pairs_per_tile:
            break
        sub = rects.split(parts, size)
        owner = owner.repeat_interleave(parts[0] * parts[1])
        size = (-(-size[0] // parts[0]), -(-size[1] // parts[1]))
        undecided = torch.empty(n_sub, dtype=torch.bool, device=dev)
        for s0 in range(0, n_sub, _REFINE_CHUNK):
            keep = torch.zeros(n_sub, dtype=torch.bool, device=dev)
            keep[s0 : s0 + _REFINE_CHUNK] = True
            a = analyzer.run(sub.select(keep))
            o = owner[s0 : s0 + _REFINE_CHUNK]
            some_true[o[a.full | a.partial]] = True
            some_false[o[a.empty | a.partial]] = True
            open_ = a.undecided
            # An allowed pair that may read out of bounds must reach exact evaluation.
            risky[o[open_ & a.may_read_out_of_bounds]] = True
            undecided[s0 : s0 + _REFINE_CHUNK] = open_
        # Tiles already proven partial need no finer look.
        undecided &= ~(some_true & some_false)[owner]
        rects, owner = sub.select(undecided), owner[undecided]
    still_open = torch.zeros(T, dtype=torch.bool, device=dev)
    still_open[owner] = True
    mixed = some_true & some_false & ~risky
    all_full = ~some_false & ~still_open & ~risky
    all_empty = ~some_true & ~still_open
    state = torch.where(all_full, int(TileState.FULL), int(TileState.PARTIAL))
    state = torch.where(all_empty, int(TileState.EMPTY), state).to(torch.int8)
    return mixed | all_full | all_empty, state


def decide(
    mask: TracedMod,
    grid: TileGrid,
    states: torch.Tensor,
    pending: TileList,
    risky: torch.Tensor | None = None,
    analyzer: Analyzer | None = None,
) -> Decided:
    """Write the states of the `pending` tiles into `states` (int8 [B, H, nq, nkv], in place):
    witnesses, then refinement, then exact evaluation. Tiles flagged in `risky` (loads that may
    read out of bounds) skip witnesses (Note [Loads out of bounds])."""
    if not len(pending):
        return Decided(0, 0, 0)
    flat = states.view(-1)
    if risky is not None:
        proven = ~risky[pending.b, pending.h, pending.i, pending.j]
        proven[proven.clone()] = prove_partial(mask, grid, _take(pending, proven))
    else:
        proven = prove_partial(mask, grid, pending)
    flat[pending.flat_index(grid.shape)[proven]] = int(TileState.PARTIAL)
    rest = _take(pending, ~proven)
    refined = 0
    if len(rest):
        analyzer = analyzer if analyzer is not None else Analyzer(mask, grid)
        done, state = _refine(analyzer, grid, rest)
        flat[rest.flat_index(grid.shape)[done]] = state[done]
        refined = int(done.sum())
        rest = _take(rest, ~done)
    if len(rest):
        flat[rest.flat_index(grid.shape)] = _exact_tiles(mask, grid, rest)
    return Decided(int(proven.sum()), refined, len(rest))


def classify(mask: TracedMod, grid: TileGrid, *, analysis: bool = True) -> Classification:
    """Tile states of `mask` on `grid`: analysis, then witnesses, then exact evaluation.

    `analysis=False` evaluates every tile exactly (for comparisons and tests).

    >>> import torch, flexfa
    >>> grid = TileGrid(1, 1, 1024, 1024, BlockSize(128, 128), torch.device("cpu"))
    >>> c = classify(flexfa.trace_mask_mod(flexfa.masks.causal), grid)
    >>> c.analytic, c.witnessed, c.refined, c.evaluated
    (64, 0, 0, 0)
    """
    if not analysis:
        states = classify_exact(
            mask,
            batch=grid.batch,
            heads=grid.heads,
            q_len=grid.q_len,
            kv_len=grid.kv_len,
            block_size=grid.block_size,
            device=grid.device,
        )
        return Classification(states, 0, 0, 0, grid.num_tiles)
    analyzer = Analyzer(mask, grid)
    result = analyzer.run(TileSet.of_grid(grid))
    states = result.partial.to(torch.int8) * int(TileState.PARTIAL)
    states.masked_fill_(result.full, int(TileState.FULL))
    pending = TileList.where(result.undecided)
    d = decide(mask, grid, states, pending, result.may_read_out_of_bounds, analyzer)
    analytic = grid.num_tiles - len(pending)
    return Classification(states, analytic, d.witnessed, d.refined, d.evaluated)


# Up to this many pairs, `column_states` evaluates its tiles exactly instead of analyzing them.
_EXACT_COLUMN_PAIRS = 1 << 16


def column_states(mask: TracedMod, grid: TileGrid, j: int) -> torch.Tensor:
    """The states of the tiles of kv-block column `j` alone, int8 [batch, heads, q-blocks]: the
    analysis of those tiles, then `decide` for what it leaves (Note [Block masks for growing key
    lengths] in flexfa/blockmask/bind.py). O(batch * heads * q-blocks) tiles, not the grid's."""
    dev = grid.device
    batch, heads, nq, _ = grid.shape
    b, h, i = (
        t.reshape(-1)
        for t in torch.meshgrid(
            torch.arange(batch, device=dev),
            torch.arange(heads, device=dev),
            torch.arange(nq, device=dev),
            indexing="ij",
        )
    )
    tiles = TileList(b, h, i, torch.full_like(i, j))
    if len(tiles) * grid.block_size.q * grid.block_size.kv <= _EXACT_COLUMN_PAIRS:
        # A decode step's few rows: evaluating the pairs costs less than the analysis's set-up.
        return _exact_tiles(mask, grid, tiles).to(torch.int8).view(batch, heads, nq)
    analyzer = Analyzer(mask, grid)
    result = analyzer.run(TileSet.of_tiles(grid, tiles))
    column = result.partial.to(torch.int8) * int(TileState.PARTIAL)
    column.masked_fill_(result.full, int(TileState.FULL))
    open_ = result.undecided
    if bool(open_.any()):
        # `decide` writes into a [B, H, nq, nkv] grid; only this column of it is read back.
        states = torch.zeros(grid.shape, dtype=torch.int8, device=dev)
        states[..., j] = column.view(batch, heads, nq)
        risky = torch.zeros(grid.shape, dtype=torch.bool, device=dev)
        risky[..., j] = result.may_read_out_of_bounds.view(batch, heads, nq)
        decide(mask, grid, states, _take(tiles, open_), risky, analyzer)
        return states[..., j].contiguous()
    return column.view(batch, heads, nq)


def grown_column(mask: TracedMod, old: BlockMask, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The states of the last kv-block column of `old` (int8 [batch, heads, q-blocks]) at its own
    key length and at `kv_len`, a longer one with the same kv blocks: only the pairs of keys
    `old.kv_len .. kv_len - 1` are new, so a full tile stays full where they are all allowed, an
    empty one empty where none is, and a partial one stays partial (Note [Block masks for growing
    key lengths] in flexfa/blockmask/bind.py). O(B * H * Lq * new keys) pairs evaluated."""
    batch, heads, nq, bq = old.batch, old.heads, old.num_q_blocks, old.block_size.q
    device = old.device
    before = _last_column(old)
    rows = torch.arange(nq * bq, device=device)
    valid = (rows < old.q_len).view(-1, 1)
    rows = rows.clamp(max=old.q_len - 1)
    cols = torch.arange(old.kv_len, kv_len, device=device)
    env = index_grids(batch, heads, rows, cols, device)
    allowed = evaluate_mask(mask, env).expand(batch, heads, nq * bq, len(cols))
    # Padding rows count as allowed for "all" and as not allowed for "any".
    shape = (batch, heads, nq, bq * len(cols))
    any_ = (allowed & valid).reshape(shape).any(-1)
    all_ = (allowed | ~valid).reshape(shape).all(-1)
    after = before.clone()
    after[(before == int(TileState.FULL)) & ~all_] = int(TileState.PARTIAL)
    after[(before == int(TileState.EMPTY)) & any_] = int(TileState.PARTIAL)
    return before, after


def _last_column(bm: BlockMask) -> torch.Tensor:
    """The states of the last kv-block column from the kv-side lists: listed ascending, its tile
    is a row's last entry where listed at all."""
    j = bm.num_kv_blocks - 1

    def listed(bl: BlockList) -> torch.Tensor:
        count = bl.count.long()
        last = bl.index.gather(-1, (count - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (count > 0) & (last == j)

    column = listed(bm.kv_partial).to(torch.int8) * int(TileState.PARTIAL)
    return column.masked_fill_(listed(bm.kv_full), int(TileState.FULL))


# Note [Block mask builders]
# A mask_mod that knows its own structure better than the analysis can carry a builder as its
# attribute `__flexfa_block_mask__(traced, grid) -> BlockMask | None`; `create_block_mask` (and so
# the block-mask cache) tries it before the fused and general paths, which build the BlockMask
# when it returns None. The builder must give what the general path would, or more partial tiles:
# never a full tile with an excluded pair nor an empty tile with an allowed one. The mask of a
# packed call is the one such mask (Note [Packed block masks] in flexfa/varlen.py).


def use_fused_kernel(device: torch.device) -> bool:
    """Whether to try the fused kernel (Note [Fused analysis] in
    flexfa/codegen/triton/blockmask/fused.py), registered by its generator (Note [Block-mask
    kernels by registration] in flexfa/blockmask/kernels.py)."""
    mode = config.fused_block_mask
    if mode == "off":
        return False
    if device.type != "cuda" and not (mode == "on" and config.triton_interpret):
        return False
    kernels = registered()
    return kernels is not None and kernels.available()


def _check_len(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_dim(name: str, value: object) -> int | None:
    if value is None:
        return None
    return _check_len(name, value)


def create_block_mask(
    mask_mod: Callable[..., object] | TracedMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
) -> BlockMask:
    """Classify every tile of `mask_mod` as full, partial or empty, without a dense mask.

    Tiles are decided by analysis of the mask's IR where it can prove them (every mask of
    q_idx - kv_idx, prefixes, chunks, documents, and their combinations), then by witnesses,
    refinement and exact evaluation of what is left (see the module docstring and
    docs/blockmask.md). Memory is O(B * H * tiles); the dense mask is never built.

    Args:
        mask_mod: `mask_mod(b, h, q_idx, kv_idx) -> bool` (True = attend).
        B, H: batch size and number of query heads, or None when the mask does not depend on them
            (stored once and broadcast). A mask that does not read `b` (or `h`) is stored once even
            when B (or H) is given.
        Q_LEN, KV_LEN: sequence lengths.
        device: where the block lists live (defaults to the device of the mask's captured tensors,
            else CPU).
        BLOCK_SIZE: tile size, an int or a (q, kv) pair.

    >>> import flexfa
    >>> bm = flexfa.create_block_mask(flexfa.masks.sliding_window(256), None, None, 1024, 1024)
    >>> print(bm)
    ░░
    ██░░
    ░░██░░
      ░░██░░
        ░░██░░
          ░░██░░
            ░░██░░
              ░░██░░
    """
    _check_dim("B", B)
    _check_dim("H", H)
    _check_len("Q_LEN", Q_LEN)
    _check_len("KV_LEN", KV_LEN)
    block_size = BlockSize.of(BLOCK_SIZE)
    traced = mask_mod if isinstance(mask_mod, TracedMod) else trace_mask_mod(mask_mod)
    if device is None:
        device = traced.tensors[0].device if traced.tensors else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # "cuda" means the current GPU
    for cap, t in zip(traced.captures, traced.tensors):
        if t.device != device:
            raise ValueError(
                f"mask_mod {traced.name!r} captures {cap.name!r} on {t.device}, but the block mask "
                f"is built on {device}; move the tensor or pass device={t.device}"
            )
    for dim, value, var in (("B", B, "b"), ("H", H, "h")):
        if value is None and var in traced.variables:
            raise ValueError(
                f"mask_mod {traced.name!r} depends on {var!r}, so {dim} must be given "
                f"(None means the mask is the same for every {var})"
            )
    batch = B if (B is not None and "b" in traced.variables) else 1
    heads = H if (H is not None and "h" in traced.variables) else 1
    grid = TileGrid(batch, heads, Q_LEN, KV_LEN, block_size, device)
    own = getattr(traced.fn, "__flexfa_block_mask__", None)
    if own is not None:  # Note [Block mask builders]
        bm = own(traced, grid)
        if bm is not None:
            return bm
    if use_fused_kernel(device):
        bm = registered().build(traced, grid)
        if bm is not None:
            return bm
    states = classify(traced, grid).states
    return BlockMask.from_tile_states(
        states, q_len=Q_LEN, kv_len=KV_LEN, block_size=block_size, mask=traced
    )
