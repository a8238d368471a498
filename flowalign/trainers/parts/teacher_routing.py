"""Which teacher supervises a prompt, for trainers that distil several domain teachers into one student.

Two forms. :func:`route` routes each prompt on its own: the first teacher whose regular expression finds it.
:func:`epoch_teacher` is the Flow-OPD authors' (``get_current_dataset_idx`` of ``scripts/train_sd3_opd_mix.py``,
CostaliyA/Flow-OPD @ 434ab16): whole steps (their epochs) alternate between the teachers in a fixed cycle,
teacher ``i`` taking ``epochs_per_cycle[i]`` consecutive steps of it in list order, every prompt of a step
drawn from that teacher's own prompt source (their dataset) and supervised by it. The cycle is a pure
function of the step: no seed, no draw, so a resumed run continues it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from flowalign.data import PromptSet, read_prompt_file
from flowalign.errors import UserError


def route(prompts: list[str], patterns: Sequence[str | None]) -> torch.Tensor:
    """``(N,)`` the index of the first teacher whose pattern finds each prompt (None matches all), −1 for none."""
    compiled = [None if p is None else re.compile(p) for p in patterns]
    out = []
    for prompt in prompts:
        out.append(next((i for i, c in enumerate(compiled) if c is None or c.search(prompt)), -1))
    return torch.tensor(out, dtype=torch.long)


def epoch_teacher(step: int, epochs_per_cycle: Sequence[int]) -> int:
    """The teacher of ``step``: the cycle of ``sum(epochs_per_cycle)`` steps gives teacher 0 its first
    ``epochs_per_cycle[0]`` steps, teacher 1 the next ``epochs_per_cycle[1]``, and so on (the authors' order:
    their ``alternate_datasets`` list, first entry at epoch 0)."""
    position = step % sum(epochs_per_cycle)
    for i, n in enumerate(epochs_per_cycle):
        if position < n:
            return i
        position -= n
    raise AssertionError("unreachable: position < sum(epochs_per_cycle)")


def teacher_epoch(step: int, epochs_per_cycle: Sequence[int]) -> int:
    """How many steps before ``step`` went to its teacher: the step's place in that teacher's own prompt order,
    so each teacher walks through its prompt source without gaps, however the cycle interleaves them."""
    i = epoch_teacher(step, epochs_per_cycle)
    cycles, position = divmod(step, sum(epochs_per_cycle))
    return cycles * epochs_per_cycle[i] + position - sum(epochs_per_cycle[:i])


def teacher_sources(data: PromptSet, files: Sequence[str | None], patterns: Sequence[str | None],
                    field: str = "trainer.teachers") -> list[PromptSet]:
    """Each teacher's prompts under epoch routing: its own prompt file (``files[i]``, read as ``data.prompts``
    is), or else its domain of ``data``: the prompts :func:`route` gives it among the teachers without a file
    (the first match wins, as when routing by prompt; a teacher with a file takes no data prompt). A teacher
    left with no prompt is refused (``field`` names the list in the message)."""
    open_ = [i for i, f in enumerate(files) if f is None]
    routed = route(data.prompts, [patterns[i] for i in open_])
    out = []
    for i, (file, pattern) in enumerate(zip(files, patterns)):
        if file is not None:
            out.append(read_prompt_file(file))
            continue
        members = (routed == open_.index(i)).nonzero().flatten().tolist()
        if not members:
            raise UserError(f"{field}[{i}] (match={pattern!r}) has no prompt: none of the {len(data)} training "
                            "prompts is routed to it first; give it its own prompts: file, or fix its match (a "
                            "regular expression searched in each prompt) or its place in the list")
        out.append(PromptSet([data.prompts[j] for j in members], [data.metadata[j] for j in members]))
    return out
