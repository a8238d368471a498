"""Run configs: overrides, validation errors that name the field and the fix."""

import pytest

from flowalign.config import load_config, validate_section
from flowalign.errors import UserError
from flowalign.trainers import get_trainer
from flowalign.train import prepare_run_dir


def test_overrides_are_read_as_yaml(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("run:\n  seed: 3\ntrainer:\n  name: flow_grpo\n  lr: 0.001\n")
    cfg = load_config(cfg_file, ["trainer.lr=1e-4", "rewards=[{name: vvr, weight: 2.0, gamma: 0.3}]", "run.resume=never"])
    assert cfg.run.seed == 3 and cfg.run.resume == "never"
    assert cfg.rewards[0].weight == 2.0 and cfg.rewards[0].options == {"gamma": 0.3}
    tcfg = validate_section(get_trainer("flow_grpo").Config, cfg.trainer, "trainer.")
    assert tcfg.lr == pytest.approx(1e-4) and tcfg.clip_range == pytest.approx(1e-4)


@pytest.mark.parametrize("override,message", [
    ("run.sed=3", "run.sed: unknown key (did you mean 'seed'?)"),
    ("run.seed=abc", "run.seed"),
    ("run.max_invalid_fraction=1.5", "run.max_invalid_fraction"),
    ("eval.evry=3", "did you mean 'every'"),
    ("eval.split=train", "eval.split: Input should be 'validation' or 'test'"),
    ("nonsense", "key=value"),
])
def test_bad_values_name_the_field(override, message):
    with pytest.raises(UserError) as info:
        load_config(None, [override])
    assert message in str(info.value)


def test_training_evaluates_on_validation_unless_asked():
    assert load_config(None, []).eval.split == "validation"
    assert load_config(None, ["eval.split=test"]).eval.split == "test"


def test_trainer_section_is_validated_by_its_trainer():
    cfg = load_config(None, ["trainer.clip_rnage=0.1"])
    with pytest.raises(UserError, match="trainer.clip_rnage: unknown key \\(did you mean 'clip_range'\\?\\)"):
        validate_section(get_trainer("flow_grpo").Config, cfg.trainer, "trainer.")
    with pytest.raises(UserError, match="unknown trainer 'grpo'"):
        get_trainer("grpo")


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_output_folder_of_another_run_is_refused(tmp_path):
    cfg = load_config(None, ["run.seed=1"])
    saved = lambda seed, steps=8: f"run:\n  seed: {seed}\nmodel:\n  path: m\ntrainer:\n  max_steps: {steps}\n"
    prepare_run_dir(tmp_path, saved(1), "auto")
    prepare_run_dir(tmp_path, saved(1, steps=9), "auto")  # resumable change
    (tmp_path / "checkpoints" / "step-000001").mkdir(parents=True)  # a complete checkpoint to continue from
    (tmp_path / "checkpoints" / "step-000001" / "COMPLETE").write_text("ok\n")
    with pytest.raises(UserError, match="holds another run's config \\(differs in run.seed"):
        prepare_run_dir(tmp_path, saved(2), "auto")
    with pytest.raises(UserError, match="already holds a run"):
        prepare_run_dir(tmp_path, saved(1), "never")
    assert "seed: 1" in (tmp_path / "config.yaml").read_text()  # nothing overwritten
    assert cfg.run.seed == 1


def resolved_config(*fixed: str):
    """A function of overrides giving the resolved ``config.yaml`` text a run with ``fixed`` and them saves."""
    from flowalign.config import dump_config
    from flowalign.trainers import trainer_config

    def resolved(*overrides: str) -> str:
        cfg = load_config(None, [*fixed, *overrides])
        return dump_config(cfg, trainer_config(cfg.trainer)[1])

    return resolved


def saved_run_without(run_dir, config_text: str, *keys: str) -> None:
    """``run_dir`` as a run with one finished checkpoint whose saved config lacks each of ``keys`` (dotted:
    ``trainer.step_draw``, ``model.lora.compute_dtype``, ``rewards.0.resize``): a run saved before those
    options existed."""
    import yaml

    earlier = yaml.safe_load(config_text)
    for key in keys:
        *path, last = key.split(".")
        section = earlier
        for name in path:
            section = section[int(name)] if isinstance(section, list) else section[name]
        del section[last]
    (run_dir / "checkpoints" / "step-000001").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints" / "step-000001" / "COMPLETE").write_text("ok\n")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(earlier, sort_keys=False))


def test_a_run_saved_before_an_option_existed_resumes_with_that_option_at_its_default(tmp_path):
    """An upgraded flowalign adds options: a run saved without them continues where each holds its default (what
    the run did before it existed), and is refused where one is set otherwise."""
    resolved = resolved_config("trainer.name=dance_grpo")
    earlier = ("model.allow_tf32", "model.lora.compute_dtype", "trainer.optimizer_kernel")
    saved_run_without(tmp_path, resolved(), *earlier)
    prepare_run_dir(tmp_path, resolved(), "auto")
    saved_run_without(tmp_path, resolved(), *earlier)
    with pytest.raises(UserError, match=r"saved before model.allow_tf32, trainer.optimizer_kernel existed, which "
                                        r"computed model.allow_tf32=false trainer.optimizer_kernel=auto"):
        prepare_run_dir(tmp_path, resolved("model.allow_tf32=true", "trainer.optimizer_kernel=fused"), "auto")
    with pytest.raises(UserError, match=r"differs in trainer.lr\)"):  # an option the run had still counts
        prepare_run_dir(tmp_path, resolved("trainer.lr=0.5"), "auto")


def test_a_run_saved_before_an_option_changed_its_computation_resumes_only_as_it_was(tmp_path):
    """An option added with the authors' form as its default (``Config.before`` names what runs saved without
    it computed): such a run is refused under the default with the line that continues it, resumes with it,
    and a run that predates several such options is told all of them."""
    resolved = resolved_config("trainer.name=dance_grpo")
    saved_run_without(tmp_path, resolved(), "trainer.step_draw", "trainer.zero_advantage")
    with pytest.raises(UserError, match=r"saved before trainer.step_draw, trainer.zero_advantage existed, which "
                                        r"computed trainer.step_draw=per_batch trainer.zero_advantage=skipped; add"):
        prepare_run_dir(tmp_path, resolved(), "auto")
    with pytest.raises(UserError, match=r"computed trainer.zero_advantage=skipped; add trainer.zero_advantage=skipped"):
        prepare_run_dir(tmp_path, resolved("trainer.step_draw=per_batch"), "auto")
    prepare_run_dir(tmp_path, resolved("trainer.step_draw=per_batch", "trainer.zero_advantage=skipped"), "auto")


@pytest.mark.parametrize("trainer", ["flow_grpo", "dance_grpo", "kvpo"])
def test_a_former_form_tied_to_another_option_refuses_only_the_runs_that_used_it(tmp_path, trainer):
    """``gdpo_std`` changed what ``advantage: gdpo`` computes, nothing else (the advantage options' ``before``
    and ``before_when``, which every trainer with them reads): a run saved before it existed resumes under the
    default unless it trained with gdpo advantages, which is told the line that continues it."""
    resolved = resolved_config(f"trainer.name={trainer}")
    for advantage, refused in (("global_std", False), ("gdpo", True)):
        saved_run_without(tmp_path, resolved(f"trainer.advantage={advantage}"), "trainer.gdpo_std")
        if refused:
            with pytest.raises(UserError, match=r"saved before trainer.gdpo_std existed, which computed "
                                                r"trainer.gdpo_std=population; add"):
                prepare_run_dir(tmp_path, resolved(f"trainer.advantage={advantage}"), "auto")
            prepare_run_dir(tmp_path, resolved(f"trainer.advantage={advantage}", "trainer.gdpo_std=population"), "auto")
        else:
            prepare_run_dir(tmp_path, resolved(f"trainer.advantage={advantage}"), "auto")


@pytest.mark.parametrize("trainer, option, fixed", [
    ("diffusion_dpo", "noise_draw", ()),
    ("flow_opd", "shuffle_draw", ("trainer.teachers=[{adapter: /a/teacher}]",)),
])
def test_a_former_form_of_the_inner_epochs_refuses_only_runs_with_several(tmp_path, trainer, option, fixed):
    """Diffusion-DPO's ``noise_draw`` and Flow-OPD's ``shuffle_draw``: a run saved before the option existed
    trained the step's first micro-batches (and draws) in every inner epoch. With one inner epoch that is the
    default's computation (it resumes); with several it is told the line that continues it."""
    resolved = resolved_config(f"trainer.name={trainer}", *fixed)
    saved_run_without(tmp_path, resolved(), f"trainer.{option}")
    prepare_run_dir(tmp_path, resolved(), "auto")
    saved_run_without(tmp_path, resolved("trainer.inner_epochs=2"), f"trainer.{option}")
    with pytest.raises(UserError, match=rf"saved before trainer.{option} existed, which computed "
                                        rf"trainer.{option}=per_step; add trainer.{option}=per_step"):
        prepare_run_dir(tmp_path, resolved("trainer.inner_epochs=2"), "auto")
    prepare_run_dir(tmp_path, resolved("trainer.inner_epochs=2", f"trainer.{option}=per_step"), "auto")


def test_a_trainer_with_required_keys_is_told_its_former_forms_too(tmp_path):
    """AFD requires ``teacher`` (no default): the run's own teacher stands in for it, so a run saved before
    ``advantage`` and ``loss_form`` existed is told the line that continues it, not refused as another run."""
    resolved = resolved_config("trainer.name=afd", "trainer.teacher={model: assets/tiny-wan-motion}")
    saved_run_without(tmp_path, resolved(), "trainer.advantage", "trainer.loss_form")
    with pytest.raises(UserError, match=r"saved before trainer.advantage, trainer.loss_form existed, which computed "
                                        r"trainer.advantage=centred trainer.loss_form=weighted_fm; add"):
        prepare_run_dir(tmp_path, resolved(), "auto")
    prepare_run_dir(tmp_path, resolved("trainer.advantage=centred", "trainer.loss_form=weighted_fm"), "auto")


def test_a_run_saved_under_an_options_former_name_resumes_and_one_whose_meaning_changed_is_refused(tmp_path):
    """SOAR's K, w_cfg, N, lam (now rollout_steps, rollout_guidance, corrections, correction_weight) in a saved
    config are read under their names now: the run resumes with the same values, and is refused with others.
    A saved option whose meaning changed (RG-OPD's anchor) refuses the run, saying what it became."""
    import yaml

    resolved = resolved_config()
    (tmp_path / "checkpoints" / "step-000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-000001" / "COMPLETE").write_text("ok\n")
    earlier = yaml.safe_load(resolved("trainer.name=soar", "trainer.rollout_steps=8"))
    for former, now in (("K", "rollout_steps"), ("w_cfg", "rollout_guidance"), ("N", "corrections"),
                        ("lam", "correction_weight")):
        earlier["trainer"][former] = earlier["trainer"].pop(now)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(earlier, sort_keys=False))
    prepare_run_dir(tmp_path, resolved("trainer.name=soar", "trainer.rollout_steps=8"), "auto")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(earlier, sort_keys=False))
    with pytest.raises(UserError, match=r"differs in trainer.rollout_steps\)"):
        prepare_run_dir(tmp_path, resolved("trainer.name=soar", "trainer.rollout_steps=9"), "auto")
    rg = ("trainer.name=rg_opd", "trainer.latent_reward=registers")
    earlier = yaml.safe_load(resolved(*rg))
    earlier["trainer"]["anchor"] = earlier["trainer"].pop("anchor_weight")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(earlier, sort_keys=False))
    with pytest.raises(UserError, match=r"saved with trainer.anchor, which this flowalign no longer reads \(RG-OPD's"):
        prepare_run_dir(tmp_path, resolved(*rg), "auto")


