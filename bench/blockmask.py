"""Benchmark: building block masks with flexfa vs torch's `create_block_mask` (eager and compiled).

    python bench/blockmask.py                      # every mask, H in {16, None}, N in {8k, 32k, 128k}
    python bench/blockmask.py --sizes 8192 --methods flexfa,torch_compiled --device cuda

Masks: causal, sliding window 1024, prefix-LM (prefix 2048), and packed documents (document ids
per batch element, document lengths uniform in [128, 2048]); B = 2; H = 16 or None; Q_LEN = KV_LEN
= N; 128 x 128 tiles. Each measurement runs in its own subprocess:

- time: one warm-up call (for torch.compile it includes compiling; its time is reported as
  `first`), then up to 5 timed calls (1 when a call takes over 20 s); the median is reported.
- peak memory: the growth of the process's peak resident memory during the timed calls on the
  CPU (Linux VmHWM, reset before them after returning freed heap memory with malloc_trim), or of
  `torch.cuda.max_memory_allocated` on CUDA.
- a run that exceeds the time limit is reported as a timeout and larger N are not tried for that
  method; on the CPU the subprocess gets an address-space limit, so running out of memory is an
  error reported as OOM (not the system's OOM killer), and torch eager runs whose estimated
  memory (9 bytes per (b, h, q, kv) pair, as measured for causal at N=8192, B=2, H=16) exceeds
  that limit are not started (reported as not run, with the estimate). On CUDA every run is
  attempted and a failed allocation is reported as OOM.
- torch's result is compared with flexfa's tile states (same tiles: N is a multiple of 128).

On a CPU shared with other work, pass `--threads 1`: torch's multi-threaded ops then do not wait on
a core that another process holds. The table is printed as markdown; with $OUT set, raw results go
to $OUT/blockmask_<device>.json. `--reuse earlier.json --methods flexfa` re-measures flexfa only and
takes the other methods' results from the earlier run.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Measure the flexfa of this checkout, whatever else is installed.
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MASKS = ("causal", "sliding_window", "prefix_lm", "document")
METHODS = ("flexfa", "torch_eager", "torch_compiled")
B = 2
BLOCK = 128
WINDOW = 1024
PREFIX = 2048
DOC_LENGTHS = (128, 2048)
# Bytes per (b, h, q, kv) pair that torch's eager create_block_mask held at its peak when measured
# on the CPU (19.3 GB for B=2, H=16, N=8192, causal); used only to decide what not to start.
EAGER_BYTES_PER_PAIR = 9.0


# ------------------------------------------------------------------------------------------------
# Worker: one measurement.
# ------------------------------------------------------------------------------------------------


def _doc_ids(n: int, device):
    import torch

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(B):
        lengths = torch.randint(
            DOC_LENGTHS[0], DOC_LENGTHS[1] + 1, (n // DOC_LENGTHS[0] + 1,), generator=g
        )
        rows.append(torch.repeat_interleave(torch.arange(lengths.numel()), lengths)[:n])
    return torch.stack(rows).to(device=device, dtype=torch.int32)


def _mask(name: str, n: int, device):
    import flexfa

    if name == "causal":
        return flexfa.masks.causal
    if name == "sliding_window":
        return flexfa.masks.sliding_window(WINDOW)
    if name == "prefix_lm":
        return flexfa.masks.prefix_lm(PREFIX)
    return flexfa.masks.document(_doc_ids(n, device))


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak(device) -> int:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    # Return freed heap memory to the system first, so that the timed calls' allocations show up
    # in the resident size instead of reusing pages of the warm-up call.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    return _rss_kib("VmRSS") * 1024


def _peak(device, base: int) -> int:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return _rss_kib("VmHWM") * 1024 - base


def worker(cfg: dict) -> dict:
    import torch

    import flexfa
    from flexfa.blockmask.block_mask import BlockSize
    from flexfa.blockmask.build import classify
    from flexfa.blockmask.grid import TileGrid

    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg["device"])
    n, heads = cfg["n"], cfg["heads"]
    mask = _mask(cfg["mask"], n, device)
    method = cfg["method"]
    if method == "flexfa":
        build = lambda: flexfa.create_block_mask(
            mask, B, heads, n, n, device=device, BLOCK_SIZE=BLOCK
        )
    else:
        from torch.nn.attention.flex_attention import create_block_mask

        fn = torch.compile(create_block_mask) if method == "torch_compiled" else create_block_mask
        build = lambda: fn(mask, B, heads, n, n, device=device, BLOCK_SIZE=BLOCK)

    def timed():
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = build()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, result

    first, _ = timed()
    repeats = 1 if first > 20 else 5
    base = _reset_peak(device)
    times = []
    result = None
    for _ in range(repeats):
        t, result = timed()
        times.append(t)
        if sum(times) > 30:
            break
    peak = _peak(device, base)
    out = {
        "status": "ok",
        "first_s": first,
        "times_s": times,
        "median_s": statistics.median(times),
        "peak_bytes": peak,
    }
    traced = flexfa.trace_mask_mod(mask)
    batch = B if "b" in traced.variables else 1
    grid = TileGrid(batch, 1, n, n, BlockSize(BLOCK, BLOCK), device)
    if method == "flexfa":
        from flexfa.codegen.triton.blockmask import fused

        # Which path built it: the fused kernel (Note [Fused analysis]) or the general tiers.
        fused_bm = fused.build(traced, grid) if device.type == "cuda" else None
        out["path"] = "fused" if fused_bm is not None else "general"
        c = classify(traced, grid)
        out["agrees_with_general_path"] = bool(torch.equal(result.tile_states(), c.states))
        out["tiers"] = {
            "analytic": c.analytic,
            "witnessed": c.witnessed,
            "refined": c.refined,
            "evaluated": c.evaluated,
        }
        out["stored_tiles"] = c.tiles
    else:
        # torch's tile states, (B, H) as it stores them, against flexfa's (broadcast).
        dense_full = result.full_kv_num_blocks is not None
        partial = _dense(result.kv_num_blocks, result.kv_indices)
        full = (
            _dense(result.full_kv_num_blocks, result.full_kv_indices)
            if dense_full
            else partial & False
        )
        theirs = partial.to(torch.int8) + 2 * full.to(torch.int8)
        ours = classify(traced, grid).states.expand(theirs.shape)
        out["agrees_with_flexfa"] = bool(torch.equal(theirs.cpu(), ours.cpu()))
    return out


def _dense(count, index):
    import torch

    cols = index.shape[-1]
    listed = torch.arange(cols, device=index.device) < count[..., None]
    out = torch.zeros(*index.shape[:-1], cols + 1, dtype=torch.bool, device=index.device)
    out.scatter_(-1, torch.where(listed, index.long(), cols), True)
    return out[..., :cols]


# ------------------------------------------------------------------------------------------------
# Orchestrator.
# ------------------------------------------------------------------------------------------------


def _available_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not in /proc/meminfo")


def _run(cfg: dict, timeout: float, mem_limit: int) -> dict:
    env = dict(os.environ)
    if cfg.get("threads"):
        env["OMP_NUM_THREADS"] = str(cfg["threads"])
    cmd = [sys.executable, __file__, "--worker", json.dumps(cfg)]

    def limit() -> None:
        if cfg["device"] == "cpu":
            resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))

    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=limit
        )
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "limit_s": timeout}
    wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        out = json.loads(lines[-1])
        out["wall_s"] = wall
        return out
    err = proc.stderr[-2000:]
    oom = any(
        s in err
        for s in ("can't allocate memory", "OutOfMemoryError", "out of memory", "MemoryError")
    )
    if proc.returncode == -9:
        oom = True
    return {"status": "oom" if oom else "error", "returncode": proc.returncode, "stderr": err}


def _run_here(cfg: dict, timeout: float) -> dict:
    """One measurement in this process (CUDA): a run slower than `timeout` counts as a timeout
    for the larger N, but is not interrupted."""
    import torch

    if cfg["device"] != "cuda":
        raise SystemExit("--in-process is for CUDA runs (CPU runs need their own process)")
    if cfg["method"] == "torch_compiled":
        torch._dynamo.reset()  # compile afresh, as the subprocess would (no recompile limit)
    start = time.perf_counter()
    try:
        out = worker(cfg)
    except torch.OutOfMemoryError as e:
        out = {"status": "oom", "stderr": str(e)[-500:]}
    finally:
        torch.cuda.empty_cache()
    wall = time.perf_counter() - start
    out["wall_s"] = wall
    if out["status"] == "ok" and wall > timeout:
        out = {"status": "timeout", "limit_s": timeout, "measured": out}
    return out


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + f", {os.cpu_count()} cores"
    return platform.machine()


def _fmt_time(r: dict | None) -> str:
    if r is None:
        return "—"
    s = r["status"]
    if s == "ok":
        t = r["median_s"]
        return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"
    if s == "timeout":
        return f"timeout (> {r['limit_s']:.0f} s)"
    if s == "skipped":
        return f"not run: {r['reason']}"
    return s.upper() if s == "oom" else f"error ({r.get('returncode')})"


def _fmt_mem(r: dict | None) -> str:
    if r is None or r["status"] != "ok":
        return ""
    b = max(r["peak_bytes"], 0)
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def _speedup(ours: dict | None, theirs: dict | None) -> str:
    if not ours or not theirs or ours["status"] != "ok" or theirs["status"] != "ok":
        return ""
    return f"{theirs['median_s'] / ours['median_s']:.0f}×"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--sizes", default="8192,32768,131072")
    p.add_argument("--heads", default="16,None")
    p.add_argument("--masks", default=",".join(MASKS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per measurement (default 600 on CPU, 300 on CUDA)",
    )
    p.add_argument(
        "--memory-fraction", type=float, default=0.85, help="of available memory a CPU run may use"
    )
    p.add_argument(
        "--reuse",
        default=None,
        help="a JSON file of an earlier run: its results fill the methods not run now",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="CUDA only: run every measurement in this process (torch.compile's caches are reset "
        "before each torch_compiled one; no time limit is enforced, and out-of-memory is caught)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for every method (default: torch's); 1 is stable on a shared machine",
    )
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    import torch

    import flexfa

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    timeout = args.timeout or 300.0
    load_at_start = os.getloadavg()
    capacity = _available_bytes(device)
    mem_limit = int(capacity * args.memory_fraction)
    sizes = [int(s) for s in args.sizes.split(",")]
    heads_list = [None if h == "None" else int(h) for h in args.heads.split(",")]
    masks = args.masks.split(",")
    methods = args.methods.split(",")

    results: list[dict] = []
    if args.reuse:
        earlier = json.loads(Path(args.reuse).read_text())["results"]
        results = [r for r in earlier if r["method"] not in methods and r["device"] == device]
    given_up: dict[tuple, str] = {}  # (method, mask, heads) -> why larger N are not tried
    for mask in masks:
        for heads in heads_list:
            for n in sizes:
                for method in methods:
                    cfg = {
                        "device": device,
                        "mask": mask,
                        "heads": heads,
                        "n": n,
                        "method": method,
                        "threads": args.threads,
                    }
                    key = (method, mask, heads)
                    h = heads or 1
                    estimate = EAGER_BYTES_PER_PAIR * B * h * n * n
                    if key in given_up:
                        r = {"status": "skipped", "reason": given_up[key]}
                    elif method == "torch_eager" and device == "cpu" and estimate > mem_limit:
                        r = {
                            "status": "skipped",
                            "reason": f"needs ~{estimate / 2**30:.0f} GiB (limit {mem_limit / 2**30:.0f} GiB)",
                        }
                    elif args.in_process:
                        r = _run_here(cfg, timeout)
                    else:
                        r = _run(cfg, timeout, mem_limit)
                    if r["status"] in ("timeout", "oom") and key not in given_up:
                        given_up[key] = f"{r['status']} at N={n}"
                    results.append({**cfg, **r})
                    print(
                        f"{mask:15s} H={heads!s:4s} N={n:6d} {method:15s} {_fmt_time(r):>24s} {_fmt_mem(r):>10s}",
                        flush=True,
                    )

    def get(method, mask, heads, n):
        for r in results:
            if (r["method"], r["mask"], r["heads"], r["n"]) == (method, mask, heads, n):
                return r
        return None

    name = torch.cuda.get_device_name(0) if device == "cuda" else _cpu_name()
    threads = f", {args.threads} CPU thread(s)" if device == "cpu" and args.threads else ""
    print(
        f"\n### create_block_mask on {device} ({name}{threads}), B={B}, {BLOCK}x{BLOCK} tiles, "
        "median time and peak memory\n"
    )
    print(
        "| mask | H | N | flexfa | torch eager | torch compiled (compile) | vs eager | vs compiled |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mask in masks:
        for heads in heads_list:
            for n in sizes:
                f, e, c = (get(m, mask, heads, n) for m in METHODS)
                fcell = f"{_fmt_time(f)}, {_fmt_mem(f)}" if f else "—"
                ecell = (
                    f"{_fmt_time(e)}, {_fmt_mem(e)}" if e and e["status"] == "ok" else _fmt_time(e)
                )
                if c and c["status"] == "ok":
                    ccell = f"{_fmt_time(c)}, {_fmt_mem(c)} ({c['first_s']:.0f} s)"
                else:
                    ccell = _fmt_time(c)
                print(
                    f"| {mask} | {heads} | {n // 1024}k | {fcell} | {ecell} | {ccell} | {_speedup(f, e)} | {_speedup(f, c)} |"
                )
    out_dir = os.environ.get("OUT")
    if out_dir:
        meta = {
            "device": device,
            "device_name": name,
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "flexfa": str(Path(flexfa.__file__).parent),
            "flexfa_commit": _git_commit(),
            "B": B,
            "block": BLOCK,
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg(),
            "timeout_s": timeout,
            "threads": args.threads or torch.get_num_threads(),
            "memory_limit_bytes": mem_limit if device == "cpu" else None,
        }
        path = Path(out_dir) / f"blockmask_{device}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
