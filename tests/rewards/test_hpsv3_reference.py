"""``hpsv3`` against hpsv3 1.0.0's ``HPSv3RewardInferencer`` (known answers).

The hpsv3 1.0.0 wheel (the package of MizzenAI/HPSv3; it pins transformers 4.45.2) was run on the tiny folder of
``save_tiny_hpsv3`` (seed 0, ``conftest.py`` ``hpsv3_dir``): their ``create_model_and_processor`` built their
``Qwen2VLRewardModelBT`` with the ``ranknet`` head, their strict load read ``HPSv3.safetensors``, and their
``reward(images, prompts)`` scored PIL images through their ``prepare_batch`` (``fetch_image``: ``smart_resize`` to
``min_pixels = max_pixels = 256·28²``, PIL bicubic; their instruction ending in ``<|Reward|>``; the chat template)
and their forward (``position_ids=None``: text positions ``0..L−1`` on all three M-RoPE axes). Only names and
paths were mapped: the folder re-laid in transformers 4.45.2's file layout (flat ``config.json``, 4.45's key
names, ``chat_template.json``), its ``preprocessor_config.json`` given Qwen2-VL-7B-Instruct's own pixel bounds
(the bounds flowalign's loader sets), and their ``HPSv3_7B.yaml`` pointed at it in float32 on the CPU (on a CPU
their head's CUDA autocast is off, so bf16 cannot feed the float32 head). Their μ and σ, and hashes of their
token ids, are kept in ``known_answers/hpsv3_reference.json`` (provenance inside); each test feeds the same
images and prompts to flowalign's ``hpsv3`` in float32.

Tolerance 1e-6 (seen: 6e-8; μ of the tiny model lies near −0.14, images 6e-3 apart). Each of these moves some
batch by far more: bilinear resampling 7.7e-4, Lanczos 3.6e-4, a budget of 128·28² or 324·28² pixels 7.1e-3 and
8.0e-3, Qwen2-VL's 3-D M-RoPE positions for the image tokens (transformers' ``get_rope_index``) in place of the
reference's plain positions 2.0e-4, the prompt without HPSv3's instruction 3.6e-2, 0.5 mean/std 1.5e-2 (the
least, 2.0e-4, is 200× the tolerance); each of them moves every batch by 2.2e-5 or more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rewards
from tests.rewards.known_hashes import ids_sha256, tensors_sha256
from tests.rewards.known_images import known_batch

ANSWERS = json.loads((Path(__file__).parent / "known_answers" / "hpsv3_reference.json").read_text())
BATCHES = list(ANSWERS["batches"])
#: see the module docstring
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def hpsv3(hpsv3_dir):
    return rewards.load("hpsv3", path=str(hpsv3_dir), dtype="float32", device="cpu")


def test_the_tiny_folder_is_the_one_their_code_scored(hpsv3_dir):
    assert tensors_sha256([hpsv3_dir / "HPSv3.safetensors"]) == ANSWERS["model"]["tiny_tensors_sha256"]


@pytest.mark.parametrize("name", BATCHES)
def test_hpsv3_gives_the_model_their_tokens_and_image_grid(hpsv3, name):
    """The same token ids (their instruction, the chat template, ``<|Reward|>``, one ``<|image_pad|>`` a visual
    token) and the same ``smart_resize`` grid, square, wide and larger than the budget alike."""
    spec = ANSWERS["batches"][name]
    inputs = hpsv3._inputs(*known_batch(spec))
    assert inputs["image_grid_thw"].tolist() == spec["image_grid_thw"]
    assert inputs["input_ids"].shape[1] == spec["input_length"]
    assert ids_sha256(inputs["input_ids"], inputs["attention_mask"]) == spec["input_ids_sha256"]


@pytest.mark.parametrize("name", BATCHES)
def test_hpsv3_mu_and_sigma_equal_the_inferencers(hpsv3, name):
    spec = ANSWERS["batches"][name]
    x, prompts = known_batch(spec)
    out = hpsv3(x, prompts, [])
    torch.testing.assert_close(out.components["hpsv3"], torch.tensor(spec["mu"]), atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(torch.tensor([i["sigma"] for i in out.info]), torch.tensor(spec["sigma"]),
                               atol=TOLERANCE, rtol=0)


def test_hpsv3_video_is_the_mean_of_the_frames_mu_as_kvpos_video_hpsv3(hpsv3, hpsv3_dir):
    """``hpsv3_video``: every frame scored with its video's prompt, μ averaged over the frames (KVPO @ 7703196,
    ``rewards/rewards.py`` ``video_hpsv3_local``: the all-frame average is its reward); frames of the known
    batch, whose μ the image reward reproduces above."""
    x, prompts = known_batch(ANSWERS["batches"]["square96"])
    video = rewards.load("hpsv3_video", path=str(hpsv3_dir), dtype="float32", device="cpu")
    out = video(x[None], [prompts[0]], [{}])
    per_frame = hpsv3(x, [prompts[0]] * len(x), []).components["hpsv3"]
    assert out.components["hpsv3"].item() == pytest.approx(per_frame.mean().item(), abs=TOLERANCE)
    assert per_frame.std() > 10 * TOLERANCE  # the frames score differently: the mean is not any one of them
