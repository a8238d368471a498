"""The authors' paper architecture (``grid_pool``, their ``zimage_latent_reward_grid_pool_nope_multihead``) on Z-Image.

Known answers: their Z-Image model (zimage_latent_reward_grid.py @ 4772ee6 on zimage_backbone.py @ c22b65e, the
frozen trunk under their latent-gradient mode) was run on a tiny seeded Z-Image transformer (6 main layers, one
refiner layer each) with every register/head parameter drawn from a seed in the sorted order of their parameter
names, on two captions of different lengths (5 and 37 tokens: 32 and 64 rows once rounded, so the batch padding
and its masks are exercised), at two settings: their preset's taps on this depth (1, 2, 3) and a deeper one
(separate text taps, the stream running to the last layer, the second readout run). Scores per head and
d score / d latent are in ``tests/flowalign/trainers/known_answers/lrr_grid_pool_zimage.json``. The same draw over
OUR parameter names gives their weights one to one, so equal scores and gradients check the architecture, and the
name check checks that their state dicts load.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml
from diffusers import FluxTransformer2DModel, ZImageTransformer2DModel

from flowalign.errors import UserError
from flowalign.protocols import Conditioning
from flowalign.sampling import load_latent_reward
from pipelines._varlen import unpad
from rewards.latent_registers.grid import GridReward, grid_registers
from rewards.latent_registers.zimage_grid import PAPER, ZImageGridRegisters, paper_options

from .authors_folders import train_grid_pool, write_register_folder
from .seeded_weights import seeded_fill

KNOWN = Path(__file__).parents[2] / "flowalign" / "trainers" / "known_answers" / "lrr_grid_pool_zimage.json"


@pytest.fixture(scope="module")
def known() -> dict:
    return json.loads(KNOWN.read_text())


@pytest.fixture(scope="module")
def transformer(known) -> ZImageTransformer2DModel:
    tr = ZImageTransformer2DModel(**known["transformer"])
    seeded_fill(tr.named_parameters(), known["seeds"]["transformer"])
    return tr.requires_grad_(False).eval()


def authors_weights(known: dict, transformer, entry: str = "paper") -> ZImageGridRegisters:
    r = known[entry]["register"]
    keys = ("feature_layers", "text_layers", "num_transformer_layers", "layer_index_base", "num_reward_tokens",
            "num_attn_heads", "pool_factor", "width", "head_hidden_factor", "skip_attn2", "use_self_attn", "use_proj_in")
    reward = ZImageGridRegisters(transformer, heads=r["head_names"], **{k: r[k] for k in keys})
    seeded_fill(reward.named_parameters(), known["seeds"]["register"])
    return reward


def inputs(known: dict):
    """``(x, σ, cond)``: the known answers' latents, captions padded with a mask as flowalign's Z-Image policy
    holds them."""
    i = known["inputs"]
    embeds = torch.tensor(i["prompt_embeds"])
    mask = torch.zeros(embeds.shape[:2], dtype=torch.long)
    for row, n in enumerate(i["caption_lengths"]):
        mask[row, :n] = 1
    cond = Conditioning({"prompt_embeds": embeds, "prompt_embeds_mask": mask}, ["a short prompt", "a longer prompt"])
    return torch.tensor(i["latents"]), torch.tensor(i["sigma"]), cond


def assert_equals_known(reward, known: dict, entry: str = "paper") -> None:
    x, sigma, cond = inputs(known)
    x = x.requires_grad_(True)
    scores = reward.score_heads(x, sigma, cond)
    want = known[entry]
    for head, values in want["scores"].items():
        torch.testing.assert_close(scores[head], torch.tensor(values), rtol=1e-5, atol=1e-6)
    for head, grad in want["grad"].items():
        g, = torch.autograd.grad(scores[head].sum(), x, retain_graph=True)
        assert g.abs().max() > 1e-3  # the latent path is live, not a detached trunk
        torch.testing.assert_close(g, torch.tensor(grad), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("entry", ["paper", "deep"])
def test_parameter_names_and_shapes_are_the_authors(known, transformer, entry):
    reward = authors_weights(known, transformer, entry)
    assert {k: list(v.shape) for k, v in reward.state_dict().items()} == known[entry]["state_dict_shapes"]
    assert sorted(n for n, _ in reward.named_parameters()) == known[entry]["trainable"]
    # the σ-embedding bridge: Z-Image's adaLN input (min(dim, 256) wide) to the transformer's width
    assert list(reward.temb_proj.weight.shape) == [32, 32]


@pytest.mark.parametrize("entry", ["paper", "deep"])
def test_scores_and_latent_gradient_equal_the_authors(known, transformer, entry):
    reward = authors_weights(known, transformer, entry)
    assert_equals_known(reward, known, entry)
    assert reward.score(*inputs(known)).shape == (2,)


def test_caption_lengths_and_sigma_are_read(known, transformer):
    """Each sample's caption is cut to its mask, and σ enters as t = 1 - σ: the full padded caption, or σ read as
    t, scores otherwise, so the known answer does not pass by accident."""
    x, sigma, cond = inputs(known)
    want = torch.tensor(known["paper"]["scores"]["preference"])
    reward = authors_weights(known, transformer)
    full = Conditioning({**cond.tensors, "prompt_embeds_mask": torch.ones_like(cond.tensors["prompt_embeds_mask"])},
                        cond.prompts)
    assert not torch.allclose(reward.score(x, sigma, full), want, rtol=1e-3)
    assert not torch.allclose(reward.score(x, 1 - sigma, cond), want, rtol=1e-3)
    # the longest caption alone scores as in the batch: the batch padding is masked out of the trunk's and the
    # registers' attention; a shorter one does not, as theirs: its text taps carry the batch's padding rows
    # (zeroed, but the head reads them unmasked)
    def alone(i):
        one = Conditioning({k: v[i: i + 1] for k, v in cond.tensors.items()}, cond.prompts[i: i + 1])
        return reward.score(x[i: i + 1], sigma[i: i + 1], one)

    torch.testing.assert_close(alone(1), want[1:], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(alone(0), want[:1], rtol=1e-3)


def test_generator_velocity_is_unchanged_by_the_register_path(known, transformer):
    x, sigma, cond = inputs(known)
    captions = unpad(cond.tensors["prompt_embeds"], cond.tensors["prompt_embeds_mask"])

    def velocity():
        return torch.stack(transformer(list(x.unsqueeze(2).unbind(0)), 1 - sigma, captions, return_dict=False)[0])

    before = velocity()
    reward = authors_weights(known, transformer, "deep")
    reward.score(x.clone().requires_grad_(True), sigma, cond).sum().backward()
    assert torch.equal(velocity(), before)
    assert not any(p.requires_grad for p in transformer.parameters())
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in transformer.layers)


def test_only_registers_and_heads_train(known, transformer):
    reward = authors_weights(known, transformer)
    x, sigma, cond = inputs(known)
    sum(s.sum() for s in reward.score_heads(x, sigma, cond).values()).backward()
    assert all(p.grad is None for p in transformer.parameters())
    trained = {n for n, p in reward.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert {"reward_tokens", "reward_q_proj.weight", "temb_proj.weight", "reward_head.query_proj.weight",
            "score_mlps.1.2.weight", "reward_head.layer_adapters_text.2.cond_mlp.2.weight"} <= trained
    assert not any(n.startswith("reward_head.attn2.") for n in trained)  # skipped, as in the preset


def test_save_load_round_trips(known, transformer, tmp_path):
    reward = authors_weights(known, transformer, "deep")
    reward.save(tmp_path / "r")
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["architecture"] == "grid_pool" and config["family"] == "zimage" and config["dim"] == 32
    again = load_latent_reward(tmp_path / "r", transformer=transformer)
    assert type(again) is ZImageGridRegisters and again.head_names == reward.head_names
    for k, v in reward.state_dict().items():
        assert torch.equal(again.state_dict()[k], v)
    assert_equals_known(again, known, "deep")
    flux = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
    with pytest.raises(UserError, match="of a 'zimage' transformer cannot read a 'flux' one") as err:
        load_latent_reward(tmp_path / "r", transformer=flux)
    assert "\n" not in str(err.value)


def write_authors_folder(folder: Path, known: dict, reward: ZImageGridRegisters, transformer, *,
                         manifest_over=None) -> Path:
    """Their ``save_register_checkpoint`` layout for Z-Image: the wrapper's state dict (``model.`` + the model's,
    frozen backbone included), ``config.yaml`` (their Z-Image paper config's sections) and ``manifest.json``."""
    r = known["paper"]["register"]
    register = {"head_names": r["head_names"], "score_keys": ["teacher_score_zscore", "imagereward_score"],
                "feature_layers": r["feature_layers"], "text_layers": r["text_layers"],
                "num_transformer_layers": r["num_transformer_layers"],
                "architecture": "zimage_latent_reward_grid_pool_nope_multihead", "head_hidden_factor": 2,
                "layer_index_base": 1, "num_reward_tokens": r["num_reward_tokens"], "num_attn_heads": 8,
                "pool_factor": 4, "vis_h": 8, "vis_w": 8, "width": -1, "dropout": 0.0, "use_proj_in": False,
                "use_self_attn": True, "noise_convention": "native_t_equals_one_minus_sigma"}
    backbone = {"name": "z-image", "model_name_or_path": "Tongyi-MAI/Z-Image-Turbo", "revision": "c8c84018e"}
    manifest = {"format_version": 1, "backbone": "z-image", "backbone_revision": "c8c84018e", "adapter": "register",
                "head_names": r["head_names"], "feature_layers": r["feature_layers"],
                "noise_convention": "native_t_equals_one_minus_sigma", "source_checkpoint": None,
                **(manifest_over or {})}
    config = {"task": "train-register", "backbone": backbone, "register": register, "train": {"learning_rate": 5e-5}}
    return write_register_folder(folder, reward, transformer, config, manifest)


def test_authors_folder_loads_on_a_local_base_model(known, transformer, tmp_path):
    folder = write_authors_folder(tmp_path / "theirs", known, authors_weights(known, transformer), transformer)
    base = tmp_path / "zimage"
    transformer.save_pretrained(str(base / "transformer"))
    with pytest.raises(UserError, match="zimage model"):
        load_latent_reward(folder)
    reward = load_latent_reward(folder, base_model=str(base))
    assert type(reward) is ZImageGridRegisters and reward.head_names == known["paper"]["register"]["head_names"]
    assert_equals_known(reward, known)
    # their manifest spelled "zimage" reads the same
    again = write_authors_folder(tmp_path / "theirs2", known, authors_weights(known, transformer), transformer,
                                 manifest_over={"backbone": "zimage"})
    assert_equals_known(load_latent_reward(again, base_model=str(base)), known)
    # or the base model named once, in a config.json beside their files
    (folder / "config.json").write_text(json.dumps({"class": "rewards.latent_registers:LatentRegisters",
                                                    "architecture": "grid_pool", "base_model": str(base)}))
    assert_equals_known(load_latent_reward(folder), known)
    assert GridReward.sizes(folder)["own"] == sum(p.numel() for p in reward.parameters())


def test_authors_folder_of_a_flux_architecture_under_a_zimage_manifest_fails_in_one_line(known, transformer, tmp_path):
    folder = write_authors_folder(tmp_path / "theirs", known, authors_weights(known, transformer), transformer)
    text = yaml.safe_load((folder / "config.yaml").read_text())
    text["register"]["architecture"] = "flux_latent_reward_grid_pool_nope_multihead"
    (folder / "config.yaml").write_text(yaml.safe_dump(text))
    with pytest.raises(UserError, match="with backbone 'zimage' only 'zimage_latent_reward_grid_pool_nope_multihead'") as err:
        load_latent_reward(folder, transformer=transformer)
    assert "\n" not in str(err.value)


def test_bad_input_fails_in_one_line(known, transformer):
    reward = authors_weights(known, transformer)
    x, sigma, cond = inputs(known)
    for bad, match in ((x.flatten(2), r"latents \(B, C, h, w\)"), (x[..., :15], "not divisible by the patch size"),
                       (x[..., :12, :12], "6x6 token grid is not divisible by pool_factor 4")):
        with pytest.raises(UserError, match=match) as err:
            reward.score(bad, sigma, cond)
        assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="Z-Image conditioning"):
        reward.score(x, sigma, Conditioning({"prompt_embeds": cond.tensors["prompt_embeds"]}))


