"""DiffusionOPSD: the method page's properties (docs/methods/diffusion_opsd.md) on closed forms and the tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowalign import checkpoint as ckpt
from flowalign.advantages import compute_advantages
from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.trainers.diffusion_opsd import (
    DiffusionOPSDConfig,
    DiffusionOPSDTrainer,
    bounded_targets,
    direction_targets,
    dpm2_suffix,
    opsd_loss,
    query_anchor,
    query_index,
)
from flowalign.trainers.parts.negative_aware import mirrored_velocities, reward_weight
from flowalign.trainers.self_distill import BehaviourWeights, FitUnit, SelfDistillTrainer, behaviour_lambda
from rewards.vvr import generate_tasks

from .conftest import small_config
from .resume_check import assert_trains_and_resumes_bit_exactly

SOFT = "rewards=[{name: vvr_soft}]"
ANSWERS = Path(__file__).parent / "known_answers"
#: worldbench/DiffusionOPSD's targets (the shared first gradient and _opa_tr_step), on a fixed smooth reward
TARGETS = json.loads((ANSWERS / "diffusion_opsd_targets.json").read_text())
#: their OPA fitting loss, its gradient, and one optimiser step accumulated over shuffled micro-batches
LOSS = json.loads((ANSWERS / "diffusion_opsd_loss.json").read_text())
#: their query index, global-std advantages and behaviour refresh (return_decay, decay_type 1)
SCHEDULE = json.loads((ANSWERS / "diffusion_opsd_schedule.json").read_text())
#: their appendix ablations: opa_dir_mode, opa_state_mode forward, opa_dual_neg / opa_target_mode aux in the loss,
#: opa_cert's dpm2 suffix and acceptance
ABLATIONS = json.loads((ANSWERS / "diffusion_opsd_ablations.json").read_text())


def _f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _known_reward(x: torch.Tensor) -> torch.Tensor:
    """The known answers' reward ``R_i(x) = ⟨a_i, x_i⟩ + Σ c_i·sin(2x_i) − ½⟨w, x_i⟩²`` ``(B,)``."""
    a, c, w = _f64(TARGETS["a"]), _f64(TARGETS["c"]), _f64(TARGETS["w"])
    return (a * x).flatten(1).sum(1) + (c * torch.sin(2 * x)).flatten(1).sum(1) - 0.5 * (w * x).flatten(1).sum(1) ** 2


def _reward_gradient(y: torch.Tensor) -> torch.Tensor:
    y = y.detach().requires_grad_(True)
    return torch.autograd.grad(_known_reward(y).sum(), y)[0]


