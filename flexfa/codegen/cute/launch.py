"""Calls of FlashAttention-4's forward and backward with flexfa's generated hooks.

flexfa's layout is (batch, heads, len, dim); FA4's is (batch, len, heads, dim), and (total_len,
heads, dim) for packed sequences on its varlen path (flexfa's (1, heads, total_len, dim)). The
transposes below are views (FA4 reads any strides with a contiguous last dim), so no copy is made.
Outputs come back as views in flexfa's layout.

These functions import flash_attn; only the "fa4" backend and export call them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from flexfa.codegen.cute import direct, jitcache
from flexfa.codegen.cute.emit import AuxLayout
from flexfa.codegen.cute.plan import MaskLowering
from flexfa.codegen.cute.sparse import SparseLists
from flexfa.layout import row_major


@dataclasses.dataclass(frozen=True)
class Hooks:
    """The generated functions FA4 receives for one call (None where unused)."""

    score_mod: Callable | None
    score_mod_bwd: Callable | None
    mask_mod: Callable | None
    aux: AuxLayout


# Narrow integer tensors are read as int32 (their IR type, flexfa/ir/dtypes.py), bool as uint8.
_STORED_AS = {
    torch.bool: torch.uint8,
    torch.int8: torch.int32,
    torch.uint8: torch.int32,
    torch.int16: torch.int32,
}


def captured_tensor(t: torch.Tensor) -> torch.Tensor:
    """A captured tensor as the hooks read it (Note [Captured tensors by address] in emit.py):
    in the storage type of its IR type (bool as uint8, read back as `!= 0`; int8, uint8 and int16
    as int32), 0-d as a one-element vector (the generated code reads element 0), with the
    row-major strides of its shape (Note [Aux tensor layouts]). A copy where any of these
    differ: the caller keeps the result alive until FA4 has enqueued its kernels."""
    t = t.detach()
    if t.dtype in _STORED_AS:
        t = t.to(_STORED_AS[t.dtype])
    if t.ndim == 0:
        t = t.reshape(1)
    return row_major(t)


# Note [Aux tensor layouts]
# The generated hooks index captured tensors and gradient buffers with the row-major strides of
# their sizes (Note [Captured tensors by address] in emit.py), and FA4 compiles its block-sparse
# lists with a static unit stride in the last dim, checked at every call. torch calls a tensor
# contiguous whatever the strides of its size-1 dims, and keeps them through `.contiguous()`: in
# flexfa's GPU fuzz a backward list of shape (1, 1, 1) with strides (2, 2, 2) (one KV block)
# failed FA4's check ("Expected strides[leading_dim] == 1, but got 2") once FA4 broadcast it
# over heads. So every captured tensor, gradient buffer and list gets the row-major strides of
# its shape (`flexfa.layout.row_major`): one layout rule.


def _address(t: torch.Tensor) -> int:
    """`t`'s device address; 0 for a fake tensor (a compile without a GPU, offline.py: FA4 keys
    its kernels by the scalars' types, so the value is never used)."""
    if type(t) is not torch.Tensor:
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(t):
            return 0
    return t.data_ptr()


def aux_scalars(
    aux: AuxLayout | None, values: tuple[float, ...], tensors: Sequence[torch.Tensor] = ()
) -> tuple | None:
    """FA4's run-time `aux_scalars` for one call, in the order `aux` gives: the lifted floats
    (Note [Constants in generated CuTe source]), then each tensor's address and sizes (Note
    [Captured tensors by address]); None when there are none. `tensors` are the call's captured
    tensors (`captured_tensor`) in `aux`'s positions, then in the backward the gradient buffers
    (the forward's hooks read none, and they come last); the caller holds them until FA4 has
    enqueued its kernels."""
    if not values and not tensors:
        return None
    # The same layout, values (bit for bit) and tensors give the same tuple, kept: building the
    # DSL's scalar objects is a large part of a repeated call's host time.
    key = (
        id(aux),
        tuple(float(v).hex() for v in values),
        *[(_address(t), t.shape, t.stride(), t.dtype) for t in tensors],
    )
    hit = _scalar_tuples.get(key)
    if hit is not None and hit[0] is aux:
        return hit[1]
    result = _aux_scalars(aux, values, tensors)
    if len(_scalar_tuples) >= 256:
        _scalar_tuples.clear()
    _scalar_tuples[key] = (aux, result)
    return result


