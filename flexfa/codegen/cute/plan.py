"""How a call's mask reaches FlashAttention-4: its native causal / sliding-window paths, or a
generated mask_mod. Every native rewrite is proven from the mask's IR, never guessed.

# Note [Native masks from the IR]
# FA4's fastest paths are its own masks: none (full), causal, and a local window. They are
# bottom-right aligned: with off = len_kv - len_q, the pair (q, kv) is allowed iff
#     q + off - window_left <= kv <= q + off + window_right
# (a missing bound is unbounded; causal is window_right = 0 with no left bound).
# flexfa's tile analysis (Note [Tile analysis] in flexfa/blockmask/analysis.py) gives each IR node a
# signature; a mask whose output has signature D and reads neither b nor h is a function of the
# single integer d = q_idx - kv_idx. Its value is then evaluated exactly at every d the call can
# see, from -(len_kv - 1) to len_q - 1 (one pair per d). If the allowed d form one contiguous run
# [lo, hi], the mask is exactly `lo <= q_idx - kv_idx <= hi`, which is FA4's window with
#     window_left  = hi + off   (None when hi = len_q - 1: no pair is cut on that side)
#     window_right = -lo - off  (None when lo = -(len_kv - 1))
# and "full" when both are None. A negative bound is legal arithmetic but not a shape FA4's block
# scheduler is documented for, so such masks (e.g. causal with len_q < len_kv, whose top-left
# alignment is not FA4's) keep the generated mask_mod. Anything else (masks of b or h, document
# masks, prefix-LM, dilated windows) keeps the generated mask_mod too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Literal

import torch

from flexfa.blockmask.analysis import Static
from flexfa.blockmask.block_mask import BlockSize, TileState
from flexfa.blockmask.build import classify
from flexfa.blockmask.exact import evaluate_mask
from flexfa.blockmask.grid import TileGrid
from flexfa.blockmask.lines import Sig
from flexfa.frontend.trace import TracedMod
from flexfa.ir import build
from flexfa.ir.nodes import Node, Op, toposort

# Head dims at which flexfa's GPU tests verified FA4's sm90 backward, with and without a
# score_mod (Note [Backward with a score_mod] in flexfa/codegen/cute/backend.py).
SM90_BACKWARD_HEAD_DIMS = (64, 96, 128, 192, 256)


def backward_head_dim(head_dim: int, head_dim_v: int, arch_major: int | None) -> int | None:
    """The head dim FA4's backward runs this call at, zero-padded (Note [Padded backward] in
    flexfa/codegen/cute/backend.py), or None where it runs at the call's own head dims. sm90 only:
    FA4's authors test its Blackwell backward, which no flexfa machine can run.

    >>> backward_head_dim(80, 80, 9), backward_head_dim(128, 64, 9), backward_head_dim(64, 64, 9)
    (96, 128, None)
    """
    if arch_major != 9:
        return None
    if head_dim == head_dim_v and head_dim in SM90_BACKWARD_HEAD_DIMS:
        return None
    return min(d for d in SM90_BACKWARD_HEAD_DIMS if d >= max(head_dim, head_dim_v))


LoweringKind = Literal["full", "causal", "window", "rows", "mask_mod"]


@dataclasses.dataclass(frozen=True)
class MaskLowering:
    """How the mask of one call is passed to FA4, and why (`reason`, for explain and export).
    "rows": two calls, each with a native mask (`split`, Note [Prefix masks as two native
    calls])."""

    kind: LoweringKind
    window_left: int | None = None
    window_right: int | None = None
    reason: str = ""
    split: RowSplit | None = None

    @property
    def native(self) -> bool:
        return self.kind != "mask_mod"

    def fa4_kwargs(self) -> dict:
        """Keyword arguments of FA4's `_flash_attn_fwd` / `_flash_attn_bwd` for this mask."""
        if self.kind == "rows":
            raise ValueError("a split mask is two FA4 calls: use the lowerings of its parts")
        if self.kind == "causal":
            return {"causal": True}
        if self.kind == "window":
            return {"window_size_left": self.window_left, "window_size_right": self.window_right}
        return {}


