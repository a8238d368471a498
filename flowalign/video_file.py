"""Videos scored as the files their authors' scripts score: written to an mp4 and read back.

DanceGRPO's and Pref-GRPO's video scripts never hand a reward the decoded frames: each sampled video is
written with diffusers' ``export_to_video`` (float frames scaled by 255 and truncated to 8 bits, H.264 at
imageio's quality 5, at the script's frame rate) and the reward model reads the file back (VideoAlign from its
path, UnifiedReward's frames and a first-frame HPS or CLIP score through OpenCV). The codec's 4:2:0 chroma and
quantisation change what the reward sees, most on fine detail and noise. A reward entry's ``video_mp4_fps``
(:class:`flowalign.config.RewardSpec`) scores through that round trip: :class:`Mp4RoundTrip`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flowalign.errors import UserError


def through_mp4(videos: torch.Tensor, fps: int) -> torch.Tensor:
    """``videos`` ``(B, F, 3, H, W)`` float in [0, 1] → the same videos written to an mp4 at ``fps`` frames per
    second by ``diffusers.utils.export_to_video`` and decoded again, float32 in [0, 1] on ``videos``' device:
    ``(B, F, 3, H', W')``, with H' and W' rounded up to multiples of 16 where they are not (imageio scales
    such frames up for the codec's macroblocks, as it does for the authors' files)."""
    import imageio
    from diffusers.utils import export_to_video

    if not isinstance(videos, torch.Tensor) or videos.ndim != 5 or videos.shape[2] != 3:
        shape = tuple(videos.shape) if isinstance(videos, torch.Tensor) else type(videos).__name__
        raise UserError(f"video_mp4_fps writes videos (B, F, 3, H, W) to mp4 files; got {shape}: drop video_mp4_fps "
                        "from an image reward's entry")
    frames = videos.detach().float().nan_to_num(0.0).clamp(0, 1).permute(0, 1, 3, 4, 2).cpu().numpy()
    read = []
    with tempfile.TemporaryDirectory(prefix="flowalign-mp4-") as folder:
        for i, video in enumerate(frames):
            path = str(Path(folder) / f"{i}.mp4")
            export_to_video(list(video), path, fps=fps)
            with imageio.get_reader(path, "ffmpeg") as reader:
                decoded = np.stack([np.asarray(frame) for frame in reader])
            if len(decoded) != len(video):
                raise RuntimeError(f"an mp4 of {len(video)} frames read back as {len(decoded)} frames")
            read.append(torch.from_numpy(decoded).permute(0, 3, 1, 2).float() / 255)
    return torch.stack(read).to(videos.device)


class Mp4RoundTrip:
    """``reward`` scoring videos after :func:`through_mp4` at ``fps``. The round trip has no gradient, so the
    wrapped reward is not differentiable; every other attribute (``name``, ``requires_metadata``, ...) is the
    reward's."""

    differentiable = False

    def __init__(self, reward: Any, fps: int):
        self._reward, self._fps = reward, int(fps)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # own state not set yet (copy, pickle): no recursion into _reward
            raise AttributeError(attr)
        return getattr(self._reward, attr)

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Any:
        return self._reward(through_mp4(samples, self._fps), prompts, metadata)
