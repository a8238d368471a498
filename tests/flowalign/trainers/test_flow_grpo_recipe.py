"""Flow-GRPO's defaults follow the authors' recipe: trained steps counted over all T steps, a stochastic
last step, the unconditional CFG branch detached in the loss, per-prompt global-std advantages, and the
shipped tiny configs keep a trust region (LoRA, KL, EMA, two updates per batch)."""

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from flowalign.config import load_config, validate_section
from flowalign.sampling import euler_step
from flowalign.train import build_trainer
from flowalign.trainers import get_trainer
from flowalign.trainers.flow_grpo import FlowGRPOConfig, StepUnit, guided_velocity

from .conftest import small_config

REPO = Path(__file__).resolve().parents[3]


def _trainer(tmp_path, model, prompts, name="run", *extra):
    return build_trainer(small_config(tmp_path / name, model, prompts, *extra))


@pytest.mark.parametrize("last", [True, False])
def test_timestep_fraction_counts_all_steps_and_the_last_step_may_be_stochastic(tmp_path, tiny_sd3_dir, prompt_file, last):
    t = _trainer(tmp_path, tiny_sd3_dir, prompt_file, f"l{last}", "trainer.num_steps=10", "trainer.group_size=2",
                 "trainer.batch_size=2", "trainer.prompts_per_step=1", f"trainer.sde_last_step={last}")
    chunk = t.collect(0).chunks[0]
    assert t.trained_steps(chunk) == list(range(9))  # ⌊0.99·10⌋ = 9 trained steps either way
    assert bool(chunk.sde_mask[-1]) == last
    assert torch.isfinite(chunk.log_probs[:, -1]).all() == last
    x, sigma = chunk.latents[:, -2], chunk.sigmas[-2].item()
    with torch.no_grad():
        v = t.policy.velocity(x, sigma, chunk.cond, chunk.guidance_scale)
    euler = euler_step(v, x, sigma, 0.0).prev_sample
    assert torch.allclose(chunk.final_latents, euler, atol=1e-5) != last  # noise on the last step only if asked


def test_defaults_are_the_reference_recipe():
    tcfg = FlowGRPOConfig()
    assert tcfg.sde_last_step and tcfg.cfg_grad == "detached" and tcfg.advantage == "global_std"
    assert tcfg.timestep_fraction == 0.99


def test_cfg_grad_detached_backpropagates_through_the_conditional_branch_only(tmp_path, tiny_sd3_dir, prompt_file):
    t = _trainer(tmp_path, tiny_sd3_dir, prompt_file)
    chunk = t.collect(0).chunks[0]
    x, sigma, w = chunk.latents[:, 1], chunk.sigmas[1].item(), chunk.guidance_scale
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))

    def grads(fn):
        t.optimizer.zero_grad(set_to_none=True)
        v = fn()
        (v * probe).sum().backward()
        return v.detach(), [p.grad.clone() for p in t.params]

    v_det, g_det = grads(lambda: guided_velocity(t.policy, x, sigma, chunk.cond, w, "detached"))
    v_full, g_full = grads(lambda: guided_velocity(t.policy, x, sigma, chunk.cond, w, "full"))
    _, g_cond = grads(lambda: t.policy.velocity(x, sigma, chunk.cond, 1.0))
    torch.testing.assert_close(v_det, v_full, rtol=0, atol=1e-5)  # the same velocity
    for a, c in zip(g_det, g_cond):
        torch.testing.assert_close(a, w * c, rtol=1e-4, atol=1e-7)  # ∂v/∂θ = w·∂v_c/∂θ
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(g_det, g_full))


