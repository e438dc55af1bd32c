"""A catalogue of attention variants written as torch FlexAttention programs, run by flexfa.

Each variant is plain torch code, the same functions one would pass to
`torch.nn.attention.flex_attention`; only the call changes (`flexfa.attention`). tests/e2e/
test_variants_catalogue.py checks each against torch's eager flex_attention.

- `natten`: 2-D neighbourhood attention on an image of H x W tokens in raster order: each query
  sees the K x K window around it, shifted inward at the borders so every window is full (NATTEN).
- `morton_natten`: the same neighbourhood with tokens in Morton (Z) order, so that windows are more
  often whole tiles; the coordinates come back by de-interleaving index bits with `>>` and `&`.
- `video_topk`: sparse video attention that keeps, for each query block, the KV blocks a router
  picked (a captured (q-blocks, k) tensor of block ids), with `(...== ...).any(-1)`.
- `mla_rope`: multi-head latent attention with a decoupled rotary part: the content score is
  q . k, and the positional part adds `q_rope[b, h, q_idx] . k_rope[b, kv_idx]` with `torch.dot`
  over the small rotary dim.
- `softcap_fast_tanh`: soft-capping through a custom op (a fast tanh), given a flexfa lowering.

    python examples/variants.py
"""

from __future__ import annotations

import torch

import flexfa


def natten(height: int, width: int, kernel: int):
    """mask_mod of 2-D neighbourhood attention over raster-ordered tokens."""
    r = kernel // 2

    def mask_mod(b, h, q_idx, kv_idx):
        qy, qx = q_idx // width, q_idx % width
        ky, kx = kv_idx // width, kv_idx % width
        cy = torch.clamp(qy, r, height - 1 - r)  # windows shift inward at the borders
        cx = torch.clamp(qx, r, width - 1 - r)
        return ((ky - cy).abs() <= r) & ((kx - cx).abs() <= r)

    return mask_mod


def _morton_decode(i):
    """(y, x) of a Morton index of up to 16 bits: even bits are x, odd bits y."""
    x = i & 0x5555
    y = (i >> 1) & 0x5555
    for shift, m in ((1, 0x3333), (2, 0x0F0F), (4, 0x00FF)):
        x = (x | (x >> shift)) & m
        y = (y | (y >> shift)) & m
    return y, x


def morton_natten(side: int, kernel: int):
    """mask_mod of neighbourhood attention over a side x side image in Morton order."""
    r = kernel // 2

    def mask_mod(b, h, q_idx, kv_idx):
        qy, qx = _morton_decode(q_idx)
        ky, kx = _morton_decode(kv_idx)
        cy = torch.clamp(qy, r, side - 1 - r)
        cx = torch.clamp(qx, r, side - 1 - r)
        return ((ky - cy).abs() <= r) & ((kx - cx).abs() <= r)

    return mask_mod


def video_topk(topk_blocks: torch.Tensor, block: int):
    """mask_mod keeping, for each q-block, the KV blocks listed in its row of `topk_blocks`."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (topk_blocks[q_idx // block] == kv_idx // block).any(-1)

    return mask_mod


def mla_rope(q_rope: torch.Tensor, k_rope: torch.Tensor, scale: float):
    """score_mod adding the decoupled rotary score: q_rope (B, H, L, R), k_rope (B, L, R)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + scale * torch.dot(q_rope[b, h, q_idx], k_rope[b, kv_idx])

    return score_mod


def fast_tanh_math(x):
    """A rational (Pade) tanh approximation, clamped to [-1, 1]."""
    return torch.clamp(x * (27.0 + x * x) / (27.0 + 9.0 * x * x), -1.0, 1.0)


@torch.library.custom_op("flexfa_examples::fast_tanh", mutates_args=())
def fast_tanh(x: torch.Tensor) -> torch.Tensor:
    return fast_tanh_math(x)


flexfa.register_lowering(fast_tanh, fast_tanh_math)


def softcap_fast_tanh(cap: float):
    """score_mod soft-capping the score at +-cap with the fast tanh custom op."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * fast_tanh(score / cap)

    return score_mod


def main() -> None:
    g = torch.Generator().manual_seed(0)
    B, H, D, side = 1, 2, 32, 16
    L = side * side
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    topk = torch.stack([torch.randperm(L // 64, generator=g)[:2] for _ in range(L // 64)])
    q_rope = torch.randn(B, H, L, 8, generator=g)
    k_rope = torch.randn(B, L, 8, generator=g)
    cases = {
        "natten": dict(mask_mod=natten(side, side, 5)),
        "morton_natten": dict(mask_mod=morton_natten(side, 5)),
        "video_topk": dict(mask_mod=video_topk(topk, 64)),
        "mla_rope": dict(score_mod=mla_rope(q_rope, k_rope, D**-0.5)),
        "softcap_fast_tanh": dict(score_mod=softcap_fast_tanh(20.0)),
    }
    for name, kw in cases.items():
        mask_mod = kw.get("mask_mod")
        bm = (
            flexfa.create_block_mask(mask_mod, None, None, L, L, BLOCK_SIZE=32)
            if mask_mod is not None
            else None
        )
        out = flexfa.attention(q, k, v, score_mod=kw.get("score_mod"), block_mask=bm)
        skipped = bm.sparsity() if bm is not None else 0.0
        print(f"{name:18} out {tuple(out.shape)}  tiles skipped {skipped:5.1f}%")


if __name__ == "__main__":
    main()
