"""``flowalign pretrain-tiny kontext``: the T5 vocabulary extension, the training loss fed exactly as the
policy samples, and a seconds-long run end to end (rendered edit pairs, a falling loss, an export that
diffusers and ``pipelines.load`` read and that ``flowalign evaluate --bench vvr_edit`` scores)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from diffusers import FluxKontextPipeline
from transformers import CLIPTextModel, T5EncoderModel, T5Tokenizer

import pipelines
from flowalign.cli.main import main
from flowalign.paths import assets_dir
from flowalign.protocols import Conditioning
from pipelines._common import pack_2x2
from pipelines.pretrain import kontext
from pipelines.pretrain.stage import losses

SD3 = assets_dir() / "tiny-sd3-vvr"
INSTRUCTIONS = ["make the red circle blue", "move the green square to the left of the blue star",
                "remove the yellow triangle", "add a purple circle above the red square"]


def test_t5_vocabulary_gains_the_instruction_words_and_keeps_its_old_ids():
    tok = T5Tokenizer.from_pretrained(SD3 / "tokenizer_3")
    t5 = T5EncoderModel.from_pretrained(SD3 / "text_encoder_3")
    old_rows = t5.get_input_embeddings().weight.detach().clone()
    old_prompt = "a red circle is to the left of a blue square"
    assert len(tok("make").input_ids) > 2  # spelt in character pieces before: not a word of its vocabulary
    extended = kontext.extend_t5(tok, t5, sorted({w for p in INSTRUCTIONS for w in p.split()}))
    assert extended("make").input_ids[1:] == [extended.eos_token_id]  # now one piece, then </s>
    assert extended(old_prompt).input_ids == tok(old_prompt).input_ids
    rows = t5.get_input_embeddings().weight
    assert len(rows) == len(extended) and t5.config.vocab_size == len(extended) > len(old_rows)
    assert torch.equal(rows[: len(old_rows)], old_rows)
    new = {extended.convert_tokens_to_ids(f"▁{w}") for w in ("make", "move", "remove", "add")}
    assert min(new) >= len(old_rows) and len({tuple(rows[i].tolist()) for i in new}) == 4  # distinct rows


def _argv(out: Path, export: Path, *extra: str) -> list[str]:
    """24 rendered edit pairs at 16 px, 40 transformer steps on a 1 + 1 block model."""
    return ["pretrain-tiny", "kontext", "--out", str(out), "--export", str(export), "--size", "16",
            "--n-scenes", "24", "--dit-steps", "40", "--dit-minutes", "0", "--batch", "8", "--warmup", "5",
            "--lr", "2e-3", "--num-layers", "1", "--num-single-layers", "1", "--save-every", "20",
            "--demo-n", "2", "--threads", str(torch.get_num_threads()), *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kontext")
    out, export = root / "run", root / "model"
    assert main(_argv(out, export)) == 0
    return out, export


def test_a_short_run_learns_edit_pairs_and_exports_a_kontext_folder(run):
    out, export = run
    data = json.loads((out / "data.json").read_text())
    assert len(data["prompts"]) == 24 and set(data["levels"]) == {"easy", "medium"}
    assert data["prompts"][0].split()[0] in {"make", "move", "remove", "add"}
    seen = losses(out / "dit")
    assert len(seen) == 40 and sum(seen[-10:]) < 0.8 * sum(seen[:10]), seen
    assert (out / "samples_train_pairs.png").is_file()

    defaults = json.loads((export / "flowalign.json").read_text())
    assert defaults["family"] == "kontext" and defaults["height"] == 16 and defaults["guidance_scale"] == 1.0
    pipe = FluxKontextPipeline.from_pretrained(export)
    config = pipe.transformer.config
    assert config.in_channels == 16 and config.joint_attention_dim == 128 and not config.guidance_embeds
    assert config.pooled_projection_dim == pipe.text_encoder.config.hidden_size
    assert pipe.text_encoder_2.get_input_embeddings().weight.shape[0] == len(pipe.tokenizer_2)
    # the reused VAE keeps its latent factors, and the text encoders moved with the transformer
    sd3_vae = json.loads((SD3 / "vae" / "config.json").read_text())
    assert pipe.vae.config.shift_factor == sd3_vae["shift_factor"]
    assert pipe.vae.config.scaling_factor == sd3_vae["scaling_factor"]
    before = CLIPTextModel.from_pretrained(SD3 / "text_encoder").state_dict()
    after = pipe.text_encoder.state_dict()
    assert after.keys() <= before.keys() and any(not torch.equal(after[k], before[k]) for k in after)


def test_the_training_loss_feeds_the_transformer_as_the_policy_samples(run):
    _, export = run
    policy = pipelines.load(export)
    assert policy.family == "kontext" and policy.latent_hw == (4, 4)
    g = torch.Generator().manual_seed(0)
    pair = torch.randn(2, 2, 4, 4, 4, generator=g)
    prompts = INSTRUCTIONS[:2]
    text = kontext.conditioning(policy.pipe, None, int(policy.defaults["max_sequence_length"]))(prompts)
    torch.manual_seed(3)
    with torch.no_grad():
        loss = kontext.flow_loss(policy.transformer, pair, text)
    torch.manual_seed(3)  # the same σ and ε, drawn in the same order
    sigma = torch.sigmoid(torch.randn(2))
    eps = torch.randn(2, 4, 4, 4)
    s = sigma.view(-1, 1, 1, 1)
    source, target = pair[:, 0], pair[:, 1]
    cond = Conditioning({"prompt_embeds": text["encoder_hidden_states"],
                         "pooled_prompt_embeds": text["pooled_projections"], "image_latents": pack_2x2(source)},
                        prompts)
    with torch.no_grad():
        v = policy.velocity(pack_2x2((1 - s) * target + s * eps), sigma, cond, 1.0)
    torch.testing.assert_close(loss, torch.nn.functional.mse_loss(v, pack_2x2(eps - target)))
    # the source really is context: another source changes the loss
    torch.manual_seed(3)
    with torch.no_grad():
        other = kontext.flow_loss(policy.transformer, pair[:, [1, 1]], text)
    assert not torch.allclose(loss, other)


def test_the_export_is_scored_by_flowalign_evaluate_on_vvr_edit(run, tmp_path):
    _, export = run
    assert main(["evaluate", "--model", str(export), "--bench", "vvr_edit", "--level", "easy", "--split", "validation",
                 "--n", "2", "--out", str(tmp_path / "eval")]) == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["n"] == 2 and 0.0 <= metrics["mean_score"] <= 1.0


def test_without_a_tiny_sd3_folder_to_reuse_it_is_a_one_line_error(tmp_path, capsys):
    assert main(_argv(tmp_path / "run", tmp_path / "m", "--n-scenes", "2", "--init-from", str(tmp_path))) == 2
    assert "--init-from" in capsys.readouterr().err
    assert main(_argv(tmp_path / "run2", tmp_path / "m", "--cfg", "3")) == 2
    assert "--cfg 3" in capsys.readouterr().err

