"""ir tests."""
