"""Two DDP ranks are the single-process algorithm for the trainers whose steps span ranks (draws keyed by
sample, statistics gathered, means over every rank's units): 2 CPU ranks × 1 prompt end with identical
weights on both ranks, the same logged rewards and the weights of one process × 2 prompts. All runs of a
layout share one process (``fsdp_many``'s runner: start-up paid once per layout, not once per trainer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from .conftest import small_run
from .test_diffusion_nft import NFT_PARTS
from .test_diffusion_opsd import OPSD_RUN
from .test_fsdp import TORCHRUN, many, single, torchrun
from .test_kvpo import AUTHORS as KVPO
from .test_umm_reflection import MODEL as UMM_MODEL

RED_PROMPTS = "tests.flowalign.trainers.toy_rewards:redness_of_red_prompts"
UMM = ("trainer.name=umm_reflection", "trainer.group_size=2", "trainer.batch_size=2", "trainer.num_steps=2",
       "trainer.max_new_tokens=2", "trainer.guidance_scale=1.0", "trainer.advantage=group", "trainer.max_steps=1")

#: the layouts' weights apart at most (float sums in another order); tighter where a trainer was measured closer
TOLERANCE = {"umm_reflection": 1e-6}


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def last_weights(run: Path) -> dict:
    return load_file(str(max((run / "checkpoints").glob("step-*")) / "trainable.safetensors"))


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun missing")
def test_two_ranks_match_one_process(tmp_path, tiny_model_dir, tiny_sd3_dir, prompt_file, lrr_dir):
    # name: (model folder, overrides of both layouts, the single process's own)
    cases = {
        # one rollout batch of 8 in the single process where each rank rolls out one group of 4
        "flow_grpo": (tiny_sd3_dir, (), ("trainer.batch_size=8",)),
        # ω's mean runs over the optimiser step's samples on every rank (the two groups' steps k differ)
        "flash_grpo": (tiny_sd3_dir, ("trainer.name=flash_grpo", "trainer.num_steps=8"), ()),
        # the parts are drawn over every rank's samples: the same two optimiser steps
        "diffusion_nft": (tiny_sd3_dir, NFT_PARTS, ()),
        # the step's mean runs over every rank's samples: the same θ and behaviour copy φ
        "diffusion_opsd": (tiny_sd3_dir, OPSD_RUN, ()),
        # one optimiser step per visited state, each weighted over every rank's units
        "rg_opd": (tiny_sd3_dir, ("trainer.name=rg_opd", f"trainer.latent_reward={lrr_dir}",
                                  "trainer.active_sigma_min=0.9"), ("trainer.batch_size=8",)),
        # each rank streams one prompt's anchor and branches
        "kvpo": (tiny_model_dir("anyflow_far"), KVPO, ()),
        # trajectories keyed by (group, member), advantages and per-round counts gathered
        "umm_reflection": (UMM_MODEL, UMM, ()),
        # a prompt's flat trunks dropped over every rank (the non-red prompts score 0), the rank left with
        # fewer trunks padding its branch sets up to the other's
        "self_opd": (tiny_sd3_dir, ("trainer.name=self_opd", "trainer.trunks=2", "trainer.branches=2",
                                    "trainer.branch_steps=1", "rewards=[{name: '%s'}]" % RED_PROMPTS), ()),
    }
    run = lambda layout, name, *extra: small_run(tmp_path / layout / name, cases[name][0], prompt_file,
                                                 *cases[name][1], *extra)
    many(torchrun, [run("ddp", name, "trainer.prompts_per_step=1") for name in cases], tmp_path / "ddp.json")
    many(single, [run("one", name, "trainer.prompts_per_step=2", *cases[name][2]) for name in cases],
         tmp_path / "one.json")

    for name in cases:
        ddp, one = tmp_path / "ddp" / name, tmp_path / "one" / name
        state = json.loads((max((ddp / "checkpoints").glob("step-*")) / "trainer_state.json").read_text())
        assert state["world_size"] == 2 and len(set(state["rank_checksums"])) == 1, name  # identical ranks
        assert len(rows(ddp)) == len(rows(one)), name
        for a, b in zip(rows(ddp), rows(one)):  # the same samples: rewards equal whatever the layout
            assert a["reward/total"] == pytest.approx(b["reward/total"], abs=1e-6), name
            assert all(a[k] == pytest.approx(b[k], abs=1e-6) for k in a if k.startswith(("round", "zero_adv"))), name
        wa, wb = last_weights(ddp), last_weights(one)
        limit = TOLERANCE.get(name, 1e-5)
        assert wa.keys() == wb.keys() and max((wa[k] - wb[k]).abs().max().item() for k in wa) < limit, name
        assert max(wa[k].abs().max().item() for k in wa if "lora_B" in k) > 0, name  # B starts at zero: it moved
    assert any(k.startswith("behaviour.") for k in last_weights(tmp_path / "ddp" / "diffusion_opsd"))
    assert 0 < rows(tmp_path / "ddp" / "rg_opd")[0]["train/guided_fraction"] < 1  # σ = 1 guided, the lower not
    assert any(0 < r["trunk/kept_fraction"] < 1 for r in rows(tmp_path / "ddp" / "self_opd"))  # a rank padded
