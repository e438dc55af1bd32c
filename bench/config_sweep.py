"""Time forward and forward+backward for each candidate kernel config of the autotuner (GPU only).

    python bench/config_sweep.py --cases full,causal --n 8192 --head-dim 128

Prints milliseconds per config and case; the defaults in flexfa/codegen/triton/configs.py come
from runs of this script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from triton_vs_flex import make_case

import flexfa
from flexfa.codegen.triton import autotune


def _call(q, k, v, score_mod, bm, opts, do=None):
    def run():
        out = flexfa.attention(q, k, v, score_mod, bm, kernel_options=opts)
        if do is not None:
            out.backward(do)

    return run


def _call(q, k, v, score_mod, bm, opts, do=None):
    """A closure that runs one attention call (and its backward when `do` is given)."""

    def run():
        out = flexfa.attention(q, k, v, score_mod, bm, kernel_options=opts)
        if do is not None:
            out.backward(do)

    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="full,causal")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    from triton.testing import do_bench

    dev, dt = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    cap = torch.cuda.get_device_capability()
    B, H, N, D = args.batch, args.heads, args.n, args.head_dim
    rows = []
    for case in args.cases.split(","):
        score_mod, mask_mod, per_batch = make_case(case, B, H, N, dev)
        bm = (
            flexfa.create_block_mask(mask_mod, B if per_batch else None, None, N, N, device=dev)
            if mask_mod
            else None
        )
        q, k, v = (
            torch.randn(B, H, N, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3)
        )
        do = torch.randn_like(q)
        for c in autotune.fwd_candidates(cap, D, dt):
            opts = {
                "block_m": c.block_m,
                "block_n": c.block_n,
                "num_warps": c.num_warps,
                "num_stages": c.num_stages,
            }
            try:
                with torch.no_grad():
                    ms = do_bench(
                        _call(q, k, v, score_mod, bm, opts),
                        warmup=25,
                        rep=100,
                        return_mode="median",
                    )
            except Exception as e:
                ms = repr(e)[:80]
            rows.append({"case": case, "kernel": "fwd", "config": dataclasses.asdict(c), "ms": ms})
            print(json.dumps(rows[-1]), flush=True)
        for c in autotune.bwd_candidates(cap, D, dt):
            for mode in ("separate", "fused"):
                opts = {
                    f"bwd_{f}": getattr(c, f)
                    for f in (
                        "block_m1",
                        "block_n1",
                        "block_m2",
                        "block_n2",
                        "num_warps",
                        "num_stages",
                    )
                }
                opts["bwd_dq"] = mode
                try:
                    ms = do_bench(
                        _call(q, k, v, score_mod, bm, opts, do),
                        warmup=25,
                        rep=100,
                        return_mode="median",
                        grad_to_none=[q, k, v],
                    )
                except Exception as e:
                    ms = repr(e)[:80]
                rows.append(
                    {
                        "case": case,
                        "kernel": f"fwd+bwd ({mode} dQ)",
                        "config": dataclasses.asdict(c),
                        "ms": ms,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "config_sweep.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