@pytest.mark.parametrize("cfg_grad", ["detached", "full"])
def test_each_cfg_grad_setting_trains_with_ratio_one_on_the_first_pass(tmp_path, tiny_sd3_dir, prompt_file, cfg_grad):
    t = _trainer(tmp_path, tiny_sd3_dir, prompt_file, cfg_grad, f"trainer.cfg_grad={cfg_grad}")
    batch = t.collect(0)
    k = t.trained_steps(batch.chunks[0])[0]
    loss, info = t.loss(batch, StepUnit(0, k, 1, 0))
    loss.backward()
    # the on-policy ratio is exactly 1 (the detached branch's separate forwards round as the rollout's batched one)
    assert info["ratio"] == 1.0 and info["ratio_dev"] == 0.0
    assert sum(p.grad.abs().sum() for p in t.params if p.grad is not None) > 0


def test_the_first_optimizer_step_reuses_the_rollouts_unconditional_velocities(tmp_path, tiny_sd3_dir, prompt_file):
    t = _trainer(tmp_path, tiny_sd3_dir, prompt_file, "reuse", "trainer.num_steps=4")
    batch = t.collect(0)
    chunk = batch.chunks[0]
    stored = chunk.unconditional_velocities
    assert stored is not None and stored.shape[:2] == (len(chunk), chunk.num_steps)
    with torch.no_grad():  # what the rollout kept is the unconditional branch at every step
        for k in range(chunk.num_steps):
            v_u = t.policy.unconditional_velocity(chunk.latents[:, k], chunk.sigmas[k].item(), chunk.cond)
            assert torch.equal(stored[:, k], v_u)

    calls = []
    own = t.policy.unconditional_velocity
    t.policy.unconditional_velocity = lambda *a: calls.append(1) or own(*a)

    def loss_and_grads(update):
        t.optimizer.zero_grad(set_to_none=True)
        loss, info = t.loss(batch, StepUnit(0, 1, 1, update))
        loss.backward()
        return loss.item(), info, [p.grad.clone() for p in t.params]

    first, info, g_first = loss_and_grads(0)  # the sampling weights: v_u comes from the rollout
    assert calls == [] and info["ratio"] == 1.0 and info["ratio_dev"] == 0.0
    later, _, g_later = loss_and_grads(1)  # after an optimiser step v_u must be recomputed
    assert calls == [1]
    assert first == pytest.approx(later, rel=1e-5)  # (same weights here: the two paths compute one loss)
    for a, b in zip(g_first, g_later):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)

    full = _trainer(tmp_path, tiny_sd3_dir, prompt_file, "full", "trainer.cfg_grad=full")
    assert full.collect(0).chunks[0].unconditional_velocities is None  # full backpropagates through v_u


def test_advantages_are_normalised_per_prompt_with_the_global_std(tmp_path, tiny_sd3_dir):
    one = tmp_path / "one.txt"
    one.write_text("a red circle\n")  # both groups of the step draw the same prompt
    t = build_trainer(small_config(tmp_path / "run", tiny_sd3_dir, one))
    batch = t.collect(0)
    assert batch.groups.unique().tolist() == [0, 1] and batch.prompt_ids.unique().tolist() == [0]
    total = batch.scores.total
    expected = ((total - total.mean()) / (total.std(unbiased=False) + 1e-4)).clamp(-5, 5)
    torch.testing.assert_close(batch.advantages, expected)


def test_the_kl_reference_is_computed_once_per_batch(tmp_path, tiny_sd3_dir, prompt_file):
    t = _trainer(tmp_path, tiny_sd3_dir, prompt_file, "kl", "trainer.beta=0.04", "trainer.inner_epochs=2",
                 "trainer.updates_per_epoch=2", "trainer.clip_range=0.2")
    calls = []
    disabled = t.policy.adapter_disabled

    @contextmanager
    def counted():
        calls.append(1)
        with disabled():
            yield

    t.policy.adapter_disabled = counted
    batch = t.collect(0)
    logs = t.update(batch, torch.Generator().manual_seed(0))
    units = {(i, k) for i, c in enumerate(batch.chunks) for k in t.trained_steps(c)}
    assert len(calls) == len(units)  # 2 epochs × 2 updates, one reference each
    # the plan computes those the prepare hook did not (while the last batch was scored) and its units carry
    # them (one tensor per rollout batch and step): loss reads them
    prepared = len(batch.prepared or {})
    plan = [u for step in t.plan(batch, torch.Generator().manual_seed(0)).steps for u in step]
    assert len(calls) == 2 * len(units) - prepared
    refs = {}
    for u in plan:
        assert refs.setdefault((u.chunk, u.k), u.reference) is u.reference is not None
    # the second update of a batch sees moved weights: the clip acts there and is logged
    assert logs["ratio_dev_late"] > 0 and "clip_frac_late" in logs and logs["kl"] > 0


