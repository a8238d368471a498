"""Flash-GRPO: iso-temporal groups and temporal gradient rectification (docs/methods/flow_grpo.md)."""

import torch

from flowalign.sampling import flow_sde_step
from flowalign.train import build_trainer
from flowalign.trainers.flash_grpo import flash_diffusion, rectification_coefficient

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
    assert abs(t.sample_weights(batch).mean().item() - 1.0) < 1e-6


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
