"""Packed documents with causal attention inside each document and a learned relative-position bias.

Several documents of random lengths are packed into each sequence of the batch. A query attends
only to earlier keys of its own document (a mask built from per-token document ids), and every
score gets a learned per-head bias for its clipped relative distance. A small model trains for a
few steps; gradients flow into q, k, v and into the bias table through flexfa's backward.

    python examples/document_packing.py            # GPU (Triton kernels) if available, else CPU
    python examples/document_packing.py --device cpu

On CPU flexfa runs its tiled PyTorch backend; on CUDA the generated Triton kernels.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import flexfa
from flexfa.masks import and_masks, causal, document


def pack_documents(batch: int, seq_len: int, min_len: int, max_len: int, generator) -> torch.Tensor:
    """Document id of every token, (batch, seq_len): runs of random lengths in [min_len, max_len)."""
    ids = torch.empty(batch, seq_len, dtype=torch.int32)
    for b in range(batch):
        pos, doc = 0, 0
        while pos < seq_len:
            length = int(torch.randint(min_len, max_len, (1,), generator=generator))
            ids[b, pos : pos + length] = doc
            pos += length
            doc += 1
    return ids


class PackedAttentionLM(torch.nn.Module):
    """Embedding -> one attention block with a learned relative bias -> next-token logits."""

    def __init__(self, vocab: int, dim: int, heads: int, max_distance: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.max_distance = heads, dim // heads, max_distance
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        # One bias per head and clipped distance q_idx - kv_idx in [0, max_distance] (causal).
        self.rel_bias = torch.nn.Parameter(torch.zeros(heads, max_distance + 1))

    def score_mod(self):
        table, max_distance = self.rel_bias, self.max_distance

        def relative_bias(score, b, h, q_idx, kv_idx):
            distance = torch.clamp(q_idx - kv_idx, 0, max_distance)
            return score + table[h, distance]

        return relative_bias

    def forward(self, tokens: torch.Tensor, mask_mod, dtype: torch.dtype) -> torch.Tensor:
        B, L = tokens.shape
        x = self.embed(tokens)
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = flexfa.attention(
            q.to(dtype), k.to(dtype), v.to(dtype), score_mod=self.score_mod(), block_mask=mask_mod
        )
        y = y.to(x.dtype).transpose(1, 2).reshape(B, L, -1)
        return self.head(x + self.out(y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    batch, seq_len, dim, heads = (4, 4096, 512, 8) if gpu else (2, 512, 64, 4)
    dtype = torch.bfloat16 if gpu else torch.float32
    g = torch.Generator().manual_seed(0)

    doc_ids = pack_documents(
        batch, seq_len, 32 if not gpu else 128, 160 if not gpu else 1024, g
    ).to(device)
    # Tokens are random per document, then repeated inside it, so attention within the document
    # (and a useful relative bias) lowers the loss.
    period = 16
    base = torch.randint(0, 256, (batch, seq_len // period + 1), generator=g)
    tokens = base.repeat_interleave(period, dim=1)[:, : seq_len + 1].to(device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:]

    mask_mod = and_masks(causal, document(doc_ids))
    block_mask = flexfa.create_block_mask(mask_mod, batch, None, seq_len, seq_len, device=device)
    print(
        f"device {device}, {batch} x {seq_len} tokens, {int(doc_ids.max()) + 1} documents in row 0"
    )
    print(f"block mask: {block_mask.sparsity():.1f}% of tiles skipped")

    model = PackedAttentionLM(vocab=256, dim=dim, heads=heads, max_distance=64).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(args.steps):
        start = time.perf_counter()
        logits = model(inputs, block_mask, dtype)
        loss = F.cross_entropy(logits.reshape(-1, 256).float(), targets.reshape(-1).long())
        opt.zero_grad()
        loss.backward()
        bias_grad = model.rel_bias.grad.norm().item()
        opt.step()
        if gpu:
            torch.cuda.synchronize()
        losses.append(loss.item())
        print(
            f"step {step}: loss {loss.item():.4f}  |d rel_bias| {bias_grad:.3e}  "
            f"{1e3 * (time.perf_counter() - start):.0f} ms"
        )
    if not losses[-1] < losses[0]:
        raise SystemExit("the loss did not decrease")
    if not model.rel_bias.abs().sum() > 0:
        raise SystemExit("the relative bias did not learn")
    print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; the relative bias learned (max |bias| "
        f"{model.rel_bias.abs().max().item():.3f})"
    )


if __name__ == "__main__":
    main()
