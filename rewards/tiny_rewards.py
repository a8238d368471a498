"""Tiny, randomly initialised weights of every model reward, in the formats their cards ship.

``TINY_BUILDERS[name](folder)`` writes into an empty ``folder`` what ``rewards.load(name, path=folder)``
loads (a builder that needs more options, such as a second folder or the ``ocr`` reward's ``engine``,
returns them): the reward's real classes with tiny configs, saved as the real downloads are (``save_pretrained``
folders, open_clip's ``open_clip_config.json`` + safetensors, the aesthetic head's state dict), so each
reward's real loading code runs offline (tests, ``flowalign tiny-reward``, demos). A reward module adds one
entry. Weights are drawn from a fixed seed: the same folder on every machine. Each builder imports torch
and its reward's libraries itself, so listing the names (``flowalign tiny-reward --help``) loads none of them.

Every builder writes atomically (:func:`flowalign.io.atomic_dir`, a writer name of its own): a failure leaves
the folder as it was, and a folder holding files the builder did not write is refused unless ``overwrite``
(which replaces only its own files). Inside ``flowalign tiny-reward``'s atomic folder it writes straight into it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from rewards.tiny_towers import clip_style_towers

#: image side of the tiny vision towers: real samples are resized to it as to 224 for the real models
TINY_IMAGE = 64

# A ViT-B-style open_clip CLIP shrunk to 64 px and 2 layers; the text tower keeps CLIP's 49,408-token
# vocabulary because open_clip's tokenizer is the full BPE.
TINY_OPEN_CLIP = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": TINY_IMAGE, "layers": 2, "width": 64, "head_width": 32, "patch_size": 16},
    "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


def save_tiny_open_clip(folder: Path, seed: int = 0, *, overwrite: bool = False) -> None:
    """An open_clip ``CLIP`` as open_clip's ``local-dir:`` reads it (``clip_score``, ``hps``); written
    atomically (writer ``save-tiny-open-clip``)."""
    import open_clip
    import torch
    from safetensors.torch import save_file

    from flowalign.io import atomic_dir

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = open_clip.CLIP(**TINY_OPEN_CLIP).eval()
    with atomic_dir(folder, writer="save-tiny-open-clip", overwrite=overwrite) as tmp:
        (tmp / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY_OPEN_CLIP}))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp / "open_clip_model.safetensors")


def save_tiny_hf_clip(folder: Path, seed: int = 0, *, overwrite: bool = False, projection_dim: int = 32) -> None:
    """A transformers ``CLIPModel`` with its tokenizer and ``preprocessor_config.json`` in one folder, as
    ``yuvalkirstain/PickScore_v1`` ships (``pickscore``); written atomically (writer ``save-tiny-hf-clip``).
    ``projection_dim`` 768 gives the joint space of OpenAI's ViT-L/14, which the LAION aesthetic head reads
    (a scorer that hard-codes that head's 768 inputs can then load it)."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from flowalign.io import atomic_dir

    # the byte-level CLIP BPE the tiny pipelines use (real merges, a truncated vocabulary)
    from pipelines.tiny_tokenizers import clip_tokenizer

    tok = clip_tokenizer(vocab_size=1024, model_max_length=32)
    text, vision = clip_style_towers(tok, layers=2, max_positions=32, image_size=TINY_IMAGE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim)).eval()
    with atomic_dir(folder, writer="save-tiny-hf-clip", overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        CLIPImageProcessor(size={"shortest_edge": TINY_IMAGE},
                           crop_size={"height": TINY_IMAGE, "width": TINY_IMAGE}).save_pretrained(tmp)


def save_tiny_aesthetic(folder: Path, seed: int = 0, *, overwrite: bool = False) -> None:
    """The LAION aesthetic MLP head (``head.safetensors``) beside its CLIP backbone (``clip/``); written
    atomically as one folder (writer ``save-tiny-aesthetic``)."""
    import torch
    from safetensors.torch import save_file

    from flowalign.io import atomic_dir
    from rewards.aesthetic import AestheticHead

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        head = AestheticHead(TINY_OPEN_CLIP["embed_dim"])
    with atomic_dir(folder, writer="save-tiny-aesthetic", overwrite=overwrite) as tmp:
        save_tiny_open_clip(tmp / "clip", seed)  # inside this atomic folder: written straight into it
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, tmp / "head.safetensors")


