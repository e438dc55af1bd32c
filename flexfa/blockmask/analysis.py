"""The analytic tier: prove tiles full, empty or partial from the mask's IR, for all tiles at once.

`analyze(mask, grid)` returns, for every tile of the grid, whether the mask is proven True at every
in-range pair (full), False at every pair (empty), or True at some and False at others (partial).
Tiles it cannot decide are left to witnesses and to exact evaluation (`flexfa.blockmask.build`).
Every claim is a proof: a wrong "full" or "empty" would be a silently wrong attention result.

# Note [Tile analysis]
# The analysis splits the mask's DAG by what each node varies with inside a tile (its `Sig`):
#   NONE  nothing but b and h, which are fixed in a tile (constants, `bias[h]`, `lengths[b]`);
#   Q     q_idx only (`doc[q_idx]`, `q_idx // 64`);      K   kv_idx only (`kv_idx < prefix`);
#   D     q_idx - kv_idx only (`q_idx >= kv_idx`, `abs(q_idx - kv_idx) % 4 == 0`);
#   TWO   anything else (`doc[q_idx] == doc[kv_idx]`, `q_idx // 128 == kv_idx // 128`).
# Integer arithmetic is tracked as affine forms in (b, h, q_idx, kv_idx), so `q_idx - kv_idx + 3`
# is recognized as D however it was written, and a comparison `a < b` of two affine integers has
# the signature of `b - a` (causal `q_idx >= kv_idx` is D, not TWO).
#
# A node of signature Q, K or D is a function of a single integer u (q_idx, kv_idx or
# q_idx - kv_idx), and the values of u inside a tile form one contiguous range. So such a node is
# evaluated *exactly*, once per value of u (O(Q_LEN + KV_LEN) work per (b, h), through the IR
# evaluator), and its per-tile minimum and maximum come from a sparse table of range minima
# (O(1) per tile). For a bool this is its exact classification on every tile; this alone decides
# causal, sliding-window, dilated and every other mask of q_idx - kv_idx. A TWO node is bounded
# from its sources by interval arithmetic and three-valued logic (`flexfa.blockmask.intervals`),
# e.g. `doc[q_idx] == doc[kv_idx]` is True on a tile when both per-tile ranges are the same single
# document and False when the ranges are disjoint.
#
# Affine forms are used only when their value cannot wrap: the largest |value| over the whole
# grid, computed from the lengths, must fit the node's type (and 2**52 for int64, see Note
# [Bounds as float64]). Then the form *is* the computed value at every in-range pair.
#
# Loads out of bounds (Note [Loads out of bounds] in flexfa/ir/evaluate.py) are an error at
# allowed pairs. The analysis tracks per tile whether some load may read out of bounds; such tiles
# are never called full or partial here (only empty, which has no allowed pair), so exact
# evaluation sees them and raises where the Note says so.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import torch

from flexfa.blockmask import intervals as iv
from flexfa.blockmask.grid import TileGrid, TileSet
from flexfa.blockmask.intervals import Abstract, Interval, Truth
from flexfa.frontend.trace import TracedMod
from flexfa.ir.dtypes import DType
from flexfa.ir.evaluate import Evaluator
from flexfa.ir.nodes import COMPARE_OPS, Node, Op, toposort


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


@dataclasses.dataclass(frozen=True)
class Affine:
    """`const + sum(coeff * var)` over the mod parameters b, h, q_idx, kv_idx (exact integers)."""

    coeffs: tuple[tuple[str, int], ...]
    const: int

    @staticmethod
    def make(coeffs: dict[str, int], const: int) -> Affine:
        return Affine(tuple(sorted((k, v) for k, v in coeffs.items() if v != 0)), const)

    def coeff(self, name: str) -> int:
        return dict(self.coeffs).get(name, 0)

    def combine(self, other: Affine, sign: int) -> Affine:
        out = dict(self.coeffs)
        for k, v in other.coeffs:
            out[k] = out.get(k, 0) + sign * v
        return Affine.make(out, self.const + sign * other.const)

    def scale(self, k: int) -> Affine:
        return Affine.make({n: v * k for n, v in self.coeffs}, self.const * k)

    @property
    def sig(self) -> Sig:
        cq, ck = self.coeff("q_idx"), self.coeff("kv_idx")
        if cq == 0 and ck == 0:
            return Sig.NONE
        if ck == 0:
            return Sig.Q
        if cq == 0:
            return Sig.K
        if cq == -ck:
            return Sig.D
        return Sig.TWO


@dataclasses.dataclass(frozen=True, eq=False)
class Analysis:
    """Per rectangle (bool tensors of the TileSet's shape; [B, H, nq, nkv] for a whole grid):
    proven full, proven empty, proven partial.

    `may_read_out_of_bounds` marks rectangles where some load may read out of bounds at an
    in-range pair; they are never proven full or partial here, and must be decided by exact
    evaluation.
    """

    full: torch.Tensor
    empty: torch.Tensor
    partial: torch.Tensor
    may_read_out_of_bounds: torch.Tensor

    @property
    def undecided(self) -> torch.Tensor:
        return ~(self.full | self.empty | self.partial)


_LIMITS = {DType.INT32: 2**31 - 1, DType.INT64: 2**52}


class _Static:
    """Affine forms, signatures and the parts of the DAG the analysis needs (no tensors)."""

    def __init__(self, root: Node, grid: TileGrid) -> None:
        self.order = toposort([root])
        self.var_max = {
            "b": grid.batch - 1,
            "h": grid.heads - 1,
            "q_idx": grid.q_len - 1,
            "kv_idx": grid.kv_len - 1,
        }
        self.affine: dict[int, Affine] = {}
        self.sig: dict[int, Sig] = {}
        self.diff: dict[int, Affine] = {}  # comparisons of two affine integers: b - a
        for n in self.order:
            form = self._affine_of(n)
            if form is not None and self._fits(form, n.dtype):
                self.affine[id(n)] = form
                self.sig[id(n)] = form.sig
                continue
            if n.op in COMPARE_OPS:
                a, b = (self.affine.get(id(s)) for s in n.srcs)
                if a is not None and b is not None:
                    d = b.combine(a, -1)
                    self.diff[id(n)] = d
                    self.sig[id(n)] = d.sig
                    continue
            sig = Sig.NONE
            for s in n.srcs:
                sig = _join(sig, self.sig[id(s)])
            self.sig[id(n)] = sig
        # Nodes whose abstract value is needed: the root, and the sources of TWO nodes that are
        # not bounded directly from an affine form.
        needed = {id(root)}
        for n in reversed(self.order):
            if id(n) in needed and self.sig[id(n)] is Sig.TWO and not self.shortcut(n):
                needed.update(id(s) for s in n.srcs)
        self.needed = needed

    def shortcut(self, n: Node) -> bool:
        return id(n) in self.affine or id(n) in self.diff

    def _affine_of(self, n: Node) -> Affine | None:
        if not n.dtype.is_int:
            return None
        if n.op is Op.CONST:
            return Affine.make({}, n.arg)
        if n.op is Op.VAR:
            return Affine.make({n.arg: 1}, 0)
        forms = [self.affine.get(id(s)) for s in n.srcs]
        if n.op is Op.CAST and n.srcs[0].dtype.is_int:
            return forms[0]
        if any(f is None for f in forms) or not forms:
            return None
        if n.op is Op.ADD:
            return forms[0].combine(forms[1], 1)
        if n.op is Op.SUB:
            return forms[0].combine(forms[1], -1)
        if n.op is Op.NEG:
            return forms[0].scale(-1)
        if n.op is Op.MUL:
            a, b = forms
            if not a.coeffs:
                return b.scale(a.const)
            if not b.coeffs:
                return a.scale(b.const)
        return None

    def _fits(self, form: Affine, dtype: DType) -> bool:
        bound = abs(form.const) + sum(abs(c) * self.var_max[v] for v, c in form.coeffs)
        return bound <= _LIMITS[dtype]


# ------------------------------------------------------------------------------------------------
# One-dimensional exact evaluation and range queries.
# ------------------------------------------------------------------------------------------------


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


class _Line:
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
        self._keep: list[Node] = []

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

    def _group(self, ts: TileSet, gb: int, gh: int) -> torch.Tensor:
        """Row of a [gb * gh, U] table for each rectangle's (b, h)."""
        b = ts.b if gb > 1 else torch.zeros_like(ts.b)
        h = ts.h if gh > 1 else torch.zeros_like(ts.h)
        return b * gh + h

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
        table = self._tables.get(key)
        if table is None or (1 << table.levels) <= int((hi - lo).max()) + 1:
            # Tiles span at most max_len values; other rectangles may be longer.
            max_len = max(self.max_len, int((hi - lo).max()) + 1)
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
            return flags.reshape(-1)[group].to(torch.int64), torch.ones_like(group)
        lo, hi = pos
        hi = hi + hi_shift
        prefix = self._tables.get(key)
        if prefix is None:
            rows = flags.reshape(gb * gh, gu)
            zero = torch.zeros(gb * gh, 1, dtype=torch.int64, device=flags.device)
            prefix = torch.cat([zero, torch.cumsum(rows, dim=1)], dim=1)
            self._tables[key] = prefix
        base = group * (gu + 1)
        count = prefix.take(base + hi + 1) - prefix.take(base + lo)
        return count, hi - lo + 1

    def value(self, node: Node) -> torch.Tensor:
        self._keep.append(node)
        return _as3d(self.evaluator(node))

    def abstract(self, node: Node, ts: TileSet) -> Abstract:
        value = self.value(node)
        key = id(node)
        if node.dtype.is_bool:
            true, length = self.counts((key, "v"), value.to(torch.int64), ts)
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


# ------------------------------------------------------------------------------------------------
# Bounds of TWO nodes.
# ------------------------------------------------------------------------------------------------


def _affine_bounds(form: Affine, ts: TileSet) -> Interval:
    """Exact per-rectangle min and max of an affine form (attained at corners of the rectangle)."""
    f64 = torch.float64
    b, h = ts.b.to(f64), ts.h.to(f64)
    ranges = {
        "b": (b, b),
        "h": (h, h),
        "q_idx": (ts.q_lo.to(f64), ts.q_hi.to(f64)),
        "kv_idx": (ts.kv_lo.to(f64), ts.kv_hi.to(f64)),
    }
    lo = torch.tensor(float(form.const), dtype=f64, device=b.device)
    hi = lo
    for name, c in form.coeffs:
        a, z = ranges[name]
        if c > 0:
            lo, hi = lo + c * a, hi + c * z
        else:
            lo, hi = lo + c * z, hi + c * a
    # With a single varying index, or q_idx - kv_idx, and unit steps, every integer is taken.
    cq, ck = form.coeff("q_idx"), form.coeff("kv_idx")
    unit = (abs(cq), abs(ck)) in ((0, 0), (1, 0), (0, 1)) or (abs(cq) == 1 and cq == -ck)
    contiguous = torch.tensor(unit, device=b.device)
    return Interval(lo, hi, None, tight=True, contiguous=contiguous)


class _CaptureStats:
    """Global min / max (and NaN) of each captured tensor, computed once."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.tensors = tensors
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}

    def get(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if slot not in self._cache:
            t = self.tensors[slot]
            if t.numel() == 0:
                self._cache[slot] = None
            else:
                if t.dtype == torch.bool:
                    t = t.to(torch.int8)
                if t.is_floating_point():
                    nan = torch.isnan(t).any()
                    clean = torch.nan_to_num(t, nan=0.0, posinf=torch.inf, neginf=-torch.inf)
                    self._cache[slot] = (clean.min(), clean.max(), nan)
                else:
                    self._cache[slot] = (t.min(), t.max(), torch.zeros((), dtype=torch.bool))
        return self._cache[slot]


def _load_bounds(
    n: Node, indices: list[Abstract], stats: _CaptureStats, device: torch.device
) -> tuple[Abstract, torch.Tensor | None]:
    """Bounds of a load whose indices vary in two dimensions: the whole tensor's range (and 0 for a
    guarded out-of-bounds read). Returns the bounds and the per-tile may-be-out-of-bounds flag."""
    cap = n.srcs[0].arg
    tensor = stats.tensors[cap.slot]
    oob: torch.Tensor | None = None
    for dim, idx in enumerate(indices):
        assert isinstance(idx, Interval)
        bad = (idx.lo < 0) | (idx.hi > tensor.shape[dim] - 1)
        oob = bad if oob is None else (oob | bad)
    s = stats.get(cap.slot)
    if s is None:  # an empty tensor: every read is out of bounds and gives 0
        zero = torch.zeros((), dtype=n.dtype.torch, device=device)
        return iv.point(zero, n.dtype), torch.ones((), dtype=torch.bool, device=device)
    mn, mx, has_nan = (x.to(device) for x in s)
    if n.dtype.is_bool:
        may_true, may_false = mx == 1, mn == 0
        if oob is not None:
            may_false = may_false | oob
        return Truth(may_true, may_false, torch.zeros_like(may_true & may_false)), oob
    if n.dtype.is_int:
        base = iv.from_int_range(mn.to(torch.int64), mx.to(torch.int64), n.dtype, tight=False)
        lo, hi, nan = base.lo, base.hi, None
    else:
        lo, hi, nan = mn.to(torch.float64), mx.to(torch.float64), has_nan
    if oob is not None:
        lo = torch.where(oob, torch.clamp(lo, max=0.0), lo)
        hi = torch.where(oob, torch.clamp(hi, min=0.0), hi)
    return Interval(lo, hi, nan, False), oob


def _independent(a: Sig, b: Sig) -> bool:
    """Every combination of the two operands' values occurs in a tile."""
    q_side = (Sig.NONE, Sig.Q)
    kv_side = (Sig.NONE, Sig.K)
    return (a in q_side and b in kv_side) or (a in kv_side and b in q_side)


