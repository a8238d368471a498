"""``parallel.sequence_parallel``: each sample's tokens split over processes through diffusers' context
parallelism, alone and with FSDP over a 2-D (data × sequence) mesh, on CPU processes with gloo. The tiny
Wan twin's velocity is bit-equal to the whole model's and training ends at the single process's weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.paths import REPO_ROOT
from flowalign.sequence_parallel import Layout, split_sequences
from tests.warm_start import run_env, run_ranks, starter

#: two short Flow-GRPO steps of the tiny Wan twin with a LoRA and a dense pixel reward
RUN = ["configs/tiny/flow_grpo_motion.yaml", "run.progress=false", "run.tensorboard=false", "eval.bench=null",
       "trainer.max_steps=2", "trainer.max_minutes=null", "trainer.group_size=2", "trainer.batch_size=2",
       "trainer.num_steps=3", "trainer.steps_per_chunk=2", "model.finetune=lora", "model.lora.rank=4", "trainer.lr=1e-3",
       "data.n=8", "run.checkpoint_every=2", "rewards=[{name: 'tests.flowalign.trainers.toy_rewards:redness'}]"]


def test_processes_are_data_ranks_times_sequence_ranks():
    layout = Layout.of(2, world=6, rank=5)
    assert (layout.data_world, layout.data_rank, layout.sequence_rank) == (3, 2, 1)
    assert [Layout.of(2, 4, r).data_rank for r in range(4)] == [0, 0, 1, 1]
    assert Layout.of(1, 3, 2).data_rank == 2  # without sequence parallelism every process is a data rank
    with pytest.raises(UserError, match=r"parallel.sequence_parallel=2 must divide the number of processes \(3\)"):
        Layout.of(2, 3, 0)


def test_a_transformer_without_a_context_parallel_plan_is_refused(tiny_model_dir):
    from diffusers import SD3Transformer2DModel

    transformer = SD3Transformer2DModel.from_pretrained(str(tiny_model_dir("sd3") / "transformer"))
    with pytest.raises(UserError, match="SD3Transformer2DModel no context-parallel plan"):
        split_sequences(transformer, mesh=None, attention="ulysses")


def test_one_process_with_sequence_parallelism_is_refused_before_training(tmp_path):
    """The layout is checked when the trainer is built: a clear error, no step taken, no checkpoint."""
    cfg = load_config(REPO_ROOT / RUN[0], [*RUN[1:], f"run.output_dir={tmp_path / 'run'}",
                                            "parallel.sequence_parallel=2"])
    from flowalign.train import train

    with pytest.raises(UserError, match="must divide the number of processes"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


def launch(nproc: int, module: str, args: list[str], timeout: int = 600) -> str:
    """``python -m MODULE ARGS``, or ``torchrun --standalone --nproc_per_node NPROC -m MODULE ARGS``, warm-started
    (:mod:`tests.warm_start`); the output of every process."""
    if nproc == 1:
        out, _ = (proc := starter().start(module, args, run_env())).communicate(timeout=timeout)
        code = proc.returncode
    else:
        code, out = run_ranks(module, args, nproc, timeout=timeout)
    assert code == 0, out[-6000:]
    return out


@pytest.mark.slow
def test_split_velocity_equals_the_whole_models_and_the_gradients_sum_to_its(tmp_path):
    launch(2, "tests.flowalign.sequence_parallel_check", [str(tmp_path), "ddp", "fsdp"])
    for kind in ("ddp", "fsdp"):
        for rank in (0, 1):
            result = json.loads((tmp_path / kind / f"rank{rank}.json").read_text())
            assert result["velocity_max_diff"] == 0.0 and result["velocity_scale"] > 1, kind  # bit-equal, not trivially
            assert result["gradient_max_relative_diff"] < 1e-5, kind  # the data rank's gradient: its sequence ranks' sum
            assert "native backend" in result["refusals"]["ring"], kind  # ring attention needs log-sum-exp: refused on CPU


def run_args(run: Path, prompts: int, *extra: str) -> list[str]:
    return [*RUN, f"run.output_dir={run}", f"trainer.prompts_per_step={prompts}", *extra]


def trained(run: Path) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The run's final weights and its log lines."""
    logs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return load_file(str(run / "checkpoints" / "step-000002" / "trainable.safetensors")), logs


def train_run(run: Path, nproc: int, prompts: int, *extra: str) -> tuple[dict[str, torch.Tensor], list[dict]]:
    launch(nproc, "flowalign", ["train", *run_args(run, prompts, *extra)])
    return trained(run)


@pytest.mark.slow
def test_training_with_split_sequences_ends_at_the_single_process_weights(tmp_path):
    """4 processes as 2 data ranks × 2 sequence ranks with FSDP sharding over all four (the 2-D mesh) against
    one process holding both prompts: the same first rollouts (their rewards equal to the bit) and the same
    weights. (ddp's split velocity and gradient sums are checked above; a 1 × 2 ddp run adds no code path.)
    Adam's first steps turn the last-bit gradient differences of near-zero entries (the split sums over tokens
    in another order) into up to ~2e-5 on a few of 32768 weights (measured)."""
    launch(1, "flowalign", ["train", *run_args(tmp_path / "one-two-prompts", 2)])
    two, two_logs = trained(tmp_path / "one-two-prompts")
    assert max(v.abs().max().item() for k, v in two.items() if "lora_B" in k) > 1e-3  # B starts at zero: it moved
    weights, logs = train_run(tmp_path / "fsdp-2x2", 4, 1, "parallel.sequence_parallel=2", "parallel.strategy=fsdp")
    # the first rollouts: from the same weights, their rewards equal to the bit
    assert logs[0]["reward/total"] == two_logs[0]["reward/total"]
    assert logs[1]["reward/total"] == pytest.approx(two_logs[1]["reward/total"], rel=1e-4)
    # Adam would hide a gradient off by a constant factor (a sequence rank's share not summed): the norm shows it
    for log, ref_log in zip(logs, two_logs, strict=True):
        assert log["train/grad_norm"] == pytest.approx(ref_log["train/grad_norm"], rel=1e-4)
    diffs = torch.cat([(weights[k] - two[k]).abs().flatten() for k in two])
    assert diffs.max() < 1e-4 and (diffs > 1e-6).float().mean() < 1e-3, (diffs.max(), (diffs > 1e-6).sum())
