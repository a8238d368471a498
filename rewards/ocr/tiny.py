"""A random, architecture-faithful GOT-OCR 2.0 folder for offline tests of the ``ocr`` reward's model engine.

``save_tiny_got_ocr2(out)`` writes a ``GotOcr2ForConditionalGeneration`` with tiny configs and its
``GotOcr2Processor`` with ``save_pretrained``, as ``stepfun-ai/GOT-OCR-2.0-hf`` ships them:
``rewards.load("ocr", engine="got_ocr2", path=out)`` reads it through the engine's real loading code.
"""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_got_ocr2(out: Path, seed: int = 0, *, overwrite: bool = False) -> dict[str, object]:
    """Write the tiny GOT-OCR 2.0 folder into ``out``; returns the reward options that load it
    (``{"engine": "got_ocr2", "path": out}``).

    A byte-level tokenizer with GOT's special tokens; a 1024 px input, so the vision tower yields the
    processor's 256 image tokens; windowed attention only, to be fast on a CPU. Written atomically
    (:func:`flowalign.io.atomic_dir`, writer ``save-tiny-got-ocr2``): a failure leaves ``out`` as it was, and a
    folder holding files it did not write is refused unless ``overwrite``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        GotOcr2Config,
        GotOcr2ForConditionalGeneration,
        GotOcr2ImageProcessor,
        GotOcr2Processor,
        PreTrainedTokenizerFast,
    )

    from flowalign.io import atomic_dir

    bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, merges=[]))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<img>", "</img>", "<imgpad>"]})
    config = GotOcr2Config(
        vision_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=2, image_size=1024,
                           patch_size=16, window_size=4, global_attn_indexes=[], use_rel_pos=False, mlp_dim=64),
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512),
        image_token_index=tokenizer.convert_tokens_to_ids("<imgpad>"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GotOcr2ForConditionalGeneration(config).eval()
    with atomic_dir(out, writer="save-tiny-got-ocr2", overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        GotOcr2Processor(image_processor=GotOcr2ImageProcessor(size={"height": 1024, "width": 1024}),
                         tokenizer=tokenizer).save_pretrained(tmp)
    return {"engine": "got_ocr2", "path": Path(out)}
