"""The check to run first whenever a GPU is at hand (about 8 minutes on one H200): one table, one JSON file.

    python scripts/gpu_check.py [--out gpu_check.json] [--reference-src DIR] [--device cuda]
    python scripts/gpu_check.py --smoke --out smoke.json           # the same code paths, tiny, on the CPU (tests)

(a) recipes: every ``configs/tiny/*.yaml`` trains 2 steps on the device from a fresh run folder, each in its
    own process (one crash, hang or CUDA error stops that recipe alone), with a JPEG-size reward beside its
    own so that rewards differ inside every group and every update runs (a differentiable brightness term where
    the recipe's rewards are all differentiable, as a reward-gradient trainer needs). Recorded: status, the last
    step's loss and gradient norm (finite), the device of the trained weights, seconds. A recipe whose shipped
    prerequisite is missing (a teacher, a latent reward, a reward model's download) is ``stopped`` with
    its one-line reason, as a user would see it; ``failed``, ``nonfinite``, ``no-update`` and
    ``wrong-device`` are failures. A recipe that pins a former form of its trainer (kept as measured) runs
    again with the trainer's defaults, the authors' forms a user gets (the ``RECIPE+defaults`` rows); the
    streaming recipes run once more on a tiny causal Wan (``RECIPE+defaults@causal_wan``: Self-Forcing /
    LongLive's architecture and re-noising sampler).
(b) side by side (``--reference-src DIR``: a source tree of github.com/yifan123/flow_grpo, see
    ``docs/performance.md``): SD3.5-Medium at its released size (random weights), Flow-GRPO, 4 prompts x 2
    samples, 10 SDE steps (9 trained), CFG 4.5, 512 px, LoRA r32/alpha64, KL beta 0.04, T5 128 tokens, no
    gradient checkpointing: ``flowalign`` (bf16), the reference's own functions as its base config ships
    them (``reference_fp16``: fp16 autocast, fp32 weights) and with the transformer in bf16
    (``reference_bf16``); each side in its own process, a warm-up iteration then ``--repeats`` timed ones
    (minimum). Rollout, training pass, iteration, peak memory, and MFU: the transformer's passes each side
    runs (rows counted by a forward hook; a pass with gradients counts three forwards), FLOPs per row
    counted on the meta device, over the measured bf16 matrix-product rate of this GPU (``--peak-tflops``).
(c) plan: ``flowalign plan``'s total for one GPU against the step's measured peak
    (``torch.cuda.max_memory_allocated``, the trainer's ``memory/peak_gib_allocated``) for SD3.5-Medium with
    and without gradient checkpointing (4 prompts x 2, batch 8) and Wan 2.1-1.3B (its recipe, 4 samples).

(d) levers (``--parts levers``, not in the default parts: about 4 more minutes): flowalign's side of (b) in one
    process, one speed option switched on after another (``model.allow_tf32``, ``model.lora.compute_dtype=model``,
    ``model.attention_backend=_native_cudnn``, ``trainer.optimizer_kernel=fused``, then ``model.compile``), each
    timed as (b) times a side, with its ratio to the defaults' iteration and MFU; and a ``torch.profiler`` table
    of one iteration with the defaults (the operators taking the most device time), to choose the defaults from
    and the next lever.

``--smoke``: (a) on two tiny recipes for 1 step at the test suite's sizes, (c) on the tiny SD3 twin, (b)
only when ``--reference-src`` is given (on the tiny twin), (d) on the tiny twin with the options a CPU runs
quickly (no compile, no TF32 or CUDA attention kernel), all on the CPU unless ``--device`` says otherwise.
Exit status 1 when anything failed (``stopped`` recipes are not failures).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
if str(SCRIPTS) not in sys.path:  # bench.py, bench_reference.py and gpu_fullsize.py beside this file
    sys.path.insert(0, str(SCRIPTS))
TINY = REPO / "configs" / "tiny"
GIB = 2**30
MARK = "gpu_check"  # the key that says a JSON file is this check's own output (rewritten without asking)

# ------------------------------------------------------------------------------------------- (a) recipes

#: every run quiet and short: no evaluation, no progress bar, no TensorBoard, never a resumed run
QUIET = ("trainer.max_minutes=null", "eval.bench=null", "eval.prompts=null", "eval.rewards=[]", "eval.every=0",
         "eval.at_start=false", "run.progress=false", "run.tensorboard=false", "run.resume=never",
         "run.checkpoint_every=1000000")
#: --smoke's size of a step (as the tiny-config test's): one prompt, 2 samples, 2 sampling steps
SMOKE_SIZE = ("trainer.prompts_per_step=1", "trainer.group_size=2", "trainer.batch_size=2", "trainer.num_steps=2",
              "data.n=16")
#: what a recipe's own settings need beside SMOKE_SIZE (tests/test_tiny_configs_train.py keeps the same list)
SMOKE_FIT = {"dance_grpo_vvr": ("trainer.num_steps=4",), "pref_grpo_vvr": ("trainer.num_steps=4",),
             "flash_grpo_vvr": ("trainer.num_steps=4",), "flash_grpo_motion": ("trainer.num_steps=4",),
             "mix_grpo_vvr": ("trainer.num_steps=4",), "tempflow_grpo_vvr": ("trainer.branch_steps=null",),
             "festdpo_vvr": ("trainer.K=8", "trainer.pairs_per_prompt=2"), "afd_motion": ("trainer.teacher.num_steps=2",),
             # four prompts: a step whose prompts match neither teacher's domain trains nothing
             "flow_opd_vvr": ("trainer.cold_start_steps=0", "trainer.prompts_per_step=4"),
             # the authors' 4 anchors need more than smoke's 2 candidates; their 100-group reference buffer, 2 here
             "ar_copo_motion": ("trainer.anchors=2", "trainer.buffer_size=2")}
#: a recipe's ``+defaults`` row where the authors' forms need another reward than the recipe's: KVPO's local
#: signal scores the routed chunk's frames alone, which the tiny motion verifier (a whole-trajectory judge) calls
#: invalid, so that row is scored by the JPEG size of the video alone, which scores any clip
DEFAULTS_FIT = {"kvpo_motion": ('rewards=[{"name": "jpeg_compressibility_video"}]',)}
#: the streaming recipes run again on a tiny causal Wan (Self-Forcing / LongLive's architecture: its KV cache,
#: rotary positions and re-noising draws made per call), with their trainers' defaults, at the motion tasks' 9
#: frames streamed one latent frame a chunk: rows ``RECIPE+defaults@causal_wan``
CAUSAL_WAN = "@causal_wan"
CAUSAL_RECIPES = ("kvpo_motion", "ar_copo_motion", "afd_motion")
CAUSAL_OVERRIDES = ("model.defaults={num_frames: 9, chunk_frames: 1}",)
#: --smoke's recipes: the reference trainer and one that once mixed CPU and CUDA tensors (both quick on a CPU),
#: whose recipe pins former forms, so its authors' defaults run as a row of their own too
SMOKE_RECIPES = ("flow_grpo_vvr", "dgpo_vvr")
#: the label of a recipe's row run with its trainer's defaults where the recipe pins a former form
DEFAULTS = "+defaults"
#: the JPEG term's weight: enough to separate samples a verifier scores alike, small beside the recipe's reward
JPEG_WEIGHT = 0.1
#: the varying term of a recipe whose rewards are all differentiable (a reward-gradient trainer, DiffusionOPSD or
#: FAV, refuses a reward without a gradient such as the JPEG size): a differentiable pixel statistic
GRADIENT_TERM = "brightness"
#: trainers whose credit reads a reward in [0, 1] (UMM-Reflection's shaped trajectory reward): the recipe's rewards
#: are scaled to 1 − JPEG_WEIGHT and the varying term is a score in [0, 1] (:data:`GRADIENT_TERM`), so the total
#: stays a score in [0, 1]
UNIT_RANGE_TRAINERS = ("umm_reflection",)
FAILURES = ("failed", "nonfinite", "no-update", "wrong-device", "timeout")


def varying_rewards(recipe: Path) -> str:
    """The ``rewards=`` override: the recipe's own rewards plus a JPEG-size term (the video twin for a video
    recipe), so samples that the recipe's reward scores alike still differ and every update runs; where the
    recipe's rewards are all differentiable, a differentiable term (:data:`GRADIENT_TERM`) in its place, which a
    trainer that follows its rewards' gradient accepts; for a trainer of :data:`UNIT_RANGE_TRAINERS`, that term
    beside the recipe's rewards scaled to 1 − :data:`JPEG_WEIGHT`."""
    from flowalign.plugins import differentiable_rewards

    data = yaml.safe_load(recipe.read_text()) or {}
    rewards = list(data.get("rewards") or [{"name": "vvr"}])
    names = " ".join(str(r.get("name", "")) for r in rewards if isinstance(r, dict))
    video = "motion" in names or "video" in names
    gradients = set(differentiable_rewards())
    if ((data.get("trainer") or {}).get("name") in UNIT_RANGE_TRAINERS
            and all(isinstance(r, dict) for r in rewards)):
        scaled = [{**r, "weight": float(r.get("weight", 1.0)) * (1 - JPEG_WEIGHT)} for r in rewards]
        return "rewards=" + json.dumps([*scaled, {"name": GRADIENT_TERM, "weight": JPEG_WEIGHT}])
    if not video and all(isinstance(r, dict) and r.get("name") in gradients for r in rewards):
        term = {"name": GRADIENT_TERM, "weight": JPEG_WEIGHT}
    else:
        term = {"name": "jpeg_compressibility_video" if video else "jpeg_compressibility", "weight": JPEG_WEIGHT}
    return "rewards=" + json.dumps([*rewards, term])


