"""``flowalign evaluate``: score a model (and adapter) on a benchmark split, or on a prompt file with any
rewards (``--prompts FILE --reward SPEC ...``); writes metrics.json, results.jsonl and the samples."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from flowalign import strict_json
from flowalign.cli.common import (
    add_guide_args,
    add_model_args,
    add_number,
    add_reflection_args,
    add_sampling_args,
    check_guide_args,
    check_positive,
    load_guided_policy,
)
from flowalign.errors import UserError
from flowalign.io import check_out_dir
from flowalign.limits import MAX_BATCH, MAX_SEED, MAX_TASKS
from flowalign.paths import default_model_dir

if TYPE_CHECKING:
    from flowalign.data import PromptSet


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("evaluate", help="evaluate on a benchmark split or a prompt file with any rewards "
                                        "(metrics.json, samples, verdicts)")
    add_model_args(p)
    from flowalign.benchmarks import available_benchmarks

    p.add_argument("--bench", default=None,
                   help=f"benchmark name (default vvr): {', '.join(available_benchmarks())}")
    p.add_argument("--reward-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the benchmark's own reward (repeatable; VALUE read as YAML), e.g. for geneval "
                        "--reward-option path=/weights/mask2former --reward-option clip_path=/weights/clip")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="evaluate on this prompt file instead of a benchmark: .txt (one prompt a line) or .jsonl "
                        "(a \"prompt\" per line, the rest its metadata, e.g. GenEval's metadata files); needs --reward")
    p.add_argument("--reward", action="append", default=[], metavar="SPEC",
                   help="a reward to score the samples with (repeatable): a name, or the YAML mapping of a config's "
                        "rewards: list, e.g. \"{name: pickscore, path: /weights/pickscore}\"; each gets its mean with "
                        "a 95%% interval in metrics.json and its score per sample in results.jsonl")
    p.add_argument("--level", default="easy", help="easy, medium or hard")
    p.add_argument("--split", default="test",
                   help="validation (choose settings on it) or test (held-out compositions; report results on it)")
    add_number(p, "--n", type=int, lo=1, hi=MAX_TASKS, default=None, help="number of tasks (default: the whole split)")
    add_number(p, "--seed", type=int, lo=0, hi=MAX_SEED, default=None,
                   help="draw a fresh split of the same distribution with this seed instead of the shipped one (also seeds the noise)")
    add_sampling_args(p)
    p.add_argument("--solver", default="euler", choices=["euler", "dpm2"],
                   help="the ODE solver: euler (default) or dpm2, multistep DPM-Solver++(2) on the model's own grid")
    add_number(p, "--batch-size", type=int, lo=1, hi=MAX_BATCH, default=16)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out that holds no earlier evaluation (only metrics.json, "
                        "results.jsonl and samples/ are replaced; other files are kept)")
    add_guide_args(p)
    add_reflection_args(p)
    return p


def run(args: argparse.Namespace) -> None:
    from flowalign.config import reward_spec_from_text
    from flowalign.evaluation import evaluate
    from flowalign.reward_check import check_video_files
    from flowalign.reward_set import load_panel

    check_positive(args, "steps", "batch_size", "n")
    specs = [reward_spec_from_text(text, "--reward") for text in args.reward]
    if args.prompts is not None:
        if args.bench is not None:
            raise UserError("give --prompts FILE or --bench NAME, not both")
        if args.reward_option:
            raise UserError("--reward-option sets options of a benchmark's reward; with --prompts give each reward's "
                            "options in its --reward mapping, e.g. \"{name: pickscore, path: /weights/pickscore}\"")
        if not specs:
            raise UserError("--prompts needs at least one --reward to score the samples with, e.g. --reward brightness")
        source = _prompt_source(args)
    else:
        from flowalign.benchmarks import load_benchmark

        source = load_benchmark(args.bench or "vvr", args.level, args.n, args.seed, split=args.split,
                                reward_options=_reward_options(args.reward_option))
    check_guide_args(args)
    check_out_dir(args.out, writer="evaluate", overwrite=args.overwrite)  # before the model is loaded
    panel = load_panel(specs, "--reward") if specs else None
    policy, guide = load_guided_policy(args)
    check_video_files(specs, policy.is_video, "--reward")
    labels = {}
    reflection = getattr(policy, "reflection", None)  # a unified model's loop (--adapter of a umm_reflection run)
    if reflection is not None:
        if guide is not None:
            raise UserError("--guide steers one rollout; a unified model's reflection loop runs several: drop --guide")
        labels = {"reflection": dataclasses.asdict(reflection)}
    if guide is not None:
        from flowalign.sampling.guidance import GuidedPolicy

        policy = GuidedPolicy(policy, guide)  # every sampling step of the evaluation is reward-guided
        labels = {"guide": args.guide, "guide_scale": guide.scale, "guide_window": args.guide_window}
        if guide.bands is not None:
            labels = {"guide": args.guide, "guide_bands": [list(band) for band in guide.bands]}
        if guide.heads is not None:
            labels["guide_heads"] = {h: (guide.head_weights or {}).get(h, 1.0) for h in guide.heads}
    model = {"model": str(args.model or default_model_dir()), "adapter": args.adapter,
             **({"solver": args.solver} if args.solver != "euler" else {})}
    if args.prompts is not None:
        labels = {"prompts": str(args.prompts), "seed": args.seed or 0, "reward": panel.names[0],
                  "rewards": panel.names, **model, **labels}
    else:
        labels = {"bench": source.name, "split": source.split, "seed": args.seed or 0, "reward": source.reward.name,
                  **({"rewards": panel.names} if panel else {}), **model, **labels}
    metrics = evaluate(policy, source.prompts, source.metadata, getattr(source, "reward", None), seed=args.seed or 0,
                       num_steps=args.steps, guidance_scale=args.guidance, batch_size=args.batch_size,
                       out_dir=args.out, overwrite=args.overwrite, labels=labels, panel=panel, solver=args.solver)
    print(strict_json.dumps({k: v for k, v in metrics.items() if k != "per_constraint"}, indent=2))
    print(f"wrote {args.out}/metrics.json")


def _prompt_source(args: argparse.Namespace) -> PromptSet:
    """``--prompts`` (its first ``--n``), read before any model is loaded."""
    from flowalign.data import PromptSet, read_prompt_file

    prompts = read_prompt_file(args.prompts)
    if args.n is not None:
        prompts = PromptSet(prompts.prompts[: args.n], prompts.metadata[: args.n])
    return prompts


def _reward_options(items: list[str]) -> dict[str, object]:
    """``--reward-option KEY=VALUE`` items as a mapping, each value read as YAML (``batch_size=8`` is a number)."""
    import yaml

    from flowalign.yaml_load import load_yaml

    options: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--reward-option {item!r} is not KEY=VALUE (e.g. --reward-option path=/weights/mask2former)")
        try:
            options[key.strip()] = load_yaml(raw, f"--reward-option {key}") if raw else None
        except yaml.YAMLError:
            raise UserError(f"--reward-option {key}: {raw!r} is not valid YAML; quote a text value") from None
    return options
