"""Packed prefill: 8 sequences of mixed lengths (512-8192) in one packed batch, causal within each.

Shape: H=16, D=128, bf16, the lengths below (26 124 tokens). Every system in one process,
`triton.testing.do_bench` medians, TFLOP/s over the allowed pairs (forward 4·H·D·Σ L(L+1)/2,
forward+backward 3.5× that):

  flexfa   flexfa.attention(q, k, v, block_mask=causal, cu_seqlens_q=cu, cu_seqlens_kv=cu), the
           backend `--flexfa-backend` picks (default "auto"); on fa4 that is FA4's varlen kernels
           (Note [Packed calls on FA4's varlen path])
  flexfa_concat  the same call as one call on the concatenation with a document mask, the path
           fa4 took before (kernel_options={"block_sparse": True}; fa4 only)
  fa4      FlashAttention-4's flash_attn_varlen_func(..., causal=True), if installed
  flex     torch.compile(flex_attention) with the equivalent document-causal BlockMask (built
           once, outside the timing)

It also times what a new packed batch costs flexfa before its kernels run: the packing of the
offsets and the BlockMask of the packed causal mask (the goal is <= 0.2 ms; timed once its
kernels are compiled), and torch's `create_block_mask` of the same mask. flexfa's is timed twice:
"same lengths" builds from a fresh offsets tensor of the lengths above each time, "new lengths"
from the offsets of another batch each time (8 random lengths in 512-8192, as a training loop's
batches come), which is what a packed batch costs in use; on a GPU also "new lengths on the host",
the same with the offsets given on the CPU (Note [Offsets on the host] in flexfa/varlen.py).
With the flexfa system it also times whole forward calls, each with the offsets of a new batch
("new offsets, forward": ms per call, synchronized after each, so its host work counts in full).

    python bench/varlen.py [--systems flexfa,flexfa_concat,fa4,flex] [--flexfa-backend auto]
                           [--rep 100]
    python bench/varlen.py --systems none            # the block-mask timings alone
    python bench/varlen.py --device cpu              # flexfa's block-mask timing on the CPU
    python bench/varlen.py --device cpu --stub-launches  # the GPU path's host work, on the CPU
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexfa
from flexfa.varlen import packed_mods, packing

H, D, DT = 16, 128, torch.bfloat16
LENGTHS = [512, 8192, 1024, 3000, 6000, 700, 4096, 2600]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def stub_launches() -> None:
    """Send packed batches down the path a GPU takes (the packing and block-list kernels) with
    every launch left out: the host work of that path, timed on a machine without a GPU. The
    checks of that path run as on a GPU (whether to use the kernels, the launch's argument
    fingerprint and specialization); only the compiled kernel's launch does nothing."""
    import flexfa.blockmask.build as build
    import flexfa.runtime.launch as launch

    use_fused = build.use_fused_kernel
    build.use_fused_kernel = lambda device: use_fused(torch.device("cuda", 0))
    torch.cuda.current_device = lambda: 0

    class NoLaunch:  # a compiled kernel whose launch does nothing
        def __getitem__(self, grid):
            return lambda *args: None

    try_call = launch.DirectLaunch.try_call

    def stubbed(self, grid, args, **options):
        if try_call(self, grid, args, **options):
            return True
        self._by_specialization[launch._specialization(args, 0)] = NoLaunch()  # "compiled" now
        return try_call(self, grid, args, **options)

    launch.DirectLaunch.try_call = stubbed


