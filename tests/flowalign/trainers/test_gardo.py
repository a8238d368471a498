"""GARDO: the gated KL (the authors' gate as known answers, known_answers/gardo_gate.json), the adaptive
reference (known_answers/gardo_refresh.json) and the centred, diversity-scaled advantages
(known_answers/gardo_diversity.json; with the authors' DINOv3 image features,
known_answers/gardo_dino_diversity.json); docs/methods/gardo.md."""

import json
from pathlib import Path

import pytest
import torch

from flowalign.advantages import diversity_scaled
from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer, check_run
from flowalign.trainers.gardo import (
    centred_advantages,
    gate_mask,
    gate_score,
    gated_kl,
    next_gate_fraction,
    rank_disagreement,
    refresh_due,
)

from .conftest import REDNESS, small_config, small_run
from .resume_check import assert_trains_and_resumes_bit_exactly

TWO_REWARDS = f"rewards=[{{name: '{REDNESS}'}}, {{name: brightness, weight: 0}}]"


KNOWN = Path(__file__).parent / "known_answers"
KNOWN_GATE = json.loads((KNOWN / "gardo_gate.json").read_text())
KNOWN_DIVERSITY = json.loads((KNOWN / "gardo_diversity.json").read_text())
KNOWN_REFRESH = json.loads((KNOWN / "gardo_refresh.json").read_text())
KNOWN_DINO = json.loads((KNOWN / "gardo_dino_diversity.json").read_text())


@pytest.fixture(scope="module")
def dinov3_dir(tmp_path_factory) -> Path:
    """The tiny random DINOv3 ViT folder the DINOv3 known answers were computed with (seed 0)."""
    from rewards.tiny_rewards import save_tiny_dinov3

    folder = tmp_path_factory.mktemp("tiny-dinov3") / "dinov3"
    save_tiny_dinov3(folder, seed=0)
    return folder


def encoder_run(folder: Path, **options: object) -> list[str]:
    """The overrides of GARDO's image-encoder diversity features with the DINOv3 folder ``folder``."""
    extra = "".join(f", {k}: {v}" for k, v in options.items())
    return ["trainer.diversity_features=image_encoder",
            f"trainer.diversity_encoder={{name: dinov3, path: '{folder}'{extra}}}"]


def test_the_gate_equals_the_authors_over_consecutive_batches():
    """``train_sd3_grpo_gardo.py``'s disagreement u, its RiskCompensator's fraction and the gated samples,
    batch after batch, from flowalign's three pieces and the trainer's defaults (gate_side included)."""
    from flowalign.trainers.gardo import GARDOConfig

    t = GARDOConfig(name="gardo")
    k = KNOWN_GATE
    assert (t.gate_fraction, t.gate_rate, t.gate_min, t.gate_max, t.gate_window) == (
        k["base"], k["rate"], k["low"], k["high"], k["window"])
    fraction, history = t.gate_fraction, []
    for batch in k["batches"]:
        r = {name: torch.tensor(v, dtype=torch.float64) for name, v in batch["rewards"].items()}
        u = gate_score(r[k["main"]], torch.stack([r[a] for a in k["auxiliary"]], dim=1), t.gate_side)
        torch.testing.assert_close(u, torch.tensor(batch["u"]), rtol=0, atol=0)
        level = u[u >= 0].mean().item()
        fraction, history = next_gate_fraction(fraction, history, level, t.gate_fraction, t.gate_min, t.gate_max,
                                               t.gate_rate, t.gate_window)
        assert fraction == pytest.approx(batch["fraction"], rel=1e-12)
        assert gate_mask(u, fraction).tolist() == batch["gate"]


