"""The authors' paper architecture (``grid_pool``) as each family's known answers describe it: the tiny seeded
transformer their model was run on, our registers holding their weights, their inputs in flowalign's convention
for the family, the generator's own velocity, and their checkpoint folder written from our model. The grid-pool
tests check one property on every family through a :class:`Family`.

How the known answers were made, for every family: the authors' model was run on a tiny seeded transformer with
every register/head parameter drawn from a seed in the sorted order of their parameter names
(:func:`~.seeded_weights.seeded_fill`); the scores per head and d score / d latent are in
``tests/flowalign/trainers/known_answers/lrr_grid_pool*.json``. The same draw over OUR parameter names reproduces
their weights one to one (the names are theirs), so equal scores and gradients check the architecture, and the
name check checks that their state dicts load.
"""

from __future__ import annotations

import json
import shutil
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, ZImageTransformer2DModel

from flowalign.protocols import Conditioning
from pipelines._common import latent_image_ids, pack_2x2
from pipelines._varlen import unpad
from rewards.latent_registers import flux_grid, sd3_grid, zimage_grid
from rewards.latent_registers.grid import GridReward

from .authors_folders import write_register_folder
from .seeded_weights import seeded_fill

KNOWN_ANSWERS = Path(__file__).parents[2] / "flowalign" / "trainers" / "known_answers"
#: the message of a latent whose token grid the pool factor 4 cannot cut
GRID_6X6 = "6x6 token grid is not divisible by pool_factor 4"
#: the register options every family's known answers name
REGISTER_KEYS = ("feature_layers", "text_layers", "num_transformer_layers", "layer_index_base", "num_reward_tokens",
                 "num_attn_heads", "pool_factor", "width", "head_hidden_factor", "skip_attn2", "use_self_attn")


