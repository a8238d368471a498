"""The tiny Qwen-Image-Edit-format *unified* world: a VL model that says what is wrong with an image and an
editing transformer that fixes it, trained for the UMM-Reflection loop (:mod:`pipelines.unified`).

Data (rendered once into ``OUT/data.*``, every image at ``--size`` and checked by the ``vvr`` verifier):

- *scenes*: ``vvr`` training tasks over the levels of ``--mix`` (task seeds < 1000, held-out compositions
  excluded), each rendered; a scene its own verifier does not pass at this size is dropped;
- *edits*: a wrong image, a ``vvr`` prompt it violates and the short ``vvr_edit``-style instruction that
  fixes it, with the fixed scene. Three sources: ``vvr_edit`` training tasks (the prompt describes the
  edited scene in ``vvr``'s words: a recolour's new object exists ("a purple square"), a removed object is
  absent ("no purple circles"), a move's or add's relation holds), and two variants of each easy ``vvr``
  scene, alternately its object in another colour ("make the blue circle red") and the empty canvas
  ("add a red circle"). An edit is kept only when its wrong image fails the prompt's verifier, its fixed
  image passes it, and its instruction and the end token fit ``--reflect-max-tokens`` tokens (so moves and
  additions with an anchor, 8+ words, are left out at the recipe's 8).

Reflection examples (:func:`reflection_examples`): every scene and fixed image with its prompt → "no
change"; every wrong image with its prompt → its instruction. The answer is "no change" exactly when the
verifier passes the image for the prompt.

Components (the real classes at the tiny twin's proportions, :data:`ARCHITECTURE`): ``AutoencoderKLQwenImage``
(f2, 4 channels: 32 px scenes are 16 × 16 latents, 8 × 8 = 64 tokens after the 2×2 packing; single frames,
so the causal convolutions' past taps only ever see their zero padding), ``Qwen2_5_VLForConditionalGeneration``
(vision tower 2 × 64, language model 3 × 64), ``QwenImageTransformer2DModel`` (4 blocks, 4 heads × 32), and
a ``Qwen2Tokenizer`` whose byte-level BPE merges are learnt from the training texts (:func:`build_tokenizer`):
the tiny twin's tokenizer spells "make the blue square purple" in 11 tokens, this one in 5, which is what
lets a fix fit the recipe's 8-token reflections.

Stages, each resumable (``--resume``):

1. ``vae``, then ``decoder`` after the transformer: :mod:`pipelines.pretrain.autoencoder` on single frames,
   the decoder without the final clamp (:func:`decode_unclamped`, as the Wan family), per-channel
   ``latents_mean`` / ``latents_std`` from the latent statistics;
2. ``reflect``: the whole VL model (vision tower, language model, head) by teacher forcing on reflection
   examples, read through the pipeline's processor and :data:`pipelines.unified.REFLECTION_TEMPLATE` as
   :class:`pipelines.unified.UnifiedEditPolicy` reads them, the loss on the answer and its ``<|im_end|>``
   (the token its ``generate`` stops at); ``--reflect-wrong`` of the reflections are on wrong images. A share
   ``--reflect-caption`` of each batch asks instead what the image shows (:data:`CAPTION_TEMPLATE`, answer
   :func:`caption`): without it the writer learns the text prior first and says "no change" to everything
   (measured: after 500 steps at batch 16, 0 of 40 held-out wrong images got a fix; with half the batch
   captions, the empty canvas was told apart and 41 % of held-out captions were exact after as many steps).
   It runs before the transformer's stage because the transformer reads this encoder's hidden states, frozen
   from then on;
3. ``dit``: rectified flow on the packed target latents with the reference image's packed latents after the
   noisy tokens (their own RoPE frame, their output dropped) and the text through the pipeline's own
   ``_get_qwen_prompt_embeds`` with the reference image, as :class:`pipelines.qwen_image_edit.QwenImageEditPolicy`
   feeds them. A batch mixes (``--dit-mix``) ``t2i``: a scene from the mid-grey canvas under its prompt (a
   unified model's first image); ``revise``: the fixed scene from the wrong one under
   ``instruction(prompt, edit)`` (:func:`flowalign.reflection.instruction`); ``keep``: a scene from itself
   under its prompt (what already satisfies the text stays). No CFG (``guidance_scale`` 1.0, the recipe's).

Export: the diffusers folder with ``flowalign.json``; ``--eval-n N`` measures (:func:`evaluate`) first-image
accuracy on ``vvr`` easy validation and how often the reflection says "no change" on correct and on wrong
validation images, and writes them into the model card (``README.md``, only one this family wrote).

The command that makes ``assets/tiny-qwen-image-umm`` (64 CPU minutes of training on one thread, plus a minute
or two of rendering and the evaluation; steps measured on a busy 2-core machine: the VAE's 0.3 s at batch 16, the
reflection writer's 0.09 s at batch 16, the transformer's 0.6 s at batch 32)::

    flowalign pretrain-tiny qwen_image_edit --out runs/pretrain-qwen-image-umm --export assets/tiny-qwen-image-umm \\
        --threads 1 --vae-minutes 8 --dec-minutes 4 --reflect-minutes 10 --dit-minutes 42 --eval-n 100
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowalign.cli.common import add_number
from flowalign.errors import UserError
from flowalign.io import atomic_path, write_json
from flowalign.limits import MAX_BATCH, MAX_LR, MAX_MINUTES, MAX_SEQUENCE_LENGTH, MAX_TASKS, MAX_TRAIN_STEPS
from pipelines.pretrain.work_folder import move_aside, redo_after_vae

# torch is imported by the functions that train: pretrain-tiny's parser (every --help) reads this module
if TYPE_CHECKING:
    import torch

    from pipelines.pretrain.autoencoder import AutoencoderRecipe

log = logging.getLogger("flowalign.pretrain")

HELP = ("the Qwen-Image-Edit-format unified model (VL reflection writer + editing transformer) on rendered vvr "
        "scenes and fixes (assets/tiny-qwen-image-umm)")
NAME, BENCH, PIPELINE = "qwen_image_edit", "vvr", "QwenImageEditPipeline"
TRAINED = ("transformer",)
COMPONENTS = ("transformer", "vae", "text_encoder")
EVAL_LEVELS = ("easy",)
DEFAULTS = dict(out="runs/pretrain-qwen-image-umm", export="assets/tiny-qwen-image-umm", size=32, threads=1,
                n_scenes=12000, mix="easy:0.8,medium:0.2", vae_minutes=8.0, vae_batch=16, vae_lr=3e-3,
                dit_minutes=42.0, batch=32, cfg=1.0, demo_n=8, max_sequence_length=0, dec_minutes=4.0, drop=0.0)
#: the stop reflection (the recipe's ``stop_phrase``)
NO_CHANGE = "no change"
#: the pixel value of the unified policy's blank canvas (0.5 as 8 bits, as its image is read)
CANVAS = 128
#: the auxiliary question whose answer (:func:`caption`) only the image can give (Qwen2.5-VL's chat format)
CAPTION_TEMPLATE = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What does the image show?<|im_end|>\n"
                    "<|im_start|>assistant\n")
#: the components' sizes (the tiny twin's layout, widened to learn in CPU minutes)
ARCHITECTURE: dict[str, Any] = {
    "transformer": {"num_layers": 4, "attention_head_dim": 32, "num_attention_heads": 4, "axes_dims_rope": [8, 12, 12]},
    "vae": {"base_dim": 16, "z_dim": 4, "dim_mult": [1, 2], "num_res_blocks": 1, "attn_scales": [],
            "temperal_downsample": [False]},
    # M-RoPE sections sum to head_dim / 2
    "text_encoder": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 3, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                                   "mrope_section": [2, 3, 3]}},
    "vision": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "fullatt_block_indexes": [1]},
}
#: the processor reads a 32 px image at 112² px: 8 × 8 patches of 14 px, 16 tokens after the 2×2 merge
PROCESSOR = {"min_pixels": 112 * 112, "max_pixels": 112 * 112, "patch_size": 14, "merge_size": 2,
             "temporal_patch_size": 2}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options only this family has."""
    add_number(p, "--n-edits", type=int, lo=0, hi=MAX_TASKS, default=6000,
               help="vvr_edit training tasks rendered as (wrong, fixed) pairs (besides the easy scenes' variants)")
    p.add_argument("--dit-mix", default="t2i:0.6,revise:0.3,keep:0.1",
                   help="transformer batch shares: t2i (from the grey canvas), revise (wrong -> fixed), keep")
    reflect = p.add_argument_group("reflection writer (the VL model)")
    add_number(reflect, "--reflect-minutes", type=float, lo=0, hi=MAX_MINUTES, default=10.0)
    add_number(reflect, "--reflect-steps", type=int, lo=1, hi=MAX_TRAIN_STEPS, default=None)
    add_number(reflect, "--reflect-batch", type=int, lo=1, hi=MAX_BATCH, default=32)
    add_number(reflect, "--reflect-lr", type=float, lo=0, hi=MAX_LR, lo_open=True, default=3e-3)
    add_number(reflect, "--reflect-wrong", type=float, lo=0, hi=1, default=0.5,
               help="share of each batch's reflections that are on wrong images (answer: an instruction)")
    add_number(reflect, "--reflect-caption", type=float, lo=0, hi=1, default=0.5,
               help="share of each batch that asks what the image shows (answer: its objects, left to right)")
    add_number(reflect, "--reflect-max-tokens", type=int, lo=2, hi=MAX_SEQUENCE_LENGTH, default=8,
               help="longest answer in tokens, end token included (the recipe's max_new_tokens)")


