"""FestDPO (docs/methods/festdpo.md): the paper's equations on worked numbers (the KDE log-likelihood of Eq. 7,
the loss of Eq. 8 and its gradient with one and two bandwidths, the mean over pairs); the toy optima, trained
with the trainer's own loss; the KDE pieces; θ = ref gives log 2; bad input; short real runs (online and
offline pairs, encoder features) with resume."""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer, check_run
from flowalign.trainers.festdpo import (FestDPOConfig, bradley_terry_pairs, festdpo_loss, kde_bandwidth,
                                        kde_log_density)

from .conftest import small_run


def _train_toy(generator_fn, params, reward, *, K, h2, beta=1.0, iters=600, pairs=128, candidates=64, lr=3e-2, seed=0, probe=None):
    """Online FestDPO on a 1-D toy: samples of G_θ with common noises, BT labels from ``reward`` on
    fresh θ samples, the trainer's loss. Returns ``probe()`` averaged over the second half."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(params, lr=lr)
    seen = []
    for it in range(iters):
        z = torch.randn(K, 1, generator=g)
        x, x_ref = generator_fn(z, params), generator_fn(z, None)
        with torch.no_grad():
            y = generator_fn(torch.randn(candidates, 1, generator=g), params)
        win, lose = bradley_terry_pairs(reward(y[:, 0]), torch.ones(candidates, dtype=torch.bool), g, 1.0, pairs)
        loss, _ = festdpo_loss(x, x_ref, y[win], y[lose], h2, beta)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if it >= iters // 2:
            seen.append(probe(g))
    return np.mean(seen, axis=0)


def test_tilted_gaussian_optimum():
    """G_ref(z)=z, G_θ(z)=μ+s·z, r(x)=a·x: μ* = a(1+h²)/β, s* = 1 (the smoothed tilted target)."""
    mu, log_s = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)

    def gen(z, params):
        return z if params is None else params[0] + params[1].exp() * z

    a, h2 = 1.0, 0.5
    mean_mu, mean_s = _train_toy(gen, [mu, log_s], lambda y: a * y, K=256, h2=h2, iters=700,
                                 probe=lambda g: (mu.item(), log_s.exp().item()))
    assert abs(mean_mu - a * (1 + h2)) < 0.08, mean_mu  # 1.5; the unsmoothed a/β = 1 or a wrong sign fail
    assert abs(mean_s - 1.0) < 0.12, mean_s


def test_two_mode_weights_follow_the_tilted_reference():
    """A two-mode reference; r = ±a on the two modes: the positive mode's weight → σ(2a/β) (0.73 from 0.5)."""
    b, log_s = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)

    def gen(z, params):
        shift, scale = (0.0, 1.0) if params is None else (params[0], params[1].exp())
        return 2 * torch.tanh(3 * (scale * z + shift))

    a = 0.5
    probe = lambda g: (gen(torch.randn(4096, 1, generator=g), [b, log_s]) > 0).float().mean().item()  # noqa: E731
    weight = _train_toy(gen, [b, log_s], lambda y: a * torch.sign(y), K=128, h2=0.1, probe=probe)
    assert abs(weight - 1 / (1 + math.exp(-2 * a))) < 0.05, weight


def test_bandwidth_is_the_median_heuristic_of_the_reference_and_detached():
    g = torch.Generator().manual_seed(0)
    x_ref = torch.randn(9, 5, generator=g, requires_grad=True)
    d2 = [((x_ref[i] - x_ref[j]) ** 2).sum().item() for i in range(9) for j in range(i + 1, 9)]
    assert kde_bandwidth(x_ref).item() == pytest.approx(float(np.median(d2)) / (2 * math.log(10)), rel=1e-6)
    assert not kde_bandwidth(x_ref).requires_grad


def test_gradient_flows_only_through_the_policy_samples():
    g = torch.Generator().manual_seed(1)
    x, x_ref = torch.randn(8, 3, generator=g, requires_grad=True), torch.randn(8, 3, generator=g, requires_grad=True)
    y_w, y_l = torch.randn(4, 3, generator=g, requires_grad=True), torch.randn(4, 3, generator=g, requires_grad=True)
    loss, _ = festdpo_loss(x, x_ref, y_w, y_l, torch.tensor(0.7, requires_grad=True), 1.0)
    loss.backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert x_ref.grad is None and y_w.grad is None and y_l.grad is None
    # θ = ref: every implicit reward is 0, the loss is log 2
    same, info = festdpo_loss(x_ref, x_ref, y_w, y_l, 0.7, 1.0)
    assert same.item() == pytest.approx(math.log(2), abs=1e-7)
    assert info["pref_accuracy"] == 0.5  # a tied margin ranks neither way


