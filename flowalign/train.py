"""Set up and run a training job from a validated config (what ``flowalign train`` calls)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

from flowalign.benchmarks import available_benchmarks
from flowalign.checkpoint import latest_checkpoint
from flowalign.checkpoint_manifest import damage
from flowalign.config import TrainConfig, check_reward_keys, dump_config
from flowalign.data import PromptSet, read_prompt_file
from flowalign.disk_space import explain_full_disk
from flowalign.errors import UserError
from flowalign.io import OLD_PREFIX, TMP_PREFIX, foreign_entries, marker_name, refuse_foreign, write_json
from flowalign.parallel import accelerator_kwargs
from flowalign.paths import REPO_ROOT
from flowalign.plugins import reward_former_forms
from flowalign.reward_check import check_frame_count, check_reward_metadata, check_video_files
from flowalign.reward_set import check_panel, load_panel, load_rewards, time_limited
from flowalign.run_lock import LOCK_NAME, RUN_WRITER, run_lock
from flowalign.signals import exit_on_sigterm
from flowalign.trainers import get_trainer, trainer_config

# keys that may change when a run is resumed (everything else must match the saved config); the folder
# itself may have been moved or copied, and the layout over ranks may change (checkpoints are consolidated)
RESUMABLE_CHANGES = {"run.output_dir", "run.resume", "run.progress", "run.checkpoint_every", "run.keep_checkpoints",
                     "trainer.max_steps", "trainer.max_minutes", "eval.every", "eval.rewards", "run.wandb",
                     "parallel.strategy", "parallel.cpu_offload", "parallel.reshard_after_forward",
                     "parallel.timeout_s"}


SHARDED_BACKENDS = ("FSDP", "DEEPSPEED", "MEGATRON_LM")
#: written after the final checkpoint: the run is finished
FINAL_METRICS = "final_metrics.json"


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def prepare_run_dir(run_dir: Path, resolved_yaml: str, resume: str) -> None:
    """Refuse a folder that holds another run; write the resolved config."""
    check_run_dir(run_dir, resolved_yaml, resume)
    write_run_config(run_dir, resolved_yaml)


#: sections every config a run saves has (a user's notes or partial config named config.yaml lacks some)
RUN_SECTIONS = ("run", "model", "trainer")


def saved_run_config(run_dir: Path) -> dict[str, Any] | None:
    """The config a run saved as ``run_dir/config.yaml`` (None when there is no such file). Refuses
    (``UserError``) a ``config.yaml`` that no run wrote: it is the user's, and the folder is not a run's."""
    saved = run_dir / "config.yaml"
    if not saved.exists():
        return None
    try:
        data: Any = yaml.safe_load(saved.read_text())
        why = "it has no run, model and trainer sections"
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        data, why = None, f"it is not readable YAML: {str(e).splitlines()[0]}"
    if not isinstance(data, dict) or not all(isinstance(data.get(k), dict) for k in RUN_SECTIONS):
        raise UserError(f"run.output_dir {run_dir} holds a config.yaml that no run wrote ({why}); choose another "
                        "run.output_dir (a run saves its own config.yaml there)")
    return data


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` flattened, with what may change on resume inside its lists taken out: a reward's deadline
    (``timeout_s``, which changes no score a call returns in time)."""
    flat = _flatten(config)
    if isinstance(flat.get("rewards"), list):
        flat["rewards"] = [{k: v for k, v in r.items() if k != "timeout_s"} if isinstance(r, dict) else r
                           for r in flat["rewards"]]
    return flat


