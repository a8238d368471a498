"""perf/tflops_per_s and perf/mfu: the transformer's passes counted as they run (flowalign/flop_meter.py)."""

from __future__ import annotations

import pytest
import torch
from diffusers import SD3Transformer2DModel
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from flowalign import flop_meter, step_metrics
from flowalign.flop_meter import FlopMeter
from pipelines.memory import transformer_inputs

SIZE = {"height": 64, "width": 64, "max_sequence_length": 16}


@pytest.fixture(scope="module")
def transformer(tiny_model_dir):
    return SD3Transformer2DModel.from_pretrained(tiny_model_dir("sd3") / "transformer")


def inputs(transformer: nn.Module, rows: int) -> dict:
    return transformer_inputs("sd3", transformer.config, rows, SIZE, device="cpu")


def test_a_call_counts_one_forward_as_the_real_forward_counts_and_three_with_gradients(transformer):
    """The meta copy's count at a call's shapes is what torch's counter finds in the real forward on the CPU
    (attention as SDPA's math form there: the counter has no formula for the CPU's fused kernel; it has for
    CUDA's); a pass with gradients counts three forwards, and the count is linear in the rows."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with FlopCounterMode(display=False) as real, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        transformer(**inputs(transformer, 2))
    forward = float(real.get_total_flops())
    assert any("bmm" in str(op) for op in real.get_flop_counts()["Global"])  # attention counted
    meter = FlopMeter([transformer])
    with torch.no_grad():
        transformer(**inputs(transformer, 2))
    assert meter.take() == forward > 0
    transformer(**inputs(transformer, 2))[0].sum()  # gradients on (the weights require them)
    transformer(**inputs(transformer, 4))
    assert meter.take() == pytest.approx(3 * forward + 3 * 2 * forward, rel=1e-9)
    assert meter.take() == 0.0 and len(meter._per_call) == 2  # one meta forward per shape
    meter._per_call.update({i: 1.0 for i in range(flop_meter.MAX_SHAPES)})  # a model called at many shapes
    with torch.no_grad():
        transformer(**inputs(transformer, 3))
    assert meter.take() is None  # no longer counted, rather than a meta forward at every call


class ReadsValues(nn.Module):
    """A model whose forward depends on tensor values: not countable on the meta device."""

    config = {}

    @classmethod
    def from_config(cls, config):
        return cls()

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.w if x.sum().item() > 0 else x


def test_a_forward_the_meta_device_cannot_run_leaves_the_count_unknown():
    model = ReadsValues()
    meter = FlopMeter([model])
    model(torch.ones(3))
    assert meter.take() is None and step_metrics.step_logs("cpu", 1.0, 4, None) == {"perf/samples_per_s": 4.0}


def test_mfu_is_the_rate_over_the_device_peak():
    logs = step_metrics.step_logs("cpu", 2.0, None, flops=3e12, peak=1.5)
    assert logs == {"perf/tflops_per_s": 1.5, "perf/mfu": 1.0}
    assert "perf/mfu" not in step_metrics.step_logs("cpu", 2.0, None, flops=3e12, peak=None)
    assert flop_meter.peak_tflops("cpu") is None and flop_meter.peak_tflops("cpu", 100.0) == 100.0
    assert dict(flop_meter.PEAK_TFLOPS)["H200"] == 989.4


def test_a_training_step_logs_the_transformers_rate(tiny_sd3_dir, tmp_path):
    """A Flow-GRPO step logs perf/tflops_per_s: its rollouts' and updates' FLOPs over the step's seconds, and
    perf/mfu over run.peak_tflops (on a CPU, only when that is given); an evaluation before the step is not
    counted in it."""
    from flowalign.config import load_config
    from flowalign.train import build_trainer

    overrides = [f"model.path={tiny_sd3_dir}", f"run.output_dir={tmp_path / 'run'}", "run.progress=false",
                 "run.tensorboard=false", "run.peak_tflops=0.001", "trainer.prompts_per_step=1", "trainer.group_size=2",
                 "trainer.batch_size=2", "trainer.num_steps=2", "data.n=4", "eval.bench=null",
                 "rewards=[{name: brightness}]"]
    trainer = build_trainer(load_config(None, overrides))
    meter_flops = []
    take = trainer.flop_meter.take
    trainer.flop_meter.take = lambda: meter_flops.append(take()) or meter_flops[-1]
    with torch.no_grad():  # an evaluation's passes, before the step
        trainer.policy.velocity(trainer.policy.initial_noise(1), 0.5, trainer.policy.encode(["x"]), 1.0)
    calls = []  # every call of the step, with its inputs, counted independently below
    copy = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    hook = trainer.policy.transformer.register_forward_pre_hook(
        lambda m, a, k: calls.append(([copy(v) for v in a], {n: copy(v) for n, v in k.items()}, torch.is_grad_enabled())),
        with_kwargs=True)
    logs = trainer.train_step()
    hook.remove()
    assert meter_flops[0] > 0  # the evaluation's, dropped when the step began
    assert logs["perf/tflops_per_s"] == pytest.approx(meter_flops[1] / logs["time/step"] / 1e12)
    # the step's count is every call's real forward (the base model's, attention as SDPA's math form), three
    # times over for the calls with gradients: rollouts and reference passes once, the policy's passes thrice
    from torch.nn.attention import SDPBackend, sdpa_kernel

    expected = 0.0
    trainer.flop_meter.known = False  # its hook now counts nothing (no meta forward inside the counts below)
    with trainer.policy.adapter_disabled(), torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        for args, kwargs, grad in calls:
            with FlopCounterMode(display=False) as real:
                trainer.policy.transformer(*args, **kwargs)
            expected += real.get_total_flops() * (3 if grad else 1)
    assert any(grad for *_, grad in calls) and not all(grad for *_, grad in calls)
    assert meter_flops[1] == pytest.approx(expected, rel=1e-9)
    assert logs["perf/mfu"] == pytest.approx(logs["perf/tflops_per_s"] / 0.001)
    # on a CPU without a configured peak nothing is counted (a meta forward per shape, for a number nobody reads)
    plain = [o for o in overrides if not o.startswith(("run.peak_tflops=", "run.output_dir="))]
    cpu = build_trainer(load_config(None, [*plain, f"run.output_dir={tmp_path / 'cpu'}"]))
    assert "perf/tflops_per_s" not in cpu.train_step() and not cpu.flop_meter.known
