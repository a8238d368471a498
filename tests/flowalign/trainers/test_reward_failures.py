"""A reward that hangs, exits or invalidates every sample: the run says which reward and why, and never
hangs or dies without a word. The plug-ins below are real rewards loaded by ``module:function``."""

from __future__ import annotations

import threading

import pytest
import torch

from flowalign.errors import UserError
from flowalign.reward_check import check_frame_count
from flowalign.reward_set import RewardScores, RewardSet, TimeLimited
from flowalign.train import build_trainer
from flowalign.trainers.rollouts import check_invalid
from rewards.vvr_motion import generate_tasks
from rewards.vvr_motion.render import render
from rewards.vvr_motion.reward import VVRMotionReward
from tests.flowalign.trainers.conftest import small_config
from tests.flowalign.trainers.toy_rewards import redness

HERE = "tests.flowalign.trainers.test_reward_failures"
#: set at the end of a test to let the abandoned ``hangs`` calls finish
RELEASE = threading.Event()
STARTED: list[int] = []


def hangs(samples: torch.Tensor, prompts, metadata) -> torch.Tensor:
    """A plug-in stuck on a dead connection: returns only once ``RELEASE`` is set."""
    STARTED.append(len(prompts))
    RELEASE.wait()
    return redness(samples, prompts, metadata)


def exits(samples: torch.Tensor, prompts, metadata) -> torch.Tensor:
    """A plug-in that calls ``sys.exit(3)`` (a CLI's main reused as a reward)."""
    raise SystemExit(3)


def interrupted(samples: torch.Tensor, prompts, metadata) -> torch.Tensor:
    raise KeyboardInterrupt


@pytest.fixture
def release():
    RELEASE.clear()
    STARTED.clear()
    yield
    RELEASE.set()


def test_a_hung_reward_is_abandoned_after_its_timeout_and_the_run_stops_naming_it(tmp_path, tiny_sd3_dir,
                                                                                      prompt_file, release):
    spec = f"rewards=[{{name: '{HERE}:hangs', timeout_s: 0.5}}]"
    t = build_trainer(small_config(tmp_path / "run", tiny_sd3_dir, prompt_file, spec))
    assert isinstance(t.rewards.entries[0][2], TimeLimited)
    with pytest.raises(UserError) as e:
        t.train_step()
    message = str(e.value)
    assert "100% of the samples have invalid rewards" in message and "timeout_s=0.5" in message
    assert f"{HERE}:hangs" in message
    # the first batch's call still hangs: the second batch is refused at once, not stacked beside it
    assert STARTED == [4]


def test_a_timed_out_batch_is_invalid_and_the_next_one_scores_again(release, capsys):
    from rewards.registry import load

    rewards = RewardSet([("stuck", 1.0, TimeLimited("stuck", load(f"{HERE}:hangs"), 0.2))])
    x = torch.rand(3, 3, 8, 8)
    first = rewards.score(x, ["a"] * 3, [{}] * 3)
    assert not first.valid.any() and first.values.eq(0).all()
    assert "warning: reward 'stuck' gave no answer within timeout_s=0.2" in capsys.readouterr().out
    assert "still running" in rewards.score(x, ["a"] * 3, [{}] * 3).reasons[0]
    RELEASE.set()
    rewards.entries[0][2]._abandoned.join()  # the abandoned call returns (and is thrown away)
    again = rewards.score(x, ["a"] * 3, [{}] * 3)
    assert again.valid.all() and torch.allclose(again.values[:, 0], redness(x, [], []))


def test_grad_mode_reaches_the_worker_thread():
    x = torch.rand(2, 3, 4, 4, requires_grad=True)
    from flowalign.protocols import RewardOutput

    def mean(samples, prompts, metadata):
        return RewardOutput({"m": samples.flatten(1).mean(1)}, valid=torch.ones(2, dtype=torch.bool))

    total = RewardSet([("m", 1.0, TimeLimited("m", mean, 10))]).weighted_total(x, ["a", "b"], [{}, {}])
    total.sum().backward()
    assert x.grad is not None and torch.allclose(x.grad, torch.full_like(x, 1 / 48))


