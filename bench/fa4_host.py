"""Where an fa4 forward's time goes, on a GPU: flexfa's host work, FA4's entry point, the compiled
kernel, and torch's FLASH backend for the same call.

For each case (the peers benchmark's shapes: B=2, H=16, N=8192, D=128, bf16, under no_grad), in one
process: `flexfa.attention(..., backend="fa4")` with direct launches (Note [Direct FA4 launches] in
flexfa/codegen/cute/direct.py) and without (`FLEXFA_FA4_DIRECT` off), ms per forward
(`triton.testing.do_bench` median), host µs per call (100 calls without a synchronization), the
part of that spent in FA4's `_flash_attn_fwd`, and the GPU time of the kernel alone (a CUDA graph of
20 direct calls); torch's compiled flex_attention with `kernel_options={"BACKEND": "FLASH"}` beside
it. `--profile CASE` prints a cProfile of 300 flexfa calls of that case (by own time).

    python bench/fa4_host.py [--cases document_causal,alibi_causal,prefixlm2048,causal] [--N 8192]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexfa
from bench.triton_vs_flex import doc_ids

B, H, D = 2, 16, 128


def cases(n: int) -> dict:
    ids = doc_ids(B, n, "cuda")
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device="cuda") / H)

    def causal(b, h, q, kv):
        return q >= kv

    def alibi(s, b, h, q, kv):
        return s + slopes[h] * (kv - q)

    return {
        "document_causal": (None, lambda b, h, q, kv: (ids[b, q] == ids[b, kv]) & (q >= kv)),
        "alibi_causal": (alibi, causal),
        "prefixlm2048": (None, lambda b, h, q, kv: (kv < 2048) | (q >= kv)),
        "causal": (None, causal),
    }


def host_us(fn, calls: int = 100) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return elapsed


class _EntryTimer:
    """Time spent inside FA4's `_flash_attn_fwd`."""

    def __init__(self):
        from flash_attn.cute import interface

        self.interface, self.original = interface, interface._flash_attn_fwd
        self.seconds, self.calls = 0.0, 0

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        timed.compile_cache = self.original.compile_cache
        interface._flash_attn_fwd = timed
        self.timed = timed

    _instance = None

    @classmethod
    def get(cls) -> _EntryTimer:
        if cls._instance is None:
            cls._instance = cls()
        cls._instance.reset()
        return cls._instance

    def reset(self):
        self.timed.compile_cache = self.original.compile_cache  # wrapped by then
        self.seconds, self.calls = 0.0, 0

    def per_call_us(self) -> float:
        return self.seconds / max(self.calls, 1) * 1e6


def graph_ms(fn, calls: int = 20) -> float:
    """GPU time per call of `fn` from a CUDA graph of `calls` calls."""
    from triton.testing import do_bench

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return do_bench(graph.replay, warmup=5, rep=100, return_mode="median") / calls


def run_case(name: str, score, mask, n: int, profile: bool, tflex) -> dict:
    """One case's row (the module docstring says what is timed)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from triton.testing import do_bench

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bm = flexfa.create_block_mask(mask, B, None, n, n, device="cuda")
    row: dict = {"case": name, "N": n}

    def call():
        return flexfa.attention(q, k, v, score, bm, backend="fa4")

    for direct in (False, True):
        tag = "direct" if direct else "entry"
        with flexfa.config.override(fa4_direct=direct):
            for _ in range(3):  # compiled, then recorded twice
                call()
            entry = _EntryTimer.get()
            row[f"{tag}_ms"] = do_bench(call, warmup=20, rep=200, return_mode="median")
            entry.reset()
            row[f"{tag}_host_us"] = host_us(call)
            row[f"{tag}_fa4_entry_us"] = entry.per_call_us()
            if not direct:
                continue
            try:
                row["gpu_ms"] = graph_ms(call)
            except Exception as e:  # report and go on
                row["gpu_error"] = repr(e)[:200]
            if profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(300):
                    call()
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    if tflex is not None:
        tbm = create_block_mask(mask, B, None, n, n, device="cuda")

        def flash():
            return tflex(q, k, v, score_mod=score, block_mask=tbm,
                         kernel_options={"BACKEND": "FLASH"})  # fmt: skip

        flash()
        row["flash_ms"] = do_bench(flash, warmup=20, rep=200, return_mode="median")
        row["flash_host_us"] = host_us(flash)
    return row


def main() -> None:
    from torch.nn.attention.flex_attention import flex_attention

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="document_causal,alibi_causal,prefixlm2048,causal")
    ap.add_argument("--N", type=int, default=8192)
    ap.add_argument("--profile", default="")
    ap.add_argument("--no-flash", action="store_true")
    a = ap.parse_args()
    all_cases = cases(a.N)
    tflex = None if a.no_flash else torch.compile(flex_attention, dynamic=False)
    for name in a.cases.split(","):
        score, mask = all_cases[name]
        with torch.no_grad():
            row = run_case(name, score, mask, a.N, a.profile == name, tflex)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
