"""What a failing reward raises: one module below every reward, so that each reward and the scoring code import it
and none imports another."""

from __future__ import annotations

from collections.abc import Sequence


class RewardError(RuntimeError):
    """A reward raised, timed out, or returned a wrong shape or a non-finite score, on these prompts."""

    def __init__(self, reward: str, prompts: Sequence[str], reason: str):
        self.reward, self.reason = reward, reason
        self.prompts = list(dict.fromkeys(prompts))  # distinct, in order: a group repeats its prompt
        shown = ", ".join(repr(p) for p in self.prompts[:3])
        if len(self.prompts) > 3:
            shown += f" and {len(self.prompts) - 3} more"
        super().__init__(f"reward {reward!r} failed on prompt {shown}: {reason}")


class RewardTimeout(RewardError):
    """No answer in time. A timeout is a failure of the whole call: `score` does not retry it prompt by prompt."""
