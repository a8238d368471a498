"""``parallel.strategy=fsdp`` end to end on two CPU processes (gloo): the same weights as unsharded runs,
bit-exact resume, checkpoints that move between 2 sharded ranks and 1 process, and a lost rank that stops
its peer with a clear error. The ranks get torchrun's variables and are forked from a warm interpreter
(:mod:`tests.warm_start`); the lost-rank test starts fresh ones, and ``test_distributed.py`` runs torchrun."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from flowalign.checkpoint import TRAINER_STATE_PREFIX, load_checkpoint

from tests.warm_start import free_port, run_env, run_ranks, starter

from .conftest import REPO, run_cli, small_run

TORCHRUN = Path(sys.executable).parent / "torchrun"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_CBWR": "COMPATIBLE", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
FSDP = "parallel.strategy=fsdp"
NFT = ("trainer.name=diffusion_nft", "trainer.timestep_fraction=0.5")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun missing")]


def torchrun(args: list[str]) -> str:
    """``torchrun --standalone --nproc_per_node 2 -m flowalign ARGS``, its ranks warm-started
    (:func:`tests.warm_start.run_ranks`); every rank's output."""
    code, out = run_ranks("flowalign", args, 2)
    assert code == 0, out[-6000:]
    return out


def single(args: list[str]) -> str:
    out, _ = (proc := run_cli(args)).communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step-{step:06d}" / "trainable.safetensors"))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def copy_run(src: Path, dst: Path, drop_step: int) -> None:
    """A copy of a run folder (its saved config pointing at the copy) without one checkpoint."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / f"step-{drop_step:06d}")
    (dst / "final_metrics.json").unlink(missing_ok=True)  # cut short: not a finished run, so it resumes
    cfg = yaml.safe_load((dst / "config.yaml").read_text())
    cfg["run"]["output_dir"] = str(dst)
    (dst / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def optimizer_moments(folder: Path) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """AdamW's (exp_avg, exp_avg_sq, step) per parameter, from either checkpoint layout (order-free)."""
    state = load_checkpoint(folder)["optimizer"]
    if state is None:  # the sharded layout, read back whole on one process
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(folder / "optimizer"), str(folder.parent / "optimizer.pt"))
        state = torch.load(str(folder.parent / "optimizer.pt"))["optimizer"]
    return sorted(((s["exp_avg"], s["exp_avg_sq"], float(s["step"])) for s in state["state"].values()),
                  key=lambda m: m[0].sum().item())


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, tiny_sd3_dir, prompt_file):
    """Flow-GRPO with LoRA: 2 FSDP ranks × 1 prompt and 1 process × 2 prompts, 3 steps, a checkpoint each step."""
    root = tmp_path_factory.mktemp("fsdp-lora")
    extra = ("trainer.max_steps=3", "run.checkpoint_every=1", "run.keep_checkpoints=3")
    torchrun(["train", "/dev/null", *small_run(root / "fsdp", tiny_sd3_dir, prompt_file, FSDP, *extra,
                                               "trainer.prompts_per_step=1")])
    single(["train", "/dev/null", *small_run(root / "single", tiny_sd3_dir, prompt_file, *extra)])
    return root


def test_lora_under_fsdp_ends_at_the_single_process_weights_with_half_the_optimiser_state_per_rank(lora_runs):
    fsdp, one = weights(lora_runs / "fsdp", 3), weights(lora_runs / "single", 3)
    assert max_diff(fsdp, one) < 1e-5
    assert max(v.abs().max().item() for k, v in fsdp.items() if "lora_B" in k) > 0  # B starts at zero: it moved
    adapter = lambda run: load_file(str(run / "checkpoints" / "step-000003" / "pytorch_lora_weights.safetensors"))
    assert max_diff(adapter(lora_runs / "fsdp"), adapter(lora_runs / "single")) < 1e-5  # diffusers' LoRA file
    from torch.distributed.checkpoint import FileSystemReader

    # bytes of AdamW's moments each rank wrote into its own shard file
    meta = FileSystemReader(str(lora_runs / "fsdp" / "checkpoints" / "step-000003" / "optimizer")).read_metadata()
    per_file: dict[str, int] = {}
    for index, info in meta.storage_data.items():
        if "exp_avg" in index.fqn:
            per_file[info.relative_path] = per_file.get(info.relative_path, 0) + info.length
    sizes = list(per_file.values())
    assert len(sizes) == 2 and all(0.4 < n / sum(sizes) < 0.6 for n in sizes), per_file


