"""Decode (short queries against a long KV cache) on one GPU: flexfa vs SDPA and torch flex.

Shape: B=8, Hq=32, Hkv=8 (GQA), D=128, bf16; Lq in {1, 4, 16}; Lkv in {4096, 32768, 131072}.
Figure of merit: effective K/V bandwidth = bytes of K and V (read once) / time. All systems run in
one process, timed by `triton.testing.do_bench` (median):

  sdpa        torch scaled_dot_product_attention(enable_gqa=True)
  flex        torch.compile(flex_attention) with enable_gqa (its decoding kernel for short queries)
  flexfa      flexfa.attention with its default decode configuration
  flexfa_best the fastest configuration of the sweep at that shape (--sweep)
  paged       flexfa over a page pool (page size --page, random page order), default configuration

    python bench/decode.py [--lkv 4096,32768] [--lq 1,4] [--systems sdpa,flex,flexfa,paged]
        [--sweep 32768 [--configs JSON]] [--masked] [--budget 400]

`--sweep L` times several (decode_block_n, decode_num_stages, decode_num_warps, decode_splits)
configurations at Lkv = L for each Lq (`--configs` gives them as a JSON list of kernel_options
instead), and `flexfa_best` uses the best one at every Lkv.
`--masked` adds ALiBi + sliding window 4096 and a document mask (Lq=1) against torch flex, also
captured in CUDA graphs (GPU time without the host's).
`--variants JSON` (a list of kernel_options) also times flexfa, the paged cache and the masked
steps with each of them, as systems named "flexfa {options}" and "paged {options}".
One JSON line per measurement; a table at the end; $OUT/decode.json when OUT is set. `--budget`
seconds stops the sweep early so the table is still printed.
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexfa

DEV, DT = "cuda", torch.bfloat16
B, HQ, HKV, D = 8, 32, 8, 128


def bench(fn, rep: int) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=max(10, rep // 4), rep=rep, return_mode="median") * 1e3  # µs


def host_us(fn, calls: int = 50) -> float:
    """Host time per call: the time to enqueue `calls` calls (fewer launches than the queue
    holds, so the host never waits for the GPU), divided by `calls`."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def paged_copy(k: torch.Tensor, v: torch.Tensor, page: int, seed: int = 0):
    """k, v (B, H, L, D) as pools (pages, H, page, D) in random page order, and the page table."""
    Bk, H, L, Dk = k.shape
    npg = L // page
    g = torch.Generator(device="cpu").manual_seed(seed)
    perm = torch.randperm(Bk * npg, generator=g).to(k.device)
    table = perm.view(Bk, npg).to(torch.int32)

    def pool(x):
        pages = (
            x.reshape(Bk, H, npg, page, Dk).permute(0, 2, 1, 3, 4).reshape(Bk * npg, H, page, Dk)
        )
        out = torch.empty_like(pages)
        out[perm] = pages
        return out

    lens = torch.full((Bk,), L, dtype=torch.int32, device=k.device)
    return pool(k), pool(v), table, lens


