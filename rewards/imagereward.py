"""``imagereward``: ImageReward, a BLIP-based human-preference model (arXiv 2304.05977).

The reference (THUDM/ImageReward) is BLIP's ViT image encoder, BLIP's BERT text encoder cross-attending
to the image tokens, and an MLP on the text's first token: ``score = (MLP(h_cls) − mean) / std`` with the
mean and std the authors published. Its checkpoint ``ImageReward.pt`` is a state dict of that model
(``blip.visual_encoder.*``, timm ViT names; ``blip.text_encoder.*``, BLIP's ``med.py`` BERT names;
``mlp.layers.*``). transformers' ``BlipVisionModel`` and ``BlipTextModel`` are the same networks (its
BLIP ports), so the checkpoint is loaded into them with a key rename, and nothing of the reference's code
is needed. The ViT's shape is read from the checkpoint's tensors (BLIP's ViTs have 64-wide heads); the text
encoder's from the ``med_config.json`` shipped beside it.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from flowalign.errors import UserError
from flowalign.protocols import NotSized
from rewards.clip_common import PIXELS, clip_preprocess
from rewards.common import BatchedImageReward, to_pil
from rewards.model_options import one_of, resolve_dtype, weights_path
from rewards.planning import existing, module_bytes, on_accelerator, on_meta, option, published
from rewards.registry import register

DOWNLOAD = "THUDM/ImageReward (ImageReward.pt and med_config.json)"
TOKENIZER_DOWNLOAD = "google-bert/bert-base-uncased (its tokenizer files)"
CHECKPOINT = "ImageReward.pt"
MED_CONFIG = "med_config.json"
#: the released model's architecture (assets/reward_architectures/): its med_config.json and its ViT's shape
ARCHITECTURE, VISION_SHAPE = "imagereward", "vision_shape.json"
#: the reference's normalisation of the raw MLP output (ImageReward.py, ``self.mean`` / ``self.std``)
MEAN, STD = 0.16717362830052426, 1.0333394966054072
#: prompts are padded / truncated to this many tokens, as the reference tokenises them
MAX_TOKENS = 35
# BLIP's preprocessing: CLIP's mean and std after a bicubic resize of the shortest side and a centre crop
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: the Linear layers of the reference's MLP head (``mlp.layers.N``; the others are dropouts, off at inference)
HEAD_LINEARS = (0, 2, 4, 6, 7)
# timm ViT names (BLIP's vit.py) → transformers BlipVisionModel names
_VISION_RENAMES = (
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
    (r"^norm\.", "post_layernorm."),
)


@functools.lru_cache(maxsize=4)
def pil_transform(size: int) -> Callable[[Any], torch.Tensor]:
    """The ImageReward package's ``_transform``: ``Resize(size, bicubic)``, ``CenterCrop(size)``, ``ToTensor()``,
    CLIP's ``Normalize``, on a PIL image (PIL's resize rounds to 8 bits after each pass)."""
    from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize, ToTensor

    return Compose([Resize(size, interpolation=InterpolationMode.BICUBIC), CenterCrop(size), ToTensor(),
                    Normalize(CLIP_MEAN, CLIP_STD)])


@torch.no_grad()
def pil_pixels(images: torch.Tensor, size: int) -> torch.Tensor:
    """``(B, 3, size, size)`` float32 on ``images``' device: each image rounded to 8 bits, through
    :func:`pil_transform` (what Flow-GRPO's ``ImageRewardScorer`` hands the package)."""
    transform = pil_transform(size)
    return torch.stack([transform(to_pil(image)) for image in images]).to(images.device)


def imagereward_head(width: int) -> nn.Sequential:
    """The reference's MLP: ``width → 1024 → 128 → 64 → 16 → 1``, Linear layers only (its ReLUs are commented
    out) with dropouts between, at the same indices so the checkpoint's ``mlp.layers.N`` keys load."""
    return nn.Sequential(nn.Linear(width, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                         nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))


def _section(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def vision_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``blip.visual_encoder.*`` of the checkpoint under transformers' ``BlipVisionModel`` names."""
    out = {}
    for key, value in _section(state, "blip.visual_encoder.").items():
        for pattern, repl in _VISION_RENAMES:
            key, hits = re.subn(pattern, repl, key)
            if hits:
                break
        out[key] = value
    return out


def _files(who: str, path: Any) -> tuple[Path, Path]:
    """The checkpoint file and its ``med_config.json``: ``path`` is the folder holding both, or the file
    with the config beside it."""
    p = weights_path(who, path, download=DOWNLOAD)
    checkpoint = p / CHECKPOINT if p.is_dir() else p
    config = checkpoint.parent / MED_CONFIG
    for f in (checkpoint, config):
        if not f.is_file():
            raise UserError(f"{who} reward: path={str(path)!r} has no {f.name}; download {DOWNLOAD} into one "
                            "folder and set path: to it")
    return checkpoint, config


def vision_shape(vis: dict[str, torch.Tensor]) -> dict[str, int]:
    """The ViT's shape read from its tensors (:func:`vision_state`'s names): width, MLP width, depth, patch
    and image side, as :class:`ImageRewardModel` takes it."""
    patch = vis["embeddings.patch_embedding.weight"].shape[-1]
    grid = round((vis["embeddings.position_embedding"].shape[1] - 1) ** 0.5)
    return {"hidden_size": vis["embeddings.class_embedding"].shape[-1],
            "intermediate_size": vis["encoder.layers.0.mlp.fc1.weight"].shape[0],
            "num_hidden_layers": 1 + max(int(k.split(".")[2]) for k in vis if k.startswith("encoder.layers.")),
            "patch_size": patch, "image_size": grid * patch}


class ImageRewardModel(nn.Module):
    """BLIP's ViT (``vision``), its cross-attending text encoder (``text``) and the MLP head (``head``); the
    ViT's shape is read from ``state`` unless ``shape`` gives it (:func:`vision_shape`)."""

    def __init__(self, state: dict[str, torch.Tensor], med: dict[str, Any], random_init: bool,
                 shape: dict[str, int] | None = None):
        from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        super().__init__()
        vis = vision_state(state)
        shape = shape or vision_shape(vis)
        width, patch = shape["hidden_size"], shape["patch_size"]
        self.vision = BlipVisionModel(BlipVisionConfig(
            hidden_size=width, intermediate_size=shape["intermediate_size"],
            num_hidden_layers=shape["num_hidden_layers"], num_attention_heads=width // 64,
            image_size=shape["image_size"], patch_size=patch,
            layer_norm_eps=1e-6, hidden_act="gelu"))  # timm ViT's LayerNorm eps and exact GELU
        # is_decoder builds the cross-attention layers (transformers ties them to it); the encoder still runs
        # bidirectionally because forward is called with is_decoder=False
        self.text = BlipTextModel(BlipTextConfig(
            vocab_size=med["vocab_size"], hidden_size=med["hidden_size"],
            encoder_hidden_size=width, intermediate_size=med["intermediate_size"],
            num_hidden_layers=med["num_hidden_layers"], num_attention_heads=med["num_attention_heads"],
            max_position_embeddings=med["max_position_embeddings"], hidden_act=med.get("hidden_act", "gelu"),
            layer_norm_eps=med.get("layer_norm_eps", 1e-12), pad_token_id=med.get("pad_token_id", 0),
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, is_decoder=True,
            bos_token_id=None, eos_token_id=None, sep_token_id=None), add_pooling_layer=False)
        self.head = imagereward_head(med["hidden_size"])
        self.image_size = shape["image_size"]
        if random_init:
            return
        text = {k: v for k, v in _section(state, "blip.text_encoder.").items() if not k.endswith("position_ids")}
        head = _section(state, "mlp.layers.")
        for part, sd in ((self.vision, vis), (self.text, text), (self.head, head)):
            missing, unexpected = part.load_state_dict(sd, strict=False)
            missing = [k for k in missing if not k.endswith("position_ids")]
            if missing or unexpected:
                raise UserError(f"imagereward reward: {CHECKPOINT} does not match the ImageReward architecture "
                                f"(missing {missing[:3]}, unexpected {unexpected[:3]}); give the checkpoint of {DOWNLOAD}")

    def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Raw head outputs ``(b,)`` float32."""
        image = self.vision(pixel_values=pixels).last_hidden_state
        ones = torch.ones(image.shape[:-1], dtype=torch.long, device=image.device)
        hidden = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image,
                           encoder_attention_mask=ones, is_decoder=False).last_hidden_state
        return self.head(hidden[:, 0].float()).squeeze(-1)


@register("imagereward")
class ImageReward(BatchedImageReward):
    """``score_i = (MLP(BLIP(x_i, prompt_i)) − 0.16717) / 1.03334``, ImageReward's standardised reward (about
    −2..2; 0 is the mean over its training comparisons).

    Options: ``path`` (a folder with ``ImageReward.pt`` and ``med_config.json`` from THUDM/ImageReward, or the
    ``.pt`` file with the config beside it), ``tokenizer_path`` (the bert-base-uncased tokenizer the reference
    uses; default ``path``'s folder when it holds one), ``random_init``, ``pixels`` (``float``, default: the
    preprocessing in torch on the float images, differentiable, as ImageReward's ReFL ascends it; ``pil``: the
    images rounded to 8 bits and put through the package's own torchvision transform of PIL images, as
    Flow-GRPO's ``ImageRewardScorer`` hands them, no gradient), ``batch_size``, ``device``, ``dtype``.
    """

    name = "imagereward"

    def __init__(self, path: str | None = None, *, tokenizer_path: str | None = None, random_init: bool = False,
                 pixels: str = "float", **options: Any):
        from transformers import AutoTokenizer

        super().__init__(**options)
        one_of("imagereward reward", "pixels", pixels, tuple(PIXELS), PIXELS)
        self.pixels = pixels
        self.differentiable = pixels == "float"
        checkpoint, config = _files(self.name, path)
        folder = checkpoint.parent if tokenizer_path is None else weights_path(
            self.name, tokenizer_path, download=TOKENIZER_DOWNLOAD, option="tokenizer_path", kind="folder")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError):
            raise UserError(f"imagereward reward: no BERT tokenizer in {str(folder)!r}; download "
                            f"{TOKENIZER_DOWNLOAD} and set tokenizer_path: to the folder") from None
        # the reference's BLIP tokenizer: bert-base-uncased plus [DEC] and [ENC] (its vocabulary of 30524)
        self.tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
        try:
            state = torch.load(checkpoint, map_location="cpu", weights_only=True)
            med = json.loads(config.read_text())
        except (RuntimeError, OSError, ValueError) as e:
            raise UserError(f"imagereward reward: cannot read {checkpoint} / {config} ({str(e).splitlines()[0]}); "
                            f"give the files of {DOWNLOAD}") from None
        if "blip.visual_encoder.cls_token" not in state:
            raise UserError(f"imagereward reward: {checkpoint} is not an ImageReward checkpoint (no "
                            f"blip.visual_encoder.*); give the {CHECKPOINT} of {DOWNLOAD}")
        if len(self.tokenizer) > med.get("vocab_size", 0):
            raise UserError(f"imagereward reward: the tokenizer in {str(folder)!r} has {len(self.tokenizer)} tokens but "
                            f"{MED_CONFIG} says {med.get('vocab_size')}; give tokenizer_path: {TOKENIZER_DOWNLOAD}")
        self.model = ImageRewardModel(state, med, random_init).to(self.dtype).eval()
        self.model.head.float()  # the head reads float32 features, as the reference's .float()
        self.model.requires_grad_(False)

    def modules(self) -> list[torch.nn.Module]:
        return [self.model]

    @classmethod
    def planned_bytes(cls, options: dict[str, Any]) -> int:
        """Bytes of the model built with ``options``, sized on the meta device: in ``dtype``, the head in
        float32 as ``__init__`` casts them; 0 on the CPU."""
        if not on_accelerator(option(cls, options, "device")):
            return 0
        model = cls.planned_modules(options)[0].to(resolve_dtype(option(cls, options, "dtype"), cls.name))
        model.head.float()
        return module_bytes([model])

    @classmethod
    def planned_modules(cls, options: dict[str, Any]) -> list[torch.nn.Module]:
        """The model on the meta device: the ViT's shape read from ``ImageReward.pt``'s tensor shapes (no data
        read) and the text encoder's from ``med_config.json``; where ``path`` does not exist, the released
        model's (``assets/reward_architectures/imagereward``: BLIP's ViT-L/16 and bert-base with cross-attention)."""
        given = existing(options.get("path"))
        if given is None:
            folder = published(ARCHITECTURE)
            med = json.loads((folder / MED_CONFIG).read_text())
            shape = json.loads((folder / VISION_SHAPE).read_text())
            return [on_meta(lambda: ImageRewardModel({}, med, random_init=True, shape=shape))]
        checkpoint = given / CHECKPOINT if given.is_dir() else given
        if not checkpoint.is_file() or not (checkpoint.parent / MED_CONFIG).is_file():
            raise NotSized(f"path={options.get('path')} has no {CHECKPOINT} with {MED_CONFIG} beside it")
        med = json.loads((checkpoint.parent / MED_CONFIG).read_text())
        try:  # tensors on the meta device: their shapes, none of their bytes
            state = torch.load(checkpoint, map_location="meta", weights_only=True, mmap=True)
        except RuntimeError:  # a checkpoint of torch's legacy format cannot be mapped
            state = torch.load(checkpoint, map_location="meta", weights_only=True)
        return [on_meta(lambda: ImageRewardModel(state, med, random_init=True))]

    def context(self, prompts: list[str], metadata: list[dict[str, Any]], samples: torch.Tensor,
                device: torch.device) -> tuple[torch.Tensor, ...]:
        tokens = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=MAX_TOKENS,
                                return_tensors="pt")
        return tokens["input_ids"].to(device), tokens["attention_mask"].to(device)

    def score_batch(self, images: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        size = self.model.image_size
        if self.pixels == "pil":
            x = pil_pixels(images, size).to(self.dtype)
        else:
            x = clip_preprocess(images, size, CLIP_MEAN, CLIP_STD).to(self.dtype)
        return (self.model(x, input_ids, attention_mask) - MEAN) / STD


#: what :func:`save_tiny_imagereward` builds: the ViT's width (heads of 64), patch grid side and patch size, the
#: text encoder's width, heads and MLP width, and the scale of the ViT's random weights. ``released`` has the
#: released model's widths (BLIP's ViT-L/16 at 224 px and bert-base), the sizes the reference's constructor
#: hard-codes; only the depths, the vocabulary and the weights are the tiny folder's
WIDTHS = {"tiny": {"vision": (128, 4, 16), "text": (32, 2, 64), "scale": 0.05},
          "released": {"vision": (1024, 14, 16), "text": (768, 12, 3072), "scale": 0.02}}


def save_tiny_imagereward(out: Path, seed: int = 0, *, overwrite: bool = False, widths: str = "tiny",
                          layers: int = 2) -> Path:
    """An ImageReward folder as THUDM/ImageReward ships it (``ImageReward.pt`` with the reference's key names,
    ``med_config.json``), a small WordPiece tokenizer in place of bert-base-uncased's, and ``layers`` layers in
    the ViT and in the text encoder. ``widths`` (:data:`WIDTHS`): ``tiny`` (a 128-wide ViT on 64-px images, a
    32-wide BERT), or ``released`` (the released widths; the head's Linear weights scaled by √3, a unit gain
    each, so the score varies with the image). Written atomically (:func:`flowalign.io.atomic_dir`, writer
    ``save-tiny-imagereward``): a failure leaves ``out`` as it was, and a folder holding files it did not write
    is refused unless ``overwrite``."""
    from transformers import BertTokenizer

    from flowalign.io import atomic_dir

    if widths not in WIDTHS:
        raise UserError(f"save_tiny_imagereward: widths={widths!r} is not known; use one of {', '.join(WIDTHS)}")
    size = WIDTHS[widths]
    out = Path(out)
    with atomic_dir(out, writer="save-tiny-imagereward", overwrite=overwrite) as tmp:
        words = ["a", "an", "the", "of", "on", "and", "in", "with", "red", "blue", "green", "circle", "square",
                 "squares", "two", "three", "cat", "dog", "photo", "painting"]
        chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'\"-")
        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, *chars, *("##" + c for c in chars if c.isalnum())]
        (tmp / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
        tokenizer = BertTokenizer(str(tmp / "vocab.txt"), do_lower_case=True)
        tokenizer.save_pretrained(tmp)
        text_width, text_heads, text_mlp = size["text"]
        med = {"architectures": ["BertModel"], "hidden_act": "gelu", "hidden_size": text_width,
               "intermediate_size": text_mlp, "layer_norm_eps": 1e-12, "max_position_embeddings": 64,
               "model_type": "bert", "num_attention_heads": text_heads, "num_hidden_layers": layers,
               "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": len(tokenizer) + 2,
               "encoder_width": size["vision"][0], "add_cross_attention": True}
        (tmp / MED_CONFIG).write_text(json.dumps(med, indent=2))
        # the checkpoint's own layout: a timm ViT
        width, grid, patch = size["vision"]
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * size["scale"]

        state = {"blip.visual_encoder.cls_token": rnd(1, 1, width),
                 "blip.visual_encoder.pos_embed": rnd(1, grid * grid + 1, width),
                 "blip.visual_encoder.patch_embed.proj.weight": rnd(width, 3, patch, patch),
                 "blip.visual_encoder.patch_embed.proj.bias": rnd(width),
                 "blip.visual_encoder.norm.weight": 1 + rnd(width), "blip.visual_encoder.norm.bias": rnd(width)}
        for i in range(layers):
            b = f"blip.visual_encoder.blocks.{i}."
            state.update({b + "norm1.weight": 1 + rnd(width), b + "norm1.bias": rnd(width),
                          b + "attn.qkv.weight": rnd(3 * width, width), b + "attn.qkv.bias": rnd(3 * width),
                          b + "attn.proj.weight": rnd(width, width), b + "attn.proj.bias": rnd(width),
                          b + "norm2.weight": 1 + rnd(width), b + "norm2.bias": rnd(width),
                          b + "mlp.fc1.weight": rnd(4 * width, width), b + "mlp.fc1.bias": rnd(4 * width),
                          b + "mlp.fc2.weight": rnd(width, 4 * width), b + "mlp.fc2.bias": rnd(width)})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = ImageRewardModel(state, med, random_init=True)
        if widths != "tiny":
            with torch.no_grad():
                for layer in model.head:
                    if isinstance(layer, nn.Linear):
                        layer.weight.mul_(3 ** 0.5)
        state.update({f"blip.text_encoder.{k}": v for k, v in model.text.state_dict().items() if "position_ids" not in k})
        state.update({f"mlp.layers.{k}": v for k, v in model.head.state_dict().items()})
        torch.save({k: v.contiguous() for k, v in state.items()}, tmp / CHECKPOINT)
    return out
