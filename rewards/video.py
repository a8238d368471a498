"""Video rewards from image rewards: per-frame scores averaged over frames, plus a temporal term.

``per_frame("clip_score", temporal_weight=0.1, random_init=True)`` wraps any registered image reward;
the built-in image rewards are also registered as ``<name>_video`` (``clip_score_video``, ...), whose
options are ``temporal_weight`` and ``frames`` (``all``, or ``first``: the first frame alone) plus the image
reward's own.
"""

from __future__ import annotations

from typing import Any

import torch

from flowalign.errors import UserError
from flowalign.protocols import Reward, RewardOutput
from rewards.common import check_lengths, finite_mask
from rewards.registry import former_forms, load, planned_bytes, register

# image rewards of this package that get a registered ``<name>_video`` twin
VIDEO_TWINS = ("clip_score", "aesthetic", "pickscore", "hps", "hpsv3", "lpips", "jpeg_compressibility",
               "jpeg_incompressibility", "brightness", "saturation")


#: which frames a video is scored by
FRAMES = ("all", "first")


class VideoReward:
    """Scores videos ``(B, F, 3, H, W)`` with an image reward applied to every frame (``frames: all``) or to the
    first frame alone (``first``: Pref-GRPO's Wan scripts score CLIP on a video's first frame).

    Components: each of the image reward's components averaged over the frames scored, plus, when
    ``temporal_weight`` is not 0, ``"temporal" = −temporal_weight · mean |x_{t+1} − x_t|`` (mean absolute
    pixel change between consecutive frames: flicker and jumps cost, slow motion costs little). A video
    is valid when all its frames are. Every frame gets its video's prompt and metadata.
    """

    def __init__(self, image_reward: Reward, temporal_weight: float = 0.0, frames: str = "all"):
        if frames not in FRAMES:
            raise UserError(f"{image_reward.name}_video reward: frames={frames!r} is not known; use all (every frame, "
                            "averaged) or first (the first frame alone)")
        self.image_reward = image_reward
        self.temporal_weight = float(temporal_weight)
        self.frames = frames
        self.name = f"{image_reward.name}_video"
        self.differentiable = image_reward.differentiable

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples`` ``(B, F, 3, H, W)`` float in [0, 1] → components ``(B,)`` float32, ``valid`` ``(B,)``."""
        if not isinstance(samples, torch.Tensor) or samples.ndim != 5 or samples.shape[2] != 3:
            shape = tuple(samples.shape) if isinstance(samples, torch.Tensor) else type(samples).__name__
            raise UserError(
                f"{self.name} reward scores videos (B, F, 3, H, W); got {shape}"
                f" (score images with the {self.image_reward.name!r} reward)"
            )
        check_lengths(samples.shape[0], prompts, metadata, self.name)
        scored = samples[:, :1] if self.frames == "first" else samples
        b, f = scored.shape[:2]
        out = self.image_reward(
            scored.flatten(0, 1), [p for p in prompts for _ in range(f)], [m for m in metadata for _ in range(f)]
        )
        components = {k: v.reshape(b, f).mean(1) for k, v in out.components.items()}
        if self.temporal_weight:
            change = (samples[:, 1:] - samples[:, :-1]).abs().float().mean((1, 2, 3, 4))
            components["temporal"] = -self.temporal_weight * change.nan_to_num(0.0)
        info = [{"frames": out.info[i * f : (i + 1) * f]} for i in range(b)] if out.info else []
        valid = out.valid.reshape(b, f).all(1) & finite_mask(samples).to(out.valid.device)
        return RewardOutput(components, valid=valid, info=info)


def per_frame(name: str, temporal_weight: float = 0.0, frames: str = "all", **options: Any) -> VideoReward:
    """The registered image reward ``name`` (built with ``options``) applied to videos."""
    return VideoReward(load(name, **options), temporal_weight, frames)


def _register_twin(image_name: str) -> None:
    class Twin(VideoReward):
        def __init__(self, temporal_weight: float = 0.0, frames: str = "all", **options: Any):
            super().__init__(load(image_name, **options), temporal_weight, frames)

        @classmethod
        def planned_bytes(cls, options: dict[str, Any]) -> int:
            """The image reward's size (the temporal term holds nothing)."""
            return planned_bytes(image_name, {k: v for k, v in options.items() if k not in ("temporal_weight", "frames")})

        @classmethod
        def former_forms(cls) -> tuple[dict[str, Any], dict[str, tuple[str, tuple[Any, ...]]], dict[str, Any]]:
            """The image reward's (its options are the image reward's)."""
            return former_forms(image_name)

    Twin.__name__ = Twin.__qualname__ = f"VideoReward[{image_name}]"
    Twin.__doc__ = f"The {image_name!r} reward per frame of a video (see :class:`VideoReward`)."
    register(f"{image_name}_video")(Twin)


for _name in VIDEO_TWINS:
    _register_twin(_name)
