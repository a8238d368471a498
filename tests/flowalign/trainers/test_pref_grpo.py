"""Pref-GRPO: advantages from within-group pairwise win rates (docs/methods/pref_grpo.md)."""

import json
import math
from pathlib import Path

import pytest
import torch

from flowalign.advantages import (
    compute_advantages,
    group_advantages,
    preference_win_rates,
    win_rates,
)
from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer, check_run
from flowalign.sampling.timesteps import model_timestep
from flowalign.trainers import trainer_config

from .conftest import small_config, small_run
from .resume_check import assert_trains_and_resumes_bit_exactly

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "pref_grpo_win_rate.json").read_text())


def _judge(outcomes: list[list[list[float | None]]]):
    """A pairwise judge replaying the fixture's verdicts: ``outcomes[g][i][j]`` (i < j) is 1 / 0 / ½ for image i
    better / worse / a tie answer, None for no verdict (a tie, as the authors count it); (j, i) is its mirror."""
    size = len(outcomes[0])

    def beats(a: int, b: int) -> float:
        g, i, j = a // size, a % size, b % size
        o = outcomes[g][min(i, j)][max(i, j)]
        o = 0.5 if o is None else o
        return o if i < j else 1.0 - o

    return beats


def _columns(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The case's reward components ``(N, M)`` in float64 (a judge's column: its unrounded win rates, as
    flowalign's pairwise judges report them; a score column: the scores), groups and judged flags."""
    size, judged = case["group_size"], case["judged"]
    n = len(case["win_rates"][0])
    groups = torch.arange(n) // size
    cols = []
    for m, is_judge in enumerate(judged):
        if is_judge:
            cols.append(win_rates(torch.zeros(n, dtype=torch.float64), groups, beats=_judge(case["outcomes"])))
        else:
            cols.append(torch.tensor([s[0] for s in case["scores"]], dtype=torch.float64))
    return torch.stack(cols, dim=1), groups, torch.tensor(judged)


@pytest.mark.parametrize("name", sorted(KNOWN["cases"]))
def test_win_rates_are_the_authors_on_fixed_verdicts_and_scores(name):
    """Each reward's win rates equal the authors' ``_pairwise_win_rate`` (each unordered pair once, a tie or a
    missing verdict ½ each, ``round(wins/compared, 3)``) at CodeGoat24/Pref-GRPO @ 3e787f6."""
    case = KNOWN["cases"][name]
    comps, groups, _ = _columns(case)
    for m, is_judge in enumerate(case["judged"]):
        beats = _judge(case["outcomes"]) if is_judge else None
        got = win_rates(comps[:, m], groups, beats=beats, decimals=3)
        torch.testing.assert_close(got, torch.tensor(case["win_rates"][m], dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("renormalise", [False, True])
@pytest.mark.parametrize("name", sorted(KNOWN["cases"]))
def test_advantages_are_the_authors_compute_weighted_advantages(name, renormalise):
    """``per_reward`` equals the authors' ``compute_weighted_advantages`` (``--use_group``; ``--apply_gdpo``
    off / on) clamped at ``adv_clip_max`` 5, in float64 at rtol 1e-6: each reward's rounded win rates normalised
    in its group (unbiased std + 1e-8), weighted after normalising (weight 4 gives 4x, clipped at 5), then
    renormalised over the batch. A score reward's column was handed to theirs as the win rates its scores give
    (``pointwise_rewards: win_rates``); their own code normalises a score reward's raw values, the default, checked
    in ``tests/rewards/test_unified_reward_flex_reference.py``."""
    case = KNOWN["cases"][name]
    comps, groups, judged = _columns(case)
    got = compute_advantages("win_rate", comps, torch.tensor(case["weights"], dtype=torch.float64), groups,
                             judged=judged, win_rate_normalisation="per_reward", batch_renormalise=renormalise,
                             pointwise_rewards="win_rates")
    want = case["advantages_batch_renormalised" if renormalise else "advantages"]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-12)


def test_the_former_weighted_sum_form_differs_from_the_authors():
    """The former form (weighted sum of unrounded win rates, population std + 1e-4, no batch step) is kept as
    an option; on the fixture it is not the authors' advantage, so the default had to change."""
    case = KNOWN["cases"]["judge_and_scores"]
    comps, groups, judged = _columns(case)
    former = compute_advantages("win_rate", comps, torch.tensor(case["weights"], dtype=torch.float64), groups,
                                judged=judged, win_rate_normalisation="weighted_sum")
    w = preference_win_rates(comps, torch.tensor(case["weights"]), groups, judged)
    torch.testing.assert_close(former, group_advantages(w, groups).clamp(-5, 5))
    assert (former - torch.tensor(case["advantages_batch_renormalised"])).abs().max() > 0.1


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


def test_the_batch_advantages_are_the_authors_form_by_default(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=pref_grpo"))
    assert t.tcfg.win_rate_normalisation == "per_reward" and t.tcfg.batch_renormalise
    batch = t.collect(0)
    want = compute_advantages("win_rate", batch.scores.values, batch.scores.weights, batch.prompt_ids,
                              win_rate_normalisation="per_reward", batch_renormalise=True)
    torch.testing.assert_close(batch.advantages, want)
    assert batch.advantages.std(unbiased=True).item() == pytest.approx(1.0, abs=1e-4)  # renormalised over the batch
    x_T = torch.cat([c.latents[:, 0] for c in batch.chunks])
    for g in torch.unique(batch.groups):  # the authors' shared initial noise per group
        assert all(torch.equal(x_T[batch.groups == g][0], m) for m in x_T[batch.groups == g])
    assert [len(c) for c in batch.chunks] == [1] * len(batch.groups)  # the authors' per-sample step draw
    chunk = batch.chunks[0]
    for k in t.trained_steps(chunk):  # on-policy ratio 1 (up to kernel noise: a one-sample forward)
        with torch.no_grad():
            again = t.step_distribution(chunk, k, t.policy_velocity(chunk, k, True))
        assert (again.log_prob - chunk.step(k)[2]).abs().max() < 1e-4
    t = build_trainer(small_config(tmp_path / "b", tiny_sd3_dir, prompt_file, "trainer.name=pref_grpo",
                                   "trainer.step_draw=per_batch"))
    chunk = t.collect(0).chunks[0]
    for k in t.trained_steps(chunk):  # per_batch recomputes the rollout's own batch: exactly 1
        with torch.no_grad():
            again = t.step_distribution(chunk, k, t.policy_velocity(chunk, k, True))
        assert len(chunk) == t.tcfg.batch_size and torch.equal(again.log_prob, chunk.step(k)[2])


def test_the_former_form_is_an_option(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=pref_grpo",
                                   "trainer.win_rate_normalisation=weighted_sum", "trainer.batch_renormalise=false"))
    batch = t.collect(0)
    w = preference_win_rates(batch.scores.values, batch.scores.weights, batch.prompt_ids)
    torch.testing.assert_close(batch.advantages, group_advantages(w, batch.prompt_ids).clamp(-5, 5))


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


def test_trains_and_resumes_bit_exactly_with_the_adaptive_kl_weight(tmp_path, tiny_sd3_dir, prompt_file):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=pref_grpo",
                                          "trainer.beta=0.004", "trainer.kl_adaptive=true", "trainer.kl_target=1e-6",
                                          "trainer.kl_horizon=2")


RATIONORM = json.loads((Path(__file__).parent / "known_answers" / "pref_grpo_rationorm.json").read_text())


@pytest.mark.parametrize("case", RATIONORM["cases"], ids=lambda c: f"step{c['index']}_adv{c['advantages'][0]:g}")
def test_the_normalised_ratio_and_loss_are_their_rationorm(case):
    """Their ``--rationorm`` (on in every recipe of theirs): GRPO-Guard's ratio with each sample's own shift, the
    surrogate's batch mean divided by the σ gap (``known_answers/pref_grpo_rationorm.json``, float32)."""
    from flowalign.sampling import sde_step
    from flowalign.trainers.parts.ratio_norm import guard_clip_loss, guard_ratio

    inputs, k = RATIONORM["inputs"], case["index"]
    sigmas = torch.tensor(inputs["sigmas"])
    x, prev = torch.tensor(inputs["x"]), torch.tensor(case["prev_sample"])
    step = [sde_step("flow_grpo", torch.tensor(inputs[v]), x, sigmas[k].item(), sigmas[k + 1].item(),
                     noise_level=inputs["eta"], prev_sample=prev) for v in ("v_new", "v_old")]
    new, old = step
    tcfg = trainer_config({"name": "pref_grpo"})[1]
    assert (tcfg.ratio_norm, tcfg.ratio_bias, tcfg.reweight) == (True, "sample", True)
    ratio = guard_ratio(new.log_prob, old.log_prob, new.mean, old.mean, new.std.flatten(1)[:, 0], tcfg.ratio_bias)
    torch.testing.assert_close(ratio, torch.tensor(case["ratio"]), rtol=1e-5, atol=1e-6)
    per_sample, _ = guard_clip_loss(ratio, torch.tensor(case["advantages"]), inputs["clip_range"],
                                    1.0 / (sigmas[k] - sigmas[k + 1]).item())
    assert per_sample.mean().item() == pytest.approx(case["policy_loss"], rel=1e-5)
    if k:  # at σ = 1 the step's τ is small enough that both reductions give r̃ within 1e-6 of 1
        batch_bias = guard_ratio(new.log_prob, old.log_prob, new.mean, old.mean, new.std.flatten(1)[:, 0], "batch")
        assert not torch.allclose(batch_bias, ratio, rtol=1e-6)  # the reduction the known answers tell apart


def test_the_default_update_trains_on_the_normalised_ratio(tmp_path, tiny_sd3_dir, prompt_file):
    """Rollouts keep their velocities (the old step means) and the update reads them; the former form (plain
    ratio, no 1/h) keeps none."""
    common = ("trainer.name=pref_grpo", "trainer.batch_size=4", "trainer.num_steps=4")
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *common))
    batch = t.collect(0)
    assert all(c.velocities is not None for c in batch.chunks)
    plan = t.plan(batch, torch.Generator().manual_seed(0))
    loss, info = t.loss(batch, plan.steps[0][0])
    assert torch.isfinite(loss)
    former = build_trainer(small_config(tmp_path / "f", tiny_sd3_dir, prompt_file, *common,
                                        "trainer.ratio_norm=false", "trainer.reweight=false"))
    assert all(c.velocities is None for c in former.collect(0).chunks)


