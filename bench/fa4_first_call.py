"""A cold first call through the fa4 backend, imported as the peers benchmark imports (GPU only).

torch, Dynamo, FlashAttention-4 and flexfa are imported first (as `peers.py` does before its first
flexfa call), the BlockMask is built, then the first forward is timed (and, with --profile, its
cProfile printed), then the first backward. Run it in a fresh process with empty caches:

    FLEXFA_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) python bench/fa4_first_call.py \\
        --case prefix [--profile] [--wait]

`--wait` waits for flexfa's pool (Triton's start-up, background compiles) before the timed call
and says how long that took; the threads and pending compiles at the call are printed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import threading
import time
from pathlib import Path

import torch
import torch._dynamo  # the peers benchmark's torch.compile imports it first

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="prefix", choices=["prefix", "alibi", "causal", "document"])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--wait", action="store_true", help="let flexfa's pool finish first")
    a = ap.parse_args()
    from flash_attn.cute import flash_attn_func  # noqa: F401

    import flexfa
    from flexfa.codegen.triton import launch

    B, H, N, D = 2, 16, 8192, 128
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    score_mod = flexfa.mods.alibi if a.case == "alibi" else None
    if a.case == "prefix":

        def mask(b, h, q_idx, kv_idx):
            return (kv_idx < 2048) | (q_idx >= kv_idx)
    elif a.case == "document":
        ids = torch.randint(0, 8, (B, N), device="cuda").sort(-1).values

        def mask(b, h, q_idx, kv_idx):
            return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)
    else:

        def mask(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

    block_mask = flexfa.create_block_mask(mask, B, None, N, N, device="cuda")
    torch.cuda.synchronize()
    pending = [future.done() for future in launch._background.values()]
    print("threads", [t.name for t in threading.enumerate()], "background compiles done", pending)
    if a.wait:
        t0 = time.perf_counter()
        launch.runtime_ready()
        launch.wait_for_background()
        print(f"waited {time.perf_counter() - t0:.2f} s")
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    if a.profile:
        profiler.enable()
    out = flexfa.attention(q, k, v, score_mod=score_mod, block_mask=block_mask, backend="fa4")
    torch.cuda.synchronize()
    profiler.disable()
    print(f"first forward ({a.case}): {time.perf_counter() - t0:.2f} s")
    t0 = time.perf_counter()
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"first backward ({a.case}): {time.perf_counter() - t0:.2f} s")
    if a.profile:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
        print(text.getvalue())


if __name__ == "__main__":
    main()
