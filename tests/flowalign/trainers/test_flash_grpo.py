"""Flash-GRPO: iso-temporal groups and temporal gradient rectification (docs/methods/flash_grpo.md)."""

import json
import math
from pathlib import Path

import pydantic
import pytest
import torch

from flowalign.sampling import flow_sde_step
from flowalign.train import build_trainer
from flowalign.trainers.flash_grpo import (
    FlashGRPOConfig,
    FlashStep,
    flash_diffusion,
    inverse_rectification,
    rectification_coefficient,
)
from flowalign.trainers.parts.policy_gradient import ppo_clip_loss

from .conftest import small_config


def _trainer(tmp_path, model, prompts, *extra):
    return build_trainer(small_config(tmp_path / "run", model, prompts, "trainer.name=flash_grpo",
                                      "trainer.num_steps=12", "trainer.prompts_per_step=4", *extra))


def test_group_members_share_one_sde_step_and_mean_weight_is_one(tmp_path, tiny_sd3_dir, prompt_file):
    t = _trainer(tmp_path, tiny_sd3_dir, prompt_file, "trainer.batch_size=2")
    batch = t.collect(0)
    ks = {}
    for chunk, gids in zip(batch.chunks, batch.per_chunk(batch.groups)):
        (k,) = chunk.trained_steps()  # one SDE step per rollout, the one trained
        assert 0 <= k < 6
        for gid in gids.tolist():
            ks.setdefault(gid, set()).add(k)
    assert all(len(v) == 1 for v in ks.values()) and len(ks) == 4  # one k per group, across its batches


def test_omega_averages_one_within_each_optimiser_step_or_over_the_batch(tmp_path, tiny_sd3_dir, prompt_file):
    """``rectify_mean: step`` (the authors' per micro-batch, one optimiser step in their recipe): within each
    optimiser step, ω ∝ 1/c_k of the unit's step and its mean over the step's samples with an advantage is 1;
    ``batch``: ω is the same 1/c_k divided by the whole batch's mean."""
    import dataclasses

    t = _trainer(tmp_path, tiny_sd3_dir, prompt_file, "trainer.batch_size=2", "trainer.updates_per_epoch=2")
    batch = t.collect(0)
    advantages = torch.linspace(-1, 1, len(batch.advantages))
    advantages[advantages == 0] = 0.5
    advantages[:2] = 0.0  # one rollout batch without an advantage: not in any step, nor in its mean
    batch = dataclasses.replace(batch, advantages=advantages)
    inv_c = batch.per_chunk(t.inverse_rectifications(batch))
    plan = t.plan(batch, torch.Generator().manual_seed(0))
    assert len(plan.steps) == 2 and all(plan.steps)
    step_means = []
    for units in plan.steps:
        weights = torch.cat([u.weight for u in units])
        assert weights.mean().item() == pytest.approx(1.0, abs=1e-6)
        ratios = {round((u.weight / inv_c[u.chunk]).unique().item(), 9) for u in units}
        assert len(ratios) == 1  # one normaliser a step: ω ∝ 1/c_k
        step_means.append(1 / ratios.pop())
    assert step_means[0] != pytest.approx(step_means[1], rel=1e-4)  # the two steps' k differ: so do their means
    t.tcfg = t.tcfg.model_copy(update={"rectify_mean": "batch"})
    omega = t.sample_weights(batch)
    assert omega.mean().item() == pytest.approx(1.0, abs=1e-6)
    by_chunk = batch.per_chunk(omega)
    assert all(torch.equal(u.weight, by_chunk[u.chunk]) for units in t.plan(batch, torch.Generator().manual_seed(0)).steps
               for u in units)


def test_rectification_coefficient_is_the_velocity_gain_of_the_step(tiny_sd3_dir):
    import pipelines

    sigmas = pipelines.load(tiny_sd3_dir).sigmas(20).float()
    for k in range(10):
        sigma, sigma_next = sigmas[k].item(), sigmas[k + 1].item()
        x, v = torch.zeros(1, 1), torch.zeros(1, 1, requires_grad=True)
        out = flow_sde_step(v, x, sigma, sigma_next, diffusion=flash_diffusion(sigmas, k))
        (gamma,) = torch.autograd.grad(out.mean.sum(), v)
        expected = gamma.abs().item() / out.std.item()
        assert abs(rectification_coefficient(sigmas, k) - expected) < 1e-4 * expected