ADAPTIVE = json.loads((Path(__file__).parent / "known_answers" / "pref_grpo_adaptive_kl.json").read_text())


@pytest.mark.parametrize("case", ADAPTIVE["kl"]["cases"], ids=lambda c: f"step{c['index']}")
def test_the_kl_term_is_their_compute_kl_loss(case):
    """With beta > 0 their scripts add ``compute_kl_loss``: mean_D Δμ²/(2τ²) with τ the step's noise, averaged over
    the batch (``kl_mode: mean``, the default); Flow-GRPO's coded KL (``code``, the former form) is that times h."""
    from flowalign.sampling import sde_step
    from flowalign.sampling.timesteps import shifted_grid
    from flowalign.trainers.flow_grpo import coded_kl_gap, gaussian_mean_kl

    kl = ADAPTIVE["kl"]
    sigmas = shifted_grid(kl["steps"], kl["sigma_shift"])
    k, x = case["index"], torch.tensor(case["latents"])
    assert sigmas[k].item() == pytest.approx(case["sigma"]) and sigmas[k + 1].item() == pytest.approx(case["sigma_next"])
    new, ref = (sde_step("flow_grpo", torch.tensor(case[v]), x, sigmas[k].item(), sigmas[k + 1].item(),
                         noise_level=kl["eta"]) for v in ("velocity", "reference_velocity"))
    assert new.std.flatten()[0].item() == pytest.approx(case["noise_scale"], rel=1e-6)
    tcfg = trainer_config({"name": "pref_grpo", "beta": 0.004})[1]
    assert tcfg.kl_mode == "mean"
    per_sample = gaussian_mean_kl(new.mean, ref.mean, new.std, 1.0, tcfg.kl_mode)
    torch.testing.assert_close(per_sample, torch.tensor(case["per_sample"]), rtol=1e-4, atol=1e-12)
    assert per_sample.mean().item() == pytest.approx(case["kl_loss"], rel=1e-4)
    gap = coded_kl_gap("flow_grpo", sigmas[k].item(), sigmas[k + 1].item())
    coded = gaussian_mean_kl(new.mean, ref.mean, new.std, gap, "code")
    assert coded.mean().item() == pytest.approx(case["kl_loss"] * gap, rel=1e-4)  # the former form, h times smaller


