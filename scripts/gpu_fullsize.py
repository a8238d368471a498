"""Full-size architectures on one GPU: one training step of the shipped recipes, timed, with peak memory.

    python scripts/gpu_fullsize.py --out docs/performance_gpu.json [--families sd3 flux wan] [--workdir /tmp/fs]
    python scripts/gpu_fullsize.py --smoke --out /tmp/smoke.json      # the same path, shrunk, on CPU (tests)

For each family it builds the published architecture with random weights (SD3.5-Medium, FLUX.1-dev,
Wan2.1-T2V-1.3B: transformer, VAE and every text encoder at their released sizes; configs below), saves it
as a diffusers folder (bf16 safetensors) and runs the family's recipe (``configs/<model>/flow_grpo_*.yaml``)
on it through ``flowalign.train`` exactly as a user would with the real checkpoint: ``model.path`` is that
folder. The recipe is cut to one optimiser step on one prompt × 4 samples, then the final evaluation samples
one held-out prompt at the recipe's full evaluation step count. Recorded per family: build, save and load
seconds; the step's sampling / reward / update seconds (the trainer's own ``time/*`` logs); the final
evaluation's seconds; and peak GPU memory (``torch.cuda.max_memory_allocated``) from the last step's start
(the trainer resets the peak at every step) through the final evaluation, and the step's own peaks.

Random weights cannot be downloaded and need none: timing and memory depend on shapes, not values. The
tokenizers are the project's offline ones (real CLIP BPE, word-level T5), padded to the released
vocabulary sizes, so sequence lengths and embedding tables are as published.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------------------- architectures

CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              projection_dim=768, hidden_act="quick_gelu")
CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              projection_dim=1280, hidden_act="gelu")
T5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu")
SD3_VAE = dict(block_out_channels=[128, 256, 512, 512], layers_per_block=2, latent_channels=16, norm_num_groups=32,
               use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True)


def _wan_vae() -> dict[str, Any]:
    """Wan 2.1's VAE: ``AutoencoderKLWan``'s own defaults are the released config (latents mean/std included)."""
    from diffusers import AutoencoderKLWan

    params = inspect.signature(AutoencoderKLWan.__init__).parameters
    keys = ("base_dim", "z_dim", "dim_mult", "num_res_blocks", "attn_scales", "temperal_downsample", "latents_mean",
            "latents_std")
    return {k: list(params[k].default) if isinstance(params[k].default, (list, tuple)) else params[k].default
            for k in keys}


def published(family: str) -> dict[str, Any]:
    """``pipelines.tiny.build_tiny(family, **overrides)`` overrides giving the released architecture."""
    if family == "sd3":  # stabilityai/stable-diffusion-3.5-medium
        return dict(height=1024, clip_vocab_size=None, clip_max_length=77, t5_max_length=256,
                    transformer=dict(patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                                     attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                                     caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                                     qk_norm="rms_norm", dual_attention_layers=list(range(13))),
                    vae={**SD3_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609},
                    text_encoder=CLIP_L, text_encoder_2=CLIP_G, text_encoder_3=T5_XXL, scheduler=dict(shift=3.0))
    if family == "flux":  # black-forest-labs/FLUX.1-dev
        return dict(clip_vocab_size=None, clip_max_length=77, t5_max_length=512,
                    transformer=dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                                     attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                     pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=[16, 56, 56]),
                    vae={**SD3_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159},
                    text_encoder=CLIP_L, text_encoder_2=T5_XXL)
    if family == "wan":  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers
        return dict(t5_max_length=512,
                    transformer=dict(patch_size=[1, 2, 2], num_attention_heads=12, attention_head_dim=128,
                                     in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                                     num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                     rope_max_seq_len=1024),
                    vae=_wan_vae(), text_encoder={**T5_XXL, "vocab_size": 256384}, scheduler=dict(shift=3.0))
    raise ValueError(f"family={family!r}: expected sd3, flux or wan")


def smoke(family: str) -> dict[str, Any]:
    """The same code path at the tiny builders' own sizes (CPU, seconds): what the tests run."""
    return {"sd3": dict(height=32), "flux": dict(), "wan": dict()}[family]


RECIPES = {"sd3": "configs/sd3.5-medium/flow_grpo_vvr.yaml", "flux": "configs/flux.1-dev/flow_grpo_vvr.yaml",
           "wan": "configs/wan2.1-1.3b/flow_grpo_motion.yaml"}

#: the recipe's verifier plus a small JPEG-size term: random weights draw nothing a verifier passes, and a
#: group whose rewards are all equal has zero advantages, so the trainer would skip the update being timed
REWARDS = {"sd3": "[{name: vvr, weight: 1.0}, {name: jpeg_compressibility, weight: 0.01}]",
           "flux": "[{name: vvr, weight: 1.0}, {name: jpeg_compressibility, weight: 0.01}]",
           "wan": "[{name: vvr_motion, weight: 1.0}, {name: jpeg_compressibility_video, weight: 0.01}]"}