def test_rectified_per_timestep_gradients_are_flat(tiny_sd3_dir):
    """|∂ℓ/∂v| ∝ c_k: weighting by 1/c_k makes the gradient scale the same at every k."""
    import pipelines

    sigmas = pipelines.load(tiny_sd3_dir).sigmas(20).float()
    xi = torch.randn(1, 256, generator=torch.Generator().manual_seed(0))
    raw, rectified = [], []
    for k in range(10):
        sigma, sigma_next = sigmas[k].item(), sigmas[k + 1].item()
        s = flash_diffusion(sigmas, k)
        x, v = torch.randn(1, 256), torch.zeros(1, 256, requires_grad=True)
        mean = flow_sde_step(v.detach(), x, sigma, sigma_next, diffusion=s).mean
        std = s * (sigma - sigma_next) ** 0.5
        out = flow_sde_step(v, x, sigma, sigma_next, diffusion=s, prev_sample=mean + std * xi)
        (g,) = torch.autograd.grad(out.log_prob.sum(), v)
        raw.append(g.norm().item())
        rectified.append(g.norm().item() / rectification_coefficient(sigmas, k))
    assert max(raw) / min(raw) > 2  # without rectification the scales differ a lot across k
    assert max(rectified) / min(rectified) < 1.0001


KNOWN = json.loads((Path(__file__).parent / "known_answers" / "flash_grpo_rectified_loss.json").read_text())


def test_step_noise_rectification_and_loss_equal_the_authors():
    """``sde_step_with_logprob`` on Wan 2.1's 20-step grid and the rectified loss lines (known_answers/): the
    noise ``s_k``, ``1/c_k`` (their ``coe``, or their table with ``rectify_source: wan_table``), the step's
    log-prob (float32, as flowalign's steps run) and the micro-batch loss with ω = (1/c)/mean(1/c) (float64)."""
    sigmas = torch.tensor(KNOWN["sigmas"], dtype=torch.float64)
    for case in KNOWN["steps"]:
        k = case["step"]
        assert math.isclose(flash_diffusion(sigmas, k), case["std_dev_t"], rel_tol=1e-6)
        assert math.isclose(inverse_rectification(sigmas, k), case["coe"], rel_tol=1e-6)
        assert inverse_rectification(sigmas, k, "wan_table") == KNOWN["value_table"][k]
        assert abs(KNOWN["value_table"][k] / case["coe"] - 1) < 2.5e-3  # the table is within 0.25 % of coe
    b = KNOWN["batch"]
    x, v_old, v, x_next = (torch.tensor(b[n], dtype=torch.float64) for n in ("sample", "velocity_old", "velocity",
                                                                               "prev_sample"))
    for i, k in enumerate(b["steps"]):
        step = FlashStep(flash_diffusion(sigmas, k))
        for velocity, name in ((v_old, "old_log_prob"), (v, "log_prob")):
            out = step(velocity[i:i + 1], x[i:i + 1], sigmas[k].item(), sigmas[k + 1].item(), None, x_next[i:i + 1])
            assert math.isclose(out.log_prob.item(), b[name][i], rel_tol=1e-5)
    lp, old, adv = (torch.tensor(b[n], dtype=torch.float64) for n in ("log_prob", "old_log_prob", "advantages"))
    for source, expected in (("wan_table", b["loss"]), ("grid", b["loss_with_coe"])):
        inv_c = torch.tensor([inverse_rectification(sigmas, k, source) for k in b["steps"]], dtype=torch.float64)
        per_sample, ratio, clipped = ppo_clip_loss(lp, old, adv, b["clip_range"], inv_c / inv_c.mean())
        torch.testing.assert_close(ratio, torch.tensor(b["ratio"], dtype=torch.float64), rtol=1e-9, atol=0)
        assert clipped.any() and not clipped.all()
        assert math.isclose(per_sample.mean().item(), expected, rel_tol=1e-6)


def test_the_authors_table_is_refused_off_its_grid():
    assert FlashGRPOConfig(rectify_source="wan_table").num_steps == 20
    with pytest.raises(pydantic.ValidationError, match="rectify_source=wan_table"):
        FlashGRPOConfig(rectify_source="wan_table", num_steps=12)
