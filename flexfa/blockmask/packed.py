"""The BlockMask of a packed mask, from the offsets and the analysis of the user's mask_mod.

A packed call's mask (Note [Packed batches as mods] in flexfa/varlen.py) is built here instead
of by the tiers of `create_block_mask` (Note [Packed block masks] there).

# Note [Tiles of a packed mask]
# The packed mask allows (q, kv) when both tokens lie in one sequence s and the user's mask_mod
# allows (s, h, q - start_q[s], kv - start_kv[s]). So a tile is the union of one sub-rectangle per
# sequence with tokens on both of its sides, in that sequence's relative positions, and masked
# pairs elsewhere. The first and last tokens of a q-block lie in sequences sq0 <= sq1, those of a
# kv-block in sk0 <= sk1, and every sequence present on both sides is in [lo, hi] =
# [max(sq0, sk0), min(sq1, sk1)]. A tile is
#   - empty when the sub-rectangles of lo and of hi are empty (the sequence has no query or no
#     key in the tile, which is always so when lo > hi, or the analysis proves the mask_mod False
#     there) and no sequence lies strictly between them (hi - lo < 2);
#   - full when the whole tile lies in one sequence (sq0 == sq1 == sk0 == sk1) and the analysis
#     proves the mask_mod True on its sub-rectangle, which is then the whole tile;
#   - partial otherwise. A tile that is not inside one sequence has a masked pair (two sequences
#     on one side, or different ones on the two sides), so it is never full; listing a tile
#     partial is always correct, since kernels evaluate the mask on partial tiles. A tile listed
#     partial is in fact empty only where a sub-rectangle the analysis left undecided, or a
#     sequence strictly between lo and hi, has no allowed pair: rare, and never with sequences of
#     at least one query and one key, a mask_mod the analysis decides and that allows some pair
#     of every sequence (tests/blockmask/test_packed.py checks the library masks against the
#     dense oracle, exactly there and for soundness everywhere).
# The sub-rectangles of lo and hi of all tiles are bounded at once, as rectangles [2, H, nq, nkv]
# with b = the sequence, by the analysis of the mask_mod (`Analyzer`, Note [Tile analysis]) on a
# grid as long as the longest sequences, kept per mask and grid. That is a fixed number of
# vectorized torch operations, whatever the number of sequences, and no synchronization: the
# lengths and the number of sequences are known on the host (`Packing`). Where the fused path
# runs, one generated kernel does all of it instead (Note [Packed block masks in one kernel] in
# flexfa/codegen/triton/blockmask/packed_fused.py), for the masks it can take.
#
# Two kinds of mask_mod take the general path when the analysis is not enough, found with one
# synchronization that only they pay:
#   - masks whose analysis is more than boolean logic over lines and comparisons of affine
#     integers or of independent lines (a table indexed by q_idx and kv_idx, products of
#     positions, ...): the analysis may leave tiles inside one sequence undecided, where the general
#     path's witnesses and exact evaluation would find full and empty ones;
#   - masks that read captured tensors: a read out of bounds at an allowed pair is an error (Note
#     [Loads out of bounds]) that the general path raises on the CPU, so no sub-rectangle may be
#     at risk.
# A mask_mod that reads `b` is analyzed on one line per sequence; when that costs much more than
# the packed lengths (many sequences, a few long ones), the general path runs instead.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable

import torch

from flexfa.blockmask.analysis import Analyzer, Static, independent
from flexfa.blockmask.block_mask import BlockList, BlockMask
from flexfa.blockmask.grid import TileGrid, TileSet
from flexfa.blockmask.kernels import registered
from flexfa.blockmask.lines import Sig
from flexfa.frontend.trace import TracedMod
from flexfa.ir.nodes import COMPARE_OPS, Op


@dataclasses.dataclass(frozen=True, eq=False)
class Packing:
    """Per token: its sequence (`seq_*`) and its position in that sequence (`pos_*`), int32; the
    offsets themselves (`cu_*`, int32 on the device) and their host copy (`offsets_*`)."""

    seq_q: torch.Tensor
    pos_q: torch.Tensor
    seq_kv: torch.Tensor
    pos_kv: torch.Tensor
    cu_q: torch.Tensor
    cu_kv: torch.Tensor
    offsets_q: tuple[int, ...]
    offsets_kv: tuple[int, ...]
    lengths_q: tuple[int, ...]  # of the sequences, from offsets_q
    lengths_kv: tuple[int, ...]
    # [True] while seq_* and pos_* are allocated but not written yet (Note [Positions written
    # with the block lists]); `fill` writes them with `write_positions` (flexfa/varlen.py's).
    unwritten: list[bool] = dataclasses.field(default_factory=lambda: [False], repr=False)
    write_positions: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None] | None = (
        dataclasses.field(default=None, repr=False)
    )

    @property
    def num_seqs(self) -> int:
        return len(self.offsets_q) - 1

    @property
    def device(self) -> torch.device:
        return self.seq_q.device

    @property
    def kv_own_positions(self) -> bool:
        """Whether seq_kv and pos_kv are tensors of their own (else views of seq_q and pos_q)."""
        return self.offsets_kv != self.offsets_q

    def fill(self) -> None:
        """Write seq_* and pos_* if they are not written yet."""
        if self.unwritten[0]:
            self.write_positions(self.cu_q, self.seq_q, self.pos_q, self.offsets_q[-1])
            if self.kv_own_positions:
                self.write_positions(self.cu_kv, self.seq_kv, self.pos_kv, self.offsets_kv[-1])
            self.unwritten[0] = False


# How many packed masks were built here ("packed"), and how many of them by the kernel ("kernel");
# tests read it to see that the general path was not taken.
built = collections.Counter()

_ANALYZERS: collections.OrderedDict[tuple, tuple[Analyzer, bool]] = collections.OrderedDict()
_MAX_ANALYZERS = 8
# Lines of a mask_mod that reads `b` hold (sequences x longest length) values: at most this many
# times the packed lengths (plus a small allowance), else the general path builds the BlockMask.
_LINE_GROWTH = 4
_LINE_ALLOWANCE = 1 << 16


def packed_block_mask(
    traced: TracedMod, grid: TileGrid, inner: TracedMod | None, pack: Packing
) -> BlockMask | None:
    """The BlockMask of the packed mask `traced` on `grid` (Note [Tiles of a packed mask]), or
    None when the general path must build it. `inner` is the user's mask_mod traced on the grid's
    device (None: no mask)."""
    if grid.batch != 1 or (grid.q_len, grid.kv_len) != (pack.offsets_q[-1], pack.offsets_kv[-1]):
        return None  # not the packing's own lengths
    own = {id(t) for t in (pack.seq_q, pack.pos_q, pack.seq_kv, pack.pos_kv)}
    if inner is not None:
        own.update(map(id, inner.tensors))
    if any(id(t) not in own for t in traced.tensors):
        return None  # other tensors bound to the trace (torch.compile rebinds captures)
    analyzer, check = None, False
    if inner is not None and inner.is_trivially_true:
        inner = None
    rel = _relative_grid(inner, grid, pack)
    if rel is None:
        return None
    if inner is not None:
        analyzer, check = _analyzer(inner, rel)
    if not check and use_packed_kernel(grid.device):  # Note [Packed block masks in one kernel]
        bm = registered().build_packed(traced, inner, grid, pack, rel)
        if bm is not None:
            built["packed"] += 1
            built["kernel"] += 1
            return bm
    pack.fill()  # the torch builder reads the positions (Note [Positions written with ...])
    ends_q, ends_kv, sides, heads = _geometry(grid)
    # The sequences of the first and last token of every q-block and kv-block, [2, nq], [2, nkv].
    sq, sk = pack.seq_q[ends_q], pack.seq_kv[ends_kv]
    top = torch.maximum(sq[:, :, None], sk[:, None])  # [2, nq, nkv]: lo, max(sq1, sk1)
    bottom = torch.minimum(sq[:, :, None], sk[:, None])  # min(sq0, sk0), hi
    single = top[1] == bottom[0]  # sq0 == sq1 == sk0 == sk1
    s = torch.stack([top[0], bottom[1]])  # [2, nq, nkv]: the sequences lo and hi
    # Their first query, first key, end of queries and end of keys: [4, 2, nq, nkv].
    cu_q, cu_kv = pack.cu_q, pack.cu_kv
    bounds = torch.stack([cu_q[:-1], cu_kv[:-1], cu_q[1:], cu_kv[1:]])[:, s]
    # The same of every tile (made per call: a grid of 10^6 tiles would keep 32 MiB).
    shape = (grid.num_q_blocks, grid.num_kv_blocks)
    tiles = torch.stack([side.expand(shape) for side in sides])[:, None]  # [4, 1, nq, nkv]
    first = torch.maximum(tiles[:2], bounds[:2])  # [side (q, kv), 2, nq, nkv], absolute
    end = torch.minimum(tiles[2:], bounds[2:])  # exclusive
    valid = (end > first).all(0)  # [2, nq, nkv]: the sequence has tokens on both sides
    # Relative, with the others (which the result ignores) as the rectangle [0, 0] x [0, 0].
    rel = torch.where(valid, torch.stack([first, end]) - bounds[:2], _unit(grid.device))
    last = rel[1] - 1
    if analyzer is None:
        full = single[None]
        empty = ~valid.any(0)
    else:
        rects = TileSet(
            b=s[:, None],
            h=heads,
            q_lo=rel[0, 0, :, None],
            q_hi=last[0, :, None],
            kv_lo=rel[0, 1, :, None],
            kv_hi=last[1, :, None],
            shape=(2, grid.heads, grid.num_q_blocks, grid.num_kv_blocks),
            extent=(grid.block_size.q, grid.block_size.kv),
        )
        a = analyzer.run(rects)
        if check:
            open_ = single & a.undecided[0]
            risky = a.may_read_out_of_bounds & valid[:, None]
            if bool(torch.stack([open_.any(), risky.any()]).any()):
                return None
        full = single & a.full[0]
        empty = (a.empty | ~valid[:, None]).all(0)
    empty = empty & (s[1] - s[0] < 2)  # no sequence strictly between lo and hi
    partial = ~(empty | full)
    built["packed"] += 1
    return _block_mask(partial, full.expand_as(partial), grid, traced)


def _block_mask(
    partial: torch.Tensor, full: torch.Tensor, grid: TileGrid, traced: TracedMod
) -> BlockMask:
    """The four block lists of [H, nq, nkv] partial and full tiles, two at a time."""
    both = torch.stack([partial, full])[:, None]  # [2, 1, H, nq, nkv]
    kv_count, kv_index = _lists(both)
    q_count, q_index = _lists(both.transpose(-1, -2).contiguous())
    return BlockMask(
        q_len=grid.q_len,
        kv_len=grid.kv_len,
        block_size=grid.block_size,
        kv_partial=BlockList(kv_count[0], kv_index[0]),
        kv_full=BlockList(kv_count[1], kv_index[1]),
        q_partial=BlockList(q_count[0], q_index[0]),
        q_full=BlockList(q_count[1], q_index[1]),
        mask=traced,
    )


def _lists(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`BlockList.from_dense`'s count and index in fewer operations, for any leading dims: a
    stable sort puts the listed columns first, in ascending order (the entries past a row's count
    are the other columns). The index is contiguous whatever the layout of `selected`."""
    count = selected.sum(-1, dtype=torch.int32)
    order = torch.sort((~selected).view(torch.uint8), dim=-1, stable=True).indices
    return count, order.to(torch.int32)


