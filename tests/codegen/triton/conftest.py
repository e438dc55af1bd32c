"""Fixtures of the Triton backend's tests."""

from __future__ import annotations

import pytest

import flexfa
from flexfa.codegen.triton import module as tmodule


@pytest.fixture
def cache_dir(tmp_path):
    """A fresh on-disk module cache under `tmp_path`, with the in-memory cache cleared around
    the test."""
    with flexfa.config.override(cache_dir=str(tmp_path / "cache")):
        tmodule.clear_memory_cache()
        yield tmp_path / "cache"
        tmodule.clear_memory_cache()
