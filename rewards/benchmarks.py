"""Benchmarks by name: the prompts, per-sample metadata and reward of an evaluation split.

The loaders and renderers here are what ``PLUGINS`` in ``rewards/__init__.py`` (and the
``flowalign.benchmarks`` / ``flowalign.renderers`` entry points) name; ``flowalign evaluate --bench NAME``
reaches them through :func:`flowalign.benchmarks.load_benchmark`, so the core never knows what a VVR task is.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from flowalign.benchmarks import TRAIN, Benchmark, scored_by
from flowalign.errors import UserError
from rewards.registry import load as load_reward

LEVELS = ("easy", "medium", "hard")
#: side of the rendered source scenes handed to editing models (they resize to their own resolution)
EDIT_IMAGE_SIZE = 256


def check_level(level: str) -> None:
    if level not in LEVELS:
        raise UserError(f"unknown level {level!r} for --level; choose one of {', '.join(LEVELS)}")


@scored_by("vvr")
def load_vvr(level: str, split: str, n: int | None, seed: int | None) -> Benchmark:
    """A VVR image split (``validation`` / ``test``: the shipped file, or a fresh one drawn with ``seed``), or
    training draws (``train``: held-out compositions excluded)."""
    check_level(level)
    from rewards.vvr import generate_tasks, load_split

    tasks = generate_tasks(n or 500, seed=seed or 0, level=level) if split == TRAIN else load_split(level, split, n, seed)
    return Benchmark(f"vvr-{level}", [t.prompt for t in tasks], [{"task": t.to_dict()} for t in tasks],
                     load_reward("vvr"), split)


@scored_by("vvr_motion")
def load_vvr_motion(level: str, split: str, n: int | None, seed: int | None) -> Benchmark:
    """A VVR-motion video split, or training draws (see :func:`load_vvr`)."""
    check_level(level)
    from rewards.vvr_motion import generate_tasks, load_split

    tasks = generate_tasks(n or 500, seed=seed or 0, level=level) if split == TRAIN else load_split(level, split, n, seed)
    return Benchmark(f"vvr_motion-{level}", [t.prompt for t in tasks], [{"task": t.to_dict()} for t in tasks],
                     load_reward("vvr_motion"), split)


@scored_by("vvr_edit")
def load_vvr_edit(level: str, split: str, n: int | None, seed: int | None) -> Benchmark:
    """Editing: each prompt's metadata carries the task and its rendered source scene as the input ``image``
    (rendered on use: thousands of training draws would otherwise hold their images in memory)."""
    check_level(level)
    from rewards.vvr_edit import generate_edit_tasks, load_split, render_source

    if split == TRAIN:
        tasks = generate_edit_tasks(n or 500, seed=seed or 0, level=level, heldout="exclude")
    else:
        tasks = load_split(level, split, n, seed)
    metadata = [{"task": t.to_dict(), "image": partial(render_source, t, size=EDIT_IMAGE_SIZE)} for t in tasks]
    return Benchmark(f"vvr_edit-{level}", [t.prompt for t in tasks], metadata, load_reward("vvr_edit"), split)


@scored_by("compass_fr")
def load_sr(level: str, split: str, n: int | None, seed: int | None) -> Benchmark:
    """Super-resolution: each prompt's metadata carries the task and its LR image as the input ``image``
    (degraded on use), the HR scene being the target; scored by ``compass_fr`` (the HR is known here)."""
    check_level(level)
    from rewards.sr import generate_sr_tasks, load_split, render_lr

    tasks = generate_sr_tasks(n or 500, seed=seed or 0, level=level) if split == TRAIN else load_split(level, split, n, seed)
    metadata = [{"task": t.to_dict(), "image": partial(render_lr, t)} for t in tasks]
    return Benchmark(f"sr-{level}", [t.prompt for t in tasks], metadata, load_reward("compass_fr"), split)


def render_sr(metadata: dict[str, Any], size: int):
    """The HR scene of one super-resolution task (the target a flow-matching cold start trains toward)."""
    from rewards.sr import render_hr

    if "task" not in metadata:
        raise UserError("an sr training item has no 'task' in its metadata; draw tasks with data.bench: sr")
    return render_hr(metadata["task"], size=size)


@scored_by("ocr")
def load_ocr(level: str, split: str, n: int | None, seed: int | None) -> Benchmark:
    """An OCR split (the level is the number of quoted words), scored by the ``ocr`` reward with its default
    engine (rapidocr: PP-OCRv4 on the CPU), or training draws (see :func:`load_vvr`), which build no reward:
    training scores with the config's own ``rewards``, whose engine may differ."""
    check_level(level)
    from rewards.ocr import generate_tasks, load_split

    if split == TRAIN:
        tasks, reward = generate_tasks(n or 500, seed=seed or 0, level=level), None
    else:
        tasks, reward = load_split(level, split, n, seed), load_reward("ocr")
    return Benchmark(f"ocr-{level}", [t.prompt for t in tasks], [t.metadata() for t in tasks], reward, split)


