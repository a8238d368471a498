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


# --- the authors' batches: σ draw, ε per group, epochs and accumulation, the group loss ----------------------
BATCHES = json.loads((Path(__file__).parent / "known_answers" / "lrr_register_batches.json").read_text())


def _scheduler_grid(shift: float, dynamic: bool = False) -> torch.Tensor:
    """The grid ``authors_grid`` reads off a policy with this scheduler (SD3: shift 3; FLUX.1: dynamic)."""
    from types import SimpleNamespace

    from diffusers import FlowMatchEulerDiscreteScheduler

    from flowalign.trainers.parts.latent_preference import authors_grid

    config = {"use_dynamic_shifting": True, "max_shift": 1.15, "base_shift": 0.5} if dynamic else {"shift": shift}
    return authors_grid(SimpleNamespace(scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **config),
                                        defaults={}))


def _grid_of(case_shift: float) -> torch.Tensor:
    return _scheduler_grid(1.0, dynamic=True) if abs(case_shift - 3.1581929) < 1e-6 else _scheduler_grid(case_shift)


def _within_group_pairs(latents: torch.Tensor) -> PreferencePairs:
    """Every pair (a < b) of each group of ``latents (G, S, ...)``, tagged with its group."""
    chosen, rejected, group = [], [], []
    for g in range(latents.shape[0]):
        for a in range(latents.shape[1]):
            for b in range(a + 1, latents.shape[1]):
                chosen.append(latents[g, a])
                rejected.append(latents[g, b])
                group.append(g)
    return PreferencePairs([f"p{g}" for g in group], torch.stack(chosen), torch.stack(rejected), group=torch.tensor(group))


@pytest.mark.parametrize("case", BATCHES["grids"], ids=lambda c: c["name"])
def test_authors_sigma_is_their_training_grid_level(case):
    """At fixed uniforms, the σ of their ``sample_timesteps`` (uniform weighting): level ⌊1000·u⌋ of the
    scheduler's training grid, pure noise for u < 1/1000, σ(1/1000) at the clean end; SD3's shift 3, shift 1,
    and FLUX.1's dynamic shift pinned at e^1.15 as their ``flux_scheduler_config``. Their timestep is 1000·σ."""
    from flowalign.trainers.parts.latent_preference import authors_sigma

    grid = _grid_of(case["shift"])
    sigma = authors_sigma(torch.tensor(case["uniform"], dtype=torch.float32), grid)
    assert torch.equal(sigma, torch.tensor(case["sigma"]))
    want_t = torch.tensor(case["timesteps"])
    assert torch.equal(sigma if case["name"].startswith("flux") else sigma * 1000, want_t)


@pytest.mark.parametrize("case", BATCHES["draws"], ids=lambda c: c["name"])
def test_authors_draw_is_their_noise_batch(case):
    """Their ``_noise_batch`` on groups of samples, by a CPU generator seeded as their global RNG: one σ and one
    ε per group, shared by every pair the group forms, in their draw order (uniforms, then ε), so the noised
    latents of every sample equal theirs; the pairs form draws σ ~ U(0, 1) per pair instead."""
    from flowalign.trainers.parts.latent_preference import authors_sigma, draw_noise

    latents = torch.tensor(case["latents"])
    pairs = _within_group_pairs(latents)
    grid = _grid_of(case["scheduler"])
    sigma, noise = draw_noise(pairs, torch.Generator().manual_seed(case["seed"]), "authors", grid)
    want_sigma, want_noise = torch.tensor(case["sigma"]), torch.tensor(case["noise"])
    group = pairs.group_ids()
    assert torch.equal(sigma, want_sigma[group]) and torch.equal(noise, want_noise[group])
    assert torch.equal(authors_sigma(torch.tensor(case["uniform"]), grid), want_sigma)
    noisy = torch.tensor(case["noisy"])
    s = sigma.view(-1, 1, 1, 1)
    k = 0
    for g in range(latents.shape[0]):
        for a in range(latents.shape[1]):
            for b in range(a + 1, latents.shape[1]):
                torch.testing.assert_close((1 - s[k]) * pairs.chosen[k] + s[k] * noise[k], noisy[g, a], rtol=0, atol=0)
                torch.testing.assert_close((1 - s[k]) * pairs.rejected[k] + s[k] * noise[k], noisy[g, b], rtol=0, atol=0)
                k += 1
    per_pair, _ = draw_noise(pairs, torch.Generator().manual_seed(case["seed"]), "pairs")
    if case["group_size"] == 2:  # one pair a group: the same uniforms, taken as σ without the grid
        assert torch.equal(per_pair, torch.tensor(case["uniform"])) and not torch.equal(per_pair, sigma)
    else:
        assert len(set(per_pair.tolist())) == len(pairs) > len(set(sigma.tolist()))


