"""Offline Qwen-family tokenizers for the tiny twins: byte-level BPE with Qwen's special tokens.

Qwen2.5-VL (Qwen-Image), Qwen3 (FLUX.2-klein, Z-Image) all use ``Qwen2Tokenizer`` (GPT-2-style byte-level
BPE, ``Ġ`` marks a leading space) with ChatML specials. The tiny vocabulary is the 256 byte symbols plus
whole-word merges for the prompt words of :mod:`pipelines.tiny` (so any text encodes, common words are one
token), then the specials. The chat template is Qwen3's for one user turn (the ``<think>`` block Qwen3
writes when ``enable_thinking=False``), enough for the pipelines' ``apply_chat_template`` calls. [derived]
"""

from __future__ import annotations

from functools import lru_cache

#: ChatML / Qwen-VL specials, in Qwen's order (ids follow the BPE vocabulary)
SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>", "<think>", "</think>",
]

#: Qwen3's template restricted to what the pipelines send: plain user/system turns, generation prompt,
#: the empty think block when thinking is off
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def add_word_merges(tokens: list[str], merges: list[tuple[str, str]], pieces: list[str]) -> None:
    """Grow a BPE vocabulary in place so each of ``pieces`` encodes as one token: every prefix of a piece
    becomes a token, merged from the prefix before it and the next character."""
    seen = set(tokens)
    for piece in pieces:
        acc = piece[0]
        for ch in piece[1:]:
            merged = acc + ch
            if merged not in seen:
                seen.add(merged)
                tokens.append(merged)
                merges.append((acc, ch))
            acc = merged


@lru_cache(maxsize=2)
def vocab_merges() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    from open_clip.tokenizer import bytes_to_unicode

    from pipelines.tiny_tokenizers import T5_WORDS

    symbols = list(bytes_to_unicode().values())
    tokens = list(symbols)
    merges: list[tuple[str, str]] = []
    add_word_merges(tokens, merges, [p for word in dict.fromkeys(T5_WORDS) for p in (word, "Ġ" + word)])
    return {t: i for i, t in enumerate(tokens)}, tuple(merges)


def qwen_tokenizer(model_max_length: int = 1024):
    """A ``Qwen2Tokenizer`` (byte-level BPE + ChatML specials + chat template), built offline."""
    from transformers import AddedToken, Qwen2Tokenizer

    vocab, merges = vocab_merges()
    vocab = dict(vocab)
    for special in SPECIALS:
        vocab[special] = len(vocab)
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=list(merges),
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
    )
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(s, special=True) for s in SPECIALS[1:]]})
    tok.chat_template = CHAT_TEMPLATE
    return tok