def render_vvr(metadata: dict[str, Any], size: int):
    """The scene of one VVR task as a PIL image (what :func:`flowalign.benchmarks.render_task` converts)."""
    from rewards.vvr import render

    if "task" not in metadata:
        raise UserError("a vvr training item has no 'task' in its metadata; draw tasks with data.bench: vvr")
    return render(metadata["task"], size=size)


def render_vvr_motion(metadata: dict[str, Any], size: int):
    """The clip of one VVR-motion task, uint8 ``(F, size, size, 3)``."""
    from rewards.vvr_motion import render

    if "task" not in metadata:
        raise UserError("a vvr_motion item has no 'task' in its metadata; draw tasks with data.bench: vvr_motion")
    return render(metadata["task"], size=size)


#: the fallback for the ``geneval`` benchmark's weight folders when its reward options do not name them
GENEVAL_ENV = {"path": "FLOWALIGN_GENEVAL_PATH", "clip_path": "FLOWALIGN_GENEVAL_CLIP_PATH"}
GENEVAL_DOWNLOADS = {"path": "a download of facebook/mask2former-swin-small-coco-instance",
                     "clip_path": "a download of openai/clip-vit-large-patch14"}


def geneval_options(options: dict[str, Any]) -> dict[str, Any]:
    """The ``geneval`` reward's options for the benchmark: ``score: strict``, ``jpeg_quality: null`` and
    ``detector_channels: rgb`` (GenEval's evaluator reads the image files uncompressed, in order) unless given, and ``path`` / ``clip_path`` not given read from
    ``$FLOWALIGN_GENEVAL_PATH`` / ``$FLOWALIGN_GENEVAL_CLIP_PATH``."""
    import os

    out = {"score": "strict", "jpeg_quality": None, "detector_channels": "rgb", **options}
    for option, var in GENEVAL_ENV.items():
        if out.get(option) is None and os.environ.get(var):
            out[option] = os.environ[var]
    return out


class DeferredGenEval:
    """The ``geneval`` reward with ``score: strict`` (so mean scores are GenEval accuracies), built on its first
    call with ``options`` (``eval.reward_options`` / ``evaluate --reward-option``); ``path`` and ``clip_path``
    not given there are read from ``$FLOWALIGN_GENEVAL_PATH`` / ``$FLOWALIGN_GENEVAL_CLIP_PATH``. Training
    draws never score with it, and an evaluation split checks the folders exist when it is loaded."""

    name = "geneval"
    differentiable = False
    requires_metadata = ("tag", "include")

    def __init__(self, check: bool, options: dict[str, Any] | None = None):
        import os

        self.options = geneval_options(options or {})
        self._reward = None
        if check:
            for option, var in GENEVAL_ENV.items():
                value = self.options.get(option)
                if not value or not os.path.isdir(str(value)):
                    raise UserError(f"benchmark geneval scores with the geneval reward: set its {option} to "
                                    f"{GENEVAL_DOWNLOADS[option]} (now {value!r}) with --reward-option "
                                    f"{option}=DIR or eval.reward_options.{option} (or ${var})")

    def __call__(self, samples, prompts, metadata):
        if self._reward is None:
            self._reward = load_reward("geneval", **self.options)
        return self._reward(samples, prompts, metadata)


@scored_by("geneval", geneval_options)
def load_geneval(level: str, split: str, n: int | None, seed: int | None,
                 reward_options: dict[str, Any] | None = None) -> Benchmark:
    """The GenEval-style split (``level`` does not apply: GenEval has one), or training draws (``train``:
    held-out compositions excluded). Each prompt's metadata is its GenEval metadata line. ``reward_options``:
    the ``geneval`` reward's options (``path``, ``clip_path``, ``device``, ...)."""
    check_level(level)
    from rewards.geneval.prompts import generate_tasks
    from rewards.geneval.splits import load_split

    tasks = generate_tasks(n or 500, seed=seed or 0) if split == TRAIN else load_split(split, n, seed)
    metadata = [{k: v for k, v in t.items() if k != "prompt"} for t in tasks]
    return Benchmark("geneval", [t["prompt"] for t in tasks], metadata, DeferredGenEval(check=split != TRAIN, options=reward_options), split)
