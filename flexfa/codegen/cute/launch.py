"""Calls of FlashAttention-4's forward and backward with flexfa's generated hooks.

flexfa's layout is (batch, heads, len, dim); FA4's is (batch, len, heads, dim). The transposes
below are views (FA4 reads any strides with a contiguous last dim), so no copy is made. Outputs
come back as views in flexfa's layout.

These functions import flash_attn; only the "fa4" backend and export call them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator

import torch

from flexfa.codegen.cute.emit import AuxLayout
from flexfa.codegen.cute.plan import MaskLowering
from flexfa.codegen.cute.sparse import SparseLists


@dataclasses.dataclass(frozen=True)
class Hooks:
    """The generated functions FA4 receives for one call (None where unused)."""

    score_mod: Callable | None
    score_mod_bwd: Callable | None
    mask_mod: Callable | None
    aux: AuxLayout


def aux_tensor(t: torch.Tensor) -> torch.Tensor:
    """A captured tensor as FA4 can take it: 0-d tensors become one-element vectors (the
    generated code reads element 0), bool tensors become uint8 (read back as `!= 0`)."""
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.ndim == 0:
        t = t.reshape(1)
    return t.detach()


def aux_scalars(values: tuple[float, ...]) -> tuple | None:
    """Lifted scalars as FA4's run-time `aux_scalars` (Note [Constants in generated CuTe source]),
    or None when the mods lift none."""
    if not values:
        return None
    import cutlass

    return tuple(cutlass.Float32(v) for v in values)


def _fa4_layout(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    lowering: MaskLowering,
    hooks: Hooks,
    aux_tensors: list[torch.Tensor],
    arch: int | None = None,
    block_sparse: SparseLists | None = None,
    scalars: tuple[float, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA4's forward. Returns (out in flexfa's layout, lse [B, H, Lq] natural log, out in FA4's
    layout for the backward)."""
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(
        _fa4_layout(q),
        _fa4_layout(k),
        _fa4_layout(v),
        softmax_scale=scale,
        score_mod=hooks.score_mod,
        mask_mod=hooks.mask_mod if not lowering.native else None,
        aux_tensors=aux_tensors or None,
        aux_scalars=aux_scalars(scalars),
        block_sparse_tensors=block_sparse.to_fa4() if block_sparse is not None else None,
        return_lse=True,
        _arch=arch,
        **lowering.fa4_kwargs(),
    )
    return out.transpose(1, 2), lse, out


_tile_lock = threading.Lock()


@contextlib.contextmanager
def sm90_backward_rows_80() -> Iterator[None]:
    """Within the block, FA4's sm90 backward takes its 80-row tiles at head dims 97..128 (Note
    [Backward with a score_mod] in backend.py). FA4 picks its tiles in one private function of
    its interface, with no argument to choose them; it is replaced for the duration of the call,
    under a lock (the choice is read when FA4 compiles or looks up the kernel, inside the call)."""
    import flash_attn.cute.interface as fa4_interface

    original = fa4_interface._tile_size_bwd_sm90

    def tiles(head_dim, head_dim_v, causal, local, sparse_block_size_q=None):
        if 96 < head_dim <= 128 and head_dim_v <= 128:
            # FA4's non-causal head-dim-128 configuration: 80 x 128 tiles, dQ with swapped operands
            return original(128, 128, False, False, sparse_block_size_q)
        return original(head_dim, head_dim_v, causal, local, sparse_block_size_q)

    with _tile_lock:
        fa4_interface._tile_size_bwd_sm90 = tiles
        try:
            yield
        finally:
            fa4_interface._tile_size_bwd_sm90 = original


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_fa4: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    *,
    scale: float,
    lowering: MaskLowering,
    hooks: Hooks,
    aux_tensors: list[torch.Tensor],
    deterministic: bool,
    block_sparse: SparseLists | None = None,
    rows_80: bool = False,
    scalars: tuple[float, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA4's backward with the generated score_mod_bwd; returns dq, dk, dv in flexfa's layout.
    Gradient buffers of captured tensors are the last entries of `aux_tensors` and are filled
    in place (Note [Captured gradients in the FA4 backward] in emit.py)."""
    from flash_attn.cute.interface import _flash_attn_bwd

    tiles = sm90_backward_rows_80() if rows_80 else contextlib.nullcontext()
    with tiles:
        dq, dk, dv = _flash_attn_bwd(
            _fa4_layout(q),
            _fa4_layout(k),
            _fa4_layout(v),
            out_fa4,
            _fa4_layout(dout),
            lse,
            softmax_scale=scale,
            deterministic=deterministic,
            score_mod=hooks.score_mod,
            score_mod_bwd=hooks.score_mod_bwd if hooks.score_mod is not None else None,
            mask_mod=hooks.mask_mod if not lowering.native else None,
            aux_tensors=aux_tensors or None,
            aux_scalars=aux_scalars(scalars),
            block_sparse_tensors=block_sparse.to_fa4() if block_sparse is not None else None,
            dlse=dlse,
            **lowering.fa4_kwargs(),
        )[:3]
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
