"""``flowalign pretrain-tiny {sd3,wan,kontext,anyflow_far} --out DIR --export FOLDER``: pretrain a tiny world's model on CPU.

``sd3``: the SD3-format text-to-image model on rendered ``vvr`` scenes (``assets/tiny-sd3-vvr``); ``wan``:
the Wan-format text-to-video model on rendered ``vvr_motion`` clips (``assets/tiny-wan-motion``);
``kontext``: the FLUX.1-Kontext-format editing model on rendered ``vvr_edit`` pairs, reusing the tiny SD3
model's VAE and text encoders (``assets/tiny-kontext-vvr-edit``); ``anyflow_far``: the AnyFlow-FAR-format
streaming video model on the same motion clips, made causal from the tiny Wan model
(``assets/tiny-anyflow-far-motion``). The model cards in those folders record
the exact commands that made them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flowalign.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pipelines.pretrain.run import FAMILIES

    p = sub.add_parser("pretrain-tiny",
                       help="pretrain a tiny SD3 (image), Wan (video), Kontext (editing) or AnyFlow-FAR (streaming video) model on rendered scenes",
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=d["threads"])
    p.add_argument("--size", type=int, default=d["size"], help="scene side in pixels")
    p.add_argument("--n-scenes", "--n-clips", dest="n_scenes", type=int, default=d["n_scenes"],
                   help="scenes (clips) rendered once for training")
    p.add_argument("--mix", default=d["mix"], help="levels of the rendered scenes and their weights")
    p.add_argument("--max-sequence-length", type=int, default=d["max_sequence_length"],
                   help="T5 / UMT5 length (sd3 default: as CLIP; wan 0: longest prompt + 2)")
    vae = p.add_argument_group("VAE and decoder")
    vae.add_argument("--vae-minutes", type=float, default=d["vae_minutes"])
    vae.add_argument("--vae-steps", type=int, default=None)
    vae.add_argument("--vae-batch", type=int, default=d["vae_batch"])
    vae.add_argument("--vae-lr", type=float, default=d["vae_lr"])
    vae.add_argument("--vae-lr2", type=float, default=3e-4)
    vae.add_argument("--vae-kl", type=float, default=1e-4, help="KL weight (per-pixel normalised)")
    vae.add_argument("--fg-weight", type=float, default=5.0, help="loss weight of object pixels vs background")
    vae.add_argument("--dec-minutes", type=float, default=d.get("dec_minutes"),
                     help="decoder-only fine-tuning (sd3 default: 5 from scratch, none with --init-from)")
    vae.add_argument("--dec-steps", type=int, default=None)
    vae.add_argument("--dec-lr", type=float, default=1e-3)
    vae.add_argument("--dec-noise", type=float, default=0.05, help="std of noise on normalised latents")
    dit = p.add_argument_group("transformer and text encoders")
    dit.add_argument("--dit-minutes", type=float, default=d["dit_minutes"])
    dit.add_argument("--dit-steps", type=int, default=None)
    dit.add_argument("--batch", type=int, default=d["batch"])
    dit.add_argument("--lr", type=float, default=1e-3)
    dit.add_argument("--wd", type=float, default=0.01)
    dit.add_argument("--warmup", type=int, default=100)
    dit.add_argument("--ema", type=float, default=0.995)
    dit.add_argument("--dit-level-weights", default=None,
                     help="batch sampling weights per level, e.g. easy:0.6,medium:0.3,hard:0.1 (default: as rendered)")
    dit.add_argument("--drop", type=float, default=d.get("drop", 0.1), help="empty-prompt rate for CFG")
    p.add_argument("--save-every", type=int, default=200, help="steps between stage checkpoints")
    after = p.add_argument_group("export and evaluation")
    after.add_argument("--cfg", type=float, default=d["cfg"], help="CFG scale written to flowalign.json")
    after.add_argument("--sample-steps", type=int, default=20)
    after.add_argument("--eval-n", type=int, default=0, help="held-out tasks per level to evaluate after export")
    after.add_argument("--demo-n", type=int, default=d["demo_n"],
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
    from pipelines.pretrain.run import FAMILIES

    family_check = getattr(FAMILIES.get(getattr(args, "family", None)), "check", None)
    if family_check is not None:
        family_check(args)


def run(args: argparse.Namespace) -> None:
    from pipelines.pretrain.run import run as run_pretraining

    check(args)
    run_pretraining(args)
