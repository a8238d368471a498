"""PD-GRPO: a pointwise and a pairwise group-relative advantage mixed over Flow-GRPO's loss
(docs/methods/pd_grpo.md)."""

import pytest
import torch
from safetensors.torch import load_file

from flowalign.advantages import compute_advantages, dual_group_advantages
from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer, check_run

from .conftest import small_config, small_run
from .resume_check import assert_trains_and_resumes_bit_exactly


def test_dual_group_advantages_on_a_known_answer():
    """Scores (0.1, 0.2, 0.9): the pointwise group keeps the large gap to 0.9, the pairwise group sees only
    the order (win rates 0, ½, 1); the advantage mixes the two by λ."""
    r, g = torch.tensor([[0.1], [0.2], [0.9]]), torch.tensor([0, 0, 0])
    mean, std = 0.4, (((0.3**2) + (0.2**2) + (0.5**2)) / 3) ** 0.5
    point = (torch.tensor([0.1, 0.2, 0.9]) - mean) / (std + 1e-4)
    pair = torch.tensor([-0.5, 0.0, 0.5]) / ((1 / 6) ** 0.5 + 1e-4)
    for lam in (0.0, 0.25, 1.0):
        torch.testing.assert_close(dual_group_advantages(r, torch.ones(1), g, lam), (1 - lam) * point + lam * pair)
    torch.testing.assert_close(compute_advantages("dual", r, torch.ones(1), g, pairwise_weight=0.25),
                               0.75 * point + 0.25 * pair)
    # λ = 0 is Flow-GRPO's group advantage, λ = 1 Pref-GRPO's win-rate advantage
    torch.testing.assert_close(compute_advantages("dual", r, torch.ones(1), g, pairwise_weight=0.0),
                               compute_advantages("group", r, torch.ones(1), g))
    torch.testing.assert_close(compute_advantages("dual", r, torch.ones(1), g, pairwise_weight=1.0),
                               compute_advantages("win_rate", r, torch.ones(1), g))


def test_a_pairwise_judge_feeds_only_the_pairwise_group():
    """Rewards: a pointwise score and a pairwise judge's win rates. The pointwise group reads the first only;
    the pairwise group takes the judge's win rates as they are and compares the pointwise scores."""
    comps = torch.tensor([[0.1, 1.0], [0.9, 0.0], [0.5, 0.5]])
    g, w, judged = torch.tensor([0, 0, 0]), torch.tensor([1.0, 1.0]), torch.tensor([False, True])
    point = compute_advantages("group", comps[:, :1], torch.ones(1), g)
    # win rates: compared scores (0, 1, ½) + the judge's (1, 0, ½) = (1, 1, 1): no pairwise signal at all
    torch.testing.assert_close(dual_group_advantages(comps, w, g, 0.5, judged), 0.5 * point)


def test_lambda_zero_and_one_train_exactly_as_flow_grpo_group_and_win_rate(tmp_path, tiny_sd3_dir, prompt_file):
    def run(name, *extra):
        cfg = small_config(tmp_path / name, tiny_sd3_dir, prompt_file, *extra)
        torch.manual_seed(0)
        build_trainer(cfg).train()
        return load_file(str(tmp_path / name / "checkpoints" / "step-000002" / "trainable.safetensors"))

    for lam, kind in ((0.0, "group"), (1.0, "win_rate")):
        pd = run(f"pd{lam}", "trainer.name=pd_grpo", f"trainer.pairwise_weight={lam}")
        ref = run(f"fg-{kind}", "trainer.name=flow_grpo", f"trainer.advantage={kind}")
        assert all(torch.equal(pd[k], ref[k]) for k in ref), kind
        assert max(v.abs().max().item() for k, v in pd.items() if "lora_B" in k) > 0  # it trained


def test_batch_advantages_mix_the_two_groups_and_the_first_ratio_is_one(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=pd_grpo",
                                   "trainer.pairwise_weight=0.3"))
    batch = t.collect(0)
    want = dual_group_advantages(batch.scores.values, batch.scores.weights, batch.prompt_ids, 0.3).clamp(-5, 5)
    torch.testing.assert_close(batch.advantages, want)
    chunk = batch.chunks[0]
    for k in t.trained_steps(chunk):
        with torch.no_grad():
            again = t.step_distribution(chunk, k, t.policy_velocity(chunk, k, True))
        assert torch.equal(again.log_prob, chunk.step(k)[2])


@pytest.mark.parametrize("bad,match", [("trainer.batch_size=2", "multiple of trainer.group_size"),
                                       ("trainer.pairwise_weight=1.5", "pairwise_weight"),
                                       ("trainer.advantage=group", "advantage")])
def test_bad_settings_name_the_field(tmp_path, tiny_sd3_dir, prompt_file, bad, match):
    with pytest.raises(UserError, match=match):
        check_run(load_config(None, small_run(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=pd_grpo", bad)))


def test_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=pd_grpo",
                                          "trainer.updates_per_epoch=2")
