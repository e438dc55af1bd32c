"""Shared pytest setup: run Triton kernels through its interpreter when there is no GPU, and pick
the tier's tests (tests/tiers.py: `pytest -q`, or `pytest -q --exhaustive`)."""

import os

import pytest
import torch

from tests import tiers

if not torch.cuda.is_available():
    # Generated Triton kernels then run on the CPU (slowly): tests keep their sizes small.
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption(
        "--exhaustive",
        action="store_true",
        help="run the exhaustive tier: tests marked exhaustive, and every property test and the "
        "fuzzer at their full example counts (tests/tiers.py)",
    )


def pytest_configure(config):
    # Before any test module is imported: their hypothesis settings read the tier.
    tiers.set_exhaustive(config.getoption("--exhaustive"))


def _in_tier(item, exhaustive: bool) -> bool:
    # A test marked slow (more than a few seconds on 2 cores) is an exhaustive one.
    if item.get_closest_marker("exhaustive") or item.get_closest_marker("slow"):
        return exhaustive
    # Property tests and the fuzzer run in both tiers, with their tier's example count.
    return not exhaustive or getattr(getattr(item, "obj", None), "is_hypothesis_test", False)


def pytest_collection_modifyitems(config, items):
    exhaustive = config.getoption("--exhaustive")
    selected = [item for item in items if _in_tier(item, exhaustive)]
    if len(selected) != len(items):
        kept = {id(item) for item in selected}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
        items[:] = selected
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
