"""SOAR and SFT (docs/methods/soar.md): one training unit, its levels and gradient equal to the authors'
script (known_answers/soar_training_unit.json), the target identities, λ=0 ≡ SFT, no gradient through the
rollout, bad input, and short real runs on the tiny model (rendered VVR pairs and pairs from a folder)."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from PIL import Image

from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.trainers.parts.training_grid import grid_sigma_of, training_grid
from flowalign.trainers.soar import (StochasticPaths, correction_targets, off_trajectory_state, rollout_levels,
                                     rollout_velocity, soar_loss, stochastic_path_state)

from .conftest import small_run

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "soar_training_unit.json").read_text())


def _grid(shift):
    """The training grid of a freshly loaded scheduler with this shift (what the authors' script indexes)."""
    return training_grid(SimpleNamespace(scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift),
                                         defaults={}))


def _toy(A, b, P):
    """The stand-in transformer of the known answers: ``v = (x·A)·(1 + b·timestep/1000) + pooled·P``, with
    flowalign's policy convention ``timestep = 1000·σ`` (σ float32, as the scheduler's timesteps are)."""

    def run(x, sigma, pooled):
        timestep = sigma.to(torch.float32) * 1000.0
        flat = x.reshape(x.shape[0], -1)
        return ((flat @ A) * (1 + b * (timestep.to(flat.dtype)[:, None] / 1000.0)) + pooled @ P).reshape(x.shape)

    return run


