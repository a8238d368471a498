"""Model rewards take their weights as ``path:``: each loads from a ``flowalign tiny-reward`` folder and scores
real decoded samples of the tiny SD3 model; a missing path is one line; the old option names still work with
a deprecation line; the score formulas match hand-computed references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pipelines
import rewards
from flowalign.cli.main import main
from flowalign.errors import UserError
from rewards.tiny_rewards import TINY_BUILDERS

MINE = ["pickscore", "hps", "clip_score", "aesthetic", "image_similarity", "imagereward"]
PROMPTS = ["a red circle", "two blue squares", "a red circle"]


@pytest.fixture(scope="module")
def tiny_reward_dir(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_reward_dir(name)``: the folder ``flowalign tiny-reward NAME --out DIR`` writes, once per module."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            out = tmp_path_factory.mktemp(f"tiny-reward-{name}") / "weights"
            assert main(["tiny-reward", name, "--out", str(out)]) == 0
            made[name] = out
        return made[name]

    return get


@pytest.fixture(scope="module")
def decoded(tiny_sd3_dir) -> torch.Tensor:
    """Three 32 px images the tiny SD3 model samples (3 Euler steps) and its VAE decodes."""
    policy = pipelines.load(tiny_sd3_dir)
    with torch.no_grad():
        cond = policy.encode(PROMPTS)
        x = policy.initial_noise(3, torch.Generator().manual_seed(0))
        grid = policy.sigmas(3)
        for k in range(len(grid) - 1):
            x = x + (grid[k + 1] - grid[k]) * policy.velocity(x, grid[k], cond, 1.0)
        return policy.decode(x)


def _metadata(images: torch.Tensor) -> list[dict]:
    # an editing prompt's source image: here the flipped sample, so the similarity is below 1
    return [{"image": img.flip(-1)} for img in images]


@pytest.mark.parametrize("name", MINE)
def test_each_model_reward_loads_its_tiny_folder_and_scores_decoded_samples(name, tiny_reward_dir, decoded):
    assert name in TINY_BUILDERS
    reward = rewards.load(name, path=str(tiny_reward_dir(name)))
    out = reward(decoded, PROMPTS, _metadata(decoded))
    score = out.components[name]
    assert score.shape == (3,) and score.dtype == torch.float32 and torch.isfinite(score).all()
    assert out.valid.all()
    assert torch.equal(reward(decoded, PROMPTS, _metadata(decoded)).components[name], score)  # deterministic
    assert not torch.allclose(score, score[:1].expand(3))  # the samples differ, so do their scores


@pytest.mark.parametrize("name", MINE)
def test_a_missing_path_is_one_line_naming_the_reward_option_and_download(name, tmp_path):
    with pytest.raises(UserError) as unset:
        rewards.load(name)
    with pytest.raises(UserError) as absent:
        rewards.load(name, path=str(tmp_path / "nothing"))
    for err in (unset, absent):
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"{name} reward: path") and "download " in message


def test_tiny_reward_refuses_a_folder_it_did_not_write(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["tiny-reward", "hps", "--out", str(out)]) == 2  # a UserError
    assert "holds files this command did not write (notes.txt)" in capsys.readouterr().err
    assert main(["tiny-reward", "hps", "--out", str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "keep me" and (out / "open_clip_config.json").is_file()
    assert main(["tiny-reward", "hps", "--out", str(out)]) == 0  # its own folder: rewritten


def test_old_option_names_still_work_with_one_deprecation_line(tiny_reward_dir, decoded, capsys):
    pick = str(tiny_reward_dir("pickscore"))
    clip = str(tiny_reward_dir("clip_score"))
    aes = tiny_reward_dir("aesthetic")
    cases = [
        ("pickscore", {"model": pick, "processor": pick}, {"path": pick}, ["model", "processor"]),
        ("clip_score", {"model": f"local-dir:{clip}"}, {"path": clip}, ["model"]),
        ("hps", {"model": f"local-dir:{clip}"}, {"path": clip}, ["model"]),
        ("aesthetic", {"head_path": str(aes / "head.safetensors"), "model": f"local-dir:{aes / 'clip'}"},
         {"path": str(aes)}, ["head_path", "model"]),
    ]
    for name, old, new, names in cases:
        capsys.readouterr()
        before = rewards.load(name, **old)(decoded, PROMPTS, []).components[name]
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
        assert lines == [f"warning: {name} reward: option {o!r} is deprecated; use "
                         f"{lines[i].split('use ', 1)[1]}" for i, o in enumerate(names)]
        assert all("deprecated" in ln and "instead" in ln for ln in lines)
        torch.testing.assert_close(before, rewards.load(name, **new)(decoded, PROMPTS, []).components[name])


def test_pickscore_forms_match_the_hand_computed_formulas(tiny_reward_dir, images):
    """``flow_grpo``: exp(s)·cos/26 (Flow-GRPO's pickscore_scorer); ``logit``: exp(s)·cos; ``cosine``: cos —
    computed here with transformers' own model, processor-free at the model's 64 px (no resize)."""
    from transformers import AutoTokenizer, CLIPModel

    folder = tiny_reward_dir("pickscore")
    model, tok = CLIPModel.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    x = images(3, size=64, seed=5)
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073])[:, None, None]
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711])[:, None, None]
    with torch.no_grad():
        img = F.normalize(model.get_image_features(pixel_values=(x - mean) / std).pooler_output, dim=-1)
        txt = F.normalize(model.get_text_features(**tok(PROMPTS, padding=True, return_tensors="pt")).pooler_output,
                          dim=-1)
    cosine = (img * txt).sum(-1)
    scale = model.logit_scale.exp()
    expected = {"flow_grpo": scale * cosine / 26, "logit": scale * cosine, "cosine": cosine}
    default = rewards.load("pickscore", path=str(folder))(x, PROMPTS, []).total
    torch.testing.assert_close(default, expected["flow_grpo"], atol=1e-5, rtol=1e-5)
    for form, want in expected.items():
        got = rewards.load("pickscore", path=str(folder), form=form)(x, PROMPTS, []).total
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(UserError, match="form='raw' is not known; use one of flow_grpo, logit, cosine"):
        rewards.load("pickscore", path=str(folder), form="raw")
    # scale: the divisor itself (26 is Flow-GRPO's, 1 the paper's logit; any other divides the logit)
    for divisor, want in ((26, expected["flow_grpo"]), (1, expected["logit"]), (100.0, scale * cosine / 100)):
        got = rewards.load("pickscore", path=str(folder), scale=divisor)(x, PROMPTS, []).total
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for bad, needle in (({"scale": 0}, "scale=0 must be a positive number"),
                        ({"scale": -26}, "scale=-26 must be a positive number"),
                        ({"scale": 26, "form": "cosine"}, "form: cosine does not use")):
        with pytest.raises(UserError, match=needle):
            rewards.load("pickscore", path=str(folder), **bad)


def test_aesthetic_equals_the_head_on_the_normalised_clip_embedding(tiny_reward_dir, images):
    import open_clip
    from safetensors.torch import load_file

    from rewards.aesthetic import AestheticHead
    from rewards.tiny_rewards import TINY_OPEN_CLIP

    folder = tiny_reward_dir("aesthetic")
    clip = open_clip.CLIP(**TINY_OPEN_CLIP).eval()
    clip.load_state_dict(load_file(folder / "clip" / "open_clip_model.safetensors"))
    head = AestheticHead(TINY_OPEN_CLIP["embed_dim"]).eval()
    head.load_state_dict(load_file(folder / "head.safetensors"))
    x = images(2, size=64, seed=6)
    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN)[:, None, None]
    std = torch.tensor(open_clip.OPENAI_DATASET_STD)[:, None, None]
    with torch.no_grad():
        expected = head(F.normalize(clip.encode_image((x - mean) / std), dim=-1))
    got = rewards.load("aesthetic", path=str(folder))(x, ["", ""], []).total
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_image_similarity_is_the_cosine_of_dinov2_cls_features(tiny_reward_dir, images):
    """DINOv2's processor resizes the shortest side to 256/224 of the crop, centre-crops, normalises with
    ImageNet statistics; the feature is the layer-normed CLS token (``pooler_output``)."""
    from transformers import AutoImageProcessor, Dinov2Model

    folder = tiny_reward_dir("image_similarity")
    model, processor = Dinov2Model.from_pretrained(folder).eval(), AutoImageProcessor.from_pretrained(folder)
    edge, crop = processor.size["shortest_edge"], processor.crop_size["height"]
    x, ref = images(2, size=edge, seed=7), images(2, size=edge, seed=8)  # square at the resize side: crop only
    mean, std = torch.tensor(processor.image_mean)[:, None, None], torch.tensor(processor.image_std)[:, None, None]
    top = (edge - crop) // 2

    def feat(t: torch.Tensor) -> torch.Tensor:
        t = (t[..., top : top + crop, top : top + crop] - mean) / std
        return F.normalize(model(pixel_values=t).pooler_output, dim=-1)

    with torch.no_grad():
        expected = (feat(x) * feat(ref)).sum(-1)
    reward = rewards.load("image_similarity", path=str(folder))
    out = reward(x, ["", ""], [{"image": ref[0]}, {"image": ref[1]}])
    torch.testing.assert_close(out.total, expected, atol=1e-5, rtol=1e-5)
    same = reward(x, ["", ""], [{"image": x[0]}, {}])  # the sample itself scores 1; no reference: invalid
    assert same.total[0].item() == pytest.approx(1.0, abs=1e-5) and same.valid.tolist() == [True, False]


def test_image_similarity_with_the_clip_backbone(tiny_reward_dir, images):
    folder = str(tiny_reward_dir("clip_score"))
    clip = rewards.load("clip_score", path=folder).clip
    x, ref = images(2, seed=9), images(2, seed=10)
    expected = (clip.encode_images(x) * clip.encode_images(ref)).sum(-1)
    got = rewards.load("image_similarity", path=folder, backbone="clip")(x, ["", ""], [{"image": r} for r in ref])
    torch.testing.assert_close(got.total, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(UserError, match="backbone='siglip' is not known"):
        rewards.load("image_similarity", path=folder, backbone="siglip")


def test_tiny_reward_of_a_reward_with_several_folders_prints_the_options_that_load_it(tmp_path, capsys):
    """GenEval's detector and CLIP are two downloads: the command says which option takes which folder,
    and those options load the reward."""
    out = tmp_path / "geneval"
    assert main(["tiny-reward", "geneval", "--out", str(out)]) == 0
    line = capsys.readouterr().out
    assert f"path: {out / 'detector'}" in line and f"clip_path: {out / 'clip'}" in line
    reward = rewards.load("geneval", path=str(out / "detector"), clip_path=str(out / "clip"))
    assert callable(reward)
    assert {"hpsv3", "unified_reward", "videoalign"} <= set(TINY_BUILDERS)


def test_imagereward_loads_the_checkpoint_file_too_and_names_a_missing_config(tiny_reward_dir, decoded, tmp_path):
    """``path:`` may be the folder or ``ImageReward.pt`` itself (its ``med_config.json`` beside it); the score
    is differentiable in the samples (ReFL ascends it); a checkpoint without its config is one line."""
    import shutil

    folder = tiny_reward_dir("imagereward")
    by_folder = rewards.load("imagereward", path=str(folder))
    by_file = rewards.load("imagereward", path=str(folder / "ImageReward.pt"))
    x = decoded.clone().requires_grad_(True)
    score = by_folder(x, PROMPTS, []).total
    torch.testing.assert_close(by_file(decoded, PROMPTS, []).total, score.detach())
    score.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(folder / "ImageReward.pt", lone / "ImageReward.pt")
    with pytest.raises(UserError) as err:
        rewards.load("imagereward", path=str(lone))
    assert "\n" not in str(err.value) and "has no med_config.json; download THUDM/ImageReward" in str(err.value)
