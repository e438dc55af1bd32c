"""Whether flexfa's compile workers still serve the process after torch.compile changed Triton's
settings (Note [Compile workers] in flexfa/codegen/triton/workers.py). GPU only.

A cold flexfa training call starts the workers; a torch.compile'd FlexAttention call then moves
TRITON_CACHE_DIR to Inductor's cache (and TRITON_PTXAS_PATH to torch's ptxas); then flexfa calls
with new kernels. Printed: what torch.compile changed, the workers' counts (`reused`: the worker's
kernel had the process's hash; `mismatched`: it did not, and the workers were given up), the
kernels compiled into the cache directory the process had left (compiled for nothing: the
process compiled them again), and the workers' warnings. Run it in a fresh process with empty
caches:

    FLEXFA_CACHE_DIR=$(mktemp -d) TRITON_HOME=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \\
        python bench/compile_workers.py
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexfa
from flexfa.codegen.triton import workers


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def inputs(n: int, d: int) -> list[torch.Tensor]:
    return [
        torch.randn(1, 4, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    ]


def flexfa_step(n: int, d: int, score_mod=None) -> None:
    q, k, v = inputs(n, d)
    bm = flexfa.create_block_mask(causal, 1, None, n, n, device="cuda")
    out = flexfa.attention(q, k, v, score_mod=score_mod, block_mask=bm, backend="triton")
    out.sum().backward()
    torch.cuda.synchronize()


def entries(path: Path) -> set[str]:
    return set(os.listdir(path)) if path.exists() else set()


def main() -> None:
    from triton import knobs

    before = {k: v for k, v in os.environ.items() if k.startswith("TRITON_")}
    first_dir = Path(knobs.cache.dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flexfa_step(1024, 64)
        started = str(workers.stats)
        kept = entries(first_dir)
        q, k, v = inputs(1024, 64)
        bm = create_block_mask(causal, 1, None, 1024, 1024, device="cuda")
        torch.compile(flex_attention)(q, k, v, block_mask=bm).sum().backward()
        torch.cuda.synchronize()
        after = {k: v for k, v in os.environ.items() if k.startswith("TRITON_")}
        for n, d in ((1000, 128), (777, 64)):
            flexfa_step(n, d, softcap)
    print("TRITON_ variables torch.compile changed:", {
        k: v for k, v in after.items() if before.get(k) != v
    })  # fmt: skip
    print("workers after flexfa's first call:", started)
    print("workers at the end:", workers.stats)
    print("cache directory now:", knobs.cache.dir)
    left = Path(first_dir) != Path(knobs.cache.dir)
    print(
        "kernels compiled into the directory the process had left:",
        len(entries(first_dir) - kept) if left else "(it did not move)",
    )
    print(
        "workers' warnings:", [str(w.message)[:100] for w in caught if "worker" in str(w.message)]
    )


if __name__ == "__main__":
    main()