def _f64(values):
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"shift{c['shift']}-K{c['K']}-N{c['N']}-lam{c['lambda_aux']}")
def test_one_training_unit_equals_the_authors_train_soar_sd3_5m(case):
    """The levels, the guided rollout velocity, every correction point's state, target, model timestep and
    error, the loss and its gradient in the stand-in transformer's weights, from flowalign's pieces."""
    inp = case["inputs"]
    x0, eps = _f64(inp["x0"]), _f64(inp["eps"])
    t0, u = torch.tensor(inp["t0"], dtype=torch.float32), torch.tensor(inp["u"], dtype=torch.float32)
    A, b, P = (_f64(inp[k]).requires_grad_(True) for k in ("A", "b", "P"))
    cond, uncond = _f64(inp["cond_pooled"]), _f64(inp["uncond_pooled"])
    grid = _grid(case["shift"])
    sigma, sigma_next = rollout_levels(t0, case["K"], grid)
    assert sigma.tolist() == case["sigma"] and sigma_next.tolist() == case["sigma_next"]  # float32, bit for bit
    assert (sigma * 1000.0).tolist() == case["timestep"]
    toy = _toy(A, b, P)
    n, batch = u.shape

    def velocity(x, s):
        return toy(x, s, cond.repeat(x.shape[0] // batch, 1))

    def guided(x, s):  # the script's CFG: one pass of [uncond; cond], v_u + w·(v_c - v_u)
        v_u, v_c = toy(torch.cat([x, x]), torch.cat([s, s]), torch.cat([uncond.expand(batch, -1), cond])).chunk(2)
        return v_u + case["cfg"] * (v_c - v_u)

    if case["lambda_aux"] == 0:  # the script makes no correction point: plain flow matching, as SFT (N = 0)
        loss, info = soar_loss(velocity, guided, x0, eps, sigma, sigma_next, u[:0], lam=0.0)
        loss.backward()
        torch.testing.assert_close(loss.item(), case["loss"], rtol=1e-6, atol=0)
        for name, param in zip("AbP", (A, b, P)):
            torch.testing.assert_close(param.grad, _f64(case["grad"][name]), rtol=1e-6, atol=1e-12)
        return
    x_sigma = (1 - sigma.to(x0).reshape(-1, 1, 1, 1)) * x0 + sigma.to(x0).reshape(-1, 1, 1, 1) * eps
    torch.testing.assert_close(guided(x_sigma, sigma), _f64(case["v_cfg"]), rtol=1e-6, atol=1e-12)
    x_hat = off_trajectory_state(rollout_velocity(guided, x_sigma, sigma), x_sigma, sigma, sigma_next)
    sigma_tilde = sigma_next[None] + u * (1 - sigma_next[None])
    assert sigma_tilde.tolist() == case["sigma_tilde"]
    assert (grid_sigma_of(sigma_tilde.reshape(-1), grid) * 1000.0).reshape(n, batch).tolist() == case["model_timestep"]
    z, v_star = correction_targets(x0, eps, x_hat, sigma_next, sigma_tilde)
    torch.testing.assert_close(z, _f64(case["z"]), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(v_star, _f64(case["v_star"]), rtol=1e-6, atol=1e-12)

    loss, info = soar_loss(velocity, guided, x0, eps, sigma, sigma_next, u, lam=case["lambda_aux"],
                           model_sigma=lambda s: grid_sigma_of(s, grid))
    loss.backward()
    torch.testing.assert_close(info["loss_base"].item(), case["loss_main"], rtol=1e-6, atol=0)
    torch.testing.assert_close(info["loss_corr"].item(), float(np.mean(case["loss_corr"])), rtol=1e-6, atol=0)
    torch.testing.assert_close(loss.item(), case["loss"], rtol=1e-6, atol=0)
    for name, param in zip("AbP", (A, b, P)):
        torch.testing.assert_close(param.grad, _f64(case["grad"][name]), rtol=1e-6, atol=1e-12)


def test_the_grid_is_the_schedulers_and_off_grid_levels_run_where_the_script_runs_them():
    """Every level of the shift-3 grid and every midpoint: the model level is the script's, bit for bit (about
    a sixth of the levels go one step noisier through the script's float32 round trip, kept on purpose)."""
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    grid = _grid(3.0)
    assert torch.equal(grid, scheduler.sigmas) and torch.equal(grid * 1000.0, scheduler.timesteps)
    probe = torch.tensor(KNOWN["roundtrip"]["sigma"], dtype=torch.float32)
    model = grid_sigma_of(probe, grid)
    assert model.tolist() == KNOWN["roundtrip"]["model_sigma"]
    assert 150 < int((model[:1000] > probe[:1000]).sum()) < 180  # the round trip moves some levels up one
    # a policy without a scheduler: the 1000 levels with its defaults' shift
    assert torch.equal(training_grid(SimpleNamespace(defaults={"shift": 3.0})), grid)


PATHS = json.loads((Path(__file__).parent / "known_answers" / "soar_rollout_paths.json").read_text())


def _path_inputs(case, batch):
    """The authors' recorded draws laid out as flowalign holds them: the ODE path's ``u (N, B)``, and per
    stochastic path its noise ``(M-1, B, ...)`` and ``u (M-1, N, B)`` on the active pairs (the rest, unused,
    0), with the active mask (their t1 > 0)."""
    draws = case["inputs"]["draws"]
    t0 = torch.tensor(case["inputs"]["t0"], dtype=torch.float32)
    active = (t0 - 1.0 / case["K"]) > 0
    rows = active.nonzero().squeeze(1)
    u = torch.tensor(draws[0]["values"], dtype=torch.float32)
    extra, n = case["num_rollout_paths"] - 1, case["trajectory_length"]
    noise, path_u = torch.zeros(extra, batch, 2, 2, 2, dtype=torch.float64), torch.zeros(extra, n, batch)
    for p in range(extra):
        assert [draws[1 + 2 * p]["kind"], draws[2 + 2 * p]["kind"]] == ["noise", "u"]
        noise[p, rows] = _f64(draws[1 + 2 * p]["values"])
        path_u[p][:, rows] = torch.tensor(draws[2 + 2 * p]["values"], dtype=torch.float32)
    return t0, u, noise, path_u, active


@pytest.mark.parametrize("case", PATHS["cases"], ids=lambda c: f"{c['sde_rollout_type']}-M{c['num_rollout_paths']}")
def test_stochastic_rollout_paths_equal_the_authors_single_step_aux_points(case):
    """``rollout_paths`` > 1 (their ``num_rollout_paths``) with each ``path_sampler``: every path's points
    (pairs, σ̃, model level, state, target, error), the loss over all of them divided by the points the
    authors count, and its gradient; a pair whose step lands on t = 0 and one at σ = 1 are among them."""
    inp = case["inputs"]
    x0, eps = _f64(inp["x0"]), _f64(inp["eps"])
    batch = x0.shape[0]
    t0, u, noise, path_u, active = _path_inputs(case, batch)
    assert not active.all() and active.any()
    A, b, P = (_f64(inp[k]).requires_grad_(True) for k in ("A", "b", "P"))
    cond, uncond = _f64(inp["cond_pooled"]), _f64(inp["uncond_pooled"])
    grid = _grid(case["shift"])
    sigma, sigma_next = rollout_levels(t0, case["K"], grid)
    assert sigma.tolist() == case["sigma"] and 1.0 in sigma.tolist()
    toy = _toy(A, b, P)

    def velocity(x, s):
        return toy(x, s, cond.repeat(x.shape[0] // batch, 1))

    def guided(x, s):
        v_u, v_c = toy(torch.cat([x, x]), torch.cat([s, s]), torch.cat([uncond.expand(batch, -1), cond])).chunk(2)
        return v_u + case["cfg"] * (v_c - v_u)

    paths = StochasticPaths(case["sde_rollout_type"], case["sde_noise_scale"], noise, path_u, active, float(grid[1]))
    # the points, path by path: the ODE path's for every pair, then each stochastic path's for the active ones
    x_sigma = (1 - sigma.to(x0).reshape(-1, 1, 1, 1)) * x0 + sigma.to(x0).reshape(-1, 1, 1, 1) * eps
    v_hat = rollout_velocity(guided, x_sigma, sigma)
    torch.testing.assert_close(v_hat, _f64(case["v_cfg"]), rtol=1e-6, atol=1e-12)
    states = [off_trajectory_state(v_hat, x_sigma, sigma, sigma_next)]
    states += [stochastic_path_state(paths.kind, v_hat, x_sigma, sigma, sigma_next, noise[p], eta=paths.eta,
                                     sigma_max=paths.sigma_max) for p in range(len(noise))]
    n = case["trajectory_length"]
    for p, (x_hat, draws) in enumerate(zip(states, [u, *path_u])):
        rows = torch.arange(batch) if p == 0 else active.nonzero().squeeze(1)
        sigma_tilde = sigma_next[None] + draws * (1 - sigma_next[None])
        z, v_star = correction_targets(x0, eps, x_hat, sigma_next, sigma_tilde)
        for j in range(n):
            point = case["points"][p * n + j]
            assert point["rows"] == rows.tolist()
            assert sigma_tilde[j, rows].tolist() == point["sigma_tilde"]
            assert (grid_sigma_of(sigma_tilde[j, rows], grid) * 1000.0).tolist() == point["model_timestep"]
            torch.testing.assert_close(z[j, rows], _f64(point["z"]), rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(v_star[j, rows], _f64(point["v_star"]), rtol=1e-6, atol=1e-8)

    loss, info = soar_loss(velocity, guided, x0, eps, sigma, sigma_next, u, lam=case["lambda_aux"],
                           model_sigma=lambda s: grid_sigma_of(s, grid), paths=paths)
    loss.backward()
    all_points = [e for point in case["points"] for e in point["loss_corr"]]
    assert len(all_points) == case["aux_count"]
    torch.testing.assert_close(info["loss_base"].item(), case["loss_main"], rtol=1e-6, atol=0)
    torch.testing.assert_close(info["loss_corr"].item(), float(np.mean(all_points)), rtol=1e-6, atol=0)
    torch.testing.assert_close(loss.item(), case["loss"], rtol=1e-6, atol=0)
    for name, param in zip("AbP", (A, b, P)):
        torch.testing.assert_close(param.grad, _f64(case["grad"][name]), rtol=1e-6, atol=1e-10)


def test_a_pair_off_the_stochastic_paths_adds_nothing_and_an_sde_step_is_cps_at_eta_one():
    """An inactive pair's path points change neither the loss nor its gradient, whatever their noise; the
    ``sde`` step is the ``cps`` step at η = 1 and ignores η; ``flow_sde`` reads σ = 1 as ``sigma_max``."""
    case = PATHS["cases"][0]
    inp = case["inputs"]
    x0, eps = _f64(inp["x0"]), _f64(inp["eps"])
    t0, u, noise, path_u, active = _path_inputs(case, x0.shape[0])
    toy = _toy(*(_f64(inp[k]) for k in ("A", "b", "P")))
    cond = _f64(inp["cond_pooled"])
    v = lambda x, s: toy(x, s, cond.repeat(x.shape[0] // len(cond), 1))  # noqa: E731
    grid = _grid(case["shift"])
    sigma, sigma_next = rollout_levels(t0, case["K"], grid)
    losses = []
    for scale in (0.0, 50.0):  # the inactive pair's noise and draws: zero, or large
        n2, u2 = noise.clone(), path_u.clone()
        n2[:, ~active] = scale
        u2[:, :, ~active] = 0.9 if scale else 0.0
        paths = StochasticPaths("flow_sde", 0.5, n2, u2, active, float(grid[1]))
        losses.append(soar_loss(v, v, x0, eps, sigma, sigma_next, u, lam=1.0, paths=paths)[0].item())
    assert losses[0] == losses[1]
    x_sigma = (1 - sigma.to(x0).reshape(-1, 1, 1, 1)) * x0 + sigma.to(x0).reshape(-1, 1, 1, 1) * eps
    v_hat = v(x_sigma, sigma)
    state = lambda kind, eta, **kw: stochastic_path_state(kind, v_hat, x_sigma, sigma, sigma_next, noise[0], eta=eta,  # noqa: E731
                                                          sigma_max=kw.get("sigma_max", float(grid[1])))
    torch.testing.assert_close(state("sde", 0.3), state("cps", 1.0), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(state("sde", 0.3), state("sde", 0.9))
    at_one = sigma == 1
    assert at_one.any() and not torch.allclose(state("flow_sde", 0.5)[at_one], state("flow_sde", 0.5, sigma_max=0.5)[at_one])
    torch.testing.assert_close(state("flow_sde", 0.5)[~at_one], state("flow_sde", 0.5, sigma_max=0.5)[~at_one])


def test_the_former_averaging_is_base_plus_lambda_times_the_mean_correction():
    """``loss_average: terms`` (the former form) and ``points`` (the authors') differ by how many points the
    corrections count: (B·base + λ·N·B·corr)/(B + λ·N·B) against base + λ·corr."""
    case = KNOWN["cases"][0]
    inp = case["inputs"]
    x0, eps = _f64(inp["x0"]), _f64(inp["eps"])
    t0, u = torch.tensor(inp["t0"], dtype=torch.float32), torch.tensor(inp["u"], dtype=torch.float32)
    toy = _toy(*(_f64(inp[k]) for k in ("A", "b", "P")))
    cond = _f64(inp["cond_pooled"])
    v = lambda x, s: toy(x, s, cond.repeat(x.shape[0] // len(cond), 1))  # noqa: E731
    sigma, sigma_next = rollout_levels(t0, case["K"], _grid(case["shift"]))
    lam, n = 0.5, u.shape[0]
    points, info = soar_loss(v, v, x0, eps, sigma, sigma_next, u, lam=lam)
    terms, _ = soar_loss(v, v, x0, eps, sigma, sigma_next, u, lam=lam, average="terms")
    torch.testing.assert_close(terms.item(), info["loss_base"].item() + lam * info["loss_corr"].item())
    torch.testing.assert_close(points.item(), (info["loss_base"].item() + lam * n * info["loss_corr"].item()) / (1 + lam * n))
    assert abs(points.item() - terms.item()) > 1e-3


def test_continuous_levels_step_in_sigma_and_need_a_floor():
    t = torch.tensor([0.05, 0.5, 0.9])
    sigma, sigma_next = rollout_levels(t, 10, None)
    assert torch.equal(sigma, t) and torch.allclose(sigma_next, torch.tensor([0.0, 0.4, 0.8]))
    shifted, shifted_next = rollout_levels(t, 10, _grid(3.0))
    assert (shifted > t).all() and shifted_next[0] > 0  # the grid shifts and never reaches σ = 0
    from flowalign.trainers import trainer_config

    with pytest.raises(UserError, match="trainer.sigma_min"):
        trainer_config({"name": "soar", "noise_levels": "continuous"})
    _, former = trainer_config({"name": "soar", "noise_levels": "continuous", "sigma_min": 0.05, "loss_average": "terms"})
    assert former.sigma_min == 0.05
    with pytest.raises(UserError, match="trainer.rollout_paths"):  # the flow_sde step reads the grid's second level
        trainer_config({"name": "soar", "noise_levels": "continuous", "sigma_min": 0.05, "rollout_paths": 2})
    _, sft = trainer_config({"name": "sft", "noise_levels": "continuous"})  # no corrections: no target to floor
    assert sft.sigma_min is None


def _state(seed=0, b=6, shape=(4, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    x0, eps = torch.randn(b, *shape, generator=g), torch.randn(b, *shape, generator=g)
    sigma = 0.3 + 0.7 * torch.rand(b, generator=g)
    return g, x0, eps, sigma


def _col(t, like):
    return t.reshape(-1, *([1] * (like.ndim - 1)))


def test_oracle_model_has_no_rollout_error_and_its_target_is_the_sft_target():
    g, x0, eps, t = _state()
    sigma, sigma_prime = rollout_levels(t, 10, _grid(3.0))
    x_sigma = (1 - _col(sigma, x0)) * x0 + _col(sigma, x0) * eps
    oracle = lambda x, s: eps - x0  # noqa: E731  the exact velocity of this pair's straight path
    x_hat = off_trajectory_state(rollout_velocity(oracle, x_sigma, sigma), x_sigma, sigma, sigma_prime)
    on = (1 - _col(sigma_prime, x0)) * x0 + _col(sigma_prime, x0) * eps
    torch.testing.assert_close(x_hat, on, rtol=0, atol=1e-6)  # e = 0
    sigma_tilde = sigma_prime[None] + torch.rand(3, len(sigma), generator=g) * (1 - sigma_prime[None])
    z, v_star = correction_targets(x0, eps, x_hat, sigma_prime, sigma_tilde)
    torch.testing.assert_close(v_star, (eps - x0)[None].expand_as(v_star), rtol=0, atol=1e-5)
    # the same check fails for re-noising toward fresh noise: the target must reuse the pair's ε
    _, v_fresh = correction_targets(x0, torch.randn(x0.shape, generator=g), x_hat, sigma_prime, sigma_tilde)
    assert (v_fresh - (eps - x0)[None]).abs().max() > 0.1


def test_target_minus_sft_target_is_alpha_e_over_sigma_tilde():
    g, x0, eps, t = _state(seed=1)
    sigma, sigma_prime = rollout_levels(t, 5, None)
    x_sigma = (1 - _col(sigma, x0)) * x0 + _col(sigma, x0) * eps
    v_model = torch.randn(x0.shape, generator=g)  # an imperfect model
    x_hat = off_trajectory_state(v_model, x_sigma, sigma, sigma_prime)
    e = x_hat - ((1 - _col(sigma_prime, x0)) * x0 + _col(sigma_prime, x0) * eps)
    assert e.abs().max() > 0.05
    sigma_tilde = sigma_prime[None] + torch.rand(4, len(sigma), generator=g) * (1 - sigma_prime[None])
    _, v_star = correction_targets(x0, eps, x_hat, sigma_prime, sigma_tilde, sigma_min=0.05)
    alpha = (1 - sigma_tilde) / (1 - sigma_prime)[None]
    expected = (alpha / sigma_tilde).reshape(*alpha.shape, 1, 1, 1) * e[None]
    torch.testing.assert_close(v_star - (eps - x0)[None], expected, rtol=0, atol=1e-5)
    # below σ_min the division is by σ_min
    small = torch.full_like(sigma_tilde, 0.01)
    z, v_small = correction_targets(x0, eps, x_hat, sigma_prime.clamp(max=0.0), small, sigma_min=0.05)
    torch.testing.assert_close(v_small, (z - x0[None]) / 0.05)


def _soar_run(tmp_path, model, name, *extra):
    return [f"run.output_dir={tmp_path / name}", f"model.path={model}", "model.finetune=full", "data.bench=vvr",
            "data.level=medium", "data.n=32", "eval.bench=null", "run.progress=false", "run.tensorboard=false",
            "trainer.max_steps=2", "trainer.batch_size=4", "trainer.lr=1e-3", "trainer.rollout_steps=10", "rewards=[]", *extra]


def _grads(trainer):
    trainer.optimizer_step = lambda: 0.0  # keep the gradients for inspection
    trainer.train_step()
    return [p.grad.clone() for p in trainer.params]


def test_lambda_zero_gives_bit_identical_gradients_to_sft(tmp_path, tiny_sd3_dir):
    """SOAR with λ=0 still runs its N correction passes; they must not change a single gradient bit
    (nor the ε, σ and captions the base loss sees)."""
    soar = build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "soar", "trainer.name=soar",
                                                     "trainer.correction_weight=0", "trainer.corrections=3",
                                                     "trainer.caption_dropout=0.25")))
    sft = build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "sft", "trainer.name=sft",
                                                    "trainer.caption_dropout=0.25")))
    a, b = _grads(soar), _grads(sft)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert sum(x.abs().sum() for x in a) > 0
    # and λ > 0 does change them (the test can fail)
    lam1 = build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "soar1", "trainer.name=soar",
                                                     "trainer.corrections=3", "trainer.caption_dropout=0.25")))
    c = _grads(lam1)
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_stochastic_paths_divide_by_the_steps_points_however_the_pairs_are_batched(tmp_path, tiny_sd3_dir):
    """``rollout_paths: 3`` on the tiny model: a step of 4 pairs in batches of 2 gives the gradient of one
    batch of 4 (each batch divided by the step's count, not its own: the pairs on stochastic paths differ
    between batches), the paths change the gradient, and the step logs its pairs on stochastic paths."""
    args = ("trainer.name=soar", "trainer.corrections=2", "trainer.rollout_steps=2", "trainer.rollout_paths=3",
            "trainer.pairs_per_step=4", "run.seed=3")
    whole = build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "whole", *args)))
    batch = whole.collect(0)
    assert batch.paths is not None and 0 < int(batch.paths.active.sum()) < 4  # K = 2: a pair with t < 1/2 takes none
    split = build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "split", *args, "trainer.batch_size=2")))
    ode = build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "ode", *args, "trainer.rollout_paths=1")))
    a, b, c = _grads(whole), _grads(split), _grads(ode)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-7)
    assert not all(torch.allclose(x, y) for x, y in zip(a, c))
    run = build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "run", *args)))
    run.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["train/stochastic_pairs"] <= 1 for r in rows)
    assert rows[0]["cost/forward_passes"] == 4 * (1 + 2 + 2 * 3)


