"""Do DiffusionOPSD's targets improve what the verifier sees? A check of a differentiable reward's gradient.

    python scripts/opsd_targets.py [--reward vvr_soft] [--level medium] [--n 96] [--rho 0.1 0.3]
                                   [--out runs/opsd_targets.json]

OPSD fits the policy toward ``y⁺`` (``n`` normalised steps up ``∇_y R(D(y))`` from the anchor ``y0``, within
``ρ‖y0‖``) and away from ``y⁻``. It can only raise verified accuracy if decoding ``y⁺`` scores higher under
the hard verifier than decoding ``y0``, and ``y⁻`` lower. This script samples the tiny model with the OPSD
config's ODE rollouts (10 steps, the model's CFG) on fresh tasks (seed < 1000), builds ``y0`` at the query
state σ* and ``y±`` exactly as the trainer does (the same functions), and reports, per ρ, the verifier's
partial-credit score and accuracy of ``D(y⁻)``, ``D(y0)``, ``D(y⁺)``, plus how many samples ``y⁺`` fixes and
breaks against ``y0``. The reward's own score of each is printed too (it should rise y⁻ → y0 → y⁺).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch



def anchor(policy, chunk, *, sigma_star: float, where: str = "query", guidance: float | None = None) -> torch.Tensor:
    """``y0`` ``(B, ...)``: the trainer's anchor at the query state (``"query"``, via the trainer's own
    :func:`query_anchor`), or the rollout's final latents (``"final"``)."""
    from flowalign.trainers.diffusion_opsd import query_anchor

    return query_anchor(policy, chunk, sigma_star, guidance)[3] if where == "query" else chunk.final_latents.to(policy.device)


