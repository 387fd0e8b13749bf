"""Checkpoints made by the project: diffusers-format Qwen-Image pipeline folders with seeded random weights, built
with diffusers' and transformers' own classes (nothing can be downloaded, so tests and benchmarks make their own).
Train side only: engine code never imports this package."""