def test_leave_one_out_density_drops_exactly_that_sample():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 2, generator=g)
    y = x[[1, 4]]
    loo = kde_log_density(y, x, 0.3, exclude=torch.tensor([1, -1]))
    assert loo[0].item() == pytest.approx(kde_log_density(y[:1], x[[0, 2, 3, 4, 5]], 0.3)[0].item(), abs=1e-6)
    assert loo[1].item() == pytest.approx(kde_log_density(y[1:], x, 0.3)[0].item(), abs=1e-6)


def test_bradley_terry_labels_follow_the_reward_and_skip_ties():
    g = torch.Generator().manual_seed(3)
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.5])
    valid = torch.tensor([True, True, True, False])
    win, lose = bradley_terry_pairs(rewards, valid, g, temperature=1e-3, max_pairs=10)
    assert sorted(zip(win.tolist(), lose.tolist())) == [(1, 0), (2, 0)]  # (1,2) tie and invalid 3 left out
    wins = 0
    for _ in range(2000):
        w, _ = bradley_terry_pairs(torch.tensor([0.0, 1.0]), torch.ones(2, dtype=torch.bool), g, 1.0, 1)
        wins += int(w.item() == 1)
    assert abs(wins / 2000 - 1 / (1 + math.exp(-1))) < 0.03


REDNESS = "tests.flowalign.trainers.toy_rewards:redness"


def _fest_run(tmp_path, model, prompt_file, name, *extra):
    return small_run(tmp_path / name, model, prompt_file, "trainer.name=festdpo", "trainer.K=8",
                     "trainer.num_steps=2", "trainer.prompts_per_step=2", "trainer.pairs_per_prompt=4",
                     "trainer.lr=1e-3", *extra)


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_at_the_start_policy_equals_reference_and_the_bandwidth_stays_fixed(tmp_path, tiny_sd3_dir, prompt_file,
                                                                           finetune):
    t = build_trainer(load_config(None, _fest_run(tmp_path, tiny_sd3_dir, prompt_file, finetune,
                                                  f"model.finetune={finetune}")))
    t.optimizer_step = lambda: 0.0
    logs = t.train_step()
    assert logs["train/dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)  # common noises: X = X_ref exactly
    assert logs["train/prompts_with_pairs"] == 2
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in t.params)
    h2 = t.bandwidth(None).clone()
    with torch.no_grad():
        for p in t.params:
            p.add_(0.05 * torch.randn_like(p))
    z = t.policy.initial_noise(8, torch.Generator().manual_seed(0))
    cond = t.policy.encode(["a red circle"] * 8)
    with torch.no_grad():
        moved = t.features(t.generate(z, cond))
        with t.reference():
            ref = t.features(t.generate(z, cond))
        assert not torch.equal(moved, ref)
        with t.reference():  # the reference is unchanged by training, and the live weights come back
            assert torch.equal(ref, t.features(t.generate(z, cond)))
        assert torch.equal(moved, t.features(t.generate(z, cond)))
    t._h2 = None
    assert torch.equal(t.bandwidth(None), h2)  # recomputed from the reference: the same value


def test_bad_input_is_refused_before_training(tmp_path, tiny_sd3_dir, prompt_file):
    with pytest.raises(UserError, match="K=4 is too small"):
        build_trainer(load_config(None, _fest_run(tmp_path, tiny_sd3_dir, prompt_file, "k", "trainer.K=4")))
    with pytest.raises(UserError, match="bandwidth_h2 pins one h"):
        build_trainer(load_config(None, _fest_run(tmp_path, tiny_sd3_dir, prompt_file, "b", "trainer.bandwidth_h2=1.0",
                                                  "trainer.bandwidth=per_step")))
    img = tmp_path / "w.png"
    Image.new("RGB", (32, 32), (255, 0, 0)).save(img)
    pairs = tmp_path / "prefs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a red circle", "chosen": "w.png", "rejected": "missing.png"}) + "\n")
    with pytest.raises(UserError, match="missing.png does not exist"):
        build_trainer(load_config(None, _fest_run(tmp_path, tiny_sd3_dir, prompt_file, "m", f"trainer.pairs={pairs}")))


