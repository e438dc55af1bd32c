"""Per-call host time of `flexfa.attention`'s front end, on the CPU.

Times, per call (the fastest of `--repeat` rounds of `--calls` calls), with a learned relative-position
bias (a captured tensor that requires grad), a closed-over float and the causal mask:
  - `build_spec`: argument checks, trace-cache lookup, block-mask cache lookup;
  - `build_spec + Launcher`: the above plus the Triton launcher's plan lookup (no kernel launch);
  - `attention (tiled, L=16)`: a whole eager call on tiny inputs, forward only.

    python bench/host_overhead.py --calls 2000 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # lets the Triton launcher be built on a CPU

import torch

import flexfa
from flexfa.api import build_spec
from flexfa.codegen.triton.backend import Launcher


def per_call_us(fn, calls: int, repeat: int) -> float:
    fn()
    rounds = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return min(rounds)  # the least disturbed round (the machine is shared)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    table = torch.zeros(4, 33, requires_grad=True)
    c = 0.5

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + c * table[h, torch.clamp(q_idx - kv_idx, -16, 16) + 16]

    q, k, v = (torch.randn(1, 4, 256, 64) for _ in range(3))
    mask = flexfa.masks.causal

    def spec_only():
        build_spec(q, k, v, rel_bias, mask)

    def spec_and_launcher():
        Launcher(build_spec(q, k, v, rel_bias, mask))

    small = [torch.randn(1, 4, 16, 16) for _ in range(3)]

    def whole_call():
        with torch.no_grad():
            flexfa.attention(*small, score_mod=rel_bias, block_mask=mask, backend="tiled")

    for name, fn in (
        ("build_spec", spec_only),
        ("build_spec + Launcher", spec_and_launcher),
        ("attention (tiled, L=16)", whole_call),
    ):
        print(f"{name:26s} {per_call_us(fn, args.calls, args.repeat):8.1f} us/call")


if __name__ == "__main__":
    main()
