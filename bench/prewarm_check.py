"""Do background compiles produce the specializations the launches use? (one GPU, a fresh process)

A forward that needs a backward starts compiling the backward's kernels on the compile pool with
argument stand-ins (Note [Compiles hold no tensors] in flexfa/codegen/triton/launch.py). If Triton
specialized a stand-in differently from the tensor it stands for, the backward's launch would
compile its kernel a second time, on the main thread, and a cold backward would be as slow as
without background compiles. This counts Triton's JIT compiles per kernel and thread (through its
`jit_cache_hook`) for a causal and an ALiBi forward + backward with empty caches, and exits with
status 1 when a backward kernel was compiled on the main thread.

    python bench/prewarm_check.py
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
import threading
from pathlib import Path

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
os.environ["FLEXFA_CACHE_DIR"] = tempfile.mkdtemp()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import triton
from triton import knobs

import flexfa


def main() -> int:
    counts: collections.Counter = collections.Counter()

    def hook(*args, **kwargs):  # Triton calls it before each compile; None lets it compile
        fn = kwargs.get("fn")
        thread = threading.current_thread().name.split("_")[0]
        counts[(getattr(fn, "name", str(fn)), thread)] += 1
        return None

    knobs.runtime.jit_cache_hook = hook  # before flexfa's own hook, which keeps and calls it
    for mod in (None, flexfa.mods.alibi):
        q, k, v = (
            torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )
        out = flexfa.attention(
            q, k, v, score_mod=mod, block_mask=flexfa.masks.causal, backend="triton"
        )
        out.sum().backward()
        torch.cuda.synchronize()
    for (name, thread), n in sorted(counts.items()):
        print(f"{name:44s} {thread:20s} {n}")
    again = sorted({name for name, thread in counts if "bwd" in name and thread == "MainThread"})
    print(
        f"triton {triton.__version__}; backward kernels compiled on the main thread: {again or 'none'}"
    )
    return 1 if again else 0


if __name__ == "__main__":
    sys.exit(main())
