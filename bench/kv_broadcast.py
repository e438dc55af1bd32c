"""K/V batch broadcast vs K/V expanded by hand, on the Triton backend (GPU only).

For each case it checks the broadcast call against the expanded one (output, LSE, dQ/dK/dV), then
times the forward and forward+backward of both with `triton.testing.do_bench` (median, ms). The
expanded K/V is materialized (`expand(...).contiguous()`), what a user does when a library rejects
the broadcast.

    python bench/kv_broadcast.py

Prints a table; with $OUT set, also writes $OUT/kv_broadcast.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexfa

# (name, B, Hq, Hkv, Lq, Lkv, causal)
CASES = (
    ("prefill_causal", 8, 16, 16, 2048, 2048, True),
    ("shared_prefix_gqa", 16, 32, 8, 256, 8192, False),
)


def run_case(name: str, B: int, Hq: int, Hkv: int, Lq: int, Lkv: int, causal: bool) -> dict:
    from triton.testing import do_bench

    dev, dt, D = "cuda", torch.bfloat16, 128
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, Hq, Lq, D, device=dev, dtype=dt, generator=g, requires_grad=True)
    k = torch.randn(1, Hkv, Lkv, D, device=dev, dtype=dt, generator=g, requires_grad=True)
    v = torch.randn(1, Hkv, Lkv, D, device=dev, dtype=dt, generator=g, requires_grad=True)
    kx = k.detach().expand(B, -1, -1, -1).contiguous().requires_grad_(True)
    vx = v.detach().expand(B, -1, -1, -1).contiguous().requires_grad_(True)
    mask = flexfa.masks.causal if causal else None
    kw = dict(block_mask=mask, enable_gqa=Hq != Hkv, backend="triton", return_lse=True)
    d_out = torch.randn(B, Hq, Lq, D, device=dev, dtype=dt, generator=g)

    def fwd(kk, vv):
        with torch.no_grad():
            return flexfa.attention(q, kk, vv, **kw)

    def fwd_bwd(kk, vv):
        out, _ = flexfa.attention(q, kk, vv, **kw)
        return torch.autograd.grad(out, (q, kk, vv), d_out)

    out_b, lse_b = fwd(k, v)
    out_x, lse_x = fwd(kx, vx)
    gb, gx = fwd_bwd(k, v), fwd_bwd(kx, vx)
    errs = {
        "out": float((out_b.float() - out_x.float()).abs().max()),
        "lse": float((lse_b - lse_x).abs().max()),
        "dq": float((gb[0].float() - gx[0].float()).abs().max()),
        "dk": float((gb[1].float() - gx[1].float().sum(0, keepdim=True)).abs().max()),
        "dv": float((gb[2].float() - gx[2].float().sum(0, keepdim=True)).abs().max()),
        "dk_max": float(gx[1].float().sum(0).abs().max()),
    }
    row = {"case": name, "B": B, "Hq": Hq, "Hkv": Hkv, "Lq": Lq, "Lkv": Lkv, "errors": errs}
    for label, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        row[f"{label}_broadcast_ms"] = do_bench(lambda fn=fn: fn(k, v), return_mode="median")
        row[f"{label}_expanded_ms"] = do_bench(lambda fn=fn: fn(kx, vx), return_mode="median")
    return row


def main() -> None:
    rows = []
    for case in CASES:
        rows.append(run_case(*case))
        print(json.dumps(rows[-1]), flush=True)
    print(f"{'case':20} {'fwd bcast':>10} {'fwd expand':>11} {'f+b bcast':>10} {'f+b expand':>11}")
    for r in rows:
        print(
            f"{r['case']:20} {r['fwd_broadcast_ms']:10.3f} {r['fwd_expanded_ms']:11.3f} "
            f"{r['fwd_bwd_broadcast_ms']:10.3f} {r['fwd_bwd_expanded_ms']:11.3f}"
        )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "kv_broadcast.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
