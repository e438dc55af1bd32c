"""Time and peak memory of the tiled backend on CPU, beside the dense reference.

The tiled backend streams K/V tiles and never holds an Lq x Lkv matrix; the reference
(flexfa.reference, dense, the semantic oracle) does. This script measures both, causal attention,
batch 1, float32:

- tiled, forward and forward+backward, at a long length (default 16384, H = 4, E = 64);
- tiled and the reference at a length where the reference still fits (default 4096).

Each case runs in its own subprocess. Memory is the process's peak resident set size
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`) minus its resident size just before the measured
call, after the inputs exist and a small warm-up call has imported and traced everything: the
memory the call itself needed. Time is wall-clock for the call (forward, or forward then
backward), the best of --repeat runs; the causal BlockMask is built before (flexfa caches it per
shape, so a training loop builds it once).

    python bench/tiled_cpu.py                      # the default cases
    python bench/tiled_cpu.py --len 8192 --ref-len 2048 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run_case(case: dict) -> dict:
    """Runs one case in this process; returns its measurements."""
    import torch

    import flexfa
    from flexfa.blockmask.bind import resolve_block_mask
    from flexfa.reference import reference_attention

    torch.set_num_threads(case["threads"])
    L, H, E = case["len"], case["heads"], case["head_dim"]
    backward = case["mode"] == "fwd+bwd"
    g = torch.Generator().manual_seed(0)

    def inputs(length: int):
        q, k, v = (torch.randn(1, H, length, E, generator=g) for _ in range(3))
        for t in (q, k, v):
            t.requires_grad_(backward)
        return q, k, v

    def call(q, k, v):
        if case["impl"] == "tiled":
            return flexfa.attention(q, k, v, block_mask=flexfa.masks.causal, backend="tiled")
        out, _ = reference_attention(q, k, v, mask_mod=flexfa.masks.causal, dtype=torch.float32)
        return out

    def once(q, k, v, dout):
        out = call(q, k, v)
        if backward:
            out.backward(dout)
            for t in (q, k, v):
                t.grad = None
        return out

    small = inputs(256)
    once(*small, torch.ones(1, H, 256, E))  # imports, tracing and block-mask caches
    q, k, v = inputs(L)
    dout = torch.randn(1, H, L, E, generator=g) if backward else None
    if case["impl"] == "tiled":  # the BlockMask is built once per shape and cached
        resolve_block_mask(flexfa.masks.causal, 1, H, L, L, q.device)

    best = float("inf")
    extra = 0
    for _ in range(case["repeat"]):
        before = _rss_bytes()
        start = time.perf_counter()
        out = once(q, k, v, dout)
        best = min(best, time.perf_counter() - start)
        extra = max(extra, _peak_rss_bytes() - before)
        del out
    return {
        **case,
        "seconds": best,
        "peak_extra_bytes": extra,
        "inputs_bytes": 3 * q.numel() * q.element_size(),
    }


def _child(case: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(case)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {**case, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--len", type=int, default=16384, help="length for the tiled backend")
    parser.add_argument("--ref-len", type=int, default=4096, help="length the reference runs at")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case (best time)")
    parser.add_argument("--json", action="store_true", help="also print one JSON line per case")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_case(json.loads(args.child))))
        return

    base = {
        "heads": args.heads,
        "head_dim": args.head_dim,
        "threads": args.threads,
        "repeat": args.repeat,
    }
    cases = [
        {**base, "impl": impl, "mode": mode, "len": length}
        for impl, length in (
            ("tiled", args.len),
            ("tiled", args.ref_len),
            ("reference", args.ref_len),
        )
        for mode in ("fwd", "fwd+bwd")
    ]
    import platform

    import torch

    print(
        f"flexfa tiled backend on CPU: causal, B=1, H={args.heads}, E={args.head_dim}, float32, "
        f"{args.threads} torch threads, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
        f"torch {torch.__version__}"
    )
    print(f"{'impl':<10} {'mode':<8} {'L':>6} {'time':>9} {'peak memory of the call':>24}")
    for case in cases:
        r = _child(case)
        if "error" in r:
            print(f"{r['impl']:<10} {r['mode']:<8} {r['len']:>6}   error: {r['error']}")
            continue
        print(
            f"{r['impl']:<10} {r['mode']:<8} {r['len']:>6} {r['seconds']:>8.2f}s "
            f"{_mib(r['peak_extra_bytes']):>24}"
        )
        if args.json:
            print(json.dumps(r))
    dense = args.heads * args.len**2 * 4
    print(
        f"(one dense float32 score matrix at L={args.len} would be {_mib(dense)}; "
        f"q, k and v together are {_mib(3 * args.heads * args.len * args.head_dim * 4)})"
    )


if __name__ == "__main__":
    main()
