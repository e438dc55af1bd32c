"""`AttentionSpec`: everything a backend needs to know about one attention call, validated."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from flexfa.blockmask.block_mask import BlockMask
from flexfa.frontend.trace import TracedMod

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: K/V may hold one of these with a query of any supported dtype (Note [fp8 K/V]).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclasses.dataclass(frozen=True, eq=False)
class PagedKV:
    """The page table of one call, validated: what kernels need besides the pools."""

    page_table: torch.Tensor  # (B, max_pages) int32
    kv_lens: torch.Tensor  # (B,) int32
    page_size: int
    num_pages: int

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    @property
    def capacity(self) -> int:
        """The logical KV length of the call: max_pages * page_size."""
        return self.max_pages * self.page_size

    def gather(self, pages: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """pages' keys at logical positions `cols` (int64 [n]) of every sequence: [B, Hkv, n, d].

        Positions at or past a sequence's length read page 0 (callers mask them)."""
        table = self.page_table[:, cols // self.page_size].long()  # [B, n]
        live = cols[None, :] < self.kv_lens[:, None]
        table = torch.where(live, table, 0)
        return pages[table, :, (cols % self.page_size)[None, :]].permute(0, 2, 1, 3)

    def in_length(self, cols: torch.Tensor) -> torch.Tensor:
        """Bool [B, 1, 1, n]: which of the logical positions `cols` are keys of each sequence."""
        return (cols[None, :] < self.kv_lens[:, None].long())[:, None, None, :]


@dataclasses.dataclass(frozen=True, eq=False)
class PackedSequences:
    """A packed call's sequences and its user's own mods, traced (`AttentionSpec.packed`), for
    backends with a variable-length path of their own (Note [Packed calls on FA4's varlen path]
    in flexfa/codegen/cute/backend.py)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    lens_q: tuple[int, ...]
    lens_kv: tuple[int, ...]
    score_mod: TracedMod | None = None
    mask: TracedMod | None = None

    @property
    def max_len_q(self) -> int:
        return max(self.lens_q)

    @property
    def max_len_kv(self) -> int:
        return max(self.lens_kv)

    @functools.cached_property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """The distinct (len_q, len_kv) of the sequences with queries and keys, longest first."""
        pairs = {(a, b) for a, b in zip(self.lens_q, self.lens_kv) if a and b}
        return tuple(sorted(pairs, key=lambda p: (-(p[0] + p[1]), p)))

    @functools.cached_property
    def one_sided(self) -> tuple[int, ...]:
        """The sequences with queries and no keys, or keys and no queries."""
        return tuple(
            s for s, (a, b) in enumerate(zip(self.lens_q, self.lens_kv)) if bool(a) != bool(b)
        )


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionSpec:
    """Shapes, types, mods and options of one call. Built by `flexfa.api` after validation.

    Layout: q (batch, heads_q, len_q, head_dim), k (batch_kv, heads_kv, len_kv, head_dim),
    v (batch_kv, heads_kv, len_kv, head_dim_v). Query head h reads KV head h // group_size; with
    batch_kv 1 every query batch element reads the one K/V (Note [K/V batch broadcast]).
    """

    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_kv: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    device: torch.device
    scale: float
    score_mod: TracedMod | None
    block_mask: BlockMask
    needs_grad: bool
    deterministic: bool = False
    kernel_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    batch_kv: int = 0  # 0: the same as `batch`
    #: K and V are page pools read through this page table (flexfa/paged.py); len_kv is then the
    #: table's capacity, max_pages * page_size.
    paged: PagedKV | None = None
    #: Which captured tensors of the score_mod get gradients, when the tensors themselves cannot say
    #: (inside a torch.library op they do not require grad); None: those that require grad.
    capture_grads: frozenset[int] | None = None
    #: Also return the row max of the modified scores (`return_aux=AuxRequest(max_scores=True)`).
    max_scores: bool = False
    #: K's and V's dtypes: `dtype` (q's) or a float8 dtype (Note [fp8 K/V]); None: q's.
    k_dtype: torch.dtype | None = None
    v_dtype: torch.dtype | None = None
    #: A packed call (cu_seqlens): its sequences and the user's own mods, for backends with a
    #: variable-length path of their own; `score_mod` and the mask above are the rewritten mods
    #: of the concatenation (Note [Packed batches as mods] in flexfa/varlen.py), which every
    #: backend can run.
    packed: PackedSequences | None = None

    def __post_init__(self) -> None:
        for name in ("k_dtype", "v_dtype"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.dtype)
            elif getattr(self, name) not in (self.dtype, *FP8_DTYPES):
                raise ValueError(
                    f"{name} must be q's dtype or a float8 dtype, got {getattr(self, name)}"
                )
        if self.batch_kv == 0:
            object.__setattr__(self, "batch_kv", self.batch)
        if self.batch_kv not in (1, self.batch):
            raise ValueError(f"batch_kv ({self.batch_kv}) must be 1 or batch ({self.batch})")
        if self.heads_q % self.heads_kv:
            raise ValueError(
                f"heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv})"
            )

    @property
    def kv_fp8(self) -> bool:
        """Whether K or V is stored in a float8 dtype (Note [fp8 K/V])."""
        return self.k_dtype in FP8_DTYPES or self.v_dtype in FP8_DTYPES

    @property
    def dtype_name(self) -> str:
        """q's dtype, and K's and V's where they differ from it: the dtype part of kernel keys and
        labels, e.g. "bfloat16" or "bfloat16, k float8_e4m3fn, v float8_e4m3fn"."""
        name = _short(self.dtype)
        if self.kv_fp8:
            name += f", k {_short(self.k_dtype)}, v {_short(self.v_dtype)}"
        return name

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def kv_broadcast(self) -> bool:
        """Whether one K/V batch element serves every query batch element."""
        return self.batch_kv != self.batch

    def kv_strides(self, t: torch.Tensor) -> tuple[int, ...]:
        """K/V strides as kernels indexed by the query's batch read them: a broadcast K/V
        (Note [K/V batch broadcast]) has batch stride 0."""
        return (0 if self.kv_broadcast else t.stride(0), *t.stride()[1:])

    @property
    def mask(self) -> TracedMod:
        return self.block_mask.mask

    @property
    def score_grad_slots(self) -> frozenset[int]:
        """Captured tensors of the score_mod whose gradients the backward must compute."""
        if self.score_mod is None or not self.needs_grad:
            return frozenset()
        if self.capture_grads is not None:
            return self.capture_grads
        return self.score_mod.grad_slots()


def validate_qkv(q: object, k: object, v: object, *, enable_gqa: bool) -> QKVShape:
    """Check q, k, v; returns (B, Hq, Hkv, Lq, Lkv, E, Ev). Raises ValueError/TypeError naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(
                f"{name} must have 4 dims (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}"
            )
    assert (
        isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    )
    check_dtypes(q, k, v)
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}"
        )
    B, Hq, Lq, E = q.shape
    Bk, Hkv, Lkv, Ek = k.shape
    Bv, Hv, Lv, Ev = v.shape
    if Bk != Bv or Bk not in (1, B):
        raise ValueError(
            f"batch sizes differ: q has {B}, k has {Bk}, v has {Bv}; k and v must share a batch "
            f"size, equal to q's or 1 (one K/V broadcast to every query batch element)"
        )
    if Ek != E:
        raise ValueError(f"k's head dim ({Ek}) must equal q's ({E})")
    if Hv != Hkv or Lv != Lkv:
        raise ValueError(
            f"k and v must have the same heads and length, got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    for name, n in (
        ("q's length", Lq),
        ("k's length", Lkv),
        ("the number of heads", Hq),
        ("the batch size", B),
    ):
        if n < 1:
            raise ValueError(f"{name} must be at least 1")
    if E < 8 or Ev < 8:
        raise ValueError(f"head dims must be at least 8, got E={E} for q/k and Ev={Ev} for v")
    if Hq != Hkv:
        if not enable_gqa:
            raise ValueError(
                f"q has {Hq} heads but k/v have {Hkv}; pass enable_gqa=True for grouped-query attention"
            )
        if Hq % Hkv:
            raise ValueError(
                f"with enable_gqa=True, q's heads ({Hq}) must be a multiple of k/v's heads ({Hkv})"
            )
    return B, Hq, Hkv, Lq, Lkv, E, Ev


