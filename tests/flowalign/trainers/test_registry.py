"""Trainers by name, by ``package.module:Class`` and by entry point; every check of a run before weights load
(``flowalign train --check``, ``flowalign plan``)."""

from __future__ import annotations


import pytest
import yaml

from flowalign.cli.main import main
from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer, check_run
from flowalign.trainers import TRAINERS, get_trainer, registered, trainer_config

from tests.tiny_recipes import recipe_of_each_trainer

from .conftest import REDNESS, small_run

TOY = "tests.flowalign.trainers.test_contract:ToyTrainer"


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_every_registered_trainer_names_itself_and_its_tiny_recipe_checks(name, tmp_path):
    cls = get_trainer(name)
    recipe = recipe_of_each_trainer()[name]
    cfg = load_config(recipe, [f"run.output_dir={tmp_path / 'r'}"])
    got_cls, tcfg = check_run(cfg)
    assert got_cls is cls and tcfg.name == name  # the Config's declared name is its registry key
    assert trainer_config({**cfg.trainer, "max_steps": 3})[1].max_steps == 3  # the shared options reach it


def test_a_trainer_given_by_path_trains_and_its_run_keeps_the_path(tmp_path, tiny_sd3_dir, prompt_file):
    args = small_run(tmp_path / "r", tiny_sd3_dir, prompt_file, f"trainer.name={TOY}", "rewards=[]",
                     "model.finetune=full", "trainer.max_steps=1")
    trainer = build_trainer(load_config(None, args))
    assert type(trainer).__name__ == "ToyTrainer" and trainer.tcfg.name == "toy"
    trainer.train()
    assert trainer.step == 1
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert saved["trainer"]["name"] == TOY  # the resolved config runs again as it is
    assert trainer_config(saved["trainer"])[0] is type(trainer)
    resumed = build_trainer(load_config(None, [*args[:-1], "trainer.max_steps=2"]))  # same run: accepted
    resumed.train()
    assert resumed.step == 2


def test_a_trainer_from_an_entry_point(tmp_path, monkeypatch):
    dist = tmp_path / "lab_trainers-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lab-trainers\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[flowalign.trainers]\nlab_toy = {TOY}\nflow_grpo = {TOY}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registered()["lab_toy"] == TOY
    assert get_trainer("lab_toy").__name__ == "ToyTrainer"
    assert get_trainer("flow_grpo").__name__ == "FlowGRPOTrainer"  # an entry point cannot replace a built-in


@pytest.mark.parametrize("name, message", [
    ("flow_grp", "did you mean 'flow_grpo'"),
    ("no_such_module:Trainer", "cannot import 'no_such_module'"),
    ("flowalign.errors:UserError", "is not a trainer class"),
])
def test_a_bad_trainer_name_is_one_line(name, message):
    with pytest.raises(UserError, match=message) as err:
        get_trainer(name)
    assert "\n" not in str(err.value)


def _cli(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("command", [["train", "--check"], ["plan"]])
def test_a_typo_in_the_trainer_section_is_refused_before_any_work(command, capsys, tmp_path, tiny_sd3_dir, prompt_file):
    args = small_run(tmp_path / "r", tiny_sd3_dir, prompt_file)
    code, out = _cli(capsys, *command, "/dev/null", *args, "trainer.lrr=1")
    assert code != 0 and "trainer.lrr" in out and "did you mean 'lr'" in out and "Traceback" not in out
    code, out = _cli(capsys, *command, "/dev/null", *args)
    assert code in (0, None), out
    assert not (tmp_path / "r").exists()  # a check writes nothing


@pytest.mark.parametrize("command", [["train"], ["train", "--check"], ["plan"]])
def test_a_setting_the_trainer_does_not_read_is_refused_naming_the_trainer(command, capsys, tmp_path):
    """Each trainer's config holds only what it reads: another trainer's setting is one line, not ignored."""
    recipe = recipe_of_each_trainer()["rg_opd"]
    code, out = _cli(capsys, *command, str(recipe), f"run.output_dir={tmp_path / 'r'}", "trainer.inner_epochs=2")
    assert code != 0 and "trainer.inner_epochs: rg_opd has no such setting" in out and "Traceback" not in out
    assert not (tmp_path / "r").exists()


def test_train_check_refuses_what_a_run_would_refuse_and_loads_nothing(tmp_path, tiny_sd3_dir, prompt_file):
    base = small_run(tmp_path / "r", tiny_sd3_dir, prompt_file)
    for extra, message in [
        (["rewards=[{name: no_such_reward}]"], "unknown reward 'no_such_reward'"),
        ([f"rewards=[{{name: '{REDNESS}', sharpness: 2}}]"], "has no option 'sharpness'"),
        (["data.prompts=null", "data.bench=vvr", "data.level=impossible"], "impossible"),
        (["eval.bench=nope"], "eval.bench=nope is not a benchmark"),
        ([f"model.path={tmp_path}"], "not a diffusers folder"),
        (["rewards=[]"], "at least one reward"),  # the trainer's own check_config
        (["model.defaults.heigth=48"], "model.defaults.heigth: not a sampling default of the sd3 family"),
    ]:
        with pytest.raises(UserError, match=message):
            check_run(load_config(None, [*base, *extra]))
    trainer_cls, tcfg = check_run(load_config(None, base))
    assert tcfg.name == "flow_grpo" and not (tmp_path / "r").exists()
