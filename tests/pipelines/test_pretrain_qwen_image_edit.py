"""``flowalign pretrain-tiny qwen_image_edit``: the reflection data are labelled by the verifier and fit the
recipe's token budget, the reflection writer learns a fixed batch, and a seconds-long run exports a folder that
``pipelines.load`` opens and :class:`pipelines.unified.UnifiedEditPolicy` uses to reflect and revise; a stage
resumed with a larger budget continues where it stopped."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from diffusers import QwenImageEditPipeline

import pipelines
from flowalign.cli.main import main
from flowalign.reflection import Reflection, instruction, reflect
from flowalign.sampling import rollout
from pipelines._common import pack_2x2
from pipelines.pretrain import qwen_image_edit as family
from pipelines.pretrain.stage import losses
from pipelines.unified import unified
from rewards.vvr import Task, verify

MIX = {"easy": 0.75, "medium": 0.25}


@pytest.fixture(scope="module")
def data() -> dict:
    return family.build_data(24, 16, MIX, seed=0, size=32, max_tokens=8)


@pytest.fixture(scope="module")
def pipe(data):
    tok = family.build_tokenizer(family.training_texts(data))
    made, _ = family.build(tok, argparse.Namespace(seed=0, max_sequence_length=0))
    return made


def test_answers_say_no_change_exactly_when_the_verifier_passes(data):
    right, wrong = family.reflection_examples(data)
    assert right and wrong and {e["kind"] for e in data["edits"]} >= {"recolour", "add", "remove"}
    for ex in right + wrong:
        image = data["pixels"][ex["image"]][:, 0].permute(1, 2, 0).numpy()
        assert verify(Task.from_dict(ex["task"]), image).all_passed == (ex["answer"] == family.NO_CHANGE), ex
    assert data["pixels"][0].unique().tolist() == [family.CANVAS]  # the grey canvas of first images
    captions = family.caption_examples(data)
    assert len(captions) == len(data["pixels"]) and {"nothing", "a red square"} <= {c["answer"] for c in captions}
    for scene in data["scenes"]:  # a one-object scene's caption is its easy prompt
        if scene["level"] == "easy":
            assert captions[scene["image"]]["answer"] == scene["prompt"]


def test_answers_and_the_end_token_fit_the_recipes_reflection_length(data, pipe):
    _, wrong = family.reflection_examples(data)
    for answer in {ex["answer"] for ex in wrong} | {family.NO_CHANGE}:
        assert len(pipe.tokenizer(answer, add_special_tokens=False).input_ids) + 1 <= 8, answer
    assert pipe.tokenizer("make the blue square purple").input_ids.__len__() == 5  # one token a word
    template, dropped = family.edit_template()  # the pipeline drops exactly the system part of its template
    assert len(pipe.tokenizer(template.split("<|vision_start|>")[0]).input_ids) == dropped


def test_reflection_loss_falls_on_a_fixed_batch(data, pipe):
    right, wrong = family.reflection_examples(data)
    batch = family.reflection_inputs(pipe, data["pixels"], right[:4] + wrong[:4])
    assert (batch["labels"] != -100).sum() == sum(len(pipe.tokenizer(ex["answer"]).input_ids) + 1
                                                  for ex in right[:4] + wrong[:4])
    language = pipe.text_encoder.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(language.parameters(), lr=3e-3)
    seen = []
    for _ in range(20):
        loss = family.reflection_loss(language, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen.append(loss.item())
    language.eval().requires_grad_(False)
    assert seen[-1] < 0.5 * seen[0], seen


def _argv(out: Path, export: Path, *extra: str) -> list[str]:
    return ["pretrain-tiny", "qwen_image_edit", "--out", str(out), "--export", str(export), "--n-scenes", "16",
            "--n-edits", "8", "--vae-steps", "2", "--vae-batch", "4", "--dec-steps", "1", "--reflect-steps", "2",
            "--reflect-batch", "4", "--dit-steps", "2", "--batch", "4", "--warmup", "1", "--save-every", "1",
            "--demo-n", "0", "--sample-steps", "2", "--threads", str(torch.get_num_threads()), *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("qwen_image_edit")
    out, export = root / "run", root / "model"
    assert main(_argv(out, export)) == 0
    return out, export


def test_a_short_run_exports_a_unified_model_that_reflects_and_revises(run):
    out, export = run
    assert [len(losses(out / stage)) for stage in ("vae", "reflect", "dit", "decoder")] == [2, 2, 2, 1]
    defaults = json.loads((export / "flowalign.json").read_text())
    assert defaults["family"] == "qwen_image_edit" and defaults["edit_image_area"] == 32 * 32
    assert defaults["guidance_scale"] == 1.0 and defaults["height"] == 32
    pipe = QwenImageEditPipeline.from_pretrained(export)
    assert pipe.text_encoder.config.text_config.vocab_size == len(pipe.tokenizer)
    assert len(pipe.tokenizer("make the blue square purple").input_ids) == 5  # the learnt merges survive a reload

    policy = unified(pipelines.load(export))
    image = torch.rand(1, 3, 32, 32)
    tokens, log_probs = policy.generate(image, ["a red circle"], 8, temperature=0)
    assert tokens.shape[1] <= 8 and torch.isfinite(log_probs).all()
    reflection = policy.decode_tokens(tokens)[0]
    revised = rollout(policy.editor, [instruction("a red circle", reflection or "make it red")], num_steps=2,
                      sampler="ode", guidance_scale=None, metadata=[{"image": image[0]}],
                      generators=[torch.Generator().manual_seed(0)]).samples
    assert revised.shape == (1, 3, 32, 32) and torch.isfinite(revised).all()
    how = Reflection(rounds=1, max_new_tokens=8, stop_phrase=family.NO_CHANGE, temperature=0)
    rounds, final = reflect(policy, image, ["a red circle"], how, lambda i, salt, r: 0, num_steps=2,
                            guidance_scale=None, batch_size=1)  # the recipe's loop runs on the exported model
    assert final.shape == (1, 3, 32, 32) and len(rounds) == 1


def test_the_transformer_trains_on_what_the_policy_feeds_it(run):
    out, export = run
    from safetensors.torch import load_file

    policy = pipelines.load(export)
    pixels = load_file(str(out / "data.safetensors"))["pixels"]
    x0 = load_file(str(out / "latents.safetensors"))["x0"]
    prompts, ref = ["a red circle", "a blue square. make the green square blue"], torch.tensor([0, 3])
    cond = policy.encode(prompts, images=[pixels[int(i)][:, 0].float() / 255 for i in ref])
    mine = family.text_conditioning(policy.pipe, prompts, [family.picture(pixels[int(i)]) for i in ref])
    assert torch.allclose(pack_2x2(x0[ref]), cond.tensors["image_latents"], atol=1e-5)
    x, sigma = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(0)), torch.tensor([0.3, 0.8])
    with torch.no_grad():
        trained = family.edit_velocity(policy.transformer, x, x0[ref], sigma, mine)
    assert torch.allclose(trained, policy.velocity(x, sigma, cond, 1.0), atol=1e-4)


def test_a_stage_resumed_with_a_larger_budget_continues(run):
    out, export = run
    assert main(_argv(out, export, "--resume", "--reflect-steps", "4")) == 0
    assert json.loads((out / "reflect" / "DONE").read_text())["step"] == 4
    assert (out / "tokenizer").is_dir()  # the first run's tokenizer, read back so the trained ids keep meaning
    assert len(losses(out / "reflect")) == 4
    assert len(losses(out / "vae")) == 2 and not list(out.glob("vae.stale-*"))  # finished, same budget: no step
    # the transformer read the old encoder's states: its stage was moved aside and trained again
    assert [p.name.split(".stale-")[0] for p in out.glob("*.stale-*")] == ["dit"]
    assert len(losses(out / "dit")) == 2


def test_evaluation_measures_first_images_and_reflections_into_the_model_card(run):
    out, export = run
    assert main(_argv(out, export, "--eval-only", "--eval-n", "4")) == 0
    measured = json.loads((out / "eval.json").read_text())
    assert measured["easy"]["n"] == 4 and 0 <= measured["easy"]["accuracy"] <= 1
    assert {"no_change_on_correct", "no_change_on_wrong", "exact_fix_on_wrong"} <= set(measured["reflection"])
    card = (export / "README.md").read_text()
    assert card.startswith(family.CARD_MARK) and "{" not in card
    (export / "README.md").write_text("# a card someone wrote\n")  # a hand-written card is kept
    assert main(_argv(out, export, "--eval-only", "--eval-n", "2")) == 0
    assert (export / "README.md").read_text() == "# a card someone wrote\n"


def test_help_lists_the_family_flags(capsys):
    with pytest.raises(SystemExit):
        main(["pretrain-tiny", "qwen_image_edit", "--help"])
    text = capsys.readouterr().out
    for flag in ("--vae-minutes", "--reflect-minutes", "--reflect-steps", "--reflect-wrong", "--reflect-max-tokens",
                 "--dit-minutes", "--dit-mix", "--n-edits", "--resume"):
        assert flag in text, flag


def test_bad_flags_are_one_line_errors(tmp_path, capsys):
    assert main(_argv(tmp_path / "a", tmp_path / "b", "--dit-mix", "t2i:1,paint:1")) != 0
    assert "--dit-mix" in capsys.readouterr().err
    assert main(_argv(tmp_path / "a", tmp_path / "b", "--size", "48")) != 0
    assert "--size 48" in capsys.readouterr().err