@pytest.mark.parametrize("name", ["flow_grpo_vvr", "flash_grpo_vvr"])
def test_shipped_tiny_configs_keep_a_trust_region(name):
    cfg = load_config(REPO / "configs" / "tiny" / f"{name}.yaml")
    tcfg = validate_section(get_trainer(cfg.trainer["name"]).Config, cfg.trainer, "trainer.")
    assert cfg.model.finetune == "lora" and tcfg.beta > 0 and tcfg.ema_decay > 0
    assert tcfg.inner_epochs * tcfg.updates_per_epoch >= 2
    assert tcfg.advantage == "global_std" and tcfg.cfg_grad == "detached"


def test_batched_first_pass_reruns_the_rollouts_forward_with_the_detached_gradient(tmp_path, tiny_sd3_dir, prompt_file):
    """``first_pass: batched``: the first pass's velocity is the rollout's own 2B-row forward, bit for bit (ratio
    1 on any kernels), and its gradient is ``cfg_grad: detached``'s (the conditional branch's alone)."""
    t = _trainer(tmp_path, tiny_sd3_dir, prompt_file, "batched", "trainer.num_steps=4", "trainer.first_pass=batched")
    batch = t.collect(0)
    chunk = batch.chunks[0]
    k = t.trained_steps(chunk)[0]
    x, sigma, w = chunk.latents[:, k], chunk.sigmas[k].item(), chunk.guidance_scale
    with torch.no_grad():
        rollout_v = t.policy.velocity_and_unconditional(x, sigma, chunk.cond, w)[0]

    def grads_of(first_pass: str):
        t.tcfg.first_pass = first_pass
        t.optimizer.zero_grad(set_to_none=True)
        v = t.policy_velocity(chunk, k, True)
        v.sum().backward()
        return v.detach(), [p.grad.clone() for p in t.params]

    v_batched, g_batched = grads_of("batched")
    v_stored, g_stored = grads_of("stored")
    assert torch.equal(v_batched, rollout_v)
    torch.testing.assert_close(v_stored, v_batched, rtol=0, atol=1e-5)
    for a, b in zip(g_batched, g_stored):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    t.tcfg.first_pass = "batched"
    _, info = t.loss(batch, StepUnit(0, k, 1, 0))
    assert info["ratio"] == 1.0 and info["ratio_dev"] == 0.0


def test_ratio_dev_is_the_largest_first_pass_deviation_of_the_step(tmp_path, tiny_sd3_dir, prompt_file):
    """``train/ratio_dev``: max |ratio − 1| over the batch's first pass (a per-step maximum, not a mean)."""
    from flowalign.trainers.unit_logs import MAX_LOGS

    assert "ratio_dev" in MAX_LOGS
    t = _trainer(tmp_path, tiny_sd3_dir, prompt_file, "dev", "trainer.num_steps=4", "trainer.updates_per_epoch=2")
    batch = t.collect(0)
    k = t.trained_steps(batch.chunks[0])[0]
    assert "ratio_dev" in t.loss(batch, StepUnit(0, k, 1, 0))[1]
    assert "ratio_dev" not in t.loss(batch, StepUnit(0, k, 1, 1))[1]  # later passes log ratio_dev_late
