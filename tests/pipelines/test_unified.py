"""The unified policy's text side on the tiny Qwen-Image-Edit twin: reflections decoded with the KV cache are the
ones a full forward per token writes, with the same log-probs, whatever the checkpoint's generation config."""

from __future__ import annotations

import pytest
import torch

import pipelines
from pipelines.unified import PAD, unified
from tests.tiny_recipes import REPO

MODEL = REPO / "assets" / "tiny-qwen-image-edit"
PROMPTS = ["a red cube", "two cats on a mat", "a blue ball"]


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    made = unified(pipelines.load(str(MODEL)))
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
            lp.append(float(torch.log_softmax(logits, -1)[token]))
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
    # at any temperature the log-probs are the model's own, the ones training recomputes with gradients
    with torch.no_grad():
        again = policy.token_log_probs(images, PROMPTS, tokens)
    assert torch.allclose(again, log_probs, atol=1e-5)


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
