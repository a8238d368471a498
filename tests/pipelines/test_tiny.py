"""Tiny pipelines: build, save, reload offline with plain ``from_pretrained``, run 2 steps."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

diffusers = pytest.importorskip("diffusers")

from pipelines.tiny import (  # noqa: E402
    SAMPLING_DEFAULTS_FILE,
    build_tiny,
    clip_tokenizer,
    read_sampling_defaults,
    save_tiny,
    t5_tokenizer,
    write_sampling_defaults,
)

PROMPT = "On a white background, exactly two red circles; a blue square is left of the green triangle."

CASES = {
    "sd3": (diffusers.StableDiffusion3Pipeline, dict(height=32, width=32, max_sequence_length=32)),
    "flux": (diffusers.FluxPipeline, dict(height=32, width=32, max_sequence_length=32, guidance_scale=3.5)),
    "wan": (diffusers.WanPipeline, dict(height=32, width=32, num_frames=5, max_sequence_length=32)),
}


def _params(pipe) -> dict[str, torch.Tensor]:
    out = {}
    for name, comp in pipe.components.items():
        if isinstance(comp, torch.nn.Module):
            out.update({f"{name}.{k}": v for k, v in comp.state_dict().items()})
    return out


@pytest.mark.parametrize("family", list(CASES))
def test_build_save_reload_run(family, tmp_path):
    cls, call_kw = CASES[family]
    pipe = save_tiny(family, tmp_path)
    assert isinstance(pipe, cls)
    assert (tmp_path / "model_index.json").is_file()
    assert list(tmp_path.rglob("*.safetensors")), "weights must be safetensors"
    assert not list(tmp_path.rglob("*.bin"))
    size = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert size < 8 * 2**20, f"tiny {family} folder is {size / 2**20:.1f} MB"

    defaults = read_sampling_defaults(tmp_path)
    assert defaults["family"] == family
    assert {"height", "width", "num_frames", "guidance_scale", "num_steps", "max_sequence_length", "shift"} <= set(
        defaults
    )

    reloaded = cls.from_pretrained(tmp_path)
    reloaded.set_progress_bar_config(disable=True)
    a, b = _params(pipe), _params(reloaded)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)

    out = reloaded(PROMPT, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np", **call_kw)
    arr = out.frames if family == "wan" else out.images
    expected = (1, 5, 32, 32, 3) if family == "wan" else (1, 32, 32, 3)
    assert tuple(arr.shape) == expected
    assert torch.isfinite(torch.as_tensor(arr)).all()


@pytest.mark.parametrize("family", list(CASES))
def test_deterministic_and_rng_untouched(family):
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    p1 = build_tiny(family)
    after = torch.rand(3)
    assert torch.equal(before, after), "builder must not consume the caller's RNG"
    p2 = build_tiny(family)
    a, b = _params(p1), _params(p2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    p3 = build_tiny(family, seed=1)
    c = _params(p3)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point() and a[k].numel() > 1)


def test_sd3_dims_and_overrides():
    pipe = build_tiny("sd3", height=64, transformer={"num_layers": 3}, scheduler={"shift": 1.0})
    t = pipe.transformer.config
    assert t.num_layers == 3 and t.sample_size == 16
    assert t.joint_attention_dim == pipe.text_encoder_3.config.d_model
    assert t.pooled_projection_dim == (
        pipe.text_encoder.config.projection_dim + pipe.text_encoder_2.config.projection_dim
    )
    assert pipe.scheduler.config.shift == 1.0
    assert pipe.vae.config.latent_channels == t.in_channels
    with pytest.raises(TypeError):
        build_tiny("sd3", bogus=1)
    with pytest.raises(ValueError):
        build_tiny("sd3", text_encoder_3={"d_model": 32})
    with pytest.raises(ValueError):
        build_tiny("nope")


def test_flux_scheduler_is_dynamic():
    pipe = build_tiny("flux")
    cfg = pipe.scheduler.config
    assert cfg.use_dynamic_shifting and cfg.base_shift == 0.5 and cfg.max_shift == 1.15
    assert pipe.transformer.config.guidance_embeds


def test_tokenizers_offline(tmp_path):
    clip = clip_tokenizer(4096)
    ids = clip(PROMPT).input_ids
    assert ids[0] == clip.bos_token_id and ids[-1] == clip.eos_token_id
    assert "red</w>" in clip.convert_ids_to_tokens(ids)
    assert clip.decode(ids, skip_special_tokens=True).startswith("on a white background")
    full = clip_tokenizer(None)
    assert len(full) == 49408
    # the real CLIP ids for common words (OpenAI CLIP: "a" -> 320, "red" -> 736)
    assert full("a red").input_ids == [49406, 320, 736, 49407]

    t5 = t5_tokenizer()
    toks = t5.convert_ids_to_tokens(t5(PROMPT).input_ids)
    assert "▁circles" in toks and "▁triangle" in toks and toks[-1] == "</s>"
    assert t5.unk_token_id not in t5("Zebra xylophone 42!").input_ids  # characters cover everything
    t5.save_pretrained(tmp_path / "t5")
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path / "t5")
    assert again(PROMPT).input_ids == t5(PROMPT).input_ids


def test_write_sampling_defaults(tmp_path):
    path = write_sampling_defaults(tmp_path / "m", family="sd3", height=64, width=64, num_frames=None)
    assert path.name == SAMPLING_DEFAULTS_FILE
    assert json.loads(path.read_text())["height"] == 64
    assert read_sampling_defaults(tmp_path) is None
