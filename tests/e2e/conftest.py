"""Fixtures for tests/e2e."""

import pytest

from flexfa.codegen.triton import decode
from tests.fixtures import one_intra_op_thread  # noqa: F401


@pytest.fixture
def decode_calls(monkeypatch):
    """Counts calls that took the Triton decode path."""
    calls = []
    real = decode.run

    def spy(spec, q, k, v):
        calls.append(spec)
        return real(spec, q, k, v)

    monkeypatch.setattr(decode, "run", spy)
    return calls