def allowed_distances(mask: TracedMod, len_q: int, len_kv: int) -> torch.Tensor | None:
    """The mask's value at each d = q_idx - kv_idx in [-(len_kv - 1), len_q - 1] (bool, in that
    order), or None when the mask is not proven to be a function of d alone."""
    if mask.variables - {"q_idx", "kv_idx"}:
        return None
    grid = TileGrid(1, 1, len_q, len_kv, BlockSize(128, 128), torch.device("cpu"))
    sig = Static(mask.output, grid).sig[id(mask.output)]
    if sig not in (Sig.D, Sig.NONE):
        return None
    device = mask.tensors[0].device if mask.tensors else torch.device("cpu")
    d = torch.arange(-(len_kv - 1), len_q, device=device, dtype=torch.int64)
    q = d.clamp(min=0)
    kv = q - d  # one in-range pair per d: 0 <= q < len_q, 0 <= kv < len_kv
    env = {
        "b": torch.zeros((), dtype=torch.int32, device=device),
        "h": torch.zeros((), dtype=torch.int32, device=device),
        "q_idx": q.to(torch.int32),
        "kv_idx": kv.to(torch.int32),
    }
    allowed = evaluate_mask(mask, env)
    return torch.broadcast_to(allowed, d.shape).cpu()


def lower_mask(mask: TracedMod | None, len_q: int, len_kv: int) -> MaskLowering:
    """FA4's native path for `mask` at these lengths where it is proven equal, else mask_mod
    (Note [Native masks from the IR]).

    >>> from flexfa.frontend.trace import trace_mask_mod
    >>> from flexfa import masks
    >>> lower_mask(trace_mask_mod(masks.causal), 300, 300).kind
    'causal'
    >>> lower_mask(trace_mask_mod(masks.sliding_window(64)), 300, 300).fa4_kwargs()
    {'window_size_left': 63, 'window_size_right': 0}
    >>> lower_mask(trace_mask_mod(masks.prefix_lm(16)), 300, 300).kind
    'mask_mod'
    """
    if mask is None or mask.is_trivially_true:
        return MaskLowering("full", reason="no mask")
    run = _allowed_run(mask, len_q, len_kv)
    if isinstance(run, MaskLowering):
        return run
    first, last, _ = run
    d_min, d_max = -(len_kv - 1), len_q - 1
    lo, hi = d_min + first, d_min + last
    off = len_kv - len_q
    left = None if hi == d_max else hi + off
    right = None if lo == d_min else -lo - off
    proof = f"proven: allowed iff {lo} <= q_idx - kv_idx <= {hi}"
    if left is None and right is None:
        return MaskLowering("full", reason=f"{proof} (every pair)")
    if (left is not None and left < 0) or (right is not None and right < 0):
        return MaskLowering(
            "mask_mod", reason=f"{proof}, but FA4's window would need a negative bound"
        )
    if left is None and right == 0:
        return MaskLowering("causal", reason=proof)
    return MaskLowering("window", left, right, reason=proof)


def native_mask(lowering: MaskLowering, len_q: int, len_kv: int) -> torch.Tensor:
    """The dense [len_q, len_kv] mask FA4's native path applies (for proofs in tests)."""
    q = torch.arange(len_q).view(-1, 1)
    kv = torch.arange(len_kv).view(1, -1)
    off = len_kv - len_q
    if lowering.kind == "full":
        return torch.ones(len_q, len_kv, dtype=torch.bool)
    if lowering.kind == "causal":
        return kv <= q + off
    if lowering.kind == "window":
        ok = torch.ones(len_q, len_kv, dtype=torch.bool)
        if lowering.window_left is not None:
            ok &= kv >= q + off - lowering.window_left
        if lowering.window_right is not None:
            ok &= kv <= q + off + lowering.window_right
        return ok
    raise ValueError("a mask_mod lowering has no native mask")


