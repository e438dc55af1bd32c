"""IR -> CuTe DSL: each traced mod becomes a named `@cute.jit` function in FlashAttention-4's hook
signatures, so that FA4's own kernel templates compile it in.

Signatures (fixed by FA4; its kernels call the functions positionally, then `aux_scalars` by
keyword):

    score_mod      <name>(score_ssa, b_ssa, h_ssa, q_ssa, kv_ssa, seqlen_info, aux_tensors,
                          aux_scalars)                                  -> new score (TensorSSA)
    mask_mod       <name>(b_ssa, h_ssa, q_ssa, kv_ssa, seqlen_info, aux_tensors, aux_scalars)
                                                                              -> bool (TensorSSA)
    score_mod_bwd  <name>(grad_ssa, score_ssa, b_ssa, h_ssa, q_ssa, kv_ssa, seqlen_info,
                          aux_tensors, aux_scalars)  -> grad * d new_score / d score (TensorSSA)

The arguments are TensorSSA vectors of a length FA4 picks per kernel (1 to 4): for each element,
the body reads the scalars, computes in scalars (one SSA line per IR node, named t0, t1, ..., as
in the Triton backend) and stores the result; the function returns the results as a vector. `score` is the scaled
score (FA4 multiplies by softmax_scale before calling the mod, which is flexfa's semantics too).

flexfa passes FA4 no `aux_tensors` (the hooks ignore that parameter): captured tensors arrive by
address in `aux_scalars`, after the lifted floats, in a fixed order (`AuxLayout`): the score_mod's
captures, then the mask_mod's, then one float32 gradient buffer per score_mod capture that needs a
gradient, each as its address and sizes (Note [Captured tensors by address]). FA4 passes the same
tuple to every hook, so each function builds views of its own entries by position.

# Note [Captured tensors by address]
# FA4 threads `aux_tensors` to its hooks, and a call that passes any pays for it in every score
# element: so that a hook indexing an aux tensor by q_idx or kv_idx never reads out of bounds, FA4
# wraps both indices of every element with a fast divmod by the sequence lengths (softmax.py's
# `apply_score_mod_inner`, mask.py, its `compute_fastdiv_mods`), and on sm90 it calls the hooks one
# element at a time (`__vec_size__` 1 in the forward, 1 instead of 4 in the backward). torch's
# FLASH backend of FlexAttention passes its captured tensors that way, so flexfa tied it (0.98x
# forward on ALiBi + causal). flexfa's loads guard their own bounds, so that work bought nothing:
# FA4's sm90 forward with `s + slopes[h] * (kv - q)` (a captured (16,) tensor) and a causal mask
# compiled to 4072 SASS instructions, 99 of them IMAD.HI (the divmods), against 2928 and none
# with the tensor passed as below (tests and numbers: docs/cute.md).
# So flexfa hands the hooks each tensor through FA4's run-time `aux_scalars` and calls FA4 with
# `aux_tensors=None`: a cutlass.Int64 address and one cutlass.Int32 per size (a 0-d capture as
# one element), after the lifted floats, in `AuxLayout`'s order, which both the emitter and the
# launcher (launch.py `aux_scalars`) take their positions from. Each hook builds, once before its
# element loop, a view of every tensor it reads (`flexfa_view`: `cute.make_ptr` in global memory,
# aligned to the element size, and a layout with the row-major strides of the sizes - the
# launcher passes every tensor row-major, Note [Aux tensor layouts] in launch.py). FA4 keys its
# compiled kernels by the scalars' types, not their values, so a new tensor at another address
# (or of other sizes) reuses the kernel. A tensor's storage type is its IR type's: bool travels
# as uint8 (read as `!= 0`), int8, uint8 and int16 are copied to int32 for the call.
# What FA4's wrapping did, the generated code does per load: an index out of range of a dim reads
# 0 (clamped for the read itself, Note [Loads out of bounds] in flexfa/ir/evaluate.py), and a
# gradient atomic skips out-of-range indices and zero contributions. Without wrapping FA4 hands
# the hooks raw indices of the padding elements of its last tiles (q_idx >= seqlen_q, kv_idx >=
# seqlen_k, and past a sequence's end on the varlen path); those scores are masked by FA4 after
# the hooks, their gradient is 0, and their loads go through the same guards; mods without
# captures always got raw indices. So nothing else depended on the wrapping.
# Lifetimes: the tensors FA4 reads are the caller's (`TracedMod.tensors`, saved for the backward
# by autograd) or temporaries made for the call (a bool -> uint8 or narrow-int copy, a reshape, a
# gradient buffer), which `backend.forward` / `backward` hold in a list until `launch.forward` /
# `backward` return, i.e. until FA4 has enqueued its kernels. After that a temporary may go back
# to torch's caching allocator: it was allocated on the current stream, FA4 launches on the current
# stream, and the allocator hands a freed block only to later work on the same stream (ordered
# after the kernel) unless told otherwise (`record_stream`), so no kernel reads freed memory.
# CUDA graphs: an address is a kernel argument like the pointer of any tensor argument; a replay
# reads the captured tensors at the addresses of the recorded call, as it would with
# `aux_tensors` (temporaries made during capture come from the graph's private pool).
# Without a GPU (offline.py) the tensors are fake and their addresses go as Int64(0): the compile
# needs only the types.

# Note [Constants in generated CuTe source]
# Every constant of the IR is printed by `Constants`, and nowhere else: `literal` prints a typed
# literal (`cutlass.Float32(0.125)`). Lifted Python scalars (SCALAR leaves, Note [Lifted scalars]
# in flexfa/ir/nodes.py) are read by `scalar` from FA4's `aux_scalars`, a tuple of run-time
# values (`cutlass.Float32`, one per slot, first; the captured tensors' addresses and sizes
# follow, Note [Captured tensors by address]) that FA4 passes to every hook by keyword. FA4 keys
# its compiled kernels by the hooks' code and the scalars' types, not their values, and flexfa's
# module key leaves the values out too, so score_mods that differ only in a lifted float share
# one generated module and one compile.
#
# Note [Fast math in generated CuTe source]
# The generated hooks run once per score element, next to FA4's own exp2 of the softmax, and the
# multi-function unit that computes both is the forward's bottleneck at head dim 128. So float32
# math is written the way FA4's kernels and flexfa's Triton kernels write it: exp, exp2, log, log2,
# tanh, sin and cos use the hardware approximations (`fastmath=True`: one `tanh.approx.f32` instead
# of an exp2, a reciprocal and an exact division); `x / c` for a constant c is `x * (1 / c)`, and
# `x / y` is `x * rcp_approx(y)` (within two units in the last place, as Triton's default float
# division). Exact IEEE division and libm-accurate functions cost several of those units per
# element: the first softcap kernels, written with them, ran at 0.61x of FA4's built-in softcap.
# The errors stay far below a bfloat16 or float16 rounding of the result, which is what the
# three-way tests check. float64 math (a float64 captured tensor) is left exact.
#
# Note [erf in generated CuTe source]
# The CuTe DSL has `cute.math.erf` (MLIR's math.erf). The GPU has no instruction for it, and the
# DSL expands it in place into MLIR's float32 rational approximation (piecewise ratios of degree-4
# polynomials, stated error about 2.5e-7: its coefficients are in the sm_90a PTX of
# tests/codegen/test_every_op.py's compile, no library call), far below a bfloat16 or float16
# rounding of the score, so it is used as it is and not in the fast-math set. GELU (`F.gelu`,
# approximate="none") reaches the IR as erf, and its derivative as exp (Note [Activations] in
# flexfa/frontend/activations.py).
#
# Note [Every op has a CuTe lowering]
# `LOWERED_OPS` is every IR op `_Body` can print, and `unlowered_ops` the ops of a mod that are
# not in it. The fa4 backend's `supports` says no, naming the op, for a mod with one, so that
# `backend="auto"` moves on instead of choosing fa4 and failing while generating the hooks;
# tests/codegen/test_every_op.py walks every op of `Op` through each backend and fails for an op
# that is neither lowered here nor refused by `supports`.
#
# Note [Captured gradients in the FA4 backward]
# d loss / d capture[idx] sums `grad * d_load` over the (q, kv) pairs whose load read capture[idx],
# and the generated `score_mod_bwd` adds those contributions into a float32 gradient buffer
# (passed by address like the captures, Note [Captured tensors by address]) with atomics. One
# atomic per score element serializes wherever many elements hit one address - a per-head slope
# or temperature (every element of a head), a relative-position table's clamped far distances, a
# table of 64 x 64 blocks - so the adds are first summed where they share an address.
# How FA4 calls the hook (flash_attn/cute softmax.py `apply_score_mod_bwd_inner`): on a vector of
# `vec_size` elements of the thread's S fragment (4 for flexfa's calls, which pass no
# `aux_tensors`), over the whole fragment in a fully unrolled loop, from every thread of the
# warps that hold S - sm90's MMA warpgroups between the dP GEMM and dS, sm100's compute warps
# after the TMEM load - in loops whose bounds are the same for the whole CTA (its m blocks or
# block-sparse list), never under a lane-dependent branch. So all 32 lanes of a warp call the hook
# together, and the hook may use warp shuffles and votes (full mask) as long as it keeps them
# outside its own lane-dependent branches: every branch around them below tests a vote's result,
# the same in all lanes; only the atomics sit under per-lane conditions. A pair that adds nothing
# (masked: `grad == 0`; padding elements past the sequence end; an index out of range) goes in as
# the value 0 and is skipped, and its offset is never read.
# - Static: an index that reads no variable but `b` and `h` (constants, lifted scalars, loads so
#   indexed: `slopes[h]`, a 0-d temperature) names one element for the whole call and warp. `b`
#   and `h` are the work tile's in flexfa's backward; FA4 hands out per-element heads only under
#   packed GQA, which flexfa's backward with a score_mod never runs (K/V repeated per query head,
#   Note [GQA in FA4's score_mod backward] in backend.py; `backend.backward` stops with an error
#   if K/V ever reach FA4 grouped with captured gradients). The call sums its elements in one
#   register (`acc`), the warp sums the lanes with five butterfly shuffles, and lane 0 issues one
#   atomic (`flexfa_atomic_add_uniform`).
# - Dynamic: other indices are decided at run time (`flexfa_atomic_add_warp`): the call keeps each
#   element's value and offset; if in every lane the adding elements share one offset (a vote) the
#   lane sums them, else each element goes alone; then, per value, a ballot of the adding lanes, the
#   smallest adding offset (`redux.sync.min`) and a vote tell whether they all add to that element:
#   if so the warp sums with butterfly shuffles and its lowest adding lane issues one atomic, else
#   each adding lane issues its own.
# Per m block of FA4's sm90 backward a warp thus adds a per-head slope with 8 atomics (one per
# hook call) instead of one per unmasked element (up to 1024), and a 64 x 64 block table or a
# clamped distance with one per call where its 128 elements share the element. Compiled for
# sm_90a (learnable causal ALiBi slopes, head dim 128), the backward holds 8 REDG where it held 32;
# the code of the dynamic path is larger (docs/cute.md has the counts).
# The order of the adds is not fixed, so these gradients are not bitwise repeatable; the backend
# refuses `deterministic=True` when a captured tensor needs a gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from flexfa.codegen.triton.emit import provably_nonnegative
from flexfa.frontend.trace import TracedMod
from flexfa.ir.autodiff import ScoreModGradient
from flexfa.ir.dtypes import DType
from flexfa.ir.nodes import Capture, Node, Op, toposort

CUTE_DTYPE = {
    DType.BOOL: "cutlass.Boolean",
    DType.INT32: "cutlass.Int32",
    DType.INT64: "cutlass.Int64",
    DType.FLOAT16: "cutlass.Float16",
    DType.BFLOAT16: "cutlass.BFloat16",
    DType.FLOAT32: "cutlass.Float32",
    DType.FLOAT64: "cutlass.Float64",
}

_MATH = {
    Op.EXP: "cute.math.exp",
    Op.EXP2: "cute.math.exp2",
    Op.LOG: "cute.math.log",
    Op.LOG2: "cute.math.log2",
    Op.SQRT: "cute.math.sqrt",
    Op.RSQRT: "cute.math.rsqrt",
    Op.TANH: "cute.math.tanh",
    Op.SIN: "cute.math.sin",
    Op.COS: "cute.math.cos",
    Op.FLOOR: "cute.math.floor",
    Op.CEIL: "cute.math.ceil",
    Op.ERF: "cute.math.erf",  # Note [erf in generated CuTe source]
}
# float32 functions computed with the GPU's approximations (Note [Fast math in generated CuTe
# source]).
_FAST = frozenset({Op.EXP, Op.EXP2, Op.LOG, Op.LOG2, Op.TANH, Op.SIN, Op.COS})
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
    Op.SHR: ">>",  # arithmetic on signed integers (arith.shrsi), as torch's and Triton's
}

# Every op `_Body` prints (Note [Every op has a CuTe lowering]): leaves, loads, `_MATH`, `_INFIX`
# and the ops `_Body._expr` spells out one by one.
LOWERED_OPS = frozenset(
    {Op.CONST, Op.VAR, Op.CAPTURE, Op.SCALAR, Op.LOAD, Op.CAST, Op.NEG, Op.NOT, Op.ABS, Op.SIGN}
    | {Op.SIGMOID, Op.MIN, Op.MAX, Op.WHERE, Op.POW, Op.FLOORDIV, Op.MOD}
    | set(_MATH)
    | set(_INFIX)
)


def unlowered_ops(roots: list[Node]) -> list[Op]:
    """The ops under `roots` that have no CuTe DSL lowering, in `Op`'s order (Note [Every op has
    a CuTe lowering])."""
    found = {n.op for n in toposort(roots)} - LOWERED_OPS
    return [op for op in Op if op in found]


# The FA4 hooks' fixed parameters (FA4 passes q_idx, kv_idx, seqlen_info and aux_tensors by
# keyword), and for each mod variable: the scalar its element 0 is read into, and the parameter.
# `aux_scalars` comes by keyword when the call passes lifted scalars or tensors (Note [Constants
# in generated CuTe source], Note [Captured tensors by address]); FA4 then passes it to every
# hook. `aux_tensors` is always empty.
SCORE_MOD_PARAMS = (
    "score_ssa", "b_idx", "h_idx", "q_idx", "kv_idx", "seqlen_info", "aux_tensors",
    "aux_scalars=None",
)  # fmt: skip
MASK_MOD_PARAMS = (
    "b_idx", "h_idx", "q_idx", "kv_idx", "seqlen_info", "aux_tensors", "aux_scalars=None",
)  # fmt: skip
SCORE_MOD_BWD_PARAMS = ("grad_ssa", *SCORE_MOD_PARAMS)
_SCALAR_OF = {
    "score": ("score", "score_ssa"),
    "b": ("b", "b_idx"),
    "h": ("h", "h_idx"),
    "q_idx": ("q", "q_idx"),
    "kv_idx": ("kv", "kv_idx"),
}


# Where a tensor's storage dtype differs from its IR dtype (Note [Captured tensors by address]).
_STORAGE = {DType.BOOL: ("cutlass.Uint8", 1)}
_BYTES = {
    DType.INT32: 4,
    DType.INT64: 8,
    DType.FLOAT16: 2,
    DType.BFLOAT16: 2,
    DType.FLOAT32: 4,
    DType.FLOAT64: 8,
}


def storage(dtype: DType) -> tuple[str, int]:
    """The CuTe DSL element type and byte width a captured tensor of IR type `dtype` is read
    with: bool tensors travel as uint8 (read back as `!= 0`), other types as themselves."""
    return _STORAGE.get(dtype) or (CUTE_DTYPE[dtype], _BYTES[dtype])


@dataclasses.dataclass(frozen=True)
class AuxLayout:
    """The order of FA4's run-time `aux_scalars` for one call's hooks, used by the emitter and
    the launcher alike (Note [Captured tensors by address]): the score_mod's lifted floats in slot
    order, then one entry per tensor - the score_mod's captures, the mask_mod's, then float32
    gradient buffers of the score_mod captures in `grad_slots` (slot order) - each entry the
    tensor's address (Int64) followed by its sizes (Int32, one per dim; a 0-d capture travels as
    one element, with one size)."""

    lifted: int
    score_captures: tuple[Capture, ...]
    mask_captures: tuple[Capture, ...]
    grad_slots: tuple[int, ...]

    @staticmethod
    def of(
        score: TracedMod | None, mask: TracedMod | None, grad_slots: frozenset[int]
    ) -> AuxLayout:
        return AuxLayout(
            lifted=len(score.scalars) if score is not None else 0,
            score_captures=score.captures if score is not None else (),
            mask_captures=mask.captures if mask is not None else (),
            grad_slots=tuple(sorted(grad_slots)),
        )

    def score_capture(self, slot: int) -> int:
        """The tensor position of score_mod capture `slot`."""
        return slot

    def mask_capture(self, slot: int) -> int:
        return len(self.score_captures) + slot

    def grad_buffer(self, slot: int) -> int:
        return len(self.score_captures) + len(self.mask_captures) + self.grad_slots.index(slot)

    @functools.cached_property
    def tensors(self) -> tuple[tuple[DType, int], ...]:
        """(IR dtype, rank as passed) of the tensor at each position."""

        def entry(c: Capture) -> tuple[DType, int]:
            return c.dtype, max(c.ndim, 1)

        caps = [entry(c) for c in (*self.score_captures, *self.mask_captures)]
        grads = [(DType.FLOAT32, entry(self.score_captures[s])[1]) for s in self.grad_slots]
        return (*caps, *grads)

    @functools.cached_property
    def _addresses(self) -> tuple[int, ...]:
        starts, at = [], self.lifted
        for _, rank in self.tensors:
            starts.append(at)
            at += 1 + rank
        return (*starts, at)

    def address(self, position: int) -> int:
        """The index in `aux_scalars` of the address of the tensor at `position`."""
        return self._addresses[position]

    def size(self, position: int, dim: int) -> int:
        """The index in `aux_scalars` of size `dim` of the tensor at `position`."""
        assert 0 <= dim < self.tensors[position][1]
        return self.address(position) + 1 + dim

    @property
    def num_scalars(self) -> int:
        return self.address(len(self.tensors))


@dataclasses.dataclass(frozen=True)
class ModSource:
    """A rendered CuTe DSL function: its name and full source."""

    name: str
    source: str


class Constants:
    """Where every IR constant's text comes from (Note [Constants in generated CuTe source])."""

    def scalar(self, node: Node) -> str:
        """A lifted scalar: read from FA4's runtime `aux_scalars`, in slot order."""
        return f"aux_scalars[{node.arg.slot}]"

    def literal(self, node: Node) -> str:
        v = node.arg
        if node.dtype.is_bool:
            return f"cutlass.Boolean({bool(v)})"
        if node.dtype.is_int:
            return f"{CUTE_DTYPE[node.dtype]}({v})"
        if math.isnan(v):
            text = 'float("nan")'
        elif math.isinf(v):
            text = 'float("inf")' if v > 0 else '-float("inf")'
        else:
            text = repr(v)
        return f"{CUTE_DTYPE[node.dtype]}({text})"


