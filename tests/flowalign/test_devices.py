"""Every tiny recipe takes a training step with the model on a device that is not the CPU.

On a GPU, a tensor made on the CPU (``torch.tensor(...)``, ``arange``, an index, a group id) and mixed with
the model's tensors stops a run at its first step; on a CPU-only machine the same code runs, since every
tensor is on the CPU. So here the model's weights, and everything made on its device, are on a device that
is not the CPU (:mod:`tests.flowalign.fake_device`: real CPU data that refuses to mix with CPU tensors the
way CUDA does), and each recipe takes one step with a reward that differs within every group, so its update
runs (weights change).

A behavioural guard rather than a lint over tensor constructors: the bugs it is for need not construct
anything where they fail (DGPO's ``scatter_add_`` took the batch's CPU group ids; GARDO's ``torch.where``
mixed CPU advantages with distances computed on the device), and a lint cannot tell which CPU tensors are
meant to stay there (generators' draws, index lists, logs). Running the code on a second device can. The
``meta`` device with no data was not enough: the trainers read values (``.item()``, ``.tolist()``) all
along the step.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch

from flowalign.config import load_config
from flowalign.train import build_trainer
from flowalign.trainers import get_trainer

from tests.flowalign.fake_device import DEVICE, FakeDevice, OnDevice, _disable_current_modes, host_waits
from tests.scripts import load_script
from tests.tiny_recipes import trainer_name

GPU_CHECK = load_script("gpu_check")

REDNESS = "tests.flowalign.trainers.toy_rewards:redness"

REPO = Path(__file__).resolve().parents[2]

#: one step at the smallest size a recipe accepts (as tests/test_tiny_configs_train.py shrinks them), with a
#: reward that varies within a group, so no update is skipped for equal rewards (and an auxiliary one of
#: weight 0 for GARDO's gate)
SMALL = ("trainer.max_steps=1", "trainer.max_minutes=null", "trainer.prompts_per_step=2", "trainer.group_size=2",
         "trainer.batch_size=2", "trainer.num_steps=2", "eval.bench=null", "eval.prompts=null", "eval.rewards=[]",
         "data.n=16", "run.progress=false", "run.tensorboard=false", "trainer.ema_decay=0.0",
         f"rewards=[{{name: '{REDNESS}'}}, {{name: brightness, weight: 0}}]")
FOUR_STEPS = ("trainer.num_steps=4",)
FIT = {"dance_grpo_vvr": FOUR_STEPS, "pref_grpo_vvr": FOUR_STEPS, "flash_grpo_vvr": FOUR_STEPS,
       "mix_grpo_vvr": FOUR_STEPS, "tempflow_grpo_vvr": ("trainer.branch_steps=null",),
       "festdpo_vvr": ("trainer.K=8", "trainer.pairs_per_prompt=2", "trainer.prompts_per_step=1"),
       "gardo_vvr": ("trainer.main_reward=null",)}
VIDEO = (f"rewards=[{{name: '{REDNESS}'}}, {{name: brightness_video, weight: 0}}]",)  # frame 0 against the others
FIT.update({name: VIDEO for name in ("afd_motion", "ar_copo_motion", "kvpo_motion", "flow_grpo_motion")})
FIT["flash_grpo_motion"] = (*VIDEO, *FOUR_STEPS)
FIT["afd_motion"] = (*VIDEO, "trainer.teacher.num_steps=2")
FIT["flow_grpo_vvr"] = FOUR_STEPS  # several units in each of its two optimiser steps
FIT["diffusion_opsd_vvr"] = ("rewards=[{name: brightness}]",)  # its targets follow a differentiable reward
FIT["self_opd_vvr"] = ("trainer.trunks=2", "trainer.branches=2")  # the authors' SDE trunks (see small_config), two a prompt
#: the two that failed on CUDA, the GRPO family's loss paths they share, a video recipe (~1-3 s each), the
#: pair trainers and Self-OPD (their conditioning is picked by index lists), KVPO (its gradient passes the
#: video model's complex rotary embedding) and the other main loss paths (FestDPO, DiffusionNFT, AWM,
#: Diffusion-DPO, DiffusionOPSD), and DanceGRPO (its authors' integer timesteps, a hook on every forward).
#: Every other tiny recipe steps here too when listed (2-6 s each; kept out for the suite's time): mix_grpo, pd_grpo, pref_grpo, seppo, tempflow_grpo, rg_opd, core, afd,
#: ar_copo, fav, flow_opd (with the vvr reward its teachers name), crosstimeedit, oars, kvpo_energy,
#: flow_grpo_motion_insight (its video reward), and umm_reflection with trainer.credit=final (about 40 s)
RECIPES = ["dance_grpo_vvr", "dgpo_vvr", "gardo_vvr", "flow_grpo_vvr", "grpo_guard_vvr", "flash_grpo_vvr", "flow_grpo_motion",
           "sft_vvr", "soar_vvr", "self_opd_vvr", "kvpo_motion", "festdpo_vvr", "diffusion_nft_vvr", "awm_vvr",
           "diffusion_dpo_vvr", "diffusion_opsd_vvr"]
#: an update's host waits besides the one that reads the step's logs back (see the test below; GARDO's
#: optimiser steps' KLs, which decide its reference refresh, are read with them): DiffusionOPSD's reward
#: checks the range of the images it is given at each of its gradient's calls (one per chunk and ascent step)
MORE_UPDATE_WAITS = {"diffusion_opsd_vvr": 6}
#: recipes whose step is also taken on the CPU and compared: the device must change no number, only where
#: tensors live (the fake device once picked garbage rows for an index list, and dropped the conjugation in
#: the rotary embedding's gradient, so a finite loss alone did not show it)
SAME_AS_CPU = ["sft_vvr", "kvpo_motion"]


@pytest.fixture
def policy_on_device(monkeypatch):
    load_policies_on_device(monkeypatch)


def load_policies_on_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pipelines.load`` loads on the CPU as usual, then moves every model of the policy to :data:`DEVICE`."""
    import pipelines

    original = pipelines.load

    def load(*args, **kwargs):
        with _disable_current_modes():  # loading itself is the CPU's business
            policy = original(*args, **{**kwargs, "device": "cpu"})
        for module in policy.pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.to(DEVICE)
        policy.device = DEVICE
        return policy

    monkeypatch.setattr(pipelines, "load", load)
    # a model a trainer loads itself (a latent reward, a teacher) loads on the CPU too, then moves where it is told
    from diffusers.models.modeling_utils import ModelMixin
    from transformers import PreTrainedModel

    for base in (ModelMixin, PreTrainedModel):
        loader = base.__dict__["from_pretrained"].__func__

        def from_pretrained(cls, *args, _loader=loader, **kwargs):
            with _disable_current_modes():
                return _loader(cls, *args, **kwargs)

        monkeypatch.setattr(base, "from_pretrained", classmethod(from_pretrained))


