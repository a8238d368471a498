"""How well ``motion_insight`` diagnoses motion: AUCs on injected defects and agreement with the verifier.

Part 1 (no model): held-out VVR motion clips (the ``test`` splits of each level), rendered clean and with
each known defect of ``rewards.motion_insight.defects`` injected (drop, teleport, swap, freeze,
interpenetration), every clip then JPEG-compressed alike. For each dimension: the AUC separating defective
from clean clips by ``1 − score`` over the defects that belong to it, and the full defect × dimension
AUC table (off-diagonal AUCs near 0.5 say a defect leaves the other dimensions alone); for each defect,
how often its dimension's cause names it (``DEFECT_WORDS``).

Part 3 (``--evals``, optional): evaluation folders of ``vvr_motion`` (``flowalign evaluate --out``, e.g. those
``scripts/measure.py`` writes): each one's accuracy and the mean of each dimension over its saved clips.

Part 2 (``--model``, optional): the model's own samples of held-out ``--model-level`` prompts, verified by
``vvr_motion``: mean dimension scores of passed vs failed clips and each dimension's AUC for telling
them apart.

    .venv/bin/python scripts/motion_insight_diagnostics.py --n 60 --size 64 --jpeg 85 \\
        --model assets/tiny-wan-motion --model-n 64
"""

from __future__ import annotations

import argparse
import datetime
import io
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from rewards.motion_insight import DIMENSIONS, build, diagnose
from rewards.motion_insight.defects import (
    DEFECT_DIMENSION,
    DEFECT_WORDS,
    DEFECTS,
    inject,
)
from rewards.vvr_motion import load_split, render

LEVELS = ("easy", "medium", "hard")


def auc(positive: list[float], negative: list[float]) -> float:
    """P(a positive outranks a negative), ties counting half (Mann-Whitney); NaN when a side is empty."""
    if not positive or not negative:
        return float("nan")
    p, n = np.asarray(positive)[:, None], np.asarray(negative)[None, :]
    return float((p > n).mean() + 0.5 * (p == n).mean())


