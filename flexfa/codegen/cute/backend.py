"""Running one call through FlashAttention-4 with generated hooks: plan, module, autograd.

`run(spec, q, k, v)` lowers the mask (plan.py), loads the generated module (module.py) and runs
FA4's forward, and later its backward, through `_Fa4Function`. The "fa4" backend
(flexfa/backends/fa4.py) decides whether a call can come here.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from flexfa.codegen.cute import launch, module
from flexfa.codegen.cute.launch import Hooks
from flexfa.codegen.cute.plan import MaskLowering, lower_mask
from flexfa.frontend.trace import TracedMod
from flexfa.spec import AttentionSpec


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
    """What the forward and backward of one call share."""

    scale: float
    lowering: MaskLowering
    hooks: Hooks
    mask_tensors: tuple[torch.Tensor, ...]
    grad_slots: tuple[int, ...]
    deterministic: bool


@functools.lru_cache(maxsize=256)
def _cached_lowering(mask: TracedMod | None, len_q: int, len_kv: int) -> MaskLowering:
    return lower_mask(mask, len_q, len_kv)


def mask_lowering(mask: TracedMod | None, len_q: int, len_kv: int) -> MaskLowering:
    """`lower_mask`, cached per (mask IR, lengths) for masks without captured tensors (a mask
    that reads tensors is proven again for each call: its tensors may differ)."""
    if mask is not None and mask.captures:
        return lower_mask(mask, len_q, len_kv)
    return _cached_lowering(mask, len_q, len_kv)


def hooks_for(score: TracedMod | None, mask: TracedMod | None, grad_slots: frozenset[int]) -> Hooks:
    """The generated hooks of these mods (loads the generated module: imports cutlass)."""
    from flexfa.codegen.cute.emit import AuxLayout

    _, mod = module.load_module(score, mask, grad_slots)
    return Hooks(
        mod.SCORE_MOD, mod.SCORE_MOD_BWD, mod.MASK_MOD, AuxLayout.of(score, mask, grad_slots)
    )


def make_call(spec: AttentionSpec) -> Call:
    mask = None if spec.mask.is_trivially_true else spec.mask
    lowering = mask_lowering(mask, spec.len_q, spec.len_kv)
    grad_slots = spec.score_grad_slots
    # A native mask needs no mask_mod: leave it out of the module (and of FA4's compile key).
    hooks = hooks_for(spec.score_mod, None if lowering.native else mask, grad_slots)
    return Call(
        scale=spec.scale,
        lowering=lowering,
        hooks=hooks,
        mask_tensors=tuple(mask.tensors) if mask is not None and not lowering.native else (),
        grad_slots=tuple(sorted(grad_slots)),
        deterministic=spec.deterministic,
    )


class _Fa4Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: Call, *score_tensors):
        aux = [launch.aux_tensor(t) for t in (*score_tensors, *call.mask_tensors)]
        out, lse, out_fa4 = launch.forward(
            q, k, v, scale=call.scale, lowering=call.lowering, hooks=call.hooks, aux_tensors=aux
        )
        ctx.save_for_backward(q, k, v, out_fa4, lse, *score_tensors)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out_fa4, lse, *score_tensors = ctx.saved_tensors
        call: Call = ctx.call
        if dout is None:
            dout = torch.zeros_like(out_fa4).transpose(1, 2)
        grads = [
            torch.zeros(score_tensors[s].shape, dtype=torch.float32, device=q.device)
            for s in call.grad_slots
        ]
        aux = [launch.aux_tensor(t) for t in (*score_tensors, *call.mask_tensors)]
        aux += [g.reshape(1) if g.ndim == 0 else g for g in grads]
        dq, dk, dv = launch.backward(
            q,
            k,
            v,
            out_fa4,
            dout,
            lse,
            dlse,
            scale=call.scale,
            lowering=call.lowering,
            hooks=call.hooks,
            aux_tensors=aux,
            deterministic=call.deterministic,
        )
        capture_grads: list[torch.Tensor | None] = [None] * len(score_tensors)
        for slot, g in zip(call.grad_slots, grads):
            capture_grads[slot] = g.to(score_tensors[slot].dtype)
        return dq, dk, dv, None, *capture_grads


def run(spec: AttentionSpec, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [B, H, Lq, Ev] and natural-log LSE [B, H, Lq], both differentiable."""
    call = make_call(spec)
    score_tensors = spec.score_mod.tensors if spec.score_mod is not None else ()
    return _Fa4Function.apply(q, k, v, call, *score_tensors)
