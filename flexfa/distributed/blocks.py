"""One block of context-parallel attention: a piece of this rank's queries against a piece of keys.

# Note [Global positions by shifted mods]
# The mods see global positions. A block pairs a contiguous piece of queries starting at global
# position qo with a contiguous piece of keys starting at ko, so its mods are the user's mods with
# `q_idx + qo` and `kv_idx + ko`. The offsets are captured 0-dim int32 tensors, not Python ints: a
# trace (and a compiled kernel) depends on the dtypes and ranks of its captures, not their values,
# so every block of a call shares one trace and one kernel per mod, while the block-mask analysis
# still reads the offsets' values and proves tiles exactly as for the unshifted mask. Offset
# tensors and shifted wrappers are kept in small caches, so the trace cache and the block-mask cache
# of `flexfa.attention` (keyed by tensor identity) hit on every later step.

# Note [Block backward from the global LSE]
# The ring's partial results are merged by their LSEs (`flexfa.merge_attention`), and the backward
# could be autograd through those merges. That needs each block's own output and LSE in the
# backward: saving them costs one output per ring step (the memory the ring exists to avoid), and
# recomputing them costs a second forward per block. Instead the backward uses the flash-attention
# identity: with the *global* output O and LSE of a query row, a block's share of the gradients is
# what the backend's own backward computes when handed O and the global LSE in place of the block's
# own: p = exp(s - lse) is then the global probability and delta = rowsum(dO * O) - dlse the global
# delta, so dq, dk, dv and the gradients of captured tensors come out as that block's exact share.
# No forward is recomputed and nothing per step is saved. Backends other than tiled and triton get
# the generic path: recompute the block with autograd and feed it the upstream gradients the merge
# would have passed (w dO and w (dO . (o_j - O) + dlse), w = exp(lse_j - lse)).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from flexfa import backends
from flexfa.api import build_spec
from flexfa.blockmask.bind import resolve_block_mask
from flexfa.blockmask.block_mask import BlockMask
from flexfa.mods import bind_heads
from flexfa.spec import AttentionSpec

_CACHE_SIZE = 4096
_offsets: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()
_shifted: collections.OrderedDict[tuple, tuple[Callable, Callable]] = collections.OrderedDict()


def _lru_put(cache: collections.OrderedDict, key: tuple, value: Any) -> None:
    cache[key] = value
    while len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)


def offset_tensor(value: int, device: torch.device) -> torch.Tensor:
    key = (value, str(device))
    t = _offsets.get(key)
    if t is None:
        t = torch.tensor(value, dtype=torch.int32, device=device)
        _lru_put(_offsets, key, t)
    return t


def shift_mask(mask_mod: Callable, qo: int, ko: int, device: torch.device) -> Callable:
    """`mask_mod` seen from a block whose first query/key are global positions qo/ko."""
    key = ("mask", id(mask_mod), qo, ko, str(device))
    hit = _shifted.get(key)
    if hit is not None and hit[0] is mask_mod:
        return hit[1]
    qt, kt = offset_tensor(qo, device), offset_tensor(ko, device)

    def shifted(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + qt, kv_idx + kt)

    shifted.__name__ = shifted.__qualname__ = getattr(mask_mod, "__name__", "mask_mod")
    _lru_put(_shifted, key, (mask_mod, shifted))
    return shifted


def shift_score(score_mod: Callable, qo: int, ko: int, device: torch.device) -> Callable:
    """`score_mod` seen from a block whose first query/key are global positions qo/ko."""
    key = ("score", id(score_mod), qo, ko, str(device))
    hit = _shifted.get(key)
    if hit is not None and hit[0] is score_mod:
        return hit[1]
    qt, kt = offset_tensor(qo, device), offset_tensor(ko, device)

    def shifted(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_idx + qt, kv_idx + kt)

    shifted.__name__ = shifted.__qualname__ = getattr(score_mod, "__name__", "score_mod")
    _lru_put(_shifted, key, (score_mod, shifted))
    return shifted


@dataclasses.dataclass(frozen=True)
class Options:
    """The call's options that every block shares."""

    score_mod: Callable | None  # heads already bound (flexfa.mods.bind_heads)
    mask_mod: Callable | None
    scale: float | None
    enable_gqa: bool
    backend: str
    kernel_options: Mapping[str, Any] | None
    deterministic: bool


def block_mask(
    opts: Options,
    B: int,
    Hq: int,
    q_start: int,
    q_len: int,
    kv_start: int,
    kv_len: int,
    device: torch.device,
) -> BlockMask | None:
    """The BlockMask of a block (built in O(tiles), cached), or None when all its tiles are empty."""
    mask = opts.mask_mod
    if mask is not None:
        mask = shift_mask(mask, q_start, kv_start, device)
    bm = resolve_block_mask(mask, B, Hq, q_len, kv_len, device)
    return None if sum(tile_counts(bm)) == 0 else bm


