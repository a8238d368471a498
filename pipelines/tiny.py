"""Architecture-faithful tiny SD3 / FLUX / Wan pipelines, built offline from small configs.

Every component is the real diffusers / transformers class (``SD3Transformer2DModel``,
``AutoencoderKL``, ``CLIPTextModelWithProjection``, ``T5EncoderModel``, ``FluxTransformer2DModel``,
``WanTransformer3DModel``, ``AutoencoderKLWan``, ``UMT5EncoderModel``, ...) with a tiny config, so a
tiny pipeline exercises exactly the code paths of SD3.5 / FLUX.1-dev / Wan 2.1 and its saved folder
opens with plain ``<PipelineClass>.from_pretrained(folder)``. Nothing is downloaded:

* CLIP tokenizers are byte-level BPE built from the real CLIP merges that ship with ``open_clip``
  (``bpe_simple_vocab_16e6.txt.gz``). ``clip_vocab_size`` keeps only the first merges (a smaller
  but still complete byte-level BPE: any text encodes, no ``<unk>``), so the embedding tables stay
  small; ``clip_vocab_size=None`` keeps the full 49,408-token vocabulary. [derived]
* T5 / UMT5 tokenizers are ``T5Tokenizer`` (the class ``T5TokenizerFast`` aliases in transformers 5)
  over a small word-level Unigram vocabulary (``▁word`` pieces for the VVR / prompt vocabulary plus
  single characters as fallback, so every ASCII prompt encodes). [derived]

Builders take nested overrides per component, e.g.
``build_tiny_sd3(transformer={"num_layers": 4}, scheduler={"shift": 1.0}, height=64)``, and are
deterministic: weights are initialised under ``torch.manual_seed(seed)`` inside a forked RNG, so
the caller's global RNG state is left untouched.

``save_tiny(family, out_dir)`` writes the diffusers folder (safetensors) plus ``flowalign.json`` with
the sampling defaults that ``pipelines.load()`` reads (:func:`write_sampling_defaults`).
"""

from __future__ import annotations

import copy
import gzip
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FAMILIES",
    "build_tiny",
    "build_tiny_sd3",
    "build_tiny_flux",
    "build_tiny_wan",
    "save_tiny",
    "write_sampling_defaults",
    "read_sampling_defaults",
    "clip_tokenizer",
    "t5_tokenizer",
    "SAMPLING_DEFAULTS_FILE",
]

from pipelines.tiny_twins import TWINS, twin_module  # noqa: E402  (names only; builders load on use)

FAMILIES = ("sd3", "flux", "wan", *TWINS)
SAMPLING_DEFAULTS_FILE = "flowalign.json"

