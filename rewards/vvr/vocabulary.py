"""What each VVR level's scenes may contain, and the groups of constraint types generation uses."""

from __future__ import annotations

from dataclasses import dataclass

from rewards.vvr.geometry import SHAPES, SIZES
from rewards.vvr.palette import COLOURS
from rewards.vvr.tasks import CONSTRAINT_TYPES


@dataclass(frozen=True)
class Vocabulary:
    """What a level's scenes may contain."""

    colours: tuple[str, ...]
    shapes: tuple[str, ...]
    sizes: tuple[str, ...]
    outline: bool
    backgrounds: tuple[str, ...]


EASY_COLOURS: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple", "orange")
EASY_SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star")
MEDIUM_COLOURS: tuple[str, ...] = EASY_COLOURS + ("cyan", "pink", "brown", "black")
MEDIUM_SHAPES: tuple[str, ...] = EASY_SHAPES + ("hexagon", "rectangle")
#: per-level vocabularies (the tiny pretraining model learns the easy one first)
VOCABULARIES: dict[str, Vocabulary] = {
    "easy": Vocabulary(EASY_COLOURS, EASY_SHAPES, ("medium",), False, ("white",)),
    "medium": Vocabulary(MEDIUM_COLOURS, MEDIUM_SHAPES, SIZES, False, ("white",)),
    "hard": Vocabulary(COLOURS, SHAPES, SIZES, True, ("white", "black", "gray")),
}
#: the spatial relation types (the last group of ``CONSTRAINT_TYPES``)
RELATIONS: tuple[str, ...] = CONSTRAINT_TYPES[CONSTRAINT_TYPES.index("left_of"):]
#: the relations a medium task may use between its two objects
MEDIUM_RELATIONS: tuple[str, ...] = (
    "left_of", "right_of", "above", "below", "bigger", "inside", "touching",
    "horizontally_aligned", "vertically_aligned",
)
