"""Nonsense and unbounded inputs on the command line: one ``error:`` line through the real entry point,
never a traceback and never a result computed from them."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from flowalign.cli.main import main
from flowalign.limits import MAX_PROMPT_CHARS
from flowalign.paths import REPO_ROOT, default_model_dir
from tests.flowalign.cli.test_clear_errors import one_line_error
from tests.flowalign.cli.test_compare import eval_dir


@pytest.mark.parametrize("override,needle", [
    ("trainer.betas=[1.5,0.9]", "trainer.betas"),
    ("run.seed=-1", "run.seed"),
    (f"run.seed={10**23}", "run.seed"),
    ("trainer.lr=1.0e30", "trainer.lr"),
    ("data.n=1000000000000", "data.n"),
    ("trainer.group_size=1000000000", "trainer.group_size"),
    ("trainer.num_steps=100000000", "trainer.num_steps"),
])
def test_train_refuses_out_of_range_values(tmp_path, capsys, override, needle):
    one_line_error(["train", "/dev/null", f"run.output_dir={tmp_path / 'run'}", override], capsys, needle)
    assert not (tmp_path / "run").exists()


def test_train_refuses_a_config_with_a_key_given_twice(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("trainer:\n  name: flow_grpo\n  lr: 1.0e-4\n  lr: 1.0e-2\n")
    one_line_error(["train", cfg], capsys, "line 4: key 'lr' is given twice", "first on line 3")


@pytest.mark.parametrize("flag,value", [("--guidance", "nan"), ("--guidance", "inf"), ("--guide-scale", "nan"),
                                        ("--noise-level", "inf")])
def test_non_finite_floats_are_refused(tmp_path, capsys, flag, value):
    out = tmp_path / "x.png"
    one_line_error(["sample", "--prompt", "p", "--out", out, flag, value], capsys, f"{flag} {value}: give a finite")
    assert not out.exists()


def test_evaluate_refuses_a_nan_guidance_before_scoring(tmp_path, capsys):
    one_line_error(["evaluate", "--n", "2", "--guidance", "nan", "--out", tmp_path / "e"], capsys, "--guidance nan")
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("argv,needle", [
    (["sample", "--prompt", "p", "--seed", "-1"], "--seed -1: give an integer in 0.."),
    (["sample", "--prompt", "p", "--steps", "100000000"], "--steps 100000000: give an integer <= 1,000"),
    (["evaluate", "--n", str(10**12)], "--n 1000000000000: give an integer <= 1,000,000"),
    (["evaluate", "--batch-size", str(10**9)], "--batch-size"),
])
def test_unbounded_counts_are_refused(tmp_path, capsys, argv, needle):
    one_line_error([*argv, "--out", tmp_path / ("x.png" if argv[0] == "sample" else "e")], capsys, needle)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("command", ["sample", "evaluate"])
def test_device_cuda_without_a_gpu(tmp_path, capsys, command):
    argv = [command, "--device", "cuda", "--out", tmp_path / ("x.png" if command == "sample" else "e")]
    argv += ["--prompt", "p"] if command == "sample" else ["--n", "1"]
    one_line_error(argv, capsys, "--device cuda: no CUDA GPU is visible", "--device cpu")


def test_an_unknown_device_is_refused(tmp_path, capsys):
    one_line_error(["sample", "--prompt", "p", "--device", "gpu0", "--out", tmp_path / "x.png"], capsys,
                   "--device 'gpu0' is not a device")


def test_a_prompt_over_the_bound_is_refused_before_loading(tmp_path, capsys):
    long = "a red circle " * (MAX_PROMPT_CHARS // 13 + 1)
    one_line_error(["sample", "--prompt", long, "--model", tmp_path / "absent", "--out", tmp_path / "x.png"],
                   capsys, "--prompt: a prompt of", "give at most 20,000")


def test_a_long_prompt_warns_once_and_briefly(tmp_path):
    """A 10,000-character prompt is cut by every text encoder; that is said in one short line."""
    prompt = " ".join(["a red circle left of a blue square"] * 290)
    assert 9_000 < len(prompt) <= MAX_PROMPT_CHARS
    done = subprocess.run([sys.executable, "-m", "flowalign", "sample", "--prompt", prompt, "--steps", "1",
                           "--out", str(tmp_path / "x.png")], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("a prompt is cut to what its text encoder reads") == 1
    assert "Token indices" not in done.stderr and "red circle left" not in done.stderr
    assert len(done.stderr) < 3000, done.stderr  # the model's loading bars and the one warning


@pytest.mark.parametrize("damage,needle", [
    (lambda m: shutil.rmtree(m / "vae"), "vae/ is missing"),
    (lambda m: shutil.rmtree(m / "tokenizer_2"), "tokenizer_2/ is missing"),
    (lambda m: (m / "transformer" / "diffusion_pytorch_model.safetensors").open("r+b").truncate(100_000),
     "transformer/diffusion_pytorch_model.safetensors is 100,000 bytes but its header lays out"),
    (lambda m: (m / "transformer" / "config.json").write_text('{"num_layers": 2,'), "transformer/config.json is damaged"),
])
def test_a_damaged_model_folder_names_the_broken_part(tmp_path, capsys, damage, needle):
    model = tmp_path / "model"
    shutil.copytree(default_model_dir(), model)
    damage(model)
    err = one_line_error(["sample", "--model", model, "--prompt", "p", "--out", tmp_path / "x.png"], capsys, needle)
    assert f"model folder {model}" in err
    assert not (tmp_path / "x.png").exists()


def test_compare_names_a_torn_results_line(tmp_path, capsys):
    a = eval_dir(tmp_path / "a", [True, False, True])
    b = eval_dir(tmp_path / "b", [True, True, True])
    text = (b / "results.jsonl").read_text()
    (b / "results.jsonl").write_text(text[: len(text) - 25])  # killed while writing the last row
    one_line_error(["compare", a, b], capsys, f"{b / 'results.jsonl'}:3: not a complete JSON row")


def test_compare_writes_valid_json_for_undefined_rates(tmp_path, capsys):
    """No prompt decided: wins / (wins + losses) has no value; JSON says null, never NaN."""
    a = eval_dir(tmp_path / "a", [True, True])
    b = eval_dir(tmp_path / "b", [True, True])
    assert main(["compare", str(a), str(b)]) == 0
    line = capsys.readouterr().out.strip()

    def refuse(token):
        raise AssertionError(f"not JSON: {token}")

    row = json.loads(line, parse_constant=refuse)
    assert row["wins_over_decided"] is None and row["win_rate"] == 0.5


def test_compare_reads_null_scores_of_invalid_samples(tmp_path, capsys):
    a = eval_dir(tmp_path / "a", [True, False])
    b = eval_dir(tmp_path / "b", [True, True])
    rows = [json.loads(r) for r in (b / "results.jsonl").read_text().splitlines()]
    rows[1]["score"] = None
    (b / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["compare", str(a), str(b)]) == 0
    row = json.loads(capsys.readouterr().out)
    # the invalid sample is unscored, neither a tie nor a 0 in B's mean
    assert (row["wins"], row["losses"], row["ties"], row["unscored"]) == (0, 0, 1, 1)
    assert (row["a_mean"], row["b_mean"], row["win_rate"]) == (0.5, 1.0, 0.5)


@pytest.mark.parametrize("argv,needle", [
    (["sample", "--prompt", "p", "--guidance", "1e30"], "--guidance 1e30: give a number <= 100"),
    (["sample", "--prompt", "p", "--guidance", "-1"], "--guidance -1: give a number >= 0"),
    (["sample", "--prompt", "p", "--noise-level", "50"], "--noise-level 50: give a number <= 2"),
    (["sample", "--prompt", "p", "--guide-window", "0.1", "7"], "--guide-window 7: give a number <= 1"),
    (["evaluate", "--guidance", "1e30"], "--guidance 1e30"),
    (["pretrain-tiny", "sd3", "--size", "100000"], "--size 100000: give an integer <= 1,024"),
    (["pretrain-tiny", "wan", "--dit-steps", str(10**12)], "--dit-steps 1000000000000: give an integer <= 10,000,000"),
    (["tiny", "sd3", "--seed", "-1"], "--seed -1: give an integer in 0.."),
    (["train-reward", "--bench", "vvr", "--registers", str(10**9)], "--registers 1000000000: give an integer <= 4,096"),
])
def test_out_of_bound_options_are_refused_before_anything_runs(tmp_path, capsys, argv, needle):
    out = tmp_path / ("x.png" if argv[0] == "sample" else "o")
    one_line_error([*argv, "--out", out], capsys, needle)
    assert not out.exists()


def png_header(path, width, height):
    """A PNG whose header declares ``width x height`` with almost no pixel data (a decoded one would be
    truncated): refusing it for its size shows the header was read and nothing decoded."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\x00" * 10)) + chunk(b"IEND", b""))
    return path


