"""Abstract values for the analytic tier: what a mask's IR nodes can take over each tile.

Every abstract value describes one node over *all tiles at once*: its tensors broadcast to the tile
grid `[B', H', q-blocks, kv-blocks]` (a size-1 dim means "the same for every tile along it").

- `Interval(lo, hi, nan, tight, contiguous)` for integers and floats: every value the node takes
  at an in-range pair of the tile lies in `[lo, hi]`, or is NaN where `nan` allows it. `tight`
  says `lo` and `hi` are themselves taken in every tile (true for exact ranges), which lets
  comparisons prove that a tile is partial; `contiguous` (per tile, integers) says every integer
  of `[lo, hi]` is taken, which does the same for `==`.
- `Truth(may_true, may_false, both)` for bools: `may_true` is False only where the node is False at
  every pair of the tile (likewise `may_false`); `both` is True only where it is *proven* that the
  node is True at some pair and False at another.

The transfer functions below over-approximate: a `may_*` flag may be True where the truth is
"never", `[lo, hi]` may be wider than the values, `both` may be False where the node is mixed.
They never do the opposite; the tests check this against dense evaluation.

# Note [Bounds as float64]
# Bounds are float64 tensors, for integers as well as floats: +-inf then means "unbounded" and
# arithmetic on unbounded sides needs no special cases. An integer bound is kept only while its
# magnitude is at most 2**52, where float64 holds every integer and sums and products of such
# integers are computed exactly (a product whose true value exceeds 2**53 rounds to a float above
# 2**52, so the check still sees it). An int32 node whose bounds leave the int32 range may have
# wrapped, so it gets the whole int32 range; an int64 node with a bound past 2**52 (either side)
# may have wrapped past 2**63 or lost exactness, so it gets (-inf, inf). Otherwise the bounds are
# exact mathematical bounds of a value that did not wrap.
#
# Float nodes are computed in float32 by kernels (float64 for float64 nodes). Their bounds are
# widened after each rounding operation by a relative 2**-20 (2**-16 after transcendental functions,
# whose library or hardware approximations may err by a few ulps) plus 1e-37 absolute for
# flush-to-zero, which covers float32 rounding. Converting an integer to float is exact below 2**24
# (float32) and is not widened there, so comparisons of converted indices stay exact.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from flexfa.ir.dtypes import DType
from flexfa.ir.nodes import Op

_EXACT = float(2**52)
_INT32_MIN = float(-(2**31))
_INT32_MAX = float(2**31 - 1)
_REL = 2.0**-20
_REL_TRANSCENDENTAL = 2.0**-16
_ABS = 1e-37
_INF = math.inf
_F64 = torch.float64
_NARROW_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class Interval:
    """Bounds of a number over each tile (see the module docstring)."""

    lo: torch.Tensor
    hi: torch.Tensor
    nan: torch.Tensor | None = None
    tight: bool = False
    contiguous: torch.Tensor | None = None

    @property
    def is_point(self) -> torch.Tensor:
        return self.lo == self.hi


@dataclasses.dataclass(frozen=True, eq=False)
class Truth:
    """What a bool can be over each tile (see the module docstring)."""

    may_true: torch.Tensor
    may_false: torch.Tensor
    both: torch.Tensor

    @property
    def must_true(self) -> torch.Tensor:
        return ~self.may_false

    @property
    def must_false(self) -> torch.Tensor:
        return ~self.may_true


Abstract = Interval | Truth


def _t(value: float | bool, device: torch.device, dtype: torch.dtype = _F64) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype, device=device)


def point(value: torch.Tensor, dtype: DType) -> Abstract:
    """The abstract value of a node known exactly (per (b, h), or everywhere)."""
    if dtype.is_bool:
        v = value.to(torch.bool)
        return Truth(v, ~v, torch.zeros_like(v))
    if dtype.is_int:
        one_value = torch.ones(value.shape, dtype=torch.bool, device=value.device)
        return from_int_range(value, value, dtype, tight=True, contiguous=one_value)
    v = value.to(_F64)
    nan = torch.isnan(v)
    v = torch.nan_to_num(v, nan=0.0, posinf=_INF, neginf=-_INF)
    return Interval(v, v, nan, tight=True)


def top(dtype: DType, device: torch.device) -> Abstract:
    """Knows nothing: any value of `dtype`."""
    if dtype.is_bool:
        yes = _t(True, device, torch.bool)
        return Truth(yes, yes, ~yes)
    if dtype is DType.INT32:
        return Interval(_t(_INT32_MIN, device), _t(_INT32_MAX, device))
    if dtype is DType.INT64:
        return Interval(_t(-_INF, device), _t(_INF, device))
    return Interval(_t(-_INF, device), _t(_INF, device), _t(True, device, torch.bool))


def from_int_range(
    lo: torch.Tensor,
    hi: torch.Tensor,
    dtype: DType,
    tight: bool,
    contiguous: torch.Tensor | None = None,
) -> Interval:
    """Bounds from exact integer tensors (e.g. min/max of a captured int64 table)."""
    if lo.dtype in _NARROW_INTS and hi.dtype in _NARROW_INTS:
        # Values of at most 32 bits fit both integer types exactly: nothing to normalize (and no
        # device-to-host check of `int_result`).
        return Interval(lo.to(_F64), hi.to(_F64), None, tight, contiguous)
    lo_f, hi_f = lo.to(_F64), hi.to(_F64)
    if lo.dtype == torch.int64:
        big = 2**52
        lo_f = torch.where(lo < -big, -_INF, torch.where(lo > big, _EXACT, lo_f))
        hi_f = torch.where(hi > big, _INF, torch.where(hi < -big, -_EXACT, hi_f))
        if bool(((lo.abs() > big) | (hi.abs() > big)).any()):
            tight, contiguous = False, None
    return int_result(lo_f, hi_f, dtype, tight, contiguous)


def int_result(
    lo: torch.Tensor,
    hi: torch.Tensor,
    dtype: DType,
    tight: bool = False,
    contiguous: torch.Tensor | None = None,
) -> Interval:
    """Normalizes integer bounds computed in float64 (Note [Bounds as float64])."""
    lo = torch.nan_to_num(lo, nan=-_INF)
    hi = torch.nan_to_num(hi, nan=_INF)
    if dtype is DType.INT32:
        wraps = (lo < _INT32_MIN) | (hi > _INT32_MAX)
        limits = (_INT32_MIN, _INT32_MAX)
    else:
        # Past 2**52 the bounds are no longer exact, and past 2**63 the value wraps.
        wraps = (lo < -_EXACT) | (lo > _EXACT) | (hi < -_EXACT) | (hi > _EXACT)
        limits = (-_INF, _INF)
    if bool(wraps.any()):
        lo = torch.where(wraps, limits[0], lo)
        hi = torch.where(wraps, limits[1], hi)
        tight, contiguous = False, None
    return Interval(lo, hi, None, tight, contiguous)


def float_result(
    lo: torch.Tensor,
    hi: torch.Tensor,
    nan: torch.Tensor | None,
    dtype: DType,
    rel: float = _REL,
) -> Interval:
    """Normalizes float bounds: NaN bounds become unbounded (and NaN possible); widens for rounding."""
    lo_nan, hi_nan = torch.isnan(lo), torch.isnan(hi)
    extra = lo_nan | hi_nan
    nan = extra if nan is None else (nan | extra)
    lo = torch.where(lo_nan, -_INF, lo)
    hi = torch.where(hi_nan, _INF, hi)
    if rel > 0:
        if dtype is DType.FLOAT64:
            rel = min(rel, 2.0**-40)
        lo = lo - lo.abs() * rel - _ABS
        hi = hi + hi.abs() * rel + _ABS
        lo = torch.nan_to_num(lo, nan=-_INF)  # -inf - inf * rel
        hi = torch.nan_to_num(hi, nan=_INF)
    if dtype in (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32):
        # Values past the format's largest finite number round to infinity.
        big = {DType.FLOAT16: 65504.0, DType.BFLOAT16: 3.39e38, DType.FLOAT32: 3.4028e38}[dtype]
        lo = torch.where(lo < -big, -_INF, lo)
        hi = torch.where(hi > big, _INF, hi)
    return Interval(lo, hi, nan, False)


def _or(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return a | b


def _nan_of(x: Interval) -> torch.Tensor:
    return x.nan if x.nan is not None else torch.zeros((), dtype=torch.bool, device=x.lo.device)


# ------------------------------------------------------------------------------------------------
# Numbers.
# ------------------------------------------------------------------------------------------------


def _corners(
    fn, a: Interval, b: Interval, nan_to: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """min and max of fn over the four corners, and whether some corner was NaN."""
    vals = [fn(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    stacked = torch.stack(torch.broadcast_tensors(*vals))
    isnan = torch.isnan(stacked)
    any_nan = isnan.any(0)
    if nan_to is not None:
        stacked = torch.where(isnan, nan_to, stacked)
    lo = torch.where(isnan, _INF, stacked).amin(0)
    hi = torch.where(isnan, -_INF, stacked).amax(0)
    return lo, hi, any_nan


def _may_be(x: Interval, value: float) -> torch.Tensor:
    return (x.lo <= value) & (x.hi >= value)


def add(a: Interval, b: Interval, dtype: DType) -> Interval:
    lo, hi = a.lo + b.lo, a.hi + b.hi
    if dtype.is_float:
        # inf + -inf is NaN.
        opposite = (_may_be(a, -_INF) & _may_be(b, _INF)) | (_may_be(a, _INF) & _may_be(b, -_INF))
        return float_result(lo, hi, _or(_or(a.nan, b.nan), opposite), dtype)
    return int_result(lo, hi, dtype)


def sub(a: Interval, b: Interval, dtype: DType) -> Interval:
    lo, hi = a.lo - b.hi, a.hi - b.lo
    if dtype.is_float:
        # inf - inf is NaN.
        same = (_may_be(a, _INF) & _may_be(b, _INF)) | (_may_be(a, -_INF) & _may_be(b, -_INF))
        return float_result(lo, hi, _or(_or(a.nan, b.nan), same), dtype)
    return int_result(lo, hi, dtype)


def neg(a: Interval, dtype: DType) -> Interval:
    # Negation is exact in every format; int32's -(-2**31) wraps to itself.
    if dtype.is_float:
        return Interval(-a.hi, -a.lo, a.nan, a.tight)
    return int_result(-a.hi, -a.lo, dtype, a.tight, a.contiguous)


def mul(a: Interval, b: Interval, dtype: DType) -> Interval:
    if dtype.is_float:
        # 0 * inf is NaN: a real possibility for float values (0 need not be a corner).
        lo, hi, some_nan = _corners(torch.mul, a, b, nan_to=0.0)
        a_inf = torch.isinf(a.lo) | torch.isinf(a.hi)
        b_inf = torch.isinf(b.lo) | torch.isinf(b.hi)
        zero_inf = (_may_be(a, 0.0) & b_inf) | (_may_be(b, 0.0) & a_inf)
        return float_result(lo, hi, _or(_or(_or(a.nan, b.nan), some_nan), zero_inf), dtype)
    # Integers are finite, so a 0 * inf corner is really 0 * (a large number) = 0.
    lo, hi, _ = _corners(torch.mul, a, b, nan_to=0.0)
    return int_result(lo, hi, dtype)


def truediv(a: Interval, b: Interval, dtype: DType) -> Interval:
    spans_zero = (b.lo <= 0) & (b.hi >= 0)
    lo, hi, some_nan = _corners(torch.div, a, b)
    lo = torch.where(spans_zero, -_INF, lo)
    hi = torch.where(spans_zero, _INF, hi)
    nan = _or(_or(_or(a.nan, b.nan), some_nan), spans_zero)
    return float_result(lo, hi, nan, dtype)


def _finite_int(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x, posinf=0.0, neginf=0.0).to(torch.int64)


def floordiv(a: Interval, b: Interval, dtype: DType) -> Interval:
    device = a.lo.device
    if dtype.is_float:
        q = truediv(a, b, dtype)
        # torch's floor division of an infinity (or by one) is NaN.
        inf = torch.isinf(a.lo) | torch.isinf(a.hi) | torch.isinf(b.lo) | torch.isinf(b.hi)
        lo = torch.where(inf, -_INF, torch.floor(q.lo))
        hi = torch.where(inf, _INF, torch.floor(q.hi))
        return float_result(lo, hi, _or(q.nan, inf), dtype, rel=0.0)
    # floor(a / b) is monotone in a, and in b on each side of 0: extremes sit at corners when the
    # divisor keeps one sign and is bounded (an unbounded divisor pushes floor(-1 / b) to -1).
    ok = ((b.lo > 0) | (b.hi < 0)) & torch.isfinite(b.lo) & torch.isfinite(b.hi)
    one = _t(1.0, device)
    b_lo = torch.where(ok, b.lo, one)
    b_hi = torch.where(ok, b.hi, one)
    vals = []
    for x in (a.lo, a.hi):
        for y in (b_lo, b_hi):
            exact = torch.div(_finite_int(x), _finite_int(y), rounding_mode="floor").to(_F64)
            # An unbounded numerator stays unbounded, with the sign of x / y.
            sign = torch.sign(x) * torch.sign(y)
            vals.append(torch.where(torch.isinf(x), sign * _INF, exact))
    stacked = torch.stack(torch.broadcast_tensors(*vals))
    lo = torch.where(ok, stacked.amin(0), -_INF)
    hi = torch.where(ok, stacked.amax(0), _INF)
    return int_result(lo, hi, dtype)


def mod(a: Interval, b: Interval, dtype: DType) -> Interval:
    """Floor modulo (the result has the sign of the divisor), as torch.remainder."""
    if dtype.is_float:
        # 0 <= r < b for b > 0, b < r <= 0 for b < 0; NaN for b = 0 or an infinite dividend.
        lo = torch.where(b.lo > 0, 0.0, torch.clamp(b.lo, max=0.0))
        hi = torch.where(b.hi < 0, 0.0, torch.clamp(b.hi, min=0.0))
        nan = _or(_or(a.nan, b.nan), (b.lo <= 0) & (b.hi >= 0))
        nan = nan | torch.isinf(a.lo) | torch.isinf(a.hi)
        return float_result(lo, hi, nan, dtype)
    positive = b.lo > 0
    negative = b.hi < 0
    # General bound: [0, b_hi - 1] for a positive divisor, [b_lo + 1, 0] for a negative one.
    lo = torch.where(positive, 0.0, torch.where(negative, b.lo + 1, -_INF))
    hi = torch.where(positive, b.hi - 1, torch.where(negative, 0.0, _INF))
    # A constant divisor d and a dividend within one period of d: r = a - d * floor(a / d) is
    # increasing in a there, so [a_lo mod d, a_hi mod d] is exact.
    d_point = (b.lo == b.hi) & (positive | negative) & torch.isfinite(b.lo)
    finite_a = torch.isfinite(a.lo) & torch.isfinite(a.hi)
    d = _finite_int(torch.where(d_point, b.lo, 1.0))
    a_lo, a_hi = _finite_int(a.lo), _finite_int(a.hi)
    same_period = torch.div(a_lo, d, rounding_mode="floor") == torch.div(
        a_hi, d, rounding_mode="floor"
    )
    exact = d_point & finite_a & same_period
    lo = torch.where(exact, torch.remainder(a_lo, d).to(_F64), lo)
    hi = torch.where(exact, torch.remainder(a_hi, d).to(_F64), hi)
    # A dividend already inside [0, d) is its own remainder (tightens a wide divisor range too).
    inside = (a.lo >= 0) & (b.lo > 0) & (a.hi < b.lo)
    lo = torch.where(inside, a.lo, lo)
    hi = torch.where(inside, a.hi, hi)
    # Division by zero: torch raises on CPU and is undefined on GPU; claim nothing.
    zero = ~(positive | negative)
    lo = torch.where(zero, -_INF, lo)
    hi = torch.where(zero, _INF, hi)
    return int_result(lo, hi, dtype)


def minimum(a: Interval, b: Interval, dtype: DType) -> Interval:
    nan = _or(a.nan, b.nan)  # torch.minimum propagates NaN
    out = Interval(torch.minimum(a.lo, b.lo), torch.minimum(a.hi, b.hi), nan, False)
    return out if dtype.is_float else int_result(out.lo, out.hi, dtype)


def maximum(a: Interval, b: Interval, dtype: DType) -> Interval:
    nan = _or(a.nan, b.nan)
    out = Interval(torch.maximum(a.lo, b.lo), torch.maximum(a.hi, b.hi), nan, False)
    return out if dtype.is_float else int_result(out.lo, out.hi, dtype)


def absolute(a: Interval, dtype: DType) -> Interval:
    lo = torch.where(a.lo >= 0, a.lo, torch.where(a.hi <= 0, -a.hi, torch.zeros_like(a.lo)))
    hi = torch.maximum(a.lo.abs(), a.hi.abs())
    if dtype.is_float:
        return Interval(lo, hi, a.nan, False)
    return int_result(lo, hi, dtype)  # abs(-2**31) wraps in int32: int_result sees 2**31


def sign(a: Interval, dtype: DType) -> Interval:
    lo, hi = torch.sign(a.lo), torch.sign(a.hi)
    if dtype.is_float:
        if a.nan is not None:  # torch.sign(nan) is 0
            lo = torch.where(a.nan, torch.clamp(lo, max=0.0), lo)
            hi = torch.where(a.nan, torch.clamp(hi, min=0.0), hi)
        return Interval(lo, hi, a.nan, False)
    return int_result(lo, hi, dtype)


def monotone(
    fn, a: Interval, dtype: DType, *, increasing: bool = True, rel: float = _REL_TRANSCENDENTAL
) -> Interval:
    """An increasing (or decreasing) function applied to bounds; NaN where fn gives NaN."""
    lo, hi = fn(a.lo), fn(a.hi)
    if not increasing:
        lo, hi = hi, lo
    return float_result(lo, hi, a.nan, dtype, rel=rel)


def log_like(fn, a: Interval, dtype: DType) -> Interval:
    """log, log2, sqrt, rsqrt: NaN below 0."""
    negative = a.lo < 0
    lo_in = torch.clamp(a.lo, min=0.0)
    hi_in = torch.clamp(a.hi, min=0.0)
    lo, hi = fn(lo_in), fn(hi_in)
    if fn is torch.rsqrt:
        # Decreasing; and rsqrt(-0.0) is -inf.
        lo, hi = torch.where(a.lo <= 0, -_INF, hi), lo
    nan = _or(a.nan, negative)
    out = float_result(lo, hi, nan, dtype, rel=_REL_TRANSCENDENTAL)
    # Every input below 0 is NaN: then no number is taken at all; keep the bounds (harmless).
    return out


def periodic(a: Interval, dtype: DType) -> Interval:
    device = a.lo.device
    nan = _or(a.nan, torch.isinf(a.lo) | torch.isinf(a.hi))
    return float_result(_t(-1.0, device), _t(1.0, device), nan, dtype)


def pow_(a: Interval, b: Interval, dtype: DType) -> Interval:
    device = a.lo.device
    if dtype.is_float:
        return top(dtype, device)  # type: ignore[return-value]
    # Small non-negative constant exponents by repeated multiplication (exact); otherwise nothing.
    e_point = (b.lo == b.hi) & (b.lo >= 0) & (b.lo <= 8)
    if not bool(e_point.all()) or b.lo.numel() != 1:
        return top(dtype, device)  # type: ignore[return-value]
    e = int(b.lo.item())
    out = Interval(torch.ones_like(a.lo), torch.ones_like(a.hi))
    for _ in range(e):
        out = mul(out, a, dtype)
    return out


def bitwise(op: Op, a: Interval, b: Interval, dtype: DType) -> Interval:
    device = a.lo.device
    nonneg = (a.lo >= 0) & (b.lo >= 0) & torch.isfinite(a.hi) & torch.isfinite(b.hi)
    hi_max = torch.maximum(a.hi, b.hi).clamp(min=0)
    # Smallest 2**k - 1 >= hi_max: every OR / XOR of non-negative values up to hi_max fits.
    mask = torch.exp2(torch.ceil(torch.log2(hi_max + 1))) - 1
    if op is Op.AND:
        lo, hi = torch.zeros_like(hi_max), torch.minimum(a.hi, b.hi)
    elif op is Op.OR:
        lo, hi = torch.maximum(a.lo, b.lo), mask
    else:
        lo, hi = torch.zeros_like(hi_max), mask
    full = top(dtype, device)
    assert isinstance(full, Interval)
    lo = torch.where(nonneg, lo, full.lo)
    hi = torch.where(nonneg, hi, full.hi)
    return int_result(lo, hi, dtype)


def bitwise_not(a: Interval, dtype: DType) -> Interval:
    # ~x = -x - 1 in two's complement.
    return int_result(-a.hi - 1, -a.lo - 1, dtype, a.tight, a.contiguous)


def floor_ceil(fn, a: Interval, dtype: DType) -> Interval:
    return Interval(fn(a.lo), fn(a.hi), a.nan, False)


def cast(a: Abstract, src: DType, dst: DType) -> Abstract:
    device = (a.lo if isinstance(a, Interval) else a.may_true).device
    if dst.is_bool:
        if isinstance(a, Truth):
            return a
        zero_only = (a.lo == 0) & (a.hi == 0)
        may_true = ~zero_only | _nan_of(a)  # NaN converts to True
        may_false = (a.lo <= 0) & (a.hi >= 0)
        return Truth(may_true, may_false, torch.zeros_like(may_true & may_false))
    if isinstance(a, Truth):
        lo = torch.where(a.may_false, 0.0, 1.0).to(_F64)
        hi = torch.where(a.may_true, 1.0, 0.0).to(_F64)
        return Interval(lo, hi, None if not dst.is_float else torch.zeros_like(a.both), False)
    if dst.is_int:
        if src.is_int:
            return int_result(a.lo, a.hi, dst, a.tight, a.contiguous)
        # Float to int truncates toward zero (monotone); NaN, inf and out-of-range are undefined.
        limit = _INT32_MAX if dst is DType.INT32 else _EXACT
        bad = _nan_of(a) | (a.lo < -limit) | (a.hi > limit)
        full = top(dst, device)
        assert isinstance(full, Interval)
        lo = torch.where(bad, full.lo, torch.trunc(a.lo))
        hi = torch.where(bad, full.hi, torch.trunc(a.hi))
        return int_result(lo, hi, dst)
    # To a float type.
    if src.is_int:
        exact_below = {DType.FLOAT64: 2.0**53, DType.FLOAT32: 2.0**24}.get(dst, 2.0**8)
        small = bool(((a.lo.abs() <= exact_below) & (a.hi.abs() <= exact_below)).all())
        nan = torch.zeros((), dtype=torch.bool, device=device)
        if small:
            return Interval(a.lo, a.hi, nan, a.tight)
        rel = {DType.FLOAT64: 2.0**-50, DType.FLOAT32: _REL}.get(dst, 2.0**-6)
        return float_result(a.lo, a.hi, nan, dst, rel=rel)
    if dst is DType.FLOAT64 or (dst is DType.FLOAT32 and src in (DType.FLOAT16, DType.BFLOAT16)):
        return a  # widening is exact
    rel = _REL if dst is DType.FLOAT32 else 2.0**-6
    return float_result(a.lo, a.hi, a.nan, dst, rel=rel)


# ------------------------------------------------------------------------------------------------
# Comparisons and logic.
# ------------------------------------------------------------------------------------------------


def independent_compare(op: Op, a: Interval, b: Interval, independent: bool) -> Truth:
    """a < b, a <= b, a == b, a != b over each tile.

    `independent`: a and b vary with disjoint inputs (one with q only, the other with kv only, or
    one constant over the tile), so every combination of their values occurs in the tile. With
    tight bounds this proves a tile mixed when both outcomes are possible for < and <=.
    """
    nan = _or(a.nan, b.nan)
    if op in (Op.LT, Op.LE):
        if op is Op.LT:
            may_true = a.lo < b.hi
            may_false = a.hi >= b.lo
        else:
            may_true = a.lo <= b.hi
            may_false = a.hi > b.lo
        if nan is not None:
            may_false = may_false | nan
        both = may_true & may_false
        if not (independent and a.tight and b.tight):
            both = torch.zeros_like(both)
        elif nan is not None:
            both = both & ~nan
        return Truth(may_true, may_false, both)
    overlap = (a.lo <= b.hi) & (b.lo <= a.hi)
    same_point = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
    if nan is not None:
        same_point = same_point & ~nan
    # NaN == x is False and NaN != x is True: `same_point` already excludes NaN.
    both = torch.zeros_like(overlap & same_point)
    if independent and a.contiguous is not None and b.contiguous is not None:
        # Both take every integer of their ranges, in every combination: a common integer is a
        # pair where they are equal, and two distinct values are a pair where they differ.
        both = overlap & ~same_point & a.contiguous & b.contiguous
    eq = Truth(overlap, ~same_point, both)
    return eq if op is Op.EQ else logical_not(eq)


def difference_sign(op: Op, diff: Interval) -> Truth:
    """`a op b` from tight bounds of d = b - a (exact integers): a < b iff d > 0, and so on."""
    lo, hi = diff.lo, diff.hi
    if op is Op.LT:
        may_true, may_false = hi > 0, lo <= 0
    elif op is Op.LE:
        may_true, may_false = hi >= 0, lo < 0
    elif op is Op.EQ:
        may_true, may_false = (lo <= 0) & (hi >= 0), ~((lo == 0) & (hi == 0))
    else:
        may_true, may_false = ~((lo == 0) & (hi == 0)), (lo <= 0) & (hi >= 0)
    both = may_true & may_false if (diff.tight and op in (Op.LT, Op.LE)) else None
    if both is None:
        both = torch.zeros_like(may_true & may_false)
    return Truth(may_true, may_false, both)


def logical_not(a: Truth) -> Truth:
    return Truth(a.may_false, a.may_true, a.both)


def logical_and(a: Truth, b: Truth) -> Truth:
    # Where one side is True everywhere, the result is the other side (mixed stays mixed).
    both = (a.both & ~b.may_false) | (b.both & ~a.may_false)
    return Truth(a.may_true & b.may_true, a.may_false | b.may_false, both)


def logical_or(a: Truth, b: Truth) -> Truth:
    both = (a.both & ~b.may_true) | (b.both & ~a.may_true)
    return Truth(a.may_true | b.may_true, a.may_false & b.may_false, both)


def logical_xor(a: Truth, b: Truth) -> Truth:
    b_fixed = ~b.may_true | ~b.may_false
    a_fixed = ~a.may_true | ~a.may_false
    may_true = (a.may_true & b.may_false) | (a.may_false & b.may_true)
    may_false = (a.may_true & b.may_true) | (a.may_false & b.may_false)
    both = (a.both & b_fixed) | (b.both & a_fixed)
    return Truth(may_true, may_false, both)


def where(cond: Truth, x: Abstract, y: Abstract, dtype: DType) -> Abstract:
    only_x = ~cond.may_false
    only_y = ~cond.may_true
    if isinstance(x, Truth) and isinstance(y, Truth):
        may_true = (cond.may_true & x.may_true) | (cond.may_false & y.may_true)
        may_false = (cond.may_true & x.may_false) | (cond.may_false & y.may_false)
        # where(c, True, False) is c and where(c, False, True) is ~c: a mixed c stays mixed.
        x_t, x_f = ~x.may_false, ~x.may_true
        y_t, y_f = ~y.may_false, ~y.may_true
        both = (only_x & x.both) | (only_y & y.both) | (cond.both & ((x_t & y_f) | (x_f & y_t)))
        return Truth(may_true, may_false, both)
    assert isinstance(x, Interval) and isinstance(y, Interval)
    lo = torch.where(only_x, x.lo, torch.where(only_y, y.lo, torch.minimum(x.lo, y.lo)))
    hi = torch.where(only_x, x.hi, torch.where(only_y, y.hi, torch.maximum(x.hi, y.hi)))
    nan = None
    if x.nan is not None or y.nan is not None:
        xn, yn = _nan_of(x), _nan_of(y)
        nan = torch.where(only_x, xn, torch.where(only_y, yn, xn | yn))
    return Interval(lo, hi, nan, False)
