"""Running one call through FlashAttention-4 with generated hooks: plan, module, autograd.

`run(spec, q, k, v)` lowers the mask (plan.py), loads the generated module (module.py) and runs
FA4's forward, and later its backward, through `_Fa4Function`. The "fa4" backend
(flexfa/backends/fa4.py) decides whether a call can come here.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import weakref

import torch

from flexfa.blockmask.block_mask import BlockMask
from flexfa.codegen.cute import jitcache, launch, module, sparse
from flexfa.codegen.cute.launch import Hooks
from flexfa.codegen.cute.plan import (
    DocumentMask,
    MaskLowering,
    document_mask,
    lower_mask,
    lower_packed_mask,
    split_rows,
)
from flexfa.config import config
from flexfa.frontend.trace import TracedMod
from flexfa.layout import empty_like_query
from flexfa.spec import AttentionSpec


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
    """What the forward and backward of one call share."""

    scale: float
    lowering: MaskLowering
    bwd_lowering: MaskLowering
    hooks: Hooks
    mask_tensors: tuple[torch.Tensor, ...]
    grad_slots: tuple[int, ...]
    deterministic: bool
    fwd_sparse: sparse.SparseLists | None = None
    bwd_sparse: sparse.SparseLists | None = None
    bwd_kv_group: int = 1  # > 1: the backward runs on K/V repeated per query head
    bwd_head_dim: int | None = None  # the backward's zero-padded head dim (Note [Padded backward])
    scalars: tuple[float, ...] = ()  # the score_mod's lifted scalars, FA4's aux_scalars
    #: Packed sequences on FA4's varlen kernels (Note [Packed calls on FA4's varlen path]).
    sequences: launch.Sequences | None = None
    #: The documents of each batch row, one varlen call per row (Note [Document masks on FA4's
    #: varlen kernels] in plan.py).
    rows: tuple[launch.Sequences, ...] | None = None


@functools.lru_cache(maxsize=256)
def _cached_lowering(mask: TracedMod | None, len_q: int, len_kv: int) -> MaskLowering:
    return lower_mask(mask, len_q, len_kv)


def mask_lowering(mask: TracedMod | None, len_q: int, len_kv: int) -> MaskLowering:
    """`lower_mask`, cached per (mask IR, lengths) for masks without captured tensors (a mask
    that reads tensors is proven again for each call: its tensors may differ)."""
    if mask is not None and mask.captures:
        return lower_mask(mask, len_q, len_kv)
    return _cached_lowering(mask, len_q, len_kv)


_hooks: dict[tuple, Hooks] = {}


def hooks_for(score: TracedMod | None, mask: TracedMod | None, grad_slots: frozenset[int]) -> Hooks:
    """The generated hooks of these mods (loads the generated module: imports cutlass), kept per
    (mods' keys, gradient slots) so that a repeated call does no more than a dict lookup."""
    from flexfa.codegen.cute.emit import AuxLayout

    key = (score.key if score else None, mask.key if mask else None, tuple(sorted(grad_slots)))
    hooks = _hooks.get(key)
    if hooks is None:
        mkey, mod = module.load_module(score, mask, grad_slots)
        for name in ("SCORE_MOD", "SCORE_MOD_BWD", "MASK_MOD"):
            jitcache.tag(getattr(mod, name), mkey.digest, name)
        aux = AuxLayout.of(score, mask, grad_slots)
        hooks = Hooks(mod.SCORE_MOD, mod.SCORE_MOD_BWD, mod.MASK_MOD, aux)
        _hooks[key] = hooks
    return hooks


# Note [GQA in FA4's score_mod backward]
# FA4's sm90 backward walks one query head per work tile (it has no packed-GQA backward), yet it
# hands its score_mod and score_mod_bwd the indices of packed GQA: q_idx // G and head
# h * G + q_idx % G for G query heads per K/V head. The hooks then compute the scores of other
# positions and heads, and the gradients are wrong (on the H200: dQ, dK, dV and the captured
# tensors' gradients off by O(1) for a relative-position bias with G = 2, at head dims 64 and
# 128). FA4's own score_mod backward tests use no GQA. So the backward of a call with a score_mod
# and G > 1 runs FA4 as multi-head attention: K and V repeated per query head (a copy, G times
# their size, for the backward only), and dK, dV summed over each group in float32. Without a
# score_mod the native GQA backward is used; the forward is right with GQA and keeps it.

# Note [Backward with a score_mod]
# In flexfa's first GPU run, FA4's sm90 backward with a score_mod gave wrong dQ, dK and dV in
# cases whose tile had 64 query rows; for a while flexfa forced FA4's 80-row tiles there. Those
# failures had two other causes. GQA (Note [GQA in FA4's score_mod backward]), and head dims: on
# the H200 FA4's backward gave wrong dQ at head dims 72, 80, 104 and 112, with a score_mod and
# without one (FA4's own causal backward at head dim 80 included), and was right at 64, 88, 96,
# 120, 128, 192 and 256 (Note [Padded backward]). With GQA handled by repeated K/V, FA4's own
# tiles - 64 rows at head dims 65..128 under causal and window masks - matched the float64
# reference for ALiBi, learnable relative-position tables, a learnable per-key bias and
# temperature, and softcap (tests/codegen/cute/test_gpu.py), and ran ALiBi + causal
# forward+backward at 469 TFLOP/s against 396 on the 80-row tiles. So the backward takes FA4's
# tiles as FA4 chooses them, on the native masks, with block-sparse lists wherever they are wired.

# Note [Padded backward]
# FA4's sm90 backward is trusted at the head dims flexfa's GPU tests verified
# (`flexfa.codegen.cute.plan.SM90_BACKWARD_HEAD_DIMS`: 64, 96, 128, 192, 256, head_dim == head_dim_v).
# Elsewhere it failed: wrong dQ at head dims 72, 80, 104 and 112; at head_dim != head_dim_v a
# launch error (head_dim < head_dim_v), wrong dQ and dK (head_dim > head_dim_v, with a softcap),
# and an assertion with GQA. So such a backward runs at the next verified head dim: q and k padded
# with zeros to it (scores unchanged: the extra products are 0 * 0, and the scale stays the call's
# own), v, the output and dO likewise (their extra columns are 0, so delta = rowsum(dO * O) is
# unchanged), and dQ, dK, dV cut back. The result is exactly the unpadded one; the cost is the
# copies and the FLOPs of the padding, in the backward only - the forward was right at every head
# dim and runs unpadded. On the H200 the padded backward matched the float64 reference at head
# dims 80, 72 (softcap), 128/64 (softcap) and 64/128 (tests/codegen/cute/test_gpu.py), and the
# padding itself is checked on the CPU with a reference standing in for FA4
# (tests/codegen/cute/test_backend.py).


def plan_call(
    score: TracedMod | None,
    mask: TracedMod | None,
    *,
    len_q: int,
    len_kv: int,
    needs_grad: bool,
    scale: float,
    deterministic: bool = False,
    block_mask: BlockMask | None = None,
    group_size: int = 1,
    arch_major: int = 9,
    split: bool = True,
) -> Call:
    """Mask lowerings of both passes and the generated hooks for one call's mods. With
    `block_mask`, passes that use the mask_mod also get FA4's block-sparse lists (Note
    [Block-sparse lists for FA4]; the caller checked `sparse.why_not_sparse`). `split`: a mask
    proven to be two native masks by rows may run as two calls (Note [Prefix masks as two native
    calls] in plan.py)."""
    lowering = mask_lowering(mask, len_q, len_kv)
    if split and not lowering.native and (score is None or "q_idx" not in score.variables):
        rows = split_rows(mask, len_q, len_kv)
        if rows is not None:
            reason = (
                f"proven: native masks by rows, rows below {rows.rows} against keys below "
                f"{rows.keys}, causal rows from there on (two calls of FA4's window kernel)"
            )
            lowering = MaskLowering("rows", reason=reason, split=rows)
    bwd_lowering = lowering  # the same in both passes
    grad_slots = score.grad_slots() if score is not None and needs_grad else frozenset()
    # A mask used natively in both passes needs no mask_mod: it stays out of the module (and of
    # FA4's compile key).
    uses_mask_mod = mask is not None and not (lowering.native and bwd_lowering.native)
    hooks = hooks_for(score, mask if uses_mask_mod else None, grad_slots)
    fwd_sparse = bwd_sparse = None
    if block_mask is not None and mask is not None:
        if not lowering.native:
            fwd_sparse = sparse.forward_lists(block_mask, arch_major)
        # FA4's deterministic block-sparse backward needs write orders flexfa does not build.
        if needs_grad and not bwd_lowering.native and not deterministic:
            bwd_sparse = sparse.backward_lists(block_mask, arch_major)
    return Call(
        scale=scale,
        lowering=lowering,
        bwd_lowering=bwd_lowering,
        hooks=hooks,
        mask_tensors=tuple(mask.tensors) if uses_mask_mod else (),
        grad_slots=tuple(sorted(grad_slots)),
        deterministic=deterministic,
        fwd_sparse=fwd_sparse,
        bwd_sparse=bwd_sparse,
        bwd_kv_group=group_size if needs_grad and score is not None else 1,
        scalars=tuple(score.scalar_values) if score is not None else (),
    )


# Note [Packed calls on FA4's varlen path]
# A packed call (cu_seqlens_q, cu_seqlens_kv) runs on every backend as one call on the
# concatenation with rewritten mods (Note [Packed batches as mods] in flexfa/varlen.py), which
# reaches FA4 as a document mask and its block-sparse lists: on the H200 (bench/varlen.py, causal
# within 8 sequences of 512-8192 tokens) that ran at 0.83x forward and 0.89x forward+backward of
# FA4's own flash_attn_varlen_func(causal=True). FA4's varlen kernels do the same work without the
# document mask: a tile never crosses a sequence, and each sequence gets FA4's native mask. Their
# hooks see what the user's mods expect (FA4's seqlen_info and tile schedulers): `b` is the
# sequence index and q_idx, kv_idx count from the sequence's start (the score_mod's indices are
# the tile's offsets within its sequence; positions past a sequence's end reach the hooks as
# they are, and FA4 masks them: Note [Captured tensors by address] in emit.py). So the fa4 backend
# runs a packed call there, with the user's own mods as traced (`AttentionSpec.packed`), not the
# rewritten ones, forward and backward, captured-tensor gradients as for any call, when all of
# these hold:
#   - the inner mask is proven to be one native mask of FA4's for every sequence (no mask,
#     causal, a window: Note [Native masks per packed sequence] in plan.py): FA4's varlen
#     backward takes no block-sparse lists, so other masks stay on the concatenation;
#   - every sequence has queries and keys, or neither: a sequence with queries and no keys (FA4
#     would walk one key block before the sequence) or keys and no queries (the backward builds
#     divisors of the length 0) is a case FA4's kernels were not verified with here;
#   - sm90, where tests/codegen/cute/test_gpu_varlen.py checks it (sm100's varlen kernels are
#     other kernels, which nothing here runs);
#   - not `kernel_options={"block_sparse": ...}` (a choice about the concatenation's lists), and
#     not deterministic with a backward (FA4's deterministic varlen backward is not verified).
# Otherwise the concatenation runs as before, and `explain_backend` says which path a packed call
# takes and why. The path has run on the CPU only (its decisions, FA4's varlen kernels compiled for
# sm_90a with generated mods, and the plumbing against a float64 stand-in of FA4's varlen entry
# points), and on an H200 (tests/codegen/cute/test_gpu_varlen.py: output, LSE and gradients
# against float64, hooks that see sequences and relative positions). FLEXFA_FA4_VARLEN=0 keeps
# packed calls on the concatenation. The rest is as for single calls: GQA backward with a score_mod on repeated K/V,
# the padded backward, the generated hooks themselves (one module for a mod whether packed or not;
# FA4's compile key tells its varlen kernels apart, so Note [FA4 kernels on disk] needs nothing
# more). The host copy of the offsets that the proof and FA4's max_seqlen need is made once per
# offsets tensor state (`flexfa.varlen.packing`; none for offsets given on the host, Note
# [Offsets on the host] in flexfa/varlen.py); packed calls stay out of the call memo (Note
# [Repeated inference calls] in flexfa/api.py). Inside torch.compile packed calls run the
# concatenation (flexfa/compiled.py builds specs without `packed`).


def packed_lowering(spec: AttentionSpec) -> MaskLowering | None:
    """How a packed call reaches FA4 (Note [Packed calls on FA4's varlen path]): FA4's varlen
    kernels with this native mask, or, with kind "mask_mod", the concatenated call, and why; None
    for calls that are not packed."""
    packed = spec.packed
    if packed is None:
        return None
    if not config.fa4_varlen:
        return MaskLowering(
            "mask_mod",
            reason="FLEXFA_FA4_VARLEN=0 keeps packed calls off FA4's varlen kernels",
        )
    if "block_sparse" in spec.kernel_options:
        return MaskLowering(
            "mask_mod", reason="kernel_options['block_sparse'] asks for the concatenation's lists"
        )
    if spec.deterministic and spec.needs_grad:
        return MaskLowering(
            "mask_mod",
            reason="deterministic=True: FA4's deterministic varlen backward is not verified",
        )
    if spec.device.type == "cuda" and _arch_major(spec.device) != 9:
        return MaskLowering("mask_mod", reason="FA4's varlen kernels are verified on sm90 only")
    if packed.one_sided:
        s = packed.one_sided[0]
        return MaskLowering(
            "mask_mod",
            reason=f"sequence {s} has {packed.lens_q[s]} queries and {packed.lens_kv[s]} keys "
            "(FA4's varlen kernels are verified with sequences that have both, or neither)",
        )
    return lower_packed_mask(packed.mask, packed.shapes)


_NATIVE_NAMES = {"full": "no mask", "causal": "its causal mask", "window": "its window"}


def describe_packed(spec: AttentionSpec) -> str:
    """The path of a packed call, for `explain_backend` (Note [Packed calls on FA4's varlen
    path])."""
    lowering = packed_lowering(spec)
    assert lowering is not None, "not a packed call"
    if lowering.native:
        mask = _NATIVE_NAMES[lowering.kind]
        return (
            f"packed sequences on FA4's varlen kernels with {mask}, the mods unrewritten "
            f"({lowering.reason})"
        )
    return (
        "packed sequences as one call on the concatenation with a document mask (not FA4's "
        f"varlen kernels: {lowering.reason})"
    )


def plan_packed_call(
    score: TracedMod | None,
    lowering: MaskLowering,
    sequences: launch.Sequences | None,
    *,
    rows: tuple[launch.Sequences, ...] | None = None,
    needs_grad: bool,
    scale: float,
    group_size: int = 1,
) -> Call:
    """The call of FA4's varlen kernels for a packed call whose mask `lowering` is native, with
    the user's score_mod `score` (Note [Packed calls on FA4's varlen path]); with `rows` instead
    of `sequences`, one varlen call per batch row (Note [Document masks on FA4's varlen kernels]
    in plan.py)."""
    assert lowering.native, lowering
    assert (sequences is None) != (rows is None), "sequences or rows"
    grad_slots = score.grad_slots() if score is not None and needs_grad else frozenset()
    return Call(
        scale=scale,
        lowering=lowering,
        bwd_lowering=lowering,
        hooks=hooks_for(score, None, grad_slots),
        mask_tensors=(),
        grad_slots=tuple(sorted(grad_slots)),
        deterministic=False,
        bwd_kv_group=group_size if needs_grad and score is not None else 1,
        scalars=tuple(score.scalar_values) if score is not None else (),
        sequences=sequences,
        rows=rows,
    )


# The most batch rows a document mask runs as one varlen call each.
_MAX_DOCUMENT_ROWS = 16
_documents: dict[tuple, tuple] = {}  # (ids id, version, by_batch, length, device) -> (ref, rows)
_DOCUMENTS_KEPT = 16


def document_lowering(
    spec: AttentionSpec,
) -> tuple[MaskLowering, tuple[launch.Sequences, ...] | None] | None:
    """How a call with a document mask reaches FA4 (Note [Document masks on FA4's varlen kernels]
    in plan.py): a native lowering and the documents of each batch row, or a mask_mod lowering
    saying why not, with None; None for calls whose mask is not a document mask. Copies the ids
    to the host once per ids tensor state."""
    if spec.packed is not None or spec.mask.is_trivially_true:
        return None
    doc = document_mask(spec.mask)
    if doc is None:
        return None
    not_varlen = "a document mask, not on FA4's varlen kernels: "
    why = _why_not_documents(spec, doc)
    if why is not None:
        return MaskLowering("mask_mod", reason=not_varlen + why), None
    ids = spec.mask.tensors[doc.ids_slot]
    rows = _document_rows(ids, doc.by_batch, spec.len_q)
    if isinstance(rows, str):
        return MaskLowering("mask_mod", reason=not_varlen + rows), None
    shapes = sorted({(n, n) for _, lens in rows for n in lens}, key=lambda p: -p[0])
    lowering = lower_packed_mask(doc.inner, shapes)
    if not lowering.native:
        reason = f"{not_varlen}inside the documents, {lowering.reason}"
        return MaskLowering("mask_mod", reason=reason), None
    lowering = dataclasses.replace(
        lowering, reason=f"a document mask on FA4's varlen kernels ({lowering.reason})"
    )
    if not doc.by_batch:
        rows = rows * spec.batch
    return lowering, tuple(seqs for seqs, _ in rows)


def _why_not_documents(spec: AttentionSpec, doc: DocumentMask) -> str | None:
    """Why a call with this document mask cannot run on FA4's varlen kernels, before its ids are
    read; None when it may."""
    if not config.fa4_documents:
        return "FLEXFA_FA4_DOCUMENTS is not set (the path is opt-in: docs/cute.md)"
    if not config.fa4_varlen:
        return "FLEXFA_FA4_VARLEN=0"
    if "block_sparse" in spec.kernel_options:
        return "kernel_options['block_sparse'] asks for the mask's block-sparse lists"
    if spec.deterministic and spec.needs_grad:
        return "deterministic=True: FA4's deterministic varlen backward is not verified"
    if spec.device.type != "cuda":
        return "not on a GPU"
    if _arch_major(spec.device) != 9:
        return "FA4's varlen kernels are verified on sm90 only"
    if torch.cuda.is_current_stream_capturing():
        return "the ids are read on the host, which a CUDA graph capture does not allow"
    if spec.len_q != spec.len_kv:
        return f"{spec.len_q} queries and {spec.len_kv} keys (documents need the same positions)"
    if spec.batch > _MAX_DOCUMENT_ROWS:
        return (
            f"a batch of {spec.batch} rows (one varlen call per row; at most {_MAX_DOCUMENT_ROWS})"
        )
    score = spec.score_mod
    if score is not None and score.variables & {"b", "q_idx", "kv_idx"}:
        return "the score_mod reads b, q_idx or kv_idx, which the varlen kernels give per document"
    ids = spec.mask.tensors[doc.ids_slot]
    if doc.by_batch and (ids.ndim != 2 or ids.shape[0] != spec.batch):
        return (
            f"ids of shape {tuple(ids.shape)} read as ids[b, position] in a batch of {spec.batch}"
        )
    if ids.shape[-1] < spec.len_q:
        return f"ids of shape {tuple(ids.shape)} for {spec.len_q} positions"
    return None


def _document_rows(
    ids: torch.Tensor, by_batch: bool, length: int
) -> tuple[tuple[launch.Sequences, tuple[int, ...]], ...] | str:
    """Per row of `ids` (one row if not `by_batch`), its documents as FA4's varlen offsets and
    their lengths; or why the ids are not documents (an id that is not one run of positions).
    One host copy per ids tensor state, kept."""
    key = (id(ids), ids._version, by_batch, length, ids.device)
    hit = _documents.get(key)
    if hit is not None and hit[0]() is ids:
        return hit[1]
    rows = (ids if by_batch else ids.unsqueeze(0))[:, :length]
    host = rows.detach().to("cpu", torch.int64)
    if bool((host[:, 1:] < host[:, :-1]).any()):
        found = "the ids decrease somewhere along a row (each document must be one run)"
    else:
        found = []
        for row in host:
            starts = torch.nonzero(row[1:] != row[:-1]).flatten() + 1
            offsets = [0, *starts.tolist(), length]
            lens = tuple(b - a for a, b in itertools.pairwise(offsets))
            cu = torch.tensor(offsets, dtype=torch.int32).to(ids.device)
            found.append((launch.Sequences(cu, cu, max(lens), max(lens)), lens))
        found = tuple(found)
    if len(_documents) >= _DOCUMENTS_KEPT:
        _documents.clear()
    _documents[key] = (weakref.ref(ids), found)
    return found


def score_mod_of(spec: AttentionSpec, call: Call) -> TracedMod | None:
    """The score_mod whose hooks `call` runs: the user's own on FA4's varlen kernels, else the
    spec's (for a packed call, the rewritten one)."""
    if call.sequences is not None:
        assert spec.packed is not None
        return spec.packed.score_mod
    return spec.score_mod


def uses_block_sparse(spec: AttentionSpec) -> bool:
    """Whether the call passes its BlockMask as FA4's block-sparse lists: `kernel_options=
    {"block_sparse": ...}` when given, else wherever the lists are wired (Note [Block-sparse lists
    for FA4]); they matter only for masks that are not native."""
    option = spec.kernel_options.get("block_sparse")
    if option is not None:
        return bool(option)
    if spec.device.type != "cuda":
        return False
    major = _arch_major(spec.device)
    why = sparse.why_not_sparse(spec.block_mask, spec.head_dim, spec.head_dim_v, major)
    return why is None


_majors: dict[torch.device, tuple] = {}


def _arch_major(device: torch.device) -> int | None:
    """The compute capability's major number of a CUDA device (None elsewhere), asked of torch
    once per device (again if torch's function was replaced, as tests do)."""
    ask = torch.cuda.get_device_capability
    hit = _majors.get(device)
    if hit is not None and hit[0] is ask:
        return hit[1]
    major = ask(device)[0] if device.type == "cuda" else None
    _majors[device] = (ask, major)
    return major


def make_call(spec: AttentionSpec, *, varlen: bool = True) -> Call:
    """The planned FA4 call of `spec`; a packed call goes to FA4's varlen kernels where Note
    [Packed calls on FA4's varlen path] allows (`varlen=False`: never, for callers that pass the
    spec's own score_mod tensors and gradient slots)."""
    from flexfa.codegen.cute.plan import backward_head_dim

    lowering = packed_lowering(spec) if varlen else None
    varlen_call = None  # (the user's score_mod, the native mask, sequences, rows)
    if lowering is not None and lowering.native:
        packed = spec.packed
        assert packed is not None
        sequences = launch.Sequences(
            packed.cu_seqlens_q, packed.cu_seqlens_kv, packed.max_len_q, packed.max_len_kv
        )
        varlen_call = (packed.score_mod, lowering, sequences, None)
    elif (documents := document_lowering(spec)) is not None and documents[0].native:
        varlen_call = (spec.score_mod, documents[0], None, documents[1])
    if varlen_call is not None:
        score, lowering, sequences, rows = varlen_call
        call = plan_packed_call(
            score,
            lowering,
            sequences,
            rows=rows,
            needs_grad=spec.needs_grad,
            scale=spec.scale,
            group_size=spec.group_size,
        )
    else:
        call = plan_call(
            spec.score_mod,
            None if spec.mask.is_trivially_true else spec.mask,
            len_q=spec.len_q,
            len_kv=spec.len_kv,
            needs_grad=spec.needs_grad,
            scale=spec.scale,
            deterministic=spec.deterministic,
            block_mask=spec.block_mask if uses_block_sparse(spec) else None,
            group_size=spec.group_size,
            arch_major=_arch_major(spec.device) or 9,
            split=_may_split(spec),
        )
    if not spec.needs_grad:
        return call
    padded = backward_head_dim(spec.head_dim, spec.head_dim_v, _arch_major(spec.device))
    return dataclasses.replace(call, bwd_head_dim=padded)


def describe_split(spec: AttentionSpec) -> str | None:
    """What `explain_backend` says of a call whose mask runs as two native calls by rows (Note
    [Prefix masks as two native calls] in plan.py); None for other calls."""
    mask = None if spec.mask.is_trivially_true else spec.mask
    if mask is None or mask_lowering(mask, spec.len_q, spec.len_kv).native:
        return None
    if split_rows(mask, spec.len_q, spec.len_kv) is None:
        return None
    if not _may_split(spec):
        return "a prefix mask proven native by rows, kept on block-sparse lists as asked"
    score = spec.score_mod
    if score is not None and "q_idx" in score.variables:
        return (
            "a prefix mask proven native by rows, kept as a mask_mod: the score_mod reads q_idx, "
            "which the second call would see from 0"
        )
    return "a prefix mask as two calls with FA4's native masks, split by rows"


def _may_split(spec: AttentionSpec) -> bool:
    """Whether a mask proven to be native by rows may run as two calls: not where the caller
    asks for block-sparse lists, nor for a BlockMask of the user's own block lists (whose empty
    tiles may exclude pairs the mask_mod allows)."""
    if spec.kernel_options.get("block_sparse"):
        return False
    bm = spec.block_mask
    return bm is None or bm.tiles_from_mask


def _pad_head_dim(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, dim - t.shape[-1]))


