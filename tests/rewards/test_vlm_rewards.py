"""The Qwen-VL reward models (hpsv3, unified_reward, videoalign): each loads from its tiny architecture-faithful
folder through ``rewards.load(NAME, path=DIR)`` and scores decoded samples of the tiny SD3 / Wan models; the
score formulas and parsers match the references on fixed inputs."""

from __future__ import annotations

import pytest
import torch

import pipelines
import rewards
from flowalign.errors import UserError

PROMPTS = ["a red circle", "a red circle", "two blue squares"]


@pytest.fixture(scope="module")
def images(tiny_sd3_dir) -> torch.Tensor:
    """Three decoded images ``(3, 3, H, W)`` in [0, 1] of the tiny SD3 model."""
    policy = pipelines.load(str(tiny_sd3_dir))
    with torch.no_grad():
        return policy.decode(policy.initial_noise(3, torch.Generator().manual_seed(0))).float().clamp(0, 1)


@pytest.fixture(scope="module")
def videos(tiny_wan_dir) -> torch.Tensor:
    """Two decoded clips ``(2, F, 3, H, W)`` in [0, 1] of the tiny Wan model."""
    policy = pipelines.load(str(tiny_wan_dir))
    with torch.no_grad():
        return policy.decode(policy.initial_noise(2, torch.Generator().manual_seed(0))).float().clamp(0, 1)


def test_hpsv3_scores_decoded_images_from_its_tiny_folder(hpsv3_dir, images):
    reward = rewards.load("hpsv3", path=str(hpsv3_dir), dtype="float32")
    out = reward(images, PROMPTS, [])
    score = out.components["hpsv3"]
    assert score.shape == (3,) and torch.isfinite(score).all() and out.valid.all()
    assert torch.equal(reward(images, PROMPTS, []).components["hpsv3"], score)  # deterministic
    # a sample's score does not depend on the batch it is padded into
    alone = reward(images[2:], PROMPTS[2:], []).components["hpsv3"]
    assert torch.allclose(alone, score[2:], atol=1e-4)
    assert score[0] != score[2] and all("sigma" in x for x in out.info)


def test_hpsv3_score_is_mu_of_the_uncertainty_head():
    from rewards.hpsv3 import hpsv3_head, hpsv3_text, mu

    assert torch.equal(mu(torch.tensor([[2.5, 0.3], [-1.0, 4.0]])), torch.tensor([2.5, -1.0]))
    head = hpsv3_head(64)  # the reference's ranknet head: Linear(h,1024) ReLU Dropout Linear(1024,16) ReLU Linear(16,2)
    assert [tuple(p.shape) for p in head.parameters()] == [(1024, 64), (1024,), (16, 1024), (16,), (2, 16), (2,)]
    text = hpsv3_text("a cat")
    assert "Textual prompt - a cat\n" in text and text.endswith("Please provide the overall ratings of this image: <|Reward|>\n\nEND\n")


def test_checkpoint_keys_of_every_transformers_layout_and_peft_map_to_the_model():
    from rewards.qwen_vl_reward import canonical_key

    assert canonical_key("model.layers.0.mlp.up_proj.weight") == "model.language_model.layers.0.mlp.up_proj.weight"
    assert canonical_key("visual.blocks.1.attn.qkv.weight") == "model.visual.blocks.1.attn.qkv.weight"
    assert canonical_key("model.language_model.norm.weight") == "model.language_model.norm.weight"
    assert canonical_key("base_model.model.model.layers.3.self_attn.q_proj.base_layer.weight") == \
        "model.language_model.layers.3.self_attn.q_proj.weight"
    assert canonical_key("base_model.model.rm_head.weight") == "rm_head.weight"
    assert canonical_key("lm_head.weight") == "lm_head.weight"


def test_videoalign_scores_decoded_videos_from_its_tiny_folder(videoalign_dir, videos):
    reward = rewards.load("videoalign", path=str(videoalign_dir), dtype="float32", batch_size=1)
    out = reward(videos, PROMPTS[1:], [])
    score = out.components["videoalign"]
    assert score.shape == (2,) and torch.isfinite(score).all() and out.valid.all()
    assert torch.equal(reward(videos, PROMPTS[1:], []).components["videoalign"], score)
    for x, s in zip(out.info, score.tolist()):  # Overall = VQ + MQ + TA, each standardised
        assert x["overall"] == pytest.approx(x["vq"] + x["mq"] + x["ta"], abs=1e-5) and x["overall"] == pytest.approx(s, abs=1e-5)
    ta = rewards.load("videoalign", path=str(videoalign_dir), dtype="float32", component="ta")
    assert torch.allclose(ta(videos, PROMPTS[1:], []).components["videoalign"], torch.tensor([x["ta"] for x in out.info]),
                          atol=1e-4)
    with pytest.raises(UserError, match="scores videos"):
        reward(videos[:, 0], PROMPTS[1:], [])