# --------------------------------------------------------------------------------------------------
# Tokenizers (offline)
# --------------------------------------------------------------------------------------------------

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
_T5_WORDS = """
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
    words = list(dict.fromkeys(_T5_WORDS + list(extra_words)))
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


# --------------------------------------------------------------------------------------------------
# Config helpers
# --------------------------------------------------------------------------------------------------


def _merge(base: dict[str, Any], over: dict[str, Any] | None) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        out[k] = v
    return out


class _seeded:
    """Fork the global torch RNG, seed it, restore it on exit."""

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self):
        self._ctx = torch.random.fork_rng(devices=[])
        self._ctx.__enter__()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def _check_keys(family: str, overrides: dict[str, Any], allowed: set[str]) -> None:
    bad = sorted(set(overrides) - allowed)
    if bad:
        raise TypeError(f"build_tiny_{family}: unknown override(s) {bad}; allowed: {sorted(allowed)}")


def _vae_blocks(block_out_channels) -> dict[str, Any]:
    n = len(block_out_channels)
    return {
        "down_block_types": ["DownEncoderBlock2D"] * n,
        "up_block_types": ["UpDecoderBlock2D"] * n,
        "block_out_channels": list(block_out_channels),
    }


def _clip_config(cfg: dict[str, Any], tok) -> dict[str, Any]:
    cfg = dict(cfg)
    cfg.setdefault("vocab_size", len(tok))
    cfg.setdefault("max_position_embeddings", tok.model_max_length)
    cfg.setdefault("bos_token_id", tok.bos_token_id)
    cfg.setdefault("eos_token_id", tok.eos_token_id)
    cfg.setdefault("pad_token_id", tok.pad_token_id)
    return cfg


# --------------------------------------------------------------------------------------------------
# SD3
# --------------------------------------------------------------------------------------------------

SD3_DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "height": 32,
    "clip_vocab_size": 2048,
    "clip_max_length": 77,
    "t5_max_length": 32,
    "t5_extra_words": (),
    # SD3.5-Medium-like: qk RMS-norm and one dual-attention (MMDiT-X) block
    "transformer": {
        "patch_size": 2,
        "in_channels": 4,
        "out_channels": 4,
        "num_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "caption_projection_dim": 32,
        "pos_embed_max_size": 16,
        "qk_norm": "rms_norm",
        "dual_attention_layers": [0],
    },
    # SD3-style VAE: no quant convs, scaling + shift factor; f = 2 ** (len(block_out_channels) - 1)
    "vae": {
        "in_channels": 3,
        "out_channels": 3,
        "block_out_channels": [16, 32, 32],
        "layers_per_block": 1,
        "latent_channels": 4,
        "norm_num_groups": 8,
        "scaling_factor": 1.5305,
        "shift_factor": 0.0609,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
        "mid_block_add_attention": True,
    },
    "text_encoder": {  # CLIP-L stand-in
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "projection_dim": 32,
        "hidden_act": "quick_gelu",
    },
    "text_encoder_2": {  # CLIP-G stand-in
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "projection_dim": 32,
        "hidden_act": "gelu",
    },
    "text_encoder_3": {  # T5-XXL stand-in; d_model >= sum of CLIP hidden sizes (SD3 pads CLIP to it)
        "d_model": 64,
        "d_kv": 16,
        "d_ff": 128,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 32,
        "feed_forward_proj": "gated-gelu",
        "dropout_rate": 0.0,
    },
    "scheduler": {"num_train_timesteps": 1000, "shift": 3.0},
}


def build_tiny_sd3(**overrides):
    """A tiny ``StableDiffusion3Pipeline`` (MMDiT + SD3 VAE + CLIP-L/CLIP-G/T5 stand-ins).

    Overrides: ``seed``, ``height`` (image side the transformer's ``sample_size`` is set for),
    ``clip_vocab_size``, ``clip_max_length``, ``t5_max_length``, ``t5_extra_words``, and per-component
    config dicts ``transformer``, ``vae``, ``text_encoder``, ``text_encoder_2``, ``text_encoder_3``,
    ``scheduler`` merged key by key into the defaults. Derived fields (``joint_attention_dim`` = T5
    ``d_model``, ``pooled_projection_dim`` = sum of CLIP projection dims, ``sample_size``) are filled
    in unless given.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    _check_keys("sd3", overrides, set(SD3_DEFAULTS))
    o = {k: overrides.get(k, v) for k, v in SD3_DEFAULTS.items() if not isinstance(v, dict)}
    vae_cfg = _merge(SD3_DEFAULTS["vae"], overrides.get("vae"))
    vae_cfg = {**_vae_blocks(vae_cfg["block_out_channels"]), **vae_cfg}
    f = 2 ** (len(vae_cfg["block_out_channels"]) - 1)
    vae_cfg.setdefault("sample_size", o["height"])

    tok = clip_tokenizer(o["clip_vocab_size"], o["clip_max_length"])
    tok_2 = clip_tokenizer(o["clip_vocab_size"], o["clip_max_length"], pad_token="!")
    tok_3 = t5_tokenizer(o["t5_max_length"], tuple(o["t5_extra_words"]))
    c1 = _clip_config(_merge(SD3_DEFAULTS["text_encoder"], overrides.get("text_encoder")), tok)
    c2 = _clip_config(_merge(SD3_DEFAULTS["text_encoder_2"], overrides.get("text_encoder_2")), tok_2)
    t5 = _merge(SD3_DEFAULTS["text_encoder_3"], overrides.get("text_encoder_3"))
    t5.setdefault("vocab_size", len(tok_3))
    t5.setdefault("pad_token_id", tok_3.pad_token_id)
    t5.setdefault("eos_token_id", tok_3.eos_token_id)
    t5.setdefault("decoder_start_token_id", tok_3.pad_token_id)
    if t5["d_model"] < c1["hidden_size"] + c2["hidden_size"]:
        raise ValueError(
            f"text_encoder_3.d_model={t5['d_model']} must be >= the summed CLIP hidden sizes "
            f"{c1['hidden_size']}+{c2['hidden_size']} (SD3 pads the CLIP states to the T5 width)"
        )
    tr = _merge(SD3_DEFAULTS["transformer"], overrides.get("transformer"))
    tr.setdefault("sample_size", o["height"] // f)
    tr.setdefault("joint_attention_dim", t5["d_model"])
    tr.setdefault("pooled_projection_dim", c1["projection_dim"] + c2["projection_dim"])
    tr["dual_attention_layers"] = tuple(tr.get("dual_attention_layers") or ())
    sched = _merge(SD3_DEFAULTS["scheduler"], overrides.get("scheduler"))

    with _seeded(o["seed"]):
        transformer = SD3Transformer2DModel(**tr)
        vae = AutoencoderKL(**vae_cfg)
        te = CLIPTextModelWithProjection(CLIPTextConfig(**c1))
        te_2 = CLIPTextModelWithProjection(CLIPTextConfig(**c2))
        te_3 = T5EncoderModel(T5Config(**t5))
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**sched),
        vae=vae,
        text_encoder=te.eval(),
        tokenizer=tok,
        text_encoder_2=te_2.eval(),
        tokenizer_2=tok_2,
        text_encoder_3=te_3.eval(),
        tokenizer_3=tok_3,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


# --------------------------------------------------------------------------------------------------
# FLUX
# --------------------------------------------------------------------------------------------------

FLUX_DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "clip_vocab_size": 2048,
    "clip_max_length": 77,
    "t5_max_length": 32,
    "t5_extra_words": (),
    # FLUX.1-dev-like: guidance embedding, double + single stream blocks, 3-axis RoPE
    "transformer": {
        "patch_size": 1,
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "guidance_embeds": True,
        "axes_dims_rope": [4, 6, 6],
    },
    "vae": {
        "in_channels": 3,
        "out_channels": 3,
        "block_out_channels": [16, 32, 32],
        "layers_per_block": 1,
        "latent_channels": 4,
        "norm_num_groups": 8,
        "scaling_factor": 0.3611,
        "shift_factor": 0.1159,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
        "mid_block_add_attention": True,
    },
    "text_encoder": {  # CLIP-L stand-in (pooled output only)
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "projection_dim": 32,
        "hidden_act": "quick_gelu",
    },
    "text_encoder_2": {  # T5-XXL stand-in
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 32,
        "feed_forward_proj": "gated-gelu",
        "dropout_rate": 0.0,
    },
    # FLUX.1's scheduler config: resolution-dependent (dynamic) shift
    "scheduler": {
        "num_train_timesteps": 1000,
        "shift": 3.0,
        "use_dynamic_shifting": True,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
    },
}


