"""MixGRPO: the sliding SDE window (docs/methods/mix_grpo.md)."""

import torch

from flowalign.sampling import sliding_window
from flowalign.train import build_trainer

from .conftest import small_config
from .resume_check import assert_trains_and_resumes_bit_exactly


def test_the_window_slides_by_the_stride_every_interval_and_rolls_back():
    # T = 8: starts 0..5 (the window stays within steps 0..5, narrowing at the end), 2 training steps each
    starts = [sliding_window(step, 8, 3, 2, 1) for step in range(14)]
    assert starts == [(0, 3), (0, 3), (1, 3), (1, 3), (2, 3), (2, 3), (3, 3), (3, 3), (4, 2), (4, 2),
                      (5, 1), (5, 1), (0, 3), (0, 3)]
    assert [sliding_window(step, 8, 2, 1, 2)[0] for step in range(4)] == [0, 2, 4, 0]


def test_rollouts_are_sde_only_in_the_window_of_the_step(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=mix_grpo",
                                   "trainer.num_steps=6", "trainer.window_size=2", "trainer.shift_interval=1"))
    for step, window in ((0, [0, 1]), (1, [1, 2]), (2, [2, 3]), (3, [3]), (4, [0, 1])):
        t.step = step
        batch = t.collect(step)
        assert all(c.trained_steps() == window for c in batch.chunks)
        assert batch.logs["window_start"] == window[0]
        chunk = batch.chunks[0]
        assert torch.isnan(chunk.log_probs[:, [k for k in range(6) if k not in window]]).all()  # ODE elsewhere
        for k in window:  # on-policy: the ratio is exactly 1
            with torch.no_grad():
                again = t.step_distribution(chunk, k, t.policy_velocity(chunk, k, True))
            assert torch.equal(again.log_prob, chunk.step(k)[2])


def test_trains_and_resumes_bit_exactly_as_the_window_moves(tmp_path, tiny_sd3_dir, prompt_file):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=mix_grpo",
                                          "trainer.window_size=2", "trainer.shift_interval=1")
