"""The small protocols through which the core meets model families and rewards.

``pipelines/`` implements :class:`FlowPolicy` per model family; ``rewards/`` implements
:class:`Reward` / :class:`LatentReward`. Trainers only ever see these.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class Conditioning:
    """Text conditioning of a batch, opaque to trainers.

    ``tensors`` maps names chosen by the model family (``"prompt_embeds"``, ``"pooled"``,
    ``"negative_prompt_embeds"``, ...) to tensors whose first dimension is the batch. Indexing selects
    or repeats samples for every tensor at once, so trainers can slice and group without knowing
    what is inside.
    """

    tensors: dict[str, torch.Tensor]
    prompts: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts) if self.prompts else next(iter(self.tensors.values())).shape[0]

    def __getitem__(self, index: int | slice | list[int] | torch.Tensor) -> "Conditioning":
        if isinstance(index, int):
            index = [index]
        if isinstance(index, slice):
            idx = list(range(len(self)))[index]
        elif isinstance(index, torch.Tensor):
            idx = index.flatten().tolist()
        else:
            idx = list(index)
        picked = {k: v[idx] for k, v in self.tensors.items()}
        return Conditioning(picked, [self.prompts[i] for i in idx] if self.prompts else [])

    def repeat_interleave(self, repeats: int) -> "Conditioning":
        """Each sample repeated ``repeats`` times in place (a prompt group of G rollouts)."""
        idx = [i for i in range(len(self)) for _ in range(repeats)]
        return self[idx]

    def unconditional(self) -> "Conditioning | None":
        """The CFG negatives as a conditioning of their own, or None when there are none.

        Model families name the negative of a tensor ``<key>`` ``negative_<key>``; the result holds
        ``<key> = negative_<key>`` (and the negatives again), so ``velocity(x, σ, cond.unconditional(), 1)``
        is the unconditional branch of ``velocity(x, σ, cond, w)``.
        """
        pairs = {k: v for k, v in self.tensors.items() if f"negative_{k}" in self.tensors}
        if not pairs:
            return None
        tensors = dict(self.tensors)
        tensors.update({k: self.tensors[f"negative_{k}"] for k in pairs})
        return Conditioning(tensors, [""] * len(self.prompts) if self.prompts else [])

    def to(self, device: torch.device | str) -> "Conditioning":
        return Conditioning({k: v.to(device) for k, v in self.tensors.items()}, list(self.prompts))

    @staticmethod
    def cat(parts: list["Conditioning"]) -> "Conditioning":
        keys = parts[0].tensors.keys()
        return Conditioning(
            {k: torch.cat([p.tensors[k] for p in parts]) for k in keys},
            [s for p in parts for s in p.prompts],
        )


@runtime_checkable
class FlowPolicy(Protocol):
    """A rectified-flow generator as trainers see it (one implementation per model family).

    Conventions (``docs/methods/conventions.md``): ``x_σ = (1-σ)·x0 + σ·ε``, velocity ``v = ε - x0``,
    σ=1 is noise. Latents are whatever the family uses (``B,C,H,W`` images, ``B,C,F,H,W`` video,
    packed tokens for FLUX); trainers never look inside.

    Optional, for CFG families that have them: ``unconditional_velocity(x, σ, cond) -> v_u`` with
    ``velocity(..., uncond=v_u)`` (the conditional half alone: a detached unconditional branch), and
    ``velocity_and_unconditional(x, σ, cond, w) -> (v, v_u)`` (one batched pass; rollouts that keep
    ``v_u`` for a trainer).
    """

    family: str
    is_video: bool
    device: torch.device
    dtype: torch.dtype
    #: the module whose parameters the trainer optimises (LoRA-wrapped transformer by default)
    trainable: torch.nn.Module
    #: sampling defaults the checkpoint was made for (``guidance_scale``, ``num_steps``, ...)
    defaults: dict[str, Any]

    def encode(self, prompts: list[str]) -> Conditioning: ...

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Pure noise ``x_{σ=1}``, float32, shape ``(n, *latent_shape)``."""
        ...

    def velocity(
        self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance: float
    ) -> torch.Tensor:
        """``v(x, σ | c)``, float32, same shape as ``x``; classifier-free guidance applied inside."""
        ...

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The model's own scheduler grid ``(num_steps+1,)``, float32, from 1 down to 0 (shift applied)."""
        ...

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents to pixels in [0, 1]: images ``(B,3,H,W)``, videos ``(B,F,3,H,W)``, float32."""
        ...

    def adapter_disabled(self) -> AbstractContextManager[None]:
        """Context in which ``velocity`` is the base model's (reference passes, no second copy). Under full
        fine-tuning a policy may offer ``keep_reference(device) -> nn.Module``: it keeps a frozen copy of
        its trained modules, which ``adapter_disabled()`` then runs (:mod:`flowalign.trainers.reference`)."""
        ...

    def save_adapter(self, directory: str | Path) -> None:
        """Write the trained adapter where diffusers' ``load_lora_weights`` reads it."""
        ...