UNIFIED = "{name: unified_reward, url: http://judge:8000/v1, mode: %s}"
#: the unified_reward options whose default changed in think_pairwise, and what runs saved without them computed
UNIFIED_BEFORE = {"think_prompt": "qwen2_5vl", "verdict_parse": "lenient", "win_rate_decimals": "null",
                  "image_size": "512", "jpeg_quality": "null", "max_tokens": "512"}


def test_the_resolved_config_records_the_reward_options_whose_default_changed():
    """Each reward entry states the current value of each option whose default changed (its ``before``): the
    user's, else the default; other options, rewards without such options and plug-in paths stay as written."""
    import yaml

    resolved = resolved_config()(
        "rewards=[{name: hps, path: hps.pt}, {name: pickscore, path: ps, crop_offset: round}, " + UNIFIED % "score"
        + ", vvr, {name: clip_score, path: c}, {name: 'tests.flowalign.trainers.toy_rewards:redness', scale: 2}]",
        "eval.rewards=[{name: aesthetic, path: a}, hps_video]")
    saved = yaml.safe_load(resolved)
    hps, pickscore, unified, vvr, clip, plugin = saved["rewards"]
    assert hps == {"name": "hps", "weight": 1.0, "timeout_s": 600.0, "path": "hps.pt", "resize": "pad"}
    assert pickscore["crop_offset"] == "round"  # the user's
    assert {k: unified[k] for k in UNIFIED_BEFORE} == {"think_prompt": "qwen3vl", "verdict_parse": "answer",
                                                        "win_rate_decimals": 3, "image_size": "auto",
                                                        "jpeg_quality": "auto", "max_tokens": "auto"}
    assert "no_verdict" not in unified and "both_orders" not in unified  # defaults that did not change
    assert vvr == {"name": "vvr", "weight": 1.0, "timeout_s": 600.0}
    assert clip == {"name": "clip_score", "weight": 1.0, "timeout_s": 600.0, "path": "c"}
    assert plugin == {"name": "tests.flowalign.trainers.toy_rewards:redness", "weight": 1.0, "timeout_s": 600.0,
                      "scale": 2}
    assert saved["eval"]["rewards"][0]["crop_offset"] == "floor" and saved["eval"]["rewards"][1]["resize"] == "pad"


