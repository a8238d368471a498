"""The ``ocr`` reward: Flow-GRPO's formula on fixed strings, known answers of the default engine (PP-OCRv4
from the rapidocr_onnxruntime wheel, offline) and of tesseract (where installed) on text drawn with a
TrueType font, per-sample validity, the engines' one-line errors, and the prompt set's splits."""

import json
import socket
import sys
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

import rewards
from flowalign.benchmarks import load_benchmark, training_tasks
from flowalign.errors import UserError
from rewards.ocr import (
    SPLIT_SEEDS,
    TEMPLATES,
    OCRTask,
    WORDS,
    edit_distance,
    generate_heldout_tasks,
    generate_tasks,
    heldout_pairs,
    load_split,
    ocr_score,
    target_text,
)

REPO = Path(__file__).resolve().parents[2]
# DejaVu Sans Bold as matplotlib ships it (a test dependency): no system font package needed
FONT = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans-Bold.ttf"
TESSERACT = pytest.mark.requires_program("tesseract", install="apt-get install tesseract-ocr")


def test_edit_distance_known_values():
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("flaw", "lawn") == 2
    assert edit_distance("", "open") == 4 and edit_distance("open", "open") == 0


def test_score_matches_flow_grpo_on_fixed_strings():
    # contained after lower-casing and removing spaces (line breaks too: Flow-GRPO joins lines with nothing)
    assert ocr_score("the sign reads Open  Late today", "OPEN LATE") == 1.0
    assert ocr_score("OPEN\nLATE", "open late") == 1.0
    # otherwise 1 - d / n over the whole recognised text, n = len("openlate") = 8
    assert ocr_score("OPEN LADE", "OPEN LATE") == pytest.approx(1 - 1 / 8)  # one substitution
    assert ocr_score("PEN LATE", "OPEN LATE") == pytest.approx(1 - 1 / 8)  # one deletion
    assert ocr_score("OPE", "OPEN") == pytest.approx(0.75)
    # the distance is capped at the target's length: unrelated text scores 0, never below
    assert ocr_score("", "OPEN") == 0.0 and ocr_score("completely different words here", "OPEN") == 0.0
    with pytest.raises(ValueError):
        ocr_score("anything", "   ")


def test_target_is_the_metadata_text_else_the_first_quoted_span():
    assert target_text('a sign "NOT THIS"', {"text": "OPEN"}) == "OPEN"
    assert target_text('a sign that says "OPEN LATE" and "EXIT"') == "OPEN LATE"
    assert target_text("a mug printed with “HELLO”") == "HELLO"
    assert target_text("the baker's sign reads 'FRESH BREAD'") == "FRESH BREAD"  # an apostrophe is no quote
    assert target_text("a sign with no text") is None


def _drawn(text: str, size: int = 256, angle: float = 0, font_size: int = 28) -> torch.Tensor:
    """``text`` drawn in a TrueType font on a coloured card, turned ``angle`` degrees, (3, size, size) in [0, 1]."""
    image = Image.new("RGB", (size, size), (232, 220, 190))
    ImageDraw.Draw(image).text((size // 2, size // 2), text, fill=(25, 25, 70), anchor="mm", align="center",
                               font=ImageFont.truetype(str(FONT), font_size))
    image = image.rotate(angle, resample=Image.BICUBIC, fillcolor=(232, 220, 190))
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)


@pytest.fixture(scope="module")
def rapidocr():
    return rewards.load("ocr", batch_size=2)  # the default engine


@pytest.fixture(scope="module")
def tesseract():
    return rewards.load("ocr", engine="tesseract", batch_size=2)


def test_the_default_engine_reads_rendered_text_and_scores_it_sensibly(rapidocr):
    from rewards.ocr.engines import RapidOCR

    assert isinstance(rapidocr.engine, RapidOCR)
    texts = ["OPEN LATE", "OPEN LATE", "OPEN LATE", "COFFEE\nBREAD", "HELLO WORLD", "HELLO WORLD"]
    angles = [0, 0, 0, 0, 20, -35]
    samples = torch.stack([_drawn(t, angle=a) for t, a in zip(texts, angles)] + [torch.full((3, 256, 256), 0.9)])
    # exact, one letter off ("openlate" vs "opengate": 1 - 1/8), unrelated; two lines; turned both ways; blank
    targets = ["OPEN LATE", "OPEN GATE", "SILVER MOON", "COFFEE BREAD", "HELLO WORLD", "HELLO WORLD", "OPEN"]
    out = rapidocr(samples, [f'a sign that says "{t}"' for t in targets], [])
    score, info = out.components["ocr"].tolist(), out.info
    assert out.valid.all()
    assert info[0]["recognised"] == "OPEN LATE" and score[0] == 1.0 and info[0]["all_passed"]
    assert score[1] == pytest.approx(1 - 1 / 8) and not info[1]["all_passed"]
    assert score[2] <= 0.3
    assert info[3]["recognised"] == "COFFEE BREAD" and score[3] == 1.0  # lines in reading order
    assert score[4] == 1.0 and score[5] == 1.0  # rotated text is boxed and straightened
    assert info[6]["recognised"] == "" and score[6] == 0.0


