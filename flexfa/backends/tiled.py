"""The "tiled" backend: FlashAttention's algorithm in plain PyTorch. Runs on any device.

For each q-block it streams the KV blocks the BlockMask lists (empty tiles are skipped), a few
blocks per step, with the online-softmax recurrence. Nothing of size Lq x Lkv is ever held: memory
is O(B * H * block_q * step_columns) for scores plus O(L * E) for inputs and gradients. The backward
recomputes probabilities from the saved LSE, tile by tile, and applies the IR-derived derivatives
of the score_mod (`TracedMod.gradient`), including scatter-adds into captured tensors.

Notation (docs/glossary.md): m_i running row max, l_i running row sum, acc unnormalized output,
s scores after score_mod, p probabilities, ds gradient w.r.t. s.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref

import torch

from flexfa.backends.base import Backend, Support, register
from flexfa.blockmask.block_mask import BlockMask, TileState
from flexfa.blockmask.exact import index_grids
from flexfa.ir.autodiff import ScoreModGradient
from flexfa.ir.evaluate import Evaluator
from flexfa.layout import empty_like_query
from flexfa.spec import AttentionSpec

# Columns processed per step (a multiple of the KV block size is used).
DEFAULT_STEP_COLUMNS = 512


@dataclasses.dataclass(frozen=True)
class _Step:
    """One step over a q-block: a group of live KV blocks, their columns and their tile states.

    See Note [Tiled steps].
    """

    cols: torch.Tensor  # int64 [n] key positions
    span: tuple[int, int] | None  # (first, end) when `cols` is a contiguous range
    states: torch.Tensor  # int8 [B', H', 1, n] TileState per column
    any_partial: bool
    all_full: bool  # every (b, h) sees only full tiles: nothing to mask

    def columns(self, t: torch.Tensor) -> torch.Tensor:
        """t[:, :, cols]: a view when the columns are contiguous, else a gather."""
        if self.span is not None:
            return t[:, :, self.span[0] : self.span[1]]
        return t.index_select(2, self.cols)

    def add_columns(self, dst: torch.Tensor, value: torch.Tensor) -> None:
        """dst[:, :, cols] += value."""
        if self.span is not None:
            dst[:, :, self.span[0] : self.span[1]] += value
        else:
            dst.index_add_(2, self.cols, value)


# Note [Tiled steps]
# For each q-block the backend visits the KV blocks that are live (not empty) for any (b, h),
# `blocks_per_step` of them per step, so that each step works on a [B, H, block_q, ~step_columns]
# score tile: large enough for the matmuls and elementwise passes to amortize Python overhead,
# small enough that memory stays O(tile). Two cheap observations save most of the work on common
# masks: a step whose blocks are adjacent reads K and V as a slice (no gather copy), and a step
# whose tiles are all full (most of a causal mask) needs no mask at all, so neither the mask_mod nor
# a masked_fill runs.


# Note [Tiled plans per BlockMask]
# A call's tile states and its steps per q-block follow from the BlockMask, the device, the
# columns per step and the key length alone, and building them takes a dozen small tensor
# operations per q-block: for a decode step on the CPU most of the call. So they are kept per
# BlockMask (weakly, as the decode path keeps its plans: Note [Decode host time] in
# flexfa/codegen/triton/decode.py), and a BlockMask changed in place is seen as stale by these
# plans as by the other caches keyed by it. The steps of a q-block are made on first use and kept
# while the plan's steps hold at most _KEPT_COLUMNS key positions in all (8 MiB of int64): a
# causal mask at 32k keys would need 33 MiB, kept as long as its BlockMask lives, for calls whose
# own work dwarfs building the steps.
_plans: weakref.WeakKeyDictionary[BlockMask, dict[tuple, _SharedPlan]] = weakref.WeakKeyDictionary()
_plans_lock = threading.Lock()
_KEPT_COLUMNS = 1 << 20


@dataclasses.dataclass
class _SharedPlan:
    states: torch.Tensor  # int8 [B', H', nq, nkv] TileState values, on the call's device
    steps: dict[int, list[_Step]]  # per q-block, filled on first use
    columns: int = 0  # key positions the kept steps hold


def _shared_plan(bm: BlockMask, device: torch.device, blocks_per_step: int, len_kv: int):
    key = (str(device), blocks_per_step, len_kv)
    with _plans_lock:
        per_mask = _plans.setdefault(bm, {})
        found = per_mask.get(key)
        if found is None:
            found = per_mask[key] = _SharedPlan(bm.tile_states().to(device), {})
        return found


class _Plan:
    """What the forward and backward share: tile states, steps per q-block, index grids."""

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        self.spec = spec
        bm = spec.block_mask
        self.bq, self.bkv = bm.block_size.q, bm.block_size.kv
        step_cols = int(spec.kernel_options.get("step_columns", DEFAULT_STEP_COLUMNS))
        self.blocks_per_step = max(1, step_cols // self.bkv)
        self._shared = _shared_plan(bm, device, self.blocks_per_step, spec.len_kv)
        self.states = self._shared.states  # [B', H', nq, nkv]
        self.device = device
        self.paged = spec.paged
        self.compute_dtype = torch.float64 if spec.dtype == torch.float64 else torch.float32
        self.max_scores: torch.Tensor | None = None  # set by _forward

    def rows(self, i: int) -> tuple[int, int]:
        return i * self.bq, min((i + 1) * self.bq, self.spec.len_q)

    def steps(self, i: int) -> list[_Step]:
        """The steps over q-block i (Note [Tiled steps]), made once per shared plan."""
        shared = self._shared
        found = shared.steps.get(i)
        if found is None:
            found = self._make_steps(i)
            columns = sum(int(step.cols.numel()) for step in found)
            if shared.columns + columns <= _KEPT_COLUMNS:
                shared.columns += columns
                found = shared.steps.setdefault(i, found)
        return found

    def _make_steps(self, i: int) -> list[_Step]:
        row_states = self.states[:, :, i, :]  # [B', H', nkv]
        live_mask = (row_states != int(TileState.EMPTY)).flatten(0, 1).any(0)
        live = torch.nonzero(live_mask).flatten().tolist()
        steps = []
        for s0 in range(0, len(live), self.blocks_per_step):
            blocks = live[s0 : s0 + self.blocks_per_step]
            end = min((blocks[-1] + 1) * self.bkv, self.spec.len_kv)
            if blocks[-1] - blocks[0] == len(blocks) - 1:
                span: tuple[int, int] | None = (blocks[0] * self.bkv, end)
                cols = torch.arange(blocks[0] * self.bkv, end, device=self.device)
            else:
                span = None
                cols = torch.cat(
                    [
                        torch.arange(j * self.bkv, min((j + 1) * self.bkv, end), device=self.device)
                        for j in blocks
                    ]
                )
            st = row_states[:, :, cols // self.bkv].unsqueeze(2)  # [B', H', 1, n]
            steps.append(
                _Step(
                    cols=cols,
                    span=span,
                    states=st,
                    any_partial=bool((st == int(TileState.PARTIAL)).any()),
                    all_full=bool((st == int(TileState.FULL)).all()),
                )
            )
        return steps

    def columns(self, step: _Step, t: torch.Tensor) -> torch.Tensor:
        """K or V at the step's columns: a slice or gather, or through the page table."""
        if self.paged is not None:
            return self.paged.gather(t, step.cols)
        return step.columns(t)

    def needs_env(self, step: _Step) -> bool:
        """Whether a step evaluates a mod (the score_mod, or the mask_mod on partial tiles)."""
        return self.spec.score_mod is not None or not step.all_full

    def env(self, r0: int, r1: int, step: _Step) -> dict[str, torch.Tensor]:
        spec = self.spec
        env = index_grids(spec.batch, spec.heads_q, torch.arange(r0, r1), step.cols, self.device)
        return env

    def allowed(self, env: dict[str, torch.Tensor], step: _Step) -> torch.Tensor:
        """Bool [B|1, H|1, rows|1, n]: full tiles allow all, partial ones ask the mask."""
        full = step.states == int(TileState.FULL)
        if not step.any_partial:
            return full
        mask = self.spec.mask
        ev = Evaluator(env, mask.tensors)
        mask_value = ev(mask.output)
        partial = step.states == int(TileState.PARTIAL)
        allowed = full | (partial & mask_value)
        if ev.out_of_bounds is not None and bool((ev.out_of_bounds & partial).any()):
            raise IndexError(
                f"mask_mod {mask.name!r} indexes a captured tensor out of bounds for some in-range "
                "(q_idx, kv_idx); are its tensors sized for these sequence lengths?"
            )
        return allowed


