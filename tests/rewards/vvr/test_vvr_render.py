"""VVR renderer: RGB at any size, anti-aliased, objects ≥ 10 px at 64 px, fast."""

from __future__ import annotations

import time

import numpy as np

from rewards.vvr import Task, generate_tasks, render
from rewards.vvr.geometry import SIZE_EXTENT
from rewards.vvr.palette import PALETTE


def test_render_size_mode_and_background():
    t = generate_tasks(1, seed=0, level="hard")[0]
    for size in (64, 128, 512):
        img = render(t, size)
        assert img.mode == "RGB" and img.size == (size, size)
        assert img.getpixel((0, 0)) == PALETTE[t.background]
    assert np.array_equal(np.asarray(render(t.to_dict(), 64)), np.asarray(render(t, 64)))


def test_render_is_anti_aliased_and_paints_the_palette_colour():
    t = generate_tasks(1, seed=4, level="easy")[0]
    px = np.asarray(render(t, 64)).reshape(-1, 3)
    colour, white = np.array(PALETTE[t.objects[0].colour]), np.array(PALETTE["white"])
    exact = (px == colour).all(1).sum()
    edge = ~(px == colour).all(1) & ~(px == white).all(1)
    assert exact > 50  # the interior is the exact palette colour
    assert edge.sum() > 10  # edge pixels are mixes: anti-aliased, not jagged


def test_smallest_object_is_at_least_10_px_at_64_px():
    assert min(SIZE_EXTENT.values()) * 64 >= 10
    d = generate_tasks(1, seed=0, level="hard")[0].to_dict()
    d["objects"] = [dict(d["objects"][0], shape="star", size="small", x=0.5, y=0.5, filled=True)]
    px = np.asarray(render(Task.from_dict(d), 64))
    ys, xs = np.nonzero((px != np.array(PALETTE[d["background"]])).any(-1))
    assert xs.max() - xs.min() + 1 >= 10 and ys.max() - ys.min() + 1 >= 10


def test_render_time_is_printed():
    tasks = generate_tasks(200, seed=1, level="hard")
    t0 = time.perf_counter()
    for t in tasks:
        render(t, 64)
    ms = (time.perf_counter() - t0) / len(tasks) * 1e3
    print(f"\nrender: {ms:.2f} ms per 64 px hard scene")
