"""The analytic tier and the block lists in one generated Triton kernel (CUDA).

`build(mask, grid)` returns the BlockMask of `mask` on `grid`, or None when the mask needs what
only the general path has (`flexfa.blockmask.build`): an operation the kernel does not bound, or
tiles the analysis cannot decide. It computes the same states as the analysis, with far fewer
device operations.

# Note [Fused analysis]
# On a GPU the general path is bound by launches, not work: the analysis and the block lists of
# a causal mask take about 135 small torch operations, each a kernel launch, so a BlockMask took
# ~1.5 ms at any length. The fused path keeps what is O(Q_LEN + KV_LEN) in torch and moves
# everything that is O(tiles) into one kernel:
#
# - Lines (Note [Tile analysis]): nodes that vary with q_idx only, kv_idx only or q_idx - kv_idx
#   only are evaluated exactly along their line, as in the analysis. A bool of q_idx - kv_idx
#   (causal, sliding windows, ...) is passed as prefix sums of its values, and the kernel counts
#   the allowed positions of each tile's range of q_idx - kv_idx itself: O(1) per tile. Other
#   line nodes are summarized per block by `_Line.abstract` (O(N) work) and passed as tensors
#   that broadcast over the tile grid.
# - Everything else (the TWO nodes: affine bounds, comparisons of two affine integers, three-valued
#   logic, comparisons of bounded values) is emitted as straight-line Triton code that mirrors
#   `flexfa.blockmask.intervals` one function at a time. Operations without such a mirror make
#   the whole mask take the general path.
# - The kernel has one program per q-block (it writes that row's kv-side lists) and one per
#   kv-block (its q-side lists). Each evaluates the abstract program on its own line of tiles, so
#   every tile is evaluated twice and no tile-state grid is ever stored; that is cheaper than a
#   second launch.
# - Tiles the analysis leaves undecided are counted in one int32; when it is not 0 the result is
#   discarded and the general path (witnesses, refinement, exact evaluation) runs instead. That
#   read is the only synchronization.
#
# Soundness is the analysis' (the kernel computes the same abstract values in the same float64
# arithmetic); tests/blockmask/test_fused.py checks the lists against the general path and the
# dense oracle on random masks, through Triton's interpreter.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import hashlib
import logging
import threading
import types

import torch

from flexfa.blockmask.analysis import Sig, _independent, _Line, _Static
from flexfa.blockmask.block_mask import BlockList, BlockMask
from flexfa.blockmask.grid import TileGrid, TileSet
from flexfa.blockmask.intervals import Interval, Truth
from flexfa.config import config
from flexfa.frontend.trace import TracedMod
from flexfa.ir.dtypes import DType
from flexfa.ir.nodes import COMPARE_OPS, Node, Op, toposort

log = logging.getLogger("flexfa")


def available() -> bool:
    """Whether Triton can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------------------------
# The plan: how each needed node gets its abstract value (from the IR and the grid's lengths).
# ------------------------------------------------------------------------------------------------


class How(enum.Enum):
    PREFIX = "prefix"  # a bool of q_idx - kv_idx: prefix sums, counted per tile in the kernel
    LINE = "line"  # another line node: per-tile tensors from `_Line.abstract`
    KLINE = "kline"  # a q- or kv-line node evaluated in the kernel over each tile's block
    AFFINE = "affine"  # an affine integer of q_idx and kv_idx: bounds from the tile's corners
    DIFF = "diff"  # a comparison of two affine integers: the sign of their difference
    TRANSFER = "transfer"  # an operation on abstract values, emitted as Triton code


@dataclasses.dataclass(frozen=True)
class Step:
    node: Node
    how: How


@dataclasses.dataclass(frozen=True)
class LoadBounds:
    """A load of a KLINE node: its captured tensor's slot and, per dim, the index's affine form."""

    slot: int
    indices: tuple[object, ...]  # analysis.Affine


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """The steps of one mask on grids of one set of lengths, or why the kernel cannot do it."""

    static: _Static
    steps: tuple[Step, ...]
    reason: str | None
    loads: dict[int, tuple[LoadBounds, ...]] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def shape_key(self) -> tuple[str, ...]:
        return tuple(s.how.value for s in self.steps)


