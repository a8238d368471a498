"""AR-CoPO (*AR-CoPO: Align Autoregressive Video Generation with Contrastive Policy Optimization*, arXiv
2603.17461): forked chunk candidates around the centre's noise, Neighbor GRPO's contrastive policy per step of
the fork chunk anchored at drawn candidates, a clipped GRPO update localised to the fork chunk, and the
semi-on-policy replay buffer of reference rollouts (docs/methods/ar_copo.md). The paper's equations are
checked on small fixed tensors with the numbers worked by hand in each test."""

import math

import pytest
import torch

from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.trainers.ar_copo import (ARCoPOConfig, anchored_log_probs, contrastive_log_probs, neighbours,
                                        x0_predictions)
from flowalign.trainers.parts.policy_gradient import clipped_loss

from .conftest import small_config
from .resume_check import assert_trains_and_resumes_bit_exactly

STREAM = ("trainer.name=ar_copo", "trainer.num_steps=2", "model.finetune=lora")
#: the former form the tiny recipe pins
FORMER = ("trainer.anchor=center", "trainer.updates=1", "trainer.replay=recent")


@pytest.fixture(scope="module")
def far_dir(tiny_model_dir):
    return tiny_model_dir("anyflow_far")


# ------------------------------------------------------------------ the paper's equations on fixed tensors


def test_neighbours_are_the_papers_sqrt_one_minus_sigma_squared_mix():
    """Eq. 1 / Alg. 1 line 4: ε_i = √(1 − σ²)·ε* + σ·δ_i. With σ = 0.6 the centre's weight is 0.8."""
    center = torch.tensor([1.0, -2.0, 0.5])
    got = neighbours(center, 0.6, torch.Generator().manual_seed(5), 2)
    delta = torch.randn((2, 3), generator=torch.Generator().manual_seed(5))  # the δ_i it drew
    torch.testing.assert_close(got, 0.8 * center[None] + 0.6 * delta)
    # δ_1 = 0 would leave 0.8·ε*: [0.8, −1.6, 0.4]
    torch.testing.assert_close(0.8 * center, torch.tensor([0.8, -1.6, 0.4]))


def test_neighbours_are_standard_normal_and_as_close_to_the_centre_as_sigma_says():
    center = torch.randn(2000, generator=torch.Generator().manual_seed(0))
    near = neighbours(center, 0.1, torch.Generator().manual_seed(1), 4)
    far = neighbours(center, 1.0, torch.Generator().manual_seed(1), 4)
    assert abs(near.std().item() - 1) < 0.05 and abs(far.std().item() - 1) < 0.05
    corr = lambda a: torch.corrcoef(torch.stack([a, center]))[0, 1].item()
    assert abs(corr(near[0]) - math.sqrt(1 - 0.01)) < 0.01 and abs(corr(far[0])) < 0.06


def test_the_per_step_surrogate_policy_is_a_softmax_of_x0_distances_over_the_candidates():
    """Eq. 4: π(i | s_t) = softmax_i(−d_t^(i)/τ), d between the anchor's x̂0 and candidate i's, at each step t
    on its own (d here the per-element mean, the paper's squared norm over D = 2 elements with τ0 = 2τ)."""
    x0 = torch.tensor([[[0.0, 0.0], [0.0, 0.0]],   # candidate 0 at steps t = 0, 1
                       [[1.0, 0.0], [0.0, 0.0]],   # candidate 1
                       [[0.0, 2.0], [3.0, 0.0]]])  # candidate 2: (G=3, T=2, D=2)
    anchor = torch.zeros(1, 2, 2)  # one anchor predicting 0 at both steps
    got = anchored_log_probs(anchor, x0, temperature=0.5)
    # t = 0: d = (0, 0.5, 2), −d/τ = (0, −1, −4), log Z = log(1 + e^−1 + e^−4) = log 1.3861951 = 0.3265626
    # t = 1: d = (0, 0, 4.5), −d/τ = (0, 0, −9), log Z = log(2 + e^−9) = log 2.0001234 = 0.6932089
    want = torch.tensor([[[-0.3265626, -1.3265626, -4.3265626],
                          [-0.6932089, -0.6932089, -9.6932089]]])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # the anchor's own old policy: π_old(· | s_t, a) uses candidate a's own prediction as the anchor's
    old = anchored_log_probs(x0, x0, temperature=0.5)
    torch.testing.assert_close(old[0], want[0])


def test_x0_predictions_jump_from_each_state_straight_to_sigma_zero():
    """Alg. 1 line 9: x̂0_t = F(x_t, h, t), for a streaming flow the jump x_t − σ_t·v(x_t, σ_t → 0). With a
    velocity v(x, σ, σ') = x + σ' and the grid (1, 0.5, 0): x̂0_0 = 2 − 1·2 = 0, x̂0_1 = 1 − 0.5·1 = 0.5."""

    class Flow:
        def chunk_velocity(self, x, sigma, sigma_next, cache, cond, guidance):
            return x + sigma_next

    states = torch.tensor([[[2.0], [1.0], [0.5]]])  # (B=1, T+1=3, D=1)
    got = x0_predictions(Flow(), states, torch.tensor([1.0, 0.5, 0.0]), None, None, 1.0)
    torch.testing.assert_close(got, torch.tensor([[[0.0], [0.5]]]))