class _Body:
    """Emits scalar SSA lines for a set of roots; constants and parameters are inlined."""

    def __init__(self, aux: AuxLayout, aux_index: dict[int, int], constants: Constants) -> None:
        self.aux = aux
        self.aux_index = aux_index  # capture slot -> tensor position (AuxLayout)
        self.constants = constants
        self.names: dict[int, str] = {}
        self.lines: list[str] = []
        self.reads: set[str] = set()
        self.views: dict[int, str] = {}  # tensor position -> the line that builds its view

    def view(self, position: int) -> str:
        """The name of the tensor at `position`, built once per function from its address and
        sizes (Note [Captured tensors by address])."""
        name = f"view{position}"
        if position not in self.views:
            dtype, rank = self.aux.tensors[position]
            element, width = storage(dtype)
            sizes = [f"aux_scalars[{self.aux.size(position, d)}]" for d in range(rank)]
            strides = [" * ".join(sizes[d + 1 :]) or "1" for d in range(rank)]
            self.views[position] = (
                f"{name} = flexfa_view({element}, {width}, "
                f"aux_scalars[{self.aux.address(position)}], {_tuple(sizes)}, {_tuple(strides)})"
            )
        return name

    def name(self, node: Node) -> str:
        return self.names[id(node)]

    def emit(self, roots: list[Node]) -> None:
        for n in toposort(roots):
            if id(n) in self.names:
                continue
            if n.op is Op.CONST:
                self.names[id(n)] = self.constants.literal(n)
            elif n.op is Op.VAR:
                self.reads.add(n.arg)
                self.names[id(n)] = _SCALAR_OF[n.arg][0]
            elif n.op is Op.CAPTURE:
                self.names[id(n)] = self.view(self.aux_index[n.arg.slot])
            elif n.op is Op.SCALAR:
                self.names[id(n)] = self.constants.scalar(n)
            else:
                tmp = f"t{len(self.lines)}"
                self.lines.append(f"{tmp} = {self._expr(n)}")
                self.names[id(n)] = tmp

    def _expr(self, n: Node) -> str:
        op = n.op
        a = [self.name(s) for s in n.srcs]
        if op is Op.LOAD:
            return self._load(n)
        if op is Op.CAST:
            if n.dtype.is_bool:
                return f"{a[0]} != 0"
            if n.srcs[0].dtype.is_bool:
                return f"flexfa_select({a[0]}, {_one(n.dtype)}, {_zero(n.dtype)})"
            return f"{a[0]}.to({CUTE_DTYPE[n.dtype]})"
        if op is Op.NEG:
            return f"-{a[0]}"
        if op is Op.NOT:
            if n.dtype.is_bool:
                return f"flexfa_select({a[0]}, cutlass.Boolean(False), cutlass.Boolean(True))"
            return f"~{a[0]}"
        if op is Op.ABS:
            return f"flexfa_select({a[0]} < {_zero(n.dtype)}, -{a[0]}, {a[0]})"
        if op is Op.SIGN:
            zero, one = _zero(n.dtype), _one(n.dtype)
            return (
                f"flexfa_select({a[0]} > {zero}, {one}, "
                f"flexfa_select({a[0]} < {zero}, -{one}, {zero}))"
            )
        if op is Op.SIGMOID:
            if n.dtype is DType.FLOAT32:
                return (
                    f"cute.arch.rcp_approx({_one(n.dtype)} + cute.math.exp(-{a[0]}, fastmath=True))"
                )
            return f"{_one(n.dtype)} / ({_one(n.dtype)} + cute.math.exp(-{a[0]}))"
        if op in _MATH:
            fast = ", fastmath=True" if op in _FAST and n.dtype is DType.FLOAT32 else ""
            return f"{_MATH[op]}({a[0]}{fast})"
        if op is Op.TRUEDIV and n.dtype is DType.FLOAT32:
            return self._divide(n, a)
        if op in _INFIX:
            return f"{a[0]} {_INFIX[op]} {a[1]}"
        if op is Op.MIN:
            return f"flexfa_select({a[1]} < {a[0]}, {a[1]}, {a[0]})"
        if op is Op.MAX:
            return f"flexfa_select({a[0]} < {a[1]}, {a[1]}, {a[0]})"
        if op is Op.WHERE:
            return f"flexfa_select({a[0]}, {a[1]}, {a[2]})"
        if op is Op.POW:
            return self._pow(n, a)
        if op is Op.FLOORDIV:
            if n.dtype.is_float:
                return f"cute.math.floor({a[0]} / {a[1]})"
            if all(provably_nonnegative(s) for s in n.srcs):
                return f"{a[0]} // {a[1]}"  # truncation equals floor for non-negative operands
            return f"flexfa_floordiv({a[0]}, {a[1]})"
        if op is Op.MOD:
            if n.dtype.is_float:
                return f"{a[0]} - cute.math.floor({a[0]} / {a[1]}) * {a[1]}"
            if all(provably_nonnegative(s) for s in n.srcs):
                return f"{a[0]} % {a[1]}"
            return f"flexfa_floormod({a[0]}, {a[1]})"
        raise NotImplementedError(f"no CuTe DSL lowering for {op}")  # pragma: no cover

    def _divide(self, n: Node, a: list[str]) -> str:
        """float32 `a / b` as a product (Note [Fast math in generated CuTe source])."""
        divisor = n.srcs[1]
        if divisor.op is Op.CONST and math.isfinite(divisor.arg) and divisor.arg != 0:
            return f"{a[0]} * {_f32(1.0 / divisor.arg)}"
        return f"{a[0]} * cute.arch.rcp_approx({a[1]})"

    def _pow(self, n: Node, a: list[str]) -> str:
        exponent, base = n.srcs[1], n.srcs[0]
        if n.dtype.is_float and exponent.op is Op.CONST:
            e = float(exponent.arg)
            if e == 2.0:
                return f"{a[0]} * {a[0]}"
            return f"flexfa_pow_const({a[0]}, {e!r}, {e.is_integer()}, {e.is_integer() and int(e) % 2 == 1})"
        if n.dtype.is_float and base.op is Op.CONST and base.arg > 0:
            return f"cute.math.exp2({_f32(math.log2(base.arg))} * {a[1]})"
        if n.dtype.is_float:
            return f"flexfa_pow({a[0]}, {a[1]})"
        # Integer powers go through float and round back (exact below 2**24).
        return (
            f"cute.math.floor(flexfa_pow({a[0]}.to(cutlass.Float32), {a[1]}.to(cutlass.Float32))"
            f" + cutlass.Float32(0.5)).to({CUTE_DTYPE[n.dtype]})"
        )

    def _load(self, n: Node) -> str:
        """A guarded read of a captured tensor (Note [Loads out of bounds] in flexfa/ir/evaluate.py):
        indices are clamped into range for the read, and an out-of-range index yields 0."""
        cap: Capture = n.srcs[0].arg
        t = self.view(self.aux_index[cap.slot])
        idx = [self.name(s) for s in n.srcs[1:]]
        if not idx:  # 0-d captures travel as one-element vectors (see launch.captured_tensor)
            idx = ["cutlass.Int32(0)"]
            nodes: list[Node | None] = [None]
        else:
            nodes = list(n.srcs[1:])
        clamped, guards = [], []
        for d, (node, i) in enumerate(zip(nodes, idx)):
            size = f"{t}.shape[{d}]"
            if node is None:
                clamped.append(i)
                continue
            lo_ok = node is not None and provably_nonnegative(node)
            clamped.append(f"flexfa_clamp({i}, {size})")
            guards.append(f"({i} < {size})" if lo_ok else f"({i} >= 0) & ({i} < {size})")
        coord = clamped[0] if len(clamped) == 1 else "(" + ", ".join(clamped) + ")"
        value = f"{t}[{coord}]"
        value = f"({value} != 0)" if n.dtype.is_bool else f"{value}.to({CUTE_DTYPE[n.dtype]})"
        if not guards:
            return value
        return f"flexfa_select({' & '.join(guards)}, {value}, {_zero(n.dtype)})"


