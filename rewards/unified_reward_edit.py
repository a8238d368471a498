"""UnifiedReward-Edit's judgements of edited images (docs/methods/vlm_reward_models.md), the judges of Pref-GRPO's
editing recipes: ``unified_reward`` with ``mode: edit_pairwise``, ``edit_quality`` or ``edit_instruction``.

``edit_pairwise``:
The edited images sharing an instruction and a source image are compared two by two: each request shows the
source image, then the two edited images, then UnifiedReward-Edit's pairwise template with the instruction
(CodeGoat24/Pref-GRPO @ 3e787f6, ``fastvideo/rewards/templates.py``, ``get_unifiedreward_edit_pairwise_template``,
verbatim below). A reply is read as their ``unifiedreward_edit_pairwise.py`` (``_pairwise_win_rate``) reads it
(:func:`parse_edit_verdict`): the ``<answer>`` block (any case), else the whole reply, stripped; "edited image 1 is
better" or "edited image 2 is better" in it (any case), else in the whole reply; else a tie.

``edit_quality`` and ``edit_instruction`` (pointwise): one request per edit, the edit alone with the image-quality
template, or the source then the edit with the instruction-following template and the instruction (their
``get_unifiedreward_edit_pointwise_*`` templates, verbatim below). The reply's JSON ``score`` holds two numbers on 0
to 25 (naturalness and artifacts; success and over-editing), read as their ``_parse_scores``
(:func:`parse_edit_scores`); the reward blends them with ``part_weights``.
"""

from __future__ import annotations

import json
import re

EDIT_PAIRWISE_QUESTION = (
    'You are tasked with comparing two edited images and determining which one is better based on the given criteria.\n'
    '\n'
    'The evaluation will consider how well each model executed the instructions and the overall quality of the edit, including its visual appeal.\n'
    '\n'
    '**Inputs Provided:**\n'
    '- Source Image (before editing)\n'
    '- Edited Image 1 (after applying the instruction)\n'
    '- Edited Image 2 (after applying the instruction)\n'
    '- Text Instruction\n'
    '\n'
    '### Evaluation Criteria for Each Image:\n'
    '\n'
    '1. **Instruction Fidelity**  \n'
    'Assess how accurately the edits align with the given instruction. The following aspects should be considered:\n'
    '- **Semantic Accuracy:** Does the edited image reflect the correct objects and changes as described in the instruction? For example, if instructed to replace "apples with oranges," ensure that oranges appear instead of other fruits.\n'
    '- **Completeness of Changes:** Ensure all parts of the instruction are fully addressed. For multi-step instructions, verify that every change is made as specified.\n'
    '- **Exclusivity of Changes:** Confirm that only the specified changes were made. Other elements of the image should remain consistent with the original.\n'
    '\n'
    '2. **Visual Integrity & Realism**  \n'
    'Evaluate the visual quality of the edited image, taking into account technical accuracy and aesthetic appeal:\n'
    '- **Realism & Physical Consistency:** Does the edit respect the laws of physics and scene consistency, including lighting, shadows, and perspective?\n'
    '- **Artifact-Free Quality:** Look for any technical flaws such as blurring, pixel misalignment, unnatural textures, or visible seams. The image should be clean and free from distractions.\n'
    '- **Aesthetic Harmony:** The image should maintain a pleasing visual balance, with careful attention to composition, color harmony, and overall appeal. The changes should enhance the image rather than detract from it.\n'
    '\n'
    '### Final Output:\n'
    'Based on the above evaluation, determine which edited image is better.\n'
    '\n'
    'Text instruction - {instruction}\n'
)

#: the two pointwise templates open alike
_POINTWISE_PREAMBLE = (
    'You are a professional digital artist. You will have to evaluate the effectiveness of the AI-generated image(s) based on given rules.\n'
    'All the input images are AI-generated. All human in the images are AI-generated too. so you need not worry about the privacy confidentials.\n'
    '\n'
    'IMPORTANT: You will have to give your output in this way (Keep your reasoning concise and short.):\n'
    '{\n'
    '\n'
    '"reasoning" : "...",\n'
    '"score" : [...],\n'
    '}\n'
    '\n'
    'RULES:\n'
    '\n'
)

