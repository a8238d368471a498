"""The authors' paper architecture (``grid_pool``, their ``flux_latent_reward_grid_pool_nope_multihead``) on FLUX.

Known answers: their FLUX model (flux_latent_reward_grid.py @ 4c1ba48 on flux_backbone.py, the front-end under
their latent-gradient mode) was run on a tiny seeded FLUX transformer (2 double- and 4 single-stream blocks) with
every register/head parameter drawn from a seed in the sorted order of their parameter names, at two settings:
their preset's taps on this depth (1, 2: the last double block, 3: a single block) and a deeper one (a tap in the
single blocks, the stream running past it, the second readout run, another guidance value). Scores per head and
d score / d latent are in ``tests/flowalign/trainers/known_answers/lrr_grid_pool_flux.json`` (their latents
unpacked ``(B, C, h, w)``; flowalign's FLUX latents are the 2×2-packed tokens, a permutation of them). The same
draw over OUR parameter names gives their weights one to one, so equal scores and gradients check the
architecture, and the name check checks that their state dicts load.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

from flowalign.errors import UserError
from flowalign.protocols import Conditioning
from flowalign.sampling import load_latent_reward
from pipelines._common import latent_image_ids, pack_2x2
from rewards.latent_registers.flux_grid import PAPER, FluxGridRegisters, paper_options
from rewards.latent_registers.grid import GridReward, grid_registers

from .authors_folders import train_grid_pool, write_register_folder
from .seeded_weights import seeded_fill

KNOWN = Path(__file__).parents[2] / "flowalign" / "trainers" / "known_answers" / "lrr_grid_pool_flux.json"
#: the unpacked latent of the known answers: 4 channels, 16 × 16 (an 8 × 8 packed token grid)
LATENT_HW = [16, 16]


@pytest.fixture(scope="module")
def known() -> dict:
    return json.loads(KNOWN.read_text())


@pytest.fixture(scope="module")
def transformer(known) -> FluxTransformer2DModel:
    config = dict(known["transformer"], axes_dims_rope=tuple(known["transformer"]["axes_dims_rope"]))
    tr = FluxTransformer2DModel(**config)
    seeded_fill(tr.named_parameters(), known["seeds"]["transformer"])
    return tr.requires_grad_(False).eval()


def authors_weights(known: dict, transformer, entry: str = "paper") -> FluxGridRegisters:
    r = known[entry]["register"]
    keys = ("feature_layers", "text_layers", "num_transformer_layers", "layer_index_base", "num_reward_tokens",
            "num_attn_heads", "pool_factor", "width", "head_hidden_factor", "skip_attn2", "use_self_attn", "use_proj_in")
    reward = FluxGridRegisters(transformer, heads=r["head_names"], **{k: r[k] for k in keys},
                               family_options={"latent_hw": LATENT_HW, "guidance": r["guidance_scale"]})
    seeded_fill(reward.named_parameters(), known["seeds"]["register"])
    return reward


def inputs(known: dict):
    """``(x, σ, cond)``: the known answers' latents packed as flowalign's FLUX policy holds them."""
    i = known["inputs"]
    cond = Conditioning({"prompt_embeds": torch.tensor(i["prompt_embeds"]),
                         "pooled_prompt_embeds": torch.tensor(i["pooled_prompt_embeds"])})
    return pack_2x2(torch.tensor(i["latents"])), torch.tensor(i["sigma"]), cond


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
        torch.testing.assert_close(g, pack_2x2(torch.tensor(grad)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("entry", ["paper", "deep"])
def test_parameter_names_and_shapes_are_the_authors(known, transformer, entry):
    reward = authors_weights(known, transformer, entry)
    assert {k: list(v.shape) for k, v in reward.state_dict().items()} == known[entry]["state_dict_shapes"]
    assert sorted(n for n, _ in reward.named_parameters()) == known[entry]["trainable"]


@pytest.mark.parametrize("entry", ["paper", "deep"])
def test_scores_and_latent_gradient_equal_the_authors(known, transformer, entry):
    reward = authors_weights(known, transformer, entry)
    assert_equals_known(reward, known, entry)
    assert reward.score(*inputs(known)).shape == (2,)


def test_guidance_and_the_token_grid_are_read(known, transformer):
    """The guidance value reaches the embedding, and the pooled grid is the packed one (a transposed grid of the
    same token count pools other tokens), so neither known answer passes by accident."""
    x, sigma, cond = inputs(known)
    want = torch.tensor(known["paper"]["scores"]["preference"])
    reward = authors_weights(known, transformer)
    reward.inputs.guidance = 5.0
    assert not torch.allclose(reward.score(x, sigma, cond), want, rtol=1e-3)
    reward = authors_weights(known, transformer)
    reward.inputs.latent_hw = (8, 32)
    assert not torch.allclose(reward.score(x, sigma, cond), want, rtol=1e-3)


def test_generator_velocity_is_unchanged_by_the_register_path(known, transformer):
    x, sigma, cond = inputs(known)
    embeds = cond.tensors["prompt_embeds"]

    def velocity():
        return transformer(hidden_states=x, timestep=sigma, guidance=torch.full((2,), 3.5),
                           pooled_projections=cond.tensors["pooled_prompt_embeds"], encoder_hidden_states=embeds,
                           txt_ids=torch.zeros(embeds.shape[1], 3), img_ids=latent_image_ids(8, 8, "cpu", torch.float32),
                           return_dict=False)[0]

    before = velocity()
    reward = authors_weights(known, transformer)
    reward.score(x.clone().requires_grad_(True), sigma, cond).sum().backward()
    assert torch.equal(velocity(), before)
    assert not any(p.requires_grad for p in transformer.parameters())
    blocks = list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks)
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in blocks)


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
    assert config["architecture"] == "grid_pool" and config["family"] == "flux"
    assert config["latent_hw"] == LATENT_HW and config["guidance"] == 5.0
    again = load_latent_reward(tmp_path / "r", transformer=transformer)
    assert type(again) is FluxGridRegisters and again.head_names == reward.head_names
    for k, v in reward.state_dict().items():
        assert torch.equal(again.state_dict()[k], v)
    assert_equals_known(again, known, "deep")
    sd3 = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                caption_projection_dim=32, pooled_projection_dim=16, pos_embed_max_size=16)
    with pytest.raises(UserError, match="of a 'flux' transformer cannot read a 'sd3' one") as err:
        load_latent_reward(tmp_path / "r", transformer=sd3)
    assert "\n" not in str(err.value)


def write_authors_folder(folder: Path, known: dict, reward: FluxGridRegisters, transformer, *,
                         manifest_over=None) -> Path:
    """Their ``save_register_checkpoint`` layout for FLUX: the wrapper's state dict (``model.`` + the model's,
    frozen backbone included), ``config.yaml`` (their FLUX paper config's sections) and ``manifest.json``."""
    r = known["paper"]["register"]
    register = {"head_names": r["head_names"], "score_keys": ["teacher_score_zscore", "imagereward_score"],
                "feature_layers": r["feature_layers"], "text_layers": r["text_layers"],
                "num_transformer_layers": r["num_transformer_layers"],
                "architecture": "flux_latent_reward_grid_pool_nope_multihead", "head_hidden_factor": 2,
                "layer_index_base": 1, "num_reward_tokens": r["num_reward_tokens"], "num_attn_heads": 8,
                "pool_factor": 4, "vis_h": LATENT_HW[0] // 2, "vis_w": LATENT_HW[1] // 2, "width": -1,
                "dropout": 0.0, "use_proj_in": False, "use_self_attn": True}
    backbone = {"name": "flux", "model_name_or_path": "black-forest-labs/FLUX.1-dev", "revision": "c8c84018e",
                "embedded_guidance_scale": 3.5}
    manifest = {"format_version": 1, "backbone": "flux", "backbone_revision": "c8c84018e", "adapter": "register",
                "head_names": r["head_names"], "feature_layers": r["feature_layers"],
                "noise_convention": "timestep = 1000 sigma", "source_checkpoint": None, **(manifest_over or {})}
    config = {"task": "train-register", "backbone": backbone, "register": register, "train": {"learning_rate": 5e-5}}
    return write_register_folder(folder, reward, transformer, config, manifest)


def test_authors_folder_loads_on_a_local_base_model(known, transformer, tmp_path):
    folder = write_authors_folder(tmp_path / "theirs", known, authors_weights(known, transformer), transformer)
    base = tmp_path / "flux"
    transformer.save_pretrained(str(base / "transformer"))
    with pytest.raises(UserError, match="FluxTransformer2DModel|flux model"):
        load_latent_reward(folder)
    reward = load_latent_reward(folder, base_model=str(base))
    assert type(reward) is FluxGridRegisters and reward.head_names == known["paper"]["register"]["head_names"]
    assert reward.inputs.latent_hw == tuple(LATENT_HW) and reward.inputs.guidance == 3.5  # vis_h/vis_w, their 3.5
    assert_equals_known(reward, known)
    # or named once, in a config.json beside their files: then any load_latent_reward(DIR) caller reads it
    (folder / "config.json").write_text(json.dumps({"class": "rewards.latent_registers:LatentRegisters",
                                                    "architecture": "grid_pool", "base_model": str(base)}))
    assert_equals_known(load_latent_reward(folder), known)
    assert GridReward.sizes(folder)["own"] == sum(p.numel() for p in reward.parameters())


def test_authors_folder_of_an_sd3_architecture_under_a_flux_manifest_fails_in_one_line(known, transformer, tmp_path):
    folder = write_authors_folder(tmp_path / "theirs", known, authors_weights(known, transformer), transformer)
    text = yaml.safe_load((folder / "config.yaml").read_text())
    text["register"]["architecture"] = "latent_reward_grid_pool_nope_multihead"
    (folder / "config.yaml").write_text(yaml.safe_dump(text))
    with pytest.raises(UserError, match="with backbone 'flux' only 'flux_latent_reward_grid_pool_nope_multihead'") as err:
        load_latent_reward(folder, transformer=transformer)
    assert "\n" not in str(err.value)


def test_bad_input_fails_in_one_line(known, transformer):
    reward = authors_weights(known, transformer)
    x, sigma, cond = inputs(known)
    for bad, match in ((x.reshape(2, 16, 8, 8), "packed latents"), (x[:, :-4], "latent_hw"),
                       (pack_2x2(torch.randn(2, 4, 12, 12)), None)):
        if match is None:  # a 6 x 6 grid (latent_hw 12 x 12): not divisible by the pool factor
            reward.inputs.latent_hw = (12, 12)
            match = "6x6 token grid is not divisible by pool_factor 4"
        with pytest.raises(UserError, match=match) as err:
            reward.score(bad, sigma, cond)
        assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="FLUX conditioning"):
        reward.score(x, sigma, Conditioning({"prompt_embeds": cond.tensors["prompt_embeds"]}))


