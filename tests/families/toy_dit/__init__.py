"""A fake model family that lives only in the tests: a two-layer toy DiT (tests/test_families.py)."""
