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

import torch

from flexfa.backends.base import Backend, Support, register
from flexfa.blockmask.block_mask import TileState
from flexfa.blockmask.exact import index_grids
from flexfa.ir.autodiff import ScoreModGradient
from flexfa.ir.evaluate import Evaluator
from flexfa.spec import AttentionSpec

# Columns processed per step (a multiple of the KV block size is used).
DEFAULT_STEP_COLUMNS = 512


@dataclasses.dataclass(frozen=True)
class _Step:
    """One step over a q-block: a group of KV blocks, their columns and their tile states."""

    cols: torch.Tensor  # int64 [n] key positions
    states: torch.Tensor  # int8 [B', H', 1, n] TileState per column
    any_partial: bool
    kv_idx: torch.Tensor  # int32 [1, 1, 1, n]


class _Plan:
    """What the forward and backward share: tile states, steps per q-block, index grids."""

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        self.spec = spec
        bm = spec.block_mask
        self.bq, self.bkv = bm.block_size.q, bm.block_size.kv
        self.states = bm.tile_states().to(device)  # [B', H', nq, nkv]
        step_cols = int(spec.kernel_options.get("step_columns", DEFAULT_STEP_COLUMNS))
        self.blocks_per_step = max(1, step_cols // self.bkv)
        self.device = device
        self.compute_dtype = torch.float64 if spec.dtype == torch.float64 else torch.float32

    def rows(self, i: int) -> tuple[int, int]:
        return i * self.bq, min((i + 1) * self.bq, self.spec.len_q)

    def steps(self, i: int) -> list[_Step]:
        row_states = self.states[:, :, i, :]  # [B', H', nkv]
        live = torch.nonzero((row_states != int(TileState.EMPTY)).flatten(0, 1).any(0)).flatten()
        steps = []
        for s0 in range(0, live.numel(), self.blocks_per_step):
            blocks = live[s0 : s0 + self.blocks_per_step].tolist()
            cols = torch.cat(
                [
                    torch.arange(
                        j * self.bkv, min((j + 1) * self.bkv, self.spec.len_kv), device=self.device
                    )
                    for j in blocks
                ]
            )
            block_of_col = cols // self.bkv
            st = row_states[:, :, block_of_col].unsqueeze(2)  # [B', H', 1, n]
            steps.append(
                _Step(
                    cols=cols,
                    states=st,
                    any_partial=bool((st == int(TileState.PARTIAL)).any()),
                    kv_idx=cols.to(torch.int32).view(1, 1, 1, -1),
                )
            )
        return steps

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


def _scores(
    plan: _Plan,
    q_i: torch.Tensor,
    k_c: torch.Tensor,
    env: dict[str, torch.Tensor],
    score_tensors: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, Evaluator | None]:
    """Scores after score_mod, [B, Hq, rows, n], and the evaluator (for derivatives)."""
    spec = plan.spec
    s = _ungrouped(torch.matmul(_grouped(q_i, spec), k_c.transpose(-1, -2)), spec) * spec.scale
    if spec.score_mod is None:
        return s, None
    ev = Evaluator({**env, "score": s}, score_tensors, float_dtype=plan.compute_dtype)
    s_mod = ev(spec.score_mod.output).to(plan.compute_dtype)
    return s_mod.expand_as(s), ev


def _check_loads(spec: AttentionSpec, ev: Evaluator | None, allowed: torch.Tensor) -> None:
    if ev is not None and ev.out_of_bounds is not None and bool((ev.out_of_bounds & allowed).any()):
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
    spec = plan.spec
    cd = plan.compute_dtype
    B, Hq, Lq = spec.batch, spec.heads_q, spec.len_q
    out = torch.empty(B, Hq, Lq, spec.head_dim_v, dtype=q.dtype, device=q.device)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.empty(B, Hq, Lq, dtype=lse_dtype, device=q.device)
    for i in range(spec.block_mask.num_q_blocks):
        r0, r1 = plan.rows(i)
        q_i = q[:, :, r0:r1].to(cd)
        m_i = torch.full((B, Hq, r1 - r0, 1), -math.inf, dtype=cd, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros(B, Hq, r1 - r0, spec.head_dim_v, dtype=cd, device=q.device)
        for step in plan.steps(i):
            k_c = k.index_select(2, step.cols).to(cd)
            v_c = v.index_select(2, step.cols).to(cd)
            env = plan.env(r0, r1, step)
            s, ev = _scores(plan, q_i, k_c, env, score_tensors)
            allowed = plan.allowed(env, step)
            _check_loads(spec, ev, allowed)
            s = s.masked_fill(~allowed, -math.inf)
            m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))
            m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)  # rows with nothing yet
            p = torch.exp(s - m_safe)
            alpha = torch.exp(m_i - m_safe)
            l_i = l_i * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + _ungrouped(torch.matmul(_grouped(p, spec), v_c), spec)
            m_i = m_new
        empty = l_i == 0
        out[:, :, r0:r1] = torch.where(empty, 0.0, acc / torch.where(empty, 1.0, l_i)).to(q.dtype)
        row_lse = torch.where(empty, -math.inf, m_i + torch.log(torch.where(empty, 1.0, l_i)))
        lse[:, :, r0:r1] = row_lse.squeeze(-1).to(lse_dtype)
    return out, lse


