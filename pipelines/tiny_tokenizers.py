"""Offline tokenizers for the tiny SD3 / FLUX / Wan models: CLIP's real byte-level BPE, a word-level T5.

* CLIP tokenizers are byte-level BPE built from the real CLIP merges that ship with ``open_clip``
  (``bpe_simple_vocab_16e6.txt.gz``). ``clip_vocab_size`` keeps only the first merges (a smaller
  but still complete byte-level BPE: any text encodes, no ``<unk>``), so the embedding tables stay
  small; ``clip_vocab_size=None`` keeps the full 49,408-token vocabulary. [derived]
* T5 / UMT5 tokenizers are ``T5Tokenizer`` (the class ``T5TokenizerFast`` aliases in transformers 5)
  over a small word-level Unigram vocabulary (``▁word`` pieces for the VVR / prompt vocabulary plus
  single characters as fallback, so every ASCII prompt encodes). [derived]
"""

from __future__ import annotations

import gzip
from functools import lru_cache
from pathlib import Path


CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
_CLIP_FULL_VOCAB = 49408  # 2*256 byte tokens + 48,894 merges + 2 specials


def _clip_bpe_path() -> Path:
    import open_clip

    return Path(open_clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"


@lru_cache(maxsize=8)
def _clip_vocab_merges(vocab_size: int | None) -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """The real CLIP byte-level BPE (first ``vocab_size - 514`` merges when truncated).

    Vocabulary order exactly as OpenAI's CLIP: 256 byte symbols, the same with ``</w>``, one token
    per merge in merge order, then ``<|startoftext|>``, ``<|endoftext|>``. Truncating the merge list
    keeps a consistent BPE (every merge result is in the vocabulary).
    """
    from open_clip.tokenizer import bytes_to_unicode

    lines = gzip.open(_clip_bpe_path()).read().decode("utf-8").split("\n")
    merges = [tuple(m.split()) for m in lines[1 : 49152 - 256 - 2 + 1]]
    n_merges = len(merges)
    if vocab_size is not None:
        if vocab_size < 514:
            raise ValueError(f"clip_vocab_size={vocab_size}: must be >= 514 (bytes + specials) or None")
        n_merges = min(n_merges, vocab_size - 514)
    merges = merges[:n_merges]
    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + [CLIP_BOS, CLIP_EOS]
    return {t: i for i, t in enumerate(tokens)}, tuple(merges)


def clip_tokenizer(vocab_size: int | None = 4096, model_max_length: int = 77, pad_token: str = CLIP_EOS):
    """A ``CLIPTokenizer`` over the real CLIP BPE (optionally truncated), built offline.

    ``pad_token``: CLIP-L in SD3 pads with ``<|endoftext|>``, CLIP-G (tokenizer_2) with ``"!"``.
    """
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocab_merges(vocab_size)
    tok = CLIPTokenizer(
        vocab=dict(vocab),
        merges=[tuple(m) for m in merges],
        unk_token=CLIP_EOS,
        bos_token=CLIP_BOS,
        eos_token=CLIP_EOS,
        pad_token=pad_token,
        model_max_length=model_max_length,
    )
    return tok


# Word-level vocabulary for the tiny T5 / UMT5 tokenizers: the VVR prompt grammar plus common words.
T5_WORDS = """
a an the of on in at to and or with without is are be as by for from into onto over under than then that
this these those there their its it one two three four five six seven eight nine ten zero no none not
exactly only just each every all both any some more most less least fewer many several single pair
same different other another left right above below top bottom middle center centre corner upper lower
inside outside touching touch touches overlapping overlap overlaps separated separate apart aligned
horizontally vertically horizontal vertical between nearest closest farthest near far next beside
leftmost rightmost topmost bottommost extremal region quadrant half side edge image picture scene canvas
background foreground object objects shape shapes colour colours color colors size sizes filled outline
outlined hollow solid small medium large big tiny huge bigger smaller larger biggest smallest largest
circle circles square squares rectangle rectangles triangle triangles pentagon pentagons hexagon hexagons
star stars ellipse ellipses oval ovals dot dots disc disk box boxes line lines
red orange yellow green lime teal cyan blue navy purple violet magenta pink brown black white gray grey
gold silver beige maroon olive light dark bright pale
at-least at-most more-than equal equally count number total has have contains contain containing
lies lie sits sit placed located positioned appears appear visible shown drawn
photo photograph painting drawing render rendering style high quality detailed simple flat minimal
cat dog bird car tree house person man woman child horse boat flower sky sea water mountain city street
""".split()
_T5_CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()[]/&+*%#=_")


@lru_cache(maxsize=4)
def _t5_vocab(extra_words: tuple[str, ...] = ()) -> tuple[tuple[str, float], ...]:
    words = list(dict.fromkeys(T5_WORDS + list(extra_words)))
    words = list(dict.fromkeys(words + [w.capitalize() for w in words]))
    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -6.0)]
    # whole words beat character spellings: one piece at -5 vs >= 2 pieces at -12 each
    vocab += [("▁" + w, -5.0 - 1e-4 * i) for i, w in enumerate(words)]
    vocab += [(c, -12.0) for c in _T5_CHARS]
    vocab += [("▁" + c, -12.5) for c in _T5_CHARS if c not in words]
    seen: set[str] = set()
    out = []
    for piece, score in vocab:
        if piece not in seen:
            seen.add(piece)
            out.append((piece, score))
    return tuple(out)


def t5_tokenizer(model_max_length: int = 512, extra_words: tuple[str, ...] = ()):
    """A ``T5Tokenizer`` (= ``T5TokenizerFast``) over a small word-level Unigram vocabulary, offline.

    Layout as T5's: ``<pad>=0, </s>=1, <unk>=2``; no sentinel ``<extra_id_*>`` tokens. Case-sensitive
    (transformers rebuilds T5's backend without a normaliser on reload), so words come lower-case and
    capitalised.
    """
    from transformers import T5Tokenizer

    return T5Tokenizer(vocab=list(_t5_vocab(tuple(extra_words))), extra_ids=0, model_max_length=model_max_length)