def test_a_run_saved_before_a_reward_recorded_an_option_resumes_only_as_it_was(tmp_path):
    """hps resizes with ``pad`` now; a run saved without ``resize`` cropped (``before``): it is refused under the
    default with the one line that continues it, and resumes with that option; another change of the reward's
    options is refused as another run. A run that predates two rewards' options is told both."""
    resolved = resolved_config()
    hps = "{name: hps, path: hps.pt%s}"
    saved_run_without(tmp_path, resolved(f"rewards=[{hps % ''}]"), "rewards.0.resize")
    with pytest.raises(UserError, match=r"^\S+ holds a run saved before rewards\[0\] \(hps\) had the option resize, "
                                        r"which computed resize: crop; add resize: crop to that reward's options to "
                                        r"continue it as it was, or choose another run.output_dir$"):
        prepare_run_dir(tmp_path, resolved(f"rewards=[{hps % ''}]"), "auto")
    with pytest.raises(UserError, match=r"differs in rewards\)"):
        prepare_run_dir(tmp_path, resolved(f"rewards=[{hps % ', resize: crop, interpolation: bilinear'}]"), "auto")
    prepare_run_dir(tmp_path, resolved(f"rewards=[{hps % ', resize: crop'}]"), "auto")
    prepare_run_dir(tmp_path, resolved(f"rewards=[{hps % ', resize: crop'}]", "trainer.max_steps=3"), "auto")
    both = resolved(f"rewards=[{{name: clip_score, path: c}}, {hps % ''}, {{name: pickscore, path: ps}}]")
    saved_run_without(tmp_path, both, "rewards.1.resize", "rewards.2.crop_offset")
    with pytest.raises(UserError, match=r"saved before rewards\[1\] \(hps\) had the option resize, which computed "
                                        r"resize: crop, and before rewards\[2\] \(pickscore\) had the option "
                                        r"crop_offset, which computed crop_offset: round; add those to each reward's"):
        prepare_run_dir(tmp_path, both, "auto")


