"""The Wan family: one :class:`flowalign.families.FamilySpec` for the three Wan folder layouts, and the choice
among their policies from the folder's ``model_index.json``: :class:`pipelines.wan_t2v.WanPolicy` (Wan 2.1 /
2.2-TI2V, one transformer), :class:`pipelines.wan22.Wan22Policy` (Wan 2.2-A14B, two experts),
:class:`pipelines.wan_i2v.WanI2VPolicy` (image-to-video) and :class:`pipelines.causal_wan.CausalWanPolicy` (a
causal streaming generator: Self-Forcing, LongLive, Causal-Forcing)."""

from __future__ import annotations

from typing import Any

from flowalign.families import FamilySpec
from pipelines.causal_wan import CausalWanPolicy, is_causal_wan
from pipelines.wan22 import Wan22Policy
from pipelines.wan_i2v import WanI2VPolicy
from pipelines.wan_t2v import DEFAULT_LORA_TARGETS, WanPolicy, transformer_inputs

__all__ = ["SPEC", "WanPolicy", "Wan22Policy", "WanI2VPolicy", "CausalWanPolicy", "policy_for"]


def policy_for(index: dict[str, Any]) -> type:
    """Wan 2.1 / 2.2-TI2V (one transformer), Wan 2.2-A14B (``transformer_2``: two experts), image-to-video or a
    causal streaming generator (marked in ``model_index.json``), from the folder's ``model_index.json``."""
    if index.get("_class_name") == "WanImageToVideoPipeline":
        return WanI2VPolicy
    if is_causal_wan(index):
        return CausalWanPolicy
    entry = index.get("transformer_2")
    if entry and entry[0] is not None:
        return Wan22Policy
    return WanPolicy


SPEC = FamilySpec(
    name="wan", policy=WanPolicy, policy_for=policy_for, pipelines=("WanPipeline", "WanImageToVideoPipeline"),
    transformers=("WanTransformer3DModel",), lora_targets=tuple(DEFAULT_LORA_TARGETS),
    # Wan 2.1 T2V at 480p (the pipeline's defaults): 81 frames, 50 steps, CFG 5.0, UMT5 length 512
    size={"height": 480, "width": 832, "num_frames": 81, "max_sequence_length": 512}, num_steps=50, guidance=5.0,
    cfg="cfg", transformer_inputs=transformer_inputs,
    tiny={"wan": "pipelines.tiny_twins.wan", "wan22": "pipelines.tiny_twins.wan22",
          "wan_i2v": "pipelines.tiny_twins.wan_i2v", "causal_wan": "pipelines.tiny_twins.causal_wan"},
    architectures=("wan2.1-1.3b", "wan2.1-14b", "wan2.2-a14b", "causal-wan2.1-1.3b"),
    trained=("transformer", "transformer_2"),  # Wan 2.2 A14B: both experts (Wan22Policy.trainable)
    decode_batch=2, vae_float32=True,  # two videos at a time, the VAE in float32 as WanPipeline advises
)
