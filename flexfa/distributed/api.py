"""The public entry points: shard_sequence, unshard_sequence, context_parallel_attention."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

import flexfa.api
from flexfa.blockmask.block_mask import BlockMask
from flexfa.distributed import blocks, cost
from flexfa.distributed.comm import GatherKV, Group, gather_sequence, own_part, resolve_group
from flexfa.distributed.layout import Document, Layout, resolve_layout
from flexfa.distributed.ring import RingFunction, RingPlan
from flexfa.frontend.trace import trace_score_mod
from flexfa.spec import validate_qkv

log = logging.getLogger("flexfa.distributed")

METHODS = ("ring", "allgather", "auto")


def _global_length(balance: object, local: int, world: int) -> int:
    return sum(balance.lengths) if isinstance(balance, Document) else local * world


def _layout_for_local(g: Group, balance: object, local: int, what: str) -> Layout:
    layout = resolve_layout(balance, _global_length(balance, local, g.world_size), g.world_size)
    if layout.local_length(g.rank) != local:
        raise ValueError(
            f"{what} has local length {local} on rank {g.rank}, but balance={balance!r} gives this "
            f"rank {layout.local_length(g.rank)} of the sequence's {layout.length} positions; shard "
            "it with flexfa.distributed.shard_sequence and the same balance"
        )
    return layout


def shard_sequence(
    tensors: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor],
    *,
    group: object = None,
    balance: str | Document = "none",
    dim: int = -2,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """This rank's shard of each tensor along the sequence dim `dim` (default -2, as in (B, H, L, E)).

    Every rank passes the same full tensors and keeps its own positions (see `balance` in
    `context_parallel_attention`). Differentiable: the gradient of a shard flows back to its positions
    of the full tensor.

    >>> q_l, k_l, v_l = shard_sequence((q, k, v), balance="head_tail")  # doctest: +SKIP
    """
    g = resolve_group(group)
    single = isinstance(tensors, torch.Tensor)
    items = (tensors,) if single else tuple(tensors)
    out = []
    for n, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"shard_sequence takes tensors, got {type(t).__name__} at position {n}")
        d = dim % t.ndim if -t.ndim <= dim < t.ndim else None
        if d is None:
            raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(t.shape)}")
        layout = resolve_layout(balance, t.shape[d], g.world_size)
        out.append(own_part(layout, g.rank, t, d))
    return out[0] if single else tuple(out)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: Group, layout: Layout, x: torch.Tensor) -> torch.Tensor:
        ctx.g, ctx.layout = g, layout
        return gather_sequence(g, layout, x)

    @staticmethod
    def backward(ctx, grad):
        return None, None, own_part(ctx.layout, ctx.g.rank, grad, grad.ndim - 2)


def unshard_sequence(
    tensor: torch.Tensor, *, group: object = None, balance: str | Document = "none", dim: int = -2
) -> torch.Tensor:
    """The full tensor from every rank's shard along `dim` (the inverse of `shard_sequence`).

    Every rank receives the whole tensor. Its gradient is the rank's own positions of the incoming
    gradient: this assumes each rank computes the same function of the full tensor (as when every
    rank evaluates one replicated loss), so that one rank's copy of it stands for all.

    >>> out = unshard_sequence(out_l, balance="head_tail")  # doctest: +SKIP
    """
    g = resolve_group(group)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"unshard_sequence takes a tensor, got {type(tensor).__name__}")
    if not -tensor.ndim <= dim < tensor.ndim:
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(tensor.shape)}")
    d = dim % tensor.ndim
    x = tensor.movedim(d, -2) if tensor.ndim >= 2 else tensor.unsqueeze(-1)
    layout = _layout_for_local(g, balance, x.shape[-2], "tensor")
    full = _Unshard.apply(g, layout, x)
    return full.movedim(-2, d) if tensor.ndim >= 2 else full.squeeze(-1)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
    *,
    group: object = None,
    balance: str | Document = "none",
    method: str = "auto",
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
    kernel_options: Mapping[str, Any] | None = None,
    deterministic: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`flexfa.attention` over a sequence sharded across the ranks of `group`.

    Each rank passes its shards q, k, v (B, H, local length, E) as `shard_sequence` cut them with the
    same `balance`, and gets its queries' rows of the output (and LSE). The result equals
    `flexfa.attention` on the unsharded tensors, forward and backward; the mods see global positions,
    so a mask_mod written for one device works unchanged.

    Args:
        q, k, v: this rank's shards; shapes, dtypes, GQA, `scale`, `backend`, `kernel_options` and
            `deterministic` as in `flexfa.attention`.
        score_mod, mask_mod: as in `flexfa.attention`, on global positions (`mask_mod` must be a
            function, not a BlockMask: each rank builds the block masks of its own queries).
        group: a ProcessGroup or a 1-D DeviceMesh (default: the default group).
        balance: "none" (contiguous shards), "head_tail" (rank r holds chunks r and 2W-1-r of 2W)
            or `flexfa.distributed.Document(lengths)` (shards of equal work for packed documents).
        method: "ring" (K/V rotate between neighbours, overlapped with compute), "allgather" (K/V
            gathered once) or "auto" (a cost model picks; the reason is logged at DEBUG level on the
            "flexfa.distributed" logger).
        return_lse: also return this rank's rows of the LSE.

    Captured tensors must be the same on every rank. The gradient a rank gets for a captured tensor
    is the part from its own queries; the sum over the group is the full gradient (docs/distributed.md).

    >>> out_l = context_parallel_attention(q_l, k_l, v_l, mask_mod=flexfa.masks.causal,
    ...                                    balance="head_tail", method="ring")  # doctest: +SKIP
    """
    g = resolve_group(group)
    B, Hq, Hkv, Lq, Lkv, E, Ev = validate_qkv(q, k, v, enable_gqa=enable_gqa)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"context parallel attention needs k and v in q's dtype ({q.dtype}), got {k.dtype} "
            f"and {v.dtype}: float8 K/V are not supported here yet"
        )
    if Lq != Lkv:
        raise ValueError(
            f"q and k shards must have one length (one sequence sharded), got {Lq} and {Lkv}"
        )
    if isinstance(mask_mod, BlockMask):
        raise TypeError(
            "mask_mod must be a mask_mod function, not a BlockMask: each rank builds the block "
            "masks of its own queries from it (pass bm.mask_mod)"
        )
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable or None, got {type(mask_mod).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    layout = _layout_for_local(g, balance, Lq, "q")
    bound = blocks.bind_score_mod(score_mod, Hq)
    opts = blocks.Options(
        score_mod=bound,
        mask_mod=mask_mod,
        scale=scale,
        enable_gqa=enable_gqa,
        backend=backend,
        kernel_options=kernel_options,
        deterministic=deterministic,
    )
    plan = None
    if method in ("ring", "auto"):
        plan = RingPlan(g, layout, opts, B, Hq, Hkv, E, Ev, q.device)
    if method == "auto":
        choice = cost.choose(plan, q, Hkv, E, Ev)
        log.debug("flexfa.distributed: rank %d uses %s: %s", g.rank, choice.method, choice.reason)
        method = choice.method
    if method == "ring":
        out, lse = _ring(plan, bound, q, k, v)
    else:
        out, lse = _allgather(g, layout, opts, q, k, v)
    return (out, lse) if return_lse else out


def _captures(score_mod: Callable | None, device: torch.device) -> tuple[torch.Tensor, ...]:
    if score_mod is None:
        return ()
    traced = trace_score_mod(score_mod, device=device)
    return tuple(t for t in traced.tensors if t.dtype.is_floating_point and t.requires_grad)


def _ring(plan: RingPlan, score_mod, q, k, v):
    captures = _captures(score_mod, q.device) if torch.is_grad_enabled() else ()
    if torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or captures
    ):
        return RingFunction.apply(plan, q, k, v, *captures)
    out, lse = plan.forward(q, k, v)
    return out.to(q.dtype), lse


def _allgather(g: Group, layout: Layout, opts: blocks.Options, q, k, v):
    # K and V travel in one collective each way (fewer messages; one order of collectives in the
    # backward on every rank).
    kv = GatherKV.apply(g, layout, torch.cat([k, v], dim=-1))
    k_all, v_all = kv[..., : k.shape[-1]], kv[..., k.shape[-1] :]
    outs, lses = [], []
    for local, start, n in layout.chunks(g.rank):
        mask = opts.mask_mod and blocks.shift_mask(opts.mask_mod, start, 0, q.device)
        score = opts.score_mod and blocks.shift_score(opts.score_mod, start, 0, q.device)
        o, lse = flexfa.api.attention(
            q[..., local : local + n, :],
            k_all,
            v_all,
            score,
            mask,
            scale=opts.scale,
            enable_gqa=opts.enable_gqa,
            return_lse=True,
            backend=opts.backend,
            kernel_options=opts.kernel_options,
            deterministic=opts.deterministic,
        )
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
