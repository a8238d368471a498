"""``flowalign sample``: one prompt → a PNG (image models) or an MP4/GIF (video models)."""

from __future__ import annotations

import argparse
from pathlib import Path

from flowalign.cli.common import (add_choice, add_guide_args, add_model_args, add_number, add_sampling_args,
                                  check_positive, load_guided_policy)
from flowalign.errors import UserError
from flowalign.limits import MAX_SEED


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("sample", help="sample one prompt to an image or video file")
    add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--switch", nargs=2, action="append", default=None, metavar=("FRAME", "PROMPT"),
                   help="a streaming model that switches prompts (LongLive): from the first chunk starting at or "
                        "after latent frame FRAME, follow PROMPT; repeat for more switches")
    add_sampling_args(p)
    add_choice(p, "--sampler", default="ode", choices=sampler_kinds)
    # trainers' noise_level is at most 2 too: a larger SDE noise leaves the data's range within a step
    add_number(p, "--noise-level", type=float, lo=0, hi=2, default=None, help="a for flow_grpo, eta for cps/dance")
    add_number(p, "--seed", type=int, lo=0, hi=MAX_SEED, default=0)
    p.add_argument("--image", default=None, metavar="PATH",
                   help="input image of an editing (FLUX.1 Kontext, Qwen-Image-Edit) or image-to-video model")
    p.add_argument("--out", required=True, help="output file: .png for images, .mp4 or .gif for videos")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    add_guide_args(p)
    return p


def switch_args(pairs: list[list[str]] | None) -> list[tuple[int, str]]:
    """``--switch FRAME PROMPT`` pairs as ``(frame, prompt)``, refused in one line when FRAME is not a whole
    number or PROMPT is too long."""
    from flowalign.data import check_prompt_length

    out = []
    for frame, prompt in pairs or []:
        if not frame.isdigit():
            raise UserError(f"--switch {frame} {prompt!r}: FRAME is a latent frame index (a whole number), then "
                            "the prompt")
        check_prompt_length(prompt, "--switch")
        out.append((int(frame), prompt))
    return out


def sampler_kinds() -> list[str]:
    from flowalign.sampling import SAMPLER_KINDS  # the sampling package imports torch

    return list(SAMPLER_KINDS)


def run(args: argparse.Namespace) -> None:
    import torch

    from flowalign.data import check_prompt_length
    from flowalign.io import check_out_file
    from flowalign.media import IMAGE_SUFFIXES, VIDEO_SUFFIXES, open_image, save_image, save_video
    from flowalign.sampling import check_sampler, rollout, stream_rollout

    out = Path(args.out)
    suffix = out.suffix.lower()
    if suffix not in IMAGE_SUFFIXES + VIDEO_SUFFIXES:
        raise UserError(f"--out {out.name}: unknown file type; use .png for image models, .mp4/.gif for video models")
    check_out_file(out, overwrite=args.overwrite)  # before the model is loaded
    check_prompt_length(args.prompt, "--prompt")
    switches = switch_args(args.switch)
    check_sampler(args.sampler, args.noise_level)
    check_positive(args, "steps")
    if args.image is not None:  # refused from its header (not an image, too many pixels) before a model loads
        open_image(args.image, "--image").close()
    policy, guide = load_guided_policy(args)
    if policy.is_video and suffix in IMAGE_SUFFIXES:
        raise UserError(f"--out {out.name}: {policy.family} is a video model; write .mp4 or .gif")
    if not policy.is_video and suffix in VIDEO_SUFFIXES:
        raise UserError(f"--out {out.name}: {policy.family} is an image model; write .png")
    if args.image is not None and not getattr(policy, "input_images", False):
        raise UserError(f"--image: {policy.family} models take no input image; drop --image or use an editing / "
                        "image-to-video model")
    if args.image is not None and not Path(args.image).is_file():
        raise UserError(f"--image {args.image}: no such file; give a PNG or JPEG")
    steps = args.steps or int(policy.defaults.get("num_steps", 20))
    generator = torch.Generator().manual_seed(args.seed)
    if getattr(policy, "streaming", False):  # chunk by chunk through its KV cache, as evaluation samples it
        if guide is not None:
            raise UserError(f"--guide: {policy.family} streams chunk by chunk; latent-reward guidance steers a whole "
                            "rollout: drop --guide")
        result = stream_rollout(policy, [args.prompt], num_steps=steps, sampler=args.sampler,
                                noise_level=args.noise_level, guidance_scale=args.guidance, generator=generator,
                                switches=[(frame, [prompt]) for frame, prompt in switches], keep_caches=())
    else:
        if switches:
            raise UserError(f"--switch: {policy.family} samples a whole video at once; prompt switches need a "
                            "streaming model (a causal Wan: LongLive, Self-Forcing)")
        result = rollout(policy, [args.prompt], num_steps=steps, sampler=args.sampler, noise_level=args.noise_level,
                         guidance_scale=args.guidance, generator=generator, guide=guide,
                         metadata=[{"image": args.image}] if args.image is not None else None)
    sample = result.samples[0]
    # again: a file that appeared at --out while the model sampled (another process's) is not replaced unasked
    check_out_file(out, overwrite=args.overwrite)
    written = save_video(sample, out) if policy.is_video else save_image(sample, out)
    print(f"wrote {written}")
