"""Reward functions and models; each implements :class:`flowalign.protocols.Reward`."""

from rewards.registry import available, check, differentiable, former_forms, load, planned_bytes, register

#: what this package contributes to the core's plugin tables (:mod:`flowalign.plugins`); the same targets
#: as the ``flowalign.*`` entry points in pyproject.toml, read by the core without importing the modules
PLUGINS = {
    "commands": {"serve-judge": "rewards.cli.serve_judge", "train-reward": "rewards.cli.train_reward",
                 "serve-reward": "rewards.cli.serve_reward", "tiny-reward": "rewards.cli.tiny_reward",
                 "geneval-detector": "rewards.cli.geneval_detector"},
    "benchmarks": {"vvr": "rewards.benchmarks:load_vvr", "vvr_motion": "rewards.benchmarks:load_vvr_motion",
                   "vvr_edit": "rewards.benchmarks:load_vvr_edit",
                   "geneval": "rewards.benchmarks:load_geneval", "ocr": "rewards.benchmarks:load_ocr",
                   "sr": "rewards.benchmarks:load_sr"},
    "renderers": {"vvr_edit": "rewards.vvr_edit.reward:render_target",
                  "vvr": "rewards.benchmarks:render_vvr", "vvr_motion": "rewards.benchmarks:render_vvr_motion",
                  "sr": "rewards.benchmarks:render_sr"},
    "encoders": {"dinov3": "rewards.image_encoders:DINOv3", "dinov2": "rewards.image_encoders:DINOv2"},
}

__all__ = ["PLUGINS", "available", "check", "differentiable", "former_forms", "load", "planned_bytes", "register"]