def test_videoalign_lora_is_merged_into_the_base_weights(videoalign_dir):
    """Loading applies the adapter: the decoder's weights differ from the base model's by exactly (α/r)·B·A."""
    from safetensors.torch import load_file
    from transformers import Qwen2VLForConditionalGeneration

    reward = rewards.load("videoalign", path=str(videoalign_dir), dtype="float32")
    base = Qwen2VLForConditionalGeneration.from_pretrained(videoalign_dir / "base")
    lora = load_file(videoalign_dir / "checkpoint-1" / "adapter_model.safetensors")
    name = "layers.1.mlp.down_proj"
    a, b = lora[f"base_model.model.model.{name}.lora_A.weight"], lora[f"base_model.model.model.{name}.lora_B.weight"]
    merged = reward.model.model.language_model.get_submodule(name).weight
    expected = base.model.language_model.get_submodule(name).weight + 8 / 4 * b @ a  # tiny lora_alpha 8, r 4
    assert torch.allclose(merged, expected, atol=1e-6)


def test_videoalign_frames_and_formula_match_the_reference():
    from rewards.videoalign import frame_indices, overall

    # qwen_vl_utils smart_nframes at fps 2: an 81-frame clip at 16 fps → 10 frames; short clips → at least 4
    assert frame_indices(81, 16, 2) == [0, 9, 18, 27, 36, 44, 53, 62, 71, 80]
    assert frame_indices(9, 16, 2) == [0, 3, 5, 8]
    raw = torch.tensor([[1.0, 2.0, 3.0]])
    norm = {"VQ_mean": 1.0, "VQ_std": 2.0, "MQ_mean": 0.0, "MQ_std": 4.0, "TA_mean": 1.0, "TA_std": 1.0}
    out = overall(raw, norm)
    assert out["vq"].item() == 0.0 and out["mq"].item() == 0.5 and out["ta"].item() == 2.0 and out["overall"].item() == 2.5
    assert overall(raw, None)["overall"].item() == 6.0


@pytest.fixture(scope="module")
def unified_dir(tmp_path_factory):
    from rewards.unified_reward import save_tiny_unified_reward

    return save_tiny_unified_reward(tmp_path_factory.mktemp("tiny-unified-reward"))


def test_unified_reward_score_mode_parses_the_generated_reply(unified_dir, images):
    reward = rewards.load("unified_reward", path=str(unified_dir), dtype="float32", max_tokens=16)
    out = reward(images, PROMPTS, [])
    # the tiny model writes "... Final Score:4": Flow-GRPO's form x / 5
    assert torch.equal(out.components["unified_reward"], torch.full((3,), 0.8)) and out.valid.all()
    assert out.info[0]["reply"].endswith("Final Score:4")
    raw = rewards.load("unified_reward", path=str(unified_dir), dtype="float32", max_tokens=16, normalize=False)
    assert torch.equal(raw(images[:1], PROMPTS[:1], []).components["unified_reward"], torch.tensor([4.0]))


def test_entries_naming_one_judge_folder_hold_one_copy_of_it(unified_dir, images):
    """Two dimensions of one local judge (Pref-GRPO's alignment and style) load its weights once; another dtype
    is another copy; the copy goes when no reward holds it."""
    import gc

    from rewards.vlm_backend import LocalVLM

    alignment = rewards.load("unified_reward", path=str(unified_dir), dtype="float32", mode="dimension",
                             dimension="alignment")
    style = rewards.load("unified_reward", path=str(unified_dir), dtype="float32", mode="dimension",
                         dimension="style")
    other = rewards.load("unified_reward", path=str(unified_dir), dtype="bf16")
    assert alignment.backend is style.backend and other.backend is not alignment.backend
    # the shared judge answers both entries, and the second reads the reply the first got (one request)
    asked = []
    complete = alignment.backend.complete
    alignment.backend.complete = lambda requests: asked.append(len(requests)) or complete(requests)
    first, second = alignment(images[:1], PROMPTS[:1], []), style(images[:1], PROMPTS[:1], [])
    assert first.info[0]["reply"] == second.info[0]["reply"] and first.info[0]["reply"] and asked == [1]
    del alignment.backend.complete, complete  # the bound method holds the judge
    held = len(LocalVLM._loaded)
    del alignment, style
    gc.collect()
    assert len(LocalVLM._loaded) == held - 1


