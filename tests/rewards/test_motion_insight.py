"""``motion_insight``: clean VVR motion clips score high on every dimension; each injected defect lowers its
own dimension and the cause names it; the dimension rewards load, batch like single samples and combine
in a reward set."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rewards
from flowalign.errors import UserError
from flowalign.reward_set import RewardSet
from rewards.motion_insight import DIMENSIONS, build, diagnose
from rewards.motion_insight.defects import (
    DEFECT_DIMENSION,
    DEFECT_WORDS,
    DEFECTS,
    inject,
)
from rewards.vvr_motion import load_split, render


@pytest.fixture(scope="module")
def tasks():
    """Held-out medium and hard tasks: one or two movers, 1-3 objects."""
    return load_split("medium", "test", n=6) + load_split("hard", "test", n=6)


def _tensor(clips) -> torch.Tensor:
    """``(B, F, 3, H, W)`` float in [0, 1] from ``(F, H, W, 3)`` uint8 clips."""
    return torch.stack([torch.from_numpy(np.ascontiguousarray(c)).permute(0, 3, 1, 2).float() / 255 for c in clips])


@pytest.mark.parametrize("size", [64, 32])
def test_clean_clips_score_high_on_every_dimension(tasks, size):
    for task in tasks:
        dims = diagnose(build(render(task, size), task))
        causes = {k: d.cause for k, d in dims.items()}
        if size == 64:  # no finding at all
            assert all(d.score == 1.0 for d in dims.values()) and not any(causes.values()), (task.id, causes)
        else:  # 32 px: pixel quantisation may cost a little
            assert all(d.score >= 0.9 for d in dims.values()), (task.id, causes)


@pytest.mark.parametrize("defect", DEFECTS)
def test_each_defect_lowers_its_dimension_and_the_cause_names_it(tasks, defect):
    dimension, hit = DEFECT_DIMENSION[defect], 0
    for seed, task in enumerate(tasks):
        injected = inject(defect, task, seed)
        if injected is None:  # e.g. a swap needs two objects
            continue
        dims = diagnose(build(injected[0], task))
        assert dims[dimension].score < 0.8, (task.id, injected[1], dims[dimension].score)
        assert DEFECT_WORDS[defect] in dims[dimension].cause, (task.id, injected[1], dims[dimension].cause)
        hit += 1
    assert hit >= 4  # the defect was injected into enough clips to mean something


@pytest.mark.parametrize("defect", ["drop", "swap", "freeze"])
def test_a_defect_of_one_dimension_leaves_the_others_alone(tasks, defect):
    checked = 0
    for task in tasks:
        injected = inject(defect, task, 0)
        if injected is None:
            continue
        dims = diagnose(build(injected[0], task))
        others = {k: dims[k] for k in DIMENSIONS if k != DEFECT_DIMENSION[defect]}
        assert all(d.score >= 0.9 for d in others.values()), (task.id, injected[1], {k: d.cause for k, d in others.items()})
        checked += 1
    assert checked >= 4


def test_a_blank_clip_is_not_consistent_and_a_missing_object_is_named(tasks):
    task = tasks[-1]
    blank = np.full_like(render(task, 32), 255)
    blank[:, 0, 0] = 0  # not one colour throughout
    without_task = diagnose(build(blank))
    assert without_task["consistency"].score < 0.1 and "no objects" in without_task["consistency"].cause
    with_task = diagnose(build(blank, task))
    assert with_task["consistency"].score < 0.1 and "never appears" in with_task["consistency"].cause


def test_rewards_are_registered_and_batch_equals_per_sample(tasks):
    names = ["motion_insight", *(f"motion_insight.{d}" for d in DIMENSIONS)]
    assert set(names) <= set(rewards.available())
    clips = [render(t, 32) for t in tasks[:3]]
    clips.append(inject("teleport", tasks[3], 0, 32)[0])
    clips.append(inject("drop", tasks[4], 0, 32)[0])
    x = _tensor(clips)
    meta = [{"task": t.to_dict()} for t in tasks[:5]]
    for name in names:
        reward = rewards.load(name)
        out = reward(x, [""] * 5, meta)
        assert out.components[name].shape == (5,) and out.valid.all()
        single = torch.cat([reward(x[i : i + 1], [""], meta[i : i + 1]).components[name] for i in range(5)])
        assert torch.equal(out.components[name], single)
        assert all(0.0 <= v <= 1.0 for v in out.components[name].tolist())
    info = rewards.load("motion_insight.continuity")(x, [""] * 5, meta).info
    assert "jumps" in info[3]["reason"] and info[3]["reason"].startswith("continuity: ")
    assert info[0]["reason"] == "" and set(info[4]["scores"]) == set(DIMENSIONS)


def test_combined_reward_options(tasks):
    x = _tensor([inject("drop", tasks[0], 0, 32)[0]])
    meta = [{"task": tasks[0]}]
    dims = rewards.load("motion_insight")(x, [""], meta).info[0]["scores"]
    mean = rewards.load("motion_insight")(x, [""], meta).components["motion_insight"].item()
    assert mean == pytest.approx(sum(dims.values()) / 3, abs=1e-3)
    only = rewards.load("motion_insight", weights=[1, 0, 0])(x, [""], meta).components["motion_insight"]
    assert only.item() == pytest.approx(dims["consistency"], abs=1e-3)
    product = rewards.load("motion_insight", combine="product")(x, [""], meta).components["motion_insight"].item()
    assert product == pytest.approx(np.prod(list(dims.values())) ** (1 / 3), abs=1e-3)
    with pytest.raises(UserError, match="combine"):
        rewards.load("motion_insight", combine="max")
    with pytest.raises(UserError, match="weights"):
        rewards.load("motion_insight", weights=[1, 1])


def test_dimensions_combine_in_a_reward_set_and_mask_non_finite_clips(tasks):
    clips = [render(tasks[0], 64), inject("freeze", tasks[1], 0, 64)[0]]
    x = _tensor(clips)
    x[0, 0, 0, 0, 0] = float("nan")
    meta = [{"task": tasks[0]}, {"task": tasks[1]}]
    entries = [(f"motion_insight.{d}", 1.0, rewards.load(f"motion_insight.{d}")) for d in DIMENSIONS]
    scored = RewardSet(entries).score(x, ["", ""], meta)
    assert scored.names == [f"motion_insight.{d}" for d in DIMENSIONS]
    assert scored.ok[:, 0].tolist() == [False, True] and "NaN" in scored.reasons[0]
    assert scored.values[1, 1] < 0.8 and scored.values[1, 0] > 0.9  # the freeze costs continuity only


def test_causes_reach_the_gallery_beside_each_video(tasks, tmp_path):
    import json

    from flowalign.eval_panel import score_panel
    from flowalign.gallery import gallery_from_evals

    x = _tensor([render(tasks[0], 32), inject("teleport", tasks[3], 0, 32)[0]])
    meta = [{"task": tasks[0]}, {"task": tasks[3]}]
    panel = RewardSet([(f"motion_insight.{d}", 1.0, rewards.load(f"motion_insight.{d}")) for d in DIMENSIONS])
    _, rows = score_panel(panel, x, ["a", "b"], meta)
    assert "notes" not in rows[0]  # a clean clip has nothing to say
    assert "jumps" in rows[1]["notes"]["motion_insight.continuity"]
    # an evaluation folder as evaluate() writes it, with vvr_motion's empty reason on a valid sample
    (tmp_path / "samples").mkdir()
    results = []
    for i, row in enumerate(rows):
        (tmp_path / "samples" / f"{i:05d}.mp4").write_bytes(b"\0")
        results.append({"index": i, "prompt": "ab"[i], "valid": True, "score": 1.0, "reason": "",
                        "file": f"samples/{i:05d}.mp4", **row})
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in results))
    (tmp_path / "metrics.json").write_text(json.dumps({"reward": "vvr_motion"}))
    _, gallery_rows = gallery_from_evals([tmp_path], ["step 0"])
    assert gallery_rows[0].cells[0].reason == ""
    assert gallery_rows[1].cells[0].reason.startswith("continuity: ") and "jumps" in gallery_rows[1].cells[0].reason
