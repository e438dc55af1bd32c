"""IR -> Triton: each traced mod becomes a named `@triton.jit` device function.

Signatures (one fixed shape per role; kernels call the functions by name):

    score_mod  <name>(score, b, h, q_idx, kv_idx, <capture params>)       -> new score
    mask_mod   <name>(b, h, q_idx, kv_idx, <capture params>)              -> bool
    score grad <name>_bwd(score, b, h, q_idx, kv_idx, grad, live, <capture params>,
                          <capture grad pointers>, capture_scales, CAPTURE_MODE, Q_AXIS)
                                                                   -> grad * d new_score / d score

Capture params, per captured tensor `c` of rank n: `c_ptr, c_stride0..n-1, c_size0..n-1`, then one
`s_value` per lifted scalar `s` (a float32 argument, Note [Lifted scalars] in flexfa/ir/nodes.py);
in the gradient function also `c_grad_ptr` for each capture that needs a gradient. Inside a kernel
`score` is a [rows, cols] tile, `b`/`h` are scalars and `q_idx`/`kv_idx` broadcast along one axis
each; the body is element-wise, so the same source serves any tile orientation.

The body is SSA: one line per IR node, named t0, t1, ... Shared subexpressions appear once.
The gradient function adds up captured tensors' gradients in the way scatter.py chooses per load.

# Note [Per-pair gathers]
# A load whose index depends on both q_idx and kv_idx (a relative-position table, T5 buckets, a
# 2-D table, an additive dense mask) reads one element per score. As a `tl.load` inside the KV
# loop it feeds the P @ V matmul, so Triton's software pipeliner turns it into per-element
# `cp.async` copies staged through shared memory, one [rows, cols] buffer per stage: on sm_90
# (Triton 3.6, D=128, causal) a relative bias's forward took 176 `cp.async` against 76 for ALiBi
# and needed 128 x 64 tiles to fit, and a T5 bias's dK/dV kernel 225 KiB of shared memory. So
# these loads go through `flexfa_gather` (templates/prelude.py.jinja), which on CUDA reads 16-
# and 32-bit elements with `ld.global.nc` in inline PTX: the pipeliner only stages `tt.load`s,
# so the gather becomes plain predicated loads into registers (through the read-only cache; the
# tables are not written while a kernel reads them), as FA4's hand-written mods read theirs. The
# same forward then takes 44 `cp.async` (the K/V tiles' only), 96 KiB of shared memory instead
# of 128 KiB, and the backward keeps its 3 stages. The interpreter, ROCm and other element types
# (bool, 8- and 64-bit) keep `tl.load`; `gathered_outside_pipeline` tells the tile planner which
# loads are staged (Note [Shared memory of per-pair loads and scatters] in configs.py).
#
# Note [Deterministic captured gradients]
# Floating-point atomics add in whatever order programs arrive, so float gradients of captured
# tensors differ in the last bits from run to run. With `deterministic=True` they are accumulated in
# fixed point instead: integer addition is associative, so int64 atomics give bitwise-repeatable
# sums in any order. `CAPTURE_MODE` selects what the scatter does:
#   0  nothing (no captured tensor needs a gradient)
#   1  float32 atomic add (default, fastest)
#   2  first pass of the deterministic mode: atomic max of |contribution| per capture into
#      capture_scales[j] (max is order-independent). It runs in the dK/dV kernel, which visits
#      every pair anyway, so the mode costs no extra kernel; its contributions may differ from
#      the dQ kernel's in the last bits (another matmul order), which moves the scale by at most
#      a factor 2 and leaves the headroom below 2**63.
#   3  second pass: the reductions of Note [Scatter-add of captured gradients] (scatter.py) form
#      their float32 sums in registers as in mode 1, and each sum is added as
#      round(sum * capture_scales[j]) in int64 (`flexfa_fixed`), where the launcher chose the
#      scale 2**k so that (number of pairs) * max |contribution| * scale < 2**62: no sum
#      overflows, and the quantization step is far below float32 rounding. A program's sums are the same at every run (the same tile, the same
#      reduction order, the same branch for the same indices), so only the order of the atomics
#      varies, and integer addition does not see it. (An earlier version quantized every
#      contribution before any sum, which made the result independent of the tile shape too, at
#      one float-to-int64 conversion per pair: 64 `F2I.S64` per thread and tile in the dQ kernel on
#      sm_90, against 2 to 10 now, one per sum.)
"""