def forward(call: Call, q, k, v, score_tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4's forward for one planned call: (out [B, Hq, Lq, Ev] in q's stride order, lse)."""
    tensors = [launch.captured_tensor(t) for t in (*score_tensors, *call.mask_tensors)]
    B, Hq, Lq, _ = q.shape
    out = empty_like_query(q, (B, Hq, Lq, v.shape[-1]))  # Note [Output layout]
    if call.rows is not None:  # Note [Document masks on FA4's varlen kernels]
        lses = [
            launch.forward(
                q[b : b + 1], k[b : b + 1], v[b : b + 1], out=out[b : b + 1], scale=call.scale,
                lowering=call.lowering, hooks=call.hooks, tensors=tensors, scalars=call.scalars,
                sequences=seqs,
            )[1]
            for b, seqs in enumerate(call.rows)
        ]  # fmt: skip
        return out, torch.cat(lses)
    split = call.lowering.split
    if split is not None:  # Note [Prefix masks as two native calls] in plan.py
        rows, keys = split.rows, split.keys
        parts = (
            (slice(0, rows), slice(0, keys), split.first),
            (slice(rows, None), slice(None), split.second),
        )
        lses = [
            launch.forward(
                q[:, :, r], k[:, :, c], v[:, :, c], out=out[:, :, r], scale=call.scale,
                lowering=lowering, hooks=call.hooks, tensors=tensors, scalars=call.scalars,
            )[1]
            for r, c, lowering in parts
        ]  # fmt: skip
        return out, torch.cat(lses, dim=2)
    return launch.forward(
        q,
        k,
        v,
        out=out,
        scale=call.scale,
        lowering=call.lowering,
        hooks=call.hooks,
        tensors=tensors,
        block_sparse=call.fwd_sparse,
        scalars=call.scalars,
        sequences=call.sequences,
    )


def backward(
    call: Call, q, k, v, out, lse, dout, dlse, score_tensors
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """FA4's backward for one planned call: (dq, dk, dv, {slot: gradient of that captured tensor
    of the score_mod, in its dtype}) for every slot in `call.grad_slots`."""
    if dout is None:
        dout = torch.zeros_like(out)
    grads = [
        torch.zeros(score_tensors[s].shape, dtype=torch.float32, device=q.device)
        for s in call.grad_slots
    ]
    tensors = [launch.captured_tensor(t) for t in (*score_tensors, *call.mask_tensors)]
    tensors += [g.reshape(1) if g.ndim == 0 else g for g in grads]
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    if call.bwd_head_dim is not None:  # Note [Padded backward]
        q, k, v, out, dout = (_pad_head_dim(t, call.bwd_head_dim) for t in (q, k, v, out, dout))
    group = call.bwd_kv_group
    if group > 1:  # Note [GQA in FA4's score_mod backward]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if call.grad_slots and k.shape[1] != q.shape[1]:
        # The hooks sum a gradient whose index reads h over a warp (Note [Captured gradients in
        # the FA4 backward]): FA4's packed-GQA backward would hand one warp several heads.
        raise RuntimeError(
            f"fa4 backward with captured gradients needs as many K/V heads as query heads "
            f"(K/V repeated per query head), got {k.shape[1]} for {q.shape[1]}"
        )
    if call.rows is not None:  # Note [Document masks on FA4's varlen kernels]
        rows = [
            launch.backward(
                q[b : b + 1], k[b : b + 1], v[b : b + 1], out[b : b + 1], dout[b : b + 1],
                lse[b : b + 1], None if dlse is None else dlse[b : b + 1], scale=call.scale,
                lowering=call.bwd_lowering, hooks=call.hooks, tensors=tensors,
                deterministic=call.deterministic, scalars=call.scalars, sequences=seqs,
            )
            for b, seqs in enumerate(call.rows)
        ]  # fmt: skip
        dq, dk, dv = (torch.cat(g) for g in zip(*rows))
    elif call.bwd_lowering.split is not None:  # Note [Prefix masks as two native calls]
        split = call.bwd_lowering.split
        r, c = split.rows, split.keys
        (dq0, dk0, dv0), (dq1, dk, dv) = (
            launch.backward(
                q[:, :, rs], k[:, :, cs], v[:, :, cs], out[:, :, rs], dout[:, :, rs],
                lse[:, :, rs].contiguous(), None if dlse is None else dlse[:, :, rs].contiguous(),
                scale=call.scale, lowering=lowering, hooks=call.hooks, tensors=tensors,
                deterministic=call.deterministic, scalars=call.scalars,
            )
            for rs, cs, lowering in (
                (slice(0, r), slice(0, c), split.first),
                (slice(r, None), slice(None), split.second),
            )
        )  # fmt: skip
        dq = torch.cat([dq0, dq1], dim=2)
        dk[:, :, :c] += dk0
        dv[:, :, :c] += dv0
    else:
        dq, dk, dv = launch.backward(
            q,
            k,
            v,
            out,
            dout,
            lse,
            dlse,
            scale=call.scale,
            lowering=call.bwd_lowering,
            hooks=call.hooks,
            tensors=tensors,
            deterministic=call.deterministic,
            block_sparse=call.bwd_sparse,
            scalars=call.scalars,
            sequences=call.sequences,
        )
    if group > 1:
        dk, dv = (g.unflatten(1, (-1, group)).float().sum(2).to(g.dtype) for g in (dk, dv))
    if call.bwd_head_dim is not None:
        dq, dk, dv = dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim_v]
    captured = {s: g.to(score_tensors[s].dtype) for s, g in zip(call.grad_slots, grads)}
    return dq, dk, dv, captured


class _Fa4Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: Call, *score_tensors):
        out, lse = forward(call, q, k, v, score_tensors)
        ctx.save_for_backward(q, k, v, out, lse, *score_tensors)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *score_tensors = ctx.saved_tensors
        dq, dk, dv, captured = backward(ctx.call, q, k, v, out, lse, dout, dlse, score_tensors)
        return dq, dk, dv, None, *(captured.get(s) for s in range(len(score_tensors)))


# Note [Planned calls kept with their spec]
# A repeated inference call reuses its AttentionSpec (Note [Repeated inference calls] in
# flexfa/api.py), and its planned FA4 call is kept with it: the mask lowering, the generated hooks,
# the block lists and the arch depend on nothing the spec does not fix, except where a proof read
# a captured tensor's values, which may change in place between calls: a native lowering of a
# mask that reads tensors, and the documents of a document mask. Those calls are planned again
# each time. Without gradients the autograd Function is skipped too.


def run(spec: AttentionSpec, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [B, H, Lq, Ev] and natural-log LSE [B, H, Lq], both differentiable."""
    call = spec.__dict__.get("_fa4_call")
    if call is None:
        call = make_call(spec)
        mask = spec.mask
        if call.rows is None and not (call.lowering.native and mask.captures):
            spec.__dict__["_fa4_call"] = call  # Note [Planned calls kept with their spec]
    score = score_mod_of(spec, call)
    score_tensors = score.tensors if score is not None else ()
    if not spec.needs_grad:
        return forward(call, q, k, v, score_tensors)
    return _Fa4Function.apply(q, k, v, call, *score_tensors)
