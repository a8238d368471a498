"""VVR task grammar: objects, constraints, tasks, their JSON form and its validation.

A :class:`Task` is a scene (background colour, objects in paint order) plus constraints that are true
in that scene. The prompt is derived from the constraints (``rewards.vvr.prompts``) and the verifier only
reads the constraints and the background, so a task can be checked against any image.

Constraint arguments (all JSON values):

* a *reference* ``ref``/``a``/``b``/``c`` is a descriptor ``{"colour": str, "shape": str}`` with at least
  one key; a relation's references pick out exactly one object, a count's descriptor may match many.
* ``n`` int ≥ 0, ``colour`` a palette name, ``shape`` a shape name, ``size`` a size class, ``filled``
  bool, ``direction`` an extremal direction, ``region`` a quadrant.

32 constraint types (the method page's list has 34 names once bigger/smaller and left/right are split; we
keep 32 [derived]): ``smaller`` is ``bigger`` with its arguments swapped, and ``separated`` (neither
touching nor overlapping) is the default state of any two generated objects, so it carries no
information beyond ``touching``/``overlapping``; both are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from rewards.vvr.geometry import SHAPES, SIZE_EXTENT, SIZES, box_size
from rewards.vvr.palette import COLOURS
from rewards.vvr.predicates import Box
from rewards.vvr.prompts import prompt_for

LEVELS: tuple[str, ...] = ("easy", "medium", "hard")
DIRECTIONS: tuple[str, ...] = ("leftmost", "rightmost", "topmost", "bottommost")
REGIONS: tuple[str, ...] = ("top-left", "top-right", "bottom-left", "bottom-right")

#: constraint type → its argument names, in the order the verifier and prompts use them
CONSTRAINT_ARGS: dict[str, tuple[str, ...]] = {
    # count / existence
    "exists": ("ref",),
    "absent": ("ref",),
    "count_shape": ("shape", "n"),
    "count_colour": ("colour", "n"),
    "count_colour_shape": ("colour", "shape", "n"),
    "total_count": ("n",),
    "at_least": ("ref", "n"),
    "at_most": ("ref", "n"),
    "more_than": ("a", "b"),
    "equal_count": ("a", "b"),
    # attributes
    "colour_of": ("ref", "colour"),
    "shape_of": ("ref", "shape"),
    "size_class": ("ref", "size"),
    "bigger": ("a", "b"),
    "same_colour": ("a", "b"),
    "different_colour": ("a", "b"),
    "same_shape": ("a", "b"),
    "background_colour": ("colour",),
    "filled": ("ref", "filled"),
    # relations
    "left_of": ("a", "b"),
    "right_of": ("a", "b"),
    "above": ("a", "b"),
    "below": ("a", "b"),
    "inside": ("a", "b"),
    "touching": ("a", "b"),
    "overlapping": ("a", "b"),
    "horizontally_aligned": ("a", "b"),
    "vertically_aligned": ("a", "b"),
    "between": ("a", "b", "c"),
    "nearest_to": ("a", "b"),
    "extremal": ("ref", "direction"),
    "region": ("ref", "region"),
}
CONSTRAINT_TYPES: tuple[str, ...] = tuple(CONSTRAINT_ARGS)
assert len(CONSTRAINT_TYPES) == 32

_REF_ARGS = frozenset({"ref", "a", "b", "c"})
_CHOICES: dict[str, tuple[str, ...]] = {
    "colour": COLOURS,
    "shape": SHAPES,
    "size": SIZES,
    "direction": DIRECTIONS,
    "region": REGIONS,
}


def checked_choice(value: Any, allowed: tuple[str, ...], where: str) -> str:
    """``value`` if it is one of ``allowed``, else a ``ValueError`` naming ``where`` and the allowed values."""
    if value not in allowed:
        raise ValueError(f"{where}: {value!r} is not allowed; allowed values: {', '.join(allowed)}")
    return value


def checked_ref(value: Any, where: str) -> dict[str, str]:
    """An object descriptor ``{"colour"?, "shape"?}`` checked against the palette and the shapes."""
    if not isinstance(value, Mapping) or not value or set(value) - {"colour", "shape"}:
        raise ValueError(f"{where}: a reference must be a dict with keys 'colour' and/or 'shape', got {value!r}")
    return {k: checked_choice(value[k], _CHOICES[k], f"{where}.{k}") for k in ("colour", "shape") if k in value}


def checked_fields(d: Any, where: str, schema: Mapping[str, tuple[str, ...]], what: str = "constraint"
                   ) -> tuple[str, tuple[str, ...]]:
    """The ``type`` of the constraint dict ``d`` and its field names, once both are checked against
    ``schema`` (type → field names): a ``ValueError`` names the bad field and what is allowed."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: a constraint must be a dict, got {d!r}")
    ctype = d.get("type")
    if ctype not in schema:
        raise ValueError(f"{where}.type: unknown {what} type {ctype!r}; allowed: {', '.join(schema)}")
    names = schema[ctype]
    extra = set(d) - set(names) - {"type"}
    if extra:
        raise ValueError(f"{where}: unexpected field(s) {sorted(extra)} for {ctype!r}; expected {list(names)}")
    for name in names:
        if name not in d:
            raise ValueError(f"{where}: {ctype!r} needs field {name!r} (fields: {list(names)})")
    return ctype, names


