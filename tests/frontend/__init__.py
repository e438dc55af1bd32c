"""frontend tests."""