def authors_defaults(recipe: Path) -> list[str]:
    """Overrides that set each option the recipe pins to a former form (a tiny recipe keeps the form it was
    measured with) back to its trainer's default, the authors' form a user gets; [] when it pins none."""
    from flowalign.trainers import get_trainer

    section = (yaml.safe_load(recipe.read_text()) or {}).get("trainer") or {}
    pinned = get_trainer(str(section.get("name", "flow_grpo"))).Config.pinned_former_forms(section)
    return [f"trainer.{k}={json.dumps(v)}" for k, v in pinned.items()]


def recipe_overrides(recipe: Path, run_dir: Path, steps: int, smoke: bool, defaults: bool = False,
                     twin: Path | None = None) -> list[str]:
    """The overrides of ``recipe``'s row (``twin``: on that tiny causal Wan folder, :data:`CAUSAL_OVERRIDES`)."""
    overrides = [f"run.output_dir={run_dir}", f"trainer.max_steps={steps}", *QUIET, varying_rewards(recipe)]
    if twin is not None:
        overrides += [f"model.path={twin}", *CAUSAL_OVERRIDES]
    if smoke:  # each trainer setting only to a trainer that has it
        from flowalign.trainers import get_trainer

        name = str(((yaml.safe_load(recipe.read_text()) or {}).get("trainer") or {}).get("name", "flow_grpo"))
        fields = get_trainer(name).Config.model_fields
        sized = [o for o in SMOKE_SIZE if not o.startswith("trainer.") or o.split("=")[0].split(".", 1)[1] in fields]
        overrides += [*sized, *SMOKE_FIT.get(recipe.stem, ())]
    return overrides + ([*authors_defaults(recipe), *DEFAULTS_FIT.get(recipe.stem, ())] if defaults else [])