def test_the_preset_scales_with_depth_and_is_the_authors_on_z_image_turbo(known, transformer):
    assert paper_options(30) == PAPER  # Z-Image-Turbo: 30 layers, taps 5, 10, 15
    assert paper_options(6)["feature_layers"] == [1, 2, 3] and paper_options(6)["num_transformer_layers"] == 3
    reward = grid_registers(transformer, num_reward_tokens=4, seed=3)
    assert type(reward) is ZImageGridRegisters and reward.head_names == ["preference", "imagereward"]
    assert reward.options["feature_layers"] == [1, 2, 3] and reward.stop == 3


def test_rg_opd_and_rgs_gradients_are_the_authors_score_and_grad(known, transformer):
    """What RG-OPD and RGS read (``reward_gradient``, ``head_gradients``) is their ``score_and_grad`` per head."""
    from flowalign.sampling.guidance import head_gradients, reward_gradient

    reward = authors_weights(known, transformer)
    x, sigma, cond = inputs(known)
    want = known["paper"]["grad"]
    grad, _ = reward_gradient(reward, x, sigma, cond)
    torch.testing.assert_close(grad, torch.tensor(want["preference"]), rtol=1e-5, atol=1e-6)
    grads, _ = head_gradients(reward, x, sigma, cond, ["imagereward"])
    torch.testing.assert_close(grads["imagereward"], torch.tensor(want["imagereward"]), rtol=1e-5, atol=1e-6)


def test_train_reward_builds_the_zimage_architecture_on_a_zimage_model(tiny_model_dir, tmp_path):
    """``train-reward --architecture grid_pool`` on a Z-Image model trains these registers (their preset scaled to
    the tiny model's 2 layers) and the folder loads back as them. The tiny model samples at 128 px here: its
    32-px default gives a 2 × 2 token grid, which the pool factor 4 does not divide."""
    import shutil

    model = tmp_path / "zimage"
    shutil.copytree(tiny_model_dir("zimage"), model)
    sizes = json.loads((model / "flowalign.json").read_text())
    (model / "flowalign.json").write_text(json.dumps({**sizes, "height": 128, "width": 128}))
    policy, config, out, prompts, chosen = train_grid_pool(model, tmp_path)
    assert config["family"] == "zimage" and config["feature_layers"] == [1] and config["num_reward_tokens"] == 4
    reward = load_latent_reward(out)
    assert type(reward) is ZImageGridRegisters and reward.head_names == ["reward"]
    assert reward.score(chosen[:2], torch.tensor([0.5, 0.5]), policy.encode(prompts[:2])).shape == (2,)
