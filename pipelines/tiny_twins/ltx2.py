"""Tiny LTX-2 twin: ``LTX2Pipeline`` (text to video with its audio stream), every component shrunk, real
classes throughout.

``LTX2VideoTransformer3DModel`` (parallel video and audio streams with audio↔video cross-attention), the
``AutoencoderKLLTX2Video`` video VAE, the ``AutoencoderKLLTX2Audio`` mel-spectrogram VAE, the
``LTX2Vocoder`` (mel → waveform), the ``LTX2TextConnectors`` that turn Gemma's stacked hidden states into
the two streams' text tokens, and a ``Gemma3ForConditionalGeneration`` (a tiny SigLIP vision tower included,
as the released Gemma-3-12B has one) with a ``GemmaTokenizer`` built offline (byte-fallback BPE).

The video token width equals the audio one (video latent channels = audio latent channels × latent mel
bins, 4 = 2 × 2 here, 128 = 8 × 16 in the release), as :mod:`pipelines.ltx2` needs. Both VAEs get
non-trivial latent statistics (the release ships measured ones), so the (de)normalisation is exercised.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from pipelines.tiny_twins.base import check_keys, merge, seeded

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    # the release: 48 layers, 32 × 128 video heads, 32 × 64 audio heads, cross-attention 4096 / 2048
    "transformer": {"num_attention_heads": 2, "attention_head_dim": 8, "cross_attention_dim": 16,
                    "audio_num_attention_heads": 2, "audio_attention_head_dim": 4, "audio_cross_attention_dim": 8,
                    "num_layers": 2, "rope_type": "split", "rope_double_precision": True},
    # the release: 30 × 128 heads, 2 layers and 128 learnable registers per connector
    "connectors": {"video_connector_num_attention_heads": 2, "video_connector_attention_head_dim": 8,
                   "video_connector_num_layers": 1, "video_connector_num_learnable_registers": 4,
                   "audio_connector_num_attention_heads": 2, "audio_connector_attention_head_dim": 8,
                   "audio_connector_num_layers": 1, "audio_connector_num_learnable_registers": 4,
                   "connector_rope_base_seq_len": 32, "rope_type": "split", "rope_double_precision": True},
    # spatial ×4 (patch 2, one spatio-temporal level), temporal ×2 (the release: ×32, ×8)
    "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": [8],
            "decoder_block_out_channels": [8], "layers_per_block": [1], "decoder_layers_per_block": [1, 1],
            "spatio_temporal_scaling": [True], "decoder_spatio_temporal_scaling": [True],
            "decoder_inject_noise": [False, False], "downsample_type": ["spatiotemporal"],
            "upsample_residual": [False], "upsample_factor": [1], "timestep_conditioning": False,
            "patch_size": 2, "patch_size_t": 1, "encoder_causal": True, "decoder_causal": False},
    # 2 latent channels × (8 mel bins / 4) = 4, the video token width; the release: 8 × (64 / 4) = 128
    "audio_vae": {"base_channels": 4, "output_channels": 2, "ch_mult": [1], "num_res_blocks": 1,
                  "attn_resolutions": None, "in_channels": 2, "resolution": 32, "latent_channels": 2,
                  "norm_type": "pixel", "causality_axis": "height", "dropout": 0.0,
                  "mid_block_add_attention": False, "sample_rate": 16000, "mel_hop_length": 160,
                  "is_causal": True, "mel_bins": 8},
    "vocoder": {"hidden_channels": 16, "out_channels": 2, "upsample_kernel_sizes": [4, 4],
                "upsample_factors": [2, 2], "resnet_kernel_sizes": [3], "resnet_dilations": [[1, 3, 5]],
                "leaky_relu_negative_slope": 0.1, "output_sampling_rate": 16000},
    # Gemma-3-12B stand-in (the release: 48 layers of width 3840; the connectors read all 49 hidden states)
    "text_encoder": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 16},
    "vision": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
               "image_size": 28, "patch_size": 14},
    # the released scheduler: dynamic shift from the video token count, stretched to end at 0.1
    "scheduler": {"use_dynamic_shifting": True, "base_shift": 0.95, "max_shift": 2.05, "base_image_seq_len": 1024,
                  "max_image_seq_len": 4096, "shift_terminal": 0.1},
    "max_sequence_length": 32,
}

#: the tiny model's sampling defaults: its size, fewer steps, separate video and audio CFG scales (as the
#: pipeline's own defaults, 3 and 7, are separate)
SAMPLING: dict[str, Any] = {"height": 32, "width": 32, "num_frames": 9, "guidance_scale": 4.0,
                            "audio_guidance_scale": 6.0, "num_steps": 20, "max_sequence_length": 32,
                            "frame_rate": 24.0}

#: specials in Gemma's order, then the byte-fallback pieces ``<0x00>`` … ``<0xFF>``
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]


@lru_cache(maxsize=1)
def _gemma_vocab() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """Specials, the 256 byte pieces, ``▁`` and the ASCII letters, then whole-word merges ``▁word`` for the
    prompt words of :mod:`pipelines.tiny_tokenizers` (any text encodes: unknown characters fall back to bytes)."""
    from pipelines.tiny_tokenizers import T5_WORDS
    from pipelines.tiny_twins.tokenizers import add_word_merges

    tokens = SPECIALS + [f"<0x{i:02X}>" for i in range(256)] + ["▁"] + [chr(c) for c in range(33, 127)]
    merges: list[tuple[str, str]] = []
    add_word_merges(tokens, merges, ["▁" + word for word in dict.fromkeys(T5_WORDS)])
    return {t: i for i, t in enumerate(tokens)}, tuple(merges)


def gemma_tokenizer(model_max_length: int = 1024):
    """A ``GemmaTokenizer`` (byte-fallback BPE, ``▁`` for spaces, ``<bos>`` prepended), built offline."""
    from transformers import GemmaTokenizer

    vocab, merges = _gemma_vocab()
    return GemmaTokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=model_max_length, add_bos_token=True)


def text_encoder(cfg: dict[str, Any], vision: dict[str, Any], tok):
    """A tiny ``Gemma3ForConditionalGeneration`` whose token ids are the tokenizer's."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIALS}
    text = Gemma3TextConfig(**cfg, vocab_size=len(tok), pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"],
                            eos_token_id=ids["<eos>"], max_position_embeddings=1024)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=SiglipVisionConfig(**vision).to_dict(),
                          mm_tokens_per_image=4, image_token_index=ids["<mask>"], boi_token_index=ids["<bos>"],
                          eoi_token_index=ids["<eos>"])
    return Gemma3ForConditionalGeneration(config).eval()


