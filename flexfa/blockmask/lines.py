"""Lines: the exact evaluation of mask nodes that vary with a single index inside a tile, and
their per-rectangle minima, maxima and counts (Note [Tile analysis] in analysis.py).

A node of signature Q, K or D is a function of one integer u (q_idx, kv_idx or q_idx - kv_idx),
and the values of u inside a tile form one contiguous range; `Line` evaluates such nodes once per
value of u and answers range queries over tiles from prefix sums and sparse tables.
"""

from __future__ import annotations

import enum
import functools

import torch

from flexfa.blockmask import intervals as iv
from flexfa.blockmask.grid import TileGrid, TileSet
from flexfa.blockmask.intervals import Abstract, Interval, Truth
from flexfa.frontend.trace import TracedMod
from flexfa.ir.evaluate import Evaluator
from flexfa.ir.nodes import Node


class Sig(enum.IntEnum):
    """What a node varies with inside one tile (Note [Tile analysis])."""

    NONE = 0
    Q = 1
    K = 2
    D = 3
    TWO = 4


def _join(a: Sig, b: Sig) -> Sig:
    if a == b or b is Sig.NONE:
        return a
    if a is Sig.NONE:
        return b
    return Sig.TWO


class _RangeTable:
    """Minimum and maximum of rows of values over ranges [lo, hi], by a sparse table.

    Level k holds the min (max) of each window of 2**k values; a range of length n is covered by
    two windows of length 2**floor(log2 n). Built in O(U log W) for ranges up to W long.
    """

    def __init__(self, for_min: torch.Tensor, for_max: torch.Tensor, max_len: int) -> None:
        self.width = for_min.shape[-1]
        mins, maxs = [for_min], [for_max]
        k = 1
        while (1 << k) <= max_len:
            half = 1 << (k - 1)
            mins.append(torch.minimum(mins[-1][:, :-half], mins[-1][:, half:]))
            maxs.append(torch.maximum(maxs[-1][:, :-half], maxs[-1][:, half:]))
            k += 1
        self.levels = len(mins)
        self.mins = self._stack(mins)
        self.maxs = self._stack(maxs)

    def _stack(self, levels: list[torch.Tensor]) -> torch.Tensor:
        first = levels[0]
        # [G, levels * width]; the tail of each level past its length is never read.
        out = first.new_empty(first.shape[0], len(levels) * self.width)
        for k, level in enumerate(levels):
            out[:, k * self.width : k * self.width + level.shape[-1]] = level
        return out

    def query(
        self, group: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """min and max of row `group` over [lo, hi]; all three broadcast together."""
        length = hi - lo + 1
        k = torch.frexp(length.to(torch.float64)).exponent.to(torch.int64) - 1
        base = group * (self.levels * self.width) + k * self.width
        first = base + lo
        second = base + hi - (1 << k) + 1
        mn = torch.minimum(self.mins.take(first), self.mins.take(second))
        mx = torch.maximum(self.maxs.take(first), self.maxs.take(second))
        return mn, mx


@functools.lru_cache(maxsize=32)
def _line_env(sig: Sig, grid: TileGrid) -> tuple[tuple[str, torch.Tensor], ...]:
    """The values of b, h, q_idx and kv_idx along the line of `sig` (kept: a GPU pays a launch
    for each of these small tensors)."""
    dev = grid.device
    i32 = torch.int32
    zero = torch.zeros(1, 1, 1, dtype=i32, device=dev)
    if sig is Sig.Q:
        q, kv = torch.arange(grid.q_len, dtype=i32, device=dev).view(1, 1, -1), zero
    elif sig is Sig.K:
        q, kv = zero, torch.arange(grid.kv_len, dtype=i32, device=dev).view(1, 1, -1)
    elif sig is Sig.D:
        # u = q_idx - kv_idx from -(KV_LEN - 1) to Q_LEN - 1, each at one in-range pair.
        u = torch.arange(-(grid.kv_len - 1), grid.q_len, dtype=i32, device=dev).view(1, 1, -1)
        q, kv = torch.clamp(u, min=0), torch.clamp(-u, min=0)
    else:
        q, kv = zero, zero
    return (
        ("b", torch.arange(grid.batch, dtype=i32, device=dev).view(-1, 1, 1)),
        ("h", torch.arange(grid.heads, dtype=i32, device=dev).view(1, -1, 1)),
        ("q_idx", q),
        ("kv_idx", kv),
    )


class Line:
    """The exact evaluation of the nodes of one signature along their single varying index u
    (Note [Tile analysis]), and per-rectangle ranges of the values."""

    def __init__(self, sig: Sig, mask: TracedMod, grid: TileGrid) -> None:
        dev = grid.device
        self.sig = sig
        self.max_len = {
            Sig.Q: grid.block_size.q,
            Sig.K: grid.block_size.kv,
            Sig.D: grid.block_size.q + grid.block_size.kv - 1,
        }.get(sig, 1)
        self.kv_len = grid.kv_len
        env = dict(_line_env(sig, grid))
        self.evaluator = Evaluator(env, mask.tensors, device=dev)
        self._tables: dict[tuple[int, str], _RangeTable | torch.Tensor] = {}
        self._keep: dict[int, Node] = {}  # keeps the keys of `_tables` alive

    def positions(self, ts: TileSet) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The range [lo, hi] of u-positions of each rectangle (None: u does not vary)."""
        if self.sig is Sig.Q:
            return ts.q_lo, ts.q_hi
        if self.sig is Sig.K:
            return ts.kv_lo, ts.kv_hi
        if self.sig is Sig.D:
            off = self.kv_len - 1
            return ts.q_lo - ts.kv_hi + off, ts.q_hi - ts.kv_lo + off
        return None

    def _group(self, ts: TileSet, gb: int, gh: int) -> torch.Tensor | int:
        """Row of a [gb * gh, U] table for each rectangle's (b, h) (0 for a table of one row)."""
        if gb > 1 and gh > 1:
            return ts.b * gh + ts.h
        if gb > 1:
            return ts.b
        return ts.h if gh > 1 else 0

    def _blocks(self, ts: TileSet, values: torch.Tensor, pad: str) -> torch.Tensor | None:
        """For the tiles of a whole grid and a Q or K line: the values cut into the grid's
        blocks, [gb, gh, blocks, block size], the last block padded (`pad`: "edge" repeats the
        last value, "zero" adds zeros). None when the rectangles are not the grid's blocks."""
        grid = ts.grid
        if grid is None or self.sig not in (Sig.Q, Sig.K) or values.shape[-1] == 1:
            return None
        size = grid.block_size.q if self.sig is Sig.Q else grid.block_size.kv
        n = -(-values.shape[-1] // size)
        extra = n * size - values.shape[-1]
        if extra:
            tail = values[..., -1:] if pad == "edge" else torch.zeros_like(values[..., -1:])
            values = torch.cat([values, tail.expand(*values.shape[:-1], extra)], dim=-1)
        return values.view(*values.shape[:-1], n, size)

    def _place(self, per_block: torch.Tensor) -> torch.Tensor:
        """[gb, gh, blocks] -> [gb, gh, nq, 1] (Q line) or [gb, gh, 1, nkv] (K line)."""
        return per_block.unsqueeze(-1) if self.sig is Sig.Q else per_block.unsqueeze(-2)

    def ranges(
        self,
        key: tuple[int, str],
        for_min: torch.Tensor,
        for_max: torch.Tensor,
        ts: TileSet,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-rectangle min and max of values [gb, gh, U or 1] (broadcast to `ts.shape`)."""
        gb, gh, gu = for_min.shape
        lo_blocks = self._blocks(ts, for_min, "edge")
        if lo_blocks is not None:
            hi_blocks = self._blocks(ts, for_max, "edge")
            assert hi_blocks is not None
            return self._place(lo_blocks.amin(-1)), self._place(hi_blocks.amax(-1))
        group = self._group(ts, gb, gh)
        pos = self.positions(ts)
        if pos is None or gu == 1:
            return for_min.reshape(-1)[group], for_max.reshape(-1)[group]
        lo, hi = pos
        if ts.extent is not None:  # known on the host: no synchronization
            rows, cols = ts.extent
            longest = {Sig.Q: rows, Sig.K: cols, Sig.D: rows + cols - 1}[self.sig]
        else:
            longest = int((hi - lo).max()) + 1
        table = self._tables.get(key)
        if table is None or (1 << table.levels) <= longest:
            # Tiles span at most max_len values; other rectangles may be longer.
            max_len = max(self.max_len, longest)
            table = _RangeTable(for_min.reshape(gb * gh, gu), for_max.reshape(gb * gh, gu), max_len)
            self._tables[key] = table
        return table.query(group, lo, hi)

    def counts(
        self, key: tuple[int, str], flags: torch.Tensor, ts: TileSet, hi_shift: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per rectangle: how many of the 0/1 `flags` [gb, gh, U or 1] along its range are 1,
        and the range's length (prefix sums: O(U) to build, O(1) per rectangle).

        `hi_shift=-1` counts over [lo, hi - 1] instead (empty for one-value ranges)."""
        gb, gh, gu = flags.shape
        blocks = self._blocks(ts, flags, "zero")
        if blocks is not None:
            if hi_shift:
                blocks = blocks[..., :hi_shift]  # the last position of each block is excluded
            lo, hi = self.positions(ts)  # type: ignore[misc]
            return self._place(blocks.sum(-1)), hi - lo + 1 + hi_shift
        group = self._group(ts, gb, gh)
        pos = self.positions(ts)
        if pos is None or gu == 1:
            one = torch.ones((), dtype=torch.int64, device=flags.device)
            return flags.reshape(-1)[group].to(torch.int64), one
        lo, hi = pos
        prefix = self._tables.get(key)
        if prefix is None:
            rows = flags.reshape(gb * gh, gu)
            zero = torch.zeros(gb * gh, 1, dtype=torch.int64, device=flags.device)
            prefix = torch.cat([zero, torch.cumsum(rows, dim=1, dtype=torch.int64)], dim=1)
            self._tables[key] = prefix
        # Counted over [lo, hi + hi_shift]: prefix[hi + hi_shift + 1] - prefix[lo].
        end = hi + (hi_shift + 1)
        start = lo
        if not isinstance(group, int):
            base = group * (gu + 1)
            end, start = end + base, start + base
        count = prefix.take(end) - prefix.take(start)
        return count, hi - lo + (hi_shift + 1)

    def value(self, node: Node) -> torch.Tensor:
        self._keep[id(node)] = node
        return _as3d(self.evaluator(node))

    def abstract(self, node: Node, ts: TileSet) -> Abstract:
        value = self.value(node)
        key = id(node)
        if node.dtype.is_bool:
            true, length = self.counts((key, "v"), value, ts)
            may_true, may_false = true > 0, true < length
            return Truth(may_true, may_false, may_true & may_false)
        if node.dtype.is_int:
            mn, mx = self.ranges((key, "v"), value, value, ts)
            contiguous = self._steps(key, value, ts)
            return iv.from_int_range(mn, mx, node.dtype, tight=True, contiguous=contiguous)
        isnan = torch.isnan(value)
        lo_src = torch.where(isnan, torch.inf, value)
        hi_src = torch.where(isnan, -torch.inf, value)
        mn, mx = self.ranges((key, "v"), lo_src, hi_src, ts)
        nans, _ = self.counts((key, "nan"), isnan.to(torch.int64), ts)
        all_nan = mn > mx
        lo = torch.where(all_nan, -torch.inf, mn.to(torch.float64))
        hi = torch.where(all_nan, torch.inf, mx.to(torch.float64))
        return Interval(lo, hi, nans > 0, tight=True)

    def _steps(self, key: int, value: torch.Tensor, ts: TileSet) -> torch.Tensor:
        """Per rectangle: do consecutive values along the line differ by at most 1? Then the
        values of the rectangle are every integer between its min and max (discrete continuity)."""
        gu = value.shape[-1]
        pos = self.positions(ts)
        if pos is None or gu == 1:
            return torch.ones((), dtype=torch.bool, device=value.device)
        v = value.to(torch.int64)
        jump = torch.zeros(value.shape, dtype=torch.int64, device=value.device)
        jump[..., :-1] = ((v[..., 1:] - v[..., :-1]).abs() > 1).to(torch.int64)
        # Steps inside [lo, hi] are jump[lo .. hi - 1]; a one-value range has none.
        jumps, _ = self.counts((key, "steps"), jump, ts, hi_shift=-1)
        return jumps == 0

    def out_of_bounds(self, ts: TileSet) -> torch.Tensor | None:
        """Per rectangle: did a load evaluated on this line read out of bounds at an in-range
        pair? (Covers every load evaluated so far on this line.)"""
        oob = self.evaluator.out_of_bounds
        if oob is None:
            return None
        bad, _ = self.counts((id(self), "oob"), _as3d(oob).to(torch.int64), ts)
        return bad > 0


def _as3d(value: torch.Tensor) -> torch.Tensor:
    while value.ndim < 3:
        value = value.unsqueeze(0)
    return value
