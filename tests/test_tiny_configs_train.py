"""Every ``configs/tiny/*.yaml`` trains one step as shipped, from a fresh run folder.

Only the size of the step is shrunk (prompts, group, batch, sampling steps, one step, no evaluation); the
model, rewards, teachers and latent rewards are the ones the config names, so a config whose prerequisite
is not shipped (or not built by the run itself) fails here as it would for a user.
"""

from pathlib import Path

import pytest
import torch
import yaml

from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.trainers.parts.teacher_weights import teacher_checkpoint

from tests.tiny_recipes import CONFIGS, REPO, one_step


def strings(node, where=""):
    """Every string value of a YAML tree with its dotted place."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from strings(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from strings(v, f"{where}[{i}]")
    elif isinstance(node, str):
        yield where, node


def test_every_tiny_config_is_here():
    assert len(CONFIGS) >= 30 and {"flow_opd_vvr", "rg_opd_vvr", "core_vvr", "flow_grpo_hpsv3"} <= {p.stem for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_tiny_config_reads_only_shipped_files(path):
    # runs/ is not in a fresh clone (.gitignore): a config may write there, never read a prerequisite from it
    reads = [(k, v) for k, v in strings(yaml.safe_load(path.read_text())) if k != "run.output_dir"]
    assert not [(k, v) for k, v in reads if v.startswith("runs/")]
    assert not [(k, v) for k, v in reads if v.startswith("assets/") and not (REPO / v).exists()]


def test_a_shipped_teacher_is_found_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # as model.path and trainer.latent_reward: relative to the repository if not here
    shipped = Path("assets/tiny-sd3-vvr-teachers/counting")
    assert teacher_checkpoint(shipped) == REPO / shipped
    (tmp_path / "assets" / "mine").mkdir(parents=True)  # a folder of the user's own comes first
    assert teacher_checkpoint(Path("assets/mine")) == Path("assets/mine")
    with pytest.raises(UserError, match="'assets/none' does not exist"):
        teacher_checkpoint(Path("assets/none"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_tiny_config_trains_one_step_as_shipped(path, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the README runs configs from the repository root
    cfg = load_config(path, one_step(path, tmp_path / "run"))
    torch.manual_seed(0)
    trainer = build_trainer(cfg)
    trainer.train()
    assert trainer.step == 1
    assert (tmp_path / "run" / "checkpoints" / "step-000001" / "COMPLETE").is_file()
    assert all(torch.isfinite(p).all() for p in trainer.params)
