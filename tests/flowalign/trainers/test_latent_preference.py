"""The register's pair losses: the Thurstone loss equals Guanys-dar/latent-reward-register's
``dina_thurstone_loss`` (losses.py @ 0b10a8a) on groups of two, value and gradient, at rtol 1e-6 in float64."""

import json
from pathlib import Path

import pytest
import torch

from flowalign.errors import UserError
from flowalign.protocols import Conditioning
from flowalign.trainers.parts.latent_preference import (
    PreferencePairs,
    refit_loss,
    thurstone_loss,
)

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "rg_opd_register_loss.json").read_text())


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: c["name"])
def test_thurstone_loss_and_gradient_equal_the_authors(case):
    r_w = torch.tensor(case["r_chosen"], dtype=torch.float64, requires_grad=True)
    r_l = torch.tensor(case["r_rejected"], dtype=torch.float64, requires_grad=True)
    loss = thurstone_loss(r_w, r_l, torch.tensor(case["sigma"], dtype=torch.float64))
    g_w, g_l = torch.autograd.grad(loss, (r_w, r_l))
    assert loss.item() == pytest.approx(case["loss"], rel=1e-6)
    torch.testing.assert_close(g_w, torch.tensor(case["grad_chosen"], dtype=torch.float64), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(g_l, torch.tensor(case["grad_rejected"], dtype=torch.float64), rtol=1e-6, atol=1e-12)


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))

    def score(self, x, sigma, cond):
        return x.flatten(1) @ self.w


def test_refit_loss_takes_the_named_pair_loss():
    """The same draw under both losses: the Thurstone one is bounded in [0, 1]; an unknown name is refused."""
    pairs = PreferencePairs(["a", "b"], torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([[0.0, 2.0], [1.0, 0.0]]))
    encode = lambda prompts: Conditioning({"prompt_embeds": torch.zeros(len(prompts), 1)}, list(prompts))
    out = {name: refit_loss(_Linear(), pairs, encode, torch.Generator().manual_seed(0), loss_name=name)[0].item()
           for name in ("bradley_terry", "thurstone")}
    assert 0 <= out["thurstone"] <= 1 and out["thurstone"] != out["bradley_terry"]
    with pytest.raises(UserError, match="pair loss 'hinge'"):
        refit_loss(_Linear(), pairs, encode, torch.Generator().manual_seed(0), loss_name="hinge")
