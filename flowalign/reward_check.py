"""What a reward must return and need, checked where it is called: a wrong output or missing per-prompt
metadata is the reward's or the data's mistake, reported in one line, never a masked batch."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from flowalign.errors import UserError
from flowalign.protocols import RewardOutput


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def check_reward_output(name: str, out: Any, n: int) -> RewardOutput:
    """``out`` if it is a :class:`RewardOutput` of ``n`` samples (components ``(n,)`` numbers, ``valid``
    ``(n,)``), else ``UserError`` saying what the reward returned and what is expected."""
    expected = f"expected a RewardOutput with ({n},) float components and a ({n},) bool valid mask"
    if not isinstance(out, RewardOutput):
        raise UserError(f"reward {name!r} returned {_describe(out)}; {expected}")
    if not out.components:
        raise UserError(f"reward {name!r} returned no components; {expected}")
    for key, value in {**out.components, "valid": out.valid}.items():
        if not isinstance(value, torch.Tensor) or value.shape != (n,):
            raise UserError(f"reward {name!r} returned {key!r} as {_describe(value)} for {n} samples; {expected}")
        if key != "valid" and not (value.is_floating_point() or value.dtype in (torch.int32, torch.int64)):
            raise UserError(f"reward {name!r} returned {key!r} of dtype {value.dtype}; {expected}")
    return out


def check_reward_metadata(name: str, reward: Any, metadata: list[dict[str, Any]], source: str) -> None:
    """Refuse prompts that lack what ``reward`` reads from each prompt's metadata (its optional
    ``requires_metadata`` names, e.g. ``("task",)`` for a verifier)."""
    for key in getattr(reward, "requires_metadata", ()):
        missing = sum(1 for m in metadata if not m or m.get(key) is None)
        if missing == len(metadata):
            raise UserError(f"reward {name!r} scores each prompt against its {key!r}, but the prompts of {source} "
                            f"carry no {key!r} (plain text prompts carry none); use prompts that carry one (a .jsonl "
                            f'with a "{key}" per line, or a benchmark such as data.bench=vvr)')
        if missing:
            raise UserError(f"reward {name!r} needs a {key!r} for every prompt, but {missing} of the {len(metadata)} "
                            f"prompts of {source} have none; give each line a \"{key}\"")


def _task_frames(meta: dict[str, Any] | None) -> int | None:
    """The frame count a prompt's task is checked at (``task["num_frames"]``, e.g. a motion task's), if any."""
    task = (meta or {}).get("task")
    n = task.get("num_frames") if isinstance(task, dict) else getattr(task, "num_frames", None)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def check_frame_count(num_frames: int | None, metadata: list[dict[str, Any]], source: str) -> None:
    """Refuse prompts whose tasks are checked on clips of another length than the model samples
    (``num_frames``; None: images), before any sampling: every such sample would be invalid."""
    counts = Counter(n for n in map(_task_frames, metadata) if n is not None and n != num_frames)
    if not counts:
        return
    frames, count = counts.most_common(1)[0]
    made = f"{num_frames}-frame clips" if num_frames else "images"
    raise UserError(f"{count} of the {len(metadata)} prompts of {source} are tasks checked on {frames}-frame clips, "
                    f"but the model samples {made}: set model.defaults.num_frames={frames}"
                    + ("" if num_frames else " with a video model"))


def check_video_files(specs: list[Any], makes_videos: bool, where: str) -> None:
    """Refuse a reward entry of ``specs`` (:class:`flowalign.config.RewardSpec`) with a ``video_mp4_fps`` when the
    model makes images (``makes_videos`` false): it writes videos to mp4 files. ``where``: the option's name."""
    for i, spec in enumerate(specs):
        if spec.video_mp4_fps is not None and not makes_videos:
            raise UserError(f"{where}[{i}] ({spec.key}): video_mp4_fps writes videos to mp4 files, and this model "
                            "samples images: drop video_mp4_fps")
