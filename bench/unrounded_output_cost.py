"""What keeping the unrounded output costs a call whose captured tensors need gradients (GPU only).

Note [Unrounded output for delta] (flexfa/codegen/triton/backend.py): with float16/bfloat16 inputs
and a learnable capture, the Triton forward also writes its output in float32 and the backward's
preprocess reads that copy. Only those two kernels change, so this times each of them both ways on
the same call (a learnable per-head relative bias, causal), A/B in one process:

- `flexfa_fwd` without and with `WRITE_OUT_F32`,
- `flexfa_bwd_preprocess` reading the 16-bit output and the float32 one,

and, for scale, the whole forward+backward of the call as flexfa runs it now. The overhead is
(extra forward + extra preprocess time) / forward+backward time.

    python bench/unrounded_output_cost.py                      # B=2, H=16, N=4096, D=128, bf16
    python bench/unrounded_output_cost.py --n 1024,8192 --dtype float16

Results go to stdout and, if $OUT is set, to $OUT/unrounded_output_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexfa
from flexfa.api import build_spec
from flexfa.codegen.triton.backend import Launcher
from flexfa.layout import empty_like_query
from flexfa.runtime.launch import launch


def bench_length(n: int, args) -> dict:
    from triton.testing import do_bench

    B, H, D = args.batch, args.heads, args.head_dim
    dev, dt = torch.device("cuda"), getattr(torch, args.dtype)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, n, D, device=dev, dtype=dt)
    table = (torch.randn(H, 257, device=dev) * 0.1).requires_grad_(True)
    score_mod = flexfa.mods.relative_bias(table)
    block_mask = flexfa.create_block_mask(flexfa.masks.causal, None, None, n, n, device=dev)

    def bench(fn) -> float:
        return do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")

    launcher = Launcher(build_spec(q, k, v, score_mod, block_mask))
    assert launcher.saves_unrounded_output, "expected a call that keeps the unrounded output"
    tensors = (table.detach(),)
    shape = (B, H, n, D)
    out = empty_like_query(q, shape)
    out_f32 = empty_like_query(q, shape, torch.float32)
    lse = torch.empty(B, H, n, device=dev, dtype=torch.float32)
    fwd_plain = launcher.forward_launch(q, k, v, out, lse, tensors)
    fwd_f32 = launcher.forward_launch(q, k, v, out, lse, tensors, out_f32=out_f32)
    rec: dict = {"B": B, "H": H, "N": n, "D": D, "dtype": args.dtype, "mask": "causal"}
    rec["fwd_ms"] = bench(lambda: launch(fwd_plain))
    rec["fwd_out_f32_ms"] = bench(lambda: launch(fwd_f32))
    launch(fwd_f32)

    delta = torch.empty_like(lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    grads = [torch.zeros_like(table), torch.zeros(1, device=dev)]
    common = (lse, do, None, delta, dq, dk, dv, tensors, grads, 1)
    pre_plain = launcher.backward_launches(q, k, v, out, *common)[0]
    pre_f32 = launcher.backward_launches(q, k, v, out_f32, *common)[0]
    rec["preprocess_ms"] = bench(lambda: launch(pre_plain))
    rec["preprocess_out_f32_ms"] = bench(lambda: launch(pre_f32))

    def fwd_bwd():
        o = flexfa.attention(q, k, v, score_mod=score_mod, block_mask=block_mask, backend="triton")
        o.backward(do)

    rec["call_fwdbwd_ms"] = do_bench(
        fwd_bwd, warmup=args.warmup, rep=args.rep, return_mode="median", grad_to_none=[q, k, v]
    )
    extra = (rec["fwd_out_f32_ms"] - rec["fwd_ms"]) + (
        rec["preprocess_out_f32_ms"] - rec["preprocess_ms"]
    )
    rec["extra_ms"] = extra
    rec["overhead_pct_of_fwdbwd"] = 100 * extra / rec["call_fwdbwd_ms"]
    rec["overhead_pct_of_fwd"] = 100 * (rec["fwd_out_f32_ms"] - rec["fwd_ms"]) / rec["fwd_ms"]
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", default="4096", help="comma-separated sequence lengths")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    rows = []
    for n in (int(x) for x in args.n.split(",")):
        rec = bench_length(n, args)
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    print(
        f"{'N':>6} {'fwd ms':>8} {'+f32 ms':>8} {'pre ms':>7} {'+f32 ms':>8} {'fwd+bwd':>8} {'cost':>6}"
    )
    for r in rows:
        print(
            f"{r['N']:>6} {r['fwd_ms']:>8.3f} {r['fwd_out_f32_ms']:>8.3f} {r['preprocess_ms']:>7.3f}"
            f" {r['preprocess_out_f32_ms']:>8.3f} {r['call_fwdbwd_ms']:>8.3f}"
            f" {r['overhead_pct_of_fwdbwd']:>5.1f}%"
        )
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "unrounded_output_cost.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
