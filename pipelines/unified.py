"""A unified multimodal model as a :class:`flowalign.protocols.UnifiedPolicy`: Qwen-Image-Edit with its own
Qwen2.5-VL encoder writing the text.

Qwen-Image-Edit already holds both halves of a unified model: a vision-language model (Qwen2.5-VL: vision
tower + language model + LM head) that reads an image with text, and a flow transformer (MMDiT) that draws
an image conditioned on that language model's hidden states and on a reference image's latents. Here:

* understanding: the VL model reads an image with a reflection prompt and *writes* text (sampled token by
  token at a temperature, each token's log-probability at that temperature kept), through a LoRA on its
  language layers (the ``"reflection"`` role);
* generation: the editing policy itself (:attr:`UnifiedEditPolicy.editor`): the reflection is the edit
  instruction, the current image the reference image; the first image of a trajectory is drawn from a
  mid-grey canvas as reference (``encode(prompts)``: text to image).

One ``trainable`` module holds both roles' weights (``flow``: the transformer's LoRA or full weights;
``language``: the VL model, whose LoRA tensors are its only trained ones), so one optimiser, one EMA and one
checkpoint cover both. The conditioning the transformer reads is always the *frozen* VL model's (the
language LoRA is switched on only while writing or scoring text): prompt encodings stay cacheable, and
the reflection weights change only what is written, as BAGEL's understanding expert changes what its
generation expert reads only through the context it writes (``docs/methods/umm_reflection.md``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from PIL import Image
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from flowalign.errors import UserError
from flowalign.io import atomic_path
from flowalign.protocols import Conditioning
from flowalign.reflection import Reflection, sample_reflecting
from flowalign.sampling import rollout
from pipelines import lora as lora_utils

#: what the VL model is asked about its own image (Qwen2.5-VL's chat format; ``{}`` is the prompt)
REFLECTION_TEMPLATE = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>The image should show: {}. "
                       "What is wrong with it, and what should change? Answer 'no change' if nothing."
                       "<|im_end|>\n<|im_start|>assistant\n")
#: the language LoRA's targets: the language model's projections only (the vision tower's MLP has the same
#: leaf names, hence a full-name pattern)
LANGUAGE_TARGETS = (r".*language_model\.layers\.\d+\."
                    r"(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))")
#: file of the language LoRA in a saved adapter folder (beside the transformer's diffusers LoRA)
LANGUAGE_ADAPTER_FILE = "reflection_lora.safetensors"
#: token id after a sequence's end in :meth:`UnifiedEditPolicy.generate`'s output (its log-prob is 0)
PAD = -1


def tempered_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)`` at ``tokens``: ``logits (L, V)``, ``tokens (L,)`` → ``(L,)`` float32
    (float64 for float64 logits). The distribution a token drawn at ``temperature`` came from (UMM-Reflection's
    sampler and trainer score its tokens so, old, new and reference alike); temperature 0 (greedy) scores at
    1, the model's own."""
    scale = temperature if temperature > 0 else 1.0
    wide = logits if logits.dtype == torch.float64 else logits.float()
    return torch.log_softmax(wide / scale, dim=-1).gather(1, tokens[:, None].to(logits.device))[:, 0]


def _pictures(images: torch.Tensor) -> list[Image.Image]:
    """``(B, 3, H, W)`` in [0, 1] → PIL images (8-bit, as an image a model looks at)."""
    arrays = (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    return [Image.fromarray(a) for a in arrays]


class _Draw(LogitsProcessor):
    """The next token of a one-sequence ``generate``, drawn from the logits with ``generator`` at
    ``temperature`` (0: the most likely token); every other token is masked, so greedy decoding takes it."""

    def __init__(self, generator: torch.Generator | None, temperature: float) -> None:
        self.generator, self.temperature = generator, temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits = scores[0].float().cpu()  # the generators are CPU ones
        if self.temperature == 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(torch.log_softmax(logits / self.temperature, -1).exp(), 1,
                                          generator=self.generator))
        drawn = torch.full_like(scores, float("-inf"))
        drawn[0, token] = 0.0
        return drawn