KONTEXT = REPO_ROOT / "assets" / "tiny-kontext-vvr-edit"


def test_sample_refuses_a_file_that_is_no_image(tmp_path, capsys):
    out = tmp_path / "x.png"
    one_line_error(["sample", "--model", KONTEXT, "--prompt", "p", "--image", "/etc/passwd", "--out", out], capsys,
                   "--image /etc/passwd: cannot be read as an image (not an image file)")
    assert not out.exists()


def test_sample_refuses_a_huge_image_from_its_header(tmp_path, capsys):
    """13000 x 13000 (1.9 GiB once decoded as floats): refused from the header, before a pixel is decoded."""
    big = png_header(tmp_path / "big.png", 13000, 13000)
    out = tmp_path / "x.png"
    one_line_error(["sample", "--model", KONTEXT, "--prompt", "p", "--image", big, "--out", out], capsys,
                   "13000x13000 = 169,000,000 pixels, more than the 16,777,216")
    assert not out.exists()


def test_prompt_file_images_are_checked_like_image_options(tmp_path):
    """A JSONL ``image`` reaches the editing policy through load_input_image: the same one-line refusals, and
    a file whose header passes but whose pixels are cut short is one line too."""
    from flowalign.errors import UserError
    from flowalign.sampling.inputs import load_input_image

    with pytest.raises(UserError, match="not an image file"):
        load_input_image("/etc/passwd")
    with pytest.raises(UserError, match="169,000,000 pixels"):
        load_input_image(png_header(tmp_path / "big.png", 13000, 13000))
    with pytest.raises(UserError, match="cannot be decoded"):
        load_input_image(png_header(tmp_path / "small.png", 8, 8))


def test_preference_pair_images_are_checked_from_their_header(tmp_path):
    """The images of preference-pair files (diffusion_dpo, seppo, festdpo) are read the same way."""
    from flowalign.errors import UserError
    from flowalign.trainers.parts.pairs import load_image

    with pytest.raises(UserError, match="image /etc/passwd: cannot be read as an image"):
        load_image("/etc/passwd", 32, 32)
    with pytest.raises(UserError, match="169,000,000 pixels"):
        load_image(png_header(tmp_path / "big.png", 13000, 13000), 32, 32)