_MONOTONE = {Op.EXP: torch.exp, Op.EXP2: torch.exp2, Op.TANH: torch.tanh, Op.SIGMOID: torch.sigmoid}
_LOG_LIKE = {Op.LOG: torch.log, Op.LOG2: torch.log2, Op.SQRT: torch.sqrt, Op.RSQRT: torch.rsqrt}


def _transfer(n: Node, srcs: list[Abstract], st: _Static, device: torch.device) -> Abstract:
    op, t = n.op, n.dtype
    if op is Op.CAST:
        return iv.cast(srcs[0], n.srcs[0].dtype, t)
    if op is Op.WHERE:
        cond = srcs[0]
        assert isinstance(cond, Truth)
        return iv.where(cond, srcs[1], srcs[2], t)
    if op is Op.NOT:
        a = srcs[0]
        return iv.logical_not(a) if isinstance(a, Truth) else iv.bitwise_not(a, t)
    if op in (Op.AND, Op.OR, Op.XOR):
        a, b = srcs
        if isinstance(a, Truth) and isinstance(b, Truth):
            fn = {Op.AND: iv.logical_and, Op.OR: iv.logical_or, Op.XOR: iv.logical_xor}[op]
            return fn(a, b)
        assert isinstance(a, Interval) and isinstance(b, Interval)
        return iv.bitwise(op, a, b, t)
    if op in COMPARE_OPS:
        a, b = srcs
        if isinstance(a, Truth) and isinstance(b, Truth):  # == and != of bools
            x = iv.logical_xor(a, b)
            return iv.logical_not(x) if op is Op.EQ else x
        assert isinstance(a, Interval) and isinstance(b, Interval)
        indep = _independent(st.sig[id(n.srcs[0])], st.sig[id(n.srcs[1])])
        return iv.independent_compare(op, a, b, indep)
    if op is Op.LOAD:
        raise AssertionError("loads are bounded by _load_bounds")
    if len(srcs) == 1:
        (a,) = srcs
        assert isinstance(a, Interval)
        if op is Op.NEG:
            return iv.neg(a, t)
        if op is Op.ABS:
            return iv.absolute(a, t)
        if op is Op.SIGN:
            return iv.sign(a, t)
        if op in _MONOTONE:
            return iv.monotone(_MONOTONE[op], a, t)
        if op in _LOG_LIKE:
            return iv.log_like(_LOG_LIKE[op], a, t)
        if op in (Op.SIN, Op.COS):
            return iv.periodic(a, t)
        if op in (Op.FLOOR, Op.CEIL):
            return iv.floor_ceil(torch.floor if op is Op.FLOOR else torch.ceil, a, t)
        return iv.top(t, device)
    a, b = srcs
    assert isinstance(a, Interval) and isinstance(b, Interval)
    binary = {
        Op.ADD: iv.add,
        Op.SUB: iv.sub,
        Op.MUL: iv.mul,
        Op.TRUEDIV: iv.truediv,
        Op.FLOORDIV: iv.floordiv,
        Op.MOD: iv.mod,
        Op.MIN: iv.minimum,
        Op.MAX: iv.maximum,
        Op.POW: iv.pow_,
    }
    if op in binary:
        return binary[op](a, b, t)
    return iv.top(t, device)