class Family:
    """One family's side of the known answers; a subclass says what differs."""

    name = ""
    known_file = ""
    reward_class: type[GridReward] = GridReward
    transformer_class: type[torch.nn.Module] = torch.nn.Module
    #: the authors' preset and the depth of the model it is theirs on
    paper: dict[str, Any] = {}
    full_depth = 0
    #: the known answers' register settings, the one the single-setting checks use, and those with a shape list
    entries: tuple[str, ...] = ("paper", "deep")
    default_entry = "paper"
    shape_entries: tuple[str, ...] = ("paper", "deep")
    #: parameters of each kind (register, query, head, a score MLP, a text adapter) the default setting trains
    trained: frozenset[str] = frozenset()
    #: their checkpoint folder: ``register.architecture``, the register fields only this family's config has, its
    #: other config sections, and the manifest's ``backbone`` and ``noise_convention``
    authors_architecture = ""
    authors_register: dict[str, Any] = {}
    authors_sections: dict[str, Any] = {}
    authors_backbone, authors_noise_convention = "", "timestep = 1000 sigma"
    #: ``register.architecture`` of another model, which their folder of this family must refuse
    wrong_architecture = ""
    #: the family's name in the message of a conditioning that lacks a key
    conditioning_name = ""
    #: a family whose transformer a saved reward of this one must refuse
    refused_family = ""
    #: latents the reward refuses in one line: case → (bad latents of the known ones, message), each on fresh weights
    bad_latents: dict[str, tuple[Callable[[GridReward, torch.Tensor], torch.Tensor], str]] = {}

    def __repr__(self) -> str:
        return self.name

    @cached_property
    def known(self) -> dict[str, Any]:
        return json.loads((KNOWN_ANSWERS / self.known_file).read_text())

    def build_transformer(self, **over: Any) -> torch.nn.Module:
        """A transformer of the known answers' config (``over`` changed), default weights."""
        return self.transformer_class(**{**self.known["transformer"], **over})

    @cached_property
    def transformer(self) -> torch.nn.Module:
        """The known answers' transformer with their seeded weights, frozen."""
        tr = self.build_transformer()
        seeded_fill(tr.named_parameters(), self.known["seeds"]["transformer"])
        return tr.requires_grad_(False).eval()

    def register(self, entry: str | None = None) -> dict[str, Any]:
        return self.known[entry or self.default_entry]["register"]

    def answers(self, entry: str | None = None) -> dict[str, Any]:
        """``scores`` and ``grad`` per head of the setting ``entry``."""
        return self.known[entry or self.default_entry]

    def shapes(self, entry: str) -> tuple[dict[str, list[int]], list[str]]:
        """The authors' state-dict shapes and sorted trainable names at ``entry``."""
        return self.known[entry]["state_dict_shapes"], self.known[entry]["trainable"]

    def family_options(self, entry: str | None = None) -> dict[str, Any]:
        """The family's own options (``family_options``) of the setting ``entry``."""
        return {}

    def authors_weights(self, entry: str | None = None) -> GridReward:
        """Our registers at setting ``entry`` with the authors' (seeded) weights."""
        r = self.register(entry)
        reward = self.reward_class(self.transformer, heads=r["head_names"], **{k: r[k] for k in REGISTER_KEYS},
                                   **{k: r[k] for k in ("use_proj_in",) if k in r},
                                   family_options=self.family_options(entry))
        seeded_fill(reward.named_parameters(), self.known["seeds"]["register"])
        return reward

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, Conditioning]:
        """``(x, σ, cond)``: the known answers' inputs as flowalign's policy of the family holds them."""
        i = self.known["inputs"]
        cond = Conditioning({"prompt_embeds": torch.tensor(i["prompt_embeds"]),
                             "pooled_prompt_embeds": torch.tensor(i["pooled_prompt_embeds"])})
        return self.as_latent(torch.tensor(i["latents"])), torch.tensor(i["sigma"]), cond

    def as_latent(self, z: torch.Tensor) -> torch.Tensor:
        """The known answers' ``(B, C, h, w)`` latent (or gradient) in flowalign's latent layout."""
        return z

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The generator's velocity at ``x``, by the transformer's own forward."""
        raise NotImplementedError

    def blocks(self) -> list[torch.nn.Module]:
        return self.reward_class.blocks_of(self.transformer)

    def saved_options(self, entry: str) -> dict[str, Any]:
        """The family's own options a save at ``entry`` writes in config.json: those it was built with."""
        return self.family_options(entry)

    def authors_files(self, register_over: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Their ``config.yaml`` and ``manifest.json`` for the default setting (``register_over`` in its register)."""
        r = self.register()
        register = {"head_names": r["head_names"], "feature_layers": r["feature_layers"],
                    "text_layers": r["text_layers"], "num_transformer_layers": r["num_transformer_layers"],
                    "architecture": self.authors_architecture, "head_hidden_factor": 2, "layer_index_base": 1,
                    "num_reward_tokens": r["num_reward_tokens"], "num_attn_heads": 8, "pool_factor": 4, "width": -1,
                    "dropout": 0.0, "use_proj_in": False, "use_self_attn": True, **self.authors_register,
                    **register_over}
        config = {**self.authors_sections, "register": register, "train": {"learning_rate": 5e-5}}
        manifest = {"format_version": 1, "backbone": self.authors_backbone, "backbone_revision": "c8c84018e",
                    "adapter": "register", "head_names": r["head_names"], "feature_layers": r["feature_layers"],
                    "noise_convention": self.authors_noise_convention, "source_checkpoint": None}
        return config, manifest

    def write_authors_folder(self, folder: Path, *, manifest_over: dict[str, Any] | None = None,
                             register_over: dict[str, Any] | None = None) -> Path:
        """Their ``save_register_checkpoint`` layout of the default setting with the authors' weights."""
        config, manifest = self.authors_files(register_over or {})
        return write_register_folder(folder, self.authors_weights(), self.transformer, config,
                                     {**manifest, **(manifest_over or {})})

    def train_model(self, tiny_model_dir: Callable[..., Path], tmp_path: Path) -> Path:
        """The tiny model of the family that ``train-reward --architecture grid_pool`` runs on."""
        return tiny_model_dir(self.name)

    def policy_options(self, policy: Any) -> dict[str, Any]:
        """The family's own options a reward trained on ``policy`` must write in config.json."""
        return {}


def assert_equals_known(reward: GridReward, family: Family, entry: str | None = None) -> None:
    """Every head's scores and the known heads' d score / d latent are the authors' at ``entry``."""
    x, sigma, cond = family.inputs()
    x = x.requires_grad_(True)
    scores = reward.score_heads(x, sigma, cond)
    want = family.answers(entry)
    for head, values in want["scores"].items():
        torch.testing.assert_close(scores[head], torch.tensor(values), rtol=1e-5, atol=1e-6)
    for head, grad in want["grad"].items():
        g, = torch.autograd.grad(scores[head].sum(), x, retain_graph=True)
        assert g.abs().max() > 1e-3  # the latent path is live, not a detached trunk
        torch.testing.assert_close(g, family.as_latent(torch.tensor(grad)), rtol=1e-5, atol=1e-6)


class Sd3Family(Family):
    """Their ``latent_reward_grid_pool_nope_multihead`` (latent_reward_grid.py @ 4c1ba48) on a tiny SD3, at their
    preset's settings with the second readout skipped (``skip_attn2``) and run (``with_attn2``)."""

    name = "sd3"
    known_file = "lrr_grid_pool.json"
    reward_class = sd3_grid.GridRegisters
    transformer_class = SD3Transformer2DModel
    paper, full_depth = sd3_grid.PAPER, 24  # SD3-Medium: 24 blocks
    entries = ("skip_attn2", "with_attn2")
    default_entry = "skip_attn2"
    shape_entries = ("skip_attn2",)  # their shape list is of the preset's setting only
    trained = frozenset({"reward_tokens", "reward_q_proj.weight", "reward_head.query_proj.weight",
                         "score_mlps.2.2.weight", "reward_head.layer_adapters_text.0.cond_mlp.2.weight"})
    authors_architecture = "latent_reward_grid_pool_nope_multihead"
    authors_register = {"skip_attn2": True, "vis_h": 64, "vis_w": 64}
    authors_backbone = "sd3"
    wrong_architecture = "latent_reward_grid_mlp"
    conditioning_name = "SD3"
    refused_family = "flux"
    bad_latents = {"6x6 token grid": (lambda reward, x: torch.randn(2, 4, 12, 12), GRID_6X6)}

    def register(self, entry: str | None = None) -> dict[str, Any]:
        # one register config; the two settings differ only in skipping the second readout
        return {**self.known["register"], "skip_attn2": (entry or self.default_entry) == "skip_attn2"}

    def shapes(self, entry: str) -> tuple[dict[str, list[int]], list[str]]:
        return self.known["state_dict_shapes"], self.known["trainable"]

    def velocity(self, x, sigma, cond):
        return self.transformer(hidden_states=x, timestep=sigma * 1000,
                                encoder_hidden_states=cond.tensors["prompt_embeds"],
                                pooled_projections=cond.tensors["pooled_prompt_embeds"], return_dict=False)[0]


#: FLUX's unpacked known latent: 4 channels, 16 × 16 (an 8 × 8 packed token grid)
FLUX_LATENT_HW = [16, 16]


def _flux_grid_6x6(reward: GridReward, x: torch.Tensor) -> torch.Tensor:
    # a 6 × 6 packed grid: the reward told so by latent_hw 12 × 12
    reward.inputs.latent_hw = (12, 12)
    return pack_2x2(torch.randn(2, 4, 12, 12))


class FluxFamily(Family):
    """Their ``flux_latent_reward_grid_pool_nope_multihead`` (flux_latent_reward_grid.py @ 4c1ba48 on
    flux_backbone.py, the front-end under their latent-gradient mode) on a tiny FLUX (2 double- and 4 single-stream
    blocks), at their preset's taps on this depth (``paper``: 1, 2: the last double block, 3: a single block) and a
    deeper one (``deep``: a tap in the single blocks, the stream running past it, the second readout run, another
    guidance value). Their latents are unpacked ``(B, C, h, w)``; flowalign's FLUX latents are the 2×2-packed tokens,
    a permutation of them."""

    name = "flux"
    known_file = "lrr_grid_pool_flux.json"
    reward_class = flux_grid.FluxGridRegisters
    transformer_class = FluxTransformer2DModel
    paper, full_depth = flux_grid.PAPER, 57  # FLUX.1-dev: 19 double + 38 single blocks, taps 9, 19, 28
    trained = frozenset({"reward_tokens", "reward_q_proj.weight", "temb_proj.weight", "reward_head.query_proj.weight",
                         "score_mlps.1.2.weight", "reward_head.layer_adapters_text.2.cond_mlp.2.weight"})
    authors_architecture = "flux_latent_reward_grid_pool_nope_multihead"
    authors_register = {"score_keys": ["teacher_score_zscore", "imagereward_score"],
                        "vis_h": FLUX_LATENT_HW[0] // 2, "vis_w": FLUX_LATENT_HW[1] // 2}
    authors_sections = {"task": "train-register",
                        "backbone": {"name": "flux", "model_name_or_path": "black-forest-labs/FLUX.1-dev",
                                     "revision": "c8c84018e", "embedded_guidance_scale": 3.5}}
    authors_backbone = "flux"
    wrong_architecture = Sd3Family.authors_architecture
    conditioning_name = "FLUX"
    refused_family = "sd3"
    bad_latents = {"unpacked": (lambda reward, x: x.reshape(2, 16, 8, 8), "packed latents"),
                   "fewer tokens than latent_hw": (lambda reward, x: x[:, :-4], "latent_hw"),
                   "6x6 token grid": (_flux_grid_6x6, GRID_6X6)}

    def build_transformer(self, **over):
        config = dict(self.known["transformer"], axes_dims_rope=tuple(self.known["transformer"]["axes_dims_rope"]))
        return FluxTransformer2DModel(**{**config, **over})

    def family_options(self, entry=None):
        return {"latent_hw": FLUX_LATENT_HW, "guidance": self.register(entry)["guidance_scale"]}

    def as_latent(self, z):
        return pack_2x2(z)

    def velocity(self, x, sigma, cond):
        embeds = cond.tensors["prompt_embeds"]
        return self.transformer(hidden_states=x, timestep=sigma, guidance=torch.full((2,), 3.5),
                                pooled_projections=cond.tensors["pooled_prompt_embeds"], encoder_hidden_states=embeds,
                                txt_ids=torch.zeros(embeds.shape[1], 3),
                                img_ids=latent_image_ids(8, 8, "cpu", torch.float32), return_dict=False)[0]

    def policy_options(self, policy):
        # scored as the policy samples: its latent grid and guidance
        return {"latent_hw": list(policy.latent_hw), "guidance": policy.defaults["guidance_scale"]}


class ZImageFamily(Family):
    """Their ``zimage_latent_reward_grid_pool_nope_multihead`` (zimage_latent_reward_grid.py @ 4772ee6 on
    zimage_backbone.py @ c22b65e, the frozen trunk under their latent-gradient mode) on a tiny Z-Image (6 main
    layers, one refiner layer each), on two captions of different lengths (5 and 37 tokens: 32 and 64 rows once
    rounded, so the batch padding and its masks are exercised), at their preset's taps on this depth (``paper``:
    1, 2, 3) and a deeper one (``deep``: separate text taps, the stream running to the last layer, the second
    readout run)."""

    name = "zimage"
    known_file = "lrr_grid_pool_zimage.json"
    reward_class = zimage_grid.ZImageGridRegisters
    transformer_class = ZImageTransformer2DModel
    paper, full_depth = zimage_grid.PAPER, 30  # Z-Image-Turbo: 30 layers, taps 5, 10, 15
    trained = FluxFamily.trained
    authors_architecture = "zimage_latent_reward_grid_pool_nope_multihead"
    authors_register = {"score_keys": ["teacher_score_zscore", "imagereward_score"], "vis_h": 8, "vis_w": 8,
                        "noise_convention": "native_t_equals_one_minus_sigma"}
    authors_sections = {"task": "train-register",
                        "backbone": {"name": "z-image", "model_name_or_path": "Tongyi-MAI/Z-Image-Turbo",
                                     "revision": "c8c84018e"}}
    authors_backbone, authors_noise_convention = "z-image", "native_t_equals_one_minus_sigma"
    wrong_architecture = FluxFamily.authors_architecture
    conditioning_name = "Z-Image"
    refused_family = "flux"
    bad_latents = {"flat": (lambda reward, x: x.flatten(2), r"latents \(B, C, h, w\)"),
                   "odd width": (lambda reward, x: x[..., :15], "not divisible by the patch size"),
                   "6x6 token grid": (lambda reward, x: x[..., :12, :12], GRID_6X6)}

    def inputs(self):
        """The captions padded with a mask, as flowalign's Z-Image policy holds them."""
        i = self.known["inputs"]
        embeds = torch.tensor(i["prompt_embeds"])
        mask = torch.zeros(embeds.shape[:2], dtype=torch.long)
        for row, n in enumerate(i["caption_lengths"]):
            mask[row, :n] = 1
        cond = Conditioning({"prompt_embeds": embeds, "prompt_embeds_mask": mask},
                            ["a short prompt", "a longer prompt"])
        return torch.tensor(i["latents"]), torch.tensor(i["sigma"]), cond

    def velocity(self, x, sigma, cond):
        captions = unpad(cond.tensors["prompt_embeds"], cond.tensors["prompt_embeds_mask"])
        return torch.stack(self.transformer(list(x.unsqueeze(2).unbind(0)), 1 - sigma, captions,
                                            return_dict=False)[0])

    def train_model(self, tiny_model_dir, tmp_path):
        # sampled at 128 px: the tiny model's 32-px default gives a 2 × 2 token grid, which the pool factor 4
        # does not divide
        model = tmp_path / "zimage"
        shutil.copytree(tiny_model_dir("zimage"), model)
        sizes = json.loads((model / "flowalign.json").read_text())
        (model / "flowalign.json").write_text(json.dumps({**sizes, "height": 128, "width": 128}))
        return model


SD3, FLUX, ZIMAGE = Sd3Family(), FluxFamily(), ZImageFamily()
FAMILIES = {f.name: f for f in (SD3, FLUX, ZIMAGE)}
