"""A tiny, randomly initialised Qwen2.5-VL judge built offline (for tests and demos).

``build_tiny_vlm(out_dir)`` writes a folder that ``AutoModelForImageTextToText.from_pretrained`` and
``AutoProcessor.from_pretrained`` load like a real Qwen2.5-VL checkpoint: the real
``Qwen2_5_VLForConditionalGeneration`` with a tiny config (2 vision blocks, 2 decoder layers, hidden
64), the real ``Qwen2_5_VLProcessor`` (``Qwen2VLImageProcessor`` resizing, ``Qwen2VLVideoProcessor``)
and a ``Qwen2Tokenizer`` with Qwen's pre-tokeniser and chat template. Nothing is downloaded:

* the tokenizer is byte-level BPE (every text encodes, no ``<unk>``) whose merges are learnt here from
  a small judge / VVR corpus with ``tokenizers``' BPE trainer, so "Score", "Yes", "No" and the prompt
  words are single tokens and, as in Qwen, digits are always single tokens (Qwen's pre-tokeniser
  splits numbers into digits) [derived];
* the chat-template tokens (``<|im_start|>``, ``<|im_end|>``, ``<|vision_start|>``, ``<|image_pad|>``,
  ...) are special tokens at the end of the vocabulary, with the ids the config points at.

Images are resized by the processor to at most ``max_pixels`` (56x56 by default: 4 visual tokens per
image), so a judge call costs milliseconds on a CPU.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

__all__ = ["build_tiny_vlm", "tiny_vlm_tokenizer", "QWEN_VL_CHAT_TEMPLATE", "SPECIAL_TOKENS", "FAMILIES"]

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen2_vl")

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
)

# Qwen2-VL / Qwen2.5-VL's own chat template (as shipped in their chat_template.json).
QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# What the tokenizer's merges are learnt from: the judge prompts' words, the answers a judge gives, and
# the VVR prompt vocabulary. Each line is seen several times so that its words become single tokens.
_CORPUS = """
You are a helpful assistant. You are a strict judge of generated images and videos.
Rate how well the image matches the prompt on a scale from 1 to 9. Answer with the score only.
Score: 1 Score: 2 Score: 3 Score: 4 Score: 5 Score: 6 Score: 7 Score: 8 Score: 9 Score: 10
Does the image match the prompt? Answer Yes or No. Answer: Yes Answer: No yes no
Alignment Score (1-5): 4 Coherence Score (1-5): 3 Style Score (1-5): 5 Final Score: 7/10
<think> the image shows </think> <answer> 3 </answer> Image 1 is better. Image 2 is better.
Write a rubric for judging images generated for this prompt as JSON: a list of criteria, each with
name, description and weight; the weights sum to 1. criterion criteria rubric weight description name
Frames of a video, in order. Prompt: The prompt is
a an the of on in at to and or with is are two three four left right above below top bottom middle
red orange yellow green blue purple pink brown black white gray circle square triangle star small large
""".strip()


def tiny_vlm_tokenizer(vocab_size: int = 640):
    """A ``Qwen2Tokenizer`` (byte-level BPE, Qwen pre-tokeniser, Qwen-VL chat template), built offline.

    The special tokens take the last ``len(SPECIAL_TOKENS)`` ids.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    base = Qwen2Tokenizer(vocab={"<|endoftext|>": 0}, merges=[])  # only for Qwen's exact pre-tokeniser
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = base.backend_tokenizer.pre_tokenizer
    bpe.normalizer = base.backend_tokenizer.normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    bpe.train_from_iterator([_CORPUS] * 8, trainer=trainer)
    vocab = dict(bpe.get_vocab())
    merges = json.loads(bpe.to_str())["model"]["merges"]  # the trained model's merges, in rank order
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]
    for t in SPECIAL_TOKENS:
        vocab[t] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>", model_max_length=4096)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tok.chat_template = QWEN_VL_CHAT_TEMPLATE
    return tok


def build_tiny_vlm(out_dir: str | os.PathLike | None = None, *, family: str = "qwen2_5_vl", seed: int = 0,
                   max_pixels: int | None = None, overwrite: bool = False, **text_overrides: Any):
    """Build (and with ``out_dir``, save) a tiny Qwen2.5-VL (``family="qwen2_5_vl"``), Qwen3-VL
    (``"qwen3_vl"``) or Qwen2-VL (``"qwen2_vl"``, the base of HPSv3 and VideoAlign) model, its processor
    and tokenizer.

    Returns ``(model, processor)``; the model is in eval mode, float32, weights initialised under
    ``torch.manual_seed(seed)`` inside a forked RNG (the caller's RNG is untouched). ``max_pixels``
    caps the processor's resizing (default: 2x2 merged patches, 4 visual tokens per image).
    ``text_overrides`` change the decoder config (``num_hidden_layers``, ``hidden_size``, ...). The folder is
    written atomically (:func:`flowalign.io.atomic_dir`, writer ``build-tiny-vlm``): a failure leaves it as it
    was, and a folder holding files it did not write is refused unless ``overwrite``.
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"build_tiny_vlm: family={family!r}; use one of {FAMILIES}")
    tok = tiny_vlm_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    hidden, heads = text_overrides.pop("hidden_size", 64), text_overrides.pop("num_attention_heads", 4)
    head_dim = hidden // heads
    # Qwen's M-RoPE splits the rotary half-dimension into (temporal, height, width) sections
    hw = head_dim // 2 // 3
    mrope = [head_dim // 2 - 2 * hw, hw, hw]
    patch = 16 if family == "qwen3_vl" else 14
    text = {
        "vocab_size": len(tok), "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": 2, "head_dim": head_dim,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope,
                            **({"mrope_interleaved": True} if family == "qwen3_vl" else {})},
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"], **text_overrides,
    }
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": patch,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": hidden}
    if family == "qwen2_vl":  # Qwen2-VL's vision tower: embed_dim wide, merged to the decoder's hidden size
        text.pop("head_dim")
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": hidden, "mlp_ratio": 2, "num_heads": 2,
                  "patch_size": patch, "spatial_merge_size": 2, "temporal_patch_size": 2}
        names = ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor", "Qwen2VLVideoProcessor")
    elif family == "qwen2_5_vl":
        text.pop("head_dim")
        vision.update(window_size=56, fullatt_block_indexes=[1])
        names = ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor",
                 "Qwen2VLVideoProcessor")
    else:
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])
        names = ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", "Qwen3VLVideoProcessor")
    config_cls, model_cls, processor_cls, video_cls = (getattr(transformers, n) for n in names)
    config = config_cls(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).eval()
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    factor = patch * 2
    size = {"shortest_edge": factor * factor, "longest_edge": max_pixels or (2 * factor) ** 2}
    kw = dict(size=size, patch_size=patch, temporal_patch_size=2, merge_size=2)
    processor = processor_cls(image_processor=transformers.Qwen2VLImageProcessor(**kw), video_processor=video_cls(**kw),
                              tokenizer=tok, chat_template=QWEN_VL_CHAT_TEMPLATE)
    if out_dir is not None:
        from flowalign.io import atomic_dir

        with atomic_dir(out_dir, writer="build-tiny-vlm", overwrite=overwrite) as tmp:
            model.save_pretrained(tmp)
            processor.save_pretrained(tmp)
    return model, processor