from __future__ import annotations

import dataclasses
import math

import torch

from flexfa.codegen.triton.scatter import (
    ScatterStrategy,
    block_sizes,
    index_axes,
    monotone_in_distance,
    scatter_strategy,
)
from flexfa.frontend.trace import TracedMod
from flexfa.ir.autodiff import ScoreModGradient
from flexfa.ir.dtypes import DType
from flexfa.ir.nodes import Capture, Node, Op, Scalar, toposort

TL_DTYPE = {
    DType.BOOL: "tl.int1",
    DType.INT32: "tl.int32",
    DType.INT64: "tl.int64",
    DType.FLOAT16: "tl.float16",
    DType.BFLOAT16: "tl.bfloat16",
    DType.FLOAT32: "tl.float32",
    DType.FLOAT64: "tl.float64",
}

_UNARY_FN = {
    Op.EXP: "tl.exp",
    Op.EXP2: "tl.exp2",
    Op.LOG: "tl.log",
    Op.LOG2: "tl.log2",
    Op.SQRT: "tl.sqrt_rn",
    Op.RSQRT: "tl.rsqrt",
    Op.TANH: "flexfa_tanh",
    Op.SIGMOID: "tl.sigmoid",
    Op.ERF: "tl.math.erf",
    Op.SIN: "tl.sin",
    Op.COS: "tl.cos",
    Op.FLOOR: "tl.floor",
    Op.CEIL: "tl.ceil",
    Op.ABS: "tl.abs",
    Op.SIGN: "flexfa_sign",
}
_INFIX = {
    Op.ADD: "+",
    Op.SUB: "-",
    Op.MUL: "*",
    Op.TRUEDIV: "/",
    Op.LT: "<",
    Op.LE: "<=",
    Op.EQ: "==",
    Op.NE: "!=",
    Op.AND: "&",
    Op.OR: "|",
    Op.XOR: "^",
    Op.SHL: "<<",
    Op.SHR: ">>",  # arithmetic on signed integers, as torch's
}

# Which helper functions (in templates/prelude.py) a body may call.
HELPERS = (
    "flexfa_gather",
    "flexfa_tanh",
    "flexfa_sign",
    "flexfa_pow",
    "flexfa_floordiv",
    "flexfa_floormod",
    "flexfa_fixed",
    "flexfa_scatter_tile",
    "flexfa_scatter_sub_blocks",
    "flexfa_tile_distances",
    "flexfa_tile_distance_range",
    "flexfa_diagonal_sums",
    "flexfa_block_starts",
    "flexfa_block_sums",
)


@dataclasses.dataclass(frozen=True)
class CaptureParams:
    """The parameter names through which one captured tensor reaches a device function."""

    capture: Capture

    @property
    def ptr(self) -> str:
        return f"{self.capture.name}_ptr"

    @property
    def strides(self) -> tuple[str, ...]:
        return tuple(f"{self.capture.name}_stride{d}" for d in range(self.capture.ndim))

    @property
    def sizes(self) -> tuple[str, ...]:
        return tuple(f"{self.capture.name}_size{d}" for d in range(self.capture.ndim))

    @property
    def grad_ptr(self) -> str:
        return f"{self.capture.name}_grad_ptr"

    def names(self) -> tuple[str, ...]:
        return (self.ptr, *self.strides, *self.sizes)


@dataclasses.dataclass(frozen=True)
class ModSource:
    """A rendered device function: its name, full source and parameters after the fixed ones."""

    name: str
    source: str
    params: tuple[str, ...]


def capture_params(traced: TracedMod) -> tuple[CaptureParams, ...]:
    return tuple(CaptureParams(c) for c in traced.captures)


def scalar_param(scalar: Scalar) -> str:
    """The parameter name of a lifted scalar in generated functions and kernels."""
    return f"{scalar.name}_value"


def mod_param_names(traced: TracedMod) -> tuple[str, ...]:
    """A mod function's parameters after the fixed ones: captures, then lifted scalars."""
    caps = tuple(p for c in capture_params(traced) for p in c.names())
    return (*caps, *(scalar_param(s) for s in traced.scalars))