# Note [Native masks per packed sequence]
# FA4's varlen kernels apply one native mask to every sequence of a packed call, each with its own
# off = len_kv - len_q (bottom-right alignment per sequence), while the user's mask_mod sees
# positions within each sequence. So the proof of Note [Native masks from the IR] is made once for
# all of them: the mask is evaluated at every d = q_idx - kv_idx the longest sequences can see,
# from -(max len_kv - 1) to max len_q - 1 (every sequence sees a part of that range), and its
# allowed d must form one run [lo, hi]; an end of the range that is allowed counts as unbounded,
# since no sequence sees beyond it. FA4's window (left, right) allows, in the sequence of lengths
# (len_q, len_kv), -off - right <= d <= left - off. Candidates are the canonical windows of each
# distinct (len_q, len_kv), longest first, as `lower_mask` would pick them; the first that, in
# every sequence, allows exactly the run [lo, hi] within that sequence's range of d (interval
# arithmetic, no evaluation per sequence) is FA4's mask for the call. Negative bounds are refused
# as for single calls, and so is a window under which a sequence would have query rows without an
# allowed key (off + right < 0): what FA4's scheduler does with such rows of a varlen call is not
# verified. Sequences without queries or without keys see no d and do not enter the proof (the
# backend decides whether they may go to FA4's varlen kernels at all).


def lower_packed_mask(mask: TracedMod | None, shapes: Sequence[tuple[int, int]]) -> MaskLowering:
    """One FA4 native mask equal to `mask` within every sequence of a packed call, where one is
    proven, else mask_mod (Note [Native masks per packed sequence]). `shapes`: the distinct
    (len_q, len_kv) of the call's sequences, each at least 1, longest first.

    >>> from flexfa.frontend.trace import trace_mask_mod
    >>> from flexfa import masks
    >>> lower_packed_mask(trace_mask_mod(masks.causal), [(700, 700), (1, 1)]).kind
    'causal'
    >>> lower_packed_mask(trace_mask_mod(masks.causal), [(300, 300), (100, 200)]).kind
    'mask_mod'
    """
    if mask is None or mask.is_trivially_true:
        return MaskLowering("full", reason="no mask")
    shapes = tuple(shapes)
    if not shapes or min(min(shape) for shape in shapes) < 1:
        raise ValueError(f"shapes must be (len_q, len_kv) pairs of at least 1, got {shapes}")
    if mask.captures:  # its tensors may differ from call to call
        return _lower_packed_mask(mask, shapes)
    return _cached_packed_lowering(mask, shapes)


# Note [Allowed runs by powers of 2]
# The proofs above evaluate the mask at every d of the lengths' range: O(len_q + len_kv) work for
# each new pair of lengths, and a packed call brings new longest lengths with nearly every batch;
# that evaluation was about 40% of the host work flexfa added to a packed call on FA4's varlen path
# (2-core CPU, FA4's own entry point left out). A mask proven a function of d alone has the same
# value at a d whatever the lengths, so for a mask that reads no tensor the run is found once over
# the range of the next powers of 2 of the lengths, kept, and cut to the lengths' own range (two
# intervals intersected): the answer their evaluation would give. Where the larger range is not
# one run, or the mask is not proven a function of d on it, the lengths' range is evaluated as
# before.
def _allowed_run(mask: TracedMod, len_q: int, len_kv: int) -> tuple[int, int, int] | MaskLowering:
    """(first, last, count) over the q_idx - kv_idx of these lengths (index 0 is -(len_kv - 1))
    when the allowed ones form one run; else why the mask is not a band."""
    if not mask.tensors:  # Note [Allowed runs by powers of 2]
        span = _run_of_span(mask, 1 << (len_q - 1).bit_length(), 1 << (len_kv - 1).bit_length())
        if span is not None:
            d_min, d_max = -(len_kv - 1), len_q - 1
            lo, hi = max(span[0], d_min), min(span[1], d_max)
            if lo > hi:
                return MaskLowering("mask_mod", reason=_NO_PAIR)
            return lo - d_min, hi - d_min, d_max - d_min + 1
    return _evaluated_run(mask, len_q, len_kv)


