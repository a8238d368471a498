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
    head_pair_loss,
    pairwise_accuracy,
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


MULTIHEAD = json.loads((Path(__file__).parent / "known_answers" / "lrr_multihead_loss.json").read_text())


def test_several_heads_loss_equals_the_authors_multihead_group_loss():
    """Three heads on pairs (groups of two), each ordered by its own targets (ties leave a pair out; one head
    ties every pair: it adds 0 and still counts): ``head_pair_loss`` with the Thurstone loss equals their
    ``multihead_group_loss``, value and gradient (float32, rtol 1e-5)."""
    sigma = torch.tensor(MULTIHEAD["sigma"])
    live = {h: torch.tensor(p, requires_grad=True) for h, p in MULTIHEAD["predictions"].items()}
    directions = {h: torch.sign(torch.tensor(t)[:, 0] - torch.tensor(t)[:, 1]) for h, t in MULTIHEAD["targets"].items()}
    scores = {h: (p[:, 0], p[:, 1]) for h, p in live.items()}
    loss, _ = head_pair_loss(thurstone_loss, scores, directions, sigma)
    assert loss.item() == pytest.approx(MULTIHEAD["loss"], rel=1e-5)
    loss.backward()
    for h, p in live.items():
        want = torch.tensor(MULTIHEAD["grad"][h])
        torch.testing.assert_close(p.grad if p.grad is not None else torch.zeros_like(want), want, rtol=1e-5, atol=1e-7)


class _TwoHeads(torch.nn.Module):
    """``r_a = x·(1, −1)``, ``r_b = x·(−1, 1)``: two heads that disagree."""

    head_names = ["a", "b"]

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))

    def score_heads(self, x, sigma, cond):
        return {"a": x.flatten(1) @ self.w, "b": -(x.flatten(1) @ self.w)}

    def score(self, x, sigma, cond):
        return self.score_heads(x, sigma, cond)["a"]


def test_pairs_order_each_head_in_its_own_direction_and_save_their_margins(tmp_path):
    """Head b (scoring −r_a) is ordered the other way than head a on the pairs both order: both heads' losses
    then pull together and each head's accuracy is read in its own direction (every ordered pair right, the
    pair a ties counted for b only); the head margins survive save / load / select / cat."""
    encode = lambda prompts: Conditioning({"prompt_embeds": torch.zeros(len(prompts), 1)}, list(prompts))
    chosen, rejected = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0]]), torch.tensor([[0.0, 2.0], [0.0, 1.0], [1.0, 0.0]])
    pairs = PreferencePairs(["p", "q", "r"], chosen, rejected, head_margins={"a": torch.tensor([1.0, 1.0, 0.0]),
                                                                              "b": torch.tensor([-1.0, -1.0, 0.5])})
    assert pairs.directions(["a", "b"])["b"].tolist() == [-1.0, -1.0, 1.0]
    with pytest.raises(UserError, match="the pairs label heads"):
        pairs.directions(["a"])
    pairs.save(tmp_path / "p.safetensors")
    again = PreferencePairs.load(tmp_path / "p.safetensors")
    assert again.heads == ["a", "b"] and torch.equal(again.head_margins["b"], pairs.head_margins["b"])
    both = PreferencePairs.cat([again, pairs.select([2])])
    assert both.head_margins["a"].tolist() == [1.0, 1.0, 0.0, 0.0]
    loss, info = refit_loss(_TwoHeads(), pairs, encode, torch.Generator().manual_seed(0), loss_name="bradley_terry")
    assert 0 <= info["acc_real"] <= 1 and loss.item() > 0
    # with the b margins flipped to a's direction the heads would disagree: the loss is larger
    flipped = PreferencePairs(["p", "q", "r"], chosen, rejected, head_margins={"a": torch.tensor([1.0, 1.0, 0.0]),
                                                                                "b": torch.tensor([1.0, 1.0, 0.0])})
    assert refit_loss(_TwoHeads(), flipped, encode, torch.Generator().manual_seed(0))[0].item() > loss.item()
    accuracy = pairwise_accuracy(_TwoHeads(), pairs, encode)
    assert set(accuracy) == {"a", "b"} and accuracy["a"]["sigma=0.00"] == accuracy["b"]["sigma=0.00"] == 1.0
