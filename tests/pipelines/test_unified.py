"""The unified policy's text side on the tiny Qwen-Image-Edit twin: reflections decoded with the KV cache are the
ones a full forward per token writes, with the same log-probs (at the temperature they were drawn at), whatever
the checkpoint's generation config; the reference (``adapter_disabled``) scores them with the language LoRA off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pipelines
from pipelines.unified import PAD, tempered_log_probs, unified
from tests.tiny_recipes import REPO

MODEL = REPO / "assets" / "tiny-qwen-image-edit"
PROMPTS = ["a red cube", "two cats on a mat", "a blue ball"]


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    made = unified(pipelines.load(str(MODEL), lora={"rank": 4, "alpha": 8.0}))  # the reference: adapters off
    with torch.no_grad():  # a language LoRA that is not zero, so the written text depends on it
        for name, t in made.language_adapter().items():
            if "lora_B" in name:
                t.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return made


def full_prefix(policy, image: torch.Tensor, prompt: str, max_new_tokens: int, generator: torch.Generator,
                temperature: float = 1.0) -> tuple[list[int], list[float]]:
    """Decoding without a cache: one whole forward over prompt, image and every token so far per token."""
    inputs, tokens, lp = policy._inputs(image, prompt), [], []
    with torch.no_grad(), policy.writing():
        for _ in range(max_new_tokens):
            logits = policy._logits(inputs, torch.tensor(tokens, dtype=torch.long))[-1].cpu()
            if temperature == 0:
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial(torch.log_softmax(logits / temperature, -1).exp(), 1, generator=generator))
            tokens.append(token)
            lp.append(float(torch.log_softmax(logits / (temperature or 1.0), -1)[token]))
            if token == policy.eos_id:
                break
    return tokens, lp


@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_cached_reflections_are_the_full_prefix_ones(policy, temperature):
    images = torch.rand(len(PROMPTS), 3, 32, 32, generator=torch.Generator().manual_seed(3))
    seeds = [11, 12, 13]
    tokens, log_probs = policy.generate(images, PROMPTS, 24, [torch.Generator().manual_seed(s) for s in seeds],
                                        temperature=temperature)
    for i, (image, prompt, s) in enumerate(zip(images, PROMPTS, seeds)):
        ref_tokens, ref_lp = full_prefix(policy, image, prompt, 24, torch.Generator().manual_seed(s), temperature)
        n = len(ref_tokens)
        assert tokens[i, :n].tolist() == ref_tokens and (tokens[i, n:] == PAD).all()
        assert torch.allclose(log_probs[i, :n], torch.tensor(ref_lp), atol=1e-5)
        assert (log_probs[i, n:] == 0).all()
    if temperature > 0:  # the draws are the generators': another seed, another text
        other, _ = policy.generate(images[:1], PROMPTS[:1], 24, [torch.Generator().manual_seed(99)],
                                   temperature=temperature)
        assert not torch.equal(other[0], tokens[0])
    # the log-probs are those of the distribution drawn from, the ones training recomputes with gradients
    with torch.no_grad():
        again = policy.token_log_probs(images, PROMPTS, tokens, temperature=temperature or 1.0)
        plain = policy.token_log_probs(images, PROMPTS, tokens)
    assert torch.allclose(again, log_probs, atol=1e-5)
    if temperature not in (0.0, 1.0):
        assert not torch.allclose(plain, log_probs, atol=1e-3)


def test_log_probs_at_a_temperature_are_the_authors():
    """UMM-Reflection's teacher-forced text log-probs (waltstephen/UMM-Reflection @ 8510796,
    g008_counting.teacher_forced_text_log_probs: log_softmax(logits / temperature) at the sampled tokens;
    their training temperature 0.9), float64, on fixed logits."""
    data = json.loads((Path(__file__).parents[1] / "flowalign" / "trainers" / "known_answers" /
                       "umm_reflection_kl.json").read_text())["log_probs"]
    logits = torch.tensor(data["logits"], dtype=torch.float64)
    tokens = torch.tensor(data["tokens"])
    for temperature, expected in data["at"].items():
        ours = tempered_log_probs(logits.double(), tokens, float(temperature))
        assert torch.allclose(ours.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0), temperature
    assert not torch.allclose(tempered_log_probs(logits, tokens, 1.0).double(),
                              torch.tensor(data["at"]["0.9"], dtype=torch.float64), rtol=1e-3)


def test_the_reference_scores_text_with_the_language_lora_off(policy):
    """Inside ``adapter_disabled()`` the text is the starting model's (the LoRA off: its B zeroed gives the
    same), outside it the trained one's again."""
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(8))
    tokens, _ = policy.generate(images, PROMPTS[:2], 6, [torch.Generator().manual_seed(s) for s in (1, 2)])
    with torch.no_grad():
        trained = policy.token_log_probs(images, PROMPTS[:2], tokens, temperature=0.9)
        with policy.adapter_disabled():
            reference = policy.token_log_probs(images, PROMPTS[:2], tokens, temperature=0.9)
        after = policy.token_log_probs(images, PROMPTS[:2], tokens, temperature=0.9)
        saved = {n: t.clone() for n, t in policy.language_adapter().items() if "lora_B" in n}
        try:
            for n, t in policy.language_adapter().items():
                if "lora_B" in n:
                    t.zero_()
            zeroed = policy.token_log_probs(images, PROMPTS[:2], tokens, temperature=0.9)
        finally:
            for n, t in policy.language_adapter().items():
                if n in saved:
                    t.copy_(saved[n])
    assert torch.equal(after, trained)
    assert not torch.allclose(reference, trained, atol=1e-3)
    assert torch.allclose(reference, zeroed, atol=1e-6)


def test_the_checkpoints_generation_config_changes_nothing(policy):
    """Qwen2.5-VL ships sampling settings (repetition penalty, top-k, ...) in generation_config.json; the
    reflections are drawn from the model's own distribution regardless (what the log-probs score)."""
    images = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    plain = policy.generate(images, PROMPTS[:1], 16, [torch.Generator().manual_seed(7)])
    config = policy.language.generation_config
    saved = config.to_dict()
    # suppressing the tokens it wrote: any processor before the draw would change the text
    config.update(do_sample=True, top_k=1, temperature=0.1, repetition_penalty=1.05,
                  suppress_tokens=sorted(set(plain[0][0].tolist())))
    try:
        shipped = policy.generate(images, PROMPTS[:1], 16, [torch.Generator().manual_seed(7)])
        assert policy.language.generation_config is config  # put back as it was
    finally:
        policy.language.generation_config = type(config).from_dict(saved)
    assert torch.equal(plain[0], shipped[0]) and torch.equal(plain[1], shipped[1])


def test_written_special_tokens_are_not_markup_in_the_text(policy):
    """A reflection is an edit instruction: a special token the model writes (an untrained one writes any) must
    not become chat or vision markup there, which the editor's processor would refuse."""
    special = [policy.tokenizer.convert_tokens_to_ids(t) for t in ("<|video_pad|>", "<|image_pad|>", "<|im_start|>")]
    plain = policy.tokenizer.encode("make it red", add_special_tokens=False)
    row = torch.tensor([[special[0], *plain, special[1], special[2], policy.eos_id, PAD]])
    assert policy.decode_tokens(row) == ["make it red"]
