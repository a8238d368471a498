"""``flowalign causal-wan``: an authors' generator checkpoint (their names) over a base Wan folder becomes a folder
that loads as the streaming policy with the same weights; LongLive's LoRA merged as peft merges it."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch

import pipelines
from flowalign.cli.main import main
from flowalign.errors import UserError
from pipelines.causal_wan import CausalWanPolicy, convert_generator
from pipelines.causal_wan_checkpoint import convert_checkpoint
from pipelines.tiny import save_tiny
from tests.pipelines.test_causal_wan import authors_weights

TINY_TRANSFORMER = {"attention_head_dim": 16, "ffn_dim": 64, "freq_dim": 32, "text_dim": 16}


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A tiny Wan 2.1 folder whose transformer has the known answers' sizes."""
    folder = tmp_path / "wan"
    save_tiny("wan", folder, transformer=TINY_TRANSFORMER)
    return folder


def test_the_converted_folder_streams_the_checkpoints_weights(tmp_path: Path, base: Path) -> None:
    ckpt = tmp_path / "self_forcing_dmd.pt"
    weights = authors_weights()
    torch.save({"generator": weights, "generator_ema": {k: v + 1 for k, v in weights.items()}}, ckpt)
    assert main(["causal-wan", str(ckpt), "--wan", str(base), "--out", str(tmp_path / "sf")]) in (0, None)
    policy = pipelines.load(tmp_path / "sf")
    assert isinstance(policy, CausalWanPolicy) and policy.window is None
    expected = convert_generator(weights)
    got = policy.transformer.state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    conversion = json.loads((tmp_path / "sf" / "conversion.json").read_text())
    assert conversion["generator"]["file"] == "self_forcing_dmd.pt" and not conversion["generator"]["ema"]
    # --ema takes generator_ema; the window settings reach the policy
    convert_checkpoint(ckpt, base, tmp_path / "ema", ema=True, attention_window=12, sink_frames=3)
    ema = pipelines.load(tmp_path / "ema")
    assert (ema.window, ema.sink) == (12, 3)
    key = "blocks.0.attn1.to_q.weight"
    assert torch.equal(ema.transformer.state_dict()[key], expected[key] + 1)


class _Attention(torch.nn.Module):
    def __init__(self, q: torch.Tensor) -> None:
        super().__init__()
        self.q = torch.nn.Linear(q.shape[1], q.shape[0])
        self.q.weight.data.copy_(q)


def test_longlives_lora_is_merged_as_peft_merges_it(tmp_path: Path, base: Path) -> None:
    """Their LoRA (peft over their generator, saved under generator_lora) merged into the weights equals peft's
    own ``merge_and_unload`` of the same adapter."""
    weights = authors_weights()
    ckpt, lora_file = tmp_path / "longlive_base.pt", tmp_path / "lora.pt"
    torch.save({"generator": weights}, ckpt)
    g = torch.Generator().manual_seed(5)
    lora = {"base_model.model.blocks.0.self_attn.q.lora_A.weight": torch.randn(4, 32, generator=g),
            "base_model.model.blocks.0.self_attn.q.lora_B.weight": torch.randn(32, 4, generator=g)}
    torch.save({"generator_lora": lora}, lora_file)
    convert_checkpoint(ckpt, base, tmp_path / "ll", lora=lora_file, lora_alpha=8.0)
    merged = pipelines.load(tmp_path / "ll").transformer.state_dict()["blocks.0.attn1.to_q.weight"]

    module = torch.nn.Module()
    module.blocks = torch.nn.ModuleList([torch.nn.Module()])
    module.blocks[0].self_attn = _Attention(weights["model.blocks.0.self_attn.q.weight"])
    model = peft.get_peft_model(module, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q"]))
    peft.set_peft_model_state_dict(model, lora)
    reference = model.merge_and_unload().blocks[0].self_attn.q.weight
    assert torch.allclose(merged, reference, atol=1e-6)
    assert not torch.allclose(merged, weights["model.blocks.0.self_attn.q.weight"], atol=1e-3)


def test_foreign_checkpoints_are_refused_in_one_line(tmp_path: Path, base: Path) -> None:
    ckpt = tmp_path / "g.pt"
    torch.save({"generator": authors_weights()}, ckpt)
    with pytest.raises(UserError, match="no 'generator_ema' weights"):
        convert_checkpoint(ckpt, base, tmp_path / "a", ema=True)
    wide = tmp_path / "wide"
    save_tiny("wan", wide)  # the tiny twin's own widths, not the generator's
    with pytest.raises(UserError, match="does not fit the transformer"):
        convert_checkpoint(ckpt, wide, tmp_path / "b")
    with pytest.raises(UserError, match="no such file"):
        convert_checkpoint(tmp_path / "missing.pt", base, tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
