"""What captured-tensor gradients cost in the fa4 backend's training step, on the GPU.

Forward + backward on the fa4 backend (B=4, H=16, N=4096, D=128, bf16, causal) for three score_mods
whose captured tensors get gradients that many score elements add into one element (Note
[Captured gradients in the FA4 backward]):

    slopes  score + slopes[h] * (kv_idx - q_idx)                    # (H,): one element per head
    table   score + table[h, clamp(q_idx - kv_idx, -128, 128) + 128] # (H, 257): far pairs share
    grid    score + grid[q_idx // 64, kv_idx // 64]                  # (N/64, N/64): 64 x 64 blocks

each once with the tensor requiring grad and once without (the same kernels minus the gradient
adds), and prints the median step time of each and their ratio. Times come from CUDA events around
the step, after warm-up.

    python bench/fa4_captured_grads.py      # results also in $OUT/fa4_captured_grads.json if $OUT
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexfa

B, H, N, D = 4, 16, 4096, 128
WARMUP, REPEATS = 3, 20


def mods(device: str, learnable: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    slopes = (0.05 * torch.rand(H, generator=g)).to(device).requires_grad_(learnable)
    table = (0.5 * torch.randn(H, 257, generator=g)).to(device).requires_grad_(learnable)
    grid = (0.5 * torch.randn(N // 64, N // 64, generator=g)).to(device).requires_grad_(learnable)

    def slopes_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def grid_mod(score, b, h, q_idx, kv_idx):
        return score + grid[q_idx // 64, kv_idx // 64]

    return {
        "slopes": (slopes_mod, slopes),
        "table": (flexfa.mods.relative_bias(table, 128), table),
        "grid": (grid_mod, grid),
    }


def step_ms(q, k, v, score_mod, param) -> float:
    times = []
    for i in range(WARMUP + REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = flexfa.attention(q, k, v, score_mod, flexfa.masks.causal, backend="fa4")
        inputs = [q, k, v] + ([param] if param.requires_grad else [])
        torch.autograd.grad(out, inputs, torch.ones_like(out))
        end.record()
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    q, k, v = (
        torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    with_grad, without = mods("cuda", True), mods("cuda", False)
    rows = []
    for name in with_grad:
        ms_grad = step_ms(q, k, v, *with_grad[name])
        ms_plain = step_ms(q, k, v, *without[name])
        rows.append({"mod": name, "ms_with_grad": ms_grad, "ms_without": ms_plain})
        print(
            f"{name:7s} with gradient {ms_grad:8.3f} ms   without {ms_plain:8.3f} ms   "
            f"ratio {ms_grad / ms_plain:5.2f}x",
            flush=True,
        )
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "fa4_captured_grads.json"
        path.write_text(json.dumps({"shape": [B, H, N, D], "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
