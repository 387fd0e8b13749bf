"""Video samples a person can look at: H.264 MP4 (yuv420p, what every player plays) and a PNG strip of frames."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image


def write_mp4(frames: torch.Tensor, path: str | Path, fps: float) -> Path:
    """uint8 frames `[F, H, W, 3]` -> an H.264 MP4 at `fps` (PyAV, the `video` extra). yuv420p halves the chroma
    resolution, so H and W must be even (every size a video family makes is)."""
    import av

    f, h, w, _ = frames.shape
    if h % 2 or w % 2:
        raise ValueError(f"H.264 yuv420p needs even sides, got {w}x{h}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=round(fps))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"crf": "18"}  # visually lossless: a sample is for looking at, not for scoring
        for frame in frames.cpu().numpy():
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())  # flush the encoder
    return path


def read_frames(path: str | Path) -> np.ndarray:
    """An MP4's frames as uint8 `[F, H, W, 3]` (to check what was written)."""
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def frame_indices(num_frames: int, k: int) -> list[int]:
    """`k` frames spread evenly over a video, first and last included (all of them if it has no more)."""
    if k < 1:
        raise ValueError(f"a video needs at least one frame sampled, got {k}")
    if k >= num_frames:
        return list(range(num_frames))
    if k == 1:
        return [num_frames // 2]
    return [round(i * (num_frames - 1) / (k - 1)) for i in range(k)]


def write_strip(frames: torch.Tensor, path: str | Path, k: int = 8) -> Path:
    """`k` evenly spread frames of `[F, H, W, 3]` side by side in one PNG."""
    picked = frames[frame_indices(frames.shape[0], k)].cpu().numpy()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.concatenate(list(picked), axis=1)).save(path)
    return path
