"""Tiny random SD3 (with an SD3.5 dual-attention block), FLUX (one double-, one single-stream block) and
Wan transformers carrying latent registers, and inputs in each family's policy convention."""

import pytest
import torch

import pipelines
from rewards.latent_registers import LatentRegisters, family_options_for, load_frozen_transformer

PROMPTS = ["a red circle moving up", "a blue square", "two green stars"]


@pytest.fixture(scope="module")
def policies(tiny_model_dir):
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = pipelines.load(tiny_model_dir(family))
        return cache[family]

    return get


def make_registers(family: str, model_dir, policy, num_registers: int = 3) -> LatentRegisters:
    transformer = load_frozen_transformer(str(model_dir), model_dir)
    layers = {"sd3": "multi", "flux": [0, 1], "wan": "multi"}[family]
    return LatentRegisters(transformer, num_registers=num_registers, layers=layers, head_hidden=16,
                           base_model=str(model_dir), seed=3, family_options=family_options_for(transformer, policy))


@pytest.fixture
def policy(request, policies):
    """The tiny policy of the test module's ``FAMILY``."""
    return policies(request.module.FAMILY)


@pytest.fixture
def reward(request, policy, tiny_model_dir):
    """Random registers on the frozen transformer of the test module's ``FAMILY`` (SD3: 4 registers)."""
    family = request.module.FAMILY
    return make_registers(family, tiny_model_dir(family), policy, num_registers=4 if family == "sd3" else 3)


def family_inputs(policy, b: int = 3, seed: int = 0):
    """``(x, σ, cond)``: random latents of the policy's shape, σ = 0.9 / 0.5 / 0.2, encoded prompts."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, *policy.latent_shape, generator=gen)
    return x, torch.tensor([0.9, 0.5, 0.2][:b]), policy.encode(PROMPTS[:b])
