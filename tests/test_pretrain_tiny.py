"""scripts/pretrain_tiny.py: growing a pretrained transformer (``--init-from --num-layers``) keeps its function
exactly, and the grown blocks are the identity only until their gates train."""


import json

import pytest
import torch

from pipelines.tiny import build_tiny_sd3
from tests.scripts import load_script


pretrain = load_script("pretrain_tiny")


def _inputs(tr, batch=2):
    g = torch.Generator().manual_seed(0)
    c = tr.config
    x = torch.randn(batch, c.in_channels, c.sample_size, c.sample_size, generator=g)
    text = torch.randn(batch, 7, c.joint_attention_dim, generator=g)
    pooled = torch.randn(batch, c.pooled_projection_dim, generator=g)
    return dict(hidden_states=x, timestep=torch.tensor([250.0, 800.0]), encoder_hidden_states=text,
                pooled_projections=pooled)


def test_deepened_transformer_computes_the_same_function():
    old = build_tiny_sd3(seed=3, transformer={"num_layers": 2}).transformer.eval()
    new = pretrain.deepen_transformer(old, 4).eval()
    assert new.config.num_layers == 4
    assert [b.context_pre_only for b in new.transformer_blocks] == [False, False, False, True]
    torch.testing.assert_close(old.transformer_blocks[0].attn.to_q.weight, new.transformer_blocks[1].attn.to_q.weight)
    with torch.no_grad():
        a, b = old(**_inputs(old)).sample, new(**_inputs(new)).sample
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    # the identity is held by zero gates only: once they move, the new blocks change the output
    with torch.no_grad():
        new.transformer_blocks[0].norm1.linear.bias.normal_()
        c = new(**_inputs(new)).sample
    assert (c - a).abs().max() > 1e-3


def test_deepening_needs_a_multiple_of_the_depth():
    old = build_tiny_sd3(seed=3, transformer={"num_layers": 2}).transformer
    with pytest.raises(ValueError, match="multiple"):
        pretrain.deepen_transformer(old, 3)


# ------------------------------------------------------------------ the DiT stage (shared with the Wan script)


def _dit_args(**kw):
    import argparse

    base = dict(lr=1e-3, wd=0.01, ema=0.9, resume=False, dit_minutes=None, dit_steps=2, dit_level_weights=None,
                warmup=1, batch=4, drop=0.1, pooled_drop=0.0, save_every=1)
    return argparse.Namespace(**{**base, **kw})


def _tiny_pipe():
    pipe = build_tiny_sd3(seed=0, transformer={"num_layers": 2})
    pipe.vae.requires_grad_(False)
    return pipe


def test_sd3_conditioning_hides_the_pooled_vector_at_the_drop_rate():
    pipe = _tiny_pipe()
    prompts = ["a red circle", "a blue square", "a green star"]
    max_seq = pipe.tokenizer.model_max_length
    with torch.no_grad():
        _, _, empty, _ = pipe.encode_prompt(prompt=[""], prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
                                            max_sequence_length=max_seq)
        kept = pretrain.sd3_conditioning(pipe, _dit_args(pooled_drop=0.0), max_seq)(prompts)
        hidden = pretrain.sd3_conditioning(pipe, _dit_args(pooled_drop=1.0), max_seq)(prompts)
    assert not torch.allclose(kept["pooled_projections"], empty.expand(3, -1))
    torch.testing.assert_close(hidden["pooled_projections"], empty.expand(3, -1), atol=0, rtol=0)
    # the token sequence, where the binding has to be read from, is never hidden
    torch.testing.assert_close(hidden["encoder_hidden_states"], kept["encoder_hidden_states"], atol=0, rtol=0)


def test_dit_stage_trains_the_text_side_too_resumes_as_a_no_op_and_continues(tmp_path):
    pipe = _tiny_pipe()
    size = pipe.transformer.config.sample_size
    data = {"prompts": ["a red circle", "a blue square", "a green star", "two red circles"],
            "levels": ["easy", "easy", "easy", "medium"]}
    x0 = torch.randn(4, 4, size, size, generator=torch.Generator().manual_seed(0))
    max_seq = pipe.tokenizer.model_max_length
    t5_q = "encoder.block.0.layer.0.SelfAttention.q.weight"
    t5_start = pipe.text_encoder_3.state_dict()[t5_q].clone()
    vae_start = {k: v.clone() for k, v in pipe.vae.state_dict().items()}
    pretrain.train_dit(pipe, data, x0, _dit_args(pooled_drop=0.5, dit_level_weights="easy:0.5,medium:0.5"),
                       tmp_path, max_seq)
    assert json.loads((tmp_path / "dit" / "DONE").read_text())["step"] == 2
    assert not torch.equal(pipe.text_encoder_3.state_dict()[t5_q], t5_start)
    assert all(torch.equal(v, pipe.vae.state_dict()[k]) for k, v in vae_start.items())
    trained = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}

    again = _tiny_pipe()  # a fresh process: a finished stage loads its weights and takes no step
    pretrain.train_dit(again, data, x0, _dit_args(resume=True), tmp_path, max_seq)
    assert all(torch.equal(v, again.transformer.state_dict()[k]) for k, v in trained.items())

    pretrain.train_dit(again, data, x0, _dit_args(resume=True, dit_steps=3), tmp_path, max_seq)  # a larger budget
    assert json.loads((tmp_path / "dit" / "DONE").read_text())["step"] == 3
    assert any(not torch.equal(v, again.transformer.state_dict()[k]) for k, v in trained.items())
