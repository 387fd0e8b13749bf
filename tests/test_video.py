"""Video helpers: which frames an image reward scores, the average it takes, and the MP4s (oracles written out)."""

from __future__ import annotations

import pytest
import torch

from trueflow.engine.interface import RolloutRequest
from trueflow.placement.scored import ScoredEngine
from trueflow.engine.sampling_params import SamplingParams
from trueflow.engine.trajectory import Rollout
from trueflow.video import frame_indices, read_frames, write_mp4, write_strip


def test_frames_spread_evenly_with_both_ends():
    assert frame_indices(9, 3) == [0, 4, 8]
    assert frame_indices(57, 3) == [0, 28, 56]
    assert frame_indices(9, 1) == [4]  # one frame: the middle one
    assert frame_indices(4, 9) == [0, 1, 2, 3]  # asking for more than there are: all of them
    assert frame_indices(10, 4) == [0, 3, 6, 9]
    with pytest.raises(ValueError, match="at least one frame"):
        frame_indices(9, 0)


class _Videos:
    """An engine stand-in whose rollout holds given videos (the interface's rollout, nothing else)."""

    def __init__(self, videos: torch.Tensor):
        self.videos = videos

    def rollout(self, request: RolloutRequest, should_stop=None) -> Rollout:
        return Rollout(request.prompts, request.n_per_prompt, request.params, request.seed, [], self.videos, {})


def test_a_video_reward_is_the_mean_over_the_sampled_frames():
    # Frame f of sample i is filled with the value 10·i + f; the reward reads pixel (0, 0) of each frame.
    videos = torch.stack([torch.stack([torch.full((4, 4, 3), 10 * i + f, dtype=torch.uint8) for f in range(9)])
                          for i in range(2)])
    seen = []

    def reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        seen.append(images[:, 0, 0, 0].tolist())
        return images[:, 0, 0, 0].float()

    request = RolloutRequest(["a"], 2, SamplingParams(num_frames=9), seed=0)
    out = ScoredEngine(_Videos(videos), reward, frames=3).rollout(request)
    assert seen == [[0, 10], [4, 14], [8, 18]]  # frames 0, 4 and 8 of each sample
    assert torch.equal(out.rewards, torch.tensor([(0 + 4 + 8) / 3, (10 + 14 + 18) / 3]))
    assert out.dropped == []


def test_mp4_holds_every_frame_and_the_strip_the_picked_ones(tmp_path):
    frames = torch.zeros(9, 32, 48, 3, dtype=torch.uint8)
    frames[:, :, :, 0] = torch.arange(9, dtype=torch.uint8)[:, None, None] * 25
    back = read_frames(write_mp4(frames, tmp_path / "v.mp4", 24.0))
    assert back.shape == (9, 32, 48, 3)
    assert abs(float(back[8, :, :, 0].mean()) - 200) < 8  # lossy, but the red ramp survives
    strip = write_strip(frames, tmp_path / "s.png", k=3)
    from PIL import Image

    assert Image.open(strip).size == (3 * 48, 32)
    with pytest.raises(ValueError, match="even sides"):
        write_mp4(frames[:, :31], tmp_path / "odd.mp4", 24.0)