#: smoke runs sample at the tiny sizes (the full run keeps each recipe's own: SD3.5/FLUX 512 px, Wan 480×832×9)
SMOKE_DEFAULTS = {"sd3": "{height: 32, width: 32}", "flux": "{height: 32, width: 32}",
                  "wan": "{height: 32, width: 32, num_frames: 9}"}

# ------------------------------------------------------------------------------------------- one family


def build_folder(family: str, folder: Path, *, is_smoke: bool, device: str) -> dict[str, float]:
    """Random-init the architecture on ``device`` and save it as a bf16 (smoke: fp32) diffusers folder."""
    from pipelines.tiny import build_tiny, write_sampling_defaults

    t0 = time.perf_counter()
    overrides = smoke(family) if is_smoke else published(family)
    with torch.device(device):  # parameters are created where they will run: no 17B-parameter CPU init
        pipe = build_tiny(family, **overrides)
    if not is_smoke:
        pipe.to(torch.bfloat16)
    t_build = time.perf_counter() - t0
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in pipe.components.items()
              if isinstance(m, torch.nn.Module)}
    if folder.exists():
        shutil.rmtree(folder)
    pipe.save_pretrained(folder, safe_serialization=True)
    if is_smoke:
        from pipelines.tiny import sampling_defaults

        write_sampling_defaults(folder, **sampling_defaults(family))
    del pipe
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"build_s": t_build, "save_s": time.perf_counter() - t0 - t_build,
            "params_m": {k: round(v / 1e6, 1) for k, v in params.items()}}


def recipe_config(family: str, folder: Path, run_dir: Path, *, is_smoke: bool, extra: list[str] = ()):
    """The family's recipe cut to one optimiser step on ``folder`` (``extra``: further overrides, last)."""
    from flowalign.config import load_config

    overrides = [f"model.path={folder}", f"run.output_dir={run_dir}", "run.resume=never", "run.progress=false",
                 "run.tensorboard=false", "trainer.max_steps=1", "trainer.prompts_per_step=1",
                 "trainer.group_size=4", "trainer.batch_size=4", "eval.at_start=false", "eval.every=0", "eval.n=1",
                 "eval.batch_size=1", "eval.gallery=false", "data.n=8", f"rewards={REWARDS[family]}"]
    if is_smoke:
        overrides += ["model.dtype=fp32", f"model.defaults={SMOKE_DEFAULTS[family]}", "trainer.num_steps=2",
                      "eval.num_steps=2", "model.lora.rank=4", "model.lora.alpha=8"]
    return load_config(REPO / RECIPES[family], [*overrides, *extra])


def run_recipe(family: str, folder: Path, run_dir: Path, *, is_smoke: bool, extra: list[str] = ()) -> dict[str, Any]:
    """One optimiser step of the family's recipe on ``folder``, then its final one-prompt evaluation."""
    from flowalign.train import build_trainer

    cfg = recipe_config(family, folder, run_dir, is_smoke=is_smoke, extra=extra)
    shutil.rmtree(run_dir, ignore_errors=True)  # a measurement, never a resumed run
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer = build_trainer(cfg)
    t_load = time.perf_counter() - t0
    t1 = time.perf_counter()
    trainer.train()
    t_train = time.perf_counter() - t1
    step = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"time/step"' in line][-1]
    out = {"load_s": t_load, "sample_s": step["time/sample"], "reward_s": step["time/reward"],
           "update_s": step["time/update"], "step_s": step["time/step"],
           "grad_norm": step.get("train/grad_norm"), "zero_adv_fraction": step.get("zero_adv_fraction"),
           "final_eval_s": t_train - step["time/step"], "eval_num_steps": cfg.eval.num_steps,
           "train_num_steps": cfg.trainer.get("num_steps"), "defaults": dict(trainer.policy.defaults),
           "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
           # the step's own peaks (the trainer logs them per step; the run's peak above covers the evaluation too)
           "step_peak_gib_allocated": step.get("memory/peak_gib_allocated"),
           "step_peak_gib_reserved": step.get("memory/peak_gib_reserved")}
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=["sd3", "flux", "wan"], choices=["sd3", "flux", "wan"])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/flowalign-fullsize"))
    p.add_argument("--out", type=Path, required=True, help="JSON results (rewritten after every family)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU: the same code path, for tests")
    args = p.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU machine, or pass --smoke for the CPU check")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from flowalign.io import atomic_path

    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                               "torch": torch.__version__, "smoke": args.smoke, "families": {}}
    for family in args.families:
        folder = args.workdir / f"{family}-model"
        row: dict[str, Any] = {"recipe": RECIPES[family]}
        try:
            row.update(build_folder(family, folder, is_smoke=args.smoke, device=device))
            row.update(run_recipe(family, folder, args.workdir / f"{family}-run", is_smoke=args.smoke))
        except Exception as err:  # one family failing (e.g. out of memory) must not lose the others' numbers
            row["error"] = f"{type(err).__name__}: {err}"
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # FLUX is 34 GB in bf16: one folder on disk at a time
        results["families"][family] = row
        with atomic_path(args.out) as tmp:  # a killed run leaves the previous families' numbers whole
            tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(json.dumps({family: row}, default=str), flush=True)
    return 1 if any("error" in r for r in results["families"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
