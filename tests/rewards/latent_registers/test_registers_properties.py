"""The properties ``docs/methods/latent_registers.md`` asks of latent registers, on each DiT family: the frozen
model's velocity is untouched (fp32, atol 0), gradients reach x and the registers but no DiT parameter,
the reward is invariant to permuting registers (and depends on them), and a saved reward reloads by its
folder alone to the same scores."""

import pytest
import torch

from flowalign.sampling import load_latent_reward
from rewards.latent_registers import LatentRegisters

from .conftest import family_inputs, make_registers

FAMILIES = ["sd3", "flux", "wan"]
GUIDANCE = {"sd3": 1.0, "flux": 3.5, "wan": 1.0}  # no CFG; FLUX's guidance embedding at the reward's value


@pytest.fixture(params=FAMILIES)
def setup(request, policies, tiny_model_dir):
    family = request.param
    policy = policies(family)
    return family, policy, make_registers(family, tiny_model_dir(family), policy)


def test_velocity_with_registers_is_bit_identical_to_the_policy_velocity(setup):
    family, policy, reward = setup
    x, sigma, cond = family_inputs(policy)
    with torch.no_grad():
        v_reg, score = reward.forward_with_velocity(x, sigma, cond)
        v_plain = policy.velocity(x, sigma, cond, GUIDANCE[family])
    torch.testing.assert_close(v_reg, v_plain, atol=0, rtol=0)
    assert score.shape == (3,) and torch.isfinite(score).all()
    assert all(not blk._forward_pre_hooks for blk in reward.family.blocks())  # the hooks are gone afterwards


def test_gradient_reaches_x_and_registers_but_no_dit_parameter(setup):
    _, policy, reward = setup
    x, sigma, cond = family_inputs(policy)
    x.requires_grad_(True)
    reward.score(x, sigma, cond).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert reward.registers.grad.abs().sum() > 0 and all(p.grad is not None for p in reward.head.parameters())
    assert all(p.grad is None for p in reward.transformer.parameters())
    # only registers and head are this module's parameters (what an optimiser and a checkpoint see)
    assert {n.split(".")[0] for n, _ in reward.named_parameters()} == {"registers", "heads"}


def test_invariant_to_permuting_registers_and_dependent_on_them(setup):
    _, policy, reward = setup
    x, sigma, cond = family_inputs(policy)
    with torch.no_grad():
        before = reward.score(x, sigma, cond)
        reward.registers.copy_(reward.registers[torch.tensor([2, 0, 1])])
        permuted = reward.score(x, sigma, cond)
        reward.registers[0].mul_(-1.0)
        changed = reward.score(x, sigma, cond)
    torch.testing.assert_close(permuted, before, atol=1e-5, rtol=1e-5)
    assert (changed - before).abs().max() > 1e-4


def test_save_load_round_trip_by_the_folder_alone(setup, tmp_path):
    family, policy, reward = setup
    x, sigma, cond = family_inputs(policy)
    with torch.no_grad():
        reward.registers.add_(0.1)  # not the initialisation a fresh load would reproduce by itself
        expected = reward.score(x, sigma, cond)
    reward.save(tmp_path / "r")
    loaded = load_latent_reward(tmp_path / "r")  # by the folder's config.json, as --guide loads it
    assert isinstance(loaded, LatentRegisters) and loaded.family.name == family and loaded.layers == reward.layers
    assert loaded.transformer is not reward.transformer  # its own frozen copy of the base model
    with torch.no_grad():
        torch.testing.assert_close(loaded.score(x, sigma, cond), expected, atol=0, rtol=0)
