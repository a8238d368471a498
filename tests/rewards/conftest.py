"""Tiny randomly initialised reward models saved in their real on-disk formats, once per session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rewards.tiny_rewards import TINY_OPEN_CLIP


@pytest.fixture(scope="session")
def tiny_open_clip():
    """The tiny open_clip ``CLIP`` in memory (seed 0, eval mode), as saved in ``tiny_open_clip_dir``."""
    import open_clip

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return open_clip.CLIP(**TINY_OPEN_CLIP).eval()


@pytest.fixture(scope="session")
def tiny_open_clip_dir(tmp_path_factory: pytest.TempPathFactory, tiny_open_clip) -> Path:
    """``tiny_open_clip`` as ``local-dir:`` loads it: open_clip_config.json + open_clip_model.safetensors."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("tiny-open-clip")
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY_OPEN_CLIP}))
    state = {k: v.contiguous() for k, v in tiny_open_clip.state_dict().items()}
    save_file(state, folder / "open_clip_model.safetensors")
    return folder


@pytest.fixture
def tiny_open_clip_cfg() -> dict:
    """The tiny open_clip architecture (``model_cfg`` of ``tiny_open_clip_dir``)."""
    return json.loads(json.dumps(TINY_OPEN_CLIP))


@pytest.fixture(scope="session")
def tiny_clip_spec(tiny_open_clip_dir: Path) -> str:
    """The ``model=`` option that loads the tiny open_clip model."""
    return f"local-dir:{tiny_open_clip_dir}"


@pytest.fixture(scope="session")
def tiny_pickscore():
    """A tiny transformers ``CLIPModel`` (seed 0, eval mode) and its offline CLIP tokenizer."""
    from transformers import CLIPConfig, CLIPModel

    from pipelines.tiny import clip_tokenizer

    tok = clip_tokenizer(vocab_size=1024, model_max_length=32)
    text = {"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "max_position_embeddings": 32, "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": 64, "patch_size": 16}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)).eval()
    return model, tok


@pytest.fixture(scope="session")
def tiny_pickscore_dir(tmp_path_factory: pytest.TempPathFactory, tiny_pickscore) -> Path:
    """``tiny_pickscore`` saved as PickScore_v1 and its processor folder are (config.json, safetensors,
    tokenizer files, preprocessor_config.json), in one folder."""
    from transformers import CLIPImageProcessor

    model, tok = tiny_pickscore
    folder = tmp_path_factory.mktemp("tiny-pickscore")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}).save_pretrained(folder)
    return folder


def _images(n: int, size: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, size // 8, size // 8, generator=g)
    return torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)


@pytest.fixture
def images():
    """``images(n, size=64, seed=0)``: smooth random RGB images ``(n, 3, size, size)`` in [0, 1]."""
    return _images


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2.5-VL folder built offline, shared by the judge and server tests."""
    from rewards.vlm_tiny import build_tiny_vlm

    folder = tmp_path_factory.mktemp("tiny-vlm")
    build_tiny_vlm(folder)
    return folder


@pytest.fixture(scope="session")
def hpsv3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``rewards.hpsv3.save_tiny_hpsv3`` (seed 0): the tiny HPSv3 folder, also the one the known answers were
    scored on."""
    from rewards.hpsv3 import save_tiny_hpsv3

    return save_tiny_hpsv3(tmp_path_factory.mktemp("tiny-hpsv3"))


@pytest.fixture(scope="session")
def videoalign_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``rewards.videoalign.save_tiny_videoalign`` (seed 0): the tiny VideoReward folder, also the one the known
    answers were scored on."""
    from rewards.videoalign import save_tiny_videoalign

    return save_tiny_videoalign(tmp_path_factory.mktemp("tiny-videoalign"))