def test_rank_disagreement_and_the_gate_by_hand():
    """main (4, 3, 2, 1) ranks (1, 2, 3, 4); the auxiliary ranks (4, 3, 2, 1) and (3, 4, 1, 2): mean
    (3.5, 3.5, 1.5, 1.5) → u = (−2.5, −1.5, 1.5, 2.5). Among u ≥ 0 = (1.5, 2.5) the 0.5-quantile is 2.0:
    only the last sample is gated (the one the proxy ranks lowest against the auxiliaries)."""
    main = torch.tensor([4.0, 3.0, 2.0, 1.0])
    aux = torch.tensor([[1.0, 2.0], [2.0, 1.0], [3.0, 4.0], [4.0, 3.0]])
    u = rank_disagreement(main, aux)
    torch.testing.assert_close(u, torch.tensor([-2.5, -1.5, 1.5, 2.5]))
    assert gate_mask(u, 0.5).tolist() == [False, False, False, True]
    assert not gate_mask(torch.tensor([-1.0, -2.0]), 0.5).any()


def test_the_gate_side_picks_the_samples_the_proxy_ranks_below_or_above_the_auxiliaries():
    """Sample 0 is the proxy's best and the auxiliaries' worst (a proxy reward they do not back), sample 3 the
    reverse: proxy ranks (1, 2, 3, 4), the auxiliaries' mean ranks (4, 2.5, 2.5, 1), u = (−3, −0.5, 0.5, 3).
    Of the non-negative scores the upper half is gated: proxy_lower (the authors' code) gates sample 3,
    proxy_higher sample 0."""
    main = torch.tensor([0.9, 0.5, 0.4, 0.1])
    aux = torch.tensor([[0.0, 0.1], [0.5, 0.6], [0.6, 0.5], [1.0, 0.9]])
    lower, higher = gate_score(main, aux, "proxy_lower"), gate_score(main, aux, "proxy_higher")
    torch.testing.assert_close(lower, torch.tensor([-3.0, -0.5, 0.5, 3.0]))
    torch.testing.assert_close(higher, -lower)
    assert gate_mask(lower, 0.5).tolist() == [False, False, False, True]
    assert gate_mask(higher, 0.5).tolist() == [True, False, False, False]


def test_the_gated_fraction_adapts_to_the_disagreement_history():
    f, h = next_gate_fraction(0.5, [], 3.0, 0.1, 0.02, 0.2, 0.1, 3)
    assert (f, h) == (0.1, [3.0])  # the first batch starts at the base
    f, h = next_gate_fraction(f, h, 4.0, 0.1, 0.02, 0.2, 0.1, 3)
    assert f == pytest.approx(0.11) and h == [3.0, 4.0]  # above every level: × 1.1
    f, h = next_gate_fraction(f, h, 3.5, 0.1, 0.02, 0.2, 0.1, 3)
    assert f == pytest.approx(0.11)  # within the range: kept
    f, h = next_gate_fraction(f, h, 1.0, 0.1, 0.02, 0.2, 0.1, 3)
    assert f == pytest.approx(0.099) and h == [4.0, 3.5, 1.0]  # below all: × 0.9; the window keeps 3
    assert next_gate_fraction(0.2, [1.0], 9.0, 0.1, 0.02, 0.2, 0.1, 3)[0] == 0.2  # clipped to gate_max


def test_the_gated_kl_and_its_gradient_by_hand():
    """mean over the gated samples: ∂/∂kl_i = 1/|G| for gated i, 0 otherwise; none gated: 0, no gradient."""
    kl = torch.tensor([0.2, 0.4, 0.6, 0.8], requires_grad=True)
    gated = torch.tensor([True, False, True, False])
    value = gated_kl(kl, gated)
    value.backward()
    assert value.item() == pytest.approx(0.4) and kl.grad.tolist() == [0.5, 0.0, 0.5, 0.0]
    assert gated_kl(kl, torch.zeros(4, dtype=torch.bool)).item() == 0.0


def test_diversity_scales_only_positive_advantages_by_nearest_distance():
    """Features e1, e1, e2 (group 0): nearest cosine distances (0, 0, 1), mean 1/3 → positive advantages
    × (0, 0, 3); the negative one is kept; group 1 (one sample) is kept whole."""
    features = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    out = diversity_scaled(adv, features, torch.tensor([0, 0, 0, 1]))
    torch.testing.assert_close(out, torch.tensor([0.0, -1.0, 1.5, 2.0]))