def test_a_reward_option_whose_former_form_is_tied_to_its_mode_refuses_only_the_runs_that_used_it(tmp_path):
    """unified_reward's think options changed what ``mode: think_pairwise`` computes, nothing else (its
    ``before_when``): a run saved without them resumes under the defaults in score mode, and in think_pairwise
    is told all of them, and resumes with them."""
    resolved = resolved_config()
    for mode in ("score", "think_pairwise"):
        saved_run_without(tmp_path, resolved(f"rewards=[{UNIFIED % mode}]"),
                          *(f"rewards.0.{k}" for k in UNIFIED_BEFORE))
        if mode == "score":
            prepare_run_dir(tmp_path, resolved(f"rewards=[{UNIFIED % mode}]"), "auto")
            continue
        keep = ", ".join(f"{k}: {v}" for k, v in UNIFIED_BEFORE.items())
        with pytest.raises(UserError, match=rf"saved before rewards\[0\] \(unified_reward\) had the options "
                                            rf"{', '.join(UNIFIED_BEFORE)}, which computed {keep}; add {keep} to that"):
            prepare_run_dir(tmp_path, resolved(f"rewards=[{UNIFIED % mode}]"), "auto")
        as_it_was = UNIFIED.replace("}", ", " + keep + "}") % mode
        prepare_run_dir(tmp_path, resolved(f"rewards=[{as_it_was}]"), "auto")