_counts: collections.OrderedDict[int, tuple[BlockMask, tuple[int, int]]] = collections.OrderedDict()


def tile_counts(bm: BlockMask | None) -> tuple[int, int]:
    """(full, partial) tiles of a block mask (summed over the batch elements and heads it stores).

    Remembered per BlockMask (the block-mask cache returns the same object on later calls), so a
    training step does not pay a device-to-host copy per CP block to learn what it knew."""
    if bm is None:
        return 0, 0
    hit = _counts.get(id(bm))
    if hit is not None and hit[0] is bm:
        return hit[1]
    counts = (int(bm.kv_full.count.sum()), int(bm.kv_partial.count.sum()))
    _lru_put(_counts, id(bm), (bm, counts))
    return counts


def block_spec(
    opts: Options,
    bm: BlockMask,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    kv_start: int,
    needs_grad: bool,
) -> AttentionSpec:
    score = opts.score_mod
    if score is not None:
        score = shift_score(score, q_start, kv_start, q.device)
    with torch.no_grad():
        spec = build_spec(
            q,
            k,
            v,
            score,
            bm,
            scale=opts.scale,
            enable_gqa=opts.enable_gqa,
            kernel_options=opts.kernel_options,
            deterministic=opts.deterministic,
        )
    return dataclasses.replace(spec, needs_grad=needs_grad) if needs_grad else spec


def _score_tensors(spec: AttentionSpec) -> tuple[torch.Tensor, ...]:
    return spec.score_mod.tensors if spec.score_mod is not None else ()


def forward(
    impl: backends.Backend, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one block, without autograd."""
    with torch.no_grad():
        run_spec = dataclasses.replace(spec, needs_grad=False) if spec.needs_grad else spec
        return impl.run(run_spec, q, k, v)


def backward(
    impl: backends.Backend,
    spec: AttentionSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[torch.Tensor, torch.Tensor]]:
    """One block's share of dq, dk, dv and of the captured tensors' gradients (keyed by tensor),
    given the rows' global `out` (float32) and `lse` (Note [Block backward from the global LSE])."""
    score_tensors = _score_tensors(spec)
    slots = spec.score_grad_slots
    if impl.name == "tiled":
        from flexfa.backends import tiled

        dq, dk, dv, grads = tiled._backward(
            tiled._Plan(spec, q.device), q, k, v, out, lse, dout, dlse, score_tensors, slots
        )
    elif impl.name == "triton":
        from flexfa.codegen.triton.backend import Launcher

        # The CP block's q, k, v, out and LSE are row slices of larger tensors: the kernels get
        # dense copies (dq, dk and dv are allocated like them). `out` stays float32: delta from
        # the unrounded output (Note [Unrounded output for delta] in codegen/triton/backend.py).
        dq, dk, dv, grads = Launcher(spec).backward(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            out.contiguous(),
            lse.contiguous(),
            dout,
            dlse,
            tuple(t.contiguous() for t in score_tensors),
            slots,
        )
    else:
        return _generic_backward(impl, spec, q, k, v, out, lse, dout, dlse)
    by_tensor = {score_tensors[s]: g for s, g in grads.items() if s in slots}
    return dq, dk, dv, by_tensor


def _generic_backward(impl, spec, q, k, v, out, lse, dout, dlse):
    score_tensors = _score_tensors(spec)
    wanted = [score_tensors[s] for s in sorted(spec.score_grad_slots)]
    qd, kd, vd = (t.detach().requires_grad_(True) for t in (q, k, v))
    with torch.enable_grad():
        out_j, lse_j = impl.run(spec, qd, kd, vd)
        lse_safe = torch.where(torch.isneginf(lse), 0.0, lse)
        w = torch.where(torch.isneginf(lse_j), 0.0, torch.exp(lse_j - lse_safe))
        g_out = (w[..., None] * dout.float()).to(out_j.dtype)
        g_lse = w * (dout.float() * (out_j.float() - out.float())).sum(-1)
        if dlse is not None:
            g_lse = g_lse + w * dlse.float()
        grads = torch.autograd.grad(
            (out_j, lse_j), (qd, kd, vd, *wanted), (g_out, g_lse), allow_unused=True
        )
    dq, dk, dv = (torch.zeros_like(t) if g is None else g for t, g in zip((q, k, v), grads[:3]))
    by_tensor = {t: g for t, g in zip(wanted, grads[3:]) if g is not None}
    return dq, dk, dv, by_tensor


def bind_score_mod(score_mod: Callable | None, num_heads: int) -> Callable | None:
    return bind_heads(score_mod, num_heads)
