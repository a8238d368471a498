"""Every shipped config validates (run sections and its trainer's own section)."""

from pathlib import Path

import pytest

from flowalign.config import load_config, validate_section
from flowalign.trainers import get_trainer

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_shipped_config_validates(path):
    cfg = load_config(path)
    trainer = get_trainer(cfg.trainer["name"])
    validate_section(trainer.Config, cfg.trainer, "trainer.")


def test_there_are_tiny_and_real_recipes():
    names = {p.parent.name for p in CONFIGS}
    assert {"tiny", "sd3.5-medium", "flux.1-dev", "wan2.1-1.3b", "qwen-image", "flux.2-klein", "wan2.2-a14b",
            "flux.1-kontext"} <= names
