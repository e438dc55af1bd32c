"""flexfa's Triton backend vs torch FlexAttention, side by side in one process (GPU only).

For each case (B=2, H=16, N=8192, D=128, bf16 unless changed by flags) it measures the median
forward and forward+backward time with `triton.testing.do_bench`, converts them to TFLOP/s over the
allowed (unmasked) pairs — forward 4·B·H·N²·D·density, forward+backward 3.5× that — and prints the
ratio flexfa / torch. It also checks that the two outputs agree.

    python bench/triton_vs_flex.py                       # all cases
    python bench/triton_vs_flex.py --cases causal,alibi_causal --n 4096
    python bench/triton_vs_flex.py --compile             # cold / warm compile times (subprocesses)

Results go to stdout (a table at the end) and, if $OUT is set, to $OUT/triton_vs_flex.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexfa
from flexfa import masks as fm
from flexfa import mods as fmods

CASES = (
    "full",
    "causal",
    "sliding_window_1024",
    "prefix_lm_2048",
    "document_causal",
    "alibi_causal",
    "softcap_causal",
)


def doc_ids(batch: int, n: int, device: str, seed: int = 1) -> torch.Tensor:
    """Packed documents of random lengths in [128, 2048), as in the anchor benchmark."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(batch, n, dtype=torch.int32)
    for b in range(batch):
        pos, d = 0, 0
        while pos < n:
            length = int(torch.randint(128, 2048, (1,), generator=g))
            ids[b, pos : pos + length] = d
            pos += length
            d += 1
    return ids.to(device)


def make_case(name: str, batch: int, heads: int, n: int, device: str):
    """(score_mod, mask_mod, mask depends on batch) for a case name."""
    if name == "full":
        return None, None, False
    if name == "causal":
        return None, fm.causal, False
    if name == "sliding_window_1024":
        return None, fm.sliding_window(1024), False
    if name == "prefix_lm_2048":
        return None, fm.prefix_lm(2048), False
    if name == "document_causal":
        return None, fm.and_masks(fm.causal, fm.document(doc_ids(batch, n, device))), True
    if name == "alibi_causal":
        return fmods.alibi.bind(heads), fm.causal, False
    if name == "softcap_causal":
        return fmods.softcap(30.0), fm.causal, False
    raise ValueError(f"unknown case {name!r}; choose from {CASES}")


def density(mask_mod, batch: int, n: int, device: str) -> float:
    """Exact fraction of allowed pairs, evaluated densely a block of rows at a time."""
    if mask_mod is None:
        return 1.0
    total = 0
    cols = torch.arange(n, device=device, dtype=torch.int32)
    for b in range(batch):
        bt = torch.tensor(b, device=device, dtype=torch.int32)
        h = torch.tensor(0, device=device, dtype=torch.int32)
        for r0 in range(0, n, 1024):
            rows = torch.arange(r0, min(r0 + 1024, n), device=device, dtype=torch.int32)
            total += int(mask_mod(bt, h, rows[:, None], cols[None, :]).sum())
    return total / (batch * n * n)


