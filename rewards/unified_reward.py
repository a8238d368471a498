"""``unified_reward``: UnifiedReward, a Qwen-VL fine-tuned to judge generated images
(docs/methods/vlm_reward_models.md).

Two modes, on a local model folder (``path``) or an OpenAI-compatible server (``url``: vLLM, SGLang,
``flowalign serve-judge``), through the same backends as the VLM judges (:mod:`rewards.vlm_backend`):

* ``score`` (pointwise, as Flow-GRPO trains on it): the image, resized to ``image_size``² (512, PIL's bicubic,
  on the 8-bit image) and sent losslessly, and Flow-GRPO's question; the reply's ``Final Score: x`` (x in 1..5)
  gives ``x / 5`` (``normalize: false``: ``x``).
* ``dimension`` (UnifiedReward's per-dimension scores, as Pref-GRPO's ``unifiedreward_*`` rewards read them): the
  image, as it is through JPEG 95, and UnifiedReward's image template; the reply's ``Alignment``, ``Coherence`` and
  ``Style Score (1-5)``; the reward is the ``dimension`` asked for, on 1-5 (two dimensions: two labelled entries,
  which ask their judge once per image, as Pref-GRPO does, and read one reply each).
* ``think_pairwise`` (UnifiedReward-Think, as Pref-GRPO trains on it): the images sharing a prompt are compared
  two by two with the Think prompt (``think_prompt``), each image as it is, through JPEG at quality 95 as
  Pref-GRPO's client sends it; the ``<answer>`` says "Image 1 is better" or "Image 2 is better". A sample's
  score is its win rate over its comparisons rounded to 3 decimals (Pref-GRPO's ``_pairwise_win_rate``), in
  [0, 1].

* ``flex_pairwise`` (UnifiedReward-Flex, as Pref-GRPO's Flex recipes train on it): the same pairs, shown with
  UnifiedReward-Flex's template; the reply's overall and per-category winners give each sample a blend of its
  overall and category win rates (:mod:`rewards.unified_reward_flex`), in [0, 1].

* ``edit_pairwise`` (UnifiedReward-Edit, as Pref-GRPO's editing recipes train on it): the edited images sharing
  an instruction and a source image (``metadata["image"]``) compared two by two, each request showing the source,
  then the two edits, with UnifiedReward-Edit's pairwise template (:mod:`rewards.unified_reward_edit`); each
  sample's win rate in its group, rounded to 3 decimals, in [0, 1].

* ``edit_quality`` and ``edit_instruction`` (UnifiedReward-Edit's pointwise judgements, Pref-GRPO's pointwise editing
  recipe): one request per edit, the edit alone with the image-quality template (naturalness, artifacts) or the
  source then the edit with the instruction-following template (success, over-editing); the reply's two scores
  (0-25) blended with ``part_weights``. Each part also travels with the score (``RewardScores.parts``): Pref-GRPO's
  advantage is the blend of the two parts' group advantages.

Both think_pairwise and flex_pairwise judge videos ``(B, F, 3, H, W)`` too, as Pref-GRPO's Wan scripts do: each video is shown as
``frames`` evenly spaced frames (8), a pair's request holding the first video's frames then the second's, with
the video templates; the verdicts name "Video k" (:mod:`rewards.unified_reward_video`).

A reply without a score makes its sample invalid, never 0 (Flow-GRPO scores it 0); a pairwise reply without a
verdict counts as a tie (half a win to each image, as Pref-GRPO's ``unifiedreward_think.py`` does;
``no_verdict: unread`` leaves it out), a failed request is left out (Pref-GRPO's loop stops on it), and a
sample none of whose comparisons came back, or alone with its prompt (Pref-GRPO: 0), is invalid.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path
from typing import Any, ClassVar

import torch

from flowalign.errors import UserError
from flowalign.protocols import RewardOutput
from rewards.common import check_images, check_jpeg_quality, check_lengths, finite_mask, jpeg_round_trip, to_pil
from rewards.model_options import one_of
from rewards.planning import existing, missing, on_accelerator, option, published
from rewards.qwen_vl_reward import local_path
from rewards.registry import register
from rewards.unified_reward_flex import FLEX_BLENDS, FLEX_QUESTION, flex_win_rates, parse_flex
from rewards.unified_reward_edit import (
    EDIT_PAIRWISE_QUESTION,
    EDIT_QUALITY_QUESTION,
    edit_instruction_question,
    parse_edit_scores,
    parse_edit_verdict,
)
from rewards.unified_reward_video import FLEX_VIDEO_QUESTION, THINK_VIDEO_QUESTION, frame_indices
from rewards.vlm_backend import ChatRequest
from rewards.vlm_parse import answer_region

log = logging.getLogger("flowalign.rewards.unified_reward")

MODES = ("score", "dimension", "think_pairwise", "flex_pairwise", "edit_pairwise", "edit_quality", "edit_instruction")
#: mode: dimension's dimensions, by the name the reply gives each
DIMENSIONS = {"alignment": "Alignment", "coherence": "Coherence", "style": "Style"}
#: each judge's last mode: dimension replies, by request: labelled entries reading two dimensions of the same
#: (greedy) reply ask once per image, as Pref-GRPO's one request per image; only the latest batch is kept
_DIMENSION_REPLIES: dict[str, dict[str, Any]] = {}
#: the info keys of a pointwise edit judgement's parts (RewardScores.parts): the two scores, "both" (always 1: the
#: blend applies to every sample) and the two weights
EDIT_PARTS = {"edit_quality": ("naturalness", "artifacts", "both", "naturalness_weight", "artifacts_weight"),
              "edit_instruction": ("success", "overedit", "both", "success_weight", "overedit_weight")}
#: the flex parts: overall and category win rates, whether the sample has categories, their weights
FLEX_PARTS = ("overall", "dim_mean", "has_dims", "overall_weight", "dim_weight")
#: what UnifiedReward-qwen-7b and UnifiedReward-Think-qwen-7b are, as published (assets/reward_architectures/)
ARCHITECTURE_7B = "qwen2.5-vl-7b-instruct"
DOWNLOAD = ("a UnifiedReward model (e.g. CodeGoat24/UnifiedReward-qwen-7b, or for think_pairwise"
            " CodeGoat24/UnifiedReward-Think-qwen3vl-8b, or -Think-qwen-7b with think_prompt: qwen2_5vl, or for"
            " flex_pairwise CodeGoat24/UnifiedReward-Flex-qwen3vl-8b, or for edit_pairwise"
            " CodeGoat24/UnifiedReward-Edit-qwen3vl-8b)")

# Flow-GRPO's pointwise question, verbatim (flow_grpo/rewards.py, unifiedreward_score_sglang)
SCORE_QUESTION = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate"
    " this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with"
    " the provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as"
    " described in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including"
    " clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria,"
    " assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)
# UnifiedReward's per-dimension image question, verbatim (Pref-GRPO 3e787f6 fastvideo/rewards/templates.py
# get_unifiedreward_image_template): mode: dimension
DIMENSION_QUESTION = (
    'You are presented with a generated image and its associated text caption. Your task is to analyze the image across multiple dimensions in relation to the caption. Specifically:\n'
    'Provide overall assessments for the image along the following axes (each rated from 1 to 5):\n'
    '- Alignment Score: How well the image matches the caption in terms of content.\n'
    '- Coherence Score: How logically consistent the image is (absence of visual glitches, object distortions, etc.).\n'
    '- Style Score: How aesthetically appealing the image looks, regardless of caption accuracy.\n'
    '\n'
    'Output your evaluation using the format below:\n'
    '\n'
    'Alignment Score (1-5): X\n'
    'Coherence Score (1-5): Y\n'
    'Style Score (1-5): Z\n'
    '\n'
    'Your task is provided as follows:\n'
    'Text Caption: [{prompt}]'
)
# UnifiedReward-Think-qwen-7b's image-generation pairwise question, verbatim (UnifiedReward's
# qwen_infer_cot_image_generation.py; Pref-GRPO's template up to its commit c541ed1): think_prompt: qwen2_5vl
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
# UnifiedReward-Think-qwen3vl-8b's image-generation pairwise question, verbatim, indentation and all (Pref-GRPO
# 3e787f6 fastvideo/rewards/templates.py get_unifiedreward_think_image_template; UnifiedReward's
# qwen3_infer_cot_image_generation.py): think_prompt: qwen3vl, the default
THINK_QUESTION_QWEN3VL = (
    "You are an objective and precise evaluator for image quality comparison. I will provide you"
    " with a text caption and two images generated based on this caption. You must analyze the two"
    " images carefully and determine which image is better.\n"
    "\n"
    "        Evaluation procedure:\n"
    "\n"
    "        1. The caption for the generated images is: 「{prompt}」. You must evaluate the two"
    " images across these core dimensions:\n"
    "        - Semantic consistency (how closely the image content aligns with the caption)\n"
    "        - Aesthetics (composition, color usage, artistic expression)\n"
    "        - Authenticity (realism and attention to detail)\n"
    "\n"
    "        2. You are also encouraged to add up to two additional evaluation dimensions if they"
    " are relevant to the specific caption or images (e.g., creativity, spatial layout, fine-grained"
    " detail). If no extra dimensions are relevant, just keep the three core dimensions.\n"
    "\n"
    "        3. For each evaluation dimension:\n"
    "        - Provide a score between 1–10 for both Image 1 and Image 2\n"
    "        - Provide a short rationale for each score (2–5 short sentences)\n"
    "        - The evaluation must follow exactly this format with line breaks and indentation:\n"
    "            Dimension name: \n"
    "                Image 1 (x/10) - rationale; \n"
    "                Image 2 (y/10) - rationale\n"
    "\n"
    "        4. After evaluating all dimensions, calculate the total score for each image and show"
    " the calculation explicitly, following this exact format:\n"
    "            Total score:\n"
    "            Image 1: x+x+x=total\n"
    "            Image 2: y+y+y=total\n"
    "\n"
    "        5. Wrap all reasoning and scoring strictly within <think> and </think> tags.\n"
    "\n"
    "        6. After </think>, output the final judgment strictly inside <answer> and </answer>"
    " tags, containing only one of:\n"
    "        - Image 1 is better\n"
    "        - Image 2 is better\n"
    "\n"
    "        Constraints:\n"
    "        - You must strictly follow the line breaks, indentation, and formatting shown in the"
    " example below.\n"
    "        - Do not merge multiple dimensions into one line. Each dimension must follow the 3-line"
    " block format shown below.\n"
    "        - Do not use Markdown formatting, bullet points, bold text, or headings.\n"
    "        - Do not output explanations outside <think> and <answer>.\n"
    "        - The <answer> tag must contain only the final string with no extra words.\n"
    "\n"
    "        Required output format:\n"
    "\n"
    "        <think>\n"
    "        1. Semantic consistency: \n"
    "            Image 1 (9/10) - ...; \n"
    "            Image 2 (7/10) - ...\n"
    "        2. Aesthetics: \n"
    "            Image 1 (8/10) - ...; \n"
    "            Image 2 (8/10) - ...\n"
    "        3. Authenticity: \n"
    "            Image 1 (8/10) - ...; \n"
    "            Image 2 (5/10) - ...\n"
    "        [Additional dimension if any]: \n"
    "            Image 1 (7/10) - ...; \n"
    "            Image 2 (8/10) - ...\n"
    "        [Additional dimension if any]: \n"
    "            Image 1 (6/10) - ...; \n"
    "            Image 2 (7/10) - ...\n"
    "        Total score:\n"
    "        Image 1: 9+8+8+7+6=38\n"
    "        Image 2: 7+8+5+8+7=35\n"
    "        </think>\n"
    "        <answer>Image 1 is better</answer>\n"
    "\n"
    "        Note: The example above is only to illustrate the exact format (line breaks,"
    " indentation, symbols, and style). Your actual evaluation must follow this format exactly, but"
    " be based on the given caption and images.\n"
    "        "
)
#: think_prompt → the question (its caption goes in ``{prompt}``)
THINK_PROMPTS = {"qwen3vl": THINK_QUESTION_QWEN3VL, "qwen2_5vl": THINK_QUESTION}
THINK_PROMPT_MEANINGS = {
    "qwen3vl": "UnifiedReward-Think-qwen3vl-8b's, as Pref-GRPO 3e787f6 sends it",
    "qwen2_5vl": "UnifiedReward-Think-qwen-7b's, the former default",
}
VERDICT_PARSE_MEANINGS = {
    "answer": "Pref-GRPO's: the first closed <answer> block holds 'Image 1 is better', else 'Image 2 is better',"
              " exactly as written",
    "lenient": "the former form: 'Image k is better' in any case and spacing, in the <answer> block or, without"
               " one, anywhere outside <think>",
}
#: the defaults that follow ``mode``: Flow-GRPO's for score, Pref-GRPO's (3e787f6) for think_pairwise
MODE_DEFAULTS = {
    "score": {"image_size": 512, "jpeg_quality": None, "max_tokens": 512},
    "think_pairwise": {"image_size": None, "jpeg_quality": 95, "max_tokens": 4096},
    "flex_pairwise": {"image_size": None, "jpeg_quality": 95, "max_tokens": 4096},
    "edit_pairwise": {"image_size": None, "jpeg_quality": 95, "max_tokens": 4096},
    "dimension": {"image_size": None, "jpeg_quality": 95, "max_tokens": 4096},
    "edit_quality": {"image_size": None, "jpeg_quality": 95, "max_tokens": 4096},
    "edit_instruction": {"image_size": None, "jpeg_quality": 95, "max_tokens": 4096},
}
_FINAL_SCORE = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")  # Flow-GRPO's pattern
_DIMENSION_SCORE = re.compile(r"(\w+) Score \(1-5\):\s*([0-5](?:\.\d+)?)")  # Pref-GRPO's extract_normalized_rewards
_VERDICT = {noun: re.compile(noun + r"\s*([12])\s*is\s*better", re.I) for noun in ("Image", "Video")}
_CLOSED_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def parse_final_score(text: str | None) -> float | None:
    """The ``x`` of the first ``Final Score: x`` (1..5) in a reply, or None (Flow-GRPO scores that 0)."""
    m = _FINAL_SCORE.search(text or "")
    return float(m.group(1)) if m else None


def parse_dimension_scores(text: str | None) -> dict[str, float]:
    """Each ``<Name> Score (1-5): x`` of a reply, by name (the last where one repeats), as Pref-GRPO's
    ``extract_normalized_rewards`` reads them."""
    return {key: float(value) for key, value in _DIMENSION_SCORE.findall(text or "")}


def parse_verdict(text: str | None, form: str = "answer", noun: str = "Image") -> int | None:
    """1 or 2, the image (``noun="Video"``: the video) the reply prefers, or None.

    ``form="answer"`` (Pref-GRPO's reading): the first ``<answer>…</answer>`` block (closed, tags as written),
    stripped, holds the exact phrase "Image 1 is better" (looked for first) or "Image 2 is better"; a reply
    without such a block names no winner. ``form="lenient"`` (the former form): the first "Image k is better"
    in any case and spacing in the ``<answer>`` block, or in the whole reply without ``<think>`` when it has no
    answer block."""
    if form == "lenient":
        m = _VERDICT[noun].search(answer_region(text or ""))
        return int(m.group(1)) if m else None
    block = _CLOSED_ANSWER.search(text or "")
    if block is None:
        return None
    answer = block.group(1).strip()
    return 1 if f"{noun} 1 is better" in answer else 2 if f"{noun} 2 is better" in answer else None


def win_rates(n: int, verdicts: list[tuple[int, int, int | None]],
              decimals: int | None = None) -> tuple[list[float | None], list[int]]:
    """Each sample's share of won comparisons among those read: ``verdicts`` are ``(a, b, winner)`` with
    ``winner`` 1 (a) / 2 (b) / 0 (a tie: half a win each) / None (unread). ``decimals``: each share rounded as
    Python's ``round`` (Pref-GRPO: 3); None keeps it exact. Returns ``(rates, comparisons read)``; None where
    none was read."""
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
    return [None if not r else w / r if decimals is None else round(w / r, decimals)
            for w, r in zip(wins, read)], read


def record_win_rates(members: list[int], rates: list[float | None], read: list[int], scores: torch.Tensor,
                     info: list[dict[str, Any]], lone: str, unread: str) -> None:
    """Each member of one group gets its win rate as its score (and its count of comparisons read in ``info``), or
    the reason it has none: ``lone`` when the group has one member, ``unread`` when none of its comparisons was."""
    for i in members:
        info[i]["comparisons"] = read[i]
        if len(members) < 2:
            info[i]["reason"] = lone
        elif rates[i] is None:
            info[i]["reason"] = unread
        else:
            scores[i] = rates[i]


@register("unified_reward")
class UnifiedReward:
    """UnifiedReward in one of its modes (``score``, ``dimension``, ``think_pairwise``, ``flex_pairwise``,
    ``edit_pairwise``, ``edit_quality``, ``edit_instruction``; see the module docstring).

    Options: ``path`` (a local UnifiedReward folder, run in this process) or ``url`` (an OpenAI-compatible
    server) with ``model``, ``api_key``, ``timeout``, ``retries``, ``concurrency``; ``mode``; ``image_size``
    (images are resized to a square of this side, PIL's bicubic on the 8-bit image; null keeps them; ``auto``:
    512 in score mode as Flow-GRPO, kept in think_pairwise as Pref-GRPO), ``jpeg_quality`` (the images go
    through JPEG at this quality first, as a client sending JPEG does; null sends the pixels losslessly;
    ``auto``: null in score mode, Flow-GRPO's PNG, 95 in think_pairwise, Pref-GRPO's), ``normalize``,
    ``max_tokens`` (reply length; ``auto``: 512 in score mode, 4096 in think_pairwise as Pref-GRPO);
    think_pairwise: ``think_prompt`` (``qwen3vl``, Pref-GRPO's, or ``qwen2_5vl``, the former), ``verdict_parse``
    (``answer``, Pref-GRPO's, or ``lenient``, the former), ``win_rate_decimals`` (3, Pref-GRPO's rounding; null
    keeps rates exact, the former form), ``both_orders`` (judge each pair in both orders), ``no_verdict``
    (``tie``, half a win each as Pref-GRPO counts it, or ``unread``); flex_pairwise: ``overall_weight``,
    ``dim_weight`` and ``category_weights`` (Pref-GRPO's ``OVERALL_WEIGHT``, ``DIM_WEIGHT``, ``CATEGORY_WEIGHTS``:
    1, 1 and none by default, 0.3, 0.7 and 1, 0.7, 0.7 in their Flex recipes), ``flex_blend`` (``code``, their
    code's blend, or ``as_set``; :mod:`rewards.unified_reward_flex`); ``device`` (None: the samples'),
    ``dtype`` (bf16), ``batch_size`` (requests per forward); dimension: ``dimension`` (alignment, coherence or
    style); edit_quality / edit_instruction: ``part_weights`` (the two scores' weights, [1, 1]); videos
    (think_pairwise, flex_pairwise): ``frames`` (8, Pref-GRPO's ``num_frames``), the frames each video is shown by.
    """

    name = "unified_reward"
    differentiable = False
    #: what runs saved without these options computed in think_pairwise (UnifiedReward-Think-qwen-7b's prompt,
    #: any "Image k is better", exact win rates, 512² lossless images, 512 tokens); score mode computed what
    #: the defaults compute now (rewards.registry.former_forms)
    before: ClassVar[dict[str, Any]] = {"think_prompt": "qwen2_5vl", "verdict_parse": "lenient",
                                        "win_rate_decimals": None, "image_size": 512, "jpeg_quality": None,
                                        "max_tokens": 512}
    before_when: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {k: ("mode", ("think_pairwise",))
                                                                     for k in before}

    def __init__(self, path: str | None = None, *, url: str | None = None, model: str | None = None,
                 api_key: str | None = None, timeout: float = 120.0, retries: int = 2, concurrency: int = 8,
                 mode: str = "score", image_size: int | str | None = "auto", jpeg_quality: int | str | None = "auto",
                 normalize: bool = True, max_tokens: int | str = "auto", think_prompt: str = "qwen3vl",
                 verdict_parse: str = "answer", win_rate_decimals: int | None = 3, both_orders: bool = False,
                 no_verdict: str = "tie", overall_weight: float = 1.0, dim_weight: float = 1.0,
                 category_weights: list[float] | None = None, flex_blend: str = "code",
                 part_weights: list[float] | None = None, dimension: str | None = None, frames: int = 8,
                 device: str | None = None, dtype: str = "bfloat16", batch_size: int = 8):
        label = "unified_reward reward"
        if mode not in MODES:
            raise UserError(f"unified_reward reward: mode={mode!r} is not one of {list(MODES)}")
        defaults = MODE_DEFAULTS[mode]
        image_size = defaults["image_size"] if image_size == "auto" else image_size
        jpeg_quality = defaults["jpeg_quality"] if jpeg_quality == "auto" else jpeg_quality
        max_tokens = defaults["max_tokens"] if max_tokens == "auto" else max_tokens
        if image_size is not None and (isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 28):
            raise UserError(f"unified_reward reward: image_size={image_size!r} must be an integer >= 28, null or auto")
        check_jpeg_quality(jpeg_quality, "unified_reward", " or auto")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise UserError(f"unified_reward reward: max_tokens={max_tokens!r} must be a positive integer or auto")
        if win_rate_decimals is not None and (isinstance(win_rate_decimals, bool)
                                              or not isinstance(win_rate_decimals, int)
                                              or not 0 <= win_rate_decimals <= 15):
            raise UserError(f"unified_reward reward: win_rate_decimals={win_rate_decimals!r} must be an integer from 0"
                            " to 15 (Pref-GRPO's: 3) or null (exact)")
        one_of(label, "think_prompt", think_prompt, THINK_PROMPTS, THINK_PROMPT_MEANINGS)
        one_of(label, "verdict_parse", verdict_parse, VERDICT_PARSE_MEANINGS, VERDICT_PARSE_MEANINGS)
        if no_verdict not in ("tie", "unread"):
            raise UserError(f"unified_reward reward: no_verdict={no_verdict!r} must be 'tie' (Pref-GRPO's: half a win "
                            "each) or 'unread' (the comparison is not counted)")
        for option, value in (("overall_weight", overall_weight), ("dim_weight", dim_weight),
                              *((f"category_weights[{k}]", w) for k, w in enumerate(category_weights or []))):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1e6:
                raise UserError(f"unified_reward reward: {option}={value!r} must be a number from 0 to 1e6")
        one_of(label, "flex_blend", flex_blend, FLEX_BLENDS, FLEX_BLENDS)
        if isinstance(frames, bool) or not isinstance(frames, int) or not 1 <= frames <= 256:
            raise UserError(f"unified_reward reward: frames={frames!r} must be an integer from 1 to 256 (the frames a "
                            "video is shown by; Pref-GRPO's: 8)")
        self.frames = frames
        if mode != "flex_pairwise" and (overall_weight != 1.0 or dim_weight != 1.0 or category_weights
                                        or flex_blend != "code"):
            raise UserError("unified_reward reward: overall_weight, dim_weight, category_weights and flex_blend are read"
                            f" only with mode: flex_pairwise (this entry has mode: {mode}): drop them or set mode:"
                            " flex_pairwise")
        if part_weights is not None and not mode.startswith("edit_") or mode == "edit_pairwise" and part_weights:
            raise UserError("unified_reward reward: part_weights is read only with mode: edit_quality or "
                            f"edit_instruction (this entry has mode: {mode}): drop it or set one of those modes")
        part_weights = [1.0, 1.0] if part_weights is None else part_weights
        if (not isinstance(part_weights, (list, tuple)) or len(part_weights) != 2
                or any(isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 1e6 for w in part_weights)):
            raise UserError(f"unified_reward reward: part_weights={part_weights!r} must be two numbers from 0 to 1e6 "
                            "(the two scores' weights; Pref-GRPO's pointwise edit recipe: [0.6, 0.4])")
        self.part_weights = (float(part_weights[0]), float(part_weights[1]))
        if (mode == "dimension") != (dimension is not None):
            raise UserError("unified_reward reward: mode: dimension reads one dimension of the reply: give dimension: "
                            f"{' / '.join(DIMENSIONS)} with it, and only with it (this entry has mode: {mode}, "
                            f"dimension: {dimension})")
        if dimension is not None:
            one_of("unified_reward reward", "dimension", dimension, DIMENSIONS)
        self.dimension = dimension
        if overall_weight + dim_weight <= 0:
            raise UserError("unified_reward reward: overall_weight + dim_weight must be positive (Pref-GRPO's Flex "
                            "recipes: 0.3 and 0.7)")
        if (path is None) == (url is None):
            raise UserError("unified_reward reward: give either path: (the local folder of " + DOWNLOAD + ") or url:"
                            " (an OpenAI-compatible server serving it), not both")
        self.mode, self.image_size, self.jpeg_quality, self.normalize = mode, image_size, jpeg_quality, normalize
        #: think_pairwise scores are win rates among the samples sharing a prompt (Pref-GRPO's reward)
        self.pairwise = mode in ("think_pairwise", "flex_pairwise", "edit_pairwise")
        #: flex_pairwise (each sample's overall and category win rates) and the pointwise edit judgements (each
        #: sample's two scores): the info keys of the parts that go with its score (RewardScores.parts)
        self.blend_parts: tuple[str, ...] = FLEX_PARTS if mode == "flex_pairwise" else EDIT_PARTS.get(mode, ())
        self.overall_weight, self.dim_weight = float(overall_weight), float(dim_weight)
        self.category_weights = [float(w) for w in category_weights or []]
        self.flex_blend = flex_blend
        self.max_tokens, self.both_orders = max_tokens, both_orders
        self.think_question = THINK_PROMPTS[think_prompt]
        self.verdict_parse, self.win_rate_decimals = verdict_parse, win_rate_decimals
        #: a reply that names no winner: "tie" counts it half a win to each image (Pref-GRPO's
        #: unifiedreward_think.py), "unread" leaves the comparison out; a failed request is always unread
        self.no_verdict = no_verdict
        self.device = torch.device(device) if device is not None else None
        if url is not None:
            from rewards.vlm_http import OpenAIChatClient

            self.backend: Any = OpenAIChatClient(url, model, api_key=api_key, timeout=timeout, retries=retries,
                                                 concurrency=concurrency)
            self.local = False
            self.judge = f"{url}\x00{model}"
        else:
            from rewards.vlm_backend import LocalVLM

            folder = local_path(path, self.name, "path", DOWNLOAD)
            if not (folder / "config.json").is_file():
                raise UserError(f"unified_reward reward: path={str(path)!r} is not a model folder (no config.json);"
                                f" download {DOWNLOAD}")
            self.backend = LocalVLM.shared(folder, device=self.device or "cpu", dtype=dtype, batch_size=batch_size)
            self.local = True
            self.judge = f"{folder.resolve()}\x00{dtype}"

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
        """The image the judge is shown: 8-bit, resized to ``image_size``² (PIL's default filter, bicubic, as
        Flow-GRPO's ``Image.resize((512, 512))``), then through JPEG at ``jpeg_quality`` (Pref-GRPO's client
        encodes its PNG rollouts so; the decoded pixels are what a server reads) where set."""
        pil = to_pil(image)
        if self.image_size:
            pil = pil.resize((self.image_size, self.image_size))
        if self.jpeg_quality is not None:
            pil = jpeg_round_trip(pil, self.jpeg_quality)
        return pil

    def _ask(self, images: list[Any], text: str) -> ChatRequest:
        parts = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
        return ChatRequest([{"role": "user", "content": parts}], max_tokens=self.max_tokens, temperature=0.0)

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples`` ``(B, 3, H, W)`` (or videos ``(B, F, 3, H, W)`` in the pairwise modes) in [0, 1] →
        ``{"unified_reward": (B,)}`` + ``valid``; replies in ``info``."""
        video = isinstance(samples, torch.Tensor) and samples.ndim == 5
        if video:
            if self.mode.startswith("edit_"):
                raise UserError(f"unified_reward reward: mode: {self.mode} judges edited images, not videos")
            if not self.pairwise:
                raise UserError("unified_reward reward: mode: score judges images; videos are judged in pairs (mode: "
                                "think_pairwise or flex_pairwise, as Pref-GRPO's Wan scripts)")
            if samples.shape[2] != 3:
                raise UserError(f"unified_reward reward: videos must have shape (B, F, 3, H, W); got {tuple(samples.shape)}")
            check_images(samples.flatten(0, 1), self.name)
        else:
            check_images(samples, self.name)
        check_lengths(samples.shape[0], prompts, metadata, self.name)
        if self.mode in ("edit_pairwise", "edit_instruction") and (len(metadata) != samples.shape[0]
                                                                  or any(m.get("image") is None for m in metadata)):
            raise UserError(f"unified_reward reward: mode: {self.mode} shows the judge each sample's source image: "
                            "give every prompt its metadata 'image' (an editing data set, or data.bench: vvr_edit)")
        if self.local:
            device = self.device or samples.device
            if self.backend.device != device:
                self.backend.model.to(device)
                self.backend.device = device
        n = samples.shape[0]
        valid_in = finite_mask(samples)
        todo = [i for i in range(n) if valid_in[i]]
        if video:  # each video as its evenly spaced frames
            shown = frame_indices(samples.shape[1], self.frames)
            images = {i: [self._pil(samples[i, f]) for f in shown] for i in todo}
        else:
            images = {i: [self._pil(samples[i])] for i in todo}
        scores = torch.full((n,), float("nan"))
        info: list[dict[str, Any]] = [{"mode": self.mode} for _ in range(n)]
        for i in range(n):
            if not valid_in[i]:
                info[i]["reason"] = "sample has NaN/inf values"
        if self.mode == "dimension":
            replies = self._asked_once([self._ask(images[i], DIMENSION_QUESTION.format(prompt=prompts[i]))
                                        for i in todo])
            name = DIMENSIONS[self.dimension]  # type: ignore[index]
            for i, c in zip(todo, replies):
                found = parse_dimension_scores(c.text) if c.error is None else {}
                info[i].update(reply=(c.text or "")[-300:], dimensions=found)
                if name in found:
                    scores[i] = found[name]
                else:
                    info[i]["reason"] = c.error or f"no '{name} Score (1-5): x' in the reply"
        elif self.mode == "score":
            replies = self.backend.complete([self._ask(images[i], SCORE_QUESTION.format(prompt=prompts[i]))
                                             for i in todo])
            for i, c in zip(todo, replies):
                x = parse_final_score(c.text) if c.error is None else None
                info[i]["reply"] = (c.text or "")[-300:]
                if x is None:
                    info[i]["reason"] = c.error or "no 'Final Score: x' in the reply"
                else:
                    scores[i] = x / 5.0 if self.normalize else x
        elif self.mode == "edit_pairwise":
            self._edit_pairwise(todo, images, prompts, metadata, scores, info)
        elif self.mode in EDIT_PARTS:
            self._edit_pointwise(todo, images, prompts, metadata, scores, info)
        else:
            self._pairwise(todo, images, prompts, scores, info, "Video" if video else "Image")
        valid = torch.isfinite(scores)
        if not valid.all():
            log.warning("%s: %d/%d samples invalid (first: %s)", self.name, int((~valid).sum()), n,
                        next(str(x.get("reason")) for x, ok in zip(info, valid.tolist()) if not ok)[:120])
        return RewardOutput({self.name: scores.to(samples.device)}, valid=valid.to(samples.device), info=info)

    def _asked_once(self, requests: list[ChatRequest]) -> list[Any]:
        """The judge's replies to ``requests``, a request this judge was just asked (by another entry's dimension)
        answered from its reply; failed replies are asked again."""
        memo = _DIMENSION_REPLIES.get(self.judge, {})
        keys = [r.digest() for r in requests]
        missing = [j for j, k in enumerate(keys) if k not in memo]
        asked = dict(zip(missing, self.backend.complete([requests[j] for j in missing]))) if missing else {}
        replies = [asked[j] if j in asked else memo[k] for j, k in enumerate(keys)]
        _DIMENSION_REPLIES[self.judge] = {k: c for k, c in zip(keys, replies) if c.error is None}
        return replies

    def _pairwise(self, todo: list[int], images: dict[int, list[Any]], prompts: list[str], scores: torch.Tensor,
                  info: list[dict[str, Any]], noun: str) -> None:
        groups: dict[str, list[int]] = {}
        for i in todo:
            groups.setdefault(prompts[i], []).append(i)
        pairs = [(g[x], g[y]) for g in groups.values() for x in range(len(g)) for y in range(x + 1, len(g))]
        if self.both_orders:
            pairs += [(b, a) for a, b in pairs]
        flex = self.mode == "flex_pairwise"
        if noun == "Video":
            question = FLEX_VIDEO_QUESTION if flex else THINK_VIDEO_QUESTION
        else:
            question = FLEX_QUESTION if flex else self.think_question
        replies = self.backend.complete([self._ask(images[a] + images[b], question.format(prompt=prompts[a]))
                                         for a, b in pairs])
        if self.mode == "flex_pairwise":
            self._flex(todo, groups, pairs, replies, prompts, scores, info)
            return
        tie = 0 if self.no_verdict == "tie" else None
        verdicts = [(a, b, None if c.error is not None else (parse_verdict(c.text, self.verdict_parse, noun) or tie))
                    for (a, b), c in zip(pairs, replies)]
        rates, read = win_rates(len(scores), verdicts, self.win_rate_decimals)
        for members in groups.values():
            record_win_rates(members, rates, read, scores, info, "think_pairwise needs at least 2 samples per prompt",
                             "no comparison of this sample gave a verdict")

    def _edit_pairwise(self, todo: list[int], images: dict[int, list[Any]], prompts: list[str],
                       metadata: list[dict[str, Any]], scores: torch.Tensor, info: list[dict[str, Any]]) -> None:
        """The edits sharing an instruction and a source image compared two by two (the earlier sample as Edited
        Image 1), each request the source, the two edits and the instruction's question; win rates per group."""
        from flowalign.sampling.inputs import load_input_image

        sources, groups = {}, {}
        for i in todo:
            source = load_input_image(metadata[i]["image"])
            key = (prompts[i], hashlib.sha1((source * 255).round().to(torch.uint8).numpy().tobytes()).hexdigest())
            sources.setdefault(key, self._pil(source))
            groups.setdefault(key, []).append(i)
        pairs = [(key, g[x], g[y]) for key, g in groups.items() for x in range(len(g)) for y in range(x + 1, len(g))]
        if self.both_orders:
            pairs += [(key, b, a) for key, a, b in pairs]
        replies = self.backend.complete([self._ask([sources[key], *images[a], *images[b]],
                                                   EDIT_PAIRWISE_QUESTION.format(instruction=key[0]))
                                         for key, a, b in pairs])
        verdicts = [(a, b, None if c.error is not None else parse_edit_verdict(c.text))
                    for (_, a, b), c in zip(pairs, replies)]
        rates, read = win_rates(len(scores), verdicts, self.win_rate_decimals)
        for members in groups.values():
            record_win_rates(members, rates, read, scores, info,
                             "edit_pairwise needs at least 2 edits of each source and instruction",
                             "no comparison of this sample came back")

    def _edit_pointwise(self, todo: list[int], images: dict[int, list[Any]], prompts: list[str],
                        metadata: list[dict[str, Any]], scores: torch.Tensor, info: list[dict[str, Any]]) -> None:
        """One request per edit (``edit_quality``: the edit; ``edit_instruction``: the source, then the edit, with
        the instruction); its two scores blended ``(w0·s0 + w1·s1)/(w0 + w1)`` (a non-positive sum of weights
        divides by 1, as theirs), each part kept in ``info``."""
        from flowalign.sampling.inputs import load_input_image

        if self.mode == "edit_quality":
            asks = [self._ask(images[i], EDIT_QUALITY_QUESTION) for i in todo]
        else:
            # a group's edits share one source: read and encode it once
            sources = {id(metadata[i]["image"]): metadata[i]["image"] for i in todo}
            shown = {key: self._pil(load_input_image(image)) for key, image in sources.items()}
            asks = [self._ask([shown[id(metadata[i]["image"])], *images[i]], edit_instruction_question(prompts[i]))
                    for i in todo]
        first, second, _, w0_key, w1_key = EDIT_PARTS[self.mode]
        w0, w1 = self.part_weights
        for i, c in zip(todo, self.backend.complete(asks)):
            parsed = parse_edit_scores(c.text) if c.error is None else None
            info[i]["reply"] = (c.text or "")[-300:]
            if parsed is None:
                info[i]["reason"] = c.error or "no JSON 'score': [x, y] in the reply"
                continue
            info[i].update({first: parsed[0], second: parsed[1], "both": 1.0, w0_key: w0, w1_key: w1})
            scores[i] = (w0 * parsed[0] + w1 * parsed[1]) / (w0 + w1 if w0 + w1 > 0 else 1.0)

    def _flex(self, todo: list[int], groups: dict[str, list[int]], pairs: list[tuple[int, int]], replies: list[Any],
              prompts: list[str], scores: torch.Tensor, info: list[dict[str, Any]]) -> None:
        """Each prompt's group read as Pref-GRPO's ``_pairwise_win_rate`` reads one call's replies (its categories
        keyed in the order its replies name them); a sample's ``info`` keeps its ``overall``, ``dim_mean`` and
        ``has_dims``, the parts Pref-GRPO's ``--apply_gdpo`` blends (:mod:`rewards.unified_reward_flex`)."""
        verdicts = {pair: None if c.error is not None else parse_flex(c.text) for pair, c in zip(pairs, replies)}
        for members in groups.values():
            local = {i: k for k, i in enumerate(members)}
            rates = flex_win_rates(len(members), [(local[a], local[b], v) for (a, b), v in verdicts.items()
                                                  if a in local],
                                   overall_weight=self.overall_weight, dim_weight=self.dim_weight,
                                   category_weights=self.category_weights, blend=self.flex_blend)
            for i, k in local.items():
                info[i].update(comparisons=rates.read[k], overall=rates.overall[k], dim_mean=rates.dim_mean[k],
                               has_dims=rates.has_dims[k], overall_weight=self.overall_weight,
                               dim_weight=self.dim_weight)
                if len(members) < 2:
                    info[i]["reason"] = "flex_pairwise needs at least 2 samples per prompt"
                elif rates.reward[k] is None:
                    info[i]["reason"] = "no comparison of this sample came back"
                else:
                    scores[i] = rates.reward[k]


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
