"""What checking cached modules costs on the first call of a process (Note [Disk caches]).

    python bench/cache_first_call.py                  # GPU if there is one, else the CPU
    python bench/cache_first_call.py --runs 9 --cases alibi_causal

One process fills flexfa's and Triton's caches (in a temporary directory); then fresh processes
make one attention call each with those caches warm, alternating two modes:

- `verified`: flexfa as it is: each cached module is used only after re-rendering it and
  comparing the bytes (flexfa/runtime/diskcache.py);
- `unverified`: the file is imported as found, as flexfa did before the check (the child patches
  `diskcache.load_generated`; nothing in flexfa offers this). That import also wrote and reused a
  bytecode file in `__pycache__`, which the checked path does not trust, so the difference is the
  re-render and comparison plus compiling the module's Python.

Per process it measures the first call (synchronized; the CUDA context is created before) and the
time spent loading generated modules (attention and, on a GPU, the block-mask kernel). Medians
per mode print as a table; with $OUT set they also go to $OUT/cache_first_call.json. On the CPU
the kernels run in Triton's interpreter with tiny shapes: only the difference between the modes
means something there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = ("causal", "alibi_causal", "softcap_document")

_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    mode, case, device = sys.argv[1], sys.argv[2], sys.argv[3]
    cuda = device == "cuda"
    if cuda:  # the CUDA context and cuBLAS start before the clock does
        x = torch.randn(64, 64, device="cuda")
        (x @ x).sum().item()
    import flexfa
    from flexfa.runtime import diskcache
    import importlib.util

    from flexfa.codegen.triton import module as tmodule

    def _import_unchecked(path, name):  # what flexfa did before checking cached modules
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    real_load = diskcache.load_generated
    loading = [0.0]

    def unverified(backend, entry, render, name, *, key=None, file_name="kernels.py"):
        root = diskcache.directory(backend)
        path = root / entry / file_name if root is not None else None
        if path is not None and path.is_file():  # the import flexfa did before the check
            return diskcache.Loaded(_import_unchecked(path, name), "disk", path)
        return real_load(backend, entry, render, name, key=key, file_name=file_name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return (real_load if mode == "verified" else unverified)(*args, **kwargs)
        finally:
            loading[0] += time.perf_counter() - t

    diskcache.load_generated = timed
    if cuda:
        shape, dtype = (1, 4, 1024, 128), torch.bfloat16
    else:
        shape, dtype = (1, 2, 32, 16), torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    doc = (torch.arange(shape[2], device=device) // max(1, shape[2] // 4)).view(1, -1)
    score_mod, mask_mod = {
        "causal": (None, flexfa.masks.causal),
        "alibi_causal": (flexfa.mods.alibi, flexfa.masks.causal),
        "softcap_document": (
            flexfa.mods.softcap(30.0),
            flexfa.and_masks(flexfa.masks.causal, flexfa.masks.document(doc)),
        ),
    }[case]
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = flexfa.attention(q, k, v, score_mod=score_mod, block_mask=mask_mod, backend="triton")
    if cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - t
    print(json.dumps({
        "first_call_ms": 1e3 * first,
        "load_ms": 1e3 * loading[0],
        "disk_hits": tmodule.stats.disk_hits,
        "writes": tmodule.stats.writes,
        "finite": bool(torch.isfinite(out).all()),
    }))
    """
)


def _child(mode: str, case: str, device: str, env: dict) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, case, device],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if res.returncode != 0:
        raise RuntimeError(f"{mode} {case}: child failed\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure(case: str, device: str, runs: int, workdir: Path) -> dict:
    env = dict(os.environ)
    env["FLEXFA_CACHE_DIR"] = str(workdir / f"flexfa-{case}")
    env["TRITON_CACHE_DIR"] = str(workdir / f"triton-{case}")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    warm = _child("verified", case, device, env)  # fills both caches
    print(json.dumps({"case": case, "mode": "cold", **warm}), flush=True)
    assert warm["writes"] == 1, warm
    rows: dict[str, list[dict]] = {"verified": [], "unverified": []}
    for _ in range(runs):
        for mode in rows:  # alternate, so drift in the machine's load hits both
            got = _child(mode, case, device, env)
            assert got["disk_hits"] == 1 and got["writes"] == 0 and got["finite"], got
            print(json.dumps({"case": case, "mode": mode, **got}), flush=True)
            rows[mode].append(got)
    result = {
        "case": case,
        "device": device,
        "runs": runs,
        "cold_first_call_ms": warm["first_call_ms"],
    }
    for mode, got in rows.items():
        for field in ("first_call_ms", "load_ms"):
            result[f"{mode}_{field}"] = statistics.median(r[field] for r in got)
    result["verify_cost_ms"] = result["verified_load_ms"] - result["unverified_load_ms"]
    return result


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {CASES}")
    p.add_argument("--runs", type=int, default=5, help="fresh processes per mode and case")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r}; expected one of {CASES}")
    results = []
    with tempfile.TemporaryDirectory(prefix="flexfa-bench-") as tmp:
        for case in cases:
            results.append(measure(case, args.device, args.runs, Path(tmp)))
    head = (
        f"{'case':<18} {'first call, verified':>21} {'unverified':>11} "
        f"{'loading, verified':>18} {'unverified':>11} {'check costs':>12}"
    )
    print(f"device: {args.device}; medians over {args.runs} fresh processes per mode; ms")
    print(head)
    for r in results:
        print(
            f"{r['case']:<18} {r['verified_first_call_ms']:>21.1f} "
            f"{r['unverified_first_call_ms']:>11.1f} {r['verified_load_ms']:>18.2f} "
            f"{r['unverified_load_ms']:>11.2f} {r['verify_cost_ms']:>12.2f}"
        )
    out = os.environ.get("OUT")
    if out:
        Path(out, "cache_first_call.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
