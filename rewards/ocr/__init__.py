"""Text rendering: the ``ocr`` reward (Flow-GRPO's OCR score over a choice of OCR engines) and the
project's OCR prompt set (short quoted texts in varied scenes, with held-out compositions).

See ``docs/methods/ocr.md``. The reward registers on import.
"""

from rewards.ocr.prompts import LEVELS, TEMPLATES, WORDS, OCRTask, generate_heldout_tasks, generate_tasks, heldout_pairs
from rewards.ocr.reward import OCRReward
from rewards.ocr.score import edit_distance, ocr_score, target_text
from rewards.ocr.splits import SPLIT_SEEDS, draw_split, load_split

__all__ = [
    "LEVELS", "OCRReward", "OCRTask", "SPLIT_SEEDS", "TEMPLATES", "WORDS", "draw_split", "edit_distance",
    "generate_heldout_tasks", "generate_tasks", "heldout_pairs", "load_split", "ocr_score", "target_text",
]