def main() -> None:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", default="flexfa,flexfa_concat,fa4,flex")
    ap.add_argument("--flexfa-backend", default="auto")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--device", default="cuda", help="cpu: flexfa's block-mask timing only")
    ap.add_argument("--builds", type=int, default=40, help="block masks timed per row")
    ap.add_argument(
        "--stub-launches",
        action="store_true",
        help="with --device cpu: the GPU's path (the packing and block-list kernels), launches left out",
    )
    a = ap.parse_args()
    if a.stub_launches:
        if a.device != "cpu":
            raise SystemExit(
                "--stub-launches times the GPU path's host work on the CPU: --device cpu"
            )
        stub_launches()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    total = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    pairs = sum(n * (n + 1) // 2 for n in LENGTHS)
    flops = 4 * H * D * pairs
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(1, H, total, D, device=dev, dtype=DT, requires_grad=True) for _ in range(3)
    )
    do = torch.randn_like(q)
    records = []

    def emit(**rec) -> None:
        records.append(rec)
        print(json.dumps(rec), flush=True)

    # What a new batch of offsets costs before the kernels: packing + the packed causal BlockMask.
    # 40 batches warm the caches (the kernels' specializations: Note [Concurrent compiles]),
    # --builds others are timed, each once.
    gen = torch.Generator().manual_seed(1)
    batches, host_batches = [], []
    for _ in range(40 + a.builds):
        lens = torch.randint(512, 8193, (len(LENGTHS),), generator=gen)
        offsets = [0, *lens.cumsum(0).tolist()]
        batches.append((torch.tensor(offsets, dtype=torch.int32, device=dev), offsets[-1]))
        host_batches.append((torch.tensor(offsets, dtype=torch.int32), offsets[-1]))

    def build_flexfa(new_lengths: bool = False, host: bool = False) -> None:
        # As a packed call makes them: the BlockMask's kernel writes the positions too (Note
        # [Positions written with the block lists]).
        if host:  # another batch's offsets, given on the CPU (Note [Offsets on the host])
            fresh, n = host_batches.pop(0)
        elif new_lengths:  # another batch's offsets, never seen before
            fresh, n = batches.pop(0)
        else:
            fresh, n = cu.clone(), total
        pack = packing(fresh, fresh, n, n, q.device, defer=True)
        _, mask = packed_mods(None, causal, pack, H)
        flexfa.create_block_mask(mask, 1, None, n, n, device=dev)
        pack.fill()

    def build_torch():
        from torch.nn.attention.flex_attention import create_block_mask

        doc = torch.repeat_interleave(
            torch.arange(len(LENGTHS), device=dev), torch.tensor(LENGTHS, device=dev)
        )

        def doc_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        return create_block_mask(doc_causal, 1, None, total, total, device=dev)

    # torch's dense build of 26k x 26k pairs is not run on the CPU (gigabytes, seconds).
    timed = [("flexfa", "same lengths", build_flexfa)]
    timed.append(("flexfa", "new lengths", lambda: build_flexfa(new_lengths=True)))
    if cuda:
        timed.append(("flexfa", "new lengths on the host", lambda: build_flexfa(host=True)))
    if cuda:
        timed.append(("torch", "same lengths", build_torch))
    for name, batches_of, build in timed:
        build()
        if name == "flexfa":  # its kernels compile in the background (Note [Concurrent compiles])
            from flexfa.runtime.launch import wait_for_background

            wait_for_background()
            for _ in range(39 if batches_of.startswith("new lengths") else 1):
                build()
            wait_for_background()
        times = []
        for _ in range(a.builds if batches_of.startswith("new lengths") else a.builds // 2):
            sync()
            t0 = time.perf_counter()
            build()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        emit(block_mask=name, batches=batches_of, ms=statistics.median(times), min_ms=min(times))

    fns = {}
    systems = a.systems.split(",") if cuda else []
    if "flexfa" in systems:
        fns["flexfa"] = lambda q, k, v: flexfa.attention(
            q, k, v, block_mask=causal, cu_seqlens_q=cu, cu_seqlens_kv=cu,
            backend=a.flexfa_backend,
        )  # fmt: skip
    if "flexfa_concat" in systems:
        fns["flexfa_concat"] = lambda q, k, v: flexfa.attention(
            q, k, v, block_mask=causal, cu_seqlens_q=cu, cu_seqlens_kv=cu, backend="fa4",
            kernel_options={"block_sparse": True},
        )  # fmt: skip
    if "fa4" in systems:
        try:
            from flash_attn.cute import flash_attn_varlen_func

            fns["fa4"] = lambda q, k, v: flash_attn_varlen_func(
                q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(LENGTHS),
                max_seqlen_k=max(LENGTHS), causal=True,
            )[0].transpose(0, 1)[None]  # fmt: skip
        except Exception as e:  # report and go on without FA4
            emit(system="fa4", error=repr(e)[:200])
    if "flex" in systems:
        from torch.nn.attention.flex_attention import flex_attention

        tflex = torch.compile(flex_attention, dynamic=False)
        tbm = build_torch()
        fns["flex"] = lambda q, k, v: tflex(q, k, v, block_mask=tbm)

    ref = None
    for name, fn in fns.items():
        try:
            t0 = time.perf_counter()
            out = fn(q, k, v)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            with torch.no_grad():
                fwd = do_bench(lambda: fn(q, k, v), warmup=25, rep=a.rep, return_mode="median")
            fn(q, k, v).backward(do)
            fb = do_bench(
                lambda: fn(q, k, v).backward(do), warmup=10, rep=a.rep, return_mode="median",
                grad_to_none=[q, k, v],
            )  # fmt: skip
        except Exception as e:
            emit(system=name, error=repr(e)[:300])
            continue
        out = out.detach().float()
        ref = out if ref is None else ref
        emit(
            system=name,
            first_call_s=first,
            fwd_ms=fwd,
            fwd_bwd_ms=fb,
            fwd_tflops=flops / fwd / 1e9,
            fwd_bwd_tflops=3.5 * flops / fb / 1e9,
            rel_diff_vs_first=float((out - ref).norm() / ref.norm()),
        )
    if "flexfa" in fns:
        # A packed call with the offsets of a new batch each time, as a training or serving loop
        # makes them, forward under no_grad: ms per call with a synchronization after each, so
        # that the host work before the kernels counts in full. Each batch keeps the longest
        # length (8192) and the total of the lengths above, so the kernels are the same.
        rest = total - max(LENGTHS)
        calls = []
        for _ in range(20 + a.builds):
            cuts = sorted(torch.randint(0, rest + 1, (len(LENGTHS) - 2,), generator=gen).tolist())
            lens = [max(LENGTHS), *(hi - lo for lo, hi in zip([0, *cuts], [*cuts, rest]))]
            calls.append(
                torch.tensor(
                    [0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev
                )
            )
        call = lambda offsets: flexfa.attention(
            q, k, v, block_mask=causal, cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
            backend=a.flexfa_backend,
        )  # fmt: skip
        times = []
        with torch.no_grad():
            for i, offsets in enumerate(calls):
                sync()
                t0 = time.perf_counter()
                call(offsets)
                sync()
                if i >= 20:  # the first warm the caches
                    times.append((time.perf_counter() - t0) * 1e3)
        emit(system="flexfa", calls="new offsets, forward", ms=statistics.median(times),
             min_ms=min(times))  # fmt: skip
        lines = flexfa.explain_backend(
            q, k, v, block_mask=causal, cu_seqlens_q=cu, cu_seqlens_kv=cu
        ).splitlines()
        emit(explain=lines[-1], fa4=lines[0])  # which path fa4 takes
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "varlen.json"), "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
