"""The plan of the fused block-mask kernel: how each node of a mask gets its abstract value, and
what the kernel is given for it (Note [Fused analysis] in flexfa/codegen/triton/blockmask/fused.py)."""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools

from flexfa.blockmask.analysis import Static
from flexfa.blockmask.grid import TileGrid
from flexfa.blockmask.lines import Sig
from flexfa.frontend.trace import TracedMod
from flexfa.ir.dtypes import DType
from flexfa.ir.nodes import COMPARE_OPS, Node, Op, toposort


class How(enum.Enum):
    PREFIX = "prefix"  # a bool of q_idx - kv_idx: prefix sums, counted per tile in the kernel
    LINE = "line"  # another line node: per-tile tensors from `Line.abstract`
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

    static: Static
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


def _in_kernel(n: Node, st: Static) -> bool:
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
    st = Static(mask.output, grid)
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


def _affine_loads(n: Node, st: Static) -> tuple[LoadBounds, ...] | None:
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


def load_in_bounds(load: LoadBounds, grid: TileGrid, sig: Sig, tensors) -> bool:
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
