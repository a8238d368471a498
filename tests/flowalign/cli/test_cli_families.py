"""``flowalign tiny F``, ``flowalign sample`` and a 2-step LoRA ``flowalign train`` for every newer family,
from the command line; ``--image`` for the editing model."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from flowalign.cli.main import main
from tests.flowalign.trainers.conftest import small_run
from tests.pipelines.family_checks import prompt_file

FAMILIES = {"qwen_image": ".png", "flux2": ".png", "flux2_dev": ".png", "zimage": ".png", "wan22": ".mp4",
            "kontext": ".png",
            "wan_i2v": ".mp4", "qwen_image_edit": ".png"}


def run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_sample_and_train_from_the_cli(family, tmp_path, capsys):
    model = tmp_path / family
    assert run(["tiny", family, "--out", str(model)], capsys)[0] == 0
    edits = family in ("kontext", "wan_i2v", "qwen_image_edit")  # these take an input image
    prompts = prompt_file(tmp_path, images=edits)
    image = ["--image", str(tmp_path / "inputs" / "0.png")] if edits else []
    out = tmp_path / f"sample{FAMILIES[family]}"
    code, stdout, err = run(["sample", "--model", str(model), "--prompt", "a red circle", "--steps", "2", *image,
                             "--out", str(out)], capsys)
    assert code == 0 and str(out) in stdout, err
    assert out.stat().st_size > 0
    config = tmp_path / "run.yaml"
    config.write_text("trainer: {name: flow_grpo}\n")
    code, _, err = run(["train", str(config), *small_run(tmp_path / "run", model, prompts), "trainer.num_steps=3",
                        "trainer.group_size=2", "trainer.batch_size=2"], capsys)
    assert code == 0, err
    assert list((tmp_path / "run" / "checkpoints").glob("step-000002/pytorch_lora_weights.safetensors"))


def test_sample_image_changes_the_edit_and_is_required(tmp_path, capsys):
    model = tmp_path / "kontext"
    run(["tiny", "kontext", "--out", str(model)], capsys)
    prompt_file(tmp_path, images=True)
    outs = []
    for i in (0, 2):
        out = tmp_path / f"edit{i}.png"
        code, _, err = run(["sample", "--model", str(model), "--prompt", "make it purple", "--steps", "2",
                            "--image", str(tmp_path / "inputs" / f"{i}.png"), "--out", str(out)], capsys)
        assert code == 0, err
        outs.append(np.asarray(Image.open(out)))
    assert not np.array_equal(outs[0], outs[1]), "the input image must condition the sample"
    code, _, err = run(["sample", "--model", str(model), "--prompt", "x", "--out", str(tmp_path / "y.png")], capsys)
    assert code != 0 and "image" in err and "Traceback" not in err
    sd3 = tmp_path / "sd3"
    run(["tiny", "sd3", "--out", str(sd3)], capsys)
    code, _, err = run(["sample", "--model", str(sd3), "--prompt", "x", "--image", str(tmp_path / "inputs" / "0.png"),
                        "--out", str(tmp_path / "z.png")], capsys)
    assert code != 0 and "--image" in err


def test_evaluate_an_editing_model_on_vvr_edit(tmp_path, capsys):
    import json

    model = tmp_path / "kontext"
    run(["tiny", "kontext", "--out", str(model)], capsys)
    out = tmp_path / "eval"
    code, _, err = run(["evaluate", "--model", str(model), "--bench", "vvr_edit", "--level", "easy", "--n", "2",
                        "--steps", "2", "--out", str(out)], capsys)
    assert code == 0, err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["bench"] == "vvr_edit-easy" and metrics["n"] == 2 and "accuracy" in metrics
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {c for c, _ in rows[0]["constraints"]} >= {"total_count"} and (out / rows[0]["file"]).is_file()


def test_an_editing_benchmark_refuses_a_text_to_image_model(tmp_path, capsys):
    model = tmp_path / "sd3"
    run(["tiny", "sd3", "--out", str(model)], capsys)
    code, _, err = run(["evaluate", "--model", str(model), "--bench", "vvr_edit", "--n", "1", "--out",
                        str(tmp_path / "e")], capsys)
    assert code != 0 and "input images" in err and "Traceback" not in err


@pytest.mark.parametrize("family", ["causal_wan", "anyflow_far"])
def test_a_streaming_model_samples_from_the_cli_as_its_stream(family, tmp_path, capsys):
    """``flowalign sample`` streams a streaming model chunk by chunk (``stream_rollout``), the video equal to the
    stream the library draws from the same seed."""
    import torch

    import pipelines
    from flowalign.media import load_video
    from flowalign.sampling import stream_rollout

    model = tmp_path / family
    assert run(["tiny", family, "--out", str(model)], capsys)[0] == 0
    out = tmp_path / "clip.gif"
    code, stdout, err = run(["sample", "--model", str(model), "--prompt", "a red circle", "--seed", "3",
                             "--out", str(out)], capsys)
    assert code == 0 and str(out) in stdout, err
    policy = pipelines.load(model)
    stream = stream_rollout(policy, ["a red circle"], num_steps=int(policy.defaults["num_steps"]),
                            generator=torch.Generator().manual_seed(3))
    other = stream_rollout(policy, ["a red circle"], num_steps=int(policy.defaults["num_steps"]),
                           generator=torch.Generator().manual_seed(4))
    written = load_video(out)
    assert written.shape == stream.samples[0].shape
    # that stream's frames, up to the GIF's 256-colour palette; another seed's stream is much further
    near = (written - stream.samples[0]).abs().mean().item()
    assert near < 0.02 and (written - other.samples[0]).abs().mean().item() > 3 * near


def test_a_causal_wan_switches_prompts_from_the_cli(tmp_path, capsys):
    """``--switch FRAME PROMPT`` streams LongLive's interactive way: the video equals the library's stream with the
    same switch; a switch on a model that cannot recache, or a FRAME that is not a number, is refused in one line."""
    import torch

    import pipelines
    from flowalign.media import load_video
    from flowalign.sampling import stream_rollout

    model = tmp_path / "causal"
    assert run(["tiny", "causal_wan", "--out", str(model)], capsys)[0] == 0
    out = tmp_path / "clip.gif"
    code, stdout, err = run(["sample", "--model", str(model), "--prompt", "a red circle", "--switch", "4",
                             "a blue square", "--seed", "3", "--out", str(out)], capsys)
    assert code == 0 and str(out) in stdout, err
    policy = pipelines.load(model)
    stream = stream_rollout(policy, ["a red circle"], num_steps=int(policy.defaults["num_steps"]),
                            generator=torch.Generator().manual_seed(3), switches=[(4, ["a blue square"])])
    assert stream.switches == [(2, ["a blue square"])]  # the first chunk starting at or after frame 4
    assert (load_video(out) - stream.samples[0]).abs().mean().item() < 0.02
    code, _, err = run(["sample", "--model", str(model), "--prompt", "a", "--switch", "x", "b", "--out",
                        str(tmp_path / "b.gif")], capsys)
    assert code != 0 and "FRAME is a latent frame index" in err and "Traceback" not in err
    far = tmp_path / "far"
    assert run(["tiny", "anyflow_far", "--out", str(far)], capsys)[0] == 0
    code, _, err = run(["sample", "--model", str(far), "--prompt", "a", "--switch", "2", "b", "--out",
                        str(tmp_path / "c.gif")], capsys)
    assert code != 0 and "streams one prompt a video" in err and "Traceback" not in err