def check(args: argparse.Namespace) -> None:
    """Bad values as one-line errors, before anything is rendered."""
    from pipelines.pretrain.data import parse_mix

    if args.size % 32:
        raise UserError(f"--size {args.size}: use a multiple of 32 (the pipeline rounds its condition image's sides "
                        "to 32, and the reference must match the output)")
    if not args.reflect_steps and not args.reflect_minutes and not args.eval_only:
        raise UserError("--reflect-minutes / --reflect-steps: the reflect stage needs a budget")
    unknown = set(parse_mix(args.dit_mix)) - {"t2i", "revise", "keep"}
    if unknown:
        raise UserError(f"--dit-mix {args.dit_mix!r}: unknown kind(s) {sorted(unknown)}; use t2i, revise and keep")
    if args.cfg > 1 and not args.drop:
        raise UserError(f"--cfg {args.cfg}: true CFG needs a model that saw the negative prompt; give --drop > 0 "
                        "or leave --cfg at 1.0")


# ------------------------------------------------------------------ data


def render(scene: Any, size: int) -> torch.Tensor:
    """A ``vvr`` scene (task or dict) → uint8 pixels ``(3, 1, size, size)`` (one frame, the VAE's layout)."""
    import numpy as np
    import torch

    from rewards.vvr import render as render_vvr

    pixels = np.array(render_vvr(scene, size=size).convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(pixels).permute(2, 0, 1)[:, None].contiguous()


def passes(task: Any, pixels: torch.Tensor) -> bool:
    """Whether the ``vvr`` verifier passes ``pixels (3, 1, H, W)`` uint8 for ``task``."""
    from rewards.vvr import verify

    return bool(verify(task, pixels[:, 0].permute(1, 2, 0).numpy()).all_passed)


def described(edit_task: Any) -> Any:
    """The ``vvr`` task whose prompt describes ``edit_task``'s edited scene and fails on its source (see the
    module docstring): the instruction's constraints without the ones another constraint implies."""
    from rewards.vvr import Task
    from rewards.vvr_edit.verify import instruction_constraints

    constraints = [c for c in instruction_constraints(edit_task) if c.type != "total_count"]
    if edit_task.kind == "recolour":
        # "a purple square", as vvr's easy prompts name what should be there; the source fails it: no object
        # of the new colour and shape is in it (the generator's objects are unique by colour and shape)
        constraints = constraints[:1]
    return Task(edit_task.id, edit_task.level, edit_task.background, edit_task.result, tuple(constraints))


def easy_variant(task: Any, i: int, rng: random.Random) -> tuple[Any, str]:
    """A wrong version of a one-object scene and the instruction that fixes it: even ``i`` its object in
    another colour of the level ("make the blue circle red"), odd ``i`` the empty canvas ("add a red circle")."""
    import dataclasses

    from rewards.vvr import VOCABULARIES
    from rewards.vvr.prompts import indefinite
    from rewards.vvr_edit.tasks import describe

    (obj,) = task.objects
    if i % 2:
        return dataclasses.replace(task, objects=()), f"add {indefinite({'colour': obj.colour, 'shape': obj.shape})}"
    colour = rng.choice([c for c in VOCABULARIES[task.level].colours if c not in (obj.colour, task.background)])
    wrong = dataclasses.replace(obj, colour=colour)
    return dataclasses.replace(task, objects=(wrong,)), f"make the {describe(wrong)} {obj.colour}"


def caption(objects: Any) -> str:
    """What a scene shows, as only its image tells: its objects left to right ("a red circle, a green
    square"), or "nothing"."""
    from rewards.vvr.prompts import indefinite

    ordered = sorted(objects, key=lambda o: (o.x, o.y))
    return ", ".join(indefinite({"colour": o.colour, "shape": o.shape}) for o in ordered) or "nothing"


def answer_fits(answer: str, max_tokens: int) -> bool:
    """Whether ``answer`` can fit ``max_tokens`` (end token included) once each word is one token."""
    return len(answer.split()) + 1 <= max_tokens


def build_data(n_scenes: int, n_edits: int, mix: dict[str, float], seed: int, size: int, max_tokens: int) -> dict:
    """Render the scenes and edits (see the module docstring) → ``pixels (M, 3, 1, size, size)`` uint8 (index 0
    the grey canvas), ``scenes`` and ``edits`` (records of image indices, prompts, answers and ``vvr`` task dicts),
    ``prompts`` and ``levels`` of the scenes."""
    import torch
    from tqdm import tqdm

    from rewards.vvr import Task
    from rewards.vvr.generate import generate_tasks
    from rewards.vvr.heldout import is_heldout
    from rewards.vvr_edit import generate_edit_tasks
    from rewards.vvr_edit.generate import LEVELS as EDIT_LEVELS
    from rewards.vvr_edit.tasks import scene_dict
    from pipelines.pretrain.data import level_counts, task_seed

    pixels, captions = [torch.full((3, 1, size, size), CANVAS, dtype=torch.uint8)], ["nothing"]
    scenes, edits = [], []
    rng = random.Random(seed)

    def add(image: torch.Tensor, objects: Any) -> int:
        pixels.append(image)
        captions.append(caption(objects))
        return len(pixels) - 1

    def add_edit(task, wrong_scene, fixed: int | None, answer: str, level: str, kind: str) -> None:
        if not answer_fits(answer, max_tokens) or is_heldout(task.constraints):
            return
        wrong = render(wrong_scene, size)
        if passes(task, wrong):
            return
        if fixed is None:
            image = render(task, size)
            if not passes(task, image):
                return
            fixed = add(image, task.objects)
        edits.append({"source": add(wrong, wrong_scene.objects), "target": fixed, "prompt": task.prompt,
                      "edit": answer, "level": level, "kind": kind, "task": task.to_dict()})

    for i, (level, k) in enumerate(level_counts(n_scenes, mix)):
        if k == 0:
            continue
        for j, task in enumerate(tqdm(generate_tasks(k, seed=task_seed(seed, i), level=level), desc=f"render {level}",
                                      mininterval=5)):
            image = render(task, size)
            if not passes(task, image):  # too small to verify at this size: no exact label
                continue
            index = add(image, task.objects)
            scenes.append({"image": index, "prompt": task.prompt, "level": level, "task": task.to_dict()})
            if len(task.objects) == 1:
                wrong, answer = easy_variant(task, j, rng)
                add_edit(task, wrong, index, answer, level, "add" if j % 2 else "recolour")
    edit_mix = {lv: w for lv, w in mix.items() if lv in EDIT_LEVELS}
    for i, (level, k) in enumerate(level_counts(n_edits, edit_mix) if edit_mix and n_edits else []):
        if k == 0:
            continue
        for task in tqdm(generate_edit_tasks(k, seed=task_seed(seed, i), level=level, heldout="exclude"),
                         desc=f"render edits {level}", mininterval=5):
            add_edit(described(task), Task.from_dict(scene_dict(task, task.objects)), None, task.prompt, level,
                     task.kind)
    if not scenes:
        raise UserError("--n-scenes: no rendered scene passed its verifier at this --size; use a larger --size")
    log.info("data: %d scenes, %d edits (%s)", len(scenes), len(edits),
             ", ".join(f"{kind} {sum(e['kind'] == kind for e in edits)}" for kind in ("recolour", "add", "remove", "move")))
    return {"pixels": torch.stack(pixels), "captions": captions, "scenes": scenes, "edits": edits,
            "prompts": [s["prompt"] for s in scenes], "levels": [s["level"] for s in scenes]}


def load_data(args: argparse.Namespace, out: Path) -> dict:
    """:func:`build_data`, cached in ``OUT/data.safetensors`` + ``OUT/data.json``."""
    from safetensors.torch import load_file, save_file

    from pipelines.pretrain.data import parse_mix

    tensors, text = out / "data.safetensors", out / "data.json"
    if tensors.is_file() and text.is_file():
        data = {"pixels": load_file(str(tensors))["pixels"], **json.loads(text.read_text())}
        log.info("data: %d cached scenes, %d edits", len(data["scenes"]), len(data["edits"]))
        return data
    data = build_data(args.n_scenes, args.n_edits, parse_mix(args.mix), args.seed, args.size, args.reflect_max_tokens)
    with atomic_path(tensors) as tmp:
        save_file({"pixels": data["pixels"]}, str(tmp))
    write_json(text, {k: v for k, v in data.items() if k != "pixels"})
    return data


def reflection_examples(data: dict) -> tuple[list[dict], list[dict]]:
    """``(right, wrong)`` reflection examples ``{"image", "prompt", "answer", "task"}``: scenes and fixed images
    answer :data:`NO_CHANGE`, wrong images their instruction."""
    right = [{"image": s["image"], "prompt": s["prompt"], "answer": NO_CHANGE, "task": s["task"]} for s in data["scenes"]]
    seen = {(r["image"], r["prompt"]) for r in right}
    for e in data["edits"]:
        if (e["target"], e["prompt"]) not in seen:
            seen.add((e["target"], e["prompt"]))
            right.append({"image": e["target"], "prompt": e["prompt"], "answer": NO_CHANGE, "task": e["task"]})
    wrong = [{"image": e["source"], "prompt": e["prompt"], "answer": e["edit"], "task": e["task"]} for e in data["edits"]]
    return right, wrong


def caption_examples(data: dict) -> list[dict]:
    """Every image with :data:`CAPTION_TEMPLATE` → :func:`caption` of its scene: an answer no prior over the
    text can give, so it teaches the vision tower colours, shapes and their places from the first steps."""
    return [{"image": i, "prompt": "", "answer": text, "template": CAPTION_TEMPLATE}
            for i, text in enumerate(data["captions"])]


def edit_template() -> tuple[str, int]:
    """``QwenImageEditPipeline``'s prompt template and how many of its first tokens its encoding drops."""
    from diffusers import QwenImageEditPipeline

    empty = QwenImageEditPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None,
                                  transformer=None)
    return empty.prompt_template_encode, empty.prompt_template_encode_start_idx


