"""Which of flexfa's GPU backends is faster where: "fa4" against "triton", side by side (GPU only).

`backend="auto"` tries fa4 first on sm90 (Note [Which backend auto picks] in
flexfa/backends/fa4.py); this script is the measurement behind that rule. For each case and
sequence length (B·N = 16384 tokens, H=16, D=128, bf16 unless changed by flags) it times the
forward and forward+backward of both backends with `triton.testing.do_bench` (medians, ms), prints
fa4's speed relative to triton's (> 1: fa4 faster) and what `auto` chose for the call.

    python bench/auto_choice.py
    python bench/auto_choice.py --cases causal,alibi_causal --n 512,2048,8192

Results go to stdout and, if $OUT is set, to $OUT/auto_choice.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from triton_vs_flex import make_case

import flexfa
from flexfa.api import build_spec


def time_backend(backend, q, k, v, score_mod, block_mask, dout):
    from triton.testing import do_bench

    def run():
        return flexfa.attention(q, k, v, score_mod, block_mask, backend=backend)

    run().backward(dout)  # compile both passes outside the timing
    with torch.no_grad():
        fwd = do_bench(run, warmup=25, rep=150, return_mode="median")
    fb = do_bench(lambda: run().backward(dout), warmup=10, rep=150, return_mode="median",
                  grad_to_none=[q, k, v])  # fmt: skip
    return fwd, fb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="causal,alibi_causal,document_causal")
    ap.add_argument("--n", default="512,2048,8192")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), getattr(torch, args.dtype)
    rows = []
    for name in args.cases.split(","):
        for n in (int(x) for x in args.n.split(",")):
            B, H, D = max(1, args.tokens // n), args.heads, args.head_dim
            score_mod, mask_mod, per_batch = make_case(name, B, H, n, dev)
            torch.manual_seed(0)
            q, k, v = (
                torch.randn(B, H, n, D, device=dev, dtype=dt, requires_grad=True) for _ in "qkv"
            )
            dout = torch.randn_like(q)
            bm = flexfa.create_block_mask(mask_mod, B if per_batch else None, None, n, n,
                                          device=dev) if mask_mod else None  # fmt: skip
            chosen = flexfa.backends.select("auto", build_spec(q, k, v, score_mod, bm)).name
            row = dict(case=name, B=B, H=H, N=n, D=D, auto=chosen)
            for backend in ("triton", "fa4"):
                try:
                    row[backend] = time_backend(backend, q, k, v, score_mod, bm, dout)
                except Exception as e:  # one backend failing must not hide the other
                    row[backend] = repr(e)[:200]
            if all(isinstance(row[b], tuple) for b in ("triton", "fa4")):
                row["fa4_vs_triton"] = [t / f for t, f in zip(row["triton"], row["fa4"])]
            print(json.dumps(row), flush=True)
            rows.append(row)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "auto_choice.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print("case, N: fa4 speed / triton speed, forward / forward+backward; auto's choice")
    for r in rows:
        ratio = r.get("fa4_vs_triton")
        text = (
            f"{ratio[0]:.2f} / {ratio[1]:.2f}"
            if ratio
            else f"{r['triton']!s:.60} | {r['fa4']!s:.60}"
        )
        print(f"{r['case']:16} {r['N']:6}: {text}; auto: {r['auto']}")


if __name__ == "__main__":
    main()
