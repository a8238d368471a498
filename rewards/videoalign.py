"""``videoalign``: VideoReward of "Improving Video Generation with Human Feedback" (VideoAlign), a Qwen2-VL-2B
with LoRA and a linear head read at three special tokens (docs/methods/vlm_reward_models.md).

The clip, sampled at ``sample_fps`` frames per second of its ``fps`` and resized to at most
``max_frame_pixels`` per frame, goes in with VideoAlign's detailed prompt, which asks for the visual quality
at ``<|VQ_reward|>``, the motion quality at ``<|MQ_reward|>`` and the text alignment at ``<|TA_reward|>``.
The head gives one number per token; each is standardised with the checkpoint's ``inference_config``
(``(r − mean) / std``) and ``Overall = VQ + MQ + TA`` (the reference's ``use_norm=True``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flowalign.errors import UserError
from flowalign.protocols import RewardOutput
from rewards.common import check_lengths, check_unit_range, resolve_dtype
from rewards.planning import existing, module_bytes, on_accelerator, on_meta, option, published
from rewards.qwen_vl_reward import (build_qwen2_vl, load_reward_state, local_path, meta_qwen2_vl, read_state,
                                    smart_resize, special_token_states, to_uint8)
from rewards.registry import register

DOWNLOAD = "VideoReward (the KwaiVGI/VideoReward model card: model_config.json and checkpoint-*/)"
BASE_DOWNLOAD = "Qwen2-VL-2B-Instruct (Qwen/Qwen2-VL-2B-Instruct)"
#: the base VideoReward is trained on, as published (assets/reward_architectures/)
BASE_ARCHITECTURE = "qwen2-vl-2b-instruct"
TOKENS = ["<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>"]
DIMENSIONS = ("VQ", "MQ", "TA")
COMPONENTS = ("overall", "vq", "mq", "ta")
# qwen_vl_utils' video bounds (VIDEO_MIN_PIXELS, FRAME_FACTOR, FPS_MIN_FRAMES, FPS_MAX_FRAMES)
VIDEO_MIN_PIXELS, FRAME_FACTOR, MIN_FRAMES, MAX_FRAMES = 128 * 28 * 28, 2, 4, 768

# VideoAlign's "detailed_special" prompt, verbatim (prompt_template.py)
PROMPT = """
You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of the others.

**Visual Quality:**  
Evaluate the overall visual quality of the video, with a focus on static factors. The following sub-dimensions should be considered:
- **Reasonableness:** The video should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The video should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

Please provide the ratings of Visual Quality: <|VQ_reward|>
END

**Motion Quality:**  
Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following sub-dimensions:
- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, textures, or missing body parts).
- **Naturalness:** The movement should align with physical laws and be realistic. For example, clothing should flow naturally with motion, and facial expressions should change appropriately (e.g., blinking, mouth movements).
- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different motions or camera angles should be seamless, and the overall dynamic feel should be visually pleasing.
- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.
- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas where the video might have blurry or unsteady sections that hinder visual continuity.
- **Amplitude:** If the video is largely static or has little movement, assign a low score for motion quality.

Please provide the ratings of Motion Quality: <|MQ_reward|>
END

**Text Alignment:**  
Assess how well the video matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial expressions like talking or blinking) align with the described prompt. The motion should match the prompt in terms of type, scale, and direction.
- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes checking if real-world locations or scenes are accurately represented, though some stylistic adaptation is acceptable.  
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the video adheres to this style.
- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus shifts) are consistent with the expected behavior from the prompt.

