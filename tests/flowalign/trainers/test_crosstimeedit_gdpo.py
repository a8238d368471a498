"""CrossTimeEdit's GDPO advantages against the authors' code (docs/methods/crosstimeedit.md): their
``AdvantageProcessor.compute_gdpo`` (Flow-Factory as vendored in their release) driven on fixed rewards, and
the GDPO authors' own trl lines on the same rewards, kept in known_answers/crosstimeedit_gdpo_advantages.json."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowalign.advantages import compute_advantages, gdpo_advantages
from flowalign.reward_set import RewardScores
from flowalign.trainers.flow_grpo import FlowGRPOConfig, FlowGRPOTrainer

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "crosstimeedit_gdpo_advantages.json").read_text())
CASES = KNOWN["cases"]


def _inputs(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    names = list(case["rewards"])
    components = torch.tensor([case["rewards"][n] for n in names], dtype=torch.float32).T  # their float32 scores
    weights = torch.tensor([case["weights"][n] for n in names])
    groups = torch.arange(len(components)) // case["group_size"]
    return components, weights, groups


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_the_default_gdpo_is_the_crosstimeedit_authors_compute_gdpo(case):
    """flow_grpo's default ``gdpo_std: floor`` gives their advantages: population std floored at 1e-6 within
    each group and over the batch, weights as written, clipped at ±5 as their loss clamps them (case 3 reaches
    the clip). The former form (population std + 1e-4) differs on every case."""
    components, weights, groups = _inputs(case)
    tcfg = FlowGRPOConfig(advantage="gdpo")
    assert tcfg.gdpo_std == "floor" and tcfg.adv_clip == 5.0
    ours = compute_advantages("gdpo", components, weights, groups, clip=tcfg.adv_clip, gdpo_std=tcfg.gdpo_std)
    torch.testing.assert_close(ours, torch.tensor(case["advantages_clipped"]), rtol=1e-5, atol=1e-6)
    unclipped = gdpo_advantages(components.double(), weights, groups)
    torch.testing.assert_close(unclipped, torch.tensor(case["advantages"], dtype=torch.float64), rtol=1e-6, atol=1e-7)
    former = compute_advantages("gdpo", components, weights, groups, clip=100.0, gdpo_std="population")
    assert FlowGRPOConfig.former_forms()[0]["gdpo_std"] == "population"
    assert not torch.allclose(former, torch.tensor(case["advantages"]), rtol=1e-5, atol=1e-6)


def test_ties_floors_and_the_clip_are_exercised():
    """The fixture reaches what the formula's details decide: a criterion tied within a group (its
    contribution 0), a spread under the 1e-6 floor but not zero, and a batch-renormalised advantage past 5."""
    tied = below_floor = False
    for case in CASES:
        components, _, groups = _inputs(case)
        for m in range(components.shape[1]):
            for g in torch.unique(groups):
                spread = components[groups == g, m].double().std(unbiased=False)
                tied |= bool(spread == 0)
                below_floor |= bool(0 < spread < 1e-6)
    assert tied and below_floor
    assert any(max(map(abs, c["advantages"])) > 5 for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_gdpo_std_unbiased_is_the_gdpo_authors_trl_form(case):
    """``gdpo_std: unbiased`` is the GDPO authors' trl trainer (unbiased std + 1e-4 in each group and over the
    batch); their lines run in float32, hence the tolerance."""
    components, weights, groups = _inputs(case)
    ours = compute_advantages("gdpo", components, weights, groups, clip=100.0, gdpo_std="unbiased")
    torch.testing.assert_close(ours, torch.tensor(case["trl_gdpo_advantages"]), rtol=1e-4, atol=1e-5)


def test_the_loop_passes_the_trainers_gdpo_std(tmp_path):
    """``judge`` (every trainer's scoring service) computes ``advantage: gdpo`` with the section's
    ``gdpo_std``: the authors' form by default, the former one when a recipe pins it."""
    case = CASES[1]
    components, weights, groups = _inputs(case)
    n = len(components)
    scores = RewardScores(values=components, ok=torch.ones_like(components, dtype=torch.bool), weights=weights,
                          names=list(case["rewards"]))
    acc = SimpleNamespace(device=torch.device("cpu"), process_index=0, gather=lambda t: t)
    trainer = FlowGRPOTrainer.__new__(FlowGRPOTrainer)
    trainer.acc, trainer.run_dir = acc, tmp_path
    trainer.cfg = SimpleNamespace(run=SimpleNamespace(max_invalid_fraction=0.5))
    for gdpo_std, expected in (("floor", torch.tensor(case["advantages"])),
                               ("population", compute_advantages("gdpo", components, weights, groups,
                                                                 gdpo_std="population"))):
        trainer.tcfg = FlowGRPOConfig(advantage="gdpo", gdpo_std=gdpo_std)
        out = trainer.judge(scores, torch.zeros(n, 3, 4, 4), groups, step=0).advantages
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
