"""Every shipped config validates (run sections and its trainer's own section), and so does the trainer section a
run saves of it (every option stated, most at their defaults), so a saved config can be run again."""

from pathlib import Path

import pytest

import yaml

from flowalign.config import dump_config, load_config, validate_section
from flowalign.trainers import get_trainer

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_shipped_config_validates(path):
    cfg = load_config(path)
    trainer = get_trainer(cfg.trainer["name"])
    validate_section(trainer.Config, cfg.trainer, "trainer.")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_the_trainer_section_a_run_saves_validates_again(path):
    """An option that only another form reads is refused when it is given a value, not when the saved config
    states it at its default (a refusal there would stop `flowalign train <run>/config.yaml`)."""
    cfg = load_config(path)
    trainer = get_trainer(cfg.trainer["name"])
    saved = yaml.safe_load(dump_config(cfg, validate_section(trainer.Config, cfg.trainer, "trainer.")))["trainer"]
    assert validate_section(trainer.Config, saved, "trainer.").model_dump() == \
        validate_section(trainer.Config, cfg.trainer, "trainer.").model_dump()


def test_there_are_tiny_and_real_recipes():
    names = {p.parent.name for p in CONFIGS}
    assert {"tiny", "sd3.5-medium", "flux.1-dev", "wan2.1-1.3b", "qwen-image", "flux.2-klein", "wan2.2-a14b",
            "flux.1-kontext", "qwen-image-edit"} <= names
