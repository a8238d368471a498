"""FestDPO (docs/methods/festdpo.md): the toy optima of the abstract, trained with the trainer's own loss;
the KDE pieces; θ = ref gives log 2; bad input; short real runs (online and offline pairs) with resume."""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.trainers.festdpo import bradley_terry_pairs, festdpo_loss, kde_bandwidth, kde_log_density

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
