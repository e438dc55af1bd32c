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
# evaluated *exactly* (`flexfa.blockmask.lines`), once per value of u (O(Q_LEN + KV_LEN) work
# per (b, h), through the IR evaluator), and its per-tile minimum and maximum come from a sparse table of range minima
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

import torch

from flexfa.blockmask import intervals as iv
from flexfa.blockmask.grid import TileGrid, TileSet
from flexfa.blockmask.intervals import Abstract, Interval, Truth
from flexfa.blockmask.lines import Line, Sig, _join
from flexfa.frontend.trace import TracedMod
from flexfa.ir.dtypes import DType
from flexfa.ir.nodes import COMPARE_OPS, Node, Op, toposort


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


class Static:
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


def independent(a: Sig, b: Sig) -> bool:
    """Every combination of the two operands' values occurs in a tile."""
    q_side = (Sig.NONE, Sig.Q)
    kv_side = (Sig.NONE, Sig.K)
    return (a in q_side and b in kv_side) or (a in kv_side and b in q_side)


_MONOTONE = {
    Op.EXP: torch.exp,
    Op.EXP2: torch.exp2,
    Op.TANH: torch.tanh,
    Op.SIGMOID: torch.sigmoid,
    Op.ERF: torch.erf,
}
_LOG_LIKE = {Op.LOG: torch.log, Op.LOG2: torch.log2, Op.SQRT: torch.sqrt, Op.RSQRT: torch.rsqrt}


def _transfer(n: Node, srcs: list[Abstract], st: Static, device: torch.device) -> Abstract:
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
        indep = independent(st.sig[id(n.srcs[0])], st.sig[id(n.srcs[1])])
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
        self.static = Static(mask.output, grid)
        self.stats = _CaptureStats(mask.tensors)
        self._lines: dict[Sig, Line] = {}

    def _line(self, sig: Sig) -> Line:
        line = self._lines.get(sig)
        if line is None:
            line = self._lines[sig] = Line(sig, self.mask, self.grid)
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
        empty = ~may_true
        full = may_true & ~may_false
        partial = both & may_true & may_false
        if oob_flags:
            risky = oob_flags[0].expand(shape)
            for flag in oob_flags[1:]:
                risky = risky | flag.expand(shape)
            full, partial = full & ~risky, partial & ~risky
        else:
            risky = torch.zeros((), dtype=torch.bool, device=device).expand(shape)
        return Analysis(full=full, empty=empty, partial=partial, may_read_out_of_bounds=risky)


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