def _added_options(old: dict[str, Any], new: dict[str, Any],
                   new_section: dict[str, Any] | None = None) -> tuple[set[str], dict[str, Any]]:
    """Options of ``new`` (flattened) that the saved config ``old`` lacks, added since the run was saved (an
    upgraded flowalign): the keys set to what the run computed before they existed (their default, or the
    trainer's ``before`` value where the default changed the computation), and ``{key: that value}`` of the
    others, which would change the run. ``new_section``: the new config's trainer section, whose values stand
    in for the keys a trainer requires (AFD's ``teacher``), which have no default."""
    missing = set(new) - set(old)
    if not missing:
        return set(), {}
    section = {"name": new.get("trainer.name") or "flow_grpo"}
    try:
        config = get_trainer(str(section["name"])).Config
        required = {k: new_section[k] for k, f in config.model_fields.items()
                    if f.is_required() and k != "name" and k in (new_section or {})}
        trainer, tcfg = trainer_config({**section, **required})
        defaults = _comparable(yaml.safe_load(dump_config(TrainConfig(), tcfg)))
    except UserError:  # a trainer this flowalign lacks, or required keys the new config does not give
        return set(), {}
    was = {k: defaults[k] for k in missing if k in defaults}
    before, when = trainer.Config.former_forms()
    was.update({f"trainer.{k}": v for k, v in before.items() if f"trainer.{k}" in missing
                and _former_form_applies(when.get(k), old, defaults)})
    unchanged = {k for k, v in was.items() if new[k] == v}
    return unchanged, {k: v for k, v in was.items() if k not in unchanged}


def _former_form_applies(when: tuple[str, tuple[Any, ...]] | None, old: dict[str, Any], defaults: dict[str, Any],
                         prefix: str = "trainer.") -> bool:
    """Whether a former form computed something else for the saved run ``old`` (flattened): always, unless
    ``when`` (its ``before_when`` entry) ties it to values of another option that the run did not have.
    ``prefix``: how ``old`` and ``defaults`` name the options (a reward entry's are its own keys)."""
    if when is None:
        return True
    option, values = when
    return old.get(f"{prefix}{option}", defaults.get(f"{prefix}{option}")) in values


def _added_reward_options(old: Any, new: Any) -> tuple[Any, dict[int, tuple[str, dict[str, Any]]]]:
    """The new ``rewards`` list with each option that its saved entry lacks (saved before the reward recorded
    it: ``recorded_reward``) taken out where it holds what the run computed: the reward's ``before`` value
    where its ``before_when`` applies to the saved entry, else the current default. Also ``{place: (name,
    {option: what the run computed})}`` of those set otherwise, which would change the run."""
    if not (isinstance(old, list) and isinstance(new, list) and len(old) == len(new)):
        return new, {}
    kept, was = [], {}
    for i, (saved, entry) in enumerate(zip(old, new)):
        if not (isinstance(saved, dict) and isinstance(entry, dict) and saved.get("name") == entry.get("name")):
            kept.append(entry)
            continue
        before, when, defaults = reward_former_forms(str(entry["name"]))
        computed = {k: before[k] if _former_form_applies(when.get(k), saved, defaults, prefix="") else defaults[k]
                    for k in before if k in entry and k not in saved}
        other = {k: v for k, v in computed.items() if entry[k] != v}
        kept.append({k: v for k, v in entry.items() if k not in computed or k in other})
        if other:
            was[i] = (str(entry["name"]), other)
    return kept, was


def _reward_former_forms_line(run_dir: Path, was: dict[int, tuple[str, dict[str, Any]]]) -> str:
    """The refusal of a run whose reward entries predate options they record now, naming what continues it."""
    def options(forms: dict[str, Any]) -> str:
        return ", ".join(f"{k}: {_yaml_value(v)}" for k, v in forms.items())

    saved_before = ", and before ".join(
        f"rewards[{i}] ({name}) had the option{'s' if len(forms) > 1 else ''} {', '.join(forms)}, which computed "
        f"{options(forms)}" for i, (name, forms) in was.items())
    fix = (f"add {options(next(iter(was.values()))[1])} to that reward's options" if len(was) == 1
           else "add those to each reward's options")
    return (f"{run_dir} holds a run saved before {saved_before}; {fix} to continue it as it was, or choose another "
            "run.output_dir")


