"""The differential fuzzer at scale on a GPU: N random programs (tests/e2e/fuzzgen.py) through a
GPU backend, output, LSE and every gradient against the float64 reference (three-way rule).

    python bench/fuzz_gpu.py --programs 1000 --workers 16 --seconds 150
    python bench/fuzz_gpu.py --backend fa4 --programs 1000 --workers 12 --seconds 400

Each backend compiles every distinct program (forward, backward and block-mask kernels), which costs
far more than running it, so programs run in a pool of worker processes, each with its own CUDA
context and flexfa cache directory: the compiles proceed in parallel on the host's cores. No new
program starts after `--seconds`; the report counts those checked, passed and failed, and prints
each failure as Python source that reproduces it (tests/e2e/fuzzgen.py `Program`). With $OUT set
the report also goes to $OUT/fuzz_gpu.json and the failures to $OUT/fuzz_gpu_failures.py, and
each program's result is appended to $OUT/fuzz_gpu_progress.jsonl as soon as it is known.

Programs the backend refuses (`supports()`: for "fa4" e.g. float32, or gradients through a
score_mod where FA4's tiles are not verified) are counted as "unsupported", with their reasons.
`--device cpu` runs the same driver through Triton's interpreter (tiny problems), to try it
without a GPU. `--save FILE` only draws the programs (hypothesis) and writes them as JSON;
`--load FILE` runs such a file, so the drawing can happen elsewhere; `--done PROGRESS.jsonl`
leaves out what earlier runs of that file reported, so a campaign can span several runs.
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
_BACKEND = "triton"


def _init(deadline: float, device: str, backend: str) -> None:
    global _DEADLINE, _DEVICE, _BACKEND
    _DEADLINE, _DEVICE, _BACKEND = deadline, device, backend
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

    options = INTERPRETER_TILES if _DEVICE == "cpu" and _BACKEND == "triton" else None
    start = time.monotonic()
    try:
        program.check(_BACKEND, options, _DEVICE)
        return index, "passed", "", time.monotonic() - start
    except ValueError as e:
        refusal = f"backend {_BACKEND!r} cannot run this call: "
        if str(e).startswith(refusal):
            return index, "unsupported", str(e).removeprefix(refusal), 0.0
        return _failed(index, program, options)
    except Exception:  # every failure is reported, whatever it is
        return _failed(index, program, options)


def _failed(index, program, options):
    message = traceback.format_exc(limit=4)[-3000:]
    source = program.source(_BACKEND, options, _DEVICE)
    return index, "failed", f"{source}\n# {message.replace(chr(10), chr(10) + '# ')}", 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seconds", type=float, default=150.0, help="start no program after")
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--backend", choices=["triton", "fa4"], default="triton")
    parser.add_argument("--save", help="write the drawn programs to this JSON file and stop")
    parser.add_argument("--load", help="run the programs of this JSON file (from --save)")
    parser.add_argument("--skip", type=int, default=0, help="leave out the first N loaded programs")
    parser.add_argument(
        "--done",
        action="append",
        default=[],
        metavar="JSONL",
        help="leave out the programs an earlier run of the same --load file reported in this "
        "fuzz_gpu_progress.jsonl (repeatable): a campaign spread over several runs",
    )
    args = parser.parse_args()

    import torch

    from tests.e2e.fuzzgen import draw_programs, fa4_programs, gpu_programs, interpreter_programs

    t0 = time.monotonic()
    if args.backend == "fa4":
        strategy = fa4_programs()
    else:
        strategy = interpreter_programs() if args.device == "cpu" else gpu_programs()
    if args.load:
        from tests.e2e.fuzzgen import Program

        data = json.loads(Path(args.load).read_text())
        progs = [Program.from_json(d) for d in data]
    else:
        progs = draw_programs(args.programs, args.seed, strategy)
    if args.save:
        Path(args.save).write_text(json.dumps([p.to_json() for p in progs]))
        print(f"{len(progs)} programs written to {args.save}")
        return
    done = {
        json.loads(line)["index"]
        for path in args.done
        for line in Path(path).read_text().splitlines()
        if line.strip()
    }
    # (index in the loaded or drawn list, program): indices stay those of the list across runs.
    items = [(i, p) for i, p in enumerate(progs) if i >= args.skip and i not in done]
    items = items[: args.programs]
    drawn_s = time.monotonic() - t0
    deadline = time.monotonic() + args.seconds
    results = []
    out = os.environ.get("OUT")
    # One line per program as it finishes: a run killed before the report keeps what it found.
    progress = open(Path(out, "fuzz_gpu_progress.jsonl"), "a") if out else None  # noqa: SIM115
    ctx = mp.get_context("spawn")
    with ctx.Pool(
        args.workers, initializer=_init, initargs=(deadline, args.device, args.backend)
    ) as pool:
        for r in pool.imap_unordered(_run, items, chunksize=1):
            results.append(r)
            if progress is not None and r[1] != "skipped":
                line = {"index": r[0], "status": r[1], "seconds": round(r[3], 2)}
                progress.write(json.dumps({**line, "detail": r[2]}) + "\n")
                progress.flush()
    if progress is not None:
        progress.close()
    wall = time.monotonic() - t0
    statuses = ("passed", "failed", "unsupported", "skipped")
    counts = {k: sum(1 for r in results if r[1] == k) for k in statuses}
    reasons: dict[str, int] = {}
    for r in results:
        if r[1] == "unsupported":
            reasons[r[2]] = reasons.get(r[2], 0) + 1
    checked = counts["passed"] + counts["failed"]
    times = sorted(r[3] for r in results if r[1] == "passed")
    report = {
        "backend": args.backend,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)",
        "seed": args.seed,
        "skipped_first": args.skip,
        "done_before": len(done),
        "programs_drawn": len(progs),
        "programs_this_run": len(items),
        "checked": checked,
        **counts,
        "workers": args.workers,
        "wall_s": round(wall, 1),
        "draw_s": round(drawn_s, 1),
        "median_program_s": round(times[len(times) // 2], 2) if times else None,
        "unsupported_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
    }
    failures = [r[2] for r in sorted(results) if r[1] == "failed"]
    for f in failures:
        print("=" * 100 + "\n" + f)
    print(json.dumps(report, indent=1))
    if out:
        Path(out, "fuzz_gpu.json").write_text(json.dumps(report, indent=1))
        Path(out, "fuzz_gpu_failures.py").write_text("\n\n".join(failures) or "# no failures\n")


if __name__ == "__main__":
    main()
