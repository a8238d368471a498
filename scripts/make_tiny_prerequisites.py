"""Build the shipped prerequisites of the tiny configs that need more than the embedded model.

    python scripts/make_tiny_prerequisites.py teachers        # assets/tiny-sd3-vvr-teachers/{counting,spatial}
    python scripts/make_tiny_prerequisites.py latent-reward   # assets/tiny-sd3-vvr-latent-reward
    python scripts/make_tiny_prerequisites.py rewards         # assets/tiny-rewards/<name>

- ``teachers`` (``configs/tiny/flow_opd_vvr.yaml``): the two stage-1 LoRA teachers, each a short run of its
  stage-1 recipe (``configs/tiny/flow_grpo_vvr.yaml``, ``configs/tiny/mix_grpo_vvr.yaml``) without evaluation;
  the EMA weights of the last checkpoint (what those runs evaluate) are saved as an adapter.
- ``latent-reward`` (``configs/tiny/rg_opd_vvr.yaml``, ``core_vvr.yaml``): ``flowalign train-reward`` on a
  smaller pair set than its defaults, with the pairs kept (CoRe's real set).
- ``rewards`` (the ``flow_grpo_<reward>`` tiny configs): ``flowalign tiny-reward``'s random folders.

Run from the repository root; the runs go under ``runs/tiny-prerequisites/``. Each asset's README.md records
the numbers of the build it ships. An existing asset folder is replaced only with ``--overwrite``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = "assets/tiny-sd3-vvr"
WORK = Path("runs/tiny-prerequisites")

#: teacher name -> its stage-1 recipe
TEACHERS = {"counting": "configs/tiny/flow_grpo_vvr.yaml", "spatial": "configs/tiny/mix_grpo_vvr.yaml"}
TEACHER_STEPS = 10
#: the tiny reward folders the configs load (flowalign tiny-reward NAME)
REWARDS = ("geneval", "hpsv3", "imagereward", "unified_reward", "videoalign")


def flowalign(*args: str) -> None:
    cmd = [sys.executable, "-m", "flowalign", *args]
    print("+", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def fresh(out: Path, overwrite: bool) -> None:
    if out.exists():
        if not overwrite:
            sys.exit(f"{out} exists; pass --overwrite to rebuild it")
        shutil.rmtree(out)


def teachers(out: Path, overwrite: bool) -> None:
    """Train each stage-1 recipe briefly, then save its last checkpoint's EMA weights as an adapter."""
    import pipelines
    from flowalign.checkpoint_manifest import resume_folder
    from flowalign.cli.common import load_adapter_checked, load_ema_weights
    from flowalign.config import load_config

    for name, recipe in TEACHERS.items():
        run = WORK / Path(recipe).stem
        flowalign("train", recipe, f"run.output_dir={run}", f"trainer.max_steps={TEACHER_STEPS}",
                  "trainer.max_minutes=null", f"run.checkpoint_every={TEACHER_STEPS}", "eval.bench=null",
                  "run.progress=false", "run.tensorboard=false")
        ckpt = resume_folder(REPO / run, "auto", main=False)
        # the adapter as training built it (same rank, alpha and parameter names), then its weights read in
        policy = pipelines.load(REPO / MODEL, lora=load_config(REPO / recipe).model.lora.model_dump())
        load_adapter_checked(policy, ckpt)
        load_ema_weights(policy, ckpt)
        fresh(out / name, overwrite)
        policy.save_adapter(out / name)
        print(f"wrote the {name} teacher ({recipe}, {ckpt.name}, EMA) to {out / name}", flush=True)


def latent_reward(out: Path, overwrite: bool) -> None:
    fresh(out, overwrite)
    flowalign("train-reward", "--model", MODEL, "--bench", "vvr", "--level", "medium", "--n", "64",
              "--train-steps", "300", "--no-progress", "--out", str(out))


def rewards(out: Path, overwrite: bool) -> None:
    for name in REWARDS:
        fresh(out / name, overwrite)
        flowalign("tiny-reward", name, "--out", str(out / name))


BUILDERS = {"teachers": (teachers, "assets/tiny-sd3-vvr-teachers"),
            "latent-reward": (latent_reward, "assets/tiny-sd3-vvr-latent-reward"),
            "rewards": (rewards, "assets/tiny-rewards")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=sorted(BUILDERS))
    p.add_argument("--out", help="folder to write (default: the asset folder the configs name)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    args = p.parse_args()
    build, default = BUILDERS[args.what]
    build(Path(args.out or REPO / default), args.overwrite)


if __name__ == "__main__":
    main()