def mod_values(traced: TracedMod, tensors: tuple[torch.Tensor, ...]) -> list:
    """The launch arguments for `mod_param_names(traced)`: `capture_values`, then the scalars."""
    return [*capture_values(tensors), *traced.scalar_values]


def capture_values(tensors: tuple[torch.Tensor, ...]) -> list:
    """The launch arguments for `CaptureParams.names()` of each capture: pointer, strides, sizes."""
    out: list = []
    for t in tensors:
        out.append(t)
        out.extend(t.stride())
        out.extend(t.shape)
    return out


def _literal(node: Node) -> str:
    """A constant operand: a Python literal where Triton's weak typing gives the node's dtype
    (bool, int32, float32), a 0-dim tensor otherwise."""
    text = _scalar_text(node)
    if node.dtype in (DType.BOOL, DType.INT32, DType.FLOAT32):
        return text
    return f"tl.full([], {text}, {TL_DTYPE[node.dtype]})"


def provably_nonnegative(node: Node) -> bool:
    """A cheap sufficient check that an integer expression is >= 0 (indices, lengths, ...)."""
    op = node.op
    if op is Op.VAR:
        return node.arg in ("b", "h", "q_idx", "kv_idx")
    if op is Op.CONST:
        return not node.dtype.is_bool and node.arg >= 0
    if op is Op.ABS:
        return True
    if op in (Op.ADD, Op.MUL, Op.MIN, Op.FLOORDIV, Op.MOD):
        return all(provably_nonnegative(s) for s in node.srcs)
    if op is Op.MAX:
        return any(provably_nonnegative(s) for s in node.srcs)
    if op is Op.WHERE:
        return all(provably_nonnegative(s) for s in node.srcs[1:])
    if op is Op.CAST and node.dtype.is_int and node.srcs[0].dtype.is_int:
        return provably_nonnegative(node.srcs[0])
    return op is Op.CAST and node.srcs[0].dtype.is_bool


