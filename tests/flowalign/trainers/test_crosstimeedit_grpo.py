"""CrossTimeEdit's Stage-2 loop against the authors' code (docs/methods/crosstimeedit.md): the velocity KL
(``kl_mode: velocity``) against the v-based KL lines of their ``GRPOTrainer.optimize``, and the one SDE step a
training step (``sde_window: 1``, ``sde_window_range: [1, 4]``, ``sde_window_draw: per_step``) against their
scheduler's draw, each kept in known_answers/ as numbers."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.sampling import Rollout
from flowalign.sampling.windows import shared_window_start
from flowalign.train import build_trainer
from flowalign.trainers import trainer_config
from flowalign.trainers.flow_grpo import FlowGRPOConfig, FlowGRPOTrainer, StepUnit, velocity_kl
from flowalign.trainers.rollouts import StepBatch

from .conftest import REPO, small_config

ANSWERS = Path(__file__).parent / "known_answers"
KL = json.loads((ANSWERS / "crosstimeedit_velocity_kl.json").read_text())
DRAW = json.loads((ANSWERS / "crosstimeedit_sde_step_draw.json").read_text())
RECIPE = REPO / "configs" / "flux.2-klein" / "crosstimeedit_grpo.yaml"


def test_velocity_kl_per_sample_is_the_authors_kl_div():
    """Their ``kl_div`` of a micro-batch of one sample (their ``per_device_batch_size`` 1): the mean over every
    element of (v − v_ref)², not a sum, not the step means' KL."""
    v, v_ref = torch.tensor(KL["velocity"]), torch.tensor(KL["velocity_ref"])
    torch.testing.assert_close(velocity_kl(v, v_ref), torch.tensor(KL["kl_div_per_sample"]), rtol=1e-6, atol=0)
    # the same on the latent layout a policy returns (B, C, H, W): the mean does not depend on the shape
    torch.testing.assert_close(velocity_kl(v.reshape(3, 3, 2, 2), v_ref.reshape(3, 3, 2, 2)),
                               torch.tensor(KL["kl_div_per_sample"]), rtol=1e-6, atol=0)


def _unit_loss(beta: float, v: torch.Tensor, v_ref: torch.Tensor, kl_mode: str = "velocity"):
    """Flow-GRPO's loss of one unit (the three samples at step 1 of a 4-step rollout) with the policy's
    velocity fixed to ``v`` and the plan's reference to ``v_ref``."""
    trainer = FlowGRPOTrainer.__new__(FlowGRPOTrainer)
    trainer.tcfg = FlowGRPOConfig(kl_mode=kl_mode, beta=beta, clip_range=1e-3, noise_level=0.7)
    trainer.policy_velocity = lambda chunk, k, sampling_weights: v
    g = torch.Generator().manual_seed(1)
    n, shape = v.shape[0], v.shape[1:]
    chunk = Rollout(prompts=["p"] * n, metadata=[{}] * n, latents=torch.randn(n, 5, *shape, generator=g),
                    sigmas=torch.tensor([1.0, 0.8, 0.55, 0.3, 0.0]), log_probs=torch.zeros(n, 4),
                    sde_mask=torch.ones(4, dtype=torch.bool), samples=None, cond=None, sampler="flow_grpo",
                    noise_level=0.7)
    batch = StepBatch(chunks=[chunk], groups=torch.zeros(n, dtype=torch.long),
                      advantages=torch.tensor([0.8, -1.3, 0.5]))
    return trainer.loss(batch, StepUnit(0, 1, 1, 0, reference=v_ref))


