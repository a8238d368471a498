"""The timestep a policy's transformer reads (flowalign/sampling/timesteps.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flowalign.errors import UserError
from flowalign.sampling.timesteps import fixed, integer_timestep, model_timestep, truncated


class Recorder(torch.nn.Module):
    def forward(self, *, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        return timestep


def test_the_two_integer_forms_differ_where_the_float32_product_rounds_up():
    """σ = 0.278 in float32 is 0.27799999713…: the float32 product 1000·σ rounds to 278.0 (trunc 278, the
    authors' rollout form), the double-precision product is 277.99999… (int 277, their anchor and fit form)."""
    sigma = torch.tensor(0.278)
    assert truncated(sigma * 1000.0).item() == 278.0
    assert integer_timestep(sigma.item()) == 277
    assert torch.full([1], sigma * 1000, dtype=torch.long).item() == 278  # their pipeline_with_logprob
    assert torch.full([1], float(sigma) * 1000, dtype=torch.long).item() == 277  # their OPA block


def test_model_timestep_rewrites_the_keyword_only_inside_the_block():
    policy = SimpleNamespace(transformer=Recorder())
    t = torch.tensor([960.1293, 278.0488])
    with model_timestep(policy, truncated):
        assert policy.transformer(hidden_states=t, timestep=t).tolist() == [960.0, 278.0]
    with model_timestep(policy, fixed(277)):
        assert policy.transformer(hidden_states=t, timestep=t).tolist() == [277.0, 277.0]
    assert torch.equal(policy.transformer(hidden_states=t, timestep=t), t)


def test_a_policy_without_a_transformer_module_is_refused():
    with pytest.raises(UserError, match="continuous"):
        with model_timestep(SimpleNamespace(), truncated):
            pass


def test_a_transformer_that_reads_sigma_itself_reads_the_integer_form_over_1000():
    """FLUX's transformer reads σ (it scales by 1000 inside): it reads ``form(1000·σ) / 1000``, as DanceGRPO's FLUX
    script feeds it ``timesteps / 1000`` of its integer timesteps; a timestep that is neither ``1000·σ`` nor σ is
    refused."""
    policy = SimpleNamespace(transformer=Recorder(), family="flux")
    sigma = torch.tensor([0.7, 0.7])
    with model_timestep(policy, truncated, 0.7):
        read = policy.transformer(hidden_states=sigma, timestep=sigma)
    theirs = torch.full([2], int(torch.tensor(0.7) * 1000), dtype=torch.long) / 1000
    assert read.dtype == torch.float32 and torch.equal(read, theirs)
    odd = torch.tensor([0.6993, 0.6993])  # trunc(699.3) = 699
    with model_timestep(policy, truncated, 0.6993):
        assert torch.equal(policy.transformer(hidden_states=odd, timestep=odd), torch.tensor([699, 699]) / 1000)
    with model_timestep(policy, fixed(277), 0.7):
        assert policy.transformer(hidden_states=sigma, timestep=sigma).tolist() == pytest.approx([0.277, 0.277])
    reads_1000_sigma = SimpleNamespace(transformer=Recorder(), family="sd3")  # each transformer reads one scale
    with model_timestep(reads_1000_sigma, truncated, 0.7):
        assert reads_1000_sigma.transformer(hidden_states=sigma, timestep=sigma * 1000).tolist() == [700.0, 700.0]
    odd = SimpleNamespace(transformer=Recorder(), family="odd")
    with pytest.raises(UserError, match="neither 1000\\*sigma, sigma nor 1 - sigma.*trainer.model_timestep: continuous"):
        with model_timestep(odd, truncated, 0.7):
            odd.transformer(hidden_states=sigma, timestep=sigma * 10)


def test_the_scale_is_read_once_per_transformer():
    """What a transformer reads (1000·σ or σ) is learnt at its first call under a form and kept: later calls read
    no value back (each would make the host wait on a GPU), even in later blocks."""
    from flowalign.sampling import timesteps

    policy = SimpleNamespace(transformer=Recorder(), family="flux")
    sigma = torch.tensor([0.5])
    with model_timestep(policy, truncated, 0.5):
        policy.transformer(hidden_states=sigma, timestep=sigma)
    assert timesteps._SCALES[policy.transformer] == 1.0
    with model_timestep(policy, truncated, 0.25):  # no check now: the scale is known
        assert policy.transformer(hidden_states=sigma, timestep=torch.tensor([0.2509])).tolist() == \
            pytest.approx([0.25])
    tiny = SimpleNamespace(transformer=Recorder(), family="sd3")
    with model_timestep(tiny, truncated, 1e-4):  # 1000·σ and σ alike: nothing learnt
        tiny.transformer(hidden_states=sigma, timestep=torch.tensor([0.1]))
    assert tiny.transformer not in timesteps._SCALES
