"""GenEval's own detector for the ``geneval`` reward: its mmdetection Mask2Former checkpoint as a transformers folder.

GenEval scores with mmdetection 2.x's Mask2Former (Swin-S, ``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco``,
the checkpoint its ``download_models.sh`` fetches). The reward runs ``Mask2FormerForUniversalSegmentation``;
this module renames that checkpoint's tensors to transformers' names (the same architecture, laid out
differently), so the reward detects with GenEval's weights rather than another training run's
(``flowalign geneval-detector CHECKPOINT OUT``). What changes besides the names:

* Swin's fused ``qkv`` projections (backbone) and the decoder's fused self-attention ``in_proj`` are split into
  query, key and value;
* Swin's patch merging: mmdetection gathers each 2×2 patch with ``nn.Unfold`` (channel-major: ``c·4 + 2·kh + kw``),
  transformers concatenates the four positions (``(kh + 2·kw)·C + c``), so the reduction's input columns and
  its norm are permuted;
* the mask MLP's ``Sequential`` indices (0, 2, 4 around the ReLUs) become transformers' three layers.

``tests/rewards/geneval/test_mmdet_checkpoint.py`` holds what mmdetection 2.28.2's own model computes from a
checkpoint of this layout and checks the converted folder computes the same class and mask logits.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from flowalign.errors import UserError
from flowalign.io import atomic_dir
from flowalign.manifest import sha256_file

#: GenEval's detector config (mmdetection's ``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.py``): what the
#: checkpoint's shapes do not say
SWIN_WINDOW, SWIN_MLP_RATIO, HEADS_PER_DIM = 7, 4.0, 32
#: mmdetection's normalisation (means 123.675, 116.28, 103.53 and stds 58.395, 57.12, 57.375 on 0-255 pixels),
#: on [0, 1] pixels as transformers' processor applies it (the values of facebook/mask2former-*'s processors)
PIXEL_MEAN, PIXEL_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
#: GenEval's test scale: the shorter side to 800, the longer at most 1333 (the reward's ``detector_size: geneval``
#: scales itself; ``processor`` reads this)
TEST_SCALE = {"shortest_edge": 800, "longest_edge": 1333}
#: the writer name of the folders :func:`convert_checkpoint` writes (:func:`flowalign.io.atomic_dir`)
WRITER = "geneval-detector"


def _merge_order(channels: int) -> torch.Tensor:
    """Index ``(4C,)``: transformers' patch-merging position ``p`` reads mmdetection's ``order[p]``."""
    order = []
    for p in range(4 * channels):
        j, c = divmod(p, channels)
        kh, kw = j % 2, j // 2
        order.append(c * 4 + kh * 2 + kw)
    return torch.tensor(order)


def _count(state: dict[str, torch.Tensor], pattern: str) -> int:
    """How many distinct indices ``pattern`` (a regex with one group) matches among ``state``'s keys."""
    return len({m.group(1) for k in state if (m := re.fullmatch(pattern, k))})


