"""Ring attention: K/V shards travel around the group while each rank attends with its queries.

# Note [Ring schedule]
# At step s (0 <= s < W) rank r holds the K/V shard of rank (r - s) mod W. Before attending to it,
# it posts the send of that shard to rank r + 1 and the receive of the next one from rank r - 1
# (one `batch_isend_irecv`), so the transfer runs while the block in hand is computed: on GPUs NCCL
# runs P2P on its own stream, so compute (on the current stream) and communication overlap, and
# `wait()` only orders the next step after the receive. A (step, query piece, key piece) triple
# whose tiles are all empty under the mask is skipped without launching anything; the K/V still
# travel, since later ranks need them. Partial results are merged by their LSEs as they come
# (`flexfa.merge_attention`, in float32).
#
# The backward runs the same ring. With the global output and LSE saved by the forward, each block
# yields its exact share of dq, dk, dv (Note [Block backward from the global LSE]). dq stays home;
# dk/dv accumulators travel with their K/V one step behind: after step s, rank r passes the
# accumulator of shard (r - s) on to rank r + 1, posted right after the block is done and waited on
# only before the next addition. After W passes every accumulator is back at its owner, complete.
"""

from __future__ import annotations

import torch

from flexfa import backends
from flexfa.distributed import blocks
from flexfa.distributed.comm import Group, exchange, wait
from flexfa.distributed.layout import Layout
from flexfa.merge import merge_attention


class RingPlan:
    """This rank's ring: for each step, the non-empty blocks and their block masks."""

    def __init__(
        self,
        g: Group,
        layout: Layout,
        opts: blocks.Options,
        B: int,
        Hq: int,
        Hkv: int,
        E: int,
        Ev: int,
        device: torch.device,
    ) -> None:
        self.g, self.layout, self.opts = g, layout, opts
        self.B, self.Hq, self.Hkv, self.E, self.Ev = B, Hq, Hkv, E, Ev
        self.q_chunks = layout.chunks(g.rank)
        self.steps: list[list[tuple[int, int, object]]] = []
        self.total_blocks = 0
        for s in range(g.world_size):
            src = (g.rank - s) % g.world_size
            todo = []
            for i, (_, qs, qn) in enumerate(self.q_chunks):
                for j, (_, ks, kn) in enumerate(layout.chunks(src)):
                    self.total_blocks += 1
                    bm = blocks.block_mask(opts, B, Hq, qs, qn, ks, kn, device)
                    if bm is not None:
                        todo.append((i, j, bm))
            self.steps.append(todo)

    def source(self, step: int) -> int:
        return (self.g.rank - step) % self.g.world_size

    def computed_blocks(self) -> list[tuple[int, int, int]]:
        """(step, query piece, key piece) of every block this rank computes."""
        return [(s, i, j) for s, todo in enumerate(self.steps) for i, j, _ in todo]

    def _kv_shapes(self, src: int, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        n = self.layout.local_length(src)
        return [((self.B, self.Hkv, n, self.E), dtype), ((self.B, self.Hkv, n, self.Ev), dtype)]

    def _block(self, step: int, i: int, j: int, q, k, v):
        ql, qs, qn = self.q_chunks[i]
        kl, ks, kn = self.layout.chunks(self.source(step))[j]
        q_i = q[..., ql : ql + qn, :]
        return (ql, qn), (kl, kn), q_i, k[..., kl : kl + kn, :], v[..., kl : kl + kn, :], qs, ks

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out float32, lse float32) of this rank's queries over the whole sequence."""
        g = self.g
        acc: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.q_chunks)
        for s in range(g.world_size):
            if s < g.world_size - 1:
                reqs, nxt = exchange(g, [k, v], self._kv_shapes(self.source(s + 1), k.dtype))
            for i, j, bm in self.steps[s]:
                _, _, q_i, k_j, v_j, qs, ks = self._block(s, i, j, q, k, v)
                spec = blocks.block_spec(self.opts, bm, q_i, k_j, v_j, qs, ks, needs_grad=False)
                impl = backends.select(self.opts.backend, spec)
                o, lse = blocks.forward(impl, spec, q_i, k_j, v_j)
                o = o.float()
                acc[i] = (o, lse) if acc[i] is None else merge_attention(*acc[i], o, lse)
            if s < g.world_size - 1:
                wait(reqs)
                k, v = nxt
        outs, lses = [], []
        for a, (_, _, qn) in zip(acc, self.q_chunks):
            if a is None:  # no allowed key anywhere: out 0, lse -inf
                a = (
                    q.new_zeros((self.B, self.Hq, qn, self.Ev), dtype=torch.float32),
                    q.new_full((self.B, self.Hq, qn), float("-inf"), dtype=torch.float32),
                )
            outs.append(a[0])
            lses.append(a[1])
        return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)

    def backward(self, q, k, v, out, lse, dout, dlse):
        """dq, dk, dv of this rank's shards and {captured tensor: gradient from its queries}."""
        g = self.g
        W = g.world_size
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in (k, v)]
        grads: dict[torch.Tensor, torch.Tensor] = {}
        pending = None
        for s in range(W):
            if s < W - 1:
                reqs, nxt = exchange(g, [k, v], self._kv_shapes(self.source(s + 1), k.dtype))
            parts: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
            for i, j, bm in self.steps[s]:
                (ql, qn), (kl, kn), q_i, k_j, v_j, qs, ks = self._block(s, i, j, q, k, v)
                spec = blocks.block_spec(self.opts, bm, q_i, k_j, v_j, qs, ks, needs_grad=True)
                impl = backends.select(self.opts.backend, spec)
                rows = slice(ql, ql + qn)
                dq_i, dk_j, dv_j, gr = blocks.backward(
                    impl,
                    spec,
                    q_i,
                    k_j,
                    v_j,
                    out[..., rows, :],
                    lse[..., rows],
                    dout[..., rows, :],
                    None if dlse is None else dlse[..., rows],
                )
                dq[..., rows, :] += dq_i.float()
                parts.append((kl, kn, dk_j, dv_j))
                for t, gt in gr.items():
                    grads[t] = grads[t] + gt if t in grads else gt
            if pending is not None:  # the accumulators of this step's shard, from rank - 1
                wait(pending[0])
                dkv = pending[1]
            for kl, kn, dk_j, dv_j in parts:
                dkv[0][..., kl : kl + kn, :] += dk_j.float()
                dkv[1][..., kl : kl + kn, :] += dv_j.float()
            if W > 1:
                shapes = self._kv_shapes(self.source(s + 1), torch.float32)
                pending = exchange(g, dkv, shapes)
            if s < W - 1:
                wait(reqs)
                k, v = nxt
        if pending is not None:
            wait(pending[0])
            dkv = pending[1]
        return dq, dkv[0], dkv[1], grads


class RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: RingPlan, q, k, v, *captures):
        out, lse = plan.forward(q, k, v)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.captures = captures
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan: RingPlan = ctx.plan
        dq, dk, dv, grads = plan.backward(q, k, v, out, lse, dout, dlse)
        capture_grads = []
        for t, needed in zip(ctx.captures, ctx.needs_input_grad[4:]):
            gt = grads.get(t) if needed else None
            capture_grads.append(None if gt is None else gt.to(t.dtype))
        return None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *capture_grads
