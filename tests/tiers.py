"""The two test tiers (README, "Tests").

- The default tier, `pytest -q`: every module and backend in about ten minutes on 2 CPU cores.
  Property tests (hypothesis) and the fuzzer draw a fifth of their examples (at least one); tests
  marked `exhaustive` (whole interpreter-heavy sweeps, each of which keeps a representative case
  unmarked, see `sweep`) or `slow` (more than a few seconds each) are deselected.
- The exhaustive tier, `pytest -q --exhaustive`: the tests marked `exhaustive` or `slow`, and
  every property test and the fuzzer again at their full example counts.

tests/conftest.py sets the tier from the command line before any test module is imported, so the
example counts below are read at collection. FLEXFA_HYPOTHESIS_SCALE multiplies them in either
tier (e.g. 20 for a long local hunt).
"""

from __future__ import annotations

import os

import pytest

#: The default tier's share of a property test's examples.
FAST_SHARE = 0.2

_exhaustive = False


def set_exhaustive(on: bool) -> None:
    global _exhaustive
    _exhaustive = on


def exhaustive() -> bool:
    """Whether this run is the exhaustive tier (`--exhaustive`)."""
    return _exhaustive


def examples(n: int) -> int:
    """`n` hypothesis examples in the exhaustive tier, a fifth of them (at least one) in the
    default tier; times FLEXFA_HYPOTHESIS_SCALE."""
    share = 1.0 if _exhaustive else FAST_SHARE
    return max(1, int(n * share * float(os.environ.get("FLEXFA_HYPOTHESIS_SCALE", "1"))))


def sweep(cases, *, keep: int = 1) -> list:
    """Parameters of a sweep whose first `keep` cases run in both tiers and the others only in the
    exhaustive tier (marked `exhaustive`): the default tier keeps a representative of the sweep.
    Use it in place of the list: `@pytest.mark.parametrize("case", sweep(CASES, keep=2))`; a
    tuple case gives the values of several arguments (`parametrize("name, backend", ...)`).
    """
    return [
        pytest.param(
            *(case if isinstance(case, tuple) else (case,)),
            marks=() if i < keep else pytest.mark.exhaustive,
        )
        for i, case in enumerate(cases)
    ]