def _saved_under_current_names(saved: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The saved config with its trainer section read as this flowalign reads it: options renamed since the
    run was saved under their names now (their values moved as the trainer moves them), nothing filled in.
    A saved option this flowalign refuses (its meaning changed) refuses the run, saying so."""
    section = saved["trainer"]
    try:
        config = get_trainer(str(section.get("name", "flow_grpo"))).Config
    except UserError:
        return saved  # a trainer this flowalign does not have: the comparison names it
    refused = [k for k in section if k in config.refused]
    if refused:
        raise UserError(f"{run_dir} holds a run saved with trainer.{refused[0]}, which this flowalign no longer reads "
                        f"({config.refused[refused[0]]}); continue it with the flowalign that started it, or choose "
                        "another run.output_dir")
    if not any(k in config.renamed for k in section):
        return saved
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the deprecation lines are for the user's own config
            _, tcfg = trainer_config(section)
    except UserError:
        return saved
    dumped = tcfg.model_dump(mode="json")
    return {**saved, "trainer": {**{k: dumped[k] for k in tcfg.model_fields_set}, "name": section.get("name")}}


def _yaml_value(value: Any) -> str:
    """``value`` as a ``key=value`` override writes it (``null``, ``true``, ``0.5``, ``mean``)."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def check_run_dir(run_dir: Path, resolved_yaml: str, resume: str) -> None:
    """Refuse (``UserError``) a folder that holds another run's config, or any run with ``resume=never``. A
    run that saved no checkpoint (e.g. one stopped at step 0 by a reward outage) holds nothing to continue:
    a changed config starts it over, with a line saying so."""
    saved = saved_run_config(run_dir)
    if saved is not None:
        if resume == "never":
            raise UserError(f"{run_dir} already holds a run; choose another run.output_dir or set run.resume=auto to continue it")
        old, new = _comparable(_saved_under_current_names(saved, run_dir)), _comparable(yaml.safe_load(resolved_yaml))
        added, was = _added_options(old, new, (yaml.safe_load(resolved_yaml) or {}).get("trainer"))
        new["rewards"], reward_was = _added_reward_options(old.get("rewards"), new.get("rewards"))
        # the saved rewards differ from the new ones only by options they predate, set to another computation
        unrecorded = {i: forms for i, (_, forms) in reward_was.items()}
        rewards_before = {"rewards"} if unrecorded and old.get("rewards") == [
            {k: v for k, v in entry.items() if k not in unrecorded.get(i, {})}
            for i, entry in enumerate(new["rewards"])] else set()
        changed = sorted(k for k in set(old) | set(new)
                         if old.get(k) != new.get(k) and k not in RESUMABLE_CHANGES and k not in added)
        if changed and latest_checkpoint(run_dir) is None:
            print(f"note: {run_dir} holds a run that saved no checkpoint, with another config (differs in "
                  f"{', '.join(changed[:5])}); starting it over with this one")
        elif changed and set(changed) <= set(was) | rewards_before:  # only options the run predates, set otherwise
            options = [k for k in changed if k in was]
            if not options:
                raise UserError(_reward_former_forms_line(run_dir, reward_was))
            keep = " ".join(f"{k}={_yaml_value(was[k])}" for k in options)
            raise UserError(f"{run_dir} holds a run saved before {', '.join(options)} existed, which computed "
                            f"{keep}; add {keep} to continue it as it was, or choose another run.output_dir")
        elif changed:
            raise UserError(f"{run_dir} holds another run's config (differs in {', '.join(changed[:5])}); "
                            "choose another run.output_dir, or delete the folder to start over")


def write_run_config(run_dir: Path, resolved_yaml: str) -> None:
    """``config.yaml``, written once the run is built (a failed start leaves none to block the rerun)."""
    from flowalign.io import atomic_path

    run_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(run_dir / "config.yaml") as tmp:
        tmp.write_text(resolved_yaml)


def resolve_model_path(path: str) -> Path:
    p = Path(path)
    if not p.exists() and not p.is_absolute() and (REPO_ROOT / p).exists():
        return REPO_ROOT / p  # configs name assets relative to the repository
    return p


def load_train_data(cfg: TrainConfig) -> PromptSet:
    if cfg.data.prompts:
        return read_prompt_file(cfg.data.prompts)
    if not cfg.data.bench:
        raise UserError("data needs either data.prompts (a .txt/.jsonl file) or data.bench (e.g. vvr)")
    from flowalign.benchmarks import training_tasks

    levels = [cfg.data.level] if isinstance(cfg.data.level, str) else list(cfg.data.level)
    prompts, metadata = [], []
    for i, level in enumerate(levels):
        bench = training_tasks(cfg.data.bench, level, cfg.data.n, seed=cfg.data.seed + i)
        prompts += bench.prompts
        metadata += bench.metadata
    return PromptSet(prompts, metadata)


def make_evaluator(cfg: TrainConfig):
    """A function ``(policy, out_dir) -> metrics`` over the ``eval.split`` split (validation by default), or
    over the first ``eval.n`` prompts of ``eval.prompts``, scored by the panel ``eval.rewards`` alone."""
    from flowalign.benchmarks import load_benchmark

    from flowalign.evaluation import evaluate

    # the held-out panel: scored on the same samples, logged as eval/<name> (the loop logs every number)
    panel = load_panel(cfg.eval.rewards, "eval.rewards") if cfg.eval.rewards else None
    seed = cfg.eval.seed or 0
    if cfg.eval.prompts:
        source = read_prompt_file(cfg.eval.prompts)
        prompts, metadata, reward = source.prompts[: cfg.eval.n], source.metadata[: cfg.eval.n], None
        labels = {"prompts": cfg.eval.prompts, "seed": seed, "reward": panel.names[0], "rewards": panel.names}
        title = Path(cfg.eval.prompts).name
    else:
        bench = load_benchmark(cfg.eval.bench, cfg.eval.level, cfg.eval.n, cfg.eval.seed, split=cfg.eval.split,
                               reward_options=cfg.eval.reward_options)
        # under a deadline, one wrapper for the whole run: a hung call is not stacked upon at the next evaluation
        prompts, metadata, reward = bench.prompts, bench.metadata, time_limited(bench.reward.name, bench.reward)
        labels = {"bench": bench.name, "split": bench.split, "seed": seed, "reward": bench.reward.name}
        title = bench.name

    def run(policy, out_dir: Path) -> dict[str, Any]:
        metrics = evaluate(policy, prompts, metadata, reward, seed=seed, num_steps=cfg.eval.num_steps,
                           batch_size=cfg.eval.batch_size, out_dir=out_dir, progress=False, labels=labels, panel=panel)
        if cfg.eval.gallery:
            _write_gallery(out_dir.parent.parent, f"{cfg.run.name}: {title}")
        return metrics

    run.metadata = metadata  # checked against the model before training (check_frame_count)
    return run


def _write_gallery(run_dir: Path, title: str) -> None:
    """Every evaluation so far, side by side (identical seeds), into ``run_dir/gallery/index.html``."""
    from flowalign.gallery import gallery_from_run, write_gallery

    columns, rows = gallery_from_run(run_dir)
    write_gallery(run_dir / "gallery", columns, rows, title=title, overwrite=True)  # the run's own folder


def check_run(cfg: TrainConfig) -> tuple[type, Any]:
    """Every check of a run that needs no weights, in the order a run would meet them; returns the
    trainer class and its validated section. What ``flowalign train --check`` and ``flowalign plan`` run,
    and what a run runs before it touches its folder.

    The trainer section (unknown keys with a did-you-mean) and the trainer's own refusals, each reward's
    name and options, the training prompts, the evaluation benchmark and the model folder."""
    import rewards as reward_registry

    trainer_cls, tcfg = trainer_config(cfg.trainer)
    trainer_cls.check_config(cfg, tcfg)
    check_reward_keys(cfg.rewards, "rewards")
    for spec in cfg.rewards:
        reward_registry.check(spec.name, **spec.options)
    if cfg.rewards and trainer_cls.needs_rewards and not any(spec.weight for spec in cfg.rewards):
        print(f"warning: every reward has weight 0 ({', '.join(f'{s.name}: {s.weight:g}' for s in cfg.rewards)}): "
              "the weighted total is 0 for every sample, so the run learns nothing from them; give the reward to "
              "train on a non-zero weight (weight 0 only logs a reward)")
    load_train_data(cfg.model_copy(update={"data": cfg.data.model_copy(update={"n": 1})}))  # names and levels, not n tasks
    if cfg.eval.prompts:
        read_prompt_file(cfg.eval.prompts)  # a missing or malformed file fails here, not at the first evaluation
        if not cfg.eval.rewards:
            raise UserError(f"eval.prompts={cfg.eval.prompts} has no verifier of its own: list the rewards to score "
                            "it with in eval.rewards (e.g. [pickscore, hpsv3]), or use eval.bench")
    elif cfg.eval.bench and cfg.eval.bench not in available_benchmarks():
        raise UserError(f"eval.bench={cfg.eval.bench} is not a benchmark; choose one of "
                        f"{', '.join(available_benchmarks())}, or eval.bench=null for no evaluation")
    if cfg.eval.rewards and not (cfg.eval.bench or cfg.eval.prompts):
        raise UserError("eval.rewards scores the samples of the evaluation, but eval.bench=null (and no eval.prompts) turns it "
                        "off; set "
                        "eval.bench (e.g. vvr) or eval.prompts, or drop eval.rewards")
    check_panel(cfg.eval.rewards, "eval.rewards")
    folder = resolve_model_path(cfg.model.path)
    if not (folder / "model_index.json").is_file():
        raise UserError(f"model.path {folder} is not a diffusers folder (no model_index.json): pass the model's "
                        "folder, or one of assets/architectures/* (configs only, for flowalign plan)")
    import pipelines

    pipelines.check_defaults(folder, cfg.model.defaults)  # the family's code, no weights
    return trainer_cls, tcfg


def build_trainer(cfg: TrainConfig):
    """Everything a run needs (accelerator, run folder, policy, rewards, data, evaluator) → the trainer."""
    from accelerate import Accelerator

    import pipelines

    trainer_cls, tcfg = check_run(cfg)  # before anything is written
    acc = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=accelerator_kwargs(cfg.parallel))
    if acc.distributed_type.value in SHARDED_BACKENDS:
        # flowalign shards with torch FSDP2 itself (parallel.strategy); silently ignoring the accelerate
        # config's own sharding request would run out of memory on the models that need it
        raise UserError(f"the accelerate config asks for {acc.distributed_type.value}: launch with a multi-GPU "
                        "accelerate config (distributed_type: MULTI_GPU) or torchrun and set parallel.strategy=fsdp")
    run_dir = Path(cfg.run.output_dir)
    if acc.is_main_process:
        check_run_dir(run_dir, dump_config(cfg, tcfg), cfg.run.resume)
    torch.manual_seed(cfg.run.seed)  # the same adapter initialisation on every rank
    # CUDA's flag only: set_float32_matmul_precision would change a CPU's oneDNN products too, and torch's
    # per-backend fp32_precision, once set, makes get_float32_matmul_precision() raise for every later caller
    torch.backends.cuda.matmul.allow_tf32 = cfg.model.allow_tf32

    model_path = resolve_model_path(cfg.model.path)
    lora = cfg.model.lora.model_dump() if cfg.model.finetune == "lora" else None
    policy = pipelines.load(model_path, cfg.model.family, device=acc.device, dtype=cfg.model.dtype, lora=lora,
                            full_finetune=cfg.model.finetune == "full", defaults=cfg.model.defaults or None,
                            gradient_checkpointing=cfg.model.gradient_checkpointing,
                            attention_backend=cfg.model.attention_backend, compile=cfg.model.compile,
                            offload_text_encoders=cfg.model.offload_text_encoders,
                            **({"decode_batch_size": cfg.model.decode_batch_size} if cfg.model.decode_batch_size else {}))
    check_video_files(cfg.rewards, policy.is_video, "rewards")
    check_video_files(cfg.eval.rewards, policy.is_video, "eval.rewards")
    loaded = load_rewards(cfg.rewards)
    data = load_train_data(cfg)
    for name, _, reward in loaded:
        check_reward_metadata(name, reward, data.metadata, f"data.prompts={cfg.data.prompts}" if cfg.data.prompts
                              else f"data.bench={cfg.data.bench}")
    frames = policy.defaults.get("num_frames")
    check_frame_count(frames, data.metadata, f"data.bench={cfg.data.bench}" if not cfg.data.prompts
                      else f"data.prompts={cfg.data.prompts}")
    evaluator = make_evaluator(cfg) if cfg.eval.bench or cfg.eval.prompts else None
    if evaluator is not None:
        check_frame_count(frames, getattr(evaluator, "metadata", []), f"eval.prompts={cfg.eval.prompts}"
                          if cfg.eval.prompts else f"eval.bench={cfg.eval.bench}")
    trainer = trainer_cls(cfg, tcfg, policy, loaded, data, evaluator, acc, run_dir)
    if acc.is_main_process:
        write_run_config(run_dir, dump_config(cfg, tcfg))
    acc.wait_for_everyone()
    return trainer