@pytest.mark.parametrize("case", TARGETS["cases"], ids=lambda c: f"rho{c['rho']}-n{c['n_ascent']}-eta{c['eta']}")
def test_targets_equal_the_authors_opa_tr_step(case):
    """y⁺ and y⁻ from the same y0 and reward: normalised steps, the shared first gradient, the ball projection."""
    y_pos, y_neg = bounded_targets(_f64(TARGETS["y0"]), _reward_gradient, case["rho"], case["n_ascent"], case["eta"])
    torch.testing.assert_close(y_pos, _f64(case["y_plus"]), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(y_neg, _f64(case["y_minus"]), rtol=1e-6, atol=1e-12)


def _loss_inputs() -> dict[str, torch.Tensor]:
    return {k: _f64(LOSS[k]) for k in ("z_q", "v_old", "v_theta", "y_plus", "y_minus", "advantages")}


@pytest.mark.parametrize("case", LOSS["cases"], ids=lambda c: f"mirror_beta{c['mirror_beta']}")
def test_loss_and_gradient_equal_the_authors_opa_loss(case):
    """The per-sample branches, the batch loss and its gradient in v_θ (the authors' OPA branch of the loop)."""
    x = _loss_inputs()
    r = reward_weight(x["advantages"], LOSS["adv_clip_max"])
    torch.testing.assert_close(r, _f64(case["r"]), rtol=1e-12, atol=0)
    v_theta = x["v_theta"].clone().requires_grad_(True)
    per_sample, info = opsd_loss(v_theta, x["v_old"], x["z_q"], LOSS["sigma_q"], x["y_plus"], x["y_minus"], r,
                                 case["mirror_beta"], LOSS["adv_clip_max"])
    loss = per_sample.mean()
    loss.backward()
    torch.testing.assert_close(loss.item(), case["loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(info["loss_pos"].item(), _f64(case["pos_loss"]).mean().item(), rtol=1e-6, atol=0)
    torch.testing.assert_close(info["loss_neg"].item(), _f64(case["neg_loss"]).mean().item(), rtol=1e-6, atol=0)
    torch.testing.assert_close(v_theta.grad, _f64(case["grad_v_theta"]), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("case", LOSS["cases"], ids=lambda c: f"mirror_beta{c['mirror_beta']}")
def test_one_step_gradient_equals_the_authors_accumulated_micro_batches(case):
    """The trainer's hooks (fit_loss with the unit's v_φ, σ_q, r, β, A_max; loss over the step's kept samples)
    on two fit units of three samples give the gradient the authors accumulate over their shuffled micro-batches
    before one optimiser step."""
    x = _loss_inputs()
    r = reward_weight(x["advantages"], LOSS["adv_clip_max"])
    v_theta = x["v_theta"].clone().requires_grad_(True)
    tcfg = DiffusionOPSDConfig(mirror_beta=case["mirror_beta"], adv_clip=LOSS["adv_clip_max"],
                               model_timestep="continuous")  # the stub policy has no transformer
    hooks = SimpleNamespace(tcfg=tcfg, fit_guidance=lambda chunk: 1.0)
    hooks.fit_loss = lambda unit: DiffusionOPSDTrainer.fit_loss(hooks, unit)
    for rows in (slice(0, 3), slice(3, 6)):
        tensors = {"z_q": x["z_q"][rows], "sigma_q": LOSS["sigma_q"], "v_phi": x["v_old"][rows],
                   "y_pos": x["y_plus"][rows], "y_neg": x["y_minus"][rows]}
        unit = FitUnit(SimpleNamespace(cond=None), r[rows], torch.ones(3, dtype=torch.bool), tensors, total=6)
        hooks.policy = SimpleNamespace(velocity=lambda z, sigma, cond, guidance, rows=rows: v_theta[rows])
        loss, _ = SelfDistillTrainer.loss(hooks, None, unit)
        loss.backward()
    torch.testing.assert_close(v_theta.grad, _f64(case["step"]["grad_v_theta"]), rtol=1e-6, atol=1e-12)


def test_query_index_equals_the_authors():
    """k_q on SD3.5's 10-step shift-3 grid (σ* 0.278 → k 8) and two others, σ* from 0 to 0.999."""
    for case in SCHEDULE["query"]:
        sigmas = torch.tensor(SCHEDULE["grids"][case["grid"]], dtype=torch.float32)
        assert query_index(sigmas, case["sigma_star"]) == case["k_q"], case


def test_global_std_advantages_equal_the_authors_stat_tracker():
    """``advantage: global_std``: group mean, population std of the whole batch + 1e-4 (PerPromptStatTracker).
    (flowalign sums the weighted rewards in float32; the relative error stays below 1e-6 here.)"""
    known = SCHEDULE["advantage"]
    names = sorted(set(known["prompts"]))
    groups = torch.tensor([names.index(p) for p in known["prompts"]])
    ours = compute_advantages("global_std", _f64(known["rewards"])[:, None], torch.ones(1), groups, clip=5.0)
    torch.testing.assert_close(ours.double(), _f64(known["advantages"]), rtol=1e-6, atol=0)


def test_behaviour_refresh_defaults_equal_the_authors_return_decay():
    """λ_s of the defaults (behaviour_rate 0.001, behaviour_max 0.5) is their return_decay(s, decay_type=1)."""
    c, known = DiffusionOPSDConfig(), SCHEDULE["return_decay_1"]
    ours = [behaviour_lambda(s, c.behaviour_rate, c.behaviour_max) for s in known["steps"]]
    torch.testing.assert_close(_f64(ours), _f64(known["decay"]), rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------------------------- the ablations


def _toy_velocity(c0: torch.Tensor):
    """The ablations' stand-in velocity ``v(z, σ) = c0 − (0.5 + 0.4·t/1000)·z`` at their ``t = int(1000·σ)``."""
    return lambda z, sigma: c0 - (0.5 + 0.4 * int(float(sigma) * 1000) / 1000) * z


@pytest.mark.parametrize("case", ABLATIONS["directions"]["cases"],
                         ids=lambda c: f"{c['dir_mode']}-rho{c['rho']}-n{c['n_ascent']}-eta{c['eta']}")
def test_target_directions_equal_the_authors_opa_dir_mode(case):
    """``direction`` random / residual / none give their ``_opa_tr_step`` with ``dir_mode`` rand / residual / noop
    (random: the directions their two calls drew, in that order; residual: toward the rollout's sample)."""
    names = {"rand": "random", "residual": "residual", "noop": "none"}
    draws = iter([_f64(case["d_plus"]), _f64(case["d_minus"])] if "d_plus" in case else [])
    y_pos, y_neg = direction_targets(names[case["dir_mode"]], _f64(TARGETS["y0"]), case["rho"], case["n_ascent"],
                                     case["eta"], x_end=_f64(ABLATIONS["directions"]["x_end"]),
                                     draw=lambda: next(draws))
    torch.testing.assert_close(y_pos, _f64(case["y_plus"]), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(y_neg, _f64(case["y_minus"]), rtol=1e-6, atol=1e-12)


def test_forward_query_state_equals_the_authors_opa_state_mode_forward():
    """``query_state: forward``: z_q = (1 − σ_q)·x_i + σ_q·ε from the rollout's sample (the rollout's own states
    are NaN here, so reading one fails), the anchor and the grad targets from that state."""
    known = ABLATIONS["forward_state"]
    sigmas = torch.tensor(known["sigmas"], dtype=torch.float32)
    x_end = _f64(known["x_end"])
    latents = torch.full((x_end.shape[0], len(sigmas)) + x_end.shape[1:], float("nan"), dtype=torch.float64)
    latents[:, -1] = x_end
    chunk = SimpleNamespace(sigmas=sigmas, latents=latents, cond=None, guidance_scale=1.0)
    velocity = _toy_velocity(_f64(known["c0"]))
    policy = SimpleNamespace(device=torch.device("cpu"), velocity=lambda z, sigma, cond, guidance: velocity(z, sigma))
    sigma_q, z_q, _, y0 = query_anchor(policy, chunk, known["sigma_star"], 1.0, "continuous", _f64(known["noise"]))
    assert sigma_q == known["sigma_q"]
    torch.testing.assert_close(z_q, _f64(known["z_q"]), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(y0, _f64(known["y0"]), rtol=1e-6, atol=1e-12)
    y_pos, y_neg = direction_targets("grad", y0, known["rho"], known["n_ascent"], known["eta"],
                                     gradient=_reward_gradient)
    torch.testing.assert_close(y_pos, _f64(known["y_plus"]), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(y_neg, _f64(known["y_minus"]), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("case", ABLATIONS["loss"]["cases"],
                         ids=lambda c: f"{c['opa_target_mode']}{c['opa_aux_lambda']}-dual{c['opa_dual_neg']}-"
                                       f"beta{c['mirror_beta']}-acc{int(min(c['acc_plus'] + c['acc_minus']))}")
def test_ablation_losses_equal_the_authors_opa_loss(case):
    """Through the trainer's ``fit_loss``: ``dual_negative`` false (their opa_dual_neg 0; no y⁻ is given),
    ``target_mode: aux`` with ``aux_weight`` (opa_target_mode aux, opa_aux_lambda) and the certification's
    acceptance gates; the batch loss and its gradient in v_θ."""
    x = _loss_inputs()
    r = reward_weight(x["advantages"], LOSS["adv_clip_max"])
    v_theta = x["v_theta"].clone().requires_grad_(True)
    gated = min(case["acc_plus"] + case["acc_minus"]) == 0
    tcfg = DiffusionOPSDConfig(mirror_beta=case["mirror_beta"], adv_clip=LOSS["adv_clip_max"],
                               model_timestep="continuous", dual_negative=bool(case["opa_dual_neg"]),
                               target_mode=case["opa_target_mode"], aux_weight=case["opa_aux_lambda"], certify=gated)
    hooks = SimpleNamespace(tcfg=tcfg, fit_guidance=lambda chunk: 1.0,
                            policy=SimpleNamespace(velocity=lambda z, sigma, cond, guidance: v_theta))
    tensors = {"z_q": x["z_q"], "sigma_q": LOSS["sigma_q"], "v_phi": x["v_old"], "y_pos": x["y_plus"]}
    if case["opa_dual_neg"]:
        tensors["y_neg"] = x["y_minus"]
    if case["opa_target_mode"] == "aux":
        tensors["endpoint"] = _f64(ABLATIONS["loss"]["x_end"])
    if gated:
        tensors["accept_pos"] = _f64(case["acc_plus"])
        if case["opa_dual_neg"]:
            tensors["accept_neg"] = _f64(case["acc_minus"])
    unit = FitUnit(SimpleNamespace(cond=None), r, torch.ones(6, dtype=torch.bool), tensors)
    per_sample, info = DiffusionOPSDTrainer.fit_loss(hooks, unit)
    loss = per_sample.mean()
    loss.backward()
    torch.testing.assert_close(loss.item(), case["loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(v_theta.grad, _f64(case["grad_v_theta"]), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(info["loss_pos"].item(), _f64(case["pos_loss"]).mean().item(), rtol=1e-6, atol=0)
    torch.testing.assert_close(info["loss_neg"].item(), _f64(case["neg_loss"]).mean().item(), rtol=1e-6, atol=0)


def _certification_hooks(case, margin: float):
    """The trainer's ``certified`` with the stand-in velocity (float32 as their ``vold``), an identity decoder and
    the stand-in reward, on the case's rollout states (``latents``: z_{k−1}, z_q, x_i at their places)."""
    velocity = _toy_velocity(_f64(case["c0"]))
    sigmas = torch.tensor(case["sigmas"], dtype=torch.float32)
    z_q, x_end = torch.tensor(case["z_q"]), torch.tensor(case["x_end"])
    latents = torch.full((z_q.shape[0], len(sigmas)) + z_q.shape[1:], float("nan"))
    latents[:, case["k"] - 1], latents[:, case["k"]], latents[:, -1] = torch.tensor(case["z_prev"]), z_q, x_end
    chunk = SimpleNamespace(sigmas=sigmas, latents=latents, cond=None, guidance_scale=1.0, prompts=["p"] * 3,
                            metadata=[{}] * 3)
    policy = SimpleNamespace(velocity=lambda z, sigma, cond, guidance: velocity(z.double(), sigma).float(),
                             decode=lambda y: y)
    rewards = SimpleNamespace(weighted_total=lambda images, prompts, metadata: _known_reward(images.double()))
    tcfg = DiffusionOPSDConfig(sigma_star=case["sigma_star"], model_timestep="continuous", certify=True,
                               certify_margin=margin)
    hooks = SimpleNamespace(tcfg=tcfg, policy=policy, rewards=rewards, fit_guidance=lambda chunk: 1.0)
    hooks.suffix_samples = lambda *a: DiffusionOPSDTrainer.suffix_samples(hooks, *a)
    return hooks, chunk, z_q, x_end


@pytest.mark.parametrize("case", ABLATIONS["certification"]["cases"], ids=lambda c: f"{c['grid']}-k{c['k']}")
def test_certification_equals_the_authors_exact_dpm2_suffix(case):
    """``certify`` (their opa_cert 1): the DPM-Solver++(2) suffix from z_q with y± (or y0) forced as the clean
    prediction and the previous state's as history gives their ``_dpm2_continue_from`` endpoints (float32, as
    theirs and diffusers' solver run it); the acceptance of each target at three margins is theirs."""
    velocity = _toy_velocity(_f64(case["c0"]))
    sigmas = torch.tensor(case["sigmas"], dtype=torch.float32)
    z_q, prev_x0 = torch.tensor(case["z_q"]), torch.tensor(case["prev_x0"])
    v32 = lambda z, sigma: velocity(z.double(), sigma).float()  # noqa: E731
    for forced, known in (("y_plus", "endpoint_plus"), ("y_minus", "endpoint_minus"), ("y0", "endpoint_y0")):
        end = dpm2_suffix(v32, z_q, case["k"], torch.tensor(case[forced]), prev_x0, sigmas)
        torch.testing.assert_close(end.double(), _f64(case[known]), rtol=1e-6, atol=1e-6)
    # forcing φ's own clean prediction y0 continues the rollout to its sample x_i
    torch.testing.assert_close(_f64(case["endpoint_y0"]), _f64(case["x_end"]), rtol=1e-6, atol=1e-6)
    for row in case["margins"]:
        hooks, chunk, z_q, x_end = _certification_hooks(case, row["opa_margin"])
        acc_pos, acc_neg = DiffusionOPSDTrainer.certified(hooks, chunk, z_q, x_end, torch.tensor(case["y_plus"]),
                                                          torch.tensor(case["y_minus"]))
        assert acc_pos.tolist() == row["acc_plus"] and acc_neg.tolist() == row["acc_minus"], row


def test_certification_refuses_a_forward_noised_query_state():
    with pytest.raises(ValueError, match="query_state=rollout"):
        DiffusionOPSDConfig(certify=True, query_state="forward")


def vvr_run(tmp_path, tiny_sd3_dir, *extra):
    """A seconds-long OPSD run on VVR tasks (metadata for vvr_soft) on the tiny random SD3 model."""
    return small_config(tmp_path, tiny_sd3_dir, tmp_path / "unused.txt", "data.prompts=null", "data.bench=vvr",
                        "data.level=medium", "data.n=16", SOFT, "trainer.name=diffusion_opsd", *extra)


def test_linear_reward_targets_and_fixed_point():
    """Identity decoder, R(y) = ⟨a, y⟩: y± = y0 ± ρ‖y0‖·â, and fitting drives x̂0_θ(z_q) to
    y0 + (ρ‖y0‖/β)·â whatever r (a sign error or a w that is not detached moves the fixed point)."""
    g = torch.Generator().manual_seed(0)
    b, d, sigma, rho = 3, 16, 0.3, 0.1
    z_q = torch.randn(b, d, generator=g)
    v_phi = torch.randn(b, d, generator=g)
    y0 = z_q - sigma * v_phi
    a = torch.randn(b, d, generator=g)
    a_hat = a / a.norm(dim=1, keepdim=True)
    y_pos, y_neg = bounded_targets(y0, lambda y: a.clone(), rho=rho, n=2, eta=1.0)
    radius = rho * y0.norm(dim=1, keepdim=True)
    torch.testing.assert_close(y_pos, y0 + radius * a_hat)
    torch.testing.assert_close(y_neg, y0 - radius * a_hat)
    for beta in (1.0, 0.5):
        for r_value in (0.0, 0.3, 1.0):
            v_theta = v_phi.clone().requires_grad_(True)
            opt = torch.optim.Adam([v_theta], lr=2e-2)
            r = torch.full((b,), r_value)
            for _ in range(600):
                loss, _ = opsd_loss(v_theta, v_phi, z_q, sigma, y_pos, y_neg, r, beta, a_max=5.0)
                opt.zero_grad()
                loss.mean().backward()
                opt.step()
            x0_theta = z_q - sigma * v_theta.detach()
            torch.testing.assert_close(x0_theta, y0 + radius * a_hat / beta, atol=2e-3, rtol=0)


def test_targets_stay_in_the_budget_ball_for_a_curved_reward():
    g = torch.Generator().manual_seed(1)
    y0 = torch.randn(4, 8, generator=g)
    centre = torch.randn(4, 8, generator=g)
    y_pos, y_neg = bounded_targets(y0, lambda y: -(y - centre), rho=0.2, n=3, eta=2.0)  # ∇ of −½‖y−c‖²
    budget = 0.2 * y0.norm(dim=1)
    assert ((y_pos - y0).norm(dim=1) <= budget * (1 + 1e-5)).all()
    assert ((y_neg - y0).norm(dim=1) <= budget * (1 + 1e-5)).all()
    # ascent gets closer to the reward's peak than descent
    assert ((y_pos - centre).norm(dim=1) < (y_neg - centre).norm(dim=1)).all()


def test_delta_identity():
    """With Δ = x̂0_θ − y0: ŷ⁺ = y0 + βΔ and ŷ⁻ = y0 − βΔ."""
    g = torch.Generator().manual_seed(2)
    z_q, v_phi, v_theta = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))
    sigma, beta = 0.278, 0.7
    y0, x0_theta = z_q - sigma * v_phi, z_q - sigma * v_theta
    v_pos, v_neg = mirrored_velocities(v_theta, v_phi, beta)
    torch.testing.assert_close(z_q - sigma * v_pos, y0 + beta * (x0_theta - y0))
    torch.testing.assert_close(z_q - sigma * v_neg, y0 - beta * (x0_theta - y0))


@pytest.mark.parametrize("r_value", [0.0, 0.5, 1.0])
def test_gradient_at_theta_equals_phi_is_antiparallel_to_the_ascent(r_value):
    """At θ = φ, ∂L/∂x̂0_θ points against y⁺ − y0 for every r, including r = ½ (where NFT's vanishes)."""
    g = torch.Generator().manual_seed(3)
    z_q, v_phi, a = (torch.randn(2, 32, generator=g) for _ in range(3))
    sigma = 0.4
    y0 = z_q - sigma * v_phi
    y_pos, y_neg = bounded_targets(y0, lambda y: a.clone(), rho=0.1, n=2, eta=1.0)
    x0_theta = y0.clone().requires_grad_(True)  # x̂0_θ = z_q − σ·v_θ with v_θ = v_φ
    v_theta = (z_q - x0_theta) / sigma
    loss, _ = opsd_loss(v_theta, v_phi, z_q, sigma, y_pos, y_neg, torch.full((2,), r_value), 1.0, 5.0)
    loss.sum().backward()
    cos = torch.nn.functional.cosine_similarity(x0_theta.grad, y_pos - y0, dim=1)
    torch.testing.assert_close(cos, -torch.ones(2))


def test_reward_weight_and_query_index():
    torch.testing.assert_close(reward_weight(torch.tensor([-9.0, -5.0, 0.0, 2.5, 7.0]), 5.0),
                               torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0]))
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.3, 0.1, 0.0])
    assert query_index(sigmas, 0.278) == 3
    assert query_index(sigmas, 0.99) == 1 and query_index(sigmas, 0.0) == 4  # never the noise, never σ=0


def test_refresh_with_lambda_zero_copies_theta_exactly():
    p = torch.nn.Parameter(torch.randn(5, 3))
    phi = BehaviourWeights([p])
    with torch.no_grad():
        p.add_(torch.randn(5, 3))
    phi.refresh(0.3)
    assert not torch.equal(phi.tensors[0], p.detach())
    phi.refresh(0.0)
    assert torch.equal(phi.tensors[0], p.detach())
    with phi.swapped_in():
        assert torch.equal(p.detach(), phi.tensors[0])


def test_a_non_differentiable_reward_is_refused_naming_the_differentiable_ones(tmp_path, tiny_sd3_dir):
    with pytest.raises(UserError, match="differentiable.*vvr_soft"):
        build_trainer(vvr_run(tmp_path / "bad", tiny_sd3_dir, "rewards=[{name: vvr}]"))


def test_targets_carry_no_parameter_gradient_and_the_update_moves_theta(tmp_path, tiny_sd3_dir):
    t = build_trainer(vvr_run(tmp_path / "run", tiny_sd3_dir, "trainer.behaviour_rate=0"))
    prompts, metadata, groups = t.step_prompts(0)
    chunk = t.sample(prompts, metadata, groups).chunks[0]
    with t.behaviour.swapped_in():
        (unit,) = t.fit_units(chunk, torch.full((len(chunk),), 0.5), torch.ones(len(chunk), dtype=torch.bool),
                            torch.Generator().manual_seed(0))
    assert all(p.grad is None for p in t.policy.transformer.parameters())
    x = unit.tensors
    assert not torch.equal(x["y_pos"], x["y0"]) and not torch.equal(x["y_neg"], x["y0"])
    # at θ = φ and r = ½ the OPSD loss still has a gradient (toward the reward-ascent side)
    loss, _ = t.fit_loss(unit)
    loss.mean().backward()
    assert sum(float(p.grad.abs().sum()) for p in t.params if p.grad is not None) > 0
    t.optimizer.zero_grad(set_to_none=True)

    before = [p.detach().clone() for p in t.params]
    logs = t.train_step()
    assert logs["train/behaviour_lambda"] == 0.0 and torch.isfinite(torch.tensor(logs["train/loss"]))
    assert any(not torch.equal(b, p) for b, p in zip(before, t.params))
    # one refresh with λ = 0 makes φ equal θ exactly
    assert all(torch.equal(phi, p.detach()) for phi, p in zip(t.behaviour.tensors, t.params))


def test_short_run_checkpoints_phi_and_resumes(tmp_path, tiny_sd3_dir):
    run = ["run.checkpoint_every=1", "trainer.max_steps=2", "trainer.behaviour_rate=0.3", "trainer.ema_decay=0.9"]
    first = build_trainer(vvr_run(tmp_path / "r", tiny_sd3_dir, *run))
    first.train()
    folder = ckpt.latest_checkpoint(tmp_path / "r")
    saved = ckpt.load_checkpoint(folder)["trainable"]
    assert {f"behaviour.{n}" for n in first.trainable_state() if not n.startswith("behaviour.")} <= set(saved)
    assert ckpt.load_checkpoint(folder)["trainer_state"]["hooks"]["optimizer_steps"] == 2
    # with λ > 0, φ lags θ: both are in the checkpoint and differ
    names = [n for n in saved if not n.startswith("behaviour.")]
    assert any(not torch.equal(saved[n], saved[f"behaviour.{n}"]) for n in names)

    resumed = build_trainer(vvr_run(tmp_path / "r", tiny_sd3_dir, *run[:1], "trainer.max_steps=3", *run[2:]))
    resumed.maybe_resume()
    assert resumed.step == 2 and resumed.optimizer_steps == 2
    live = resumed.trainable_state()
    for n in names:
        assert torch.equal(live[f"behaviour.{n}"], saved[f"behaviour.{n}"]) and torch.equal(live[n], saved[n])
    logs = resumed.train_step()
    assert logs["train/behaviour_lambda"] == pytest.approx(min(0.3 * 3, 0.5))


@pytest.mark.parametrize("ablation", [
    ("trainer.dual_negative=false", "trainer.direction=random", "trainer.query_state=forward",
     "trainer.target_mode=aux", "trainer.aux_weight=0.5"),
    ("trainer.rollout_solver=dpm2", "trainer.direction=residual", "trainer.certify=true", "trainer.certify_margin=0"),
], ids=["positive-random-forward-aux", "certified-residual"])
def test_short_runs_with_the_ablations_train_with_a_finite_loss(tmp_path, tiny_sd3_dir, ablation):
    """Two optimiser steps on the tiny model with the authors' ablations switched on."""
    t = build_trainer(vvr_run(tmp_path / "run", tiny_sd3_dir, "trainer.max_steps=2", *ablation))
    before = [p.detach().clone() for p in t.params]
    for _ in range(2):
        logs = t.train_step()
        assert torch.isfinite(torch.tensor(logs["train/loss"])), logs
    assert any(not torch.equal(b, p) for b, p in zip(before, t.params))
    if "trainer.certify=true" in ablation:
        assert 0 <= logs["train/accept_pos"] <= 1 and 0 <= logs["train/accept_neg"] <= 1
    else:
        assert logs["train/loss_neg"] == 0 and logs["train/loss_endpoint_neg"] == 0


def test_the_certification_suffix_forced_with_the_anchor_continues_the_rollout(tmp_path, tiny_sd3_dir):
    """On the tiny model's dpm2 rollouts (SD3.5's 10-step grid): φ's suffix from z_q with its own clean prediction
    y0 forced, the previous state's as history, ends at the rollout's sample (their null check of opa_cert);
    forcing y⁺ instead does not."""
    t = build_trainer(vvr_run(tmp_path / "run", tiny_sd3_dir, "trainer.rollout_solver=dpm2", "trainer.num_steps=10",
                              "trainer.certify=true"))
    prompts, metadata, groups = t.step_prompts(0)
    chunk = t.sample(prompts[:2], metadata[:2], groups[:2]).chunks[0]
    with t.behaviour.swapped_in():
        (unit,) = t.fit_units(chunk, torch.full((2,), 0.5), torch.ones(2, dtype=torch.bool),
                              torch.Generator().manual_seed(0))
        x = unit.tensors
        from_y0, from_y_pos = t.suffix_samples(chunk, x["z_q"], x["y0"], x["y_pos"])
    torch.testing.assert_close(from_y0, chunk.latents[:, -1], rtol=1e-5, atol=1e-5)
    assert (from_y_pos - chunk.latents[:, -1]).abs().max() > 1e-3
    assert set(x["accept_pos"].tolist()) <= {0.0, 1.0} and set(x["accept_neg"].tolist()) <= {0.0, 1.0}


def test_a_batch_with_no_reward_gradient_gets_targets_equal_to_the_anchor(tmp_path, tiny_sd3_dir):
    """Counts under ``vvr_soft(count_gradients=False)`` pass no gradient: a chunk of count tasks gets
    ``y± = y0`` (nothing to move toward) instead of an autograd error mid-run."""
    t = build_trainer(vvr_run(tmp_path / "run", tiny_sd3_dir, "rewards=[{name: vvr_soft, count_gradients: false}]"))
    tasks = [task for task in generate_tasks(60, seed=3, level="medium") if task.constraints[0].type.startswith("count")][:4]
    (chunk,) = t.sample([task.prompt for task in tasks], [{"task": task} for task in tasks], torch.zeros(4, dtype=torch.long)).chunks
    with t.behaviour.swapped_in():
        (unit,) = t.fit_units(chunk, torch.full((4,), 0.5), torch.ones(4, dtype=torch.bool), torch.Generator().manual_seed(0))
    assert torch.equal(unit.tensors["y_pos"], unit.tensors["y0"]) and torch.equal(unit.tensors["y_neg"], unit.tensors["y0"])


@pytest.mark.parametrize("fit_guidance", [None, 1.0])
def test_fit_guidance_one_reads_the_conditional_velocity_alone(tmp_path, tiny_sd3_dir, fit_guidance):
    """``trainer.fit_guidance=1``: the anchor, the targets and the fit never see the CFG negatives; null (the
    default, the method page's "same CFG as the rollout"): they do. The rollout is guided either way."""
    extra = [] if fit_guidance is None else ["trainer.fit_guidance=1.0"]
    t = build_trainer(vvr_run(tmp_path / "g", tiny_sd3_dir, *extra))
    prompts, metadata, groups = t.step_prompts(0)
    chunk = t.sample(prompts, metadata, groups).chunks[0]
    assert chunk.guidance_scale > 1
    r = torch.linspace(0, 1, len(chunk))

    def anchor_and_loss() -> tuple[torch.Tensor, torch.Tensor]:
        with t.behaviour.swapped_in():
            (unit,) = t.fit_units(chunk, r, torch.ones(len(chunk), dtype=torch.bool), torch.Generator().manual_seed(0))
        with torch.no_grad():
            return unit.tensors["y0"], t.fit_loss(unit)[0]

    y0, loss = anchor_and_loss()
    for key in ("negative_prompt_embeds", "negative_pooled_prompt_embeds"):
        chunk.cond.tensors[key] = chunk.cond.tensors[key] + 1.0
    y0_after, loss_after = anchor_and_loss()
    assert torch.equal(y0, y0_after) == torch.equal(loss, loss_after) == (fit_guidance == 1.0)


#: OPSD with a differentiable pixel reward and a lagging behaviour policy, on the loop's small run
OPSD_RUN = ("trainer.name=diffusion_opsd", "rewards=[{name: brightness}]", "trainer.behaviour_rate=0.3")


def test_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file):
    """Two steps straight equal one step, a checkpoint (θ, φ, s) and a resumed second step, bit for bit."""
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, *OPSD_RUN)


#: the timesteps their transformer reads on SD3's 10-step shift-3 grid: the rollout's (pipeline_with_logprob's
#: torch.full([B], σ*1000, dtype=long)), the anchor's and the fit's (their OPA block's int(float(σ_q)*1000))
TIMESTEPS = json.loads((ANSWERS / "diffusion_opsd_timesteps.json").read_text())


@pytest.mark.parametrize("form", ["truncated", "continuous"])
def test_the_transformer_reads_the_authors_integer_timesteps(tmp_path, tiny_sd3_dir, form):
    """``model_timestep: truncated`` (the default): every rollout step, the anchor and the fit give the
    transformer the authors' integer timestep; ``continuous`` gives it the pipeline's 1000·σ."""
    extra = [] if form == "truncated" else ["trainer.model_timestep=continuous"]
    t = build_trainer(vvr_run(tmp_path / form, tiny_sd3_dir, "trainer.num_steps=10", "trainer.fit_guidance=1.0",
                              *extra))
    seen: list[float] = []
    # a forward hook sees the keywords forward ran with (after every pre-hook)
    handle = t.policy.transformer.register_forward_hook(
        lambda m, a, kw, out: seen.extend(sorted(set(kw["timestep"].tolist()))), with_kwargs=True)
    try:
        prompts, metadata, groups = t.step_prompts(0)
        chunk = t.sample(prompts[:1], metadata[:1], groups[:1]).chunks[0]
        rollout_seen, seen[:] = list(seen), []
        with t.behaviour.swapped_in():
            (unit,) = t.fit_units(chunk, torch.full((len(chunk),), 0.5), torch.ones(len(chunk), dtype=torch.bool),
                                  torch.Generator().manual_seed(0))
        anchor_seen, seen[:] = list(seen), []
        t.fit_loss(unit)
        fit_seen = list(seen)
    finally:
        handle.remove()
    assert chunk.sigmas.tolist() == TIMESTEPS["sigmas"]  # the tiny model's grid is SD3.5's 10-step grid
    assert query_index(chunk.sigmas, TIMESTEPS["sigma_star"]) == TIMESTEPS["kq"]
    if form == "truncated":
        assert rollout_seen == [float(x) for x in TIMESTEPS["rollout_timesteps"]]
        assert anchor_seen == [float(TIMESTEPS["anchor_timestep"])] and fit_seen == [float(TIMESTEPS["fit_timestep"])]
    else:
        continuous = (chunk.sigmas[:-1] * 1000.0).tolist()
        assert rollout_seen == continuous and anchor_seen == fit_seen == [continuous[TIMESTEPS["kq"]]]
        assert rollout_seen != [float(x) for x in TIMESTEPS["rollout_timesteps"]]