def _scatter_capture_grads(
    grad: ScoreModGradient,
    ev: Evaluator,
    ds: torch.Tensor,
    allowed: torch.Tensor,
    buffers: dict[int, torch.Tensor],
) -> None:
    """buffers[slot][indices] += ds * d_load for every load of a captured tensor that needs grad."""
    for lg in grad.loads:
        contribution = torch.where(allowed, ds * ev(lg.d_load), 0.0)
        buf = buffers[lg.slot]
        shape = contribution.shape
        index = []
        for dim, node in enumerate(lg.indices):
            idx = ev(node).long()
            idx = idx.clamp(0, buf.shape[dim] - 1)  # out-of-range only where contribution is 0
            index.append(idx.expand(shape))
        if not index:
            buf += contribution.sum()
            continue
        buf.index_put_(tuple(index), contribution.to(buf.dtype), accumulate=True)


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
        slot: torch.zeros(score_tensors[slot].shape, dtype=cd, device=score_tensors[slot].device)
        for slot in grad_slots
    }
    grad = spec.score_mod.gradient(grad_slots) if spec.score_mod is not None else None
    # delta_i = sum_j p_ij dp_ij = rowsum(dO * O); a gradient of the LSE adds -dlse (d lse/d s = p).
    delta = (dout.to(cd) * out.to(cd)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(cd)
    for i in range(spec.block_mask.num_q_blocks):
        r0, r1 = plan.rows(i)
        q_i = q[:, :, r0:r1].to(cd)
        do_i = dout[:, :, r0:r1].to(cd)
        lse_i = lse[:, :, r0:r1, None].to(cd)
        lse_safe = torch.where(torch.isneginf(lse_i), math.inf, lse_i)  # empty rows: p = 0
        delta_i = delta[:, :, r0:r1, None]
        dq_i = torch.zeros_like(q_i)
        for step in plan.steps(i):
            k_c = k.index_select(2, step.cols).to(cd)
            v_c = v.index_select(2, step.cols).to(cd)
            env = plan.env(r0, r1, step)
            s, ev = _scores(plan, q_i, k_c, env, score_tensors)
            allowed = plan.allowed(env, step)
            p = torch.where(allowed, torch.exp(s - lse_safe), 0.0)
            dp = _ungrouped(torch.matmul(_grouped(do_i, spec), v_c.transpose(-1, -2)), spec)
            ds = p * (dp - delta_i)  # gradient w.r.t. the modified score
            if grad is not None and ev is not None:
                if grad.loads:
                    _scatter_capture_grads(grad, ev, ds, allowed, buffers)
                ds = torch.where(allowed, ds * ev(grad.d_score), 0.0)
            dq_i += _ungrouped(torch.matmul(_grouped(ds, spec), k_c), spec)
            dk_c = torch.matmul(_grouped(ds, spec).transpose(-1, -2), _grouped(q_i, spec))
            dv_c = torch.matmul(_grouped(p, spec).transpose(-1, -2), _grouped(do_i, spec))
            dk.index_add_(2, step.cols, dk_c)
            dv.index_add_(2, step.cols, dv_c)
        dq[:, :, r0:r1] = dq_i
    return dq * spec.scale, dk * spec.scale, dv, buffers


class _TiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, q, k, v, *score_tensors):
        out, lse = _forward(plan, q, k, v, score_tensors)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse, *score_tensors)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *score_tensors = ctx.saved_tensors
        plan: _Plan = ctx.plan
        grad_slots = frozenset(
            i
            for i, t in enumerate(score_tensors)
            if ctx.needs_input_grad[4 + i] and t.dtype.is_floating_point
        )
        if dout is None:
            dout = torch.zeros_like(out)
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

    def supports(self, spec: AttentionSpec) -> Support:
        return Support.yes()

    def run(self, spec, q, k, v):
        plan = _Plan(spec, q.device)
        score_tensors = spec.score_mod.tensors if spec.score_mod is not None else ()
        if spec.needs_grad:
            return _TiledFunction.apply(plan, q, k, v, *score_tensors)
        with torch.no_grad():
            return _forward(plan, q, k, v, score_tensors)


register(TiledBackend())
