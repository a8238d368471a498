"""``sft`` with ``timesteps: diffsynth_flux2``: DiffSynth-Studio's FlowMatchSFTLoss with its FLUX.2 scheduler, as
the CrossTimeEdit authors' SFT runs it (``flowalign/trainers/parts/diffsynth_levels.py``). The known answers
(``known_answers/diffsynth_flux2_sft.json``) are DiffSynth-Studio 079e51c's own scheduler and loss, run unchanged
on a stand-in pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.trainers import trainer_config
from flowalign.trainers.parts.diffsynth_levels import diffsynth_flux2_levels, flux2_training_grid, weighted_errors


KNOWN = json.loads((Path(__file__).parent / "known_answers" / "diffsynth_flux2_sft.json").read_text())
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def test_the_grid_and_its_training_weights_are_diffsynths_flux2_scheduler():
    sigmas, timesteps, weights = flux2_training_grid()
    ids = KNOWN["ids"]
    assert sigmas[ids].tolist() == KNOWN["sigmas"] and timesteps[ids].tolist() == KNOWN["timesteps"]
    assert weights[ids].tolist() == KNOWN["weights"]
    assert float(weights.double().sum()) == pytest.approx(KNOWN["weights_sum"], abs=1e-9)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_each_drawn_level_is_read_where_diffsynth_reads_it_in_the_pipelines_dtype(dtype):
    """The timestep cast to the pipeline's dtype, then looked up by argmin: in bf16 616 of the 1000 draws read a
    neighbouring level (in float32 none)."""
    sigmas, _, _ = flux2_training_grid()
    levels = diffsynth_flux2_levels(torch.arange(1000), DTYPES[dtype])
    read = KNOWN[f"read_level_{dtype}"]
    assert torch.equal(levels.sigma, sigmas[read])
    assert sum(i != j for i, j in enumerate(read)) == (616 if dtype == "bfloat16" else 0)


@pytest.mark.parametrize("case", KNOWN["losses"], ids=lambda c: f"seed{c['seed']}-{c['dtype']}")
def test_the_loss_is_flowmatchsftloss(case):
    """Their loss on a stand-in model ``v = 0.5·x + timestep/1000``: the same state, model timestep and loss."""
    x0 = torch.tensor(case["x0"]).reshape(1, 4, 3, 3)
    eps = torch.tensor(case["noise"]).reshape(1, 4, 3, 3)
    levels = diffsynth_flux2_levels(torch.tensor([case["level"]]), DTYPES[case["dtype"]])
    seen = {}

    def velocity(x, sigma):
        seen["x"], seen["sigma"] = x, sigma
        return 0.5 * x + sigma.reshape(-1, 1, 1, 1) * torch.ones_like(x)

    weighted, _ = weighted_errors(velocity, x0, eps, levels)
    torch.testing.assert_close(seen["x"].flatten(), torch.tensor(case["state"]), rtol=0, atol=1e-6)
    assert float(seen["sigma"][0]) * 1000 == pytest.approx(case["model_timestep"], rel=1e-7)
    assert float(weighted[0]) == pytest.approx(case["loss"], rel=1e-5)


def sft_run(tmp_path, model, *extra):
    return load_config(None, [f"run.output_dir={tmp_path}", f"model.path={model}", "data.bench=vvr", "data.level=medium",
                              "data.n=32", "eval.bench=null", "run.progress=false", "run.tensorboard=false",
                              "trainer.name=sft", "trainer.max_steps=2", "trainer.batch_size=4", "trainer.lr=1e-3",
                              "rewards=[]", "trainer.timesteps=diffsynth_flux2", *extra])


def test_a_step_trains_on_diffsynths_levels_drawn_per_pair_and_step(tmp_path, tiny_sd3_dir):
    sigmas, _, weights = flux2_training_grid()
    t = build_trainer(sft_run(tmp_path / "r", tiny_sd3_dir))
    batch = t.collect(0)
    level = (batch.levels.sigma[:, None] == sigmas[None]).float().argmax(1)
    assert bool((batch.levels.sigma[:, None] == sigmas[None]).any(1).all())  # every state on DiffSynth's grid
    assert torch.equal(batch.sigma, batch.levels.sigma) and torch.equal(batch.levels.weight, weights[level])
    assert len(set(level.tolist())) > 1  # each pair its own draw
    assert torch.equal(t.collect(0).levels.sigma, batch.levels.sigma)  # keyed: a resumed step draws them again
    assert not torch.equal(t.collect(1).levels.sigma, batch.levels.sigma)
    # the trainer's loss is FlowMatchSFTLoss at these levels: the weighted errors over the step's pairs
    n = batch.x0.shape[0]
    with torch.no_grad():
        loss, _ = t.loss(batch, slice(0, n))
        weighted, _ = weighted_errors(t.velocity(batch.cond, 1.0), batch.x0, batch.eps, batch.levels)
    torch.testing.assert_close(loss, weighted.sum() / batch.count)
    before = [p.detach().clone() for p in t.params]
    logs = t.update(batch, torch.Generator().manual_seed(0))
    assert logs["grad_norm"] > 0 and any(not torch.equal(a, b) for a, b in zip(before, t.params))


def test_the_logit_normal_options_are_refused_with_diffsynths_levels():
    for option in ("logit_mean", "noise_levels"):
        value = 0.5 if option == "logit_mean" else "continuous"
        with pytest.raises(UserError, match=f"trainer.{option} sets the logit-normal levels"):
            trainer_config({"name": "sft", "timesteps": "diffsynth_flux2", option: value})
    assert trainer_config({"name": "sft"})[1].timesteps == "logit_normal"