def test_a_reward_that_exits_is_a_reward_error_naming_it(capsys):
    from rewards.registry import load

    rewards = RewardSet([("quits", 1.0, load(f"{HERE}:exits"))])
    out = rewards.score(torch.rand(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert not out.valid.any() and out.reasons == ["quits: raised SystemExit: 3"] * 2
    assert "warning: reward 'quits' raised SystemExit: 3" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="reward 'quits' raised SystemExit"):
        rewards.weighted_total(torch.rand(2, 3, 4, 4), ["a", "b"], [{}, {}])
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C still stops the run
        RewardSet([("i", 1.0, load(f"{HERE}:interrupted"))]).score(torch.rand(1, 3, 4, 4), ["a"], [{}])


def test_the_stop_names_the_rewards_own_reason():
    tasks = generate_tasks(4, seed=0, level="easy")  # checked on 9-frame clips
    clips = torch.stack([torch.from_numpy(render(t, size=32, num_frames=5)).permute(0, 3, 1, 2).float() / 255
                         for t in tasks])
    scores = RewardSet([("vvr_motion", 1.0, VVRMotionReward())]).score(clips, [t.prompt for t in tasks],
                                                                       [{"task": t} for t in tasks])
    with pytest.raises(UserError) as e:
        check_invalid(scores, 3, 0.5)
    message = str(e.value)
    assert "the commonest reason (4 of 4): vvr_motion: wrong frame count: the task expects 9 frames, got 5" in message
    assert "model.defaults.num_frames=9" in message


def test_the_frame_count_is_checked_against_the_tasks_before_training(tmp_path, tiny_wan_dir):
    tasks = [{"task": t.to_dict()} for t in generate_tasks(3, seed=0, level="easy")]
    with pytest.raises(UserError, match=r"3 of the 3 prompts of data.bench=vvr_motion .* 9-frame clips, but the "
                                        r"model samples 5-frame clips: set model.defaults.num_frames=9"):
        check_frame_count(5, tasks, "data.bench=vvr_motion")
    check_frame_count(9, tasks, "x")  # matching
    check_frame_count(None, [{"task": {"constraints": []}}, {}], "x")  # image tasks state no frame count
    with pytest.raises(UserError, match="samples images: set model.defaults.num_frames=9 with a video model"):
        check_frame_count(None, tasks, "x")
    # the tiny Wan samples 5 frames by default: refused when the run is built, before any step
    cfg = small_config(tmp_path / "run", tiny_wan_dir, tmp_path / "unused.txt", "data.prompts=null",
                       "data.bench=vvr_motion", "data.level=easy", "data.n=2", "rewards=[{name: vvr_motion}]")
    with pytest.raises(UserError, match="set model.defaults.num_frames=9"):
        build_trainer(cfg)
    assert not (tmp_path / "run" / "config.yaml").exists()


def half_invalid(samples: torch.Tensor, prompts, metadata):
    """A judge whose every other reply has no score: those samples are invalid, with the reason."""
    from flowalign.protocols import RewardOutput

    n = len(prompts)
    valid = torch.arange(n) % 2 == 0
    return RewardOutput({"score": torch.where(valid, redness(samples, prompts, metadata), float("nan"))}, valid,
                        info=[{} if v else {"reason": "no score in the reply"} for v in valid.tolist()])


def test_an_invalid_value_scores_the_samples_a_reward_leaves_invalid_and_logs_how_many(capsys):
    from rewards.registry import load

    x = torch.rand(4, 3, 8, 8)
    masked = RewardSet([("judge", 1.0, load(f"{HERE}:half_invalid"))]).score(x, ["a"] * 4, [{}] * 4)
    assert masked.valid.tolist() == [True, False, True, False]
    assert "judge: no score in the reply" in masked.reasons[1]
    scored = RewardSet([("judge", 2.0, load(f"{HERE}:half_invalid")), ("red", 1.0, load(f"{redness.__module__}:redness"))],
                       invalid_values={"judge": -0.5}).score(x, ["a"] * 4, [{}] * 4)
    assert scored.valid.all() and scored.reasons == [""] * 4
    assert scored.values[:, 0].tolist() == [masked.values[0, 0].item(), -0.5, masked.values[2, 0].item(), -0.5]
    assert scored.substituted["judge"].tolist() == [False, True, False, True] and "red" not in scored.substituted
    logs = scored.logs()
    assert logs["reward/judge_invalid_fraction"] == 0.5 and logs["reward/red_invalid_fraction"] == 0.0
    joined = RewardScores.cat([scored, scored])
    assert joined.substituted["judge"].tolist() == scored.substituted["judge"].tolist() * 2
    # a failed call: every sample of the batch at the value, the warning still printed
    failing = RewardSet([("exits", 1.0, load(f"{HERE}:exits"))], invalid_values={"exits": 0.0})
    out = failing.score(x, ["a"] * 4, [{}] * 4)
    assert out.valid.all() and out.values.eq(0).all() and out.substituted["exits"].all()
    assert "warning: reward 'exits' raised SystemExit" in capsys.readouterr().out
    with pytest.raises(ValueError, match="not rewards of the set"):
        RewardSet([("judge", 1.0, redness)], invalid_values={"jugde": 0.0})


def test_an_invalid_value_is_refused_for_a_reward_that_blends_its_parts():
    """A reward whose advantages blend the parts of each judgement (UnifiedReward-Flex, UnifiedReward-Edit's
    pointwise scores) has no parts for a failed sample: a value alone would make its group's advantages NaN."""
    from rewards.registry import load

    blended = load(f"{HERE}:half_invalid")
    blended.blend_parts = ("overall", "dim_mean", "has_dims", "overall_weight", "dim_weight")
    with pytest.raises(UserError, match="invalid_value does not apply to a reward whose advantages blend"):
        RewardSet([("flex", 1.0, blended)], invalid_values={"flex": 0.0})


def test_a_config_gives_a_reward_its_invalid_value(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "run", tiny_sd3_dir, prompt_file,
                                   f"rewards=[{{name: '{HERE}:half_invalid', invalid_value: 0}}]"))
    assert t.rewards.invalid_values == {f"{HERE}:half_invalid": 0.0}
    scores = t.rewards.score(torch.rand(2, 3, 8, 8), ["a", "b"], [{}, {}])
    assert scores.valid.all() and scores.values[1, 0] == 0
