"""One Flow-GRPO iteration driven by the reference implementation's own functions, for ``scripts/bench.py
train --reference-src DIR``.

The project ships none of the reference's code. ``DIR`` is a source tree of github.com/yifan123/flow_grpo
that the user exports (its ``.py`` files; see ``docs/performance.md``). From it this module imports

* ``flow_grpo.diffusers_patch.sd3_pipeline_with_logprob.pipeline_with_logprob`` (the rollout),
* ``flow_grpo.diffusers_patch.sd3_sde_with_logprob.sde_step_with_logprob`` (the SDE step, used by both),
* ``flow_grpo.diffusers_patch.train_dreambooth_lora_sd3.encode_prompt``,

and takes ``compute_log_prob`` and ``compute_text_embeddings`` out of ``scripts/train_sd3.py`` with ``ast``
(that script imports its whole training stack at import time, so it cannot be imported as a module). The
GRPO objective ``train_sd3.py`` writes inline in ``main()`` (ratio, PPO clip, KL to the adapter-disabled
model, gradient accumulation over the trained steps through ``accelerate``, gradient clipping, AdamW) is
written here in the same form, calling those functions.
"""

from __future__ import annotations

import ast
import sys
import time
import types
from pathlib import Path

import torch

from bench_timing import instrument


def load_reference(src: Path) -> types.SimpleNamespace:
    """The reference's functions from its source tree ``src`` (which must hold ``flow_grpo/`` and ``scripts/``)."""
    src = Path(src).resolve()
    script = src / "scripts" / "train_sd3.py"
    if not (src / "flow_grpo" / "diffusers_patch").is_dir() or not script.is_file():
        sys.exit(f"--reference-src {src}: expected a flow_grpo source tree with flow_grpo/diffusers_patch/ "
                 "and scripts/train_sd3.py")
    sys.path.insert(0, str(src))
    # flow_grpo/ and its diffusers_patch/ are namespace packages: these imports do not pull in its rewards
    from flow_grpo.diffusers_patch.sd3_pipeline_with_logprob import pipeline_with_logprob
    from flow_grpo.diffusers_patch.sd3_sde_with_logprob import sde_step_with_logprob
    from flow_grpo.diffusers_patch.train_dreambooth_lora_sd3 import encode_prompt

    tree = ast.parse(script.read_text(), filename=str(script))
    wanted = {"compute_log_prob", "compute_text_embeddings"}
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    if {d.name for d in defs} != wanted:
        sys.exit(f"{script}: functions {sorted(wanted)} not found")
    ns = {"torch": torch, "sde_step_with_logprob": sde_step_with_logprob, "encode_prompt": encode_prompt}
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(script), "exec"), ns)
    revision = (src / "REVISION").read_text().strip() if (src / "REVISION").exists() else None
    return types.SimpleNamespace(pipeline_with_logprob=pipeline_with_logprob, compute_log_prob=ns["compute_log_prob"],
                                 compute_text_embeddings=ns["compute_text_embeddings"], revision=revision)


