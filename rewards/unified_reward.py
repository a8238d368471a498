"""``unified_reward``: UnifiedReward, a Qwen2.5-VL fine-tuned to judge generated images
(docs/methods/vlm_reward_models.md).

Two modes, on a local model folder (``path``) or an OpenAI-compatible server (``url``: vLLM, SGLang,
``flowalign serve-judge``), through the same backends as the VLM judges (:mod:`rewards.vlm_backend`):

* ``score`` (pointwise, as Flow-GRPO trains on it): the image, resized to ``image_size``², and Flow-GRPO's
  question; the reply's ``Final Score: x`` (x in 1..5) gives ``x / 5`` (``normalize: false``: ``x``).
* ``think_pairwise`` (UnifiedReward-Think): the images sharing a prompt are compared two by two with the
  Think prompt; the ``<answer>`` says "Image 1 is better" or "Image 2 is better". A sample's score is its
  win rate over its comparisons (Pref-GRPO's pairwise reward), in [0, 1].

A reply without a score makes its sample invalid, never 0; a pairwise reply without a verdict counts as a
tie (half a win to each image, as Pref-GRPO's ``unifiedreward_think.py`` does; ``no_verdict: unread`` leaves
it out), and a sample none of whose comparisons came back is invalid.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from flowalign.errors import UserError
from flowalign.protocols import RewardOutput
from rewards.common import check_images, check_lengths, finite_mask
from rewards.planning import existing, missing, on_accelerator, option, published
from rewards.qwen_vl_reward import local_path
from rewards.registry import register
from rewards.vlm_backend import ChatRequest
from rewards.vlm_parse import answer_region

log = logging.getLogger("flowalign.rewards.unified_reward")

MODES = ("score", "think_pairwise")
#: what UnifiedReward-qwen-7b and UnifiedReward-Think-qwen-7b are, as published (assets/reward_architectures/)
ARCHITECTURE_7B = "qwen2.5-vl-7b-instruct"
DOWNLOAD = "a UnifiedReward model (e.g. CodeGoat24/UnifiedReward-qwen-7b, or CodeGoat24/UnifiedReward-Think-qwen-7b for think_pairwise)"

# Flow-GRPO's pointwise question, verbatim (flow_grpo/rewards.py, unifiedreward_score_sglang)
SCORE_QUESTION = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate"
    " this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with"
    " the provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as"
    " described in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including"
    " clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria,"
    " assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)
# UnifiedReward-Think's image-generation pairwise question, verbatim (qwen_infer_cot_image_generation.py)
THINK_QUESTION = (
    "Given a caption and two images generated based on this caption, please analyze in detail the two provided"
    " images. Evaluate them on various dimensions such as semantic consistency (how closely the image content"
    " aligns with the caption), aesthetics (composition, color usage, artistic expression), authenticity (realism"
    " and attention to detail), and any other factors you deem relevant. For each evaluation dimension, provide a"
    " score between 1-10 for both images (e.g., Image 1: 8/10, Image 2: 6/10) and provide a concise rationale for"
    " the score. Calculate the total score for each image by summing all dimension scores. Use a chain-of-thought"
    " process to detail your reasoning steps, and enclose all your detailed reasoning within <think> and </think>"
    " tags. Then, in the <answer> tag, output exactly one of the following strings: 'Image 1 is better' or"
    " 'Image 2 is better' based on the total scores. No additional text is allowed in the <answer> section.\n\n"
    "Example output format:\n<think>\n1. Semantic consistency: Image 1 (9/10) - ...; Image 2 (7/10) - ...\n"
    "2. Aesthetics: Image 2 (8/10) - ...; Image 1 (8/10) - ...\n3. Authenticity: Image 1 (8/10) - ...; Image 2"
    " (5/10) - ...\n[Additional dimensions if any]: Image 2 (8/10) - ...; Image 1 (6/10) - ...\nTotal score:\n"
    "Image 1: 9+8+8+6=31\nImage 2: 7+8+5+8=28\n</think>\n<answer>Image 1 is better</answer>\n**Note: In the"
    " example above, scores and the final answer are placeholders meant only to demonstrate the format. Your"
    " actual evaluation should be based on the quality of two given images.**\n\nYour task is provided as"
    " follows:\nText Caption: [{prompt}]"
)
_FINAL_SCORE = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")  # Flow-GRPO's pattern
_VERDICT = re.compile(r"Image\s*([12])\s*is\s*better", re.I)


def parse_final_score(text: str | None) -> float | None:
    """The ``x`` of the first ``Final Score: x`` (1..5) in a reply, or None (Flow-GRPO scores that 0)."""
    m = _FINAL_SCORE.search(text or "")
    return float(m.group(1)) if m else None


def parse_verdict(text: str | None) -> int | None:
    """1 or 2 from "Image k is better" in the reply's ``<answer>`` (the whole reply without ``<think>`` when it
    has no answer block), or None."""
    m = _VERDICT.search(answer_region(text or ""))
    return int(m.group(1)) if m else None


def win_rates(n: int, verdicts: list[tuple[int, int, int | None]]) -> tuple[list[float | None], list[int]]:
    """Each sample's share of won comparisons among those read: ``verdicts`` are ``(a, b, winner)`` with
    ``winner`` 1 (a) / 2 (b) / 0 (a tie: half a win each) / None (unread). Returns ``(rates, comparisons
    read)``; None where none was read."""
    wins, read = [0.0] * n, [0] * n
    for a, b, v in verdicts:
        if v is None:
            continue
        read[a] += 1
        read[b] += 1
        if v == 0:
            wins[a] += 0.5
            wins[b] += 0.5
        else:
            wins[a if v == 1 else b] += 1
    return [w / r if r else None for w, r in zip(wins, read)], read


@register("unified_reward")
class UnifiedReward:
    """UnifiedReward in ``score`` or ``think_pairwise`` mode (see the module docstring).

    Options: ``path`` (a local UnifiedReward folder, run in this process) or ``url`` (an OpenAI-compatible
    server) with ``model``, ``api_key``, ``timeout``, ``retries``, ``concurrency``; ``mode``, ``image_size``
    (images are resized to a square of this side, 512 as Flow-GRPO; null keeps them), ``normalize``,
    ``max_tokens`` (reply length), ``both_orders`` (think_pairwise: judge each pair in both orders),
    ``no_verdict`` (think_pairwise: ``tie``, half a win each as Pref-GRPO counts it, or ``unread``);
    ``device`` (None: the samples'), ``dtype`` (bf16), ``batch_size`` (requests per forward).
    """

    name = "unified_reward"
    differentiable = False

    def __init__(self, path: str | None = None, *, url: str | None = None, model: str | None = None,
                 api_key: str | None = None, timeout: float = 120.0, retries: int = 2, concurrency: int = 8,
                 mode: str = "score", image_size: int | None = 512, normalize: bool = True, max_tokens: int = 512,
                 both_orders: bool = False, no_verdict: str = "tie", device: str | None = None,
                 dtype: str = "bfloat16", batch_size: int = 8):
        if mode not in MODES:
            raise UserError(f"unified_reward reward: mode={mode!r} is not one of {list(MODES)}")
        if image_size is not None and (isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 28):
            raise UserError(f"unified_reward reward: image_size={image_size!r} must be an integer >= 28 or null")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise UserError(f"unified_reward reward: max_tokens={max_tokens!r} must be a positive integer")
        if no_verdict not in ("tie", "unread"):
            raise UserError(f"unified_reward reward: no_verdict={no_verdict!r} must be 'tie' (Pref-GRPO's: half a win "
                            "each) or 'unread' (the comparison is not counted)")
        if (path is None) == (url is None):
            raise UserError("unified_reward reward: give either path: (the local folder of " + DOWNLOAD + ") or url:"
                            " (an OpenAI-compatible server serving it), not both")
        self.mode, self.image_size, self.normalize = mode, image_size, normalize
        #: think_pairwise scores are win rates among the samples sharing a prompt (Pref-GRPO's reward)
        self.pairwise = mode == "think_pairwise"
        self.max_tokens, self.both_orders = max_tokens, both_orders
        #: a reply that names no winner: "tie" counts it half a win to each image (Pref-GRPO's
        #: unifiedreward_think.py), "unread" leaves the comparison out; a failed request is always unread
        self.no_verdict = no_verdict
        self.device = torch.device(device) if device is not None else None
        if url is not None:
            from rewards.vlm_http import OpenAIChatClient

            self.backend: Any = OpenAIChatClient(url, model, api_key=api_key, timeout=timeout, retries=retries,
                                                 concurrency=concurrency)
            self.local = False
        else:
            from rewards.vlm_backend import LocalVLM

            folder = local_path(path, self.name, "path", DOWNLOAD)
            if not (folder / "config.json").is_file():
                raise UserError(f"unified_reward reward: path={str(path)!r} is not a model folder (no config.json);"
                                f" download {DOWNLOAD}")
            self.backend = LocalVLM(folder, device=self.device or "cpu", dtype=dtype, batch_size=batch_size)
            self.local = True

    @classmethod
    def planned_bytes(cls, options: dict[str, Any]) -> int:
        """Bytes of the local model in ``dtype``, from its folder's config on the meta device; 0 behind ``url``
        (the server holds it) or with ``device: cpu``. A ``path`` that does not exist is sized as
        UnifiedReward-qwen-7b (Qwen2.5-VL-7B-Instruct, ``assets/reward_architectures/``) where its name says 7b,
        the size of the released 7B models; other sizes are not guessed."""
        from rewards.vlm_backend import LocalVLM

        if options.get("url") is not None or not on_accelerator(option(cls, options, "device")):
            return 0
        path = options.get("path")
        folder = existing(path)
        if folder is None:
            if path is None or not re.search(r"(?<![0-9])7b", Path(str(path)).name, re.I):
                raise missing("path", path)
            folder = published(ARCHITECTURE_7B)
        return LocalVLM.planned_bytes(folder, option(cls, options, "dtype"))

    def _pil(self, image: torch.Tensor) -> Any:
        from rewards.common import to_pil

        pil = to_pil(image)
        return pil.resize((self.image_size, self.image_size)) if self.image_size else pil

    def _ask(self, images: list[Any], text: str) -> ChatRequest:
        parts = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
        return ChatRequest([{"role": "user", "content": parts}], max_tokens=self.max_tokens, temperature=0.0)

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples`` ``(B, 3, H, W)`` in [0, 1] → ``{"unified_reward": (B,)}`` + ``valid``; replies in ``info``."""
        check_images(samples, self.name)
        check_lengths(samples.shape[0], prompts, metadata, self.name)
        if self.local:
            device = self.device or samples.device
            if self.backend.device != device:
                self.backend.model.to(device)
                self.backend.device = device
        n = samples.shape[0]
        valid_in = finite_mask(samples)
        todo = [i for i in range(n) if valid_in[i]]
        images = {i: self._pil(samples[i]) for i in todo}
        scores = torch.full((n,), float("nan"))
        info: list[dict[str, Any]] = [{"mode": self.mode} for _ in range(n)]
        for i in range(n):
            if not valid_in[i]:
                info[i]["reason"] = "sample has NaN/inf values"
        if self.mode == "score":
            replies = self.backend.complete([self._ask([images[i]], SCORE_QUESTION.format(prompt=prompts[i]))
                                             for i in todo])
            for i, c in zip(todo, replies):
                x = parse_final_score(c.text) if c.error is None else None
                info[i]["reply"] = (c.text or "")[-300:]
                if x is None:
                    info[i]["reason"] = c.error or "no 'Final Score: x' in the reply"
                else:
                    scores[i] = x / 5.0 if self.normalize else x
        else:
            self._pairwise(todo, images, prompts, scores, info)
        valid = torch.isfinite(scores)
        if not valid.all():
            log.warning("%s: %d/%d samples invalid (first: %s)", self.name, int((~valid).sum()), n,
                        next(str(x.get("reason")) for x, ok in zip(info, valid.tolist()) if not ok)[:120])
        return RewardOutput({self.name: scores.to(samples.device)}, valid=valid.to(samples.device), info=info)

    def _pairwise(self, todo: list[int], images: dict[int, Any], prompts: list[str], scores: torch.Tensor,
                  info: list[dict[str, Any]]) -> None:
        groups: dict[str, list[int]] = {}
        for i in todo:
            groups.setdefault(prompts[i], []).append(i)
        pairs = [(g[x], g[y]) for g in groups.values() for x in range(len(g)) for y in range(x + 1, len(g))]
        if self.both_orders:
            pairs += [(b, a) for a, b in pairs]
        replies = self.backend.complete([self._ask([images[a], images[b]], THINK_QUESTION.format(prompt=prompts[a]))
                                         for a, b in pairs])
        tie = 0 if self.no_verdict == "tie" else None
        verdicts = [(a, b, None if c.error is not None else (parse_verdict(c.text) or tie))
                    for (a, b), c in zip(pairs, replies)]
        rates, read = win_rates(len(scores), verdicts)
        for i in todo:
            info[i]["comparisons"] = read[i]
            if len(groups[prompts[i]]) < 2:
                info[i]["reason"] = "think_pairwise needs at least 2 samples per prompt"
            elif rates[i] is None:
                info[i]["reason"] = "no comparison of this sample gave a verdict"
            else:
                scores[i] = rates[i]


# what the tiny model answers, whatever it is shown: a verdict and a score, every token distinct
TINY_REPLY = "Image 2 is better. Final Score:4"


def save_tiny_unified_reward(out: Path, *, overwrite: bool = False) -> Path:
    """A UnifiedReward folder: a tiny Qwen2.5-VL (the architecture of UnifiedReward-qwen and
    UnifiedReward-Think-qwen) with its processor and chat template, whose weights make greedy decoding write
    :data:`TINY_REPLY` after the generation prompt, so both modes read a real generated reply offline.

    How: the attention and MLP outputs are zeroed, so the last hidden state is the (normalised) embedding of
    the current token, and ``lm_head`` maps each token of the reply to the next (a bigram table).

    Written atomically (:func:`flowalign.io.atomic_dir`, writer ``save-tiny-unified-reward``): a failure leaves
    ``out`` as it was, and a folder holding files it did not write is refused unless ``overwrite``.
    """
    from flowalign.io import atomic_dir
    from rewards.vlm_tiny import build_tiny_vlm

    model, processor = build_tiny_vlm(None, family="qwen2_5_vl")
    tok = processor.tokenizer
    chain = [tok.convert_tokens_to_ids("Ċ")] + tok.encode(TINY_REPLY, add_special_tokens=False) + [tok.eos_token_id]
    text = model.model.language_model
    with torch.no_grad():
        for layer in text.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        states = text.norm(text.embed_tokens.weight[chain[:-1]])
        model.lm_head.weight.zero_()
        for state, nxt in zip(states, chain[1:]):
            model.lm_head.weight[nxt] = 50 * state / state.norm()
    out = Path(out)
    with atomic_dir(out, writer="save-tiny-unified-reward", overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
    return out
