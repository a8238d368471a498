"""DanceGRPO: a preset of Flow-GRPO (docs/methods/dance_grpo.md)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from flowalign.advantages import best_worst_mask, compute_advantages, group_advantages
from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.trainers import trainer_config
from flowalign.trainers.base import StepBatch
from flowalign.trainers.dance_grpo import DanceGRPOTrainer
from flowalign.trainers.flow_grpo import FlowGRPOTrainer
from flowalign.trainers.parts.best_worst import best_and_worst
from flowalign.trainers.parts.drawn_steps import drawn_steps, per_sample_batch

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


def _drawn(plan) -> dict[int, list[int]]:
    """The trained steps of each chunk in the plan's first optimiser step."""
    per_chunk: dict[int, list[int]] = {}
    for unit in plan.steps[0]:
        per_chunk.setdefault(unit.chunk, []).append(unit.k)
    return per_chunk


def test_shared_noise_dance_sde_and_a_random_subset_of_steps_per_sample(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=dance_grpo",
                                   "trainer.batch_size=2", "trainer.num_steps=5"))
    batch = t.collect(0)
    x_T = torch.cat([c.latents[:, 0] for c in batch.chunks])
    for g in torch.unique(batch.groups):
        members = x_T[batch.groups == g]
        assert all(torch.equal(members[0], m) for m in members)  # one x_T per group
    chunk = batch.chunks[0]
    assert chunk.sampler == "dance" and chunk.trained_steps() == [0, 1, 2, 3, 4]  # SDE on every step
    assert all(len(c) == 1 for c in batch.chunks) and len(batch.chunks) == len(batch.groups)  # one sample each
    per_sample = _drawn(t.plan(batch, torch.Generator().manual_seed(0)))
    assert len(per_sample) == int((batch.advantages != 0).sum())  # every sample with an advantage trains
    assert all(len(ks) == 2 for ks in per_sample.values())  # ⌊0.6·(5−1)⌋ steps per sample
    assert all(max(ks) < 4 for ks in per_sample.values())  # the step to σ = 0 is sampled, never trained
    assert len({tuple(ks) for ks in per_sample.values()}) > 1  # drawn per sample, not one fixed prefix


def test_per_batch_draw_shares_one_draw_across_a_rollout_batch(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=dance_grpo",
                                   "trainer.batch_size=2", "trainer.num_steps=5", "trainer.step_draw=per_batch"))
    batch = t.collect(0)
    assert all(len(c) == 2 for c in batch.chunks)
    per_chunk = _drawn(t.plan(batch, torch.Generator().manual_seed(0)))
    assert all(len(ks) == 2 and max(ks) < 4 for ks in per_chunk.values())
    assert len({tuple(ks) for ks in per_chunk.values()}) > 1  # drawn per batch, not one fixed prefix


def test_per_sample_batch_keeps_every_sample_and_its_advantage(tmp_path, tiny_sd3_dir, prompt_file):
    """Splitting a batch into one-sample chunks keeps the samples, their order and advantages."""
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=dance_grpo",
                                   "trainer.batch_size=2", "trainer.num_steps=3", "trainer.step_draw=per_batch"))
    batch = t.collect(0)
    split = per_sample_batch(batch)
    assert torch.equal(split.samples, batch.samples) and split.prompts == batch.prompts
    assert [len(c) for c in split.chunks] == [1] * len(batch.groups)
    assert all(torch.equal(a, b) for a, b in zip(split.per_chunk(split.advantages), batch.advantages.split(1)))
    assert split.chunk_keys() == [(int(g), m) for g, m in _members(batch.groups)]


def test_the_reference_means_prepared_while_scoring_are_the_plans_bit_for_bit(tmp_path, tiny_sd3_dir, prompt_file,
                                                                               monkeypatch):
    """With ``step_draw: per_sample`` the plan trains one-sample chunks; the KL reference means ``prepare``
    computes while the rewards are scored are computed on those chunks too, so each equals what the plan would
    compute in its place: how many were ready in time changes nothing (a rollout batch's forward rounds its rows
    otherwise than a one-sample forward)."""
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=dance_grpo",
                                   "trainer.beta=0.01", "trainer.num_steps=4"))
    prepare = t.prepare
    monkeypatch.setattr(t, "prepare", lambda batch, scored: prepare(batch, lambda: False))  # all, whatever the time
    batch = t.collect(0)
    assert batch.prepared and [len(c) for c in batch.chunks] == [1] * len(batch.groups)
    assert {i for i, _ in batch.prepared} == set(range(len(batch.chunks)))
    for (i, k), mean in batch.prepared.items():
        assert torch.equal(mean, t.kl_reference(batch.chunks[i], k))


