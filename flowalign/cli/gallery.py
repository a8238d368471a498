"""``flowalign gallery``: a static HTML gallery of a run's evaluations, of evaluation folders, or of a
base model and its adapters sampled side by side on a prompt file."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowalign.cli.common import add_number, check_positive, load_policy
from flowalign.errors import UserError
from flowalign.io import MARKER_PREFIX, check_out_dir, sweep_stale, temp_prefix, with_pid
from flowalign.limits import MAX_BATCH, MAX_GUIDANCE, MAX_SAMPLING_STEPS, MAX_SEED

if TYPE_CHECKING:
    import torch

    from flowalign.protocols import RewardOutput


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("gallery", help="render evaluations as a static HTML gallery (index.html)",
                       description="Render a static HTML gallery from one of: a training run (--run), evaluation "
                                   "folders (--evals) or a model and adapters sampled on a prompt file (--model).")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", default=None, help="training run folder; reads RUN/evals/step-XXXXXX/, writes RUN/gallery/")
    source.add_argument("--evals", nargs="+", default=None, help="folders written by `flowalign evaluate --out`, one column each")
    source.add_argument("--model", default=None, help="diffusers model folder to sample (the base column)")
    p.add_argument("--adapter", action="extend", nargs="+", default=[],
                   help="with --model: adapter or checkpoints/step-XXXXXX folders, one column each")
    p.add_argument("--prompts", default=None,
                   help='with --model: text file, one prompt per line, or JSONL {"prompt": ..., "task": {...}} per line')
    p.add_argument("--reward", default=None, help="with --model: reward name (default: none, images only)")
    add_number(p, "--seed", type=int, lo=0, hi=MAX_SEED, default=0,
               help="with --model: sample i gets the noise of seed + i")
    add_number(p, "--steps", type=int, lo=1, hi=MAX_SAMPLING_STEPS, default=None,
               help="with --model: sampling steps (default: the model's)")
    add_number(p, "--guidance", type=float, lo=0, hi=MAX_GUIDANCE, default=None,
               help="with --model: CFG scale (default: the model's)")
    add_number(p, "--batch-size", type=int, lo=1, hi=MAX_BATCH, default=16)
    p.add_argument("--device", default="cpu", help="with --model: cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--labels", nargs="+", default=None, help="column labels (default: folder names, 'base' for --model)")
    p.add_argument("--title", default=None, help="page title (default: the run's or output folder's name)")
    p.add_argument("--out", default=None, help="gallery folder to write (default with --run: RUN/gallery)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out that holds no earlier gallery (only index.html and media/ "
                        "are replaced; other files are kept)")
    return p


def run(args: argparse.Namespace) -> None:
    from flowalign.gallery import gallery_from_evals, gallery_from_run, write_gallery

    check_positive(args, "steps", "batch_size")
    if args.run is not None:
        run_dir = Path(args.run)
        columns, rows = gallery_from_run(run_dir)
        out = Path(args.out) if args.out else run_dir / "gallery"
        overwrite = args.overwrite  # RUN/gallery written by training is recognised by its marker
        check_out_dir(out, writer="gallery", overwrite=overwrite)
        title = args.title or run_dir.resolve().name
    else:
        if args.out is None:
            raise UserError("--out is required with --evals and --model; name the gallery folder to write")
        out, overwrite = Path(args.out), args.overwrite
        check_out_dir(out, writer="gallery", overwrite=overwrite)  # before any sampling
        title = args.title or out.resolve().name
        if args.evals is not None:
            dirs = [Path(d) for d in args.evals]
            columns, rows = gallery_from_evals(dirs, _labels(args.labels, [d.name for d in dirs], "--evals folders"))
        else:
            # the evaluations only feed the gallery, which copies their media: keep them on its file system
            # (media are hard-linked) under a name of ours, and drop them afterwards
            with tempfile.TemporaryDirectory(**_scratch(out)) as tmp:
                dirs, defaults = _sample_columns(args, Path(tmp))
                columns, rows = gallery_from_evals(dirs, _labels(args.labels, defaults, "columns (base + adapters)"))
                print(write_gallery(out, columns, rows, title=title, overwrite=overwrite))
            return
    print(write_gallery(out, columns, rows, title=title, overwrite=overwrite))


def _scratch(out: Path) -> dict[str, str]:
    """Where the sampled columns wait: inside ``out`` when it exists (a hidden name the gallery ignores),
    else beside it; named with the pid so that a killed run's scratch is swept by the next."""
    if out.is_dir():
        folder, prefix = out, f"{MARKER_PREFIX}evals-"
    else:
        folder, prefix = out.resolve().parent, temp_prefix(out.resolve().name, "evals")
        folder.mkdir(parents=True, exist_ok=True)
    sweep_stale(folder, prefix)
    return {"prefix": with_pid(prefix), "dir": str(folder)}


