"""``hpsv3``: HPSv3, a Qwen2-VL-7B human-preference model with an uncertainty-aware head (docs/methods/vlm_reward_models.md).

The image and the prompt, in HPSv3's instruction, end with the special token ``<|Reward|>``; an MLP on that
token's last hidden state gives ``(μ, σ)``, and the score is ``μ`` (the reference's ``rewards[i][0]``).
Images are resized with PIL to exactly ``pixels`` (256·28² by default: 256 visual tokens), as the
reference's ``min_pixels = max_pixels``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from flowalign.errors import UserError
from flowalign.protocols import RewardOutput
from rewards.common import check_images, check_lengths, finite_mask, resolve_dtype
from rewards.planning import existing, module_bytes, on_accelerator, on_meta, option, published
from rewards.qwen_vl_reward import (build_qwen2_vl, load_reward_state, local_path, meta_qwen2_vl, read_state,
                                    smart_resize, special_token_states, to_uint8)
from rewards.registry import register

DOWNLOAD = "HPSv3 (HPSv3.safetensors from the MizzenAI/HPSv3 model card)"
BASE_DOWNLOAD = "Qwen2-VL-7B-Instruct (config, tokenizer and processor files of Qwen/Qwen2-VL-7B-Instruct)"
CHECKPOINT = "HPSv3.safetensors"
#: the base HPSv3 is trained on, as published (assets/reward_architectures/)
BASE_ARCHITECTURE = "qwen2-vl-7b-instruct"
REWARD_TOKEN = "<|Reward|>"

# HPSv3's instruction and its closing line with the reward token, verbatim (their data collator)
INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}


"""
CLOSING = """
Please provide the overall ratings of this image: <|Reward|>

END
"""


