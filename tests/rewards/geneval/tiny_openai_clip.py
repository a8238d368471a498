"""A tiny CLIP in OpenAI's checkpoint layout (what ``open_clip.load_openai_model`` reads for GenEval's
``pretrained="openai"``), filled from a seed, and the same weights as a transformers ``CLIPModel`` folder with the
real CLIP BPE vocabulary (open_clip's ``bpe_simple_vocab_16e6``, which OpenAI's tokenizer and
``openai/clip-vit-large-patch14``'s ``vocab.json`` / ``merges.txt`` are made from).

ViT-L/14's layout at widths of 64 (open_clip derives one head per 64 channels from the checkpoint), two layers a
tower, its 224 px input in 14 px patches, its 77-token context and 49408-token vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import torch

WIDTH, LAYERS, EMBED, PATCH, IMAGE, CONTEXT, VOCAB = 64, 2, 32, 14, 224, 77, 49408


def _tower(prefix: str) -> dict[str, tuple[int, ...]]:
    w, shapes = WIDTH, {}
    for i in range(LAYERS):
        p = f"{prefix}transformer.resblocks.{i}."
        shapes.update({p + "attn.in_proj_weight": (3 * w, w), p + "attn.in_proj_bias": (3 * w,),
                       p + "attn.out_proj.weight": (w, w), p + "attn.out_proj.bias": (w,),
                       p + "ln_1.weight": (w,), p + "ln_1.bias": (w,), p + "ln_2.weight": (w,), p + "ln_2.bias": (w,),
                       p + "mlp.c_fc.weight": (4 * w, w), p + "mlp.c_fc.bias": (4 * w,),
                       p + "mlp.c_proj.weight": (w, 4 * w), p + "mlp.c_proj.bias": (w,)})
    return shapes


def openai_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """The tiny checkpoint: every tensor drawn in name order from one seeded generator (layer-norm weights near 1),
    so it does not depend on any package's initialisation; float16 values held in float32, as OpenAI's
    checkpoints store them (``load_openai_model`` loads them into a float16 model before casting up)."""
    grid = IMAGE // PATCH
    shapes = {"visual.conv1.weight": (WIDTH, 3, PATCH, PATCH), "visual.class_embedding": (WIDTH,),
              "visual.positional_embedding": (grid * grid + 1, WIDTH), "visual.ln_pre.weight": (WIDTH,),
              "visual.ln_pre.bias": (WIDTH,), "visual.ln_post.weight": (WIDTH,), "visual.ln_post.bias": (WIDTH,),
              "visual.proj": (WIDTH, EMBED), **_tower("visual."), "token_embedding.weight": (VOCAB, WIDTH),
              "positional_embedding": (CONTEXT, WIDTH), "ln_final.weight": (WIDTH,), "ln_final.bias": (WIDTH,),
              "text_projection": (WIDTH, EMBED), **_tower("")}
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name in sorted(shapes):
        noise = torch.randn(shapes[name], generator=g)
        is_norm = ".ln_" in name or name.startswith("ln_") or "visual.ln_" in name
        value = (1 + 0.1 * noise) if is_norm and name.endswith("weight") else noise * (0.1 if is_norm else 0.05)
        state[name] = value.half().float()
    state["logit_scale"] = torch.tensor(4.6052)
    return state


def _split_qkv(state: dict[str, torch.Tensor], src: str, dst: str, out: dict[str, torch.Tensor]) -> None:
    for part, kind in (("in_proj_weight", "weight"), ("in_proj_bias", "bias")):
        q, k, v = state[src + part].chunk(3)
        out.update({f"{dst}q_proj.{kind}": q, f"{dst}k_proj.{kind}": k, f"{dst}v_proj.{kind}": v})


def _layers(state: dict[str, torch.Tensor], src: str, dst: str, out: dict[str, torch.Tensor]) -> None:
    for i in range(LAYERS):
        s, d = f"{src}transformer.resblocks.{i}.", f"{dst}encoder.layers.{i}."
        _split_qkv(state, s + "attn.", d + "self_attn.", out)
        for a, b in (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"),
                     ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
            out[d + b + ".weight"], out[d + b + ".bias"] = state[s + a + ".weight"], state[s + a + ".bias"]


def transformers_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The OpenAI checkpoint's tensors under transformers' ``CLIPModel`` names (projections transposed)."""
    out = {"logit_scale": state["logit_scale"],
           "text_model.embeddings.token_embedding.weight": state["token_embedding.weight"],
           "text_model.embeddings.position_embedding.weight": state["positional_embedding"],
           "text_model.final_layer_norm.weight": state["ln_final.weight"],
           "text_model.final_layer_norm.bias": state["ln_final.bias"],
           "text_projection.weight": state["text_projection"].T.contiguous(),
           "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
           "vision_model.embeddings.patch_embedding.weight": state["visual.conv1.weight"],
           "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
           "vision_model.pre_layrnorm.weight": state["visual.ln_pre.weight"],
           "vision_model.pre_layrnorm.bias": state["visual.ln_pre.bias"],
           "vision_model.post_layernorm.weight": state["visual.ln_post.weight"],
           "vision_model.post_layernorm.bias": state["visual.ln_post.bias"],
           "visual_projection.weight": state["visual.proj"].T.contiguous()}
    _layers(state, "", "text_model.", out)
    _layers(state, "visual.", "vision_model.", out)
    return out


def save_transformers_folder(state: dict[str, torch.Tensor], out: Path) -> Path:
    """``out`` as ``CLIPModel.save_pretrained`` writes it, with a ``CLIPProcessor`` of the real BPE vocabulary and
    OpenAI's image statistics at 224 px (``openai/clip-vit-large-patch14``'s processor settings)."""
    from open_clip.tokenizer import SimpleTokenizer
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    out.mkdir(parents=True, exist_ok=True)
    bpe = SimpleTokenizer()
    # open_clip names the two specials <start_of_text> / <end_of_text>; OpenAI's vocab.json, <|startoftext|> /
    # <|endoftext|> (same ids, 49406 / 49407)
    specials = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    (out / "vocab.json").write_text(json.dumps({specials.get(k, k): v for k, v in bpe.encoder.items()}))
    merges = sorted(bpe.bpe_ranks, key=bpe.bpe_ranks.get)
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    tower = {"hidden_size": WIDTH, "intermediate_size": 4 * WIDTH, "num_attention_heads": WIDTH // 64,
             "num_hidden_layers": LAYERS, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}
    config = CLIPConfig(
        text_config={**tower, "vocab_size": VOCAB, "max_position_embeddings": CONTEXT, "bos_token_id": 49406,
                     "eos_token_id": 49407, "pad_token_id": 49407},
        vision_config={**tower, "image_size": IMAGE, "patch_size": PATCH}, projection_dim=EMBED)
    model = CLIPModel(config)
    model.load_state_dict(transformers_state_dict(state), strict=True)
    model.save_pretrained(out)
    tokenizer = CLIPTokenizer(str(out / "vocab.json"), str(out / "merges.txt"), pad_token="<|endoftext|>")
    image = CLIPImageProcessor(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE},
                               image_mean=[0.48145466, 0.4578275, 0.40821073],
                               image_std=[0.26862954, 0.26130258, 0.27577711], resample=3)
    CLIPProcessor(image_processor=image, tokenizer=tokenizer).save_pretrained(out)
    return out