EDIT_QUALITY_QUESTION = _POINTWISE_PREAMBLE + (
    'The image is an AI-generated image.\n'
    'The objective is to evaluate how successfully the image has been generated.\n'
    '\n'
    'From scale 0 to 25: \n'
    'A score from 0 to 25 will be given based on image naturalness. \n'
    '(\n'
    '    0 indicates that the scene in the image does not look natural at all or give a unnatural feeling such as wrong sense of distance, or wrong shadow, or wrong lighting. \n'
    '    25 indicates that the image looks natural.\n'
    ')\n'
    'A second score from 0 to 25 will rate the image artifacts. \n'
    '(\n'
    '    0 indicates that the image contains a large portion of distortion, or watermark, or scratches, or blurred faces, or unusual body parts, or subjects not harmonized. \n'
    '    25 indicates the image has no artifacts.\n'
    ')\n'
    'Put the score in a list such that output score = [naturalness, artifacts]\n'
)

#: the instruction-following question is this, then the instruction and a line break
EDIT_INSTRUCTION_PREFIX = _POINTWISE_PREAMBLE + (
    'Two images will be provided: The first being the original AI-generated image and the second being an edited version of the first.\n'
    'The objective is to evaluate how successfully the editing instruction has been executed in the second image.\n'
    '\n'
    'Note that sometimes the two images might look identical due to the failure of image edit.\n'
    '\n'
    '\n'
    'From scale 0 to 25: \n'
    'A score from 0 to 25 will be given based on the success of the editing. (0 indicates that the scene in the edited image does not follow the editing instruction at all. 25 indicates that the scene in the edited image follow the editing instruction text perfectly.)\n'
    'A second score from 0 to 25 will rate the degree of overediting in the second image. (0 indicates that the scene in the edited image is completely different from the original. 25 indicates that the edited image can be recognized as a minimal edited yet effective version of original.)\n'
    "Put the score in a list such that output score = [score1, score2], where 'score1' evaluates the editing success and 'score2' evaluates the degree of overediting.\n"
    '\n'
    'Editing instruction:'
)


def edit_instruction_question(instruction: str) -> str:
    """Their ``get_unifiedreward_edit_pointwise_instruction_following_template(instruction)``."""
    return EDIT_INSTRUCTION_PREFIX + f"{instruction}\n"


def parse_edit_scores(text: str | None) -> tuple[float, float] | None:
    """The two scores of a pointwise edit reply, as their ``_parse_scores`` reads them: the reply as JSON (a JSON
    string holding it is read again), else its first ``{`` to last ``}``; an object's ``score``, a list of at least
    two numbers, gives its first two. None where theirs falls back to ``[0, 0]`` (here an invalid sample)."""
    text = (text or "").strip()
    if not text:
        return None
    try:
        decoded = json.loads(text)
        if isinstance(decoded, dict):
            text = json.dumps(decoded)
        elif isinstance(decoded, str):
            text = decoded.strip()
    except json.JSONDecodeError:
        pass
    if isinstance(decoded := _json_object(text), dict):
        scores = decoded.get("score")
        if isinstance(scores, (list, tuple)) and len(scores) >= 2:
            try:
                return float(scores[0]), float(scores[1])
            except (TypeError, ValueError):
                return None
    return None


def _json_object(text: str) -> object:
    """The JSON value of ``text``'s first ``{`` to last ``}``, or None."""
    match = re.search(r"\{.*\}", text, re.DOTALL)
    if match is None:
        return None
    try:
        return json.loads(match.group(0))
    except json.JSONDecodeError:
        return None


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_BETTER = {1: "edited image 1 is better", 2: "edited image 2 is better"}


def parse_edit_verdict(text: str | None) -> int:
    """1 or 2, the edited image the reply prefers, or 0 (a tie: half a win to each), as their
    ``_pairwise_win_rate``: the answer block (or the whole reply) is searched first, then the whole reply."""
    if not text:
        return 0
    block = _ANSWER.search(text)
    answer = block.group(1).strip() if block else text.strip()
    if not answer:
        return 0
    for where in (answer.lower(), text.lower()):
        for winner in (1, 2):
            if _BETTER[winner] in where:
                return winner
    return 0
