"""The reward plug-in API: register by name, load by name / ``module:attr`` / entry point, clear errors."""

import sys

import pytest
import torch

import rewards
from flowalign.errors import UserError
from flowalign.protocols import RewardOutput
from rewards import registry


@pytest.fixture
def clean_registry():
    registry._import_builtins()  # registered once per process: keep them when restoring
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def test_registered_function_is_wrapped_with_options_and_nan_masked(clean_registry):
    @rewards.register("test_mean_plus")
    def mean_plus(samples, prompts, metadata, offset=0.0):
        score = samples.flatten(1).mean(1) + offset
        score[0] = float("nan")
        return score

    x = torch.full((3, 3, 4, 4), 0.5)
    out = rewards.load("test_mean_plus", offset=1.0)(x, ["a"] * 3, [{}] * 3)
    assert isinstance(out, RewardOutput)
    assert out.total[1:].tolist() == [1.5, 1.5]
    assert out.valid.tolist() == [False, True, True]


def test_registered_class_is_instantiated_and_names_clash(clean_registry):
    @rewards.register("test_const")
    class Const:
        differentiable = True

        def __init__(self, value: float = 2.0):
            self.value = value

        def __call__(self, samples, prompts, metadata):
            return RewardOutput({"c": torch.full((len(prompts),), self.value)}, torch.ones(len(prompts), dtype=torch.bool))

    assert rewards.load("test_const", value=3.0).value == 3.0
    assert "test_const" in registry.differentiable()
    with pytest.raises(ValueError, match="already registered"):
        rewards.register("test_const")(lambda s, p, m: s.mean())


def test_builtin_lists_and_differentiable_ones():
    names = registry.available()
    assert {"vvr", "vvr_soft", "vvr_motion", "clip_score"} <= set(names)
    diff = registry.differentiable()
    assert "vvr_soft" in diff and "vvr" not in diff and "jpeg_compressibility" not in diff


def test_module_attr_path_and_its_errors():
    reward = rewards.load("tests.flowalign.trainers.toy_rewards:redness")
    out = reward(torch.rand(2, 3, 8, 8), ["a", "b"], [{}, {}])
    assert out.total.shape == (2,)
    with pytest.raises(UserError, match="cannot import module 'no_such_pkg.scores'.*No module named"):
        rewards.load("no_such_pkg.scores:sharpness")
    with pytest.raises(UserError, match="has no attribute 'nope'"):
        rewards.load("tests.flowalign.trainers.toy_rewards:nope")
    with pytest.raises(UserError, match="unknown reward 'vvrr'.*available:.*vvr"):
        rewards.load("vvrr")


def test_entry_point_of_an_installed_package(tmp_path, monkeypatch):
    """A third-party package that declares ``flowalign.rewards`` entry points (a real dist-info on sys.path)."""
    (tmp_path / "plugin_scores.py").write_text(
        "def darkness(samples, prompts, metadata):\n    return 1 - samples.flatten(1).mean(1)\n"
    )
    info = tmp_path / "plugin_scores-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-scores\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[flowalign.rewards]\ndarkness = plugin_scores:darkness\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "darkness" in registry.available()
    out = rewards.load("darkness")(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert out.total.tolist() == [1.0, 1.0]
    sys.modules.pop("plugin_scores", None)


def test_true_is_not_a_number_for_a_numeric_option():
    """YAML's ``true`` is Python's 1: ``quality: true`` must not mean JPEG quality 1."""
    with pytest.raises(UserError, match="reward 'jpeg_compressibility': quality=True must be a number, not true/false"):
        rewards.load("jpeg_compressibility", quality=True)
    assert rewards.load("jpeg_compressibility", quality=90).quality == 90


def test_former_forms_name_options_the_reward_takes_and_a_plugin_path_has_none():
    """Each built-in reward's ``before`` names options it takes, with a former value other than the current
    default, and ``before_when`` options it takes; a video twin answers with its image reward's; a plug-in path
    and an unknown name have none (their options stay as written)."""
    declared = {}
    for name in registry.available():
        before, when, defaults = registry.former_forms(name)
        if before:
            declared[name] = before
            registry.check(name, **before, **{option: defaults[option] for option, _ in when.values()})
            assert all(before[k] != defaults[k] for k in before), name
    assert declared["hps"] == declared["hps_video"] == {"resize": "crop"}
    assert declared["pickscore"] == declared["aesthetic"] == {"crop_offset": "round"}
    assert registry.former_forms("unified_reward")[1]["think_prompt"] == ("mode", ("think_pairwise",))
    assert "clip_score" not in declared and "vvr" not in declared
    assert registry.former_forms("tests.flowalign.trainers.toy_rewards:redness") == ({}, {}, {})
    assert registry.former_forms("no_such_reward") == ({}, {}, {})
