"""``videoalign`` against KwaiVGI/VideoAlign's ``VideoVLMRewardInference`` (known answers).

KwaiVGI/VideoAlign@219ab9d (its pinned transformers 4.45.2; peft 0.13.2) was run on the tiny folder of
``save_tiny_videoalign`` (seed 0, ``conftest.py`` ``videoalign_dir``): their ``create_model_and_processor`` and
``load_model_from_checkpoint`` built their ``Qwen2VLRewardModelBT`` under PEFT's LoRA from ``model_config.json``,
``checkpoint-1/adapter_model.safetensors`` and ``non_lora_state_dict.pth``, and their ``reward(videos, prompts,
use_norm=True)`` (and ``use_norm=False``) scored the clips through their ``vision_process`` (``smart_nframes`` at
``data_config.fps`` with the clip's own fps, uniform sampling, ``smart_resize`` within ``[128·28²,
max_frame_pixels]``, torchvision's antialiased bicubic on the uint8 frames), their "detailed_special" prompt, their
forward (``position_ids=None``: plain positions) and ``_norm`` with ``inference_config``. Only names and paths were
mapped: ``base/`` re-laid in transformers 4.45.2's file layout with Qwen2-VL-2B-Instruct's own pixel bounds,
``model_name_or_path`` made absolute, ``data_config`` given the ``meta_data``/``data_dir`` keys a released
``model_config.json`` carries (their loader deletes them), their own ``disable_flash_attn2`` switch on (no flash-attn
on a CPU), and ``torchvision.io.read_video`` (gone from torchvision 0.29) answering a clip's name with its uint8
frames and fps, so their reader chose and resized the frames. Float32 on the CPU on both sides. Their numbers
are kept in ``known_answers/videoalign_reference.json`` (provenance inside).

Tolerance 1e-5 (seen: 7.7e-7 on the raw head outputs, 6.2e-7 on Overall; flowalign merges the LoRA factors into the
weights where PEFT adds ``(α/r)·B·A·x`` on the side). On Overall (about −1; clips 3e-3 apart) each of these moves
some batch by far more: no normalisation 0.44, the samples' fps read as 24 for a 16 or 8 fps clip 0.21, 4 fps
sampling 0.34, the first n frames in place of evenly spaced ones 0.26, a frame floor of 4·28² (the image default) in
place of 128·28² 0.36, a per-frame budget of 128·28² 0.022, bilinear frames 0.017, no antialiasing 5.4e-3,
Qwen2-VL's 3-D M-RoPE positions 0.064, the LoRA scaled by α instead of α/r 0.84 or left out 0.27 (the least,
5.4e-3, is 540× the tolerance).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import rewards
from rewards.videoalign import frame_indices
from tests.rewards.known_hashes import ids_sha256, tensors_sha256
from tests.rewards.known_images import known_clips

ANSWERS = json.loads((Path(__file__).parent / "known_answers" / "videoalign_reference.json").read_text())
BATCHES = list(ANSWERS["batches"])
#: see the module docstring
TOLERANCE = 1e-5


def load(folder: Path, fps: float, **options):
    return rewards.load("videoalign", path=str(folder), dtype="float32", device="cpu", fps=fps, **options)


def test_the_tiny_folder_is_the_one_their_code_scored(videoalign_dir):
    ckpt = videoalign_dir / "checkpoint-1"
    files = [videoalign_dir / "base" / "model.safetensors", ckpt / "adapter_model.safetensors",
             ckpt / "non_lora_state_dict.pth"]
    assert tensors_sha256(files) == ANSWERS["model"]["tiny_tensors_sha256"]
    config = json.loads((videoalign_dir / "model_config.json").read_text())
    assert config["inference_config"] == ANSWERS["inference_config"]


@pytest.mark.parametrize("case", ANSWERS["sampling"], ids=lambda c: f"{c['total']}-{c.get('fps')}-{c.get('sample_fps')}"
                         f"-{c.get('num_frames')}")
def test_frames_read_are_theirs(case):
    """Their ``smart_nframes`` and uniform sampling: at least 4 frames, at most ``min(F, 768)``, an even count; or
    a checkpoint's ``num_frames`` rounded to an even count."""
    got = frame_indices(case["total"], case.get("fps", 16), case.get("sample_fps", 2.0), case.get("num_frames"))
    assert got == case["frames_read"]


@pytest.mark.parametrize("name", BATCHES)
def test_videoalign_gives_the_model_their_frames_tokens_and_grid(videoalign_dir, name):
    spec = ANSWERS["batches"][name]
    clips, prompts = known_clips(spec)
    reward = load(videoalign_dir, spec["fps"])
    assert frame_indices(spec["shape"][0], spec["fps"], reward.sample_fps) == spec["frames_read"]
    inputs = reward._inputs(clips, prompts)
    assert inputs["video_grid_thw"].tolist() == spec["video_grid_thw"]
    assert inputs["input_ids"].shape[1] == spec["input_length"]
    assert ids_sha256(inputs["input_ids"], inputs["attention_mask"]) == spec["input_ids_sha256"]


@pytest.mark.parametrize("name", BATCHES)
def test_videoalign_scores_equal_the_inferencers(videoalign_dir, name):
    """Overall (the reward), the standardised VQ, MQ and TA in ``info``, and with ``normalize: false`` the raw
    head outputs (their ``use_norm=False``)."""
    spec = ANSWERS["batches"][name]
    clips, prompts = known_clips(spec)
    out = load(videoalign_dir, spec["fps"])(clips, prompts, [])
    theirs = {k: torch.tensor([n[k] for n in spec["normalized"]]) for k in ("VQ", "MQ", "TA", "Overall")}
    torch.testing.assert_close(out.components["videoalign"], theirs["Overall"].float(), atol=TOLERANCE, rtol=0)
    for k, v in theirs.items():
        torch.testing.assert_close(torch.tensor([i[k.lower()] for i in out.info]), v.float(), atol=TOLERANCE, rtol=0)
    raw = load(videoalign_dir, spec["fps"], normalize=False)(clips, prompts, [])
    got = torch.tensor([[i["vq"], i["mq"], i["ta"]] for i in raw.info])
    torch.testing.assert_close(got, torch.tensor(spec["raw"]), atol=TOLERANCE, rtol=0)


def test_a_checkpoint_trained_on_a_frame_count_reads_that_many_frames(videoalign_dir, tmp_path):
    """``data_config.num_frames`` set: their ``prepare_batch`` asks for ``nframes`` in place of the rate; an explicit
    ``sample_fps`` goes back to the rate."""
    folder = tmp_path / "videoreward"
    shutil.copytree(videoalign_dir, folder)
    config = json.loads((folder / "model_config.json").read_text())
    config["data_config"]["num_frames"] = 7  # their round_by_factor: 8
    (folder / "model_config.json").write_text(json.dumps(config))
    clip = known_clips(ANSWERS["batches"]["fps8"])[0][0]
    assert load(folder, 8)._video(clip).shape[0] == 8
    assert load(folder, 8, sample_fps=1.0)._video(clip).shape[0] == 4  # 33 frames at 8 fps, 1 a second: 4
