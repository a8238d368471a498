"""Pieces several trainers share, each in the file named for what it is.

A trainer imports these and the contract (:mod:`flowalign.trainers.base`), and at most the base method it is
a documented preset of (the Flow-GRPO family on :mod:`flowalign.trainers.flow_grpo`, DiffusionOPSD and
DiffusionNFT on :mod:`flowalign.trainers.self_distill`, SePPO on :mod:`flowalign.trainers.diffusion_dpo`);
never a sibling.

- :mod:`.policy_gradient`: PPO's clipped surrogate, per sample and as a mean
- :mod:`.global_plan`: optimiser steps over every rank's rollout batches, the same on every rank
- :mod:`.reductions`: per-sample means of per-element losses
- :mod:`.reward_gradient`: a differentiable reward's gradient with respect to latents
- :mod:`.negative_aware`: DiffusionNFT's reward weight, mirrored velocities and negative-aware loss
- :mod:`.timesteps`: flow times drawn for fitting losses
- :mod:`.units`: loss units shared by trainers
- :mod:`.groups`: checks on how prompt groups fall into rollout batches
- :mod:`.rewarded_rollouts`: the loop's group rollouts with their rewards and no advantages
- :mod:`.drawn_steps`: DanceGRPO's trained steps, a random fraction of the first T−1
- :mod:`.best_worst`: training only each group's best and worst samples
- :mod:`.pairs`, :mod:`.pair_images`: preference pairs and image pairs read from files
- :mod:`.latent_preference`: preference pairs of latents and the fit of a latent reward on them
- :mod:`.teacher_videos`, :mod:`.video_discriminator`: AFD's teachers and critic
- :mod:`.teacher_routing`: which teacher supervises a prompt: by prompt (regular expressions) or by epoch (Flow-OPD's alternation)
- :mod:`.teacher_weights`: teachers' trained tensors read from their checkpoints, and merged into one start
- :mod:`.teacher_distillation`: regression on teachers' velocities: its batch of states, their draw, its loss
- :mod:`.prompt_draws`: a step's prompts as fresh independent draws (the Flow-OPD authors' sampler)
- :mod:`.regrouped_micro_batches`: micro-batches each inner epoch re-forms from a step's samples, read from its chunks
"""
