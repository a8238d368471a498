"""``flowalign pretrain-tiny wan``: the video VAE helpers it relies on, and the whole run end to end on a few
16-px clips (the export reloads offline, resuming a finished run is a no-op, a larger decoder budget
moves the decoder only)."""

import json

import torch
from diffusers import WanPipeline
from safetensors.torch import load_file

from flowalign.cli.main import main
from pipelines.pretrain import wan
from pipelines.tiny import build_tiny_wan


def _vae():
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


def _argv(out, export) -> list[str]:
    """The whole run on 24 rendered vvr_motion clips at 16 px with a step or two per stage."""
    return ["pretrain-tiny", "wan", "--out", str(out), "--export", str(export), "--size", "16", "--n-clips", "24",
            "--vae-steps", "2", "--dit-steps", "2", "--dec-steps", "1", "--vae-batch", "2", "--batch", "4",
            "--save-every", "1", "--demo-n", "0", "--threads", str(torch.get_num_threads())]


def _weights(export):
    return {name: load_file(str(export / name / "diffusion_pytorch_model.safetensors")) for name in ("transformer", "vae")}


def test_end_to_end_resume_is_a_no_op_and_a_larger_decoder_budget_moves_the_decoder_only(tmp_path):
    out, export = tmp_path / "run", tmp_path / "model"
    argv = _argv(out, export)
    assert main(argv) == 0
    assert all((out / s / "DONE").is_file() for s in ("vae", "decoder", "dit"))
    data = json.loads((out / "data.json").read_text())
    assert len(data["prompts"]) == 24 and set(data["levels"]) == {"easy", "medium"}
    defaults = json.loads((export / "flowalign.json").read_text())
    assert defaults["family"] == "wan" and defaults["num_frames"] == 9 and defaults["height"] == 16
    pipe = WanPipeline.from_pretrained(export)
    assert pipe.vae.config.scale_factor_temporal == 2 and len(pipe.vae.config.latents_std) == 4
    first = _weights(export)
    latents = load_file(str(out / "latents.safetensors"))["x0"]

    assert main(argv + ["--resume"]) == 0  # every stage finished: nothing moves
    again = _weights(export)
    assert all(torch.equal(first[n][k], again[n][k]) for n in first for k in first[n])

    assert main(argv + ["--dec-steps", "3", "--resume"]) == 0  # the later flag wins
    assert json.loads((out / "decoder" / "DONE").read_text())["step"] == 3
    again = _weights(export)
    assert all(torch.equal(first["transformer"][k], again["transformer"][k]) for k in first["transformer"])
    assert torch.equal(load_file(str(out / "latents.safetensors"))["x0"], latents)  # the encoder stayed
    moved = {k for k in first["vae"] if not torch.equal(first["vae"][k], again["vae"][k])}
    assert moved and all(k.startswith(("decoder.", "post_quant_conv.")) for k in moved), sorted(moved)[:5]
