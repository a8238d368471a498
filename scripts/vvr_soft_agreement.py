"""How well ``vvr_soft`` ranks samples against the hard verifier ``vvr`` (Spearman, docs/rewards.md).

    python scripts/vvr_soft_agreement.py [--model assets/tiny-sd3-vvr] [--n-model 150] [--n-render 100]
                                         [--out runs/vvr_soft_agreement.json]

500 samples by default: the tiny model's ODE samples (its own steps and CFG) for ``--n-model`` medium and
``--n-model`` hard tasks, plus ``--n-render`` programmatic renders of medium + hard scenes and as many
renders with one mutation each (an object moved, recoloured, resized, or dropped). Tasks use seeds
< 1000 (training seeds, never the held-out splits). Prints and writes Spearman's ρ between the two
rewards over all samples and per subset, and the ROC AUC of ``vvr_soft`` for the verifier's all-passed.
"""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import torch


from rewards.vvr.near_miss import mutate_scene  # noqa: E402


#: the mutations of the "render-mutated" subset, in the order the measured run drew them
MUTATED = ("position", "colour", "size", "drop")


def _pixels(images) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 255 for im in images])


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """P(score of a passing sample > score of a failing one), ties counted half."""
    pos, neg = scores[labels], scores[~labels]
    if not len(pos) or not len(neg):
        return float("nan")
    return float(((pos[:, None] > neg[None]).mean() + 0.5 * (pos[:, None] == neg[None]).mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="assets/tiny-sd3-vvr")
    ap.add_argument("--n-model", type=int, default=150, help="model samples per level (medium, hard)")
    ap.add_argument("--n-render", type=int, default=100, help="correct renders (half medium, half hard); as many mutated")
    ap.add_argument("--seed", type=int, default=7, help="task seed (< 1000: never a held-out split)")
    ap.add_argument("--reward-options", default="{}", help='JSON keyword arguments of vvr_soft, e.g. \'{"shapes": true}\'')
    ap.add_argument("--out", default="runs/vvr_soft_agreement.json")
    args = ap.parse_args()

    import pipelines
    import rewards
    from flowalign.evaluation import sample_seeded
    from flowalign.io import write_json
    from flowalign.train import resolve_model_path
    from rewards.vvr import generate_tasks, render

    torch.manual_seed(0)
    soft, hard = rewards.load("vvr_soft", **json.loads(args.reward_options)), rewards.load("vvr")
    groups: dict[str, tuple[torch.Tensor, list]] = {}
    policy = pipelines.load(resolve_model_path(args.model))
    size = int(policy.defaults["height"])
    for level in ("medium", "hard"):
        tasks = generate_tasks(args.n_model, seed=args.seed, level=level)
        with torch.no_grad():
            images = sample_seeded(policy, [t.prompt for t in tasks], seed=args.seed, desc=f"model {level}")
        groups[f"model-{level}"] = (images, tasks)
    rng = random.Random(args.seed)
    half = args.n_render // 2
    rendered = (generate_tasks(half, seed=args.seed + 1, level="medium")
                + generate_tasks(args.n_render - half, seed=args.seed + 1, level="hard"))
    groups["render-correct"] = (_pixels([render(t, size) for t in rendered]), rendered)
    groups["render-mutated"] = (_pixels([render(mutate_scene(t, rng, kinds=MUTATED), size) for t in rendered]), rendered)

    rows = {}
    all_soft, all_hard, all_pass = [], [], []
    for name, (images, tasks) in groups.items():
        meta = [{"task": t} for t in tasks]
        with torch.no_grad():
            s = soft(images, [t.prompt for t in tasks], meta)
        h = hard(images, [t.prompt for t in tasks], meta)
        ok = (s.valid & h.valid).numpy()
        sv, hv = s.components["vvr_soft"].numpy()[ok], h.components["vvr"].numpy()[ok]
        passed = np.array([i["all_passed"] for i in h.info])[ok]
        rows[name] = {"n": int(ok.sum()), "spearman": spearman(sv, hv), "auc_all_passed": auc(sv, passed),
                      "mean_vvr": float(hv.mean()), "mean_vvr_soft": float(sv.mean()), "accuracy": float(passed.mean())}
        all_soft.append(sv), all_hard.append(hv), all_pass.append(passed)
    sv, hv, passed = np.concatenate(all_soft), np.concatenate(all_hard), np.concatenate(all_pass)
    rows["all"] = {"n": len(sv), "spearman": spearman(sv, hv), "auc_all_passed": auc(sv, passed),
                   "mean_vvr": float(hv.mean()), "mean_vvr_soft": float(sv.mean()), "accuracy": float(passed.mean())}
    model = np.concatenate(all_soft[:2]), np.concatenate(all_hard[:2]), np.concatenate(all_pass[:2])
    rows["model-all"] = {"n": len(model[0]), "spearman": spearman(model[0], model[1]),
                         "auc_all_passed": auc(model[0], model[2]), "mean_vvr": float(model[1].mean()),
                         "mean_vvr_soft": float(model[0].mean()), "accuracy": float(model[2].mean())}
    print(f"{'subset':16s} {'n':>4s} {'spearman':>9s} {'AUC(all)':>9s} {'vvr':>6s} {'soft':>6s} {'acc':>6s}")
    for name, r in rows.items():
        print(f"{name:16s} {r['n']:4d} {r['spearman']:9.3f} {r['auc_all_passed']:9.3f} {r['mean_vvr']:6.3f} "
              f"{r['mean_vvr_soft']:6.3f} {r['accuracy']:6.3f}")
    write_json(args.out, {"args": vars(args), "subsets": rows})


if __name__ == "__main__":
    main()
