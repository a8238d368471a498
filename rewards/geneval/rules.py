"""GenEval's rules, model-free: detections in, a verdict per sample out.

Everything here is a pure function of hand-buildable :class:`Detection` lists, so every rule is tested on
known answers without a detector. The numbers are GenEval's (``evaluation/evaluate_images.py`` of
djghosh13/geneval): a detection counts above a confidence of 0.3, or 0.9 for ``counting`` prompts (a stricter
bar, since one spurious low-confidence box breaks an exact count), compared in float32 as GenEval compares
mmdetection's float32 scores; most confident first in GenEval's order (``np.argsort`` reversed: of equal
scores, the later detection first); at most 16 per class; no extra NMS (the mask detector emits one query per
instance); and "A left of B" needs A's centre left of B's by more than 0.1 × (width A + width B) along the
dominant axis. ``tests/rewards/geneval/test_rules_reference.py`` holds GenEval's own verdicts on hand-built
detections.

Three results come out (see ``docs/methods/geneval.md``):

* ``correct``: GenEval's benchmark verdict. Each ``include`` clause needs at least ``count`` objects of its
  class; ``color`` is checked on the ``count`` most confident of them, ``position`` against every object of
  the clause it names; any ``exclude`` clause with ``count`` or more objects of its class fails the prompt.
  ``reasons`` are GenEval's reason lines.
* ``partial``: the share Flow-GRPO trains on (its reward server's ``evaluate_reward``), kept term for term so
  training signals match: per clause ``1 - |count - found| / count`` (negative when more than twice the count
  are found), then ``1 - |count - right colour| / count`` or 0 when the count is off; a position clause adds
  0 when a pair is on the wrong side and then 1 (the reference appends both), or 1 when every pair is right,
  or 0 when its target clause failed. ``exclude`` is not read: an exact count already punishes extras.
* ``exact``: the reward server's own verdict on the same terms (its ``strict_correct``, what Flow-GRPO logs
  as ``strict_accuracy``): every count exact, every colour right, every position right; ``exclude`` not read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rewards.geneval.vocabulary import COLOURS, POSITIONS

#: GenEval's defaults (evaluate_images.py options threshold, counting_threshold, max_objects, max_overlap,
#: position_threshold)
THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
NMS_THRESHOLD = 1.0
POSITION_THRESHOLD = 0.1


@dataclass
class Detection:
    """One detected instance: its class name, confidence, box ``(x0, y0, x1, y1)`` in pixels and, from a
    segmentation model, its ``(H, W)`` bool mask."""

    label: str
    score: float
    box: tuple[float, float, float, float]
    mask: np.ndarray | None = field(default=None, repr=False)


@dataclass
class Verdict:
    correct: bool
    partial: float
    #: GenEval's reason lines (``evaluate``'s ``reason``, one line each)
    reasons: list[str]
    #: (requirement type, passed) for each requirement checked: count, colour, position, exclude
    checks: list[tuple[str, bool]]
    #: the reward server's exact verdict (see the module docstring)
    exact: bool = False


ColourFn = Callable[[str, Sequence[Detection]], list[str]]


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two boxes with GenEval's inclusive pixel areas (``+1`` on each side)."""
    def area(box: Sequence[float]) -> float:
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    inter = area((max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])))
    union = area(a) + area(b) - inter
    return inter / union if union else 0.0


def select_objects(detections: Sequence[Detection], tag: str, *, threshold: float = THRESHOLD,
                   counting_threshold: float = COUNTING_THRESHOLD, max_objects: int = MAX_OBJECTS,
                   nms_threshold: float = NMS_THRESHOLD) -> dict[str, list[Detection]]:
    """Class → its kept detections, most confident first: above the tag's threshold (strictly, in float32), at
    most ``max_objects``, greedy NMS at ``nms_threshold`` (1: none). Of equal scores the later detection comes
    first, as in GenEval (``np.argsort`` of the class's scores, reversed)."""
    bar = np.float32(counting_threshold if tag == "counting" else threshold)
    by_class: dict[str, list[Detection]] = {}
    for det in detections:
        by_class.setdefault(det.label, []).append(det)
    kept: dict[str, list[Detection]] = {}
    for label, dets in by_class.items():
        scores = np.asarray([d.score for d in dets], dtype=np.float32)
        ranked = np.argsort(scores)[::-1]
        order = [dets[i] for i in ranked[scores[ranked] > bar][:max_objects].tolist()]
        if not order:
            continue
        out: list[Detection] = []
        while order:
            best = order.pop(0)
            out.append(best)
            if nms_threshold < 1:
                order = [d for d in order if box_iou(best.box, d.box) < nms_threshold]
        kept[label] = out
    return kept