_CASTS = {(DType.INT32, DType.INT32), (DType.INT32, DType.INT64), (DType.INT64, DType.INT64)}


def _unsupported(n: Node) -> str | None:
    """Why the kernel cannot bound TWO node `n` from its sources (None: it can)."""
    srcs = n.srcs
    if n.op is Op.LOAD:
        return "a load indexed by q_idx and kv_idx together"
    if n.op is Op.NOT and n.dtype.is_bool:
        return None
    if n.op in (Op.AND, Op.OR, Op.XOR) and n.dtype.is_bool:
        return None
    if n.op in COMPARE_OPS:
        a, b = srcs[0].dtype, srcs[1].dtype
        if a.is_bool == b.is_bool:
            return None
    if n.op is Op.CAST and (n.dtype.is_bool and srcs[0].dtype.is_bool):
        return None
    if n.op is Op.CAST and (srcs[0].dtype, n.dtype) in _CASTS:
        return None
    return f"{n.op.name.lower()} of values that vary with both q_idx and kv_idx"


def _in_kernel(n: Node, st: _Static) -> bool:
    """Whether line node `n` is computed in the kernel with no torch operation at all: a
    comparison of two affine integers (its difference has unit steps, so its bounds are exact),
    or logic over such comparisons (exact unless two of them are mixed in one tile; witnesses
    settle those)."""
    if id(n) in st.diff:
        return True
    if n.dtype.is_bool and n.op in (Op.AND, Op.OR, Op.XOR, Op.NOT):
        return all(s.dtype.is_bool and _in_kernel(s, st) for s in n.srcs)
    return False


def make_plan(mask: TracedMod, grid: TileGrid) -> Plan:
    st = _Static(mask.output, grid)
    if not mask.output.dtype.is_bool:
        return Plan(st, (), "the mask is not a bool")
    how: dict[int, How] = {}
    reason: str | None = None

    def visit(n: Node) -> None:
        nonlocal reason
        key = id(n)
        if key in how or reason is not None:
            return
        sig = st.sig[key]
        if key in st.diff:
            how[key] = How.DIFF
        elif key in st.affine:
            how[key] = How.AFFINE
        elif sig is Sig.TWO or _in_kernel(n, st):
            if sig is Sig.TWO:
                reason = _unsupported(n)
            for s in n.srcs:
                visit(s)
            how[key] = How.TRANSFER
        elif n.op is not Op.CAPTURE:
            how[key] = How.PREFIX if (sig is Sig.D and n.dtype.is_bool) else How.LINE

    visit(mask.output)
    loads: dict[int, tuple[LoadBounds, ...]] = {}
    for n in st.order:
        if how.get(id(n)) is How.LINE and st.sig[id(n)] in (Sig.Q, Sig.K):
            found = _affine_loads(n, st)
            if found is not None and (n.dtype.is_bool or n.dtype in _KLINE_INTS):
                how[id(n)] = How.KLINE
                loads[id(n)] = found
    steps = tuple(Step(n, how[id(n)]) for n in st.order if id(n) in how)
    return Plan(st, steps, reason, loads)


_KLINE_INTS = (DType.INT32, DType.INT64)


def _affine_loads(n: Node, st: _Static) -> tuple[LoadBounds, ...] | None:
    """The loads under `n`, when every index of each is an affine form (None otherwise): then
    whether they stay in bounds is known from the lengths and shapes alone."""
    out = []
    for m in toposort([n]):
        if m.op is Op.LOAD:
            forms = tuple(st.affine.get(id(i)) for i in m.srcs[1:])
            if any(f is None for f in forms):
                return None
            out.append(LoadBounds(m.srcs[0].arg.slot, forms))
    return tuple(out)


def _in_bounds(load: LoadBounds, grid: TileGrid, sig: Sig, tensors) -> bool:
    """Whether the load reads in bounds at every position of the line (Note [Loads out of
    bounds]): then the kernel needs no out-of-bounds flags for it."""
    top = {
        "b": grid.batch - 1,
        "h": grid.heads - 1,
        "q_idx": grid.q_len - 1 if sig is Sig.Q else 0,
        "kv_idx": grid.kv_len - 1 if sig is Sig.K else 0,
    }
    shape = tensors[load.slot].shape
    for dim, form in enumerate(load.indices):
        lo = hi = form.const
        for name, c in form.coeffs:
            lo, hi = lo + min(0, c * top[name]), hi + max(0, c * top[name])
        if lo < 0 or hi > shape[dim] - 1:
            return False
    return True