def test_online_run_with_checkpoint_and_resume(tmp_path, tiny_sd3_dir, prompt_file):
    extra = ("model.finetune=full", "run.checkpoint_every=1")
    first = build_trainer(load_config(None, _fest_run(tmp_path, tiny_sd3_dir, prompt_file, "r", *extra)))
    before = [p.detach().clone() for p in first.params]
    first.train()
    assert not all(torch.equal(x, y) for x, y in zip(before, first.params))
    assert (tmp_path / "r" / "checkpoints" / "step-000002" / "trainable.safetensors").exists()
    resumed = build_trainer(load_config(None, _fest_run(tmp_path, tiny_sd3_dir, prompt_file, "r", *extra,
                                                        "trainer.max_steps=3")))
    resumed.train()
    straight = build_trainer(load_config(None, _fest_run(tmp_path, tiny_sd3_dir, prompt_file, "s", *extra[:1],
                                                         "trainer.max_steps=3")))
    straight.train()
    assert resumed.step == straight.step == 3
    for x, y in zip(resumed.params, straight.params):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_offline_pairs_in_chunks_with_pixel_features(tmp_path, tiny_sd3_dir, prompt_file):
    rng = np.random.default_rng(0)
    rows = []
    for i, prompt in enumerate(["a red circle", "a blue square"]):
        for kind in ("chosen", "rejected"):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(tmp_path / f"{kind}{i}.png")
        rows.append({"prompt": prompt, "chosen": f"chosen{i}.png", "rejected": f"rejected{i}.png"})
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for feature in ("latent_pool", "pixels"):
        t = build_trainer(load_config(None, _fest_run(tmp_path, tiny_sd3_dir, prompt_file, feature,
                                                      f"trainer.pairs={tmp_path / 'prefs.jsonl'}", "trainer.chunk=3",
                                                      f"trainer.feature={feature}", "trainer.feature_size=4",
                                                      "trainer.max_steps=1")))
        t.optimizer_step = lambda: 0.0
        logs = t.train_step()
        assert logs["train/prompts_with_pairs"] == 2 and logs["train/dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in t.params)


def test_chunked_backward_gives_the_full_gradient(tmp_path, tiny_sd3_dir, prompt_file):
    """The loss on detached features, then regenerated chunks back-propagated: the same gradient as one pass."""
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "c.png")
    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "r.png")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a red circle", "chosen": "c.png", "rejected": "r.png"}) + "\n")
    grads = []
    for chunk in ("null", "3"):
        t = build_trainer(load_config(None, _fest_run(tmp_path, tiny_sd3_dir, prompt_file, f"c{chunk}",
                                                      f"trainer.pairs={tmp_path / 'p.jsonl'}", f"trainer.chunk={chunk}",
                                                      "trainer.prompts_per_step=1", "trainer.bandwidth_scale=4")))
        t.optimizer_step = lambda: 0.0
        t.train_step()
        grads.append([p.grad.clone() for p in t.params])
    assert sum(g.abs().sum() for g in grads[0]) > 0
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_a_pinned_bandwidth_replaces_the_median_heuristic(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(load_config(None, _fest_run(tmp_path, tiny_sd3_dir, prompt_file, "full",
                                                  "trainer.bandwidth_h2=8.0", "trainer.bandwidth_scale=2.0")))
    heuristic = t.calibrate_bandwidth()
    assert t.bandwidth(None).item() == pytest.approx(16.0)  # scale × the pinned value, not the heuristic's
    assert heuristic.item() != pytest.approx(8.0)
    logs = t.train_step()
    assert logs["train/h2"] == pytest.approx(16.0)


# ------------------------------------------------------------------ the paper's equations on worked numbers


def test_kde_log_likelihood_by_hand():
    """Eq. 7 / Eq. 21 with a Gaussian kernel: samples 0, 1, 3, the point y = 1, h² = 0.5 (2h² = 1):
    log((e^-1 + e^0 + e^-4) / 3) = -0.77205 (the kernel's h^-d (2π)^-d/2 cancels in every ratio of Eq. 8)."""
    x = torch.tensor([[0.0], [1.0], [3.0]])
    got = kde_log_density(torch.tensor([[1.0]]), x, 0.5)
    expected = math.log((math.exp(-1) + math.exp(0) + math.exp(-4)) / 3)
    assert expected == pytest.approx(-0.7720496474, abs=1e-9)
    assert got.item() == pytest.approx(expected, abs=1e-6)
    # in two dimensions the squared distance sums the coordinates: ‖(1, 1) − (0, 0)‖² = 2
    two = kde_log_density(torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 0.0], [1.0, 1.0]]), 0.5)
    assert two.item() == pytest.approx(math.log((math.exp(-2) + 1) / 2), abs=1e-6)