def build_tiny_flux(**overrides):
    """A tiny ``FluxPipeline`` (FLUX.1-dev-like: guidance embedding; CLIP-L + T5 stand-ins).

    Overrides as :func:`build_tiny_sd3` with components ``transformer``, ``vae``, ``text_encoder``
    (CLIP), ``text_encoder_2`` (T5), ``scheduler``. ``in_channels`` = 4 × VAE latent channels
    (2×2 packing), ``joint_attention_dim`` = T5 ``d_model``, ``pooled_projection_dim`` = CLIP hidden.
    The pipeline's default height is 128 × VAE factor, so pass ``height``/``width`` when calling.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    _check_keys("flux", overrides, set(FLUX_DEFAULTS))
    o = {k: overrides.get(k, v) for k, v in FLUX_DEFAULTS.items() if not isinstance(v, dict)}
    vae_cfg = _merge(FLUX_DEFAULTS["vae"], overrides.get("vae"))
    vae_cfg = {**_vae_blocks(vae_cfg["block_out_channels"]), **vae_cfg}
    tok = clip_tokenizer(o["clip_vocab_size"], o["clip_max_length"])
    tok_2 = t5_tokenizer(o["t5_max_length"], tuple(o["t5_extra_words"]))
    c1 = _clip_config(_merge(FLUX_DEFAULTS["text_encoder"], overrides.get("text_encoder")), tok)
    t5 = _merge(FLUX_DEFAULTS["text_encoder_2"], overrides.get("text_encoder_2"))
    t5.setdefault("vocab_size", len(tok_2))
    t5.setdefault("pad_token_id", tok_2.pad_token_id)
    t5.setdefault("eos_token_id", tok_2.eos_token_id)
    t5.setdefault("decoder_start_token_id", tok_2.pad_token_id)
    tr = _merge(FLUX_DEFAULTS["transformer"], overrides.get("transformer"))
    tr.setdefault("in_channels", 4 * vae_cfg["latent_channels"])
    tr.setdefault("joint_attention_dim", t5["d_model"])
    tr.setdefault("pooled_projection_dim", c1["hidden_size"])
    tr["axes_dims_rope"] = tuple(tr["axes_dims_rope"])
    if sum(tr["axes_dims_rope"]) != tr["attention_head_dim"]:
        raise ValueError(f"transformer.axes_dims_rope {tr['axes_dims_rope']} must sum to attention_head_dim")
    sched = _merge(FLUX_DEFAULTS["scheduler"], overrides.get("scheduler"))

    with _seeded(o["seed"]):
        transformer = FluxTransformer2DModel(**tr)
        vae = AutoencoderKL(**vae_cfg)
        te = CLIPTextModel(CLIPTextConfig(**c1))
        te_2 = T5EncoderModel(T5Config(**t5))
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**sched),
        vae=vae,
        text_encoder=te.eval(),
        tokenizer=tok,
        text_encoder_2=te_2.eval(),
        tokenizer_2=tok_2,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


# --------------------------------------------------------------------------------------------------
# Wan
# --------------------------------------------------------------------------------------------------

WAN_DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "t5_max_length": 32,
    "t5_extra_words": (),
    "transformer": {
        "patch_size": [1, 2, 2],
        "num_attention_heads": 2,
        "attention_head_dim": 24,  # RoPE splits it t/h/w = 8/8/8
        "freq_dim": 32,
        "ffn_dim": 64,
        "num_layers": 2,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "rope_max_seq_len": 64,
    },
    # Wan 2.1 causal 3D VAE, f_t = 2 ** sum(temperal_downsample), f_s = 2 ** len(temperal_downsample)
    "vae": {
        "base_dim": 8,
        "z_dim": 4,
        "dim_mult": [1, 2, 2],
        "num_res_blocks": 1,
        "attn_scales": [],
        "temperal_downsample": [False, True],
    },
    "text_encoder": {  # UMT5-XXL stand-in
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 32,
        "feed_forward_proj": "gated-gelu",
        "dropout_rate": 0.0,
    },
    "scheduler": {"num_train_timesteps": 1000, "shift": 3.0},
}


def build_tiny_wan(**overrides):
    """A tiny ``WanPipeline`` (Wan 2.1 T2V-like: 3D DiT with cross-attention, causal 3D VAE, UMT5).

    Overrides as :func:`build_tiny_sd3` with components ``transformer``, ``vae``, ``text_encoder``,
    ``scheduler``. ``num_frames - 1`` must be divisible by the VAE's temporal factor (2 by default).
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    _check_keys("wan", overrides, set(WAN_DEFAULTS))
    o = {k: overrides.get(k, v) for k, v in WAN_DEFAULTS.items() if not isinstance(v, dict)}
    vae_cfg = _merge(WAN_DEFAULTS["vae"], overrides.get("vae"))
    z = vae_cfg["z_dim"]
    vae_cfg.setdefault("latents_mean", [0.0] * z)
    vae_cfg.setdefault("latents_std", [1.0] * z)
    vae_cfg.setdefault("scale_factor_temporal", 2 ** sum(bool(t) for t in vae_cfg["temperal_downsample"]))
    vae_cfg.setdefault("scale_factor_spatial", 2 ** len(vae_cfg["temperal_downsample"]))
    tok = t5_tokenizer(o["t5_max_length"], tuple(o["t5_extra_words"]))
    te = _merge(WAN_DEFAULTS["text_encoder"], overrides.get("text_encoder"))
    te.setdefault("vocab_size", len(tok))
    te.setdefault("pad_token_id", tok.pad_token_id)
    te.setdefault("eos_token_id", tok.eos_token_id)
    te.setdefault("decoder_start_token_id", tok.pad_token_id)
    tr = _merge(WAN_DEFAULTS["transformer"], overrides.get("transformer"))
    tr.setdefault("in_channels", z)
    tr.setdefault("out_channels", z)
    tr.setdefault("text_dim", te["d_model"])
    tr["patch_size"] = tuple(tr["patch_size"])
    sched = _merge(WAN_DEFAULTS["scheduler"], overrides.get("scheduler"))

    with _seeded(o["seed"]):
        transformer = WanTransformer3DModel(**tr)
        vae = AutoencoderKLWan(**vae_cfg)
        text_encoder = UMT5EncoderModel(UMT5Config(**te))
    pipe = WanPipeline(
        tokenizer=tok,
        text_encoder=text_encoder.eval(),
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**sched),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


