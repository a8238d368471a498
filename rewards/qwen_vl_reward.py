"""What the Qwen2-VL reward models (``hpsv3``, ``videoalign``) share: local weights, their state dicts, the
forward pass that reads a reward head at special tokens, and Qwen's frame resizing.

Both references subclass ``Qwen2VLForConditionalGeneration``, add special tokens to the tokenizer, and read
a head ``rm_head`` at those tokens' last hidden states. Their checkpoints were written by several
transformers versions and by PEFT, so :func:`load_reward_state` reads every spelling of a key: the text
model at ``model.*`` (transformers < 4.52) or ``model.language_model.*``, the vision tower at ``visual.*`` or
``model.visual.*``, PEFT's ``base_model.model.`` prefix and ``.base_layer`` wrapper, and LoRA factors, which
are merged into the weights they adapt (``W + (alpha / r) · B A``), so scoring needs no PEFT at run time.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from flowalign.errors import UserError
from rewards.planning import on_meta

_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z_][\w]*)?\.weight$")


def local_path(value: str | Path | None, reward: str, option: str, download: str) -> Path:
    """``value`` as an existing local path, or one line naming the reward, the option and what to download.

    Nothing is fetched at run time: a reward's weights are the files a user downloads from its model card.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        raise UserError(f"{reward} reward: set {option}: to the local folder of {download}"
                        " (weights are never downloaded at run time)")
    path = Path(value).expanduser()
    if not path.exists():
        raise UserError(f"{reward} reward: {option}={str(value)!r} does not exist; download {download} and give"
                        " its local folder")
    return path


def canonical_key(key: str) -> str:
    """A checkpoint key in the layout of this transformers' ``Qwen2VLForConditionalGeneration``."""
    key = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model.") and not key.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + key[len("model."):]
    return key


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file or of a ``torch.save``d dict (read with ``weights_only``)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("model", state) if isinstance(state, dict) else state


def load_reward_state(model: torch.nn.Module, head: torch.nn.Module, state: dict[str, torch.Tensor], *,
                      lora_scale: float = 1.0, complete: bool, who: str) -> None:
    """Copy ``state`` into ``model`` (keys as :func:`canonical_key`) and ``head`` (``rm_head.*``); merge LoRA.

    ``complete``: the checkpoint must hold every weight of the model (HPSv3's full state dict); otherwise it
    updates a base model loaded before (VideoAlign's adapter + trained non-LoRA weights). A key that fits
    nothing is an error, never silently dropped.
    """
    targets = model.state_dict(keep_vars=True)
    head_state: dict[str, torch.Tensor] = {}
    lora: dict[str, dict[str, torch.Tensor]] = {}
    unknown, seen = [], set()
    for raw, value in state.items():
        key = canonical_key(raw)
        if key.startswith("rm_head."):
            head_state[key[len("rm_head."):]] = value
        elif (m := _LORA.match(key)) is not None:
            lora.setdefault(m["module"], {})[m["ab"]] = value
        elif key in targets:
            if tuple(targets[key].shape) != tuple(value.shape):
                raise UserError(f"{who} reward: weight {raw!r} has shape {tuple(value.shape)}, the model expects"
                                f" {tuple(targets[key].shape)}; is the base model the one this checkpoint was trained on?")
            with torch.no_grad():
                targets[key].copy_(value)
            seen.add(key)
        else:
            unknown.append(raw)
    if unknown:
        raise UserError(f"{who} reward: the checkpoint has weights the model lacks ({', '.join(unknown[:3])}, ...);"
                        " is the base model the one this checkpoint was trained on?")
    if complete:
        params = {k for k, v in targets.items() if isinstance(v, torch.nn.Parameter)}
        missing = sorted(params - seen)
        # a tied lm_head is the embedding under another name
        missing = [k for k in missing if not (k == "lm_head.weight" and "model.language_model.embed_tokens.weight" in seen
                                              and getattr(model.config, "tie_word_embeddings", False))]
        if missing:
            raise UserError(f"{who} reward: the checkpoint lacks {len(missing)} weights ({', '.join(missing[:3])}, ...);"
                            " give the full reward checkpoint")
    for module, ab in lora.items():
        if set(ab) != {"A", "B"} or f"{module}.weight" not in targets:
            raise UserError(f"{who} reward: LoRA weights for {module!r} do not fit the model")
        weight = targets[f"{module}.weight"]
        with torch.no_grad():
            weight += (lora_scale * ab["B"].float() @ ab["A"].float()).to(weight.dtype)
    try:
        head.load_state_dict(head_state)
    except RuntimeError as e:
        raise UserError(f"{who} reward: the checkpoint's reward head (rm_head.*) does not fit: {e}") from None