def small_config(recipe: str, run_dir: Path, *extra: str):
    """``recipe`` at the sizes above (:data:`SMALL`, :data:`FIT`) with its trainer's defaults where it pins a
    former form (the authors' forms, what a user runs on a GPU; the recipe keeps what it was measured with),
    then ``extra`` overrides."""
    path = REPO / "configs" / "tiny" / f"{recipe}.yaml"
    fields = set(get_trainer(trainer_name(path)).Config.model_fields)  # each setting only to a trainer that has it
    small = [o for o in SMALL if not o.startswith("trainer.") or o.split(".", 1)[1].split("=", 1)[0] in fields]
    defaults = GPU_CHECK.authors_defaults(path)  # the overrides the GPU check's +defaults rows run with
    return load_config(path, [f"run.output_dir={run_dir}", *small, *defaults, *FIT.get(recipe, ()), *extra])


def one_step_on_device(recipe: str, run_dir: Path, *, fake: bool = True) -> tuple[object, dict[str, float], list[torch.Tensor]]:
    """One step of ``recipe`` under :class:`FakeDevice` (``fake``; else the same step on the CPU): the trainer,
    its logs and the trainable weights before the step."""
    cfg = small_config(recipe, run_dir)
    torch.manual_seed(0)
    with FakeDevice() if fake else contextlib.nullcontext():
        trainer = build_trainer(cfg)
        before = [p.detach().clone() for p in trainer.params]
        logs = trainer.train_step()
    return trainer, logs, before


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_steps_on_a_device_that_is_not_the_cpu(recipe, tmp_path, monkeypatch, policy_on_device):
    """One step on the device, its update with the host-wait recorder on: every unit's forward and backward
    and every optimiser step are queued without the host waiting for the device. A logged value stays a
    tensor until the step's end, where the loop reads them all back at once; a mean over a mask is masked
    rather than indexed (a boolean index's size depends on the values, in the forward and in the backward);
    the gradient norm is not read back; CPU tensors go to the device without blocking. Flow-GRPO's update
    (a KL term, two optimiser steps) waited 68 times here (about 11 per unit) before."""
    monkeypatch.chdir(REPO)
    cfg = small_config(recipe, tmp_path / "run")
    torch.manual_seed(0)
    with FakeDevice():
        trainer = build_trainer(cfg)
        before = [p.detach().clone() for p in trainer.params]
        batch = trainer.collect(0)
        with host_waits() as found:
            logs = trainer.update(batch, torch.Generator().manual_seed(0))
    assert trainer.params and all(isinstance(p, OnDevice) and p.device == DEVICE for p in trainer.params)
    assert math.isfinite(logs["grad_norm"]) and logs["grad_norm"] > 0
    assert all(bool(torch.isfinite(p).all()) for p in trainer.params)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.params))  # the update ran
    assert len(found) == 1 + MORE_UPDATE_WAITS.get(recipe, 0), found
    assert any(kind == "read values" and where.startswith("flowalign/trainers/unit_logs.py:") for kind, where in found)
    assert all(isinstance(v, float) for v in logs.values())


