"""Which layers a shallow LoRA adapts: ``model.lora.blocks`` names blocks of the transformer, and the adapter's
targets become the matching modules inside them (read by the policies when they add the adapter and by
``plan`` when it sizes one)."""

from __future__ import annotations

import torch

from flowalign.errors import UserError


def transformer_blocks(transformer: torch.nn.Module) -> list[str]:
    """Module names of the transformer's blocks in forward order: the items of its child ``ModuleList``s
    whose names end in ``blocks`` (SD3, Wan: ``transformer_blocks`` / ``blocks``; FLUX: the double-stream
    ``transformer_blocks`` then the ``single_transformer_blocks``), in the order the model registers them."""
    return [f"{name}.{i}" for name, child in transformer.named_children()
            if isinstance(child, torch.nn.ModuleList) and name.endswith("blocks") for i in range(len(child))]


def selected_blocks(blocks: list[str], spec: str | list[int]) -> list[str]:
    """The blocks ``model.lora.blocks`` names: ``"last:N"`` or a list of indices into ``blocks``."""
    n = len(blocks)
    if isinstance(spec, str):
        count = spec.removeprefix("last:")
        if not spec.startswith("last:") or not count.isdigit() or not 1 <= int(count) <= n:
            raise UserError(f"model.lora.blocks {spec!r}: write last:N with N from 1 to {n} (this model's blocks)")
        return blocks[n - int(count):]
    bad = [i for i in spec if not 0 <= int(i) < n]
    if not spec or bad:
        raise UserError(f"model.lora.blocks {list(spec)}: indices must lie in [0, {n - 1}] (this model has {n} blocks)")
    return [blocks[int(i)] for i in sorted(set(spec))]


def block_targets(transformer: torch.nn.Module, targets: list[str], blocks: str | list[int] | None) -> list[str]:
    """``targets`` (module-name suffixes) as they are, or with ``blocks`` (shallow LoRA) the full names of the
    matching modules inside the selected blocks only (peft matches a full name exactly)."""
    if blocks is None:
        return targets
    chosen = selected_blocks(transformer_blocks(transformer), blocks)
    names = [name for name, _ in transformer.named_modules()
             if any(name.startswith(b + ".") for b in chosen) and any(name == t or name.endswith("." + t) for t in targets)]
    if not names:
        raise UserError(f"model.lora.blocks {blocks}: no module of lora.target_modules {targets} lies in blocks {chosen}")
    return names