def build_qwen2_vl(base: Path, special_tokens: list[str], dtype: torch.dtype, *, weights: bool, who: str,
                   download: str) -> tuple[Any, Any, list[int]]:
    """``(model, processor, special token ids)`` for a Qwen2-VL folder with ``special_tokens`` added.

    ``weights``: load the folder's weights (VideoAlign adapts them); otherwise the architecture is built from
    ``config.json`` alone without initialising it (HPSv3's checkpoint holds every weight). The embeddings are
    resized to the tokenizer, as the references do after adding their tokens.
    """
    from transformers import AutoProcessor, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.initialization import no_init_weights

    if not (base / "config.json").is_file():
        raise UserError(f"{who} reward: {str(base)!r} has no config.json; give the local folder of {download}")
    try:
        processor = AutoProcessor.from_pretrained(base, padding_side="right")
        if weights:
            model = Qwen2VLForConditionalGeneration.from_pretrained(base, dtype=dtype)
        else:
            config = Qwen2VLConfig.from_pretrained(base)
            with no_init_weights():
                model = Qwen2VLForConditionalGeneration._from_config(config, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{who} reward: could not load {str(base)!r} as Qwen2-VL ({e}); give the local folder of"
                        f" {download}") from None
    tokenizer = processor.tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens})
    ids = tokenizer.convert_tokens_to_ids(special_tokens)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    # the processor must not resize again what :func:`smart_resize` sized (Qwen2-VL's own pixel bounds)
    for proc in (processor.image_processor, getattr(processor, "video_processor", None)):
        if proc is not None:
            proc.size = {"shortest_edge": 56 * 56, "longest_edge": 16384 * 28 * 28}
    return model.eval().requires_grad_(False), processor, ids


def meta_qwen2_vl(base: Path, special_tokens: list[str], dtype: torch.dtype) -> torch.nn.Module:
    """The model :func:`build_qwen2_vl` builds from ``base``, on the meta device: its ``config.json``'s
    Qwen2-VL in ``dtype`` (its rotary tables kept in float32, as a model made in a dtype keeps them) with the embeddings resized to the tokenizer's length once ``special_tokens`` are added, as the
    references resize them. A folder without tokenizer files (a published architecture) keeps the config's
    ``vocab_size``: Qwen2-VL-7B's 152,064 rows for the 151,658 its tokenizer and HPSv3's token give, 2.9 M
    parameters (0.04 %) more than the reward holds."""
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig.from_pretrained(base)
    model = on_meta(lambda: Qwen2VLForConditionalGeneration._from_config(config, dtype=dtype))
    if (base / "tokenizer.json").is_file() or (base / "vocab.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(base)
        tokenizer.add_special_tokens({"additional_special_tokens": special_tokens})
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    return model


def special_token_states(model: Any, inputs: dict[str, torch.Tensor], token_ids: list[int]) -> torch.Tensor:
    """The decoder's last hidden states at ``token_ids``: ``(B, len(token_ids), D)``.

    As the references' forward: visual features replace the image/video pad tokens, and positions are the
    plain text positions ``cumsum(mask) − 1`` on all three M-RoPE axes (their forward hands the decoder
    ``inputs_embeds`` without ``input_ids``, so Qwen2-VL's 3-D vision positions are never built).
    """
    inner = model.model
    ids = inputs["input_ids"]
    embeds = inner.get_input_embeddings()(ids)
    for pixels, grid, token in (("pixel_values", "image_grid_thw", model.config.image_token_id),
                                ("pixel_values_videos", "video_grid_thw", model.config.video_token_id)):
        if pixels in inputs:
            feats = inner.visual(inputs[pixels].to(inner.visual.dtype), grid_thw=inputs[grid]).pooler_output
            mask = (ids == token).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(mask, feats.to(embeds.dtype))
    attention = inputs["attention_mask"]
    positions = (attention.long().cumsum(-1) - 1).clamp(min=0)
    hidden = inner.language_model(inputs_embeds=embeds, attention_mask=attention,
                                  position_ids=positions.unsqueeze(0).expand(3, -1, -1)).last_hidden_state
    rows = []
    for b in range(ids.shape[0]):
        at = [int((ids[b] == t).nonzero()[0, 0]) if (ids[b] == t).any() else -1 for t in token_ids]
        if min(at) < 0:
            raise RuntimeError("a reward token is missing from the prompt (was the prompt truncated?)")
        rows.append(hidden[b, at])
    return torch.stack(rows)


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 16384 * 28 * 28) -> tuple[int, int]:
    """Qwen2-VL's frame size: sides multiples of ``factor``, area within ``[min_pixels, max_pixels]``,
    aspect ratio kept (``qwen_vl_utils.smart_resize``)."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Float pixels in [0, 1] → uint8, as an encoded image or video file holds them."""
    return (x.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