def test_the_diversity_advantages_equal_the_authors():
    """Their PerPromptStatTracker(type='gardo'): (R − mean of the prompt's rewards) × (d_i / mean d) for the
    non-negative ones, no std, from the same rewards and features (a duplicate pair: d = 0; a sample at its
    group's mean). diversity_scaled computes in float32, hence the absolute tolerance."""
    k = KNOWN_DIVERSITY
    names = sorted(set(k["prompts"]))
    ids = torch.tensor([names.index(p) for p in k["prompts"]])
    rewards = torch.tensor(k["rewards"], dtype=torch.float64)
    centred = centred_advantages(rewards, ids, torch.ones(len(ids), dtype=torch.bool))
    out = diversity_scaled(centred, torch.tensor(k["features"], dtype=torch.float64), ids)
    torch.testing.assert_close(out.double(), torch.tensor(k["advantages"], dtype=torch.float64), rtol=1e-6, atol=1e-6)


def known_dino_images() -> torch.Tensor:
    """The known answers' 12 images ``(12, 3, 40, 56)`` in [0, 1], as their JSON's ``images`` describes."""
    k = KNOWN_DINO
    g = torch.Generator().manual_seed(2024)
    base = torch.rand(3, 3, 40, 56, generator=g)
    images = torch.stack([0.4 * base["abc".index(p)] + 0.6 * torch.rand(3, 40, 56, generator=g) for p in k["prompts"]])
    images[4] = images[3]
    return images


def test_the_dino_diversity_advantages_equal_the_authors(dinov3_dir):
    """Their diversity path on the same tiny DINOv3 weights (mapped into timm's vit_large_patch16_dinov3 at
    the tiny sizes) and images: timm's eval transform (shortest side to 256, bicubic, 256 centre crop, ImageNet
    mean/std) and default avg pool (the mean of the final-normed patch tokens), then PerPromptStatTracker's
    L2-normalised features, cosine distance to the nearest other sample of the prompt, positive advantages ×
    d / mean d. The encoder's defaults give the same features (up to the norm) and the trainer's pieces the
    same advantages; a CLS feature, a Euclidean distance or a std division would not."""
    from flowalign.trainers.gardo import DiversityEncoder
    from rewards.image_encoders import IMAGENET_MEAN, IMAGENET_STD, DINOv3

    k = KNOWN_DINO
    data = k["timm_data_config"]
    assert data["input_size"] == [3, 256, 256] and data["crop_pct"] == 1.0 and data["interpolation"] == "bicubic"
    assert (tuple(data["mean"]), tuple(data["std"]), k["timm_global_pool"]) == (IMAGENET_MEAN, IMAGENET_STD, "avg")
    defaults = DiversityEncoder()
    assert (defaults.name, defaults.dtype, defaults.options) == ("dinov3", "fp32", {})
    encoder = DINOv3(dinov3_dir)
    assert (encoder.resolution, encoder.pool) == (256, "patch_mean")
    with torch.no_grad():
        features = encoder.encode_images(known_dino_images())
    theirs = torch.nn.functional.normalize(torch.tensor(k["features"]), dim=-1)
    torch.testing.assert_close(features, theirs, rtol=1e-4, atol=2e-5)
    names = sorted(set(k["prompts"]))
    ids = torch.tensor([names.index(p) for p in k["prompts"]])
    centred = centred_advantages(torch.tensor(k["rewards"], dtype=torch.float64), ids, torch.ones(12, dtype=torch.bool))
    out = diversity_scaled(centred, features, ids)
    torch.testing.assert_close(out.double(), torch.tensor(k["advantages"], dtype=torch.float64), rtol=1e-4, atol=1e-5)
    # what would fail: the Euclidean nearest distance of the unnormalised features in place of the cosine one
    euclid = centred.clone()
    for g in ids.unique():
        m = (ids == g).nonzero().flatten()
        d = torch.cdist(torch.tensor(k["features"])[m], torch.tensor(k["features"])[m]).fill_diagonal_(float("inf"))
        near = d.min(1).values.double()
        euclid[m] = torch.where(centred[m] > 0, centred[m] * near / near.mean(), centred[m])
    assert not torch.allclose(euclid, torch.tensor(k["advantages"], dtype=torch.float64), atol=1e-3)


