"""The project's OCR prompt set: short quoted texts in varied scenes, with held-out compositions.

A prompt puts a text of one to three words from :data:`WORDS` into one of the scene :data:`TEMPLATES`
('a storefront sign that says "OPEN LATE"'). The level is the number of words: ``easy`` one, ``medium``
two, ``hard`` three.

Held out: template ``t`` never shows, in training, a word whose index ``w`` has ``(w - t) % 7 == 0``
(each template holds out 10 of the 70 words, each word is held out of two or three templates). Every
word and every template still appears in training, only not together; the test splits hold only prompts
with such a (template, word) pair, which :func:`generate_tasks` never produces.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from flowalign.errors import UserError

LEVELS = ("easy", "medium", "hard")
WORDS_PER_LEVEL = {"easy": 1, "medium": 2, "hard": 3}
#: common, unambiguous words a model can spell and an OCR engine can read
WORDS: tuple[str, ...] = (
    "OPEN", "LATE", "FRESH", "COFFEE", "BREAD", "HELLO", "WORLD", "SALE", "BOOKS", "MUSIC",
    "GARDEN", "RIVER", "SUNNY", "DREAM", "HAPPY", "NORTH", "SOUTH", "PIZZA", "TEA", "JAZZ",
    "CAFE", "HOTEL", "EXIT", "STOP", "WELCOME", "HOME", "OCEAN", "PARK", "MARKET", "BAKERY",
    "CINEMA", "STAR", "MOON", "LIGHT", "PEACE", "LOVE", "RAIN", "SNOW", "SPRING", "WINTER",
    "SUMMER", "AUTUMN", "GOLD", "SILVER", "ROSE", "TIGER", "EAGLE", "FOREST", "CLOUD", "STORM",
    "MAGIC", "ROBOT", "PIXEL", "LEMON", "HONEY", "APPLE", "CANDY", "FLOWER", "STATION", "LIBRARY",
    "THEATER", "HARBOR", "VALLEY", "CASTLE", "ISLAND", "PLANET", "ROCKET", "SECRET", "QUIET", "SMILE",
)
#: scenes, each with one ``{text}`` slot inside double quotes
TEMPLATES: tuple[str, ...] = (
    'a storefront sign that says "{text}"',
    'a neon sign glowing "{text}" on a brick wall at night',
    'a chalkboard in a cafe with "{text}" written in chalk',
    'a wooden signpost in a forest reading "{text}"',
    'a birthday cake with "{text}" written in icing',
    'a coffee mug printed with the words "{text}"',
    'a billboard over a highway that reads "{text}"',
    'a book cover titled "{text}"',
    'a T-shirt with "{text}" printed across the chest',
    'a street mural with "{text}" painted in large letters',
    'a handwritten note on a desk that says "{text}"',
    'a movie poster with the title "{text}"',
    'a banner over a market stall saying "{text}"',
    'the words "{text}" written in the sand on a beach',
    'a computer screen displaying "{text}"',
    'a vintage postcard with "{text}" in bold letters',
)
HELDOUT_PERIOD = 7


@dataclass(frozen=True)
class OCRTask:
    """One prompt: its ``text`` (what the image must show) and the index of its scene ``template``."""

    prompt: str
    text: str
    template: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OCRTask:
        return cls(d["prompt"], d["text"], int(d["template"]))

    def metadata(self) -> dict[str, Any]:
        """What the ``ocr`` reward reads (``text``) and what a gallery may show (``template``)."""
        return {"text": self.text, "template": self.template}


def heldout_pairs(task: OCRTask) -> list[str]:
    """The held-out (template, word) pairs of ``task`` as readable strings (empty: a training prompt)."""
    return [f"template {task.template} × {word}" for word in task.text.split()
            if (WORDS.index(word) - task.template) % HELDOUT_PERIOD == 0]


def _check_level(level: str) -> None:
    if level not in LEVELS:
        raise UserError(f"unknown level {level!r} for the ocr benchmark; choose one of {', '.join(LEVELS)}")


def _draw(level: str, seed: int, index: int, attempt: int) -> OCRTask:
    rng = np.random.default_rng([seed, index, attempt])
    template = int(rng.integers(len(TEMPLATES)))
    words = [WORDS[int(w)] for w in rng.choice(len(WORDS), size=WORDS_PER_LEVEL[level], replace=False)]
    text = " ".join(words)
    return OCRTask(TEMPLATES[template].format(text=text), text, template)


def generate_tasks(n: int, *, seed: int, level: str) -> list[OCRTask]:
    """``n`` training prompts of ``level``, deterministic for ``seed``; a draw with a held-out pair is
    drawn again, so no training prompt is a test prompt. Seeds < 1000 are for training."""
    _check_level(level)
    tasks = []
    for i in range(n):
        attempt = 0
        while heldout_pairs(task := _draw(level, seed, i, attempt)):
            attempt += 1
        tasks.append(task)
    return tasks


def generate_heldout_tasks(n: int, *, seed: int, level: str) -> list[OCRTask]:
    """``n`` prompts of ``level`` that hold a held-out (template, word) pair: the draws training excludes."""
    _check_level(level)
    tasks: list[OCRTask] = []
    i = 0
    while len(tasks) < n:
        if heldout_pairs(task := _draw(level, seed, i, 0)):
            tasks.append(task)
        i += 1
    return tasks
