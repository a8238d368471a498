"""The channel order the ``geneval`` reward's detector reads, against mmdetection's own data preparation.

Flow-GRPO's reward server hands mmdetection ``np.array(image)``, an RGB array, which mmdetection's loader takes
for BGR and its ``Normalize(to_rgb=True)`` then reverses: the detector Flow-GRPO trains against reads blue,
green, red. GenEval's evaluator hands it a file path, read as BGR and turned to RGB. The known answers are the
normalised channels mmdetection 2.28.2's ``inference_detector`` prepares with GenEval's Mask2Former config on
solid images both ways (provenance in the JSON); the reward's ``detector_channels`` gives the first by default
(``reversed``) and the second with ``rgb`` (the benchmark's, and the former form).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import pipelines
import rewards
from flowalign.errors import UserError
from flowalign.paths import default_model_dir
from flowalign.sampling import rollout
from rewards.benchmarks import geneval_options
from rewards.geneval.tiny import save_tiny_geneval
from rewards.registry import former_forms

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "geneval_detector_channels.json").read_text())
META = [{"tag": "single_object", "include": [{"class": "dog", "count": 1}]}]


@pytest.fixture(scope="module")
def tiny_geneval(tmp_path_factory):
    return {k: str(v) for k, v in save_tiny_geneval(tmp_path_factory.mktemp("tiny-geneval")).items()}


def detector_channels(reward, rgb: list[int]) -> list[float]:
    """The per-channel value the detector model is handed for a solid ``rgb`` sample."""
    seen = {}

    def keep(module, args, kwargs):
        seen.update(pixels=kwargs["pixel_values"][0])

    handle = reward.detector.model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        sample = torch.tensor(rgb, dtype=torch.float32).div(255).view(1, 3, 1, 1).expand(1, 3, 48, 64).contiguous()
        reward(sample, ["a photo of a dog"], META)
    finally:
        handle.remove()
    inside = seen["pixels"][:, :64, :64].flatten(1)  # inside the image at either size, clear of the padding
    assert (inside.amax(1) - inside.amin(1)).abs().max() < 1e-5  # solid in, solid out: one value a channel
    return inside.mean(1).tolist()


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: "rgb" + "_".join(map(str, c["rgb"])))
def test_the_detector_reads_what_mmdetection_prepares_for_the_server_and_for_genevals_files(tiny_geneval, case):
    assert case["file_path_channel_spread"] == case["array_channel_spread"] == 0.0
    server = rewards.load("geneval", jpeg_quality=None, **tiny_geneval)
    assert server.detector_channels == "reversed"
    assert detector_channels(server, case["rgb"]) == pytest.approx(case["array_channels"], abs=5e-5)
    files = rewards.load("geneval", jpeg_quality=None, detector_channels="rgb", **tiny_geneval)
    assert detector_channels(files, case["rgb"]) == pytest.approx(case["file_path_channels"], abs=5e-5)


def test_reversing_is_all_that_separates_the_two_paths_in_mmdetection():
    # on a random image mmdetection's two inputs differ, and agree to float rounding once the channels are reversed
    assert KNOWN["noise_max_abs_diff_same_order"] > 1.0
    assert KNOWN["noise_max_abs_diff_reversed"] < 1e-6


def test_only_the_detector_reads_reversed_channels_the_colour_crops_stay_rgb(tiny_geneval):
    """The server classifies colours on its PIL image, in order: the colour step is handed the RGB pixels."""
    policy = pipelines.load(default_model_dir())
    prompts = ["a photo of a red dog"] * 3
    samples = rollout(policy, prompts, num_steps=2, sampler="ode", generator=torch.Generator().manual_seed(0))
    samples = samples.samples.float().clamp(0, 1)
    rgb = list((samples * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy())
    meta = [{"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}]}] * 3
    for form in ("reversed", "rgb"):
        # at the processor's size the random detector finds a dog in some samples (the size is not at issue here)
        reward = rewards.load("geneval", threshold=0.0, counting_threshold=0.0, jpeg_quality=None,
                              detector_channels=form, detector_size="processor", **tiny_geneval)
        reward.detector, reward.colours = Seen(reward.detector), Seen(reward.colours)
        reward(samples, prompts, meta)
        assert reward.colours.images, "the colour step did not run"
        assert all(any(np.array_equal(image, x) for x in rgb) for image in reward.colours.images)
        expected = [x[..., ::-1] for x in rgb] if form == "reversed" else rgb
        assert all(np.array_equal(seen, x) for seen, x in zip(reward.detector.images, expected, strict=True))


class Seen:
    """A reward part that keeps the images it is handed (its first argument: one image or a list)."""

    def __init__(self, part):
        self.part, self.images = part, []

    def __call__(self, images, *args):
        self.images += [im.copy() for im in (images if isinstance(images, list) else [images])]
        return self.part(images, *args)

    def __getattr__(self, name):
        return getattr(self.part, name)


def test_defaults_by_detector_the_benchmarks_form_and_the_former_form(tiny_geneval, tmp_path):
    from rewards.geneval.tiny import save_tiny_owlv2

    assert geneval_options({})["detector_channels"] == "rgb"
    assert geneval_options({"detector_channels": "reversed"})["detector_channels"] == "reversed"
    assert former_forms("geneval")[0]["detector_channels"] == "rgb"
    owl = rewards.load("geneval", detector="owlv2", path=str(save_tiny_owlv2(tmp_path / "owl")),
                       clip_path=tiny_geneval["clip_path"])
    assert owl.detector_channels == "rgb"  # OWLv2 never ran behind Flow-GRPO's server
    with pytest.raises(UserError, match=r"geneval reward: detector_channels='bgr' is not known; use one of reversed "
                                        r"\(.*\), rgb \("):
        rewards.load("geneval", detector_channels="bgr", **tiny_geneval)


SCALE = json.loads((Path(__file__).parent / "known_answers" / "geneval_detector_scale.json").read_text())


def smooth_image(h: int, w: int) -> np.ndarray:
    """The known answers' input: uint8 ``(h, w, 3)``, a sum of sinusoids fixed by its size (see the JSON)."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    image = np.stack([127.5 + 120 * np.sin(xx / (7 + 3 * c) + yy / (11 + 2 * c) + c) for c in range(3)], -1)
    return np.clip(np.round(image), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("case", SCALE["cases"], ids=lambda c: "x".join(map(str, c["input_hw"])))
def test_the_detector_reads_each_image_at_genevals_test_scale(tiny_geneval, case):
    """mmdetection rescales with cv2's fixed-point bilinear, flowalign with torch's: the normalised pixels agree
    to within two 8-bit levels (2 / 57 ≈ 0.035) at every checked position, their means to 5e-3 (cv2 rounds its
    fixed-point weights down: 0.12 of a level lower on average)."""
    reward = rewards.load("geneval", jpeg_quality=None, **tiny_geneval)
    assert reward.detector.resize == "geneval"
    seen = {}
    handle = reward.detector.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(pixels=kwargs["pixel_values"][0]), with_kwargs=True)
    try:
        image = smooth_image(*case["input_hw"])
        reward(torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255, ["a photo of a dog"], META)
    finally:
        handle.remove()
    pixels = seen["pixels"]
    assert list(pixels.shape[-2:]) == case["padded_hw"] == case["tensor_hw"]
    h, w = case["resized_hw"]
    checked = pixels[:, case["rows"]][:, :, case["cols"]]
    assert (checked - torch.tensor(case["values"])).abs().max() < 2 / 57
    assert pixels[:, :h, :w].mean((1, 2)).tolist() == pytest.approx(case["channel_means"], abs=5e-3)
    grey = (128 - torch.tensor([123.675, 116.28, 103.53])) / torch.tensor([58.395, 57.12, 57.375])
    for padding in (pixels[:, h:, :], pixels[:, :, w:]):
        if padding.numel():
            assert torch.allclose(padding, grey[:, None, None].expand_as(padding), atol=1e-5)


