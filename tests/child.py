"""Run Python code in a child process with Triton's real compiler (not its interpreter), for
tests that compile kernels for a GPU architecture: a real compile cannot share a process with
Triton's interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_json(code: str, tmp_path: Path, timeout: float = 600) -> object:
    """Run `code` with its own flexfa cache under `tmp_path`; returns the JSON of its last line of
    output (the assertion message holds the child's stderr when it fails)."""
    env = dict(os.environ, FLEXFA_CACHE_DIR=str(tmp_path / "cache"), TRITON_INTERPRET="0")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
