"""Tiny FLUX.2 [dev] twin: ``Flux2Pipeline`` with the published FLUX.2-dev transformer config shrunk.

The dev release differs from klein in its text side and its guidance: a ``Mistral3ForConditionalGeneration``
(Mistral-Small-3.1, language model + Pixtral vision tower) read through a ``PixtralProcessor`` chat template
with FLUX.2's system message, hidden states of three layers stacked (dev: 10, 20, 30 of 40; here 1, 2, 3 of 3),
and a guidance-distilled transformer (``guidance_embeds``: the scale is an input, no CFG). VAE and scheduler
are the klein twin's. The processor's tokenizer is byte-level BPE over the tiny vocabulary with Mistral's
control tokens; the chat template is Mistral-Small-3.1's for system and user turns. [derived]
"""

from __future__ import annotations

from typing import Any

from pipelines.tiny_twins.flux2 import DEFAULTS as _KLEIN
from pipelines.tiny_twins.published import published_config

MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                    "[IMG_BREAK]", "[IMG_END]", "<pad>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% set text = m['content'] if m['content'] is string else "
    "(m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('')) %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]{% elif m['role'] == 'user' %}"
    "[INST]{{ text }}[/INST]{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)
#: FLUX.2-dev's model card: embedded guidance 4.0, 50 steps; fewer for the tiny model
SAMPLING: dict[str, Any] = {"height": 32, "width": 32, "num_frames": None, "guidance_scale": 4.0, "num_steps": 20,
                            "max_sequence_length": 48, "text_encoder_out_layers": [1, 2, 3]}


def processor():
    """A ``PixtralProcessor`` over a byte-level BPE ``LlamaTokenizer`` with Mistral's control tokens, offline."""
    from transformers import AddedToken, LlamaTokenizer, PixtralImageProcessor, PixtralProcessor

    from pipelines.tiny_twins.tokenizers import vocab_merges

    vocab, merges = vocab_merges()
    vocab = dict(vocab)
    for special in MISTRAL_SPECIALS:
        vocab[special] = len(vocab)
    tok = LlamaTokenizer(vocab=vocab, merges=list(merges), unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                         pad_token="<pad>", add_prefix_space=False)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(s, special=True) for s in MISTRAL_SPECIALS[3:]]})
    return PixtralProcessor(image_processor=PixtralImageProcessor(size={"longest_edge": 64}, patch_size=16),
                            tokenizer=tok, patch_size=16, chat_template=CHAT_TEMPLATE)


def build(**overrides):
    """A tiny ``Flux2Pipeline`` (FLUX.2-dev-like: Mistral-3 text, guidance embedding)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from pipelines.tiny_twins.base import check_keys, merge, seeded, vae_config

    check_keys("flux2_dev", overrides, {"seed", "transformer", "vae", "scheduler"})
    proc = processor()
    tok = proc.tokenizer
    text = {"model_type": "mistral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": len(tok),
            "max_position_embeddings": 512}
    vision = {"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "head_dim": 8, "patch_size": 16, "image_size": 64}
    vae_cfg = vae_config(_KLEIN["vae"], overrides.get("vae"))
    tr = {**published_config("flux2_dev"), **merge(_KLEIN["transformer"], overrides.get("transformer"))}
    tr.update(in_channels=4 * vae_cfg["latent_channels"], joint_attention_dim=3 * text["hidden_size"])
    with seeded(overrides.get("seed", 0)):
        transformer = Flux2Transformer2DModel(**tr)
        vae = AutoencoderKLFlux2(**vae_cfg)
        config = Mistral3Config(text_config=text, vision_config=vision, spatial_merge_size=1,
                                image_token_index=tok.convert_tokens_to_ids("[IMG]"))
        te = Mistral3ForConditionalGeneration(config).eval()
    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**merge(_KLEIN["scheduler"], overrides.get("scheduler"))),
        vae=vae, text_encoder=te, tokenizer=proc, transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
