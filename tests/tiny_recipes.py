"""The shipped tiny recipes (``configs/tiny/*.yaml``) shrunk to a one-step run, for the tests that train them."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs" / "tiny").glob("*.yaml"))

#: only the size of the step is shrunk (each setting given only to a trainer that has it)
SMALL = {"trainer.max_steps": "1", "trainer.max_minutes": "null", "trainer.prompts_per_step": "1",
         "trainer.group_size": "2", "trainer.batch_size": "2", "trainer.num_steps": "2", "eval.bench": "null",
         "eval.prompts": "null", "eval.rewards": "[]", "data.n": "16", "run.progress": "false",
         "run.tensorboard": "false"}
#: what a recipe's own settings need beside SMALL, to fit a 2-sample, 2-step rollout
FOUR_STEPS = ("trainer.num_steps=4",)
FIT = {"dance_grpo_vvr": FOUR_STEPS, "pref_grpo_vvr": FOUR_STEPS,  # timestep_fraction trains 0 of 2 steps
       "flash_grpo_vvr": FOUR_STEPS, "flash_grpo_motion": FOUR_STEPS, "mix_grpo_vvr": FOUR_STEPS,  # their windows
       "tempflow_grpo_vvr": ("trainer.branch_steps=null",),  # the recipe's list is for its own 10 steps
       "festdpo_vvr": ("trainer.K=8", "trainer.pairs_per_prompt=2"),  # its group is K (8 at least)
       "afd_motion": ("trainer.teacher.num_steps=2",),  # the teacher model's own 20-step videos
       "flow_opd_vvr": ("trainer.cold_start_steps=0",)}  # the distillation stage, where its rewards are scored


def trainer_name(path: Path) -> str:
    """The ``trainer.name`` a recipe picks."""
    return str((yaml.safe_load(path.read_text()).get("trainer") or {}).get("name", "flow_grpo"))


def one_step(path: Path, output_dir: Path) -> list[str]:
    """Overrides that shrink recipe ``path`` to one small step written to ``output_dir``."""
    from flowalign.trainers import get_trainer

    fields = set(get_trainer(trainer_name(path)).Config.model_fields)
    small = [f"{k}={v}" for k, v in SMALL.items() if not k.startswith("trainer.") or k.split(".", 1)[1] in fields]
    return [f"run.output_dir={output_dir}", *small, *FIT.get(path.stem, ())]


def recipe_of_each_trainer() -> dict[str, Path]:
    """The first tiny recipe of every trainer that has one, by trainer name."""
    found: dict[str, Path] = {}
    for path in CONFIGS:
        found.setdefault(trainer_name(path), path)
    return found
