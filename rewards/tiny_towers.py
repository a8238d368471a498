"""The text and vision towers of the tiny CLIP-style models the tiny reward folders hold (CLIP, OWLv2): one
width (32, MLP 64, two heads, 16 px patches) so every tiny reward builds in a second, the text tower sized to
the tiny pipelines' CLIP tokenizer."""

from __future__ import annotations

from typing import Any


def clip_style_towers(tok: Any, layers: int, max_positions: int,
                      image_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(text_config, vision_config)`` keyword dicts for a ``CLIPConfig`` / ``Owlv2Config``: ``layers`` layers
    each, the text tower over ``tok``'s vocabulary and special tokens with ``max_positions`` positions, the
    vision tower over ``image_size`` px images."""
    text = {"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
            "num_attention_heads": 2, "max_position_embeddings": max_positions, "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers, "num_attention_heads": 2,
              "image_size": image_size, "patch_size": 16}
    return text, vision