@dataclass(frozen=True)
class KeptFrames:
    """A KV routing that names latent frames, not chunks: the absolute frame indices ``frames`` (sorted) of the
    history a chunk reads. Only a streaming policy with ``routes_frames`` True takes it (a cache of per-frame
    entries, as LongLive's perturbed window picks single frames of its resident cache)."""

    frames: tuple[int, ...]


@runtime_checkable
class StreamingPolicy(FlowPolicy, Protocol):
    """A streaming (autoregressive) video generator: a video is a sequence of chunks of latent frames, each
    denoised while attending to the clean chunks before it through a KV cache
    (:mod:`flowalign.sampling.streaming` samples it; ``streaming`` is True).

    The cache is a value: ``empty_cache(batch, guidance)`` makes one of no chunks; ``append_chunks(cache, clean,
    cond, guidance)`` returns a new one holding the clean chunks ``0..k`` of ``clean`` ``(B, C, F_{≤k}, H, W)``
    and leaves ``cache`` as it was; caches have ``num_chunks``, ``batch``, ``select(index)`` and
    ``repeat_interleave(n)`` (forking), as :class:`Conditioning` has.
    """

    streaming: bool
    #: latent frames per chunk, in stream order
    chunk_frames: list[int]

    def chunk_slice(self, k: int) -> slice:
        """The latent frames of chunk ``k`` along the frame axis of ``(B, C, F, H, W)``."""
        ...

    def empty_cache(self, batch: int, guidance: float) -> Any: ...

    def chunk_velocity(self, x_chunk: torch.Tensor, sigma: float, sigma_next: float, cache: Any, cond: Conditioning,
                       guidance: float) -> torch.Tensor:
        """The velocity (mean velocity ``σ → σ'`` for a flow-map model) ``(B, C, f_k, H, W)`` float32 of chunk
        ``k = cache.num_chunks`` at ``x_chunk``; the step is ``x' = x + (σ' − σ)·v``."""
        ...

    def append_chunks(self, cache: Any, clean: torch.Tensor, cond: Conditioning, guidance: float) -> Any: ...

    def history_cache(self, clean: torch.Tensor, keep: Any, cond: Conditioning, guidance: float) -> Any:
        """KV routing: the cache the next chunk reads after the clean chunks of ``clean``, holding only the
        chunks ``keep`` (all of them: what ``append_chunks`` makes). A policy whose cache entries are written
        once (a causal model) also has ``reroute(cache, keep)``: the same entries, read only for ``keep``; one
        whose ``routes_frames`` is True also takes ``keep`` as :class:`KeptFrames`. A policy that can move a
        stream to a new prompt has ``switch_prompt(cache, clean, cond, guidance)``: the cache the next chunk
        reads under ``cond`` after the clean chunks ``clean`` (LongLive's recache)."""
        ...