@dataclass(frozen=True)
class Obj:
    """One object of a scene: centre ``(x, y)`` in [0, 1] image fractions (y down), upright."""

    id: int
    shape: str
    colour: str
    size: str
    filled: bool
    x: float
    y: float

    @property
    def box(self) -> Box:
        """The object's box in image fractions."""
        w, h = box_size(self.shape, SIZE_EXTENT[self.size])
        return Box(self.x, self.y, w, h)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "shape": self.shape, "colour": self.colour, "size": self.size,
            "filled": self.filled, "x": round(self.x, 4), "y": round(self.y, 4),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any], where: str = "object") -> "Obj":
        try:
            x, y = float(d["x"]), float(d["y"])
            oid = int(d["id"])
        except KeyError as e:
            raise ValueError(f"{where}: missing field {e.args[0]!r}") from e
        if not (0.0 <= x <= 1.0 and 0.0 <= y <= 1.0):
            raise ValueError(f"{where}: centre ({x}, {y}) must lie in [0, 1]")
        filled = d.get("filled", True)
        if not isinstance(filled, bool):
            raise ValueError(f"{where}.filled: must be true or false, got {filled!r}")
        return Obj(
            oid,
            checked_choice(d.get("shape"), SHAPES, f"{where}.shape"),
            checked_choice(d.get("colour"), COLOURS, f"{where}.colour"),
            checked_choice(d.get("size"), SIZES, f"{where}.size"),
            filled, x, y,
        )


@dataclass(frozen=True)
class Constraint:
    """A constraint ``type`` with its arguments (see the module docstring)."""

    type: str
    args: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **{k: self.args[k] for k in CONSTRAINT_ARGS[self.type]}}

    @staticmethod
    def from_dict(d: Mapping[str, Any], where: str = "constraint") -> "Constraint":
        ctype, names = checked_fields(d, where, CONSTRAINT_ARGS)
        args: dict[str, Any] = {}
        for name in names:
            v, w = d[name], f"{where}.{name}"
            if name in _REF_ARGS:
                args[name] = checked_ref(v, w)
            elif name == "n":
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise ValueError(f"{w}: must be an integer >= 0, got {v!r}")
                args[name] = v
            elif name == "filled":
                if not isinstance(v, bool):
                    raise ValueError(f"{w}: must be true or false, got {v!r}")
                args[name] = v
            else:
                args[name] = checked_choice(v, _CHOICES[name], w)
        return Constraint(ctype, args)


@dataclass(frozen=True)
class SceneTask:
    """What every VVR task kind starts with: an id, a level, a background and ``objects`` in paint order
    (later ones on top). :class:`Task` adds constraints, ``rewards.vvr_edit.EditTask`` an edit."""

    id: str
    level: str
    background: str
    objects: tuple[Obj, ...]


@dataclass(frozen=True)
class Task(SceneTask):
    """A scene plus constraints true in it; ``objects`` are in paint order (later ones on top)."""

    constraints: tuple[Constraint, ...]

    @property
    def prompt(self) -> str:
        """The deterministic prompt text (see ``rewards.vvr.prompts``)."""
        return prompt_for(self.constraints)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form; ``prompt`` is included for readers and ignored by :meth:`from_dict`."""
        return task_dict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "Task":
        """Validate and build; raises ``ValueError`` naming the bad field and the allowed values."""
        constraints = checked_constraint_list(d, "constraints")
        level = d.get("level", "hard")
        return Task(
            id=str(d.get("id", "")),
            level=checked_choice(level, LEVELS, "task.level"),
            background=checked_choice(d.get("background", "white"), COLOURS, "task.background"),
            objects=tuple(Obj.from_dict(o, f"objects[{i}]") for i, o in enumerate(d.get("objects", []))),
            constraints=tuple(Constraint.from_dict(c, f"constraints[{i}]") for i, c in enumerate(constraints)),
        )


def task_dict(task: Any, **extra: Any) -> dict[str, Any]:
    """The JSON form of a constrained task (:class:`Task`, ``rewards.vvr_motion.MotionTask``): ``id``, ``level``,
    the kind's own ``extra`` fields, ``background``, ``objects``, ``constraints`` and the ``prompt``."""
    return {
        "id": task.id,
        "level": task.level,
        **extra,
        "background": task.background,
        "objects": [o.to_dict() for o in task.objects],
        "constraints": [c.to_dict() for c in task.constraints],
        "prompt": task.prompt,
    }


def checked_constraint_list(d: Any, what: str) -> list | tuple:
    """The constraints of a task dict ``d``; a ``ValueError`` unless ``d`` is a dict with a non-empty list of
    ``what`` (e.g. ``"constraints"``) under ``"constraints"``."""
    if not isinstance(d, Mapping):
        raise ValueError(f"task: expected a dict, got {type(d).__name__}")
    constraints = d.get("constraints")
    if not isinstance(constraints, (list, tuple)) or not constraints:
        raise ValueError(f"task.constraints: must be a non-empty list of {what}")
    return constraints


def as_task(task: "Task | Mapping[str, Any]") -> Task:
    """A :class:`Task` from a task or its dict (validated)."""
    return task if isinstance(task, Task) else Task.from_dict(task)
