"""MixGRPO: the sliding SDE window (docs/methods/mix_grpo.md)."""

import json
import math
from pathlib import Path

import pytest
import torch

from flowalign.errors import UserError
from flowalign.sampling import CompressedTail, sde_step, sliding_window
from flowalign.train import build_trainer
from flowalign.trainers import trainer_config
from flowalign.trainers.parts.policy_gradient import ppo_clip_loss

from .conftest import small_config
from .resume_check import assert_trains_and_resumes_bit_exactly


def test_the_window_slides_by_the_stride_every_interval_and_rolls_back():
    # T = 8: starts 0..5 (the window stays within steps 0..5, narrowing at the end), 2 training steps each
    starts = [sliding_window(step, 8, 3, 2, 1) for step in range(14)]
    assert starts == [(0, 3), (0, 3), (1, 3), (1, 3), (2, 3), (2, 3), (3, 3), (3, 3), (4, 2), (4, 2),
                      (5, 1), (5, 1), (0, 3), (0, 3)]
    assert [sliding_window(step, 8, 2, 1, 2)[0] for step in range(4)] == [0, 2, 4, 0]


def test_rollouts_are_sde_only_in_the_window_of_the_step(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=mix_grpo",
                                   "trainer.num_steps=6", "trainer.window_size=2", "trainer.shift_interval=1"))
    for step, window in ((0, [0, 1]), (1, [1, 2]), (2, [2, 3]), (3, [3]), (4, [0, 1])):
        t.step = step
        batch = t.collect(step)
        assert all(c.trained_steps() == window for c in batch.chunks)
        assert batch.logs["window_start"] == window[0]
        chunk = batch.chunks[0]
        assert torch.isnan(chunk.log_probs[:, [k for k in range(6) if k not in window]]).all()  # ODE elsewhere
        for k in window:  # on-policy: the ratio is exactly 1
            with torch.no_grad():
                again = t.step_distribution(chunk, k, t.policy_velocity(chunk, k, True))
            assert torch.equal(again.log_prob, chunk.step(k)[2])


def test_trains_and_resumes_bit_exactly_as_the_window_moves(tmp_path, tiny_sd3_dir, prompt_file):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=mix_grpo",
                                          "trainer.window_size=2", "trainer.shift_interval=1")


KNOWN = json.loads((Path(__file__).parent / "known_answers" / "mix_grpo_window_loss.json").read_text())


SCHEDULE_ID = "T{sampling_steps}-w{group_size}-i{iters_per_group}-s{prog_overlap_step}"


