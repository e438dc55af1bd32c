"""First calls of score_mods that differ only in a Python float, on the GPU.

Twenty mods `lambda score, b, h, q_idx, kv_idx, c=c: score + c * 0.01 * (kv_idx - q_idx)` (c = 0..19,
as floats), each called once (forward + backward, B=1, H=4, N=1024, D=128, bf16, causal) in one
fresh process with empty caches. The float is a lifted scalar (Note [Lifted scalars]), so the first
mod compiles the kernels and the other nineteen reuse them: the script prints each first call's
time, the number of compiled Triton kernels after each call, and the time Python's garbage
collector took during the call.

    python bench/scalar_mods.py            # results also in $OUT/scalar_mods.json if $OUT is set
    python bench/scalar_mods.py --profile 1 # also a cProfile of the 2nd mod's first call
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("FLEXFA_CACHE_DIR", tempfile.mkdtemp(prefix="flexfa-"))
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-"))

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexfa
from flexfa.codegen.triton import module as tmodule


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", type=int, default=-1, help="cProfile this mod's first call")
    a = ap.parse_args()
    B, H, N, D = 1, 4, 1024, 128
    q, k, v = (
        torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    mods = [
        lambda s, b, h, q_idx, kv_idx, c=float(c): s + c * 0.01 * (kv_idx - q_idx)
        for c in range(20)
    ]
    rows = []
    gc_time = [0.0]
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:  # time spent in the garbage collector, per call
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - gc_start[0]

    gc.callbacks.append(on_gc)
    for i, mod in enumerate(mods):
        gc_time[0] = 0.0
        torch.cuda.synchronize()
        profile = cProfile.Profile() if i == a.profile else None
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        out = flexfa.attention(q, k, v, score_mod=mod, block_mask=flexfa.masks.causal)
        out.sum().backward()
        torch.cuda.synchronize()
        for t in (q, k, v):  # as optimizer.zero_grad() does: a second backward accumulating into
            t.grad = None  # .grad would time torch's first (lazily loaded) add kernel too
        if profile is not None:
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumtime").print_stats(30)
            print(text.getvalue(), flush=True)
        rows.append(
            {
                "mod": i,
                "first_call_s": time.perf_counter() - start,
                "kernels": tmodule.compiled_kernel_count(),
                "gc_ms": 1e3 * gc_time[0],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    later = [r["first_call_s"] * 1e3 for r in rows[1:]]
    summary = {
        "first_mod_s": rows[0]["first_call_s"],
        "later_median_ms": statistics.median(later),
        "later_max_ms": max(later),
        "kernels_after_first": rows[0]["kernels"],
        "kernels_after_last": rows[-1]["kernels"],
        "renders": tmodule.stats.renders,
    }
    print(json.dumps(summary))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "scalar_mods.json").write_text(
            json.dumps({"rows": rows, "summary": summary}, indent=1)
        )


if __name__ == "__main__":
    main()
