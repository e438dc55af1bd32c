"""Per-call host time of `flexfa.attention`'s front end, on the CPU.

Times, per call (the fastest of `--repeat` rounds of `--calls` calls), with a learned relative-position
bias (a captured tensor that requires grad), a closed-over float and the causal mask:
  - `build_spec`: argument checks, trace-cache lookup, block-mask cache lookup;
  - `build_spec + Launcher`: the above plus the Triton launcher's plan lookup (no kernel launch);
  - `attention (tiled, L=16)`: a whole eager call on tiny inputs, forward only;
  - `decode step ...`: a decode call's host work through the Triton backend (Lq=1, B=2, Hq=8, Hkv=2,
    Lkv=512, fp16, GQA; then ALiBi with a sliding-window BlockMask), everything but the kernel
    launch (after a first real call, a launch computes the direct launch's argument fingerprint and
    launches nothing), under torch.no_grad,
    with repeated calls reusing their spec ("memo", Note [Repeated inference calls]) and without.

    python bench/host_overhead.py --calls 2000 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # lets the Triton launcher be built on a CPU

import torch

import flexfa
from flexfa.api import build_spec
from flexfa.codegen.triton.backend import Launcher


def per_call_us(fn, calls: int, repeat: int) -> float:
    fn()
    rounds = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return min(rounds)  # the least disturbed round (the machine is shared)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    table = torch.zeros(4, 33, requires_grad=True)
    c = 0.5

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + c * table[h, torch.clamp(q_idx - kv_idx, -16, 16) + 16]

    q, k, v = (torch.randn(1, 4, 256, 64) for _ in range(3))
    mask = flexfa.masks.causal

    def spec_only():
        build_spec(q, k, v, rel_bias, mask)

    def spec_and_launcher():
        Launcher(build_spec(q, k, v, rel_bias, mask))

    small = [torch.randn(1, 4, 16, 16) for _ in range(3)]

    def whole_call():
        with torch.no_grad():
            flexfa.attention(*small, score_mod=rel_bias, block_mask=mask, backend="tiled")

    for name, fn in (
        ("build_spec", spec_only),
        ("build_spec + Launcher", spec_and_launcher),
        ("attention (tiled, L=16)", whole_call),
        *decode_steps(),
    ):
        print(f"{name:34s} {per_call_us(fn, args.calls, args.repeat):8.1f} us/call")


def decode_steps():
    """(name, fn) of decode calls whose kernel launches are no-ops (after one real call)."""
    from flexfa import api
    from flexfa.runtime import launch

    qd = torch.randn(2, 8, 1, 64, dtype=torch.float16)
    kd, vd = (torch.randn(2, 2, 512, 64, dtype=torch.float16) for _ in range(2))
    window = flexfa.create_block_mask(flexfa.masks.sliding_window(128), 2, 8, 1, 512)
    pages = [torch.randn(16, 2, 64, 64, dtype=torch.float16) for _ in range(2)]
    table = torch.randperm(16, dtype=torch.int32).view(2, 8)
    lens = torch.tensor([512, 300], dtype=torch.int32)
    calls = {
        "plain": lambda: flexfa.attention(qd, kd, vd, enable_gqa=True, backend="triton"),
        "paged": lambda: flexfa.attention(
            qd, *pages, enable_gqa=True, page_table=table, kv_lens=lens, backend="triton"
        ),
        "ALiBi + window": lambda: flexfa.attention(
            qd, kd, vd, flexfa.mods.alibi, window, enable_gqa=True, backend="triton"
        ),
    }
    with torch.no_grad():
        for fn in calls.values():
            fn()  # compiles (interprets) once and prepares the plan
    # The host work alone: a direct launch computes its argument fingerprint and finds its
    # kernel, a launch of a known kernel (Note [Decode launches by spec]) launches nothing.
    torch.cuda.current_device = lambda: 0
    launch.DirectLaunch.__call__ = lambda self, grid, args: self._compiled.get(
        launch._fingerprint(args, torch.cuda.current_device())
    )
    launch.DirectLaunch.compiled_for = lambda self, args: "compiled"
    launch.DirectLaunch.call_compiled = lambda self, compiled, grid, args, stream=None: None
    eligible = api._memo_eligible

    def step(fn, memo: bool):
        def run():
            api._memo_eligible = eligible if memo else (lambda *a: False)
            with torch.no_grad():
                fn()

        return run

    return [
        (f"decode step, {name}, {'memo' if memo else 'no memo'}", step(fn, memo))
        for name, fn in calls.items()
        for memo in (False, True)
    ]


if __name__ == "__main__":
    main()