def hpsv3_head(hidden_size: int) -> nn.Sequential:
    """HPSv3's ``ranknet`` head: ``hidden → 1024 → 16 → (μ, σ)`` with ReLUs (dropout is off at inference)."""
    return nn.Sequential(nn.Linear(hidden_size, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(),
                         nn.Linear(16, 2))


def mu(head_output: torch.Tensor) -> torch.Tensor:
    """The score from the head's ``(B, 2)`` output ``(μ, σ)``: ``μ``."""
    return head_output[:, 0]


def hpsv3_text(prompt: str) -> str:
    return INSTRUCTION.format(text_prompt=prompt) + CLOSING


@register("hpsv3")
class HPSv3:
    """HPSv3 preference score ``μ`` (about −5..15 on real images; higher is preferred).

    Options: ``path`` (``HPSv3.safetensors`` or the folder holding it), ``base`` (the Qwen2-VL-7B-Instruct
    folder for the config, tokenizer and processor; default: ``path``'s folder when it holds a
    ``config.json``), ``pixels`` (each image is resized to this area, default 256·28²), ``device`` (None:
    the samples'), ``dtype`` (bf16 as the reference; the head runs in float32), ``batch_size``.
    """

    name = "hpsv3"
    differentiable = False

    def __init__(self, path: str | None = None, base: str | None = None, *, pixels: int = 256 * 28 * 28,
                 device: str | None = None, dtype: str = "bfloat16", batch_size: int = 8):
        weights = local_path(path, self.name, "path", DOWNLOAD)
        if weights.is_dir():
            weights = weights / CHECKPOINT
            if not weights.is_file():
                raise UserError(f"hpsv3 reward: {str(path)!r} holds no {CHECKPOINT}; download {DOWNLOAD}")
        folder = local_path(base, self.name, "base", BASE_DOWNLOAD) if base is not None else weights.parent
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"hpsv3 reward: batch_size must be a positive integer, got {batch_size!r}")
        if isinstance(pixels, bool) or not isinstance(pixels, int) or pixels < 56 * 56:
            raise UserError(f"hpsv3 reward: pixels must be an integer >= 3136 (56x56), got {pixels!r}")
        self.device = torch.device(device) if device is not None else None
        self.dtype, self.batch_size, self.pixels = resolve_dtype(dtype, self.name), batch_size, pixels
        if base is None and not (folder / "config.json").is_file():
            raise UserError(f"hpsv3 reward: set base: to the local folder of {BASE_DOWNLOAD} ({str(folder)!r} has"
                            " no config.json)")
        self.model, self.processor, self.token_ids = build_qwen2_vl(folder, [REWARD_TOKEN], self.dtype, weights=False,
                                                                     who=self.name, download=BASE_DOWNLOAD)
        self.head = hpsv3_head(self.model.config.text_config.hidden_size).eval().requires_grad_(False)
        load_reward_state(self.model, self.head, read_state(weights), complete=True, who=self.name)

    @classmethod
    def planned_bytes(cls, options: dict[str, Any]) -> int:
        """Bytes of the Qwen2-VL in ``dtype`` and the float32 head, sized on the meta device from the config of
        ``base`` (or of ``path``'s folder); where neither holds one, the released model's base, Qwen2-VL-7B-Instruct
        (``assets/reward_architectures/qwen2-vl-7b-instruct``). 0 with ``device: cpu``."""
        if not on_accelerator(option(cls, options, "device")):
            return 0
        dtype = resolve_dtype(option(cls, options, "dtype"), cls.name)
        weights = existing(options.get("path"))
        candidates = [existing(options.get("base")), weights if weights is None or weights.is_dir() else weights.parent]
        base = next((c for c in candidates if c is not None and (c / "config.json").is_file()), None)
        model = meta_qwen2_vl(base or published(BASE_ARCHITECTURE), [REWARD_TOKEN], dtype)
        head = on_meta(lambda: hpsv3_head(model.config.text_config.hidden_size))
        return module_bytes([model, head])

    def _inputs(self, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        from PIL import Image

        pils = []
        for x in to_uint8(images).permute(0, 2, 3, 1).cpu().numpy():
            h, w = smart_resize(x.shape[0], x.shape[1], 28, self.pixels, self.pixels)
            pils.append(Image.fromarray(x).resize((w, h), Image.BICUBIC))  # qwen_vl_utils.fetch_image's resize
        messages = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": hpsv3_text(p)}]}]
                    for p in prompts]
        texts = [self.processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
        return dict(self.processor(text=texts, images=pils, padding=True, return_tensors="pt"))

    @torch.no_grad()
    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples`` ``(B, 3, H, W)`` in [0, 1] → ``{"hpsv3": μ (B,)}``; ``info`` holds ``σ``."""
        check_images(samples, self.name)
        check_lengths(samples.shape[0], prompts, metadata, self.name)
        device = self.device or samples.device
        self.model.to(device)
        self.head.to(device)
        valid = finite_mask(samples)
        images = torch.where(valid[:, None, None, None], samples, torch.zeros_like(samples))
        outputs = []
        for i in range(0, samples.shape[0], self.batch_size):
            inputs = {k: v.to(device) for k, v in self._inputs(images[i : i + self.batch_size],
                                                              prompts[i : i + self.batch_size]).items()}
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
            states = special_token_states(self.model, inputs, self.token_ids)[:, 0]
            outputs.append(self.head(states.float()))
        out = torch.cat(outputs)
        info = [{"sigma": float(s)} for s in out[:, 1].tolist()]
        return RewardOutput({self.name: mu(out).float().to(samples.device)}, valid=valid, info=info)


def save_tiny_hpsv3(out: Path, seed: int = 0, *, overwrite: bool = False) -> Path:
    """An HPSv3 folder with a tiny random Qwen2-VL: ``config.json``, the processor and tokenizer files of the
    base model and ``HPSv3.safetensors`` holding every weight with the head, as the real checkpoint. Written
    atomically (:func:`flowalign.io.atomic_dir`, writer ``save-tiny-hpsv3``): a failure leaves ``out`` as it
    was, and a folder holding files it did not write is refused unless ``overwrite``. Inside ``flowalign
    tiny-reward``'s own atomic folder it writes straight into it."""
    from safetensors.torch import save_file

    from flowalign.io import atomic_dir
    from rewards.vlm_tiny import build_tiny_vlm

    out = Path(out)
    model, processor = build_tiny_vlm(None, family="qwen2_vl", seed=seed)
    with atomic_dir(out, writer="save-tiny-hpsv3", overwrite=overwrite) as tmp:
        model.config.save_pretrained(tmp)
        processor.save_pretrained(tmp)  # the base model's tokenizer: the reward adds its token when it loads
        tokenizer = processor.tokenizer
        tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
            head = hpsv3_head(model.config.text_config.hidden_size)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        state.update({f"rm_head.{k}": v.contiguous() for k, v in head.state_dict().items()})
        save_file(state, str(tmp / CHECKPOINT))
    return out
