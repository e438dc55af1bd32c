"""Where a cold first call's time goes: a cProfile of its main thread, in a fresh process.

Each run starts a child process with empty flexfa and Triton caches (as a first call after
installing flexfa), builds the inputs, and profiles the first `flexfa.attention` call (forward, and
with --backward the first backward too) on the main thread, which is the call's critical path:
background compiles run on the compile pool and in worker processes (Note [Concurrent compiles],
Note [Compile workers], Note [Triton's start-up]). It prints the call's time and the top of the
profile by cumulative and by own time, with flexfa's compile log (FLEXFA_LOG_COMPILES) before it;
with OUT set, each child's whole output goes to $OUT/cold_profile_<backend>_<case>.txt.

    python bench/cold_profile.py [--backend triton|fa4] [--case causal|alibi|prefixlm]
        [--backward] [--no-workers] [--lines 40]

flexfa's modules are byte-compiled first, as an installed package's are (bench/triton_vs_flex.py
--compile does the same). cProfile slows Python code, so the times printed are upper bounds; the
profile says where the time goes, not how long an unprofiled call takes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import cProfile, io, logging, pstats, sys, time
logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(threadName)s %(message)s")
import torch
sys.path.insert(0, {root!r})
import flexfa
B, H, N, D = {shape}
case, backend, backward, lines = {case!r}, {backend!r}, {backward!r}, {lines!r}
q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device="cuda") / H)
score_mod = (lambda s, b, h, i, j: s + slopes[h] * (j - i)) if case == "alibi" else None
if case == "prefixlm":
    mask = lambda b, h, i, j: (j < 2048) | (i >= j)
else:
    mask = flexfa.masks.causal
torch.cuda.synchronize()
profile = cProfile.Profile()
t0 = time.perf_counter()
profile.enable()
out = flexfa.attention(q, k, v, score_mod=score_mod, block_mask=mask, backend=backend)
torch.cuda.synchronize()
forward = time.perf_counter() - t0
if backward:
    out.sum().backward()
    torch.cuda.synchronize()
profile.disable()
total = time.perf_counter() - t0
print(f"first call: forward {{forward:.2f}} s, with the backward {{total:.2f}} s (profiled)")
text = io.StringIO()
stats = pstats.Stats(profile, stream=text)
stats.sort_stats("cumulative").print_stats(lines)
stats.sort_stats("tottime").print_stats(lines // 2)
print(text.getvalue())
"""

_SHAPES = {"triton": (1, 4, 1024, 128), "fa4": (2, 16, 8192, 128)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="triton", choices=sorted(_SHAPES))
    ap.add_argument("--case", default="causal", choices=["causal", "alibi", "prefixlm"])
    ap.add_argument("--backward", action="store_true", help="profile the first backward too")
    ap.add_argument("--no-workers", action="store_true", help="FLEXFA_COMPILE_WORKERS=0")
    ap.add_argument("--lines", type=int, default=40)
    a = ap.parse_args()
    root = str(Path(__file__).resolve().parent.parent)
    subprocess.run([sys.executable, "-m", "compileall", "-q", f"{root}/flexfa"], check=False)
    code = _CHILD.format(
        root=root,
        shape=_SHAPES[a.backend],
        case=a.case,
        backend=a.backend,
        backward=a.backward,
        lines=a.lines,
    )
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(
            os.environ,
            FLEXFA_CACHE_DIR=f"{tmp}/flexfa",
            TRITON_CACHE_DIR=f"{tmp}/triton",
            FLEXFA_LOG_COMPILES="1",
        )
        if a.no_workers:
            env["FLEXFA_COMPILE_WORKERS"] = "0"
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    output = res.stderr + res.stdout
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / f"cold_profile_{a.backend}_{a.case}.txt"
        path.write_text(output)
    print(output if res.returncode == 0 else output[-4000:])
    sys.exit(res.returncode)


if __name__ == "__main__":
    main()
