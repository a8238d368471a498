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


# ------------------------------------------------------------------ decoder-only fine-tuning (stage 3b)


def test_decoder_stage_trains_the_decoder_only_so_the_latents_keep_their_meaning(tmp_path):
    import argparse

    pipe = _tiny_pipe()
    vae = pipe.vae.eval()
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (4, 3, 32, 32), generator=g, dtype=torch.uint8)
    with torch.no_grad():
        z = vae.encode(images.float() / 127.5 - 1).latent_dist.mean
    x0 = (z - vae.config.shift_factor) * vae.config.scaling_factor
    enc_start = {k: v.clone() for k, v in vae.encoder.state_dict().items()}
    dec_start = {k: v.clone() for k, v in vae.decoder.state_dict().items()}
    target = images.float() / 127.5 - 1

    def recon_error(latents: torch.Tensor) -> float:
        with torch.no_grad():
            return (vae.decode(latents).sample - target).abs().mean().item()

    before = recon_error(z)
    args = argparse.Namespace(dec_minutes=None, dec_steps=80, dec_lr=3e-3, dec_batch=4, dec_noise=0.05,
                              fg_weight=5.0, resume=False, save_every=40)
    pretrain.finetune_decoder(pipe, {"images": images}, x0, args, tmp_path)
    assert json.loads((tmp_path / "decoder" / "DONE").read_text())["step"] == 80
    # each scene is decoded from its own encoder latent (x0 un-normalised by the VAE's factors), not just
    # towards the average scene: its own latent decodes far closer than another scene's (0.23 vs 0.60 here;
    # training on wrongly scaled latents gives 0.42 vs 0.59)
    assert recon_error(z) < 0.5 * before and recon_error(z) < 0.5 * recon_error(z.roll(1, 0))
    assert all(torch.equal(v, vae.encoder.state_dict()[k]) for k, v in enc_start.items())
    assert any(not torch.equal(v, vae.decoder.state_dict()[k]) for k, v in dec_start.items())
    assert not any(p.requires_grad for p in vae.parameters())

    again = _tiny_pipe()  # a later run (e.g. --resume) loads the finished decoder instead of training again
    pretrain.finetune_decoder(again, {"images": images}, x0, args, tmp_path)
    assert all(torch.equal(v, again.vae.decoder.state_dict()[k]) for k, v in vae.decoder.state_dict().items())


def test_continuing_a_pretrained_folder_skips_the_decoder_stage_unless_asked(tmp_path, monkeypatch):
    class Stop(Exception):
        pass

    seen = []

    def stop_at_the_stages(folder, data, args, out):
        seen.append(args.dec_minutes)
        raise Stop

    monkeypatch.setattr(pretrain, "continue_from", stop_at_the_stages)
    monkeypatch.setattr(pretrain, "build_dataset", lambda *a, **k: {"prompts": []})
    for i, extra in enumerate(([], ["--dec-minutes", "15"])):
        with pytest.raises(Stop):
            pretrain.main(["--init-from", "x", "--out", str(tmp_path / str(i)), "--export", str(tmp_path / "e")] + extra)
    assert seen == [0.0, 15.0]

    def stop_at_the_vae_stage(pipe, data, args, out):  # from scratch the decoder stage keeps its 5 minutes
        seen.append(args.dec_minutes)
        raise Stop

    monkeypatch.setattr(pretrain, "train_vae", stop_at_the_vae_stage)
    monkeypatch.setattr(pretrain, "build_dataset", lambda *a, **k: {"prompts": ["a red circle", "a blue square"]})
    with pytest.raises(Stop):
        pretrain.main(["--out", str(tmp_path / "s"), "--export", str(tmp_path / "e"), "--clip-max-length", "16"])
    assert seen[-1] == 5.0
