"""AR-CoPO: forked chunk candidates around the centre's noise, Neighbor GRPO's contrastive policy, a clipped GRPO
update localised to the fork chunk, and the semi-on-policy replay buffer (docs/methods/ar_copo.md)."""

import math

import pytest
import torch

from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.trainers.ar_copo import contrastive_log_probs, neighbours
from flowalign.trainers.parts.policy_gradient import clipped_loss

from .conftest import small_config
from .resume_check import assert_trains_and_resumes_bit_exactly

STREAM = ("trainer.name=ar_copo", "trainer.num_steps=2", "model.finetune=lora")


@pytest.fixture(scope="module")
def far_dir(tiny_model_dir):
    return tiny_model_dir("anyflow_far")


def test_neighbours_are_standard_normal_and_as_close_to_the_centre_as_beta_says():
    center = torch.randn(2000, generator=torch.Generator().manual_seed(0))
    near = neighbours(center, 0.1, torch.Generator().manual_seed(1), 4)
    far = neighbours(center, 1.0, torch.Generator().manual_seed(1), 4)
    assert abs(near.std().item() - 1) < 0.05 and abs(far.std().item() - 1) < 0.05
    # corr(ε_i, ε_c) = √(1 − β²)
    corr = lambda a: torch.corrcoef(torch.stack([a, center]))[0, 1].item()
    assert abs(corr(near[0]) - math.sqrt(1 - 0.01)) < 0.01 and abs(corr(far[0])) < 0.06


def test_the_update_pulls_toward_better_candidates_and_pushes_from_worse():
    g = torch.Generator().manual_seed(2)
    candidates = torch.randn(4, 3, 2, 2, generator=g)
    y = torch.randn(3, 2, 2, generator=g, requires_grad=True)
    advantages = torch.tensor([1.5, 0.5, -0.5, -1.5])
    old = contrastive_log_probs(y.detach(), candidates, 0.5)
    loss = clipped_loss(contrastive_log_probs(y, candidates, 0.5), old, advantages, 0.2)
    (grad,) = torch.autograd.grad(loss, y)
    # with Σ A = 0 at r = 1 the gradient is (1/(Gτ)) Σ A_i ∇d_i, ∇d_i = 2(y − y_i)/D
    want = sum(a * 2 * (y.detach() - c) / y.numel() for a, c in zip(advantages, candidates)) / (4 * 0.5)
    torch.testing.assert_close(grad, want)
    step = y.detach() - 0.5 * grad
    d = lambda z: ((z - candidates) ** 2).flatten(1).mean(1)
    assert d(step)[0] < d(y.detach())[0] and d(step)[3] > d(y.detach())[3]


def test_zero_advantages_give_no_gradient_and_the_clip_stops_a_moved_ratio():
    g = torch.Generator().manual_seed(3)
    candidates, y = torch.randn(4, 8, generator=g), torch.randn(8, generator=g, requires_grad=True)
    old = contrastive_log_probs(y.detach(), candidates, 0.1)
    (grad,) = torch.autograd.grad(clipped_loss(contrastive_log_probs(y, candidates, 0.1), old, torch.zeros(4), 0.2), y)
    assert torch.equal(grad, torch.zeros_like(grad))
    # a ratio already past 1 + ε on a positive advantage takes no further gradient
    shifted = old.clone()
    shifted[0] -= 0.5  # r_0 = e^0.5 > 1.2
    advantages = torch.tensor([1.0, 0.0, 0.0, 0.0])
    (grad,) = torch.autograd.grad(clipped_loss(contrastive_log_probs(y, candidates, 0.1), shifted, advantages, 0.2), y)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_a_training_step_starts_at_ratio_one_and_moves_the_lora(tmp_path, far_dir, prompt_file):
    """The fork chunk regenerated with gradients (its prefix cache re-encoded) is the one the candidates were
    scored against: every ratio is 1 at the first update."""
    t = build_trainer(small_config(tmp_path / "run", far_dir, prompt_file, *STREAM, "trainer.max_steps=1"))
    before = {k: v.detach().clone() for k, v in t.trainable_state().items()}
    batch = t.collect(0)
    assert len(batch.groups) == 2 and all(g.candidates.shape[0] == 4 for g in batch.groups)
    for group in batch.groups:
        assert torch.allclose(group.advantages.mean(), torch.tensor(0.0), atol=1e-5)
        with torch.no_grad():
            y = t.chunk_output(group)
        again = contrastive_log_probs(y.cpu(), group.candidates, t.tcfg.temperature)
        assert (again - group.old_log_probs).abs().max() < 1e-5
    logs = t.update(batch, torch.Generator().manual_seed(0))
    assert logs["ratio_dev"] < 1e-5 and logs["grad_norm"] > 0
    after = t.trainable_state()
    assert any(not torch.equal(after[k], before[k]) for k in before)


def test_replayed_groups_keep_the_probabilities_they_were_collected_with(tmp_path, far_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "run", far_dir, prompt_file, *STREAM, "trainer.replay_groups=1"))
    first = t.collect(0)
    assert first.logs["ar_copo/replayed"] == 0 and len(t.buffer) == 2
    t.update(first, torch.Generator().manual_seed(0))
    second = t.collect(1)
    assert second.logs["ar_copo/replayed"] == 1 and len(second.groups) == 3
    replayed = second.groups[-1]
    assert any(replayed is g for g in first.groups)  # an earlier group, with its stored π_old
    with torch.no_grad():
        now = contrastive_log_probs(t.chunk_output(replayed).cpu(), replayed.candidates, t.tcfg.temperature)
    assert (now - replayed.old_log_probs).abs().max() > 0  # the weights moved since it was collected


def test_trains_and_resumes_bit_exactly_with_the_replay_buffer(tmp_path, far_dir, prompt_file):
    t = assert_trains_and_resumes_bit_exactly(tmp_path, far_dir, prompt_file, *STREAM, "trainer.replay_groups=1")
    assert len(t.buffer) == 4


def test_a_model_that_does_not_stream_is_refused(tmp_path, tiny_wan_dir, prompt_file):
    with pytest.raises(UserError, match="streaming"):
        build_trainer(small_config(tmp_path / "run", tiny_wan_dir, prompt_file, *STREAM))


def test_fork_chunks_out_of_range_are_refused(tmp_path, far_dir, prompt_file):
    with pytest.raises(UserError, match="fork_chunks"):
        build_trainer(small_config(tmp_path / "run", far_dir, prompt_file, *STREAM, "trainer.fork_chunks=[3]"))
