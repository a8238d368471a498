"""``flowalign pretrain-tiny``: a whole run on a 16-px world resumes bit-exactly and lowers its losses; the
stages and the SD3 family's pieces (deepening, pooled-vector drop, decoder-only fine-tuning)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowalign.cli.main import main
from flowalign.paths import default_model_dir
from pipelines.pretrain import run as pretrain_run
from pipelines.pretrain import sd3
from pipelines.pretrain.autoencoder import finetune_decoder
from pipelines.pretrain.dit import train_dit
from pipelines.pretrain.stage import losses
from pipelines.tiny import build_tiny_sd3


def run_argv(out: Path, export: Path, *extra: str) -> list[str]:
    """All stages on 48 synthetic 16-px scenes, 20 steps each (checkpoints every 10); step budgets only,
    so that the LR schedules do not depend on the clock."""
    return ["pretrain-tiny", "sd3", "--out", str(out), "--export", str(export), "--synthetic", "--size", "16",
            "--n-scenes", "48", "--vae-steps", "20", "--dec-steps", "10", "--dit-steps", "20", "--vae-minutes", "0",
            "--dec-minutes", "0", "--dit-minutes", "0", "--vae-batch", "8",
            "--dec-batch", "4", "--batch", "8", "--save-every", "10", "--demo-n", "0", "--clip-max-length", "16",
            "--threads", str(torch.get_num_threads()), *extra]


def exported(folder: Path) -> dict[str, torch.Tensor]:
    return {f"{part}/{k}": v for part in ("transformer", "vae", "text_encoder_3")
            for k, v in load_file(str(next((folder / part).glob("*.safetensors")))).items()}


def interrupt(out: Path, stage: str, later: tuple[str, ...]) -> None:
    """What a kill after ``stage``'s step-10 checkpoint leaves: no newer checkpoint, no DONE, no later stage."""
    shutil.rmtree(out / stage / "checkpoints" / "step-000020")
    (out / stage / "DONE").unlink()
    for name in later:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


