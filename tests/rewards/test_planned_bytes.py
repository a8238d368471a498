"""What each reward states of its size for ``flowalign plan`` (``planned_bytes``): equal to the bytes the built
reward holds, for every model reward's tiny folder; the released models' sizes, built on the meta device from
their published configs; and nothing for a reward on the CPU, behind a server or without weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import rewards
from flowalign.paths import REPO_ROOT
from flowalign.plugins import load_encoder, planned_encoder_bytes
from flowalign.protocols import NotSized
from rewards.planning import REWARD_ARCHITECTURES, module_bytes

TINY = REPO_ROOT / "assets" / "tiny-rewards"


def held_bytes(reward: Any) -> int:
    """Bytes of every module a built reward holds: its attributes and theirs (a backend, an engine, a detector),
    each tensor once. What it moves to the device, found without asking the reward."""
    found: list[torch.nn.Module] = []
    seen: set[int] = set()

    def visit(x: Any, depth: int) -> None:
        if id(x) in seen or depth > 3:
            return
        seen.add(id(x))
        if isinstance(x, torch.nn.Module):
            found.append(x)
        elif isinstance(x, (list, tuple, dict)):
            for v in (x.values() if isinstance(x, dict) else x):
                visit(v, depth + 1)
        elif hasattr(x, "__dict__") and type(x).__module__.startswith("rewards"):
            for v in vars(x).values():
                visit(v, depth + 1)

    visit(reward, 0)
    assert found, f"{type(reward).__name__} holds no module"
    return module_bytes(found)


def params(modules: list[torch.nn.Module]) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


# ------------------------------------------------------------------ the tiny folders: planned = held


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from rewards.ocr.tiny import save_tiny_got_ocr2
    from rewards.tiny_rewards import save_tiny_aesthetic, save_tiny_dinov2, save_tiny_hf_clip, save_tiny_open_clip

    root = tmp_path_factory.mktemp("planned")
    save_tiny_open_clip(root / "open_clip")
    save_tiny_hf_clip(root / "hf_clip")
    save_tiny_aesthetic(root / "aesthetic")
    save_tiny_dinov2(root / "dinov2")
    save_tiny_got_ocr2(root / "got_ocr2")
    return {"open_clip": root / "open_clip", "hf_clip": root / "hf_clip", "aesthetic": root / "aesthetic",
            "dinov2": root / "dinov2", "got_ocr2": root / "got_ocr2"}


TINY_REWARDS = [
    ("hpsv3", lambda f: {"path": str(TINY / "hpsv3"), "dtype": "float32"}),
    ("hpsv3", lambda f: {"path": str(TINY / "hpsv3")}),  # bf16, its default: the rotary tables stay float32
    ("videoalign", lambda f: {"path": str(TINY / "videoalign"), "dtype": "float32"}),
    ("unified_reward", lambda f: {"path": str(TINY / "unified_reward"), "dtype": "float32"}),
    ("imagereward", lambda f: {"path": str(TINY / "imagereward")}),
    ("imagereward", lambda f: {"path": str(TINY / "imagereward"), "dtype": "bf16"}),  # its head stays float32
    ("geneval", lambda f: {"path": str(TINY / "geneval" / "detector"), "clip_path": str(TINY / "geneval" / "clip")}),
    ("pickscore", lambda f: {"path": str(f["hf_clip"]), "dtype": "bf16"}),
    ("clip_score", lambda f: {"path": str(f["open_clip"])}),
    ("clip_score", lambda f: {"path": str(f["hf_clip"]), "dtype": "fp16"}),
    ("aesthetic", lambda f: {"path": str(f["aesthetic"])}),
    ("lpips", lambda f: {"net": "alex", "random_init": True}),
    ("image_similarity", lambda f: {"path": str(f["dinov2"])}),
    ("ocr", lambda f: {"engine": "got_ocr2", "path": str(f["got_ocr2"])}),
    ("clip_score_video", lambda f: {"path": str(f["open_clip"]), "temporal_weight": 0.1}),
]


@pytest.mark.parametrize("name,options", TINY_REWARDS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(TINY_REWARDS)])
def test_planned_bytes_are_the_bytes_the_built_reward_holds(name, options, folders):
    opts = options(folders)
    planned = rewards.planned_bytes(name, opts)
    assert planned == held_bytes(rewards.load(name, **opts)) > 0


def test_an_encoder_states_the_bytes_it_holds(tmp_path):
    from rewards.tiny_rewards import save_tiny_dinov3

    save_tiny_dinov3(tmp_path / "dinov3")
    for dtype in (torch.float32, torch.bfloat16):
        encoder = load_encoder("dinov3", str(tmp_path / "dinov3"), setting="s", dtype=dtype)
        assert planned_encoder_bytes("dinov3", str(tmp_path / "dinov3"), dtype=dtype) == module_bytes([encoder.model])


# ------------------------------------------------------------------ the released models, on the meta device


def test_pickscore_and_hps_are_clip_vit_h_14():
    """PickScore_v1's transformers config and HPS's open_clip ViT-H-14: one network, 986.11 M parameters."""
    from rewards.preference import HPSScore, PickScore

    pick = params(PickScore.planned_modules({"path": "/nowhere/PickScore_v1"}))
    hps = params(HPSScore.planned_modules({"path": "/nowhere/HPS_v2.1_compressed.pt"}))
    assert pick == hps == 986_109_441
    assert 2 * pick < rewards.planned_bytes("pickscore", {"path": "/nowhere/PickScore_v1", "dtype": "bf16"}) < 2 * pick + 1e6


def test_the_vlm_rewards_are_their_released_bases():
    """HPSv3: Qwen2-VL-7B (8.29 B); VideoAlign: Qwen2-VL-2B (2.21 B); UnifiedReward-qwen-7b: Qwen2.5-VL-7B (8.29 B),
    each in bf16 with its small float32 head."""
    from rewards.qwen_vl_reward import meta_qwen2_vl
    from rewards.vlm_backend import LocalVLM

    seven = params([meta_qwen2_vl(REWARD_ARCHITECTURES / "qwen2-vl-7b-instruct", [], torch.bfloat16)])
    two = params([meta_qwen2_vl(REWARD_ARCHITECTURES / "qwen2-vl-2b-instruct", [], torch.bfloat16)])
    assert (seven, two) == (8_291_375_616, 2_208_985_600)
    hpsv3 = rewards.planned_bytes("hpsv3", {"path": "/nowhere/HPSv3", "base": "/nowhere/Qwen2-VL-7B-Instruct"})
    assert 2 * seven < hpsv3 < 2 * seven + 20e6  # the head: 3584 × 1024 float32
    videoalign = rewards.planned_bytes("videoalign", {"path": "/nowhere/VideoReward"})
    assert 2 * two < videoalign < 2 * two + 1e6
    unified = rewards.planned_bytes("unified_reward", {"path": "/nowhere/UnifiedReward-qwen-7b"})
    assert unified == LocalVLM.planned_bytes(REWARD_ARCHITECTURES / "qwen2.5-vl-7b-instruct", "bf16")
    assert 2 * 8_292_166_656 <= unified < 2 * 8_292_166_656 + 1e6
    # float32 doubles it, device: cpu leaves nothing on the GPU
    assert rewards.planned_bytes("hpsv3", {"path": "/nowhere/HPSv3", "dtype": "fp32"}) == pytest.approx(2 * hpsv3, rel=1e-3)
    assert rewards.planned_bytes("hpsv3", {"path": "/nowhere/HPSv3", "device": "cpu"}) == 0


def test_imagereward_geneval_and_gardos_encoder_on_their_published_configs():
    from rewards.aesthetic import AestheticScore
    from rewards.image_encoders import DINOv3
    from rewards.imagereward import ImageReward

    model = ImageReward.planned_modules({"path": "/nowhere/ImageReward"})[0]
    assert (params([model.vision]), params([model]), model.image_size) == (303_301_632, 446_206_689, 224)
    # GenEval's Mask2Former Swin-S and CLIP ViT-L/14, the latter the aesthetic predictor's open_clip ViT-L/14 too
    clip_l = params(AestheticScore.planned_modules({"path": "/nowhere/sac+logos+ava1-l14-linearMSE.pth"})[:1])
    assert clip_l == 427_616_513
    geneval = rewards.planned_bytes("geneval", {"path": "/nowhere/mask2former", "clip_path": "/nowhere/clip"})
    assert 4 * (68_741_083 + clip_l) <= geneval < 4 * (68_741_083 + clip_l) + 1e6
    assert 4 * 303_129_600 <= DINOv3.planned_bytes("/nowhere/dinov3-vitl16-pretrain-lvd1689m") < 4 * 303_129_600 + 1e3


# ------------------------------------------------------------------ what holds nothing, what cannot say


@pytest.mark.parametrize("name,options", [
    ("pickscore", {"path": "/nowhere/PickScore_v1", "device": "cpu"}),
    ("imagereward", {"path": "/nowhere/ImageReward", "device": "cpu"}),
    ("unified_reward", {"url": "http://127.0.0.1:8080/v1"}),
    ("vlm_judge", {"model": "/nowhere/Qwen2.5-VL-7B-Instruct"}),  # its default device is the CPU
    ("vlm_judge_http", {"url": "http://127.0.0.1:8000/v1"}),
    ("remote", {"url": "http://127.0.0.1:8100"}),
    ("vvr", {}), ("jpeg_compressibility", {}), ("ocr", {}), ("compass", {}),
    ("ocr", {"engine": "paddleocr", "path": "/nowhere/paddleocr-en"}),  # PaddleOCR runs on the CPU unless told
    ("compass", {"path": "/nowhere/head.pth"}),  # its quality model scores the images on the CPU
])
def test_a_reward_off_the_gpu_or_without_weights_holds_nothing_there(name, options):
    assert rewards.planned_bytes(name, options) == 0


def test_a_quality_model_told_the_gpu_and_a_video_twin_count_as_the_image_reward():
    head = {"path": "/nowhere/head.pth"}
    aesthetic = rewards.planned_bytes("aesthetic", head)
    assert aesthetic > 0
    assert rewards.planned_bytes("compass", {**head, "quality_options": {"device": "cuda"}}) == aesthetic
    assert rewards.planned_bytes("aesthetic_video", {**head, "temporal_weight": 0.2}) == aesthetic


@pytest.mark.parametrize("name,options,why", [
    ("clip_score", {"path": "/nowhere/clip-vit-base-patch32"}, "path=/nowhere/clip-vit-base-patch32 does not exist"),
    ("image_similarity", {}, "path is not set"),
    ("vlm_judge", {"model": "/nowhere/judge", "device": "cuda"}, "model=/nowhere/judge does not exist"),
    ("unified_reward", {"path": "/nowhere/UnifiedReward-qwen-72b"}, "does not exist"),  # only the 7B ships
    ("ocr", {"engine": "paddleocr", "path": "/nowhere/p", "device": "cuda"}, "Paddle"),
    ("geneval", {"detector": "owlv2"}, "path is not set"),
])
def test_a_reward_that_cannot_be_sized_says_why(name, options, why):
    with pytest.raises(NotSized, match=why.replace("(", r"\(")):
        rewards.planned_bytes(name, options)


def plain_sharpness(samples, prompts, metadata):
    return samples.mean((1, 2, 3))


def test_a_plug_in_without_planned_bytes_is_not_sized():
    with pytest.raises(NotSized, match="does not state its size"):
        rewards.planned_bytes(f"{__name__}:plain_sharpness", {})


def test_every_registered_reward_states_its_size():
    """A new reward must say what it holds: on the CPU every built-in one holds nothing on the GPU, and none is
    left unsized for want of planned_bytes."""
    for name in rewards.available():
        assert rewards.planned_bytes(name, {"device": "cpu"}) == 0, name