@contextmanager
def _plain_generation(language: Any, eos_id: int) -> Iterator[None]:
    """``language.generate`` with no processor from the checkpoint's ``generation_config.json`` (Qwen2.5-VL's
    ships a repetition penalty, top-k, top-p: they would change the distribution drawn from, so the stored
    log-probs would not be the model's): greedy over :class:`_Draw`'s choice, ending at ``eos_id`` only, the
    raw logits returned."""
    saved = language.generation_config
    language.generation_config = GenerationConfig(
        do_sample=False, num_beams=1, eos_token_id=eos_id, pad_token_id=eos_id, use_cache=True,
        output_logits=True, return_dict_in_generate=True)
    try:
        yield
    finally:
        language.generation_config = saved


class UnifiedEditPolicy:
    """Qwen-Image-Edit (``editor``, a :class:`pipelines.qwen_image_edit.QwenImageEditPolicy`) whose VL encoder
    also writes text. As a :class:`flowalign.protocols.FlowPolicy` it draws text-to-image samples (the
    editor on a blank canvas); ``editor`` revises an image; ``generate`` / ``token_log_probs`` write and
    score reflections."""

    input_images = False  # as a FlowPolicy: text to image (evaluation, first images); ``editor`` takes images

    def __init__(self, editor: Any, language_lora_rank: int = 4, language_lora_alpha: float = 8.0) -> None:
        if not getattr(editor, "input_images", False) or not hasattr(editor.pipe, "processor"):
            raise UserError(f"a unified policy needs an editing model with a vision-language encoder (Qwen-Image-"
                            f"Edit); model.path holds a {editor.family!r} model")
        self.editor = editor
        self.language = editor.pipe.text_encoder
        self.processor = editor.pipe.processor
        self.tokenizer = editor.pipe.tokenizer
        self.eos_id = int(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        if not any(isinstance(m, BaseTunerLayer) for m in self.language.modules()):
            config = LoraConfig(r=language_lora_rank, lora_alpha=language_lora_alpha, lora_dropout=0.0,
                                target_modules=LANGUAGE_TARGETS, init_lora_weights=True)
            inject_adapter_in_model(config, self.language, adapter_name=lora_utils.ADAPTER_NAME)
        layers, _ = lora_utils.tuner_layers(self.language)
        for t in self.language_adapter().values():
            t.requires_grad_(True)
        for layer in layers:  # off unless writing or scoring text: the transformer reads the frozen encoder
            layer._disable_adapters = True
        self.trainable = torch.nn.ModuleDict({"flow": editor.trainable, "language": self.language})
        #: inside :meth:`adapter_disabled`: the language LoRA stays off while scoring text (the reference)
        self._reference = False
        #: how evaluation samples (:meth:`sample_for_evaluation`): the reflection loop, or None for the first
        #: image alone (set by the trainer from its options)
        self.reflection: Reflection | None = None

    # ------------------------------------------------------------------ FlowPolicy: the editor's own
    def __getattr__(self, name: str) -> Any:
        if name in ("editor", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.editor, name)

    def blank_canvas(self) -> torch.Tensor:
        """The reference image of a first image ``(3, H, W)``: uniform mid-grey at the output size."""
        return torch.full((3, int(self.editor.defaults["height"]), int(self.editor.defaults["width"])), 0.5)

    def encode(self, prompts: list[str], images: list[Any] | None = None) -> Conditioning:
        """The editor's conditioning; without images, each prompt reads the blank canvas (text to image)."""
        return self.editor.encode(prompts, images=images or [self.blank_canvas()] * len(prompts))

    def sample_for_evaluation(self, prompts: list[str], *, initial_noise: torch.Tensor, seeds: list[int],
                              num_steps: int, guidance_scale: float | None, metadata: list[dict] | None = None
                              ) -> tuple[torch.Tensor, list[dict[str, str]]]:
        """An evaluation's samples ``(B, 3, H, W)`` and per-sample notes (:func:`flowalign.evaluation.sample_seeded`):
        the final images of the model's own reflection loop (:func:`flowalign.reflection.sample_reflecting`),
        or with :attr:`reflection` None its first images (an ODE sample from ``initial_noise``), no notes."""
        if self.reflection is None:
            first = rollout(self, prompts, num_steps=num_steps, sampler="ode", guidance_scale=guidance_scale,
                            initial_noise=initial_noise, metadata=metadata)
            return first.samples.float(), [{} for _ in prompts]
        return sample_reflecting(self, self.reflection, prompts, initial_noise=initial_noise, seeds=seeds,
                                 num_steps=num_steps, guidance_scale=guidance_scale, metadata=metadata)

    def save_adapter(self, directory: str | Path) -> None:
        """The transformer's LoRA as the editor saves it (when it has one), plus the language LoRA in
        ``reflection_lora.safetensors``."""
        from safetensors.torch import save_file

        if lora_utils.has_adapter(self.editor.transformer):
            self.editor.save_adapter(directory)
        state = self.language_adapter()
        with atomic_path(Path(directory) / LANGUAGE_ADAPTER_FILE) as tmp:
            save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp))

    def load_adapter(self, directory: str | Path) -> None:
        """What :meth:`save_adapter` wrote (or a checkpoint of a run that trained this policy): the
        transformer's LoRA when the folder has one (else a full fine-tune's ``flow.*`` tensors from
        ``trainable.safetensors``), and the language LoRA of ``reflection_lora.safetensors``."""
        from safetensors.torch import load_file

        folder = Path(directory)
        if (folder / lora_utils.LORA_WEIGHT_NAME).is_file():
            self.editor.load_adapter(folder)
        elif (folder / "trainable.safetensors").is_file():
            state = {k[len("flow."):]: v for k, v in load_file(str(folder / "trainable.safetensors")).items()
                     if k.startswith("flow.")}
            _, unexpected = self.editor.trainable.load_state_dict(state, strict=False)
            if unexpected or not state:
                raise UserError(f"{folder}: its transformer weights do not match this model "
                                f"({len(unexpected)} unknown tensors)")
        language = folder / LANGUAGE_ADAPTER_FILE
        if not language.is_file():
            raise UserError(f"{folder} holds no {LANGUAGE_ADAPTER_FILE}: it is not a unified policy's adapter; give "
                            "a checkpoint of a trainer.name=umm_reflection run")
        saved, mine = load_file(str(language)), self.language_adapter()
        if set(saved) != set(mine):
            raise UserError(f"{language}: its language LoRA does not match this model's ({len(set(saved) ^ set(mine))} "
                            "tensors differ); load it on the model it was trained from")
        with torch.no_grad():
            for name, value in saved.items():
                if value.shape != mine[name].shape:
                    raise UserError(f"{language}: {name} has shape {tuple(value.shape)}, this policy's "
                                    f"{tuple(mine[name].shape)}; use the run's trainer.language_lora_rank")
                mine[name].copy_(value.to(mine[name]))

    def language_adapter(self) -> dict[str, torch.nn.Parameter]:
        """The language LoRA's tensors by name (the VL model's only trained ones)."""
        return {n: t for n, t in self.language.named_parameters() if ".lora_" in n}

    # ------------------------------------------------------------------ understanding: text
    @contextmanager
    def writing(self) -> Iterator[None]:
        """The language LoRA switched on (writing and scoring reflections), off again after; inside
        :meth:`adapter_disabled` it stays off (the starting model scores the text)."""
        layers, _ = lora_utils.tuner_layers(self.language)
        for layer in layers:
            layer._disable_adapters = self._reference
        try:
            yield
        finally:
            for layer in layers:
                layer._disable_adapters = True

    def _inputs(self, image: torch.Tensor, prompt: str) -> dict[str, torch.Tensor]:
        picture = self.editor.condition_image(image)
        inputs = self.processor(text=[REFLECTION_TEMPLATE.format(prompt)], images=[picture], return_tensors="pt")
        return {k: v.to(self.editor.device) for k, v in inputs.items()}

    def _logits(self, inputs: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``(L+1, V)`` float32 after the prompt and after each of ``tokens (L,)``: row ``j``
        predicts token ``j`` (the last row, the token after them)."""
        ids = torch.cat([inputs["input_ids"], tokens[None].to(inputs["input_ids"])], dim=1)
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        if "mm_token_type_ids" in inputs:  # the written tokens are text
            types = inputs["mm_token_type_ids"]
            extra["mm_token_type_ids"] = torch.cat([types, types.new_zeros(1, tokens.shape[0])], dim=1)
        logits = self.language(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0].float()
        return logits[inputs["input_ids"].shape[1] - 1 :]

    def generate(self, images: torch.Tensor, prompts: list[str], max_new_tokens: int,
                 generator: torch.Generator | Sequence[torch.Generator] | None = None, temperature: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reflections on ``images (B, 3, H, W)``: tokens ``(B, L)`` drawn at ``temperature`` (0: greedy) until
        ``<|im_end|>`` (kept) or ``max_new_tokens`` (after a sequence's end: :data:`PAD`), and each token's
        log-probability in the distribution it was drawn from (at ``temperature``; greedy: at 1), what
        :meth:`token_log_probs` computes at the same temperature, ``(B, L)`` float32 (0 after the end), no grad. ``generator``: one per sample (a sample's text then depends on
        nothing else in the batch) or one for the batch.

        Decoded by transformers' ``generate`` with its KV cache: the prompt and image are read once, each
        further token costs one step; the draw is :class:`_Draw` (the only logits processor, so it sees the
        raw logits ``generate`` reports)."""
        gens = list(generator) if isinstance(generator, Sequence) else [generator] * len(prompts)
        rows, logps = [], []
        with torch.no_grad(), self.writing(), _plain_generation(self.language, self.eos_id):
            for image, prompt, g in zip(images, prompts, gens):
                inputs = self._inputs(image, prompt)
                out = self.language.generate(**inputs, max_new_tokens=max_new_tokens,
                                             logits_processor=LogitsProcessorList([_Draw(g, temperature)]))
                tokens = out.sequences[0, inputs["input_ids"].shape[1] :].cpu()
                logits = torch.cat(out.logits).float().cpu()  # (L, V): the raw next-token logits
                rows.append(tokens.tolist())
                logps.append(tempered_log_probs(logits, tokens, temperature).tolist())
        length = max(1, max(len(r) for r in rows))
        out_tokens = torch.full((len(rows), length), PAD, dtype=torch.long)
        log_probs = torch.zeros(len(rows), length)
        for i, (r, lp) in enumerate(zip(rows, logps)):
            out_tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            log_probs[i, : len(lp)] = torch.tensor(lp)
        return out_tokens, log_probs

    def token_log_probs(self, images: torch.Tensor, prompts: list[str], tokens: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
        """``log π(token | image, prompt, earlier tokens)`` at ``temperature`` (``log softmax(logits / T)``)
        ``(B, L)`` float32 with gradients through the language LoRA (inside :meth:`adapter_disabled`: the
        starting model's, LoRA off); 0 at :data:`PAD` positions."""
        out = torch.zeros(tokens.shape, device=self.editor.device)
        rows = []
        with self.writing():
            for i, (image, prompt) in enumerate(zip(images, prompts)):
                n = int((tokens[i] != PAD).sum())
                if n == 0:
                    rows.append(out[i])
                    continue
                row = tokens[i, :n].to(self.editor.device)
                logp = tempered_log_probs(self._logits(self._inputs(image, prompt), row)[:-1], row, temperature)
                rows.append(torch.cat([logp, out[i, n:]]))
        return torch.stack(rows)

    def decode_tokens(self, tokens: torch.Tensor) -> list[str]:
        """Each row's text, without :data:`PAD` and special tokens (``<|im_end|>``; a written ``<|video_pad|>``
        would be markup in the revision's instruction, which the editor's processor refuses)."""
        return [self.tokenizer.decode([t for t in row.tolist() if t != PAD], skip_special_tokens=True).strip()
                for row in tokens]

    @contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """The starting model in both roles (the KL terms' reference): the editor's adapter off (or its frozen
        copy under full fine-tuning) and the language LoRA kept off while text is scored."""
        with self.editor.adapter_disabled():
            self._reference = True
            try:
                yield
            finally:
                self._reference = False


def unified(policy: Any, language_lora_rank: int = 4, language_lora_alpha: float = 8.0) -> UnifiedEditPolicy:
    """``policy`` as a unified policy (itself when it is one already; an editing model gets its VL writer)."""
    if isinstance(policy, UnifiedEditPolicy):
        return policy
    return UnifiedEditPolicy(policy, language_lora_rank, language_lora_alpha)
