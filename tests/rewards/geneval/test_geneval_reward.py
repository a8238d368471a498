"""The geneval reward through its real loaders, on a tiny random Mask2Former + CLIP, scoring real decoded
samples of the tiny SD3 model."""

import pytest
import torch

import pipelines
import rewards
from flowalign.errors import UserError
from flowalign.paths import default_model_dir
from flowalign.sampling import rollout
from rewards.geneval.tiny import save_tiny_geneval

META = [
    {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}]},
    {"tag": "position", "include": [{"class": "car", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}]},
    {"tag": "counting", "include": [{"class": "cup", "count": 2}], "exclude": [{"class": "cup", "count": 3}]},
]
PROMPTS = ["a photo of a red dog", "a photo of a dog left of a car", "a photo of two cups"]


@pytest.fixture(scope="module")
def tiny_geneval(tmp_path_factory):
    return {k: str(v) for k, v in save_tiny_geneval(tmp_path_factory.mktemp("tiny-geneval")).items()}


@pytest.fixture(scope="module")
def decoded():
    policy = pipelines.load(default_model_dir())
    out = rollout(policy, PROMPTS, num_steps=2, sampler="ode", generator=torch.Generator().manual_seed(0))
    return out.samples.float().clamp(0, 1)


def test_scores_real_samples_finite_deterministic(tiny_geneval, decoded):
    # thresholds at 0 so the random detector's detections reach the colour and position rules
    reward = rewards.load("geneval", threshold=0.0, counting_threshold=0.0, **tiny_geneval)
    first = reward(decoded, PROMPTS, META)
    again = reward(decoded, PROMPTS, META)
    score = first.components["geneval"]
    assert score.shape == (3,) and torch.isfinite(score).all() and first.valid.all()
    assert torch.equal(score, again.components["geneval"])
    assert [i["tag"] for i in first.info] == ["colors", "position", "counting"]
    assert any(kind == "colour" for kind, _ in first.info[0]["constraints"])  # the CLIP colour path ran
    assert [i["partial"] for i in first.info] == pytest.approx(score.tolist())


def test_strict_score_is_genevals_verdict_and_nonfinite_is_invalid(tiny_geneval, decoded):
    reward = rewards.load("geneval", score="strict", **tiny_geneval)
    samples = decoded.clone()
    samples[1] = float("nan")
    out = reward(samples, PROMPTS, META)
    assert out.valid.tolist() == [True, False, True]
    expected = [float(info["all_passed"]) if ok else 0.0 for info, ok in zip(out.info, out.valid.tolist())]
    assert out.components["geneval"].tolist() == expected


def test_missing_or_wrong_path_is_one_line(tiny_geneval, tmp_path):
    with pytest.raises(UserError, match="path is not set; download .*facebook/mask2former-swin-small-coco-instance"):
        rewards.load("geneval", clip_path=tiny_geneval["clip_path"])
    with pytest.raises(UserError, match="clip_path=.* is not a folder; download .*clip-vit-large-patch14"):
        rewards.load("geneval", path=tiny_geneval["path"], clip_path=str(tmp_path / "nothing"))
    with pytest.raises(UserError, match="detector='yolo'"):
        rewards.load("geneval", detector="yolo", **tiny_geneval)


def test_bad_metadata_is_one_line(tiny_geneval, decoded):
    reward = rewards.load("geneval", **tiny_geneval)
    bad = {"tag": "colors", "include": [{"class": "unicorn", "count": 1}]}
    with pytest.raises(UserError, match=r"include\[0\].class 'unicorn' is not a class of the detector.*owlv2"):
        reward(decoded[:1], PROMPTS[:1], [bad])
    with pytest.raises(UserError, match="'tag' must be one of"):
        reward(decoded[:1], PROMPTS[:1], [{"include": []}])
    with pytest.raises(UserError, match=r"position must be \[relation, index of an earlier include\]"):
        reward(decoded[:1], PROMPTS[:1], [{"tag": "position", "include": [{"class": "dog", "count": 1,
                                                                           "position": ["left of", 0]}]}])


def test_owlv2_detector_scores_any_class(tiny_geneval, decoded, tmp_path):
    from rewards.geneval.tiny import save_tiny_owlv2

    reward = rewards.load("geneval", detector="owlv2", path=str(save_tiny_owlv2(tmp_path / "owl")),
                          clip_path=tiny_geneval["clip_path"], threshold=0.0, counting_threshold=0.0)
    meta = [{"tag": "colors", "include": [{"class": "unicorn", "count": 1, "color": "red"}]}] + META[1:]
    out = reward(decoded, PROMPTS, meta)
    assert out.components["geneval"].shape == (3,) and torch.isfinite(out.components["geneval"]).all()
    assert torch.equal(out.components["geneval"], reward(decoded, PROMPTS, meta).components["geneval"])
    assert ("count", True) in out.info[0]["constraints"]  # every query box passes a zero threshold


