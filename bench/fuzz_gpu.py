"""The differential fuzzer at scale on a GPU: N random programs (tests/e2e/fuzzgen.py) through the
Triton backend, output, LSE and every gradient against the float64 reference (three-way rule).

    python bench/fuzz_gpu.py --programs 1000 --workers 16 --seconds 150

Triton compiles every distinct program (forward, backward and block-mask kernels), which costs
far more than running it, so programs run in a pool of worker processes, each with its own CUDA
context and flexfa cache directory: the compiles proceed in parallel on the host's cores. No new
program starts after `--seconds`; the report counts those checked, passed and failed, and prints
each failure as Python source that reproduces it (tests/e2e/fuzzgen.py `Program`). With $OUT set
the report also goes to $OUT/fuzz_gpu.json and the failures to $OUT/fuzz_gpu_failures.py.

`--device cpu` runs the same driver through Triton's interpreter (tiny problems), to try it
without a GPU. `--save FILE` only draws the programs (hypothesis) and writes them as JSON;
`--load FILE` runs such a file, so the drawing can happen elsewhere.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_DEADLINE = 0.0
_DEVICE = "cuda"


def _init(deadline: float, device: str) -> None:
    global _DEADLINE, _DEVICE
    _DEADLINE, _DEVICE = deadline, device
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ["FLEXFA_CACHE_DIR"] = tempfile.mkdtemp(prefix="flexfa-fuzz-")
    import torch  # noqa: F401  (import once per worker, before the first program)

    import flexfa  # noqa: F401


def _run(item):
    index, program = item
    if time.monotonic() > _DEADLINE:
        return index, "skipped", "", 0.0
    from tests.e2e.harness import INTERPRETER_TILES

    options = INTERPRETER_TILES if _DEVICE == "cpu" else None
    start = time.monotonic()
    try:
        program.check("triton", options, _DEVICE)
        return index, "passed", "", time.monotonic() - start
    except Exception:  # every failure is reported, whatever it is
        message = traceback.format_exc(limit=4)[-3000:]
        source = program.source("triton", options, _DEVICE)
        return index, "failed", f"{source}\n# {message.replace(chr(10), chr(10) + '# ')}", 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seconds", type=float, default=150.0, help="start no program after")
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--save", help="write the drawn programs to this JSON file and stop")
    parser.add_argument("--load", help="run the programs of this JSON file (from --save)")
    parser.add_argument("--skip", type=int, default=0, help="leave out the first N loaded programs")
    args = parser.parse_args()

    import torch

    from tests.e2e.fuzzgen import draw_programs, gpu_programs, interpreter_programs

    t0 = time.monotonic()
    strategy = interpreter_programs() if args.device == "cpu" else gpu_programs()
    if args.load:
        from tests.e2e.fuzzgen import Program

        data = json.loads(Path(args.load).read_text())
        progs = [Program.from_json(d) for d in data][args.skip : args.skip + args.programs]
    else:
        progs = draw_programs(args.programs, args.seed, strategy)
    if args.save:
        Path(args.save).write_text(json.dumps([p.to_json() for p in progs]))
        print(f"{len(progs)} programs written to {args.save}")
        return
    drawn_s = time.monotonic() - t0
    deadline = time.monotonic() + args.seconds
    results = []
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.workers, initializer=_init, initargs=(deadline, args.device)) as pool:
        for r in pool.imap_unordered(_run, list(enumerate(progs)), chunksize=1):
            results.append(r)
    wall = time.monotonic() - t0
    counts = {k: sum(1 for r in results if r[1] == k) for k in ("passed", "failed", "skipped")}
    checked = counts["passed"] + counts["failed"]
    times = sorted(r[3] for r in results if r[1] == "passed")
    report = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)",
        "seed": args.seed,
        "skipped_first": args.skip,
        "programs_drawn": len(progs),
        "checked": checked,
        **counts,
        "workers": args.workers,
        "wall_s": round(wall, 1),
        "draw_s": round(drawn_s, 1),
        "median_program_s": round(times[len(times) // 2], 2) if times else None,
    }
    failures = [r[2] for r in sorted(results) if r[1] == "failed"]
    for f in failures:
        print("=" * 100 + "\n" + f)
    print(json.dumps(report, indent=1))
    out = os.environ.get("OUT")
    if out:
        Path(out, "fuzz_gpu.json").write_text(json.dumps(report, indent=1))
        Path(out, "fuzz_gpu_failures.py").write_text("\n\n".join(failures) or "# no failures\n")


if __name__ == "__main__":
    main()