def finished_metrics(cfg: TrainConfig) -> dict[str, Any] | None:
    """The final metrics of the run in ``run.output_dir`` when it already finished under ``cfg``'s budget
    (its newest checkpoint reached ``trainer.max_steps`` or ``max_minutes``), else None."""
    run_dir = Path(cfg.run.output_dir)
    final_path, newest = run_dir / FINAL_METRICS, latest_checkpoint(run_dir)
    if cfg.run.resume != "auto" or not final_path.is_file() or newest is None or damage(newest) is not None:
        return None  # a damaged newest checkpoint: resume falls back and trains again
    _, tcfg = trainer_config(cfg.trainer)
    check_run_dir(run_dir, dump_config(cfg, tcfg), cfg.run.resume)  # another run's config still refuses
    try:
        state = json.loads((newest / "trainer_state.json").read_text())
        final = json.loads(final_path.read_text())
    except (OSError, ValueError):
        return None
    minutes = getattr(tcfg, "max_minutes", None)
    done = state.get("step", 0) >= getattr(tcfg, "max_steps", float("inf")) or (
        minutes is not None and state.get("train_seconds", 0.0) >= 60 * minutes)
    return final if done and isinstance(final, dict) else None


def claim_run_dir(run_dir: Path, overwrite: bool) -> None:
    """Refuse (``UserError``) a non-empty ``run_dir`` that no run wrote to (neither its ``config.yaml`` nor
    its marker) unless ``overwrite``; then mark it as a run's (a start that fails before ``config.yaml``
    still leaves the folder recognised) and sweep the temporaries a killed run left behind."""
    marker = run_dir / marker_name(RUN_WRITER)
    saved = saved_run_config(run_dir)  # a user's own config.yaml refuses before anything is written
    if not overwrite and saved is None and not marker.exists():
        refuse_foreign(run_dir, [n for n in foreign_entries(run_dir, RUN_WRITER) if n != LOCK_NAME],
                       "run.output_dir")
    if not marker.exists():
        write_json(marker, {"writer": RUN_WRITER, "entries": []})
    sweep_run_temporaries(run_dir)