def test_a_detached_clone_of_the_rollout_state_leaves_gradients_unchanged(tiny_sd3_dir):
    import pipelines

    torch.manual_seed(0)
    policy = pipelines.load(tiny_sd3_dir, full_finetune=True)
    g, x0, eps, t = _state(seed=2, b=3, shape=policy.latent_shape)
    grid = training_grid(policy)
    sigma, sigma_next = rollout_levels(t, 5, grid)
    cond = policy.encode(["a red circle", "a blue square", "two green stars"])
    u = torch.rand(2, 3, generator=g)

    def velocity(x, s):
        return policy.velocity(x, s, cond if len(x) == 3 else cond[[0, 1, 2, 0, 1, 2]], 1.0)

    def guided(x, s):
        return policy.velocity(x, s, cond, 4.0)

    def grads(rollout):
        policy.trainable.zero_grad()
        loss, _ = soar_loss(velocity, guided, x0, eps, sigma, sigma_next, u, lam=1.0, rollout=rollout,
                            model_sigma=lambda s: grid_sigma_of(s, grid))
        loss.backward()
        return [p.grad.clone() for p in policy.trainable.parameters() if p.grad is not None]

    def detached_clone(*args):
        return off_trajectory_state(*args).detach().clone()

    a, b = grads(off_trajectory_state), grads(detached_clone)
    assert len(a) == len(b) > 0
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_soar_without_pairs_is_refused(tmp_path, tiny_sd3_dir, prompt_file):
    with pytest.raises(UserError, match="trainer.pairs"):
        build_trainer(load_config(None, small_run(tmp_path / "a", tiny_sd3_dir, prompt_file, "trainer.name=soar")))
    with pytest.raises(UserError, match="does not exist"):
        build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "b", "trainer.name=soar",
                                                  f"trainer.pairs={tmp_path / 'nowhere'}")))
    folder = tmp_path / "pairs"
    folder.mkdir()
    Image.new("RGB", (40, 30), (200, 0, 0)).save(folder / "a.png")  # no a.txt caption
    with pytest.raises(UserError, match="no caption file"):
        build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "c", "trainer.name=soar",
                                                  f"trainer.pairs={folder}")))


