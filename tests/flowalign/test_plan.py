"""flowalign plan: parameter counts of the published architectures (meta device, configs only), the
activation estimate against the peak memory of a real forward+backward on CPU, and the report."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.utils._python_dispatch
import torch.utils._pytree

from dataclasses import replace

from flowalign.cli.main import main
from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.paths import REPO_ROOT
from flowalign.plan import (BYTES, CALIBRATION, GB, build_on_meta, inspect_model, lora_parameters, memory_rows, plan_text,
                            predicted_rows, settings, smallest_fix)

ARCH = REPO_ROOT / "assets" / "architectures"


@pytest.mark.parametrize("name,published,tolerance", [
    ("sd3.5-medium", 2.24e9, 0.01),   # MMDiT-X transformer of the 2.5B SD3.5-Medium pipeline
    ("flux.1-dev", 11.90e9, 0.005),   # "a 12 billion parameter rectified flow transformer"
    ("wan2.1-14b", 14.0e9, 0.03),     # Wan2.1-T2V-14B
    ("wan2.1-1.3b", 1.42e9, 0.01),    # Wan2.1-T2V-1.3B ("1.3B"; 1.42B counted on the Hub)
    ("causal-wan2.1-1.3b", 1.42e9, 0.01),  # Self-Forcing / LongLive: Wan2.1-T2V-1.3B's transformer, streamed
    ("flux.1-kontext", 11.90e9, 0.005),  # FLUX.1-Kontext-dev: FLUX.1-dev's transformer
    ("qwen-image", 20e9, 0.03),       # Qwen-Image: "a 20B MMDiT"
    ("qwen-image-edit", 20e9, 0.03),  # Qwen-Image-Edit: the same transformer
    ("flux.2-dev", 32e9, 0.01),       # FLUX.2-dev: "a 32 billion parameter rectified flow transformer"
    ("flux.2-klein", 4e9, 0.04),      # FLUX.2-klein-base-4B
    ("z-image-turbo", 6e9, 0.03),     # Z-Image-Turbo: "6B"
    ("wan2.2-a14b", 14e9, 0.03),      # Wan2.2-T2V-A14B: each of the two 14B experts
])
def test_transformer_parameter_counts_match_the_published_sizes(name, published, tolerance):
    params = sum(p.numel() for p in build_on_meta(ARCH / name)["transformer"].parameters())
    assert abs(params - published) / published < tolerance, params


@pytest.mark.parametrize("name,component,published", [
    ("qwen-image", "text_encoder", 8.29e9),     # Qwen2.5-VL-7B-Instruct (language model + vision tower)
    ("flux.2-dev", "text_encoder", 24.0e9),     # Mistral-Small-3.1-24B
    ("flux.2-klein", "text_encoder", 4.02e9),   # Qwen3-4B
    ("z-image-turbo", "text_encoder", 4.02e9),  # Qwen3-4B
    ("wan2.2-a14b", "transformer_2", 14e9),     # the low-noise expert
])
def test_other_components_match_the_published_sizes(name, component, published):
    params = sum(p.numel() for p in build_on_meta(ARCH / name)[component].parameters())
    assert abs(params - published) / published < 0.03, params


def test_text_encoders_are_counted_on_the_meta_device_too():
    models = build_on_meta(ARCH / "flux.1-dev")
    assert all(p.is_meta for m in models.values() for p in m.parameters())
    t5 = sum(p.numel() for p in models["text_encoder_2"].parameters())
    assert abs(t5 - 4.76e9) / 4.76e9 < 0.01  # the T5-XXL encoder


def test_lora_parameters_count_rank_times_in_plus_out_of_each_targeted_linear():
    layer = torch.nn.Sequential()
    layer.add_module("to_q", torch.nn.Linear(10, 20))
    layer.add_module("ff", torch.nn.Linear(20, 30))
    assert lora_parameters(layer, ["to_q"], rank=4) == 4 * (10 + 20)
    assert lora_parameters(layer, ["to_q", "ff"], rank=2) == 2 * 30 + 2 * 50


#: a forward+backward of a tiny transformer in a fresh process, printing how far the resident set grew at its
#: peak (Linux: VmHWM restarted by clear_refs) less the weights' gradients; a fixed mmap threshold makes
#: every large tensor its own mapping, returned on free, so the resident set follows the live tensors
MEASURE = """
import gc, json, sys, torch
import diffusers
from pipelines.memory import transformer_inputs
torch.set_num_threads(1)
family, folder, batch, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
cls = {"sd3": diffusers.SD3Transformer2DModel, "flux": diffusers.FluxTransformer2DModel}[family]
transformer = cls.from_pretrained(folder + "/transformer")
inputs = transformer_inputs(family, transformer.config, batch, size, device="cpu")
def read(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
gc.collect()
open("/proc/self/clear_refs", "w").write("5")
base = read("VmRSS")
transformer(**inputs)[0].square().mean().backward()
print(read("VmHWM") - base - sum(p.numel() * p.element_size() for p in transformer.parameters()))
"""


def _as_planned(folder, size: dict) -> dict:
    """``size`` with what the plan reads from ``folder``'s configs (its VAE's factor, CLIP's length): the real
    forward a test measures runs at the tiny twin's own shapes, as the plan sizes them."""
    from flowalign.plan import _text_lengths, _vae_scales

    return {**size, **_vae_scales(folder), **_text_lengths(folder)}



@pytest.mark.skipif(sys.platform != "linux", reason="peak resident memory read from /proc")
@pytest.mark.parametrize("family, side", [("sd3", 128), ("flux", 256)])  # the tiny SD3's VAE halves twice, not 3 times
def test_activation_estimate_is_within_30_percent_of_the_measured_peak(tiny_model_dir, family, side):
    folder = tiny_model_dir(family)
    batch, size = 16, {"height": side, "width": side, "max_sequence_length": 32}
    cfg = load_config(None, [f"model.path={folder}", f"trainer.batch_size={batch}", "trainer.guidance_scale=1",
                             f"model.defaults={json.dumps(size)}", "model.finetune=full"])
    estimate = inspect_model(cfg, folder).activations.per_rank(checkpointed=False) * batch
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", MEASURE, family, str(folder), str(batch), json.dumps(_as_planned(folder, size))],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    measured = int(out.stdout.strip().splitlines()[-1])
    assert estimate > 20e6 and abs(estimate - measured) / measured < 0.3, (estimate / 1e6, measured / 1e6)


def test_plan_prints_counts_memory_per_strategy_and_the_smallest_change_that_fits(capsys):
    code = main(["plan", str(REPO_ROOT / "configs/tiny/flow_grpo_vvr.yaml"), f"model.path={ARCH / 'flux.1-dev'}",
                 "model.dtype=bf16", "trainer.batch_size=1",
                 # the tiny recipe trains a LoRA now: this checks the full fine-tune's rows
                 "model.finetune=full", "trainer.beta=0", "trainer.ema_decay=0", "--gpus", "8", "--gpu-memory", "80"])
    text, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    counts = {line.split()[0]: line.split()[1] for line in text.splitlines() if line.startswith("  ")}
    assert counts["transformer"] == "11.90B" and counts["text_encoder_2"] == "4.76B"
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ")}
    ddp, fsdp = (float(x) for x in rows["gradients"].split()[1::2])
    assert ddp == pytest.approx(23.8, abs=0.1) and fsdp == pytest.approx(23.8 / 8, abs=0.1)  # bf16 grads, sharded /8
    assert "ddp: does not fit" in text  # 11.9B full fine-tune replicated: weights+grads+AdamW alone are 190 GB
    assert "fsdp: fits" in text or "fsdp: does not fit; smallest change that fits" in text


def test_plan_refuses_a_folder_without_model_index(tmp_path, capsys):
    code = main(["plan", "/dev/null", f"model.path={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "model_index.json" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("overrides,copies", [
    (("model.finetune=full", "trainer.beta=0.04"), 1),  # Flow-GRPO's KL reference: a frozen transformer copy
    (("model.finetune=full", "trainer.beta=0.04", "trainer.reference_offload=true"), 0),  # in CPU memory
    (("model.finetune=full", "trainer.beta=0"), 0),
    (("model.finetune=lora", "trainer.beta=0.04"), 0),  # the adapter switched off: no copy
])
def test_plan_counts_the_reference_copy_of_a_full_fine_tune_with_kl(overrides, copies):
    cfg = load_config(REPO_ROOT / "configs/tiny/flow_grpo_vvr.yaml", ["trainer.ema_decay=0", *overrides])
    assert settings(cfg, "fsdp", 2).extra_copies == copies


def _small(folder, *overrides):
    """A config sizing one tiny sample (the meta forward stays cheap) of ``folder``'s model."""
    size = {"height": 64, "width": 64, "num_frames": 5, "max_sequence_length": 16}
    return load_config(None, [f"model.path={folder}", "trainer.batch_size=1", f"model.defaults={json.dumps(size)}",
                              *overrides])


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_plan_counts_both_wan22_experts_as_trained(finetune):
    model = inspect_model(_small(ARCH / "wan2.2-a14b", f"model.finetune={finetune}"), ARCH / "wan2.2-a14b")
    assert set(model.trained) == {"transformer", "transformer_2"}  # Wan22Policy trains both experts
    assert model.trained["transformer_2"] == model.trained["transformer"] > 0
    assert model.trained_weights == model.params["transformer"] + model.params["transformer_2"]
    rows = plan_text(_small(ARCH / "wan2.2-a14b", f"model.finetune={finetune}"), ARCH / "wan2.2-a14b", 2, 141)
    assert "transformer_2" in rows and "frozen" not in next(l for l in rows.splitlines() if "transformer_2" in l)


def test_a_distilled_flux2_klein_is_sized_without_cfg(tmp_path):
    distilled = tmp_path / "klein-distilled"
    shutil.copytree(ARCH / "flux.2-klein", distilled)
    index = json.loads((distilled / "model_index.json").read_text())
    (distilled / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    # cfg_grad: full backpropagates through both CFG halves (detached, the default, only the conditional one)
    base = [inspect_model(_small(ARCH / "flux.2-klein", f"trainer.guidance_scale={g}", "trainer.cfg_grad=full"),
                          ARCH / "flux.2-klein") for g in (1, 4)]
    saved = lambda model: model.activations.per_rank(checkpointed=False)
    assert saved(base[1]) == pytest.approx(2 * saved(base[0]), rel=0.01)  # klein base: CFG doubles it
    # the distilled checkpoint takes no guidance (Flux2Policy refuses w > 1): one pass whatever the scale
    assert saved(inspect_model(_small(distilled, "trainer.guidance_scale=4", "trainer.cfg_grad=full"),
                               distilled)) == saved(base[0])


def test_sequence_parallel_divides_what_the_blocks_save_and_nothing_else():
    """Wan's blocks save bytes nearly in proportion to their video tokens (twice the latent frames: 1.94 times
    the bytes, the rest is the cross-attention's text keys and values, which every rank holds whole), which
    is why S sequence ranks each hold about 1/S of them; the embeddings and output outside the blocks stay whole."""
    frames = {n: inspect_model(_small(ARCH / "wan2.1-1.3b", f'model.defaults={{height: 64, width: 64, num_frames: {n}, '
                                                            'max_sequence_length: 16}', "model.finetune=full"),
                                 ARCH / "wan2.1-1.3b").activations
              for n in (5, 13)}  # 2 and 4 latent frames
    assert 1.9 * frames[5].in_blocks < frames[13].in_blocks <= 2 * frames[5].in_blocks
    act = frames[13]
    assert act.in_blocks > 10 * act.outside > 0  # a full fine-tune's patch embedding saves its input
    for checkpointed in (False, True):
        whole, split = act.per_rank(checkpointed), act.per_rank(checkpointed, sequence_parallel=4)
        assert split < whole and split - act.outside == pytest.approx((whole - act.outside) / 4)
    cfg = _small(ARCH / "wan2.1-1.3b", "parallel.sequence_parallel=2", "model.finetune=full")
    assert "tokens split over 2 sequence ranks" in plan_text(cfg, ARCH / "wan2.1-1.3b", 2, 80)
    with pytest.raises(UserError, match="must divide --gpus 3"):
        plan_text(cfg, ARCH / "wan2.1-1.3b", 3, 80)


SD35_RECIPE = REPO_ROOT / "configs" / "sd3.5-medium" / "flow_grpo_vvr.yaml"


def _sd35(*overrides):
    return load_config(SD35_RECIPE, [f"model.path={ARCH / 'sd3.5-medium'}", *overrides])


def test_a_rollout_sample_holds_its_latents_stored_velocities_log_probs_conditioning_and_pixels():
    cfg = _sd35()
    model = inspect_model(cfg, ARCH / "sd3.5-medium")
    s = settings(cfg, "ddp", 1, model)
    assert (s.prompts_per_step, s.group_size, s.num_steps) == (4, 24, 10)  # the recipe's 4 prompts x 24, T 10
    assert s.stored_velocities == 0.5  # cfg_grad: detached keeps CFG's unconditional branch, bf16
    latent = 16 * (512 // 8) ** 2 * 4  # float32 latent at 512 px
    text = ((77 + 256) * 4096 + 2048) * 2 * 2  # CLIP + T5 tokens and the pooled vector, bf16, both CFG branches
    pixels = 3 * 512 * 512 * 4  # the decoded image, float32
    expected = 96 * ((10 + 1 + 10 * 0.5) * latent + 4 * 10 + text + pixels)
    assert s.rollout_bytes(model.rollout) == pytest.approx(expected, rel=1e-9)
    # with its KL (beta 0.04) Flow-GRPO keeps every sample's reference step means through the update: one
    # float32 latent for each of the 9 trained steps (the first ⌊0.99·10⌋); under fsdp the loss computes them
    means = 96 * 9 * latent
    assert memory_rows(model, s)["rollouts of the step"] == pytest.approx(expected + means, rel=1e-9)
    assert memory_rows(model, settings(cfg, "fsdp", 2, model))["rollouts of the step"] == pytest.approx(expected)
    # an oversized step: 4,096 prompts x 1,024 samples a step hold 4M rollouts (54 TB) where 96 hold 1.2 GB
    huge = replace(s, prompts_per_step=4096, group_size=1024)
    assert sum(memory_rows(model, s).values()) < 80 * GB < sum(memory_rows(model, huge).values())
    assert smallest_fix(model, huge, 80 * GB).startswith("trainer.prompts_per_step=")


@pytest.mark.parametrize("overrides,verdict", [
    (("trainer.prompts_per_step=4", "trainer.group_size=24"), "ddp: fits"),
    (("trainer.prompts_per_step=256", "trainer.group_size=64"),
     "ddp: does not fit; smallest change that fits: trainer.prompts_per_step="),
])
def test_how_many_rollouts_a_step_holds_decides_whether_it_fits(overrides, verdict, capsys):
    rc = main(["plan", str(SD35_RECIPE), *overrides, "--gpu-memory", "80"])
    out = capsys.readouterr().out
    assert rc == 0 and verdict in out, out
    assert "rollouts a step per rank: " + overrides[0].split("=")[1] + " prompts x " in out


@pytest.mark.parametrize("recipe,stored", [
    ("configs/sd3.5-medium/self_opd.yaml", 1.0),  # self-distillation keeps every step's velocity (float32)
    ("configs/tiny/rg_opd_vvr.yaml", 1.0),
    ("configs/sd3.5-medium/diffusion_nft.yaml", 0.0),
])
def test_trainers_that_store_velocities_count_them(recipe, stored):
    cfg = load_config(REPO_ROOT / recipe, [f"model.path={ARCH / 'sd3.5-medium'}"])
    assert settings(cfg, "ddp", 1).stored_velocities == stored


def test_a_placeholder_model_path_plans_on_the_recipes_published_architecture(capsys, tmp_path):
    assert main(["plan", str(REPO_ROOT / "configs/flux.2-klein/flow_grpo_vvr.yaml")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == ("model.path /path/to/FLUX.2-klein-base-4B does not exist: planning on the published architecture "
                     "assets/architectures/flux.2-klein (its configs, no weights)")
    # a path given on the command line is taken as meant; a recipe outside configs/<model>/ names the choices
    assert main(["plan", str(SD35_RECIPE), "model.path=/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert "model.path /no/such/model does not exist" in err and "sd3.5-medium" in err and len(err.splitlines()) == 1
    copied = tmp_path / "my_run.yaml"
    copied.write_text(SD35_RECIPE.read_text())
    assert main(["plan", str(copied)]) == 2
    err = capsys.readouterr().err
    assert "model.path=assets/architectures/NAME" in err and "flux.1-dev" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("config,message", [
    ({"num_layers": -5}, "transformer/config.json: num_layers=-5 must be between 1 and 1,024"),
    ({"num_layers": "many"}, 'transformer/config.json: num_layers="many" must be a whole number'),
    ({"attention_head_dim": 64.5}, "attention_head_dim=64.5 must be a whole number"),
    ({"qk_norm": "bogus"}, "transformer/config.json does not build a SD3Transformer2DModel (unknown qk_norm"),
    ([1, 2], "transformer/config.json holds a JSON list, not a mapping of settings"),
    ('{"num_layers": 3,', "transformer/config.json is damaged (line 1"),
])
def test_a_bad_architecture_config_is_one_line_naming_the_field(config, message, tmp_path, capsys):
    arch = tmp_path / "sd3.5-medium"
    shutil.copytree(ARCH / "sd3.5-medium", arch)
    path = arch / "transformer" / "config.json"
    if isinstance(config, dict):
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    else:
        path.write_text(config if isinstance(config, str) else json.dumps(config))
    assert main(["plan", str(SD35_RECIPE), f"model.path={arch}"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("overrides,halves", [
    ((), 1),  # cfg_grad: detached: the conditional half carries the gradient, v_u is stored or taken without grad
    (("trainer.cfg_grad=full",), 2),  # the [uncond; cond] batch with grad
    (("trainer.first_pass=batched",), 2),  # the batch's first optimiser step reruns the rollout's 2B rows
])
def test_the_training_forward_counts_the_rows_that_carry_gradients(overrides, halves):
    one = inspect_model(_small(ARCH / "sd3.5-medium", "trainer.guidance_scale=1"), ARCH / "sd3.5-medium")
    cfg = inspect_model(_small(ARCH / "sd3.5-medium", "trainer.guidance_scale=4.5", *overrides), ARCH / "sd3.5-medium")
    saved = lambda model: model.activations.per_rank(checkpointed=False)
    assert saved(cfg) == pytest.approx(halves * saved(one), rel=0.02)
    assert cfg.rollout.conditioning == pytest.approx(2 * one.rollout.conditioning)  # a rollout keeps both branches


def test_soar_sizes_its_training_forward_by_the_correction_states_it_backpropagates():
    """SOAR's loss holds a batch's pairs and every correction state (N per path) in one backward: its
    activations are (1 + N·M)× SFT's on the same batch."""
    from flowalign.plan import memory_rows, settings

    arch = ARCH / "sd3.5-medium"
    sft = _small(arch, "trainer.name=sft", "rewards=[]")
    model = inspect_model(sft, arch)  # per sample: the same forward for both
    activations = lambda cfg: memory_rows(model, settings(cfg, "ddp", 1, model))["activations"]  # noqa: E731
    for overrides, rows in [(("trainer.corrections=6",), 7), (("trainer.corrections=6", "trainer.rollout_paths=3"), 19)]:
        soar = _small(arch, "trainer.name=soar", "rewards=[]", *overrides)
        assert activations(soar) == pytest.approx(rows * activations(sft))


@pytest.mark.parametrize("compute_dtype", ["fp32", "model"])
def test_a_lora_forward_is_sized_as_the_policys_own_adapter_saves_it(tiny_model_dir, compute_dtype):
    """The meta forward under LoRA saves, byte for byte, what the tiny SD3 transformer saves on the CPU with the
    adapter the policies add (pipelines.lora.setup_training, bf16 base, float32 adapter): frozen layers keep
    no input for a weight gradient, each adapted one peft's float32 copy of its input (``fp32``) or none
    (``model``: the adapter computes in bf16). A full fine-tune's count differs."""
    from diffusers import SD3Transformer2DModel

    from flowalign.parallel import block_modules
    from flowalign.plan import saved_activation_bytes
    from pipelines.lora import setup_training
    from pipelines.memory import transformer_inputs
    from pipelines.sd3 import DEFAULT_LORA_TARGETS

    folder, size = tiny_model_dir("sd3"), {"height": 64, "width": 64, "max_sequence_length": 16}
    common = [f"model.path={folder}", "trainer.batch_size=2", "trainer.guidance_scale=1", f"model.defaults={json.dumps(size)}",
              "model.dtype=bf16", "model.lora.rank=4", "model.lora.alpha=8", f"model.lora.compute_dtype={compute_dtype}"]
    planned = {f: inspect_model(load_config(None, [*common, f"model.finetune={f}"]), folder).activations for f in ("lora", "full")}
    transformer = SD3Transformer2DModel.from_pretrained(folder / "transformer").to(torch.bfloat16)
    setup_training(transformer, lora={"rank": 4, "alpha": 8, "compute_dtype": compute_dtype}, full_finetune=False,
                   default_targets=DEFAULT_LORA_TARGETS)
    real = saved_activation_bytes(transformer, block_modules(transformer),
                                  transformer_inputs("sd3", transformer.config, 2, _as_planned(folder, size), device="cpu",
                                                     dtype=torch.bfloat16))
    assert 2 * planned["lora"].in_blocks == pytest.approx(real.in_blocks, rel=0.01) and real.in_blocks > 0
    assert 2 * planned["lora"].outside == pytest.approx(real.outside, rel=0.01)
    assert planned["full"].in_blocks != pytest.approx(planned["lora"].in_blocks, rel=0.05)
    cfg = _small(ARCH / "sd3.5-medium", "model.lora.target_modules=[no_such_layer]")
    with pytest.raises(UserError, match="match no linear layer"):
        inspect_model(cfg, ARCH / "sd3.5-medium")


#: peak memory measured on one H200, 2026-12, torch 2.11, with the settings below:
#: ``torch.cuda.max_memory_allocated`` over the run (GB = 1e9 bytes; docs/performance.md, "Memory planner").
#: SD3.5-M: ``flowalign train`` steps 1-4 of Flow-GRPO, 4 prompts x 2 samples, 10 SDE steps, CFG 4.5, 512 px,
#: LoRA r32/alpha64, KL 0.04, T5 128 tokens, no gradient checkpointing (37.9 GiB); Wan 2.1-1.3B:
#: ``scripts/gpu_fullsize.py``, the recipe cut to 1 prompt x 4 samples, batch 4, with checkpointing (31.0 GiB)
MEASURED_PEAKS = [
    ("configs/sd3.5-medium/flow_grpo_vvr.yaml", "sd3.5-medium", (
        "model.gradient_checkpointing=false", "model.lora.rank=32", "model.lora.alpha=64",
        "model.defaults={height: 512, width: 512, max_sequence_length: 128, num_steps: 10, guidance_scale: 4.5}",
        "trainer.prompts_per_step=4", "trainer.group_size=2", "trainer.batch_size=8", "trainer.num_steps=10",
        "trainer.guidance_scale=4.5", "trainer.timestep_fraction=0.99", "trainer.steps_per_chunk=0",
        "trainer.updates_per_epoch=1", "trainer.beta=0.04"), 40.7),
    ("configs/wan2.1-1.3b/flow_grpo_motion.yaml", "wan2.1-1.3b", (
        "trainer.prompts_per_step=1", "trainer.group_size=4", "trainer.batch_size=4"), 33.3),
]


@pytest.mark.parametrize("recipe,arch,overrides,measured_gb", MEASURED_PEAKS, ids=["sd3.5m-no-ckpt", "wan1.3b-ckpt"])
def test_the_plan_predicts_the_measured_gpu_peaks_within_15_percent(recipe, arch, overrides, measured_gb):
    cfg = load_config(REPO_ROOT / recipe, [f"model.path={ARCH / arch}", *overrides])
    rows = predicted_rows(cfg, ARCH / arch)
    predicted = sum(rows.values()) / GB
    assert abs(predicted - measured_gb) / measured_gb < 0.15, {k: round(v / GB, 2) for k, v in rows.items()}


def test_the_plan_says_what_its_estimate_is_calibrated_on(capsys):
    assert main(["plan", str(SD35_RECIPE)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert CALIBRATION in lines and lines.index(CALIBRATION) == next(i for i, l in enumerate(lines) if l.startswith("  total")) + 1
    assert "H200" in CALIBRATION and "docs/performance.md" in CALIBRATION


@pytest.mark.parametrize("family,blocks", [("sd3", "last:1"), ("sd3", [0]), ("flux", "last:1")])
def test_a_shallow_lora_counts_the_adapter_on_its_blocks_only(tiny_model_dir, family, blocks):
    """With ``model.lora.blocks`` the plan's trained parameters are those of the adapter the policy really
    adds (peft on the chosen blocks' layers), fewer than an adapter on every block; its meta forward saves
    what the real shallow adapter's forward saves (a frozen block keeps no float32 input copy)."""
    import pipelines
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    from flowalign.parallel import block_modules
    from flowalign.plan import saved_activation_bytes
    from pipelines.lora import setup_training
    from pipelines import flux, sd3
    from pipelines.memory import transformer_inputs

    folder, size = tiny_model_dir(family), {"height": 64, "width": 64, "max_sequence_length": 16}
    common = [f"model.path={folder}", "trainer.batch_size=2", "trainer.guidance_scale=1", f"model.defaults={json.dumps(size)}",
              "model.dtype=bf16", "model.lora.rank=4", "model.lora.alpha=8"]
    shallow = inspect_model(load_config(None, [*common, f"model.lora.blocks={json.dumps(blocks)}"]), folder)
    every = inspect_model(load_config(None, common), folder)
    policy = pipelines.load(folder, lora={"rank": 4, "alpha": 8, "blocks": blocks})
    real = sum(p.numel() for p in policy.trainable.parameters() if p.requires_grad)
    assert shallow.trainable == real and 0 < real < every.trainable
    assert every.trainable == sum(p.numel() for p in pipelines.load(folder, lora={"rank": 4, "alpha": 8})
                                  .trainable.parameters() if p.requires_grad)
    cls, targets = {"sd3": (SD3Transformer2DModel, sd3.DEFAULT_LORA_TARGETS),
                    "flux": (FluxTransformer2DModel, flux.DEFAULT_LORA_TARGETS)}[family]
    transformer = cls.from_pretrained(folder / "transformer").to(torch.bfloat16)
    setup_training(transformer, lora={"rank": 4, "alpha": 8, "blocks": blocks}, full_finetune=False,
                   default_targets=list(targets))
    saved = saved_activation_bytes(transformer, block_modules(transformer),
                                   transformer_inputs(family, transformer.config, 2, _as_planned(folder, size), device="cpu",
                                                      dtype=torch.bfloat16))
    assert 2 * shallow.activations.in_blocks == pytest.approx(saved.in_blocks, rel=0.01)
    assert shallow.activations.in_blocks < every.activations.in_blocks


@pytest.mark.parametrize("recipe,overrides,swaps", [
    ("flow_grpo_vvr", ("trainer.ema_decay=0",), False),  # the KL reference is the adapter switched off
    ("flow_grpo_vvr", ("trainer.ema_decay=0", "model.finetune=full", "trainer.beta=0.04"), False),  # frozen modules
    ("flow_grpo_vvr", ("trainer.ema_decay=0.9",), True),  # evaluation samples with the EMA's weights
    ("diffusion_nft_vvr", ("trainer.ema_decay=0",), True),  # behaviour weights sample the rollouts
    ("gardo_vvr", ("trainer.ema_decay=0",), True),  # its KL reference is a snapshot
    ("seppo_vvr", ("trainer.ema_decay=0",), True),  # its reference checkpoints sample the losing side
    ("flow_opd_vvr", ("trainer.ema_decay=0",), True),  # the teachers' adapters
])
def test_plan_knows_which_trainers_swap_weights_into_the_live_parameters(recipe, overrides, swaps):
    cfg = load_config(REPO_ROOT / "configs" / "tiny" / f"{recipe}.yaml", list(overrides))
    assert settings(cfg, "ddp", 1).swapped_in is swaps


class _NewStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the storages the ops run inside it make (an in-place copy or a view makes none)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_plan_counts_the_live_weights_swapped_in_keeps_during_sampling(finetune, tmp_path, monkeypatch):
    """DiffusionNFT samples with its behaviour weights swapped into the live parameters: ``swapped_in`` then
    holds a copy of the live trained tensors, measured here on the tiny recipe's trainer, which the plan
    adds to the sampling peak (decoding runs under it) and nowhere else: the gradients are freed then, so
    while the decode is below the update's peak the copy changes nothing."""
    from flowalign.train import build_trainer
    from tests.tiny_recipes import one_step

    monkeypatch.chdir(REPO_ROOT)
    recipe = REPO_ROOT / "configs" / "tiny" / "diffusion_nft_vvr.yaml"
    cfg = load_config(recipe, [*one_step(recipe, tmp_path / "run"), f"model.finetune={finetune}", "trainer.ema_decay=0"])
    trainer = build_trainer(cfg)
    with _NewStorages() as new, trainer.behaviour.swapped_in():
        pass
    model = inspect_model(cfg, REPO_ROOT / cfg.model.path)
    s = settings(cfg, "ddp", 1, model)
    assert s.swapped_in and new.bytes == model.trainable * (4 if finetune == "lora" else BYTES[cfg.model.dtype]) > 0
    row = "sampling, above the update's peak"
    plain, swapping = replace(s, swapped_in=False), s
    below = replace(model, decode=0.0)
    assert memory_rows(below, swapping) == memory_rows(below, plain)
    above = replace(model, decode=10 * GB)
    assert memory_rows(above, swapping)[row] - memory_rows(above, plain)[row] == pytest.approx(new.bytes)
    others = {k: v for k, v in memory_rows(above, swapping).items() if k != row}
    assert others == {k: v for k, v in memory_rows(above, plain).items() if k != row}
    # under fsdp each rank keeps its shards' live values
    sharded = {sw: memory_rows(above, replace(s, strategy="fsdp", gpus=4, swapped_in=sw))[row] for sw in (True, False)}
    assert sharded[True] - sharded[False] == pytest.approx(new.bytes / 4)


def test_plan_suggests_no_strategy_the_trainer_refuses(monkeypatch):
    """GARDO refuses fsdp in its check_config: its plan has no fsdp column, says why in the trainer's words, and
    never suggests fsdp as the change that fits; Flow-GRPO, which takes it, keeps both."""
    from flowalign.plan import fsdp_refusal

    monkeypatch.chdir(REPO_ROOT)
    gardo = load_config(REPO_ROOT / "configs" / "tiny" / "gardo_vvr.yaml")
    refusal = fsdp_refusal(gardo)
    assert refusal is not None and refusal.startswith("parallel.strategy=fsdp: gardo")
    out = plan_text(gardo, REPO_ROOT / gardo.model.path, 4, 0.001)
    assert "fsdp" not in out.split("memory per rank")[1].splitlines()[1]  # the columns: ddp alone
    assert f"fsdp: not planned, the trainer refuses it ({refusal})" in out
    assert "parallel.strategy=fsdp" not in out.split(refusal)[1] and "ddp: does not fit" in out
    model = inspect_model(gardo, REPO_ROOT / gardo.model.path)
    # the less disruptive changes already made: fsdp would be the first suggestion
    s = replace(settings(gardo, "ddp", 4, model), gradient_checkpointing=True, offload_text_encoders=True)
    total = sum(memory_rows(model, s).values())
    assert smallest_fix(model, s, total - 1, fsdp=True) == "parallel.strategy=fsdp"  # what it would have said
    fix = smallest_fix(model, s, total - 1, fsdp=False)
    assert fix is None or "fsdp" not in fix
    grpo = load_config(REPO_ROOT / "configs" / "tiny" / "flow_grpo_vvr.yaml")
    assert fsdp_refusal(grpo) is None
    assert "fsdp" in plan_text(grpo, REPO_ROOT / grpo.model.path, 4, 80).split("memory per rank")[1].splitlines()[1]


def test_the_tiny_sd3_plan_sizes_the_latents_and_text_its_policy_makes(tmp_path, monkeypatch):
    """The SD3 inputs read the VAE's factor from its block_out_channels (the tiny twin's VAE halves twice: 4,
    not the released 8) and CLIP's length from its tokenizer (48, not 77): a planned rollout sample's latent
    and conditioning (both CFG branches) are the bytes of the ones a real tiny rollout holds."""
    from flowalign.train import build_trainer
    from tests.tiny_recipes import one_step

    monkeypatch.chdir(REPO_ROOT)
    path = REPO_ROOT / "configs" / "tiny" / "flow_grpo_vvr.yaml"
    cfg = load_config(path, one_step(path, tmp_path / "run"))
    trainer = build_trainer(cfg)
    rollout = trainer.sample(["a red circle"] * 2, [{}, {}], torch.tensor([0, 0]), torch.tensor([0, 0]), 0).chunks[0]
    model = inspect_model(cfg, REPO_ROOT / cfg.model.path)
    assert rollout.latents.dtype == torch.float32 and rollout.latents.shape[-2:] == (16, 16)  # 64 px / 4
    assert model.rollout.latent == rollout.latents[:1, 0].nbytes
    assert model.rollout.conditioning == sum(t[:1].nbytes for t in rollout.cond.tensors.values())
    assert model.rollout.decoded == rollout.samples[:1].nbytes
    # the released architecture keeps its 8 and 77
    sd35 = inspect_model(_sd35(), ARCH / "sd3.5-medium")
    assert sd35.rollout.latent == 16 * (512 // 8) ** 2 * 4


@pytest.mark.parametrize("twin, trainer", [("causal_wan", "kvpo"), ("anyflow_far", "ar_copo")])
def test_a_streamed_samples_kv_caches_are_counted_as_a_rollout_keeps_them(twin, trainer, tiny_model_dir):
    """The bytes ``plan`` counts for a streamed sample's caches are those a real rollout of the tiny twin keeps
    (every distinct tensor of its ``caches``): the causal Wan's shared entries, AnyFlow-FAR's cache a chunk."""
    import pipelines
    from flowalign.sampling import stream_rollout

    folder = tiny_model_dir(twin)
    cfg = load_config(None, [f"model.path={folder}", f"trainer.name={trainer}", "trainer.num_steps=2"])
    counted = inspect_model(cfg, folder).rollout.kv_cache
    policy = pipelines.load(folder)
    r = stream_rollout(policy, ["a"], num_steps=2, initial_noise=policy.initial_noise(1, torch.Generator().manual_seed(0)),
                       decode=False)
    tensors: dict[int, torch.Tensor] = {}
    for cache in r.caches:
        parts = ([t for seg in cache.segments for kv in seg.blocks for t in kv] if twin == "causal_wan"
                 else [t for layer in cache.layers.values() for t in layer.values()])
        tensors.update({t.data_ptr(): t for t in parts})
    assert counted > 0 and counted == sum(t.nbytes for t in tensors.values())


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_streaming_trainers_training_forward_is_its_chunk_calls(checkpointed, tiny_model_dir):
    """KVPO's loss holds a call of ``G`` one-chunk rows per window chunk and step: planned as all of them at once,
    or, with gradient checkpointing (each call recomputed in the backward pass), as one call."""
    folder = tiny_model_dir("causal_wan")

    def planned(window: int) -> float:
        cfg = load_config(None, [f"model.path={folder}", "trainer.name=kvpo", "trainer.group_size=4",
                                 f"trainer.window_chunks={window}", f"model.gradient_checkpointing={checkpointed}"])
        return inspect_model(cfg, folder).activations.per_rank(checkpointed=checkpointed)

    one, two = planned(1), planned(2)
    assert one > 0 and (two == pytest.approx(one) if checkpointed else two == pytest.approx(2 * one, rel=0.05))


def test_a_resident_causal_cache_is_counted_as_the_frames_it_holds(tmp_path):
    """With LongLive's resident cache (``cache_frames``, the window by default) a stream that keeps no cache to
    fork from holds at most the cache's frames: ``plan`` counts them, at least every resident cache's entries of
    the stream and fewer than every frame's."""
    import pipelines
    from flowalign.sampling import stream_rollout
    from pipelines.tiny import save_tiny

    folder = tmp_path / "causal"
    save_tiny("causal_wan", folder, sampling={"num_frames": 29, "attention_window": 9, "sink_frames": 3})
    cfg = load_config(None, [f"model.path={folder}", "trainer.name=kvpo", "trainer.num_steps=2"])
    counted = inspect_model(cfg, folder).rollout.kv_cache
    policy = pipelines.load(folder)
    r = stream_rollout(policy, ["a"], num_steps=2, initial_noise=policy.initial_noise(1, torch.Generator().manual_seed(0)),
                       decode=False)
    per_cache = [sum(t.nbytes for seg in c.segments for kv in seg.blocks for t in kv) for c in r.caches]
    per_frame = per_cache[-1] / len(r.caches[-1].alive())
    assert max(per_cache) <= counted < 12 * per_frame  # the 12 frames written before the last chunk