def _members(groups: torch.Tensor) -> list[tuple[int, int]]:
    seen: dict[int, int] = {}
    out = []
    for g in groups.tolist():
        out.append((g, seen.get(g, 0)))
        seen[g] = out[-1][1] + 1
    return out


ADVANTAGES = json.loads((Path(__file__).parent / "known_answers" / "dance_grpo_advantages.json").read_text())


@pytest.mark.parametrize("case", ADVANTAGES["cases"], ids=range(len(ADVANTAGES["cases"])))
def test_advantages_equal_the_authors(case):
    """``advantage_std: unbiased`` is the authors' (r − mean)/(Tensor.std() + 1e-8) per group of consecutive
    samples (their ``--use_group``; known_answers/dance_grpo_advantages.json); the population std differs."""
    rewards = torch.tensor(case["rewards"], dtype=torch.float64)
    groups = torch.arange(len(rewards)) // case["num_generations"]
    assert case["use_group"]
    ours = group_advantages(rewards, groups, std="group", eps=1e-8, unbiased=True)
    expected = torch.tensor(case["advantages"], dtype=torch.float64)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-9)
    population = group_advantages(rewards, groups, std="group", eps=1e-8)
    if expected.abs().max() > 0:
        assert not torch.allclose(population, expected, rtol=1e-3)


def test_the_loops_advantages_take_the_unbiased_std(tmp_path, tiny_sd3_dir, prompt_file):
    """A collected batch's advantages are the authors' (unbiased std + 1e-8), not Flow-GRPO's population std."""
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=dance_grpo"))
    batch = t.collect(0)
    scores = batch.scores
    want = compute_advantages("group", scores.values, scores.weights, batch.prompt_ids, eps=1e-8, unbiased=True)
    torch.testing.assert_close(batch.advantages, want)
    population = compute_advantages("group", scores.values, scores.weights, batch.prompt_ids)
    assert not torch.allclose(batch.advantages, population, rtol=1e-3)


def test_the_trainer_passes_the_unbiased_std_to_the_loop():
    from flowalign.trainers.dance_grpo import DanceGRPOConfig
    t = DanceGRPOTrainer.__new__(DanceGRPOTrainer)
    t.tcfg = DanceGRPOConfig()
    assert t.advantage_options() == {"unbiased": True, "eps": 1e-8}
    t.tcfg = DanceGRPOConfig(advantage_std="population")
    assert t.advantage_options() == {}
    t.tcfg = DanceGRPOConfig(advantage="gdpo")  # another kind keeps its own normalisation
    assert t.advantage_options() == {}


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


def test_on_policy_ratio_is_exactly_one_per_batch_and_one_up_to_kernel_noise_per_sample(tmp_path, tiny_sd3_dir,
                                                                                          prompt_file):
    """``per_batch`` recomputes the rollout's own batch: ratio exactly 1 on a CPU. ``per_sample`` forwards one
    sample where the rollout forwarded its batch (as the authors' trainer does): 1 up to float kernels."""
    for draw in ("per_batch", "per_sample"):
        t = build_trainer(small_config(tmp_path / draw, tiny_sd3_dir, prompt_file, "trainer.name=dance_grpo",
                                       f"trainer.step_draw={draw}"))
        chunks = t.collect(0).chunks
        assert len(chunks[0]) == (1 if draw == "per_sample" else t.tcfg.batch_size)
        for k in chunks[0].trained_steps():
            with torch.no_grad():
                again = t.step_distribution(chunks[0], k, t.policy_velocity(chunks[0], k, True))
            if draw == "per_batch":
                assert torch.equal(again.log_prob, chunks[0].step(k)[2])
            else:
                assert (again.log_prob - chunks[0].step(k)[2]).abs().max() < 1e-4