def test_a_rollout_step_that_does_not_match_the_sampler_is_flagged(tmp_path, tiny_sd3_dir, capsys):
    """K is the inference step count (the method page): a K that differs from the steps the model samples with
    is named at start-up, with the value to set; a matching K, and SFT (no rollout step), say nothing."""
    build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "k", "trainer.name=soar", "trainer.corrections=1")))
    assert "trainer.rollout_steps=10 but the model samples with 20 steps" in capsys.readouterr().out
    build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "m", "trainer.name=soar", "trainer.corrections=1",
                                              "eval.num_steps=10")))
    build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "s", "trainer.name=sft")))
    assert "warning" not in capsys.readouterr().out


def test_soar_trains_on_rendered_vvr_scenes_and_resumes(tmp_path, tiny_sd3_dir):
    """2 steps, a checkpoint every step, then a resumed run to 3 steps ends where an uninterrupted run does."""
    first = build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "r", "trainer.name=soar",
                                                      "trainer.corrections=2", "run.checkpoint_every=1")))
    before = [p.detach().clone() for p in first.params]
    first.train()
    assert (tmp_path / "r" / "checkpoints" / "step-000002" / "trainable.safetensors").exists()
    assert not all(torch.equal(x, y) for x, y in zip(before, first.params))
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["train/loss_corr"] > 0 and rows[0]["cost/forward_passes"] == 4 * (1 + 2 + 2)

    resumed = build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "r", "trainer.name=soar",
                                                        "trainer.corrections=2", "run.checkpoint_every=1",
                                                        "trainer.max_steps=3")))
    resumed.train()
    straight = build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "s", "trainer.name=soar",
                                                         "trainer.corrections=2", "trainer.max_steps=3")))
    straight.train()
    assert resumed.step == straight.step == 3
    for x, y in zip(resumed.params, straight.params):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_sft_trains_on_a_folder_and_a_jsonl_of_pairs(tmp_path, tiny_sd3_dir):
    folder = tmp_path / "pairs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i, caption in enumerate(["a red circle", "a blue square", "a green star"]):
        Image.fromarray(rng.integers(0, 255, (48, 40, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(caption + "\n")
        rows.append({"image": f"pairs/{i}.png", "caption": caption})
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for source in (folder, tmp_path / "pairs.jsonl"):
        t = build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, f"f{source.suffix}", "trainer.name=sft",
                                                      f"trainer.pairs={source}", "trainer.max_steps=1")))
        assert t.pairs.prompts == ["a red circle", "a blue square", "a green star"]
        t.train()
        assert t.step == 1 and len(t.encoded) == 3