@runtime_checkable
class UnifiedPolicy(FlowPolicy, Protocol):
    """One model that reads images and writes text (understanding) and draws images (generation), with one
    ``trainable`` module behind both roles (``docs/methods/umm_reflection.md``; Qwen-Image-Edit with its own
    VL encoder writing: :mod:`pipelines.unified`).

    As a :class:`FlowPolicy` it draws an image from text; ``editor`` is the same generator as a FlowPolicy
    that takes a reference image, ``editor.encode(instructions, images=[...])`` (a revision: the text it
    wrote is the instruction, its current image the reference). Written tokens are ids ``(B, L)``, ``-1``
    after a sequence's end (its log-prob 0). ``reflection`` (a :class:`flowalign.reflection.Reflection`, or
    None for its first image alone) is what an evaluation draws: ``sample_for_evaluation`` (the hook of
    :func:`flowalign.evaluation.sample_seeded_with_notes`) runs :func:`flowalign.reflection.sample_reflecting`.
    """

    editor: FlowPolicy
    reflection: Any

    def generate(self, images: torch.Tensor, prompts: list[str], max_new_tokens: int,
                 generator: torch.Generator | Sequence[torch.Generator] | None = None,
                 temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Text about ``images (B, 3, H, W)`` in [0, 1] drawn at ``temperature`` (0: greedy; ``generator``: one
        per sample or one for the batch): tokens ``(B, L)`` and each token's log-probability in the distribution
        it was drawn from (at ``temperature``; greedy: at 1), as :meth:`token_log_probs` at that temperature,
        ``(B, L)`` float32, no grad."""
        ...

    def sample_for_evaluation(self, prompts: list[str], *, initial_noise: torch.Tensor, seeds: list[int],
                              num_steps: int, guidance_scale: float | None, metadata: list[dict] | None = None
                              ) -> tuple[torch.Tensor, list[dict[str, str]]]:
        """An evaluation's samples and per-sample notes: the final images of the reflection loop from the
        first images of ``initial_noise`` (or those first images when ``reflection`` is None)."""
        ...

    def token_log_probs(self, images: torch.Tensor, prompts: list[str], tokens: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
        """``log π(tokens | image, prompt)`` at ``temperature`` (``log softmax(logits / T)``) ``(B, L)`` float32,
        with gradients (0 after a sequence's end); inside ``adapter_disabled()`` the starting model's, in both
        roles (the reference of a KL term)."""
        ...

    def decode_tokens(self, tokens: torch.Tensor) -> list[str]:
        """Each row of ``tokens`` as text (end marker and padding dropped)."""
        ...


@dataclass
class RewardOutput:
    """Named per-sample reward components ``(B,)`` float32 and a ``valid`` mask ``(B,)`` bool.

    An invalid sample (a judge that failed, an unparseable image) is masked, never scored zero (unless the run
    gives the reward an ``invalid_value``: :class:`flowalign.reward_set.RewardSet`).
    ``info`` carries per-sample details (verdicts, reasons) for logs and galleries.
    """

    components: dict[str, torch.Tensor]
    valid: torch.Tensor
    info: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total(self) -> torch.Tensor:
        """Sum of the components (weights are applied by the caller that combines rewards)."""
        return torch.stack(list(self.components.values())).sum(0)


@runtime_checkable
class Reward(Protocol):
    """A frozen scorer of decoded samples: ``(B,3,H,W)`` or ``(B,F,3,H,W)`` in [0,1]."""

    name: str
    #: True when gradients flow from the score to ``samples`` (for gradient-based trainers)
    differentiable: bool

    def __call__(
        self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]
    ) -> RewardOutput: ...


@runtime_checkable
class FeatureReward(Protocol):
    """A reward that is a function of an image embedding: ``R(x, c) = feature_scores(features(x), c)``.

    CLIP-based scorers (CLIP score, HPS, PickScore, aesthetic) are; a trainer that works in the reward's
    own feature space (FAV's particles) reads the two halves apart."""

    def features(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> torch.Tensor:
        """Decoded samples ``(B, 3, H, W)`` in [0, 1] → embeddings ``(B, D)`` float32, differentiable."""
        ...

    def feature_scores(self, features: torch.Tensor, prompts: list[str],
                       metadata: list[dict[str, Any]]) -> torch.Tensor:
        """Embeddings ``(B, D)`` → the reward's scores ``(B,)``, differentiable in ``features``."""
        ...


@runtime_checkable
class LatentReward(Protocol):
    """A reward read from noisy latents: ``score(x, σ, cond) -> (B,)``, differentiable in ``x``."""

    def score(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor: ...


class NotSized(Exception):
    """What a reward's (or image encoder's) ``planned_bytes`` raises when it cannot state its size without its
    weights (a missing folder and no published architecture to stand in for it); the message says why, and
    ``flowalign plan`` lists the reward as not counted with it."""


@runtime_checkable
class SizedReward(Protocol):
    """A reward that states, without loading anything, what its frozen models hold on the device of one
    process: ``planned_bytes(options)`` (a classmethod or staticmethod of the registered class, called with the
    options it would be built with) → bytes of its parameters and buffers in the dtype it runs in, built from
    its folder's configs on the meta device (or a published architecture where the folder does not exist);
    0 where it holds nothing there (no weights, a remote judge, ``device: cpu``). It raises :class:`NotSized`
    where it cannot say. ``flowalign plan`` reaches it through the reward registry
    (:func:`rewards.registry.planned_bytes`); a reward without it is planned as not counted."""

    @classmethod
    def planned_bytes(cls, options: dict[str, Any]) -> int: ...