Textual prompt - {text_prompt}
Please provide the ratings of Text Alignment: <|TA_reward|>
END
"""


def frame_indices(total: int, fps: float, sample_fps: float, num_frames: float | None = None) -> list[int]:
    """Frames read from a clip of ``total`` frames at ``fps``: ``total / fps · sample_fps`` of them, at least 4,
    at most ``min(total, 768)``, rounded to an even count, evenly spaced (VideoAlign's ``smart_nframes`` and
    uniform sampling, from qwen_vl_utils). ``num_frames`` (a checkpoint's ``data_config.num_frames``): that many
    rounded to an even count, at most ``total``, in place of the rate."""
    if num_frames is not None:
        n = num_frames
    else:
        n = min(max(total / fps * sample_fps, MIN_FRAMES), min(MAX_FRAMES, total) // FRAME_FACTOR * FRAME_FACTOR)
    n = min(max(FRAME_FACTOR, round(n / FRAME_FACTOR) * FRAME_FACTOR), total)
    return torch.linspace(0, total - 1, n).round().long().tolist()


def overall(raw: torch.Tensor, norm: dict[str, float] | None) -> dict[str, torch.Tensor]:
    """``raw`` ``(B, 3)`` head outputs at (VQ, MQ, TA) → the standardised dimensions and their sum."""
    out = {}
    for j, d in enumerate(DIMENSIONS):
        x = raw[:, j]
        out[d.lower()] = x if norm is None else (x - norm[f"{d}_mean"]) / norm[f"{d}_std"]
    out["overall"] = out["vq"] + out["mq"] + out["ta"]
    return out


def _checkpoint_dir(folder: Path) -> Path:
    """The latest ``checkpoint-<step>`` folder (as the reference's default ``load_from_pretrained_step=-1``)."""
    found = [p for p in folder.glob("checkpoint-*") if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)]
    if not found:
        raise UserError(f"videoalign reward: {str(folder)!r} holds no checkpoint-<step> folder; download {DOWNLOAD}")
    return max(found, key=lambda p: int(p.name.split("-")[1]))


@register("videoalign")
class VideoAlign:
    """VideoReward scores of videos ``(B, F, 3, H, W)``: ``component`` (``overall`` = VQ + MQ + TA, or one of
    ``vq``/``mq``/``ta``) is the reward; all four are in ``info``.

    Options: ``path`` (the VideoReward folder: ``model_config.json`` + ``checkpoint-*/``), ``base`` (the
    Qwen2-VL-2B-Instruct folder; default: the checkpoint's ``model_name_or_path`` when that is a local
    folder, relative to ``path``), ``fps`` (frame rate of the samples, 16 for Wan 2.1), ``sample_fps`` and
    ``max_frame_pixels`` (default: the checkpoint's ``data_config``: 2 fps, 448·448; a ``data_config`` that sets
    ``num_frames`` reads that many frames a clip unless ``sample_fps`` is given), ``normalize`` (the
    checkpoint's standardisation, as the reference's default), ``device``, ``dtype`` (bf16), ``batch_size``.
    """

    name = "videoalign"
    differentiable = False

    def __init__(self, path: str | None = None, base: str | None = None, *, component: str = "overall",
                 fps: float = 16.0, sample_fps: float | None = None, max_frame_pixels: int | None = None,
                 normalize: bool = True, device: str | None = None, dtype: str = "bfloat16", batch_size: int = 2):
        folder = local_path(path, self.name, "path", DOWNLOAD)
        config_file = folder / "model_config.json"
        if not config_file.is_file():
            raise UserError(f"videoalign reward: {str(folder)!r} has no model_config.json; download {DOWNLOAD}")
        if component not in COMPONENTS:
            raise UserError(f"videoalign reward: component={component!r} is not one of {list(COMPONENTS)}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"videoalign reward: batch_size must be a positive integer, got {batch_size!r}")
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0:
            raise UserError(f"videoalign reward: fps={fps!r} must be the samples' frame rate (> 0), e.g. 16 for Wan")
        config = json.loads(config_file.read_text())
        data, peft = config.get("data_config", {}), config.get("peft_lora_config", {})
        self.norm = config.get("inference_config") if normalize else None
        self.component, self.fps, self.batch_size = component, float(fps), batch_size
        self.sample_fps = float(sample_fps if sample_fps is not None else data.get("fps") or 2.0)
        # a checkpoint trained on a fixed frame count reads that many (the reference's nframes), unless sample_fps
        self.num_frames = float(data["num_frames"]) if sample_fps is None and data.get("num_frames") else None
        self.max_pixels = int(max_frame_pixels if max_frame_pixels is not None else data.get("max_frame_pixels") or 448 * 448)
        self.device = torch.device(device) if device is not None else None
        self.dtype = resolve_dtype(dtype, self.name)
        if base is None:
            named = (folder / str(config.get("model_config", {}).get("model_name_or_path", ""))).expanduser()
            if not (named / "config.json").is_file():
                raise UserError(f"videoalign reward: set base: to the local folder of {BASE_DOWNLOAD}")
            base_dir = named
        else:
            base_dir = local_path(base, self.name, "base", BASE_DOWNLOAD)
        self.model, self.processor, self.token_ids = build_qwen2_vl(base_dir, TOKENS, self.dtype, weights=True,
                                                                     who=self.name, download=BASE_DOWNLOAD)
        hidden = self.model.config.text_config.hidden_size
        output_dim = int(config.get("model_config", {}).get("output_dim", 1))
        self.head = nn.Linear(hidden, output_dim, bias=False).eval().requires_grad_(False)
        ckpt = _checkpoint_dir(folder)
        state: dict[str, torch.Tensor] = {}
        for name in ("model.pth", "adapter_model.safetensors", "non_lora_state_dict.pth"):
            if (ckpt / name).is_file():
                state.update(read_state(ckpt / name))
        if not state:
            raise UserError(f"videoalign reward: {str(ckpt)!r} holds neither model.pth nor adapter_model.safetensors")
        scale = float(peft.get("lora_alpha", 1)) / float(peft.get("lora_r", 1)) if peft.get("lora_enable") else 1.0
        load_reward_state(self.model, self.head, state, lora_scale=scale, complete=False, who=self.name)

    @classmethod
    def planned_bytes(cls, options: dict[str, Any]) -> int:
        """Bytes of the Qwen2-VL in ``dtype`` and the float32 head, sized on the meta device from the base's
        config (``base``, else the one ``path``'s ``model_config.json`` names); where there is none, the base
        VideoReward is trained on, Qwen2-VL-2B-Instruct (``assets/reward_architectures/qwen2-vl-2b-instruct``).
        0 with ``device: cpu``."""
        if not on_accelerator(option(cls, options, "device")):
            return 0
        dtype = resolve_dtype(option(cls, options, "dtype"), cls.name)
        folder = existing(options.get("path"))
        config_file = folder / "model_config.json" if folder is not None else None
        model_config = json.loads(config_file.read_text()).get("model_config", {}) \
            if config_file is not None and config_file.is_file() else {}
        named = folder / str(model_config.get("model_name_or_path", "")) if folder is not None else None
        candidates = [existing(options.get("base")), existing(named) if model_config else None]
        base = next((c for c in candidates if c is not None and (c / "config.json").is_file()), None)
        model = meta_qwen2_vl(base or published(BASE_ARCHITECTURE), TOKENS, dtype)
        hidden, output_dim = model.config.text_config.hidden_size, int(model_config.get("output_dim", 1))
        return module_bytes([model, on_meta(lambda: nn.Linear(hidden, output_dim, bias=False))])

    @property
    def videos_kwargs(self) -> dict[str, bool]:
        """The video processor's options: frames arrive sampled and resized as qwen_vl_utils does (``_video``).
        VideoAlign gives qwen_vl_utils an explicit per-frame ``max_pixels``, which overrides its total-video
        budget, so the processor's own budget (``cap_pixels_per_frame``, in transformers that have it) is off."""
        kwargs = {"do_rescale": True, "do_sample_frames": False}
        if hasattr(self.processor.video_processor, "cap_pixels_per_frame"):
            kwargs["cap_pixels_per_frame"] = False
        return kwargs

    def _video(self, clip: torch.Tensor) -> torch.Tensor:
        """One clip ``(F, 3, H, W)`` in [0, 1] → the frames VideoAlign reads, ``(n, 3, h, w)`` float in 0..255."""
        from torchvision.transforms.functional import InterpolationMode, resize

        frames = to_uint8(clip[frame_indices(clip.shape[0], self.fps, self.sample_fps, self.num_frames)])
        h, w = smart_resize(clip.shape[-2], clip.shape[-1], 28, VIDEO_MIN_PIXELS, self.max_pixels)
        # qwen_vl_utils.fetch_video: a uint8 video, bicubic with antialias, then float
        return resize(frames, [h, w], interpolation=InterpolationMode.BICUBIC, antialias=True).float()

    def _inputs(self, clips: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The processor's tensors for clips ``(b, F, 3, H, W)`` in [0, 1] and their prompts."""
        videos = [self._video(c) for c in clips]
        messages = [[{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPT.format(text_prompt=p)}]}]
                    for p in prompts]
        texts = [self.processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
        inputs = self.processor(text=texts, videos=videos, padding=True, return_tensors="pt",
                                videos_kwargs=self.videos_kwargs)
        return {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}

    @torch.no_grad()
    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples`` ``(B, F, 3, H, W)`` in [0, 1] → ``{"videoalign": (B,)}`` (the ``component``)."""
        if not isinstance(samples, torch.Tensor) or samples.ndim != 5 or samples.shape[2] != 3:
            shape = tuple(samples.shape) if isinstance(samples, torch.Tensor) else type(samples).__name__
            raise UserError(f"videoalign reward scores videos (B, F, 3, H, W); got {shape}")
        check_unit_range(samples, self.name)
        check_lengths(samples.shape[0], prompts, metadata, self.name)
        device = self.device or samples.device
        self.model.to(device)
        self.head.to(device)
        valid = torch.isfinite(samples.detach()).flatten(1).all(1)
        clips = torch.where(valid[:, None, None, None, None], samples, torch.zeros_like(samples))
        raw = []
        for i in range(0, samples.shape[0], self.batch_size):
            inputs = {k: v.to(device) for k, v in self._inputs(clips[i : i + self.batch_size],
                                                              prompts[i : i + self.batch_size]).items()}
            inputs["pixel_values_videos"] = inputs["pixel_values_videos"].to(self.dtype)
            states = special_token_states(self.model, inputs, self.token_ids)  # (b, 3, D)
            out = self.head(states.to(self.head.weight.dtype)).float()  # (b, 3, output_dim)
            # output_dim 1: one number per token; 3: token j reads its own dimension (the reference's diagonal)
            raw.append(out[..., 0] if out.shape[-1] == 1 else out.diagonal(dim1=1, dim2=2))
        scores = overall(torch.cat(raw), self.norm)
        info = [{k: float(v[b]) for k, v in scores.items()} for b in range(samples.shape[0])]
        return RewardOutput({self.name: scores[self.component].to(samples.device)}, valid=valid.to(samples.device),
                            info=info)


def save_tiny_videoalign(out: Path, seed: int = 0, *, overwrite: bool = False) -> Path:
    """A VideoReward folder around a tiny random Qwen2-VL, laid out as the real one: ``model_config.json``,
    ``checkpoint-1/adapter_model.safetensors`` (LoRA on every decoder linear layer, PEFT's key names of
    transformers < 4.52), ``checkpoint-1/non_lora_state_dict.pth`` (head, embeddings, vision tower) and the
    base model in ``base/`` (named by ``model_name_or_path``). Written atomically as one folder
    (:func:`flowalign.io.atomic_dir`, writer ``save-tiny-videoalign``): a failure leaves ``out`` as it was, and a
    folder holding files it did not write is refused unless ``overwrite``."""
    from safetensors.torch import save_file

    from flowalign.io import atomic_dir
    from rewards.vlm_tiny import build_tiny_vlm

    out = Path(out)
    with atomic_dir(out, writer="save-tiny-videoalign", overwrite=overwrite) as tmp:
        # inside this atomic folder the base model is written straight into it
        model, processor = build_tiny_vlm(tmp / "base", family="qwen2_vl", seed=seed)
        processor.tokenizer.add_special_tokens({"additional_special_tokens": TOKENS})
        r, alpha = 4, 8
        lora, non_lora = {}, {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            model.resize_token_embeddings(len(processor.tokenizer), mean_resizing=False)
            hidden = model.config.text_config.hidden_size
            for name, module in model.model.language_model.named_modules():
                if isinstance(module, nn.Linear):
                    legacy = f"base_model.model.model.{name}"
                    lora[f"{legacy}.lora_A.weight"] = torch.randn(r, module.in_features) * 0.1
                    lora[f"{legacy}.lora_B.weight"] = torch.randn(module.out_features, r) * 0.1
            non_lora["base_model.model.rm_head.weight"] = torch.randn(1, hidden) * 0.1
        non_lora["base_model.model.model.embed_tokens.weight"] = model.model.language_model.embed_tokens.weight.detach().clone()
        for k, v in model.model.visual.merger.state_dict().items():
            non_lora[f"base_model.model.visual.merger.{k}"] = v.detach().clone()
        ckpt = tmp / "checkpoint-1"
        ckpt.mkdir(parents=True, exist_ok=True)
        save_file(lora, ckpt / "adapter_model.safetensors")
        torch.save(non_lora, ckpt / "non_lora_state_dict.pth")
        config = {
            "data_config": {"fps": 2.0, "max_frame_pixels": 200704, "eval_dim": list(DIMENSIONS),
                            "prompt_template_type": "detailed_special", "sample_type": "uniform", "num_frames": None},
            "model_config": {"model_name_or_path": "base", "output_dim": 1, "use_special_tokens": True,
                             "reward_token": "special"},
            "peft_lora_config": {"lora_enable": True, "vision_lora": False, "lora_r": r, "lora_alpha": alpha,
                                 "lora_namespan_exclude": ["lm_head", "rm_head", "embed_tokens", "visual"]},
            "inference_config": {"VQ_mean": 0.1, "VQ_std": 2.0, "MQ_mean": -0.2, "MQ_std": 1.5, "TA_mean": 0.3, "TA_std": 1.2},
        }
        (tmp / "model_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
