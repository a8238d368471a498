"""scripts/grad_snr.py: batches for the same prompts differ only in their rollout noise."""

import torch

from flowalign.train import build_trainer
from .conftest import small_config
from tests.scripts import load_script


def test_batches_share_prompts_and_differ_in_noise(tmp_path, tiny_sd3_dir, prompt_file):
    snr = load_script("grad_snr")
    t = build_trainer(small_config(tmp_path / "run", tiny_sd3_dir, prompt_file))
    prompts, metadata, groups = t.step_prompts(0)
    first = snr.batch_gradients(t, prompts, metadata, groups, step=0)
    again = snr.batch_gradients(t, prompts, metadata, groups, step=0)
    other = snr.batch_gradients(t, prompts, metadata, groups, step=1)
    assert sorted(first) == [0, 1, 2]  # the trainer's trained steps: the first ⌊0.99·4⌋ of a 4-step rollout
    for k in first:
        assert torch.allclose(first[k], again[k], atol=1e-7)  # same noise, same gradient; weights untouched
        assert snr.mean_cosine([first[k], other[k]]) < 0.99
    assert abs(snr.mean_cosine([first[0], first[0], 2 * first[0]]) - 1) < 1e-6


def test_the_measured_gradient_is_the_one_the_trainer_applies(tmp_path, tiny_sd3_dir, prompt_file):
    """Summed over steps, the script's gradient points exactly where the trainer's own update would step
    (the update's accumulated gradient, caught just before its optimiser step)."""
    snr = load_script("grad_snr")
    t = build_trainer(small_config(tmp_path / "run", tiny_sd3_dir, prompt_file))
    prompts, metadata, groups = t.step_prompts(0)
    measured = sum(snr.batch_gradients(t, prompts, metadata, groups, step=0).values())
    t.step = 0
    batch = t.group_batch(prompts, metadata, groups)
    applied = []
    t.optimizer_step = lambda: applied.append(torch.cat([p.grad.flatten() for p in t.params])) or 0.0
    t.update(batch, torch.Generator().manual_seed(0))
    assert len(applied) == 1
    assert snr.mean_cosine([measured, applied[0]]) > 1 - 1e-5
