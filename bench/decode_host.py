"""Where a short decode step's time goes: GPU time, host time and the host's profile.

At 4k keys a decode step is a few tens of microseconds of GPU work, so the host time of a call
(argument checks, plan lookups, kernel launches) decides its speed. For Lq=1 (B=8, Hq=32, Hkv=8,
D=128, bf16) this times, in one process, SDPA and flexfa with its kernels launched through Triton's
`JITFunction.run` ("jit", as before Note [Direct launches]), directly with the argument fingerprint
of every call ("direct"), or from the second call of a spec by the kernels kept for it ("by spec",
the default, Note [Decode launches by spec]), with the merge as its own kernel or fused into the
split kernel (Note [Fused merge]):
  - us: `triton.testing.do_bench` median (as ../shared/bench/decode_peers.py times it);
  - host_us: time to enqueue 50 calls, per call;
  - graph_us: the same call captured in a CUDA graph and replayed (GPU time without the host);
each the best of --rounds interleaved rounds (the machine is shared), and prints the top of a
cProfile of 500 default flexfa calls. `--sweep` also times, by GPU time alone (CUDA graphs), the
defaults against other splits, tile sizes and stage counts (kernel_options; the direct launch and
fused merge of the defaults), since at 4k keys do_bench would time the host.

    python bench/decode_host.py [--lkv 4096,32768] [--lq 1] [--rep 300] [--rounds 3] [--sweep]
        [--variants JSON]

`--variants '[{"decode_dense": false}, {}]'` times, instead of the launch and merge matrix, SDPA
and flexfa (launched by spec) with each of these kernel_options, interleaved round by round: an
A/B of a kernel change in one process. `--lq` sets the queries per step (SDPA as well).
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexfa
from bench.decode import host_us
from flexfa.codegen.triton import decode
from flexfa.runtime import launch as tlaunch

B, HQ, HKV, D = 8, 32, 8, 128


def main() -> None:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser()
    ap.add_argument("--lkv", default="4096")
    ap.add_argument("--rep", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="GPU time of other launch configs")
    ap.add_argument("--lq", default="1")
    ap.add_argument("--variants", default="", help="JSON list of kernel_options to compare")
    a = ap.parse_args()
    variants = json.loads(a.variants) if a.variants else None
    records = []
    direct_call = tlaunch.DirectLaunch.__call__
    compiled_for = tlaunch.DirectLaunch.compiled_for

    def jit_call(self, grid, args):
        self._jit(grid, args)

    def set_launch(launch: str) -> None:
        tlaunch.DirectLaunch.__call__ = jit_call if launch == "jit" else direct_call
        keep = launch == "by spec"
        tlaunch.DirectLaunch.compiled_for = compiled_for if keep else (lambda self, args: None)
        for _, prep in decode._by_spec.values():  # what "by spec" kept, for the others to miss
            prep.by_spec.clear()

    shapes = [(lq, lkv) for lq in map(int, a.lq.split(",")) for lkv in map(int, a.lkv.split(","))]
    for lq, lkv in shapes:
        torch.manual_seed(0)
        q = torch.randn(B, HQ, lq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, HKV, lkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).float()
        cases = {"sdpa": (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), None)}
        sweep = [{"decode_splits": sp} for sp in (2, 4, 6, 12, 16)] + [
            {"decode_block_n": bn, "decode_num_stages": st}
            for bn, st in ((64, 2), (64, 4), (128, 2), (128, 3))
        ]
        for opts in sweep if a.sweep else []:
            cases["flexfa " + json.dumps(opts)] = (
                lambda opts=opts: flexfa.attention(q, k, v, enable_gqa=True, kernel_options=opts),
                "by spec",
            )
        for opts in variants or []:
            cases["flexfa " + json.dumps(opts)] = (
                lambda opts=opts: flexfa.attention(q, k, v, enable_gqa=True, kernel_options=opts),
                "by spec",
            )
        for merge in ("separate", "fused") if variants is None else ():
            opts = {"decode_merge": merge}
            for launch in ("jit", "direct", "by spec"):
                cases[f"flexfa {launch} {merge}"] = (
                    lambda opts=opts: flexfa.attention(
                        q, k, v, enable_gqa=True, kernel_options=opts
                    ),
                    launch,
                )
        best: dict[str, dict] = {}
        for _ in range(a.rounds):
            for name, (fn, launch) in cases.items():
                set_launch(launch)
                with torch.no_grad():
                    out = fn()
                    err = float((out.float() - ref).norm() / ref.norm())
                    us = do_bench(fn, warmup=50, rep=a.rep, return_mode="median") * 1e3
                    host = min(host_us(fn) for _ in range(5))
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        fn()
                    graph_us = do_bench(graph.replay, warmup=50, rep=a.rep, return_mode="median")
                    del graph
                rec = dict(Lq=lq, Lkv=lkv, system=name, us=us, host_us=host, graph_us=graph_us * 1e3,
                           rel_err_vs_sdpa=err)  # fmt: skip
                print(json.dumps(rec), flush=True)
                old = best.setdefault(name, rec)
                for key in ("us", "host_us", "graph_us"):
                    old[key] = min(old[key], rec[key])
        records += best.values()
        for rec in best.values():
            print("best", json.dumps(rec), flush=True)
        set_launch("by spec")
        fn = lambda: flexfa.attention(q, k, v, enable_gqa=True)
        with torch.no_grad():
            fn()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(500):
                fn()
            pr.disable()
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue())
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "decode_host.json"), "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
