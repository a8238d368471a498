"""What a run checks of its config and folder before training: a config that can teach nothing is warned
about; a folder whose run saved no checkpoint does not block a corrected rerun, one with a checkpoint does."""

from flowalign.cli.main import main
from flowalign.train import check_run
from tests.flowalign.trainers.conftest import REDNESS, prompt_file, small_config, small_run  # noqa: F401 (a fixture)

#: a plug-in that exits: every batch it scores is invalid (a reward outage)
EXITS = "tests.flowalign.trainers.test_reward_failures:exits"


def test_rewards_all_of_weight_zero_are_warned_about(tmp_path, tiny_sd3_dir, prompt_file, capsys):
    check_run(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, f"rewards=[{{name: '{REDNESS}', weight: 0}}]"))
    out = capsys.readouterr().out
    assert f"warning: every reward has weight 0 ({REDNESS}: 0)" in out and "learns nothing" in out
    check_run(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file,
                           f"rewards=[{{name: '{REDNESS}', weight: 0}}, {{name: '{REDNESS}_of_red_prompts', weight: 0.5}}]"))
    assert "warning" not in capsys.readouterr().out


def test_a_run_failed_before_its_first_checkpoint_does_not_block_the_corrected_rerun(tmp_path, tiny_sd3_dir,
                                                                                     prompt_file, capsys):
    run_dir = tmp_path / "r"

    def train(reward: str, *extra: str) -> int:
        return main(["train", "/dev/null", *small_run(run_dir, tiny_sd3_dir, prompt_file, "trainer.max_steps=1",
                                                      "run.checkpoint_every=1", f"rewards=[{reward}]", *extra)])

    assert train(f"{{name: '{EXITS}'}}") == 2  # step 0: every sample invalid
    assert "100% of the samples have invalid rewards" in capsys.readouterr().err
    assert (run_dir / "config.yaml").exists() and not (run_dir / "checkpoints").exists()
    assert train(f"{{name: '{REDNESS}'}}") == 0
    assert f"note: {run_dir} holds a run that saved no checkpoint, with another config (differs in rewards)" in \
        capsys.readouterr().out
    # with a checkpoint to continue, another reward is another run; a new deadline is not
    assert train(f"{{name: '{EXITS}'}}", "trainer.max_steps=2") == 2
    assert "holds another run's config (differs in rewards)" in capsys.readouterr().err
    assert train(f"{{name: '{REDNESS}', timeout_s: 30}}", "trainer.max_steps=2") == 0
    assert "resumed from" in capsys.readouterr().out