def _zero(dtype: DType) -> str:
    if dtype.is_bool:
        return "cutlass.Boolean(False)"
    return f"{CUTE_DTYPE[dtype]}({'0.0' if dtype.is_float else '0'})"


def _one(dtype: DType) -> str:
    if dtype.is_bool:
        return "cutlass.Boolean(True)"
    return f"{CUTE_DTYPE[dtype]}({'1.0' if dtype.is_float else '1'})"


def _tuple(items: list[str]) -> str:
    return f"({items[0]},)" if len(items) == 1 else "(" + ", ".join(items) + ")"


def _f32(x: float) -> str:
    return f"cutlass.Float32({x!r})"


def _reads(body: _Body, names: tuple[str, ...]) -> list[str]:
    """`x = x_param[i]` for each mod parameter the body reads, in the signature's order."""
    return [f"{_SCALAR_OF[v][0]} = {_SCALAR_OF[v][1]}[i]" for v in names if v in body.reads]


def _function(
    name: str,
    params: tuple[str, ...],
    first: str,
    body: _Body,
    lines: list[str],
    result: str,
    dtype: str,
    doc: str,
    before: tuple[str, ...] = (),
    after: tuple[str, ...] = (),
) -> str:
    """A hook: the views of the tensors it reads, then for each element i of the argument vectors
    (FA4 chooses their length, e.g. 2 in the forward and 4 in the backward) the scalar body, then
    the results as one vector. `before` / `after`: lines around the element loop (the backward's
    per-call gradient sums, Note [Captured gradients in the FA4 backward])."""
    sig = ", ".join(params)
    head = f"@cute.jit\ndef {name}({sig}):"
    if len(f"def {name}({sig}):") > 100:
        joined = ",\n".join(f"    {p}" for p in params)
        head = f"@cute.jit\ndef {name}(\n{joined},\n):"
    views = "".join(f"    {body.views[p]}\n" for p in sorted(body.views))
    text = "\n".join(f"        {line}" for line in lines)
    head_lines = "".join(f"    {line}\n" for line in before)
    tail_lines = "".join(f"    {line}\n" for line in after)
    return (
        f'{head}\n    """{doc}"""\n'
        f"{views}"
        f"    n = cutlass.const_expr(cute.size({first}.shape))\n"
        f"    result = cute.make_rmem_tensor(n, {dtype})\n"
        f"{head_lines}"
        f"    for i in cutlass.range_constexpr(n):\n"
        f"{text}\n"
        f"        result[i] = {result}\n"
        f"{tail_lines}"
        f"    return result.load()"
    )


