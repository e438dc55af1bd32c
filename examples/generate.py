"""Generation with a tiny decoder (random weights): a packed prefill, then token-by-token decoding
from a paged KV cache, with plain causal attention and with ALiBi + a sliding window.

    python examples/generate.py [--steps 32] [--device cuda]

Prefill runs the prompts as one packed batch (`cu_seqlens_q`/`cu_seqlens_kv`: mods see positions
within each prompt); each layer's keys and values then go to a `flexfa.PagedKVCache`, and every
decode step attends its one new query per sequence to the cache (`page_table`/`kv_lens`). In a
decode step the query's own position is `kv_lens[b] - 1`, so the window reads the cache's lengths.
"""

from __future__ import annotations

import argparse
import time

import torch

import flexfa

VOCAB, DIM, HEADS_Q, HEADS_KV, HEAD_DIM, LAYERS, WINDOW = 256, 128, 4, 2, 32, 2, 16


class Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.qkv = torch.nn.ModuleList(
            torch.nn.Linear(DIM, (HEADS_Q + 2 * HEADS_KV) * HEAD_DIM) for _ in range(LAYERS)
        )
        self.out = torch.nn.ModuleList(
            torch.nn.Linear(HEADS_Q * HEAD_DIM, DIM) for _ in range(LAYERS)
        )

    def heads(self, layer: int, x: torch.Tensor):
        """x (B, L, DIM) -> q (B, Hq, L, E), k and v (B, Hkv, L, E)."""
        B, L, _ = x.shape
        qkv = self.qkv[layer](x).view(B, L, HEADS_Q + 2 * HEADS_KV, HEAD_DIM).transpose(1, 2)
        return qkv.split([HEADS_Q, HEADS_KV, HEADS_KV], dim=1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.emb.weight.T


def generate(model, prompts, steps, variant, device):
    lens = [len(p) for p in prompts]
    B = len(prompts)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    caches = [
        flexfa.PagedKVCache(
            num_pages=B * ((max(lens) + steps) // 16 + 2), batch=B, heads_kv=HEADS_KV,
            page_size=16, head_dim=HEAD_DIM, device=device,
        )
        for _ in range(LAYERS)
    ]  # fmt: skip
    score_mod = flexfa.mods.alibi if variant == "alibi+window" else None
    prefill_mask = (
        flexfa.masks.sliding_window(WINDOW) if variant == "alibi+window" else flexfa.masks.causal
    )

    # Prefill: all prompts packed into one sequence of sum(lens) tokens.
    start = time.perf_counter()
    x = model.emb(torch.cat(prompts))[None]  # (1, total, DIM)
    for layer in range(LAYERS):
        q, k, v = model.heads(layer, x)
        att = flexfa.attention(
            q, k, v, score_mod, prefill_mask, enable_gqa=True, cu_seqlens_q=cu, cu_seqlens_kv=cu
        )
        for s in range(B):
            a, b = int(cu[s]), int(cu[s + 1])
            caches[layer].append(k[:, :, a:b], v[:, :, a:b], [s])
        x = x + model.out[layer](att.transpose(1, 2).reshape(1, -1, HEADS_Q * HEAD_DIM))
    last = x[0, cu[1:].long() - 1]  # each prompt's last position
    token = model.logits(last).argmax(-1)
    prefill_s = time.perf_counter() - start

    # Decode: one token per sequence per step, from the paged caches.
    def window(b, h, q_idx, kv_idx):  # the query sits at kv_lens[b] - 1
        return kv_idx > caches[0].kv_lens[b] - 1 - WINDOW

    decode_mask = window if variant == "alibi+window" else None
    out_tokens = [token]
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            x = model.emb(token)[:, None]  # (B, 1, DIM)
            for layer in range(LAYERS):
                q, k, v = model.heads(layer, x)
                caches[layer].append(k, v)
                att = caches[layer].attention(q, score_mod, decode_mask, enable_gqa=True)
                x = x + model.out[layer](att.transpose(1, 2).reshape(B, 1, HEADS_Q * HEAD_DIM))
            token = model.logits(x[:, 0]).argmax(-1)
            out_tokens.append(token)
    if device.type == "cuda":
        torch.cuda.synchronize()
    decode_s = time.perf_counter() - start
    return torch.stack(out_tokens, 1), sum(lens) / prefill_s, B * steps / decode_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    device = torch.device(a.device)
    torch.manual_seed(0)
    model = Decoder().to(device)
    prompts = [torch.randint(VOCAB, (n,), device=device) for n in (12, 5, 20, 9)]
    for variant in ("causal", "alibi+window"):
        with torch.no_grad():
            tokens, prefill_tps, decode_tps = generate(model, prompts, a.steps, variant, device)
        print(
            f"{variant:13s} prefill {prefill_tps:8.0f} tokens/s, decode {decode_tps:7.0f} "
            f"tokens/s, first tokens {tokens[:, :6].tolist()}"
        )


if __name__ == "__main__":
    main()
