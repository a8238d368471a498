"""``flowalign train-reward``: fit latent reward registers to preference pairs; writes a reward folder.

Pairs come from a JSONL of images (``{"prompt", "chosen", "rejected"}``, paths relative to the file), a
pairs file written before (``.safetensors``), or the model's own samples ranked by a benchmark's
verifier (``--bench vvr --level medium --n N``). The folder gets ``config.json`` +
``registers.safetensors`` (what ``--guide`` and ``trainer.latent_reward`` read), ``metrics.json``
(pairwise accuracy per σ bin on train and held-out pairs) and ``pairs.safetensors`` (CoRe's real set).
An interrupted run continues from ``OUT.partial/`` with ``--resume``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from flowalign.cli.common import add_model_args, add_number, check_positive, load_policy
from flowalign.errors import UserError
from flowalign.io import atomic_dir, check_out_dir, check_out_file, remove_owned, write_json
from flowalign.limits import MAX_BATCH, MAX_GROUP_SIZE, MAX_LR, MAX_SAMPLING_STEPS, MAX_SEED, MAX_TASKS, MAX_TRAIN_STEPS, MAX_WIDTH
from flowalign.paths import REPO_ROOT, default_model_dir


#: the writer name of ``OUT.partial/`` (the resume folder), whose files only this command removes
PARTIAL, PARTIAL_FLAG = "train-reward-partial", "--out (its resume folder)"

#: training pairs scored for the train-accuracy report (a random subset when there are more)
TRAIN_ACCURACY_PAIRS = 1024


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("train-reward", help="train latent reward registers from preference pairs")
    add_model_args(p)
    src = p.add_argument_group("pairs (one source)")
    src.add_argument("--pairs", nargs="+", default=None,
                     help="JSONL files of {prompt, chosen, rejected} images and/or saved pairs .safetensors (merged)")
    src.add_argument("--bench", default=None, help="generate pairs from the model's samples ranked by this benchmark's verifier (vvr)")
    src.add_argument("--level", default="medium", help="benchmark level: easy, medium or hard")
    add_number(src, "--n", type=int, lo=1, hi=MAX_TASKS, default=200, help="benchmark tasks (prompts) to sample")
    add_number(src, "--group-size", type=int, lo=1, hi=MAX_GROUP_SIZE, default=4,
               help="samples per prompt; every differently scored pair is kept, and the prompt's pairs are one "
                    "group (the unit of --batch-form authors)")
    add_number(src, "--data-seed", type=int, lo=0, hi=MAX_SEED, default=0, help="seed of the freshly drawn tasks (never the held-out split)")
    add_number(src, "--steps", type=int, lo=1, hi=MAX_SAMPLING_STEPS, default=None, help="sampling steps (default: the model's)")
    src.add_argument("--no-partial-credit", action="store_true", help="rank vvr samples by the plain verifier score")
    src.add_argument("--heads", nargs="+", default=None, metavar="REWARD",
                     help="one register head per reward, each labelled by that registered reward (e.g. vvr vvr_soft); "
                          "the first orders the pairs (default: one head, labelled by the benchmark's verifier)")
    src.add_argument("--pairs-out", default=None, help="also save the generated pairs here (.safetensors) for reuse")
    p.add_argument("--out", required=True, help="reward folder to write")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out that holds no earlier reward (only the files this command "
                        "writes are replaced; other files are kept)")
    p.add_argument("--architecture", choices=["registers", "grid_pool"], default="registers",
                   help="registers: M tokens through every block, head = MLP(LN(mean)); grid_pool: the authors' paper "
                        "architecture on SD3, FLUX or Z-Image (registers to half depth, pooled image and text taps, "
                        "attention readout)")
    add_number(p, "--registers", type=int, lo=1, hi=MAX_WIDTH, default=None,
               help="number of register tokens M (default 8; grid_pool: the authors' 32)")
    p.add_argument("--layers", default="last", help="'last', 'multi' (L/2, 3L/4, L) or comma-separated block indices "
                                                    "(registers only: grid_pool taps 1/6, 1/3, 1/2 of the depth)")
    add_number(p, "--head-hidden", type=int, lo=1, hi=MAX_WIDTH, default=256, help="head width (registers only)")
    add_number(p, "--train-steps", type=int, lo=1, hi=MAX_TRAIN_STEPS, default=None,
               help="optimiser steps, each on --batch-size random pairs or groups (default 1000; not with --epochs)")
    add_number(p, "--batch-size", type=int, lo=1, hi=MAX_BATCH, default=32,
               help="pairs (--batch-form pairs) or groups (authors) a batch; with --epochs, a micro-batch")
    add_number(p, "--epochs", type=int, lo=1, hi=MAX_TRAIN_STEPS, default=None,
               help="train in the authors' epochs instead of --train-steps: each a pass over the training pairs or "
                    "groups in a seeded shuffle (random.Random(seed + epoch)), micro-batches of --batch-size, the "
                    "last incomplete one dropped (their preset: 3)")
    add_number(p, "--global-batch", type=int, lo=1, hi=MAX_TASKS, default=None,
               help="with --epochs: pairs or groups an optimiser step, a multiple of --batch-size whose micro-batches' "
                    "gradients are averaged (their preset: 64 over micro-batches of 8; default --batch-size)")
    add_number(p, "--lr", type=float, lo=0, hi=MAX_LR, lo_open=True, default=None,
               help="learning rate (default 1e-3; --recipe authors: their 5e-5)")
    p.add_argument("--recipe", choices=["adam", "authors"], default="adam",
                   help="adam: plain Adam; authors: AdamW (weight decay 0.01), linear lr warm-up, gradient norm "
                        "clipped to 1.0, and the EMA (0.999) of the weights saved as the reward")
    add_number(p, "--warmup-steps", type=int, lo=0, hi=MAX_TRAIN_STEPS, default=None,
               help="--recipe authors: steps of linear lr warm-up (default their 1000)")
    p.add_argument("--loss", choices=["bradley_terry", "thurstone"], default="bradley_terry",
                   help="pair loss: Bradley-Terry, or the registers' authors' Thurstone loss (a noisier pair costs less)")
    p.add_argument("--batch-form", choices=["pairs", "authors"], default=None,
                   help="pairs: random pairs, each noised at its own σ ~ U(0, 1) with its own ε; authors: the registers' "
                        "authors' batches: whole groups (a prompt's samples from --bench; a pair of a file is its own "
                        "group), one σ a group from the scheduler's 1000-level training grid at u ~ U(0, 1), one ε "
                        "shared by the group, the loss averaged over each group's pairs, then over groups, heads "
                        "summed (default: authors with --recipe authors, else pairs)")
    add_number(p, "--test-fraction", type=float, lo=0, hi=1, default=0.2, help="prompts held out for the accuracy report")
    p.add_argument("--eval-pairs", nargs="+", default=None,
                   help="held-out pairs (JSONL / .safetensors) to report accuracy on instead of a prompt split of --pairs")
    add_number(p, "--seed", type=int, lo=0, hi=MAX_SEED, default=0)
    add_number(p, "--checkpoint-every", type=int, lo=1, hi=MAX_TRAIN_STEPS, default=200, help="save OUT.partial/ every N steps (resume point)")
    p.add_argument("--resume", action="store_true", help="continue from OUT.partial/ if it exists")
    p.add_argument("--no-save-pairs", action="store_true", help="do not copy the pairs into the reward folder")
    p.add_argument("--no-progress", action="store_true")
    return p


def _check(args: argparse.Namespace) -> None:
    if args.registers is None:
        args.registers = 32 if args.architecture == "grid_pool" else 8
    if args.lr is None:
        args.lr = 5e-5 if args.recipe == "authors" else 1e-3
    if args.warmup_steps is not None and args.recipe != "authors":
        raise UserError("--warmup-steps belongs to --recipe authors (plain Adam has no warm-up)")
    if args.batch_form is None:  # their recipe trains on their batches; plain Adam keeps the pairs form
        args.batch_form = "authors" if args.recipe == "authors" else "pairs"
    if args.epochs is not None and args.train_steps is not None:
        raise UserError("--epochs and --train-steps both set how long to train: give one")
    if args.global_batch is not None and args.epochs is None:
        raise UserError("--global-batch belongs to --epochs (their micro-batches accumulated into one step)")
    if args.global_batch is not None and (args.global_batch < args.batch_size or args.global_batch % args.batch_size):
        raise UserError(f"--global-batch {args.global_batch}: give a multiple of --batch-size {args.batch_size} "
                        "(their preset: 64 over micro-batches of 8)")
    if args.epochs is None and args.train_steps is None:
        args.train_steps = 1000
    if bool(args.pairs) == bool(args.bench):
        raise UserError("give exactly one pair source: --pairs FILE or --bench NAME (e.g. --bench vvr --level medium --n 200)")
    for flag, files in (("--pairs", args.pairs), ("--eval-pairs", args.eval_pairs)):
        for f in files or []:
            if not Path(f).is_file():
                raise UserError(f"{flag} {f}: no such file")
            if Path(f).suffix not in (".jsonl", ".safetensors"):
                raise UserError(f"{flag} {f}: use a .jsonl of images or a .safetensors pairs file")
    for name in ("n", "group_size", "train_steps", "batch_size", "registers", "head_hidden", "checkpoint_every"):
        if getattr(args, name) is not None and getattr(args, name) < (2 if name == "group_size" else 1):
            raise UserError(f"--{name.replace('_', '-')} must be >= {2 if name == 'group_size' else 1}, got {getattr(args, name)}")
    if args.heads is not None:
        if not args.bench:
            raise UserError("--heads labels the model's own samples: give it with --bench (pair files carry their heads)")
        if len(set(args.heads)) != len(args.heads) or not all(h.isidentifier() for h in args.heads):
            raise UserError(f"--heads {' '.join(args.heads)}: give distinct registered reward names, e.g. --heads vvr vvr_soft")
        import rewards

        for name in args.heads:
            rewards.check(name)
    if not 0 <= args.test_fraction < 1:
        raise UserError(f"--test-fraction {args.test_fraction}: use a value in [0, 1)")
    if not 0 < args.lr <= MAX_LR:
        raise UserError(f"--lr {args.lr}: give a learning rate in (0, {MAX_LR:g}] (e.g. the default 1e-3)")
    check_positive(args, "steps", "n", "group_size", "batch_size")


def _out_folders(args: argparse.Namespace) -> tuple[Path, Path]:
    """``--out`` and its resume folder ``OUT.partial``, refused before anything is sampled or trained."""
    out = Path(args.out)
    if not out.resolve().name:
        raise UserError(f"--out {args.out}: give a folder below the file system's root")
    partial = out.resolve().with_name(out.resolve().name + ".partial")
    check_out_dir(out, writer="train-reward", overwrite=args.overwrite)
    check_out_dir(partial, writer=PARTIAL, overwrite=args.overwrite or args.resume, flag=PARTIAL_FLAG)
    if args.pairs_out and not args.pairs:  # written only where the pairs are generated
        check_out_file(args.pairs_out, overwrite=args.overwrite, flag="--pairs-out")
    return out, partial


def _portable(path: Path) -> str:
    """The base model as the reward folder records it: relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path.resolve())


