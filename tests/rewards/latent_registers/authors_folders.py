"""What the grid-pool register tests of every family share: the authors' checkpoint folder layout, written from a
flowalign model, and a ``train-reward --architecture grid_pool`` run on a tiny model of the family."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file


def write_register_folder(folder: Path, reward: torch.nn.Module, transformer: torch.nn.Module,
                          config: dict[str, Any], manifest: dict[str, Any]) -> Path:
    """Their ``save_register_checkpoint`` layout: ``register.safetensors`` (the wrapper's state dict, ``model.`` +
    the model's, frozen backbone included), ``config.yaml`` (``config``) and ``manifest.json`` (``manifest``)."""
    folder.mkdir(parents=True)
    state = {f"model.{k}": v for k, v in reward.state_dict().items()}
    state.update({f"model.backbone.transformer.{k}": v for k, v in transformer.state_dict().items()})
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "register.safetensors"))
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def train_grid_pool(model: Path, tmp_path: Path) -> tuple[Any, dict[str, Any], Path, list[str], torch.Tensor]:
    """``train-reward --architecture grid_pool`` with 4 registers for 3 steps on 8 pairs of random latents of the
    policy at ``model`` (the rejected one the chosen's negative); returns ``(policy, config.json, the folder,
    prompts, chosen latents)`` after checking the command succeeded."""
    import pipelines
    from flowalign.cli.main import main
    from flowalign.trainers.parts.latent_preference import PreferencePairs

    policy = pipelines.load(model)
    gen = torch.Generator().manual_seed(0)
    prompts = [f"prompt {i}" for i in range(8)]
    chosen = torch.randn(8, *policy.latent_shape, generator=gen)
    PreferencePairs(prompts=prompts, chosen=chosen, rejected=-chosen).save(tmp_path / "pairs.safetensors")
    out = tmp_path / "grid"
    code = main(["train-reward", "--model", str(model), "--pairs", str(tmp_path / "pairs.safetensors"), "--out",
                 str(out), "--architecture", "grid_pool", "--registers", "4", "--train-steps", "3", "--batch-size",
                 "4", "--test-fraction", "0.25", "--no-progress"])
    assert code == 0
    return policy, json.loads((out / "config.json").read_text()), out, prompts, chosen