def _labels(given: list[str] | None, defaults: list[str], what: str) -> list[str]:
    if given is None:
        return defaults
    if len(given) != len(defaults):
        raise UserError(f"--labels has {len(given)} names for {len(defaults)} {what}; give one per column")
    return given


def read_prompts(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """Prompts and per-prompt metadata from a text file (one prompt per line) or JSONL
    (``{"prompt": ..., "task": {...}}`` per line; a task becomes the metadata ``{"task": ...}``)."""
    from flowalign.config import read_text_file

    if not path.exists():
        raise UserError(f"--prompts {path}: no such file; give a text file with one prompt per line")
    prompts, metadata = [], []
    text = read_text_file(path, "--prompts", "a text file with one prompt per line")
    for line_no, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if not line.startswith("{"):
            prompts.append(line)
            metadata.append({})
            continue
        try:
            entry = json.loads(line)
            prompt = entry["prompt"]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f'{path}:{line_no}: expected {{"prompt": ..., "task": {{...}}}} ({e})') from e
        prompts.append(str(prompt))
        metadata.append({"task": entry["task"]} if entry.get("task") is not None else {})
    if not prompts:
        raise UserError(f"--prompts {path} has no prompts; write one prompt per line")
    return prompts, metadata


def _sample_columns(args: argparse.Namespace, folder: Path) -> tuple[list[Path], list[str]]:
    """Evaluate the base model and each adapter on the prompts with the same seeds; one folder each."""
    from flowalign.evaluation import evaluate
    from flowalign.reward_check import check_reward_metadata

    if args.prompts is None:
        raise UserError("--model needs --prompts FILE (one prompt per line, or JSONL with prompt and task)")
    prompts, metadata = read_prompts(Path(args.prompts))
    if args.reward is not None:
        from flowalign.plugins import load_reward

        reward = load_reward(args.reward)
        check_reward_metadata(args.reward, reward, metadata, f"--prompts {args.prompts}")
    else:
        reward = Unscored()
    dirs, labels = [], []
    for i, adapter in enumerate([None, *args.adapter]):
        policy = load_policy(argparse.Namespace(**{**vars(args), "adapter": adapter}))
        dirs.append(folder / f"{i:02d}")
        # "reward" and "seed" in metrics.json tell the gallery what the score is called and which
        # noise each sample had
        evaluate(policy, prompts, metadata, reward, seed=args.seed, num_steps=args.steps, guidance_scale=args.guidance,
                 batch_size=args.batch_size, out_dir=dirs[-1],
                 labels={"reward": args.reward, "seed": args.seed, "adapter": adapter})
        labels.append("base" if adapter is None else Path(adapter).name)
    if len(set(labels)) < len(labels):  # e.g. two runs' checkpoints/step-000100: show the paths given
        labels = ["base", *args.adapter]
    return dirs, labels


class Unscored:
    """The reward of an images-only gallery: every sample valid, no score worth showing (the gallery
    drops it because the evaluation records ``reward: null``)."""

    name = "none"
    differentiable = False

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        import torch

        from flowalign.protocols import RewardOutput

        n = len(prompts)
        return RewardOutput({"none": torch.zeros(n)}, valid=torch.ones(n, dtype=torch.bool))
