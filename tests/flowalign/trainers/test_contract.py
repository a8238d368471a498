"""The trainer contract: a trainer written here through the documented hooks only (collect, plan, loss,
finish, state_dict/load_state_dict) trains on the tiny model, checkpoints, and resumes bit-exactly."""

import inspect
import json
import sys
from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch
import yaml
from accelerate import Accelerator

from flowalign.config import load_config, validate_section
from flowalign.data import read_prompt_file
from flowalign.errors import UserError
from flowalign.reward_set import RewardSet
from flowalign.train import build_trainer
from flowalign.trainers import TRAINERS, get_trainer
from flowalign.trainers.base import GroupTrainer, Plan, TrainerConfig, derived_seed

from tests.tiny_recipes import REPO, one_step, recipe_of_each_trainer

from .conftest import REDNESS, small_config, small_run


class ToyConfig(TrainerConfig):
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

    def finish(self, batch, steps):
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
    own = {k: v for k, v in cfg.trainer.items() if k in ToyConfig.model_fields}  # small_config's are Flow-GRPO's
    tcfg = validate_section(ToyConfig, {**own, "name": "toy"}, "trainer.")
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


def test_finish_sees_each_optimiser_steps_logs_apart(tmp_path, tiny_sd3_dir, prompt_file, monkeypatch):
    """The toy's plan takes two optimiser steps of one unit each: ``finish`` gets two dicts, each with that
    step's one logged loss and its gradient norm (as floats), and the step's log line is their mean."""
    t = _toy(tmp_path / "r", tiny_sd3_dir, prompt_file)
    seen, finish = [], t.finish
    monkeypatch.setattr(t, "finish", lambda batch, steps: seen.append(steps) or finish(batch, steps))
    logs = t.update(t.collect(0), torch.Generator().manual_seed(0))
    (steps,) = seen
    assert [sorted(s) for s in steps] == [["grad_norm", "loss"]] * 2
    assert all(len(s["loss"]) == len(s["grad_norm"]) == 1 and type(s["grad_norm"][0]) is float for s in steps)
    assert steps[0]["loss"] != steps[1]["loss"]  # two units, not one step's value twice
    assert logs["loss"] == pytest.approx((steps[0]["loss"][0] + steps[1]["loss"][0]) / 2)
    assert logs["grad_norm"] == pytest.approx((steps[0]["grad_norm"][0] + steps[1]["grad_norm"][0]) / 2)