def test_random_init_builds_from_the_configs_alone(tiny_geneval, decoded, tmp_path):
    # the folders without their weight files: random_init reads config.json and the processor files only
    import shutil

    folders = {}
    for key, src in tiny_geneval.items():
        folders[key] = shutil.copytree(src, tmp_path / key)
        for weights in folders[key].glob("*.safetensors"):
            weights.unlink()
    reward = rewards.load("geneval", threshold=0.0, counting_threshold=0.0, random_init=True,
                          **{k: str(v) for k, v in folders.items()})
    loaded = rewards.load("geneval", **tiny_geneval)
    assert type(reward.detector.model) is type(loaded.detector.model)
    assert sum(p.numel() for p in reward.colours.model.parameters()) == sum(p.numel() for p in loaded.colours.model.parameters())
    score = reward(decoded, PROMPTS, META).components["geneval"]
    assert score.shape == (3,) and torch.isfinite(score).all()


class Observed:
    """The reward's detector, keeping the images it was handed."""

    def __init__(self, detector):
        self.detector, self.images = detector, None

    def __call__(self, images, *args):
        self.images = [im.copy() for im in images]
        return self.detector(images, *args)

    def __getattr__(self, name):
        return getattr(self.detector, name)


def test_the_detector_reads_the_jpeg_flow_grpo_sends_and_the_benchmark_the_decoded_pixels(tiny_geneval, decoded):
    """Flow-GRPO's ``geneval_score`` saves each sample as a JPEG at PIL's default quality (75) for its reward
    server: the default. ``jpeg_quality: null`` (the former form, and the benchmark's, as GenEval's evaluator
    reads the PNGs it is given) hands the detector the decoded 8-bit pixels."""
    import numpy as np
    from PIL import Image

    from rewards.benchmarks import geneval_options
    from rewards.common import jpeg_round_trip

    seen = {}
    for quality in (75, None):
        reward = rewards.load("geneval", detector_channels="rgb", **tiny_geneval,
                              **({} if quality == 75 else {"jpeg_quality": None}))
        reward.detector = Observed(reward.detector)
        reward(decoded, PROMPTS, META)
        seen[quality] = reward.detector.images
    pixels = (decoded * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    assert all(np.array_equal(a, b) for a, b in zip(seen[None], pixels))
    jpeg = [np.asarray(jpeg_round_trip(Image.fromarray(p), 75)) for p in pixels]
    assert all(np.array_equal(a, b) for a, b in zip(seen[75], jpeg))
    assert not all(np.array_equal(a, b) for a, b in zip(seen[75], seen[None]))
    assert geneval_options({})["jpeg_quality"] is None and geneval_options({"jpeg_quality": 90})["jpeg_quality"] == 90
    with pytest.raises(UserError, match="geneval reward: jpeg_quality=0 must be an integer from 1 to 100"):
        rewards.load("geneval", jpeg_quality=0, **tiny_geneval)


def test_colour_crops_go_through_genevals_transform_unless_the_former_form_is_asked(tiny_geneval, decoded):
    """``colour_preprocess: open_clip`` (default) hands CLIP what GenEval's open_clip transform makes of each crop
    (checked against GenEval in ``test_colour_pixels_reference.py``); ``processor`` is the former form, and what
    runs saved before the option resume with."""
    from rewards.registry import former_forms

    seen = {}
    for form in ("open_clip", "processor"):
        reward = rewards.load("geneval", threshold=0.0, counting_threshold=0.0, colour_preprocess=form, **tiny_geneval)
        assert reward.colours.preprocess == form
        model = reward.colours.model
        calls = []
        hook = model.get_image_features
        model.get_image_features = lambda pixel_values, **kw: calls.append(pixel_values) or hook(pixel_values=pixel_values, **kw)
        reward(decoded, PROMPTS, META)
        seen[form] = torch.cat(calls)
    assert rewards.load("geneval", **tiny_geneval).colours.preprocess == "open_clip"
    assert seen["open_clip"].shape == seen["processor"].shape and not torch.equal(seen["open_clip"], seen["processor"])
    assert former_forms("geneval")[0]["colour_preprocess"] == "processor"
    with pytest.raises(UserError, match=r"geneval reward: colour_preprocess='pil' .*open_clip \(GenEval's open_clip "
                                        r"transform\), processor \(transformers' CLIPImageProcessor\)"):
        rewards.load("geneval", colour_preprocess="pil", **tiny_geneval)
