"""Rollouts in batches of trainer.batch_size across prompt groups: samples and log-probs do not depend on
the batching, and rewards of one batch are scored while the next one samples."""

import dataclasses
import time

import pytest
import torch

from flowalign.train import build_trainer

from . import toy_rewards
from .conftest import small_config

# One sample alone through the transformer (batch 1: a CFG forward of 2 rows) and the same sample among
# others (2+ rows each half) take different CPU matmul kernels for some shapes, which round differently
# in the last bits (measured: ≤ 2.4e-6 on a velocity of magnitude ~1). Batches of 2 and 8 are bit-equal.
ROUNDING = dict(rtol=0, atol=2e-5)


def _collect(tmp_path, model, prompts, batch_size, *extra):
    t = build_trainer(small_config(tmp_path / f"b{batch_size}", model, prompts, "trainer.group_size=4",
                                   "trainer.prompts_per_step=2", f"trainer.batch_size={batch_size}", *extra))
    return t.collect(0)


def test_batch_sizes_1_2_8_give_the_same_samples_and_log_probs(tmp_path, tiny_sd3_dir, prompt_file):
    batches = {b: _collect(tmp_path, tiny_sd3_dir, prompt_file, b) for b in (1, 2, 8)}
    assert [len(c) for c in batches[8].chunks] == [8]  # one batch holds both prompt groups
    assert [len(c) for c in batches[2].chunks] == [2] * 4
    latents = {b: torch.cat([c.latents for c in batch.chunks]) for b, batch in batches.items()}
    log_probs = {b: torch.cat([c.log_probs for c in batch.chunks]) for b, batch in batches.items()}
    for b in (1, 2, 8):
        assert torch.equal(batches[b].groups, torch.tensor([0] * 4 + [1] * 4))
    assert torch.equal(latents[2], latents[8]) and torch.equal(log_probs[2], log_probs[8])
    torch.testing.assert_close(latents[1], latents[8], **ROUNDING)
    torch.testing.assert_close(log_probs[1], log_probs[8], **ROUNDING)
    # samples of a group differ (own noise), and the noise is not shared across groups
    x_T = latents[8][:, 0]
    assert len({tuple(x.flatten()[:4].tolist()) for x in x_T}) == 8


def test_rewards_of_a_batch_are_scored_while_the_next_one_samples(tmp_path, tiny_sd3_dir, prompt_file):
    slow = "rewards=[{name: 'tests.flowalign.trainers.toy_rewards:slow_redness'}]"
    t = build_trainer(small_config(tmp_path / "slow", tiny_sd3_dir, prompt_file, slow, "trainer.group_size=4",
                                   "trainer.prompts_per_step=3", "trainer.batch_size=4"))
    finished = []  # when each rollout batch finished sampling (its decode is the last thing it does)
    decode = t.policy.decode
    t.policy.decode = lambda x: (lambda out: finished.append(time.perf_counter()) or out)(decode(x))
    toy_rewards.SLOW_CALLS.clear()
    batch = t.collect(0)
    calls = toy_rewards.SLOW_CALLS
    assert len(batch.chunks) == len(finished) == len(calls) == 3
    # batch 0's reward started once batch 0 was drawn and before batch 1 finished sampling: the two overlap
    assert finished[0] <= calls[0][0] < finished[1]
    # each reward runs after its batch, one at a time (a judge is never called concurrently)
    assert all(finished[i] <= calls[i][0] for i in range(3))
    assert all(calls[i][1] <= calls[i + 1][0] for i in range(2))
    assert batch.logs["reward/total"] == pytest.approx(
        (torch.cat([toy_rewards.redness(c.samples, None, None) for c in batch.chunks])).mean().item(), abs=1e-6)


def _reference_passes(trainer) -> list[tuple[float, float, tuple[int, int]]]:
    """Record (start, end, (chunk id, step)) of every KL reference pass the trainer runs (the real one)."""
    passes = []
    reference_mean = trainer.reference_mean

    def timed(chunk, k):
        start = time.perf_counter()
        out = reference_mean(chunk, k)
        passes.append((start, time.perf_counter(), (id(chunk), k)))
        return out

    trainer.reference_mean = timed
    return passes


def test_the_kl_reference_runs_while_the_last_batch_is_scored_and_changes_no_result(tmp_path, tiny_sd3_dir,
                                                                                     prompt_file):
    layout = ("trainer.group_size=4", "trainer.prompts_per_step=2", "trainer.batch_size=4", "trainer.beta=0.04")
    slow = "rewards=[{name: 'tests.flowalign.trainers.toy_rewards:slow_redness'}]"
    t = build_trainer(small_config(tmp_path / "slow", tiny_sd3_dir, prompt_file, slow, *layout))
    passes = _reference_passes(t)
    finished = []  # when each rollout batch finished sampling (its decode is the last thing it does)
    decode = t.policy.decode
    t.policy.decode = lambda x: (lambda out: finished.append(time.perf_counter()) or out)(decode(x))
    toy_rewards.SLOW_CALLS.clear()
    batch = t.collect(0)
    calls = toy_rewards.SLOW_CALLS
    assert len(batch.chunks) == len(calls) == len(finished) == 2
    # every reference pass ran after the last batch was drawn and before its scores were in (the tiny
    # model's passes take milliseconds, a reward call 0.4 s), none of them twice, and the step's log
    # shows the time it took
    assert passes and all(finished[-1] <= start and end <= calls[-1][1] for start, end, _ in passes)
    assert len({key for *_, key in passes}) == len(passes) == len(batch.prepared)
    assert batch.logs["time/prepare"] > 0
    # the plan takes the prepared means and computes none again: they are the means it computes itself
    plan = t.plan(batch, torch.Generator().manual_seed(0))
    assert len(passes) == len(batch.prepared)
    fresh = t.plan(dataclasses.replace(batch, prepared=None), torch.Generator().manual_seed(0))
    units = [u for step in plan.steps for u in step]
    assert units and all(u.reference is not None for u in units)
    assert [(u.chunk, u.k) for u in units] == [(u.chunk, u.k) for step in fresh.steps for u in step]
    assert all(torch.equal(u.reference, f.reference) for u, f in zip(units, (f for s in fresh.steps for f in s)))

    # a whole step with the slow reward ends at the weights of the same step with the instant one (the
    # same scores; its scores are in at once, so its plan computes all or nearly all the means)
    def trained(trainer):
        trainer.train_step()
        return {n: p.detach().clone() for n, p in trainer.policy.trainable.named_parameters() if p.requires_grad}

    fast = build_trainer(small_config(tmp_path / "fast", tiny_sd3_dir, prompt_file, *layout))
    slow_again = build_trainer(small_config(tmp_path / "slow2", tiny_sd3_dir, prompt_file, slow, *layout))
    a, b = trained(slow_again), trained(fast)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], p) for n, p in t.policy.trainable.named_parameters() if p.requires_grad)
