"""One training step of a long-context, document-masked model with its sequence sharded across ranks.

Every rank holds the same small model and the same packed sequence (documents of random lengths,
attention causal inside each document, a learned relative-position bias per head). Each rank keeps
its shard of the tokens, runs the per-token layers on it, and the attention layer runs over the
whole sequence with `flexfa.distributed.context_parallel_attention`. Parameter gradients are summed
over the group (what DDP/FSDP over the context-parallel dimension does), which for the bias table
captured by the score_mod is the rule "each rank holds the part from its own queries". The loss,
every gradient and the parameters after one optimizer step are checked against one process
running `flexfa.attention` on the unsharded sequence.

    torchrun --nproc_per_node=2 examples/context_parallel.py                  # gloo on CPU, NCCL on GPUs
    torchrun --nproc_per_node=2 examples/context_parallel.py --method allgather --balance head_tail
    python examples/context_parallel.py                                       # one process (world of 1)
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flexfa
from flexfa.distributed import (
    Document,
    context_parallel_attention,
    shard_sequence,
    unshard_sequence,
)
from flexfa.masks import and_masks, causal, document


def pack(seq_len: int, min_len: int, max_len: int, generator) -> list[int]:
    """Random document lengths in [min_len, max_len) filling exactly seq_len tokens."""
    lengths, total = [], 0
    while total < seq_len:
        n = min(int(torch.randint(min_len, max_len, (1,), generator=generator)), seq_len - total)
        lengths.append(n)
        total += n
    return lengths


class Model(torch.nn.Module):
    """Embedding -> attention with a learned relative bias (doc-causal) -> next-token logits."""

    def __init__(self, vocab: int, dim: int, heads: int, max_distance: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.max_distance = heads, dim // heads, max_distance
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.rel_bias = torch.nn.Parameter(0.1 * torch.randn(heads, max_distance + 1))

    def score_mod(self):
        table, max_distance = self.rel_bias, self.max_distance

        def relative_bias(score, b, h, q_idx, kv_idx):  # q_idx, kv_idx: global positions
            return score + table[h, torch.clamp(q_idx - kv_idx, 0, max_distance)]

        return relative_bias

    def forward(self, tokens, attend, dtype):
        B, L = tokens.shape
        x = self.embed(tokens)
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = attend(q.to(dtype), k.to(dtype), v.to(dtype), self.score_mod())
        y = y.to(x.dtype).transpose(1, 2).reshape(B, L, -1)
        return self.head(x + self.out(y))


def init() -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ:  # plain `python`: a world of one process
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="ring", choices=["ring", "allgather", "auto"])
    parser.add_argument("--balance", default="document", choices=["document", "head_tail", "none"])
    parser.add_argument("--seq-len", type=int, default=None)
    args = parser.parse_args()
    rank, world, device = init()
    gpu = device.type == "cuda"
    seq_len = args.seq_len or (65536 if gpu else 2048)
    dim, heads, vocab = (512, 8, 256) if gpu else (64, 4, 64)
    dtype = torch.bfloat16 if gpu else torch.float32
    # Every rank draws the same sequence and the same initial model.
    g = torch.Generator().manual_seed(0)
    lengths = pack(seq_len, seq_len // 64, seq_len // 8, g)
    doc_ids = torch.repeat_interleave(
        torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths)
    ).to(device)
    period = 16  # tokens repeat inside a document, so attention to it lowers the loss
    base = torch.randint(0, vocab, (1, seq_len // period + 1), generator=g)
    tokens = base.repeat_interleave(period, dim=1)[:, : seq_len + 1].to(device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    mask_mod = and_masks(causal, document(doc_ids))
    balance = Document(lengths) if args.balance == "document" else args.balance

    torch.manual_seed(0)
    model = Model(vocab, dim, heads, max_distance=256).to(device)
    reference = Model(vocab, dim, heads, max_distance=256).to(device)
    reference.load_state_dict(model.state_dict())

    # Context parallel: this rank's tokens, attention over the whole sequence.
    def cp_attend(q, k, v, score_mod):
        return context_parallel_attention(
            q, k, v, score_mod, mask_mod, balance=balance, method=args.method
        )

    inputs_l = shard_sequence(inputs, balance=balance, dim=-1)
    targets_l = shard_sequence(targets, balance=balance, dim=-1)
    if gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    logits = model(inputs_l, cp_attend, dtype)
    # The mean over all tokens of the sequence: each rank's sum over its tokens / the total.
    loss_l = F.cross_entropy(logits.flatten(0, 1).float(), targets_l.flatten(), reduction="sum")
    (loss_l / seq_len).backward()
    for p in model.parameters():  # what DDP/FSDP over the context-parallel dimension does
        dist.all_reduce(p.grad)
    loss = loss_l.detach().clone()
    dist.all_reduce(loss)
    loss = loss / seq_len
    if gpu:
        torch.cuda.synchronize()
    cp_time = time.perf_counter() - start
    logits_full = unshard_sequence(logits.detach(), balance=balance, dim=1)

    # One process: the same step with flexfa.attention on the unsharded sequence.
    def attend(q, k, v, score_mod):
        return flexfa.attention(q, k, v, score_mod, mask_mod)

    start = time.perf_counter()
    ref_logits = reference(inputs, attend, dtype)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1).float(), targets.flatten())
    ref_loss.backward()
    if gpu:
        torch.cuda.synchronize()
    ref_time = time.perf_counter() - start

    for m in (model, reference):
        torch.optim.SGD(m.parameters(), lr=0.1).step()

    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    errors = {"loss": (loss - ref_loss).abs().item() / max(ref_loss.abs().item(), 1e-6)}
    errors["logits"] = ((logits_full - ref_logits).abs().max() / ref_logits.abs().max()).item()
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        errors[f"grad {name}"] = ((p.grad - r.grad).abs().max() / r.grad.abs().max()).item()
        errors[f"after step {name}"] = ((p - r).abs().max() / r.abs().max()).item()
    worst = max(errors, key=errors.get)
    if rank == 0:
        print(
            f"{world} rank(s) on {device.type} ({dist.get_backend()}), {seq_len} tokens in "
            f"{len(lengths)} documents, method={args.method}, balance={args.balance}, {dtype}"
        )
        print(f"loss {loss.item():.5f} (one process: {ref_loss.item():.5f})")
        print(f"forward+backward: context parallel {cp_time:.3f} s, one process {ref_time:.3f} s")
        print(f"largest relative difference from one process: {errors[worst]:.2e} ({worst})")
    ok = errors[worst] <= tol
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(f"rank {rank}: {worst} differs from one process by {errors[worst]:.2e}")
    if rank == 0:
        print("matches one process")


if __name__ == "__main__":
    main()
