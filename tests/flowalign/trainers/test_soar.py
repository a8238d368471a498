"""SOAR and SFT (docs/methods/soar.md): the target identities, λ=0 ≡ SFT, no gradient through the rollout,
bad input, and short real runs on the tiny model (rendered VVR pairs and pairs from a folder)."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.trainers.soar import correction_targets, off_trajectory_state, soar_loss

from .conftest import small_run


def _state(seed=0, b=6, shape=(4, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    x0, eps = torch.randn(b, *shape, generator=g), torch.randn(b, *shape, generator=g)
    sigma = 0.3 + 0.7 * torch.rand(b, generator=g)
    return g, x0, eps, sigma


def _col(t, like):
    return t.reshape(-1, *([1] * (like.ndim - 1)))


def test_oracle_model_has_no_rollout_error_and_its_target_is_the_sft_target():
    g, x0, eps, sigma = _state()
    x_sigma = (1 - _col(sigma, x0)) * x0 + _col(sigma, x0) * eps
    oracle = lambda x, s: eps - x0  # noqa: E731  the exact velocity of this pair's straight path
    x_hat, sigma_prime = off_trajectory_state(oracle, x_sigma, sigma, K=10)
    on = (1 - _col(sigma_prime, x0)) * x0 + _col(sigma_prime, x0) * eps
    torch.testing.assert_close(x_hat, on, rtol=0, atol=1e-6)  # e = 0
    sigma_tilde = sigma_prime[None] + torch.rand(3, len(sigma), generator=g) * (1 - sigma_prime[None])
    assert sigma_tilde.min() >= 0.05  # above σ_min: the identity is exact there
    z, v_star = correction_targets(x0, eps, x_hat, sigma_prime, sigma_tilde, sigma_min=0.05)
    torch.testing.assert_close(v_star, (eps - x0)[None].expand_as(v_star), rtol=0, atol=1e-5)
    # the same check fails for re-noising toward fresh noise: the target must reuse the pair's ε
    _, v_fresh = correction_targets(x0, torch.randn(x0.shape, generator=g), x_hat, sigma_prime, sigma_tilde, 0.05)
    assert (v_fresh - (eps - x0)[None]).abs().max() > 0.1


def test_target_minus_sft_target_is_alpha_e_over_sigma_tilde():
    g, x0, eps, sigma = _state(seed=1)
    x_sigma = (1 - _col(sigma, x0)) * x0 + _col(sigma, x0) * eps
    v_model = torch.randn(x0.shape, generator=g)  # an imperfect model
    x_hat, sigma_prime = off_trajectory_state(lambda x, s: v_model, x_sigma, sigma, K=5)
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


def test_a_detached_clone_of_the_rollout_state_leaves_gradients_unchanged(tiny_sd3_dir):
    import pipelines

    torch.manual_seed(0)
    policy = pipelines.load(tiny_sd3_dir, full_finetune=True)
    g, x0, eps, sigma = _state(seed=2, b=3, shape=policy.latent_shape)
    cond = policy.encode(["a red circle", "a blue square", "two green stars"])
    u = torch.rand(2, 3, generator=g)

    def velocity(x, s):
        return policy.velocity(x, s, cond if len(x) == 3 else cond[[0, 1, 2, 0, 1, 2]], 1.0)

    def guided(x, s):
        return policy.velocity(x, s, cond, 4.0)

    def grads(rollout):
        policy.trainable.zero_grad()
        loss, _ = soar_loss(velocity, guided, x0, eps, sigma, u, K=5, lam=1.0, sigma_min=0.05, rollout=rollout)
        loss.backward()
        return [p.grad.clone() for p in policy.trainable.parameters() if p.grad is not None]

    def detached_clone(*args):
        x_hat, sigma_prime = off_trajectory_state(*args)
        return x_hat.detach().clone(), sigma_prime

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
    args = ("trainer.name=soar", "trainer.corrections=2", "trainer.caption_dropout=0.5")
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
