"""Running one call through FlashAttention-4 with generated hooks: plan, module, autograd.

`run(spec, q, k, v)` lowers the mask (plan.py), loads the generated module (module.py) and runs
FA4's forward, and later its backward, through `_Fa4Function`. The "fa4" backend
(flexfa/backends/fa4.py) decides whether a call can come here.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from flexfa.blockmask.block_mask import BlockMask
from flexfa.codegen.cute import jitcache, launch, module, sparse
from flexfa.codegen.cute.launch import Hooks
from flexfa.codegen.cute.plan import MaskLowering, lower_mask
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
# (`flexfa.backends.fa4.SM90_BACKWARD_HEAD_DIMS`: 64, 96, 128, 192, 256, head_dim == head_dim_v).
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
) -> Call:
    """Mask lowerings of both passes and the generated hooks for one call's mods. With
    `block_mask`, passes that use the mask_mod also get FA4's block-sparse lists (Note
    [Block-sparse lists for FA4]; the caller checked `sparse.why_not_sparse`)."""
    lowering = mask_lowering(mask, len_q, len_kv)
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


def uses_block_sparse(spec: AttentionSpec) -> bool:
    """Whether the call passes its BlockMask as FA4's block-sparse lists: `kernel_options=
    {"block_sparse": ...}` when given, else wherever the lists are wired (Note [Block-sparse lists
    for FA4]); they matter only for masks that are not native."""
    option = spec.kernel_options.get("block_sparse")
    if option is not None:
        return bool(option)
    if spec.device.type != "cuda":
        return False
    major = torch.cuda.get_device_capability(spec.device)[0]
    why = sparse.why_not_sparse(spec.block_mask, spec.head_dim, spec.head_dim_v, major)
    return why is None


def _arch_major(device: torch.device) -> int | None:
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None


def make_call(spec: AttentionSpec) -> Call:
    from flexfa.backends.fa4 import backward_head_dim

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
    )
    if not spec.needs_grad:
        return call
    padded = backward_head_dim(spec.head_dim, spec.head_dim_v, _arch_major(spec.device))
    return dataclasses.replace(call, bwd_head_dim=padded)


def _pad_head_dim(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, dim - t.shape[-1]))


def forward(call: Call, q, k, v, score_tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4's forward for one planned call: (out [B, Hq, Lq, Ev] in q's stride order, lse)."""
    aux = [launch.aux_tensor(t) for t in (*score_tensors, *call.mask_tensors)]
    B, Hq, Lq, _ = q.shape
    out = empty_like_query(q, (B, Hq, Lq, v.shape[-1]))  # Note [Output layout]
    return launch.forward(
        q,
        k,
        v,
        out=out,
        scale=call.scale,
        lowering=call.lowering,
        hooks=call.hooks,
        aux_tensors=aux,
        block_sparse=call.fwd_sparse,
        scalars=call.scalars,
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
    aux = [launch.aux_tensor(t) for t in (*score_tensors, *call.mask_tensors)]
    aux += [launch.with_leading_dim(g.reshape(1) if g.ndim == 0 else g) for g in grads]
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    if call.bwd_head_dim is not None:  # Note [Padded backward]
        q, k, v, out, dout = (_pad_head_dim(t, call.bwd_head_dim) for t in (q, k, v, out, dout))
    group = call.bwd_kv_group
    if group > 1:  # Note [GQA in FA4's score_mod backward]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
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
        aux_tensors=aux,
        deterministic=call.deterministic,
        block_sparse=call.bwd_sparse,
        scalars=call.scalars,
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


def run(spec: AttentionSpec, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [B, H, Lq, Ev] and natural-log LSE [B, H, Lq], both differentiable."""
    call = make_call(spec)
    score_tensors = spec.score_mod.tensors if spec.score_mod is not None else ()
    return _Fa4Function.apply(q, k, v, call, *score_tensors)