def test_median_heuristic_by_hand():
    """The [derived] default bandwidth: reference samples 0, 1, 3 have squared distances 1, 9, 4; their median
    4 over 2·log(K + 1) = 2·log 4 gives h² = 1.4427."""
    assert kde_bandwidth(torch.tensor([[0.0], [1.0], [3.0]])).item() == pytest.approx(4 / (2 * math.log(4)), rel=1e-6)


def _hand_margin_and_gradient(x, x_ref, y_w, y_l, h2, beta):
    """Eq. 8's margin for one 1-D pair and d(-log σ(margin))/dx_k, written out term by term: the margin
    β[log Σ_k e^{-(y_w-x_k)²/2h²} − log Σ_k e^{-(y_w-x^ref_k)²/2h²} − (the same at y_l)] (the 1/K cancels), and
    d margin/dx_k = β[w_k(y_w)(y_w − x_k) − w_k(y_l)(y_l − x_k)]/h² with w_k(y) the softmax weight of sample k
    in y's policy KDE; dL/d margin = −σ(−margin)."""
    def lse(y, xs):
        return math.log(sum(math.exp(-(y - v) ** 2 / (2 * h2)) for v in xs))

    def weights(y):
        e = [math.exp(-(y - v) ** 2 / (2 * h2)) for v in x]
        return [w / sum(e) for w in e]

    margin = beta * (lse(y_w, x) - lse(y_w, x_ref) - lse(y_l, x) + lse(y_l, x_ref))
    ww, wl = weights(y_w), weights(y_l)
    dmargin = [beta * (ww[k] * (y_w - x[k]) - wl[k] * (y_l - x[k])) / h2 for k in range(len(x))]
    sig = 1 / (1 + math.exp(margin))  # σ(−margin)
    return margin, math.log1p(math.exp(-margin)), [-sig * d for d in dmargin]


