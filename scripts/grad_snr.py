"""How much signal is in one step's policy gradient? Measure it before tuning learning rates.

Draws ``--batches`` independent batches of rollouts for the *same* prompts (the trainer's first step,
fresh noise each time), computes each batch's gradient of the trainer's own loss at the starting weights
(every trained SDE step, no optimiser step), and compares the batches. With ``g_b = μ + n_b`` (true
gradient plus batch noise) the expected cosine between two batches is ``|μ|² / (|μ|² + E|n|²)``, so

    SNR² = cos / (1 − cos)        samples for SNR 1 ≈ samples per batch · (1 − cos) / cos

Per SDE step it also reports the gradient norm and the same cosine, to show which timesteps carry the
signal and which dominate the update's size.

    python scripts/grad_snr.py configs/tiny/flow_grpo_vvr.yaml --batches 6 [key=value ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flowalign.config import load_config  # noqa: E402
from flowalign.train import build_trainer  # noqa: E402


def batch_gradients(trainer, prompts, metadata, groups, step: int) -> dict[int, torch.Tensor]:
    """Flattened gradient of the trainer's loss per trained SDE step ``{k: (P,)}`` for one fresh batch."""
    from flowalign.trainers.flow_grpo import StepUnit

    trainer.step = step  # the rollout noise is seeded by (run seed, step, group, member)
    batch = trainer.group_batch(prompts, metadata, groups)
    per_step: dict[int, torch.Tensor] = {}
    for i, (chunk, a) in enumerate(zip(batch.chunks, batch.per_chunk(batch.advantages))):
        if not a.abs().sum() > 0:
            continue
        for k in trainer.trained_steps(chunk):
            loss, _ = trainer.loss(batch, StepUnit(i, k, 1, 0))
            loss.backward()
            grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in trainer.params])
            per_step[k] = per_step.get(k, 0) + grad / len(batch.chunks)
            trainer.optimizer.zero_grad(set_to_none=True)
    return per_step


def pairwise_cosines(vectors: list[torch.Tensor]) -> list[float]:
    return [torch.nn.functional.cosine_similarity(a, b, dim=0).item() for a, b in itertools.combinations(vectors, 2)]


def mean_cosine(vectors: list[torch.Tensor]) -> float:
    cosines = pairwise_cosines(vectors)
    return sum(cosines) / len(cosines)


def module_groups(trainer) -> dict[str, list[tuple[int, int]]]:
    """Slices of the flattened gradient per module group (``blocks.N.attn2``, ``condition_embedder``, ...)."""
    names = {id(p): n for n, p in trainer.policy.trainable.named_parameters()}
    groups: dict[str, list[tuple[int, int]]] = {}
    offset = 0
    for p in trainer.params:
        parts = names.get(id(p), "?").split(".")
        key = ".".join(parts[:3] if parts[0] in ("blocks", "transformer_blocks", "single_transformer_blocks") else parts[:1])
        groups.setdefault(key, []).append((offset, offset + p.numel()))
        offset += p.numel()
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--out", default="runs/grad_snr", help="run folder (the trainer writes its config there)")
    args = parser.parse_intermixed_args()
    cfg = load_config(args.config, [f"run.output_dir={args.out}", "run.resume=never", "eval.at_start=false",
                                    "trainer.steps_per_chunk=0", *args.overrides])
    trainer = build_trainer(cfg)
    prompts, metadata, groups = trainer.step_prompts(0)
    grads = [batch_gradients(trainer, prompts, metadata, groups, step=b) for b in range(args.batches)]
    if any(not g for g in grads):  # every group of a batch had equal rewards: no gradient to compare
        raise SystemExit(f"{sum(not g for g in grads)} of {args.batches} batches had no non-zero advantage; "
                         "use more prompts per step (trainer.prompts_per_step) or a graded reward")
    # Flash-GRPO trains one step per group, drawn afresh per batch: compare whole gradients, and per-step
    # figures only for the steps every batch trained
    totals = [sum(g.values()) for g in grads]
    steps = sorted(set.intersection(*(set(g) for g in grads)))
    cosines = pairwise_cosines(totals)
    cos = sum(cosines) / len(cosines)
    n = len(prompts)
    report = {
        "samples_per_batch": n, "batches": args.batches, "cosine": cos,
        # spread of the pairs (they share batches, so this understates the error of the mean a little)
        "cosine_pair_std": float(torch.tensor(cosines).std()),
        "snr": (max(cos, 0.0) / (1 - cos)) ** 0.5,
        "samples_for_snr_1": n * (1 - cos) / cos if cos > 0 else float("inf"),
        "per_step": {k: {"grad_norm": sum(g[k].norm().item() for g in grads) / len(grads),
                         "cosine": mean_cosine([g[k] for g in grads])} for k in steps},
    }
    # where the signal is: the cosine between batches restricted to each module group's parameters
    report["per_module"] = {}
    for key, spans in module_groups(trainer).items():
        parts = [torch.cat([t[a:b] for a, b in spans]) for t in totals]
        report["per_module"][key] = {"params": int(parts[0].numel()), "cosine": mean_cosine(parts),
                                     "grad_norm": sum(v.norm().item() for v in parts) / len(parts)}
    print(json.dumps(report, indent=2))
    (Path(args.out) / "grad_snr.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