_plans: collections.OrderedDict[tuple, tuple[Node, Plan]] = collections.OrderedDict()
_PLANS_KEPT = 64


def plan_for(mask: TracedMod, grid: TileGrid) -> Plan:
    """The cached plan of `mask` for the grid's lengths (the affine forms trusted depend on them)."""
    key = (id(mask.output), grid.batch, grid.heads, grid.q_len, grid.kv_len)
    hit = _plans.get(key)
    if hit is not None and hit[0] is mask.output:
        _plans.move_to_end(key)
        return hit[1]
    plan = make_plan(mask, grid)
    _plans[key] = (mask.output, plan)  # the node is kept alive, so its id is not reused
    while len(_plans) > _PLANS_KEPT:
        _plans.popitem(last=False)
    return plan


# ------------------------------------------------------------------------------------------------
# Kernel inputs, as they are known at a call: tensors, and their static description.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TruthInput:
    """A Truth as three bool tensors over the grid."""


@dataclasses.dataclass(frozen=True)
class IntervalInput:
    """An Interval as float64 bounds over the grid, with optional NaN and contiguity flags."""

    nan: bool
    contiguous: bool
    tight: bool


@dataclasses.dataclass(frozen=True)
class PrefixInput:
    """Prefix sums of a bool of q_idx - kv_idx, [b, h, U + 1] with row strides."""


@dataclasses.dataclass(frozen=True)
class KernelLineInput:
    """A q- or kv-line node evaluated in the kernel (no tensor)."""


Input = TruthInput | IntervalInput | PrefixInput | KernelLineInput


class _Args:
    """The kernel arguments after the fixed ones: tensors with their strides."""

    def __init__(self, grid: TileGrid) -> None:
        self.grid = grid
        self.values: list[object] = []
        self.names: list[str] = []

    def grid_tensor(self, t: torch.Tensor) -> str:
        """A tensor that broadcasts over [B, H, nq, nkv]; returns its parameter name."""
        while t.ndim < 4:
            t = t.unsqueeze(0)
        t = t.expand(self.grid.shape)
        if t.dtype == torch.bool:
            t = t.view(torch.int8)
        name = f"x{len(self.names) // 5}"
        self.names += [name, f"{name}_sb", f"{name}_sh", f"{name}_si", f"{name}_sj"]
        self.values += [t, *t.stride()]
        return name

    def prefix_tensor(self, t: torch.Tensor) -> str:
        """Prefix sums [b, h, U + 1] (b, h of size 1 broadcast)."""
        name = f"x{len(self.names) // 5}"
        sb = t.stride(0) if t.shape[0] > 1 else 0
        sh = t.stride(1) if t.shape[1] > 1 else 0
        # Padded to five names, so every input has one parameter block of the same size.
        self.names += [name, f"{name}_sb", f"{name}_sh", f"{name}_si", f"{name}_sj"]
        self.values += [t, sb, sh, 0, 0]
        return name


# ------------------------------------------------------------------------------------------------
# The emitter: the TWO nodes as Triton code mirroring flexfa.blockmask.intervals.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _T:
    """A Truth in the kernel: `{v}_t`, `{v}_f`, `{v}_b`."""

    v: str


@dataclasses.dataclass(frozen=True)
class _I:
    """An Interval in the kernel: `{v}_lo`, `{v}_hi`, and `{v}_nan` / `{v}_c` where present."""

    v: str
    nan: bool
    contiguous: bool
    tight: bool


def _load(name: str) -> str:
    return f"tl.load({name} + b * {name}_sb + h * {name}_sh + i * {name}_si + j * {name}_sj)"


