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

Several LoRA runs of one model merge into one folder, each adapter fused with its ``--scale`` (the weights
become ``W + Σ_i s_i·ΔW_i``): AR-CoPO's final model is its semi-on-policy run plus 0.8 × its on-policy run
(``docs/methods/ar_copo.md``):

    python scripts/export_run.py --model MODEL --run runs/semi --run runs/on_policy --scale 1 0.8 --out merged
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


def export(model: Path, run: Path | list[Path], out: Path, *, ema: bool, overwrite: bool,
           scales: list[float] | None = None) -> Path:
    """Load ``model`` with ``run``'s weights (fused when a LoRA) and save it as a diffusers folder ``out``; with
    several runs (LoRA adapters of ``model``), each adapter fused in turn with its ``scales`` entry (default 1).
    Returns the (first) checkpoint folder read."""
    from flowalign.cli.common import load_ema_weights, load_policy
    from flowalign.io import atomic_dir, check_out_dir
    from flowalign.saved_weights import load_adapter_checked
    from pipelines import lora as lora_utils

    runs = [run] if isinstance(run, Path) else list(run)
    scales = [1.0] * len(runs) if scales is None else list(scales)
    if len(scales) != len(runs):
        raise UserError(f"--scale: {len(scales)} value(s) for {len(runs)} --run folder(s); give one per --run")
    check_out_dir(out, writer=WRITER, overwrite=overwrite)
    folders = [checkpoint_of(r) for r in runs]
    policy = load_policy(argparse.Namespace(model=str(model), adapter=str(folders[0]), ema=ema, device="cpu",
                                            dtype="fp32"))
    for i, (folder, scale) in enumerate(zip(folders, scales)):
        if i:
            load_adapter_checked(policy, folder, "--run")
            if ema:
                load_ema_weights(policy, folder)
        if not lora_utils.has_adapter(policy.transformer):
            if len(runs) > 1 or scale != 1.0:
                raise UserError(f"--run {runs[i]}: a full fine-tune's weights are not a LoRA delta; --scale and "
                                "several --run merge LoRA runs only")
            continue
        # W ← W + scale·ΔW, then the adapter goes: the next run's delta lands on these weights
        policy.pipe.fuse_lora(lora_scale=scale)
        policy.pipe.unload_lora_weights()
    folder = folders[0]
    with atomic_dir(out, writer=WRITER, overwrite=overwrite) as tmp:
        policy.pipe.save_pretrained(tmp)
        if (model / "flowalign.json").is_file():
            shutil.copy(model / "flowalign.json", tmp / "flowalign.json")
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the model folder the run trained from (its model.path)")
    p.add_argument("--run", required=True, action="append", type=Path,
                   help="a run folder (newest checkpoint) or a checkpoints/step-XXXXXX folder; several LoRA runs of "
                        "the model merge (each fused with its --scale)")
    p.add_argument("--scale", nargs="+", type=float, default=None,
                   help="one factor per --run for its LoRA delta (default 1 each), e.g. --scale 1 0.8")
    p.add_argument("--out", required=True, help="the diffusers folder to write")
    p.add_argument("--ema", action="store_true", help="the checkpoint's EMA weights (what the run evaluates)")
    p.add_argument("--overwrite", action="store_true", help="write into a folder this script did not write")
    args = p.parse_args(argv)
    try:
        folder = export(Path(args.model), args.run, Path(args.out), ema=args.ema, overwrite=args.overwrite,
                        scales=args.scale)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} from {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
