"""Clean latents of (image, caption) pairs for trainers that learn from real images (SOAR, SFT, SePPO).

The pairs are a folder of images with ``.txt`` captions or a JSONL of ``{"image", "prompt"}`` on disk, or,
for a benchmark of programmatic scenes (``data.bench: vvr``), its training tasks rendered at the model's
resolution (a rendered scene satisfies its prompt by construction). Each pair is encoded once with the
policy's VAE (posterior mean) and kept in a least-recently-used cache.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from flowalign.data import PromptSet
from flowalign.errors import UserError


class PairImages:
    """``pairs`` (captions and metadata, a :class:`PromptSet`) and :meth:`latents` of any of them."""

    def __init__(self, policy: Any, cfg: Any, data: PromptSet, source: str | None, trainer: str, cache: int):
        if not hasattr(policy, "encode_images"):
            raise UserError(f"the {policy.family} policy cannot encode images to latents (no encode_images); "
                            f"trainer.name={trainer} needs it")
        self.policy, self.cache = policy, cache
        if source:
            from flowalign.trainers.parts.pairs import read_caption_pairs

            self.pairs, self.bench = read_caption_pairs(source), None
        elif cfg.data.prompts or not cfg.data.bench:
            raise UserError(f"trainer.name={trainer} trains on (image, caption) pairs, not prompts: set "
                            "trainer.pairs to a folder or JSONL of image/caption pairs, or data.bench: vvr (rendered "
                            "scenes)")
        else:
            self.pairs, self.bench = data, cfg.data.bench
        #: clean latents by pair index, least recently used first (at most ``cache``)
        self.encoded: OrderedDict[int, torch.Tensor] = OrderedDict()

    def latents(self, indices: list[int]) -> torch.Tensor:
        """``(B, C, h, w)`` clean latents x0 of the pairs, encoded once each and cached."""
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
                self.encoded[i] = self.policy.encode_images(image[None])[0].cpu()
                while len(self.encoded) > self.cache:
                    self.encoded.popitem(last=False)
            self.encoded.move_to_end(i)
            out.append(self.encoded[i])
        return torch.stack(out).to(self.policy.device)