class _Emitter:
    def __init__(
        self, plan: Plan, inputs: dict[int, tuple[Input, tuple[str, ...]]], root: Node
    ) -> None:
        self.plan = plan
        self.root = root
        self.inputs = inputs
        self.lines: list[str] = []
        self.values: dict[int, _T | _I] = {}
        self.functions: list[tuple[str, Node]] = []  # device functions of KLINE nodes
        self.capture_args = ""

    def emit(self, oob: tuple[str, ...]) -> str:
        for k, step in enumerate(self.plan.steps):
            self.values[id(step.node)] = self._step(f"v{k}", step)
        for name in oob:
            self.lines.append(f"safe = safe & ({_load(name)} == 0)")
        root = self.values[id(self.root)]
        assert isinstance(root, _T)
        return root.v

    def _out(self, line: str) -> None:
        self.lines.append(line)

    def _truth(self, v: str, t: str, f: str, both: str) -> _T:
        self._out(f"{v}_t = {t}")
        self._out(f"{v}_f = {f}")
        self._out(f"{v}_b = {both}")
        return _T(v)

    def _step(self, v: str, step: Step) -> _T | _I:
        n = step.node
        st = self.plan.static
        if step.how is How.PREFIX:
            (name,) = self.inputs[id(n)][1]
            self._out(f"{v}_row = {name} + b * {name}_sb + h * {name}_sh")
            self._out(f"{v}_lo = q_lo - kv_hi + (Lkv - 1)")
            self._out(f"{v}_hi = q_hi - kv_lo + (Lkv - 1)")
            self._out(f"{v}_n = tl.load({v}_row + {v}_hi + 1) - tl.load({v}_row + {v}_lo)")
            return self._truth(v, f"{v}_n > 0", f"{v}_n < {v}_hi - {v}_lo + 1", f"{v}_t & {v}_f")
        if step.how in (How.LINE, How.KLINE):
            desc, names = self.inputs[id(n)]
            if isinstance(desc, KernelLineInput):
                return self._kernel_line(v, n)
            if isinstance(desc, TruthInput):
                t, f, both = (f"{_load(x)} != 0" for x in names)
                return self._truth(v, t, f, both)
            assert isinstance(desc, IntervalInput)
            self._out(f"{v}_lo = {_load(names[0])}")
            self._out(f"{v}_hi = {_load(names[1])}")
            rest = list(names[2:])
            if desc.nan:
                self._out(f"{v}_nan = {_load(rest.pop(0))} != 0")
            if desc.contiguous:
                self._out(f"{v}_c = {_load(rest.pop(0))} != 0")
            return _I(v, desc.nan, desc.contiguous, desc.tight)
        if step.how is How.AFFINE:
            return self._affine(v, st.affine[id(n)])
        if step.how is How.DIFF:
            d = self._affine(v + "d", st.diff[id(n)])
            return self._difference_sign(v, n.op, d)
        return self._transfer(v, n)

    def _kernel_line(self, v: str, n: Node) -> _T | _I:
        """`_Line.abstract` over each tile's block, evaluated here: the node's device function at
        every position of the block (and the next one, for the steps)."""
        fn = f"line_{v}"
        self.functions.append((fn, n))
        sig = self.plan.static.sig[id(n)]
        pos, ok, hi = ("q_pos", "q_ok", "q_hi") if sig is Sig.Q else ("kv_pos", "kv_ok", "kv_hi")
        args = f"{pos}, origin" if sig is Sig.Q else f"origin, {pos}"
        nxt = f"{pos} + 1, origin" if sig is Sig.Q else f"origin, {pos} + 1"
        self._out(
            f"{v}_x = {fn}(b, h, {args}{self.capture_args}) & ({ok} | ~{ok})"
            if n.dtype.is_bool
            else f"{v}_x = {fn}(b, h, {args}{self.capture_args}) + 0 * {pos}"
        )
        if n.dtype.is_bool:
            self._out(f"{v}_n = tl.sum(({v}_x & {ok}).to(tl.int32), 1)")
            self._out(f"{v}_len = tl.sum({ok}.to(tl.int32), 1)")
            return self._truth(v, f"{v}_n > 0", f"{v}_n < {v}_len", f"{v}_t & {v}_f")
        big = "2147483647" if n.dtype is DType.INT32 else "tl.full([], 2**62, tl.int64)"
        self._out(f"{v}_y = {fn}(b, h, {nxt}{self.capture_args}) + 0 * {pos}")
        self._out(f"{v}_mn = tl.min(tl.where({ok}, {v}_x, {big}), 1)")
        self._out(f"{v}_mx = tl.max(tl.where({ok}, {v}_x, -{big}), 1)")
        self._out(f"{v}_step = tl.where({pos} + 1 <= {hi}[:, None], {v}_y - {v}_x, 0)")
        self._out(f"{v}_c = tl.max(((({v}_step > 1) | ({v}_step < -1))).to(tl.int32), 1) == 0")
        if n.dtype is DType.INT32:
            self._out(f"{v}_lo = {v}_mn.to(tl.float64)")
            self._out(f"{v}_hi = {v}_mx.to(tl.float64)")
            return _I(v, nan=False, contiguous=True, tight=True)
        # int64: past 2**52 float64 bounds are not exact (Note [Bounds as float64]): unbounded.
        self._out(f"{v}_small = ({v}_mn >= -(2**52)) & ({v}_mx <= 2**52)")
        self._out(f"{v}_lo = tl.where({v}_small, {v}_mn.to(tl.float64), -float('inf'))")
        self._out(f"{v}_hi = tl.where({v}_small, {v}_mx.to(tl.float64), float('inf'))")
        self._out(f"{v}_c = {v}_c & {v}_small")
        return _I(v, nan=False, contiguous=True, tight=False)

    def _affine(self, v: str, form) -> _I:
        """`analysis._affine_bounds`: exact bounds at the tile's corners (int64, then float64)."""
        ranges = {
            "b": ("b", "b"),
            "h": ("h", "h"),
            "q_idx": ("q_lo", "q_hi"),
            "kv_idx": ("kv_lo", "kv_hi"),
        }
        lo, hi = [str(form.const)], [str(form.const)]
        for name, c in form.coeffs:
            a, z = ranges[name]
            small, large = (a, z) if c > 0 else (z, a)
            lo.append(f"{c} * {small}.to(tl.int64)")
            hi.append(f"{c} * {large}.to(tl.int64)")
        self._out(f"{v}_lo = ({' + '.join(lo)}).to(tl.float64)")
        self._out(f"{v}_hi = ({' + '.join(hi)}).to(tl.float64)")
        cq, ck = form.coeff("q_idx"), form.coeff("kv_idx")
        unit = (abs(cq), abs(ck)) in ((0, 0), (1, 0), (0, 1)) or (abs(cq) == 1 and cq == -ck)
        if unit:
            self._out(f"{v}_c = one")
        return _I(v, nan=False, contiguous=unit, tight=True)

    def _difference_sign(self, v: str, op: Op, d: _I) -> _T:
        """`intervals.difference_sign`."""
        lo, hi = f"{d.v}_lo", f"{d.v}_hi"
        if op is Op.LT:
            t, f = f"{hi} > 0", f"{lo} <= 0"
        elif op is Op.LE:
            t, f = f"{hi} >= 0", f"{lo} < 0"
        elif op is Op.EQ:
            t, f = f"({lo} <= 0) & ({hi} >= 0)", f"~(({lo} == 0) & ({hi} == 0))"
        else:
            t, f = f"~(({lo} == 0) & ({hi} == 0))", f"({lo} <= 0) & ({hi} >= 0)"
        # With unit steps every integer between the bounds is a difference at some pair, so a
        # mixed tile is proven for == and != as well.
        exact = (d.tight and op in (Op.LT, Op.LE)) or (d.contiguous and op in (Op.EQ, Op.NE))
        return self._truth(v, t, f, f"{v}_t & {v}_f" if exact else "zero")

    def _transfer(self, v: str, n: Node) -> _T | _I:
        srcs = [self.values[id(s)] for s in n.srcs]
        if n.op is Op.CAST:
            (a,) = srcs
            return a  # bool -> bool, and int casts that cannot wrap (see _CASTS)
        if n.op is Op.NOT:
            (a,) = srcs
            assert isinstance(a, _T)
            return self._truth(v, f"{a.v}_f", f"{a.v}_t", f"{a.v}_b")
        if n.op in (Op.AND, Op.OR, Op.XOR) and isinstance(srcs[0], _T):
            return self._logic(v, n.op, *srcs)
        assert n.op in COMPARE_OPS
        a, b = srcs
        if isinstance(a, _T):
            x = self._logic(v + "x", Op.XOR, a, b)
            if n.op is Op.EQ:
                return self._truth(v, f"{x.v}_f", f"{x.v}_t", f"{x.v}_b")
            return x
        st = self.plan.static
        indep = _independent(st.sig[id(n.srcs[0])], st.sig[id(n.srcs[1])])
        return self._compare(v, n.op, a, b, indep)

    def _logic(self, v: str, op: Op, a: _T, b: _T) -> _T:
        """`intervals.logical_and`, `logical_or`, `logical_xor`."""
        a, b = a.v, b.v
        if op is Op.AND:
            both = f"({a}_b & ~{b}_f) | ({b}_b & ~{a}_f)"
            return self._truth(v, f"{a}_t & {b}_t", f"{a}_f | {b}_f", both)
        if op is Op.OR:
            both = f"({a}_b & ~{b}_t) | ({b}_b & ~{a}_t)"
            return self._truth(v, f"{a}_t | {b}_t", f"{a}_f & {b}_f", both)
        t = f"({a}_t & {b}_f) | ({a}_f & {b}_t)"
        f = f"({a}_t & {b}_t) | ({a}_f & {b}_f)"
        both = f"({a}_b & (~{b}_t | ~{b}_f)) | ({b}_b & (~{a}_t | ~{a}_f))"
        return self._truth(v, t, f, both)

    def _compare(self, v: str, op: Op, a: _I, b: _I, independent: bool) -> _T:
        """`intervals.independent_compare`."""
        nan = " | ".join(f"{x.v}_nan" for x in (a, b) if x.nan) or None
        if nan:
            self._out(f"{v}_nan = {nan}")
        if op in (Op.LT, Op.LE):
            if op is Op.LT:
                t, f = f"{a.v}_lo < {b.v}_hi", f"{a.v}_hi >= {b.v}_lo"
            else:
                t, f = f"{a.v}_lo <= {b.v}_hi", f"{a.v}_hi > {b.v}_lo"
            if nan:
                f = f"({f}) | {v}_nan"
            if not (independent and a.tight and b.tight):
                both = "zero"
            else:
                both = f"{v}_t & {v}_f" + (f" & ~{v}_nan" if nan else "")
            return self._truth(v, t, f, both)
        self._out(f"{v}_ov = ({a.v}_lo <= {b.v}_hi) & ({b.v}_lo <= {a.v}_hi)")
        same = f"({a.v}_lo == {a.v}_hi) & ({b.v}_lo == {b.v}_hi) & ({a.v}_lo == {b.v}_lo)"
        if nan:
            same = f"{same} & ~{v}_nan"
        self._out(f"{v}_same = {same}")
        both = "zero"
        if independent and a.contiguous and b.contiguous:
            both = f"{v}_ov & ~{v}_same & {a.v}_c & {b.v}_c"
        if op is Op.EQ:
            return self._truth(v, f"{v}_ov", f"~{v}_same", both)
        return self._truth(v, f"~{v}_same", f"{v}_ov", both)