_VAR_ORDER = ("score", "b", "h", "q_idx", "kv_idx")


def _aux_index(traced: TracedMod, aux: AuxLayout) -> dict[int, int]:
    place = aux.score_capture if traced.kind == "score_mod" else aux.mask_capture
    return {c.slot: place(c.slot) for c in traced.captures}


def emit_mod(
    traced: TracedMod, fn_name: str, aux: AuxLayout, constants: Constants | None = None
) -> ModSource:
    """The forward hook of a score_mod (`score_mod`) or mask_mod (`mask_mod`)."""
    body = _Body(aux, _aux_index(traced, aux), constants or Constants())
    body.emit([traced.output])
    ret = body.name(traced.output)
    lines = [*_reads(body, _VAR_ORDER), *body.lines]
    doc = f"{traced.kind} {traced.name!r}, traced by flexfa."
    if traced.kind == "score_mod":
        source = _function(
            fn_name, SCORE_MOD_PARAMS, "score_ssa", body, lines, ret, "cutlass.Float32", doc
        )
    else:
        source = _function(
            fn_name, MASK_MOD_PARAMS, "q_idx", body, lines, ret, "cutlass.Boolean", doc
        )
    return ModSource(fn_name, source)


def emit_score_mod_bwd(
    traced: TracedMod,
    grad: ScoreModGradient,
    fn_name: str,
    aux: AuxLayout,
    constants: Constants | None = None,
) -> ModSource:
    """The `score_mod_bwd` hook, from flexfa's autodiff (never written by hand): it returns
    grad * d score_mod / d score and adds the captured tensors' gradients into their buffers
    (Note [Captured gradients in the FA4 backward])."""
    body = _Body(aux, _aux_index(traced, aux), constants or Constants())
    loads = [g for g in grad.loads if g.slot in aux.grad_slots]
    body.emit([grad.d_score, *(g.d_load for g in loads), *(i for g in loads for i in g.indices)])
    lines = ["grad = grad_ssa[i]", *_reads(body, _VAR_ORDER), *body.lines]
    scatters = [_scatter(j, g.load, g.d_load, body, aux) for j, g in enumerate(loads)]
    for sc in scatters:
        lines.extend(sc.each)
    d = grad.d_score
    ret = "grad" if d.op is Op.CONST and d.arg == 1.0 else f"grad * {body.name(d)}"
    doc = f"gradient of score_mod {traced.name!r} (derived by flexfa's autodiff)."
    source = _function(
        fn_name, SCORE_MOD_BWD_PARAMS, "grad_ssa", body, lines, ret, "cutlass.Float32", doc,
        before=tuple(line for sc in scatters for line in sc.before),
        after=tuple(line for sc in scatters for line in sc.after),
    )  # fmt: skip
    return ModSource(fn_name, source)