def test_a_gardo_step_with_the_image_encoder_scales_by_its_features(tmp_path, tiny_sd3_dir, prompt_file, dinov3_dir):
    """With diversity_features=image_encoder the batch's advantages are the centred rewards scaled by the
    encoder's features of the decoded samples (a direct computation), not by the final latents; the step
    then trains on them."""
    from rewards.image_encoders import DINOv3

    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=gardo", TWO_REWARDS,
                                   "trainer.gate_fraction=0.2", *encoder_run(dinov3_dir)))
    assert isinstance(t.encoder, DINOv3) and not any(p.requires_grad for p in t.encoder.model.parameters())
    batch = t.collect(0)
    centred = t.centred(batch)
    assert (centred > 0).any()
    with torch.no_grad():
        features = DINOv3(dinov3_dir).encode_images(batch.samples)
    assert batch.samples.dim() == 4 and 0 <= batch.samples.min() and batch.samples.max() <= 1
    expected = diversity_scaled(centred, features, batch.prompt_ids).float().clamp(-t.tcfg.adv_clip, t.tcfg.adv_clip)
    torch.testing.assert_close(batch.advantages, expected, rtol=1e-5, atol=1e-6)
    latents = torch.cat([c.final_latents for c in batch.chunks])
    from_latents = diversity_scaled(centred, latents, batch.prompt_ids).float().clamp(-t.tcfg.adv_clip, t.tcfg.adv_clip)
    assert not torch.allclose(batch.advantages, from_latents, atol=1e-4)
    start = [p.detach().clone() for p in t.params]
    logs = t.update(batch, torch.Generator().manual_seed(0))
    assert all(torch.isfinite(torch.tensor(float(v))) for v in logs.values())
    assert any(not torch.equal(a, p) for a, p in zip(start, t.params))


