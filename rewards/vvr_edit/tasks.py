"""VVR editing tasks: a source scene, one edit instruction, and the edited scene it asks for.

An :class:`EditTask` holds the source scene (``background`` and ``objects``, VVR :class:`~rewards.vvr.Obj`),
the ``edit`` (a dict with ``kind`` and its arguments) and ``result``, the reference edited scene (what a
correct edit looks like; the verifier does not need its free parts, see :mod:`rewards.vvr_edit.verify`).

Edit kinds (objects are named by colour and shape, unique in the scene):

* ``recolour``: ``{"kind": "recolour", "target": id, "colour": c}``: "make the red circle blue";
* ``move``: ``{"kind": "move", "target": id, "relation": r, "anchor": id}``: "move the blue square to the left
  of the green star" (``r`` in left_of / right_of / above / below);
* ``remove``: ``{"kind": "remove", "target": id}``: "remove the yellow triangle";
* ``add``: ``{"kind": "add", "object": {...}, "relation": r, "anchor": id}``: "add a green star above the
  red circle" (the new object's size is the scene's medium, its place only constrained by ``r``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from rewards.vvr import Obj
from rewards.vvr.tasks import SceneTask

EDIT_KINDS: tuple[str, ...] = ("recolour", "move", "remove", "add")
RELATIONS: tuple[str, ...] = ("left_of", "right_of", "above", "below")
_RELATION_WORDS = {"left_of": "to the left of", "right_of": "to the right of", "above": "above", "below": "below"}
_EDIT_FIELDS = {
    "recolour": ("target", "colour"),
    "move": ("target", "relation", "anchor"),
    "remove": ("target",),
    "add": ("object", "relation", "anchor"),
}


def describe(obj: Obj) -> str:
    """``"red circle"``: how instructions name an object."""
    return f"{obj.colour} {obj.shape}"


@dataclass(frozen=True)
class EditTask(SceneTask):
    """A source scene, an edit, and the edited scene (see the module docstring)."""

    edit: Mapping[str, Any]
    result: tuple[Obj, ...]

    def by_id(self, oid: int) -> Obj:
        return next(o for o in self.objects if o.id == oid)

    @property
    def kind(self) -> str:
        return str(self.edit["kind"])

    @property
    def added(self) -> Obj | None:
        """The object an ``add`` edit creates (None for other kinds)."""
        return Obj.from_dict(self.edit["object"]) if self.kind == "add" else None

    @property
    def prompt(self) -> str:
        """The instruction text."""
        e = self.edit
        if self.kind == "recolour":
            return f"make the {describe(self.by_id(e['target']))} {e['colour']}"
        if self.kind == "remove":
            return f"remove the {describe(self.by_id(e['target']))}"
        where = f"{_RELATION_WORDS[e['relation']]} the {describe(self.by_id(e['anchor']))}"
        if self.kind == "move":
            return f"move the {describe(self.by_id(e['target']))} {where}"
        article = "an" if self.added.colour[0] in "aeiou" else "a"
        return f"add {article} {describe(self.added)} {where}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "level": self.level, "background": self.background,
            "objects": [o.to_dict() for o in self.objects], "edit": dict(self.edit),
            "result": [o.to_dict() for o in self.result], "prompt": self.prompt,
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "EditTask":
        """Validate and build; a ``ValueError`` names the bad field."""
        edit = d.get("edit")
        if not isinstance(edit, Mapping) or edit.get("kind") not in EDIT_KINDS:
            raise ValueError(f"edit.kind: must be one of {', '.join(EDIT_KINDS)}, got {edit!r:.80}")
        missing = [f for f in _EDIT_FIELDS[edit["kind"]] if f not in edit]
        if missing:
            raise ValueError(f"edit: {edit['kind']!r} needs field(s) {missing}")
        if "relation" in edit and edit["relation"] not in RELATIONS:
            raise ValueError(f"edit.relation: {edit['relation']!r} is not one of {', '.join(RELATIONS)}")
        objects = tuple(Obj.from_dict(o, f"objects[{i}]") for i, o in enumerate(d.get("objects", [])))
        ids = {o.id for o in objects}
        for field_name in ("target", "anchor"):
            if field_name in edit and edit[field_name] not in ids:
                raise ValueError(f"edit.{field_name}: no object with id {edit[field_name]!r} in the scene")
        return EditTask(
            id=str(d.get("id", "")), level=str(d.get("level", "easy")), background=str(d.get("background", "white")),
            objects=objects, edit=dict(edit),
            result=tuple(Obj.from_dict(o, f"result[{i}]") for i, o in enumerate(d.get("result", []))),
        )


def scene_dict(task: EditTask, objects: tuple[Obj, ...]) -> dict[str, Any]:
    """A VVR task dict of ``objects`` on the task's background (what :func:`rewards.vvr.render` draws)."""
    return {"id": task.id, "level": task.level, "background": task.background,
            "objects": [o.to_dict() for o in objects], "constraints": [{"type": "total_count", "n": len(objects)}]}


def as_edit_task(task: "EditTask | Mapping[str, Any]") -> EditTask:
    return task if isinstance(task, EditTask) else EditTask.from_dict(task)