class _Body:
    """Emits SSA lines for a set of roots; leaves are inlined."""

    def __init__(self, param_of_var: dict[str, str], prefix: str = "t") -> None:
        self.param_of_var = param_of_var
        self.prefix = prefix
        self.names: dict[int, str] = {}
        self.lines: list[str] = []
        self._keep: list[Node] = []

    def name(self, node: Node) -> str:
        return self.names[id(node)]

    def emit(self, roots: list[Node]) -> None:
        for n in toposort(roots):
            if id(n) in self.names:
                continue
            self._keep.append(n)
            if n.op is Op.CONST:
                self.names[id(n)] = _literal(n)
            elif n.op is Op.VAR:
                self.names[id(n)] = self.param_of_var[n.arg]
            elif n.op is Op.CAPTURE:
                self.names[id(n)] = CaptureParams(n.arg).ptr
            elif n.op is Op.SCALAR:
                self.names[id(n)] = scalar_param(n.arg)
            else:
                tmp = f"{self.prefix}{len(self.lines)}"
                self.lines.append(f"{tmp} = {self._expr(n)}")
                self.names[id(n)] = tmp

    def _expr(self, n: Node) -> str:
        op = n.op
        a = [self.name(s) for s in n.srcs]
        if op is Op.LOAD:
            return self._load(n)
        if op is Op.CAST:
            if n.dtype.is_bool:
                return f"({a[0]} != 0)"
            return f"{a[0]}.to({TL_DTYPE[n.dtype]})"
        if op is Op.NEG:
            return f"-{a[0]}"
        if op is Op.NOT:
            return f"({a[0]} == 0)" if n.dtype.is_bool else f"~{a[0]}"
        if op in _UNARY_FN:
            return f"{_UNARY_FN[op]}({a[0]})"
        if op in _INFIX:
            return f"{a[0]} {_INFIX[op]} {a[1]}"
        if op is Op.MIN:
            return f"tl.minimum({a[0]}, {a[1]})"
        if op is Op.MAX:
            return f"tl.maximum({a[0]}, {a[1]})"
        if op is Op.WHERE:
            return f"tl.where({a[0]}, {a[1]}, {a[2]})"
        if op is Op.POW:
            exponent = n.srcs[1]
            if n.dtype.is_float and exponent.op is Op.CONST:
                return self._const_pow(a[0], float(exponent.arg))
            base = n.srcs[0]
            if n.dtype.is_float and base.op is Op.CONST and base.arg > 0:
                return f"tl.exp2({math.log2(base.arg)!r} * {a[1]})"
            if n.dtype.is_float and base.op is Op.CONST:
                return (
                    f"flexfa_pow({a[1]} * 0.0 + {a[0]}, {a[1]})"  # a tensor base of the right shape
                )
            if n.dtype.is_float:
                return f"flexfa_pow({a[0]}, {a[1]})"
            # Integer powers go through float and round back (exact below 2**24).
            return f"tl.floor(flexfa_pow({a[0]}.to(tl.float32), {a[1]}.to(tl.float32)) + 0.5).to({TL_DTYPE[n.dtype]})"
        if op is Op.FLOORDIV:
            if n.dtype.is_float:
                return f"tl.floor({a[0]} / {a[1]})"
            if all(provably_nonnegative(s) for s in n.srcs):
                return f"{a[0]} // {a[1]}"  # C truncation equals floor for non-negative operands
            return f"flexfa_floordiv({a[0]}, {a[1]})"
        if op is Op.MOD:
            if n.dtype.is_float:
                return f"{a[0]} - tl.floor({a[0]} / {a[1]}) * {a[1]}"
            if all(provably_nonnegative(s) for s in n.srcs):
                return f"{a[0]} % {a[1]}"
            return f"flexfa_floormod({a[0]}, {a[1]})"
        raise NotImplementedError(f"no Triton lowering for {op}")  # pragma: no cover

    @staticmethod
    def _const_pow(x: str, e: float) -> str:
        """x ** e for a constant e, with torch's signs: odd integer powers keep the sign of x, a
        negative x to a non-integer power is NaN, 0 ** e is 0 (e > 0) or inf (e < 0)."""
        r = f"tl.exp2({e!r} * tl.log2(tl.abs({x})))"
        if e.is_integer():
            return f"tl.where({x} < 0, -{r}, {r})" if int(e) % 2 else r
        return f'tl.where({x} < 0, float("nan"), {r})'

    def _load(self, n: Node) -> str:
        cap: Capture = n.srcs[0].arg
        p = CaptureParams(cap)
        idx = [self.name(s) for s in n.srcs[1:]]
        if not idx:
            return f"tl.load({p.ptr}).to({TL_DTYPE[n.dtype]})"
        offset = " + ".join(f"{i} * {s}" for i, s in zip(idx, p.strides))
        guards = []
        for node, i, size in zip(n.srcs[1:], idx, p.sizes):
            if not provably_nonnegative(node):
                guards.append(f"({i} >= 0)")
            guards.append(f"({i} < {size})")
        # `!= 0` keeps the mask boolean where a scalar guard meets a tile guard (Triton's
        # interpreter widens that `&` to an integer array). See Note [Loads out of bounds] in
        # flexfa/ir/evaluate.py for why loads are guarded at all.
        mask = " & ".join(guards)
        if index_axes(n) == {"q_idx", "kv_idx"}:  # Note [Per-pair gathers]
            return f"flexfa_gather({p.ptr}, {offset}, ({mask}) != 0).to({TL_DTYPE[n.dtype]})"
        return f"tl.load({p.ptr} + {offset}, mask=({mask}) != 0, other=0).to({TL_DTYPE[n.dtype]})"


# Note [Constant and index-only results]
# Simplification can fold a mod (or a derivative) to a constant: `torch.zeros_like(score)`,
# `torch.where(q_idx != q_idx, score, -inf)`, `x * 0`. Its emitted name is then a Python literal
# (`0.0`, `True`) with no Triton type and no shape, and a value that depends on the indices alone
# has the shape of the index it reads (a scalar for `h`, a row for `q_idx`). A device function's
# result is always a Triton tensor of the node's dtype: a score_mod's fills the score tile (the
# kernels reduce it along both axes), a constant elsewhere is a 0-dim tensor that broadcasts
# against any tile (mask_mods, the block-mask kernels' line functions). Dependence on `score` is
# read from the IR, not from the mod's parameters, since a mod that names `score` may still fold
# to something without it.


def depends_on(node: Node, var: str) -> bool:
    """Whether `node`'s value reads the variable `var` (after simplification, structurally)."""
    return any(n.op is Op.VAR and n.arg == var for n in toposort([node]))


