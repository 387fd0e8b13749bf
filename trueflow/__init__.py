"""trueflow: online RL for flow-matching diffusion transformers with bitwise train/rollout parity."""

__version__ = "0.1.0"
