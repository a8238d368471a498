"""flowalign plan counts the rollouts a step holds from each trainer's ``rollouts_per_step``: checked here
against what one step of every registered trainer's tiny recipe samples."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import yaml

from flowalign.config import load_config
from flowalign.train import build_trainer
from flowalign.trainers import TRAINERS

from tests.flowalign.trainers.conftest import REDNESS
from tests.tiny_recipes import REPO, one_step, recipe_of_each_trainer

RECIPES = recipe_of_each_trainer()
#: trainers that learn from data alone ((image, caption) pairs): a step samples nothing
DATA_ONLY = {"sft", "soar"}
#: trainers whose trajectories may end early: their count is the most a step draws, checked with none ending
NO_EARLY_STOP = {"umm_reflection": ("trainer.stop_phrase=a phrase no reflection holds",)}


def sampled_in_one_step(trainer) -> tuple[int, set[int]]:
    """Samples of the trained policy that one step's ``collect`` draws, and the step counts its samplers
    asked the policy's σ grid for.

    Counted where the samples are made: rows the shared sampler :func:`flowalign.sampling.rollout` starts
    from noise (a state continued with the ODE, e.g. a branch's finish, is no new sample), rows of
    :func:`flowalign.sampling.streaming.stream_rollout` (only its forks when the streams fork: the stream
    they fork from is their prefix), and for a trainer with a sampling loop of its own, the rows it hands
    the scoring service (each sample it draws is scored once). A teacher model's samples are not the policy's."""
    rollout_module = sys.modules["flowalign.sampling.rollout"]
    streaming = sys.modules["flowalign.sampling.streaming"]
    trainer_module = sys.modules[type(trainer).__module__]
    trained = {id(p) for p in trainer.params}
    started, streams, judged, grids = [], [], [], set()

    def is_policy(policy) -> bool:
        return any(id(p) in trained for p in getattr(policy, "trainable", torch.nn.Module()).parameters())

    start, stream, judge, sigmas = rollout_module._start, streaming.stream_rollout, trainer.judge, trainer.policy.sigmas

    def counted_start(policy, n, *args, **kwargs):
        if is_policy(policy):
            started.append(n)
        return start(policy, n, *args, **kwargs)

    def counted_stream(policy, prompts, *args, **kwargs):
        if is_policy(policy):
            streams.append((len(prompts), kwargs.get("prefix") is not None))
        return stream(policy, prompts, *args, **kwargs)

    def counted_judge(scores, samples, *args, **kwargs):
        judged.append(len(samples))
        return judge(scores, samples, *args, **kwargs)

    def counted_sigmas(num_steps, *args, **kwargs):
        grids.add(int(num_steps))
        return sigmas(num_steps, *args, **kwargs)

    patched = [(rollout_module, "_start", counted_start), (streaming, "stream_rollout", counted_stream)]
    if hasattr(trainer_module, "stream_rollout"):
        patched.append((trainer_module, "stream_rollout", counted_stream))
    saved = [(m, name, getattr(m, name)) for m, name, _ in patched]
    for m, name, f in patched:
        setattr(m, name, f)
    trainer.judge, trainer.policy.sigmas = counted_judge, counted_sigmas
    try:
        trainer.collect(trainer.step)
    finally:
        for m, name, f in saved:
            setattr(m, name, f)
        del trainer.judge, trainer.policy.sigmas
    forks = [n for n, forked in streams if forked]
    drawn = sum(started) + (sum(forks) if forks else sum(n for n, _ in streams))
    return (drawn if drawn else sum(judged)), grids


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_rollouts_per_step_are_what_a_step_samples(name, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    path = RECIPES[name]
    torch.manual_seed(0)
    overrides = [*one_step(path, tmp_path / "run"), *NO_EARLY_STOP.get(name, ())]
    recipe_rewards = (yaml.safe_load(path.read_text()) or {}).get("rewards") or []
    if recipe_rewards:  # a reward that varies within every group, as the contract tests add
        video = any("motion" in str(r.get("name", "")) for r in recipe_rewards)
        overrides.append("rewards=" + json.dumps([*recipe_rewards, {"name": REDNESS if video else "brightness",
                                                                    "weight": 1.0}]))
    trainer = build_trainer(load_config(path, overrides))
    prompts, per_prompt, steps = type(trainer).rollouts_per_step(trainer.tcfg)
    drawn, grids = sampled_in_one_step(trainer)
    assert prompts * per_prompt == drawn, f"{name}: rollouts_per_step says {prompts} x {per_prompt}, a step drew {drawn}"
    if name in DATA_ONLY:
        assert drawn == 0 and steps == 0
    else:
        assert drawn > 0 and steps in grids, f"{name}: {steps} sampling steps, its samplers ran {sorted(grids)}"
