"""A causal Wan generator's released checkpoint (Self-Forcing's ``self_forcing_dmd.pt``, LongLive's
``longlive_base.pt`` with its ``lora.pt``, Causal-Forcing's) as a folder :mod:`pipelines.causal_wan` loads.

Their checkpoints hold the generator alone, in their ``CausalWanModel``'s names (Wan's original ones, under
``model.``), as ``{"generator": ..., "generator_ema": ...}`` or ``{"model": ...}``, as their inference script
reads them. The folder is the base Wan 2.1-T2V-1.3B diffusers folder (its UMT5, VAE, tokenizer and scheduler,
hard-linked where the file system allows, copied otherwise) with the generator as ``transformer/``
(diffusers' own Wan conversion, :func:`pipelines.causal_wan.convert_generator`), ``model_index.json`` marked
causal and the authors' inference settings in ``flowalign.json``.

LongLive's LoRA (peft, rank 256 and α 256 over every linear layer of the attention blocks, saved with
``get_peft_model_state_dict``, optionally under ``generator_lora``) is merged into the weights:
``W + (α / r)·B·A``, what peft's ``merge_and_unload`` computes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from flowalign.errors import UserError
from flowalign.families import SIZE_KEYS
from flowalign.io import atomic_dir
from flowalign.manifest import sha256_file
from flowalign.saved_weights import read_torch_file
from pipelines._common import sampling_defaults
from pipelines.causal_wan import MARKER, MARKER_KEY, convert_generator
from pipelines.tiny import SAMPLING_DEFAULTS_FILE

WRITER = "causal-wan"
#: the components taken from the base Wan folder as they are
BASE_PARTS = ("text_encoder", "tokenizer", "vae", "scheduler")


def generator_state(saved: Any, *, ema: bool, source: Path) -> dict[str, torch.Tensor]:
    """The generator's tensors of a loaded checkpoint, as their inference script picks them (``generator_ema``
    with ``ema``, else ``generator``, else ``model``; FSDP's wrapper prefix dropped)."""
    if not isinstance(saved, dict):
        raise UserError(f"{source}: not a generator checkpoint (a dict of tensors)")
    key = "generator_ema" if ema else "generator"
    if key in saved:
        state = saved[key]
    elif "model" in saved and not ema:
        state = saved["model"]
    elif any(str(k).startswith(("blocks.", "model.blocks.")) for k in saved):
        state = saved
    else:
        found = ", ".join(sorted(str(k) for k in saved)[:5])
        raise UserError(f"{source}: no {key!r} weights (it holds {found}); "
                        + ("drop --ema" if ema else "add --ema if it holds only the EMA generator"))
    return {k.replace("_fsdp_wrapped_module.", ""): v for k, v in state.items()}


def merge_lora(state: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], alpha: float | None,
               source: Path) -> int:
    """Add ``(α / r)·B·A`` of every LoRA pair in ``lora`` (peft's names over their generator) to ``state`` in
    place; ``alpha`` None: α = r (LongLive's release). Returns the number of layers merged."""
    names = {k: k.replace("_fsdp_wrapped_module.", "") for k in lora}
    merged = 0
    for key, clean in names.items():
        if not clean.endswith(".lora_A.weight"):
            continue
        stem = clean[:-len(".lora_A.weight")]
        base = stem.split("base_model.model.", 1)[-1]
        target = next((n for n in (f"model.{base}.weight", f"{base}.weight") if n in state), None)
        b = next((lora[k] for k, c in names.items() if c == f"{stem}.lora_B.weight"), None)
        if target is None or b is None:
            raise UserError(f"{source}: LoRA layer {base!r} has no {'lora_B' if b is None else 'base weight'} to "
                            "merge with; give the LoRA saved with this generator")
        a = lora[key].float()
        scale = (float(alpha) if alpha is not None else a.shape[0]) / a.shape[0]
        state[target] = (state[target].float() + scale * (b.float() @ a)).to(state[target].dtype)
        merged += 1
    if not merged:
        raise UserError(f"{source}: no LoRA layers (lora_A / lora_B weights) in it")
    return merged