def training_texts(data: dict) -> list[str]:
    """Every text the model reads or writes: prompts, answers, revision instructions and the templates' words."""
    from flowalign.reflection import instruction
    from pipelines.unified import REFLECTION_TEMPLATE

    texts = [s["prompt"] for s in data["scenes"]] + [NO_CHANGE] + data["captions"] + [CAPTION_TEMPLATE] * 10
    for e in data["edits"]:
        texts += [e["prompt"], e["edit"], instruction(e["prompt"], e["edit"])]
    return texts + [REFLECTION_TEMPLATE, edit_template()[0]] * 10


# ------------------------------------------------------------------ model


def build_tokenizer(texts: list[str]):
    """A ``Qwen2Tokenizer`` (byte-level BPE, Qwen2's pre-tokenizer, ChatML specials and the tiny twins' chat
    template) whose merges are learnt from ``texts`` until every word of them is one token (after a space or
    not): a BPE replays its merges in the order it learnt them, so a training word comes out whole."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import AddedToken, Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from pipelines.tiny_twins.tokenizers import CHAT_TEMPLATE, SPECIALS

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    plain = []
    for text in texts:  # the specials are added tokens, never merged: learn the text around them
        for special in SPECIALS:
            text = text.replace(special, "\n")
        plain.append(text)
    bpe.train_from_iterator(plain, trainers.BpeTrainer(vocab_size=1 << 16, min_frequency=1, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(bpe.to_str())["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    for special in SPECIALS:
        vocab[special] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         model_max_length=1024)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(s, special=True) for s in SPECIALS[1:]]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def work_tokenizer(out: Path, texts: list[str]):
    """:func:`build_tokenizer` of ``texts``, saved in ``OUT/tokenizer`` by the first run and read back by a
    resumed one (its ids must stay those the saved text encoder was trained with)."""
    import os
    import shutil

    from transformers import Qwen2Tokenizer

    saved = out / "tokenizer"
    if saved.is_dir():
        return Qwen2Tokenizer.from_pretrained(saved)
    tok = build_tokenizer(texts)
    tmp = out / ".tokenizer.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save_pretrained(tmp)
    os.replace(tmp, saved)
    return tok


def check_template(tok) -> None:
    """Refuse a tokenizer that spells the edit template's system part in fewer tokens than the pipeline drops
    (its encoding would then drop the image's and the prompt's first tokens too)."""
    template, dropped = edit_template()
    system = len(tok(template.split("<|vision_start|>")[0]).input_ids)
    if system < dropped:
        raise ValueError(f"the tokenizer spells the edit template's system part in {system} tokens; the pipeline "
                         f"drops the first {dropped}")


def build(tok, args: argparse.Namespace):
    """A fresh ``QwenImageEditPipeline`` at :data:`ARCHITECTURE`'s sizes around the tokenizer ``tok``
    (:func:`build_tokenizer`) → ``(pipe, max_sequence_length)``; the length is only recorded in ``flowalign.json``:
    the editing policy pads a batch's text to its longest row."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline
    from diffusers import QwenImageTransformer2DModel
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    from pipelines.tiny_twins import qwen_image
    from pipelines.tiny_twins.base import seeded
    from pipelines.tiny_twins.published import published_config

    check_template(tok)
    vae_cfg = {**ARCHITECTURE["vae"]}
    z = vae_cfg["z_dim"]
    tr = {**published_config("qwen_image"), **ARCHITECTURE["transformer"], "in_channels": 4 * z, "out_channels": z,
          "joint_attention_dim": ARCHITECTURE["text_encoder"]["hidden_size"]}
    with seeded(args.seed):
        transformer = QwenImageTransformer2DModel(**tr)
        vae = AutoencoderKLQwenImage(**vae_cfg, latents_mean=[0.0] * z, latents_std=[1.0] * z)
        te = qwen_image.text_encoder(ARCHITECTURE["text_encoder"], ARCHITECTURE["vision"], tok)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**PROCESSOR), tokenizer=tok,
                                 video_processor=Qwen2VLVideoProcessor(**PROCESSOR))
    pipe = QwenImageEditPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**qwen_image.DEFAULTS["scheduler"]),
                                 vae=vae, text_encoder=te, tokenizer=tok, processor=processor, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe, args.max_sequence_length or 512


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """``AutoencoderKLQwenImage._decode`` of one frame ``z (B, C, 1, h, w)`` → ``(B, 3, 1, H, W)`` without its
    final clamp to [-1, 1] (a clamped output passes no gradient: see the Wan family's)."""
    vae.clear_cache()
    vae._conv_idx = [0]
    out = vae.decoder(vae.post_quant_conv(z), feat_cache=vae._feat_map, feat_idx=vae._conv_idx)
    vae.clear_cache()
    return out


