"""What a gallery (:mod:`flowalign.gallery`) shows: a row per prompt, a cell per column, and where a cell's
files landed in the written folder; :mod:`flowalign.gallery_html` renders them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class GalleryCell:
    """One sample: its media file (image, MP4 or GIF), scores and, when judged, the verdicts."""

    media: Path
    poster: Path | None = None
    scores: dict[str, float] = field(default_factory=dict)
    constraints: list[tuple[str, bool]] | None = None
    all_passed: bool | None = None
    reason: str = ""

    @property
    def score(self) -> float | None:
        """The first score: the one gains, sorting and the summary's Δ use."""
        return next(iter(self.scores.values()), None)


@dataclass
class GalleryRow:
    """One prompt, sampled with the same ``seed`` in every column (``None`` where a column is missing)."""

    prompt: str
    cells: list[GalleryCell | None]
    seed: int | None = None

    @property
    def gain(self) -> float | None:
        """Last column's score minus the first's; ``None`` when either is missing or unscored."""
        first, last = self.cells[0], self.cells[-1]
        if first is None or last is None or first.score is None or last.score is None:
            return None
        return last.score - first.score


@dataclass
class Placed:
    """Where a cell's files landed in the gallery, as paths relative to index.html."""

    media: str
    poster: str | None
    gif: str | None  # the GIF fallback of an MP4
