"""KVPO: the authors' training rule (anchor-relative advantages, the x0-space replay score with the σ floor and
gradient steps, the asymmetric clip with a KL to the starting weights and the anchor slot, the dispersed
routing window) against their functions (known_answers/kvpo_training_rule.json), the earlier energy form
against their objective (known_answers/kvpo_branch_objective.json), and the trainer (docs/methods/kvpo.md)."""

import json
from pathlib import Path

import pytest
import torch

from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.sampling.streaming import jump_velocities as taken_velocities
from flowalign.trainers.kvpo import KVPOConfig, layout_span, middle_frames
from flowalign.trainers.parts.prompt_segments import segment_bounds
from flowalign.trainers.parts.anchor_advantages import (
    fused_anchor_advantages,
    weighted_anchor_advantages,
)
from flowalign.trainers.parts.branch_policy import (
    anchor_slot_scale,
    branch_objective,
    velocity_energy,
    x0_scores,
)
from flowalign.protocols import KeptFrames
from flowalign.trainers.parts.kv_routing import (
    bernoulli_routing,
    dispersed_draws,
    frame_keep,
    frame_pool,
    frame_routable,
    slot_shift,
    window_keep,
    window_routings,
)
from flowalign.trainers.parts.policy_gradient import clipped_loss

from .conftest import small_config
from .resume_check import assert_trains_and_resumes_bit_exactly

HERE = Path(__file__).parent / "known_answers"
KNOWN = json.loads((HERE / "kvpo_branch_objective.json").read_text())
RULE = json.loads((HERE / "kvpo_training_rule.json").read_text())
SIGNALS = json.loads((HERE / "kvpo_signals.json").read_text())
FRAMES = json.loads((HERE / "kvpo_frame_routing.json").read_text())
CLIPS = json.loads((HERE / "kvpo_segment_clips.json").read_text())
#: the authors' rule on the tiny 3-chunk model: a branch keeps one of the two chunks before chunk 2
AUTHORS = ("trainer.name=kvpo", "trainer.num_steps=2", "model.finetune=lora", "trainer.keep_sink=false",
           "trainer.nearest_chunks=0", "trainer.older_chunks=1")
#: flowalign's earlier form: one routed chunk, each history chunk kept with keep_prob, the velocity energy
EARLIER = ("trainer.name=kvpo", "trainer.num_steps=2", "model.finetune=lora", "trainer.keep_sink=false",
           "trainer.routing=bernoulli", "trainer.score=velocity_energy", "trainer.advantage=group",
           "trainer.clip_low=0.2", "trainer.kl_coef=0", "trainer.grad_steps=null", "trainer.adv_clip=5")


@pytest.fixture(scope="module")
def far_dir(tiny_model_dir):
    return tiny_model_dir("anyflow_far")


def _f64(value) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


# ------------------------------------------------------------------------------ the authors' rule, known answers

RULE_IDS = lambda c: f"{c['rewards']}-{c['old']}-floor{c['log_prob_sigma_floor']}-grad{c['log_prob_grad_steps']}-kl{c['kl_coef']}"


@pytest.mark.parametrize("case", RULE["cases"], ids=RULE_IDS)
def test_anchor_relative_advantages_equal_the_authors(case):
    """Per reward ``(r − r_anchor)/std(r, r_anchor)``, weighted and summed, std-normalised, clamped to ±2.5."""
    rewards = RULE["reward_cases"][case["rewards"]]
    values, anchor, weights = _f64(rewards["values"]), _f64(rewards["anchor"]), _f64(RULE["weights"])
    torch.testing.assert_close(weighted_anchor_advantages(values, anchor, weights), _f64(case["advantages_raw"]),
                               rtol=1e-6, atol=1e-12)
    fused = fused_anchor_advantages([(values, anchor, 1.0)], weights, RULE["adv_clip"])
    torch.testing.assert_close(fused, _f64(case["advantages"]), rtol=1e-6, atol=1e-12)
    assert bool(((values * weights).sum(1) > (anchor * weights).sum()).any()) == case["safe"]