def recipe(vae, args: argparse.Namespace) -> AutoencoderRecipe:
    """The Wan family's autoencoder recipe on single frames (its two-rate schedule, unclamped decoder)."""
    import torch

    from pipelines.pretrain import wan
    from pipelines.pretrain.autoencoder import AutoencoderRecipe
    from pipelines.pretrain.data import to_unit

    base = wan.recipe(vae, args)

    def vae_batch(pixels: torch.Tensor, fraction: float) -> torch.Tensor:
        return to_unit(pixels[torch.randint(0, len(pixels), (args.vae_batch,))])  # (B, 3, 1, H, W)

    return AutoencoderRecipe(vae_batch=vae_batch, decode=decode_unclamped, denormalise=base.denormalise,
                             vae_lr=base.vae_lr, decoder_modules=base.decoder_modules, decoder_batch=args.vae_batch,
                             log_every=25)


def set_latent_factors(vae, z: torch.Tensor, keep: bool = False) -> torch.Tensor:
    """Per-channel ``latents_mean`` / ``latents_std`` from the statistics of ``z (N, C, 1, h, w)``."""
    from pipelines.pretrain import wan

    return wan.set_latent_factors(vae, z, keep)


# ------------------------------------------------------------------ reflection stage


def picture(pixels: torch.Tensor):
    """uint8 ``(3, 1, H, W)`` → the PIL image a policy reads (its ``condition_image`` of an image at the output
    size, which the pipeline's resize leaves as it is)."""
    from PIL import Image

    return Image.fromarray(pixels[:, 0].permute(1, 2, 0).numpy())