# The variables whose value is the same in every element of a hook call and every lane of a warp
# in flexfa's backward (Note [Captured gradients in the FA4 backward]).
_WARP_UNIFORM_VARS = frozenset({"b", "h"})


def warp_uniform_index(load: Node) -> bool:
    """Whether a load's index reads no variable but `b` and `h` (constants, lifted scalars and
    loads so indexed are fine): the same element for a whole hook call and warp."""
    index = list(load.srcs[1:])
    return all(n.arg in _WARP_UNIFORM_VARS for n in toposort(index) if n.op is Op.VAR)


@dataclasses.dataclass(frozen=True)
class Scatter:
    """The lines that add one captured tensor's gradient (Note [Captured gradients in the FA4
    backward]): `each` in the element loop, `before` / `after` around it."""

    each: tuple[str, ...]
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()


def _scatter(j: int, load: Node, d_load: Node, body: _Body, aux: AuxLayout) -> Scatter:
    cap: Capture = load.srcs[0].arg
    buf = body.view(aux.grad_buffer(cap.slot))
    idx = [body.name(s) for s in load.srcs[1:]] or ["cutlass.Int32(0)"]
    guards = [f"({ix} < {buf}.shape[{d}])" for d, ix in enumerate(idx)]
    guards += [
        f"({ix} >= 0)" for ix, node in zip(idx, load.srcs[1:]) if not provably_nonnegative(node)
    ]
    coord = idx[0] if len(idx) == 1 else "(" + ", ".join(idx) + ")"
    c = "grad" if d_load.op is Op.CONST and d_load.arg == 1.0 else f"grad * {body.name(d_load)}"
    # Out-of-range indices and zero contributions add nothing: the value goes in as 0.
    value = f"flexfa_select({' & '.join(guards)}, ({c}).to(cutlass.Float32), cutlass.Float32(0.0))"
    if warp_uniform_index(load):
        return Scatter(
            each=(f"c{j} = {value}", f"acc{j} = acc{j} + c{j}"),
            before=(f"acc{j} = cutlass.Float32(0.0)",),
            after=(f"flexfa_atomic_add_uniform(acc{j}, {buf}, {coord})",),
        )
    return Scatter(
        each=(f"values{j}[i] = {value}", f"offsets{j}[i] = cute.crd2idx({coord}, {buf}.layout)"),
        before=(
            f"values{j} = cute.make_rmem_tensor(n, cutlass.Float32)",
            f"offsets{j} = cute.make_rmem_tensor(n, cutlass.Int32)",
        ),
        after=(f"flexfa_atomic_add_warp(values{j}, offsets{j}, {buf})",),
    )