@functools.lru_cache(maxsize=64)
def _run_of_span(mask: TracedMod, span_q: int, span_kv: int) -> tuple[float, float] | None:
    """The allowed d = q_idx - kv_idx of a mask of d alone over the range of these lengths, as
    one run (lo, hi) (empty: lo > hi), or None when they are not one run or the mask is not
    proven a function of d (Note [Allowed runs by powers of 2])."""
    run = _evaluated_run(mask, span_q, span_kv)
    if not isinstance(run, tuple):
        return (math.inf, -math.inf) if run.reason == _NO_PAIR else None
    first, last, _ = run
    return first - (span_kv - 1), last - (span_kv - 1)


_NO_PAIR = "the mask allows no pair"


def _evaluated_run(mask: TracedMod, len_q: int, len_kv: int) -> tuple[int, int, int] | MaskLowering:
    """`_allowed_run` by evaluating the mask at every d of these lengths."""
    allowed = allowed_distances(mask, len_q, len_kv)
    if allowed is None:
        return MaskLowering("mask_mod", reason="the mask is not a function of q_idx - kv_idx")
    hits = torch.nonzero(allowed).flatten()
    if hits.numel() == 0:
        return MaskLowering("mask_mod", reason=_NO_PAIR)
    first, last = int(hits[0]), int(hits[-1])
    if last - first + 1 != hits.numel():
        return MaskLowering("mask_mod", reason="the allowed q_idx - kv_idx are not one run")
    return first, last, allowed.numel()


@functools.lru_cache(maxsize=256)
def _cached_packed_lowering(mask: TracedMod, shapes: tuple[tuple[int, int], ...]) -> MaskLowering:
    return _lower_packed_mask(mask, shapes)


def _lower_packed_mask(mask: TracedMod, shapes: tuple[tuple[int, int], ...]) -> MaskLowering:
    max_q = max(lq for lq, _ in shapes)
    max_kv = max(lkv for _, lkv in shapes)
    run = _allowed_run(mask, max_q, max_kv)
    if isinstance(run, MaskLowering):
        return run
    first, last, count = run
    d_min = -(max_kv - 1)
    lo = -math.inf if first == 0 else d_min + first
    hi = math.inf if last == count - 1 else d_min + last
    proof = f"proven in every sequence: {_allowed(lo, hi)}"
    refusals = []
    for candidate in dict.fromkeys(_canonical(lo, hi, lq, lkv) for lq, lkv in shapes):
        why = _why_not_window(candidate, lo, hi, shapes)
        if why is None:
            left, right = candidate
            if left is None and right is None:
                return MaskLowering("full", reason=proof)
            if left is None and right == 0:
                return MaskLowering("causal", reason=proof)
            return MaskLowering("window", left, right, reason=proof)
        refusals.append(why)
    return MaskLowering("mask_mod", reason=f"{proof}, but {refusals[0]}")


def _allowed(lo: float, hi: float) -> str:
    if math.isfinite(lo) and math.isfinite(hi):
        return f"allowed iff {int(lo)} <= q_idx - kv_idx <= {int(hi)}"
    if math.isfinite(lo):
        return f"allowed iff q_idx - kv_idx >= {int(lo)}"
    if math.isfinite(hi):
        return f"allowed iff q_idx - kv_idx <= {int(hi)}"
    return "every pair allowed"