def test_the_default_engine_needs_no_network_and_no_opencv(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    # OpenCV's wheel (a dependency of rapidocr_onnxruntime, imported by its pipeline) needs the system's
    # libGL: the engine must import neither. A None in sys.modules makes `import cv2` raise ImportError, as
    # it does without libGL.
    monkeypatch.setitem(sys.modules, "cv2", None)
    out = rewards.load("ocr")(_drawn("FRESH")[None], ['a sign that says "FRESH"'], [])
    assert out.valid.all() and out.components["ocr"].item() == 1.0


def test_a_sample_the_engine_fails_on_is_invalid_and_its_batch_neighbours_are_scored(rapidocr, monkeypatch):
    real, calls = rapidocr.engine.read, []

    def read(images, device):  # fails on any batch holding an image with a black corner
        calls.append(len(images))
        if any(image.getpixel((0, 0)) == (0, 0, 0) for image in images):
            raise ValueError("cannot read this image")
        return real(images, device)

    monkeypatch.setattr(rapidocr.engine, "read", read)
    samples = torch.stack([_drawn("OPEN"), _drawn("EXIT")])
    samples[1, :, 0, 0] = 0
    out = rapidocr(samples, ['"OPEN"', '"EXIT"'], [])
    assert calls == [2, 1, 1]  # the batch, then each image alone
    assert out.valid.tolist() == [True, False] and out.components["ocr"][0] == 1.0
    assert out.info[1]["reason"] == "the OCR engine failed: ValueError: cannot read this image"


@TESSERACT
def test_known_answers_with_tesseract(tesseract):
    nan = torch.full((3, 256, 256), float("nan"))
    samples = torch.stack([_drawn(t, font_size=34) for t in ("OPEN LATE", "HELLO WORLD")] + [nan, _drawn("FRESH")])
    prompts = ['a storefront sign that says "OPEN LATE"', 'a storefront sign that says "OPEN LATE"',
               'a sign that says "OPEN"', "a sign with no quoted text"]
    out = tesseract(samples, prompts, [])
    score, valid, info = out.components["ocr"], out.valid, out.info
    assert score.shape == (4,) and score.dtype == torch.float32
    assert score[0] >= 0.9 and info[0]["all_passed"] and info[0]["recognised"] == "OPEN LATE"
    assert score[1] <= 0.5 and not info[1]["all_passed"]
    # a sample the reward cannot judge is invalid with a reason, never a zero that trains
    assert valid.tolist() == [True, True, False, False]
    assert info[2]["reason"] == "non-finite pixels" and "quotes no text" in info[3]["reason"]
    # the metadata's text wins over the prompt's quotes
    again = tesseract(samples[[0]], ['a sign that says "EXIT"'], [{"text": "open late"}])
    assert again.components["ocr"].item() == 1.0


@TESSERACT
def test_an_image_the_engine_fails_on_is_invalid_with_its_reason(tesseract):
    # tesseract refuses images wider than 32767 px: both fail, first as a batch, then one by one
    out = tesseract(torch.full((2, 3, 1, 40000), 0.5), ['"OPEN"', '"EXIT"'], [])
    assert not out.valid.any()
    assert all("TesseractError" in i["reason"] and "too large" in i["reason"] for i in out.info)


@pytest.mark.parametrize("engine, hint", [("got_ocr2", "GOT-OCR-2.0-hf"), ("paddleocr", "det/ and rec/")])
def test_a_model_engine_without_its_weights_is_one_line(tmp_path, engine, hint):
    for options in ({}, {"path": str(tmp_path / "missing")}):
        with pytest.raises(UserError) as e:
            rewards.load("ocr", engine=engine, **options)
        message = str(e.value)
        assert "\n" not in message and message.startswith("ocr reward") and "path" in message and hint in message


def test_got_ocr2_loads_a_tiny_reward_folder_and_scores_real_samples(tmp_path, capsys):
    from flowalign.cli.main import main

    out = tmp_path / "got"
    assert main(["tiny-reward", "ocr", "--out", str(out)]) == 0
    assert f"(load with {{name: ocr, engine: got_ocr2, path: {out}}})" in capsys.readouterr().out
    reward = rewards.load("ocr", engine="got_ocr2", path=str(out), batch_size=2)
    samples, prompts = torch.rand(3, 3, 96, 96, generator=torch.Generator().manual_seed(0)), ['"OPEN"', '"EXIT"', '"TEA"']
    first, second = reward(samples, prompts, []), reward(samples, prompts, [])
    score = first.components["ocr"]
    assert score.shape == (3,) and first.valid.all() and ((0 <= score) & (score <= 1)).all()
    assert torch.equal(score, second.components["ocr"]) and all(isinstance(i["recognised"], str) for i in first.info)


def test_bad_options_are_one_line():
    with pytest.raises(UserError, match="unknown engine='easyocr'; choose one of rapidocr, tesseract, got_ocr2, "
                                        "paddleocr"):
        rewards.load("ocr", engine="easyocr")
    with pytest.raises(UserError, match="batch_size must be a positive integer"):
        rewards.load("ocr", batch_size=0)
    with pytest.raises(UserError, match="engine tesseract takes no path"):
        rewards.load("ocr", engine="tesseract", path="/weights/got-ocr2")
    with pytest.raises(UserError, match="engine rapidocr takes no path .* rapidocr_onnxruntime package"):
        rewards.load("ocr", path="/weights/got-ocr2")


def test_the_default_engine_without_its_package_is_one_line(monkeypatch):
    import rewards.ocr.ppocr

    monkeypatch.setattr(rewards.ocr.ppocr, "models_folder", lambda: None)
    with pytest.raises(UserError) as e:
        rewards.load("ocr")
    assert "\n" not in str(e.value) and "pip install 'rapidocr_onnxruntime" in str(e.value)


def test_no_training_prompt_holds_a_test_pair_and_every_word_and_template_trains():
    test = {t.prompt for level in ("easy", "medium") for t in load_split(level, "test")}
    training = generate_tasks(1500, seed=0, level="easy") + generate_tasks(1500, seed=1, level="medium")
    assert not any(heldout_pairs(t) for t in training) and not test & {t.prompt for t in training}
    assert {t.template for t in training} == set(range(len(TEMPLATES)))
    assert {w for t in training for w in t.text.split()} == set(WORDS)


@pytest.mark.parametrize("level", ["easy", "medium", "hard"])
def test_shipped_splits_are_disjoint_and_match_the_generator(level):
    test, validation = load_split(level, "test"), load_split(level, "validation")
    assert len(test) == len(validation) == 500
    assert all(heldout_pairs(t) for t in test) and not any(heldout_pairs(t) for t in validation)
    assert not {t.prompt for t in test} & {t.prompt for t in validation}
    assert all(len(t.text.split()) == {"easy": 1, "medium": 2, "hard": 3}[level] for t in test + validation)
    # each prompt quotes exactly its text, which the reward reads from the metadata or the quotes alike
    assert all(target_text(t.prompt) == t.text for t in test + validation)
    assert test[:10] == generate_heldout_tasks(10, seed=SPLIT_SEEDS["test"][level], level=level)
    assert validation[:10] == generate_tasks(10, seed=SPLIT_SEEDS["validation"][level], level=level)
    first = json.loads((REPO / "assets" / "ocr" / level / "test.jsonl").read_text().splitlines()[0])
    assert first == test[0].to_dict()


def test_the_ocr_benchmark_is_registered():
    from rewards.ocr.engines import RapidOCR

    bench = load_benchmark("ocr", "medium", n=3, split="validation")
    assert bench.name == "ocr-medium" and bench.reward.name == "ocr" and len(bench.prompts) == 3
    assert isinstance(bench.reward.engine, RapidOCR)  # the default engine: the benchmark scores anywhere
    assert all(m["text"] and f'"{m["text"]}"' in p for p, m in zip(bench.prompts, bench.metadata))
    draws = training_tasks("ocr", "hard", n=200, seed=3)
    # training draws build no reward (the config's own scores them) and hold no test pair
    assert draws.reward is None
    assert not any(heldout_pairs(OCRTask(p, m["text"], m["template"])) for p, m in zip(draws.prompts, draws.metadata))


def test_the_tiny_ocr_config_trains_two_steps(tmp_path):
    from flowalign.cli.main import main

    # the tiny model cannot draw letters: this checks the pipeline and its logs, not learning
    run = tmp_path / "run"
    assert main(["train", str(REPO / "configs" / "tiny" / "flow_grpo_ocr.yaml"), f"run.output_dir={run}",
                 "run.progress=false", "run.tensorboard=false", "trainer.max_steps=2", "trainer.prompts_per_step=2",
                 "trainer.group_size=2", "trainer.batch_size=4", "trainer.num_steps=2", "eval.every=2", "eval.n=2",
                 "eval.num_steps=2"]) == 0
    logs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in logs if "reward/ocr" in row]
    assert [row["step"] for row in steps] == [1, 2]
    assert all(0 <= row["reward/ocr"] <= 1 and row["reward/ocr_invalid_fraction"] == 0 for row in steps)
    evals = [row for row in logs if "eval/mean_score" in row]
    assert evals and all(row["eval/valid_fraction"] == 1 and 0 <= row["eval/mean_score"] <= 1 for row in evals)
