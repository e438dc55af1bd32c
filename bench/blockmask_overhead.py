"""Where the time of a fused create_block_mask goes on a GPU (Note [Fused analysis]).

    python bench/blockmask_overhead.py            # causal and documents, N = 8192, B = 2, H = 16

For each mask it times, in one process, median over many calls: the whole `create_block_mask`
(synchronize to synchronize), `fused.build` alone, the kernel launch call alone (host time, no
synchronize), the kernel on the device (CUDA events), and the pieces around it (the buffer clear,
the device-to-host read). Results print as a table; with $OUT set they also go to
$OUT/blockmask_overhead.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import flexfa
from flexfa.blockmask.block_mask import BlockSize
from flexfa.blockmask.grid import TileGrid
from flexfa.codegen.triton.blockmask import fused

N, B, H, REPS = 8192, 2, 16, 200


def _median_us(fn, reps: int = REPS, sync: bool = True) -> float:
    times = []
    for _ in range(reps):
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def _measure(name: str, fn, batch: int, dev: torch.device) -> dict:
    traced = flexfa.trace_mask_mod(fn)
    grid = TileGrid(batch, 1, N, N, BlockSize(128, 128), dev)
    flexfa.create_block_mask(fn, B, H, N, N, device=dev)  # compile
    row: dict = {"mask": name}
    row["create_block_mask_us"] = _median_us(
        lambda: flexfa.create_block_mask(fn, B, H, N, N, device=dev)
    )
    row["fused_build_us"] = _median_us(lambda: fused.build(traced, grid))
    # The launch alone: record the kernel call the build makes, then repeat only that call.
    calls = []
    real = fused.run_logged
    fused.run_logged = lambda key, label, run: (calls.append(run), run())[1]
    try:
        fused.build(traced, grid)
    finally:
        fused.run_logged = real
    launch = calls[-1]
    row["launch_host_us"] = _median_us(launch, sync=False)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device_ms = []
    for _ in range(50):
        start.record()
        launch()
        end.record()
        end.synchronize()
        device_ms.append(start.elapsed_time(end))
    row["kernel_device_us"] = 1e3 * statistics.median(device_ms)
    total = 2 * batch * 64 + 4 * batch * 64 * 64 + 1
    row["zeros_us"] = _median_us(lambda: torch.zeros(total, dtype=torch.int32, device=dev))
    buf = torch.zeros(total, dtype=torch.int32, device=dev)
    row["item_us"] = _median_us(lambda: int(buf[-1].item()))
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(128, 2049, (N // 128 + 1,), generator=g)
    docs = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)[:N]
    docs = docs.view(1, -1).repeat(B, 1).to(dev, torch.int32)
    cases = (("causal", flexfa.masks.causal, 1), ("document", flexfa.masks.document(docs), B))
    rows = [_measure(name, fn, batch, dev) for name, fn, batch in cases]
    keys = [k for k in rows[0] if k != "mask"]
    print("\n| mask | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for r in rows:
        print(f"| {r['mask']} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + " |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "blockmask_overhead.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