# --------------------------------------------------------------------------------------------------
# Family dispatch, saving, sampling defaults
# --------------------------------------------------------------------------------------------------

_BUILDERS = {"sd3": build_tiny_sd3, "flux": build_tiny_flux, "wan": build_tiny_wan}

#: Sampling defaults written next to each tiny model (``flowalign.json``), per family.
SAMPLING_DEFAULTS: dict[str, dict[str, Any]] = {
    "sd3": {"height": 32, "width": 32, "num_frames": None, "guidance_scale": 4.0, "num_steps": 20,
            "max_sequence_length": 32, "shift": 3.0},
    "flux": {"height": 32, "width": 32, "num_frames": None, "guidance_scale": 3.5, "num_steps": 20,
             "max_sequence_length": 32, "shift": 3.0},
    "wan": {"height": 32, "width": 32, "num_frames": 5, "guidance_scale": 5.0, "num_steps": 20,
            "max_sequence_length": 32, "shift": 3.0},
}


def build_tiny(family: str, **overrides):
    """Build the tiny pipeline of ``family`` (one of :data:`FAMILIES`; twins in :mod:`pipelines.tiny_twins`)."""
    if family in TWINS:
        return twin_module(family).build(**overrides)
    if family not in _BUILDERS:
        raise ValueError(f"family={family!r}: expected one of {list(FAMILIES)}")
    return _BUILDERS[family](**overrides)


