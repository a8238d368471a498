"""Benchmarks (ratios measured in one run; never timed assertions in tests).

    python scripts/bench.py rollout [--model DIR] [--steps 20] [--repeats 7]
    python scripts/bench.py train [--repeats 7] [--threads 2] [--reference-src DIR] [--model DIR]
                                 [--slow-reward] [--batch-size 8] [--no-bare] [--profile FILE]
    python scripts/bench.py rewards [...]   (reward throughput: scripts/bench_rewards.py --help)

``rollout``: ``flowalign.sampling.rollout`` (ODE, decode included) against the diffusers pipeline's own
``__call__`` on the same folder, same steps and seed, alternating, median of the repeats; target ratio
≤ 1.10. Also reports the cost of an SDE rollout relative to the ODE one.

``train``: one Flow-GRPO iteration of flowalign's trainer against a bare loop written below with straight
torch, diffusers and peft calls (no flowalign code), on the same tiny SD3 folder (2.3M-parameter
transformer, 64 px) and the same work: 8 samples (4 prompts × 2), 10 SDE steps with stored log-probs,
CFG 4.5, LoRA r8, KL β 0.04 to the adapter-disabled model, one clipped-ratio pass over ⌊0.99·10⌋ = 9
steps, fp32. The two alternate; the medians and the median of the paired ratios are printed, with the
toolkit overhead: the share of an iteration outside model forward/backward passes, the VAE decode and
the reward. ``--slow-reward`` makes the reward sleep 0.5 s per call (a remote judge) and prints the
iteration against max(sampling + training, scoring). ``--reference-src DIR`` (a source tree of the
reference implementation, github.com/yifan123/flow_grpo) adds a third side driven by that code's own
functions (``scripts/bench_reference.py``); the ratio against it is printed first, the bare loop's second.

Reward against wall-clock time for Flow-GRPO and Flash-GRPO with the shipped tiny configs: ``scripts/bench_curves.py``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_timing import SLOW_REWARD_SECONDS, SPANS, instrument, redness, slow_redness  # noqa: E402
from pipelines.pretrain.sd3 import model_overrides  # noqa: E402


def _median_time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def bench_rollout(args: argparse.Namespace) -> None:
    import diffusers

    import pipelines
    from flowalign.paths import default_model_dir
    from flowalign.sampling import rollout

    model = Path(args.model) if args.model else default_model_dir()
    if not (model / "model_index.json").exists():
        from pipelines.tiny import save_tiny

        model = Path(tempfile.mkdtemp()) / "tiny-sd3"
        save_tiny("sd3", model)
        print(f"(no embedded model found; benchmarking a random tiny SD3 at {model})")
    torch.set_num_threads(args.threads)
    policy = pipelines.load(model)
    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    d = policy.defaults
    prompts = [args.prompt] * args.batch
    guidance = float(d.get("guidance_scale", 1.0))
    size = dict(height=d["height"], width=d["width"])

    def ours(sampler: str = "ode"):
        rollout(policy, prompts, num_steps=args.steps, sampler=sampler, guidance_scale=guidance,
                generator=torch.Generator().manual_seed(0))

    def theirs():
        kw = {"max_sequence_length": d["max_sequence_length"]} if "max_sequence_length" in d else {}
        pipe(prompts, num_inference_steps=args.steps, guidance_scale=guidance, output_type="pt",
             generator=torch.Generator().manual_seed(0), **size, **kw)

    ours(), theirs()  # warm-up (and fills the prompt cache, as in training)
    t_ours, t_theirs, t_sde = [], [], []
    for _ in range(args.repeats):
        t_ours += _median_time(ours, 1)
        t_theirs += _median_time(theirs, 1)
        t_sde += _median_time(lambda: ours("flow_grpo"), 1)
    m_ours, m_theirs, m_sde = (statistics.median(t) for t in (t_ours, t_theirs, t_sde))
    print(f"model: {model}  batch {args.batch}  steps {args.steps}  threads {args.threads}  repeats {args.repeats}")
    print(f"flowalign rollout (ODE): median {m_ours * 1000:.1f} ms")
    print(f"diffusers __call__:      median {m_theirs * 1000:.1f} ms")
    print(f"ratio rollout/diffusers: {m_ours / m_theirs:.3f}  (target <= 1.10)")
    print(f"SDE (flow_grpo) / ODE rollout: {m_sde / m_ours:.3f}")


# --------------------------------------------------------------------------------------------------
# train: the setting both sides run
# --------------------------------------------------------------------------------------------------

#: the 4-block tiny SD3 (2.30M-parameter transformer, 64 px): the shipped architecture as
#: ``pipelines.tiny.save_tiny`` overrides, from the pretraining code that defines it
TINY_SD3_2M = model_overrides([], clip_max_length=77, t5_max_length=48)
PROMPTS = ["a red circle", "a blue square", "a green star", "a yellow triangle"]
SETTING = dict(group=2, steps=10, guidance=4.5, noise_level=0.7, rank=8, alpha=16.0, beta=0.04,
               clip_range=1e-4, timestep_fraction=0.99, lr=1e-4, adv_clip=5.0)
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def build_tiny_folder(out: Path) -> Path:
    folder = out / "tiny-sd3-2m"
    if not (folder / "model_index.json").exists():
        from pipelines.tiny import save_tiny

        sampling = dict(guidance_scale=SETTING["guidance"], num_steps=SETTING["steps"], max_sequence_length=48)
        save_tiny("sd3", folder, sampling=sampling, **TINY_SD3_2M)
    return folder


# --------------------------------------------------------------------------------------------------
# train: the bare loop (straight torch / diffusers / peft, the reference's math)
# --------------------------------------------------------------------------------------------------


def sde_step_with_logprob(v, x, sigmas, k, noise_level, prev_sample=None, generator=None):
    """Flow-GRPO's SDE step as its reference code computes it (float32): ``(x_next, log_prob, mean, s_k)``."""
    v, x = v.float(), x.float()
    sigma, sigma_next = sigmas[k], sigmas[k + 1]
    dt = sigma_next - sigma
    std_dev = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigmas[1], sigma)))
    mean = x * (1 + std_dev**2 / (2 * sigma) * dt) + v * (1 + std_dev**2 * (1 - sigma) / (2 * sigma)) * dt
    tau = std_dev * torch.sqrt(-dt)
    if prev_sample is None:
        prev_sample = mean + tau * torch.randn(x.shape, generator=generator)
    log_prob = -((prev_sample.detach() - mean) ** 2) / (2 * tau**2) - torch.log(tau) - 0.5 * math.log(2 * math.pi)
    return prev_sample, log_prob.mean(dim=tuple(range(1, x.ndim))), mean, std_dev