def test_each_step_draws_a_fresh_posterior_sample_of_a_pair_or_takes_its_mean(tmp_path, tiny_sd3_dir):
    """``image_latents: sample`` (the authors' ``latent_dist.sample()`` at every step): x0 = mean + std·ξ, ξ
    keyed by the pair's place in the step's draw, so two steps training the same pair see two samples;
    ``mean`` (the former form) takes the posterior mean, the same at every step."""
    from flowalign.trainers.base import derived_seed

    t = build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "p", "trainer.name=sft")))
    indices = t.step_pairs(0)
    mean, std = t.images.posteriors(indices)
    xi = torch.stack([torch.randn(mean.shape[1:], generator=torch.Generator().manual_seed(
        derived_seed(t.cfg.run.seed, 0, j, 4))) for j in range(len(indices))])
    torch.testing.assert_close(t.collect(0).x0, mean + std * xi, rtol=0, atol=0)
    assert torch.equal(t.latents(indices), mean)
    again = t.clean_latents(1, indices)  # the same pairs at another step: another sample
    assert not torch.allclose(again, t.collect(0).x0)
    t.tcfg = t.tcfg.model_copy(update={"image_latents": "mean"})
    assert torch.equal(t.collect(0).x0, mean) and torch.equal(t.clean_latents(1, indices), mean)


