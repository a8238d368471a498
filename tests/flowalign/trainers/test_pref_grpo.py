"""Pref-GRPO: advantages from within-group pairwise win rates (docs/methods/pref_grpo.md)."""

import pytest
import torch

from flowalign.advantages import compute_advantages, group_advantages, preference_win_rates
from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer, check_run
from flowalign.trainers import trainer_config

from .conftest import small_config, small_run
from .resume_check import assert_trains_and_resumes_bit_exactly


def test_win_rates_from_compared_scores_and_from_a_pairwise_judge():
    """Group 0 scores (0.1, 0.9, 0.5): wins (0, 2, 1) of 2 → W = (0, 1, ½); group 1 ties (0.4, 0.4): ½ each.
    A judged reward's value is its win rate already and is taken as it is."""
    scores = torch.tensor([[0.1], [0.9], [0.5], [0.4], [0.4]])
    groups = torch.tensor([0, 0, 0, 1, 1])
    w = preference_win_rates(scores, torch.tensor([1.0]), groups)
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, 0.5, 0.5, 0.5]))
    judged = preference_win_rates(torch.tensor([[0.25], [0.75], [1.0], [0.0], [0.0]]), torch.tensor([2.0]),
                                  groups, judged=torch.tensor([True]))
    torch.testing.assert_close(judged, torch.tensor([0.5, 1.5, 2.0, 0.0, 0.0]))
    adv = compute_advantages("win_rate", scores, torch.tensor([1.0]), groups)
    # (W − mean_g)/(std_g + 1e-4): group 0 mean ½, population std sqrt(1/6); group 1 all ties → 0
    s = (1 / 6) ** 0.5
    torch.testing.assert_close(adv, torch.tensor([-0.5 / (s + 1e-4), 0.5 / (s + 1e-4), 0.0, 0.0, 0.0]))
    # a judge's win rates are not compared again (that would give rank win rates, not the judge's)
    mixed = compute_advantages("win_rate", torch.tensor([[0.2], [0.3], [1.0]]), torch.tensor([1.0]),
                               torch.tensor([0, 0, 0]), judged=torch.tensor([True]))
    torch.testing.assert_close(mixed, group_advantages(torch.tensor([0.2, 0.3, 1.0]), torch.tensor([0, 0, 0])))


def test_the_batch_advantages_are_the_group_normalised_win_rates(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=pref_grpo"))
    batch = t.collect(0)
    w = preference_win_rates(batch.scores.values, batch.scores.weights, batch.prompt_ids)
    torch.testing.assert_close(batch.advantages, group_advantages(w, batch.prompt_ids).clamp(-5, 5))
    x_T = torch.cat([c.latents[:, 0] for c in batch.chunks])
    for g in torch.unique(batch.groups):  # the authors' shared initial noise per group
        assert all(torch.equal(x_T[batch.groups == g][0], m) for m in x_T[batch.groups == g])
    chunk = batch.chunks[0]
    for k in t.trained_steps(chunk):  # on-policy ratio exactly 1
        with torch.no_grad():
            again = t.step_distribution(chunk, k, t.policy_velocity(chunk, k, True))
        assert torch.equal(again.log_prob, chunk.step(k)[2])


def test_its_settings_are_dance_grpos_step_draw_and_best_of_not_steps_per_chunk():
    """A preset of flow_grpo with DanceGRPO's step draw: steps_per_chunk is refused, naming it."""
    _, tcfg = trainer_config({"name": "pref_grpo", "best_of": 4})
    assert tcfg.timestep_fraction == 0.6 and tcfg.best_of == 4 and tcfg.advantage == "win_rate"
    with pytest.raises(UserError, match="trainer.steps_per_chunk: pref_grpo has no such setting"):
        trainer_config({"name": "pref_grpo", "steps_per_chunk": 2})


def test_rollout_batches_must_hold_whole_groups(tmp_path, tiny_sd3_dir, prompt_file):
    with pytest.raises(UserError, match="multiple of trainer.group_size"):
        check_run(load_config(None, small_run(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=pref_grpo",
                                              "trainer.batch_size=2")))


def test_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=pref_grpo",
                                          "trainer.updates_per_epoch=2")
