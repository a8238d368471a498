"""CrossTimeEdit's pieces (docs/methods/crosstimeedit.md): GDPO's per-criterion group standardisation on a
table worked by hand, and the vvr_edit parts that stand in for its Instruction Alignment and Background
Preservation criteria scoring what each criterion names and nothing else."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

import rewards
from flowalign.advantages import compute_advantages, gdpo_advantages
from rewards.vvr import render
from rewards.vvr_edit import generate_edit_tasks, render_result, render_source
from rewards.vvr_edit.tasks import scene_dict


def test_gdpo_standardises_each_criterion_within_its_group_before_the_weighted_sum():
    """Two prompts, two samples each, three criteria (IA, BP, QP). In a group of two, a criterion's
    standardised values are +1 for the higher sample and -1 for the lower (population std), whatever its
    scale. Weights (0.5, 0.3, 0.2):

    =====  ====  ====  ====  =================  ==========================
    group  IA    BP    QP    standardised       weighted sum S
    =====  ====  ====  ====  =================  ==========================
    0 a    1.0   0.9   0.2   (+1, +1, -1)       0.5 + 0.3 - 0.2 = +0.6
    0 b    0.0   0.1   0.4   (-1, -1, +1)       -0.6
    1 c    0.2   0.3   30    (-1, -1, +1)       -0.6
    1 d    0.6   0.5   10    (+1, +1, -1)       +0.6
    =====  ====  ====  ====  =================  ==========================

    S has batch mean 0 and population std 0.6, so the advantages are (+1, -1, -1, +1). Normalising the raw
    weighted sum instead lets QP's scale decide group 1: c = 0.1 + 0.09 + 6 = 6.19 beats d = 2.45.
    """
    table = torch.tensor([[1.0, 0.9, 0.2], [0.0, 0.1, 0.4], [0.2, 0.3, 30.0], [0.6, 0.5, 10.0]])
    weights, groups = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0, 0, 1, 1])
    torch.testing.assert_close(gdpo_advantages(table, weights, groups, eps=0.0), torch.tensor([1.0, -1.0, -1.0, 1.0]))
    summed = compute_advantages("group", table, weights, groups)
    assert summed[2] > 0 > summed[3], "the weighted sum's own normalisation follows QP's scale in group 1"
    assert torch.equal(compute_advantages("gdpo", table, weights, groups).sign(), torch.tensor([1.0, -1.0, -1.0, 1.0]))


def _pixels(image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)


def _score(name: str, images: list, tasks: list) -> tuple[torch.Tensor, list[bool]]:
    out = rewards.load(name)(torch.stack([_pixels(im) for im in images]), [t.prompt for t in tasks],
                             [{"task": t.to_dict()} for t in tasks])
    assert out.valid.all()
    return out.components[name], [info["all_passed"] for info in out.info]


def test_vvr_edit_parts_score_the_instruction_and_the_preservation_apart():
    tasks = generate_edit_tasks(24, seed=5, level="medium")
    moves = [t for t in tasks if t.kind == "move"][:3]
    # the right edit, but an object the instruction does not name moved by a fifth of the image
    shifted = []
    for t in tasks:
        named = {t.edit.get("target"), t.edit.get("anchor")}
        free = [o for o in t.result if o.id not in named and (t.added is None or o.id != t.added.id)]
        if free and len(shifted) < 3:
            b = free[0]
            moved = dataclasses.replace(b, x=b.x - 0.2 if b.x > 0.5 else b.x + 0.2)
            shifted.append((t, render(scene_dict(t, tuple(moved if o.id == b.id else o for o in t.result)), size=64)))
    assert len(moves) == 3 and len(shifted) == 3
    correct = [render_result(t) for t in moves]
    for name in ("vvr_edit.instruction", "vvr_edit.preservation", "vvr_edit"):
        score, passed = _score(name, correct, moves)
        assert torch.equal(score, torch.ones(3)) and all(passed)
    # an unedited source of a move: nothing else changed, but the instruction was not carried out
    source = [render_source(t) for t in moves]
    ia, ia_passed = _score("vvr_edit.instruction", source, moves)
    bp, bp_passed = _score("vvr_edit.preservation", source, moves)
    assert (ia < 1).all() and not any(ia_passed) and torch.equal(bp, torch.ones(3)) and all(bp_passed)
    # the instruction carried out, a bystander moved: preservation alone drops
    ia, _ = _score("vvr_edit.instruction", [im for _, im in shifted], [t for t, _ in shifted])
    bp, bp_passed = _score("vvr_edit.preservation", [im for _, im in shifted], [t for t, _ in shifted])
    assert torch.equal(ia, torch.ones(3)) and (bp < 1).all() and not any(bp_passed)
