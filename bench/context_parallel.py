"""Time of context-parallel attention (ring, all-gather) beside one process, and the ring's overlap.

Spawns --world processes (gloo on the CPU, NCCL on GPUs, one GPU per rank) and measures, for a
causal mask (balance head_tail) and a document-causal mask (balance Document(lengths)):

- `one process`: flexfa.attention on the whole sequence, in rank 0 alone while the others wait;
- `ring` and `allgather`: context_parallel_attention on every rank (the slowest rank's time);
- `ring, compute alone`: the ring with its transfers replaced by local copies of the same shapes,
  so `ring` minus this is the communication the ring failed to hide.

Forward and forward+backward, the median of --repeat runs after one warm-up (tracing, block masks
and kernels are built in the warm-up). Printed as a markdown table.

    python bench/context_parallel.py --world 2 --len 4096 --threads 1
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flexfa
from flexfa.distributed import Document, context_parallel_attention, ring, shard_sequence
from flexfa.masks import and_masks, causal, document


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, repeat, device):
    fn()
    times = []
    for _ in range(repeat):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        t = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        t = t.to(device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time
        times.append(float(t))
    return statistics.median(times)


def _no_comm_exchange(g, tensors, recv_like):
    """The ring's exchange without communication: buffers of the shapes it would receive."""
    device = tensors[0].device
    return [[], []], [torch.randn(shape, device=device).to(dtype) for shape, dtype in recv_like]


def _case(rank, device, args, q, k, v, mask, balance):
    """{implementation: (forward s, forward+backward s)} for one mask."""
    ql, kl, vl = (
        t.detach().requires_grad_(True) for t in shard_sequence((q, k, v), balance=balance)
    )
    qf, kf, vf = (t.detach().requires_grad_(True) for t in (q, k, v))

    def one_fwd():
        with torch.no_grad():
            flexfa.attention(qf, kf, vf, block_mask=mask)

    def one_fb():
        flexfa.attention(qf, kf, vf, block_mask=mask).sum().backward()

    def cp(method, backward):
        def run():
            with torch.set_grad_enabled(backward):
                out = context_parallel_attention(
                    ql, kl, vl, mask_mod=mask, balance=balance, method=method
                )
                if backward:
                    out.sum().backward()

        return run

    result = {}
    # One process: rank 0 alone (barriers inside _time need every rank, so time it directly).
    dist.barrier()
    if rank == 0:
        tf, tb = [], []
        one_fwd(), one_fb()
        for _ in range(args.repeat):
            _sync(device)
            s = time.perf_counter()
            one_fwd()
            _sync(device)
            tf.append(time.perf_counter() - s)
            s = time.perf_counter()
            one_fb()
            _sync(device)
            tb.append(time.perf_counter() - s)
        result["one process"] = (statistics.median(tf), statistics.median(tb))
    dist.barrier()
    for method in ("ring", "allgather"):
        result[method] = (
            _time(cp(method, False), args.repeat, device),
            _time(cp(method, True), args.repeat, device),
        )
    real = ring.exchange
    ring.exchange = _no_comm_exchange
    try:
        result["ring, compute alone"] = (
            _time(cp("ring", False), args.repeat, device),
            _time(cp("ring", True), args.repeat, device),
        )
    finally:
        ring.exchange = real
    return result


def _worker(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    if torch.cuda.is_available():
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
        dtype = torch.bfloat16
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
        dtype = torch.float32
    L, H, E = args.len, args.heads, args.dim
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, L, E, generator=gen).to(device, dtype) for _ in range(3))
    lengths, total = [], 0
    while total < L:
        n = min(int(torch.randint(L // 32, L // 4, (1,), generator=gen)), L - total)
        lengths.append(n)
        total += n
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    cases = [
        ("causal", causal, "head_tail"),
        ("document", and_masks(causal, document(doc)), Document(lengths)),
    ]
    rows = [
        (name, _case(rank, device, args, q, k, v, mask, balance)) for name, mask, balance in cases
    ]
    if rank == 0:
        print(
            f"{world} ranks, {device.type} ({dist.get_backend()}), L={L}, H={H}, E={E}, {dtype}, "
            f"{args.threads} thread(s) per rank, median of {args.repeat}"
        )
        print("| mask | implementation | forward | forward + backward |")
        print("| --- | --- | ---: | ---: |")
        for name, result in rows:
            for impl, (f, b) in result.items():
                print(f"| {name} | {impl} | {f * 1e3:.1f} ms | {b * 1e3:.1f} ms |")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.world, port, args), nprocs=args.world)


if __name__ == "__main__":
    main()