def build(**overrides):
    """A tiny ``LTX2Pipeline``; ``overrides`` replace whole component configs or ``seed`` /
    ``max_sequence_length``."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    check_keys("ltx2", overrides, set(DEFAULTS))
    cfg = {k: merge(v, overrides.get(k)) if isinstance(v, dict) else overrides.get(k, v) for k, v in DEFAULTS.items()}
    tok = gemma_tokenizer(model_max_length=cfg["max_sequence_length"])
    te_cfg, vae_cfg, audio_cfg = cfg["text_encoder"], cfg["vae"], cfg["audio_vae"]
    audio_width = audio_cfg["latent_channels"] * (audio_cfg["mel_bins"] // 4)
    tr = {**cfg["transformer"], "in_channels": vae_cfg["latent_channels"], "out_channels": vae_cfg["latent_channels"],
          "audio_in_channels": audio_width, "audio_out_channels": audio_width,
          "caption_channels": te_cfg["hidden_size"]}
    with seeded(cfg["seed"]):
        te = text_encoder(te_cfg, cfg["vision"], tok)
        transformer = LTX2VideoTransformer3DModel(**tr)
        connectors = LTX2TextConnectors(**cfg["connectors"], caption_channels=te_cfg["hidden_size"],
                                        text_proj_in_factor=te_cfg["num_hidden_layers"] + 1)
        vae = AutoencoderKLLTX2Video(**vae_cfg)
        audio_vae = AutoencoderKLLTX2Audio(**audio_cfg)
        vocoder = LTX2Vocoder(**cfg["vocoder"], in_channels=audio_cfg["output_channels"] * audio_cfg["mel_bins"])
        # measured statistics stand-ins: a mean off zero and a spread off one, per channel
        for model in (vae, audio_vae):
            model.latents_mean.copy_(0.1 * torch.randn(model.latents_mean.shape))
            model.latents_std.copy_(0.75 + 0.5 * torch.rand(model.latents_std.shape))
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**cfg["scheduler"]), vae=vae, audio_vae=audio_vae,
                        text_encoder=te, tokenizer=tok, connectors=connectors, transformer=transformer,
                        vocoder=vocoder)
    pipe.set_progress_bar_config(disable=True)
    return pipe