def test_a_checkpoint_without_state_the_trainer_keeps_is_refused_in_one_line(tmp_path, tiny_sd3_dir, prompt_file,
                                                                             monkeypatch):
    """A checkpoint saved before a trainer kept some state (an earlier flowalign) is refused by name, not with a
    KeyError's trace, and nothing of the run is lost."""
    _toy(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.max_steps=1").train()
    saved = sorted((tmp_path / "r" / "checkpoints").iterdir())
    resumed = _toy(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.max_steps=2")
    monkeypatch.setattr(resumed, "load_state_dict", lambda state: state["count_since_upgrade"])
    with pytest.raises(UserError, match=r"holds no 'count_since_upgrade' of toy's state .* choose another "
                                        r"run.output_dir"):
        resumed.train()
    assert sorted((tmp_path / "r" / "checkpoints").iterdir()) == saved


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


RECIPES = recipe_of_each_trainer()
#: what the loop owns, not the trainer: walked past when counting the trainer's own copies of weights
LOOP_OWNED = {"policy", "optimisation", "optimizer", "params", "ema", "_rewards", "data", "evaluator", "logger", "acc",
              "parallel", "cfg", "tcfg", "run_dir"}
#: what a trainer file must not call: the loop's scoring service and the strategy's collectives do it
NOT_IN_A_TRAINER = ('"reward/total"', "acc.gather", "acc.reduce", "torch.distributed", "parallel.gather",
                    "parallel.total", "rewards.score", "gathered_advantages", "compute_advantages", "check_invalid",
                    "not_differentiable()", "pixel_reward_gradient(", "flowalign.cli")


def test_every_registered_trainer_has_a_tiny_recipe():
    """Adding a trainer is its file, its registry line, its tiny recipe and its test: the contract tests
    below find each trainer's recipe in configs/tiny/."""
    assert not set(TRAINERS) - set(RECIPES), f"no configs/tiny recipe for {sorted(set(TRAINERS) - set(RECIPES))}"


def owned_tensors(obj, depth: int = 0, seen: set | None = None) -> list[torch.Tensor]:
    """Every tensor ``obj`` holds (walking containers, dataclasses, modules and plain objects), once each."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 6:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, torch.nn.Module):
        return [t for t in (*obj.parameters(), *obj.buffers()) if id(t) not in seen and not seen.add(id(t))]
    if isinstance(obj, dict):
        values = obj.values()
    elif isinstance(obj, (list, tuple, set)):
        values = obj
    elif hasattr(obj, "__dict__") and not callable(obj) and not isinstance(obj, type):
        values = vars(obj).values()
    else:
        return []
    return [t for v in values for t in owned_tensors(v, depth + 1, seen)]


def held_policies(obj, seen: set, depth: int = 0) -> list:
    """The second models ``obj`` holds (policies: objects with ``trained_modules``, e.g. a teacher model inside a
    helper), walking as :func:`owned_tensors` does."""
    if id(obj) in seen or depth > 6 or isinstance(obj, (torch.Tensor, torch.nn.Module, type)) or callable(obj):
        return []
    seen.add(id(obj))
    if hasattr(obj, "trained_modules"):
        return [obj]
    if isinstance(obj, dict):
        values = obj.values()
    elif isinstance(obj, (list, tuple, set)):
        values = obj
    else:
        values = vars(obj).values() if hasattr(obj, "__dict__") else []
    return [p for v in values for p in held_policies(v, seen, depth + 1)]


def copies_held(trainer) -> dict[str, int]:
    """Copies of weights the trainer allocated, counted from what it holds: ``trained`` (sets of tensors shaped
    like the trained ones), ``model`` (modules as large as the trained model, and second policies such as a
    teacher model, whatever their size) and the loop's ``reference``."""
    from collections import Counter

    # a helper holding the policy (e.g. to encode images) holds no copy: the walk stops at what the loop owns
    loop = {id(v) for k, v in vars(trainer).items() if k in LOOP_OWNED} | {id(p) for p in trainer.params}
    second = [p for k, v in vars(trainer).items() if k not in LOOP_OWNED for p in held_policies(v, set(loop))]
    loop |= {id(p) for p in second}  # a second model is counted once, as a model
    own = [t for k, v in vars(trainer).items() if k not in LOOP_OWNED for t in owned_tensors(v, seen=set(loop))]
    trained = Counter(tuple(p.shape) for p in trainer.params)
    held = Counter(tuple(t.shape) for t in own)
    modules = [v for k, v in vars(trainer).items() if k not in LOOP_OWNED]
    policy = trainer.policy
    model_size = sum(p.numel() for name in getattr(policy, "trained_modules", ()) for p in
                     getattr(policy, name).parameters())
    held_modules = [m for v in modules for m in (v if isinstance(v, (list, tuple)) else [v])
                    if isinstance(m, torch.nn.Module)]
    # a module may keep another outside its own tree (a latent reward's frozen transformer): a network too
    hidden = [x for m in held_modules for sub in m.modules() for x in vars(sub).values()
              if isinstance(x, torch.nn.Module) and x not in list(sub.children())]
    networks = [sum(p.numel() for p in m.parameters()) for m in held_modules + hidden]
    whole = sum(1 for n in networks if n >= model_size > 0)
    return {"trained": min(held[shape] // n for shape, n in trained.items()),
            "model": whole + len(second), "reference": int(getattr(policy, "reference_modules", None) is not None),
            "own": sorted(n for n in networks if n < model_size)}


def copies_declared(trainer) -> dict[str, int]:
    copies = type(trainer).weight_copies(trainer.cfg, trainer.tcfg)
    return {"trained": sum(c.count for c in copies if c.size == "trained" and c.kind != "reference"),
            "model": sum(c.count for c in copies if c.size == "model"),
            "reference": sum(c.count for c in copies if c.kind == "reference"),
            "own": sorted(c.params for c in copies if c.size == "own" for _ in range(c.count))}


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_every_trainer_keeps_the_contract(name, tmp_path, monkeypatch):
    """Each registered trainer, one step of its tiny recipe: ``reward/total`` comes from the loop's scoring
    service (every rank's valid samples), in the same log line as the per-reward means it weighs, and a
    trainer without rewards logs none; its hooks read the batch and never change it (``loss()`` changes
    neither batch nor unit); collectives and rewards go through the loop (nothing of either in the trainer's
    file); and the copies of weights it declares (``weight_copies``, what ``plan`` counts) are the copies it holds."""
    monkeypatch.chdir(REPO)
    path = RECIPES[name]
    torch.manual_seed(0)
    overrides = one_step(path, tmp_path / "run")
    recipe_rewards = (yaml.safe_load(path.read_text()) or {}).get("rewards") or []
    if recipe_rewards:  # one reward that varies within every group, so each trainer's update runs
        video = any("motion" in str(r.get("name", "")) for r in recipe_rewards)
        varying = REDNESS if video else "brightness"  # brightness: differentiable, for the reward-gradient trainers
        overrides.append("rewards=" + json.dumps([*recipe_rewards, {"name": varying, "weight": 1.0}]))
    t = build_trainer(load_config(path, overrides))
    own_loss, own_plan, own_judge = t.loss, t.plan, t.judge
    calls, judged, planned = [], [], []

    def loss_that_must_not_mutate(batch, unit):
        before = state_of((batch, unit))
        out = own_loss(batch, unit)
        calls.append(same_state(before, state_of((batch, unit))))
        return out

    def plan_that_remembers(batch, generator):
        planned.append((batch, state_of(batch)))
        return own_plan(batch, generator)

    def judge_that_counts(*args, **kw):
        judged.append(1)
        return own_judge(*args, **kw)

    t.loss, t.plan, t.judge = loss_that_must_not_mutate, plan_that_remembers, judge_that_counts
    logs = t.train_step()
    assert calls and all(calls), f"{name}: loss() changed its batch or unit; do that work once in plan()"
    batch, before = planned[0]
    assert same_state(before, state_of(batch)), f"{name}: plan/loss/finish changed the batch; hooks only read it"
    if t.cfg.rewards:
        assert judged, f"{name}: scored its samples without the loop's scoring service (GroupTrainer.score)"
        assert "reward/total" in logs
    else:
        assert not any(k.startswith("reward/") for k in logs)
    source = inspect.getsource(sys.modules[type(t).__module__])
    for own in NOT_IN_A_TRAINER:
        assert own not in source, f"{name}: {own} in the trainer's file; use GroupTrainer's services"
    assert copies_held(t) == copies_declared(t), f"{name}: weight_copies declares other copies than it holds"


#: the base methods a trainer may build on: the Flow-GRPO family's presets, DiffusionOPSD/NFT's shared
#: self-distillation, SePPO's DPO (SFT lives in soar.py itself)
BASE_METHODS = {"flow_grpo", "self_distill", "diffusion_dpo"}


def test_no_trainer_imports_a_sibling_but_its_documented_base_method():
    """The trainers folder reads in three floors: the contract and parts, base methods, presets of them."""
    import ast

    folder = REPO / "flowalign" / "trainers"
    methods = {path.stem for path in folder.glob("*.py")} & ({t.split(":")[0].rsplit(".", 1)[1] for t in
                                                              TRAINERS.values()} | BASE_METHODS)
    bad = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flowalign.trainers."):
                other = node.module.split(".")[2]
                if other in methods and other != path.stem and (other not in BASE_METHODS or path.stem in BASE_METHODS):
                    bad.append(f"{path.name} imports {node.module}")
    assert not bad, bad


#: the loop's own machinery and services: a trainer supplies hooks around them and never replaces one
LOOP_METHODS = ("update", "train_step", "optimizer_step", "train", "evaluate", "save_checkpoint", "maybe_resume",
                "score", "judge", "reward_gradient", "gather", "gather_objects", "total", "keyed_generator")


def test_no_trainer_replaces_the_loop_or_its_services():
    """Work after the optimiser steps belongs in ``finish(batch, steps)`` (which sees each step's logs), not in
    an override of ``update`` that wraps the loop."""
    replaced = {name: [m for m in LOOP_METHODS if getattr(get_trainer(name), m) is not getattr(GroupTrainer, m)]
                for name in sorted(TRAINERS)}
    assert not {name: methods for name, methods in replaced.items() if methods}


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_what_runs_saved_before_an_option_computed_is_a_setting_of_that_option(name):
    """``Config.before`` (with its option groups', ``former_forms()``): each key is an option of the trainer, its
    value a valid setting other than the default (a run saved without the key resumes only with it, see
    test_config.py); a ``before_when`` entry names a former form and another option of the trainer."""
    from typing import Annotated

    from pydantic import TypeAdapter

    config = get_trainer(name).Config
    before, when = config.former_forms()
    for key, (option, values) in when.items():
        assert key in before and option in config.model_fields and values, (name, key, option)
    for key, value in before.items():
        assert key in config.model_fields, f"{name}: before names {key!r}, not an option"
        field = config.model_fields[key]
        kind = Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
        assert TypeAdapter(kind).validate_python(value) == value, (name, key)
        assert value != field.get_default(call_default_factory=True), f"{name}: before.{key} is the default"