def _result(body: _Body, node: Node, shape: str | None) -> str:
    """The returned expression of a device function, typed and shaped (Note [Constant and
    index-only results]); `shape` is the tile's shape expression where the result must fill it."""
    name = body.name(node)
    dtype = TL_DTYPE[node.dtype]
    if node.op is Op.CONST:
        return f"tl.full({shape or '[]'}, {_scalar_text(node)}, {dtype})"
    if shape is not None and not depends_on(node, "score"):
        return f"tl.broadcast_to({name}, {shape})"
    return name


def _scalar_text(node: Node) -> str:
    """A constant's value as a Python literal (no Triton type attached)."""
    v = node.arg
    if node.dtype.is_bool:
        return "True" if v else "False"
    if node.dtype.is_int:
        return str(int(v))
    if math.isnan(v):
        return 'float("nan")'
    if math.isinf(v):
        return 'float("inf")' if v > 0 else '-float("inf")'
    return repr(float(v))


def _function(name: str, params: list[str], lines: list[str], ret: str, doc: str) -> str:
    body = "\n".join(f"    {line}" for line in lines)
    sig = ",\n".join(f"    {p}" for p in params)
    parts = [f"@triton.jit\ndef {name}(\n{sig},\n):", f'    """{doc}"""']
    if body:
        parts.append(body)
    parts.append(f"    return {ret}")
    return "\n".join(parts) + "\n"


_VAR_PARAMS = {v: v for v in ("score", "b", "h", "q_idx", "kv_idx")}


def emit_mod(traced: TracedMod, fn_name: str) -> ModSource:
    """The forward device function of a score_mod or mask_mod."""
    extra = mod_param_names(traced)
    body = _Body(_VAR_PARAMS)
    body.emit([traced.output])
    ret = _result(body, traced.output, "score.shape" if traced.kind == "score_mod" else None)
    params = [*traced.params, *extra]
    doc = f"{traced.kind} {traced.name!r}, traced by flexfa."
    return ModSource(fn_name, _function(fn_name, params, body.lines, ret, doc), extra)


def emit_score_mod_grad(
    traced: TracedMod, grad: ScoreModGradient, fn_name: str, grad_slots: frozenset[int]
) -> ModSource:
    """The backward device function of a score_mod (see the module docstring).

    It takes one gradient pointer per slot in `grad_slots`, in slot order, whether or not the
    score_mod's value depends on that capture (a zero derivative adds nothing).
    """
    caps = capture_params(traced)
    grad_caps = sorted(grad_slots)
    extra = (
        *mod_param_names(traced),
        *(caps[slot].grad_ptr for slot in grad_caps),
        *(("capture_scales",) if grad_caps else ()),
    )
    body = _Body(_VAR_PARAMS)
    # Only the loads' indices are needed here (their values enter through d_load when they matter).
    body.emit(
        [grad.d_score, *(g.d_load for g in grad.loads), *(i for g in grad.loads for i in g.indices)]
    )
    lines = list(body.lines)
    lines.append(f"d_score = tl.where(live, {_times(body, grad.d_score)}, 0.0)")
    if grad.loads and grad_caps:
        lines.append("if CAPTURE_MODE != 0:")
        for i, g in enumerate(grad.loads):
            j = grad_caps.index(g.slot)
            lines.extend(
                "    " + line for line in _scatter_lines(i, j, g.load, g.d_load, body, caps)
            )
    params = [
        *traced.params,
        "grad",
        "live",
        *extra,
        "CAPTURE_MODE: tl.constexpr",
        "Q_AXIS: tl.constexpr",
    ]
    doc = f"gradient of score_mod {traced.name!r} (derived by flexfa's autodiff)."
    return ModSource(fn_name, _function(fn_name, params, lines, "d_score", doc), tuple(extra))


def _times(body: _Body, derivative: Node) -> str:
    """`grad * derivative`, written as `grad` when the derivative is the constant 1."""
    if derivative.op is Op.CONST and derivative.arg == 1.0:
        return "grad"
    return f"grad * {body.name(derivative)}"


# The capture dtypes `flexfa_gather` reads with inline PTX on CUDA (Note [Per-pair gathers]).
_ASM_GATHER_DTYPES = frozenset({DType.FLOAT32, DType.INT32, DType.FLOAT16, DType.BFLOAT16})


