"""The ``vvr_edit`` verifier: edited image + edit task → per-check pass/fail.

Two groups of checks, all deterministic:

* **the instruction**, as VVR constraints checked by the VVR verifier on the edited image: recolour →
  ``exists`` the new colour and ``absent`` the old one; move → the asked relation between the moved object
  and its anchor; remove → ``absent``; add → ``exists`` and the relation to the anchor; and always
  ``total_count`` (nothing else appeared or vanished);
* **everything not named stays** (``keeps``): each object the edit does not move or create is detected with
  its colour and shape, its centre within ``POSITION_TOL`` of where it was and its size within
  ``SIZE_RATIO`` (the recoloured object with its new colour, in its old place).

The score is VVR's ``(1-γ)·mean + γ·all`` over all checks; ``all_passed`` is the benchmark's accuracy.
"""

from __future__ import annotations

from typing import Any, Mapping

from rewards.vvr import Constraint, Obj, Task, Verdict, verify
from rewards.vvr.verify import score
from rewards.vvr_edit.tasks import EditTask, as_edit_task

#: a kept object's detected centre may move this much (image fractions; 3.8 px at 64 px)
POSITION_TOL = 0.06
#: a kept object's detected extent may differ by this factor either way
SIZE_RATIO = 1.4


def _ref(obj: Obj) -> dict[str, str]:
    return {"colour": obj.colour, "shape": obj.shape}


def instruction_constraints(task: EditTask) -> list[Constraint]:
    """The VVR constraints the edited image must satisfy (see the module docstring)."""
    e = task.edit
    out: list[Constraint] = []
    if task.kind == "recolour":
        old = task.by_id(e["target"])
        out += [Constraint("exists", {"ref": {"colour": e["colour"], "shape": old.shape}}),
                Constraint("absent", {"ref": _ref(old)})]
    elif task.kind == "remove":
        out.append(Constraint("absent", {"ref": _ref(task.by_id(e["target"]))}))
    else:
        moved = task.by_id(e["target"]) if task.kind == "move" else task.added
        if task.kind == "add":
            out.append(Constraint("exists", {"ref": _ref(moved)}))
        out.append(Constraint(e["relation"], {"a": _ref(moved), "b": _ref(task.by_id(e["anchor"]))}))
    out.append(Constraint("total_count", {"n": len(task.result)}))
    return out


def kept_objects(task: EditTask) -> list[Obj]:
    """Objects of the edited scene that must stay where they were (all but a moved or added one)."""
    free = {task.edit["target"]} if task.kind == "move" else set()
    added = task.added
    return [o for o in task.result if o.id not in free and not (added is not None and o.id == added.id)]


def keeps(obj: Obj, detected: list[dict[str, Any]]) -> bool:
    """Whether some detected object has ``obj``'s colour and shape, near its centre, at about its size."""
    extent = obj.box.extent
    for d in detected:
        cx, cy, w, h = d["box"]
        if d["colour"] != obj.colour or d["shape"] != obj.shape:
            continue
        ratio = max(w, h) / extent
        if abs(cx - obj.x) <= POSITION_TOL and abs(cy - obj.y) <= POSITION_TOL and 1 / SIZE_RATIO <= ratio <= SIZE_RATIO:
            return True
    return False


def verify_edit(task: EditTask | Mapping[str, Any], image: Any) -> Verdict:
    """Check an edited ``image`` (PIL, ``(H, W, 3)`` array or ``(3, H, W)`` tensor) against ``task``."""
    task = as_edit_task(task)
    scene = Task(task.id, task.level, task.background, task.result, tuple(instruction_constraints(task)))
    base = verify(scene, image)
    if not base.valid:
        return base
    checks = list(base.constraints) + [("keeps", keeps(o, base.detected)) for o in kept_objects(task)]
    passed = [p for _, p in checks]
    return Verdict(checks, score(passed), all(passed), detected=base.detected)
