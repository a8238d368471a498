import json
from pathlib import Path

import pytest
import torch

from flowalign.ema import EMA

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "ema_schedule.json").read_text())


def run(ema: EMA, param: torch.nn.Parameter, weights: torch.Tensor) -> list[torch.Tensor]:
    """Step ``param`` through ``weights[1:]`` as the optimiser would, calling the EMA as the loop does."""
    shadows = []
    for w in weights[1:]:
        ema.before_step()
        with torch.no_grad():
            param.copy_(w)
        ema.update()
        shadows.append(ema.shadow[0].clone())
    return shadows


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"every{c['every']}-micro{c['micro_batches']}")
def test_warmup_schedule_equals_flow_grpos_ema_module_wrapper(case):
    """flow_grpo's EMAModuleWrapper as train_sd3.py calls it (after each micro-batch, the step counted at the
    last): the warm-up decay, the (s + 1) % every phase and the earlier micro-batches' calls."""
    weights = torch.tensor(KNOWN["weights"], dtype=torch.float64)
    param = torch.nn.Parameter(weights[0].clone())
    ema = EMA([param], case["decay"], case["every"], warmup=True, micro_batches=case["micro_batches"])
    got = torch.stack(run(ema, param, weights))
    torch.testing.assert_close(got, torch.tensor(case["shadows"], dtype=torch.float64), rtol=1e-6, atol=1e-12)


def test_constant_schedule_moves_every_every_steps_at_the_fixed_decay():
    weights = torch.tensor(KNOWN["weights"], dtype=torch.float64)
    param = torch.nn.Parameter(weights[0].clone())
    shadows = run(EMA([param], 0.9, 8), param, weights)
    assert torch.equal(shadows[6], weights[0])  # no move before step 8
    torch.testing.assert_close(shadows[7], 0.1 * weights[8])  # 0.9 · start (zeros) + 0.1 · weights after step 8
    torch.testing.assert_close(shadows[15], 0.9 * shadows[7] + 0.1 * weights[16])


def test_the_warmup_follows_young_weights_then_settles_at_the_decay():
    param = torch.nn.Parameter(torch.zeros(3))
    warm, plain = EMA([param], 0.99, warmup=True), EMA([param], 0.99)
    with torch.no_grad():
        param.fill_(1.0)
    warm.update()
    plain.update()
    # after one step the decay is min(0.99, 2 / 11): 82 % of the new weights, against 1 % without warm-up
    torch.testing.assert_close(warm.shadow[0], torch.full((3,), 9 / 11))
    torch.testing.assert_close(plain.shadow[0], torch.full((3,), 0.01))