def link_or_copy(src: str, dst: str) -> None:
    """A hard link where the file system allows one (the base model's files are never written), a copy else."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def convert_checkpoint(checkpoint: Path, base: Path, out_dir: Path, *, ema: bool = False, lora: Path | None = None,
                       lora_alpha: float | None = None, attention_window: int | None = None, sink_frames: int = 0,
                       overwrite: bool = False, trust_pickle: bool = False) -> Path:
    """Write the folder (see the module docstring) of ``checkpoint`` over the base Wan folder ``base`` into
    ``out_dir`` atomically; ``attention_window`` / ``sink_frames`` (LongLive: 12 and 3) go to ``flowalign.json``."""
    from diffusers import WanTransformer3DModel

    from flowalign.families import read_index

    checkpoint, base = Path(checkpoint), Path(base)
    index = read_index(base)
    if index.get("_class_name") != "WanPipeline" or not (base / "transformer" / "config.json").is_file():
        raise UserError(f"--wan {base}: not a Wan text-to-video diffusers folder (model_index.json names "
                        f"{index.get('_class_name')!r}); give Wan2.1-T2V-1.3B-Diffusers")
    missing = [p for p in BASE_PARTS if not (base / p).is_dir()]
    if missing:
        raise UserError(f"--wan {base}: it has no {', '.join(missing)}; give the whole Wan2.1-T2V-1.3B-Diffusers folder")
    what = "the generator checkpoint (self_forcing_dmd.pt, longlive_base.pt, ...)"
    state = generator_state(read_torch_file(checkpoint, trust_pickle=trust_pickle, what=what), ema=ema,
                            source=checkpoint)
    sources = {"generator": {"file": checkpoint.name, "sha256": sha256_file(checkpoint), "ema": ema}}
    if lora is not None:
        saved = read_torch_file(Path(lora), trust_pickle=trust_pickle, what="LongLive's lora.pt")
        saved = saved.get("generator_lora", saved) if isinstance(saved, dict) else saved
        layers = merge_lora(state, saved, lora_alpha, Path(lora))
        sources["lora"] = {"file": Path(lora).name, "sha256": sha256_file(Path(lora)), "layers": layers,
                           "alpha": lora_alpha}
    with torch.device("meta"):  # names and shapes checked without allocating the model
        transformer = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(base / "transformer"))
    converted = convert_generator(state)
    try:
        transformer.load_state_dict(converted, strict=True, assign=True)
    except RuntimeError as e:
        first = str(e).splitlines()[0][:160]
        raise UserError(f"{checkpoint}: its generator does not fit the transformer of --wan {base} ({first}); "
                        "give the Wan folder the generator was trained from (Wan2.1-T2V-1.3B)") from None
    # the base folder's own sampling sizes (a flowalign.json beside it), else the policy's (480 x 832, 81 frames)
    sizes = {k: v for k, v in sampling_defaults(base).items() if k in SIZE_KEYS}
    defaults = {**sizes, "num_steps": 4, "guidance_scale": 1.0, "shift": 5.0, "chunk_frames": 3,
                "attention_window": attention_window, "sink_frames": sink_frames}
    with atomic_dir(Path(out_dir), writer=WRITER, overwrite=overwrite) as tmp:
        for part in BASE_PARTS:
            shutil.copytree(base / part, tmp / part, copy_function=link_or_copy)
        # the checkpoint's tensors as they are (dtype included), under the config they were checked against
        (tmp / "transformer").mkdir()
        transformer.save_config(tmp / "transformer")
        save_file({k: v.contiguous() for k, v in converted.items()},
                  str(tmp / "transformer" / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
        (tmp / "model_index.json").write_text(json.dumps({**index, MARKER_KEY: MARKER}, indent=2) + "\n")
        (tmp / SAMPLING_DEFAULTS_FILE).write_text(json.dumps(defaults, indent=2) + "\n")
        (tmp / "conversion.json").write_text(json.dumps(sources, indent=2) + "\n")
    return Path(out_dir)