@pytest.mark.parametrize("name, updates", [("dance_grpo", 1), ("dance_grpo", 2), ("pref_grpo", 2)])
def test_zero_advantage_samples_count_in_the_authors_divisor(tmp_path, tiny_sd3_dir, prompt_file, name, updates):
    """Counted (the default; Pref-GRPO's loop is DanceGRPO's), every unit of an optimiser step is divided by the authors'
    ``gradient_accumulation_steps × train_timesteps`` (the step's samples, zero-advantage ones included, × the
    drawn steps); only samples with an advantage run. Skipped, the divisor counts the running samples only."""
    plans, grads = {}, {}
    for mode in ("counted", "skipped"):
        t = build_trainer(small_config(tmp_path / mode, tiny_sd3_dir, prompt_file, f"trainer.name={name}",
                                       "trainer.batch_size=4", "trainer.num_steps=5",
                                       f"trainer.updates_per_epoch={updates}", f"trainer.zero_advantage={mode}"))
        batch = t.collect(0)
        n = len(batch.groups)
        advantages = torch.tensor([1.0, -1.0, 0.0, 0.0] * (n // 4) + [0.5] * (n % 4))  # half of them zero
        batch = dataclasses.replace(batch, advantages=advantages)
        plans[mode] = t.plan(batch, torch.Generator().manual_seed(0))
        params = [q for q in t.policy.trainable.parameters() if q.requires_grad]
        for unit in plans[mode].steps[0]:  # the loss divides by the unit's count: the first step's gradient
            t.loss(batch, unit)[0].backward()
        grads[mode] = torch.cat([q.grad.flatten() for q in params])
    active = int((advantages != 0).sum())
    per_sample = int(0.6 * (5 - 1))
    counted, skipped = plans["counted"].steps, plans["skipped"].steps
    assert len(counted) == updates
    assert all(u.of == n // updates * per_sample for step in counted for u in step)  # GA × train_timesteps
    for plan in (counted, skipped):  # the units that run: the samples with an advantage, each at its steps
        run = [u.chunk for step in plan for u in step]
        assert sorted(set(run)) == [i for i in range(n) if advantages[i] != 0] and len(run) == active * per_sample
    assert sum(u.of for step in skipped for u in step[:1]) == active * per_sample  # skipped: they alone count
    if updates == 1:  # one step holds every sample: counting the zero ones scales its gradient by active / n
        assert torch.allclose(grads["counted"], grads["skipped"] * active / n, rtol=1e-4, atol=1e-9)
        assert grads["counted"].abs().max() > 0


@pytest.mark.parametrize("mode", ["counted", "skipped"])
def test_a_step_of_zero_advantage_samples_only_steps_adamw_on_a_zero_gradient(tmp_path, tiny_sd3_dir, prompt_file, mode):
    """Counted, a batch whose groups all tie still takes its optimiser steps, as the authors' loop runs every
    sample and steps AdamW on the zero gradient: with its moments still zero, only the weight decay moves the
    weights, w·(1 − lr·wd) a step. Skipped (Flow-GRPO's filter), no step is taken."""
    t = build_trainer(small_config(tmp_path / mode, tiny_sd3_dir, prompt_file, "trainer.name=dance_grpo",
                                   f"trainer.zero_advantage={mode}", "trainer.updates_per_epoch=2",
                                   "trainer.weight_decay=0.5"))
    batch = t.collect(0)
    batch = dataclasses.replace(batch, advantages=torch.zeros_like(batch.advantages))
    before = [p.detach().clone() for p in t.params]
    logs = t.update(batch, torch.Generator().manual_seed(0))
    steps = 2 if mode == "counted" else 0
    assert [t.optimizer.state[p].get("step", 0) for p in t.params] == [steps] * len(t.params)
    shrink = (1 - t.optimizer.param_groups[0]["lr"] * 0.5) ** steps
    for p, b in zip(t.params, before):
        torch.testing.assert_close(p.detach(), b * shrink, rtol=1e-6, atol=0)
    assert logs.get("grad_norm", 0.0) == 0.0 and any(b.abs().max() > 0 for b in before)


def test_best_of_with_counted_zero_advantages_is_refused(tmp_path, tiny_sd3_dir, prompt_file):
    with pytest.raises(UserError, match="trainer.zero_advantage: skipped"):
        build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=dance_grpo",
                                   "trainer.best_of=2"))


def test_best_of_zeroes_the_middle_samples(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=dance_grpo",
                                   "trainer.best_of=2", "trainer.zero_advantage=skipped"))
    batch = t.collect(0)
    for g in torch.unique(batch.groups):
        assert int((batch.advantages[batch.groups == g] != 0).sum()) <= 2


