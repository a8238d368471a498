"""``flowalign pretrain-tiny FAMILY --out DIR --export FOLDER``: pretrain a tiny world's model on CPU.

``sd3``: the SD3-format text-to-image model on rendered ``vvr`` scenes (``assets/tiny-sd3-vvr``); ``wan``:
the Wan-format text-to-video model on rendered ``vvr_motion`` clips (``assets/tiny-wan-motion``);
``kontext``: the FLUX.1-Kontext-format editing model on rendered ``vvr_edit`` pairs, reusing the tiny SD3
model's VAE and text encoders (``assets/tiny-kontext-vvr-edit``); ``anyflow_far``: the AnyFlow-FAR-format
streaming video model on the same motion clips, made causal from the tiny Wan model
(``assets/tiny-anyflow-far-motion``); ``kontext_sr``: the Kontext model fine-tuned for super-resolution
(``assets/tiny-kontext-sr``); ``qwen_image_edit``: a Qwen-Image-Edit-format unified model whose VL encoder
says what is wrong with an image and whose transformer fixes it (``assets/tiny-qwen-image-umm``). The model
cards in those folders record the exact commands that made them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flowalign.cli.common import add_number
from flowalign.limits import MAX_BATCH, MAX_COEFFICIENT, MAX_GUIDANCE, MAX_LR, MAX_MINUTES, MAX_SAMPLING_STEPS, MAX_SEED, MAX_SEQUENCE_LENGTH, MAX_TASKS, MAX_THREADS, MAX_TINY_SIDE, MAX_TRAIN_STEPS
from flowalign.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pipelines.pretrain.families import FAMILIES

    p = sub.add_parser("pretrain-tiny",
                       help="pretrain a tiny SD3 (image), Wan (video), Kontext (editing, super-resolution), AnyFlow-FAR (streaming "
                            "video) or Qwen-Image-Edit (unified: reflects and revises) model on rendered scenes",
                       description="Pretrain a tiny world's model on CPU, in resumable stages (VAE, decoder, "
                                   "transformer), then export it as a diffusers folder.")
    families = p.add_subparsers(dest="family", required=True, metavar="FAMILY")
    for name, family in FAMILIES.items():
        f = families.add_parser(name, help=family.HELP, description=family.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        add_common_arguments(f, family.DEFAULTS)
        family.add_arguments(f)
    return p


def add_common_arguments(p: argparse.ArgumentParser, d: dict) -> None:
    """The options of every family; ``d``: the family's defaults."""
    p.add_argument("--out", default=d["out"], help="work folder (caches, stage checkpoints, train.log)")
    p.add_argument("--export", default=d["export"], help="final diffusers folder")
    p.add_argument("--overwrite", action="store_true",
                   help="export into a folder that holds files no export wrote (e.g. to regenerate a shipped model in "
                        "assets/), or work in an --out folder of other files; only the model's (the work's) files "
                        "are replaced, a model card is kept")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoints in --out")
    add_number(p, "--seed", type=int, lo=0, hi=MAX_SEED, default=0)
    add_number(p, "--threads", type=int, lo=1, hi=MAX_THREADS, default=d["threads"])
    add_number(p, "--size", type=int, lo=16, hi=MAX_TINY_SIDE, default=d["size"], help="scene side in pixels")
    add_number(p, "--n-scenes", "--n-clips", dest="n_scenes", type=int, lo=1, hi=MAX_TASKS, default=d["n_scenes"],
                   help="scenes (clips) rendered once for training")
    p.add_argument("--mix", default=d["mix"], help="levels of the rendered scenes and their weights")
    add_number(p, "--max-sequence-length", type=int, lo=0, hi=MAX_SEQUENCE_LENGTH, default=d["max_sequence_length"],
                   help="T5 / UMT5 length (sd3 default: as CLIP; wan 0: longest prompt + 2)")
    vae = p.add_argument_group("VAE and decoder")
    add_number(vae, "--vae-minutes", type=float, lo=0, hi=MAX_MINUTES, default=d["vae_minutes"])
    add_number(vae, "--vae-steps", type=int, lo=1, hi=MAX_TRAIN_STEPS, default=None)
    add_number(vae, "--vae-batch", type=int, lo=1, hi=MAX_BATCH, default=d["vae_batch"])
    add_number(vae, "--vae-lr", type=float, lo=0, hi=MAX_LR, lo_open=True, default=d["vae_lr"])
    add_number(vae, "--vae-lr2", type=float, lo=0, hi=MAX_LR, lo_open=True, default=3e-4)
    add_number(vae, "--vae-kl", type=float, lo=0, hi=MAX_COEFFICIENT, default=1e-4, help="KL weight (per-pixel normalised)")
    add_number(vae, "--fg-weight", type=float, lo=0, hi=MAX_COEFFICIENT, default=5.0, help="loss weight of object pixels vs background")
    add_number(vae, "--dec-minutes", type=float, lo=0, hi=MAX_MINUTES, default=d.get("dec_minutes"),
                     help="decoder-only fine-tuning (sd3 default: 5 from scratch, none with --init-from)")
    add_number(vae, "--dec-steps", type=int, lo=1, hi=MAX_TRAIN_STEPS, default=None)
    add_number(vae, "--dec-lr", type=float, lo=0, hi=MAX_LR, lo_open=True, default=1e-3)
    add_number(vae, "--dec-noise", type=float, lo=0, hi=MAX_COEFFICIENT, default=0.05, help="std of noise on normalised latents")
    dit = p.add_argument_group("transformer and text encoders")
    add_number(dit, "--dit-minutes", type=float, lo=0, hi=MAX_MINUTES, default=d["dit_minutes"])
    add_number(dit, "--dit-steps", type=int, lo=1, hi=MAX_TRAIN_STEPS, default=None)
    add_number(dit, "--batch", type=int, lo=1, hi=MAX_BATCH, default=d["batch"])
    add_number(dit, "--lr", type=float, lo=0, hi=MAX_LR, lo_open=True, default=1e-3)
    add_number(dit, "--wd", type=float, lo=0, hi=MAX_COEFFICIENT, default=0.01)
    add_number(dit, "--warmup", type=int, lo=0, hi=MAX_TRAIN_STEPS, default=100)
    add_number(dit, "--ema", type=float, lo=0, hi=1, default=0.995)
    dit.add_argument("--dit-level-weights", default=None,
                     help="batch sampling weights per level, e.g. easy:0.6,medium:0.3,hard:0.1 (default: as rendered)")
    add_number(dit, "--drop", type=float, lo=0, hi=1, default=d.get("drop", 0.1), help="empty-prompt rate for CFG")
    add_number(p, "--save-every", type=int, lo=1, hi=MAX_TRAIN_STEPS, default=200, help="steps between stage checkpoints")
    after = p.add_argument_group("export and evaluation")
    add_number(after, "--cfg", type=float, lo=0, hi=MAX_GUIDANCE, default=d["cfg"], help="CFG scale written to flowalign.json")
    add_number(after, "--sample-steps", type=int, lo=1, hi=MAX_SAMPLING_STEPS, default=20)
    add_number(after, "--eval-n", type=int, lo=0, hi=MAX_TASKS, default=0, help="held-out tasks per level to evaluate after export")
    add_number(after, "--demo-n", type=int, lo=0, hi=MAX_BATCH, default=d["demo_n"],
                       help="training prompts sampled into OUT/samples_train_prompts.png")
    after.add_argument("--eval-only", action="store_true", help="only evaluate the --export folder")


