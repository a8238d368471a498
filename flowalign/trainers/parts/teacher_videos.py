"""Black-box video teachers: completed videos per prompt, from a folder or from a second model.

A teacher exposes nothing but clean videos: no scores, latents, trajectories or step schedule. Two kinds:

- :class:`VideoFolderTeacher`: ``DIR/videos.jsonl``, one ``{"prompt": ..., "video": "relative/path.mp4"}`` per
  line (several lines per prompt: several videos, one drawn per request). Any generator's outputs, a
  proprietary model's included, become a teacher this way.
- :class:`ModelTeacher`: a diffusers folder of any family flowalign loads, sampled with its own sampler on
  request (its own architecture, step count and guidance: heterogeneous by construction).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import torch

from flowalign.errors import UserError
from flowalign.media import load_video


class VideoTeacher(Protocol):
    def check_prompts(self, prompts: list[str]) -> None:
        """Refuse prompts the teacher has no video for (before training starts)."""

    def videos(self, prompts: list[str], seeds: list[int]) -> torch.Tensor:
        """One completed video per prompt ``(N, F, 3, H, W)`` in [0, 1]; ``seeds`` pick among a prompt's
        videos (a folder) or seed the noise (a model)."""


class VideoFolderTeacher:
    """Videos listed in ``DIR/videos.jsonl`` (see the module docstring), loaded once and kept in memory."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = self.folder / "videos.jsonl"
        if not index.is_file():
            raise UserError(f"trainer.teacher.videos={str(folder)!r} holds no videos.jsonl: write one line "
                            '{"prompt": ..., "video": "file.mp4"} per teacher video')
        self.by_prompt: dict[str, list[Path]] = {}
        for n, line in enumerate(index.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, video = row["prompt"], row["video"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise UserError(f"{index}:{n}: expected {{\"prompt\": ..., \"video\": ...}}, got {line[:80]!r} "
                                f"({err})") from err
            self.by_prompt.setdefault(str(prompt), []).append(self.folder / str(video))
        if not self.by_prompt:
            raise UserError(f"{index} lists no videos")
        self._loaded: dict[Path, torch.Tensor] = {}

    def check_prompts(self, prompts: list[str]) -> None:
        missing = sorted({p for p in prompts if p not in self.by_prompt})
        if missing:
            raise UserError(f"trainer.teacher.videos={str(self.folder)!r} has no video for {len(missing)} of the "
                            f"training prompts (e.g. {missing[0]!r}): add their videos to videos.jsonl or train on "
                            "the prompts it covers (data.prompts)")

    def videos(self, prompts: list[str], seeds: list[int]) -> torch.Tensor:
        self.check_prompts(prompts)
        out = []
        for prompt, seed in zip(prompts, seeds):
            paths = self.by_prompt[prompt]
            path = paths[seed % len(paths)]
            if path not in self._loaded:
                self._loaded[path] = load_video(path)
            out.append(self._loaded[path])
        shapes = {tuple(v.shape) for v in out}
        if len(shapes) > 1:
            raise UserError(f"trainer.teacher.videos={str(self.folder)!r}: videos of different shapes {sorted(shapes)}; "
                            "give every teacher video the same frame count and size")
        return torch.stack(out)


class ModelTeacher:
    """A second model sampled on request (ODE, its own defaults unless ``num_steps`` / ``guidance_scale``)."""

    def __init__(self, path: str | Path, device: Any, num_steps: int | None = None,
                 guidance_scale: float | None = None) -> None:
        from flowalign import families

        spec = families.detect(path)
        self.policy = spec.policy(path, device=device)
        self.num_steps, self.guidance_scale = num_steps, guidance_scale
        if not getattr(self.policy, "is_video", False):
            raise UserError(f"trainer.teacher.model={str(path)!r} is a {spec.name} image model: a video teacher must "
                            "generate videos")

    def check_prompts(self, prompts: list[str]) -> None:
        return None  # a model answers every prompt

    def videos(self, prompts: list[str], seeds: list[int]) -> torch.Tensor:
        from flowalign.evaluation import sample_seeded

        return torch.cat([sample_seeded(self.policy, [p], seed=s, num_steps=self.num_steps,
                                        guidance_scale=self.guidance_scale, progress=False).cpu()
                          for p, s in zip(prompts, seeds)])
