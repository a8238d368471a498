"""Soundness: rendered clips of generated tasks pass every constraint, clean, JPEG'd and blurred."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageFilter

from rewards.vvr_motion import CONSTRAINT_TYPES, MotionTask, generate_tasks, render, verify


def _jpeg(frame: Image.Image) -> Image.Image:
    buf = io.BytesIO()
    frame.save(buf, "JPEG", quality=75)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def _blur(frame: Image.Image) -> Image.Image:
    return frame.filter(ImageFilter.GaussianBlur(0.6 * frame.size[0] / 64))


DEGRADE = {"clean": lambda f: f, "jpeg": _jpeg, "blur": _blur}


def _per_frame(clip: np.ndarray, fn) -> np.ndarray:
    return np.stack([np.asarray(fn(Image.fromarray(f))) for f in clip])


def _covering(per_type: int = 3) -> list[MotionTask]:
    """Generated hard tasks until every type occurs ``per_type`` times, plus easy and medium ones."""
    counts = dict.fromkeys(CONSTRAINT_TYPES, 0)
    chosen = []
    for t in generate_tasks(200, seed=21, level="hard"):
        if any(counts[c.type] < per_type for c in t.constraints):
            chosen.append(t)
            for c in t.constraints:
                counts[c.type] += 1
    assert min(counts.values()) >= per_type, counts
    return chosen + generate_tasks(2, seed=21, level="easy") + generate_tasks(4, seed=21, level="medium")


SOUND_TASKS = _covering()


def test_every_constraint_type_is_covered():
    assert {c.type for t in SOUND_TASKS for c in t.constraints} == set(CONSTRAINT_TYPES)


@pytest.mark.parametrize("size", (64, 128))
@pytest.mark.parametrize("variant", list(DEGRADE))
def test_rendered_clips_pass_every_constraint(size, variant):
    failures = []
    for t in SOUND_TASKS:
        v = verify(t, _per_frame(render(t, size), DEGRADE[variant]))
        assert v.valid, v.reason
        failures += [(t.id, kind, t.prompt, v.detected) for kind, ok in v.constraints if not ok]
    assert not failures, failures[:2]