def convert_state_dict(state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """mmdetection Mask2Former (Swin backbone) tensors → ``(Mask2FormerConfig kwargs, transformers tensors)``.

    Every tensor of ``state`` is used once or refused: a key this mapping does not know raises, so a checkpoint
    of another architecture cannot convert into a folder that silently computes something else."""
    state = {k: v for k, v in state.items() if not k.endswith("relative_position_index")}  # rebuilt by both
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        if key not in state:
            raise UserError(f"the checkpoint has no tensor {key!r}: it is not an mmdetection Mask2Former with a Swin "
                            "backbone (GenEval's mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.pth)")
        used.add(key)
        return state[key]

    def move(src: str, dst: str, params: tuple[str, ...] = ("weight", "bias")) -> None:
        for p in params:
            out[f"{dst}.{p}"] = take(f"{src}.{p}")

    def split(weight: str, bias: str, dst: str) -> None:
        """A fused query-key-value projection (``(3D, ...)``, query first) into ``dst``'s three projections."""
        for src, param in ((weight, "weight"), (bias, "bias")):
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), take(src).chunk(3, dim=0)):
                out[f"{dst}.{proj}.{param}"] = part

    stages = _count(state, r"backbone\.stages\.(\d+)\..*")
    depths = [_count(state, rf"backbone\.stages\.{s}\.blocks\.(\d+)\..*") for s in range(stages)]
    embed = take("backbone.patch_embed.projection.weight").shape[0]
    enc = "model.pixel_level_module.encoder"  # transformers' Swin backbone: its model under .swin, its output norms
    move("backbone.patch_embed.projection", f"{enc}.swin.embeddings.patch_embeddings.projection")
    move("backbone.patch_embed.norm", f"{enc}.swin.embeddings.norm")
    for s, depth in enumerate(depths):
        for b in range(depth):
            src, dst = f"backbone.stages.{s}.blocks.{b}", f"{enc}.swin.encoder.layers.{s}.blocks.{b}"
            move(f"{src}.norm1", f"{dst}.layernorm_before")
            move(f"{src}.norm2", f"{dst}.layernorm_after")
            out[f"{dst}.attention.relative_position_bias.relative_position_bias_table"] = take(
                f"{src}.attn.w_msa.relative_position_bias_table")
            split(f"{src}.attn.w_msa.qkv.weight", f"{src}.attn.w_msa.qkv.bias", f"{dst}.attention")
            move(f"{src}.attn.w_msa.proj", f"{dst}.attention.o_proj")
            move(f"{src}.ffn.layers.0.0", f"{dst}.mlp.fc1")
            move(f"{src}.ffn.layers.1", f"{dst}.mlp.fc2")
        if f"backbone.stages.{s}.downsample.reduction.weight" in state:
            src, dst = f"backbone.stages.{s}.downsample", f"{enc}.swin.encoder.layers.{s}.downsample"
            order = _merge_order(take(f"{src}.reduction.weight").shape[1] // 4)
            out[f"{dst}.reduction.weight"] = take(f"{src}.reduction.weight")[:, order]
            out[f"{dst}.norm.weight"] = take(f"{src}.norm.weight")[order]
            out[f"{dst}.norm.bias"] = take(f"{src}.norm.bias")[order]
    for s in range(stages):
        move(f"backbone.norm{s}", f"{enc}.hidden_states_norms.stage{s + 1}")

    pix, dec = "panoptic_head.pixel_decoder", "model.pixel_level_module.decoder"
    levels = _count(state, rf"{pix}\.input_convs\.(\d+)\..*")
    for i in range(levels):
        move(f"{pix}.input_convs.{i}.conv", f"{dec}.input_projections.{i}.0")
        move(f"{pix}.input_convs.{i}.gn", f"{dec}.input_projections.{i}.1")
    encoder_layers = _count(state, rf"{pix}\.encoder\.layers\.(\d+)\..*")
    for layer in range(encoder_layers):
        src, dst = f"{pix}.encoder.layers.{layer}", f"{dec}.encoder.layers.{layer}"
        for name in ("sampling_offsets", "attention_weights", "value_proj", "output_proj"):
            move(f"{src}.attentions.0.{name}", f"{dst}.self_attn.{name}")
        move(f"{src}.ffns.0.layers.0.0", f"{dst}.fc1")
        move(f"{src}.ffns.0.layers.1", f"{dst}.fc2")
        move(f"{src}.norms.0", f"{dst}.self_attn_layer_norm")
        move(f"{src}.norms.1", f"{dst}.final_layer_norm")
    out[f"{dec}.level_embed"] = take(f"{pix}.level_encoding.weight")
    move(f"{pix}.lateral_convs.0.conv", f"{dec}.adapter_1.0", ("weight",))
    move(f"{pix}.lateral_convs.0.gn", f"{dec}.adapter_1.1")
    move(f"{pix}.output_convs.0.conv", f"{dec}.layer_1.0", ("weight",))
    move(f"{pix}.output_convs.0.gn", f"{dec}.layer_1.1")
    move(f"{pix}.mask_feature", f"{dec}.mask_projection")

    head, tm = "panoptic_head", "model.transformer_module"
    out[f"{tm}.queries_embedder.weight"] = take(f"{head}.query_embed.weight")
    out[f"{tm}.queries_features.weight"] = take(f"{head}.query_feat.weight")
    out[f"{tm}.level_embed.weight"] = take(f"{head}.level_embed.weight")
    decoder_layers = _count(state, rf"{head}\.transformer_decoder\.layers\.(\d+)\..*")
    for layer in range(decoder_layers):
        src, dst = f"{head}.transformer_decoder.layers.{layer}", f"{tm}.decoder.layers.{layer}"
        # the layer's order of operations: cross-attention, norm, self-attention, norm, FFN, norm
        move(f"{src}.attentions.0.attn", f"{dst}.cross_attn", ("in_proj_weight", "in_proj_bias"))
        move(f"{src}.attentions.0.attn.out_proj", f"{dst}.cross_attn.out_proj")
        split(f"{src}.attentions.1.attn.in_proj_weight", f"{src}.attentions.1.attn.in_proj_bias", f"{dst}.self_attn")
        move(f"{src}.attentions.1.attn.out_proj", f"{dst}.self_attn.out_proj")
        move(f"{src}.norms.0", f"{dst}.cross_attn_layer_norm")
        move(f"{src}.norms.1", f"{dst}.self_attn_layer_norm")
        move(f"{src}.norms.2", f"{dst}.final_layer_norm")
        move(f"{src}.ffns.0.layers.0.0", f"{dst}.fc1")
        move(f"{src}.ffns.0.layers.1", f"{dst}.fc2")
    move(f"{head}.transformer_decoder.post_norm", f"{tm}.decoder.layernorm")
    for i, seq in enumerate((0, 2, 4)):
        move(f"{head}.mask_embed.{seq}", f"{tm}.decoder.mask_predictor.mask_embedder.{i}.0")
    move(f"{head}.cls_embed", "class_predictor")

    left = sorted(set(state) - used)
    if left:
        raise UserError(f"the checkpoint has {len(left)} tensors this conversion does not know (e.g. {left[0]!r}): "
                        "it is not GenEval's mmdetection Mask2Former with a Swin backbone")
    hidden = out[f"{tm}.queries_features.weight"].shape[1]
    config = {
        "backbone_config": {"model_type": "swin", "embed_dim": int(embed), "depths": depths,
                            "num_heads": [int(embed * 2**s) // HEADS_PER_DIM for s in range(stages)],
                            "window_size": SWIN_WINDOW, "mlp_ratio": SWIN_MLP_RATIO, "qkv_bias": True,
                            "drop_path_rate": 0.0, "out_features": [f"stage{s + 1}" for s in range(stages)]},
        "num_labels": int(out["class_predictor.weight"].shape[0]) - 1,
        "num_queries": int(out[f"{tm}.queries_features.weight"].shape[0]),
        "hidden_dim": int(hidden), "feature_size": int(hidden), "mask_feature_size": int(hidden),
        "encoder_layers": encoder_layers, "decoder_layers": decoder_layers + 1,
        "encoder_feedforward_dim": int(out[f"{dec}.encoder.layers.0.fc1.weight"].shape[0]),
        "dim_feedforward": int(out[f"{tm}.decoder.layers.0.fc1.weight"].shape[0]),
        "num_attention_heads": 8,
    }
    return config, out


def convert_checkpoint(checkpoint: Path, out_dir: Path, overwrite: bool = False, trust_pickle: bool = False) -> Path:
    """Write the transformers folder (config, weights, image processor) of mmdetection ``checkpoint`` into
    ``out_dir`` atomically; its classes are COCO's 80 in mmdetection's order (the checkpoint's own names when
    it records them). The checkpoint is read as tensors and plain values only, unless ``trust_pickle`` (a
    pickle can run code: only for a file you trust)."""
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessor

    from flowalign.saved_weights import read_torch_file

    checkpoint = Path(checkpoint)
    saved = read_torch_file(checkpoint, trust_pickle=trust_pickle,
                            what="GenEval's mmdetection checkpoint (mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.pth, "
                                 "from its download_models.sh)")
    state = saved.get("state_dict", saved) if isinstance(saved, dict) else None
    if not isinstance(state, dict):
        raise UserError(f"{checkpoint}: not a checkpoint (a dict with a state_dict of tensors)")
    kwargs, tensors = convert_state_dict(state)
    classes = (saved.get("meta") or {}).get("CLASSES") if isinstance(saved, dict) else None
    if classes and len(classes) == kwargs["num_labels"]:
        kwargs["id2label"] = {i: str(c) for i, c in enumerate(classes)}
        kwargs["label2id"] = {str(c): i for i, c in enumerate(classes)}
    config = Mask2FormerConfig(**kwargs)
    model = Mask2FormerForUniversalSegmentation(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # transformers' own extras: the backbone's final norm (unused by the detector) and the loss's class weights
    allowed = {"model.pixel_level_module.encoder.swin.layernorm.weight",
               "model.pixel_level_module.encoder.swin.layernorm.bias", "criterion.empty_weight"}
    if unexpected or set(missing) - allowed:
        raise UserError(f"the converted tensors do not fit transformers' Mask2Former (missing "
                        f"{sorted(set(missing) - allowed)[:3]}, unexpected {sorted(unexpected)[:3]})")
    processor = Mask2FormerImageProcessor(image_mean=PIXEL_MEAN, image_std=PIXEL_STD, size=TEST_SCALE, size_divisor=32,
                                          ignore_index=255, num_labels=config.num_labels)
    with atomic_dir(Path(out_dir), writer=WRITER, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        # which weights the folder holds, for a reported number to name them (GenEval's download has one SHA-256)
        source = {"from": checkpoint.name, "sha256": sha256_file(checkpoint), "tensors": len(tensors)}
        (tmp / "conversion.json").write_text(json.dumps(source, indent=2) + "\n")
    return Path(out_dir)
