"""UnifiedReward-Edit's pairwise judgement: ``unified_reward`` with ``mode: edit_pairwise``
(docs/methods/vlm_reward_models.md), the judge of Pref-GRPO's editing recipes.

The edited images sharing an instruction and a source image are compared two by two: each request shows the
source image, then the two edited images, then UnifiedReward-Edit's pairwise template with the instruction
(CodeGoat24/Pref-GRPO @ 3e787f6, ``fastvideo/rewards/templates.py``, ``get_unifiedreward_edit_pairwise_template``,
verbatim below). A reply is read as their ``unifiedreward_edit_pairwise.py`` (``_pairwise_win_rate``) reads it
(:func:`parse_edit_verdict`): the ``<answer>`` block (any case), else the whole reply, stripped; "edited image 1 is
better" or "edited image 2 is better" in it (any case), else in the whole reply; else a tie.
"""

from __future__ import annotations

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