@pytest.mark.parametrize("case", SIGNALS["cases"], ids=lambda c: c["name"])
def test_the_local_and_global_signals_fuse_as_the_authors(case):
    """Their ``_fuse_signal_advantages``: each signal's anchor advantages std-normalised, local × 1 + global × 0.5,
    clamped; a group beat its anchor when a branch beat it on either signal; the local signal alone as well."""
    weights = _f64(SIGNALS["reward_weights"])
    local = (_f64(case["local_values"]), _f64(case["local_anchor"]), SIGNALS["local_weight"])
    whole = (_f64(case["global_values"]), _f64(case["global_anchor"]), SIGNALS["global_weight"])
    got = fused_anchor_advantages([local, whole], weights, SIGNALS["adv_clip"])
    torch.testing.assert_close(got, _f64(case["advantages"]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused_anchor_advantages([local], weights, SIGNALS["adv_clip"]), _f64(case["local_only"]),
                               rtol=1e-6, atol=1e-6)
    beat = any(bool(((v * weights).sum(1) > (a * weights).sum()).any()) for v, a, _ in (local, whole))
    assert beat == case["safe"]


@pytest.mark.parametrize("window", SIGNALS["clip_windows"], ids=lambda w: f"{w['frames']}-{w['clip']}")
def test_the_global_clip_is_the_authors_centred_window(window):
    videos = torch.arange(window["frames"], dtype=torch.float32).view(1, -1, 1, 1, 1)
    start, end = window["window"]
    assert middle_frames(videos, window["clip"]).flatten().tolist() == list(range(start, end))
    assert middle_frames(videos, None) is videos


def _rule_scores(v: torch.Tensor, floor: float, grad_steps: int) -> torch.Tensor:
    """The trainer's replay score on the known tensors: each window chunk's x0 score, summed; the velocities of
    steps from ``grad_steps`` on without gradient (the trainer computes them under no_grad)."""
    sigmas, states = _f64(RULE["sigmas"]), _f64(RULE["states"])
    total = torch.zeros(v.shape[0], dtype=torch.float64)
    for w in range(states.shape[1]):
        u = taken_velocities(states[:, w], sigmas)
        vw = torch.cat([v[:, w, :grad_steps], v[:, w, grad_steps:].detach()], dim=1)
        total = total + x0_scores(vw, u, sigmas, floor)
    return total


@pytest.mark.parametrize("case", RULE["cases"], ids=RULE_IDS)
def test_the_replay_scores_loss_and_gradient_equal_the_authors(case):
    """Their ``_compute_trajectory_log_prob`` (σ floored, gradient through the first steps) and
    ``_compute_policy_objective_from_logits`` (mechanism_2: asymmetric clip, KL to π_init, anchor slot): the
    branch scores, the loss and its gradient in the policy's velocities."""
    floor, steps = case["log_prob_sigma_floor"], case["log_prob_grad_steps"]
    v = _f64(RULE["policy_v"]).requires_grad_(True)
    scores = _rule_scores(v, floor, steps)
    torch.testing.assert_close(scores.detach(), _f64(case["scores"]), rtol=1e-6, atol=1e-12)
    old = _rule_scores(_f64(RULE["far_old_v" if case["old"] == "far" else "old_v"]), floor, steps)
    init = _rule_scores(_f64(RULE["init_v"]), floor, steps)
    torch.testing.assert_close(old, _f64(case["old_scores"]), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(init, _f64(case["init_scores"]), rtol=1e-6, atol=1e-12)
    loss, info = branch_objective(scores, old, _f64(case["advantages"]), RULE["clip_low"], RULE["clip_high"],
                                  case["kl_coef"], init, case["safe"])
    loss.backward()
    torch.testing.assert_close(loss.item(), case["total_loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(info["kl"].item(), case["kl"], rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(1 - info["anchor_scale"].item(), case["pi_anchor"], rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(v.grad, _f64(case["grad_v"]), rtol=1e-6, atol=1e-15)
    # the steps from grad_steps on set the value, not the gradient
    assert torch.equal(v.grad[:, :, steps:], torch.zeros_like(v.grad[:, :, steps:]))


@pytest.mark.parametrize("plan", RULE["routing"], ids=lambda p: f"k{p['chunk']}-m{p['nearest']}-n{p['older']}")
def test_the_dispersed_routings_equal_the_authors_branch_plans(plan):
    """Their ``_build_dispersed_branch_plans`` over ``plan_perturbation``'s pool: one permutation, shifted windows."""
    drawn = window_routings(plan["chunk"], plan["group_size"], plan["nearest"], plan["older"], plan["keep_sink"],
                            torch.Generator().manual_seed(plan["master_seed"]))
    assert [list(d) for d in drawn] == plan["selected"]


@pytest.mark.parametrize("case", FRAMES["cases"], ids=lambda c: c["label"])
def test_frame_routing_equals_the_authors_plan(case):
    """In frames, as theirs: the start blocks ``plan_perturbation`` finds eligible (among those its streaming layout
    allows: ``P`` blocks inside one of the first ``within`` streaming chunks) and their stable pools, bounded by
    the resident cache; and each branch's drawn frames, from their master permutation's seed."""
    nearest, sink, resident, window = case["m"], case["sink"], case["cache"], case["local"]
    older = max(window - sink, 0) - nearest
    starts = [first + 3 * b for first, new in case["streaming_chunks"][:case["within"]]
              for b in range(new // 3) if b + case["P"] <= new // 3]
    last = lambda start: start + 3 * (case["P"] - 1)  # noqa: E731
    eligible = [[start, frame_pool(start, last(start), nearest, sink, resident)[0],
                 frame_pool(start, last(start), nearest, sink, resident)[-1] + 1]
                for start in starts if frame_routable(start, last(start), nearest, older, sink, resident, window)]
    assert eligible == case["eligible"]
    for plan in case["plans"]:
        pool = frame_pool(plan["start_frame"], last(plan["start_frame"]), nearest, sink, resident)
        assert [pool[0], pool[-1] + 1] == plan["pool"] and older == plan["n_random_frames"]
        drawn = dispersed_draws(pool, case["K"], older, torch.Generator().manual_seed(plan["master_seed"]))
        assert [list(d) for d in drawn] == plan["selected"]


@pytest.mark.parametrize("case", CLIPS["cases"], ids=lambda c: f"{c['latent_frames']}-{c['switch_frames']}")
def test_the_global_clips_of_a_switched_stream_are_the_authors_per_segment_clips(case):
    """A clip centred on each prompt segment (their ``_build_global_segment_clip_specs``), read by the frame index
    of the video: the segment of each clip and its frames."""
    frames = torch.arange(case["decoded_frames"]).view(1, -1, 1, 1, 1).float()
    clips = [[f"p{i}", int(c[0, 0]), int(c[0, -1]) + 1]
             for i, a, b in segment_bounds(case["decoded_frames"], case["switch_frames"], case["stride"])
             for c in [middle_frames(frames, case["clip"], (a, b)).flatten(1)]]
    assert clips == case["clips"]


@pytest.mark.parametrize("case", FRAMES["cases"], ids=lambda c: c["label"])
def test_the_local_signals_chunk_is_the_authors_streaming_chunk(case):
    """Every frame's chunk in their streaming layout (``_compute_chunk_layout``, in the frame-routing answers)."""
    first, then = case["chunk_size"], case["min_new"]
    for start, new in case["streaming_chunks"]:
        assert all(layout_span(f, first, then, case["total"]) == (start, start + new) for f in range(start, start + new))


def test_their_window_reads_drawn_frames_a_chunk_later_once_their_cache_is_full():
    """``_build_perturbed_local_window``'s slot arithmetic (tests/pipelines/test_causal_wan.py, setting
    ``longlive_full``: a 15-frame cache full at the routed block at frame 18, frames 9..13 drawn, 12..16 read);
    before the cache fills (setting ``longlive_frames``, a 21-frame cache at block 15) the drawn frames are read."""
    assert slot_shift(18, 3, 15, 3) == 3
    assert slot_shift(15, 3, 21, 3) == 0
    assert slot_shift(13, 3, 15, 3) == 1  # filling up during the block: part of a chunk
    assert slot_shift(39, 3, 33, 3) == 3 and slot_shift(21, 3, 33, 3) == 0  # their recipe's 147 frames, 39
    assert slot_shift(39, 3, None, 3) == 0


def test_a_frame_routed_chunk_reads_the_sink_the_drawn_frames_and_its_nearest_frames():
    """LongLive's 12-frame window in KVPO's recipe: 3 sink frames, 5 drawn ones, and of the 4 nearest frames the
    block being made and the frame before it; the nearest frame follows the block, the drawn ones stay."""
    drawn = (3, 11, 12, 13, 16)
    assert frame_keep(21, 3, drawn, 4, 3) == KeptFrames((0, 1, 2, 3, 11, 12, 13, 16, 20))
    assert frame_keep(24, 3, drawn, 4, 3) == KeptFrames((0, 1, 2, 3, 11, 12, 13, 16, 23))
    assert frame_keep(12, 3, (4,), 3, 0) == KeptFrames((4,))  # the nearest frames are the block itself


def test_a_routed_window_keeps_the_sink_the_drawn_chunks_and_the_nearest_ones():
    assert window_keep(6, (2, 3), 1, True) == (0, 2, 3, 5)
    assert window_keep(7, (2, 3), 2, True) == (0, 2, 3, 5, 6)  # the nearest follow the chunk being generated
    assert window_keep(3, (), 0, False) == ()


def test_the_anchor_slot_halves_the_loss_of_a_group_that_did_not_beat_its_anchor():
    log_pi = torch.log_softmax(torch.tensor([0.3, -1.0, 2.0]), 0)
    assert anchor_slot_scale(log_pi, True).item() == 1.0
    assert anchor_slot_scale(log_pi, False).item() == pytest.approx(0.5, abs=1e-7)


# ------------------------------------------------------------------------------ the earlier form, known answers

def test_routings_keep_each_chunk_with_its_probability_and_the_sink_when_asked():
    g = torch.Generator().manual_seed(0)
    draws = [bernoulli_routing(6, 0.3, False, g) for _ in range(3000)]
    share = sum(len(d) for d in draws) / (6 * len(draws))
    assert abs(share - 0.3) < 0.02 and all(all(0 <= j < 6 for j in d) for d in draws)
    assert all(0 in bernoulli_routing(6, 0.0, True, g) for _ in range(50))
    assert bernoulli_routing(4, 1.0, False, g) == (0, 1, 2, 3)


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"floor{c['log_prob_sigma_floor']}-clip{c['clip_range']}")
def test_the_clipped_objective_over_branch_scores_equals_the_authors(case):
    """``_compute_policy_objective_from_logits`` on a safe rank without KL: flowalign's ``clipped_loss`` and
    ``branch_objective`` with a symmetric clip on the same scores and advantages."""
    log_probs, old = torch.log_softmax(_f64(case["log_pi_theta"]), 0), torch.log_softmax(_f64(case["log_pi_old"]), 0)
    torch.testing.assert_close(torch.exp(log_probs - old), _f64(case["ratio"]), rtol=1e-6, atol=0)
    loss = clipped_loss(log_probs, old, _f64(KNOWN["advantages"]), case["clip_range"])
    torch.testing.assert_close(loss.item(), case["total_loss"], rtol=1e-6, atol=0)
    eps = case["clip_range"]
    loss, _ = branch_objective(_f64(case["log_pi_theta"]), _f64(case["log_pi_old"]), _f64(KNOWN["advantages"]), eps, eps)
    torch.testing.assert_close(loss.item(), case["total_loss"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", [c for c in KNOWN["cases"] if c["log_prob_sigma_floor"] == 0],
                         ids=lambda c: f"clip{c['clip_range']}")
def test_the_energy_policy_at_temperature_2_over_T_equals_the_authors_per_step_scores(case):
    """Without their σ floor the authors' branch score ``−Σ_t mse(x0 − x̂0)/(2σ_t²)`` is ``−Σ_t mse_v/2 = −(T/2)·E``
    (x0 = x_t − σ_t·v): the energy policy at τ = 2/T, taken velocities read from the states."""
    sigmas, states = _f64(KNOWN["sigmas"]), _f64(KNOWN["states"])
    steps = len(sigmas) - 1
    u = taken_velocities(states, sigmas)
    torch.testing.assert_close(u, _f64(KNOWN["taken_u"]), rtol=1e-6, atol=1e-12)
    v = _f64(KNOWN["policy_v"]).requires_grad_(True)
    tau = 2 / steps
    log_probs = torch.log_softmax(-velocity_energy(v, u) / tau, 0)
    torch.testing.assert_close(log_probs.detach(), torch.log_softmax(_f64(case["log_pi_theta"]), 0), rtol=1e-6, atol=0)
    torch.testing.assert_close(x0_scores(v, u, sigmas, 0.0).detach(), _f64(case["log_pi_theta"]), rtol=1e-6, atol=0)
    old = torch.log_softmax(-velocity_energy(_f64(KNOWN["old_v"]), u) / tau, 0)
    loss = clipped_loss(log_probs, old, _f64(KNOWN["advantages"]), case["clip_range"])
    loss.backward()
    torch.testing.assert_close(loss.item(), case["total_loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(v.grad, _f64(case["grad_v"]), rtol=1e-6, atol=1e-15)


def test_taken_velocities_invert_the_jumps():
    g = torch.Generator().manual_seed(1)
    sigmas = torch.tensor([1.0, 0.7, 0.3, 0.0])
    x0, u = torch.randn(2, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    states = [x0]
    for t in range(3):
        states.append(states[-1] + (sigmas[t + 1] - sigmas[t]) * u[:, t])
    torch.testing.assert_close(taken_velocities(torch.stack(states, 1), sigmas), u)


def test_the_update_moves_the_velocity_field_toward_better_branches():
    g = torch.Generator().manual_seed(2)
    u = torch.randn(4, 2, 6, generator=g)  # 4 branches, 2 steps
    v = torch.randn(2, 6, generator=g, requires_grad=True)  # the policy's (shared-state stand-in) velocities
    advantages = torch.tensor([1.5, 0.5, -0.5, -1.5])
    energy = lambda w: velocity_energy(w.expand(4, -1, -1), u)
    old = torch.log_softmax(-energy(v.detach()) / 0.1, 0)
    (grad,) = torch.autograd.grad(clipped_loss(torch.log_softmax(-energy(v) / 0.1, 0), old, advantages, 0.2), v)
    want = sum(a * 2 * (v.detach() - u[i]) / v.numel() for i, a in enumerate(advantages)) / (4 * 0.1)
    torch.testing.assert_close(grad, want)
    stepped = v.detach() - 0.3 * grad
    assert energy(stepped)[0] < energy(v.detach())[0] and energy(stepped)[3] > energy(v.detach())[3]
    (zero,) = torch.autograd.grad(clipped_loss(torch.log_softmax(-energy(v) / 0.1, 0), old, torch.zeros(4), 0.2), v)
    assert torch.equal(zero, torch.zeros_like(zero))


# ------------------------------------------------------------------------------ the trainer

def test_the_authors_rule_scores_branches_against_their_anchor(tmp_path, far_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "run", far_dir, prompt_file, *AUTHORS))
    batch = t.collect(0)
    assert len(batch.groups) == 2
    for group in batch.groups:
        assert group.chunk == 2 and {r for r in group.routings} <= {(0,), (1,)} and len(set(group.routings)) == 2
        assert group.init_scores is not None and group.old_scores.shape == (4,)
        assert group.advantages.abs().max() <= 2.5
    # at the first update the adapter is off-equivalent (B = 0): π_old = π_init, ratio 1, KL 0
    logs = t.update(batch, torch.Generator().manual_seed(0))
    assert logs["ratio_dev"] < 1e-5 and logs["kl"] < 1e-9 and logs["grad_norm"] > 0
    assert 0 <= batch.logs["kvpo/beat_anchor"] <= 1 and "kvpo/anchor_reward" in batch.logs


def test_a_branch_that_keeps_every_entry_has_zero_energy_and_the_first_update_has_ratio_one(tmp_path, far_dir,
                                                                                        prompt_file):
    t = build_trainer(small_config(tmp_path / "run", far_dir, prompt_file, *EARLIER, "trainer.keep_prob=0.5"))
    batch = t.collect(0)
    assert len(batch.groups) == 2 and all(g.states[0].shape[0] == 4 for g in batch.groups)
    kinds = [(group, i, keep == tuple(range(group.chunk))) for group in batch.groups
             for i, keep in enumerate(group.routings)]
    assert {whole for *_, whole in kinds} == {True, False}  # keep_prob 0.5 over 8 branches draws both kinds here
    for group, i, whole in kinds:
        with torch.no_grad():
            e = -t.scores(group, grad=False)[i] * t.tcfg.temperature
        # a branch that kept everything is the policy's own trajectory; a routed history changed what it did
        assert e < 1e-9 if whole else e > 1e-8
    logs = t.update(batch, torch.Generator().manual_seed(0))
    assert logs["ratio_dev"] < 1e-5 and logs["grad_norm"] > 0


@pytest.mark.parametrize("form", [AUTHORS, EARLIER], ids=["authors", "earlier"])
def test_trains_and_resumes_bit_exactly(tmp_path, far_dir, prompt_file, form):
    assert_trains_and_resumes_bit_exactly(tmp_path, far_dir, prompt_file, *form)


def test_a_model_that_cannot_route_and_a_chunk_without_history_are_refused(tmp_path, far_dir, tiny_wan_dir,
                                                                           prompt_file):
    with pytest.raises(UserError, match="routes a streaming"):
        build_trainer(small_config(tmp_path / "a", tiny_wan_dir, prompt_file, *EARLIER))
    with pytest.raises(UserError, match="route_chunks"):
        build_trainer(small_config(tmp_path / "b", far_dir, prompt_file, *EARLIER, "trainer.route_chunks=[0]"))
    # the authors' defaults (sink, 1 nearest, 2 older chunks) leave nothing to route on a 3-chunk model
    with pytest.raises(UserError, match="older_chunks"):
        build_trainer(small_config(tmp_path / "c", far_dir, prompt_file, "trainer.name=kvpo", "model.finetune=lora"))


def test_frame_routing_is_refused_where_the_cache_routes_whole_chunks_and_mixed_units_are_refused(
        tmp_path, far_dir, prompt_file):
    with pytest.raises(UserError, match="routes its history in whole chunks; use trainer.nearest_chunks"):
        build_trainer(small_config(tmp_path / "a", far_dir, prompt_file, "trainer.name=kvpo", "model.finetune=lora",
                                   "trainer.nearest_frames=4", "trainer.older_frames=1"))
    with pytest.raises(Exception, match="older_frames is read when routing in frames"):
        build_trainer(small_config(tmp_path / "b", far_dir, prompt_file, *AUTHORS, "trainer.older_frames=2"))
    with pytest.raises(Exception, match="nearest_chunks counts whole chunks"):
        build_trainer(small_config(tmp_path / "c", far_dir, prompt_file, *AUTHORS, "trainer.nearest_frames=4"))


def test_an_option_of_the_other_form_and_the_former_symmetric_clip_are_refused(tmp_path, far_dir, prompt_file):
    with pytest.raises(Exception, match="temperature is read only with trainer.score=velocity_energy"):
        build_trainer(small_config(tmp_path / "a", far_dir, prompt_file, *AUTHORS, "trainer.temperature=0.1"))
    with pytest.raises(Exception, match="clip_low"):
        build_trainer(small_config(tmp_path / "b", far_dir, prompt_file, *AUTHORS, "trainer.clip_range=0.2"))


def test_the_signals_score_the_routed_chunk_and_the_whole_video(tmp_path, far_dir, prompt_file):
    """The default rule scores each branch twice: its whole video (the global signal, weight 0.5; the tiny videos are
    shorter than the 36-frame clip) and its routed chunk's frames decoded alone (the local signal, weight 1), each
    against the anchor's same frames; a group's advantages are the two fused. The former form (one signal, the
    whole video at weight 1) is what runs saved before the signals resume with."""
    t = build_trainer(small_config(tmp_path / "run", far_dir, prompt_file, *AUTHORS))
    assert (t.tcfg.local_weight, t.tcfg.global_weight, t.tcfg.global_frames) == (1.0, 0.5, 36)
    assert KVPOConfig.before == {"local_weight": 0.0, "global_weight": 1.0, "global_frames": None}
    seen, score = [], t.score

    def recording(samples, *args, **kw):
        out = score(samples, *args, **kw)
        seen.append((samples.shape, out.scores.values.double(), samples.detach().clone()))
        return out

    t.score = recording
    batch = t.collect(0)
    g, frames = 4, t.policy.decode(torch.zeros(1, *t.policy.latent_shape)).shape[1]
    chunk = t.policy.decode(torch.zeros(1, *t.policy.latent_shape)[:, :, -t.policy.chunk_frames[2]:]).shape[1]
    (whole, values, _), (anchors, anchor_values, _), *local = seen
    assert whole[:2] == (2 * g, frames) and anchors[:2] == (2, frames) and chunk < frames
    assert [shape[:2] for shape, _, _ in local] == [(g, chunk), (1, chunk)] * 2
    for j, group in enumerate(batch.groups):  # the local videos are the routed chunk's own, decoded alone
        with torch.no_grad():
            routed_chunk = t.policy.decode(group.states[0][:, -1].to(t.policy.device))
        torch.testing.assert_close(local[2 * j][2], routed_chunk)
    weights = torch.ones(1, dtype=torch.float64)
    for j, group in enumerate(batch.groups):
        branch_local, anchor_local = local[2 * j][1], local[2 * j + 1][1][0]
        expected = fused_anchor_advantages([(values[j * g:(j + 1) * g], anchor_values[j], 0.5),
                                            (branch_local, anchor_local, 1.0)], weights, 2.5)
        torch.testing.assert_close(group.advantages.double(), expected, rtol=1e-6, atol=1e-6)
        beat = any(bool((v > a).any()) for v, a in ((values[j * g:(j + 1) * g, 0], anchor_values[j, 0]),
                                                     (branch_local[:, 0], anchor_local[0])))
        assert group.safe == beat
    with pytest.raises(Exception, match="no reward signal is left"):
        build_trainer(small_config(tmp_path / "none", far_dir, prompt_file, *AUTHORS, "trainer.local_weight=0",
                                   "trainer.global_weight=0"))
    with pytest.raises(Exception, match="local_weight is read only with trainer.advantage=anchor"):
        build_trainer(small_config(tmp_path / "grp", far_dir, prompt_file, *EARLIER, "trainer.local_weight=0.5"))