def jpeg(clip: np.ndarray, quality: int) -> np.ndarray:
    """Each frame through a JPEG round trip at ``quality`` (0: untouched)."""
    if not quality:
        return clip
    out = []
    for frame in clip:
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="JPEG", quality=quality)
        out.append(np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB")))
    return np.stack(out)


def injected_defects(n: int, size: int, quality: int) -> dict[str, object]:
    tasks = [t for level in LEVELS for t in load_split(level, "test", n=n)]
    badness: dict[str, dict[str, list[float]]] = {"clean": {d: [] for d in DIMENSIONS}}
    named: dict[str, list[bool]] = {d: [] for d in DEFECTS}
    examples: dict[str, str] = {}
    start = time.perf_counter()
    clips = 0
    for i, task in enumerate(tasks):
        dims = diagnose(build(jpeg(render(task, size), quality), task))
        clips += 1
        for d in DIMENSIONS:
            badness["clean"][d].append(1.0 - dims[d].score)
        for defect in DEFECTS:
            made = inject(defect, task, i, size)
            if made is None:
                continue
            dims = diagnose(build(jpeg(made[0], quality), task))
            clips += 1
            for d in DIMENSIONS:
                badness.setdefault(defect, {k: [] for k in DIMENSIONS})[d].append(1.0 - dims[d].score)
            cause = dims[DEFECT_DIMENSION[defect]].cause
            named[defect].append(DEFECT_WORDS[defect] in cause)
            examples.setdefault(defect, f"{made[1]} → {cause}")
    seconds = time.perf_counter() - start
    matrix = {defect: {d: auc(badness[defect][d], badness["clean"][d]) for d in DIMENSIONS} for defect in DEFECTS}
    per_dimension = {}
    for d in DIMENSIONS:
        mine = [x for defect in DEFECTS if DEFECT_DIMENSION[defect] == d for x in badness[defect][d]]
        per_dimension[d] = auc(mine, badness["clean"][d])
    clean_perfect = float(np.mean([all(badness["clean"][d][k] == 0 for d in DIMENSIONS)
                                   for k in range(len(badness["clean"]["consistency"]))]))
    return {"tasks": len(tasks), "counts": {d: len(badness[d]["consistency"]) for d in DEFECTS},
            "per_dimension": per_dimension, "matrix": matrix, "clean_perfect": clean_perfect,
            "named": {d: float(np.mean(v)) if v else float("nan") for d, v in named.items()},
            "examples": examples, "ms_per_clip": 1000 * seconds / clips}


def model_agreement(model: str, n: int, level: str) -> dict[str, object]:
    import torch

    import pipelines
    from flowalign.benchmarks import load_benchmark
    from flowalign.evaluation import sample_seeded
    from rewards.motion_insight.reward import diagnose_batch

    torch.set_num_threads(1)
    bench = load_benchmark("vvr_motion", level, n, None, split="test")
    policy = pipelines.load(Path(model), device="cpu", dtype=torch.float32)
    start = time.perf_counter()
    samples = sample_seeded(policy, bench.prompts, seed=0, batch_size=16, progress=False, metadata=bench.metadata)
    sampled = time.perf_counter() - start
    verdict = bench.reward(samples, bench.prompts, bench.metadata)
    passed = [bool(i.get("all_passed")) and bool(v) for i, v in zip(verdict.info, verdict.valid.tolist())]
    dims = diagnose_batch(samples, bench.metadata, "motion_insight")
    scores = {d: [x[d].score if x is not None else 0.0 for x in dims] for d in DIMENSIONS}
    out: dict[str, object] = {"n": n, "passed": sum(passed), "sample_s": sampled, "level": level}
    for d in DIMENSIONS:
        ok = [s for s, p in zip(scores[d], passed) if p]
        bad = [s for s, p in zip(scores[d], passed) if not p]
        out[d] = {"pass_mean": float(np.mean(ok)) if ok else float("nan"),
                  "fail_mean": float(np.mean(bad)) if bad else float("nan"), "auc": auc(ok, bad)}
    causes = [x["consistency"].cause or x["continuity"].cause or x["plausibility"].cause
              for x, p in zip(dims, passed) if x is not None and not p]
    out["fail_causes"] = [c for c in causes if c][:3]
    return out


def score_evals(folders: list[str], level: str) -> list[dict[str, object]]:
    """Accuracy and mean dimensions of each evaluation folder's saved clips (tasks: the ``level`` test split)."""
    import json

    from rewards.vvr_motion.video import as_clip

    out = []
    for folder in folders:
        rows = [json.loads(line) for line in (Path(folder) / "results.jsonl").read_text().splitlines() if line.strip()]
        tasks = load_split(level, "test", n=max(int(r["index"]) for r in rows) + 1)
        dims = [diagnose(build(as_clip(Path(folder) / r["file"]), tasks[int(r["index"])])) for r in rows]
        out.append({"folder": folder, "n": len(rows),
                    "accuracy": float(np.mean([bool(r.get("all_passed")) for r in rows])),
                    **{d: float(np.mean([x[d].score for x in dims])) for d in DIMENSIONS}})
    return out


def report(part1: dict[str, object], part2: dict[str, object] | None, args: argparse.Namespace) -> str:
    lines = [f"### motion_insight diagnostics ({datetime.date.today().isoformat()})", "",
             f"`{' '.join(['.venv/bin/python', 'scripts/motion_insight_diagnostics.py', *sys.argv[1:]])}`", "",
             (f"{part1['tasks']} held-out tasks ({args.n} per level of the test splits) rendered at {args.size} px, "
             f"JPEG q{args.jpeg}; each clip clean and with each defect it can hold "
             f"({', '.join(f'{d} {c}' for d, c in part1['counts'].items())} clips); "
             f"{part1['clean_perfect']:.0%} of clean clips have no finding in any dimension; "
             f"{part1['ms_per_clip']:.1f} ms a clip (2 shared CPU cores)."), "",
             "| AUC (defective vs clean, by 1 − score) | " + " | ".join(DIMENSIONS) + " | cause names it |",
             "|---|" + "---|" * (len(DIMENSIONS) + 1)]
    for defect in DEFECTS:
        cells = [f"**{v:.3f}**" if DEFECT_DIMENSION[defect] == d else f"{v:.3f}"
                 for d, v in part1["matrix"][defect].items()]
        lines.append(f"| {defect} ({DEFECT_DIMENSION[defect]}) | " + " | ".join(cells)
                     + f" | {part1['named'][defect]:.0%} |")
    lines.append("| its own defects | " + " | ".join(f"**{part1['per_dimension'][d]:.3f}**" for d in DIMENSIONS) + " | |")
    lines += ["", "Example causes: " + "; ".join(f"{d}: \"{e}\"" for d, e in part1["examples"].items())]
    if part2:
        lines += ["", (f"On {part2['n']} samples of `{args.model}` ({part2['level']} test prompts, its own 20 steps; "
                      f"{part2['passed']} pass `vvr_motion`; sampling {part2['sample_s']:.0f} s):"), "",
                  "| dimension | mean score, passed | mean score, failed | AUC passed vs failed |", "|---|---|---|---|"]
        for d in DIMENSIONS:
            r = part2[d]
            lines.append(f"| {d} | {r['pass_mean']:.3f} | {r['fail_mean']:.3f} | {r['auc']:.3f} |")
        if part2["fail_causes"]:
            lines += ["", "Causes on failed samples: " + "; ".join(f'"{c}"' for c in part2["fail_causes"])]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=60, help="held-out tasks per level (easy, medium, hard)")
    p.add_argument("--size", type=int, default=64, help="frame size (px)")
    p.add_argument("--jpeg", type=int, default=85, help="JPEG quality every clip goes through (0: none)")
    p.add_argument("--model", default=None, help="a motion model folder whose own samples are compared with vvr_motion")
    p.add_argument("--model-n", type=int, default=64, help="samples of --model")
    p.add_argument("--model-level", default="easy", choices=LEVELS, help="the level of --model's prompts")
    p.add_argument("--evals", nargs="+", default=None, help="vvr_motion evaluation folders to score (alone: part 3 only)")
    p.add_argument("--evals-level", default="easy", choices=LEVELS, help="the motion level --evals were evaluated on")
    args = p.parse_args()
    if args.evals:
        print("| evaluation | clips | accuracy | " + " | ".join(DIMENSIONS) + " |")
        print("|---|---|---|" + "---|" * len(DIMENSIONS))
        for r in score_evals(args.evals, args.evals_level):
            print(f"| {r['folder']} | {r['n']} | {100 * r['accuracy']:.1f} % | "
                  + " | ".join(f"{r[d]:.3f}" for d in DIMENSIONS) + " |")
        return
    part1 = injected_defects(args.n, args.size, args.jpeg)
    part2 = model_agreement(args.model, args.model_n, args.model_level) if args.model else None
    print(report(part1, part2, args))


if __name__ == "__main__":
    main()