def test_mix_grpo_flash_steps_on_a_device_that_is_not_the_cpu(tmp_path, monkeypatch, policy_on_device):
    """MixGRPO-Flash's tail on the device: the window's clean prediction handed to DPM-Solver++(2), whose
    scheduler keeps its σ grid on the CPU, then the window's update."""
    monkeypatch.chdir(REPO)
    cfg = small_config("mix_grpo_vvr", tmp_path / "run", "trainer.post_window_solver=dpm2")
    torch.manual_seed(0)
    with FakeDevice():
        trainer = build_trainer(cfg)
        before = [p.detach().clone() for p in trainer.params]
        batch = trainer.collect(0)
        logs = trainer.update(batch, torch.Generator().manual_seed(0))
    assert all(c.num_steps < 4 and c.latents.device == DEVICE for c in batch.chunks)  # the compressed tail ran
    assert math.isfinite(logs["grad_norm"]) and logs["grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.params))


@pytest.mark.parametrize("recipe", SAME_AS_CPU)
def test_a_step_on_the_device_computes_what_the_cpu_computes(recipe, tmp_path, monkeypatch):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.chdir(REPO)
    # attention as SDPA's math form on the CPU too: on the fake device its device type picks that kernel, where
    # the CPU runs its fused one (KVPO's video loss is then 2e-3 apart on some CPUs)
    with sdpa_kernel(SDPBackend.MATH):
        _, cpu, _ = one_step_on_device(recipe, tmp_path / "cpu", fake=False)
    load_policies_on_device(monkeypatch)
    _, device, _ = one_step_on_device(recipe, tmp_path / "device")
    for key in ("train/loss", "train/kvpo_loss", "train/grad_norm"):
        if key in cpu:  # the same kernels on the same data
            assert device[key] == pytest.approx(cpu[key], rel=1e-5), key


def test_the_fake_device_refuses_what_cuda_refuses():
    with FakeDevice():
        d = torch.ones(4, device=DEVICE)
        cpu_index = torch.tensor([0, 1, 0, 1])
        with pytest.raises(RuntimeError, match="same device"):
            torch.zeros(2, device=DEVICE).scatter_add_(0, cpu_index, d)
        with pytest.raises(RuntimeError, match="same device"):
            torch.where(torch.ones(4) > 0, d, torch.zeros(4))
        with pytest.raises(RuntimeError, match="generator"):
            torch.randn(3, device=DEVICE, generator=torch.Generator())
        # what CUDA accepts: CPU scalars, CPU indices into a device tensor, copies, values read back
        out = torch.zeros(2, device=DEVICE).scatter_add_(0, cpu_index.to(DEVICE), d) * torch.tensor(2.0)
        assert isinstance(out, OnDevice) and out.device == DEVICE
        assert out.tolist() == [4.0, 4.0] and out[torch.tensor([1])].item() == 4.0
        assert torch.randn(3, generator=torch.Generator().manual_seed(0)).to(DEVICE).cpu().device.type == "cpu"


def test_the_fake_device_computes_what_the_cpu_computes():
    x = torch.arange(6.0).reshape(3, 2)
    with FakeDevice():
        d = x.to(DEVICE)
        # an index list: PyTorch gives a meta tensor's list no data, CUDA's gets its values
        assert d[[0, 2]].tolist() == x[[0, 2]].tolist() and d[[True, False, True]].tolist() == x[[0, 2]].tolist()
        assert d[[0, 2], [1, 0]].tolist() == [1.0, 4.0] and d[[]].shape == (0, 2)
        # a list of device scalars made a tensor on the device (Qwen2.5-VL's rope index does): CUDA reads them
        scalars = torch.tensor([d.sum(), d.max() + 1], device=DEVICE)
        assert isinstance(scalars, OnDevice) and scalars.tolist() == [15.0, 6.0]
        d[[0, 2]] = torch.zeros(2, 2, device=DEVICE)
        assert d.tolist() == [[0.0, 0.0], [2.0, 3.0], [0.0, 0.0]]

    # a rotary embedding's complex product, with the conjugate its gradient takes (the CPU kernel under the
    # fake device would ignore a lazy conjugation bit)
    g = torch.Generator().manual_seed(0)
    h, angles, grad = torch.randn(2, 3, 8, generator=g), torch.randn(3, 4, generator=g), torch.randn(2, 3, 8, generator=g)
    freqs = torch.polar(torch.ones_like(angles, dtype=torch.float64), angles.double())

    def rotated(device: torch.device) -> tuple[list, list]:
        x = h.detach().clone().to(device).requires_grad_(True)
        out = torch.view_as_real(torch.view_as_complex(x.double().unflatten(-1, (-1, 2))) * freqs.to(device))
        out.flatten(-2).float().backward(grad.to(device))
        return out.detach().flatten().tolist(), x.grad.flatten().tolist()

    expected = rotated(torch.device("cpu"))
    with FakeDevice():
        got = rotated(DEVICE)
    assert got[0] == pytest.approx(expected[0], rel=1e-6) and got[1] == pytest.approx(expected[1], rel=1e-6)
    with FakeDevice():
        c = torch.tensor([1 + 2j, 3 - 1j], device=DEVICE)
        assert (torch.tensor([1 + 1j, 2 + 0j], device=DEVICE) * c.conj()).tolist() == [3 - 1j, 6 + 2j]


#: families whose rollout waits once, and their guidance (with CFG: stored ``v_u``)
ROLLOUT_FAMILIES = {"sd3": 4.5, "zimage": 4.5, "flux": 1.0, "flux2": 1.0, "wan": 4.5, "wan22": 4.5}


def waits_by_steps(sample, step_counts: tuple[int, ...]) -> tuple[dict[int, list], object]:
    """The host waits of ``sample(n)`` for each ``n`` of ``step_counts``, after one 1-step call that fills the
    caches (the prompts' encoding), and the last call's output."""
    sample(1)
    waits, out = {}, None
    for steps in step_counts:
        with host_waits() as found:
            out = sample(steps)
        waits[steps] = found
    return waits, out


@pytest.mark.parametrize("family", sorted(ROLLOUT_FAMILIES))
def test_a_rollout_makes_the_host_wait_once_whatever_its_steps(family, tiny_model_dir, policy_on_device, monkeypatch):
    """On a GPU the host queues a rollout's work ahead of the device unless something makes it wait: a value
    read back, a copy to the host or a blocking copy to the device (``torch.as_tensor(sigma, device=...)``) waits
    for everything queued before it. A Flow-GRPO rollout (per-sample noise streams; SD3.5 with CFG and stored
    ``v_u``, the trainers' form) waits once, for its log-probs after the last step, however many steps it has.
    What a policy makes once comes first: the prompts' encoding (cached) and FLUX's token position ids (made
    on the host and copied at every transformer call before: a wait a step). Z-Image read its prompts'
    lengths back from a mask on the device at every forward (4 waits a step with CFG); the mask stays on
    the host now. Wan 2.2 split its batch between its experts by σ read back from the device (5 a step)."""
    import pipelines
    from flowalign.sampling.rollout import rollout

    monkeypatch.chdir(REPO)
    prompts = ["two red circles", "a blue square"]
    folder = "assets/tiny-sd3-vvr" if family == "sd3" else tiny_model_dir(family)
    with FakeDevice():
        policy = pipelines.load(folder, lora={"rank": 4, "alpha": 8})

        def sample(steps: int):
            return rollout(policy, prompts, num_steps=steps, sampler="flow_grpo", guidance_scale=ROLLOUT_FAMILIES[family],
                           generators=[torch.Generator().manual_seed(i) for i in range(2)], keep_unconditional=True)

        waits, out = waits_by_steps(sample, (2, 6))
    assert len(waits[2]) == len(waits[6]) == 1, waits
    assert waits[6][0][0] == "copy to the host" and waits[6][0][1].startswith("flowalign/sampling/rollout.py:")
    assert out.log_probs.device.type == "cpu" and bool(torch.isfinite(out.log_probs[:, :-1]).all())


def test_a_streamed_rollout_makes_the_host_wait_once_whatever_its_steps(policy_on_device, monkeypatch):
    """The streaming sampler (FAR's chunks, KVPO's and AR-CoPO's rollouts) keeps each step's log-probs on the
    device and reads them back after the last chunk: it read them at every step of every chunk before."""
    import pipelines
    from flowalign.sampling.streaming import stream_rollout

    monkeypatch.chdir(REPO)
    prompts = ["a red ball rolls left", "a blue cube"]
    with FakeDevice():
        policy = pipelines.load("assets/tiny-anyflow-far-motion", lora={"rank": 4, "alpha": 8})

        def stream(steps: int):
            return stream_rollout(policy, prompts, num_steps=steps, sampler="flow_grpo",
                                  generator=torch.Generator().manual_seed(0), decode=False)

        waits, out = waits_by_steps(stream, (1, 3))
    assert len(waits[1]) == len(waits[3]) == 1, waits
    assert waits[3][0][0] == "copy to the host" and waits[3][0][1].startswith("flowalign/sampling/streaming.py:")
    assert out.log_probs.shape[1:] == (out.num_chunks, 3) and bool(torch.isfinite(out.log_probs).all())


def test_host_waits_are_what_cuda_waits_for():
    with FakeDevice():
        with host_waits() as found:
            d = torch.as_tensor(0.5, device=DEVICE)  # a copy of host data, blocking
            e = torch.full((2,), 0.5, device=DEVICE) * d  # filled in on the device: no copy
            e.to(DEVICE, dtype=torch.float64)  # on the device already
            torch.ones(2).to(DEVICE, non_blocking=True)
            e.sum().item(), e.tolist(), e.cpu()
            e[e > 0], e.nonzero()
        assert [kind for kind, _ in found] == ["blocking copy to the device", "read a value", "read values",
                                               "copy to the host", "value-dependent size", "value-dependent size"]


@pytest.mark.parametrize("recipe", ["kvpo_motion", "ar_copo_motion"])
def test_the_streaming_trainers_step_on_the_device_with_a_causal_wan(recipe, tmp_path, monkeypatch, policy_on_device,
                                                                    tiny_model_dir):
    """A causal Wan (its re-noising draws made on the host, its KV cache and rotary positions built per call)
    streams, routes and trains on a device that is not the CPU."""
    monkeypatch.chdir(REPO)
    # the motion tasks' 9 frames: five latent frames, streamed one a chunk; AR-CoPO's anchors within the small
    # group; KVPO's whole-video signal alone (a one-frame chunk is no clip for the frame-to-frame toy reward)
    extra = ("trainer.anchors=2",) if recipe == "ar_copo_motion" else ("trainer.local_weight=0",)
    cfg = small_config(recipe, tmp_path / "run", f"model.path={tiny_model_dir('causal_wan')}",
                       "model.defaults={num_frames: 9, chunk_frames: 1}", *extra)
    torch.manual_seed(0)
    with FakeDevice():
        trainer = build_trainer(cfg)
        before = [p.detach().clone() for p in trainer.params]
        logs = trainer.train_step()
    assert trainer.params and all(isinstance(p, OnDevice) and p.device == DEVICE for p in trainer.params)
    assert math.isfinite(logs["train/grad_norm"]) and logs["train/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.params))


def test_a_re_noised_stream_makes_the_host_wait_twice_whatever_its_steps(policy_on_device, monkeypatch, tiny_model_dir):
    """A causal Wan's stream reads its initial noise back once (the keys of its fresh draws) and its log-probs
    once after the last chunk; its draws go to the device without the host waiting."""
    import pipelines
    from flowalign.sampling.streaming import stream_rollout

    with FakeDevice():
        policy = pipelines.load(tiny_model_dir("causal_wan"), lora={"rank": 4, "alpha": 8})

        def stream(steps: int):
            return stream_rollout(policy, ["a red ball", "a cube"], num_steps=steps,
                                  generator=torch.Generator().manual_seed(0), decode=False)

        waits, out = waits_by_steps(stream, (2, 4))
    assert len(waits[2]) == len(waits[4]) == 2, waits
    assert all(where.startswith("flowalign/sampling/streaming.py:") for _, where in waits[4])
    assert bool(torch.isfinite(out.log_probs[:, :, :-1]).all())