_scalar_tuples: dict[tuple, tuple] = {}


def _aux_scalars(
    aux: AuxLayout | None, values: tuple[float, ...], tensors: Sequence[torch.Tensor]
) -> tuple:
    import cutlass

    assert aux is not None and len(values) == aux.lifted, (aux, values)
    captures = len(aux.score_captures) + len(aux.mask_captures)
    assert len(tensors) in (captures, len(aux.tensors)), (len(tensors), aux)
    scalars: list = [cutlass.Float32(v) for v in values]
    for position, (t, (dtype, rank)) in enumerate(zip(tensors, aux.tensors)):
        assert len(scalars) == aux.address(position)
        stored = _STORED_AS.get(dtype.torch, dtype.torch)
        assert t.dtype == stored and t.ndim == rank, (position, t.dtype, t.shape, dtype, rank)
        # Contiguous is enough: the hooks index with the strides of the sizes, and a size-1 dim
        # is only ever indexed at 0.
        assert t.is_contiguous() and t.numel() < 2**31, (t.shape, t.stride())
        scalars.append(cutlass.Int64(_address(t)))
        scalars.extend(cutlass.Int32(n) for n in t.shape)
    return tuple(scalars)


@dataclasses.dataclass(frozen=True, eq=False)
class Sequences:
    """A packed call's sequences as FA4's varlen kernels take them (Note [Packed calls on FA4's
    varlen path] in backend.py): int32 offsets on the device and the longest lengths."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    def tensors(self) -> dict[str, torch.Tensor]:
        """The offsets as FA4 takes them, by name."""
        return {
            "cu_seqlens_q": self.cu_seqlens_q.contiguous(),
            "cu_seqlens_k": self.cu_seqlens_k.contiguous(),
        }

    def fa4_kwargs(self, tensors: dict[str, torch.Tensor] | None = None) -> dict:
        """Keyword arguments of FA4's `_flash_attn_fwd` / `_flash_attn_bwd` for these sequences
        (with the offsets of `tensors`, by name, where given)."""
        offsets = self.tensors() if tensors is None else tensors
        return {
            "cu_seqlens_q": offsets["cu_seqlens_q"],
            "cu_seqlens_k": offsets["cu_seqlens_k"],
            "max_seqlen_q": self.max_seqlen_q,
            "max_seqlen_k": self.max_seqlen_k,
        }


def _fa4_layout(t: torch.Tensor, sequences: Sequences | None = None) -> torch.Tensor:
    """(B, H, L, D) as FA4's (B, L, H, D); with `sequences`, (1, H, total, D) as (total, H, D)."""
    return t.transpose(1, 2) if sequences is None else t.select(0, 0).transpose(0, 1)


def _flexfa_layout(t: torch.Tensor, sequences: Sequences | None) -> torch.Tensor:
    """The inverse of `_fa4_layout`."""
    return t.transpose(1, 2) if sequences is None else t.transpose(0, 1).unsqueeze(0)


