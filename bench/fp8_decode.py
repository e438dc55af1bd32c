"""Decode with an fp8 KV cache against a bf16 one, on one GPU (Note [fp8 K/V] in flexfa/spec.py).

Shape: B=8, Hq=32, Hkv=8 (GQA), D=128, bf16 queries; Lq in {1, 4}; Lkv in {32768, 131072}. The
bf16 row reads a bf16 cache; the fp8 rows read a float8_e4m3fn (or e5m2) cache and dequantize K
with a per-head scale in the score_mod (`score * k_scale[h]`), as an fp8 cache is used. Each
output is checked against flexfa on the same fp8 values upcast to bf16 (relative error). Timing:
`triton.testing.do_bench` medians; tokens/s = B * Lq / time; "vs bf16" is the tokens/s ratio
(the goal: >= 1.8). "fp8 bn64" pins 64-key tiles (the default for fp8 is 128, Note [Decode
configs]) to show what the larger tile gives; "fp8 v keys-inner" stores V as (B, Hkv, D, Lkv), keys
contiguous (no byte-wise shared-memory reads of V in its PTX, `bench/fp8_ptx.py --v-keys-inner`, a one-off script in git history).

    python bench/fp8_decode.py [--lkv 32768,131072] [--lq 1,4] [--rep 100] [--e5m2]
        [--paged [--page 128]]

`--paged` adds the same caches as page pools (pages of --page keys in random order), bf16 and fp8.
`--sweep` also times the fp8 cache under other warps, pipeline stages and splits (JSON lines only);
`--configs JSON` gives that sweep's kernel_options as a JSON list instead.

One JSON line per measurement, a table at the end; $OUT/fp8_decode.json when OUT is set.
"""

# The timed lambdas close over loop variables on purpose: each is called within its iteration.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexfa
from bench.decode import paged_copy

DEV, DT = "cuda", torch.bfloat16
B, HQ, HKV, D = 8, 32, 8, 128


# Configs of --sweep (the defaults for this shape: 128-key tiles, 4 warps, 5 stages, 8 splits).
SWEEP = [
    {"decode_num_warps": w, "decode_num_stages": st}
    for w, st in ((4, 4), (4, 6), (4, 7), (8, 5), (8, 6))
] + [{"decode_splits": sp, "decode_num_stages": st} for sp in (4, 6, 16) for st in (5, 6)]