def _canonical(lo: float, hi: float, len_q: int, len_kv: int) -> tuple[int | None, int | None]:
    """`lower_mask`'s window for one sequence of these lengths: a bound its d never reach is
    None."""
    off = len_kv - len_q
    left = None if hi >= len_q - 1 else int(hi) + off
    right = None if lo <= -(len_kv - 1) else -int(lo) - off
    return left, right


def _clip(a: float, b: float, lo: int, hi: int) -> tuple[float, float] | None:
    a, b = max(a, lo), min(b, hi)
    return (a, b) if a <= b else None


def _why_not_window(
    window: tuple[int | None, int | None],
    lo: float,
    hi: float,
    shapes: tuple[tuple[int, int], ...],
) -> str | None:
    """Why FA4's window (left, right) is not the mask allowing lo <= d <= hi in every sequence
    of these shapes, or None when it is."""
    left, right = window
    if (left is not None and left < 0) or (right is not None and right < 0):
        return f"FA4's window would need a negative bound ({left}, {right})"
    for len_q, len_kv in shapes:
        off = len_kv - len_q
        fa4_lo = -math.inf if right is None else -off - right
        fa4_hi = math.inf if left is None else left - off
        seen = (-(len_kv - 1), len_q - 1)
        if _clip(fa4_lo, fa4_hi, *seen) != _clip(lo, hi, *seen):
            return (
                "no one FA4 window (aligned to each sequence's last key) equals it in every "
                f"sequence: (left={left}, right={right}) differs in sequences of {len_q} queries "
                f"and {len_kv} keys"
            )
        if right is not None and off + right < 0:
            return (
                f"sequences of {len_q} queries and {len_kv} keys would have query rows without "
                "an allowed key, which FA4's varlen kernels are not verified with"
            )
    return None


# Note [Document masks on FA4's varlen kernels]
# The most common FlexAttention mask is a document mask: `ids[b, q_idx] == ids[b, kv_idx]` (or
# `ids[q_idx] == ids[kv_idx]`), usually with causal or a window inside each document. Through
# FA4's template it runs as a generated mask_mod over block-sparse lists, the kernel torch's FLASH
# backend runs; FA4's varlen kernels do the same work without the mask: with `cu_seqlens` marking
# where the documents of a batch row start, a tile never crosses a document, and the condition
# inside each document is FA4's native causal mask or window (as for packed calls, Note [Packed
# calls on FA4's varlen path] in backend.py). `document_mask` finds the documents in the IR: the
# mask is a conjunction (`&` at the top) one of whose terms is `ids[..., q_idx] == ids[...,
# kv_idx]`, the same captured integer tensor read at the same leading index (`b` or none) and at
# q_idx and kv_idx as its last; the other terms (`inner`) must read q_idx and kv_idx only, and no
# tensor. Then, within a document whose tokens are the positions start..end - 1, the mask is
# inner(q_idx, kv_idx) on absolute positions, which the varlen kernels present as positions
# relative to the document's start: the same where inner is a function of q_idx - kv_idx, which
# the native lowering per document proves (`lower_packed_mask` on the documents' lengths). The
# ids become documents only where each id is one run of positions: the backend checks that the
# ids never decrease along a row (one host copy per ids tensor state) and declines otherwise.
@dataclasses.dataclass(frozen=True, eq=False)
class DocumentMask:
    """A document mask found in a mask's IR (Note [Document masks on FA4's varlen kernels])."""

    ids_slot: int  # the captured tensor of document ids
    by_batch: bool  # read as ids[b, pos] (else ids[pos]: every batch row has the same documents)
    inner: TracedMod | None  # the other terms, a mask of q_idx and kv_idx (None: no other term)