# ------------------------------------------------------------------------------------------------
# Rendering, loading and launching.
# ------------------------------------------------------------------------------------------------


# Witness pairs per undecided tile (a subset of Note [Witness candidates]): corners, centre, edge
# midpoints, the diagonal q_idx - kv_idx in {-1, 0, 1} where it crosses the tile, and neighbours of
# corners. Every pair lies inside the tile; only a pair allowed and a pair excluded prove anything.
_CLAMP_Q = "tl.minimum(tl.maximum({}, q_lo), q_hi)"
_CLAMP_KV = "tl.minimum(tl.maximum({}, kv_lo), kv_hi)"
_WITNESSES = (
    ("q_lo", "kv_lo"),
    ("q_lo", "kv_hi"),
    ("q_hi", "kv_lo"),
    ("q_hi", "kv_hi"),
    ("q_mid", "kv_mid"),
    ("q_lo", "kv_mid"),
    ("q_hi", "kv_mid"),
    ("q_mid", "kv_lo"),
    ("q_mid", "kv_hi"),
    *(
        (
            _CLAMP_Q.format(f"kv_lo + {t}"),
            _CLAMP_KV.format(f"{_CLAMP_Q.format(f'kv_lo + {t}')} - {t}"),
        )
        for t in (-1, 0, 1)
    ),
    ("q_lo", _CLAMP_KV.format("kv_lo + 1")),
    ("q_hi", _CLAMP_KV.format("kv_hi - 1")),
    (_CLAMP_Q.format("q_lo + 1"), "kv_lo"),
    (_CLAMP_Q.format("q_hi - 1"), "kv_hi"),
)