def _where(err: BaseException) -> str:
    """``Type: first line (file:line)`` of an exception, the frame it was raised in."""
    frames = traceback.extract_tb(err.__traceback__)
    at = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {first}{at}"


def run_one_recipe(recipe: Path, run_dir: Path, steps: int, smoke: bool, device: str,
                   defaults: bool = False, twin: Path | None = None) -> dict[str, Any]:
    """Train ``recipe`` for ``steps`` steps in this process (``defaults``: with :func:`authors_defaults`; ``twin``:
    on that tiny causal Wan); what the table reports about it."""
    from flowalign.config import load_config
    from flowalign.errors import UserError
    from flowalign.train import build_trainer

    os.chdir(REPO)  # recipes name their assets relative to the repository, as the README runs them
    row: dict[str, Any] = {"recipe": row_label(recipe, defaults, twin)}
    t0 = time.perf_counter()
    try:
        cfg = load_config(recipe, recipe_overrides(recipe, run_dir, steps, smoke, defaults, twin))
        torch.manual_seed(0)
        trainer = build_trainer(cfg)
        trainer.train()
    except UserError as err:  # a prerequisite the recipe names is missing here: the user's one line
        line = (str(err).splitlines() or [""])[0][:300]
        # the loop's own stop on a non-finite loss or weight is a UserError too, and a failure here
        row.update(status="nonfinite" if "non-finite" in line else "stopped", error=line)
        return row
    except Exception as err:  # noqa: BLE001 - any other error is the recipe's failure, recorded in one line
        row.update(status="failed", error=_where(err))
        return row
    finally:
        row["seconds"] = round(time.perf_counter() - t0, 2)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if '"time/step"' in line] \
        if metrics.exists() else []
    weights = trainer.params[0] if trainer.params else None
    row["weights_device"] = str(weights.device) if weights is not None else None
    row["steps"] = len(rows)
    last = rows[-1] if rows else {}
    losses = sorted(k for k in last if k.startswith("train/") and "loss" in k)
    row["loss_key"] = losses[0] if losses else None
    row["loss"] = last.get(losses[0]) if losses else None
    row["grad_norm"] = last.get("train/grad_norm")
    row["peak_gib"] = max((r.get("memory/peak_gib_allocated", 0.0) for r in rows), default=0.0) or None
    numbers = [v for r in rows for v in r.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    finite_weights = all(bool(torch.isfinite(p).all()) for p in trainer.params)
    if len(rows) != steps:
        row["status"], row["error"] = "failed", f"{len(rows)} of {steps} steps logged"
    elif not (finite_weights and all(math.isfinite(v) for v in numbers)):
        row["status"] = "nonfinite"
    elif any("train/grad_norm" not in r for r in rows) or not row["grad_norm"]:
        row["status"] = "no-update"  # a step logged no gradient: its update was skipped
    elif torch.device(row["weights_device"]).type != torch.device(device).type:
        row["status"] = "wrong-device"
    else:
        row["status"] = "ok"
    return row


def _child_env(device: str, threads: int | None = None) -> dict[str, str]:
    """The environment of a child process; ``threads``: its CPU threads where several children run at once (each
    would otherwise start one per core)."""
    env = dict(os.environ)
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if torch.device(device).type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU run of a GPU machine: no process touches the GPU
    return env


def run_child(args: list[str], result: Path, log: Path, device: str, timeout: float,
              threads: int | None = None) -> dict[str, Any]:
    """This script in a new process (``args``: its hidden mode); the JSON it wrote, or why it wrote none."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *args, "--result", str(result), "--device", device]
    with open(log, "w") as out:
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=_child_env(device, threads), cwd=REPO,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "error": f"no result within {timeout:.0f} s (log: {log})"}
    if result.exists():
        return json.loads(result.read_text())
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or ["no output"]
    return {"status": "failed", "error": f"exit status {proc.returncode}: {tail[0][:300]} (log: {log})"}


def row_label(recipe: Path, defaults: bool, twin: Path | None) -> str:
    return recipe.stem + (DEFAULTS if defaults else "") + (CAUSAL_WAN if twin is not None else "")


def recipe_rows(recipes: list[Path], twin: Path | None) -> list[tuple[Path, bool, Path | None]]:
    """``(recipe, defaults, twin)`` of every row: each recipe, its ``+defaults`` row where it pins a former form,
    and a streaming recipe's ``+defaults@causal_wan`` row on ``twin`` (when given)."""
    rows = [(r, d, None) for r in recipes for d in (False, True) if not d or authors_defaults(r)]
    return rows + [(r, True, twin) for r in recipes if twin is not None and r.stem in CAUSAL_RECIPES]


def check_recipes(recipes: list[Path], work: Path, steps: int, smoke: bool, device: str, jobs: int,
                  timeout: float) -> list[dict[str, Any]]:
    """Every recipe in its own process, ``jobs`` at a time, and again with its trainer's defaults where it pins
    a former form (the ``+defaults`` rows), and the streaming ones on a tiny causal Wan (built here once);
    rows in the recipes' order."""
    def one(entry: tuple[Path, bool, Path | None]) -> dict[str, Any]:
        recipe, defaults, on = entry
        label = row_label(recipe, defaults, on)
        folder = work / "recipes" / label
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        t0 = time.perf_counter()
        row = run_child(["--run-recipe", str(recipe), "--steps", str(steps), *(["--smoke"] if smoke else []),
                         *(["--authors-defaults"] if defaults else []), *(["--twin", str(on)] if on else []),
                         "--run-dir", str(folder / "run")],
                        folder / "result.json", folder / "log.txt", device, timeout, threads)
        row.setdefault("recipe", label)
        row["process_seconds"] = round(time.perf_counter() - t0, 2)  # imports and loading included
        print(f"  recipe {label}: {row['status']}" + (f" ({row['error']})" if row.get("error") else ""), flush=True)
        return row

    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))  # the children share the cores
    twin = None
    if any(r.stem in CAUSAL_RECIPES for r in recipes):
        from pipelines.tiny import save_tiny

        twin = work / "causal_wan_twin"
        shutil.rmtree(twin, ignore_errors=True)
        save_tiny("causal_wan", twin)
    entries = recipe_rows(recipes, twin)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, entries))