@pytest.mark.slow
def test_a_run_resumed_after_a_kill_ends_bit_exactly_where_an_uninterrupted_one_does(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(run_argv(straight, tmp_path / "model-a")) == 0
    reference = exported(tmp_path / "model-a")
    assert json.loads((tmp_path / "model-a" / "flowalign.json").read_text())["height"] == 16
    for name in ("vae", "decoder", "dit"):  # every stage learns something
        seen = losses(straight / name)
        assert len(seen) == (10 if name == "decoder" else 20)
        assert sum(seen[-5:]) < sum(seen[:5]), (name, seen)

    assert main(run_argv(resumed, tmp_path / "model-b")) == 0
    interrupt(resumed, "dit", ())  # killed in the transformer stage
    assert main(run_argv(resumed, tmp_path / "model-b", "--resume")) == 0
    again = exported(tmp_path / "model-b")
    assert again.keys() == reference.keys() and all(torch.equal(again[k], reference[k]) for k in reference)

    interrupt(resumed, "vae", ("latents.safetensors", "decoder", "dit"))  # killed in the VAE stage
    assert main(run_argv(resumed, tmp_path / "model-b", "--resume")) == 0
    again = exported(tmp_path / "model-b")
    assert all(torch.equal(again[k], reference[k]) for k in reference)
    assert losses(resumed / "dit") == losses(straight / "dit")  # the log was cut back to the checkpoint

    # resumed once more, every stage is finished: nothing moves
    assert main(run_argv(resumed, tmp_path / "model-b", "--resume")) == 0
    assert all(torch.equal(exported(tmp_path / "model-b")[k], reference[k]) for k in reference)

    # a finished VAE given a larger budget continues; what was trained on its latents is set aside and redone
    assert main(run_argv(resumed, tmp_path / "model-b", "--resume", "--vae-steps", "25")) == 0
    assert json.loads((resumed / "vae" / "DONE").read_text())["step"] == 25
    assert {p.name.split(".stale-")[0] for p in resumed.glob("*.stale-*")} == {"dit", "decoder"}
    assert len(losses(resumed / "dit")) == 20 and len(losses(resumed / "vae")) == 25
    assert not torch.equal(exported(tmp_path / "model-b")["vae/decoder.conv_out.weight"], reference["vae/decoder.conv_out.weight"])


def test_bad_budgets_are_one_line_errors(tmp_path, capsys):
    assert main(run_argv(tmp_path, tmp_path / "m", "--dit-steps", "0")) == 2
    assert "--dit-steps 0" in capsys.readouterr().err
    assert main(run_argv(tmp_path, tmp_path / "m", "--size", "20")) == 2
    assert "--size 20" in capsys.readouterr().err


# ------------------------------------------------------------------ deepening a pretrained transformer


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
    new = sd3.deepen_transformer(old, 4).eval()
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
        sd3.deepen_transformer(old, 3)


# ------------------------------------------------------------------ the transformer stage


def _dit_args(**kw):
    base = dict(seed=0, lr=1e-3, wd=0.01, ema=0.9, resume=False, dit_minutes=None, dit_steps=2, dit_level_weights=None,
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
        kept = sd3.conditioning(pipe, _dit_args(pooled_drop=0.0), max_seq)(prompts)
        hidden = sd3.conditioning(pipe, _dit_args(pooled_drop=1.0), max_seq)(prompts)
    assert not torch.allclose(kept["pooled_projections"], empty.expand(3, -1))
    torch.testing.assert_close(hidden["pooled_projections"], empty.expand(3, -1), atol=0, rtol=0)
    # the token sequence, where the binding has to be read from, is never hidden
    torch.testing.assert_close(hidden["encoder_hidden_states"], kept["encoder_hidden_states"], atol=0, rtol=0)


def _train_dit(pipe, data, x0, args, out):
    max_seq = pipe.tokenizer.model_max_length
    return train_dit(pipe, data, x0, args, out, sd3.TRAINED, sd3.conditioning(pipe, args, max_seq))


def test_dit_stage_trains_the_text_side_too_resumes_as_a_no_op_and_continues(tmp_path):
    pipe = _tiny_pipe()
    size = pipe.transformer.config.sample_size
    data = {"prompts": ["a red circle", "a blue square", "a green star", "two red circles"],
            "levels": ["easy", "easy", "easy", "medium"]}
    x0 = torch.randn(4, 4, size, size, generator=torch.Generator().manual_seed(0))
    t5_q = "encoder.block.0.layer.0.SelfAttention.q.weight"
    t5_start = pipe.text_encoder_3.state_dict()[t5_q].clone()
    vae_start = {k: v.clone() for k, v in pipe.vae.state_dict().items()}
    _train_dit(pipe, data, x0, _dit_args(pooled_drop=0.5, dit_level_weights="easy:0.5,medium:0.5"), tmp_path)
    assert json.loads((tmp_path / "dit" / "DONE").read_text())["step"] == 2
    assert not torch.equal(pipe.text_encoder_3.state_dict()[t5_q], t5_start)
    assert all(torch.equal(v, pipe.vae.state_dict()[k]) for k, v in vae_start.items())
    trained = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}

    again = _tiny_pipe()  # a fresh process: a finished stage loads its weights and takes no step
    _train_dit(again, data, x0, _dit_args(resume=True), tmp_path)
    assert all(torch.equal(v, again.transformer.state_dict()[k]) for k, v in trained.items())

    _train_dit(again, data, x0, _dit_args(resume=True, dit_steps=3), tmp_path)  # a larger budget
    assert json.loads((tmp_path / "dit" / "DONE").read_text())["step"] == 3
    assert any(not torch.equal(v, again.transformer.state_dict()[k]) for k, v in trained.items())


# ------------------------------------------------------------------ decoder-only fine-tuning


def test_decoder_stage_trains_the_decoder_only_so_the_latents_keep_their_meaning(tmp_path):
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
    args = argparse.Namespace(seed=0, dec_minutes=None, dec_steps=80, dec_lr=3e-3, dec_batch=4, dec_noise=0.05,
                              fg_weight=5.0, resume=False, save_every=40, size=32, vae_crop=0, vae_batch=4,
                              vae_lr=1e-3, vae_lr2=1e-4)
    finetune_decoder(vae, images, x0, args, tmp_path, sd3.recipe(vae, args))
    assert json.loads((tmp_path / "decoder" / "DONE").read_text())["step"] == 80
    # each scene is decoded from its own encoder latent (x0 un-normalised by the VAE's factors), not just
    # towards the average scene: its own latent decodes far closer than another scene's
    assert recon_error(z) < 0.5 * before and recon_error(z) < 0.5 * recon_error(z.roll(1, 0))
    assert all(torch.equal(v, vae.encoder.state_dict()[k]) for k, v in enc_start.items())
    assert any(not torch.equal(v, vae.decoder.state_dict()[k]) for k, v in dec_start.items())
    assert not any(p.requires_grad for p in vae.parameters())

    again = _tiny_pipe().vae  # a later run (e.g. --resume) loads the finished decoder instead of training again
    finetune_decoder(again, images, x0, args, tmp_path, sd3.recipe(again, args))
    assert all(torch.equal(v, again.decoder.state_dict()[k]) for k, v in vae.decoder.state_dict().items())


def test_continuing_a_pretrained_folder_skips_the_decoder_stage_unless_asked(tmp_path, monkeypatch):
    class Stop(Exception):
        pass

    seen = []

    def stop_at_training(family, data, args, out):
        seen.append(args.dec_minutes)
        raise Stop

    monkeypatch.setattr(pretrain_run, "train", stop_at_training)
    argv = run_argv(tmp_path, tmp_path / "e")
    at = argv.index("--dec-minutes")
    del argv[at : at + 2]  # the family's default
    for i, extra in enumerate((["--init-from", "x"], ["--init-from", "x", "--dec-minutes", "15"], [])):
        with pytest.raises(Stop):
            main(argv + ["--out", str(tmp_path / str(i)), *extra])
    assert seen == [0.0, 15.0, 5.0]


def test_an_export_folder_with_files_no_export_wrote_is_refused_before_training(tmp_path, capsys):
    """Hours of training must not end by replacing a shipped model or a user's folder: the export folder is
    checked first; ``--overwrite`` lets an export replace only the model's files."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    (model / "notes.txt").write_text("mine")
    assert main(run_argv(tmp_path / "work", model)) == 2
    err = capsys.readouterr().err
    assert "--export" in err and "--overwrite" in err and "Traceback" not in err
    assert not (tmp_path / "work").exists()  # refused before any stage ran
    assert (model / "model_index.json").read_text() == "{}"


def test_a_work_folder_of_a_users_files_is_refused_before_training(tmp_path, capsys):
    """``--out`` is where stages checkpoint into ``vae/``, ``dit/``, ``decoder/`` and move stale ones aside:
    a folder pretraining never worked in (a model folder given by mistake, a user's notes) is refused first,
    and nothing is written there."""
    model = shutil.copytree(default_model_dir(), tmp_path / "model")  # --out and --export mixed up
    before = sorted(str(p.relative_to(model)) for p in model.rglob("*"))
    assert main(run_argv(model, tmp_path / "export")) == 2
    err = capsys.readouterr().err
    assert f"--out {model}" in err and "--overwrite" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert sorted(str(p.relative_to(model)) for p in model.rglob("*")) == before
    assert not (tmp_path / "export").exists()
