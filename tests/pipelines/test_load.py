"""``pipelines.load``: family detection, sampling defaults, dtypes, frozen weights, one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import pipelines
from flowalign.errors import UserError
from pipelines.flux import FluxPolicy
from pipelines.sd3 import SD3Policy
from pipelines.wan import WanPolicy


@pytest.mark.parametrize(
    "fixture, cls", [("tiny_sd3_dir", SD3Policy), ("tiny_flux_dir", FluxPolicy), ("tiny_wan_dir", WanPolicy)]
)
def test_detects_family_and_freezes_everything(request, fixture, cls):
    folder = request.getfixturevalue(fixture)
    policy = pipelines.load(folder)
    assert type(policy) is cls and pipelines.FAMILIES[policy.family] is cls
    assert policy.device == torch.device("cpu") and policy.dtype == torch.float32
    for name, module in policy.pipe.components.items():
        if isinstance(module, torch.nn.Module):
            assert not any(p.requires_grad for p in module.parameters()), name
            assert not module.training, name
    assert pipelines.load(folder, cls.family).family == cls.family


def test_defaults_merge_family_file_and_caller(tiny_sd3_dir, tmp_path):
    written = json.loads((tiny_sd3_dir / "flowalign.json").read_text())
    policy = pipelines.load(tiny_sd3_dir, defaults={"num_steps": 7})
    assert policy.defaults["height"] == written["height"] == 32
    assert policy.defaults["guidance_scale"] == written["guidance_scale"]
    assert policy.defaults["num_steps"] == 7
    assert "family" not in policy.defaults
    # without flowalign.json: the checkpoint's own defaults (sample size × VAE factor, scheduler shift)
    bare = tmp_path / "bare"
    shutil.copytree(tiny_sd3_dir, bare)
    (bare / "flowalign.json").unlink()
    plain = pipelines.load(bare)
    assert plain.defaults["height"] == plain.pipe.default_sample_size * plain.pipe.vae_scale_factor
    assert plain.defaults["shift"] == plain.pipe.scheduler.config.shift
    assert plain.defaults["max_sequence_length"] == 256


def test_a_default_the_family_does_not_read_is_refused_in_one_line(tiny_sd3_dir, tiny_model_dir):
    """A misspelt key would otherwise ride along unread; a subclass's own keys (Qwen-Image-Edit's forms) are
    known. Refused before any weight is read."""
    with pytest.raises(UserError, match=r"^model.defaults.heigth: not a sampling default of the sd3 family: did you "
                                        r"mean 'height'\? give one of guidance_scale, height, .*width$"):
        pipelines.load(tiny_sd3_dir, defaults={"heigth": 48})
    edit = pipelines.load(tiny_model_dir("qwen_image_edit"), defaults={"vl_image": "vae_tensor", "edit_image_area": 1024})
    assert edit.defaults["vl_image"] == "vae_tensor"
    with pytest.raises(UserError, match="model.defaults.vl_imag: not a sampling default of the qwen_image_edit"):
        pipelines.check_defaults(tiny_model_dir("qwen_image_edit"), {"vl_imag": "vae_tensor"})


def _twins() -> list[str]:
    from flowalign import families

    return [twin for name in families.names() for twin in families.get(name).tiny]


@pytest.mark.parametrize("twin", _twins())
def test_each_policy_reads_exactly_the_sampling_keys_it_states(twin, tiny_model_dir):
    """The keys a policy class states (what ``check_defaults`` and ``flowalign train --check`` accept) are the
    keys of its defaults once built: a key read but not stated, or stated but never set, fails here."""
    policy = pipelines.load(tiny_model_dir(twin))
    assert set(policy.defaults) == set(type(policy).sampling_keys)


def test_shift_default_overrides_the_scheduler_shift(tiny_sd3_dir):
    policy = pipelines.load(tiny_sd3_dir, defaults={"shift": 1.0})
    grid = policy.sigmas(4)
    torch.testing.assert_close(grid[:-1], torch.linspace(1.0, 0.001, 4))  # shift 1: the plain linear grid


@pytest.mark.parametrize("name, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtype_strings(name, dtype):
    assert pipelines.parse_dtype(name) is dtype
    assert pipelines.parse_dtype(dtype) is dtype


def test_bf16_policy_runs_in_bf16_and_returns_float32(tiny_sd3_dir):
    policy = pipelines.load(tiny_sd3_dir, dtype="bf16")
    assert policy.transformer.dtype == torch.bfloat16
    cond = policy.encode(["a red circle"])
    x = policy.initial_noise(1)
    with torch.no_grad():
        v = policy.velocity(x, 0.5, cond, 4.0)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


def test_missing_folder(tmp_path):
    with pytest.raises(UserError, match="path .* does not exist"):
        pipelines.load(tmp_path / "nope")


def test_folder_without_model_index(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="not a diffusers folder"):
        pipelines.load(tmp_path)


def test_unknown_pipeline_class(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(UserError, match="family .*StableDiffusionXLPipeline.*StableDiffusion3Pipeline"):
        pipelines.load(tmp_path)


def test_unknown_or_mismatched_family(tiny_sd3_dir):
    with pytest.raises(UserError, match="family=.sdxl. is unknown: known families are anyflow_far, flux, flux2, hunyuan_video15, kontext, ltx2, qwen_image, qwen_image_edit, sd3, wan, zimage"):
        pipelines.load(tiny_sd3_dir, "sdxl")
    with pytest.raises(UserError, match="family='flux' but .* holds a 'sd3' pipeline"):
        pipelines.load(tiny_sd3_dir, "flux")


def test_bad_dtype_and_options(tiny_sd3_dir):
    with pytest.raises(UserError, match="dtype='float8'"):
        pipelines.load(tiny_sd3_dir, dtype="float8")
    with pytest.raises(UserError, match="unknown option"):
        pipelines.load(tiny_sd3_dir, guidance=3.0)
    with pytest.raises(UserError, match="height=30"):
        pipelines.load(tiny_sd3_dir, defaults={"height": 30})


def test_errors_are_one_line(tmp_path):
    with pytest.raises(UserError) as info:
        pipelines.load(tmp_path / "nope")
    assert "\n" not in str(info.value)


def test_a_tokenizer_listed_but_missing_is_refused_not_skipped(tiny_sd3_dir, tmp_path):
    """Without tokenizer_2/ diffusers would load and sample other images; the folder is refused."""
    broken = tmp_path / "m"
    shutil.copytree(tiny_sd3_dir, broken)
    shutil.rmtree(broken / "tokenizer_2")
    with pytest.raises(UserError, match=r"model folder .*m: tokenizer_2/ is missing \(model_index.json lists a "
                                        r"CLIPTokenizer\)"):
        pipelines.load(broken)


def test_a_truncated_weights_file_or_config_is_named(tiny_sd3_dir, tmp_path):
    broken = tmp_path / "m"
    shutil.copytree(tiny_sd3_dir, broken)
    weights = broken / "vae" / "diffusion_pytorch_model.safetensors"
    full = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(full - 1)
    with pytest.raises(UserError, match=f"vae/diffusion_pytorch_model.safetensors is {full - 1:,} bytes but its "
                                        f"header lays out {full:,}"):
        pipelines.load(broken)
    shutil.copy(tiny_sd3_dir / "vae" / "diffusion_pytorch_model.safetensors", weights)
    (broken / "scheduler" / "scheduler_config.json").write_bytes(b"\xff\xfe")
    with pytest.raises(UserError, match="scheduler/scheduler_config.json is damaged \\(not UTF-8 text\\)"):
        pipelines.load(broken)
    (broken / "scheduler" / "scheduler_config.json").write_text("{}")
    weights.write_bytes(b"\x00" * 4)
    with pytest.raises(UserError, match="not a readable safetensors file"):
        pipelines.load(broken)