def render(
    mask: TracedMod, plan: Plan, inputs: dict, oob: tuple[str, ...], names: list[str]
) -> str:
    """The module: prelude, the mask_mod as a device function, the kernel for this plan."""
    from flexfa import __version__
    from flexfa.codegen.triton import emit, module

    emitter = _Emitter(plan, inputs, mask.output)
    fn = emit.emit_mod(mask, f"mask_mod_{mask.name}")
    captures = [f"mm_{p}" for p in fn.params]
    emitter.capture_args = "".join(f", {n}" for n in captures)
    root = emitter.emit(oob)
    env = module.jinja_environment()
    lines_src = "".join(
        "\n\n" + emit.emit_mod(dataclasses.replace(mask, output=node), name).source
        for name, node in emitter.functions
    )
    kernel = env.get_template("block_lists.py.jinja").render(
        params="".join(f"\n    {n}," for n in names),
        args="".join(f"\n                {n}," for n in names),
        capture_params="".join(f"\n    {n}," for n in captures),
        capture_call_args="".join(f"\n                {n}," for n in captures),
        capture_args="".join(f", {n}" for n in captures),
        mask_fn=fn.name,
        witnesses=_WITNESSES,
        body="\n    ".join(emitter.lines),
        root=root,
    )
    prelude = env.get_template("prelude.py.jinja").render(flexfa_version=__version__)
    return prelude + "\n\n" + fn.source + lines_src + kernel


