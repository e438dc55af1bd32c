"""Fixtures for tests/ir."""

from tests.fixtures import one_intra_op_thread  # noqa: F401