def test_resume_under_fsdp_is_bit_exact(lora_runs, tiny_sd3_dir, prompt_file):
    resumed = lora_runs / "resumed"
    copy_run(lora_runs / "fsdp", resumed, drop_step=3)
    out = torchrun(["train", "/dev/null", *small_run(resumed, tiny_sd3_dir, prompt_file, FSDP, "trainer.max_steps=3",
                                                     "run.checkpoint_every=1", "run.keep_checkpoints=3",
                                                     "trainer.prompts_per_step=1")])
    assert "resumed from" in out and "step-000002" in out
    a, b = weights(resumed, 3), weights(lora_runs / "fsdp", 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("source,strategy", [("fsdp", "ddp"), ("single", "fsdp")])
def test_a_checkpoint_moves_between_two_sharded_ranks_and_one_process(lora_runs, tiny_sd3_dir, prompt_file,
                                                                      source, strategy):
    """Resumed in the other layout and saved again at once, the weights and the optimiser state are the same."""
    moved = lora_runs / f"{source}-moved"
    copy_run(lora_runs / source, moved, drop_step=3)
    original = lora_runs / f"{source}-step2"
    shutil.copytree(moved / "checkpoints" / "step-000002", original)
    args = ["train", "/dev/null", *small_run(moved, tiny_sd3_dir, prompt_file, f"parallel.strategy={strategy}",
                                             "trainer.max_steps=2", "run.checkpoint_every=1", "run.keep_checkpoints=3",
                                             f"trainer.prompts_per_step={1 if source == 'fsdp' else 2}")]
    out = single(args) if strategy == "ddp" else torchrun(args)
    assert "resumed from" in out
    saved = moved / "checkpoints" / "step-000002"
    assert (saved / "optimizer").is_dir() == (strategy == "fsdp")  # really written in the other layout
    a, b = load_file(str(saved / "trainable.safetensors")), load_file(str(original / "trainable.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    for (m1, v1, s1), (m2, v2, s2) in zip(optimizer_moments(saved), optimizer_moments(original), strict=True):
        assert torch.equal(m1, m2) and torch.equal(v1, v2) and s1 == s2 == 2


BASELINES = {
    "pd_grpo": (), "mix_grpo": ("trainer.window_size=2",), "grpo_guard": (), "awm": (), "dgpo": (),
    "dance_grpo": (),  # one-sample chunks (the per-sample draw), counted zero advantages: the plan is global
    # β 1: at the recipe's β 2000 the sharded sums' last-bit differences are amplified past the tolerance
    "diffusion_dpo": ("trainer.dpo_beta=1.0",),
    "seppo": ("data.prompts=null", "data.bench=vvr", "data.level=easy", "data.n=16", "rewards=[]",
              "trainer.dpo_beta=1.0", "trainer.reference_every=1"),
    "fav": ("data.prompts=null", "data.bench=vvr", "data.level=easy", "data.n=16", "rewards=[{name: vvr_soft}]"),
    # each stage on its own: a cold-start step followed by a distillation step meets one gradient near Adam's
    # eps, whose last-bit difference between layouts grows to 4e-5 (measured); each stage alone matches
    "flow_opd_cold": ("trainer.cold_start_steps=2",),
    # the authors' rule pairs every advantage of a rollout chunk with every ratio in it, so a chunk's loss
    # depends on its members: one sample per chunk keeps the two layouts' chunks equal
    "flow_opd": ("trainer.cold_start_steps=0", "trainer.batch_size=1"),
    "flow_opd_distill": ("trainer.cold_start_steps=0", "trainer.objective=velocity_distillation"),
    "festdpo": ("trainer.K=8", "trainer.num_steps=2", "trainer.pairs_per_prompt=4"),
    # the same trunks, branches and advantages; two SDE trunks a prompt, the flat ones dropped over every rank
    # (2.1e-5 apart, measured: the SDE trunks carry the sharded sums' last bits further than the ODE did)
    "self_opd": ("trainer.branches=2", "trainer.branch_steps=1", "trainer.trunks=2"),
}
#: tighter than the loop's 5e-5 where a trainer was measured closer
TOLERANCE = {"festdpo": 1e-5}


def many(launch, runs: list[list[str]], path: Path) -> None:
    """Every run of ``runs`` in one process, or one process a rank (``launch``: :func:`torchrun` or
    :func:`single`)."""
    path.write_text(json.dumps(runs))
    module = "tests.flowalign.trainers.fsdp_many"
    if launch is torchrun:
        code, out = run_ranks(module, [str(path)], 2, timeout=1200)
    else:
        out, _ = (proc := starter().start(module, [str(path)], run_env())).communicate(timeout=1200)
        code = proc.returncode
    assert code == 0, out[-6000:]


def test_every_baseline_under_fsdp_ends_at_the_single_process_weights(tmp_path, tiny_sd3_dir, prompt_file):
    """For each trainer whose loss, advantage or reference is its own: two sharded ranks × 1 prompt and one
    process × 2 prompts draw the same rollouts, advantages (or pairs, particles, teachers' targets) and end at
    the same weights. All runs of a layout share one process (start-up paid once)."""
    teacher_run = small_run(tmp_path / "teacher", tiny_sd3_dir, prompt_file, "trainer.max_steps=1", "trainer.lr=1e-2",
                            "run.checkpoint_every=1")
    teacher = f"trainer.teachers=[{{adapter: {tmp_path / 'teacher' / 'checkpoints' / 'step-000001'}}}]"

    def runs(layout: str, *extra: str) -> list[list[str]]:
        out = []
        for name, own in BASELINES.items():
            trainer = name.removesuffix("_cold").removesuffix("_distill")
            opd = ("trainer.group_size=1", "trainer.states_per_sample=2", teacher) if trainer == "flow_opd" else ()
            out.append(small_run(tmp_path / layout / name, tiny_sd3_dir, prompt_file, f"trainer.name={trainer}",
                                 *own, *opd, *extra))
        return out

    many(single, [teacher_run, *runs("single")], tmp_path / "single.json")  # Flow-OPD's teacher first
    many(torchrun, runs("fsdp", FSDP, "trainer.prompts_per_step=1"), tmp_path / "fsdp.json")
    for name in BASELINES:
        fsdp, one = weights(tmp_path / "fsdp" / name, 2), weights(tmp_path / "single" / name, 2)
        # float32 kernels sum one-sample and two-sample batches in different orders, and AdamW enlarges that where
        # an element's second moment is tiny: up to 1.4e-5 on some CPUs (DanceGRPO, one element), 3e-6 elsewhere.
        # A step's work done differently moves weights by the learning rate's order, 1e-3 a step
        assert max_diff(fsdp, one) < TOLERANCE.get(name, 5e-5), name
        assert max(v.abs().max().item() for k, v in one.items() if "lora_B" in k) > 0, name  # B moved from 0


@pytest.fixture(scope="module")
def nft_runs(tmp_path_factory, tiny_sd3_dir, prompt_file):
    """DiffusionNFT on 2 sharded and 2 replicated ranks × 1 prompt, 2 steps, a checkpoint each step, and a
    final evaluation."""
    root = tmp_path_factory.mktemp("fsdp-nft")
    many(torchrun, [nft_run(root / strategy, tiny_sd3_dir, prompt_file, strategy) for strategy in ("fsdp", "ddp")],
         root / "runs.json")
    return root


def nft_run(run: Path, model: Path, prompts: Path, strategy: str) -> list[str]:
    evals = ("eval.bench=vvr", "eval.level=easy", "eval.n=2", "eval.batch_size=2", "eval.num_steps=2",
             "eval.at_start=false", "eval.gallery=false")
    return small_run(run, model, prompts, *NFT, *evals, f"parallel.strategy={strategy}", "trainer.prompts_per_step=1",
                     "run.checkpoint_every=1")


def test_diffusion_nft_under_fsdp_ends_at_the_replicated_weights_and_evaluates_on_every_rank(nft_runs):
    """Sharded and replicated ranks end at the same weights; the final evaluation runs sharded too (every
    rank joins)."""
    assert max_diff(weights(nft_runs / "fsdp", 2), weights(nft_runs / "ddp", 2)) < 1e-5
    final = [json.loads((nft_runs / s / "final_metrics.json").read_text()) for s in ("fsdp", "ddp")]
    assert final[0]["accuracy"] == final[1]["accuracy"] and final[0]["n"] == 2


def test_diffusion_nft_resumes_under_fsdp_bit_exactly_with_its_behaviour_copy(nft_runs, tiny_sd3_dir, prompt_file):
    """The behaviour copy φ is restored into each rank's shards: resumed from step 1, the run ends at the
    uninterrupted run's weights and φ, bit for bit."""
    resumed = nft_runs / "resumed"
    copy_run(nft_runs / "fsdp", resumed, drop_step=2)
    out = torchrun(["train", "/dev/null", *nft_run(resumed, tiny_sd3_dir, prompt_file, "fsdp")])
    assert "resumed from" in out and "step-000001" in out
    a, b = weights(resumed, 2), weights(nft_runs / "fsdp", 2)
    assert a.keys() == b.keys()
    behaviour = [k for k in a if k.startswith(TRAINER_STATE_PREFIX)]
    assert behaviour and all(torch.equal(a[k], b[k]) for k in a)
    # φ is not θ (λ > 0 from the first refresh), so the equality above is φ's own, not the weights' again
    assert max_diff({k: b[k] for k in behaviour}, {k: b[k.removeprefix(TRAINER_STATE_PREFIX)] for k in behaviour}) > 0



def test_a_killed_rank_stops_the_other_with_a_clear_error_and_the_run_resumes(tmp_path, tiny_sd3_dir, prompt_file):
    run = tmp_path / "run"
    args = [sys.executable, "-m", "flowalign", "train", "/dev/null",
            *small_run(run, tiny_sd3_dir, prompt_file, FSDP, "trainer.max_steps=6", "run.checkpoint_every=1",
                       "trainer.prompts_per_step=1", "parallel.timeout_s=20")]
    port = str(free_port())
    ranks = [subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2",
                                   "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"})
             for r in range(2)]
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step-000001" / "COMPLETE").exists():
        assert time.time() < deadline and ranks[0].poll() is None, "no checkpoint was written"
        time.sleep(0.05)
    ranks[1].send_signal(signal.SIGKILL)
    killed_at = time.time()
    out, _ = ranks[0].communicate(timeout=120)
    ranks[1].wait()
    assert ranks[0].returncode == 2 and time.time() - killed_at < 20 + 30
    assert "rank 0: lost contact with the other ranks" in out and "run.resume=auto" in out
    assert not (run / "checkpoints" / "step-000006").exists()

    out = torchrun(args[3:])
    assert "resumed from" in out
    assert (run / "checkpoints" / "step-000006" / "COMPLETE").exists()


def test_a_rank_whose_groups_all_have_zero_advantage_keeps_step_with_the_others(tmp_path, tiny_sd3_dir):
    """One prompt per rank, and only the red one is rewarded: the other rank has nothing to train on but
    must still join every sharded forward and optimiser step (its shard's gradient comes from its peer)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    reward = "rewards=[{name: 'tests.flowalign.trainers.toy_rewards:redness_of_red_prompts'}]"
    extra = (reward, "trainer.advantage=group", "parallel.timeout_s=60")
    torchrun(["train", "/dev/null", *small_run(tmp_path / "fsdp", tiny_sd3_dir, prompts, FSDP, *extra,
                                               "trainer.prompts_per_step=1")])
    single(["train", "/dev/null", *small_run(tmp_path / "single", tiny_sd3_dir, prompts, *extra)])
    # both prompts make up every step (one per rank): each rank's group is rewarded wholly or not at all
    rows = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["zero_adv_fraction"] == 0.5 for r in rows)
    # the blue rank adds zero gradients: the ranks' gradients are summed (each unit weighted by the global
    # unit count), so the update is the single process's, not half of it
    fsdp, one = weights(tmp_path / "fsdp", 2), weights(tmp_path / "single", 2)
    assert max_diff(fsdp, one) < 1e-5
    assert max(v.abs().max().item() for k, v in fsdp.items() if "lora_B" in k) > 1e-3  # and they did move