def document_mask(mask: TracedMod | None) -> DocumentMask | None:
    """The documents and the condition inside them of `mask`, or None when it is not of the form
    of Note [Document masks on FA4's varlen kernels].

    >>> import torch
    >>> from flexfa.frontend.trace import trace_mask_mod
    >>> ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    >>> doc = document_mask(trace_mask_mod(lambda b, h, q, kv: (ids[b, q] == ids[b, kv]) & (q >= kv)))
    >>> doc.by_batch, sorted(doc.inner.variables)
    (True, ['kv_idx', 'q_idx'])
    """
    if mask is None:
        return None
    return _document_mask(mask.output, mask.name)


def _inner_has_no_function(*args: object) -> None:
    raise TypeError("the inner condition of a document mask exists only as IR")


@functools.lru_cache(maxsize=128)
def _document_mask(output: Node, name: str) -> DocumentMask | None:
    """`document_mask` by the mask's IR (interned: equal IR is the same node) and name, so that a
    repeated call finds the same inner TracedMod, and with it the cached lowerings."""
    terms = _terms(output, Op.AND)
    found = next((t for t in terms if _ids_slot(t) is not None), None)
    if found is None:
        return None
    slot, by_batch = _ids_slot(found)
    rest = [t for t in terms if t is not found]
    inner = None
    if rest:
        node = functools.reduce(lambda a, b: build.binary(Op.AND, a, b), rest)
        if any(n.op in (Op.LOAD, Op.CAPTURE) for n in toposort([node])):
            return None
        inner = TracedMod(
            kind="mask_mod", name=f"{name}_inner", output=node, captures=(), tensors=(),
            fn=_inner_has_no_function,
        )  # fmt: skip
        if inner.variables - {"q_idx", "kv_idx"}:
            return None
    return DocumentMask(slot, by_batch, inner)


def _terms(node: Node, op: Op) -> list[Node]:
    """The terms of a boolean `&` (op AND) or `|` (op OR) tree at the top of `node`."""
    if node.op is op and node.dtype.is_bool:
        return [t for src in node.srcs for t in _terms(src, op)]
    return [node]


def _ids_slot(node: Node) -> tuple[int, bool] | None:
    """(capture slot, read with b) when `node` is ids[..., q_idx] == ids[..., kv_idx]."""
    if node.op is not Op.EQ:
        return None
    a, b = node.srcs
    if a.op is not Op.LOAD or b.op is not Op.LOAD or a.srcs[0] is not b.srcs[0]:
        return None
    if not a.dtype.is_int:
        return None
    ia, ib = a.srcs[1:], b.srcs[1:]
    if len(ia) != len(ib) or len(ia) not in (1, 2) or ia[:-1] != ib[:-1]:
        return None
    if {_var(ia[-1]), _var(ib[-1])} != {"q_idx", "kv_idx"}:
        return None
    if len(ia) == 2 and _var(ia[0]) != "b":
        return None
    return a.srcs[0].arg.slot, len(ia) == 2


def _var(node: Node) -> str | None:
    return node.arg if node.op is Op.VAR else None


# Note [Prefix masks as two native calls]
# A prefix-LM mask, `kv_idx < P | kv_idx <= q_idx`, is no band of q_idx - kv_idx, so it reaches
# FA4 as a mask_mod over block-sparse lists: the block-sparse kernel torch's FLASH backend runs
# too. Split at row P it is two of FA4's native masks: rows below P attend to keys below P, all of
# them (a full mask on the first P keys); rows from P on are causal over every key, which, with
# the row slice's own length, is FA4's bottom-right causal mask (off = len_kv - (len_q - P), so
# kv_idx <= (q_idx - P) + off = q_idx + len_kv - len_q). Both parts run as FA4's local window with
# a left bound no key reaches: (len_kv, P - 1 + len_kv) and (len_kv, 0), so one compiled kernel
# (per pass) serves both, and a first call compiles it once. `split_rows` finds P in the IR (a
# top-level `|` with a term kv_idx < P, or kv_idx <= P - 1) and proves both parts with flexfa's
# tile analysis, exactly: the masks `q_idx < P & (mask != kv_idx < P)` and `q_idx >= P & (mask !=
# kv_idx <= q_idx + len_kv - len_q)` must have no pair on the call's grid (`classify`, whose
# undecided tiles are evaluated pair by pair). Any mask of q_idx and kv_idx alone, without
# tensors, that passes the proof takes the split, whatever its form. The score_mod must not read
# q_idx: the second call's hooks see rows from 0 (the backend checks it). The backward runs both
# parts' backwards and adds the first part's dK and dV into the second's.
@dataclasses.dataclass(frozen=True)
class RowSplit:
    """A mask proven to be two native masks by rows (Note [Prefix masks as two native calls]):
    rows [0, rows) against keys [0, keys) under `first`, rows [rows, len_q) against every key
    under `second`."""

    rows: int
    keys: int
    first: MaskLowering
    second: MaskLowering


