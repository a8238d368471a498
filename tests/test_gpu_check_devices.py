"""scripts/gpu_check.py on a GPU, checked on the CPU: what its CUDA branches decide (precision, peaks, timing
boundaries) with the device queries faked, the recipes it trains there accepting the reward it adds, and the
wheels docs/performance.md carries to a GPU machine holding what its model folders are built with."""

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.scripts import load_script

check = load_script("gpu_check")
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["diffusion_opsd_vvr", "fav_vvr"])
def test_a_recipe_following_its_rewards_gradient_accepts_the_reward_the_check_adds(name, tmp_path):
    """DiffusionOPSD and FAV refuse a reward without a gradient: the check's varying term for their recipes is
    a differentiable one, so they train on the GPU instead of stopping at the check's own override."""
    from flowalign.config import load_config
    from flowalign.plugins import differentiable_rewards
    from flowalign.train import build_trainer

    recipe = check.TINY / f"{name}.yaml"
    added = json.loads(check.varying_rewards(recipe).removeprefix("rewards="))[-1]
    assert added["name"] in differentiable_rewards()
    trainer = build_trainer(load_config(recipe, check.recipe_overrides(recipe, tmp_path / "run", 1, True)))
    assert added["name"] in trainer.rewards.names


class Transformer(torch.nn.Module):
    """Rows through it are what :class:`gpu_check.RowCounter` counts."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, hidden_states):
        return hidden_states * self.w


@pytest.fixture
def fake_cuda(monkeypatch):
    """The CUDA allocator and stream queries, answered on the CPU; the calls are recorded in order."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset peak"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: calls.append("peak") or 3 * 2**30)
    return calls


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_reference_sides_run_at_the_precision_each_names_and_report_the_peak_on_cuda(device, fake_cuda,
                                                                                         monkeypatch, tmp_path):
    """``reference_fp16`` is the reference as its base config ships on a GPU (fp16 autocast over fp32 weights),
    ``reference_bf16`` a bf16 transformer under bf16 autocast, on a CPU too (there without autocast its bf16
    weights met float32 inputs and the side failed); timed from a drained queue to a drained queue after a
    warm-up, with the peak read after the warm-up's reset. The reference's code is stood in for by a recorder
    (its own functions need its source tree)."""
    made = []

    class Reference:
        def __init__(self, src, folder, reward, setting, prompts, targets, max_len, *, device, mixed_precision,
                     transformer_dtype, size):
            made.append(dict(device=device, mixed_precision=mixed_precision, transformer_dtype=transformer_dtype,
                             size=size, rank=setting["rank"]))
            self.pipe = SimpleNamespace(transformer=Transformer())

        def iteration(self, rep):
            fake_cuda.append(f"iteration {rep}")
            with torch.no_grad():  # a pass without gradients counts its rows once
                self.pipe.transformer(hidden_states=torch.ones(4, 3))
            return 0.5, 1.5

    monkeypatch.setitem(sys.modules, "bench_reference", SimpleNamespace(ReferenceFlowGRPO=Reference))
    rows = {side: check.run_side(side, tmp_path, tmp_path, tmp_path, 2, device, 512, 128)
            for side in ("reference_fp16", "reference_bf16")}
    fp16, bf16 = made
    assert (bf16["mixed_precision"], bf16["transformer_dtype"]) == ("bf16", "bf16")
    if device == "cuda":
        assert (fp16["mixed_precision"], fp16["transformer_dtype"]) == ("fp16", "fp32")
        one = ["iteration 0", "reset peak", "synchronize", "iteration 1", "synchronize", "synchronize", "iteration 2",
               "synchronize", "peak"]
        assert fake_cuda == one + one
        assert all(r["peak_gib"] == 3.0 for r in rows.values())
    else:
        assert (fp16["mixed_precision"], fp16["transformer_dtype"]) == ("no", "fp32")  # no fp16 autocast on a CPU
        assert fake_cuda == ["iteration 0", "iteration 1", "iteration 2"] * 2
        assert all(r["peak_gib"] is None for r in rows.values())
    assert all(m["rank"] == 32 and m["size"] == 512 and m["device"] == device for m in made)
    for row in rows.values():
        assert row["status"] == "ok" and row["rows"] == 4 and row["iteration_s"] >= 0


def docs_wheels() -> set[str]:
    """The distributions that docs/performance.md's ``pip download`` carries to a GPU machine."""
    text = (REPO / "docs" / "performance.md").read_text()
    block = text.split("### Carrying the check to a GPU machine", 1)[1].split("```", 2)[1]
    return {re.sub(r"[-_.]+", "_", m.lower()) for m in re.findall(r"([A-Za-z0-9_.-]+)==[0-9]", block)}


def test_the_wheels_for_a_gpu_machine_carry_the_clip_vocabulary_the_sd3_folder_is_built_with():
    """The check builds its SD3 folder (side by side, levers, the SD3 plan) with tokenizers over CLIP's BPE, read
    from open_clip's package: without it the folder fails and those parts with it. A GPU machine with PyTorch has
    no open_clip, so the wheels carry it and what importing it needs beyond PyTorch (ftfy, and ftfy's wcwidth)."""
    code = ("import sys; sys.modules['open_clip'] = None\n"
            "from pipelines.tiny_tokenizers import clip_tokenizer\n"
            "try:\n    clip_tokenizer(1000)\nexcept ImportError as err:\n    print('needs', err.name.partition('.')[0])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "needs open_clip"
    assert {"open_clip_torch", "ftfy", "wcwidth"} <= docs_wheels()