# ------------------------------------------------------------------------------------------- (b) side by side

#: the side-by-side setting at full size: bench.py's Flow-GRPO setting with the recipe's LoRA
def full_setting() -> dict[str, Any]:
    import bench

    return {**bench.SETTING, "rank": 32, "alpha": 64.0}


SIDES = ("flowalign", "reference_fp16", "reference_bf16")


class RowCounter:
    """Rows through the transformer, in forward-pass equivalents: a pass with gradients counts 3 (its
    backward costs about two forwards, the usual MFU convention), one without 1."""

    def __init__(self, module: torch.nn.Module):
        self.rows = 0.0
        module.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs) -> None:
        x = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(x, torch.Tensor):
            self.rows += x.shape[0] * (3 if torch.is_grad_enabled() else 1)


def run_side(side: str, folder: Path, work: Path, reference_src: Path | None, repeats: int, device: str,
             size: int, max_len: int) -> dict[str, Any]:
    """One side of the side-by-side in this process: a warm-up iteration, then ``repeats`` timed ones."""
    import bench
    from bench_timing import redness

    cuda = torch.device(device).type == "cuda"
    setting = full_setting() if size >= 256 else bench.SETTING
    if side == "flowalign":
        extra = ["model.dtype=bf16"] if cuda else []
        trainer = bench.build_flowalign(folder, work / "flowalign", "bench_timing:redness", 8, size=size,
                                        max_sequence_length=max_len, setting=setting,
                                        extra=[*extra, "model.gradient_checkpointing=false"])
        counter = RowCounter(trainer.policy.transformer)

        def iteration(rep: int) -> tuple[float, float]:
            return bench.flowalign_iteration(trainer)
    else:
        from bench_reference import ReferenceFlowGRPO

        precision = side.rsplit("_", 1)[1]
        # the bf16 transformer runs under bf16 autocast on a CPU too (a CPU has no fp16 autocast: fp32 there)
        ref = ReferenceFlowGRPO(reference_src, folder, redness, setting, bench.PROMPTS, bench.LORA_TARGETS, max_len,
                                device=device, mixed_precision=precision if cuda or precision == "bf16" else "no",
                                transformer_dtype="bf16" if precision == "bf16" else "fp32", size=size)
        counter = RowCounter(ref.pipe.transformer)
        iteration = ref.iteration
    iteration(0)  # warm-up: kernels chosen, caches filled
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = timed_iterations(iteration, counter, repeats, device)
    best = min(times, key=lambda t: t["iteration_s"])
    return {"side": side, "status": "ok", **{k: round(v, 3) for k, v in best.items()},
            "rollout_min_s": round(min(t["rollout_s"] for t in times), 3),
            "train_min_s": round(min(t["train_s"] for t in times), 3),
            "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None}


def timed_iterations(iteration: Any, counter: RowCounter, repeats: int, device: str) -> list[dict[str, float]]:
    """``repeats`` iterations ``iteration(rep) -> (rollout_s, train_s)``, each timed from a drained device queue
    to a drained queue, with the transformer rows it ran."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times = []
    for rep in range(1, repeats + 1):
        counter.rows = 0.0
        sync()
        t0 = time.perf_counter()
        rollout_s, train_s = iteration(rep)
        sync()
        times.append({"rollout_s": rollout_s, "train_s": train_s, "iteration_s": time.perf_counter() - t0,
                      "rows": counter.rows})
    return times


def row_flops(folder: Path, size: int, max_len: int) -> float | None:
    """FLOPs of one row's transformer forward at ``size`` px and ``max_len`` T5 tokens, counted as training runs
    count them (:func:`flowalign.flop_meter.forward_flops`, on the meta device); None when it cannot be counted."""
    from flowalign import families
    from flowalign.flop_meter import forward_flops
    from flowalign.plan import build_on_meta

    transformer = build_on_meta(folder)["transformer"].to(torch.bfloat16)
    spec = families.detect(folder)
    inputs = spec.transformer_inputs(transformer.config, 1, {**spec.size, "height": size, "width": size,
                                                              "max_sequence_length": max_len}, dtype=torch.bfloat16)
    flops = forward_flops(transformer, kwargs=inputs)
    if not flops:
        print("  (FLOPs per row not counted: the forward does not run on the meta device)", flush=True)
    return flops or None


def matmul_tflops(device: str) -> float | None:
    """This GPU's bf16 matrix-product rate (8192^3, mean of 10 after 3 warm-ups), TFLOP/s; None on a CPU."""
    if torch.device(device).type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    rate = 10 * 2 * 8192**3 / (time.perf_counter() - t0) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return rate


def side_by_side(folder: Path, work: Path, reference_src: Path, repeats: int, device: str, size: int, max_len: int,
                 peak_tflops: float | None, timeout: float) -> dict[str, Any]:
    flops = row_flops(folder, size, max_len)
    rows = []
    for side in SIDES:
        d = work / "sides" / side
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        row = run_child(["--run-side", side, "--folder", str(folder), "--reference-src", str(reference_src),
                         "--repeats", str(repeats), "--size", str(size), "--max-len", str(max_len),
                         "--work", str(d)], d / "result.json", d / "log.txt", device, timeout)
        row.setdefault("side", side)
        if row.get("status") == "ok" and flops:
            row["tflops_per_s"] = row["rows"] * flops / row["iteration_s"] / 1e12
            row["mfu"] = row["tflops_per_s"] / peak_tflops if peak_tflops else None
        print(f"  side {side}: {row.get('status')}" + (f" ({row['error']})" if row.get("error") else ""), flush=True)
        rows.append(row)
    return {"flops_per_row_forward": flops, "peak_tflops": peak_tflops, "size": size, "max_sequence_length": max_len,
            "sides": rows}


# ------------------------------------------------------------------------------------------- (d) levers

#: the speed options (d) switches on one after another, each on top of the ones before; CUDA only where marked
LEVERS = [("defaults", False), ("allow_tf32", True), ("lora.compute_dtype=model", False),
          ("attention_backend=_native_cudnn", True), ("optimizer_kernel=fused", False), ("compile", False)]


def switch_on(lever: str, trainer: Any) -> None:
    """What the config option of ``lever`` does at load time, done on a built trainer (its transformer, or its
    optimiser: a new one, whose state its first step makes)."""
    from flowalign.trainers.optim import adamw
    from pipelines.lora import compute_in_input_dtype
    from pipelines.memory import compile_blocks, set_attention_backend

    transformer, device = trainer.policy.transformer, trainer.policy.device
    if lever == "allow_tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
    elif lever == "lora.compute_dtype=model":
        compute_in_input_dtype(transformer)
    elif lever.startswith("attention_backend="):
        set_attention_backend(transformer, lever.split("=", 1)[1], device)
    elif lever == "optimizer_kernel=fused":
        trainer.tcfg.optimizer_kernel = "fused"
        trainer.optimizer = trainer.optimisation.optimizer = adamw(trainer.params, trainer.tcfg)
    elif lever == "compile":
        compile_blocks(transformer)


def profile_table(trainer: Any, device: str, rows: int = 25) -> list[dict[str, Any]]:
    """One iteration under ``torch.profiler``: the operators with the most self device time (CPU time on a
    CPU), with their share of the iteration's total and their call counts."""
    import bench
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        bench.flowalign_iteration(trainer)
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    total = sum(getattr(e, key) for e in events) or 1.0
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    return [{"op": e.key, "ms": round(getattr(e, key) / 1e3, 2), "share": round(getattr(e, key) / total, 4),
             "calls": e.count} for e in events[:rows]]


def run_levers(folder: Path, work: Path, repeats: int, device: str, size: int, max_len: int) -> dict[str, Any]:
    """(d) in this process: the defaults profiled, then each lever switched on and timed as :func:`run_side`
    times a side (a warm-up iteration, which also compiles, then ``repeats`` timed ones)."""
    import bench

    cuda = torch.device(device).type == "cuda"
    setting = full_setting() if size >= 256 else bench.SETTING
    trainer = bench.build_flowalign(folder, work / "levers", "bench_timing:redness", 8, size=size,
                                    max_sequence_length=max_len, setting=setting,
                                    extra=[*(["model.dtype=bf16"] if cuda else []), "model.gradient_checkpointing=false"])
    counter = RowCounter(trainer.policy.transformer)
    bench.flowalign_iteration(trainer)  # warm-up before the profile
    profile = profile_table(trainer, device)
    rows = []
    for lever, cuda_only in LEVERS:
        if cuda_only and not cuda or (lever == "compile" and not cuda):  # a CPU compiles for a minute
            continue
        try:
            switch_on(lever, trainer)
            bench.flowalign_iteration(trainer)  # warm-up: kernels chosen, blocks compiled
            times = timed_iterations(lambda rep: bench.flowalign_iteration(trainer), counter, repeats, device)
            best = min(times, key=lambda t: t["iteration_s"])
            rows.append({"lever": lever, "status": "ok", **{k: round(v, 3) for k, v in best.items()}})
        except Exception as err:  # noqa: BLE001 - the levers after it build on it: stop here, say why
            rows.append({"lever": lever, "status": "failed", "error": _where(err)})
            break
    return {"levers": rows, "profile": profile}


def levers(folder: Path, work: Path, repeats: int, device: str, size: int, max_len: int, peak_tflops: float | None,
           timeout: float) -> dict[str, Any]:
    d = work / "levers"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    got = run_child(["--run-levers", "--folder", str(folder), "--repeats", str(repeats), "--size", str(size),
                     "--max-len", str(max_len), "--work", str(d)], d / "result.json", d / "log.txt", device, timeout)
    rows = got.get("levers") or [{"lever": "defaults", "status": got.get("status", "failed"), "error": got.get("error")}]
    flops = row_flops(folder, size, max_len)
    base = next((r["iteration_s"] for r in rows if r.get("lever") == "defaults" and r.get("status") == "ok"), None)
    for r in rows:
        if r.get("status") != "ok":
            continue
        r["speed_vs_defaults"] = base / r["iteration_s"] if base else None
        if flops:
            r["mfu"] = r["rows"] * flops / r["iteration_s"] / 1e12 / peak_tflops if peak_tflops else None
    return {"rows": rows, "profile": got.get("profile", []), "size": size, "flops_per_row_forward": flops}


# ------------------------------------------------------------------------------------------- (c) plan


def plan_cases(family: str, smoke: bool) -> list[tuple[str, list[str]]]:
    """``(label, extra overrides)`` of the planner comparisons on ``family``'s full-size (smoke: tiny) folder."""
    if family == "sd3":
        batch = ["trainer.prompts_per_step=4", "trainer.group_size=2", "trainer.batch_size=8",
                 "trainer.updates_per_epoch=1"]
        if smoke:
            batch = ["trainer.prompts_per_step=2", "trainer.group_size=2", "trainer.batch_size=4"]
        return [("SD3.5-M, no gradient checkpointing", [*batch, "model.gradient_checkpointing=false"]),
                ("SD3.5-M, gradient checkpointing", [*batch, "model.gradient_checkpointing=true"])]
    return [("Wan 2.1-1.3B (recipe)", [])]


def planned_total(cfg: Any, folder: Path) -> dict[str, float]:
    """``flowalign plan``'s memory rows for one GPU (ddp), GB, and their total (the frozen reward models
    included: the measured peak holds them too)."""
    from flowalign import plan

    model = plan.inspect_model(cfg, folder)
    rows = plan.memory_rows(model, plan.settings(cfg, "ddp", 1, model))
    return {"total_gb": sum(rows.values()) / 1e9, "activations_gb": rows.get("activations", 0.0) / 1e9,
            "reward_models_gb": rows.get("frozen reward models", 0.0) / 1e9}


def check_plan(family: str, folder: Path, work: Path, smoke: bool) -> list[dict[str, Any]]:
    import gpu_fullsize as fullsize

    out = []
    for label, extra in plan_cases(family, smoke):
        row: dict[str, Any] = {"case": label, "family": family}
        run_dir = work / f"plan-{family}-{len(out)}"
        t0 = time.perf_counter()
        try:
            cfg = fullsize.recipe_config(family, folder, run_dir, is_smoke=smoke, extra=extra)
            row["gradient_checkpointing"] = cfg.model.gradient_checkpointing
            predicted = planned_total(cfg, folder)
            row["predicted_gib"] = predicted["total_gb"] * 1e9 / GIB
            row["predicted_activations_gib"] = predicted["activations_gb"] * 1e9 / GIB
            row["predicted_reward_models_gib"] = predicted["reward_models_gb"] * 1e9 / GIB
            got = fullsize.run_recipe(family, folder, run_dir, is_smoke=smoke, extra=extra)
            row["measured_gib"] = got.get("step_peak_gib_allocated")
            row["measured_reserved_gib"] = got.get("step_peak_gib_reserved")
            row["step_s"] = got.get("step_s")
            if row["measured_gib"]:
                row["predicted_over_measured"] = row["predicted_gib"] / row["measured_gib"]
            row["status"] = "ok"
        except Exception as err:  # noqa: BLE001 - one case failing (out of memory) keeps the others
            row.update(status="failed", error=_where(err))
        finally:
            row["seconds"] = round(time.perf_counter() - t0, 2)
            shutil.rmtree(run_dir, ignore_errors=True)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        out.append(row)
    return out


def plan_child(family: str, folder: Path, work: Path, smoke: bool, device: str, timeout: float) -> list[dict[str, Any]]:
    """:func:`check_plan` in its own process: the peaks it measures hold no other run's tensors."""
    d = work / f"plan-{family}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    got = run_child(["--run-plan", family, "--folder", str(folder), "--work", str(d), *(["--smoke"] if smoke else [])],
                    d / "result.json", d / "log.txt", device, timeout * len(plan_cases(family, smoke)))
    rows = got["rows"] if "rows" in got else [{"case": f"{family} planner cases", "family": family, **got}]
    for row in rows:
        print(f"  plan {row['case']}: {row['status']}" + (f" ({row['error']})" if row.get("error") else ""), flush=True)
    return rows


