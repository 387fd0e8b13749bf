"""One rollout request: prompts, samples per prompt, sampling params, seed. A leaf (it imports the sampling params
and nothing heavy), so the wire format, the HTTP client and the server's bodies read it without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

from .sampling_params import SamplingParams


@dataclass(frozen=True)
class RolloutRequest:
    """`n_per_prompt` samples of each prompt. `first_prompt` is the global index of `prompts[0]` in the rollout that a
    data-parallel run splits over its engines: every random stream of a sample (its noise, its microgroup's SDE
    window) follows the sample's global prompt index, so a prompt's samples are the same whichever engine draws
    them. The rollout's own indices (`prompt_index`, `sample_indices`, image order) stay local to the request."""

    prompts: list[str]
    n_per_prompt: int
    params: SamplingParams
    seed: int
    first_prompt: int = 0
    decode: bool = True
    record_snapshot: bool = False

    def __post_init__(self) -> None:
        if self.first_prompt < 0:
            raise ValueError(f"first_prompt must be >= 0, got {self.first_prompt}")

    def sample_prompts(self) -> list[str]:
        """Each sample's prompt, prompt-major (the order of the rollout's images)."""
        return [p for p in self.prompts for _ in range(self.n_per_prompt)]