@functools.lru_cache(maxsize=8)
def _unit(device: torch.device) -> torch.Tensor:
    """The relative rectangle [0, 0] x [0, 0] as (first, end) pairs, int64 [2, 1, 1, 1, 1]."""
    return torch.tensor([0, 1], device=device).view(2, 1, 1, 1, 1)


@functools.lru_cache(maxsize=16)
def _geometry(
    grid: TileGrid,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """Per grid, O(nq + nkv) (kept, like `TileSet.of_grid`): the first and last token of each
    q-block and kv-block, int64 [2, nq] and [2, nkv]; the first q, first kv, end of q and end of
    kv (exclusive) of the tiles as [nq, 1] and [1, nkv] columns and rows; the heads, int64
    [1, H, 1, 1]."""
    q_lo, q_hi = grid.q_bounds
    kv_lo, kv_hi = grid.kv_bounds
    sides = (q_lo[:, None], kv_lo[None], q_hi[:, None] + 1, kv_hi[None] + 1)
    heads = torch.arange(grid.heads, device=grid.device).view(1, -1, 1, 1)
    return torch.stack([q_lo, q_hi]), torch.stack([kv_lo, kv_hi]), sides, heads


def _relative_grid(inner: TracedMod | None, grid: TileGrid, pack: Packing) -> TileGrid | None:
    """The grid of the analysis of the user's mask_mod on relative positions: one batch element
    per sequence if it reads `b`, as long as the longest sequences; None when its lines would cost
    too much (Note [Tiles of a packed mask])."""
    batch = pack.num_seqs if inner is not None and "b" in inner.variables else 1
    q_len, kv_len = max(1, *pack.lengths_q), max(1, *pack.lengths_kv)
    if batch > 1:
        cost = batch * (q_len + kv_len)
        if cost > _LINE_GROWTH * (grid.q_len + grid.kv_len) + _LINE_ALLOWANCE:
            return None
    if inner is None or not inner.tensors:  # Note [Relative grids of powers of 2]
        q_len, kv_len = _span(q_len), _span(kv_len)
    return _grid(batch, grid.heads, q_len, kv_len, grid.block_size, grid.device)


# The same object for the same grid: its hash is computed once (it keys `_analyzer` and the
# packed kernels), and relative grids repeat from batch to batch.
_grid = functools.lru_cache(maxsize=64)(TileGrid)


# Note [Relative grids of powers of 2]
# The analysis of the user's mask_mod and the packed kernel's plan are kept per relative grid, whose
# lengths were those of the longest sequences: every batch of new lengths built both again (the
# analysis, the kernel's plan and its prefix sums: 0.10 -> 0.32 ms per BlockMask on the 2-core CPU
# with the kernel launches left out, bench/varlen.py's "new lengths"). The grid is now as long as
# the next power of 2 of the longest sequences, so batches share it. That is sound and as tight:
# the sub-rectangles bounded are each sequence's own, inside the longer grid, and a line or prefix
# sum over the grid has the same values at the positions a sequence has. A mask_mod that reads a
# captured tensor keeps the exact lengths: evaluated past them, its reads could leave the tensor,
# and the check of those reads would send it to the general path.
def _span(n: int) -> int:
    """The length of a relative grid for sequences of at most `n` tokens."""
    return 1 << (n - 1).bit_length()


def _analyzer(inner: TracedMod, rel: TileGrid) -> tuple[Analyzer, bool]:
    """The analysis of the user's mask_mod on the relative grid `rel` and whether its result must
    be checked (kept per mask, captured tensors and grid)."""
    key = (inner.key, tuple((id(t), t._version) for t in inner.tensors), rel)
    found = _ANALYZERS.get(key)  # its tensors are alive: their ids are theirs
    if found is None:
        analyzer = Analyzer(inner, rel)
        found = _ANALYZERS[key] = (analyzer, _needs_check(analyzer.static))
        while len(_ANALYZERS) > _MAX_ANALYZERS:
            _ANALYZERS.popitem(last=False)
    else:
        _ANALYZERS.move_to_end(key)
    return found


def use_packed_kernel(device: torch.device) -> bool:
    """Whether to try the packed kernel: where the fused path runs (CUDA, or Triton's interpreter
    when FLEXFA_FUSED_BLOCK_MASK=on)."""
    from flexfa.blockmask.build import use_fused_kernel

    return use_fused_kernel(device)


def _needs_check(st: Static) -> bool:
    """Whether a mask's result must be checked before it is trusted (Note [Tiles of a packed
    mask]): it reads captured tensors, or its analysis is more than logic over exact values."""
    for n in st.order:
        if n.op is Op.LOAD:
            return True
        key = id(n)
        if key not in st.needed or st.sig[key] is not Sig.TWO or st.shortcut(n):
            continue
        if n.dtype.is_bool and all(s.dtype.is_bool for s in n.srcs):
            continue  # logic over bools, where(bool, bool, bool) included
        if n.op in COMPARE_OPS and independent(*(st.sig[id(s)] for s in n.srcs)):
            continue  # a value of q_idx alone against one of kv_idx alone, both exact lines
        return True
    return False