def _grouped(x: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """[B, Hq, rows, d] -> [B, Hkv, G * rows, d] (query heads of one KV head stacked)."""
    B, _, rows, d = x.shape
    return x.reshape(B, spec.heads_kv, spec.group_size * rows, d)


def _ungrouped(x: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """[B, Hkv, G * rows, n] -> [B, Hq, rows, n]."""
    B, _, gr, n = x.shape
    return x.reshape(B, spec.heads_q, gr // spec.group_size, n)


def _kv_batch(x: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """A [B, Hkv, n, d] gradient summed to K/V's batch (Note [K/V batch broadcast] in spec.py)."""
    return x.sum(0, keepdim=True) if spec.kv_broadcast else x


def _scores(
    plan: _Plan,
    qg: torch.Tensor,
    k_c: torch.Tensor,
    env: dict[str, torch.Tensor] | None,
    score_tensors: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, Evaluator | None]:
    """Scores after score_mod, [B, Hq, rows, n], and the evaluator (for derivatives).

    `qg` is the q-block grouped (`_grouped`) and already multiplied by the scale.
    """
    spec = plan.spec
    s = _ungrouped(torch.matmul(qg, k_c.transpose(-1, -2)), spec)
    if spec.score_mod is None:
        return s, None
    assert env is not None
    ev = Evaluator(
        {**env, "score": s},
        score_tensors,
        float_dtype=plan.compute_dtype,
        scalars=spec.score_mod.scalar_values,
    )
    s_mod = ev(spec.score_mod.output).to(plan.compute_dtype)
    return s_mod.expand_as(s), ev


def _check_loads(spec: AttentionSpec, ev: Evaluator | None, allowed: torch.Tensor | None) -> None:
    """Raise if the score_mod read out of bounds at an attended pair (`allowed` None: all are)."""
    if ev is None or ev.out_of_bounds is None:
        return
    bad = ev.out_of_bounds if allowed is None else ev.out_of_bounds & allowed
    if bool(bad.any()):
        assert spec.score_mod is not None
        raise IndexError(
            f"score_mod {spec.score_mod.name!r} indexes a captured tensor out of bounds for an "
            "attended (q_idx, kv_idx) pair; captured tensors must cover every pair the mask allows"
        )


def _forward(
    plan: _Plan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_tensors: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse); `out` is in the compute dtype, not yet rounded to q's (Note [Delta from the
    unrounded output])."""
    spec = plan.spec
    cd = plan.compute_dtype
    B, Hq, Lq = spec.batch, spec.heads_q, spec.len_q
    out = empty_like_query(q, (B, Hq, Lq, spec.head_dim_v), cd)  # Note [Output layout]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.empty(B, Hq, Lq, dtype=lse_dtype, device=q.device)
    max_scores = torch.empty(B, Hq, Lq, dtype=lse_dtype, device=q.device)
    for i in range(spec.block_mask.num_q_blocks):
        r0, r1 = plan.rows(i)
        qg = _grouped(q[:, :, r0:r1].to(cd) * spec.scale, spec)
        m_i = torch.full((B, Hq, r1 - r0, 1), -math.inf, dtype=cd, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros(B, Hq, r1 - r0, spec.head_dim_v, dtype=cd, device=q.device)
        for step in plan.steps(i):
            k_c = plan.columns(step, k).to(cd)
            v_c = plan.columns(step, v).to(cd)
            env = plan.env(r0, r1, step) if plan.needs_env(step) else None
            s, ev = _scores(plan, qg, k_c, env, score_tensors)
            if step.all_full:
                _check_loads(spec, ev, None)
            else:
                assert env is not None
                allowed = plan.allowed(env, step)
                _check_loads(spec, ev, allowed)
                s = s.masked_fill(~allowed, -math.inf)
            if plan.paged is not None:  # keys past each sequence's length
                s = s.masked_fill(~plan.paged.in_length(step.cols), -math.inf)
            m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))
            m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)  # rows with nothing yet
            p = torch.exp(s - m_safe)
            alpha = torch.exp(m_i - m_safe)
            l_i = l_i * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + _ungrouped(torch.matmul(_grouped(p, spec), v_c), spec)
            m_i = m_new
        empty = l_i == 0
        out[:, :, r0:r1] = torch.where(empty, 0.0, acc / torch.where(empty, 1.0, l_i))
        row_lse = torch.where(empty, -math.inf, m_i + torch.log(torch.where(empty, 1.0, l_i)))
        lse[:, :, r0:r1] = row_lse.squeeze(-1).to(lse_dtype)
        max_scores[:, :, r0:r1] = torch.where(empty, -math.inf, m_i).squeeze(-1).to(lse_dtype)
    plan.max_scores = max_scores
    return out, lse


# Note [Accumulating captured-tensor gradients]
# The gradient of one entry of a captured tensor is a sum over every pair that loads it: a 0-dim
# temperature or a per-head scale receives B * Lq * Lkv terms, one relative-bias entry about B * L.
# Added one by one into a float32 buffer (what index_put_ with accumulate does) the rounding error
# grows with that count; the tests measured 5x the error of eager torch for a per-head entry read by
# 3000 pairs. So contributions are first summed over the dims their indices do not vary along (a
# load of `scale[h]` sums over b, q_idx and kv_idx with torch's pairwise sum, which also makes the
# scatter much smaller), and the buffers accumulate in float64 (float32 only where a device lacks
# float64), twice the size of the captured tensors that need grad, only for the backward.


def _accumulation_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _scatter_capture_grads(
    grad: ScoreModGradient,
    ev: Evaluator,
    ds: torch.Tensor,
    allowed: torch.Tensor | None,
    buffers: dict[int, torch.Tensor],
) -> None:
    """buffers[slot][indices] += ds * d_load for every load of a captured tensor that needs grad.

    `allowed` None means every pair is attended. See Note [Accumulating captured-tensor gradients].
    """
    for lg in grad.loads:
        contribution = ds * ev(lg.d_load)
        if allowed is not None:
            contribution = torch.where(allowed, contribution, 0.0)
        buf = buffers[lg.slot]
        if not lg.indices:
            buf += contribution.sum()
            continue
        # out-of-range indices occur only where the contribution is 0 (Note [Loads out of bounds])
        indices = [
            ev(node).long().clamp(0, buf.shape[dim] - 1) for dim, node in enumerate(lg.indices)
        ]
        index_shape = torch.broadcast_tensors(*indices)[0].shape  # broadcast_shapes imports sympy
        index_shape = (1,) * (contribution.ndim - len(index_shape)) + tuple(index_shape)
        constant_dims = [
            d for d, n in enumerate(index_shape) if n == 1 and contribution.shape[d] > 1
        ]
        if constant_dims:
            contribution = contribution.sum(dim=constant_dims, keepdim=True)
        shape = contribution.shape
        index = tuple(i.expand(shape) for i in indices)
        buf.index_put_(index, contribution.to(buf.dtype), accumulate=True)


def _backward(
    plan: _Plan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    score_tensors: tuple[torch.Tensor, ...],
    grad_slots: frozenset[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    spec = plan.spec
    cd = plan.compute_dtype
    dq = torch.zeros(q.shape, dtype=cd, device=q.device)
    dk = torch.zeros(k.shape, dtype=cd, device=q.device)
    dv = torch.zeros(v.shape, dtype=cd, device=q.device)
    buffers = {
        slot: torch.zeros(
            score_tensors[slot].shape,
            dtype=_accumulation_dtype(score_tensors[slot].device),
            device=score_tensors[slot].device,
        )
        for slot in grad_slots
    }
    grad = spec.score_mod.gradient(grad_slots) if spec.score_mod is not None else None
    # delta_i = sum_j p_ij dp_ij = rowsum(dO * O); a gradient of the LSE adds -dlse (d lse/d s = p).
    # `out` is the unrounded output (Note [Delta from the unrounded output]).
    delta = (dout.to(cd) * out).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(cd)
    for i in range(spec.block_mask.num_q_blocks):
        r0, r1 = plan.rows(i)
        qg = _grouped(q[:, :, r0:r1].to(cd) * spec.scale, spec)
        dog = _grouped(dout[:, :, r0:r1].to(cd), spec)
        lse_i = lse[:, :, r0:r1, None].to(cd)
        lse_safe = torch.where(torch.isneginf(lse_i), math.inf, lse_i)  # empty rows: p = 0
        delta_i = delta[:, :, r0:r1, None]
        dqg = torch.zeros_like(qg)
        for step in plan.steps(i):
            k_c = step.columns(k).to(cd)
            v_c = step.columns(v).to(cd)
            env = plan.env(r0, r1, step) if plan.needs_env(step) else None
            s, ev = _scores(plan, qg, k_c, env, score_tensors)
            allowed = None
            p = torch.exp(s - lse_safe)
            if not step.all_full:
                assert env is not None
                allowed = plan.allowed(env, step)
                p = p.masked_fill_(~allowed, 0.0)
            dp = _ungrouped(torch.matmul(dog, v_c.transpose(-1, -2)), spec)
            ds = dp.sub_(delta_i).mul_(p)  # gradient w.r.t. the modified score
            if grad is not None and ev is not None:
                if grad.loads:
                    _scatter_capture_grads(grad, ev, ds, allowed, buffers)
                ds = ds * ev(grad.d_score)
                if allowed is not None:  # d_score may be inf or NaN at excluded pairs
                    ds = torch.where(allowed, ds, 0.0)
            dsg = _grouped(ds, spec)
            dqg += torch.matmul(dsg, k_c)
            dk_c = torch.matmul(dsg.transpose(-1, -2), qg)  # qg holds the scale
            step.add_columns(dk, _kv_batch(dk_c, spec))
            dv_c = torch.matmul(_grouped(p, spec).transpose(-1, -2), dog)
            step.add_columns(dv, _kv_batch(dv_c, spec))
        dq[:, :, r0:r1] = _ungrouped(dqg, spec)
    return dq * spec.scale, dk, dv, buffers


# Note [Delta from the unrounded output]
# The backward needs delta_i = sum_j p_ij dp_ij, computed as rowsum(dO * O). With float16/bfloat16
# inputs, O rounded to the input dtype differs from sum_j p_ij v_j by up to half an ulp, while the
# dp_ij it is subtracted from are exact float32 products: each row's ds then carries an error of
# about |dO| * ulp(O), invisible in dq/dk/dv but summed over every row and head in the gradient of a
# captured scalar (a temperature): the tests measured 10x the error of eager torch in bfloat16. So
# the backward uses the float32 output from before the rounding (O(Lq * Ev) memory, like O itself).


class _TiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, q, k, v, *score_tensors):
        out, lse = _forward(plan, q, k, v, score_tensors)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse, *score_tensors)
        ctx.mark_non_differentiable(plan.max_scores)
        return out.to(q.dtype), lse, plan.max_scores

    @staticmethod
    def backward(ctx, dout, dlse, dmax=None):
        q, k, v, out, lse, *score_tensors = ctx.saved_tensors
        plan: _Plan = ctx.plan
        grad_slots = frozenset(
            i
            for i, t in enumerate(score_tensors)
            if ctx.needs_input_grad[4 + i] and t.dtype.is_floating_point
        )
        if dout is None:
            dout = torch.zeros(out.shape, dtype=q.dtype, device=q.device)
        dq, dk, dv, buffers = _backward(
            plan, q, k, v, out, lse, dout, dlse, tuple(score_tensors), grad_slots
        )
        capture_grads = [
            buffers[i].to(t.dtype) if i in buffers else None for i, t in enumerate(score_tensors)
        ]
        return None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *capture_grads


class TiledBackend(Backend):
    """PyTorch implementation of the tiled algorithm; the default where no GPU kernel applies."""

    name = "tiled"
    auto_device_types = frozenset({"cpu", "cuda", "mps", "xpu"})
    supports_paged = True  # forward only; flexfa.api refuses paged calls that need gradients

    def supports(self, spec: AttentionSpec) -> Support:
        return Support.yes()

    def forward(self, spec, q, k, v):
        score_tensors = spec.score_mod.tensors if spec.score_mod is not None else ()
        plan = _Plan(spec, q.device)
        out, lse = _forward(plan, q, k, v, score_tensors)
        return out.to(q.dtype), lse, out, plan.max_scores if spec.max_scores else None

    def backward(self, spec, q, k, v, saved, lse, dout, dlse, grad_slots):
        score_tensors = spec.score_mod.tensors if spec.score_mod is not None else ()
        plan = _Plan(spec, q.device)
        dq, dk, dv, buffers = _backward(
            plan, q, k, v, saved.to(plan.compute_dtype), lse, dout, dlse, score_tensors, grad_slots
        )
        grads = {i: b.to(score_tensors[i].dtype) for i, b in buffers.items()}
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), grads

    def run(self, spec, q, k, v):
        plan = _Plan(spec, q.device)
        score_tensors = spec.score_mod.tensors if spec.score_mod is not None else ()
        if spec.needs_grad:
            out, lse, max_scores = _TiledFunction.apply(plan, q, k, v, *score_tensors)
        else:
            with torch.no_grad():
                out, lse = _forward(plan, q, k, v, score_tensors)
                out, max_scores = out.to(q.dtype), plan.max_scores
        return (out, lse, max_scores) if spec.max_scores else (out, lse)


register(TiledBackend())