def check(args: argparse.Namespace) -> None:
    """Bad values as one-line errors, before anything is rendered."""
    for flag in ("vae_steps", "dec_steps", "dit_steps", "save_every", "n_scenes", "batch", "vae_batch", "size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} {value}: give a positive integer")
    for stage in ("vae", "dit"):
        if stage == "vae" and getattr(args, "init_from", None):
            continue  # a pretrained VAE is kept as it is: no VAE stage
        if not getattr(args, f"{stage}_steps") and not getattr(args, f"{stage}_minutes") and not args.eval_only:
            raise UserError(f"--{stage}-minutes / --{stage}-steps: the {stage} stage needs a budget")
    from pipelines.pretrain.work_folder import check_work_folder

    check_work_folder(Path(args.out), args.overwrite)
    if not args.eval_only:
        from pipelines.pretrain.export import check_export_folder

        check_export_folder(Path(args.export), args.overwrite)
    if args.size % 16:
        raise UserError(f"--size {args.size}: use a multiple of 16 (the VAE and patch factors divide it)")
    from pipelines.pretrain.families import FAMILIES

    family_check = getattr(FAMILIES.get(getattr(args, "family", None)), "check", None)
    if family_check is not None:
        family_check(args)


def run(args: argparse.Namespace) -> None:
    from pipelines.pretrain.run import run as run_pretraining

    check(args)
    run_pretraining(args)