def reflection_inputs(pipe, pixels: torch.Tensor, examples: list[dict]) -> dict[str, torch.Tensor]:
    """A teacher-forced batch: per example the processor's reading of ``REFLECTION_TEMPLATE`` (or the example's
    ``template``) with the image (as :meth:`pipelines.unified.UnifiedEditPolicy._inputs`), then the answer's
    tokens and ``<|im_end|>``; ``labels`` are -100 except on those; right-padded."""
    import torch

    from pipelines.unified import REFLECTION_TEMPLATE

    eos = int(pipe.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    pad = int(pipe.tokenizer.pad_token_id)
    rows, images, grids, types = [], [], [], []
    for ex in examples:
        text = ex.get("template", REFLECTION_TEMPLATE).format(ex["prompt"])
        read = pipe.processor(text=[text], images=[picture(pixels[ex["image"]])], return_tensors="pt")
        answer = pipe.tokenizer(ex["answer"], add_special_tokens=False).input_ids + [eos]
        rows.append((read["input_ids"][0], torch.tensor(answer)))
        images.append(read["pixel_values"])
        grids.append(read["image_grid_thw"])
        types.append(read.get("mm_token_type_ids"))
    length = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, (prompt, answer) in enumerate(rows):
        n = len(prompt) + len(answer)
        ids[i, :n] = torch.cat([prompt, answer])
        labels[i, len(prompt) : n] = answer
        mask[i, :n] = 1
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": torch.cat(images),
           "image_grid_thw": torch.cat(grids)}
    if types[0] is not None:
        tt = torch.zeros(len(rows), length, dtype=types[0].dtype)
        for i, t in enumerate(types):
            tt[i, : t.shape[1]] = t[0]
        out["mm_token_type_ids"] = tt
    return out


