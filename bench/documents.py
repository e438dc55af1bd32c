"""Document masks on the "fa4" backend: FA4's varlen kernels against the generated mask_mod.

A document-causal mask, `(ids[b, q] == ids[b, kv]) & (q >= kv)`, with the documents of the peers
benchmark (random lengths of 128-2047 tokens per batch row), H=16, D=128, bf16; the same call with
`FLEXFA_FA4_DOCUMENTS` on (one FA4 varlen call per batch row, Note [Document masks on FA4's varlen
kernels] in flexfa/codegen/cute/plan.py) and off (the mask_mod over FA4's block-sparse lists), in
one process: ms forward and forward+backward (`triton.testing.do_bench` medians) and the host time
of a forward call.

    python bench/documents.py [--B 1,2] [--N 8192]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexfa
from bench.triton_vs_flex import doc_ids

H, D = 16, 128


def run(B: int, N: int) -> None:
    """Both paths for one batch size, one JSON line each."""
    from triton.testing import do_bench

    ids = doc_ids(B, N, "cuda")  # the peers benchmark's documents

    def mask(b, h, q, kv):
        return (ids[b, q] == ids[b, kv]) & (q >= kv)

    q, k, v = (
        torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    do = torch.randn_like(q)

    def fn():
        return flexfa.attention(q, k, v, block_mask=mask, backend="fa4")

    for documents in (True, False):
        with flexfa.config.override(fa4_documents=documents):
            path = flexfa.explain_backend(q, k, v, None, mask).splitlines()[0]
            fn().backward(do)  # compiles both passes
            with torch.no_grad():
                fwd = do_bench(fn, warmup=20, rep=200, return_mode="median")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(50):
                    fn()
                host = (time.perf_counter() - t0) / 50 * 1e6
                torch.cuda.synchronize()
            fb = do_bench(
                lambda: fn().backward(do), warmup=10, rep=100, return_mode="median",
                grad_to_none=[q, k, v],
            )  # fmt: skip
        rec = dict(B=B, N=N, documents=documents, fwd_ms=fwd, fwd_bwd_ms=fb, host_us_fwd=host,
                   path=path)  # fmt: skip
        print(json.dumps(rec), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", default="1,2")
    ap.add_argument("--N", type=int, default=8192)
    a = ap.parse_args()
    for B in map(int, a.B.split(",")):
        run(B, a.N)


if __name__ == "__main__":
    main()
