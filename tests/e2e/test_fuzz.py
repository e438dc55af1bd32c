"""The differential fuzzer: random programs (tests/e2e/fuzzgen.py) on every backend this machine
has, output, LSE and every gradient against the float64 reference.

CI runs a fixed budget with a fixed seed (derandomized: the same programs every run). A long
campaign draws fresh programs:

    FLEXFA_FUZZ_EXAMPLES=2000 python -m pytest tests/e2e/test_fuzz.py -k tiled

`FLEXFA_FUZZ_EXAMPLES` sets the number of programs per backend (it also turns derandomization
off, and `FLEXFA_FUZZ_SEED` picks the seed). A failing program shrinks to a small one and is
printed as Python source that reproduces it. GPU backends run under `-m gpu`; bench/fuzz_gpu.py
runs many programs on a GPU at once.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, note, seed, settings

from tests.e2e.fuzzgen import (
    INTERPRETER_TILES,
    Program,
    gpu_programs,
    interpreter_programs,
    programs,
)

#: Programs per backend in CI (measured: see the budgets below).
_CI_EXAMPLES = {"tiled": 60, "triton": 12, "gpu": 200}
_LONG = os.environ.get("FLEXFA_FUZZ_EXAMPLES")
_SEED = int(os.environ.get("FLEXFA_FUZZ_SEED", "19"))

TRITON_TILES = INTERPRETER_TILES


def fuzz_settings(backend: str):
    n = int(_LONG) if _LONG else _CI_EXAMPLES[backend]
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=not _LONG,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


def run_program(
    program: Program, backend: str, kernel_options: dict | None = None, device: str = "cpu"
) -> None:
    """Check one program; on failure the reproduction source goes into hypothesis' report."""
    note("Reproduce with:\n\n" + program.source(backend, kernel_options, device))
    program.check(backend, kernel_options, device)


@fuzz_settings("tiled")
@seed(_SEED)
@given(program=programs(max_len=24))
def test_fuzz_tiled(program):
    run_program(program, "tiled")


@fuzz_settings("triton")
@seed(_SEED)
@given(program=interpreter_programs())
def test_fuzz_triton_interpreter(program):
    run_program(program, "triton", TRITON_TILES)


@pytest.mark.gpu
@fuzz_settings("gpu")
@seed(_SEED)
@given(program=gpu_programs())
def test_fuzz_triton_gpu(program):
    run_program(program, "triton", device="cuda")
