"""``flowalign pretrain-tiny kontext_sr``: its training pairs are the policy's own (LR resized as the Kontext
policy resizes its input image, HR rendered at the model size), from training scenes only, and a bad
starting folder is one line."""

import argparse

import pytest
import torch

from flowalign.errors import UserError
from flowalign.sampling.inputs import load_input_image
from pipelines._common import resize_input
from pipelines.pretrain import kontext_sr
from rewards.sr import generate_sr_tasks, load_split, render_hr, render_lr, scene_key


def test_pairs_are_lr_as_the_policy_sees_it_then_hr_from_training_scenes():
    data = kontext_sr.render_pairs(4, {"easy": 0.5, "hard": 0.5}, seed=0, size=32)
    assert data["pixels"].shape == (8, 3, 32, 32) and data["pixels"].dtype == torch.uint8
    assert data["levels"] == ["easy", "easy", "hard", "hard"] and len(set(data["prompts"])) == 1
    task = generate_sr_tasks(2, seed=0, level="easy")[0]  # level 0 of the mix draws with task seed 0
    lr = resize_input(load_input_image(render_lr(task)), 32, 32)
    hr = load_input_image(render_hr(task, 32))
    assert torch.equal(data["pixels"][0], (lr * 255).round().to(torch.uint8))
    assert torch.equal(data["pixels"][1], (hr * 255).round().to(torch.uint8))
    assert (data["pixels"][0].float() - data["pixels"][1].float()).abs().mean() > 1  # the LR is degraded
    held_out = {scene_key(t.scene) for t in load_split("hard", "test")}
    assert not {scene_key(t.scene) for t in generate_sr_tasks(2, seed=1, level="hard")} & held_out


def test_it_starts_only_from_a_kontext_folder(tmp_path):
    with pytest.raises(UserError, match="--init-from .*FLUX.1 Kontext folder"):
        kontext_sr.check(argparse.Namespace(init_from=str(tmp_path), cfg=1.0))