def bench_case(name: str, args) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from triton.testing import do_bench

    B, H, N, D = args.batch, args.heads, args.n, args.head_dim
    dev, dt = torch.device("cuda", torch.cuda.current_device()), getattr(torch, args.dtype)
    score_mod, mask_mod, per_batch = make_case(name, B, H, N, dev)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, N, D, device=dev, dtype=dt)
    rec: dict = {"case": name, "B": B, "H": H, "N": N, "D": D, "dtype": args.dtype}
    rec["density"] = dens = density(mask_mod, B, N, dev)
    fl_fwd = 4 * B * H * N * N * D * dens

    # flexfa
    t0 = time.perf_counter()
    bm_f = (
        flexfa.create_block_mask(mask_mod, B if per_batch else None, None, N, N, device=dev)
        if mask_mod
        else None
    )
    torch.cuda.synchronize()
    rec["flexfa_blockmask_first_ms"] = 1e3 * (time.perf_counter() - t0)

    def f_fwd():
        return flexfa.attention(q, k, v, score_mod=score_mod, block_mask=bm_f, backend="triton")

    # torch FlexAttention
    flex = torch.compile(flex_attention, dynamic=False)
    bm_t = (
        create_block_mask(mask_mod, B if per_batch else None, None, N, N, device=dev)
        if mask_mod
        else None
    )

    def t_fwd():
        return flex(q, k, v, score_mod=score_mod, block_mask=bm_t)

    t0 = time.perf_counter()
    with torch.no_grad():
        o_f = f_fwd()
    torch.cuda.synchronize()
    rec["flexfa_first_fwd_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        o_t = t_fwd()
    torch.cuda.synchronize()
    rec["flex_first_fwd_s"] = time.perf_counter() - t0
    rec["max_abs_diff_out"] = float((o_f.float() - o_t.float()).abs().max())

    # Gradients agree too (one backward each, outside timing).
    gf = torch.autograd.grad(f_fwd(), (q, k, v), do)
    gt = torch.autograd.grad(t_fwd(), (q, k, v), do)
    rec["max_abs_diff_grads"] = max(
        float((a.float() - b.float()).abs().max()) for a, b in zip(gf, gt)
    )

    def fb(fn):
        def run():
            o = fn()
            o.backward(do)

        return run

    for label, fn in (("flexfa", f_fwd), ("flex", t_fwd)):
        with torch.no_grad():
            ms = do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")
        rec[f"{label}_fwd_ms"] = ms
        rec[f"{label}_fwd_tflops"] = fl_fwd / (ms * 1e-3) / 1e12
        ms = do_bench(
            fb(fn), warmup=args.warmup, rep=args.rep, return_mode="median", grad_to_none=[q, k, v]
        )
        rec[f"{label}_fwdbwd_ms"] = ms
        rec[f"{label}_fwdbwd_tflops"] = 3.5 * fl_fwd / (ms * 1e-3) / 1e12

    if not args.fused_dq:
        rec["ratio_fwd"] = rec["flexfa_fwd_tflops"] / rec["flex_fwd_tflops"]
        rec["ratio_fwdbwd"] = rec["flexfa_fwdbwd_tflops"] / rec["flex_fwdbwd_tflops"]
        return rec

    # The other backward mode: dQ fused into the dK/dV kernel with atomics.
    def f_fused():
        return flexfa.attention(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=bm_f,
            backend="triton",
            kernel_options={"bwd_dq": "fused"},
        )

    ms = do_bench(
        fb(f_fused), warmup=args.warmup, rep=args.rep, return_mode="median", grad_to_none=[q, k, v]
    )
    rec["flexfa_fused_fwdbwd_ms"] = ms
    rec["flexfa_fused_fwdbwd_tflops"] = 3.5 * fl_fwd / (ms * 1e-3) / 1e12
    rec["ratio_fwd"] = rec["flexfa_fwd_tflops"] / rec["flex_fwd_tflops"]
    rec["ratio_fwdbwd"] = rec["flexfa_fwdbwd_tflops"] / rec["flex_fwdbwd_tflops"]
    return rec


# -- compile times ----------------------------------------------------------------------------------

_COMPILE_CHILD = r"""
import json, logging, sys, time, torch
if {log!r}:
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(threadName)s %(message)s")
sys.path.insert(0, {root!r})
import flexfa
sys.path.insert(0, {bench!r})
from triton_vs_flex import make_case
which, name = {which!r}, {name!r}
B, H, N, D = 1, 4, 1024, 128
score_mod, mask_mod, per_batch = make_case(name, B, H, N, "cuda")
q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
torch.cuda.synchronize()
if which == "flexfa":
    run = lambda: flexfa.attention(q, k, v, score_mod=score_mod, block_mask=mask_mod, backend="triton")
else:
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    bm = create_block_mask(mask_mod, B if per_batch else None, None, N, N, device="cuda") if mask_mod else None
    flex = torch.compile(flex_attention, dynamic=False)
    run = lambda: flex(q, k, v, score_mod=score_mod, block_mask=bm)
t0 = time.perf_counter(); o = run(); torch.cuda.synchronize(); fwd = time.perf_counter() - t0
t0 = time.perf_counter(); o.sum().backward(); torch.cuda.synchronize(); bwd = time.perf_counter() - t0
extra = {{}}
if which == "flexfa":
    import dataclasses
    from flexfa.runtime import workers
    extra["workers"] = dataclasses.asdict(workers.stats)
print(json.dumps(dict(fwd_s=fwd, bwd_s=bwd, **extra)))
"""


def compile_times(cases: list[str], systems: list[str], log: bool = False) -> list[dict]:
    """First-call times in fresh processes: 'cold' with empty caches, 'warm' reusing them. With
    `log`, flexfa's compile log of each child (FLEXFA_LOG_COMPILES, ms since the child started) is
    kept in the row."""
    root = str(Path(__file__).resolve().parent.parent)
    # flexfa's modules byte-compiled first, as an installed package's are (pip compiles them, and
    # torch's come so): where Python writes no bytecode, each cold child would otherwise compile
    # flexfa's ~120 modules from source (0.37 s on the H200), a cost no installed flexfa pays.
    subprocess.run([sys.executable, "-m", "compileall", "-q", f"{root}/flexfa"], check=False)
    rows = []
    for name in cases:
        for which in systems:
            with tempfile.TemporaryDirectory() as tmp:
                env = dict(
                    os.environ,
                    FLEXFA_CACHE_DIR=f"{tmp}/flexfa",
                    TRITON_CACHE_DIR=f"{tmp}/triton",
                    TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor",
                )
                if log:
                    env["FLEXFA_LOG_COMPILES"] = "1"
                code = _COMPILE_CHILD.format(
                    root=root, bench=str(Path(__file__).parent), which=which, name=name, log=log
                )
                row = {"case": name, "system": which}
                for phase in ("cold", "warm"):
                    res = subprocess.run(
                        [sys.executable, "-c", code], env=env, capture_output=True, text=True
                    )
                    if res.returncode != 0:
                        row[phase] = {"error": res.stderr[-800:]}
                    else:
                        row[phase] = json.loads(res.stdout.strip().splitlines()[-1])
                    if log:
                        row[phase]["log"] = [
                            ln for ln in res.stderr.splitlines() if "flexfa" in ln
                        ][-40:]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--rep", type=int, default=300)
    p.add_argument("--compile", action="store_true", help="measure cold/warm compile times instead")
    p.add_argument(
        "--systems", default="flexfa,flex", help="with --compile: flexfa, flex (torch) or both"
    )
    p.add_argument("--log", action="store_true", help="with --compile: keep flexfa's compile log")
    p.add_argument("--fused-dq", action="store_true", help="also time the fused-dQ backward mode")
    args = p.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    out_dir = os.environ.get("OUT")
    if args.compile:
        rows = compile_times(cases, args.systems.split(","), args.log)
        if out_dir:
            Path(out_dir, "compile_times.json").write_text(json.dumps(rows, indent=1))
        print(
            f"\n{'case':22} {'system':7} {'cold fwd':>9} {'cold bwd':>9} {'warm fwd':>9} {'warm bwd':>9}"
        )
        for r in rows:
            c, w = r["cold"], r["warm"]
            if "error" in c or "error" in w:
                print(
                    f"{r['case']:22} {r['system']:7} error: {(c.get('error') or w.get('error'))[-200:]}"
                )
                continue
            print(
                f"{r['case']:22} {r['system']:7} {c['fwd_s']:9.2f} {c['bwd_s']:9.2f} {w['fwd_s']:9.2f} {w['bwd_s']:9.2f}"
            )
        return
    results = []
    for name in cases:
        try:
            rec = bench_case(name, args)
        except Exception as e:  # keep going: one failing case must not hide the others
            rec = {"case": name, "error": repr(e)[:500]}
        print(json.dumps(rec), flush=True)
        results.append(rec)
    if out_dir:
        Path(out_dir, "triton_vs_flex.json").write_text(json.dumps(results, indent=1))
    print(
        f"\n{'case':22} {'dens':>5} | {'fwd TF/s':>17} {'ratio':>6} | {'fwd+bwd TF/s':>17} {'ratio':>6} | {'diff':>7}"
    )
    print(
        f"{'':22} {'':5} | {'flexfa':>8} {'torch':>8} {'':6} | {'flexfa':>8} {'torch':>8} {'':6} |"
    )
    for r in results:
        if "error" in r:
            print(f"{r['case']:22} ERROR {r['error'][:150]}")
            continue
        print(
            f"{r['case']:22} {r['density']:5.3f} | {r['flexfa_fwd_tflops']:8.1f} {r['flex_fwd_tflops']:8.1f} "
            f"{r['ratio_fwd']:6.2f} | {r['flexfa_fwdbwd_tflops']:8.1f} {r['flex_fwdbwd_tflops']:8.1f} "
            f"{r['ratio_fwdbwd']:6.2f} | {r['max_abs_diff_out']:7.1e}"
            + (
                f" | fused dQ f+b {r['flexfa_fused_fwdbwd_tflops']:6.1f}"
                if "flexfa_fused_fwdbwd_tflops" in r
                else ""
            )
        )


if __name__ == "__main__":
    main()
