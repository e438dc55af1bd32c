"""`method="auto"`: choosing between the ring and the all-gather by a simple cost model.

# Note [Auto cost model]
# Both methods move the same bytes: every rank receives the other W - 1 K/V shards. They differ in
# what hides the transfer and what it costs in memory and launches:
#   ring      = sum over steps s < W-1 of max(compute_s, transfer of one shard) + compute_{W-1}
#               (each transfer overlaps the step before it), plus one launch per non-empty block;
#   allgather = (W - 1) transfers of one shard, not overlapped, + all compute, with one launch per
#               query piece; it also holds all W shards of K/V at once.
# compute_s is the step's non-empty tiles times the tile's floating-point work (forward: 2 * (E + Ev)
# per pair and head) over the device's throughput; a transfer is its bytes over the link bandwidth
# plus a latency. The constants are round figures per device type. CPU: a gloo exchange of 1-64 MiB
# each way between two processes of one host measured 0.7-1.0 GB/s and 0.24 ms for a tiny message;
# the tiled backend's causal forward at L = 16384 (README) does about 4e10 FLOP/s on one quiet core,
# taken at half for shared machines; the per-CP-block overhead is a guess. CUDA: nominal NVLink and
# tensor-core rates, not yet measured. When the gathered K/V would not fit in half the free GPU
# memory, the ring is chosen whatever the times. Each rank knows only its own blocks, so the ranks
# take the maximum of their estimates in one small all-reduce before choosing (they must agree).
# The choice and its numbers are logged at DEBUG level.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from flexfa.distributed import blocks


@dataclasses.dataclass(frozen=True)
class Machine:
    """Round rates of one device type: FLOP/s of attention, link bytes/s, seconds per message and
    per kernel launch."""

    flops: float
    bandwidth: float
    latency: float
    launch: float


MACHINES = {
    "cuda": Machine(flops=2.0e14, bandwidth=1.0e11, latency=3.0e-5, launch=2.0e-5),
    "cpu": Machine(flops=2.0e10, bandwidth=1.0e9, latency=2.0e-4, launch=5.0e-4),
}


@dataclasses.dataclass(frozen=True)
class Choice:
    method: str
    reason: str
    ring_s: float
    allgather_s: float


def estimate(plan, q: torch.Tensor, Hkv: int, E: int, Ev: int) -> tuple[float, float, int]:
    """(ring seconds, all-gather seconds, bytes of the gathered K/V) for `plan`'s call."""
    m = MACHINES.get(q.device.type, MACHINES["cuda"])
    g, layout = plan.g, plan.layout
    B, Hq = plan.B, plan.Hq
    compute = []
    for todo in plan.steps:
        pairs = 0.0
        for _, _, bm in todo:
            per = bm.block_size.q * bm.block_size.kv * (B * Hq) / (bm.batch * bm.heads)
            pairs += sum(blocks.tile_counts(bm)) * per
        compute.append(pairs * 2 * (E + Ev) / m.flops + len(todo) * m.launch)
    elem = q.element_size()
    shard = B * Hkv * layout.max_local_length * (E + Ev) * elem
    transfer = shard / m.bandwidth + m.latency
    W = g.world_size
    ring = sum(max(c, transfer) for c in compute[:-1]) + compute[-1]
    launches = len(plan.q_chunks) * m.launch
    allgather = (
        (W - 1) * shard / m.bandwidth
        + m.latency
        + sum(compute)
        - sum(len(todo) * m.launch for todo in plan.steps)
        + launches
    )
    return ring, allgather, shard * W


def choose(plan, q: torch.Tensor, Hkv: int, E: int, Ev: int) -> Choice:
    """The method for `plan`'s call, the same on every rank of its group.

    Each rank estimates its own times (it knows only its own blocks); one small all-reduce takes
    the slowest rank's estimates and whether any rank lacks the memory for the all-gather, so all
    ranks choose alike (a rank on the ring while another gathers would deadlock)."""
    ring, allgather, gathered = estimate(plan, q, Hkv, E, Ev)
    free = None
    if q.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(q.device)
    short = float(free is not None and gathered > free // 2)
    if plan.g.world_size > 1:
        t = torch.tensor([ring, allgather, short], dtype=torch.float64, device=q.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=plan.g.group)
        ring, allgather, short = t.tolist()
    if short:
        return Choice(
            "ring",
            f"the gathered K/V ({gathered / 2**20:.0f} MiB) would exceed half the free GPU memory "
            "of a rank",
            ring,
            allgather,
        )
    method = "ring" if ring <= allgather else "allgather"
    reason = (
        f"estimated ring {ring * 1e3:.3f} ms vs allgather {allgather * 1e3:.3f} ms on the slowest "
        f"rank (W={plan.g.world_size}; this rank computes {sum(len(t) for t in plan.steps)} of "
        f"{plan.total_blocks} CP blocks)"
    )
    return Choice(method, reason, ring, allgather)