def test_the_image_encoder_options_are_checked(tmp_path, tiny_sd3_dir, prompt_file, dinov3_dir):
    base = small_run(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=gardo", TWO_REWARDS)
    with pytest.raises(UserError, match="diversity_encoder is read only with trainer.diversity_features=image_encoder"):
        check_run(load_config(None, [*base, f"trainer.diversity_encoder={{name: dinov3, path: '{dinov3_dir}'}}"]))
    with pytest.raises(UserError, match="trainer.diversity_encoder.path is not set"):
        check_run(load_config(None, [*base, "trainer.diversity_features=image_encoder"]))
    with pytest.raises(UserError, match="trainer.diversity_encoder.name='dinov9' is not a known image encoder"):
        check_run(load_config(None, [*base, "trainer.diversity_features=image_encoder",
                                     f"trainer.diversity_encoder={{name: dinov9, path: '{dinov3_dir}'}}"]))
    with pytest.raises(UserError, match=r"trainer.diversity_encoder.path='.*nowhere' does not exist; download "
                                        r"facebook/dinov3-vitl16-pretrain-lvd1689m"):
        build_trainer(load_config(None, [*base, *encoder_run(tmp_path / "nowhere")]))
    check_run(load_config(None, [*base, *encoder_run(dinov3_dir, options="{pool: cls}")]))


def test_centred_advantages_by_hand():
    """Group 0: (1, 3) → (−1, 1); group 1: (2, 5, invalid 9) → the valid mean 3.5: (−1.5, 1.5, 0)."""
    out = centred_advantages(torch.tensor([1.0, 2.0, 3.0, 5.0, 9.0]), torch.tensor([0, 1, 0, 1, 1]),
                             torch.tensor([True, True, True, True, False]))
    torch.testing.assert_close(out, torch.tensor([-1.0, -1.5, 1.0, 1.5, 0.0], dtype=torch.float64))


def test_the_reference_refresh_equals_the_authors():
    """Their loop copies the policy into the reference at the start of epoch e after an optimiser step of e−1
    logged a KL above kl_thres (one step above it is enough: epoch 2's (4.5e-4, 1e-4) average 2.75e-4), or
    when e − last > reset_freq; flowalign refreshes after the step that leaves e steps done."""
    k = KNOWN_REFRESH
    last, refreshed = 0, []
    for step, kls in enumerate(k["step_kls"][:-1]):
        if refresh_due(kls, k["kl_thres"], step + 1, last, k["reset_freq"]):
            last = step + 1
            refreshed.append(last)
    assert refreshed == k["copied"]


def test_the_trainers_advantages_are_centred_and_its_gate_takes_its_side(tmp_path, tiny_sd3_dir, prompt_file):
    """The batch's advantages are each total reward minus its prompt's mean (no std); the gate is
    gate_mask(gate_score(proxy, auxiliary, gate_side), fraction) on the batch's rewards, for either side."""
    for side in ("proxy_lower", "proxy_higher"):
        t = build_trainer(small_config(tmp_path / side, tiny_sd3_dir, prompt_file, "trainer.name=gardo", TWO_REWARDS,
                                       "trainer.diversity=false", "trainer.gate_fraction=0.2",
                                       f"trainer.gate_side={side}"))
        batch = t.collect(0)
        values = batch.scores.values.double()
        totals = values @ batch.scores.weights.double()
        expected = torch.stack([totals[i] - totals[batch.prompt_ids == batch.prompt_ids[i]].mean()
                                for i in range(len(totals))])
        torch.testing.assert_close(batch.advantages.double(), expected, rtol=1e-6, atol=1e-7)
        assert totals.std() > 0 and not torch.allclose(expected, expected / totals.std())  # a std would show
        u = gate_score(values[:, 0], values[:, 1:], side)
        assert batch.gate.tolist() == gate_mask(u, batch.gate_state["fraction"]).tolist()


def test_the_loops_advantage_is_refused_with_the_centred_form(tmp_path, tiny_sd3_dir, prompt_file):
    base = small_run(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=gardo", TWO_REWARDS)
    with pytest.raises(UserError, match="centred_advantage=false"):
        check_run(load_config(None, [*base, "trainer.advantage=group"]))
    check_run(load_config(None, [*base, "trainer.advantage=group", "trainer.centred_advantage=false"]))
    check_run(load_config(None, [*base, "trainer.advantage=global_std"]))  # the default stated, as a saved run does


def test_the_kl_is_to_the_snapshot_and_a_large_kl_refreshes_it(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=gardo", TWO_REWARDS,
                                   "trainer.kl_threshold=1e-30", "trainer.updates_per_epoch=2",
                                   "trainer.gate_fraction=0.2", "trainer.clip_range=0.2"))
    batch = t.collect(0)
    assert batch.gate.dtype == torch.bool and 0 < int(batch.gate.sum()) < len(batch.gate)
    chunk = batch.chunks[0]
    k = t.trained_steps(chunk)[0]
    with torch.no_grad():  # on-policy and at the start: the snapshot is the policy, μ_ref = μ_θ, ratio 1
        out = t.step_distribution(chunk, k, t.policy_velocity(chunk, k, True))
    torch.testing.assert_close(t.reference_mean(chunk, k), out.mean)
    assert torch.equal(out.log_prob, chunk.step(k)[2])
    start = [r.clone() for r in t.reference]
    logs = t.update(batch, torch.Generator().manual_seed(0))
    assert logs["kl"] > 0  # the second optimiser step moved away from the snapshot
    assert logs["kl_update_max"] >= logs["kl"]  # the refresh reads the largest optimiser step's mean
    assert any(not torch.equal(a, b) for a, b in zip(start, t.reference))  # a new snapshot ...
    assert all(torch.equal(r, p) for r, p in zip(t.reference, t.params))  # refreshed to the updated weights
    assert t.last_refresh == 1 and logs["reference_age"] == 0
    assert t.gate_fraction == batch.gate_state["fraction"]  # the controller's state committed by finish


def test_the_refresh_reads_each_optimiser_steps_mean_kl_over_every_rank():
    """This rank logged KLs (0.1, 0.3) in optimiser step 0 and (0.5) in step 1; another rank (0.2) and (0.1).
    The steps' means over both ranks are 0.6 / 3 = 0.2 and 0.6 / 2 = 0.3: a threshold of 0.35 keeps the
    snapshot (this rank's own step-1 mean, 0.5, would have refreshed it), 0.25 refreshes it."""
    from types import SimpleNamespace

    from flowalign.trainers.gardo import GARDOConfig, GARDOTrainer

    steps = [{"kl": [0.1, 0.3], "grad_norm": [1.0]}, {"kl": [0.5], "grad_norm": [1.0]}, {"grad_norm": [0.0]}]
    other_rank = [(0.2, 1), (0.1, 1), (0.0, 0)]
    for threshold, refreshed in ((0.35, False), (0.25, True)):
        params = [torch.nn.Parameter(torch.ones(2))]
        t = SimpleNamespace(tcfg=GARDOConfig(name="gardo", kl_threshold=threshold), step=4, last_refresh=0,
                            params=params, reference=[torch.zeros(2)], gather_objects=lambda mine: [mine, other_rank])
        logs = GARDOTrainer.finish(t, SimpleNamespace(gate_state={}), steps)
        assert logs["kl_update_max"] == pytest.approx(0.3, abs=1e-12)
        assert (t.last_refresh == 5) == refreshed and torch.equal(t.reference[0], params[0].detach()) == refreshed
        assert logs["reference_age"] == (0.0 if refreshed else 5.0)


def test_a_gate_needs_an_auxiliary_reward_and_main_reward_names_one(tmp_path, tiny_sd3_dir, prompt_file):
    base = small_run(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=gardo")
    with pytest.raises(UserError, match="auxiliary rewards"):
        check_run(load_config(None, base))
    with pytest.raises(UserError, match="main_reward='nope'"):
        check_run(load_config(None, [*base, TWO_REWARDS, "trainer.main_reward=nope"]))
    check_run(load_config(None, [*base, "trainer.gate=false"]))


def test_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file):
    """The snapshot, its age and the gate controller travel in the checkpoint (reset_every=1: a refresh
    at the step the cut run stops)."""
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=gardo", TWO_REWARDS,
                                          "trainer.updates_per_epoch=2", "trainer.reset_every=1",
                                          "trainer.clip_range=0.2")


def test_proxy_higher_is_the_papers_eq_7_win_rate_uncertainty():
    """The paper's U(x_i) = w(R̃(x_i)) − mean_n w(R̂_n(x_i)), w the in-batch win rate (1/B)·Σ_{j≠i} 𝟙(y_i > y_j)
    (arXiv 2512.24138v1 §4.2, Eq. (7)), is ``gate_side: proxy_higher``'s score over B; the authors' code's side
    is its negation."""
    g = torch.Generator().manual_seed(0)
    main, aux = torch.rand(24, generator=g), torch.rand(24, 2, generator=g)

    def win_rate(y: torch.Tensor) -> torch.Tensor:
        return (y[:, None] > y[None, :]).float().sum(1) / len(y)

    paper = win_rate(main) - torch.stack([win_rate(aux[:, 0]), win_rate(aux[:, 1])]).mean(0)
    torch.testing.assert_close(gate_score(main, aux, "proxy_higher") / 24, paper)
    torch.testing.assert_close(gate_score(main, aux, "proxy_lower") / 24, -paper)
