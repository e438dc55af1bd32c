"""The communication context parallelism needs, on torch.distributed (NCCL on GPUs, gloo on the CPU).

Nothing here has its own transport: process groups, `batch_isend_irecv`, `all_gather` and
`reduce_scatter` carry everything.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from flexfa.distributed.layout import Layout


@dataclasses.dataclass(frozen=True)
class Group:
    """A process group with this process's rank in it and the global ranks of its members."""

    group: object
    rank: int
    world_size: int
    global_ranks: tuple[int, ...]

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world_size


def resolve_group(group: object) -> Group:
    """`group`: a ProcessGroup, a 1-D DeviceMesh, or None for the default group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "flexfa.distributed needs an initialized process group: call "
            "torch.distributed.init_process_group first (e.g. under torchrun)"
        )
    if group is None:
        group = dist.group.WORLD
    elif hasattr(group, "get_group") and hasattr(group, "ndim"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(
                f"group must be a 1-D DeviceMesh (the context-parallel dimension), got a "
                f"{group.ndim}-D mesh; pass mesh['cp'] or mesh.get_group('cp')"
            )
        group = group.get_group()
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of `group`")
    world = dist.get_world_size(group)
    ranks = tuple(dist.get_global_rank(group, r) for r in range(world))
    return Group(group, rank, world, ranks)


def exchange(
    g: Group, tensors: list[torch.Tensor], recv_like: list[tuple[tuple[int, ...], torch.dtype]]
) -> tuple[list, list[torch.Tensor]]:
    """Send `tensors` to the next rank and receive tensors of the given shapes from the previous
    one, asynchronously; returns the requests to wait on and the receive buffers."""
    device = tensors[0].device
    bufs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in recv_like]
    sent = [t.contiguous() for t in tensors]  # kept alive until the sends complete
    ops = [dist.P2POp(dist.isend, t, g.global_ranks[g.next], g.group) for t in sent]
    ops += [dist.P2POp(dist.irecv, b, g.global_ranks[g.prev], g.group) for b in bufs]
    return [dist.batch_isend_irecv(ops), sent], bufs


def wait(requests: list) -> None:
    """Wait for the requests of `exchange` (and release its send buffers)."""
    for r in requests[0]:
        r.wait()
    requests.clear()


def _pad(x: torch.Tensor, length: int) -> torch.Tensor:
    if x.shape[-2] == length:
        return x.contiguous()
    pad = x.new_zeros((*x.shape[:-2], length - x.shape[-2], x.shape[-1]))
    return torch.cat([x, pad], dim=-2)


def gather_sequence(g: Group, layout: Layout, x: torch.Tensor) -> torch.Tensor:
    """Every rank's shard of x (B, H, local length, E), in global order (B, H, length, E)."""
    m = layout.max_local_length
    parts = [torch.empty_like(_pad(x, m)) for _ in range(g.world_size)]
    dist.all_gather(parts, _pad(x, m), group=g.group)
    full = x.new_empty((*x.shape[:-2], layout.length, x.shape[-1]))
    for r, part in enumerate(parts):
        for local, start, n in layout.chunks(r):
            full[..., start : start + n, :] = part[..., local : local + n, :]
    return full


def scatter_sum(g: Group, layout: Layout, full: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of `full` (global order), each rank receiving its own positions."""
    m = layout.max_local_length
    parts = []
    for r in range(g.world_size):
        pieces = [full[..., start : start + n, :] for start, n in layout.pieces[r]]
        parts.append(_pad(torch.cat(pieces, dim=-2), m))
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=g.group)
    return out[..., : layout.local_length(g.rank), :]


def own_part(layout: Layout, rank: int, full: torch.Tensor, dim: int) -> torch.Tensor:
    """Rank `rank`'s positions of `full` along `dim`, in local order."""
    pieces = [full.narrow(dim, start, n) for start, n in layout.pieces[rank]]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


class GatherKV(torch.autograd.Function):
    """all_gather forward; its backward reduce-scatters the gradient back to the shards' owners."""

    @staticmethod
    def forward(ctx, g: Group, layout: Layout, x: torch.Tensor) -> torch.Tensor:
        ctx.g, ctx.layout = g, layout
        return gather_sequence(g, layout, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None, scatter_sum(ctx.g, ctx.layout, grad.contiguous())