class ReferenceFlowGRPO:
    """The reference's iteration on ``bench.py``'s setting: prompts encoded every rollout (the negative once),
    ``pipeline_with_logprob`` on all samples with ``[uncond; cond]`` batched, the reward, GRPO advantages,
    then ``compute_log_prob`` with gradients on the ``[uncond; cond]`` batch for each trained step, the KL
    reference under ``disable_adapter()``, gradients accumulated by ``accelerate``, one optimiser step."""

    def __init__(self, src: Path, folder: Path, reward, setting: dict, prompts: list[str], lora_targets: list[str],
                 max_sequence_length: int = 48, *, device: str = "cpu", mixed_precision: str = "no",
                 transformer_dtype: str = "fp32", size: int = 64):
        """On a GPU, ``mixed_precision="fp16"`` is the reference as its base config ships (accelerate's fp16
        autocast, TF32 on, the transformer's weights fp32, text encoders in fp16, the VAE fp32);
        ``transformer_dtype="bf16"`` with ``mixed_precision="bf16"`` is a tuned reference."""
        from accelerate import Accelerator
        from diffusers import StableDiffusion3Pipeline
        from peft import LoraConfig, get_peft_model

        self.fn = load_reference(src)
        self.s = setting
        self.max_len = max_sequence_length
        self.device, self.size = torch.device(device), size
        self.n_train = int(setting["steps"] * setting["timestep_fraction"])
        self.config = types.SimpleNamespace(
            train=types.SimpleNamespace(cfg=True, clip_range=setting["clip_range"], adv_clip_max=setting["adv_clip"],
                                        beta=setting["beta"], max_grad_norm=1.0),
            sample=types.SimpleNamespace(guidance_scale=setting["guidance"], noise_level=setting["noise_level"]))
        torch.manual_seed(0)
        self.accelerator = Accelerator(cpu=self.device.type == "cpu", mixed_precision=mixed_precision,
                                       gradient_accumulation_steps=self.n_train)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # train_sd3.py allows TF32
        inference_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mixed_precision, torch.float32)
        pipe = StableDiffusion3Pipeline.from_pretrained(str(folder), torch_dtype=torch.float32)
        for m in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3, pipe.transformer):
            m.requires_grad_(False)
        pipe.vae.to(self.device, dtype=torch.float32)
        for m in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
            m.to(self.device, dtype=inference_dtype)
        pipe.transformer.to(self.device, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[transformer_dtype])
        pipe.set_progress_bar_config(disable=True)
        lora = LoraConfig(r=setting["rank"], lora_alpha=setting["alpha"], init_lora_weights="gaussian",
                          target_modules=lora_targets)
        pipe.transformer = get_peft_model(pipe.transformer, lora)
        params = [p for p in pipe.transformer.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=setting["lr"], betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8)
        self.transformer, self.optimizer = self.accelerator.prepare(pipe.transformer, optimizer)
        self.pipe, self.reward = pipe, reward
        self.text_encoders = [pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]
        self.tokenizers = [pipe.tokenizer, pipe.tokenizer_2, pipe.tokenizer_3]
        self.prompts = [p for p in prompts for _ in range(setting["group"])]
        self.n_prompts = len(prompts)
        self.neg = self.fn.compute_text_embeddings([""], self.text_encoders, self.tokenizers, self.max_len,
                                                   self.device)
        instrument(pipe, pipe.transformer)

    def rollout(self, seed: int) -> dict:
        n = len(self.prompts)
        torch.manual_seed(seed)
        self.pipe.transformer.eval()
        pe, ppe = self.fn.compute_text_embeddings(self.prompts, self.text_encoders, self.tokenizers, self.max_len,
                                                  self.device)
        with torch.no_grad():
            images, latents, log_probs = self.fn.pipeline_with_logprob(
                self.pipe, prompt_embeds=pe, pooled_prompt_embeds=ppe,
                negative_prompt_embeds=self.neg[0].repeat(n, 1, 1), negative_pooled_prompt_embeds=self.neg[1].repeat(n, 1),
                num_inference_steps=self.s["steps"], guidance_scale=self.s["guidance"], output_type="pt",
                height=self.size, width=self.size, noise_level=self.s["noise_level"])
        latents = torch.stack(latents, dim=1)
        return {"prompt_embeds": pe, "pooled_prompt_embeds": ppe, "images": images,
                "timesteps": self.pipe.scheduler.timesteps.repeat(n, 1),
                "latents": latents[:, :-1], "next_latents": latents[:, 1:], "log_probs": torch.stack(log_probs, dim=1)}

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        groups = rewards.view(self.n_prompts, self.s["group"])
        adv = (groups - groups.mean(1, keepdim=True)).flatten() / (rewards.std() + 1e-4)
        return adv.unsqueeze(1).repeat(1, self.n_train).to(self.device)

    def train_pass(self, sample: dict, record_ratio: bool = False) -> list[torch.Tensor]:
        """``train_sd3.py``'s inner loop over the trained steps of one batch; the ratios if asked."""
        cfg, acc, transformer, n = self.config, self.accelerator, self.transformer, len(self.prompts)
        embeds = torch.cat([self.neg[0].repeat(n, 1, 1), sample["prompt_embeds"]])
        pooled = torch.cat([self.neg[1].repeat(n, 1), sample["pooled_prompt_embeds"]])
        self.pipe.transformer.train()
        ratios = []
        for j in range(self.n_train):
            with acc.accumulate(transformer):
                _, log_prob, mean, std = self.fn.compute_log_prob(transformer, self.pipe, sample, j, embeds, pooled, cfg)
                with torch.no_grad(), acc.unwrap_model(transformer).disable_adapter():
                    _, _, mean_ref, _ = self.fn.compute_log_prob(transformer, self.pipe, sample, j, embeds, pooled, cfg)
                a = torch.clamp(sample["advantages"][:, j], -cfg.train.adv_clip_max, cfg.train.adv_clip_max)
                ratio = torch.exp(log_prob - sample["log_probs"][:, j])
                eps = cfg.train.clip_range
                policy_loss = torch.mean(torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1.0 - eps, 1.0 + eps)))
                kl = torch.mean(((mean - mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std**2))
                if record_ratio:
                    ratios.append(ratio.detach())
                acc.backward(policy_loss + cfg.train.beta * kl)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(transformer.parameters(), cfg.train.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad()
        return ratios

    def iteration(self, seed: int) -> tuple[float, float]:
        """``(rollout + reward seconds, training-pass seconds)``."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        sample = self.rollout(seed)
        rewards = self.reward(sample.pop("images"), self.prompts, [{}] * len(self.prompts)).float()
        sample["advantages"] = self.advantages(rewards)
        sync()  # the work queued on the GPU is the phase's
        t1 = time.perf_counter()
        self.train_pass(sample)
        sync()
        return t1 - t0, time.perf_counter() - t1
