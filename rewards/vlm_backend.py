"""Chat requests to a VLM judge and a local transformers backend that answers them.

A judge speaks to its model through one call, ``backend.complete(requests) -> completions``, whether
the model runs in this process (:class:`LocalVLM`) or behind an OpenAI-compatible server
(:class:`rewards.vlm_http.OpenAIChatClient`); ``flowalign serve-judge`` serves a :class:`LocalVLM`.
So the scoring code, the parsing and the HTTP path all see the same requests and replies.
"""

from __future__ import annotations

import hashlib
import math
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flowalign.errors import UserError
from rewards.common import resolve_dtype
from rewards.planning import module_bytes, on_meta


@dataclass
class ChatRequest:
    """One judge query.

    ``messages``: OpenAI-style ``[{"role", "content"}]`` where ``content`` is a string or a list of
    parts ``{"type": "text", "text": str}`` / ``{"type": "image", "image": PIL.Image}``.
    ``assistant_prefix``: text the reply is forced to start with (e.g. ``"Score:"``); the completion
    holds only what follows it. ``temperature`` 0 is greedy. ``top_logprobs`` > 0 asks for that many
    alternatives (token text → log-prob) at each generated position. ``template_kwargs``: extra variables
    for the model's chat template, e.g. ``{"enable_thinking": False}`` for a Qwen3 template (vLLM's
    ``chat_template_kwargs``).
    """

    messages: list[dict[str, Any]]
    assistant_prefix: str = ""
    max_tokens: int = 16
    temperature: float = 0.0
    top_logprobs: int = 0
    seed: int | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def digest(self) -> str:
        """A SHA-256 of everything this request asks: roles, texts, images' pixels and the decoding settings."""
        h = hashlib.sha256(repr((self.assistant_prefix, self.max_tokens, self.temperature, self.top_logprobs,
                                 self.seed, sorted(self.template_kwargs.items()))).encode())
        for message in self.messages:
            h.update(message["role"].encode())
            content = message["content"]
            for part in [{"type": "text", "text": content}] if isinstance(content, str) else content:
                if part["type"] == "image":
                    image = part["image"]
                    h.update(repr((image.mode, image.size)).encode())
                    h.update(image.tobytes())
                else:
                    h.update(part["text"].encode())
        return h.hexdigest()


@dataclass
class Completion:
    """A reply: ``text`` (None on failure, with ``error``), the generated ``tokens`` (the stop token
    included) and, when asked,
    ``top_logprobs`` per generated position: ``(token text, log-prob)`` pairs, most likely first, one per
    token id (two ids may share a text), log-probs under the model before temperature."""

    text: str | None
    tokens: list[str] = field(default_factory=list)
    top_logprobs: list[list[tuple[str, float]]] = field(default_factory=list)
    finish_reason: str = "stop"
    error: str | None = None
    prompt_tokens: int = 0


def images_of(messages: list[dict[str, Any]]) -> list[Any]:
    """The PIL images of a conversation, in order of appearance."""
    return [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"]
            if p.get("type") == "image"]


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # chat templates want {"type": "image"} placeholders; the pixels go to the processor separately
    out = []
    for m in messages:
        if isinstance(m["content"], list):
            parts = [{"type": "image"} if p.get("type") == "image" else {"type": "text", "text": p["text"]}
                     for p in m["content"]]
            out.append({"role": m["role"], "content": parts})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


