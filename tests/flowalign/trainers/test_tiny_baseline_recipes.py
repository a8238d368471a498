"""The shipped tiny recipes of tempflow_grpo, pref_grpo, gardo, pd_grpo, seppo and fav train two steps on the embedded model as
written (only the sizes shrunk), with the settings that make each method itself."""

from pathlib import Path

import pytest
import torch

from flowalign.config import load_config
from flowalign.train import build_trainer
from flowalign.trainers import get_trainer

REPO = Path(__file__).resolve().parents[3]
SMALL = ("trainer.max_steps=2", "trainer.max_minutes=null", "trainer.prompts_per_step=1", "trainer.group_size=4",
         "trainer.batch_size=4", "trainer.num_steps=4", "eval.bench=null", "run.progress=false",
         "run.tensorboard=false", "run.checkpoint_every=2", "data.n=16")


@pytest.mark.parametrize("name", ["tempflow_grpo", "pref_grpo", "gardo", "pd_grpo", "seppo", "fav"])
def test_the_tiny_recipe_trains_two_steps(name, tmp_path):
    fields = get_trainer(name).Config.model_fields  # each trainer setting only to a trainer that has it
    small = [o for o in SMALL if not o.startswith("trainer.") or o.split("=")[0].split(".", 1)[1] in fields]
    overrides = [f"run.output_dir={tmp_path / name}", f"model.path={REPO / 'assets' / 'tiny-sd3-vvr'}", *small]
    if name == "tempflow_grpo":
        overrides.append("trainer.branch_steps=null")  # the recipe's list is for its own 10 steps
    cfg = load_config(REPO / "configs" / "tiny" / f"{name}_vvr.yaml", overrides)
    torch.manual_seed(0)
    t = build_trainer(cfg)
    before = [p.detach().clone() for p in t.params]
    t.train()
    assert t.step == 2 and any(not torch.equal(a, b) for a, b in zip(before, t.params))
    assert (tmp_path / name / "checkpoints").is_dir()
    if name == "gardo":
        assert t.tcfg.main_reward == "vvr" and [n for n, _, _ in t.rewards] == ["vvr", "vvr_soft"]
    if name == "pref_grpo":
        assert t.tcfg.advantage == "win_rate" and t.tcfg.shared_initial_noise
    if name == "pd_grpo":
        assert t.tcfg.advantage == "dual" and t.tcfg.pairwise_weight == 0.5
    if name == "seppo":
        assert t.reference_steps == [0] and t.tcfg.anchor and t.tcfg.reference_selection == "random"
    if name == "fav":
        assert t.tcfg.num_steps == 4 and t.cfg.eval.num_steps == 4 and t.tcfg.betas == (0.9, 0.95)