# ------------------------------------------------------------------------------------------------
# The driver.
# ------------------------------------------------------------------------------------------------


class Analyzer:
    """The analysis of one mask on one grid; `run` bounds any set of rectangles of the grid.

    The exact line evaluations and their range tables are computed once and shared by every run,
    so bounding sub-rectangles of undecided tiles (`TileSet.split`) costs only the interval
    arithmetic of the TWO nodes.
    """

    def __init__(self, mask: TracedMod, grid: TileGrid) -> None:
        self.mask = mask
        self.grid = grid
        self.static = _Static(mask.output, grid)
        self.stats = _CaptureStats(mask.tensors)
        self._lines: dict[Sig, _Line] = {}

    def _line(self, sig: Sig) -> _Line:
        line = self._lines.get(sig)
        if line is None:
            line = self._lines[sig] = _Line(sig, self.mask, self.grid)
        return line

    def run(self, ts: TileSet) -> Analysis:
        """Proven full / empty / partial, and may-read-out-of-bounds, per rectangle of `ts`."""
        if ts.grid is not None and ts.grid != self.grid:
            raise ValueError("a TileSet of another grid than the analyzer's")
        st = self.static
        root = self.mask.output
        device = self.grid.device
        values: dict[int, Abstract] = {}
        oob_flags: list[torch.Tensor] = []
        # Remaining uses of each value among the nodes still to bound, to free tensors early.
        uses: dict[int, int] = {}
        for n in st.order:
            if id(n) in st.needed and st.sig[id(n)] is Sig.TWO and not st.shortcut(n):
                for s in n.srcs:
                    uses[id(s)] = uses.get(id(s), 0) + 1
        for n in st.order:
            key = id(n)
            if key not in st.needed:
                continue
            sig = st.sig[key]
            if sig is not Sig.TWO:
                if n.op is not Op.CAPTURE:
                    values[key] = self._line(sig).abstract(n, ts)
                continue
            if key in st.affine:
                values[key] = _affine_bounds(st.affine[key], ts)
                continue
            if key in st.diff:
                values[key] = iv.difference_sign(n.op, _affine_bounds(st.diff[key], ts))
                continue
            if n.op is Op.LOAD:
                indices = [values[id(s)] for s in n.srcs[1:]]
                value, oob = _load_bounds(n, indices, self.stats, device)
                if oob is not None:
                    oob_flags.append(oob)
                values[key] = value
            else:
                values[key] = _transfer(n, [values[id(s)] for s in n.srcs], st, device)
            for s in n.srcs:
                uses[id(s)] -= 1
                if uses[id(s)] == 0 and id(s) != id(root):
                    values.pop(id(s), None)
        for line in self._lines.values():
            flag = line.out_of_bounds(ts)
            if flag is not None:
                oob_flags.append(flag)
        result = values[id(root)]
        assert isinstance(result, Truth)
        shape = ts.shape
        may_true = result.may_true.expand(shape)
        may_false = result.may_false.expand(shape)
        both = result.both.expand(shape)
        safe = torch.ones(shape, dtype=torch.bool, device=device)
        for flag in oob_flags:
            safe = safe & ~flag.expand(shape)
        empty = ~may_true
        full = ~may_false & safe & may_true
        partial = both & safe & ~empty & ~full
        return Analysis(full=full, empty=empty, partial=partial, may_read_out_of_bounds=~safe)


def analyze(mask: TracedMod, grid: TileGrid) -> Analysis:
    """Classify the tiles of `grid` that can be decided from the IR of `mask` (Note [Tile analysis]).

    >>> import torch, flexfa
    >>> from flexfa.blockmask.block_mask import BlockSize
    >>> grid = TileGrid(1, 1, 256, 256, BlockSize(64, 64), torch.device("cpu"))
    >>> a = analyze(flexfa.trace_mask_mod(flexfa.masks.causal), grid)
    >>> a.full.int()[0, 0].tolist()[3], a.partial.int()[0, 0].tolist()[3]
    ([1, 1, 1, 0], [0, 0, 0, 1])
    """
    return Analyzer(mask, grid).run(TileSet.of_grid(grid))