_modules: dict[str, types.ModuleType] = {}
_sources: dict[tuple, tuple[str, str]] = {}
_lock = threading.Lock()


def _kernel(source: str, digest: str):
    from flexfa.codegen.triton import module

    with _lock:
        mod = _modules.get(digest)
        if mod is None:
            path = config.cache_dir / "blockmask" / f"lists_{digest[:24]}" / "kernels.py"
            if not path.exists():
                module.atomic_write(path, source)
            mod = module.import_file(path, f"flexfa_block_lists_{digest[:24]}")
            _modules[digest] = mod
    return mod.flexfa_block_lists


def clear_memory_cache() -> None:
    """Forget loaded kernels and rendered sources (the files on disk stay)."""
    with _lock:
        _modules.clear()
        _sources.clear()


@functools.lru_cache(maxsize=1)
def _versions() -> str:
    import triton

    from flexfa import __version__
    from flexfa.codegen.triton.module import TEMPLATE_DIR

    h = hashlib.sha256((TEMPLATE_DIR / "block_lists.py.jinja").read_bytes())
    return f"{__version__}:{triton.__version__}:{h.hexdigest()[:16]}"


def _pow2_at_least(n: int, cap: int) -> int:
    """The least power of two >= n (at least 16), or `cap` if that is smaller."""
    p = 16
    while p < n and p < cap:
        p *= 2
    return p


# Elements of the output buffer are addressed with int32 offsets in the kernel.
_MAX_ELEMENTS = 2**31 - 1
_CHUNK_CAP = 1024
_KLINE_CHUNK_CAP = 16


def _capture_args(mask: TracedMod) -> list:
    out: list = []
    for t in mask.tensors:
        out.append(t)
        out.extend(t.stride())
        out.extend(t.shape)
    return out


