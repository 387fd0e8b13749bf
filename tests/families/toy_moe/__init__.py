"""A second fake model family: toy_dit with two experts, batched CFG and a distilled guidance input
(tests/test_toy_moe.py)."""