# ------------------------------------------------------------------------------------------- report


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def table(results: dict[str, Any]) -> str:
    """The one table: a row per recipe, side and planner case."""
    lines = ["| part | case | status | seconds | peak GiB | detail |", "|---|---|---|---|---|---|"]
    for r in results.get("recipes", []):
        detail = (f"loss {_f(r.get('loss'), '{:.4g}')}, grad norm {_f(r.get('grad_norm'), '{:.4g}')}, "
                  f"weights on {r.get('weights_device', '-')}") if r.get("status") != "stopped" else ""
        if r.get("error"):
            detail = (detail + "; " if detail else "") + r["error"]
        lines.append(f"| recipe | {r['recipe']} | {r['status']} | {_f(r.get('seconds'), '{:.1f}')} | "
                     f"{_f(r.get('peak_gib'))} | {detail} |")
    for r in (results.get("side_by_side") or {}).get("sides", []):
        detail = r.get("error") or (f"rollout {_f(r.get('rollout_s'))} s, training pass {_f(r.get('train_s'))} s, "
                                    f"MFU {_f(r.get('mfu'), '{:.0%}')}")
        lines.append(f"| side by side | {r['side']} | {r.get('status')} | {_f(r.get('iteration_s'))} | "
                     f"{_f(r.get('peak_gib'))} | {detail} |")
    for r in (results.get("levers") or {}).get("rows", []):
        detail = r.get("error") or (f"x{_f(r.get('speed_vs_defaults'))} the defaults; rollout {_f(r.get('rollout_s'))} s, "
                                    f"training pass {_f(r.get('train_s'))} s, MFU {_f(r.get('mfu'), '{:.0%}')}")
        lines.append(f"| levers | {r['lever']} | {r.get('status')} | {_f(r.get('iteration_s'))} | - | {detail} |")
    for r in results.get("plan", []):
        detail = r.get("error") or (f"planned {_f(r.get('predicted_gib'), '{:.1f}')} GiB (activations "
                                    f"{_f(r.get('predicted_activations_gib'), '{:.3g}')}, reward models "
                                    f"{_f(r.get('predicted_reward_models_gib'), '{:.3g}')}), planned/measured "
                                    f"{_f(r.get('predicted_over_measured'))}")
        lines.append(f"| plan | {r['case']} | {r['status']} | {_f(r.get('seconds'), '{:.1f}')} | "
                     f"{_f(r.get('measured_gib'))} | {detail} |")
    return "\n".join(lines)


