"""Trainer test helpers: a tiny SD3 folder, a prompt file, and config builders."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowalign.config import load_config
from tests.warm_start import WarmProcess, run_env, starter

REPO = Path(__file__).resolve().parents[3]
REDNESS = "tests.flowalign.trainers.toy_rewards:redness"


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red circle\na blue square\na green star\na yellow triangle\n")
    return path


#: the trainer settings of a seconds-long run, each given only to a trainer that has it
SMALL_TRAINER = {"max_steps": "2", "prompts_per_step": "2", "group_size": "4", "batch_size": "4", "num_steps": "4",
                 "lr": "1e-3"}


def trainer_fields(overrides: list[str] | tuple[str, ...]) -> set[str]:
    """The settings of the trainer that ``overrides`` name (``trainer.name=...``, default flow_grpo)."""
    from flowalign.trainers import get_trainer

    names = [o.split("=", 1)[1] for o in overrides if o.startswith("trainer.name=")]
    return set(get_trainer(names[-1] if names else "flow_grpo").Config.model_fields)


def small_run(run_dir: Path, model_dir: Path, prompt_file: Path, *extra: str) -> list[str]:
    """Overrides for a seconds-long run on the tiny model with a pixel reward and no evaluation."""
    fields = trainer_fields(extra)
    return [
        f"run.output_dir={run_dir}", f"model.path={model_dir}", f"data.prompts={prompt_file}",
        f"rewards=[{{name: '{REDNESS}'}}]", "eval.bench=null", "run.progress=false", "run.tensorboard=false",
        *(f"trainer.{k}={v}" for k, v in SMALL_TRAINER.items() if k in fields), "model.lora.rank=4", *extra,
    ]


def small_config(run_dir: Path, model_dir: Path, prompt_file: Path, *extra: str):
    return load_config(None, small_run(run_dir, model_dir, prompt_file, *extra))


def run_cli(args: list[str]) -> WarmProcess:
    """``python -m flowalign ARGS`` as a process of its own (its output in ``.stdout``), bit-reproducible
    across processes (:data:`tests.warm_start.RUN_ENV`), forked from this worker's warm interpreter."""
    return starter().start("flowalign", args, run_env())


@pytest.fixture(scope="session")
def lrr_dir(tiny_sd3_dir, tmp_path_factory):
    """Random latent registers on the tiny SD3 model, with a small real-pairs file for CoRe."""
    import torch

    import pipelines
    from flowalign.trainers.parts.latent_preference import PreferencePairs
    from rewards.latent_registers import LatentRegisters, load_frozen_transformer

    folder = tmp_path_factory.mktemp("lrr") / "reward"
    reward = LatentRegisters(load_frozen_transformer(str(tiny_sd3_dir), tiny_sd3_dir), num_registers=4,
                             head_hidden=16, base_model=str(tiny_sd3_dir))
    reward.save(folder)
    shape = pipelines.load(tiny_sd3_dir).latent_shape
    gen = torch.Generator().manual_seed(0)
    pairs = PreferencePairs(["a red circle", "a blue square"] * 4, torch.randn(8, *shape, generator=gen),
                            torch.randn(8, *shape, generator=gen))
    pairs.save(folder / "pairs.safetensors")
    return folder