@pytest.mark.parametrize("run", ADAPTIVE["controller"]["runs"], ids=("their_wan_recipe", "wide"))
def test_the_adaptive_kl_weight_follows_their_controller(run):
    from flowalign.trainers.parts.adaptive_kl import next_kl_weight

    s = run["settings"]
    tcfg = trainer_config({"name": "pref_grpo", "beta": s["init_beta"], "kl_adaptive": True, "kl_target": s["target"],
                           "kl_horizon": s["horizon"], "kl_ema_alpha": s["ema_alpha"], "kl_beta_min": s["beta_min"],
                           "kl_beta_max": s["beta_max"]})[1]
    beta, average, betas = tcfg.beta, None, []
    for kl in ADAPTIVE["controller"]["kls"]:
        beta, average = next_kl_weight(beta, average, kl, tcfg)
        betas.append(beta)
    assert betas == pytest.approx(run["betas"], rel=1e-12)


def test_the_adaptive_weight_moves_the_loss_and_resumes(tmp_path, tiny_sd3_dir, prompt_file):
    """A step's logged KL moves β (logged ``kl_beta``), the next step's loss weighs the KL by it, and the trainer's
    saved state carries β and the average."""
    common = ("trainer.name=pref_grpo", "trainer.batch_size=4", "trainer.num_steps=4", "trainer.beta=0.004",
              "trainer.kl_adaptive=true", "trainer.kl_target=1e-9", "trainer.kl_horizon=1")
    t = build_trainer(small_config(tmp_path / "a", tiny_sd3_dir, prompt_file, *common))
    assert t.kl_coefficient() == 0.004
    logs = t.finish(None, [{"kl": [2e-9, 4e-9]}])
    assert logs["kl_beta"] == pytest.approx(0.004 * math.exp((3e-9 - 1e-9) / 1e-9))  # e = 3e-9 on the first step
    assert t.kl_coefficient() == logs["kl_beta"]
    with torch.no_grad():  # move the policy off the reference, so the KL is not 0
        for p in t.policy.trainable.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    batch = t.collect(0)
    unit = t.plan(batch, torch.Generator().manual_seed(0)).steps[0][0]
    loss, info = t.loss(batch, unit)
    t.kl_weight *= 3
    tripled, _ = t.loss(batch, unit)
    assert info["kl"] > 0
    # float32 losses: their difference is good to about 1e-3 of itself
    assert (tripled - loss).item() == pytest.approx(2 * logs["kl_beta"] * info["kl"].item() / unit.of, rel=1e-2)
    t.kl_weight /= 3
    state = t.state_dict()
    again = build_trainer(small_config(tmp_path / "b", tiny_sd3_dir, prompt_file, *common))
    again.load_state_dict(state)
    assert (again.kl_coefficient(), again.kl_average) == (t.kl_coefficient(), t.kl_average)
    with pytest.raises(UserError, match="trainer.kl_target set the adaptive KL controller, which is off"):
        trainer_config({"name": "pref_grpo", "beta": 0.004, "kl_target": 0.1})
    with pytest.raises(UserError, match="kl_adaptive moves the KL weight from trainer.beta, which is 0 here"):
        trainer_config({"name": "pref_grpo", "kl_adaptive": True})