def test_the_losss_kl_term_and_its_gradient_are_the_authors_kl_loss():
    """Through ``FlowGRPOTrainer.loss``: with ``kl_mode: velocity`` the loss minus its β = 0 value is their
    ``kl_loss = kl_beta · mean_batch mean_D (v − v_ref)²`` (β 2e-3, theirs), the logged ``kl`` their ``kl_div``,
    and its gradient in the velocity theirs (the reference carries none)."""
    v_ref = torch.tensor(KL["velocity_ref"])
    v = torch.tensor(KL["velocity"]).requires_grad_(True)
    with_kl, info = _unit_loss(KL["kl_beta"], v, v_ref)
    without, _ = _unit_loss(0.0, v, v_ref)
    term = with_kl - without
    torch.testing.assert_close(term, torch.tensor(KL["kl_loss_batch"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(info["kl"], torch.tensor(KL["kl_div_batch"]), rtol=1e-6, atol=0)
    (grad,) = torch.autograd.grad(term, v)
    torch.testing.assert_close(grad, torch.tensor(KL["kl_loss_grad"]), rtol=1e-4, atol=1e-10)
    # kl_mode code (the default) is another quantity on the same tensors: the step means' coded KL
    code_kl = _unit_loss(KL["kl_beta"], v, v_ref, "code")[1]["kl"]
    assert not torch.allclose(code_kl, torch.tensor(KL["kl_div_batch"]), rtol=1e-2)
    assert FlowGRPOConfig().kl_mode == "code"


def test_the_loop_compares_the_policys_velocity_with_the_references(tmp_path, tiny_sd3_dir, prompt_file):
    """On the tiny SD3 model with CFG: the plan's reference under ``kl_mode: velocity`` is the adapter-disabled
    guided velocity at the rollout's x_k, and the loss's ``kl`` is mean_D (v_θ − v_ref)² over the chunk's
    samples; under ``code`` the plan keeps the reference's step mean, as before."""
    t = build_trainer(small_config(tmp_path / "v", tiny_sd3_dir, prompt_file, "trainer.beta=0.002",
                                   "trainer.kl_mode=velocity"))
    with torch.no_grad():
        for p in t.params:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    prompts, metadata, groups = t.step_prompts(0)
    batch = t.sample(prompts, metadata, groups)
    batch.advantages = torch.linspace(-1, 1, len(batch.groups))
    chunk, k = batch.chunks[0], 1
    x_k, sigma = chunk.step(k)[0], chunk.sigmas[k].item()
    with torch.no_grad():
        with t.policy.adapter_disabled():
            v_ref = t.policy.velocity(x_k, sigma, chunk.cond, chunk.guidance_scale)
        v = t.policy.velocity(x_k, sigma, chunk.cond, chunk.guidance_scale)
    assert chunk.guidance_scale > 1
    torch.testing.assert_close(t.kl_reference(chunk, k), v_ref)
    unit = next(u for step in t.plan(batch, torch.Generator().manual_seed(0)).steps for u in step
                if u.chunk == 0 and u.k == k)
    torch.testing.assert_close(unit.reference, v_ref)
    _, info = t.loss(batch, unit)
    expected = ((v - v_ref) ** 2).flatten(1).mean(1)
    active = batch.per_chunk(batch.advantages)[0] != 0
    torch.testing.assert_close(info["kl"], expected[active].mean(), rtol=1e-4, atol=1e-9)
    assert info["kl"] > 0
    t.tcfg = t.tcfg.model_copy(update={"kl_mode": "code"})
    torch.testing.assert_close(t.kl_reference(chunk, k), t.reference_mean(chunk, k))


@pytest.mark.parametrize("seed", sorted(DRAW["train_timesteps_by_seed"]))
def test_the_per_step_window_is_the_authors_scheduler_draw(seed):
    """``sde_window_draw: per_step`` with ``sde_window_range: [1, 4]`` at width 1 draws, at step s, the step their
    scheduler trains at epoch s (``set_seed(epoch + seed)``, ``sde_steps [1, 2, 3]``, ``num_sde_steps 1``), for
    every prompt group alike."""
    theirs = [steps[0] for steps in DRAW["train_timesteps_by_seed"][seed]]
    low, high = DRAW["sde_steps"][0], DRAW["sde_steps"][-1] + 1
    t = DRAW["num_inference_steps"]
    assert [shared_window_start(t, 1, int(seed) + s, low, high) for s in range(len(theirs))] == theirs
    trainer = FlowGRPOTrainer.__new__(FlowGRPOTrainer)
    trainer.cfg = SimpleNamespace(run=SimpleNamespace(seed=int(seed)))
    trainer.optimisation = SimpleNamespace(step=0)
    trainer.tcfg = FlowGRPOConfig(num_steps=t, sde_window=1, sde_window_range=(low, high), sde_window_draw="per_step")
    for step, k in enumerate(theirs):
        trainer.step = step
        assert {trainer.sampling(group).sde_window for group in range(6)} == {(k, 1)}
    # the default draw, per prompt group, keeps to the range but differs between groups
    trainer.tcfg = FlowGRPOConfig(num_steps=t, sde_window=1, sde_window_range=(low, high))
    trainer.step = 0
    starts = {trainer.sampling(group).sde_window[0] for group in range(12)}
    assert starts == {1, 2, 3}


def test_one_sde_step_shared_by_every_rollout_of_the_step(tmp_path, tiny_sd3_dir, prompt_file):
    """In the loop: every chunk of the step is stochastic (and trained) at the one drawn step only."""
    t = build_trainer(small_config(tmp_path / "w", tiny_sd3_dir, prompt_file, "trainer.num_steps=10",
                                   "trainer.sde_window=1", "trainer.sde_window_range=[1, 4]",
                                   "trainer.sde_window_draw=per_step", "trainer.batch_size=2"))
    for step in (0, 3):
        t.step = step
        prompts, metadata, groups = t.step_prompts(step)
        chunks = t.sample(prompts, metadata, groups).chunks
        assert len(chunks) == 4
        k = shared_window_start(10, 1, t.cfg.run.seed + step, 1, 4)
        assert all(t.trained_steps(c) == c.trained_steps() == [k] for c in chunks)


@pytest.mark.parametrize("overrides,needle", [
    (["trainer.sde_window_range=[1, 4]"], "trainer.sde_window_range=[1, 4] places an SDE window"),
    (["trainer.sde_window=2", "trainer.sde_window_range=[1, 2]"], "trainer.sde_window_range=[1, 2]: give low"),
    (["trainer.sde_window=1", "trainer.sde_window_range=[5, 10]"], "trainer.sde_window_range=[5, 10]: give low"),
    (["trainer.sde_window=1", "trainer.sde_window_range=[-1, 4]"], "trainer.sde_window_range.0"),
    (["trainer.sde_window_draw=per_step"], "trainer.sde_window_draw=per_step draws an SDE window"),
    (["trainer.sde_window=1", "trainer.sde_window_draw=once"], "trainer.sde_window_draw: Input should be"),
    (["trainer.kl_mode=v-based"], "trainer.kl_mode: Input should be"),
    (["trainer.name=tempflow_grpo", "trainer.kl_mode=velocity"], "trainer.kl_mode: Input should be 'code' or 'exact'"),
    (["trainer.name=gardo", "trainer.kl_mode=velocity"], "trainer.kl_mode: Input should be 'code' or 'exact'"),
])
def test_bad_settings_are_refused_in_one_line_naming_the_field(overrides, needle):
    with pytest.raises(UserError) as err:
        trainer_config(load_config(None, overrides).trainer)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_klein_recipe_sets_the_authors_kl_and_step_draw():
    """configs/flux.2-klein/crosstimeedit_grpo.yaml: their v-based KL at β 2e-3 and one SDE step a step drawn
    from steps 1-3 for the whole batch."""
    section = yaml.safe_load(RECIPE.read_text())["trainer"]
    _, tcfg = trainer_config(section)
    assert (tcfg.kl_mode, tcfg.beta, tcfg.guidance_scale) == ("velocity", 0.002, 1.0)
    assert (tcfg.num_steps, tcfg.sde_window, tcfg.sde_window_range, tcfg.sde_window_draw) == (10, 1, (1, 4), "per_step")