def targets(policy, rewards: list, chunk, y0: torch.Tensor, *, rho: float, ascent_steps: int,
            eta: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y⁺, y⁻)`` from ``y0`` exactly as ``DiffusionOPSDTrainer.prepare`` builds them. ``rewards``:
    ``(name, weight, reward)`` triples, as a trainer holds them."""
    from flowalign.trainers.diffusion_opsd import bounded_targets, pixel_reward_gradient

    grad_fn = pixel_reward_gradient(policy, rewards, chunk.prompts, chunk.metadata)
    return bounded_targets(y0, grad_fn, rho, ascent_steps, eta)


def score(policy, y: torch.Tensor, soft, judge, prompts: list[str], meta: list[dict]) -> dict[str, list]:
    """Decode latents ``y`` once; the verifier's partial-credit score and verdict, and the reward's score."""
    with torch.no_grad():
        images = policy.decode(y)
        s = soft(images, prompts, meta).total
    h = judge(images, prompts, meta)
    return {"vvr": h.total.tolist(), "passed": [bool(i["all_passed"]) for i in h.info], "soft": s.tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="assets/tiny-sd3-vvr")
    ap.add_argument("--reward", default="vvr_soft", help="a registered differentiable reward")
    ap.add_argument("--reward-options", default="{}", help='JSON keyword arguments of the reward, e.g. \'{"count_gradients": false}\'')
    ap.add_argument("--level", default="medium")
    ap.add_argument("--n", type=int, default=96)
    ap.add_argument("--seed", type=int, default=7, help="task and noise seed (< 1000: never a held-out split)")
    ap.add_argument("--steps", type=int, default=10, help="ODE rollout steps (the OPSD config's)")
    ap.add_argument("--sigma-star", type=float, default=0.278)
    ap.add_argument("--anchor", choices=["query", "final"], default="query",
                    help="y0 at the query state (the trainer's) or the rollout's final latent")
    ap.add_argument("--fit-guidance", type=float, default=None,
                    help="CFG scale of the anchor's velocity (the trainer's trainer.fit_guidance; default: the rollout's)")
    ap.add_argument("--rho", type=float, nargs="+", default=[0.1, 0.3])
    ap.add_argument("--ascent-steps", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default="runs/opsd_targets.json")
    args = ap.parse_args()

    import json

    import pipelines
    import rewards
    from flowalign.io import write_json
    from flowalign.sampling import rollout
    from flowalign.train import resolve_model_path
    from rewards.vvr import generate_tasks

    torch.manual_seed(0)
    policy = pipelines.load(resolve_model_path(args.model))
    soft = rewards.load(args.reward, **json.loads(args.reward_options))
    judge = rewards.load("vvr", partial_credit=True)
    if not getattr(soft, "differentiable", False):
        raise SystemExit(f"--reward {args.reward!r} is not differentiable")
    tasks = generate_tasks(args.n, seed=args.seed, level=args.level)
    names = ["y-", "y0", "y+"]
    res = {rho: {k: {"vvr": [], "passed": [], "soft": []} for k in names} for rho in args.rho}
    kinds = [t.constraints[0].type if len(t.constraints) == 1 else "several" for t in tasks]
    for start in range(0, len(tasks), args.batch_size):
        chunk = tasks[start : start + args.batch_size]
        prompts, meta = [t.prompt for t in chunk], [{"task": t} for t in chunk]
        gen = torch.Generator().manual_seed(args.seed * 100_003 + start)
        with torch.no_grad():
            r = rollout(policy, prompts, num_steps=args.steps, sampler="ode", generator=gen, metadata=meta, decode=False)
        y0 = anchor(policy, r, sigma_star=args.sigma_star, where=args.anchor, guidance=args.fit_guidance)
        scored = {"y0": score(policy, y0, soft, judge, prompts, meta)}  # y0 does not depend on ρ: decoded once
        for rho in args.rho:
            y_pos, y_neg = targets(policy, [(args.reward, 1.0, soft)], r, y0, rho=rho, ascent_steps=args.ascent_steps)
            scored["y+"], scored["y-"] = (score(policy, y, soft, judge, prompts, meta) for y in (y_pos, y_neg))
            for name in names:
                for key in ("vvr", "passed", "soft"):
                    res[rho][name][key] += scored[name][key]
        print(f"{start + len(chunk)}/{len(tasks)} tasks", flush=True)

    summary = {}
    print(f"{'rho':>5s} {'target':>6s} {'vvr(pc)':>8s} {'acc':>6s} {args.reward:>9s}   y+ vs y0: fixed/broken, vvr up/down")
    for rho in args.rho:
        row = {}
        for name in names:
            d = res[rho][name]
            row[name] = {"vvr": float(np.mean(d["vvr"])), "accuracy": float(np.mean(d["passed"])), "soft": float(np.mean(d["soft"]))}
        p0, pp = np.array(res[rho]["y0"]["passed"]), np.array(res[rho]["y+"]["passed"])
        v0, vp = np.array(res[rho]["y0"]["vvr"]), np.array(res[rho]["y+"]["vvr"])
        row["fixed"], row["broken"] = int((pp & ~p0).sum()), int((p0 & ~pp).sum())
        row["vvr_up"], row["vvr_down"] = int((vp > v0).sum()), int((vp < v0).sum())
        by_type = {}
        for kind in sorted(set(kinds)):
            idx = np.array([k == kind for k in kinds])
            by_type[kind] = {"n": int(idx.sum()), "vvr_y0": float(v0[idx].mean()), "vvr_y+": float(vp[idx].mean()),
                             "fixed": int((pp & ~p0 & idx).sum()), "broken": int((p0 & ~pp & idx).sum())}
        row["by_constraint"] = by_type
        summary[str(rho)] = row
        for name in names:
            print(f"{rho:5.2f} {name:>6s} {row[name]['vvr']:8.3f} {row[name]['accuracy']:6.3f} {row[name]['soft']:9.3f}"
                  + (f"   {row['fixed']}/{row['broken']}, {row['vvr_up']}/{row['vvr_down']}" if name == "y+" else ""))
    print_by_constraint(summary)
    write_json(args.out, {"args": vars(args), "by_rho": summary})


def print_by_constraint(summary: dict) -> None:
    for rho, row in summary.items():
        print(f"ρ {rho}: y+ against y0 by constraint type (n, vvr y0 → y+, fixed/broken)")
        for kind, d in row["by_constraint"].items():
            print(f"  {kind:22s} {d['n']:4d}  {d['vvr_y0']:.3f} → {d['vvr_y+']:.3f}  {d['fixed']}/{d['broken']}")


if __name__ == "__main__":
    main()
