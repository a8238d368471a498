"""DanceGRPO: a preset of Flow-GRPO (docs/methods/dance_grpo.md)."""

import json
from pathlib import Path

import pytest
import torch

from flowalign.advantages import best_worst_mask
from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.trainers import trainer_config
from flowalign.trainers.base import StepBatch
from flowalign.trainers.dance_grpo import DanceGRPOTrainer
from flowalign.trainers.flow_grpo import FlowGRPOTrainer
from flowalign.trainers.parts.best_worst import best_and_worst
from flowalign.trainers.parts.drawn_steps import drawn_steps

from .conftest import small_config
from .resume_check import assert_trains_and_resumes_bit_exactly, trainer


def test_best_worst_mask_keeps_the_extremes_of_each_group():
    adv = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -2.0, 3.0, 0.1])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    assert best_worst_mask(adv, groups, 2).tolist() == [False, True, True, False, False, True, True, False]
    assert best_worst_mask(adv, groups, 4).all()  # a group no larger than best_of is kept whole


def test_best_and_worst_is_a_new_batch_and_the_loops_is_left_as_it_was():
    adv = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -2.0, 3.0, 0.1])
    batch = StepBatch([], torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), advantages=adv.clone(), logs={"time/reward": 1.0})
    kept = best_and_worst(batch, 2)
    assert kept.advantages.tolist() == [0.0, -1.0, 2.0, 0.0, 0.0, -2.0, 3.0, 0.0]
    assert kept.logs == {"time/reward": 1.0, "best_of_fraction": 0.5}
    assert torch.equal(batch.advantages, adv) and batch.logs == {"time/reward": 1.0}


def test_steps_per_chunk_is_not_a_dance_grpo_setting():
    """The draw is timestep_fraction's: a config that also sets steps_per_chunk is refused, naming it."""
    with pytest.raises(UserError, match="trainer.steps_per_chunk: dance_grpo has no such setting"):
        trainer_config({"name": "dance_grpo", "steps_per_chunk": 2})


def test_shared_noise_dance_sde_and_a_random_subset_of_steps(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=dance_grpo",
                                   "trainer.batch_size=2", "trainer.num_steps=5"))
    batch = t.collect(0)
    x_T = torch.cat([c.latents[:, 0] for c in batch.chunks])
    for g in torch.unique(batch.groups):
        members = x_T[batch.groups == g]
        assert all(torch.equal(members[0], m) for m in members)  # one x_T per group
    chunk = batch.chunks[0]
    assert chunk.sampler == "dance" and chunk.trained_steps() == [0, 1, 2, 3, 4]  # SDE on every step
    plan = t.plan(batch, torch.Generator().manual_seed(0))
    per_chunk = {}
    for unit in plan.steps[0]:
        per_chunk.setdefault(unit.chunk, []).append(unit.k)
    assert all(len(ks) == 2 for ks in per_chunk.values())  # ⌊0.6·(5−1)⌋ steps per rollout batch
    assert all(max(ks) < 4 for ks in per_chunk.values())  # the step to σ = 0 is sampled, never trained
    assert len({tuple(ks) for ks in per_chunk.values()}) > 1  # drawn per batch, not one fixed prefix


KNOWN = json.loads((Path(__file__).parent / "known_answers" / "dance_grpo_step_selection.json").read_text())


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"T{c['num_steps']}-f{c['fraction']}")
def test_step_selection_equals_the_authors_scripts(case):
    """Counts and candidate range as DanceGRPO's and Pref-GRPO's scripts compute them (known_answers/)."""
    T, f = case["num_steps"], case["fraction"]
    seen = set()
    for seed in range(20):
        steps = drawn_steps(tuple(range(T)), T, f, torch.Generator().manual_seed(seed))
        assert len(steps) == case["train_timesteps"] and steps == sorted(set(steps))
        assert set(steps) <= set(range(case["candidates"]))
        seen |= set(steps)
    if "max_trained_index" in case:
        assert max(seen) == case["max_trained_index"] and len(seen) == case["candidates"]


def test_a_fraction_that_trains_no_step_is_refused(tmp_path, tiny_sd3_dir, prompt_file):
    with pytest.raises(Exception, match="timestep_fraction"):
        build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=dance_grpo",
                                   "trainer.num_steps=2", "trainer.timestep_fraction=0.5"))


def test_on_policy_ratio_is_exactly_one(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=dance_grpo"))
    chunk = t.collect(0).chunks[0]
    for k in chunk.trained_steps():
        with torch.no_grad():
            again = t.step_distribution(chunk, k, t.policy_velocity(chunk, k, True))
        assert torch.equal(again.log_prob, chunk.step(k)[2])


def test_best_of_zeroes_the_middle_samples(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=dance_grpo",
                                   "trainer.best_of=2"))
    batch = t.collect(0)
    for g in torch.unique(batch.groups):
        assert int((batch.advantages[batch.groups == g] != 0).sum()) <= 2


def test_the_loss_is_flow_grpos(tmp_path, tiny_sd3_dir, prompt_file):
    """With Flow-GRPO's sampler, dance_grpo's step equals flow_grpo's with the same trained-step draw (the
    last step deterministic in both, so both draw from the first T−1 steps)."""
    assert DanceGRPOTrainer.loss is FlowGRPOTrainer.loss and DanceGRPOTrainer.surrogate is FlowGRPOTrainer.surrogate
    common = ("trainer.max_steps=1", "trainer.noise_level=0.7", "trainer.shared_initial_noise=true",
              "trainer.num_steps=5", "trainer.sde_last_step=false",
              "trainer.advantage=group", "trainer.beta=0", "trainer.clip_range=1e-4")
    flow = trainer(tmp_path / "f", tiny_sd3_dir, prompt_file, *common, "trainer.timestep_fraction=1.0",
                   "trainer.steps_per_chunk=2")
    dance = trainer(tmp_path / "d", tiny_sd3_dir, prompt_file, *common, "trainer.name=dance_grpo",
                    "trainer.sampler=flow_grpo", "trainer.timestep_fraction=0.5")
    flow.train()
    dance.train()
    a, b = flow.trainable_state(), dance.trainable_state()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=dance_grpo")
