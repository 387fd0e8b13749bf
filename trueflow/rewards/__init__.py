"""Rewards: uint8 images + prompts -> float32 scores, by name, weighted, custom, or from a reward server.

Where a reward runs is where `build_reward` is called: in the trainer process, in the engine process, or in a
reward server (`trueflow reward-serve`) that either of them reaches through a URL spec or `RemoteReward`.
"""

from .base import REWARDS, Reward, RewardError, RewardTimeout, WeightedSum, build_reward, score

__all__ = ["REWARDS", "Reward", "RewardError", "RewardTimeout", "WeightedSum", "build_reward", "score"]