def bench(fn, rep: int) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=max(10, rep // 4), rep=rep, return_mode="median") * 1e3  # µs


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lkv", default="32768,131072")
    ap.add_argument("--lq", default="1,4")
    ap.add_argument("--rep", type=int, default=100, help="do_bench milliseconds per measurement")
    ap.add_argument("--e5m2", action="store_true", help="also time a float8_e5m2 cache")
    ap.add_argument("--paged", action="store_true", help="also bf16 and fp8 paged caches")
    ap.add_argument("--page", type=int, default=128, help="page size of --paged")
    ap.add_argument("--sweep", action="store_true", help="also fp8 under other launch configs")
    ap.add_argument("--configs", default="", help="JSON list of kernel_options for --sweep")
    a = ap.parse_args()
    start = time.perf_counter()
    records: list[dict] = []

    def emit(**rec) -> None:
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "fp8_decode.json"), "w") as f:
                json.dump(records, f, indent=1)

    g = torch.Generator(device=DEV).manual_seed(0)
    k_scale = torch.rand(HQ, device=DEV, generator=g) * 0.05 + 0.02  # dequantization, per head

    def dequant(score, b, h, q_idx, kv_idx):
        return score * k_scale[h]

    # (name, dtype, pinned tile keys, V stored keys inner: (B, Hkv, D, Lkv) seen transposed)
    kinds = [
        ("fp8", torch.float8_e4m3fn, None, False),
        ("fp8 bn64", torch.float8_e4m3fn, 64, False),
        ("fp8 v keys-inner", torch.float8_e4m3fn, None, True),
    ]
    if a.e5m2:
        kinds.append(("fp8 e5m2", torch.float8_e5m2, None, False))
    table = []
    for lkv in [int(x) for x in a.lkv.split(",")]:
        k16 = torch.randn(B, HKV, lkv, D, device=DEV, dtype=DT, generator=g)
        v16 = torch.randn(B, HKV, lkv, D, device=DEV, dtype=DT, generator=g)
        for lq in [int(x) for x in a.lq.split(",")]:
            q = torch.randn(B, HQ, lq, D, device=DEV, dtype=DT, generator=g)
            row = {"Lq": lq, "Lkv": lkv}
            with torch.no_grad():
                fn = lambda: flexfa.attention(q, k16, v16, enable_gqa=True)
                us = bench(fn, a.rep)
                row["bf16"] = us
                emit(Lq=lq, Lkv=lkv, kv="bf16", us=us, tokens_s=B * lq / us * 1e6)
                for name, dt, block_n, keys_inner in kinds:
                    k8 = (k16 / 8).to(dt)  # quantized with scale 8 (folded into k_scale's range)
                    v8 = v16.to(dt)
                    if keys_inner:
                        v8 = v8.transpose(-1, -2).contiguous().transpose(-1, -2)
                    opts = {"decode_block_n": block_n} if block_n else None
                    fn = lambda: flexfa.attention(
                        q, k8, v8, dequant, enable_gqa=True, kernel_options=opts
                    )
                    want = flexfa.attention(q, k8.to(DT), v8.to(DT), dequant, enable_gqa=True)
                    err = rel_err(fn(), want)
                    want = None  # the upcast copy of this check only
                    us = bench(fn, a.rep)
                    row[name] = us
                    emit(
                        Lq=lq,
                        Lkv=lkv,
                        kv=name,
                        us=us,
                        tokens_s=B * lq / us * 1e6,
                        vs_bf16=row["bf16"] / us,
                        rel_err_vs_upcast=err,
                    )
                    torch.cuda.empty_cache()
                if a.sweep:
                    k8, v8 = (k16 / 8).to(torch.float8_e4m3fn), v16.to(torch.float8_e4m3fn)
                    for opts in json.loads(a.configs) if a.configs else SWEEP:
                        fn = lambda: flexfa.attention(
                            q, k8, v8, dequant, enable_gqa=True, kernel_options=opts
                        )
                        try:
                            us = bench(fn, a.rep)
                        except Exception as e:  # a config that does not fit is reported
                            emit(Lq=lq, Lkv=lkv, sweep=opts, error=repr(e)[:200])
                            continue
                        emit(Lq=lq, Lkv=lkv, sweep=opts, us=us, vs_bf16=row["bf16"] / us)
                    k8 = v8 = None
                if a.paged:
                    for name, dt, keys_inner in (
                        ("paged bf16", DT, False),
                        ("paged fp8", torch.float8_e4m3fn, False),
                        ("paged fp8 v keys-inner", torch.float8_e4m3fn, True),
                    ):
                        kp, vp, pt, lens = paged_copy(k16 / 8, v16, a.page)  # in bf16
                        kp, vp = kp.to(dt), vp.to(dt)
                        if keys_inner:  # pages (num_pages, Hkv, D, page) seen transposed
                            vp = vp.transpose(-1, -2).contiguous().transpose(-1, -2)
                        mod = dequant if dt != DT else None
                        fn = lambda: flexfa.attention(
                            q, kp, vp, mod, enable_gqa=True, page_table=pt, kv_lens=lens
                        )
                        us = bench(fn, a.rep)
                        row[name] = us
                        emit(Lq=lq, Lkv=lkv, kv=name, us=us, tokens_s=B * lq / us * 1e6)
                        kp = vp = None
                    if "paged fp8" in row:
                        emit(Lq=lq, Lkv=lkv, paged_fp8_vs_bf16=row["paged bf16"] / row["paged fp8"])
            table.append(row)
        torch.cuda.empty_cache()

    names = (
        ["bf16"]
        + [n for n, *_ in kinds]
        + (["paged bf16", "paged fp8", "paged fp8 v keys-inner"] if a.paged else [])
    )
    print("\n| Lq, Lkv | " + " | ".join(f"{n} µs" for n in names) + " | fp8 vs bf16 tokens/s |")
    print("|---" * (len(names) + 2) + "|")
    for r in table:
        cells = [f"{r[n]:.0f}" if n in r else "-" for n in names]
        ratio = r["bf16"] / r["fp8"] if "fp8" in r else float("nan")
        print(f"| {r['Lq']}, {r['Lkv'] // 1024}k | " + " | ".join(cells) + f" | {ratio:.2f}× |")
    emit(total_s=time.perf_counter() - start, device=torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
