"""How far a unified model's revisions can carry its reflection loop: the verifier writes the fixes.

    python scripts/umm_oracle_fixes.py --model assets/tiny-qwen-image-umm --split validation --n 100

The model draws its first image of each easy `vvr` task (`flowalign evaluate --rounds 0`'s: ODE, noise seed i,
the model's guidance); the verifier says what is wrong; where the model's fix language can say it ("make the <seen colour>
<shape> <wanted colour>", "add a <colour> <shape>": the two kinds of fix its revisions were taught), that fix
is the reflection, and one ODE revision follows. Printed: the first images' errors by kind, and how many of
the failing ones the oracle's fix repairs. A bound on what any reflection policy trained on this model can
reach in one round: a writer can at best name the right fix, the revision has to carry it out.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

import pipelines
from flowalign.benchmarks import load_benchmark
from flowalign.evaluation import sample_seeded
from flowalign.reflection import instruction
from flowalign.sampling.rollout import rollout
from pipelines.unified import unified
from rewards.vvr.prompts import indefinite
from rewards.vvr.verify import verify


def oracle_fix(task: dict, detected: list[dict]) -> tuple[str, str | None]:
    """The kind of a failing one-object image's error and the fix the model's language has for it (None: it
    has none). ``task``: a vvr task dict with one object; ``detected``: the verifier's objects."""
    (wanted,) = task["objects"]
    if not detected:
        return "nothing drawn", f"add {indefinite(wanted)}"
    if len(detected) > 1:
        return "several objects", None
    (seen,) = detected
    if seen["shape"] == wanted["shape"]:
        return "wrong colour", f"make the {seen['colour']} {seen['shape']} {wanted['colour']}"
    return "wrong shape", None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="assets/tiny-qwen-image-umm")
    p.add_argument("--split", default="validation", choices=["validation", "test"])
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--steps", type=int, default=None, help="sampling steps (default: the model's flowalign.json)")
    args = p.parse_args()

    policy = unified(pipelines.load(args.model, device="cpu", dtype="float32"))  # reflection None: first images
    steps = args.steps or int(policy.editor.defaults["num_steps"])
    bench = load_benchmark("vvr", "easy", args.n, None, split=args.split)
    tasks = [m["task"] for m in bench.metadata]
    first = sample_seeded(policy, bench.prompts, seed=0, num_steps=steps, metadata=bench.metadata,
                          progress=False).float().clamp(0, 1)  # what `flowalign evaluate --rounds 0` scores

    kinds: collections.Counter = collections.Counter()
    fixes: dict[int, tuple[str, str]] = {}  # failing first image -> (its error's kind, the oracle's fix)
    for i, task in enumerate(tasks):
        verdict = verify(task, first[i])
        if verdict.all_passed:
            kinds["passes"] += 1
            continue
        kind, fix = oracle_fix(task, verdict.detected)
        kinds[kind] += 1
        if fix is not None:
            fixes[i] = (kind, fix)
    repaired: collections.Counter = collections.Counter()
    if fixes:
        idx = list(fixes)
        revised = rollout(policy.editor, [instruction(bench.prompts[i], fixes[i][1]) for i in idx],
                          metadata=[{"image": first[i]} for i in idx], num_steps=steps, sampler="ode",
                          guidance_scale=None, generators=[torch.Generator().manual_seed(10_000 + i) for i in idx])
        for j, i in enumerate(idx):
            repaired[fixes[i][0]] += verify(tasks[i], revised.samples[j].float().clamp(0, 1)).all_passed
    failing = len(tasks) - kinds["passes"]
    print(json.dumps({"model": args.model, "split": args.split, "n": len(tasks), "num_steps": steps,
                      "first_images": dict(kinds), "oracle_fixes": len(fixes), "repaired": dict(repaired),
                      "repaired_of_failing": f"{sum(repaired.values())} / {failing}"}, indent=1))


if __name__ == "__main__":
    main()