def test_caption_dropout_drops_a_training_batchs_captions_together_or_each_pair_its_own(tmp_path, tiny_sd3_dir,
                                                                                        monkeypatch):
    """``caption_dropout_per: batch`` (the authors' one ``random() < cond_dropout_rate`` a batch): the captions
    of a batch of ``batch_size`` pairs are dropped all together or kept; ``pair``: each on its own draw."""
    import flowalign.trainers.soar as soar

    seen, encode = [], soar.encode_prompts

    def recording(policy, prompts, metadata):
        seen.append(list(prompts))
        return encode(policy, prompts, metadata)

    monkeypatch.setattr(soar, "encode_prompts", recording)
    for per in ("batch", "pair"):
        t = build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, per, "trainer.name=sft",
                                                      "trainer.caption_dropout=0.5", "trainer.batch_size=2",
                                                      "trainer.pairs_per_step=8", f"trainer.caption_dropout_per={per}")))
        seen.clear()
        for step in range(4):
            t.collect(step)
        dropped = [[p == "" for p in prompts] for prompts in seen]
        batches = [d[b:b + 2] for d in dropped for b in range(0, len(d), 2)]
        together = all(len(set(b)) == 1 for b in batches)
        assert together == (per == "batch"), (per, dropped)
        assert 0 < sum(map(sum, dropped)) < sum(map(len, dropped))  # some dropped, some kept


