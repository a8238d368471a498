"""Clean latents of (image, caption) pairs for trainers that learn from real images (SOAR, SFT, SePPO).

The pairs are a folder of images with ``.txt`` captions or a JSONL of ``{"image", "prompt"}`` on disk, or,
for a benchmark of programmatic scenes (``data.bench: vvr``), its training tasks rendered at the model's
resolution (a rendered scene satisfies its prompt by construction). Each pair is encoded once with the
policy's VAE and kept in a least-recently-used cache: its posterior mean, or (``posterior``) the posterior's
mean and standard deviation, from which a trainer draws a fresh sample each time it trains the pair.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from flowalign.data import PromptSet
from flowalign.errors import UserError


class PairImages:
    """``pairs`` (captions and metadata, a :class:`PromptSet`) and :meth:`latents` of any of them."""

    def __init__(self, policy: Any, cfg: Any, data: PromptSet, source: str | None, trainer: str, cache: int,
                 posterior: bool = False):
        if not hasattr(policy, "encode_images"):
            raise UserError(f"the {policy.family} policy cannot encode images to latents (no encode_images); "
                            f"trainer.name={trainer} needs it")
        if posterior and not hasattr(policy, "encode_posterior"):
            raise UserError(f"trainer.image_latents=sample: the {policy.family} policy gives no VAE posterior to "
                            "draw from (no encode_posterior); set trainer.image_latents=mean")
        self.policy, self.cache, self.posterior = policy, cache, posterior
        if source:
            from flowalign.trainers.parts.pairs import read_caption_pairs

            self.pairs, self.bench = read_caption_pairs(source), None
        elif cfg.data.prompts or not cfg.data.bench:
            raise UserError(f"trainer.name={trainer} trains on (image, caption) pairs, not prompts: set "
                            "trainer.pairs to a folder or JSONL of image/caption pairs, or data.bench: vvr (rendered "
                            "scenes)")
        else:
            self.pairs, self.bench = data, cfg.data.bench
        #: clean latents by pair index (with ``posterior``, the mean and std stacked: ``(2, ...)``), least
        #: recently used first (at most ``cache``)
        self.encoded: OrderedDict[int, torch.Tensor] = OrderedDict()

    def latents(self, indices: list[int]) -> torch.Tensor:
        """``(B, C, h, w)`` clean latents x0 of the pairs (the posterior means), encoded once each and cached."""
        encoded = self._encoded(indices)
        return torch.stack([e[0] if self.posterior else e for e in encoded]).to(self.policy.device)

    def posteriors(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs' posterior mean and standard deviation, each ``(B, C, h, w)`` (``posterior`` only)."""
        encoded = torch.stack(self._encoded(indices)).to(self.policy.device)
        return encoded[:, 0], encoded[:, 1]

    def _encoded(self, indices: list[int]) -> list[torch.Tensor]:
        """The cache's entries of the pairs, encoding those not in it."""
        h, w = int(self.policy.defaults["height"]), int(self.policy.defaults["width"])
        out = []
        for i in indices:
            if i not in self.encoded:
                meta = self.pairs.metadata[i]
                if self.bench is not None:
                    if h != w:
                        raise UserError(f"rendered {self.bench} scenes are square but the model samples {h}x{w}: set "
                                        "model.defaults height = width")
                    from flowalign.benchmarks import render_task

                    image = render_task(self.bench, meta, h)
                else:
                    from flowalign.trainers.parts.pairs import load_image

                    image = load_image(meta["image"], h, w)
                if self.posterior:
                    self.encoded[i] = torch.stack([t[0] for t in self.policy.encode_posterior(image[None])]).cpu()
                else:
                    self.encoded[i] = self.policy.encode_images(image[None])[0].cpu()
                while len(self.encoded) > self.cache:
                    self.encoded.popitem(last=False)
            self.encoded.move_to_end(i)
            out.append(self.encoded[i])
        return out
