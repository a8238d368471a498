"""Saved weights read into a live policy: a LoRA adapter, or a checkpoint's trainable tensors (a LoRA or a
full fine-tune), checked first so a damaged or foreign folder is one line naming it.

The command line (``--adapter``) and trainers that start from other runs' weights (Flow-OPD's teachers)
both read weights this way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flowalign.errors import UserError


def load_adapter_checked(policy: Any, path: Path, source: str = "--adapter") -> None:
    """:func:`load_weights`, with a damaged checkpoint or unreadable file reported in one line naming
    ``source`` (the flag or config field that gave ``path``)."""
    from flowalign.checkpoint_manifest import MANIFEST, damage

    if path.is_dir() and (path / MANIFEST).is_file() and (reason := damage(path)):
        raise UserError(f"{source} {path}: the checkpoint is damaged ({reason}); use another checkpoint")
    try:
        load_weights(policy, path, source)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors, peft and diffusers each raise their own kinds
        first = (str(e).splitlines() or [""])[0][:160]
        raise UserError(f"{source} {path}: cannot read its weights ({type(e).__name__}: {first}); it is damaged "
                        "or not an adapter; give a folder written by training or save_adapter") from None


def load_weights(policy: Any, folder: Path, source: str = "--adapter") -> None:
    """A LoRA adapter (a saved adapter or a LoRA checkpoint), or a full fine-tune's checkpoint."""
    full = folder / "trainable.safetensors"
    if full.exists() and not any(folder.glob("*lora*.safetensors")):
        refuse_lora_without_its_file(folder, full, source)
        from safetensors.torch import load_file

        from flowalign.checkpoint import weight_names

        state = load_file(str(full))
        state = {k: state[k] for k in weight_names(state)}
        _, unexpected = policy.trainable.load_state_dict(state, strict=False)
        if unexpected or len(state) == 0:
            raise UserError(f"{source} {folder}: its weights do not match this model ({len(unexpected)} unknown tensors)")
        return
    policy.load_adapter(folder)


def refuse_lora_without_its_file(folder: Path, full: Path, source: str = "--adapter") -> None:
    """A LoRA run's checkpoint keeps the adapter in its own file; without it the exact trainable tensors
    cannot be matched to a model that has no LoRA layers."""
    from safetensors import safe_open

    with safe_open(str(full), "pt") as f:
        lora = any("lora_" in k for k in f.keys())
    if lora:
        raise UserError(f"{source} {folder}: this LoRA checkpoint is missing its LoRA file "
                        "(pytorch_lora_weights.safetensors); restore it, or use another checkpoint")


def read_torch_file(path: Path, *, trust_pickle: bool, what: str) -> Any:
    """A ``torch.save`` file from elsewhere (an authors' release), read as tensors and plain values only unless
    ``trust_pickle`` (a pickle can run code: only for a file you trust); a missing or unreadable file is one
    line naming ``what`` it should be."""
    import pickle

    import torch

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file; give {what}")
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except (pickle.UnpicklingError, EOFError, RuntimeError) as e:
        why = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        if trust_pickle:
            raise UserError(f"{path}: not a torch checkpoint ({why})") from e
        raise UserError(f"{path}: not a checkpoint of tensors and plain values ({why}); if it is one you trust "
                        "that holds more, add --trust-pickle") from e