def test_former_option_names_are_read_with_one_deprecation_line_each(capsys, monkeypatch):
    from flowalign.trainers import options, trainer_config

    monkeypatch.setattr(options, "_REPORTED_RENAMES", set())
    former = {"name": "soar", "K": 8, "w_cfg": 3.0, "N": 2, "lam": 0.5}
    for _ in range(2):  # a config is read more than once (check, then the run): said once
        _, tcfg = trainer_config(former)
    assert (tcfg.rollout_steps, tcfg.rollout_guidance, tcfg.corrections, tcfg.correction_weight) == (8, 3.0, 2, 0.5)
    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == sorted(f"warning: trainer.{old} is deprecated and will be removed: write trainer.{new} "
                                   "(same meaning)" for old, new in [("K", "rollout_steps"), ("w_cfg", "rollout_guidance"),
                                                                     ("N", "corrections"), ("lam", "correction_weight")])
    with pytest.raises(UserError, match="trainer.K and trainer.rollout_steps are the same option"):
        trainer_config({"name": "soar", "K": 8, "rollout_steps": 8})
    # micro_batch came with batch_size meaning pairs per step: both keep that meaning
    _, old = trainer_config({"name": "sft", "batch_size": 8, "micro_batch": 2})
    assert (old.step_pairs, old.batch_size) == (8, 2)
    assert "trainer.pairs_per_step: 8" in capsys.readouterr().out
    _, whole = trainer_config({"name": "sft", "batch_size": 6})  # no micro_batch: one forward per step, as before
    assert (whole.step_pairs, whole.batch_size) == (6, 6)