# kernel_options the sweep times after the defaults ({}); --configs replaces them.
SWEEP = (
    [dict(decode_merge="separate")]
    + [
        dict(decode_block_n=bn, decode_num_stages=st, decode_num_warps=w)
        for bn, st, w in ((64, 4, 4), (64, 3, 2), (128, 3, 4), (64, 3, 8), (64, 4, 8), (32, 4, 4))
    ]
    + [dict(decode_splits=splits) for splits in (4, 5, 6, 10, 12, 16)]
    + [
        dict(decode_splits=4, **extra)
        for extra in (dict(decode_num_warps=8), dict(decode_num_stages=4))
    ]
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lkv", default="4096,32768,131072")
    ap.add_argument("--lq", default="1,4,16")
    ap.add_argument("--systems", default="sdpa,flex,flexfa,flexfa_best,paged")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--sweep", type=int, default=0, help="Lkv of the config sweep (0: none)")
    ap.add_argument("--masked", action="store_true")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--budget", type=float, default=1e9)
    ap.add_argument("--configs", default="", help="JSON list of kernel_options for --sweep")
    ap.add_argument("--variants", default="", help="JSON list of kernel_options to time as well")
    a = ap.parse_args()
    variants = [json.dumps(o) for o in json.loads(a.variants)] if a.variants else []
    start = time.perf_counter()
    systems = a.systems.split(",")
    lqs = [int(x) for x in a.lq.split(",")]
    lkvs = [int(x) for x in a.lkv.split(",")]
    records: list[dict] = []

    def emit(**rec) -> None:
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "decode.json"), "w") as f:
                json.dump(records, f, indent=1)

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.recompile_limit = 256
    tflex = torch.compile(flex_attention, dynamic=False)

    def inputs(lkv: int, lq: int):
        torch.manual_seed(0)
        k = torch.randn(B, HKV, lkv, D, device=DEV, dtype=DT)
        v = torch.randn(B, HKV, lkv, D, device=DEV, dtype=DT)
        q = torch.randn(B, HQ, lq, D, device=DEV, dtype=DT)
        return q, k, v

    best: dict[int, dict] = {}
    if a.sweep:
        lkv = a.sweep
        for lq in lqs:
            q, k, v = inputs(lkv, lq)
            ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            configs = [{}] + (json.loads(a.configs) if a.configs else SWEEP)
            results = []
            for opts in configs:
                if time.perf_counter() - start > a.budget * 0.6:
                    emit(note="sweep stopped: budget")
                    break
                fn = lambda: flexfa.attention(q, k, v, enable_gqa=True, kernel_options=opts)
                try:
                    with torch.no_grad():
                        err = rel_err(fn(), ref)
                        us = bench(fn, a.rep)
                except Exception as e:
                    emit(sweep=True, Lq=lq, Lkv=lkv, options=opts, error=repr(e)[:300])
                    continue
                results.append((us, opts))
                kv_bytes = 2 * k.numel() * k.element_size()
                emit(
                    sweep=True,
                    Lq=lq,
                    Lkv=lkv,
                    options=opts,
                    us=us,
                    tb_s=kv_bytes / us / 1e6,
                    rel_err=err,
                )
            if results:
                best[lq] = min(results, key=lambda r: r[0])[1]
            del q, k, v, ref
            torch.cuda.empty_cache()

    rows = []
    for lkv in lkvs:
        for lq in lqs:
            q, k, v = inputs(lkv, lq)
            kv_bytes = 2 * k.numel() * k.element_size()
            ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            row = dict(Lq=lq, Lkv=lkv)
            fns = {
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                "flex": lambda: tflex(q, k, v, enable_gqa=True),
                "flexfa": lambda: flexfa.attention(q, k, v, enable_gqa=True),
            }
            if lq in best:
                opts = best[lq]
                fns["flexfa_best"] = lambda: flexfa.attention(
                    q, k, v, enable_gqa=True, kernel_options=opts
                )
            if "paged" in systems:
                kp, vp, table, lens = paged_copy(k, v, a.page)
                fns["paged"] = lambda: flexfa.attention(
                    q, kp, vp, enable_gqa=True, page_table=table, kv_lens=lens
                )
            names = list(systems)
            for tag in variants:
                opts = json.loads(tag)
                if "flexfa" in systems:
                    names.append(f"flexfa {tag}")
                    fns[names[-1]] = lambda opts=opts: flexfa.attention(
                        q, k, v, enable_gqa=True, kernel_options=opts
                    )
                if "paged" in systems:
                    names.append(f"paged {tag}")
                    fns[names[-1]] = lambda opts=opts: flexfa.attention(
                        q, kp, vp, enable_gqa=True, page_table=table, kv_lens=lens,
                        kernel_options=opts,
                    )  # fmt: skip
            for name in names:
                fn = fns.get(name)
                if fn is None:
                    continue
                try:
                    with torch.no_grad():
                        err = rel_err(fn(), ref)
                        us = bench(fn, a.rep)
                        host = host_us(fn)
                except Exception as e:
                    emit(Lq=lq, Lkv=lkv, system=name, error=repr(e)[:300])
                    continue
                row[name] = us
                emit(
                    Lq=lq,
                    Lkv=lkv,
                    system=name,
                    us=us,
                    host_us=host,
                    tb_s=kv_bytes / us / 1e6,
                    rel_err_vs_sdpa=err,
                    options=best.get(lq) if name == "flexfa_best" else None,
                )
            rows.append(row)
            del q, k, v, ref, fns
            torch.cuda.empty_cache()

    if a.masked:
        lkv = 32768
        q, k, v = inputs(lkv, 1)
        kv_bytes = 2 * k.numel() * k.element_size()
        docs = (torch.arange(lkv, device=DEV) // 3000).to(torch.int32)

        def sw(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + lkv - 1) & (q_idx + lkv - 1 - kv_idx < 4096)

        def doc(b, h, q_idx, kv_idx):
            return docs[kv_idx] == docs[lkv - 1]

        for name, score, mask in (("alibi_sw4096", flexfa.mods.alibi, sw), ("document", None, doc)):
            try:
                tbm = create_block_mask(mask, None, None, 1, lkv, device=DEV)
                fbm = flexfa.create_block_mask(mask, None, None, 1, lkv, device=DEV)
                tscore = flexfa.mods.alibi.bind(HQ) if score is not None else None
                live = float((fbm.kv_full.count + fbm.kv_partial.count).sum()) * 128 / lkv
                with torch.no_grad():
                    ref = tflex(q, k, v, score_mod=tscore, block_mask=tbm, enable_gqa=True)
                    f1 = lambda: tflex(q, k, v, score_mod=tscore, block_mask=tbm, enable_gqa=True)
                    f2 = lambda: flexfa.attention(q, k, v, score, fbm, enable_gqa=True)
                    err = rel_err(f2(), ref)
                    t1, t2 = bench(f1, a.rep), bench(f2, a.rep)
                    graphs, extra = {}, {}
                    timed = [("flex", f1), ("flexfa", f2)]
                    for tag in variants:
                        opts = json.loads(tag)
                        fn = lambda opts=opts: flexfa.attention(
                            q, k, v, score, fbm, enable_gqa=True, kernel_options=opts
                        )
                        extra[f"flexfa {tag} us"] = bench(fn, a.rep)
                        timed.append((f"flexfa {tag}", fn))
                    for system, fn in timed:
                        try:  # GPU time alone: the call captured in a CUDA graph, replayed
                            graph = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(graph):
                                fn()
                            graphs[f"{system}_graph_us"] = bench(graph.replay, a.rep)
                        except Exception as e:
                            graphs[f"{system}_graph_error"] = repr(e)[:120]
                emit(
                    masked=name,
                    Lq=1,
                    Lkv=lkv,
                    flex_us=t1,
                    flexfa_us=t2,
                    speedup=t1 / t2,
                    kv_fraction_read=live,
                    flexfa_tb_s_read=kv_bytes * live / t2 / 1e6,
                    rel_err=err,
                    **extra,
                    **graphs,
                )
            except Exception as e:
                emit(masked=name, error=repr(e)[:300])

    columns = list(dict.fromkeys(name for r in rows for name in r if name not in ("Lq", "Lkv")))
    print(f"{'Lq, Lkv':>14} " + "".join(f"| {s:>18} " for s in columns))
    for r in rows:
        lkv = r["Lkv"]
        kv_bytes = 2 * B * HKV * lkv * D * 2
        cells = "".join(
            f"| {r[s]:8.0f} ({kv_bytes / r[s] / 1e6:4.2f}) " if s in r else f"| {'-':>18} "
            for s in columns
        )
        print(f"{r['Lq']:>4}, {lkv:>8} " + cells)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
