"""flexfa quickstart: ALiBi with a sliding window, forward and backward, on the CPU.

Runs attention with `flexfa.mods.alibi` as the score_mod and `flexfa.masks.sliding_window` as the
mask, checks the output and the gradients against the dense float64 reference
(`flexfa.reference`), and prints the errors and the times. No GPU needed: on a machine without one,
flexfa runs its tiled PyTorch backend.

    python examples/quickstart.py
"""

from __future__ import annotations

import time

import torch

import flexfa
from flexfa.masks import sliding_window
from flexfa.mods import alibi
from flexfa.reference import reference_attention

B, H, L, E = 2, 8, 1024, 64  # batch, heads, sequence length, head dim
WINDOW = 256


def main() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, E, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, L, E)

    print(
        f"q, k, v: {tuple(q.shape)} float32; score_mod=alibi, block_mask=sliding_window({WINDOW})"
    )
    print(flexfa.explain_backend(q, k, v, score_mod=alibi, block_mask=sliding_window(WINDOW)))

    # The first call traces the mods and builds the BlockMask (cached for later calls).
    start = time.perf_counter()
    out = flexfa.attention(q, k, v, score_mod=alibi, block_mask=sliding_window(WINDOW))
    first = time.perf_counter() - start

    start = time.perf_counter()
    out = flexfa.attention(q, k, v, score_mod=alibi, block_mask=sliding_window(WINDOW))
    forward = time.perf_counter() - start
    start = time.perf_counter()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    backward = time.perf_counter() - start

    # The same attention, dense, in float64: the semantics flexfa is tested against.
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, _ = reference_attention(q64, k64, v64, score_mod=alibi, mask_mod=sliding_window(WINDOW))
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.double() - b).abs().max().item()

    errors = {
        "out": error(out, ref),
        **{name: error(g, r) for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads)},
    }
    print(
        "max |flexfa - float64 reference|: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items())
    )
    print(
        f"time: first call {first:.3f}s (tracing and BlockMask included), "
        f"forward {forward:.3f}s, backward {backward:.3f}s"
    )
    worst = max(errors.values())
    if worst > 1e-4:
        raise SystemExit(f"error {worst:.2e} is larger than expected for float32")
    print("ok")


if __name__ == "__main__":
    main()