def test_unified_reward_think_pairwise_gives_win_rates_per_prompt(unified_dir, images):
    # the tiny model writes "Image 2 is better" with no <answer> block: Pref-GRPO's reading (verdict_parse:
    # answer, the default) names no winner, a tie; the former lenient reading finds the verdict outside the block
    reward = rewards.load("unified_reward", path=str(unified_dir), dtype="float32", max_tokens=16,
                          mode="think_pairwise")
    out = reward(images, PROMPTS, [])
    assert out.components["unified_reward"][:2].tolist() == [0.5, 0.5] and out.valid.tolist() == [True, True, False]
    lenient = rewards.load("unified_reward", path=str(unified_dir), dtype="float32", max_tokens=16,
                           mode="think_pairwise", verdict_parse="lenient")
    out = lenient(images, PROMPTS, [])
    # "Image 2 is better" always: of the pair sharing a prompt the second wins; the lone sample has no pair
    assert out.components["unified_reward"][:2].tolist() == [0.0, 1.0] and out.valid.tolist() == [True, True, False]
    assert "at least 2 samples" in out.info[2]["reason"]


@pytest.mark.parametrize("no_verdict,expected", [("tie", [0.5, 0.5]), ("unread", [None, None])])
def test_a_pairwise_reply_without_a_verdict_is_a_tie_or_unread(unified_dir, images, no_verdict, expected):
    """Pref-GRPO counts an answer naming no winner as half a win to each image; ``unread`` leaves it out, and
    a sample with no comparison read is invalid."""
    from rewards.vlm_backend import Completion

    reward = rewards.load("unified_reward", path=str(unified_dir), dtype="float32", max_tokens=16,
                          mode="think_pairwise", no_verdict=no_verdict)
    reward.backend.complete = lambda requests: [Completion("<answer>Both are equally good</answer>", [])
                                                for _ in requests]
    out = reward(images[:2], PROMPTS[:2], [])
    if expected[0] is None:
        assert out.valid.tolist() == [False, False]
    else:
        assert out.components["unified_reward"].tolist() == expected and out.valid.all()


def test_unified_reward_parsers_and_win_rates_on_fixed_replies():
    from rewards.unified_reward import parse_final_score, parse_verdict, win_rates

    assert parse_final_score("The image is sharp.\nFinal Score: 4.5") == 4.5
    assert parse_final_score("Final Score: 7") is None  # Flow-GRPO's pattern reads 1..5 only
    assert parse_final_score("I would give it 3") is None
    assert parse_verdict("<think>Image 1 is better on colour</think>\n<answer>Image 2 is better</answer>") == 2
    assert parse_verdict("<think>...</think> no verdict") is None
    rates, read = win_rates(3, [(0, 1, 1), (0, 2, 2), (1, 2, None)])
    assert rates == [0.5, 0.0, 1.0] and read == [2, 1, 1]
    # Pref-GRPO's count: a reply naming no winner is half a win to each (unifiedreward_think.py)
    rates, read = win_rates(3, [(0, 1, 1), (0, 2, 0), (1, 2, 0)])
    assert rates == [0.75, 0.25, 0.5] and read == [2, 2, 2]


@pytest.mark.parametrize("name,download", [("hpsv3", "HPSv3"), ("videoalign", "VideoReward"),
                                           ("unified_reward", "UnifiedReward")])
def test_a_missing_path_is_one_line_naming_the_reward_the_option_and_the_download(name, download, tmp_path):
    with pytest.raises(UserError) as e:
        rewards.load(name, path=str(tmp_path / "nowhere"))
    message = str(e.value)
    assert "\n" not in message and message.startswith(name) and "path=" in message and download in message
    if name != "unified_reward":
        with pytest.raises(UserError, match=f"{name} reward: set path:"):
            rewards.load(name)


@pytest.mark.parametrize("name,match", [("hpsv3", "holds no HPSv3.safetensors"), ("videoalign", "has no model_config.json"),
                                        ("unified_reward", "is not a model folder")])
def test_a_folder_without_the_reward_files_is_one_line(name, match, tmp_path):
    with pytest.raises(UserError, match=match) as e:
        rewards.load(name, path=str(tmp_path))
    assert "\n" not in str(e.value)
