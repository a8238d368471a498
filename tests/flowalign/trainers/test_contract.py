"""The trainer contract: a trainer written here through the documented hooks only (collect, plan, loss,
finish, state_dict/load_state_dict) trains on the tiny model, checkpoints, and resumes bit-exactly."""

import inspect
import sys
from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch
from accelerate import Accelerator

from flowalign.config import load_config, validate_section
from flowalign.data import read_prompt_file
from flowalign.errors import UserError
from flowalign.reward_set import RewardSet
from flowalign.train import build_trainer
from flowalign.trainers import TRAINERS, get_trainer
from flowalign.trainers.base import GroupTrainer, GroupTrainerConfig, Plan, derived_seed

from .conftest import small_config, small_run
from .test_rg_opd import lrr_dir  # noqa: F401  (a fixture)


class ToyConfig(GroupTrainerConfig):
    name: Literal["toy"] = "toy"
    micro_batches: int = 2


def toy_loss(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``mean‖v − target‖²`` (flow matching toward a fixed latent)."""
    return ((v - target) ** 2).mean()


@dataclass
class ToyBatch:
    x: torch.Tensor
    sigma: float
    target: torch.Tensor
    cond: object
    logs: dict = field(default_factory=dict)


class ToyTrainer(GroupTrainer):
    """Flow matching of noised zero latents, two optimiser steps per batch; counts the samples it saw."""

    Config = ToyConfig
    needs_rewards = False

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.seen = 0
        self.running = torch.zeros(())

    def collect(self, step):
        g = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, 9))
        prompts = [self.data.prompts[i] for i in self.data.batch_indices(self.cfg.run.seed, step, 4)]
        eps = self.policy.initial_noise(4, g)
        sigma = float(torch.rand((), generator=g)) * 0.8 + 0.1
        return ToyBatch(sigma * eps, sigma, eps, self.policy.encode(prompts), {"toy/sigma": sigma})

    def plan(self, batch, generator):
        parts = torch.randperm(4, generator=generator).tensor_split(self.tcfg.micro_batches)
        return Plan([[p] for p in parts])

    def loss(self, batch, unit):
        v = self.policy.velocity(batch.x[unit], batch.sigma, batch.cond[unit.tolist()], 1.0)
        loss = toy_loss(v, batch.target[unit])
        return loss, {"loss": loss.item()}

    def finish(self, batch):
        self.seen += len(batch.x)
        self.running = 0.5 * self.running + 0.5 * batch.target.mean()
        return {"seen": float(self.seen)}

    def state_dict(self):
        return {"seen": self.seen, "running": self.running}

    def load_state_dict(self, state):
        self.seen, self.running = int(state["seen"]), state["running"].clone()


def _toy(run_dir, model_dir, prompt_file, *extra):
    import pipelines

    torch.manual_seed(0)
    cfg = small_config(run_dir, model_dir, prompt_file, "model.finetune=full", "rewards=[]",
                       "run.checkpoint_every=1", "trainer.lr=1e-3", "trainer.ema_decay=0.9",
                       "trainer.ema_every=1", *extra)
    tcfg = validate_section(ToyConfig, {**cfg.trainer, "name": "toy"}, "trainer.")
    ToyTrainer.check_config(cfg, tcfg)
    policy = pipelines.load(model_dir, full_finetune=True)
    run_dir.mkdir(parents=True, exist_ok=True)  # what flowalign.train.prepare_run_dir does for a registered trainer
    return ToyTrainer(cfg, tcfg, policy, [], read_prompt_file(prompt_file), None, Accelerator(cpu=True), run_dir)


def test_a_toy_trainer_trains_checkpoints_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file):
    first = _toy(tmp_path / "r", tiny_sd3_dir, prompt_file)
    before = [p.detach().clone() for p in first.params]
    first.train()  # 2 steps
    assert first.step == 2 and first.seen == 8
    assert not all(torch.equal(a, b) for a, b in zip(before, first.params))
    resumed = _toy(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.max_steps=3")
    resumed.train()
    straight = _toy(tmp_path / "s", tiny_sd3_dir, prompt_file, "trainer.max_steps=3")
    straight.train()
    assert resumed.step == straight.step == 3 and resumed.seen == straight.seen == 12
    assert torch.equal(resumed.running, straight.running)
    for a, b in zip(resumed.params, straight.params):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(resumed.ema.shadow, straight.ema.shadow))


def test_reward_free_trainers_accept_no_rewards_and_the_others_refuse(tmp_path, tiny_sd3_dir, prompt_file):
    assert len(RewardSet([])) == 0
    scores = RewardSet([]).score(torch.zeros(3, 3, 4, 4), ["a"] * 3, [{}] * 3)
    assert scores.valid.all() and torch.equal(scores.total, torch.zeros(3))
    with pytest.raises(UserError, match="at least one reward"):
        build_trainer(load_config(None, small_run(tmp_path / "grpo", tiny_sd3_dir, prompt_file, "rewards=[]")))
    assert not (tmp_path / "grpo").exists()  # refused before the run folder is written


def test_festdpo_needs_rewards_only_to_label_its_own_samples(tmp_path, tiny_sd3_dir, prompt_file):
    festdpo = get_trainer("festdpo")
    cfg = load_config(None, small_run(tmp_path / "f", tiny_sd3_dir, prompt_file, "rewards=[]", "trainer.name=festdpo"))
    online = validate_section(festdpo.Config, cfg.trainer, "trainer.")
    with pytest.raises(UserError, match="at least one reward"):
        festdpo.check_config(cfg, online)
    festdpo.check_config(cfg, online.model_copy(update={"pairs": "prefs.jsonl"}))  # offline labels: no reward needed


#: what each built-in trainer needs for a one-step run on the tiny model (besides conftest's small_run)
VVR = ("data.prompts=null", "data.bench=vvr", "data.level=medium", "data.n=16")
ONE_STEP = {
    "flow_grpo": (),
    "flash_grpo": ("trainer.num_steps=4",),
    "diffusion_nft": (),
    "diffusion_opsd": (*VVR, "rewards=[{name: vvr_soft}]"),
    "rg_opd": ("trainer.num_steps=3",),
    "festdpo": ("trainer.K=8", "trainer.num_steps=2", "trainer.prompts_per_step=1"),
    "soar": (*VVR, "rewards=[]", "model.finetune=full", "trainer.corrections=1", "trainer.rollout_steps=4"),
    "sft": (*VVR, "rewards=[]", "model.finetune=full"),
    "dance_grpo": (),
    "mix_grpo": (),
    "grpo_guard": (),
    "awm": (),
    "dgpo": (),
    "diffusion_dpo": (),
    "self_opd": ("trainer.branches=2",),
    "tempflow_grpo": (),
    "pref_grpo": (),
    "gardo": ("trainer.gate=false",),  # one reward: the gate's auxiliary comparison is tested in test_gardo
    "pd_grpo": (),
    "seppo": (*VVR, "rewards=[]", "trainer.reference_every=1"),
    "fav": (*VVR, "rewards=[{name: vvr_soft}]"),
    "flow_opd": ("trainer.cold_start_steps=0", "trainer.group_size=1"),  # its teacher: the student's own adapter
    "ar_copo": ("trainer.num_steps=2",),
    "kvpo": ("trainer.num_steps=2", "trainer.keep_sink=false"),
    "afd": ("trainer.num_steps=2", "trainer.train_timesteps=1"),  # its teacher: a second copy of the student
}
#: trainers of streaming video models run on the tiny streaming twin instead of the tiny SD3
STREAMING = {"ar_copo", "kvpo", "afd"}


def state_of(obj, depth: int = 0):
    """What ``obj`` holds, copied so that a later change shows: tensors cloned; dataclasses, mappings,
    sequences and plain objects walked (modules and functions are not data: left out)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.detach().clone())
    if depth > 8 or isinstance(obj, torch.nn.Module) or callable(obj):
        return None
    if isinstance(obj, dict):
        return {k: state_of(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [state_of(v, depth + 1) for v in obj]
    if isinstance(obj, (int, float, str, bool, type(None))):
        return obj
    if hasattr(obj, "__dict__"):
        return {k: state_of(v, depth + 1) for k, v in vars(obj).items()}
    return obj


def same_state(a, b) -> bool:
    if isinstance(a, tuple) and a[:1] == ("tensor",):
        return isinstance(b, tuple) and a[1].shape == b[1].shape and a[1].dtype == b[1].dtype and bool(
            ((a[1] == b[1]) | (a[1].isnan() & b[1].isnan()) if a[1].is_floating_point() else a[1] == b[1]).all())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a:
        return b != b  # NaN equals itself here
    return a is b or (type(a) is type(b) and isinstance(a, (int, float, str, bool, type(None))) and a == b)


def test_the_state_check_sees_a_changed_field():
    batch = ToyBatch(torch.zeros(2), 0.5, torch.ones(2), None, {"a": 1.0})
    before = state_of(batch)
    assert same_state(before, state_of(batch))
    batch.target[0] = 3.0
    assert not same_state(before, state_of(batch))
    batch.target[0], batch.logs["b"] = 1.0, 2.0
    assert not same_state(before, state_of(batch))
    unscored = state_of(torch.full((2,), float("nan")))  # a NaN that stays is no change
    assert same_state(unscored, state_of(torch.full((2,), float("nan"))))
    assert not same_state(unscored, state_of(torch.tensor([float("nan"), 0.0])))


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_every_trainer_logs_reward_total_over_all_ranks_or_not_at_all(name, tmp_path, tiny_sd3_dir, prompt_file,
                                                                      lrr_dir, tiny_model_dir):
    """``reward/total`` comes from the loop's :meth:`GroupTrainer.reward_logs` (every rank's valid samples),
    in the same step's log line as the per-reward means it weighs; a trainer without rewards logs none
    (no placeholder). Collectives go through the loop's hooks: no trainer file makes its own. ``loss()``
    changes neither its batch nor its unit."""
    assert set(ONE_STEP) == set(TRAINERS)  # a new built-in trainer gets a line here
    extra = ONE_STEP[name] + ((f"trainer.latent_reward={lrr_dir}",) if name == "rg_opd" else ())
    if name == "flow_opd":
        torch.manual_seed(0)
        build_trainer(small_config(tmp_path / "teacher", tiny_sd3_dir, prompt_file)).policy.save_adapter(
            tmp_path / "teacher-adapter")
        extra += (f"trainer.teachers=[{{adapter: {tmp_path / 'teacher-adapter'}}}]",)
    model = tiny_model_dir("anyflow_far") if name in STREAMING else tiny_sd3_dir
    if name == "afd":
        extra += (f"trainer.teacher={{model: '{model}'}}",)
    t = build_trainer(small_config(tmp_path / name, model, prompt_file, f"trainer.name={name}", *extra))
    own_loss, calls = t.loss, []

    def loss_that_must_not_mutate(batch, unit):
        before = state_of((batch, unit))
        out = own_loss(batch, unit)
        calls.append(same_state(before, state_of((batch, unit))))
        return out

    t.loss = loss_that_must_not_mutate
    logs = t.train_step()
    assert calls and all(calls), f"{name}: loss() changed its batch or unit; do that work once in plan()"
    if t.cfg.rewards:  # one reward of weight 1: the total is its mean
        (mean,) = [k for k in logs if k.startswith("reward/") and "invalid" not in k and k != "reward/total"]
        assert logs["reward/total"] == pytest.approx(logs[mean], abs=1e-6)
    else:
        assert not any(k.startswith("reward/") for k in logs)
    source = inspect.getsource(sys.modules[type(t).__module__])
    for own in ('"reward/total"', "acc.gather", "acc.reduce", "torch.distributed", "parallel.gather", "parallel.total"):
        assert own not in source, f"{name}: {own} in the trainer's file; use GroupTrainer's hook"
