"""The final checkpoint is written before the final evaluation: a kill during the evaluation loses no
training."""

from flowalign import checkpoint as ckpt
from flowalign.train import train
from tests.flowalign.trainers.conftest import prompt_file, small_config  # noqa: F401 (a fixture)


def test_the_final_checkpoint_precedes_the_final_evaluation(tmp_path, tiny_sd3_dir, prompt_file):
    run_dir = tmp_path / "r"
    train(small_config(run_dir, tiny_sd3_dir, prompt_file, "trainer.max_steps=1", "run.checkpoint_every=1000",
                       "eval.bench=vvr", "eval.level=easy", "eval.n=1", "eval.num_steps=2", "eval.at_start=false",
                       "eval.gallery=false"))
    saved = ckpt.latest_checkpoint(run_dir)
    assert saved == run_dir / "checkpoints" / "step-000001"
    evaluated = run_dir / "evals" / "step-000001" / "metrics.json"
    assert (saved / ckpt.COMPLETE).stat().st_mtime_ns <= evaluated.stat().st_mtime_ns
