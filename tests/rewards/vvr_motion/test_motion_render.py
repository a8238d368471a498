"""The motion renderer: clip shape, anti-aliasing, interpolation, appearance, speed."""

from __future__ import annotations

import time

import numpy as np

from rewards.vvr.palette import PALETTE
from rewards.vvr_motion import MotionTask, generate_tasks, render

_TASK = {
    "num_frames": 9,
    "objects": [
        {"id": 0, "shape": "square", "colour": "red", "size": "small", "x": 0.25, "y": 0.5, "end_x": 0.75,
         "end_y": 0.5, "end_size": "large"},
        {"id": 1, "shape": "circle", "colour": "blue", "size": "medium", "x": 0.5, "y": 0.15, "appear": 0.5},
    ],
    "constraints": [{"type": "moves", "ref": {"colour": "red", "shape": "square"}, "direction": "right"}],
}


def _mask(frame: np.ndarray, colour: str) -> np.ndarray:
    return (np.abs(frame.astype(int) - PALETTE[colour]).sum(-1) < 30)


def test_clip_shape_dtype_and_frame_count():
    clip = render(_TASK)
    assert clip.shape == (9, 64, 64, 3) and clip.dtype == np.uint8
    assert render(_TASK, size=128, num_frames=17).shape == (17, 128, 128, 3)


def test_motion_size_and_appearance_follow_the_task():
    clip = render(_TASK, size=128)
    xs = [np.nonzero(_mask(f, "red"))[1].mean() / 128 for f in clip]
    assert abs(xs[0] - 0.25) < 0.01 and abs(xs[-1] - 0.75) < 0.01 and np.all(np.diff(xs) > 0)
    areas = [_mask(f, "red").sum() for f in clip]
    assert np.all(np.diff(areas) > 0) and areas[-1] / areas[0] > 3
    blue = [_mask(f, "blue").any() for f in clip]
    assert blue == [False] * 4 + [True] * 5  # visible from t = 0.5: frame 4 of 9


def test_anti_aliased_edges():
    frame = render(_TASK)[0]
    colours = {tuple(p) for p in frame.reshape(-1, 3)}
    assert len(colours) > 3  # edge pixels mix the object's colour with the background


def test_fast_enough_for_training():
    task = MotionTask.from_dict(generate_tasks(1, seed=0, level="hard")[0].to_dict())
    render(task)
    start = time.perf_counter()
    for _ in range(20):
        render(task)
    assert (time.perf_counter() - start) / 20 < 0.02  # about 1-2 ms when the machine is idle