def test_the_loss_is_flow_grpos(tmp_path, tiny_sd3_dir, prompt_file):
    """With Flow-GRPO's sampler, grid, timesteps and CFG gradient, dance_grpo's step equals flow_grpo's with the
    same trained-step draw (the last step deterministic in both, so both draw from the first T−1 steps)."""
    assert DanceGRPOTrainer.loss is FlowGRPOTrainer.loss and DanceGRPOTrainer.surrogate is FlowGRPOTrainer.surrogate
    common = ("trainer.max_steps=1", "trainer.noise_level=0.7", "trainer.shared_initial_noise=true",
              "trainer.num_steps=5", "trainer.sde_last_step=false",
              "trainer.advantage=group", "trainer.beta=0", "trainer.clip_range=1e-4")
    flow = trainer(tmp_path / "f", tiny_sd3_dir, prompt_file, *common, "trainer.timestep_fraction=1.0",
                   "trainer.steps_per_chunk=2")
    dance = trainer(tmp_path / "d", tiny_sd3_dir, prompt_file, *common, "trainer.name=dance_grpo",
                    "trainer.sampler=flow_grpo", "trainer.timestep_fraction=0.5", "trainer.step_draw=per_batch",
                    "trainer.advantage_std=population", "trainer.zero_advantage=skipped",
                    "trainer.sigma_grid=model", "trainer.model_timestep=continuous", "trainer.cfg_grad=detached")
    flow.train()
    dance.train()
    a, b = flow.trainable_state(), dance.trainable_state()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=dance_grpo")


SCHEDULE = json.loads((Path(__file__).parent / "known_answers" / "dance_grpo_schedule.json").read_text())


@pytest.mark.parametrize("case", SCHEDULE["grids"], ids=lambda c: f"{c['num_steps']}steps_shift{c['shift']:g}")
def test_the_shifted_grid_and_integer_timesteps_are_the_authors(case):
    """``sd3_time_shift(shift, linspace(1, 0, T + 1))`` bit for bit (float32), and what their transformer reads:
    ``int(1000·σ)``, FLUX that over 1000 (``known_answers/dance_grpo_schedule.json``)."""
    from flowalign.sampling.timesteps import shifted_grid, truncated

    grid = shifted_grid(case["num_steps"], case["shift"])
    assert grid.dtype == torch.float32 and grid.tolist() == case["sigmas"]
    # the pipelines' 1000·σ in float32, truncated: their int(sigma * 1000) of the float32 σ
    assert truncated(grid[:-1] * 1000).tolist() == [float(t) for t in case["timesteps"]]
    assert (truncated(grid[:-1] * 1000) / 1000).tolist() == case["flux_timesteps"]


@pytest.mark.parametrize("step", SCHEDULE["steps"], ids=lambda s: f"index{s['index']}")
def test_the_dance_sde_step_is_the_authors_flux_step(step):
    """The step's mean and log-prob equal their ``flux_step(..., sde_solver=True)`` (float32, rtol 1e-5)."""
    from flowalign.sampling import sde_step
    from flowalign.sampling.timesteps import shifted_grid

    inputs, k = SCHEDULE["inputs"], step["index"]
    sigmas = shifted_grid(16, 3.0)
    out = sde_step("dance", torch.tensor(inputs["model_output"]), torch.tensor(inputs["latents"]), sigmas[k].item(),
                   sigmas[k + 1].item(), noise_level=inputs["eta"], prev_sample=torch.tensor(step["prev_sample"]))
    torch.testing.assert_close(out.mean, torch.tensor(step["mean"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.log_prob, torch.tensor(step["log_prob"]), rtol=1e-5, atol=1e-5)


class ReadTimesteps:
    """Records the timestep the transformer's forward receives (after every pre-hook, the timestep form's too)."""

    def __init__(self, transformer: torch.nn.Module):
        self.transformer, self.seen = transformer, []
        forward = transformer.forward

        def recorded(*args, **kwargs):
            self.seen.extend(kwargs["timestep" if "timestep" in kwargs else "t"].flatten().tolist())
            return forward(*args, **kwargs)

        transformer.forward = recorded

    def remove(self) -> None:
        del self.transformer.forward


@pytest.mark.parametrize("name", ["dance_grpo", "pref_grpo", "mix_grpo"])
def test_rollouts_and_updates_read_the_authors_grid_and_integer_timesteps(name, tmp_path, tiny_sd3_dir, prompt_file):
    """By default (DanceGRPO's scripts, and Pref-GRPO's and MixGRPO's built on them) the rollouts sample on ``linspace(1, 0, T + 1)`` shifted
    by 3 and the transformer reads ``int(1000·σ)`` in the rollout, the KL reference and the update alike;
    ``sigma_grid: model`` with ``model_timestep: continuous`` (the former form) is the checkpoint's own grid read
    as ``1000·σ``."""
    from flowalign.sampling.timesteps import shifted_grid

    overrides = (f"trainer.name={name}", "trainer.batch_size=4", "trainer.num_steps=5", "trainer.beta=0.04")
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *overrides))
    handle = ReadTimesteps(t.policy.transformer)
    seen = handle.seen
    batch = t.collect(0)
    grid = shifted_grid(5, 3.0)
    assert all(torch.equal(c.sigmas, grid) for c in batch.chunks)
    ints = set(torch.trunc(grid[:-1] * 1000).tolist())
    assert set(seen) == ints  # every rollout forward
    seen.clear()
    plan = t.plan(batch, torch.Generator().manual_seed(0))
    unit = plan.steps[0][0]
    t.loss(batch, unit)
    handle.remove()
    assert seen and set(seen) <= ints and any(v != 1000 * grid[unit.k].item() for v in seen)

    former = build_trainer(small_config(tmp_path / "f", tiny_sd3_dir, prompt_file, *overrides,
                                        "trainer.sigma_grid=model", "trainer.model_timestep=continuous"))
    handle = ReadTimesteps(former.policy.transformer)
    seen = handle.seen
    chunk = former.collect(0).chunks[0]
    handle.remove()
    assert torch.equal(chunk.sigmas, former.policy.sigmas(5)) and not torch.equal(chunk.sigmas, grid)
    assert set(seen) == set((chunk.sigmas[:-1] * 1000).tolist())