def split_rows(mask: TracedMod | None, len_q: int, len_kv: int) -> RowSplit | None:
    """The split of Note [Prefix masks as two native calls] where it is proven, else None.

    >>> from flexfa.frontend.trace import trace_mask_mod
    >>> from flexfa import masks
    >>> split = split_rows(trace_mask_mod(masks.prefix_lm(100)), 300, 300)
    >>> split.rows, split.keys, split.second.fa4_kwargs()
    (100, 100, {'window_size_left': 300, 'window_size_right': 0})
    >>> split_rows(trace_mask_mod(masks.causal), 300, 300) is None
    True
    """
    if mask is None or mask.captures or mask.variables - {"q_idx", "kv_idx"}:
        return None
    return _split_rows(mask, len_q, len_kv)


@functools.lru_cache(maxsize=256)
def _split_rows(mask: TracedMod, len_q: int, len_kv: int) -> RowSplit | None:
    prefix = _prefix_length(mask)
    if prefix is None or not 0 < prefix < min(len_q, len_kv) or len_kv < len_q:
        return None
    q, kv = build.var("q_idx"), build.var("kv_idx")
    first = build.binary(Op.LT, kv, build.const(prefix))
    # FA4's causal mask of the rows from `prefix` on, in the call's own positions
    second = build.binary(Op.LE, kv, build.add(q, build.const(len_kv - len_q)))
    rows_first = build.binary(Op.LT, q, build.const(prefix))
    differs_first = build.binary(Op.AND, rows_first, build.binary(Op.NE, mask.output, first))
    differs_second = build.binary(
        Op.AND,
        build.unary(Op.NOT, rows_first),
        build.binary(Op.NE, mask.output, second),
    )
    grid = TileGrid(1, 1, len_q, len_kv, BlockSize(128, 128), torch.device("cpu"))
    for name, node in (("first", differs_first), ("second", differs_second)):
        differs = TracedMod(
            kind="mask_mod", name=f"{mask.name}_{name}_differs", output=node, captures=(),
            tensors=(), fn=_inner_has_no_function,
        )  # fmt: skip
        if bool((classify(differs, grid).states != int(TileState.EMPTY)).any()):
            return None
    left = len_kv  # no key is that far left of its row
    return RowSplit(
        rows=prefix,
        keys=prefix,
        first=MaskLowering("window", left, prefix - 1 + len_kv, reason="rows before the prefix"),
        second=MaskLowering("window", left, 0, reason="causal rows from the prefix on"),
    )


def _prefix_length(mask: TracedMod) -> int | None:
    """P of a top-level term kv_idx < P (or kv_idx <= P - 1) of a `|`."""
    if mask.output.op is not Op.OR:
        return None
    for term in _terms(mask.output, Op.OR):
        if term.op not in (Op.LT, Op.LE):
            continue
        a, b = term.srcs
        if _var(a) == "kv_idx" and b.op is Op.CONST and isinstance(b.arg, int):
            return b.arg if term.op is Op.LT else b.arg + 1
    return None