@pytest.mark.parametrize("case", KNOWN["schedules"], ids=lambda c: SCHEDULE_ID.format(**c))
def test_the_window_schedule_is_the_authors_without_their_empty_windows(case):
    """GRPOTrainingStates' ``timesteps_train`` per training step (known_answers/): the authors' window also
    visits a start of T − 2, where it is empty (their step trains nothing); flowalign's is their sequence with
    those steps left out."""
    T, width, interval, stride = (case[n] for n in ("sampling_steps", "group_size", "iters_per_group",
                                                    "prog_overlap_step"))
    theirs = case["timesteps_train"]
    assert all(w or i // interval % ((T - 2) // stride + 1) * stride == T - 2 for i, w in enumerate(theirs))
    trained = [w for w in theirs if w]
    assert len(trained) < len(theirs)  # the fixture reaches the empty window
    windows = (sliding_window(i, T, width, interval, stride) for i in range(len(trained)))
    ours = [list(range(start, start + n)) for start, n in windows]
    assert ours == trained


def test_window_steps_and_loss_equal_the_authors():
    """``flow_grpo_step`` and ``train_one_step``'s loss on fixed tensors (known_answers/): each window step's
    log-prob (float32, as flowalign's steps run) and the optimiser step's loss, the sum over samples and window
    steps of mean(max(−A·r, −A·clip(r))) / (samples · steps), in float64."""
    sigmas, eta, window = KNOWN["sigmas"], KNOWN["eta"], KNOWN["window"]
    x, v_old, v = (torch.tensor(KNOWN[n], dtype=torch.float64) for n in ("sample", "velocity_old", "velocity"))
    adv = torch.tensor(KNOWN["advantages"], dtype=torch.float64).clamp(-KNOWN["adv_clip_max"], KNOWN["adv_clip_max"])
    total, flags = 0.0, []
    for j, (k, case) in enumerate(zip(window, KNOWN["steps"])):
        x_next = torch.tensor(case["prev_sample"], dtype=torch.float64)
        for velocity, name in ((v_old, "old_log_prob"), (v, "log_prob")):
            out = sde_step("flow_grpo", velocity[:, j], x[:, j], sigmas[k], sigmas[k + 1], noise_level=eta,
                           prev_sample=x_next)
            torch.testing.assert_close(out.log_prob, torch.tensor(case[name]).float(), rtol=1e-5, atol=1e-6)
        lp, old = (torch.tensor(case[n], dtype=torch.float64) for n in ("log_prob", "old_log_prob"))
        per_sample, _, clipped = ppo_clip_loss(lp, old, adv, KNOWN["clip_range"])
        flags.append(clipped)
        total += per_sample.mean().item() / len(window)  # one unit per window step, each weighted 1 / units
    assert math.isclose(total, KNOWN["total_loss"], rel_tol=1e-6)
    assert torch.cat(flags).any() and not torch.cat(flags).all()  # the fixture exercises both sides of the clip


ADVANTAGES = json.loads((Path(__file__).parent / "known_answers" / "mix_grpo_advantages.json").read_text())


@pytest.mark.parametrize("case", ADVANTAGES["cases"], ids=range(len(ADVANTAGES["cases"])))
def test_advantages_equal_the_authors(case):
    """The default ``advantage: per_reward`` with ``advantage_std: unbiased`` is the authors' ``advantage_aggr``:
    each reward's (r − mean)/(Tensor.std() + 1e-8) per group, weight-summed (known_answers/mix_grpo_advantages.json).
    Normalising the weighted sum instead (``group``) differs wherever two rewards disagree."""
    from flowalign.advantages import compute_advantages
    from flowalign.trainers.mix_grpo import MixGRPOConfig, MixGRPOTrainer

    t = MixGRPOTrainer.__new__(MixGRPOTrainer)
    t.tcfg = MixGRPOConfig()
    names = list(case["rewards"])
    components = torch.tensor([case["rewards"][n] for n in names], dtype=torch.float32).T
    weights = torch.tensor([case["weights"][n] for n in names])
    groups = torch.arange(len(components)) // case["num_generations"]
    ours = compute_advantages(t.tcfg.advantage, components, weights, groups, clip=100.0, **t.advantage_options())
    expected = torch.tensor(case["advantages"])
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    if len(names) > 1:
        summed_first = compute_advantages("group", components, weights, groups, clip=100.0, **t.advantage_options())
        assert not torch.allclose(summed_first, expected, rtol=1e-3)
    # their reward weights are divided by their sum at start: weights written 3x give the same advantages
    torch.testing.assert_close(compute_advantages(t.tcfg.advantage, components, 3 * weights, groups, clip=100.0,
                                                  **t.advantage_options()), expected, rtol=1e-5, atol=1e-6)
    t.tcfg = MixGRPOConfig(reward_weights="as_written")  # the former form: the weights as written
    assert MixGRPOConfig.before["reward_weights"] == "as_written"
    tripled = compute_advantages(t.tcfg.advantage, components, 3 * weights, groups, clip=100.0, **t.advantage_options())
    torch.testing.assert_close(tripled, 3 * expected, rtol=1e-5, atol=1e-5)
    t.tcfg = MixGRPOConfig(advantage_std="population")  # Flow-GRPO's population std + 1e-4: another number
    assert t.advantage_options() == {"normalise_weights": True}
    assert not torch.allclose(compute_advantages("per_reward", components, weights, groups, clip=100.0), expected,
                              rtol=1e-3)


FLASH = json.loads((Path(__file__).parents[1] / "sampling" / "known_answers" / "mix_grpo_flash_rollout.json").read_text())


def test_a_stride_of_zero_keeps_the_window_at_the_start_as_flash_star():
    """Flash*'s ``prog_overlap_step 0``: GRPOTrainingStates' window over 300 training steps (known_answers/)."""
    known = FLASH["frozen_schedule"]
    T, width, interval = known["sampling_steps"], known["group_size"], known["iters_per_group"]
    ours = [list(range(s, s + n)) for s, n in (sliding_window(i, T, width, interval, 0) for i in range(300))]
    assert ours == known["timesteps_train"]


def test_flash_rollouts_finish_on_the_compressed_grid_and_train_the_window(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=mix_grpo",
                                   "trainer.num_steps=10", "trainer.window_size=2", "trainer.shift_interval=1",
                                   "trainer.post_window_solver=dpm2"))
    for step, window in ((0, [0, 1]), (3, [3, 4])):
        t.step = step
        batch = t.collect(step)
        chunk = batch.chunks[0]
        assert torch.equal(chunk.sigmas, CompressedTail(3.0, 0.4).sigmas(10, window[-1]))
        assert chunk.num_steps == window[-1] + 1 + int((10 - window[-1]) * 0.4) - 1 < 10
        assert all(c.trained_steps() == window for c in batch.chunks)
        for k in window:  # on-policy: the ratio is exactly 1 at every trained step
            with torch.no_grad():
                again = t.step_distribution(chunk, k, t.policy_velocity(chunk, k, True))
            assert torch.equal(again.log_prob, chunk.step(k)[2])


@pytest.mark.parametrize("stride", [1, 0])
def test_the_plan_counts_the_longest_compressed_rollout_the_schedule_samples(stride, tmp_path, tiny_sd3_dir,
                                                                              prompt_file):
    """``flowalign plan`` holds a Flash rollout at its compressed length, the longest over the windows the run
    places (Flash*: the window at step 0 only), not at ``num_steps``."""
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=mix_grpo",
                                   "trainer.num_steps=8", "trainer.window_size=2", "trainer.shift_interval=1",
                                   f"trainer.window_stride={stride}", "trainer.post_window_solver=dpm2"))
    lengths = set()
    for step in range(8):
        t.step = step
        lengths.add(t.collect(step).chunks[0].num_steps)
    assert type(t).rollouts_per_step(t.tcfg)[2] == max(lengths) < 8
    assert (len(lengths) > 1) == (stride == 1)


def test_flash_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=mix_grpo",
                                          "trainer.window_size=2", "trainer.shift_interval=1",
                                          "trainer.post_window_solver=dpm2", "trainer.post_window_compress=0.5")


def test_the_flash_options_are_refused_where_they_are_not_read():
    with pytest.raises(UserError, match="post_window_solver=dpm2 compresses the authors' shifted grid"):
        trainer_config({"name": "mix_grpo", "post_window_solver": "dpm2", "sigma_grid": "model"})
    with pytest.raises(UserError, match="post_window_compress is read only with trainer.post_window_solver=dpm2"):
        trainer_config({"name": "mix_grpo", "post_window_compress": 0.2})
    assert trainer_config({"name": "mix_grpo", "window_stride": 0})[1].window_stride == 0
