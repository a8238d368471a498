"""Super-resolution tasks: a VVR scene (the HR image, rendered on use) and the degradation that makes its LR.

A task of split ``s`` and level ``L`` is scene ``i`` of :func:`rewards.vvr.generate_tasks` (level ``L``,
held-out compositions excluded) with the split's scene seed, and a degradation drawn from
``random.Random(f"sr:{L}:{seed}:{i}")`` (:func:`rewards.sr.degrade.draw_degradation`). Scene seeds: the
validation and test splits use :data:`SPLIT_SEEDS` (≥ 2000); training draws use seeds < 1000 and skip any
scene that is also in the validation or test split of its level, so the three splits share no scene by
construction (a scene is identified by its background and objects, :func:`scene_key`).

The HR image is the scene rendered at :data:`HR_SIZE` px (any size for the full-reference reward: scenes
are procedural); the LR image is that HR degraded (``HR_SIZE / scale`` px). Every task has one instruction,
:data:`SR_PROMPT`: what an image-conditioned editing model (FLUX.1 Kontext) is asked to do with its input.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

from PIL import Image

from rewards.sr.degrade import Degradation, degrade, draw_degradation

LEVELS = ("easy", "medium", "hard")
#: the side of the HR scene the LR image is made from (the tiny models' resolution)
HR_SIZE = 64
SR_PROMPT = "restore a sharp high resolution image"
SPLITS = ("validation", "test")
#: split → scene seed (seeds < 1000 are training draws)
SPLIT_SEEDS = {"validation": 2001, "test": 2002}
SPLIT_SIZE = 100
TRAIN_SEED_LIMIT = 1000


@dataclass(frozen=True)
class SRTask:
    """``scene``: a VVR task dict (what :func:`rewards.vvr.render` draws); ``degradation``: how its LR is made."""

    id: str
    level: str
    scene: Mapping[str, Any]
    degradation: Degradation

    @property
    def prompt(self) -> str:
        return SR_PROMPT

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "level": self.level, "scene": dict(self.scene),
                "degradation": self.degradation.to_dict(), "prompt": self.prompt}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "SRTask":
        """Build from :meth:`to_dict`'s form; a ``ValueError`` names the missing field."""
        for key in ("scene", "degradation"):
            if not isinstance(d.get(key), Mapping):
                raise ValueError(f"sr task: field {key!r} must be a mapping, got {d.get(key)!r:.60}")
        return SRTask(str(d.get("id", "")), str(d.get("level", "easy")), dict(d["scene"]),
                      Degradation.from_dict(d["degradation"]))


def as_sr_task(task: "SRTask | Mapping[str, Any]") -> SRTask:
    return task if isinstance(task, SRTask) else SRTask.from_dict(task)


def scene_key(scene: Mapping[str, Any]) -> tuple:
    """What identifies a scene: its background and its objects (shape, colour, size, fill, place)."""
    objects = tuple(sorted((o["shape"], o["colour"], o["size"], bool(o.get("filled", True)), round(o["x"], 4),
                            round(o["y"], 4)) for o in scene["objects"]))
    return scene["background"], objects


def render_hr(task: "SRTask | Mapping[str, Any]", size: int = HR_SIZE) -> Image.Image:
    """The task's ground-truth HR image at ``size`` px."""
    from rewards.vvr import render

    return render(as_sr_task(task).scene, size=size)


def render_lr(task: "SRTask | Mapping[str, Any]") -> Image.Image:
    """The task's LR image: its :data:`HR_SIZE` render degraded (the model's conditioning image)."""
    task = as_sr_task(task)
    return degrade(render_hr(task, HR_SIZE), task.degradation)


def _check(level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"level: {level!r} is not allowed; allowed values: {', '.join(LEVELS)}")


def _scene(task: Any) -> dict[str, Any]:
    """A VVR task's scene as a renderable dict (its constraints replaced by the object count)."""
    d = task.to_dict()
    return {"id": d["id"], "level": d["level"], "background": d["background"], "objects": d["objects"],
            "constraints": [{"type": "total_count", "n": len(d["objects"])}]}


def _draw(level: str, seed: int, n: int, skip: frozenset = frozenset()) -> list[SRTask]:
    """The first ``n`` scenes of VVR's draws of ``level`` with ``seed`` not in ``skip``, with their degradations
    (VVR's draw ``j`` does not depend on how many are drawn, so a longer draw extends a shorter one)."""
    from rewards.vvr import generate_tasks

    m = n
    while True:
        scenes = [_scene(t) for t in generate_tasks(m, seed=seed, level=level)]
        kept = [(j, s) for j, s in enumerate(scenes) if scene_key(s) not in skip]
        if len(kept) >= n:
            break
        m += n - len(kept)
    return [SRTask(f"sr-{level}-{seed}-{j}", level, scene, draw_degradation(random.Random(f"sr:{level}:{seed}:{j}"), level))
            for j, scene in kept[:n]]


@lru_cache(maxsize=None)
def held_out_scenes(level: str) -> frozenset:
    """The scene keys of the validation and test splits of ``level`` (what training draws skip)."""
    return frozenset(scene_key(t.scene) for split in SPLITS for t in _draw(level, SPLIT_SEEDS[split], SPLIT_SIZE))


def generate_sr_tasks(n: int, *, seed: int, level: str) -> list[SRTask]:
    """``n`` training tasks of ``level`` for ``seed`` (< 1000), none of whose scenes is in a split."""
    _check(level)
    if not 0 <= seed < TRAIN_SEED_LIMIT:
        raise ValueError(f"seed: training draws use seeds in [0, {TRAIN_SEED_LIMIT}), got {seed}")
    return _draw(level, seed, n, held_out_scenes(level))


def load_split(level: str, split: str = "test", n: int | None = None, seed: int | None = None) -> list[SRTask]:
    """The first ``n`` (default :data:`SPLIT_SIZE`) tasks of ``split``, drawn with the split's scene seed
    (deterministic, so nothing is stored), or with ``seed`` for a fresh draw of the same distribution."""
    from flowalign.errors import UserError

    _check(level)
    if split not in SPLITS:
        raise UserError(f"sr split {split!r} is unknown; choose one of {', '.join(SPLITS)}")
    return _draw(level, SPLIT_SEEDS[split] if seed is None else seed, n or SPLIT_SIZE)
