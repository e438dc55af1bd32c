"""Training speed of learnable mods: gradients of captured tensors (GPU only).

For each case and shape it measures, in one process, the median time (`triton.testing.do_bench`)
of the forward and of forward+backward with the mod's tensor frozen, the same with it learnable
(its gradient accumulated by the kernels, Note [Scatter-add of captured gradients] in
flexfa/codegen/triton/scatter.py), learnable with `deterministic=True`, and torch FlexAttention
(`torch.compile(flex_attention)`) on the same learnable call where it runs ("fails: <reason>"
otherwise). All calls are causal. The table gives frozen/learnable and frozen/deterministic
(fwd+bwd; 1.0 means a learnable tensor costs nothing) and torch/flexfa (learnable fwd+bwd; above 1
means flexfa is faster).

Cases (every tensor per query head unless said otherwise):
    relbias      table[h, clamp(q - kv, -128, 128) + 128], 257 entries per head
    t5           T5's log-bucketed relative position, 32 buckets per head
    alibi        slopes[h] * (kv - q)
    temperature  score * temperature[h]
    bh_bias      bias[b, h]
    block2d      table[q // 64, kv // 64]

    python bench/captured_grads.py
    python bench/captured_grads.py --cases relbias,t5 --shapes 1x32x8x8192x128 --no-torch
    python bench/captured_grads.py --shapes 2x16x16x4096x64,1x16x16x16384x64
    python bench/captured_grads.py --backend triton      # every call on the Triton kernels
    python bench/captured_grads.py --smoke               # a tiny shape, on the CPU too
    python bench/captured_grads.py --backend triton --kernel-options '{"bwd_block_m1": 32}'

A shape is BxHqxHkvxNxD. Results go to stdout and, if $OUT is set, to $OUT/captured_grads.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexfa
from flexfa import masks as fm

CASES = ("relbias", "t5", "alibi", "temperature", "bh_bias", "block2d")
DEFAULT_SHAPES = "1x32x8x8192x128,2x16x16x4096x64"


def make_mod(name: str, batch: int, heads: int, n: int, device: torch.device):
    """(score_mod, learnable tensor) for a case; the tensor is float32."""

    def param(*shape: int, fill: float = 0.0) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        return (torch.randn(shape, generator=g) * 0.1 + fill).to(device)

    if name == "relbias":
        table = param(heads, 257)

        def relbias(score, b, h, q_idx, kv_idx):
            return score + table[h, torch.clamp(q_idx - kv_idx, -128, 128) + 128]

        return relbias, table
    if name == "t5":
        table = param(heads, 32)

        def t5(score, b, h, q_idx, kv_idx):
            d = q_idx - kv_idx  # buckets 0-15 for kv before q, 16-31 after, log beyond 8
            n_ = torch.abs(d)
            log_bucket = 8 + (torch.log(n_.float() / 8 + 1e-6) / math.log(16) * 8).to(torch.int32)
            bucket = torch.where(n_ < 8, n_, torch.clamp(log_bucket, max=15))
            return score + table[h, bucket + torch.where(d < 0, 16, 0)]

        return t5, table
    if name == "alibi":
        slopes = param(heads, fill=0.05)

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        return alibi, slopes
    if name == "temperature":
        temperature = param(heads, fill=1.0)

        def temperature_mod(score, b, h, q_idx, kv_idx):
            return score * temperature[h]

        return temperature_mod, temperature
    if name == "bh_bias":
        bias = param(batch, heads)

        def bh_bias(score, b, h, q_idx, kv_idx):
            return score + bias[b, h]

        return bh_bias, bias
    if name == "block2d":
        blocks = (n + 63) // 64
        table = param(blocks, blocks)

        def block2d(score, b, h, q_idx, kv_idx):
            return score + table[q_idx // 64, kv_idx // 64]

        return block2d, table
    raise ValueError(f"unknown case {name!r}; choose from {CASES}")


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 5:
        raise ValueError(f"--shapes: expected BxHqxHkvxNxD (e.g. 1x32x8x8192x128), got {text!r}")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def _cpu_bench(fn, warmup: int, rep: int, return_mode: str = "median", grad_to_none=None):
    """`do_bench`'s interface on the CPU (`--smoke`): the median of a few timed calls, ms."""
    del warmup, rep, return_mode
    times = []
    for _ in range(3):
        for t in grad_to_none or ():
            t.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def bench_case(name: str, shape: tuple[int, int, int, int, int], args) -> dict:
    B, Hq, Hkv, N, D = shape
    if args.smoke and not torch.cuda.is_available():
        dev, dt, do_bench = torch.device("cpu"), torch.float32, _cpu_bench
    else:
        from triton.testing import do_bench

        dev, dt = torch.device("cuda", torch.cuda.current_device()), getattr(torch, args.dtype)
    torch.manual_seed(0)
    q = torch.randn(B, Hq, N, D, device=dev, dtype=dt, requires_grad=True)
    k, v = (torch.randn(B, Hkv, N, D, device=dev, dtype=dt, requires_grad=True) for _ in "kv")
    do = torch.randn(B, Hq, N, D, device=dev, dtype=dt)
    score_mod, tensor = make_mod(name, B, Hq, N, dev)
    gqa = Hq != Hkv
    rec: dict = {
        "case": name,
        "shape": "x".join(map(str, shape)),
        "dtype": str(dt).removeprefix("torch."),
    }
    bm = flexfa.create_block_mask(fm.causal, None, None, N, N, device=dev)

    def flexfa_call(deterministic: bool = False):
        def call():
            return flexfa.attention(
                q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa,
                backend=args.backend, deterministic=deterministic,
                kernel_options=args.kernel_options,
            )  # fmt: skip

        return call

    def chosen(learnable: bool) -> str:
        """The backend the call runs on (the last line of explain_backend: "auto: <name>")."""
        tensor.requires_grad_(learnable)
        if args.backend != "auto":
            return args.backend
        text = flexfa.explain_backend(
            q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa
        )  # fmt: skip
        return text.strip().splitlines()[-1].split(":", 1)[1].strip()

    def fwd_bwd(fn, learnable: bool):
        def run():
            fn().backward(do)

        tensor.requires_grad_(learnable)
        grads = [q, k, v, tensor] if learnable else [q, k, v]
        fn().backward(do)  # compile outside the timing
        ms = do_bench(
            run, warmup=args.warmup, rep=args.rep, return_mode="median", grad_to_none=grads
        )
        return ms

    def fwd(fn):
        tensor.requires_grad_(False)
        with torch.no_grad():
            fn()
            return do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")

    rec["frozen_backend"], rec["learnable_backend"] = chosen(False), chosen(True)
    rec["fwd_ms"] = fwd(flexfa_call())
    rec["frozen_ms"] = fwd_bwd(flexfa_call(), learnable=False)
    rec["learnable_ms"] = fwd_bwd(flexfa_call(), learnable=True)
    if args.deterministic:
        rec["deterministic_ms"] = fwd_bwd(flexfa_call(deterministic=True), learnable=True)
    if args.torch:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
            bm_t = create_block_mask(
                lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, N, N, device=dev
            )

            def torch_call():
                return flex(q, k, v, score_mod=score_mod, block_mask=bm_t, enable_gqa=gqa)

            rec["torch_fwd_ms"] = fwd(torch_call)
            rec["torch_learnable_ms"] = fwd_bwd(torch_call, learnable=True)
            # The two learnable gradients agree (one backward each, outside timing).
            tensor.requires_grad_(True)
            g_f = torch.autograd.grad(flexfa_call()(), tensor, do)[0]
            g_t = torch.autograd.grad(torch_call(), tensor, do)[0]
            scale = float(g_t.abs().max()) or 1.0
            rec["grad_rel_diff_vs_torch"] = float((g_f - g_t).abs().max()) / scale
        except Exception as e:  # report any failure of torch's path
            rec["torch_fails"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            torch._dynamo.reset()
    tensor.requires_grad_(False)
    return rec


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b is not None else "-"


def print_table(records: list[dict]) -> None:
    head = (
        f"{'case':<12}{'shape':<18}{'fwd':>8}{'frozen':>9}{'learn':>9}{'determ':>9}"
        f"{'torch':>9}  {'frz/lrn':>7}{'frz/det':>8}{'tch/ffa':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in records:
        torch_ms = r.get("torch_learnable_ms")

        def ms(key, r=r):
            return f"{r[key]:9.2f}" if key in r else f"{'-':>9}"

        print(
            f"{r['case']:<12}{r['shape']:<18}{r['fwd_ms']:8.2f}{ms('frozen_ms')}"
            f"{ms('learnable_ms')}{ms('deterministic_ms')}{ms('torch_learnable_ms')}  "
            f"{_ratio(r['frozen_ms'], r['learnable_ms']):>7}"
            f"{_ratio(r['frozen_ms'], r.get('deterministic_ms')):>8}"
            f"{_ratio(torch_ms, r['learnable_ms']):>8}"
        )
        if r.get("frozen_backend") != r.get("learnable_backend"):
            print(f"    frozen on {r['frozen_backend']}, learnable on {r['learnable_backend']}")
        if "torch_fails" in r:
            print(f"    torch flex fails: {r['torch_fails']}")
    print("times in ms (median); fwd+bwd except the fwd column; learnable/torch: tensor learnable")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated, from " + ", ".join(CASES)
    )
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated BxHqxHkvxNxD")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument(
        "--backend",
        default="auto",
        help="flexfa's backend for every call (auto: what a user gets; the frozen call may then "
        "run on fa4 and the learnable one on triton, both recorded)",
    )
    ap.add_argument("--no-torch", dest="torch", action="store_false", help="skip torch flex")
    ap.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    ap.add_argument(
        "--kernel-options",
        type=json.loads,
        default=None,
        help="flexfa's kernel_options for every call, as JSON (e.g. '{\"bwd_block_m1\": 32}')",
    )
    ap.add_argument("--warmup", type=int, default=10, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=50, help="do_bench repetitions, ms")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny shape, on the CPU without a GPU (float32, wall-clock times): checks the script",
    )
    args = ap.parse_args()
    if args.smoke:
        args.shapes = "1x2x1x256x16"
    elif not torch.cuda.is_available():
        sys.exit("captured_grads.py needs a CUDA GPU (--smoke runs a tiny shape on the CPU)")
    records = []
    for shape_text in args.shapes.split(","):
        shape = parse_shape(shape_text)
        for name in args.cases.split(","):
            rec = bench_case(name.strip(), shape, args)
            print(json.dumps(rec), flush=True)
            records.append(rec)
    print_table(records)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "captured_grads.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
