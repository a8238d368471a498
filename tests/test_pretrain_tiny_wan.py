"""scripts/pretrain_tiny.py --family wan (scripts/pretrain_tiny_wan.py): the VAE helpers it relies on, and the
whole script end to end on a few clips (export reloads offline, resume is a no-op)."""

import json

import torch
from diffusers import WanPipeline
from safetensors.torch import load_file

from tests.scripts import load_script


wan = load_script("pretrain_tiny_wan")


def _vae():
    from pipelines.tiny import build_tiny_wan

    return build_tiny_wan(**wan.model_overrides([], 16)).vae.eval()


def test_inflated_vae_starts_as_a_per_frame_autoencoder():
    vae = _vae()
    wan.inflate_(vae)
    x = torch.rand(1, 3, 9, 32, 32) * 2 - 1
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean
        # latent frame k is the image encoding of frame 2k (the temporal downsampling keeps one of each pair)
        frames = torch.cat([vae.encode(x[:, :, i : i + 1]).latent_dist.mean for i in (0, 2, 4, 6, 8)], 2)
        assert z.shape == (1, 4, 5, 16, 16) and torch.allclose(z, frames, atol=1e-5)
        rec = wan.decode_unclamped(vae, z)
        single = [wan.decode_unclamped(vae, z[:, :, k : k + 1]) for k in range(5)]
    # decoded frame f repeats latent frame ceil(f / 2): the temporal upsampling repeats the current frame
    assert rec.shape == (1, 3, 9, 32, 32)
    for f in range(9):
        assert torch.allclose(rec[:, :, f], single[(f + 1) // 2][:, :, 0], atol=1e-5), f
    # a random init mixes other frames in: the same check fails without inflation
    raw = _vae()
    with torch.no_grad():
        z_raw = raw.encode(x).latent_dist.mean
        f2 = raw.encode(x[:, :, 2:3]).latent_dist.mean
    assert not torch.allclose(z_raw[:, :, 1:2], f2, atol=1e-3)


def test_unclamped_decode_is_the_vae_decode_before_its_clamp():
    vae = _vae()
    z = torch.randn(2, 4, 5, 16, 16)
    with torch.no_grad():
        ours = wan.decode_unclamped(vae, z)
        theirs = vae.decode(z).sample
    assert ours.shape == theirs.shape == (2, 3, 9, 32, 32)
    assert torch.allclose(ours.clamp(-1, 1), theirs, atol=1e-5)


def _tiny_run_argv(out, export) -> list[str]:
    """The whole script on 24 clips with a step or two per stage."""
    return ["--family", "wan", "--out", str(out), "--export", str(export), "--n-clips", "24", "--vae-steps", "2",
            "--dit-steps", "2", "--dec-steps", "1", "--vae-batch", "2", "--batch", "4", "--save-every", "1",
            "--demo-n", "0", "--threads", str(torch.get_num_threads())]


def test_family_wan_end_to_end_and_resume_is_a_no_op(tmp_path):
    mod = load_script("pretrain_tiny")
    out, export = tmp_path / "run", tmp_path / "model"
    argv = _tiny_run_argv(out, export)
    mod.main(argv)
    assert all((out / s / "DONE").is_file() for s in ("vae", "decoder", "dit"))
    defaults = json.loads((export / "flowalign.json").read_text())
    assert defaults["family"] == "wan" and defaults["num_frames"] == 9 and defaults["height"] == 32
    pipe = WanPipeline.from_pretrained(export)
    assert pipe.vae.config.scale_factor_temporal == 2 and len(pipe.vae.config.latents_std) == 4
    before = load_file(str(export / "transformer" / "diffusion_pytorch_model.safetensors"))
    mod.main(argv + ["--resume"])
    after = load_file(str(export / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_resumed_with_a_larger_decoder_budget_the_decoder_continues_and_nothing_else_moves(tmp_path):
    mod = load_script("pretrain_tiny")
    out, export = tmp_path / "run", tmp_path / "model"
    argv = _tiny_run_argv(out, export)
    mod.main(argv)
    first = {name: load_file(str(export / name / "diffusion_pytorch_model.safetensors")) for name in ("transformer", "vae")}
    latents = torch.load(out / "latents.pt")["x0"]
    mod.main(argv + ["--dec-steps", "3", "--resume"])  # the later flag wins
    assert json.loads((out / "decoder" / "DONE").read_text())["step"] == 3
    again = {name: load_file(str(export / name / "diffusion_pytorch_model.safetensors")) for name in ("transformer", "vae")}
    assert all(torch.equal(first["transformer"][k], again["transformer"][k]) for k in first["transformer"])
    assert torch.equal(torch.load(out / "latents.pt")["x0"], latents)  # the encoder (and so the latents) stayed
    moved = {k for k in first["vae"] if not torch.equal(first["vae"][k], again["vae"][k])}
    assert moved and all(k.startswith(("decoder.", "post_quant_conv.")) for k in moved), sorted(moved)[:5]
