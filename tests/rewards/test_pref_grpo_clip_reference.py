"""``clip_score`` against Pref-GRPO's CLIP reward (known answers): ``init_clip_model`` + ``compute_clip_score`` of
their ``fastvideo/rewards/clip_reward.py``, the images written as PNG and read back as their dispatcher does, on the
tiny open_clip of ``conftest.py`` (``known_answers/pref_grpo_clip_score.json``, provenance inside).

Their image reaches the model through open_clip's own evaluation transform of a PIL image (PIL's bicubic resize,
which rounds to 8 bits after each pass, the centre crop, ``ToTensor``): ``pixels: pil`` does the same and gives
their scores to 1e-6; the float path (the default) resizes the floats and misses them by the rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import rewards
from flowalign.errors import UserError

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "pref_grpo_clip_score.json").read_text())


def images() -> torch.Tensor:
    rng = np.random.RandomState(KNOWN["images"]["seed"])
    return [torch.from_numpy((rng.rand(h, w, 3) * 255).astype(np.uint8)).permute(2, 0, 1).float() / 255
            for h, w in KNOWN["images"]["sizes_hw"]]


def test_pixels_pil_equals_their_clip_reward(tiny_open_clip_dir):
    reward = rewards.load("clip_score", path=str(tiny_open_clip_dir), pixels="pil")
    float_path = rewards.load("clip_score", path=str(tiny_open_clip_dir))
    assert reward.differentiable is False and float_path.differentiable is True
    theirs = torch.tensor(KNOWN["scores"])
    ours = torch.cat([reward(x[None], [p], []).components["clip_score"] for x, p in zip(images(), KNOWN["prompts"])])
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    rounded = torch.cat([float_path(x[None], [p], []).components["clip_score"]
                         for x, p in zip(images(), KNOWN["prompts"])])
    assert (rounded - theirs).abs().max() > 1e-5  # what the 8-bit rounding of PIL's resize moves


def test_pixels_pil_takes_the_models_own_resize_and_crop(tiny_open_clip_dir):
    for extra, message in (({"crop_offset": "floor"}, "crop_offset: round"), ({"form": "flow_grpo"}, "interpolation"),
                           ({"resize": "pad"}, "resize: model")):
        with pytest.raises(UserError, match=message):
            rewards.load("clip_score", path=str(tiny_open_clip_dir), pixels="pil", **extra)
