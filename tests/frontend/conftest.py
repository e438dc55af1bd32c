"""Fixtures for tests/frontend."""

from tests.fixtures import one_intra_op_thread  # noqa: F401