def test_pref_grpo_trains_an_editing_model_with_the_edit_judge(tmp_path):
    """Pref-GRPO's editing recipes in small: the tiny Kontext editor on vvr_edit's scenes, the (tiny, random)
    UnifiedReward judging each source's edits in pairs (the source and two edits a request), beside a pixel reward
    so that the update runs; the judge sees every sample's source."""
    from flowalign.paths import assets_dir
    from flowalign.train import train

    run = tmp_path / "run"
    judge = assets_dir() / "tiny-rewards" / "unified_reward"
    cfg = load_config(None, [
        f"run.output_dir={run}", f"model.path={assets_dir() / 'tiny-kontext-vvr-edit'}", "model.lora.rank=4",
        "data.bench=vvr_edit", "data.level=[easy]", "data.n=20", "eval.bench=null", "run.progress=false",
        "run.tensorboard=false",
        f"rewards=[{{name: unified_reward, weight: 1.0, path: '{judge}', mode: edit_pairwise, dtype: float32, "
        "max_tokens: 16}, {name: jpeg_compressibility, weight: 0.5}]",
        "trainer.name=pref_grpo", "trainer.max_steps=1", "trainer.prompts_per_step=1", "trainer.group_size=3",
        "trainer.batch_size=3", "trainer.num_steps=4",
    ])
    train(cfg)
    (metrics,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics["reward/unified_reward"] == 0.5  # the tiny judge's reply names no winner: ties
    assert metrics["reward/unified_reward_invalid_fraction"] == 0.0 and "train/policy_loss" in metrics


@pytest.mark.parametrize("name", ["pref_grpo", "dance_grpo"])
def test_the_update_backpropagates_through_both_cfg_branches_as_their_grpo_one_step(tmp_path, tiny_sd3_dir,
                                                                                     prompt_file, name):
    """Their ``grpo_one_step`` runs CFG's ``[cond; uncond]`` pass with its gradient (the Wan, FLUX.2 klein, Z-Image
    scripts): ``cfg_grad: full`` by default; ``detached`` (Flow-GRPO's, the conditional branch only) the former."""
    from flowalign.trainers.flow_grpo import guided_velocity

    t = build_trainer(small_config(tmp_path / name, tiny_sd3_dir, prompt_file, f"trainer.name={name}",
                                   "trainer.batch_size=4", "trainer.num_steps=4"))
    assert t.tcfg.cfg_grad == "full"
    chunk = t.collect(0).chunks[0]
    assert chunk.guidance_scale > 1 and chunk.unconditional_velocities is None  # nothing detached to keep
    k = 1
    probe = torch.randn(chunk.latents[:, k].shape, generator=torch.Generator().manual_seed(0))

    def grads(velocity):
        t.optimizer.zero_grad(set_to_none=True)
        (velocity() * probe).sum().backward()
        return [p.grad.clone() for p in t.params]

    ours = grads(lambda: t.policy_velocity(chunk, k, True))
    x, sigma, w = chunk.latents[:, k], chunk.sigmas[k].item(), chunk.guidance_scale
    with model_timestep(t.policy, t.timestep_form, sigma):
        full = grads(lambda: guided_velocity(t.policy, x, sigma, chunk.cond, w, "full"))
        detached = grads(lambda: guided_velocity(t.policy, x, sigma, chunk.cond, w, "detached"))
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(ours, full))
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(ours, detached))
