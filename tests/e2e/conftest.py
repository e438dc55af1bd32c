"""Fixtures for tests/e2e."""

from tests.fixtures import one_intra_op_thread  # noqa: F401
