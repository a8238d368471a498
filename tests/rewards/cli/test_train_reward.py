"""``flowalign train-reward`` and the ``--guide`` options of ``sample`` / ``evaluate``, end to end."""

import argparse
import json

import numpy as np
import pytest
import torch
from PIL import Image

from flowalign.cli.main import main
from flowalign.paths import REPO_ROOT


def run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def image_pairs(tmp_path_factory):
    """A JSONL of 8 (prompt, chosen, rejected) image pairs: a red disc is preferred to a blue one."""
    folder = tmp_path_factory.mktemp("pairs")
    yy, xx = np.mgrid[:32, :32]
    rows = []
    for i in range(8):
        disc = (yy - 10 - i) ** 2 + (xx - 16) ** 2 < 60
        for name, colour in (("chosen", (230, 30, 30)), ("rejected", (30, 30, 230))):
            img = np.full((32, 32, 3), 245, np.uint8)
            img[disc] = colour
            Image.fromarray(img).save(folder / f"{name}{i}.png")
        rows.append({"prompt": f"a circle number {i % 4}", "chosen": f"chosen{i}.png", "rejected": f"rejected{i}.png"})
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "pairs.jsonl"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_sd3_dir, image_pairs):
    out = tmp_path_factory.mktemp("reward") / "lrr"
    code = main(["train-reward", "--model", str(tiny_sd3_dir), "--pairs", str(image_pairs), "--out", str(out),
                 "--registers", "4", "--head-hidden", "32", "--train-steps", "60", "--batch-size", "8", "--lr", "3e-3",
                 "--test-fraction", "0.25", "--no-progress"])
    assert code == 0
    return out


def test_train_reward_from_image_pairs_learns_them(trained):
    metrics = json.loads((trained / "metrics.json").read_text())
    assert {"config.json", "registers.safetensors", "pairs.safetensors", "metrics.json"} <= {p.name for p in trained.iterdir()}
    assert metrics["train_pairs"] == 6 and metrics["test_pairs"] == 2  # split by prompt
    assert set(metrics["accuracy_test"]) == {"sigma=0.00", "sigma=0.10", "sigma=0.30", "sigma=0.50", "sigma=0.70", "sigma=0.90"}
    # red vs blue is easy: the registers must rank every clean and lightly noised pair right
    assert metrics["accuracy_train"]["sigma=0.00"] == 1.0 and metrics["accuracy_test"]["sigma=0.10"] == 1.0
    assert metrics["final_train_loss"] < 0.6931  # below chance (log 2)


def test_the_authors_thurstone_loss_trains_the_registers(tiny_sd3_dir, image_pairs, tmp_path):
    """``--loss thurstone``: the registers' authors' pair loss, recorded in the metrics, learns the easy pairs
    (its chance value is 1 − sqrt(Φ(0)) = 0.293; Bradley-Terry's is log 2)."""
    out = tmp_path / "lrr"
    code = main(["train-reward", "--model", str(tiny_sd3_dir), "--pairs", str(image_pairs), "--out", str(out),
                 "--registers", "4", "--head-hidden", "32", "--train-steps", "60", "--batch-size", "8", "--lr", "3e-3",
                 "--test-fraction", "0.25", "--no-progress", "--loss", "thurstone"])
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["loss"] == "thurstone"
    assert metrics["final_train_loss"] < 1 - 0.5 ** 0.5
    assert metrics["accuracy_train"]["sigma=0.00"] == 1.0


def test_several_pair_files_train_and_eval_pairs_are_held_out(trained, image_pairs, tiny_sd3_dir, tmp_path, monkeypatch):
    """``--pairs`` merges JSONL and saved pairs; ``--eval-pairs`` replaces the prompt split, and pairs whose
    prompts never occur in training are also scored on their own. The train accuracy of a set larger than
    ``TRAIN_ACCURACY_PAIRS`` is taken on a subset of that size."""
    monkeypatch.setattr("rewards.cli.train_reward.TRAIN_ACCURACY_PAIRS", 5)
    rows = [json.loads(line) for line in image_pairs.read_text().splitlines()][:4]
    for r in rows[2:]:
        r["prompt"] = "a circle no training pair names"
    held_out = image_pairs.parent / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "lrr"
    code = main(["train-reward", "--model", str(tiny_sd3_dir), "--pairs", str(image_pairs), str(trained / "pairs.safetensors"),
                 "--eval-pairs", str(held_out), "--out", str(out), "--registers", "2", "--head-hidden", "16",
                 "--train-steps", "3", "--batch-size", "4", "--no-progress"])
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_pairs"] == 16 and metrics["test_pairs"] == 4  # nothing of --pairs held out
    assert metrics["accuracy_train_pairs"] == 5
    assert metrics["test_pairs_unseen_prompts"] == 2 and "sigma=0.50" in metrics["accuracy_test_unseen_prompts"]


