"""rewards.image_encoders: the frozen DINOv3 encoder (GARDO's diversity features) against transformers' own
processor and model on a tiny random folder, its options, its errors, and the ``encoders`` plugin table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flowalign.errors import UserError
from flowalign.plugins import load_encoder, targets
from rewards.image_encoders import DINOv2, DINOv3
from rewards.tiny_rewards import save_tiny_dinov2, save_tiny_dinov3


@pytest.fixture(scope="module")
def dinov3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-dinov3") / "dinov3"
    save_tiny_dinov3(folder)
    return folder


def reference_features(folder: Path, images: torch.Tensor, resolution: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' processor (told the authors' 256 px bicubic, images already in [0, 1]) and model:
    the unit mean of the patch tokens ``(B, D)`` and the unit CLS feature ``(B, D)``."""
    from transformers import AutoImageProcessor, DINOv3ViTModel
    from transformers.image_utils import PILImageResampling

    processor = AutoImageProcessor.from_pretrained(folder)
    model = DINOv3ViTModel.from_pretrained(folder).eval()
    x = processor(list(images), size={"height": resolution, "width": resolution},
                  resample=PILImageResampling.BICUBIC, do_rescale=False, return_tensors="pt").pixel_values
    with torch.no_grad():
        out = model(pixel_values=x)
    prefix = 1 + model.config.num_register_tokens
    return (F.normalize(out.last_hidden_state[:, prefix:].mean(1), dim=-1),
            F.normalize(out.pooler_output, dim=-1))


def test_dinov3_features_are_transformers_processor_and_model_output(dinov3_dir, images):
    """Square images (the processor resizes to a square, the encoder the shortest side then crops: the same
    here): the default feature is the patch-token mean (timm's ``avg`` pool, the GARDO authors'), ``pool=cls``
    the CLS token; both unit vectors, float32, computed without touching the frozen weights."""
    x = images(3, size=64, seed=3)
    patch_mean, cls = reference_features(dinov3_dir, x, 256)
    encoder = DINOv3(dinov3_dir)
    with torch.no_grad():
        got = encoder.encode_images(x)
    assert got.dtype == torch.float32 and got.shape == (3, 32)
    torch.testing.assert_close(got, patch_mean, atol=2e-5, rtol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(DINOv3(dinov3_dir, pool="cls").encode_images(x), cls, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(patch_mean, cls, atol=1e-2)  # the two pools are different features
    assert not encoder.model.training and not any(p.requires_grad for p in encoder.model.parameters())


def test_dinov3_resolution_option(dinov3_dir, images):
    x = images(2, size=64, seed=4)
    patch_mean, _ = reference_features(dinov3_dir, x, 128)
    with torch.no_grad():
        torch.testing.assert_close(DINOv3(dinov3_dir, resolution=128).encode_images(x), patch_mean, atol=2e-5, rtol=1e-4)


def test_a_missing_or_wrong_folder_is_one_line_naming_the_option_and_the_fix(dinov3_dir, tmp_path):
    setting = "trainer.diversity_encoder"
    with pytest.raises(UserError, match=r"trainer\.diversity_encoder\.path is not set; download "
                                        r"facebook/dinov3-vitl16-pretrain-lvd1689m") as unset:
        load_encoder("dinov3", None, setting=setting)
    with pytest.raises(UserError, match=r"trainer\.diversity_encoder\.path='.*nowhere' does not exist") as missing:
        load_encoder("dinov3", str(tmp_path / "nowhere"), setting=setting)
    save_tiny_dinov2(tmp_path / "dinov2")
    with pytest.raises(UserError, match=r"is not a DINOv3 ViT folder .*download facebook/dinov3") as wrong:
        load_encoder("dinov3", str(tmp_path / "dinov2"), setting=setting)
    with pytest.raises(UserError, match=r"trainer\.diversity_encoder\.name='dinov9' is not a known image encoder; "
                                        r"known: .*dinov3") as unknown:
        load_encoder("dinov9", str(dinov3_dir), setting=setting)
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text((dinov3_dir / "config.json").read_text())
    with pytest.raises(UserError, match=r"config_only' is not a DINOv3 ViT folder") as no_weights:
        load_encoder("dinov3", str(tmp_path / "config_only"), setting=setting)
    for err in (unset, missing, wrong, unknown, no_weights):
        assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="pool='avg' is not known"):
        DINOv3(dinov3_dir, pool="avg")


def test_the_encoders_plugin_table_builds_each_encoder(dinov3_dir, tmp_path):
    assert {"dinov3", "dinov2"} <= set(targets("encoders"))
    assert isinstance(load_encoder("dinov3", str(dinov3_dir), setting="s", resolution=64), DINOv3)
    save_tiny_dinov2(tmp_path / "dinov2")
    assert isinstance(load_encoder("dinov2", str(tmp_path / "dinov2"), setting="s"), DINOv2)
