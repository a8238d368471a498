"""VVR motion task grammar: moving objects, motion constraints, tasks, their JSON form and validation.

A :class:`MotionTask` is a VVR scene extended in time: each :class:`MotionObj` is a VVR object
(:class:`rewards.vvr.tasks.Obj`: shape, colour, size class, fill, centre) at the start of the clip plus
where it ends (centre and size class) and from when it is visible. Time ``t`` runs over [0, 1] from the
first to the last frame (frame ``f`` of ``F`` is at ``t = f / (F - 1)``); centres and extents move
linearly in ``t``, so one task renders at any frame count, while ``num_frames`` says how many frames a
clip checked against it must have.

Constraint arguments (JSON values): a reference ``ref``/``a``/``b`` is a VVR descriptor
``{"colour": str, "shape": str}`` (at least one key) that picks out exactly one object in a frame;
``direction`` is one of ``MOTION_DIRECTIONS`` (image directions: "up" is towards the top row).

Seven constraint types:

* ``moves(ref, direction)``: travels left / right / up / down.
* ``still(ref)``: stays in place.
* ``appears(ref)``: absent from the first frame, present from some frame on.
* ``grows(ref)`` / ``shrinks(ref)``: its area increases / decreases.
* ``toward(a, b)`` / ``away_from(a, b)``: the distance from A to B decreases / increases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from rewards.vvr.geometry import SIZE_EXTENT, SIZES, box_size
from rewards.vvr.palette import COLOURS
from rewards.vvr.predicates import Box
from rewards.vvr.tasks import (
    LEVELS,
    Obj,
    checked_choice,
    checked_constraint_list,
    checked_fields,
    checked_ref,
    task_dict,
)
from rewards.vvr_motion.prompts import prompt_for, ref_key  # noqa: F401  (ref_key re-exported)

#: frames per clip by default: Wan's VAE needs F = 4k + 1, and the tiny video model makes 9
NUM_FRAMES = 9
#: the fewest frames a task may ask for (monotonicity is judged over ≥ 4 steps)
MIN_FRAMES = 5
MOTION_DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")

#: constraint type → its argument names, in the order prompts and the verifier use them
CONSTRAINT_ARGS: dict[str, tuple[str, ...]] = {
    "moves": ("ref", "direction"),
    "still": ("ref",),
    "appears": ("ref",),
    "grows": ("ref",),
    "shrinks": ("ref",),
    "toward": ("a", "b"),
    "away_from": ("a", "b"),
}
CONSTRAINT_TYPES: tuple[str, ...] = tuple(CONSTRAINT_ARGS)
_REF_ARGS = frozenset({"ref", "a", "b"})


def _unit(value: Any, where: str, *, upper_open: bool = False) -> float:
    """A float in [0, 1] (or [0, 1) with ``upper_open``), else ``ValueError`` naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: must be a number in [0, 1], got {value!r}")
    v = float(value)
    if not (0.0 <= v < 1.0 if upper_open else 0.0 <= v <= 1.0):
        raise ValueError(f"{where}: must lie in [0, {'1)' if upper_open else '1]'}, got {v}")
    return v