def test_two_ranks_draw_the_pairs_and_noise_of_one_process(tmp_path, tiny_sd3_dir):
    """A pair's caption dropout, ε, σ and σ̃ are keyed by its place in the step's global draw: ranks 0 and 1
    of 2 (2 pairs each) hold what one process drawing 4 pairs holds, and a step's 4 pairs in 2 batches
    of 2 are one optimiser step."""
    # each caption on its own draw: a batch's one draw would depend on the batch size, which differs here
    args = ("trainer.name=soar", "trainer.corrections=2", "trainer.caption_dropout=0.5",
            "trainer.caption_dropout_per=pair")
    one = build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "one", *args)))
    whole = one.collect(1)
    ranks = build_trainer(load_config(None, _soar_run(tmp_path, tiny_sd3_dir, "two", *args, "trainer.pairs_per_step=2",
                                                      "trainer.batch_size=1")))
    parts = []
    for rank in (0, 1):  # the draws of each rank of a 2-process run (collect makes no collective call)
        ranks.rank, ranks.world = rank, 2
        parts.append(ranks.collect(1))
    assert [p for part in parts for p in part.cond.prompts] == whole.cond.prompts
    assert "" in whole.cond.prompts and len(set(whole.cond.prompts)) > 1  # some captions dropped, not all
    for name in ("x0", "eps", "sigma"):
        assert torch.equal(torch.cat([getattr(p, name) for p in parts]), getattr(whole, name))
    assert torch.equal(torch.cat([p.u for p in parts], 1), whole.u)
    assert ranks.plan(parts[0], torch.Generator()).steps == [[slice(0, 1), slice(1, 2)]]