def _fa4_lse(t: torch.Tensor | None, sequences: Sequences | None) -> torch.Tensor | None:
    """flexfa's (B, H, L) LSE as FA4's: the same, or (H, total) for packed sequences."""
    return t if t is None or sequences is None else t.select(0, 0)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    out: torch.Tensor,
    scale: float,
    lowering: MaskLowering,
    hooks: Hooks,
    tensors: list[torch.Tensor],
    arch: int | None = None,
    block_sparse: SparseLists | None = None,
    scalars: tuple[float, ...] = (),
    sequences: Sequences | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4's forward, writing into `out` ([B, H, Lq, Ev], any stride order with a unit-stride
    head dim: the caller gives it q's, Note [Output layout] in flexfa/layout.py). Returns (out,
    lse [B, H, Lq] natural log). `tensors`: the call's captured tensors (`captured_tensor`), which
    reach the hooks by address (Note [Captured tensors by address] in emit.py); this frame holds
    them until FA4 has enqueued its kernels. With `sequences`, B is 1 and FA4's varlen kernels
    run."""
    from flash_attn.cute.interface import _flash_attn_fwd

    jitcache.install()
    # The call's tensors as FA4 takes them, detached (FA4 hands its kernel detached tensors), and
    # the LSE allocated here: the same tensors reach FA4's entry point or its compiled kernel
    # (Note [Direct FA4 launches] in direct.py).
    fa4_lse = torch.empty(
        (q.shape[1], q.shape[2]) if sequences is not None else q.shape[:3],
        dtype=torch.float32,
        device=q.device,
    )
    named = {
        "q": _fa4_layout(q, sequences).detach(),
        "k": _fa4_layout(k, sequences).detach(),
        "v": _fa4_layout(v, sequences).detach(),
        "out": _fa4_layout(out, sequences).detach(),
        "lse": fa4_lse,
    }
    if sequences is not None:
        named.update(sequences.tensors())
    if block_sparse is not None:
        named.update(block_sparse.tensors())
    aux = aux_scalars(hooks.aux, scalars, tensors)
    mask_mod = hooks.mask_mod if not lowering.native else None

    def through_fa4() -> None:
        _flash_attn_fwd(
            named["q"],
            named["k"],
            named["v"],
            **(sequences.fa4_kwargs(named) if sequences is not None else {}),
            softmax_scale=scale,
            score_mod=hooks.score_mod,
            mask_mod=mask_mod,
            aux_tensors=None,  # Note [Captured tensors by address]
            aux_scalars=aux,
            block_sparse_tensors=block_sparse.to_fa4(named) if block_sparse is not None else None,
            return_lse=True,
            out=named["out"],
            lse=fa4_lse,
            _arch=arch,
            **lowering.fa4_kwargs(),
        )

    extra = (
        scale,
        lowering,
        hooks.score_mod,
        mask_mod,
        arch,
        None if sequences is None else (sequences.max_seqlen_q, sequences.max_seqlen_k),
        None if block_sparse is None else block_sparse.block_size,
    )
    direct.launch(named, aux, through_fa4, extra)
    return out, (fa4_lse if sequences is None else fa4_lse.unsqueeze(0))


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    *,
    scale: float,
    lowering: MaskLowering,
    hooks: Hooks,
    tensors: list[torch.Tensor],
    deterministic: bool,
    block_sparse: SparseLists | None = None,
    scalars: tuple[float, ...] = (),
    sequences: Sequences | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA4's backward with the generated score_mod_bwd; returns dq, dk, dv in flexfa's layout.
    `tensors`: the captured tensors as for `forward`, then the float32 gradient buffers of those
    that need one, filled in place (Note [Captured gradients in the FA4 backward] in emit.py).
    With `sequences`, FA4's varlen kernels run."""
    from flash_attn.cute.interface import _flash_attn_bwd

    jitcache.install()

    dq, dk, dv = _flash_attn_bwd(
        _fa4_layout(q, sequences),
        _fa4_layout(k, sequences),
        _fa4_layout(v, sequences),
        _fa4_layout(out, sequences),
        _fa4_layout(dout, sequences),
        _fa4_lse(lse, sequences),
        **(sequences.fa4_kwargs() if sequences is not None else {}),
        softmax_scale=scale,
        deterministic=deterministic,
        score_mod=hooks.score_mod,
        score_mod_bwd=hooks.score_mod_bwd if hooks.score_mod is not None else None,
        mask_mod=hooks.mask_mod if not lowering.native else None,
        aux_tensors=None,  # Note [Captured tensors by address]
        aux_scalars=aux_scalars(hooks.aux, scalars, tensors),
        block_sparse_tensors=block_sparse.to_fa4() if block_sparse is not None else None,
        dlse=_fa4_lse(dlse, sequences),
        **lowering.fa4_kwargs(),
    )[:3]
    return tuple(_flexfa_layout(g, sequences) for g in (dq, dk, dv))