def test_an_image_shared_by_several_pairs_keeps_every_pair_aligned(image_pairs, tiny_sd3_dir):
    import pipelines
    from rewards.cli.train_reward import pairs_from_jsonl

    rows = [json.loads(line) for line in image_pairs.read_text().splitlines()][:3]
    rows[1]["chosen"] = rows[0]["chosen"]  # one chosen scene against two rejected ones
    shared = image_pairs.parent / "shared.jsonl"
    shared.write_text("".join(json.dumps(r) + "\n" for r in rows))
    policy = pipelines.load(str(tiny_sd3_dir))
    pairs = pairs_from_jsonl(policy, shared, batch=2)  # batches smaller than the file list
    alone = pairs_from_jsonl(policy, image_pairs, batch=64)
    assert torch.equal(pairs.chosen[0], pairs.chosen[1]) and torch.allclose(pairs.chosen[0], alone.chosen[0], atol=1e-6)
    assert torch.allclose(pairs.rejected, alone.rejected[:3], atol=1e-6) and torch.allclose(pairs.chosen[2], alone.chosen[2], atol=1e-6)


def test_guide_zero_is_plain_sampling_and_evaluate_takes_a_guide(trained, tiny_sd3_dir, tmp_path, capsys):
    base = ["sample", "--model", str(tiny_sd3_dir), "--prompt", "a red circle", "--steps", "3", "--seed", "2"]
    assert run(base + ["--out", str(tmp_path / "plain.png")], capsys)[0] == 0
    assert run(base + ["--guide", str(trained), "--guide-scale", "0", "--out", str(tmp_path / "k0.png")], capsys)[0] == 0
    assert run(base + ["--guide", str(trained), "--guide-scale", "0.5", "--out", str(tmp_path / "k.png")], capsys)[0] == 0
    plain, zero, guided = (np.asarray(Image.open(tmp_path / f)) for f in ("plain.png", "k0.png", "k.png"))
    assert np.array_equal(plain, zero) and not np.array_equal(plain, guided)
    code, out, _ = run(["evaluate", "--model", str(tiny_sd3_dir), "--bench", "vvr", "--level", "easy", "--n", "2",
                        "--steps", "2", "--guide", str(trained), "--guide-scale", "0.1", "--out", str(tmp_path / "ev")], capsys)
    assert code == 0
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text())["guide_scale"] == 0.1
    # the authors' σ bands: a band above every step's σ guides nothing, one below them all guides each step
    # at its scale, as --guide-scale does
    for name, bands in (("none", ["1.0:0.5"]), ("all", ["0.001:0.5"])):
        code = run(base + ["--guide", str(trained), "--guide-bands", *bands, "--out", str(tmp_path / f"b-{name}.png")],
                   capsys)[0]
        assert code == 0
    none, every = (np.asarray(Image.open(tmp_path / f"b-{n}.png")) for n in ("none", "all"))
    assert np.array_equal(none, plain) and np.array_equal(every, guided)


