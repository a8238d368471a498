"""A unified model's own reflection loop (``docs/methods/umm_reflection.md``): from a first image, up to R rounds
of reflect (the model writes about its image) → revise (its generator edits the image with what it wrote as
instruction), ended early by a stop reflection. One loop for training (:mod:`flowalign.trainers.umm_reflection`:
sampled text, SDE revisions whose log-probs it keeps) and evaluation (:func:`sample_reflecting`: the final
image is the sample that is scored; ODE revisions), so what is evaluated is what is trained.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flowalign.protocols import UnifiedPolicy
from flowalign.sampling import Rollout, rollout
from flowalign.trainers.rollouts import derived_seed

#: what a seed of a round's draw is salted with: its reflection's text, its revision's noise
TEXT_SALT, REVISION_SALT = 23, 29

#: ``seed(i, salt, r)``: the seed of trajectory ``i``'s draw ``salt`` in round ``r`` (0-based), so a trajectory's
#: draws depend on nothing else in its batch
Seeds = Callable[[int, int, int], int]
#: ``window(i, r)``: the SDE steps ``(start, width)`` of trajectory ``i``'s revision in round ``r`` (None: every
#: step but the last)
Windows = Callable[[int, int], "tuple[int, int] | None"]


@dataclass(frozen=True)
class Reflection:
    """How a unified model reflects: at most ``rounds`` reflect → revise rounds, reflections of at most
    ``max_new_tokens`` tokens (end token included) written at ``temperature`` (0: greedy), a reflection that is
    empty or contains ``stop_phrase`` (case-insensitive) ending the loop."""

    rounds: int
    max_new_tokens: int
    stop_phrase: str
    temperature: float = 1.0


@dataclass(frozen=True)
class Revision:
    """The rollout of one batch of revisions: trajectories ``index`` (into the loop's N)."""

    index: torch.Tensor
    rollout: Rollout


@dataclass(frozen=True)
class Round:
    """One reflect → revise round over N trajectories.

    ``images (N, 3, H, W)``: the image each reflected on; ``tokens`` / ``log_probs (N, L)``: the reflection
    and its tokens' log-probs in the distribution they were drawn from (at the loop's temperature; -1, 0 for
    a trajectory that had ended); ``texts``: the reflections ("" for an ended trajectory); ``reflected (N,)``:
    the trajectory was still going;
    ``revised (N,)``: it reflected without stopping, so it was revised."""

    images: torch.Tensor
    tokens: torch.Tensor
    log_probs: torch.Tensor
    texts: list[str]
    reflected: torch.Tensor
    revised: torch.Tensor
    revisions: list[Revision]


def stopped(texts: list[str], stop_phrase: str) -> torch.Tensor:
    """``(B,)`` bool: a reflection that is empty or says the stop phrase ends its trajectory."""
    phrase = stop_phrase.lower()
    return torch.tensor([not t.strip() or phrase in t.lower() for t in texts], dtype=torch.bool)


def instruction(prompt: str, reflection: str) -> str:
    """The edit instruction of a revision: the reflection, after the prompt it serves (the revision reads the
    whole context, as a unified model's does)."""
    return f"{prompt}. {reflection}"


def reflect(unified: UnifiedPolicy, first: torch.Tensor, prompts: list[str], how: Reflection, seeds: Seeds, *,
            num_steps: int, guidance_scale: float | None, batch_size: int, sampler: str = "ode",
            noise_level: float | None = None, windows: Windows | None = None) -> tuple[list[Round], torch.Tensor]:
    """The loop from ``first (N, 3, H, W)``: returns its rounds (as many as ``how.rounds``, a round after every
    trajectory stopped included, with nothing reflected) and the final images ``(N, 3, H, W)`` (a trajectory
    that stopped keeps its last image). Revisions: rollouts of ``unified.editor`` (``sampler``, ``noise_level``,
    ``num_steps``, ``guidance_scale``; ``windows``: each revision's SDE window, revisions of one window batched
    together), in batches of ``batch_size``, each
    from its keyed noise. No grad."""
    images, active, rounds = first, torch.ones(len(prompts), dtype=torch.bool), []
    with torch.no_grad():
        for r in range(how.rounds):
            done = reflection_round(unified, images, active, prompts, r, how, seeds, num_steps=num_steps,
                                    guidance_scale=guidance_scale, batch_size=batch_size, sampler=sampler,
                                    noise_level=noise_level, windows=windows)
            rounds.append(done)
            images = images.clone()
            for rev in done.revisions:
                images[rev.index] = rev.rollout.samples.float()
            active = done.revised
    return rounds, images


def reflection_round(unified: UnifiedPolicy, images: torch.Tensor, active: torch.Tensor, prompts: list[str], r: int,
                     how: Reflection, seeds: Seeds, *, num_steps: int, guidance_scale: float | None,
                     batch_size: int, sampler: str, noise_level: float | None,
                     windows: Windows | None = None) -> Round:
    """Round ``r``: the still-going trajectories (``active (N,)``) write a reflection on their image; those that
    did not stop are revised, each on its SDE window (``windows(i, r)``; one rollout holds one window, so the
    revisions are batched by window, each from its own keyed noise whatever its batch)."""
    n = len(prompts)
    going = active.nonzero().flatten().tolist()
    texts = [""] * n
    tokens = torch.full((n, 1), -1, dtype=torch.long)
    log_probs = torch.zeros(n, 1)
    revised = torch.zeros(n, dtype=torch.bool)
    if going:
        gens = [torch.Generator().manual_seed(seeds(i, TEXT_SALT, r)) for i in going]
        written, lp = unified.generate(images[going], [prompts[i] for i in going], how.max_new_tokens, gens,
                                       temperature=how.temperature)
        tokens = torch.full((n, written.shape[1]), -1, dtype=torch.long)
        log_probs = torch.zeros(n, written.shape[1])
        tokens[going], log_probs[going] = written, lp
        said = unified.decode_tokens(written)
        revised[going] = ~stopped(said, how.stop_phrase)
        for i, text in zip(going, said):
            texts[i] = text
    revisions = []
    by_window: dict[tuple[int, int] | None, list[int]] = {}
    for i in revised.nonzero().flatten().tolist():
        window = windows(i, r) if windows is not None and sampler != "ode" else None
        by_window.setdefault(window, []).append(i)
    for window, members in by_window.items():
        for s in range(0, len(members), batch_size):
            il = members[s : s + batch_size]
            gens = [torch.Generator().manual_seed(seeds(i, REVISION_SALT, r)) for i in il]
            drawn = rollout(unified.editor, [instruction(prompts[i], texts[i]) for i in il],
                            metadata=[{"image": images[i]} for i in il], num_steps=num_steps, sampler=sampler,
                            noise_level=noise_level, guidance_scale=guidance_scale, generators=gens,
                            sde_window=window)
            revisions.append(Revision(torch.tensor(il, dtype=torch.long), drawn))
    return Round(images, tokens, log_probs, texts, active.clone(), revised, revisions)


def sample_reflecting(unified: UnifiedPolicy, how: Reflection, prompts: list[str], *, initial_noise: torch.Tensor,
                      seeds: list[int], num_steps: int, guidance_scale: float | None,
                      metadata: list[dict] | None = None) -> tuple[torch.Tensor, list[dict[str, str]]]:
    """What a unified model draws at inference, with no verifier: its first image (an ODE sample from
    ``initial_noise (B, ...)``), then the loop (ODE revisions, each sample's draws keyed by its ``seeds[i]``).
    Returns the final images ``(B, 3, H, W)`` and per sample ``{"reflections": ...}``: what it wrote each
    round (for results and galleries)."""
    first = rollout(unified, prompts, num_steps=num_steps, sampler="ode", guidance_scale=guidance_scale,
                    initial_noise=initial_noise, metadata=metadata).samples.float()
    rounds, final = reflect(unified, first, prompts, how, lambda i, salt, r: derived_seed(seeds[i], salt, r),
                            num_steps=num_steps, guidance_scale=guidance_scale, batch_size=len(prompts))
    notes = []
    for i in range(len(prompts)):
        said = [f"{r + 1}: {rnd.texts[i] or '(nothing)'}" for r, rnd in enumerate(rounds) if rnd.reflected[i]]
        notes.append({"reflections": " | ".join(said)})
    return final, notes