def check_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: str = "k and v") -> None:
    """Raise TypeError unless q has a supported dtype and k and v each have q's dtype or a float8
    dtype (Note [fp8 K/V]). `kv` names k and v in messages ("k_pages and v_pages" for pools)."""
    k_name, v_name = kv.split(" and ")
    expected = "expected one of float16, bfloat16, float32, float64"
    for name, t in (("q", q), (k_name, k), (v_name, v)):
        if t.dtype in SUPPORTED_DTYPES or (name != "q" and t.dtype in FP8_DTYPES):
            continue
        if name == "q":
            fp8 = " (float8 is supported for k and v only)" if t.dtype in FP8_DTYPES else ""
            raise TypeError(f"q has dtype {t.dtype}; {expected}{fp8}")
        raise TypeError(
            f"{name} has dtype {t.dtype}; {expected} (q's), or float8_e4m3fn or float8_e5m2"
        )
    if any(t.dtype != q.dtype and t.dtype not in FP8_DTYPES for t in (k, v)):
        raise TypeError(
            f"q, {kv} must share a dtype, got {q.dtype}, {k.dtype} and {v.dtype}; {kv} may "
            "also be float8 (torch.float8_e4m3fn, torch.float8_e5m2), read as fp8 and upcast to "
            "q's dtype in the kernel"
        )


