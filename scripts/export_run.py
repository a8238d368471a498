"""Write a training run's weights as a diffusers model folder: the ``model.path`` a next stage starts from.

    python scripts/export_run.py --model assets/tiny-kontext-sr --run runs/oars_1_coldstart \
        --out runs/oars_1_coldstart/model --ema

A recipe starts from a model folder (``model.path``), not from another run, so a staged method (OARS:
``docs/methods/oars.md``) hands each stage's result to the next as a folder. ``--run`` is a run folder (its
newest checkpoint that verifies) or one ``checkpoints/step-XXXXXX`` folder; ``--model`` the folder that run
trained from. A LoRA checkpoint is fused into the transformer (the next stage trains a fresh adapter on the
merged weights), a full fine-tune's tensors are loaded; ``--ema`` takes the checkpoint's EMA weights (what
the run evaluates). The folder gets the model's ``flowalign.json`` (sampling defaults), opens with
``pipelines.load`` and diffusers' ``from_pretrained``, and is written atomically; a folder this script did not
write is refused unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from flowalign.errors import UserError  # noqa: E402

WRITER = "export_run"


def checkpoint_of(run: Path) -> Path:
    """``run`` itself if it is a checkpoint folder, else the run's newest checkpoint that verifies."""
    if not run.is_dir():
        raise UserError(f"--run {run}: no such folder; give a run folder or its checkpoints/step-XXXXXX")
    from flowalign.checkpoint_manifest import resolve_checkpoint

    newest = resolve_checkpoint(run)
    if newest is None:
        raise UserError(f"--run {run}: the run has no whole checkpoint yet; train it first")
    return newest


def export(model: Path, run: Path, out: Path, *, ema: bool, overwrite: bool) -> Path:
    """Load ``model`` with ``run``'s weights (fused when a LoRA) and save it as a diffusers folder ``out``."""
    from flowalign.cli.common import load_policy
    from flowalign.io import atomic_dir, check_out_dir
    from pipelines import lora as lora_utils

    check_out_dir(out, writer=WRITER, overwrite=overwrite)
    folder = checkpoint_of(run)
    policy = load_policy(argparse.Namespace(model=str(model), adapter=str(folder), ema=ema, device="cpu",
                                            dtype="fp32"))
    if lora_utils.has_adapter(policy.transformer):
        policy.pipe.fuse_lora()
        policy.pipe.unload_lora_weights()
    with atomic_dir(out, writer=WRITER, overwrite=overwrite) as tmp:
        policy.pipe.save_pretrained(tmp)
        if (model / "flowalign.json").is_file():
            shutil.copy(model / "flowalign.json", tmp / "flowalign.json")
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the model folder the run trained from (its model.path)")
    p.add_argument("--run", required=True, help="a run folder (newest checkpoint) or a checkpoints/step-XXXXXX folder")
    p.add_argument("--out", required=True, help="the diffusers folder to write")
    p.add_argument("--ema", action="store_true", help="the checkpoint's EMA weights (what the run evaluates)")
    p.add_argument("--overwrite", action="store_true", help="write into a folder this script did not write")
    args = p.parse_args(argv)
    try:
        folder = export(Path(args.model), Path(args.run), Path(args.out), ema=args.ema, overwrite=args.overwrite)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} from {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