def relative_position(a: Sequence[float], b: Sequence[float], margin: float = POSITION_THRESHOLD) -> set[str]:
    """Where box ``a`` lies relative to box ``b``: a subset of {left of, right of, above, below}.

    The centre offset is shrunk by ``margin`` × the summed box sizes on each axis; what is left, as a share of
    the full offset's length, must exceed 0.5 on an axis for that relation (so diagonal placements count only
    on their dominant axis, and heavily overlapping boxes have none)."""
    boxes = np.asarray([a[:4], b[:4]], dtype=np.float64).reshape(2, 2, 2)
    centre_a, centre_b = boxes.mean(axis=1)
    size_a, size_b = np.abs(boxes[:, 1] - boxes[:, 0])
    offset = centre_a - centre_b
    revised = np.maximum(np.abs(offset) - margin * (size_a + size_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def judge(objects: Mapping[str, list[Detection]], metadata: Mapping[str, Any], colours: ColourFn, *,
          position_threshold: float = POSITION_THRESHOLD) -> Verdict:
    """Both verdicts of one sample (see the module docstring); ``colours(class, detections)`` names each
    detection's colour and is called only for clauses that ask for one."""
    correct, reasons, checks = _benchmark(objects, metadata, colours, position_threshold)
    partial, exact = _partial(objects, metadata, colours, position_threshold)
    return Verdict(correct, partial, reasons, checks, exact)


def _wrong_pair(found: Sequence[Detection], targets: Sequence[Detection], relation: str,
                margin: float) -> set[str] | None:
    """The relations of the first (object, target) pair where ``relation`` does not hold, pairs taken in
    GenEval's order (each object against every target); None when it holds for every pair."""
    for o in found:
        for t in targets:
            relations = relative_position(o.box, t.box, margin)
            if relation not in relations:
                return relations
    return None


def _colour_reason(colour: str, cls: str, n: int, named: Sequence[str]) -> str:
    tally = ", ".join(f"{named.count(c)} {c}" for c in COLOURS if c in named)
    return f"expected {colour} {cls}>={n}, found {named.count(colour)} {colour}; and {tally}"


def _benchmark(objects: Mapping[str, list[Detection]], metadata: Mapping[str, Any], colours: ColourFn,
               margin: float) -> tuple[bool, list[str], list[tuple[str, bool]]]:
    correct, reasons, checks = True, [], []
    groups: list[list[Detection] | None] = []
    for req in metadata.get("include", []):
        cls, n = req["class"], req["count"]
        found = objects.get(cls, [])[:n]
        matched = len(found) >= n
        checks.append(("count", matched))
        if not matched:
            reasons.append(f"expected {cls}>={n}, found {len(found)}")
        else:
            if "color" in req:
                named = colours(cls, found)
                ok = named.count(req["color"]) >= n
                checks.append(("colour", ok))
                if not ok:
                    matched = False
                    reasons.append(_colour_reason(req["color"], cls, n, named))
            if "position" in req and matched:
                relation, target = req["position"]
                if groups[target] is None:
                    matched = False
                    reasons.append(f"no target for {cls} to be {relation}")
                else:
                    wrong = _wrong_pair(found, groups[target], relation, margin)
                    if wrong is not None:
                        matched = False
                        shown = " and ".join(r for r in POSITIONS if r in wrong)
                        reasons.append(f"expected {cls} {relation} target, found {shown} target")
                checks.append(("position", matched))
        correct = correct and matched
        groups.append(found if matched else None)
    for req in metadata.get("exclude", []):
        cls, n = req["class"], req["count"]
        ok = len(objects.get(cls, [])) < n
        checks.append(("exclude", ok))
        if not ok:
            correct = False
            reasons.append(f"expected {cls}<{n}, found {len(objects[cls])}")
    return correct, reasons, checks


def _partial(objects: Mapping[str, list[Detection]], metadata: Mapping[str, Any], colours: ColourFn,
             margin: float) -> tuple[float, bool]:
    """The reward server's score and its exact verdict."""
    terms: list[float] = []
    exact = True
    groups: list[list[Detection] | None] = []
    for req in metadata.get("include", []):
        cls, n = req["class"], req["count"]
        found = objects.get(cls, [])
        terms.append(1 - abs(n - len(found)) / n)
        matched = len(found) == n
        if not matched:
            if "color" in req or "position" in req:
                terms.append(0.0)
        else:
            if "color" in req:
                right = colours(cls, found).count(req["color"])
                terms.append(1 - abs(n - right) / n)
                matched = right == n
            if "position" in req and matched:
                relation, target = req["position"]
                if groups[target] is None:
                    matched = False
                    terms.append(0.0)
                else:
                    if _wrong_pair(found, groups[target], relation, margin) is not None:
                        matched = False
                        terms.append(0.0)
                    terms.append(1.0)  # the reference appends this after a failed pair too
        exact = exact and matched
        groups.append(found if matched else None)
    return (sum(terms) / len(terms) if terms else 0.0), exact