def test_the_clipped_objective_is_the_papers_eq_3():
    """J = (1/G) Σ min(r·A, clip(r, 1 − ε, 1 + ε)·A): r = (1.2, 0.8, 1.0), A = (1, −1, 0), ε = 0.1 give
    min(1.2, 1.1) = 1.1, min(−0.8, −0.9) = −0.9, 0: J = 0.2/3, the loss −J."""
    old = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    new = old + torch.log(torch.tensor([1.2, 0.8, 1.0]))
    loss = clipped_loss(new, old, torch.tensor([1.0, -1.0, 0.0]), 0.1)
    torch.testing.assert_close(loss, torch.tensor(-0.2 / 3))


def test_the_update_pulls_the_anchors_prediction_toward_better_candidates_and_from_worse():
    """At r = 1 with Σ A = 0 the loss's gradient in the anchor's x̂0 is (1/(Gτ)) Σ A_i ∂d_i, ∂d_i = 2(y − y_i)/D:
    candidates (0, 0), (1, 0), (0, 2), A = (1, 0, −1), y = (0, 0), τ = 0.5: (1/1.5)·(−1)·(0, −2) = (0, 4/3)."""
    x0 = torch.tensor([[[0.0, 0.0]], [[1.0, 0.0]], [[0.0, 2.0]]])  # (G=3, T=1, D=2)
    y = torch.zeros(1, 1, 2, requires_grad=True)
    old = anchored_log_probs(y.detach(), x0, 0.5)
    advantages = torch.tensor([1.0, 0.0, -1.0]).expand(1, 1, 3)
    (grad,) = torch.autograd.grad(clipped_loss(anchored_log_probs(y, x0, 0.5), old, advantages, 1e-4), y)
    torch.testing.assert_close(grad, torch.tensor([[[0.0, 4 / 3]]]))  # a step −grad moves y away from (0, 2)


def test_the_former_centre_anchor_update_pulls_toward_better_candidates():
    g = torch.Generator().manual_seed(2)
    candidates = torch.randn(4, 3, 2, 2, generator=g)
    y = torch.randn(3, 2, 2, generator=g, requires_grad=True)
    advantages = torch.tensor([1.5, 0.5, -0.5, -1.5])
    old = contrastive_log_probs(y.detach(), candidates, 0.5)
    loss = clipped_loss(contrastive_log_probs(y, candidates, 0.5), old, advantages, 0.2)
    (grad,) = torch.autograd.grad(loss, y)
    want = sum(a * 2 * (y.detach() - c) / y.numel() for a, c in zip(advantages, candidates)) / (4 * 0.5)
    torch.testing.assert_close(grad, want)


def test_zero_advantages_give_no_gradient_and_the_clip_stops_a_moved_ratio():
    g = torch.Generator().manual_seed(3)
    candidates, y = torch.randn(4, 8, generator=g), torch.randn(8, generator=g, requires_grad=True)
    old = contrastive_log_probs(y.detach(), candidates, 0.1)
    (grad,) = torch.autograd.grad(clipped_loss(contrastive_log_probs(y, candidates, 0.1), old, torch.zeros(4), 0.2), y)
    assert torch.equal(grad, torch.zeros_like(grad))
    shifted = old.clone()
    shifted[0] -= 0.5  # r_0 = e^0.5 > 1.2
    advantages = torch.tensor([1.0, 0.0, 0.0, 0.0])
    (grad,) = torch.autograd.grad(clipped_loss(contrastive_log_probs(y, candidates, 0.1), shifted, advantages, 0.2), y)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_the_defaults_are_the_papers_and_the_former_form_is_recorded():
    c = ARCoPOConfig()
    assert (c.group_size, c.lr, c.neighborhood, c.clip_range, c.anchors, c.updates, c.buffer_size) == \
        (12, 1e-5, 0.5, 1e-4, 4, 2, 100)
    assert (c.anchor, c.replay) == ("candidates", "reference")
    assert ARCoPOConfig.former_forms()[0]["anchor"] == "center"
    with pytest.raises(ValueError, match="trainer.anchors=5"):
        ARCoPOConfig(group_size=4, anchors=5)


# ------------------------------------------------------------------ the trainer on the tiny streaming model