@dataclass(frozen=True)
class MotionObj:
    """A VVR object moving linearly from ``start`` (its state at t = 0) to ``(end_x, end_y)`` at
    ``end_size``, visible from ``t ≥ appear`` on (0: from the first frame). Positions are image fractions."""

    start: Obj
    end_x: float
    end_y: float
    end_size: str
    appear: float = 0.0

    @property
    def ref(self) -> dict[str, str]:
        """The descriptor that names this object in constraints."""
        return {"colour": self.start.colour, "shape": self.start.shape}

    def visible(self, t: float) -> bool:
        """Whether the object is on screen at time ``t`` ∈ [0, 1] (a frame exactly at ``appear`` shows it)."""
        return t >= self.appear - 1e-9

    def box(self, t: float) -> Box:
        """The object's box at time ``t`` ∈ [0, 1]: centre and extent interpolated linearly."""
        s = self.start
        extent = SIZE_EXTENT[s.size] + t * (SIZE_EXTENT[self.end_size] - SIZE_EXTENT[s.size])
        w, h = box_size(s.shape, extent)
        return Box(s.x + t * (self.end_x - s.x), s.y + t * (self.end_y - s.y), w, h)

    def to_dict(self) -> dict[str, Any]:
        """The start object's fields plus ``end_x``, ``end_y``, ``end_size``, ``appear``."""
        return {**self.start.to_dict(), "end_x": round(self.end_x, 4), "end_y": round(self.end_y, 4),
                "end_size": self.end_size, "appear": round(self.appear, 4)}

    @staticmethod
    def from_dict(d: Mapping[str, Any], where: str = "object") -> "MotionObj":
        """Validate and build; missing end fields mean a static object visible throughout."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: an object must be a dict, got {d!r}")
        start = Obj.from_dict(d, where)
        return MotionObj(
            start,
            _unit(d.get("end_x", start.x), f"{where}.end_x"),
            _unit(d.get("end_y", start.y), f"{where}.end_y"),
            checked_choice(d.get("end_size", start.size), SIZES, f"{where}.end_size"),
            _unit(d.get("appear", 0.0), f"{where}.appear", upper_open=True),
        )


@dataclass(frozen=True)
class MotionConstraint:
    """A motion constraint ``type`` with its arguments (see the module docstring)."""

    type: str
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def refs(self) -> list[dict[str, str]]:
        """The descriptors this constraint names, subject first."""
        return [self.args[k] for k in CONSTRAINT_ARGS[self.type] if k in _REF_ARGS]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **{k: self.args[k] for k in CONSTRAINT_ARGS[self.type]}}

    @staticmethod
    def from_dict(d: Mapping[str, Any], where: str = "constraint") -> "MotionConstraint":
        """Validate and build; raises ``ValueError`` naming the bad field and the allowed values."""
        ctype, names = checked_fields(d, where, CONSTRAINT_ARGS, what="motion constraint")
        args = {name: checked_ref(d[name], f"{where}.{name}") if name in _REF_ARGS
                else checked_choice(d[name], MOTION_DIRECTIONS, f"{where}.{name}") for name in names}
        return MotionConstraint(ctype, args)


@dataclass(frozen=True)
class MotionTask:
    """A moving scene plus constraints true in it, checked on clips of ``num_frames`` frames."""

    id: str
    level: str
    num_frames: int
    background: str
    objects: tuple[MotionObj, ...]
    constraints: tuple[MotionConstraint, ...]

    @property
    def prompt(self) -> str:
        """The deterministic prompt text (see ``rewards.vvr_motion.prompts``)."""
        return prompt_for(self.constraints)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form; ``prompt`` is included for readers and ignored by :meth:`from_dict`."""
        return task_dict(self, num_frames=self.num_frames)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "MotionTask":
        """Validate and build; raises ``ValueError`` naming the bad field and the allowed values."""
        constraints = checked_constraint_list(d, "motion constraints")
        objects = d.get("objects", [])
        if not isinstance(objects, (list, tuple)):
            raise ValueError(f"task.objects: must be a list of objects, got {objects!r}")
        return MotionTask(
            id=str(d.get("id", "")),
            level=checked_choice(d.get("level", "hard"), LEVELS, "task.level"),
            num_frames=checked_frames(d.get("num_frames", NUM_FRAMES), "task.num_frames"),
            background=checked_choice(d.get("background", "white"), COLOURS, "task.background"),
            objects=tuple(MotionObj.from_dict(o, f"objects[{i}]") for i, o in enumerate(objects)),
            constraints=tuple(MotionConstraint.from_dict(c, f"constraints[{i}]") for i, c in enumerate(constraints)),
        )


def checked_frames(value: Any, where: str) -> int:
    """``value`` if it is a valid clip length (an int ≥ ``MIN_FRAMES``), else a ``ValueError`` naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_FRAMES:
        raise ValueError(f"{where}: must be an integer >= {MIN_FRAMES} (Wan-style models use 4k+1), got {value!r}")
    return value


def as_task(task: "MotionTask | Mapping[str, Any]") -> MotionTask:
    """A :class:`MotionTask` from a task or its dict (validated)."""
    return task if isinstance(task, MotionTask) else MotionTask.from_dict(task)