def test_a_run_saved_with_its_reward_options_recorded_resumes_unchanged(tmp_path):
    """A run saved from now on states what its rewards compute, and resumes as it is; a recorded option is
    compared as any other, and a reward's deadline may still change."""
    resolved = resolved_config()
    rewards = lambda hps="": f"rewards=[{{name: hps, path: hps.pt{hps}}}, {UNIFIED % 'think_pairwise'}]"
    saved_run_without(tmp_path, resolved(rewards()))
    prepare_run_dir(tmp_path, resolved(rewards()), "auto")
    saved = (tmp_path / "config.yaml").read_text()
    assert saved == resolved(rewards()) and "resize: pad" in saved and "think_prompt: qwen3vl" in saved
    with pytest.raises(UserError, match=r"differs in rewards\)"):
        prepare_run_dir(tmp_path, resolved(rewards(", resize: crop")), "auto")
    prepare_run_dir(tmp_path, resolved(rewards(", timeout_s: 30")), "auto")


@pytest.mark.parametrize("override,message", [
    ("run.seed=-1", "run.seed: Input should be greater than or equal to 0"),
    (f"run.seed={10**23}", "run.seed: Input should be less than or equal to 9223372036854775807"),
    ("data.n=1000000000000", "data.n: Input should be less than or equal to 1000000"),
    ("eval.num_steps=0", "eval.num_steps: Input should be greater than or equal to 1"),
])
def test_unbounded_run_values_are_refused(override, message):
    with pytest.raises(UserError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("trainer,override,message", [
    ("flow_grpo", "trainer.betas=[1.5, 0.9]", "trainer.betas: each of Adam's betas must be in [0, 1)"),
    ("flow_grpo", "trainer.lr=1.0e30", "trainer.lr: Input should be less than or equal to 1"),
    ("flow_grpo", "trainer.group_size=1000000000", "trainer.group_size: Input should be less than or equal to 1024"),
    ("flow_grpo", "trainer.num_steps=100000000", "trainer.num_steps: Input should be less than or equal to 1000"),
    ("flash_grpo", "trainer.num_steps=100000000", "trainer.num_steps: Input should be less than or equal to 1000"),
    ("diffusion_nft", "trainer.lr=2.0", "trainer.lr: Input should be less than or equal to 1"),
    ("festdpo", "trainer.K=true", "trainer.K: expected a number, not true/false"),
])
def test_unbounded_trainer_values_are_refused(trainer, override, message):
    cfg = load_config(None, [f"trainer.name={trainer}", override])
    with pytest.raises(UserError) as info:
        validate_section(get_trainer(trainer).Config, cfg.trainer, "trainer.")
    assert message in str(info.value)


def test_real_values_pass_the_bounds():
    cfg = load_config(None, ["run.seed=4294967295", "data.n=100000", "trainer.lr=0.01", "trainer.betas=[0.0, 0.99]",
                             "trainer.group_size=64", "trainer.num_steps=100"])
    tcfg = validate_section(get_trainer("flow_grpo").Config, cfg.trainer, "trainer.")
    assert tcfg.betas == (0.0, 0.99) and tcfg.group_size == 64