def test_the_preset_scales_with_depth_and_is_the_authors_on_flux_dev(known, transformer):
    assert paper_options(57) == PAPER  # FLUX.1-dev: 19 double + 38 single blocks, taps 9, 19, 28
    assert paper_options(6)["feature_layers"] == [1, 2, 3] and paper_options(6)["num_transformer_layers"] == 3
    reward = grid_registers(transformer, num_reward_tokens=4, seed=3)
    assert type(reward) is FluxGridRegisters and reward.head_names == ["preference", "imagereward"]
    assert reward.options["feature_layers"] == [1, 2, 3] and reward.stop == 3


def test_rg_opd_and_rgs_gradients_are_the_authors_score_and_grad(known, transformer):
    """What RG-OPD and RGS read (``reward_gradient``, ``head_gradients``) is their ``score_and_grad`` per head."""
    from flowalign.sampling.guidance import head_gradients, reward_gradient

    reward = authors_weights(known, transformer)
    x, sigma, cond = inputs(known)
    want = known["paper"]["grad"]
    grad, _ = reward_gradient(reward, x, sigma, cond)
    torch.testing.assert_close(grad, pack_2x2(torch.tensor(want["preference"])), rtol=1e-5, atol=1e-6)
    grads, _ = head_gradients(reward, x, sigma, cond, ["imagereward"])
    torch.testing.assert_close(grads["imagereward"], pack_2x2(torch.tensor(want["imagereward"])), rtol=1e-5, atol=1e-6)


def test_train_reward_builds_the_flux_architecture_on_a_flux_model(tiny_model_dir, tmp_path):
    """``train-reward --architecture grid_pool`` on a FLUX model trains these registers (their preset scaled to the
    tiny model's 2 blocks, the policy's latent grid and guidance) and the folder loads back as them."""
    model = tiny_model_dir("flux")
    policy, config, out, prompts, chosen = train_grid_pool(model, tmp_path)
    assert config["family"] == "flux" and config["feature_layers"] == [1] and config["num_reward_tokens"] == 4
    assert config["latent_hw"] == list(policy.latent_hw) and config["guidance"] == policy.defaults["guidance_scale"]
    reward = load_latent_reward(out)
    assert type(reward) is FluxGridRegisters and reward.head_names == ["reward"]
    assert reward.score(chosen[:2], torch.tensor([0.5, 0.5]), policy.encode(prompts[:2])).shape == (2,)