def gathered_outside_pipeline(load: Node) -> bool:
    """Whether a per-pair load is read by `flexfa_gather`'s inline PTX on CUDA, out of reach of
    Triton's software pipeliner (Note [Per-pair gathers]); never on ROCm."""
    return torch.version.hip is None and load.srcs[0].arg.dtype in _ASM_GATHER_DTYPES


def _offset_and_guard(idx: list[str], p: CaptureParams) -> tuple[str, str]:
    offset = " + ".join(f"{ix} * {s}" for ix, s in zip(idx, p.strides))
    guards = " & ".join(f"({ix} >= 0) & ({ix} < {size})" for ix, size in zip(idx, p.sizes))
    return offset, guards


def _scatter_lines(i: int, j: int, load: Node, d_load: Node, body: _Body, caps) -> list[str]:
    """Scatter-add of grad * d_load into the capture's gradient, in the way `scatter_strategy`
    chose (Note [Scatter-add of captured gradients] in scatter.py)."""
    cap: Capture = load.srcs[0].arg
    p = caps[cap.slot]
    index_nodes = load.srcs[1:]
    strategy = scatter_strategy(load)
    c, v = f"c{i}", f"v{i}"
    # See Note [Deterministic captured gradients] for the modes. Sums are formed in float32 in
    # registers, in an order fixed by the kernel's configuration; in mode 3 each is quantized just
    # before its atomic (`flexfa_fixed`).
    scale = f"capture_scales + {j}"
    lines = [
        f"{c} = tl.where(live, {_times(body, d_load)}, 0.0)",
        "if CAPTURE_MODE == 2:",
        f"    tl.atomic_max({scale}, tl.max(tl.max(tl.abs({c}), 1), 0))",
        "else:",
        f"    {v} = {c}",
    ]
    idx = [body.name(s) for s in index_nodes]
    offset, guards = _offset_and_guard(idx, p) if idx else ("0", "True")
    if strategy in (ScatterStrategy.TILE, ScatterStrategy.ROW, ScatterStrategy.COLUMN):
        r = f"r{i}"
        if strategy is ScatterStrategy.TILE:
            reduce = f"{r} = tl.sum(tl.sum({v}, 1, keep_dims=True), 0, keep_dims=True)"
        elif strategy is ScatterStrategy.ROW:
            reduce = f"{r} = tl.sum({v}, 1 - Q_AXIS, keep_dims=True)"
        else:
            reduce = f"{r} = tl.sum({v}, Q_AXIS, keep_dims=True)"
        # Broadcast the offsets to the reduced contribution's shape. Adding zeros gives the guard
        # that shape (and a boolean type in Triton's interpreter too, whose `&` of a scalar and a
        # tile yields integers).
        body_lines = [
            reduce,
            f"o{i} = ({offset}) + tl.zeros_like({r}).to(tl.int32)",
            f"m{i} = (({guards}) + tl.zeros_like(o{i})) != 0",
            f"tl.atomic_add({p.grad_ptr} + o{i}, flexfa_fixed({r}, {scale}, CAPTURE_MODE), "
            f"mask=m{i})",
        ]
        return lines + ["    " + line for line in body_lines]
    if strategy is ScatterStrategy.GENERAL:
        # The offsets of the whole tile, over its live pairs only; the helper decides per tile.
        body_lines = [
            f"o{i} = ({offset}) + tl.zeros_like({c}).to(tl.int32)",
            f"m{i} = ((({guards}) + tl.zeros_like(o{i})) != 0) & live",
            f"flexfa_scatter_tile({p.grad_ptr}, {v}, o{i}, m{i}, {scale}, CAPTURE_MODE)",
        ]
        return lines + ["    " + line for line in body_lines]
    if strategy is ScatterStrategy.BLOCKED:
        # The index keeps its value over blocks of cq x ckv aligned positions (`block_sizes`;
        # tiles start at multiples of their sides, which are powers of two): it is evaluated
        # once per block of the tile, at a position in it, and each block's sum takes one atomic.
        cq, ckv = block_sizes(index_nodes)
        blocks = _Body({**_VAR_PARAMS, "q_idx": f"bq{i}", "kv_idx": f"bk{i}"}, prefix=f"w{i}_")
        blocks.emit(list(index_nodes))
        b_offset, b_guards = _offset_and_guard([blocks.name(s) for s in index_nodes], p)
        body_lines = [
            f"bq{i}, bk{i} = flexfa_block_starts({c}, q_idx, kv_idx, {cq}, {ckv}, Q_AXIS)",
            *blocks.lines,
            f"s{i} = flexfa_fixed(flexfa_block_sums({v}, {cq}, {ckv}, Q_AXIS), {scale}, "
            "CAPTURE_MODE)",
            f"o{i} = ({b_offset}) + tl.zeros_like(s{i}).to(tl.int32)",
            f"m{i} = ((({b_guards}) + tl.zeros_like(o{i})) != 0) & (s{i} != 0)",
            f"tl.atomic_add({p.grad_ptr} + o{i}, s{i}, mask=m{i})",
        ]
        return lines + ["    " + line for line in body_lines]
    # DIAGONAL: the index is a function of d = q_idx - kv_idx, so it is evaluated once per
    # diagonal of the tile (a vector), with q_idx := d and kv_idx := 0 (reads_only_distance says
    # that gives the same value), and each diagonal's sum takes one atomic; a tile whose diagonals
    # all give one offset (far tiles of a clamped distance) takes one atomic of its sum.
    diag = _Body({**_VAR_PARAMS, "q_idx": f"d{i}", "kv_idx": "0"}, prefix=f"u{i}_")
    diag.emit(list(index_nodes))
    d_offset, d_guards = _offset_and_guard([diag.name(s) for s in index_nodes], p)
    one_atomic = (
        f"tl.atomic_add({p.grad_ptr} + {{offset}}, "
        f"flexfa_fixed(tl.sum(tl.sum({v}, 1), 0), {scale}, CAPTURE_MODE))"
    )
    per_diagonal = [
        f"s{i} = flexfa_fixed(flexfa_diagonal_sums({v}), {scale}, CAPTURE_MODE)",
        f"tl.atomic_add({p.grad_ptr} + o{i}, s{i}, mask=m{i} & (s{i} != 0))",
    ]
    vector = [
        f"d{i}, e{i} = flexfa_tile_distances({c}, q_idx, kv_idx, Q_AXIS)",
        *diag.lines,
        f"o{i} = ({d_offset}) + tl.zeros_like(d{i})",
        f"m{i} = ((({d_guards}) + tl.zeros_like(d{i})) != 0) & e{i}",
    ]
    if monotone_in_distance(index_nodes):
        # Note [Far tiles decided at their corners] in scatter.py: the index at the tile's least
        # and greatest distance decides, the vector is evaluated only where it differs.
        ends = []
        for end in ("lo", "hi"):
            body = _Body({**_VAR_PARAMS, "q_idx": f"d{end}{i}", "kv_idx": "0"}, prefix=f"{end}{i}_")
            body.emit(list(index_nodes))
            ends.append((body, [body.name(s) for s in index_nodes]))
        (lo, lo_idx), (hi, hi_idx) = ends
        same = " & ".join(f"({a} == {b})" for a, b in zip(lo_idx, hi_idx) if a != b) or "True"
        lo_offset, lo_guards = _offset_and_guard(lo_idx, p)
        body_lines = [
            f"dlo{i}, dhi{i} = flexfa_tile_distance_range({c}, q_idx, kv_idx, Q_AXIS)",
            *lo.lines,
            *hi.lines,
            f"if {same}:",
            f"    if {lo_guards}:",
            "        " + one_atomic.format(offset=f"({lo_offset})"),
            "else:",
            *("    " + line for line in [*vector, *per_diagonal]),
        ]
        return lines + ["    " + line for line in body_lines]
    # Otherwise the vector decides: equal offsets on every diagonal take one atomic.
    body_lines = [
        *vector,
        f"lo{i} = tl.min(tl.where(m{i}, o{i}, 2147483647), 0)",
        f"hi{i} = tl.max(tl.where(m{i}, o{i}, -1), 0)",
        f"if lo{i} == hi{i}:",
        "    " + one_atomic.format(offset=f"hi{i}"),
        f"elif lo{i} < hi{i}:",
        *("    " + line for line in per_diagonal),
    ]
    return lines + ["    " + line for line in body_lines]
