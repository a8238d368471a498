"""MixGRPO-Flash's compressed ODE tail (flowalign/sampling/compressed_tail.py) against the authors' sampler.

Known answers (``known_answers/mix_grpo_flash_rollout.json``) come from MixGRPO's ``run_sample_step``
(Tencent-Hunyuan/MixGRPO @ e5cdd6a, ``fastvideo/utils/sampling_utils.py``) run unchanged with its Flash settings
(``dpmsolver++``, ``post``, order 2, ``midpoint``, ``--flow_grpo_sampling`` η 0.7, shift 3) on a toy transformer
``v = c0 − (0.5 + 0.4·t)·x`` reading their ``int(1000·σ)/1000``; each SDE step's noise was drawn per sample from
seeded generators as flowalign's rollouts draw it, so the two trajectories can be compared latent for latent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowalign.sampling import CompressedTail, rollout
from flowalign.sampling.timesteps import ShiftedGrid, shifted_grid, truncated

from .test_ode_solvers import ToyPolicy

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "mix_grpo_flash_rollout.json").read_text())
Z = torch.tensor(KNOWN["z"], dtype=torch.float32)
C0 = torch.tensor(KNOWN["c0"], dtype=torch.float64)


def _rollout(T: int, window: list[int], seeds: list[int], tail: CompressedTail | None, eta: float = 0.7,
             shift: float = 3.0):
    policy = ToyPolicy(C0, shifted_grid(T, shift))
    out = rollout(policy, ["a"] * len(Z), num_steps=T, sampler="flow_grpo", noise_level=eta,
                  sde_window=(window[0], len(window)), initial_noise=Z, decode=False,
                  generators=[torch.Generator().manual_seed(s) for s in seeds], grid=ShiftedGrid(shift),
                  timestep_form=truncated, tail=tail)
    return policy, out


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"T{c['num_steps']}-w{c['window'][0]}-r{c['ratio']}")
def test_the_rollout_equals_the_authors_run_sample_step(case):
    T, window, seeds = case["num_steps"], case["window"], case["seeds"]
    for i, noise in enumerate(case["sde_noise"]):  # the generators draw the noise the answer was made with
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        draws = [[torch.randn(Z.shape[1:], generator=g) for _ in range(i + 1)][-1] for g in gens]
        assert torch.equal(torch.stack(draws), torch.tensor(noise))
    policy, out = _rollout(T, window, seeds, CompressedTail(case["shift"], case["ratio"]))
    assert out.sigmas.tolist() == case["sigmas"]  # the compressed grid, point for point
    assert out.num_steps == len(case["sigmas"]) - 1 < T
    # the integer timestep at every step, the tail's included (theirs read it over 1000)
    assert policy.transformer.timesteps == [float(round(1000 * t)) for t in case["timesteps"]]
    assert out.trained_steps() == window
    torch.testing.assert_close(out.latents.double(), torch.tensor(case["latents"], dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.log_probs[:, window].double(),
                               torch.tensor(case["window_log_probs"], dtype=torch.float64), rtol=1e-5, atol=1e-4)
    assert torch.isnan(out.log_probs[:, window[-1] + 1:]).all()  # the tail is deterministic


@pytest.mark.parametrize("ratio", [0.4, 0.2])
def test_the_compressed_grids_are_the_authors_and_always_reach_zero(ratio):
    """Every window their GRPOTrainingStates visits at 25 steps: the grid equals theirs wherever theirs ends at
    σ = 0; where it keeps a single point (a window within 4 steps of the end at 0.4), theirs stops at
    σ_{last+1} > 0 and flowalign's adds the step to 0."""
    grids = [g for g in KNOWN["grids"] if g["ratio"] == ratio]
    assert len(grids) == 23
    stopped = 0
    for g in grids:
        ours = CompressedTail(3.0, ratio).sigmas(25, g["window"][-1]).tolist()
        if g["sigmas"][-1] == 0:
            assert ours == g["sigmas"]
        else:
            stopped += 1
            assert ours == g["sigmas"] + [0.0]
    assert stopped > 0  # the fixture reaches the windows where the two differ


def test_the_steps_through_the_window_are_those_of_the_full_grid():
    """The tail changes nothing before and in the window (same noise, same states, same log-probs); it changes
    the sample, on fewer steps, and not by much on this smooth toy (both integrate the same ODE)."""
    _, full = _rollout(25, [3, 4, 5, 6], [5, 6], None)
    _, flash = _rollout(25, [3, 4, 5, 6], [5, 6], CompressedTail(3.0, 0.4))
    assert flash.num_steps == 7 + int(18 * 0.4) - 1 and full.num_steps == 25
    assert torch.equal(flash.latents[:, :8], full.latents[:, :8])
    assert torch.equal(flash.sigmas[:8], full.sigmas[:8])
    assert torch.equal(flash.log_probs[:, :7].nan_to_num(), full.log_probs[:, :7].nan_to_num())
    gap = (flash.final_latents - full.final_latents).abs().max()
    assert 1e-4 < gap < 0.1 * full.final_latents.abs().max()


def test_a_tail_is_refused_off_the_shifted_grid_and_without_a_window():
    tail = CompressedTail(3.0, 0.4)
    with pytest.raises(ValueError, match="sigma_grid: shifted"):
        tail.apply(shifted_grid(10, 2.0), torch.tensor([True] * 3 + [False] * 7))
    with pytest.raises(ValueError, match="no SDE step"):
        tail.apply(shifted_grid(10, 3.0), torch.zeros(10, dtype=torch.bool))
    with pytest.raises(ValueError, match="ratio"):
        CompressedTail(3.0, 0.0)