def save_tiny_dinov2(folder: Path, seed: int = 0, *, overwrite: bool = False) -> None:
    """A transformers ``Dinov2Model`` with its ``BitImageProcessor`` config, as facebook/dinov2-base ships
    (``image_similarity``): the real processor's resize-then-crop, scaled to the tiny image side; written
    atomically (writer ``save-tiny-dinov2``)."""
    import torch
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    from flowalign.io import atomic_dir

    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
                          image_size=TINY_IMAGE, patch_size=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Dinov2Model(config).eval()
    with atomic_dir(folder, writer="save-tiny-dinov2", overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        BitImageProcessor(size={"shortest_edge": TINY_IMAGE * 8 // 7},
                          crop_size={"height": TINY_IMAGE, "width": TINY_IMAGE}, do_center_crop=True,
                          image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225], resample=3,
                          do_convert_rgb=True).save_pretrained(tmp)


def save_tiny_dinov3(folder: Path, seed: int = 0, *, overwrite: bool = False) -> None:
    """A transformers ``DINOv3ViTModel`` (4 register tokens and no q/k/v bias, as timm's
    ``vit_large_patch16_dinov3``) with the ``DINOv3ViTImageProcessorFast`` config facebook/dinov3-vitl16-*
    ships; written atomically (writer ``save-tiny-dinov3``). Every weight is drawn in name order from one
    seeded generator (N(0, 0.2²), layer norms and layer scales 1 + that), not by transformers' init, so the
    folder stays the same across transformers versions (the GARDO known answers were computed from it)."""
    import torch
    import transformers
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    from flowalign.io import atomic_dir

    config = DINOv3ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             patch_size=16, image_size=TINY_IMAGE, num_register_tokens=4, query_bias=False,
                             key_bias=False, value_bias=False, layerscale_value=1.0)
    model = DINOv3ViTModel(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            draw = 0.2 * torch.randn(tensor.shape, generator=gen)
            # a unit scale plus noise where the weight multiplies (norms, layer scales): activations stay O(1)
            scale = name.endswith("lambda1") or (("norm" in name) and name.endswith("weight"))
            tensor.copy_(1 + draw if scale else draw)
    with atomic_dir(folder, writer="save-tiny-dinov3", overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        # transformers 5 names the processor without the "Fast" its 4.x releases had
        processor = getattr(transformers, "DINOv3ViTImageProcessor", None) or transformers.DINOv3ViTImageProcessorFast
        processor().save_pretrained(tmp)


#: reward name → the function writing its tiny folder (``rewards.load(name, path=folder)`` loads it)
TINY_BUILDERS: dict[str, Callable[[Path], None]] = {
    "pickscore": save_tiny_hf_clip,
    "hps": save_tiny_open_clip,
    "clip_score": save_tiny_open_clip,
    "aesthetic": save_tiny_aesthetic,
    "image_similarity": save_tiny_dinov2,
    "geneval": lambda out: _builder("rewards.geneval.tiny:save_tiny_geneval")(out),
    "imagereward": lambda out: _builder("rewards.imagereward:save_tiny_imagereward")(out),
    "hpsv3": lambda out: _builder("rewards.hpsv3:save_tiny_hpsv3")(out),
    "unified_reward": lambda out: _builder("rewards.unified_reward:save_tiny_unified_reward")(out),
    "videoalign": lambda out: _builder("rewards.videoalign:save_tiny_videoalign")(out),
    # the transformers engine (GOT-OCR 2.0); rapidocr carries its models, tesseract and paddleocr read none
    "ocr": lambda out: _builder("rewards.ocr.tiny:save_tiny_got_ocr2")(out),
}


def _builder(target: str) -> Callable[[Path], object]:
    """A builder that lives beside its reward, imported only when used."""
    import importlib

    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