@pytest.mark.parametrize("argv,needle", [
    (["train-reward", "--pairs", "x.jsonl", "--bench", "vvr", "--out", "o"], "exactly one"),
    (["train-reward", "--out", "o"], "exactly one"),
    (["train-reward", "--pairs", "/nonexistent.jsonl", "--out", "o"], "no such file"),
    (["train-reward", "--bench", "vvr", "--group-size", "1", "--out", "o"], "--group-size"),
    (["train-reward", "--bench", "vvr", "--eval-pairs", "/nonexistent.safetensors", "--out", "o"], "--eval-pairs"),
    (["sample", "--prompt", "p", "--guide", "/nonexistent", "--out", "x.png"], "no such folder"),
    (["sample", "--prompt", "p", "--guide-window", "0.2", "0.5", "--out", "x.png"], "--guide-window needs"),
    (["sample", "--prompt", "p", "--guide-bands", "0.8:0.3", "--out", "x.png"], "--guide-bands needs"),
])
def test_user_errors(argv, needle, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("extra,needle", [
    (["--guide-bands", "0.8"], "--guide-bands 0.8: give SIGMA:SCALE"),
    (["--guide-bands", "0.2:0.05", "0.8:0.3"], "strictly decreasing"),
    (["--guide-bands", "0.8:0.3", "--guide-scale", "0.1"], "drop --guide-scale and --guide-window"),
])
def test_bad_guide_bands_are_refused_before_loading(extra, needle, trained, capsys):
    code, _, err = run(["sample", "--prompt", "p", "--guide", str(trained), *extra, "--out", "x.png"], capsys)
    assert code == 2 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("extra,needle", [
    (["--lr", "nan"], "--lr nan: give a finite number"),
    (["--lr", "1e30"], "--lr 1e30: give a number <= 1"),
    (["--n", str(10**12)], "--n 1000000000000: give an integer <= 1,000,000"),
    (["--group-size", str(10**9)], "--group-size 1000000000: give an integer <= 1,024"),
    (["--head-hidden", "0"], "--head-hidden 0: give an integer >= 1"),
])
def test_out_of_range_options_are_refused_before_sampling(extra, needle, tmp_path, capsys):
    code, _, err = run(["train-reward", "--bench", "vvr", "--out", str(tmp_path / "o"), *extra], capsys)
    assert code == 2 and needle in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


def test_out_dot_is_the_working_folder(image_pairs, tiny_sd3_dir, tmp_path, monkeypatch, capsys):
    """``--out .`` names the working folder (its resume folder sits beside it), not a path without a name."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code, _, err = run(["train-reward", "--model", str(tiny_sd3_dir), "--pairs", str(image_pairs), "--out", ".",
                        "--overwrite", "--layers", "first"], capsys)
    assert code == 2 and "--layers 'first'" in err and "Traceback" not in err, err  # got past --out
    assert not (tmp_path / "work.partial").exists()


def test_several_heads_each_labelled_by_its_reward(tmp_path, capsys):
    """``--heads vvr vvr_soft``: one register head per reward; each pair carries both heads' score differences
    (the verifier's ties kept where the soft score orders them), the folder loads with both heads, and the
    accuracy is reported per head. On the shipped model, whose samples the verifier tells apart."""
    tiny_sd3_dir = REPO_ROOT / "assets" / "tiny-sd3-vvr"
    from flowalign.cli.common import load_policy
    from flowalign.sampling.guidance import load_latent_reward
    from flowalign.trainers.parts.latent_preference import PreferencePairs

    out = tmp_path / "two-heads"
    code, stdout, err = run(["train-reward", "--model", str(tiny_sd3_dir), "--bench", "vvr", "--level", "medium", "--n", "6",
                             "--group-size", "3", "--steps", "8", "--heads", "vvr", "vvr_soft", "--registers", "2",
                             "--head-hidden", "8", "--train-steps", "3", "--batch-size", "4", "--test-fraction", "0.34",
                             "--out", str(out), "--no-progress"], capsys)
    assert code == 0, err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["heads"] == ["vvr", "vvr_soft"] and set(metrics["accuracy_train"]) == {"vvr", "vvr_soft"}
    assert "head vvr_soft" in stdout
    pairs = PreferencePairs.load(out / "pairs.safetensors")
    assert pairs.heads == ["vvr", "vvr_soft"]
    vvr, soft = pairs.head_margins["vvr"], pairs.head_margins["vvr_soft"]
    assert torch.equal(vvr, pairs.margin)  # the first head orders the pairs: its margin is the pair's
    assert (vvr >= 0).all() and (soft != 0).all()  # a pair the verifier ties is kept for the soft score
    assert (vvr == 0).any() and (vvr > 0).any()  # on these samples: both kinds of pair
    # each pair keeps its prompt's group of samples (the unit of --batch-form authors)
    assert pairs.group is not None and all(len({pairs.prompts[i] for i in g}) == 1 for g in pairs.groups())
    reward = load_latent_reward(out)
    assert reward.head_names == ["vvr", "vvr_soft"]
    policy = load_policy(argparse.Namespace(model=str(tiny_sd3_dir), adapter=None, device="cpu", dtype="fp32"))
    x, cond = pairs.chosen[:2], policy.encode(pairs.prompts[:2])
    heads = reward.score_heads(x, 0.3, cond)
    assert set(heads) == {"vvr", "vvr_soft"} and torch.equal(heads["vvr"], reward.score(x, 0.3, cond))
    assert not torch.equal(heads["vvr"], heads["vvr_soft"])
    code, _, err = run(["train-reward", "--model", str(tiny_sd3_dir), "--pairs", str(out / "pairs.safetensors"),
                        "--heads", "vvr", "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "--heads labels the model's own samples" in err

    # RGS on the heads: the first head alone is the reward's score; both heads, weighted, steer elsewhere
    base = ["sample", "--model", str(tiny_sd3_dir), "--prompt", "two red circles", "--steps", "3", "--seed", "1",
            "--guide", str(out), "--guide-scale", "0.5"]
    for name, heads in (("score", []), ("first", ["--guide-heads", "vvr"]), ("both", ["--guide-heads", "vvr", "vvr_soft:0.5"])):
        assert run(base + heads + ["--out", str(tmp_path / f"{name}.png")], capsys)[0] == 0
    score, first, both = (np.asarray(Image.open(tmp_path / f"{n}.png")) for n in ("score", "first", "both"))
    assert np.array_equal(score, first) and not np.array_equal(first, both)
    code, _, err = run(base + ["--guide-heads", "pickscore", "--out", str(tmp_path / "x.png")], capsys)
    assert code == 2 and "has heads vvr, vvr_soft" in err


def test_grid_pool_with_the_authors_recipe_trains_and_loads(tiny_model_dir, image_pairs, tmp_path):
    """``--architecture grid_pool --recipe authors``: the authors' register architecture (on an SD3 without
    dual-attention blocks, as theirs) and their optimiser; the folder loads back as that architecture."""
    from flowalign.sampling import load_latent_reward
    from rewards.latent_registers.sd3_grid import GridRegisters

    model = tiny_model_dir("sd3", transformer={"dual_attention_layers": [], "num_layers": 6})
    out = tmp_path / "grid"
    code = main(["train-reward", "--model", str(model), "--pairs", str(image_pairs), "--out", str(out),
                 "--architecture", "grid_pool", "--registers", "4", "--recipe", "authors", "--lr", "3e-3",
                 "--warmup-steps", "5", "--train-steps", "40", "--batch-size", "8", "--test-fraction", "0.25",
                 "--no-progress"])
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    assert config["architecture"] == "grid_pool" and config["feature_layers"] == [1, 2, 3]
    assert config["num_transformer_layers"] == 3 and config["num_reward_tokens"] == 4
    assert metrics["recipe"] == "authors" and metrics["final_train_loss"] < 0.6931
    reward = load_latent_reward(out)
    assert isinstance(reward, GridRegisters) and reward.head_names == ["reward"]


def test_warmup_steps_belong_to_the_authors_recipe(capsys):
    code, _, err = run(["train-reward", "--pairs", "x.jsonl", "--out", "o", "--warmup-steps", "3"], capsys)
    assert code != 0 and "--warmup-steps" in err


def test_the_authors_batches_train_on_groups_in_epochs(trained, tiny_sd3_dir, tmp_path, capsys):
    """``--batch-form authors --epochs --global-batch``: the authors' batches on a pairs file whose pairs form
    groups (two pairs a prompt): whole groups a micro-batch, their epochs and accumulation as optimiser steps
    (``train_steps`` is their count), the groups kept in the saved pairs, and the easy pairs learned."""
    from flowalign.trainers.parts.latent_preference import PreferencePairs, authors_steps

    pairs = PreferencePairs.load(trained / "pairs.safetensors")
    prompts = sorted(set(pairs.prompts))
    pairs.group = torch.tensor([prompts.index(p) for p in pairs.prompts])
    pairs.save(tmp_path / "groups.safetensors")
    out = tmp_path / "authors"
    code, _, err = run(["train-reward", "--model", str(tiny_sd3_dir), "--pairs", str(tmp_path / "groups.safetensors"),
                        "--out", str(out), "--registers", "4", "--head-hidden", "32", "--lr", "3e-3",
                        "--loss", "thurstone", "--batch-form", "authors", "--epochs", "15", "--batch-size", "1",
                        "--global-batch", "2", "--test-fraction", "0.25", "--no-progress"], capsys)
    assert code == 0, err
    metrics = json.loads((out / "metrics.json").read_text())
    # three training groups a epoch: a step of two micro-batches and one of the leftover one
    assert len(authors_steps(3, epochs=15, batch_size=1, global_batch=2, seed=0)) == metrics["train_steps"] == 30
    assert metrics["batch_form"] == "authors" and metrics["epochs"] == 15 and metrics["global_batch"] == 2
    assert metrics["final_train_loss"] < 0.293  # below the Thurstone loss's chance value, 1 − sqrt(Φ(0))
    saved = PreferencePairs.load(out / "pairs.safetensors")
    assert len(saved.groups()) == 4 and all(len(g) == 2 for g in saved.groups())


@pytest.mark.parametrize("extra,needle", [
    (["--epochs", "3", "--train-steps", "10"], "--epochs and --train-steps"),
    (["--global-batch", "64"], "--global-batch belongs to --epochs"),
    (["--epochs", "3", "--batch-size", "8", "--global-batch", "60"], "multiple of --batch-size 8"),
])
def test_the_authors_batch_options_are_checked_before_sampling(extra, needle, tmp_path, capsys):
    code, _, err = run(["train-reward", "--bench", "vvr", "--out", str(tmp_path / "o"), *extra], capsys)
    assert code == 2 and needle in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()