def build(mask: TracedMod, grid: TileGrid) -> BlockMask | None:
    """The BlockMask of `mask` on `grid` from one kernel (Note [Fused analysis]), or None when the
    general path must build it (the reason is logged at DEBUG level)."""
    plan = plan_for(mask, grid)
    if plan.reason is not None:
        log.debug("flexfa: block mask of %s takes the general path: %s", mask.name, plan.reason)
        return None
    P = grid.batch * grid.heads
    nq, nkv = grid.num_q_blocks, grid.num_kv_blocks
    # counts: kv partial, kv full, q partial, q full; then the indices in the same order.
    sizes = (P * nq, P * nq, P * nkv, P * nkv) + (P * nq * nkv,) * 4
    if sum(sizes) + 1 > _MAX_ELEMENTS:
        log.debug("flexfa: block mask of %s takes the general path: too many tiles", mask.name)
        return None
    args = _Args(grid)
    inputs: dict[int, tuple[Input, tuple[str, ...]]] = {}
    lines: dict[Sig, _Line] = {}
    ts: TileSet | None = None
    for step in plan.steps:
        n = step.node
        if step.how not in (How.PREFIX, How.LINE, How.KLINE):
            continue
        sig = plan.static.sig[id(n)]
        if step.how is How.KLINE and all(
            _in_bounds(ld, grid, sig, mask.tensors) for ld in plan.loads[id(n)]
        ):
            inputs[id(n)] = (KernelLineInput(), ())
            continue
        line = lines.get(sig)
        if line is None:
            line = lines[sig] = _Line(sig, mask, grid)
        if step.how is How.PREFIX:
            values = line.value(n)
            prefix = torch.zeros(
                *values.shape[:-1], values.shape[-1] + 1, dtype=torch.int32, device=grid.device
            )
            torch.cumsum(values, -1, dtype=torch.int32, out=prefix[..., 1:])
            inputs[id(n)] = (PrefixInput(), (args.prefix_tensor(prefix),))
            continue
        if ts is None:
            ts = TileSet.of_grid(grid)
        a = line.abstract(n, ts)
        if isinstance(a, Truth):
            names = tuple(args.grid_tensor(x) for x in (a.may_true, a.may_false, a.both))
            inputs[id(n)] = (TruthInput(), names)
            continue
        assert isinstance(a, Interval)
        tensors = [a.lo, a.hi]
        if a.nan is not None:
            tensors.append(a.nan)
        if a.contiguous is not None:
            tensors.append(a.contiguous)
        desc = IntervalInput(a.nan is not None, a.contiguous is not None, a.tight)
        inputs[id(n)] = (desc, tuple(args.grid_tensor(x) for x in tensors))
    oob: list[str] = []
    for line in lines.values():
        if line.evaluator.out_of_bounds is None:
            continue
        if ts is None:
            ts = TileSet.of_grid(grid)
        flag = line.out_of_bounds(ts)
        if flag is not None:
            oob.append(args.grid_tensor(flag))
    descs = tuple(inputs[id(s.node)][0] for s in plan.steps if id(s.node) in inputs)
    source_key = (mask.key, plan.shape_key, descs, len(oob), _versions())
    hit = _sources.get(source_key)
    if hit is None:
        source = render(mask, plan, inputs, tuple(oob), args.names)
        hit = _sources[source_key] = (source, hashlib.sha256(source.encode()).hexdigest())
    kernel = _kernel(*hit)

    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    total = offsets[-1]
    out = torch.zeros(total + 1, dtype=torch.int32, device=grid.device)
    # Lines evaluated in the kernel hold [CHUNK, block] values: fewer tiles per step then.
    kernel_lines = any(isinstance(d, KernelLineInput) for d in descs)
    chunk_cap = _KLINE_CHUNK_CAP if kernel_lines else _CHUNK_CAP
    undecided = out[total:]
    bs = grid.block_size
    kernel[(nq + nkv, P)](
        out, undecided, grid.q_len, grid.kv_len, nq, nkv, grid.heads,
        *offsets[:8], *args.values, *_capture_args(mask),
        BLOCK_Q=bs.q, BLOCK_KV=bs.kv, BQ_P2=_pow2_at_least(bs.q, bs.q),
        BKV_P2=_pow2_at_least(bs.kv, bs.kv), CHUNK=_pow2_at_least(max(nq, nkv), chunk_cap),
    )  # fmt: skip
    if int(undecided.item()) != 0:
        log.debug("flexfa: block mask of %s takes the general path: undecided tiles", mask.name)
        return None
    B, H = grid.batch, grid.heads

    def part(k: int, *shape: int) -> torch.Tensor:
        return out[offsets[k] : offsets[k + 1]].view(B, H, *shape)

    return BlockMask(
        q_len=grid.q_len,
        kv_len=grid.kv_len,
        block_size=bs,
        kv_partial=BlockList(part(0, nq), part(4, nq, nkv)),
        kv_full=BlockList(part(1, nq), part(5, nq, nkv)),
        q_partial=BlockList(part(2, nkv), part(6, nkv, nq)),
        q_full=BlockList(part(3, nkv), part(7, nkv, nq)),
        mask=mask,
    )