def reflection_loss(language, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens (and the end token) of a :func:`reflection_inputs` batch."""
    return language(**batch).loss


def redo_after_reflect(out: Path) -> None:
    """A finished reflect stage given a larger budget: the transformer was trained on the old encoder's
    hidden states, so its stage starts again (moved aside, as a VAE continuation moves its followers)."""
    if (out / "dit").is_dir():
        move_aside(out, "dit")
        log.info("reflect: the dit stage will be redone")


def train_reflection(pipe, data: dict, args: argparse.Namespace, out: Path) -> None:
    """Stage ``reflect``: the whole VL model by teacher forcing (see the module docstring); frozen after."""
    import torch

    from pipelines.pretrain.dit import dit_lr
    from pipelines.pretrain.stage import Stage, run_stage

    language = pipe.text_encoder
    right, wrong = reflection_examples(data)
    params = [p for p in language.parameters()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=args.reflect_lr, weight_decay=0.0, betas=(0.9, 0.99))
    stage = Stage(out / "reflect", {"text_encoder": language}, params, optimizer, args.reflect_steps,
                  args.reflect_minutes, seed=args.seed, save_every=args.save_every,
                  on_continue=lambda: redo_after_reflect(out))
    captions = caption_examples(data)
    log.info("reflect: %d right, %d wrong and %d caption examples", len(right), len(wrong), len(captions))

    def draw(examples: list[dict], n: int) -> list[dict]:
        return [examples[i] for i in torch.randint(0, len(examples), (n,)).tolist()] if examples and n else []

    def loss(fraction: float) -> tuple[torch.Tensor, dict[str, float]]:
        n = torch.tensor(float(args.reflect_batch))
        n_caption = int(torch.binomial(n, torch.tensor(args.reflect_caption)))
        n_wrong = int(torch.binomial(n - n_caption, torch.tensor(args.reflect_wrong))) if wrong else 0
        batch = draw(captions, n_caption) + draw(wrong, n_wrong) + draw(right, args.reflect_batch - n_caption - n_wrong)
        return reflection_loss(language, reflection_inputs(pipe, data["pixels"], batch)), {"wrong": float(n_wrong),
                                                                                           "caption": float(n_caption)}

    language.train()
    run_stage(stage, loss, dit_lr(args.reflect_lr, min(args.warmup, 50)), resume=args.resume)
    language.eval().requires_grad_(False)


# ------------------------------------------------------------------ transformer stage


def text_conditioning(pipe, prompts: list[str], references: list) -> dict[str, torch.Tensor]:
    """The frozen VL encoder's reading of ``prompts`` with their reference pictures, through the pipeline's own
    prompt encoding, padding shared by every row dropped → ``encoder_hidden_states (B, L, D)`` and its mask
    (None when no row is padded), as the policy passes them."""
    import torch

    from pipelines._varlen import trim

    with torch.no_grad():
        embeds, mask = pipe._get_qwen_prompt_embeds(prompts, references, device=torch.device("cpu"))
    embeds, mask = trim(embeds, mask)
    return {"encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask}


def edit_velocity(transformer, x: torch.Tensor, reference: torch.Tensor, sigma: torch.Tensor,
                  cond: dict[str, torch.Tensor]) -> torch.Tensor:
    """The transformer's velocity ``(B, seq, 4·C)`` at packed noisy latents ``x`` with the reference latents
    ``(B, C, 1, h, w)`` packed after them (their own RoPE frame, their output dropped) and timestep σ ``(B,)``,
    as :meth:`pipelines.qwen_image.QwenImagePolicy._forward` calls it."""
    import torch

    from pipelines._common import pack_2x2

    h, w = reference.shape[-2:]
    shapes = [(1, h // 2, w // 2)] * 2
    v = transformer(hidden_states=torch.cat([x, pack_2x2(reference)], dim=1), timestep=sigma, guidance=None,
                    img_shapes=[shapes] * len(x), return_dict=False, **cond)[0]
    return v[:, : x.shape[1]]


def edit_flow_loss(transformer, target: torch.Tensor, reference: torch.Tensor, cond: dict[str, torch.Tensor]
                   ) -> torch.Tensor:
    """Rectified flow on target latents ``(B, C, 1, h, w)`` given the reference's (:func:`edit_velocity`):
    ``x_σ = (1 − σ)·x0 + σ·ε``, target ``ε − x0``, σ logit-normal(0, 1)."""
    import torch
    import torch.nn.functional as F

    from pipelines._common import pack_2x2

    sigma = torch.sigmoid(torch.randn(len(target)))
    eps = torch.randn(target.shape)
    s = sigma.view(-1, 1, 1, 1, 1)
    v = edit_velocity(transformer, pack_2x2((1 - s) * target + s * eps), reference, sigma, cond)
    return F.mse_loss(v.float(), pack_2x2(eps - target).float())


def draw_items(data: dict, kinds: list[str], scene_weights: torch.Tensor | None) -> list[tuple[int, int, str]]:
    """``(reference, target, text)`` image indices and text per kind: ``t2i`` a scene from the canvas under its
    prompt, ``revise`` a fixed scene from its wrong one under ``instruction(prompt, edit)``, ``keep`` a scene
    from itself under its prompt."""
    import torch

    from flowalign.reflection import instruction

    scenes, edits = data["scenes"], data["edits"]
    items = []
    for kind in kinds:
        if kind == "revise" and edits:
            e = edits[int(torch.randint(0, len(edits), (1,)))]
            items.append((e["source"], e["target"], instruction(e["prompt"], e["edit"])))
            continue
        i = int(torch.randint(0, len(scenes), (1,)) if scene_weights is None else torch.multinomial(scene_weights, 1))
        s = scenes[i]
        items.append((s["image"] if kind == "keep" else 0, s["image"], s["prompt"]))
    return items


def train_transformer(pipe, data: dict, x0: torch.Tensor, args: argparse.Namespace, out: Path):
    """Stage ``dit`` on the cached normalised latents ``x0 (M, C, 1, h, w)`` of ``data["pixels"]``; returns the
    transformer's EMA (what the export writes)."""
    import torch

    from flowalign.ema import EMA
    from pipelines.pretrain.data import level_sampling_weights, parse_mix
    from pipelines.pretrain.dit import dit_lr, dit_optimizer, named_trainable
    from pipelines.pretrain.stage import Stage, run_stage

    named = named_trainable(pipe, TRAINED)
    params = [p for _, p in named]
    for p in params:
        p.requires_grad_(True)
    ema = EMA(params, args.ema, warmup=True)
    stage = Stage(out / "dit", {"transformer": pipe.transformer}, params, dit_optimizer(named, args.lr, args.wd),
                  args.dit_steps, args.dit_minutes, seed=args.seed, save_every=args.save_every, ema=ema)
    share = parse_mix(args.dit_mix)
    names, weights = list(share), torch.tensor(list(share.values()), dtype=torch.float64)
    scene_weights = level_sampling_weights(data["levels"], args.dit_level_weights)
    negative = " "  # the policy's negative prompt: what a dropped text becomes, for true CFG

    def loss(fraction: float) -> tuple[torch.Tensor, dict[str, float]]:
        kinds = [names[int(k)] for k in torch.multinomial(weights, args.batch, True)]
        items = draw_items(data, kinds, scene_weights)
        ref, tgt = (torch.tensor([it[j] for it in items]) for j in (0, 1))
        texts = [t if random.random() >= args.drop else negative for _, _, t in items]
        cond = text_conditioning(pipe, texts, [picture(data["pixels"][int(r)]) for r in ref])
        return edit_flow_loss(pipe.transformer, x0[tgt], x0[ref], cond), {}

    pipe.transformer.train()
    run_stage(stage, loss, dit_lr(args.lr, args.warmup), resume=args.resume)
    pipe.transformer.eval().requires_grad_(False)
    return ema


def train(data: dict, args: argparse.Namespace, out: Path):
    """Every stage in order: VAE → latents → reflection writer → transformer → decoder → ``(pipe, ema, max_seq)``."""
    from pipelines.pretrain.autoencoder import encode_latents, finetune_decoder, train_vae

    pipe, max_seq = build(work_tokenizer(out, training_texts(data)), args)
    _, wrong = reflection_examples(data)
    longest = max([len(pipe.tokenizer(ex["answer"]).input_ids) for ex in wrong] + [len(pipe.tokenizer(NO_CHANGE).input_ids)])
    if longest + 1 > args.reflect_max_tokens:  # the learnt merges make every training word one token
        raise ValueError(f"an answer of {longest} tokens does not fit --reflect-max-tokens {args.reflect_max_tokens}")
    for name in COMPONENTS:
        log.info("  %-15s %8.3fM params", name, sum(p.numel() for p in getattr(pipe, name).parameters()) / 1e6)
    pipe.text_encoder.requires_grad_(False)
    pipe.transformer.requires_grad_(False)
    recipe_ = recipe(pipe.vae, args)
    train_vae(pipe.vae, data["pixels"], args, out, recipe_, on_continue=lambda: redo_after_vae(out))
    pipe.vae.requires_grad_(False)
    x0 = encode_latents(pipe.vae, data["pixels"], out, lambda z: set_latent_factors(pipe.vae, z))
    train_reflection(pipe, data, args, out)
    ema = train_transformer(pipe, data, x0, args, out)
    finetune_decoder(pipe.vae, data["pixels"], x0, args, out, recipe_)
    return pipe, ema, max_seq


# ------------------------------------------------------------------ export and evaluation


def sampling_defaults(args: argparse.Namespace, max_seq: int) -> dict:
    """``flowalign.json``: the condition area is the output's, one conditional pass per step (``--cfg``)."""
    from pipelines.tiny_twins.qwen_image import SAMPLING

    return {**SAMPLING, "family": NAME, "height": args.size, "width": args.size, "guidance_scale": args.cfg,
            "num_steps": args.sample_steps, "max_sequence_length": max_seq, "edit_image_area": args.size * args.size,
            "shift": 1.0}


def demo(folder: Path, data: dict, args: argparse.Namespace, out: Path) -> None:
    """``OUT/samples_train_prompts.png``: the exported model's first images (from the grey canvas) of
    ``--demo-n`` training prompts."""
    import pipelines
    from flowalign.evaluation import sample_seeded
    from pipelines.pretrain.export import save_sheet
    from pipelines.unified import unified

    prompts = [data["prompts"][i] for i in random.Random(12345).sample(range(len(data["prompts"])), args.demo_n)]
    png = out / "samples_train_prompts.png"
    save_sheet(sample_seeded(unified(pipelines.load(folder)), prompts, seed=0, progress=False), png)
    with atomic_path(png.with_suffix(".txt")) as tmp:
        tmp.write_text("\n".join(prompts) + "\n")


def reflection_rates(policy, right: list[dict], wrong: list[dict], pixels: torch.Tensor,
                     max_new_tokens: int = 8) -> dict[str, Any]:
    """How often greedy reflections (at most ``max_new_tokens``) stop the loop (:func:`flowalign.reflection.stopped`:
    they say :data:`NO_CHANGE`, or nothing) on ``right`` and on ``wrong`` examples, and how often a wrong image's
    reflection is exactly its instruction."""
    import torch

    from flowalign.reflection import stopped

    result: dict[str, Any] = {}
    for name, examples in (("correct", right), ("wrong", wrong)):
        if not examples:
            continue
        images = torch.stack([pixels[ex["image"]][:, 0].float() / 255 for ex in examples])
        tokens, _ = policy.generate(images, [ex["prompt"] for ex in examples], max_new_tokens, temperature=0)
        said = policy.decode_tokens(tokens)
        result[f"no_change_on_{name}"] = float(stopped(said, NO_CHANGE).float().mean())
        if name == "wrong":
            result["exact_fix_on_wrong"] = sum(s == ex["answer"] for s, ex in zip(said, examples)) / len(examples)
        result[f"examples_{name}"] = [f"{ex['prompt']} -> {s}" for ex, s in list(zip(examples, said))[:4]]
    return result


def evaluate(folder: Path, n: int, out: Path) -> dict:
    """First-image accuracy on ``vvr`` easy validation (``flowalign evaluate``'s code path on the unified policy,
    no reflection) and the reflection's "no change" rates on the same tasks' rendered scenes (correct) and their
    wrong variants (:func:`easy_variant`); the measured numbers go into the model card."""
    import time

    import torch

    import pipelines
    from flowalign.benchmarks import load_benchmark
    from flowalign.evaluation import evaluate as run_evaluation
    from pipelines.unified import unified
    from rewards.vvr import Task

    policy = unified(pipelines.load(folder))
    size = int(policy.editor.defaults["height"])
    split = load_benchmark(BENCH, "easy", n, split="validation")
    t0 = time.time()
    m = run_evaluation(policy, split.prompts, split.metadata, split.reward, seed=0, batch_size=16,
                       out_dir=out / "eval-easy", progress=False)
    results: dict[str, Any] = {"easy": {"n": m["n"], "accuracy": m.get("accuracy"), "mean_score": m["mean_score"],
                                        "seconds": round(time.time() - t0, 1)}}
    rng = random.Random(0)
    pixels, right, wrong = [], [], []
    for i, meta in enumerate(split.metadata):
        task = Task.from_dict(meta["task"])
        image = render(task, size)
        if passes(task, image):
            pixels.append(image)
            right.append({"image": len(pixels) - 1, "prompt": task.prompt, "answer": NO_CHANGE})
        scene, answer = easy_variant(task, i, rng)
        image = render(scene, size)
        if not passes(task, image):
            pixels.append(image)
            wrong.append({"image": len(pixels) - 1, "prompt": task.prompt, "answer": answer})
    results["reflection"] = reflection_rates(policy, right, wrong, torch.stack(pixels))
    results["settings"] = dict(policy.editor.defaults)
    results["params_m"] = {name: round(sum(p.numel() for p in getattr(policy.editor.pipe, name).parameters()) / 1e6, 2)
                           for name in COMPONENTS}
    log.info("eval: %s", results)
    write_card(folder, results)
    return results


#: the first line of a model card this family wrote (a card without it is someone's and is kept)
CARD_MARK = "<!-- model card written by flowalign pretrain-tiny qwen_image_edit -->"

CARD = CARD_MARK + """
# tiny-qwen-image-umm: a tiny unified model in Qwen-Image-Edit format

A Qwen-Image-Edit folder (`QwenImageEditPipeline`: `QwenImageTransformer2DModel`, `AutoencoderKLQwenImage`,
`Qwen2_5_VLForConditionalGeneration` with its `Qwen2VLProcessor`) trained on CPU as a *unified* model for
UMM-Reflection (`configs/tiny/umm_reflection_vvr.yaml`, `pipelines/unified.py`): its VL encoder looks at an image
with a `vvr` prompt and answers "no change" or a short fix ("make the blue circle red"); its transformer draws a
first image from a mid-grey canvas and revises an image with `prompt. fix` as the edit instruction.
{size} x {size} px. How it was made: `pipelines/pretrain/qwen_image_edit.py` (its docstring has the command).

## Measured (vvr easy validation, {n} tasks, flowalign.json defaults, noise seed 0)

| what | value |
|---|---:|
| first images (from the grey canvas, no reflection): all constraints pass | **{accuracy}** |
| reflection stops the loop ("no change" or nothing) on the rendered correct scenes | {no_change_on_correct} |
| reflection stops the loop on wrong scenes (recoloured object, empty canvas) | {no_change_on_wrong} |
| reflection on a wrong scene is exactly its fix | {exact_fix_on_wrong} |

Greedy reflections of at most 8 tokens (the recipe's `max_new_tokens`), e.g.:
{examples}

## Architecture

| component | class | size |
|---|---|---|
| transformer | `QwenImageTransformer2DModel`, 4 blocks, 4 heads x 32 | {transformer} M |
| vae | `AutoencoderKLQwenImage`, f2, 4 channels, per-channel latent mean / std | {vae} M |
| text_encoder | `Qwen2_5_VLForConditionalGeneration`: vision tower 2 x 64, language model 3 x 64 | {text_encoder} M |
| tokenizer | `Qwen2Tokenizer`, byte-level BPE learnt from the training texts (one token per word) | |
"""


def write_card(folder: Path, results: dict) -> None:
    """``folder/README.md`` from :data:`CARD` with ``results``; a card this family did not write is kept."""
    card = folder / "README.md"
    if card.is_file() and not card.read_text().startswith(CARD_MARK):
        log.info("model card %s kept (not written by this family); measured: %s", card, results)
        return
    reflection = results.get("reflection", {})

    def pct(value: Any) -> str:
        return "-" if value is None else f"{100 * value:.0f} %"

    examples = "\n".join(f"- `{e}`" for e in reflection.get("examples_correct", []) + reflection.get("examples_wrong", []))
    text = CARD.format(size=results["settings"]["height"], n=results["easy"]["n"], accuracy=pct(results["easy"]["accuracy"]),
                       no_change_on_correct=pct(reflection.get("no_change_on_correct")),
                       no_change_on_wrong=pct(reflection.get("no_change_on_wrong")),
                       exact_fix_on_wrong=pct(reflection.get("exact_fix_on_wrong")), examples=examples or "-",
                       **results.get("params_m", {name: "?" for name in COMPONENTS}))
    with atomic_path(card) as tmp:
        tmp.write_text(text)