def write_sampling_defaults(out_dir: str | os.PathLike, **defaults: Any) -> Path:
    """Write ``flowalign.json`` (sampling defaults that ``pipelines.load()`` reads) into ``out_dir``.

    Typical keys: ``family``, ``height``, ``width``, ``num_frames`` (None for images),
    ``guidance_scale``, ``num_steps``, ``max_sequence_length``, ``shift``. Written atomically.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / SAMPLING_DEFAULTS_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(defaults, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_sampling_defaults(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The ``flowalign.json`` of a model folder, or None when absent."""
    path = Path(folder) / SAMPLING_DEFAULTS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def save_tiny(family: str, out_dir: str | os.PathLike, *, sampling: dict[str, Any] | None = None, **overrides):
    """Build a tiny ``family`` pipeline, save it as a diffusers folder (safetensors) plus
    ``flowalign.json``; returns the pipeline. ``sampling`` updates the family's sampling defaults."""
    pipe = build_tiny(family, **overrides)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    sampling_table = twin_module(family).SAMPLING if family in TWINS else SAMPLING_DEFAULTS[family]
    defaults = {"family": family, **sampling_table}
    if family in ("sd3", "flux") and "height" in overrides:
        defaults["height"] = defaults["width"] = overrides["height"]
    defaults["shift"] = float(pipe.scheduler.config.shift)
    defaults.update(sampling or {})
    write_sampling_defaults(out_dir, **defaults)
    return pipe