class LocalVLM:
    """A transformers VLM (``AutoModelForImageTextToText`` + ``AutoProcessor``) from a local folder.

    Qwen2.5-VL / Qwen3-VL and any other model whose processor has a chat template work. Images go
    through the processor unchanged (its own resizing: ``min_pixels``/``max_pixels`` for Qwen).
    Requests are answered in batches of ``batch_size`` with left padding; one lock serialises
    access, so a server may call :meth:`complete` from many threads.
    """

    #: the judges loaded in this process, by folder, device, dtype and batch size, while a reward holds them
    _loaded: "weakref.WeakValueDictionary[tuple[str, str, str, int], LocalVLM]" = weakref.WeakValueDictionary()

    @classmethod
    def shared(cls, model: str | Path, *, device: str | torch.device = "cpu", dtype: str | torch.dtype = "fp32",
               batch_size: int = 8) -> "LocalVLM":
        """The judge in ``model`` loaded once in this process: reward entries naming the same folder (two
        dimensions of one judge) hold one copy of its weights, not one each."""
        key = (str(Path(model).resolve()), str(torch.device(device)), str(resolve_dtype(dtype, "VLM judge")),
               batch_size if isinstance(batch_size, int) else -1)  # a bad batch size: refused by the constructor
        judge = cls._loaded.get(key)
        if judge is None:
            judge = cls._loaded[key] = cls(model, device=device, dtype=dtype, batch_size=batch_size)
        return judge

    def __init__(self, model: str | Path, *, device: str | torch.device = "cpu", dtype: str | torch.dtype = "fp32",
                 batch_size: int = 8):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        path = Path(model)
        if not (path / "config.json").is_file():
            raise UserError(f"VLM judge: model={str(model)!r} is not a model folder (no config.json); give the"
                            " local folder of a transformers VLM such as Qwen2.5-VL-7B-Instruct")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"VLM judge: batch_size must be a positive integer, got {batch_size!r}")
        self.name, self.batch_size = path.name, batch_size
        self.device, self.dtype = torch.device(device), resolve_dtype(dtype, "VLM judge")
        try:
            self.processor = AutoProcessor.from_pretrained(path)
            net = AutoModelForImageTextToText.from_pretrained(path, dtype=self.dtype)
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"VLM judge: could not load {str(path)!r} as an image-text-to-text model ({e})") from e
        self.model = net.to(self.device).eval().requires_grad_(False)
        self.tokenizer = self.processor.tokenizer
        self.tokenizer.padding_side = "left"  # generation continues every row from its last real token
        if getattr(self.processor, "chat_template", None) is None and self.tokenizer.chat_template is None:
            raise UserError(f"VLM judge: {str(path)!r} has no chat template; use an instruction-tuned VLM")
        eos = self.model.generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._eos.add(self.tokenizer.eos_token_id)
        self._pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else next(iter(self._eos))
        self._texts: dict[int, str] = {}
        self.lock = threading.Lock()

    @staticmethod
    def planned_bytes(model: str | Path, dtype: str | torch.dtype) -> int:
        """Bytes of the model this backend loads from the folder ``model``, in ``dtype``: its ``config.json``'s
        image-text-to-text model built on the meta device (no weights read)."""
        from transformers import AutoConfig, AutoModelForImageTextToText

        torch_dtype = resolve_dtype(dtype, "VLM judge")
        net = on_meta(lambda: AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model), dtype=torch_dtype))
        return module_bytes([net])

    def token_text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self.tokenizer.decode([token_id])
        return self._texts[token_id]

    def render(self, request: ChatRequest) -> str:
        """The prompt text the model continues (chat template + generation prompt + forced prefix)."""
        text = self.processor.apply_chat_template(_template_messages(request.messages), add_generation_prompt=True,
                                                  tokenize=False, **request.template_kwargs)
        return text + request.assistant_prefix

    def complete(self, requests: list[ChatRequest]) -> list[Completion]:
        """Answer ``requests`` (same order). Requests with equal generation settings share batches."""
        out: list[Completion | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.max_tokens, float(r.temperature), r.top_logprobs, r.seed), []).append(i)
        with self.lock:
            for idx in groups.values():
                for s in range(0, len(idx), self.batch_size):
                    chunk = idx[s : s + self.batch_size]
                    for i, c in zip(chunk, self._complete_batch([requests[i] for i in chunk])):
                        out[i] = c
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def _complete_batch(self, requests: list[ChatRequest]) -> list[Completion]:
        r0 = requests[0]
        texts = [self.render(r) for r in requests]
        images = [im for r in requests for im in images_of(r.messages)]
        inputs = self.processor(text=texts, images=images or None, padding=True, return_tensors="pt")
        inputs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        sampling = r0.temperature > 0
        kwargs: dict[str, Any] = dict(max_new_tokens=r0.max_tokens, do_sample=sampling, output_logits=True,
                                      return_dict_in_generate=True, pad_token_id=self._pad)
        if sampling:
            kwargs.update(temperature=float(r0.temperature), top_k=None, top_p=None)
        else:  # greedy: drop sampling defaults a checkpoint's generation_config may carry
            kwargs.update(temperature=None, top_k=None, top_p=None)
        if sampling and r0.seed is not None:  # a seeded request: reproducible, the global RNG untouched
            cuda = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
                if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):
                torch.manual_seed(r0.seed)
                gen = self.model.generate(**inputs, **kwargs)
        else:
            gen = self.model.generate(**inputs, **kwargs)
        n_prompt = inputs["input_ids"].shape[1]
        new = gen.sequences[:, n_prompt:].cpu()
        logps = [torch.log_softmax(step.float(), dim=-1).cpu() for step in gen.logits]  # T x (B, V)
        prompt_lens = inputs["attention_mask"].sum(1).tolist()
        completions = []
        for b in range(len(requests)):
            ids = new[b].tolist()
            length = next((t for t, tok in enumerate(ids) if tok in self._eos), None)
            finish = "stop" if length is not None else "length"
            length = len(ids) if length is None else length
            n_tokens = min(length + (finish == "stop"), len(logps))  # the stop token is a generated token too
            tops: list[list[tuple[str, float]]] = []
            if r0.top_logprobs > 0:
                for t in range(n_tokens):
                    values, top_ids = logps[t][b].topk(min(r0.top_logprobs, logps[t].shape[-1]))
                    tops.append([(self.token_text(j), v) for v, j in zip(values.tolist(), top_ids.tolist())
                                 if math.isfinite(v)])
            completions.append(Completion(
                text=self.tokenizer.decode(ids[:length], skip_special_tokens=True),
                tokens=[self.token_text(j) for j in ids[:n_tokens]], top_logprobs=tops, finish_reason=finish,
                prompt_tokens=int(prompt_lens[b]),
            ))
        return completions