def test_a_flux_rollout_reads_the_integer_timesteps_over_1000(tiny_flux_dir):
    """FLUX's transformer reads σ: on the authors' grid it reads ``int(1000·σ) / 1000``, their ``timesteps/1000``."""
    import pipelines
    from flowalign.sampling import rollout
    from flowalign.sampling.timesteps import ShiftedGrid, truncated

    policy = pipelines.load(tiny_flux_dir)
    read = ReadTimesteps(policy.transformer)
    out = rollout(policy, ["a red circle"], num_steps=4, sampler="dance", noise_level=0.3, grid=ShiftedGrid(3.0),
                  timestep_form=truncated, decode=False, generator=torch.Generator().manual_seed(0))
    read.remove()
    assert torch.equal(out.sigmas, ShiftedGrid(3.0)(4))
    # run_sample_step's timestep_value = int(sigma * 1000), torch.long, fed as timesteps / 1000
    theirs = (torch.tensor([int(s * 1000) for s in out.sigmas[:-1]], dtype=torch.long) / 1000).tolist()
    assert read.seen == theirs


def test_a_zimage_rollout_reads_one_minus_the_integer_timesteps_over_1000(tiny_model_dir):
    """Z-Image's transformer reads ``1 − σ``: on the authors' grid it reads ``1 − int(1000·σ) / 1000``, as
    Pref-GRPO's ``train_zimage.py`` (``timestep_input = 1.0 − timesteps / 1000.0``)."""
    import pipelines
    from flowalign.sampling import rollout
    from flowalign.sampling.timesteps import ShiftedGrid, truncated

    policy = pipelines.load(tiny_model_dir("zimage"))
    read = ReadTimesteps(policy.transformer)
    out = rollout(policy, ["a red circle"], num_steps=6, sampler="flow_grpo", noise_level=0.7, grid=ShiftedGrid(3.0),
                  timestep_form=truncated, decode=False, generator=torch.Generator().manual_seed(0))
    read.remove()
    per_call = read.seen[:: len(read.seen) // 6]  # one call a step (CFG's two rows read the same time)
    theirs = [1.0 - int(s * 1000) / 1000.0 for s in out.sigmas[:-1]]
    assert len(set(read.seen)) == 6 and per_call == pytest.approx(theirs, abs=1e-6)
    assert per_call != pytest.approx([1.0 - s for s in out.sigmas[:-1].tolist()], abs=1e-6)  # not the continuous σ


def test_a_shift_without_the_shifted_grid_is_refused():
    with pytest.raises(UserError, match="trainer.sigma_shift is read only with trainer.sigma_grid=shifted"):
        trainer_config({"name": "dance_grpo", "sigma_grid": "model", "sigma_shift": 5})
