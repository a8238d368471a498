"""Shallow LoRA (``model.lora.blocks``): the adapter sits on the chosen transformer blocks only, counted over
the block lists in forward order, and a bad choice is one clear line."""

from __future__ import annotations

import re

import pytest
import torch

import pipelines
from flowalign.config import LoraSection
from flowalign.errors import UserError
from flowalign.lora_blocks import transformer_blocks

LORA = {"rank": 4, "alpha": 8}


def adapted_blocks(policy) -> set[str]:
    """The ``<list>.<index>`` blocks holding adapter tensors, and that any adapter tensor lies in a block."""
    names = [n for n, p in policy.transformer.named_parameters() if "lora_" in n]
    assert names and all(p.requires_grad for n, p in policy.transformer.named_parameters() if "lora_" in n)
    blocks = {re.match(r"^(\w*blocks\.\d+)\.", n).group(1) for n in names}
    return blocks


def test_kontext_last_block_is_the_last_single_stream_block(tiny_model_dir):
    folder = tiny_model_dir("kontext")
    full = pipelines.load(folder, lora=LORA)
    order = transformer_blocks(full.transformer)
    assert order[0].startswith("transformer_blocks.") and order[-1].startswith("single_transformer_blocks.")
    assert adapted_blocks(full) == set(order)
    shallow = pipelines.load(folder, lora={**LORA, "blocks": "last:1"})
    assert adapted_blocks(shallow) == {order[-1]}
    first = pipelines.load(folder, lora={**LORA, "blocks": [0]})
    assert adapted_blocks(first) == {order[0]}
    # the same attention projections inside the chosen block as the full adapter puts there
    def in_block(policy, block):
        return {n for n, _ in policy.transformer.named_parameters() if "lora_" in n and n.startswith(block + ".")}
    assert in_block(shallow, order[-1]) == in_block(full, order[-1])


def test_shallow_adapter_trains_saves_and_loads_back(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("kontext")
    lora = {**LORA, "blocks": "last:1"}
    policy = pipelines.load(folder, lora=lora)
    with torch.no_grad():
        for p in policy.transformer.parameters():
            if p.requires_grad:
                p.add_(0.05)
    policy.save_adapter(tmp_path)
    again = pipelines.load(folder, lora=lora)
    again.load_adapter(tmp_path)  # the resume path: copied into an adapter of the same blocks
    saved = {n: p for n, p in policy.transformer.named_parameters() if "lora_" in n}
    loaded = dict(again.transformer.named_parameters())
    assert all(torch.equal(p, loaded[n]) for n, p in saved.items())
    with pytest.raises(UserError, match="targets"):
        pipelines.load(folder, lora=LORA).load_adapter(tmp_path)  # an adapter of every block does not fit


@pytest.mark.parametrize("blocks, needle", [("last:9", "last:N with N from 1 to 2"), ([5], r"indices must lie in \[0, 1\]")])
def test_blocks_beyond_the_model_are_one_line_errors(tiny_model_dir, blocks, needle):
    with pytest.raises(UserError, match=needle) as err:
        pipelines.load(tiny_model_dir("kontext"), lora={**LORA, "blocks": blocks})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("blocks", ["first:2", "last:0", "last:x", [], [1, 1], [-1]])
def test_config_refuses_malformed_blocks(blocks):
    with pytest.raises(ValueError, match="model.lora.blocks|greater than or equal"):
        LoraSection(blocks=blocks)
    assert LoraSection(blocks="last:2").blocks == "last:2" and LoraSection(blocks=[3, 0]).blocks == [3, 0]
