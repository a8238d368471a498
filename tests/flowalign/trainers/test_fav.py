"""FAV: SVGD on sample particles toward the reward-tilted reference, amortised into the generator by
fixed-point regression, and the authors' SVGD loss as known answers (known_answers/fav_svgd_loss.json;
docs/methods/fav.md)."""

import json
import math
from pathlib import Path

import pytest
import torch

from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.trainers.base import SliceUnit
from flowalign.trainers.fav import (FAVConfig, euler_sample, feature_reward_gradient, fixed_point_loss, kde_score,
                                    particles, svgd_velocity)

from .conftest import small_config, small_run
from .resume_check import assert_trains_and_resumes_bit_exactly

VVR = ("trainer.name=fav", "data.prompts=null", "data.bench=vvr", "data.level=easy", "data.n=16",
       "rewards=[{name: vvr_soft}]")


KNOWN = json.loads((Path(__file__).parent / "known_answers" / "fav_svgd_loss.json").read_text())
FEATURES = json.loads((Path(__file__).parent / "known_answers" / "fav_feature_particles.json").read_text())


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"beta{c['beta']}-kde{len(c['temp_kde'])}")
def test_score_velocity_and_loss_equal_the_authors_fav_loss_chunked(case):
    """``fav_total_score`` then ``fav_loss_chunked`` over one prompt's K particles: the total score, the
    Stein velocity, the loss and its gradient, with the default repulsion (the authors' ½)."""
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)
    x, y = f64(KNOWN["gen"]), f64(KNOWN["ref"])
    score = kde_score(x, y, case["temp_kde"]) + case["beta"] * f64(case["reward_grad"])
    torch.testing.assert_close(score, f64(case["total_score"]), rtol=1e-6, atol=1e-12)
    velocity = svgd_velocity(x, score, case["temp_stein"], FAVConfig(name="fav").repulsion)
    torch.testing.assert_close(velocity, f64(case["stein_velocity"]), rtol=1e-6, atol=1e-12)
    live = x.clone().requires_grad_(True)
    loss = fixed_point_loss(live, velocity).mean()
    loss.backward()
    torch.testing.assert_close(loss.item(), case["loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(live.grad, f64(case["grad_gen"]), rtol=1e-6, atol=1e-12)


def test_kde_score_is_the_gradient_of_the_log_kernel_density():
    g = torch.Generator().manual_seed(0)
    x, ref = torch.randn(5, 3, generator=g), torch.randn(40, 3, generator=g)
    temps = [0.3, 2.0]
    xr = x.clone().requires_grad_(True)
    d2 = torch.cdist(xr, ref) ** 2
    log_density = torch.logsumexp(torch.cat([-d2 / t for t in temps], dim=1), dim=1)
    (want,) = torch.autograd.grad(log_density.sum(), xr)
    torch.testing.assert_close(kde_score(x, ref, temps), want)


def test_svgd_velocity_matches_its_definition():
    """φ(x_i) = (1/N) Σ_j [k(x_j, x_i) s(x_j) + ∇_{x_j} k(x_j, x_i)], the kernel gradient by autograd."""
    g = torch.Generator().manual_seed(1)
    x, s = torch.randn(6, 2, generator=g), torch.randn(6, 2, generator=g)
    temps = [0.5, 1.5]
    want = torch.zeros_like(x)
    for i in range(6):
        for j in range(6):
            xj = x[j].clone().requires_grad_(True)
            k = sum(torch.exp(-((xj - x[i]) ** 2).sum() / t) for t in temps)
            (dk,) = torch.autograd.grad(k, xj)
            want[i] += k.detach() * s[j] + dk
    torch.testing.assert_close(svgd_velocity(x, s, temps), want / 6)
    torch.testing.assert_close(svgd_velocity(x, s, temps, repulsion=0.0),
                               sum(torch.exp(-torch.cdist(x, x) ** 2 / t) for t in temps) @ s / 6)


def _svgd(beta: float, repulsion: float = 1.0):
    g = torch.Generator().manual_seed(0)
    ref = 2 + torch.randn(1000, 1, generator=g)  # the reference: N(2, 1)
    x = -1 + 0.3 * torch.randn(150, 1, generator=g)  # particles start far away and narrow
    for _ in range(400):
        score = kde_score(x, ref, [0.1]) + beta * torch.ones_like(x)  # r(x) = x: ∇r = 1
        x = x + 0.25 * svgd_velocity(x, score, [0.2], repulsion)
    return ref, x


def test_svgd_with_a_flat_reward_leaves_the_particles_distributed_as_the_reference():
    """Target = the reference's kernel density (N(2, 1) widened by the kernel's variance t/2 = 0.05)."""
    ref, x = _svgd(beta=0.0)
    assert x.mean().item() == pytest.approx(ref.mean().item(), abs=0.08)
    assert x.std().item() == pytest.approx((ref.var().item() + 0.05) ** 0.5, abs=0.08)
    _, collapsed = _svgd(beta=0.0, repulsion=0.0)  # without the repulsive term the particles bunch up
    assert collapsed.std().item() < 0.5 * x.std().item()


def test_svgd_with_a_linear_reward_reaches_the_tilted_gaussian():
    """p_ref·exp(β·x) for a Gaussian p_ref shifts its mean by β·variance and keeps its width."""
    ref, x = _svgd(beta=0.5)
    var = ref.var().item() + 0.05
    assert x.mean().item() == pytest.approx(ref.mean().item() + 0.5 * var, abs=0.08)
    assert x.std().item() == pytest.approx(var**0.5, abs=0.08)


def test_the_fixed_point_regression_moves_the_generator_onto_the_particles():
    """With the particles themselves as the generator's weights, one SGD step on the regression with
    lr = N·D/2 lands exactly on x + φ; a linear sample-only generator G(z) = a·z + b (no likelihood)
    trained by the same loss moves its samples toward the tilted target."""
    g = torch.Generator().manual_seed(0)
    x = torch.nn.Parameter(torch.randn(8, 3, generator=g))
    phi = torch.randn(8, 3, generator=g)
    before = x.detach().clone()
    (fixed_point_loss(x, phi).sum() / 8).backward()
    with torch.no_grad():
        x -= (8 * 3 / 2) * x.grad
    torch.testing.assert_close(x.detach(), before + phi)

    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([a, b], lr=0.5)
    for step in range(150):
        z = torch.randn(128, 1, generator=g)
        ref = torch.randn(512, 1, generator=g)  # the frozen generator at a = 1, b = 0: N(0, 1)
        samples = a * z + b
        score = kde_score(samples.detach(), ref, [0.1]) + 0.5  # β = 0.5, r(x) = x
        phi = svgd_velocity(samples.detach(), score, [0.3])
        opt.zero_grad()
        fixed_point_loss(samples, phi).mean().backward()
        opt.step()
    assert b.item() == pytest.approx(0.5 * 1.05, abs=0.12)  # the tilted mean β·(1 + t/2)
    assert a.item() == pytest.approx(1.0, abs=0.15)  # and about the reference's width


def _trainer(tmp_path, tiny_sd3_dir, prompt_file, name="r", *extra):
    torch.manual_seed(0)
    return build_trainer(small_config(tmp_path / name, tiny_sd3_dir, prompt_file, *VVR, *extra))


def test_a_training_step_moves_the_few_step_samples_along_the_svgd_direction(tmp_path, tiny_sd3_dir, prompt_file):
    t = _trainer(tmp_path, tiny_sd3_dir, prompt_file, "r", "trainer.lr=3e-4")
    assert t.tcfg.num_steps == 4  # the few-step sampler by default
    batch = t.collect(0)
    x0 = particles(t.generate(batch.noise, batch.cond)).float()
    # the loss regenerates the particles the directions were computed at, bit for bit
    sigmas = t.policy.sigmas(4).float()
    again = particles(euler_sample(t.policy, batch.noise[:4], sigmas, batch.cond[:4], t.guidance())).float()
    assert torch.equal(again.detach(), x0[:4])
    before = fixed_point_loss(x0, batch.velocity).mean()
    t.update(batch, torch.Generator().manual_seed(0))
    x1 = particles(t.generate(batch.noise, batch.cond)).float()
    assert ((x1 - x0) * batch.velocity).sum() > 0
    assert ((x1 - (x0 + batch.velocity)) ** 2).mean(1).mean() < before
    assert math.isfinite(batch.logs["reward/total"]) and "reward/vvr_soft" in batch.logs  # scored and logged


def test_a_non_differentiable_reward_is_refused_unless_the_tilt_is_zero(tmp_path, tiny_sd3_dir, prompt_file):
    args = (*VVR, "rewards=[{name: vvr}]")
    with pytest.raises(UserError, match="differentiable"):
        build_trainer(load_config(None, small_run(tmp_path / "a", tiny_sd3_dir, prompt_file, *args)))
    build_trainer(load_config(None, small_run(tmp_path / "b", tiny_sd3_dir, prompt_file, *args, "trainer.tilt=0")))
    # beta is a KL weight everywhere in flowalign: FAV's former name for its tilt is refused, naming the new one
    with pytest.raises(UserError, match="trainer.tilt"):
        build_trainer(load_config(None, small_run(tmp_path / "c", tiny_sd3_dir, prompt_file, *args, "trainer.beta=0")))


def test_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, *VVR)


class _HPSv2OnFeatures:
    """The authors' HPSv2 reward read from features (``HPSv2Reward.forward`` on a ``(B, D)`` input): unit image
    features · the prompt's unit text feature."""

    def __init__(self, text: torch.Tensor):
        self.text = text

    def feature_scores(self, features, prompts, metadata):
        return (features * self.text).sum(-1)


@pytest.mark.parametrize("case", FEATURES["cases"], ids=lambda c: f"beta{c['beta']:g}-kde{len(c['temp_kde'])}")
def test_feature_particles_equal_the_authors_with_hpsv2_on_features(case):
    """Particles in the reward's feature space (unit CLIP-like features, β 100 and t 0.3 as their HPSv2
    recipe): the reward's gradient taken in feature space, then the total score, the loss and its gradient
    equal ``fav_total_score`` / ``fav_loss_chunked`` driven with their reward."""
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)
    gen, ref = f64(FEATURES["gen_features"]), f64(FEATURES["ref_features"])
    reward = _HPSv2OnFeatures(f64(FEATURES["text_features"]))
    grad = feature_reward_gradient(reward, 1.0, gen, [""] * len(gen), [{}] * len(gen))
    score = kde_score(gen, ref, case["temp_kde"]) + case["beta"] * grad
    torch.testing.assert_close(score, f64(case["total_score"]), rtol=1e-6, atol=1e-9)
    velocity = svgd_velocity(gen, score, case["temp_stein"], FAVConfig(name="fav").repulsion)
    live = gen.clone().requires_grad_(True)
    loss = fixed_point_loss(live, velocity).mean()
    loss.backward()
    torch.testing.assert_close(loss.item(), case["loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(live.grad, f64(case["grad_gen"]), rtol=1e-6, atol=1e-9)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """The tiny open_clip model as ``flowalign tiny-reward`` writes it (random, seed 0)."""
    from rewards.tiny_rewards import save_tiny_open_clip

    folder = tmp_path_factory.mktemp("clip") / "open_clip"
    save_tiny_open_clip(folder)
    return folder


def _clip_run(clip_dir, *extra):
    return (*VVR, f"rewards=[{{name: clip_score, path: '{clip_dir}', weight: 2.0}}]", *extra)


def test_particles_are_the_image_features_of_a_reward_that_has_them(tmp_path, tiny_sd3_dir, prompt_file, clip_dir):
    """With CLIP score (``particles: auto``): the particles are the decoded samples' unit CLIP embeddings,
    the driving term's reward gradient is w·β times the prompt's text embedding (∇_f of w·f·t), the loss
    regenerates the features bit for bit (its value is mean φ²), and a step moves them along φ."""
    t = _trainer(tmp_path, tiny_sd3_dir, prompt_file, "f", *_clip_run(clip_dir, "trainer.tilt=3", "trainer.lr=3e-4"))
    weight, reward = t.embedding
    assert weight == 2.0
    batch = t.collect(0)
    x = reward.features(t.policy.decode(t.generate(batch.noise, batch.cond)), batch.prompts, batch.metadata)
    _, _, groups = t.step_prompts(0)
    with t.policy.adapter_disabled():
        y = reward.features(t.policy.decode(t.generate(t.noise(0, groups, 73), batch.cond)), batch.prompts,
                            batch.metadata)
    text = reward.clip.encode_texts(batch.prompts, torch.device("cpu"), 8)
    want = torch.zeros_like(x)
    for g in dict.fromkeys(groups.tolist()):
        m = groups == g
        want[m] = svgd_velocity(x[m], kde_score(x[m], y[m], [0.5]) + 3 * 2.0 * text[m], [0.5], 0.5)
    assert batch.velocity.shape == (len(x), reward.clip.embed_dim)
    torch.testing.assert_close(batch.velocity, want, rtol=1e-5, atol=1e-6)

    _, logs = t.loss(batch, SliceUnit(slice(0, 4), 4))
    torch.testing.assert_close(logs["fav_loss"], (batch.velocity[:4] ** 2).mean(1).mean(), rtol=1e-5, atol=0)
    t.update(batch, torch.Generator().manual_seed(0))
    x1 = reward.features(t.policy.decode(t.generate(batch.noise, batch.cond)), batch.prompts, batch.metadata)
    assert ((x1 - x) * batch.velocity).sum() > 0


def test_the_particles_option_chooses_latents_or_refuses_a_reward_without_features(tmp_path, tiny_sd3_dir,
                                                                                    prompt_file, clip_dir):
    t = _trainer(tmp_path, tiny_sd3_dir, prompt_file, "l", *_clip_run(clip_dir, "trainer.particles=latents"))
    assert t.embedding is None
    batch = t.collect(0)
    assert batch.velocity.shape[1] == batch.noise[0].numel()  # the latents at unit RMS
    assert _trainer(tmp_path, tiny_sd3_dir, prompt_file, "v").embedding is None  # vvr_soft has no embedding
    with pytest.raises(UserError, match="trainer.particles: reward_features needs one reward"):
        _trainer(tmp_path, tiny_sd3_dir, prompt_file, "r2", "trainer.particles=reward_features")
