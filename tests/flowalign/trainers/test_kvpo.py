"""KVPO: branches that attend to random subsets of their KV history, the Trajectory Velocity Energy surrogate
policy and its clipped group-relative update (docs/methods/kvpo.md); the surrogate and its objective against
the authors' trainer (known_answers/kvpo_branch_objective.json)."""

import json
from pathlib import Path

import pytest
import torch

from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.trainers.parts.policy_gradient import clipped_loss
from flowalign.trainers.kvpo import draw_routing, taken_velocities, velocity_energy

from .conftest import small_config
from .resume_check import assert_trains_and_resumes_bit_exactly

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "kvpo_branch_objective.json").read_text())
STREAM = ("trainer.name=kvpo", "trainer.num_steps=2", "model.finetune=lora", "trainer.keep_sink=false")


@pytest.fixture(scope="module")
def far_dir(tiny_model_dir):
    return tiny_model_dir("anyflow_far")


def test_routings_keep_each_chunk_with_its_probability_and_the_sink_when_asked():
    g = torch.Generator().manual_seed(0)
    draws = [draw_routing(6, 0.3, False, g) for _ in range(3000)]
    share = sum(len(d) for d in draws) / (6 * len(draws))
    assert abs(share - 0.3) < 0.02 and all(all(0 <= j < 6 for j in d) for d in draws)
    assert all(0 in draw_routing(6, 0.0, True, g) for _ in range(50))
    assert draw_routing(4, 1.0, False, g) == (0, 1, 2, 3)


def _f64(value) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"floor{c['log_prob_sigma_floor']}-clip{c['clip_range']}")
def test_the_clipped_objective_over_branch_scores_equals_the_authors(case):
    """``_compute_policy_objective_from_logits``: π = softmax of the branch scores, the clipped ratio to π_old,
    −mean over the branches; flowalign's ``clipped_loss`` on the same scores and advantages."""
    log_probs, old = torch.log_softmax(_f64(case["log_pi_theta"]), 0), torch.log_softmax(_f64(case["log_pi_old"]), 0)
    torch.testing.assert_close(torch.exp(log_probs - old), _f64(case["ratio"]), rtol=1e-6, atol=0)
    loss = clipped_loss(log_probs, old, _f64(KNOWN["advantages"]), case["clip_range"])
    torch.testing.assert_close(loss.item(), case["total_loss"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", [c for c in KNOWN["cases"] if c["log_prob_sigma_floor"] == 0],
                         ids=lambda c: f"clip{c['clip_range']}")
def test_the_energy_policy_at_temperature_2_over_T_equals_the_authors_per_step_scores(case):
    """Without their σ floor the authors' branch score ``−Σ_t mse(x0 − x̂0)/(2σ_t²)`` is ``−Σ_t mse_v/2 = −(T/2)·E``
    (x0 = x_t − σ_t·v): the energy policy at τ = 2/T, taken velocities read from the states. Loss and its
    gradient in the policy's velocities equal theirs."""
    sigmas, states = _f64(KNOWN["sigmas"]), _f64(KNOWN["states"])
    steps = len(sigmas) - 1
    u = taken_velocities(states, sigmas)
    torch.testing.assert_close(u, _f64(KNOWN["taken_u"]), rtol=1e-6, atol=1e-12)
    v = _f64(KNOWN["policy_v"]).requires_grad_(True)
    tau = 2 / steps
    log_probs = torch.log_softmax(-velocity_energy(v, u) / tau, 0)
    torch.testing.assert_close(log_probs.detach(), torch.log_softmax(_f64(case["log_pi_theta"]), 0), rtol=1e-6, atol=0)
    old = torch.log_softmax(-velocity_energy(_f64(KNOWN["old_v"]), u) / tau, 0)
    loss = clipped_loss(log_probs, old, _f64(KNOWN["advantages"]), case["clip_range"])
    loss.backward()
    torch.testing.assert_close(loss.item(), case["total_loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(v.grad, _f64(case["grad_v"]), rtol=1e-6, atol=1e-15)


def test_taken_velocities_invert_the_jumps():
    g = torch.Generator().manual_seed(1)
    sigmas = torch.tensor([1.0, 0.7, 0.3, 0.0])
    x0, u = torch.randn(2, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    states = [x0]
    for t in range(3):
        states.append(states[-1] + (sigmas[t + 1] - sigmas[t]) * u[:, t])
    torch.testing.assert_close(taken_velocities(torch.stack(states, 1), sigmas), u)


def test_the_update_moves_the_velocity_field_toward_better_branches():
    g = torch.Generator().manual_seed(2)
    u = torch.randn(4, 2, 6, generator=g)  # 4 branches, 2 steps
    v = torch.randn(2, 6, generator=g, requires_grad=True)  # the policy's (shared-state stand-in) velocities
    advantages = torch.tensor([1.5, 0.5, -0.5, -1.5])
    energy = lambda w: velocity_energy(w.expand(4, -1, -1), u)
    old = torch.log_softmax(-energy(v.detach()) / 0.1, 0)
    (grad,) = torch.autograd.grad(clipped_loss(torch.log_softmax(-energy(v) / 0.1, 0), old, advantages, 0.2), v)
    want = sum(a * 2 * (v.detach() - u[i]) / v.numel() for i, a in enumerate(advantages)) / (4 * 0.1)
    torch.testing.assert_close(grad, want)
    stepped = v.detach() - 0.3 * grad
    assert energy(stepped)[0] < energy(v.detach())[0] and energy(stepped)[3] > energy(v.detach())[3]
    (zero,) = torch.autograd.grad(clipped_loss(torch.log_softmax(-energy(v) / 0.1, 0), old, torch.zeros(4), 0.2), v)
    assert torch.equal(zero, torch.zeros_like(zero))


def test_a_branch_that_keeps_every_entry_has_zero_energy_and_the_first_update_has_ratio_one(tmp_path, far_dir,
                                                                                        prompt_file):
    t = build_trainer(small_config(tmp_path / "run", far_dir, prompt_file, *STREAM, "trainer.keep_prob=0.5"))
    batch = t.collect(0)
    assert len(batch.groups) == 2 and all(g.states.shape[0] == 4 for g in batch.groups)
    kinds = [(group, i, keep == tuple(range(group.chunk))) for group in batch.groups
             for i, keep in enumerate(group.routings)]
    assert {whole for *_, whole in kinds} == {True, False}  # keep_prob 0.5 over 8 branches draws both kinds here
    for group, i, whole in kinds:
        with torch.no_grad():
            e = t.energies(group)[i]
        # a branch that kept everything is the policy's own trajectory; a routed history changed what it did
        assert e < 1e-9 if whole else e > 1e-8
    logs = t.update(batch, torch.Generator().manual_seed(0))
    assert logs["ratio_dev"] < 1e-5 and logs["grad_norm"] > 0


def test_trains_and_resumes_bit_exactly(tmp_path, far_dir, prompt_file):
    assert_trains_and_resumes_bit_exactly(tmp_path, far_dir, prompt_file, *STREAM)


def test_a_model_that_cannot_route_and_a_chunk_without_history_are_refused(tmp_path, far_dir, tiny_wan_dir,
                                                                           prompt_file):
    with pytest.raises(UserError, match="routes a streaming"):
        build_trainer(small_config(tmp_path / "a", tiny_wan_dir, prompt_file, *STREAM))
    with pytest.raises(UserError, match="route_chunks"):
        build_trainer(small_config(tmp_path / "b", far_dir, prompt_file, *STREAM, "trainer.route_chunks=[0]"))
