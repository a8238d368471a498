"""Evaluate a policy on prompts with a reward: sample with fixed seeds, score, summarise, save."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from flowalign.eval_panel import score_panel, tag_accuracy
from flowalign.io import atomic_dir, write_json, write_jsonl
from flowalign.media import save_image, save_poster, save_video
from flowalign.protocols import FlowPolicy, Reward, RewardOutput
from flowalign.reward_check import check_reward_output
from flowalign.reward_set import RewardSet, RewardTimeout, time_limited
from flowalign.errors import UserError
from flowalign.sampling import OdeSolver, rollout, stream_rollout


def sample_seeded(policy: FlowPolicy, prompts: list[str], **options: Any) -> torch.Tensor:
    """The decoded samples of :func:`sample_seeded_with_notes` (same keyword options), without the notes."""
    return sample_seeded_with_notes(policy, prompts, **options)[0]


def sample_seeded_with_notes(
    policy: FlowPolicy,
    prompts: list[str],
    *,
    seed: int,
    num_steps: int | None = None,
    guidance_scale: float | None = None,
    batch_size: int = 16,
    progress: bool = True,
    desc: str = "sampling",
    metadata: list[dict[str, Any]] | None = None,
    solver: str = "euler",
) -> tuple[torch.Tensor, list[dict[str, str]]]:
    """ODE samples, one per prompt, and per sample the notes its policy wrote about it (``{}`` for most
    policies). Sample ``i`` always gets the noise of ``seed + i`` (so checkpoints compared side by side see
    identical noise whatever the batch size). ``metadata`` (one dict per prompt) carries per-prompt inputs
    such as an editing model's ``image``. ``solver``: ``"euler"`` (the ODE sampler) or ``"dpm2"`` (multistep
    DPM-Solver++(2) on the policy's grid, :class:`~flowalign.sampling.OdeSolver`).

    A policy whose inference is more than one rollout (a unified model's reflect → revise loop) has
    ``sample_for_evaluation(prompts, initial_noise=, seeds=, num_steps=, guidance_scale=, metadata=) ->
    (samples, notes)``: it starts from the same noise, keys its other draws by each sample's ``seed + i``, and
    names what it did per sample (e.g. ``{"reflections": ...}``), shown in results and galleries."""
    steps = int(num_steps or policy.defaults.get("num_steps", 20))
    own = getattr(policy, "sample_for_evaluation", None)
    if solver != "euler" and (own is not None or getattr(policy, "streaming", False)):
        raise UserError(f"--solver {solver}: {policy.family} samples with its own loop (chunk by chunk, or reflect "
                        "-> revise); evaluate it with --solver euler")
    sampler = OdeSolver(solver) if solver != "euler" else "ode"
    out, notes = [], []
    for start in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=not progress, unit="batch"):
        chunk = prompts[start : start + batch_size]
        seeds = [seed + start + i for i in range(len(chunk))]
        noise = torch.cat([policy.initial_noise(1, torch.Generator().manual_seed(s)) for s in seeds])
        meta = None if metadata is None else metadata[start : start + batch_size]
        if own is not None:
            samples, said = own(chunk, initial_noise=noise, seeds=seeds, num_steps=steps,
                                guidance_scale=guidance_scale, metadata=meta)
            out.append(samples.cpu())
            notes += said
            continue
        # chunk by chunk (keeping no cache to fork from: a long stream holds its resident cache only), or whole
        streaming = {"keep_caches": ()} if getattr(policy, "streaming", False) else {}
        sample = stream_rollout if streaming else rollout
        r = sample(policy, chunk, num_steps=steps, sampler=sampler, guidance_scale=guidance_scale, initial_noise=noise,
                   metadata=meta, **streaming)
        out.append(r.samples.cpu())
        notes += [{} for _ in chunk]
    return torch.cat(out), notes


def summarise(rewards_out: Any, n: int, metadata: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``mean_score``, ``valid_fraction`` and, when the reward reports verdicts, ``accuracy`` (all
    constraints passed) and ``per_constraint`` accuracy; with ``metadata`` whose prompts carry a ``tag``,
    ``accuracy/<tag>`` (:func:`flowalign.eval_panel.tag_accuracy`): of the verdicts where the reward gives
    them, else of its scores."""
    valid = rewards_out.valid
    total = rewards_out.total
    metrics: dict[str, Any] = {
        "n": n,
        "valid_fraction": valid.float().mean().item(),
        "mean_score": (torch.where(valid, total, torch.zeros_like(total))).mean().item(),
    }
    infos = rewards_out.info
    if infos and all("all_passed" in i for i in infos):
        metrics["accuracy"] = sum(bool(i["all_passed"]) for i in infos) / n
        per: dict[str, list[bool]] = defaultdict(list)
        for info in infos:
            for ctype, passed in info.get("constraints", []):
                per[ctype].append(bool(passed))
        metrics["per_constraint"] = {k: sum(v) / len(v) for k, v in sorted(per.items())}
    if metadata is not None:
        verdicts = [bool(i["all_passed"]) for i in infos] if "accuracy" in metrics else None
        values = total.detach().float().cpu() if verdicts is None else torch.tensor(verdicts, dtype=torch.float32)
        metrics.update(tag_accuracy(values, valid.cpu().bool(), metadata))
    return metrics


def evaluate(
    policy: FlowPolicy,
    prompts: list[str],
    metadata: list[dict[str, Any]],
    reward: Reward | None,
    *,
    seed: int = 0,
    num_steps: int | None = None,
    guidance_scale: float | None = None,
    batch_size: int = 16,
    out_dir: str | Path | None = None,
    save_samples: bool = True,
    progress: bool = True,
    labels: dict[str, Any] | None = None,
    overwrite: bool = True,
    panel: RewardSet | None = None,
    solver: str = "euler",
) -> dict[str, Any]:
    """Sample every prompt once, score with ``reward`` and write ``metrics.json``, ``results.jsonl`` and
    ``samples/`` under ``out_dir`` (if given), all at once (:func:`flowalign.io.atomic_dir`: other files
    there are kept; ``overwrite=False`` refuses a non-empty folder without an earlier evaluation). Returns
    the metrics.

    ``panel``: more rewards scored on the same samples (:func:`flowalign.eval_panel.score_panel`): their
    means with 95% intervals in the metrics, each sample's in its row's ``scores``. Without ``reward``,
    the panel's first reward gives each row's ``score`` and the tag accuracies."""
    if reward is None and not panel:
        raise ValueError("evaluate needs a reward or a panel of rewards")
    samples, notes = sample_seeded_with_notes(policy, prompts, seed=seed, num_steps=num_steps,
                                              guidance_scale=guidance_scale, batch_size=batch_size,
                                              progress=progress, desc="evaluating", metadata=metadata, solver=solver)
    metrics = dict(labels or {})
    rows: list[dict[str, Any]] = [{"index": i, "prompt": prompt} for i, prompt in enumerate(prompts)]
    if reward is not None:
        scored = score_within_deadline(reward, samples, prompts, metadata)
        metrics.update(summarise(scored, len(prompts), metadata))
        for i, row in enumerate(rows):
            row.update({"valid": bool(scored.valid[i]), "score": float(scored.total[i]),
                        **(scored.info[i] if scored.info else {})})
    if panel:
        panel_metrics, panel_rows = score_panel(panel, samples, prompts, metadata)
        metrics.update(panel_metrics)
        first = panel.names[0]
        judged = reward is None and first in panel_rows[0].get("passed", {})  # the first reward gives verdicts
        for row, extra in zip(rows, panel_rows):
            if reward is None:  # the first reward of the panel is the evaluation's score (and verdict)
                row.update({"valid": extra["scores"][first] is not None, "score": extra["scores"][first]})
                if judged:
                    row["all_passed"] = extra["passed"][first]
            row.update(extra)
        if reward is None:
            metrics.setdefault("reward", first)
            metrics.setdefault("n", len(prompts))
            values = torch.tensor([float("nan") if r["score"] is None else r["score"] for r in rows])
            ok = ~values.isnan()
            if judged:  # e.g. GenEval trained on its partial score: its accuracy is still the strict verdict's
                values = torch.tensor([float(r["all_passed"]) for r in rows])
                metrics["accuracy"] = values.mean().item()
            metrics.update(tag_accuracy(values.nan_to_num(0.0), ok, metadata))
    for row, said in zip(rows, notes):  # the policy's notes beside the rewards' (galleries show them)
        if said:
            row["notes"] = {**said, **row.get("notes", {})}
    if out_dir is not None:
        with atomic_dir(out_dir, writer="evaluate", overwrite=overwrite) as out:
            if save_samples:
                for i, row in enumerate(rows):
                    row["file"] = _save_sample(samples[i], out / "samples", i)
            write_jsonl(out / "results.jsonl", rows)
            write_json(out / "metrics.json", metrics)
    return metrics


def score_within_deadline(reward: Reward, samples: torch.Tensor, prompts: list[str],
                          metadata: list[dict[str, Any]]) -> RewardOutput:
    """``reward`` on ``samples`` under its deadline (:func:`flowalign.reward_set.time_limited`, the default one
    unless it has its own): a call with no answer by then leaves every sample invalid with the reason."""
    name = getattr(reward, "name", type(reward).__name__)
    try:
        return check_reward_output(name, time_limited(name, reward)(samples, prompts, metadata), len(prompts))
    except RewardTimeout as e:
        print(f"warning: reward {name!r} {e}; its {len(prompts)} samples are invalid", flush=True)
        n = len(prompts)
        return RewardOutput({"score": torch.zeros(n)}, torch.zeros(n, dtype=torch.bool),
                            [{"reason": f"{name}: {e}"} for _ in range(n)])


def _save_sample(sample: torch.Tensor, folder: Path, index: int) -> str:
    if sample.ndim == 4:
        path = save_video(sample, folder / f"{index:05d}.mp4")
        save_poster(sample, folder / f"{index:05d}.poster.png")
    else:
        path = save_image(sample, folder / f"{index:05d}.png")
    return str(path.relative_to(folder.parent))
