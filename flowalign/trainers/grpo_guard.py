"""GRPO-Guard (arXiv 2510.22319): Flow-GRPO with a regulated clip (``docs/methods/grpo_guard.md``).

The ratio normalisation and the 1/h reweighting are :mod:`flowalign.trainers.parts.ratio_norm`'s. The authors'
code averages the shift ``Δμ²`` over the whole micro-batch as well as over the elements (its ``mean(dim=tuple(
range(1, log_prob.ndim)))`` runs on a per-sample log-prob, so it reduces every dimension); here the micro-batch is
the chunk's samples with a non-zero advantage (the authors drop the others before batching): ``ratio_bias:
batch``. ``ratio_bias: sample`` takes each sample's own shift instead.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flowalign.limits import MAX_COEFFICIENT
from flowalign.trainers.flow_grpo import (FlowGRPOBase, FlowGRPOTrainer, SDEOptions, SDEWindowOptions,
                                           StepFractionOptions, StepSubsetOptions)
from flowalign.trainers.options import ReferenceOptions
from flowalign.trainers.parts.ratio_norm import RatioNorm, RatioNormOptions


class GRPOGuardConfig(FlowGRPOBase, ReferenceOptions, SDEOptions, SDEWindowOptions, StepFractionOptions,
                      StepSubsetOptions, RatioNormOptions):
    name: Literal["grpo_guard"] = "grpo_guard"  # type: ignore[assignment]
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"ratio_bias": "sample"}
    #: the ratio normalisation and the reweighting need a Gaussian step: the Flow-GRPO SDE
    sampler: Literal["flow_grpo"] = "flow_grpo"  # type: ignore[assignment]
    beta: float = Field(0.0, ge=0, le=MAX_COEFFICIENT)


class GRPOGuardTrainer(RatioNorm, FlowGRPOTrainer):
    Config = GRPOGuardConfig
    tcfg: GRPOGuardConfig
