"""Shared pytest setup: run Triton kernels through its interpreter when there is no GPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Generated Triton kernels then run on the CPU (slowly): tests keep their sizes small.
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