def test_loss_and_gradient_by_hand_one_and_two_bandwidths():
    """Policy samples (0.5, 2), reference samples (0, 1.5) from the same noises, y_w = 0, y_l = 2, β = 1.
    h² = 0.5 (2h² = 1): the policy's log-ratio log(e^-0.25 + e^-4) − log(1 + e^-2.25) = −0.32696, and the
    reference's, log(1 + e^-2.25) − log(e^-4 + e^-0.25), is its negative, so margin = 2·(−0.32696) = −0.65392
    and loss = log(1 + e^0.65392) = 1.07263. h² = 2: margin −0.36596, loss 0.89277. Two bandwidths: the loss
    and its gradient are the two averaged (App. E.1), not summed, not one kernel of the mean width."""
    x_list, ref_list = [0.5, 2.0], [0.0, 1.5]
    x = torch.tensor(x_list, dtype=torch.float64)[:, None].requires_grad_()
    ref = torch.tensor(ref_list, dtype=torch.float64)[:, None]
    y_w, y_l = torch.tensor([[0.0]], dtype=torch.float64), torch.tensor([[2.0]], dtype=torch.float64)
    m1, l1, g1 = _hand_margin_and_gradient(x_list, ref_list, 0.0, 2.0, 0.5, 1.0)
    m2, l2, g2 = _hand_margin_and_gradient(x_list, ref_list, 0.0, 2.0, 2.0, 1.0)
    assert (m1, l1) == (pytest.approx(2 * -0.3269610945), pytest.approx(1.0726339876))
    assert (m2, l2) == (pytest.approx(-0.3659581480), pytest.approx(0.8927743343))

    loss, info = festdpo_loss(x, ref, y_w, y_l, 0.5, 1.0)
    (grad,) = torch.autograd.grad(loss, x)
    assert loss.item() == pytest.approx(l1, abs=1e-12) and info["margin"].item() == pytest.approx(m1, abs=1e-12)
    torch.testing.assert_close(grad[:, 0], torch.tensor(g1, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert grad[0, 0] > 0  # the policy sample at 0.5 is pulled toward y_w = 0 (gradient descent lowers it)

    loss2, info2 = festdpo_loss(x, ref, y_w, y_l, torch.tensor([0.5, 2.0], dtype=torch.float64), 1.0)
    (grad2,) = torch.autograd.grad(loss2, x)
    assert loss2.item() == pytest.approx((l1 + l2) / 2, abs=1e-12)
    assert info2["dpo_loss"].item() == pytest.approx((l1 + l2) / 2, abs=1e-12)
    averaged = torch.tensor([(a + b) / 2 for a, b in zip(g1, g2)], dtype=torch.float64)
    torch.testing.assert_close(grad2[:, 0], averaged, rtol=1e-10, atol=1e-12)

    # β scales the margin: β = 0.5 halves it
    half, _ = festdpo_loss(x, ref, y_w, y_l, 0.5, 0.5)
    assert half.item() == pytest.approx(math.log1p(math.exp(-m1 / 2)), abs=1e-12)


def test_the_loss_sums_or_averages_over_pairs_by_hand():
    """Two pairs of one prompt: (y_w, y_l) = (0, 2) and (2, 0) have margins m and −m, so their losses are
    log(1 + e^{−m}) and log(1 + e^{m}); ``sum`` adds them, ``mean`` halves the sum."""
    x, ref = torch.tensor([[0.5], [2.0]]), torch.tensor([[0.0], [2.0]])
    y_w, y_l = torch.tensor([[0.0], [2.0]]), torch.tensor([[2.0], [0.0]])
    m = -0.3269610945
    pair_losses = math.log1p(math.exp(-m)) + math.log1p(math.exp(m))
    total, _ = festdpo_loss(x, ref, y_w, y_l, 0.5, 1.0, reduction="sum")
    mean, info = festdpo_loss(x, ref, y_w, y_l, 0.5, 1.0)
    assert total.item() == pytest.approx(pair_losses, abs=1e-5)
    assert mean.item() == pytest.approx(pair_losses / 2, abs=1e-5) and info["pref_accuracy"].item() == 0.5


# ------------------------------------------------------------------ the paper's forms in the trainer


def test_the_paper_forms_are_the_defaults_and_the_tiny_recipe_pins_the_former():
    import yaml

    cfg = FestDPOConfig()
    assert (cfg.loss_mean, cfg.K, cfg.bandwidths) == ("pairs", 12, None)
    assert FestDPOConfig.former_forms()[0] == {"loss_mean": "prompts"}
    recipe = yaml.safe_load(open("configs/tiny/festdpo_vvr.yaml"))["trainer"]
    assert FestDPOConfig.pinned_former_forms(recipe) == {"loss_mean": "pairs"}


def test_bandwidths_are_squared_scaled_and_averaged_over(tmp_path, tiny_sd3_dir, prompt_file):
    """``bandwidths: [0.5, 1.0]`` with bandwidth_scale 2: h² = 2·(0.25, 1) = (0.5, 2), used as they are (no
    median heuristic), and the step's loss is the two kernels' losses averaged."""
    t = build_trainer(load_config(None, _fest_run(tmp_path, tiny_sd3_dir, prompt_file, "bw",
                                                  "trainer.bandwidths=[0.5, 1.0]", "trainer.bandwidth_scale=2.0")))
    torch.testing.assert_close(t.bandwidth(None), torch.tensor([0.5, 2.0]))
    t.optimizer_step = lambda: 0.0
    logs = t.train_step()
    assert logs["train/h2"] == pytest.approx(1.25)
    assert logs["train/dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)  # θ = ref at the start, each kernel
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in t.params)


def test_loss_mean_pairs_weighs_every_pair_of_the_step_alike(tmp_path, tiny_sd3_dir, prompt_file):
    """The same draws under both forms: a prompt with M_n of the step's M pairs gets ``p·M_n/M`` times the
    ``prompts`` form's gradient (each prompt's mean over its pairs / p) under ``pairs`` (the sum over its pairs
    / M), and the plan sums the ranks' gradients."""
    extra = ("model.finetune=full", "trainer.pairs_per_prompt=6")
    batches, counts = {}, []

    def fewer_for_the_first_prompt(pick):
        def pairs(*args):  # the first prompt keeps 2 of its pairs, so the two prompts' counts differ
            out = pick(*args)
            if out is not None and not counts:
                out = {k: v[:2] for k, v in out.items()}
            counts.append(len(out["y_w"]))
            return out
        return pairs

    for form in ("pairs", "prompts"):
        counts.clear()
        t = build_trainer(load_config(None, _fest_run(tmp_path, tiny_sd3_dir, prompt_file, form, *extra,
                                                      f"trainer.loss_mean={form}")))
        with torch.no_grad():  # a moved policy: the loss is not the flat log 2 of θ = ref
            for q in t.params:
                q.add_(0.02 * torch.randn(q.shape, generator=torch.Generator().manual_seed(5)))
        t.preference_pairs = fewer_for_the_first_prompt(t.preference_pairs)
        batches[form] = (t, t.collect(0))
    (t, by_pairs), (_, by_prompts) = batches["pairs"], batches["prompts"]
    used = list(counts)
    assert used == [2, 6] and by_pairs.pairs == 8
    plan = t.plan(by_pairs, torch.Generator())
    assert plan.global_weights and len(plan.steps) == 1
    p = t.tcfg.prompts_per_step
    for unit, other, m in zip(plan.steps[0], by_prompts.units, used):
        assert unit.grad.abs().sum() > 0
        torch.testing.assert_close(unit.grad, other.grad * p * m / sum(used), rtol=1e-5, atol=1e-9)


@pytest.fixture(scope="module")
def dinov2_dir(tmp_path_factory):
    from rewards.tiny_rewards import save_tiny_dinov2

    folder = tmp_path_factory.mktemp("tiny-dinov2") / "dinov2"
    save_tiny_dinov2(folder, seed=0)
    return folder


def test_encoder_features_are_the_frozen_encoders_of_the_decoded_samples(tmp_path, tiny_sd3_dir, prompt_file,
                                                                        dinov2_dir):
    """Sec. 5.3 / Eq. 11: ϕ = a frozen pretrained encoder of the decoded image; the gradient reaches the policy
    through it (the encoder itself does not train)."""
    from rewards.image_encoders import DINOv2

    t = build_trainer(load_config(None, _fest_run(tmp_path, tiny_sd3_dir, prompt_file, "enc", "trainer.feature=encoder",
                                                  f"trainer.feature_encoder={{name: dinov2, path: '{dinov2_dir}'}}")))
    assert isinstance(t.encoder, DINOv2) and not any(q.requires_grad for q in t.encoder.model.parameters())
    z = t.policy.initial_noise(2, torch.Generator().manual_seed(0))
    cond = t.policy.encode(["a red circle"] * 2)
    with torch.no_grad():
        x0 = t.generate(z, cond)
        torch.testing.assert_close(t.features(x0), DINOv2(dinov2_dir).encode_images(t.policy.decode(x0)))
    t.optimizer_step = lambda: 0.0
    logs = t.train_step()
    assert logs["train/dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert any(q.grad is not None and q.grad.abs().sum() > 0 for q in t.params)


def test_the_new_options_refuse_bad_input(tmp_path, tiny_sd3_dir, prompt_file, dinov2_dir):
    base = _fest_run(tmp_path, tiny_sd3_dir, prompt_file, "x")
    for extra, message in [
        (["trainer.bandwidths=[0.2]", "trainer.bandwidth_h2=1.0"], "trainer.bandwidths and trainer.bandwidth_h2 both"),
        (["trainer.bandwidths=[0.2]", "trainer.bandwidth=per_step"], "trainer.bandwidths sets the run's kernels"),
        (["trainer.bandwidths=[0.0]"], r"trainer.bandwidths.0: Input should be greater than 0"),
        (["trainer.bandwidths=[]"], "trainer.bandwidths: List should have at least 1 item"),
        (["trainer.loss_mean=tokens"], "trainer.loss_mean: Input should be 'pairs' or 'prompts'"),
        ([f"trainer.feature_encoder={{name: dinov2, path: '{dinov2_dir}'}}"],
         "trainer.feature_encoder is read only with trainer.feature=encoder"),
        (["trainer.feature=encoder"], "trainer.feature_encoder.path is not set"),
        (["trainer.feature=encoder", f"trainer.feature_encoder={{name: dinov9, path: '{dinov2_dir}'}}"],
         "trainer.feature_encoder.name='dinov9' is not a known image encoder"),
    ]:
        with pytest.raises(UserError, match=message):
            check_run(load_config(None, [*base, *extra]))