# Note [fp8 K/V]
# As torch FlexAttention allows, k and v may be float8 (float8_e4m3fn or float8_e5m2, each
# independently) while q is float16, bfloat16, float32 or float64: an fp8 KV cache, half the bytes
# of a bf16 one. The result is what torch's eager flex_attention computes, which is attention on
# K/V upcast to q's dtype: every fp8 value is exactly representable in float16 and bfloat16, so
# the upcast loses nothing. Scores and the softmax are computed in float32 as for any call, the
# output has q's dtype. Kernels read K/V tiles as fp8 from memory and convert them in registers
# (the Triton kernels) or one step of columns at a time (the tiled backend); no upcast copy of K/V
# is ever made. Scales (per tensor or per head) are not arguments: as in torch, a score_mod
# applies them through a captured tensor (`score * k_scale[h]`); a V scale multiplies the output.
# Any strides are read; on Hopper an fp8 V stored keys-contiguous is the fast layout for decoding
# (its tiles reach the second product without byte-wise shared-memory reads: 1.82-1.88x the bf16
# cache's tokens/s on an H200 against 1.60-1.66x keys-outer, docs/performance.md), so
# docs/semantics.md recommends it; flexfa never copies K/V into another layout.
# Gradients: torch refuses a backward with mixed dtypes, and so does flexfa, when the backward is
# asked for (flexfa.api: the forward runs without autograd and the outputs carry a grad_fn that
# raises). Other mixed dtypes (a bfloat16 k with a float16 q, a float32 v with a bfloat16 q) are
# refused, although torch's eager path takes them (it computes q @ k^T in float32): a kernel would
# have to round one operand to the other's dtype or multiply in float32. Inside torch.compile and
# context parallelism fp8 K/V are not supported yet.


# Note [K/V batch broadcast]
# As in torch FlexAttention, k and v may have batch size 1 while q has B: every query batch element
# attends to the same keys (a shared prefix, one KV cache for many queries). Nothing is expanded:
# kernels read K/V with batch stride 0, and the backward sums dK/dV over the query batch (the tiled
# backend reduces over the batch dim; the Triton dK/dV kernel walks every query batch element of
# its K/V tile, like the query heads of a GQA group, so the sum stays in registers). score_mod and
# mask_mod see the query's batch index b. torch additionally requires a block mask of batch B in
# this case; flexfa also accepts one of batch 1 (or none).


QKVShape = tuple[int, int, int, int, int, int, int]


def spec_from_shape(shape: QKVShape, q: torch.Tensor, **fields: Any) -> AttentionSpec:
    """The AttentionSpec of a call whose q, k, v `validate_qkv` (or `validate_paged`) checked.

    `shape` is what the check returned, (B, Hq, Hkv, Lq, Lkv, E, Ev); dtype and device come from
    `q`; `fields` gives the rest (scale, score_mod, block_mask, needs_grad, ...). The eager and the
    compiled paths both build their specs here.
    """
    B, Hq, Hkv, Lq, Lkv, E, Ev = shape
    return AttentionSpec(
        batch=B,
        heads_q=Hq,
        heads_kv=Hkv,
        len_q=Lq,
        len_kv=Lkv,
        head_dim=E,
        head_dim_v=Ev,
        dtype=q.dtype,
        device=q.device,
        **fields,
    )


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite number or None, got {scale!r}")
    return float(scale)