def _layers(text: str):
    if text in ("last", "multi"):
        return text
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UserError(f"--layers {text!r}: use 'last', 'multi' or comma-separated block indices like 1,3") from None


def pairs_from_jsonl(policy, path: Path, batch: int = 64):
    import numpy as np
    import torch

    from flowalign.config import read_text_file
    from flowalign.trainers.parts.latent_preference import PreferencePairs
    from flowalign.media import open_image
    from rewards.latent_registers import encode_images

    prompts, files, margins = [], [], []
    text = read_text_file(path, "--pairs", "a .jsonl of {prompt, chosen, rejected} images")
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pair = [path.parent / row["chosen"], path.parent / row["rejected"]]
            prompt = str(row["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise UserError(f"{path}:{line_no}: each line must be a JSON object with prompt, chosen, rejected ({err})") from err
        for f in pair:
            if not f.is_file():
                raise UserError(f"{path}:{line_no}: image {f} does not exist (paths are relative to the JSONL's folder)")
        prompts.append(prompt)
        files += pair
        margins.append(float(row.get("margin", 1.0)))
    if not prompts:
        raise UserError(f"{path} holds no pairs")
    # an image may serve several pairs (one chosen scene against several near misses): encode it once
    position = {f: k for k, f in enumerate(dict.fromkeys(files))}
    unique = list(position)
    latents = []
    for i in range(0, len(unique), batch):
        # each file's header checked first (not an image, too many pixels: one line, before decoding)
        ims = [torch.from_numpy(np.asarray(open_image(f, f"{path}: image").convert("RGB"), dtype=np.float32) / 255)
               .permute(2, 0, 1) for f in unique[i : i + batch]]
        latents.append(encode_images(policy, torch.stack(ims)))
    latents = torch.cat(latents)[torch.tensor([position[f] for f in files])]  # chosen, rejected interleaved
    return PreferencePairs(prompts, latents[0::2], latents[1::2], torch.tensor(margins))


def load_pair_files(policy, files: list[str]):
    from flowalign.trainers.parts.latent_preference import PreferencePairs

    parts = [PreferencePairs.load(f) if Path(f).suffix == ".safetensors" else pairs_from_jsonl(policy, Path(f))
             for f in files]
    return parts[0] if len(parts) == 1 else PreferencePairs.cat(parts)


def load_pairs(args: argparse.Namespace, policy):
    """The preference pairs of ``args`` and a summary of where they came from."""
    from flowalign.trainers.parts.latent_preference import PreferencePairs, generate_pairs

    if args.pairs:
        pairs = load_pair_files(policy, args.pairs)
        return pairs, {"source": " + ".join(args.pairs), "pairs": len(pairs)}
    from flowalign.benchmarks import training_tasks
    from rewards.registry import load as load_reward

    bench = training_tasks(args.bench, args.level, args.n, args.data_seed)
    partial = args.bench == "vvr" and not args.no_partial_credit
    reward = load_reward("vvr", partial_credit=True) if partial else bench.reward
    labeller = reward.name + (" (partial credit)" if partial else "")
    if args.heads:  # one labeller per head; the benchmark's own verifier keeps the partial credit asked for
        reward = {h: reward if h == bench.reward.name else load_reward(h) for h in args.heads}
        labeller = ", ".join(labeller if h == bench.reward.name else h for h in args.heads)
    pairs, info = generate_pairs(policy, bench.prompts, bench.metadata, reward, group_size=args.group_size,
                                 num_steps=args.steps, seed=args.data_seed, progress=not args.no_progress)
    if args.pairs_out:
        pairs.save(args.pairs_out)
    return pairs, {"source": f"{args.bench}/{args.level} n={args.n} seed={args.data_seed} group={args.group_size}",
                   "labeller": labeller, **info}


def split_pairs(args: argparse.Namespace, pairs, policy, source: dict) -> tuple:
    """Training and held-out pairs: ``--eval-pairs`` files, or a split of ``pairs`` by prompt."""
    if args.eval_pairs:
        train_pairs, test_pairs = pairs, load_pair_files(policy, args.eval_pairs)
        print(f"{len(pairs)} training pairs from {source['source']}; {len(test_pairs)} held-out pairs from "
              + " + ".join(args.eval_pairs))
    else:
        train_pairs, test_pairs = pairs.split(args.test_fraction, seed=args.seed)
        print(f"{len(pairs)} pairs ({len(train_pairs)} train, {len(test_pairs)} held out by prompt) from {source['source']}")
    return train_pairs, test_pairs


def accuracy_report(args: argparse.Namespace, reward, encode, train_pairs, test_pairs) -> dict:
    """Pairwise accuracy per σ bin on (a subset of) the training pairs and on the held-out ones."""
    import torch

    from flowalign.trainers.parts.latent_preference import pairwise_accuracy

    # how well the pairs were fitted; a random subset of a large set says the same at a fraction of the cost
    fit_check = train_pairs
    if len(train_pairs) > TRAIN_ACCURACY_PAIRS:
        order = torch.randperm(len(train_pairs), generator=torch.Generator().manual_seed(args.seed))
        fit_check = train_pairs.select(order[:TRAIN_ACCURACY_PAIRS])
    metrics = {"accuracy_train": pairwise_accuracy(reward, fit_check, encode, seed=args.seed + 1),
               "accuracy_train_pairs": len(fit_check)}
    if len(test_pairs):
        metrics["accuracy_test"] = pairwise_accuracy(reward, test_pairs, encode, seed=args.seed + 1)
        seen = set(train_pairs.prompts)
        unseen = [i for i, p in enumerate(test_pairs.prompts) if p not in seen]
        if 0 < len(unseen) < len(test_pairs):  # --eval-pairs may share prompts with the training pairs
            metrics["test_pairs_unseen_prompts"] = len(unseen)
            metrics["accuracy_test_unseen_prompts"] = pairwise_accuracy(reward, test_pairs.select(unseen), encode,
                                                                        seed=args.seed + 1)
    return metrics


def training_schedule(args: argparse.Namespace, train_pairs) -> list | None:
    """With ``--epochs``, the authors' optimiser steps (their micro-batches of pairs or groups); sets
    ``args.train_steps`` to their count. None: ``--train-steps`` random batches."""
    from flowalign.trainers.parts.latent_preference import authors_steps

    if args.epochs is None:
        return None
    units = len(train_pairs) if args.batch_form == "pairs" else len(train_pairs.groups())
    schedule = authors_steps(units, epochs=args.epochs, batch_size=args.batch_size, global_batch=args.global_batch,
                             seed=args.seed)
    if not schedule:
        kind = "pairs" if args.batch_form == "pairs" else "groups"
        raise UserError(f"--epochs: {units} training {kind}, fewer than --batch-size {args.batch_size}, fill no "
                        "micro-batch (an incomplete one is dropped, as theirs); lower --batch-size")
    args.train_steps = len(schedule)
    return schedule


def fit_registers(args: argparse.Namespace, reward, pairs, train_pairs, source: dict, partial: Path,
                  encode, resume: bool, grid=None) -> dict:
    """Train ``reward`` on ``train_pairs``, checkpointing into ``partial`` (resumed from it when asked).
    ``grid``: the noise levels the authors' batch form draws from (``authors_grid``)."""
    import torch
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    from flowalign.disk_space import explain_no_space

    from flowalign.trainers.parts.latent_preference import fit

    if args.recipe == "authors":
        from rewards.latent_registers.recipe import WARMUP_STEPS, AuthorsRecipe

        warmup = WARMUP_STEPS if args.warmup_steps is None else args.warmup_steps
        optimizer = AuthorsRecipe(reward, lr=args.lr, warmup_steps=warmup)
    else:
        optimizer = torch.optim.Adam(reward.parameters(), lr=args.lr)
    start = 0
    if resume:
        reward.load_state_dict(load_file(str(partial / "registers.safetensors")))
        optimizer.load_state_dict(torch.load(partial / "optimizer.pt", weights_only=True))
        start = int(json.loads((partial / "state.json").read_text())["step"])
        print(f"resumed from {partial} at step {start}")

    def checkpoint(step: int) -> None:
        with explain_no_space(partial, saved_bytes(reward, pairs), f"the resume point of step {step}"), \
                atomic_dir(partial, writer=PARTIAL, overwrite=args.overwrite or args.resume, flag=PARTIAL_FLAG) as tmp:
            pairs.save(tmp / "pairs.safetensors")
            save_file({k: v.detach().cpu().contiguous() for k, v in reward.state_dict().items()}, str(tmp / "registers.safetensors"))
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
            (tmp / "state.json").write_text(json.dumps({"step": step, "source": source}))

    schedule = training_schedule(args, train_pairs)
    if not resume:
        checkpoint(0)  # the pairs are the expensive part: keep them before training
    bar = tqdm(total=args.train_steps, initial=start, desc="training registers", unit="step", disable=args.no_progress)

    def on_step(step: int, info: dict) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{info['loss']:.3f}", acc=f"{info['acc_real']:.2f}")
        if (step + 1) % args.checkpoint_every == 0 and step + 1 < args.train_steps:
            checkpoint(step + 1)

    stats = fit(reward, train_pairs, encode, steps=args.train_steps, batch_size=args.batch_size, lr=args.lr,
                seed=args.seed, start_step=start, optimizer=optimizer, on_step=on_step, loss=args.loss,
                batch_form=args.batch_form, grid=grid, schedule=schedule)
    bar.close()
    if args.recipe == "authors":
        optimizer.finish()  # the average is the reward that is evaluated and saved
    return stats


def saved_bytes(reward, pairs) -> int:
    """About what a resume point takes on disk: the pairs, the registers and Adam's two moments."""
    from flowalign.disk_space import tensor_bytes

    return 3 * tensor_bytes(reward.state_dict().values()) + 4 * (pairs.chosen.numel() * 2 + pairs.margin.numel())


def run(args: argparse.Namespace) -> None:
    from flowalign.disk_space import explain_no_space
    from flowalign.trainers.parts.latent_preference import PreferencePairs, authors_grid
    from rewards.latent_registers import DEFAULT_HEAD, LatentRegisters, family_options_for, load_frozen_transformer

    _check(args)
    out, partial = _out_folders(args)
    layers = _layers(args.layers)
    policy = load_policy(args)
    model = _portable(Path(args.model) if args.model else default_model_dir())
    t0 = time.perf_counter()

    resume = args.resume and (partial / "state.json").is_file()
    if resume:
        pairs = PreferencePairs.load(partial / "pairs.safetensors")
        source = json.loads((partial / "state.json").read_text())["source"]
    else:
        pairs, source = load_pairs(args, policy)
    train_pairs, test_pairs = split_pairs(args, pairs, policy, source)
    transformer = load_frozen_transformer(model, Path(model), policy.device, policy.dtype)
    if args.architecture == "grid_pool":
        from rewards.latent_registers.grid import grid_registers

        # the family's class (SD3, FLUX or Z-Image) with its paper preset scaled to the depth, scoring as the policy samples
        reward = grid_registers(transformer, policy, num_reward_tokens=args.registers, heads=pairs.heads or [DEFAULT_HEAD],
                                base_model=model, seed=args.seed)
    else:
        reward = LatentRegisters(transformer, num_registers=args.registers, layers=layers, head_hidden=args.head_hidden,
                                 base_model=model, seed=args.seed, family_options=family_options_for(transformer, policy),
                                 heads=pairs.heads or [DEFAULT_HEAD])
    grid = authors_grid(policy) if args.batch_form == "authors" else None
    stats = fit_registers(args, reward, pairs, train_pairs, source, partial, policy.encode, resume, grid=grid)
    metrics = {"pairs": source, "heads": reward.head_names, "architecture": args.architecture, "recipe": args.recipe, "train_pairs": len(train_pairs), "test_pairs": len(test_pairs),
               "train_steps": args.train_steps, "loss": args.loss, "final_train_loss": stats.get("loss"),
               "batch_form": args.batch_form, "epochs": args.epochs, "global_batch": args.global_batch,
               **accuracy_report(args, reward, policy.encode, train_pairs, test_pairs)}
    metrics["minutes"] = (time.perf_counter() - t0) / 60
    with explain_no_space(out, saved_bytes(reward, pairs), "the reward folder"), \
            atomic_dir(out, writer="train-reward", overwrite=args.overwrite) as tmp:
        reward.write_files(tmp, extra={"trained_on": source})
        if not args.no_save_pairs:
            pairs.save(tmp / "pairs.safetensors")
        write_json(tmp / "metrics.json", metrics)
    remove_owned(partial, PARTIAL)
    shown = metrics.get("accuracy_test", metrics["accuracy_train"])
    kind = "held-out" if "accuracy_test" in metrics else "train"
    for head, table in (shown.items() if len(reward.head_names) > 1 else [(None, shown)]):
        print(f"pairwise accuracy ({kind}{'' if head is None else ', head ' + head}): "
              + ", ".join(f"{k} {v:.1%}" for k, v in table.items()))
    print(f"wrote {out}")