def sweep_run_temporaries(run_dir: Path) -> None:
    """The temporaries of a run killed mid-write (checkpoints, evaluations, the gallery, logs). Only
    under the run's lock: every process writing into the folder is this one."""
    for folder in [run_dir, run_dir / "checkpoints", run_dir / "evals", run_dir / "gallery",
                   *(run_dir / "evals").glob("step-*")]:
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if not _temporary(folder, p.name):
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


#: temporaries of :mod:`flowalign.io`'s writers (``.NAME.tmp-PID-...``), of checkpoints and, named without
#: the pid by older versions, of evaluations
_TEMPORARY = {"checkpoints": re.compile(r"^\.tmp-"), "evals": re.compile(r"^\.step-\d{6}\.tmp-")}
_WRITER_TEMPORARY = re.compile(r"^\..+\.tmp-\d+-")


def _temporary(folder: Path, name: str) -> bool:
    if name.startswith((TMP_PREFIX, OLD_PREFIX)) or _WRITER_TEMPORARY.match(name):
        return True
    pattern = _TEMPORARY.get(folder.name)
    return pattern is not None and pattern.match(name) is not None


def train(cfg: TrainConfig, overwrite: bool = False) -> dict[str, Any]:
    """Train per ``cfg``; returns the final evaluation metrics (those on file for a finished run).
    ``overwrite``: train in a non-empty ``run.output_dir`` that holds no run (its other files are kept)."""
    with run_lock(Path(cfg.run.output_dir)), exit_on_sigterm():  # a second live run on the folder refuses
        if int(os.environ.get("RANK", "0")) == 0:
            claim_run_dir(Path(cfg.run.output_dir), overwrite)
        final = finished_metrics(cfg)
        if final is not None:
            print(f"{cfg.run.output_dir} already finished (final metrics in {FINAL_METRICS}); raise trainer.max_steps "
                  "to train it further")
            return final
        trainer = build_trainer(cfg)
        with explain_full_disk(trainer.run_dir, trainer.params, cfg.run.keep_checkpoints), \
                trainer.parallel.explain_failures():
            final = trainer.train()
        if trainer.acc.is_main_process:
            write_json(trainer.run_dir / FINAL_METRICS, final)  # also marks the run finished
    return final