def test_the_processor_size_is_the_former_form_and_owlv2s(tiny_geneval, tmp_path):
    from rewards.geneval.tiny import save_tiny_owlv2

    assert former_forms("geneval")[0]["detector_size"] == "processor"
    reward = rewards.load("geneval", detector_size="processor", **tiny_geneval)
    seen = {}
    handle = reward.detector.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(pixels=kwargs["pixel_values"]), with_kwargs=True)
    reward(torch.full((1, 3, 512, 512), 0.5), ["a photo of a dog"], META)
    handle.remove()
    assert tuple(seen["pixels"].shape[-2:]) == (64, 64)  # the tiny processor's shortest_edge
    owl = str(save_tiny_owlv2(tmp_path / "owl"))
    assert rewards.load("geneval", detector="owlv2", path=owl, clip_path=tiny_geneval["clip_path"]).detector_size == "processor"
    with pytest.raises(UserError, match="geneval reward: detector_size=geneval is GenEval's Mask2Former test scale"):
        rewards.load("geneval", detector="owlv2", detector_size="geneval", path=owl, clip_path=tiny_geneval["clip_path"])
    with pytest.raises(UserError, match=r"geneval reward: detector_size='800' is not known; use one of geneval"):
        rewards.load("geneval", detector_size="800", **tiny_geneval)