class BareFlowGRPO:
    """One Flow-GRPO iteration as a plain loop: re-encodes the prompts every rollout (the negative once),
    samples all 8 at once with ``[uncond; cond]`` batched, trains 9 steps with the unconditional half
    detached and the KL reference from ``disable_adapter()``, one optimiser step."""

    def __init__(self, folder: Path, reward):
        from diffusers import StableDiffusion3Pipeline
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        self.pipe = StableDiffusion3Pipeline.from_pretrained(str(folder), torch_dtype=torch.float32)
        for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
            getattr(self.pipe, name).requires_grad_(False)
        config = LoraConfig(r=SETTING["rank"], lora_alpha=SETTING["alpha"], init_lora_weights="gaussian",
                            target_modules=LORA_TARGETS)
        self.transformer = get_peft_model(self.pipe.transformer, config)
        self.params = [p for p in self.transformer.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=SETTING["lr"], weight_decay=1e-4)
        self.reward = reward
        self.negative = self.encode([""])
        self.pipe.scheduler.set_timesteps(SETTING["steps"])
        self.sigmas = self.pipe.scheduler.sigmas.float()
        self.prompts = [p for p in PROMPTS for _ in range(SETTING["group"])]
        instrument(self.pipe, self.pipe.transformer)

    def encode(self, prompts):
        embeds, _, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None,
                                                       do_classifier_free_guidance=False, max_sequence_length=48)
        return embeds, pooled

    def velocity(self, x, k, embeds, pooled):
        timestep = (self.sigmas[k] * 1000).expand(2 * len(x))
        out = self.transformer(hidden_states=torch.cat([x, x]), timestep=timestep, encoder_hidden_states=embeds,
                               pooled_projections=pooled, return_dict=False)[0]
        uncond, cond = out.chunk(2)
        uncond = uncond.detach()
        return uncond + SETTING["guidance"] * (cond - uncond)

    @torch.no_grad()
    def rollout(self, generator):
        embeds, pooled = self.encode(self.prompts)
        n = len(self.prompts)
        embeds = torch.cat([self.negative[0].expand(n, -1, -1), embeds])
        pooled = torch.cat([self.negative[1].expand(n, -1), pooled])
        side = 64 // self.pipe.vae_scale_factor
        x = torch.randn((n, self.pipe.transformer.config.in_channels, side, side), generator=generator)
        latents, log_probs = [x], []
        for k in range(SETTING["steps"]):
            v = self.velocity(x, k, embeds, pooled)
            x, log_prob, _, _ = sde_step_with_logprob(v, x, self.sigmas, k, SETTING["noise_level"], generator=generator)
            latents.append(x)
            log_probs.append(log_prob)
        z = x / self.pipe.vae.config.scaling_factor + (self.pipe.vae.config.shift_factor or 0.0)
        images = (self.pipe.vae.decode(z, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)
        return dict(embeds=embeds, pooled=pooled, latents=torch.stack(latents, 1),
                    log_probs=torch.stack(log_probs, 1), images=images)

    def advantages(self, rewards):
        groups = rewards.view(len(PROMPTS), SETTING["group"])
        adv = (groups - groups.mean(1, keepdim=True)).flatten() / (rewards.std(unbiased=False) + 1e-4)
        return adv.clamp(-SETTING["adv_clip"], SETTING["adv_clip"])

    def train_pass(self, batch, adv):
        steps = range(int(SETTING["steps"] * SETTING["timestep_fraction"]))
        eps, a = SETTING["clip_range"], SETTING["noise_level"]
        for j in steps:
            x, x_next = batch["latents"][:, j], batch["latents"][:, j + 1]
            v = self.velocity(x, j, batch["embeds"], batch["pooled"])
            _, log_prob, mean, std_dev = sde_step_with_logprob(v, x, self.sigmas, j, a, prev_sample=x_next)
            with torch.no_grad(), self.transformer.disable_adapter():
                v_ref = self.velocity(x, j, batch["embeds"], batch["pooled"])
                _, _, mean_ref, _ = sde_step_with_logprob(v_ref, x, self.sigmas, j, a, prev_sample=x_next)
            ratio = torch.exp(log_prob - batch["log_probs"][:, j])
            policy_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps)).mean()
            kl = (((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * std_dev**2)).mean()
            ((policy_loss + SETTING["beta"] * kl) / len(steps)).backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def iteration(self, seed: int) -> tuple[float, float]:
        """``(rollout + reward seconds, training-pass seconds)``."""
        t0 = time.perf_counter()
        batch = self.rollout(torch.Generator().manual_seed(seed))
        adv = self.advantages(self.reward(batch["images"], self.prompts, [{}] * len(self.prompts)).float())
        t1 = time.perf_counter()
        self.train_pass(batch, adv)
        return t1 - t0, time.perf_counter() - t1


# --------------------------------------------------------------------------------------------------
# train: flowalign's trainer on the same setting, and the interleaved measurement
# --------------------------------------------------------------------------------------------------


def build_flowalign(folder: Path, out: Path, reward_name: str, batch_size: int = 8, *, size: int = 64,
                    max_sequence_length: int = 48, setting: dict | None = None, extra: list[str] = ()):
    """flowalign's Flow-GRPO trainer through its public config + ``build_trainer``, on the setting above
    (or ``setting``) at ``size`` px; ``extra``: further overrides (e.g. ``model.dtype=bf16`` on a GPU)."""
    from flowalign.config import load_config
    from flowalign.train import build_trainer
    from flowalign.trainers.flow_grpo import FlowGRPOConfig

    out.mkdir(parents=True, exist_ok=True)
    prompt_file = out / "prompts.txt"
    prompt_file.write_text("\n".join(PROMPTS) + "\n")
    s = setting or SETTING
    overrides = [
        f"run.output_dir={out / 'run'}", "run.resume=never", "run.progress=false", "run.tensorboard=false",
        "run.checkpoint_every=1000000", f"model.path={folder}", "model.finetune=lora", f"model.lora.rank={s['rank']}",
        f"model.lora.alpha={s['alpha']}", f"data.prompts={prompt_file}",
        # the setting's size and schedule, whatever the folder's own defaults (--model may be any SD3 folder)
        f"model.defaults={{height: {size}, width: {size}, max_sequence_length: {max_sequence_length}, "
        f"num_steps: {s['steps']}, "
        f"guidance_scale: {s['guidance']}}}", f"rewards=[{{name: '{reward_name}'}}]",
        "eval.bench=null", "trainer.name=flow_grpo", "trainer.max_steps=1000000",
        f"trainer.prompts_per_step={len(PROMPTS)}", f"trainer.group_size={s['group']}",
        f"trainer.batch_size={batch_size}", f"trainer.num_steps={s['steps']}",
        f"trainer.guidance_scale={s['guidance']}", f"trainer.noise_level={s['noise_level']}",
        f"trainer.beta={s['beta']}", "trainer.kl_mode=code", f"trainer.clip_range={s['clip_range']}",
        f"trainer.timestep_fraction={s['timestep_fraction']}", "trainer.inner_epochs=1", "trainer.updates_per_epoch=1",
        "trainer.advantage=global_std", f"trainer.lr={s['lr']}", f"trainer.adv_clip={s['adv_clip']}",
    ]
    # the reference's choices, where this version of the trainer has the option
    options = {"sde_last_step": "true", "cfg_grad": "detached"}
    overrides += [f"trainer.{k}={v}" for k, v in options.items() if k in FlowGRPOConfig.model_fields]
    overrides += list(extra)
    if (out / "run").exists():
        import shutil

        shutil.rmtree(out / "run")
    trainer = build_trainer(load_config(None, overrides))
    instrument(trainer.policy.pipe, trainer.policy.transformer)
    return trainer


#: flowalign's last step logs (``time/sample``, ``time/prepare``, ``time/reward``, ``time/update``): the
#: slow-reward check reads them
LAST_LOGS: list[dict[str, float]] = []


def flowalign_iteration(trainer) -> tuple[float, float]:
    logs = trainer.train_step()
    trainer.step += 1
    LAST_LOGS.append(logs)
    # the KL reference means prepared while the last batch was scored are training-pass work
    train = logs["time/update"] + logs.get("time/prepare", 0.0)
    return logs["time/step"] - train, train


def timed(iteration, *args) -> dict[str, float]:
    """One iteration: rollout, training pass, wall time, toolkit overhead share, trained steps."""
    SPANS.grad_timesteps.clear()
    t0, cpu0 = time.perf_counter(), time.process_time()
    rollout_s, train_s = iteration(*args)
    t1 = time.perf_counter()
    wall = t1 - t0
    # CPU seconds of this process (every thread): on a machine other jobs load, the work done, where the
    # wall time also counts the waits for a core
    return dict(rollout=rollout_s, train=train_s, wall=wall, cpu=time.process_time() - cpu0,
                overhead=(wall - SPANS.busy(t0, t1)) / wall,
                trained=SPANS.trained_timesteps())


def _loadavg() -> float:
    """The machine's 1-minute load average (other engineers' jobs included), recorded with each repetition."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def bench_train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    folder = Path(args.model) if args.model else build_tiny_folder(out)
    reward = slow_redness if args.slow_reward else redness
    trainer = build_flowalign(folder, out / "flowalign", f"bench_timing:{reward.__name__}", args.batch_size)
    sides = {"flowalign": (flowalign_iteration, lambda rep: (trainer,))}
    if args.reference_src:
        from bench_reference import ReferenceFlowGRPO

        ref = ReferenceFlowGRPO(Path(args.reference_src), folder, reward, SETTING, PROMPTS, LORA_TARGETS)
        sides["reference"] = (ref.iteration, lambda rep: (rep,))
    if not args.no_bare:
        bare = BareFlowGRPO(folder, reward)
        sides["bare loop"] = (bare.iteration, lambda rep: (rep,))
    torch.Tensor.backward = SPANS.wrap(torch.Tensor.backward)  # both sides' backward passes are model work
    torch.autograd.backward = SPANS.wrap(torch.autograd.backward)
    n_params = sum(p.numel() for p in trainer.policy.transformer.parameters() if not p.requires_grad)
    rows: dict[str, list[dict]] = {name: [] for name in sides}
    names = list(sides)
    for rep in range(args.repeats + 1):  # the first round warms up
        order = names[rep % len(names):] + names[:rep % len(names)]  # rotate which side goes first
        got = {}
        for name in order:
            fn, fn_args = sides[name]
            got[name] = timed(fn, *fn_args(rep))
            if name == "flowalign" and args.slow_reward:
                # the best the step can do: sampling and training on the main thread, scoring beside them
                logs, calls = LAST_LOGS[-1], math.ceil(len(PROMPTS) * SETTING["group"] / args.batch_size)
                # (the update's work done while the last batch is scored, time/prepare, is training work)
                main = logs["time/sample"] + logs.get("time/prepare", 0.0) + logs["time/update"]
                got[name]["bound"] = max(main, calls * SLOW_REWARD_SECONDS)
            got[name]["load"] = _loadavg()
        if rep:
            for name in names:
                rows[name].append(got[name])
        print(f"  {'warm-up' if not rep else f'repetition {rep}'}: "
              + ", ".join(f"{n} {got[n]['wall']:.2f} s" for n in names) + f"  (load average {_loadavg():.2f})",
              flush=True)
    loads = [r["load"] for r in rows["flowalign"]]
    print(f"SD3 {folder} ({n_params / 1e6:.2f}M-parameter transformer, 64 px), 8 samples = 4 prompts x 2, "
          f"10 SDE steps, CFG 4.5, LoRA r8, KL beta 0.04, {args.threads} threads, fp32, reward {reward.__name__}, "
          f"trainer.batch_size {args.batch_size}; {args.repeats} interleaved repetitions; "
          f"1-min load average {min(loads):.2f}-{max(loads):.2f}")
    print("| | rollout (min / median) | training pass (min / median) | iteration (min / median) | trained steps "
          "| CPU seconds (min) | toolkit overhead (median) |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in rows.items():
        col = {k: (min(r[k] for r in rs), statistics.median(r[k] for r in rs)) for k in rs[0]}
        print(f"| {name} | {col['rollout'][0]:.2f} / {col['rollout'][1]:.2f} s | {col['train'][0]:.2f} / "
              f"{col['train'][1]:.2f} s | {col['wall'][0]:.2f} / {col['wall'][1]:.2f} s | {col['trained'][1]:.0f} "
              f"| {col['cpu'][0]:.2f} s | {col['overhead'][1]:.1%} |")
    fa_min = min(r["wall"] for r in rows["flowalign"])
    for name in names[1:]:
        ratios = [b["wall"] / o["wall"] for o, b in zip(rows["flowalign"], rows[name])]
        print(f"speed vs {name} ({name} / flowalign iteration): ratio of minima "
              f"{min(r['wall'] for r in rows[name]) / fa_min:.2f}, median of paired ratios "
              f"{statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}; target >= 1.25); "
              f"ratio of CPU-second minima {min(r['cpu'] for r in rows[name]) / min(r['cpu'] for r in rows['flowalign']):.2f}")
    if args.slow_reward:
        walls, bounds = [r["wall"] for r in rows["flowalign"]], [r["bound"] for r in rows["flowalign"]]
        print(f"flowalign with a {SLOW_REWARD_SECONDS} s reward, trainer.batch_size {args.batch_size}: iteration "
              f"{min(walls):.2f} s (min) against max(sampling + training, scoring) {min(bounds):.2f} s: "
              f"{min(walls) / min(bounds) - 1:+.1%}; median of paired "
              f"{statistics.median(w / b - 1 for w, b in zip(walls, bounds)):+.1%} (target <= +5%)")
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(lambda: [flowalign_iteration(trainer) for _ in range(args.repeats)])
        profiler.dump_stats(args.profile)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main() -> None:
    if sys.argv[1:2] == ["rewards"]:  # its own options: scripts/bench_rewards.py
        import bench_rewards

        sys.exit(bench_rewards.main(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    p = sub.add_parser("rollout")
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", default="a red circle")
    p = sub.add_parser("train")
    p.add_argument("--repeats", type=int, default=7, help="interleaved repetitions after one warm-up pair")
    p.add_argument("--slow-reward", action="store_true", help="the reward sleeps 0.5 s per call")
    p.add_argument("--profile", default=None, help="then cProfile this many flowalign iterations into FILE")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench-train")
    p.add_argument("--reference-src", default=None,
                   help="a flow_grpo source tree: also time the reference's own functions (scripts/bench_reference.py)")
    p.add_argument("--model", default=None,
                   help="an SD3 diffusers folder to run the setting on (default: the tiny one built under --out)")
    p.add_argument("--no-bare", action="store_true", help="leave the bare loop out")
    p.add_argument("--batch-size", type=int, default=8, help="flowalign's trainer.batch_size (8: one batch a step)")
    args = parser.parse_args()
    {"rollout": bench_rollout, "train": bench_train}[args.bench](args)


if __name__ == "__main__":
    main()