def write_json(path: Path, results: dict[str, Any]) -> None:
    """Atomically (a killed check leaves the previous file or the new one, never half of one)."""
    from flowalign.io import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")


def failed(results: dict[str, Any]) -> bool:
    rows = [*results.get("recipes", []), *(results.get("side_by_side") or {}).get("sides", []),
            *(results.get("levers") or {}).get("rows", []), *results.get("plan", [])]
    return any(r.get("status") in FAILURES for r in rows)


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("diffusers", "transformers", "peft", "accelerate"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    return found


def check_out_path(path: Path) -> str | None:
    """Why ``--out`` may not be written (a file that is not an earlier check's), or None."""
    if not path.exists():
        return None
    try:
        ours = MARK in json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, OSError):
        ours = False
    return None if ours else (f"--out {path} exists and is not an earlier gpu_check result: "
                              "pass another --out or remove it")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON results (written atomically)")
    p.add_argument("--device", default=None, help="default: cuda when there is one (smoke: cpu)")
    p.add_argument("--smoke", action="store_true", help="the same code paths at tiny sizes, on the CPU (tests)")
    p.add_argument("--reference-src", type=Path, default=None,
                   help="a flow_grpo source tree: adds the SD3.5-M side-by-side against its own functions")
    p.add_argument("--parts", nargs="+", default=["recipes", "side_by_side", "plan"],
                   choices=["recipes", "side_by_side", "plan", "levers"])
    p.add_argument("--recipes", nargs="+", default=None, help="recipe names of configs/tiny (default: all)")
    p.add_argument("--steps", type=int, default=None, help="steps per recipe (default 2; smoke 1)")
    p.add_argument("--jobs", type=int, default=None, help="recipes at a time (default 4 on a GPU, 1 on a CPU)")
    p.add_argument("--repeats", type=int, default=2, help="timed side-by-side iterations after a warm-up")
    p.add_argument("--peak-tflops", type=float, default=None, help="MFU's peak (default: measured bf16 matmul rate)")
    p.add_argument("--plan-families", nargs="+", default=None, choices=["sd3", "wan"],
                   help="planner comparisons (default sd3 wan; smoke sd3)")
    p.add_argument("--timeout", type=float, default=600, help="seconds for one recipe's or side's process")
    p.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a new temporary one)")
    # one recipe or one side in this process (what the check runs in its child processes)
    p.add_argument("--run-recipe", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--authors-defaults", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--twin", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--run-side", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--run-plan", choices=["sd3", "wan"], help=argparse.SUPPRESS)
    p.add_argument("--run-levers", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--max-len", type=int, default=128, help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; pass --device cpu (or --smoke)")
    steps = args.steps or (1 if args.smoke else 2)

    if args.run_recipe is not None:  # child: one recipe
        write_json(args.result, run_one_recipe(args.run_recipe, args.run_dir, steps, args.smoke, args.device,
                                               args.authors_defaults, args.twin))
        return 0
    if args.run_side is not None:  # child: one side of the side-by-side
        try:
            row = run_side(args.run_side, args.folder, args.work, args.reference_src, args.repeats, args.device,
                           args.size, args.max_len)
        except Exception as err:  # noqa: BLE001 - the parent's table shows the line
            row = {"side": args.run_side, "status": "failed", "error": _where(err)}
        write_json(args.result, row)
        return 0
    if args.run_levers:  # child: the levers, one after another
        try:
            got = run_levers(args.folder, args.work, args.repeats, args.device, args.size, args.max_len)
        except Exception as err:  # noqa: BLE001 - the parent's table shows the line
            got = {"status": "failed", "error": _where(err)}
        write_json(args.result, got)
        return 0
    if args.run_plan is not None:  # child: the planner cases of one family
        write_json(args.result, {"rows": check_plan(args.run_plan, args.folder, args.work, args.smoke)})
        return 0

    why = check_out_path(args.out)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    if args.reference_src is not None and not (args.reference_src / "flow_grpo" / "diffusers_patch").is_dir():
        print(f"error: --reference-src {args.reference_src}: expected a flow_grpo source tree with "
              "flow_grpo/diffusers_patch/ (see docs/performance.md)", file=sys.stderr)
        return 2
    names = args.recipes or (list(SMOKE_RECIPES) if args.smoke else sorted(f.stem for f in TINY.glob("*.yaml")))
    missing = [n for n in names if not (TINY / f"{n}.yaml").is_file()]
    if missing:
        print(f"error: --recipes {' '.join(missing)}: no such file in configs/tiny", file=sys.stderr)
        return 2
    # children run in the repository: every path they get is absolute
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="gpu-check-"))).resolve()
    if args.reference_src is not None:
        args.reference_src = args.reference_src.resolve()
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        MARK: 1, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": torch.cuda.get_device_name() if cuda else "cpu", "smoke": args.smoke, "versions": versions()}
    t_start = time.perf_counter()
    save = lambda: write_json(args.out, results)  # noqa: E731 - after every part: a timeout keeps what was measured

    if "recipes" in args.parts:
        print(f"(a) {len(names)} tiny recipes (and the trainer defaults of those pinning a former form), "
              f"{steps} step(s) each on {args.device}", flush=True)
        jobs = args.jobs or (4 if cuda else 1)
        results["recipes"] = check_recipes([TINY / f"{n}.yaml" for n in names], work, steps, args.smoke,
                                           args.device, jobs, args.timeout)
        save()

    families = args.plan_families or (["sd3"] if args.smoke else ["sd3", "wan"])
    want_sides = "side_by_side" in args.parts and args.reference_src is not None
    want_plan = "plan" in args.parts
    want_levers = "levers" in args.parts
    if want_sides or want_plan or want_levers:
        import gpu_fullsize as fullsize

        results["plan"] = []
        order = list(dict.fromkeys((["sd3"] if want_sides or want_levers else []) + (families if want_plan else [])))
        for family in order:
            folder = work / f"{family}-model"
            print(f"building {'the tiny' if args.smoke else 'the full-size'} {family} folder", flush=True)
            try:
                fullsize.build_folder(family, folder, is_smoke=args.smoke, device=args.device)
            except Exception as err:  # noqa: BLE001 - e.g. out of disk: the other family may still fit
                results["plan"].append({"case": f"{family} folder", "family": family, "status": "failed",
                                        "error": _where(err)})
                save()
                continue
            try:
                if want_plan and family in families:
                    print(f"(c) plan against measured peaks, {family}", flush=True)
                    results["plan"] += plan_child(family, folder, work, args.smoke, args.device, args.timeout)
                    save()
                if family == "sd3" and want_sides:
                    size, max_len = (64, 48) if args.smoke else (512, 128)
                    print(f"(b) side by side against the reference, {size} px", flush=True)
                    results["side_by_side"] = side_by_side(folder, work, args.reference_src, args.repeats,
                                                           args.device, size, max_len,
                                                           args.peak_tflops or matmul_tflops(args.device),
                                                           args.timeout)
                    save()
                if family == "sd3" and want_levers:
                    size, max_len = (64, 48) if args.smoke else (512, 128)
                    print(f"(d) levers, {size} px", flush=True)
                    results["levers"] = levers(folder, work, args.repeats, args.device, size, max_len,
                                               args.peak_tflops or matmul_tflops(args.device), args.timeout)
                    save()
            finally:
                shutil.rmtree(folder, ignore_errors=True)  # one full-size folder on disk at a time
        if not results["plan"]:
            results.pop("plan")

    results["seconds"] = round(time.perf_counter() - t_start, 1)
    save()
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    print(table(results))
    print(f"{results['device']}, {', '.join(f'{k} {v}' for k, v in results['versions'].items())}; "
          f"{results['seconds']:.0f} s; JSON: {args.out}")
    return 1 if failed(results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