def test_authors_steps_are_their_epochs_and_accumulation():
    """Their loop on 21 pairs, micro-batches of 4, global batch 12, 3 epochs, seed 42: each epoch its own
    seeded shuffle, the incomplete micro-batch dropped, three micro-batches a step and the epoch's leftover two
    one more step, each micro-batch's gradient weighted 1/(the step's micro-batches), as ``fit`` weights them."""
    from flowalign.trainers.parts.latent_preference import authors_steps

    sched = BATCHES["schedule"]
    steps = authors_steps(sched["pairs"], epochs=sched["epochs"], batch_size=sched["batch_size"],
                          global_batch=sched["global_batch_size"], seed=sched["seed"])
    assert steps == [s["micro_batches"] for s in sched["steps"]]
    for mine, theirs in zip(steps, sched["steps"]):
        assert 1 / len(mine) == pytest.approx(theirs["gradient_scale"], rel=1e-6)
    with pytest.raises(UserError, match="multiple of the batch size"):
        authors_steps(21, epochs=1, batch_size=4, global_batch=10)


def test_fit_averages_a_steps_micro_batches():
    """One scheduled step of two micro-batches: the parameters move by the mean of the two micro-batches'
    gradients (plain SGD, lr 1), each noised from the step's generator in turn."""
    from flowalign.trainers.parts.latent_preference import authors_grid, fit, refit_loss
    import numpy as np
    from types import SimpleNamespace

    pairs = PreferencePairs(["a", "b", "c", "d"], torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0], [3.0, 0.5]]),
                            torch.tensor([[0.0, 2.0], [1.0, 0.0], [0.5, 2.0], [0.0, 0.0]]), group=torch.tensor([0, 0, 1, 2]))
    encode = lambda prompts: Conditioning({"prompt_embeds": torch.zeros(len(prompts), 1)}, list(prompts))
    grid = authors_grid(SimpleNamespace(defaults={"shift": 3.0}))
    model = _Linear()
    fit(model, pairs, encode, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), loss="thurstone",
        batch_form="authors", grid=grid, schedule=[[[0], [1, 2]]], seed=3)
    replay, grads = _Linear(), []
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence([3, 0]).generate_state(1)[0]))
    for idx in ([0, 1], [2, 3]):  # group 0 is pairs 0 and 1; groups 1 and 2 are pairs 2 and 3
        loss, _ = refit_loss(replay, pairs.select(idx), encode, gen, loss_name="thurstone", batch_form="authors", grid=grid)
        grads.append(torch.autograd.grad(loss, replay.w)[0])
    torch.testing.assert_close(model.w.detach(), _Linear().w.detach() - (grads[0] + grads[1]) / 2)


def test_group_loss_equals_their_multihead_group_loss_on_groups_of_four():
    """Three groups of four samples, three heads (ties, an unscored sample, per-group σ): ``group_head_loss``
    on the groups' pairs (each head ordering the pairs its scores separate) equals their
    ``multihead_group_loss`` @ f251e52, value and gradient: per head the mean over a group's pairs, then over the
    groups, and the heads summed."""
    from flowalign.trainers.parts.latent_preference import group_head_loss

    case = BATCHES["group_loss"]
    live = {h: torch.tensor(p, requires_grad=True) for h, p in case["predictions"].items()}
    targets = {h: torch.tensor(t) for h, t in case["targets"].items()}
    masks = {h: torch.tensor(m) for h, m in case["head_masks"].items()}
    sigma = torch.tensor(case["sigma"])
    index = [(g, a, b) for g in range(3) for a in range(4) for b in range(a + 1, 4)]
    group = torch.tensor([g for g, _, _ in index])
    scores = {h: (p[group, torch.tensor([a for _, a, _ in index])], p[group, torch.tensor([b for _, _, b in index])])
              for h, p in live.items()}
    directions = {}
    for h, t in targets.items():
        d = torch.tensor([float(torch.sign(t[g, a] - t[g, b])) for g, a, b in index])
        valid = torch.tensor([bool(masks[h][g, a] and masks[h][g, b]) for g, a, b in index])
        directions[h] = d * valid
    loss, _ = group_head_loss("thurstone", scores, directions, sigma[group], group)
    assert loss.item() == pytest.approx(case["loss"], rel=1e-6)
    loss.backward()
    for h, p in live.items():
        torch.testing.assert_close(p.grad, torch.tensor(case["grad"][h]), rtol=1e-5, atol=1e-7)


def test_pairs_keep_their_groups_through_select_cat_and_save(tmp_path):
    """Group ids survive save / load / select; cat keeps each part's groups apart; a pair without a group is
    its own."""
    x = torch.zeros(3, 2)
    grouped = PreferencePairs(["p", "p", "q"], x, x.clone(), group=torch.tensor([4, 4, 9]))
    grouped.save(tmp_path / "g.safetensors")
    again = PreferencePairs.load(tmp_path / "g.safetensors")
    assert again.group.tolist() == [4, 4, 9] and again.groups() == [[0, 1], [2]]
    assert again.select([2, 0]).group.tolist() == [9, 4]
    both = PreferencePairs.cat([again, PreferencePairs(["r", "s"], x[:2], x[:2])])
    assert both.group.tolist() == [0, 0, 5, 6, 7] and both.groups() == [[0, 1], [2], [3], [4]]
    assert PreferencePairs(["a", "b"], x[:2], x[:2]).groups() == [[0], [1]]