def test_a_paper_step_starts_at_ratio_one_and_moves_the_lora(tmp_path, far_dir, prompt_file):
    """Each anchor's x̂0, recomputed from its stored state with the prefix cache re-encoded, is the one the
    candidates were scored against: every ratio is 1 at the first update; anchors are drawn per group and dealt
    into two optimiser steps."""
    t = build_trainer(small_config(tmp_path / "run", far_dir, prompt_file, *STREAM, "trainer.max_steps=1",
                                   "trainer.anchors=2"))
    before = {k: v.detach().clone() for k, v in t.trainable_state().items()}
    batch = t.collect(0)
    assert len(batch.groups) == 2 and all(g.candidates.shape[0] == 4 for g in batch.groups)
    for group in batch.groups:
        assert group.states.shape[:2] == (4, 3) and group.x0.shape[:2] == (4, 2)
        torch.testing.assert_close(group.states[:, -1], group.candidates)
        with torch.no_grad():
            x0 = t.anchor_predictions(group, [0, 1, 2, 3])
        again = anchored_log_probs(x0.cpu(), group.x0, t.tcfg.temperature)
        assert (again - group.old_log_probs).abs().max() < 1e-5
    plan = t.plan(batch, torch.Generator().manual_seed(0))
    assert len(plan.steps) == 2 and sum(len(s) for s in plan.steps) == 4  # 2 groups × 2 anchors
    for i in range(2):
        drawn = [u.anchors[0] for s in plan.steps for u in s if u.index == i]
        assert len(drawn) == 2 == len(set(drawn))
    logs = t.update(batch, torch.Generator().manual_seed(0))  # the second step's ratios moved: the clip holds them
    assert logs["grad_norm"] > 0
    after = t.trainable_state()
    assert any(not torch.equal(after[k], before[k]) for k in before)


def test_a_former_centre_step_starts_at_ratio_one(tmp_path, far_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "run", far_dir, prompt_file, *STREAM, *FORMER, "trainer.max_steps=1"))
    batch = t.collect(0)
    for group in batch.groups:
        assert group.states is None
        with torch.no_grad():
            y = t.chunk_output(group)
        again = contrastive_log_probs(y.cpu(), group.candidates, t.tcfg.temperature)
        assert (again - group.old_log_probs).abs().max() < 1e-5
    logs = t.update(batch, torch.Generator().manual_seed(0))
    assert logs["ratio_dev"] < 1e-5 and logs["grad_norm"] > 0


def test_semi_on_policy_trains_on_a_fixed_buffer_of_reference_rollouts(tmp_path, far_dir, prompt_file):
    """replay: reference fills the buffer once with the starting weights' groups, and every step replays
    replay_groups of them with their stored π_old, with no fresh groups."""
    t = build_trainer(small_config(tmp_path / "run", far_dir, prompt_file, *STREAM, "trainer.replay_groups=1",
                                   "trainer.buffer_size=2"))
    first = t.collect(0)
    reference = list(t.buffer)
    assert len(reference) == 2 and first.fresh == 0 and len(first.groups) == 1
    assert first.groups[0] in reference
    t.update(first, torch.Generator().manual_seed(0))
    second = t.collect(1)
    assert second.fresh == 0 and len(t.buffer) == 2 and all(a is b for a, b in zip(t.buffer, reference))
    replayed = second.groups[0]
    with torch.no_grad():
        now = anchored_log_probs(t.anchor_predictions(replayed, [0, 1, 2, 3]).cpu(), replayed.x0, t.tcfg.temperature)
    assert (now - replayed.old_log_probs).abs().max() > 0  # the weights moved since the reference sampled it


def test_the_former_recent_buffer_mixes_earlier_groups_into_fresh_ones(tmp_path, far_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "run", far_dir, prompt_file, *STREAM, *FORMER, "trainer.replay_groups=1"))
    first = t.collect(0)
    assert first.logs["ar_copo/replayed"] == 0 and len(t.buffer) == 2
    t.update(first, torch.Generator().manual_seed(0))
    second = t.collect(1)
    assert second.logs["ar_copo/replayed"] == 1 and len(second.groups) == 3 and second.fresh == 2
    assert any(second.groups[-1] is g for g in first.groups)


def test_trains_and_resumes_bit_exactly_with_the_reference_buffer(tmp_path, far_dir, prompt_file):
    t = assert_trains_and_resumes_bit_exactly(tmp_path, far_dir, prompt_file, *STREAM, "trainer.replay_groups=1",
                                              "trainer.buffer_size=2", "trainer.anchors=2")
    assert len(t.buffer) == 2 and t.buffer[0].x0 is not None


def test_trains_and_resumes_bit_exactly_in_the_former_form(tmp_path, far_dir, prompt_file):
    t = assert_trains_and_resumes_bit_exactly(tmp_path, far_dir, prompt_file, *STREAM, *FORMER, "trainer.replay_groups=1")
    assert len(t.buffer) == 4


def test_a_model_that_does_not_stream_is_refused(tmp_path, tiny_wan_dir, prompt_file):
    with pytest.raises(UserError, match="streaming"):
        build_trainer(small_config(tmp_path / "run", tiny_wan_dir, prompt_file, *STREAM))


def test_fork_chunks_out_of_range_are_refused(tmp_path, far_dir, prompt_file):
    with pytest.raises(UserError, match="fork_chunks"):
        build_trainer(small_config(tmp_path / "run", far_dir, prompt_file, *STREAM, "trainer.fork_chunks=[3]"))
