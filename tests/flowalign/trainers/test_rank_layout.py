"""N ranks are the single-process algorithm: 2 CPU ranks × 1 prompt take the optimiser steps of one
process × 2 prompts (same rewards, gradient norms and weights), under ddp and fsdp, for LoRA and full
fine-tuning (whose KL reference is a frozen copy), with a random subset of trained steps per rollout
(``steps_per_chunk``) and two optimiser steps per batch, and with DanceGRPO's per-sample step draw; and the
global plan that makes it so."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from flowalign.trainers.base import derived_seed
from flowalign.trainers.parts.global_plan import ChunkRef, global_plan

from .conftest import small_run
from .test_fsdp import TORCHRUN, many, max_diff, optimizer_moments, single, torchrun, weights

# rollout batches of 2 (4 per step in all, 2 per optimiser step), 2 of the 3 trainable steps drawn per rollout
LAYOUT_ARGS = ("trainer.steps_per_chunk=2", "trainer.updates_per_epoch=2", "trainer.advantage=global_std",
               "trainer.batch_size=2", "trainer.beta=0.04", "trainer.clip_range=0.2")
FINETUNE = {"lora": ("model.finetune=lora",), "full": ("model.finetune=full", "trainer.lr=1e-4")}


def test_the_global_plan_is_the_same_for_any_rank_layout():
    """Chunks spread over 1, 2 or 4 ranks (in any local order) give the same optimiser steps, each chunk
    in one of them; a rank's own units are its chunks' share of every step."""
    keys = [(g, m) for g in range(4) for m in (0, 2)]
    active = {k: k != (1, 2) for k in keys}  # one rollout batch has zero advantage: never trained

    def chosen(chunk: ChunkRef, epoch: int) -> list[int]:  # keyed by the chunk, like the trainer's
        g = torch.Generator().manual_seed(derived_seed(0, 3, *chunk.key, epoch, 17))
        return sorted(torch.randperm(len(chunk.steps), generator=g)[:2].tolist())

    def plan(ranks: int) -> list[list[tuple[tuple[int, int], int, int]]]:
        per_rank = [keys[r::ranks][::-1] for r in range(ranks)]  # interleaved and reversed: order must not matter
        refs = [ChunkRef(k, r, i, active[k], (0, 1, 2, 3)) for r, ks in enumerate(per_rank) for i, k in enumerate(ks)]
        steps = global_plan(refs, 2, 3, torch.Generator().manual_seed(5), chosen)
        return [[(c.key, c.rank, k) for c, k in step] for step in steps]

    one = plan(1)
    assert len(one) == 6  # 2 epochs × 3 optimiser steps
    for epoch in (one[:3], one[3:]):
        trained = [key for step in epoch for key, _, _ in step]
        assert sorted(set(trained)) == sorted(k for k in keys if active[k]) and len(trained) == 2 * 7
    for ranks in (2, 4):
        layout = plan(ranks)
        assert [[(key, k) for key, _, k in step] for step in layout] == [[(key, k) for key, _, k in step] for step in one]
        assert all(rank == keys.index(key) % ranks for step in layout for key, rank, _ in step)


def test_counted_inactive_chunks_keep_their_places_and_an_all_inactive_step_is_still_taken():
    """``count_inactive``: the split is over every chunk (the inactive ones stay in their steps' pairs, so they
    count in the steps' sizes), the same for any rank layout; a step of inactive chunks only stays in the plan
    (an optimiser step on a zero gradient, as the authors' loop takes it)."""
    keys = [(g, 0) for g in range(6)]
    active = {k: k[0] in (0, 3) for k in keys}

    def plan(ranks: int, count: bool) -> list[list[tuple[int, int]]]:
        refs = [ChunkRef(k, i % ranks, i // ranks, active[k], (0, 1)) for i, k in enumerate(keys)]
        steps = global_plan(refs, 1, 3, torch.Generator().manual_seed(1), lambda chunk, epoch: [0], count)
        return [[c.key for c, _ in step] for step in steps]

    counted, skipped = plan(1, True), plan(1, False)
    assert plan(2, True) == counted and plan(3, True) == counted
    order = [k for step in skipped for k in step]
    assert sorted(order) == [(0, 0), (3, 0)] and all(len(step) == 1 for step in skipped)
    assert len(counted) == 3 and all(len(step) == 2 for step in counted)  # 6 chunks in 3 steps of 2
    assert sorted(k for step in counted for k in step if active[k]) == [(0, 0), (3, 0)]
    assert any(not any(active[k] for k in step) for step in counted)  # two active chunks fill at most two steps


#: each two-rank layout against the one process it must equal: (its single-process run, its own overrides)
LAYOUTS = {
    "lora-ddp": ("lora", ("parallel.strategy=ddp",)), "full-ddp": ("full", ("parallel.strategy=ddp",)),
    "lora-fsdp": ("lora", ("parallel.strategy=fsdp",)), "full-fsdp": ("full", ("parallel.strategy=fsdp",)),
    # DanceGRPO's per-sample draw keys each sample's steps by its (group, member): 2 ranks draw what one does
    "dance-ddp": ("dance", ("parallel.strategy=ddp",)),
}
SINGLE = {**{name: (*LAYOUT_ARGS, *own) for name, own in FINETUNE.items()},
          # CFG's gradient on the conditional branch, as the other layouts: through both branches (the default) the
          # rank split of the [uncond; cond] rows moves the weights by ~1e-5, over this test's bound
          "dance": ("trainer.name=dance_grpo", "trainer.batch_size=2", "trainer.beta=0.04", "trainer.num_steps=4",
                    "trainer.timestep_fraction=0.7", "trainer.cfg_grad=detached")}


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun missing")
def test_two_ranks_take_the_single_process_steps(tmp_path, tiny_sd3_dir, prompt_file):
    """Each layout's 2 ranks × 1 prompt against one process × 2 prompts: the same rewards, gradient norms,
    weights and optimiser-step counts. All runs of a launch share one process (start-up paid once)."""
    many(single, [small_run(tmp_path / name, tiny_sd3_dir, prompt_file, *own) for name, own in SINGLE.items()],
         tmp_path / "single.json")
    many(torchrun, [small_run(tmp_path / name, tiny_sd3_dir, prompt_file, *SINGLE[one], *own,
                              "trainer.prompts_per_step=1") for name, (one, own) in LAYOUTS.items()],
         tmp_path / "ranks.json")
    rows = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                        if "train/grad_norm" in line]
    start = load_file(str(next((tiny_sd3_dir / "transformer").glob("*.safetensors"))))
    for name, (single_name, _) in LAYOUTS.items():
        ranks, one = tmp_path / name, tmp_path / single_name
        assert len(rows(ranks)) == len(rows(one)) == 2, name
        for a, b in zip(rows(ranks), rows(one)):
            assert a["reward/total"] == pytest.approx(b["reward/total"], abs=1e-6), name
            assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], abs=1e-5), name
            # the KL term ran: after the first optimiser step the policy left its reference
            assert b["train/kl"] > 0, name
        assert max_diff(weights(ranks, 2), weights(one, 2)) < 1e-5, name
    for finetune in FINETUNE:
        ranks, one = tmp_path / f"{finetune}-ddp", tmp_path / finetune
        for run in (one, ranks, tmp_path / f"{finetune}-fsdp"):  # the same optimiser-step count: 2 steps × 2 updates
            assert {s for _, _, s in optimizer_moments(run / "checkpoints" / "step-000002")} == {4.0}, run.name
        moved = weights(one, 2)
        if finetune == "full":
            assert max((moved[k] - start[k]).abs().max().item() for k in moved) > 1e-5
        else:  # LoRA's B starts at zero
            assert max(v.abs().max().item() for k, v in moved.items() if "lora_B" in k) > 0
