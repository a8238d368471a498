"""The authors' paper architecture (``grid_pool``) against their known answers, each property on every family
(SD3, FLUX, Z-Image; :mod:`.grid_pool_families` says how the answers were made): parameter names and shapes,
scores and d score / d latent, the generator left untouched, what trains, our files and theirs, the inputs it
refuses, the preset and the guidance gradients. Then what only SD3's folders are checked for. What only FLUX or
Z-Image reads is in ``test_registers_grid_pool_flux.py`` and ``test_registers_grid_pool_zimage.py``.
"""

import json

import pytest
import torch

from flowalign.errors import UserError
from flowalign.paths import REPO_ROOT
from flowalign.protocols import Conditioning
from flowalign.sampling import load_latent_reward
from rewards.latent_registers import LatentRegisters
from rewards.latent_registers.grid import GridReward, from_authors_state, grid_registers

from .authors_folders import train_grid_pool
from .grid_pool_families import FAMILIES, FLUX, SD3, ZIMAGE, assert_equals_known

by_family = pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILIES.keys())


def settings(entries_of):
    """``(family, entry)`` cases, one per setting ``entries_of(family)`` names, with ids ``family-entry``."""
    return [pytest.param(f, e, id=f"{f.name}-{e}") for f in FAMILIES.values() for e in entries_of(f)]


@pytest.mark.parametrize("family, entry", settings(lambda f: f.shape_entries))
def test_parameter_names_and_shapes_are_the_authors(family, entry):
    reward = family.authors_weights(entry)
    shapes, trainable = family.shapes(entry)
    assert {k: list(v.shape) for k, v in reward.state_dict().items()} == shapes
    assert sorted(n for n, _ in reward.named_parameters()) == trainable


@pytest.mark.parametrize("family, entry", settings(lambda f: f.entries))
def test_scores_and_latent_gradient_equal_the_authors(family, entry):
    reward = family.authors_weights(entry)
    assert_equals_known(reward, family, entry)
    assert reward.score(*family.inputs()).shape == (2,)


@pytest.mark.parametrize("family, entry", settings(lambda f: f.entries))
def test_generator_velocity_is_unchanged_by_the_register_path(family, entry):
    x, sigma, cond = family.inputs()
    before = family.velocity(x, sigma, cond)
    reward = family.authors_weights(entry)
    reward.score(x.clone().requires_grad_(True), sigma, cond).sum().backward()
    assert torch.equal(family.velocity(x, sigma, cond), before)
    assert not any(p.requires_grad for p in family.transformer.parameters())
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in family.blocks())


@by_family
def test_only_registers_and_heads_train(family):
    reward = family.authors_weights()
    x, sigma, cond = family.inputs()
    sum(s.sum() for s in reward.score_heads(x, sigma, cond).values()).backward()
    assert all(p.grad is None for p in family.transformer.parameters())
    trained = {n for n, p in reward.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert family.trained <= trained
    assert not any(n.startswith("reward_head.attn2.") for n in trained)  # skipped, as in the preset


@pytest.mark.parametrize("family, entry", settings(lambda f: f.entries))
def test_save_load_round_trips(family, entry, tmp_path):
    reward = family.authors_weights(entry)
    reward.save(tmp_path / "r")
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["architecture"] == "grid_pool" and config["class"] == "rewards.latent_registers:LatentRegisters"
    assert config["family"] == family.name and config["dim"] == 32  # every known transformer is 32 wide
    assert {k: config[k] for k in family.saved_options(entry)} == family.saved_options(entry)
    again = load_latent_reward(tmp_path / "r", transformer=family.transformer)
    assert type(again) is family.reward_class and again.head_names == reward.head_names
    for k, v in reward.state_dict().items():
        assert torch.equal(again.state_dict()[k], v)
    assert_equals_known(again, family, entry)


@by_family
def test_a_saved_reward_refuses_another_familys_transformer_in_one_line(family, tmp_path):
    family.authors_weights().save(tmp_path / "r")
    other = FAMILIES[family.refused_family]
    with pytest.raises(UserError, match=f"of a '{family.name}' transformer cannot read a '{other.name}' one") as err:
        load_latent_reward(tmp_path / "r", transformer=other.transformer)
    assert "\n" not in str(err.value)


@by_family
def test_authors_folder_loads_on_a_local_base_model(family, tmp_path):
    folder = family.write_authors_folder(tmp_path / "theirs")
    base = tmp_path / family.name
    family.transformer.save_pretrained(str(base / "transformer"))
    with pytest.raises(UserError, match=f"their {family.name} model .*base_model"):
        load_latent_reward(folder)
    reward = load_latent_reward(folder, base_model=str(base))
    assert type(reward) is family.reward_class and reward.head_names == family.register()["head_names"]
    assert_equals_known(reward, family)
    # or named once, in a config.json beside their files: then any load_latent_reward(DIR) caller reads it
    (folder / "config.json").write_text(json.dumps({"class": "rewards.latent_registers:LatentRegisters",
                                                    "architecture": "grid_pool", "base_model": str(base)}))
    assert_equals_known(load_latent_reward(folder), family)
    assert GridReward.sizes(folder)["own"] == sum(p.numel() for p in reward.parameters())


@by_family
def test_authors_folder_of_another_architecture_fails_in_one_line(family, tmp_path):
    folder = family.write_authors_folder(tmp_path / "theirs", register_over={"architecture": family.wrong_architecture})
    with pytest.raises(UserError, match=f"register.architecture '{family.wrong_architecture}'; with backbone "
                                        f"'{family.name}' only '{family.authors_architecture}'") as err:
        load_latent_reward(folder, transformer=family.transformer)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family, case", settings(lambda f: f.bad_latents))
def test_latents_the_family_cannot_read_fail_in_one_line(family, case):
    reward = family.authors_weights()
    x, sigma, cond = family.inputs()
    make, match = family.bad_latents[case]
    with pytest.raises(UserError, match=match) as err:
        reward.score(make(reward, x), sigma, cond)
    assert "\n" not in str(err.value)


@by_family
def test_incomplete_conditioning_fails_in_one_line(family):
    reward = family.authors_weights()
    x, sigma, cond = family.inputs()
    with pytest.raises(UserError, match=f"{family.conditioning_name} conditioning") as err:
        reward.score(x, sigma, Conditioning({"prompt_embeds": cond.tensors["prompt_embeds"]}))
    assert "\n" not in str(err.value)


@by_family
def test_the_preset_scales_with_depth_and_is_the_authors_on_the_full_model(family):
    paper_options = family.reward_class.paper_options
    assert paper_options(family.full_depth) == family.paper
    assert paper_options(6)["feature_layers"] == [1, 2, 3] and paper_options(6)["num_transformer_layers"] == 3
    # the known transformers are 6 blocks deep: the preset built on one is the scaled preset, with its heads
    reward = grid_registers(family.transformer, num_reward_tokens=4, seed=3)
    assert type(reward) is family.reward_class and reward.head_names == family.register()["head_names"]
    assert reward.options["feature_layers"] == [1, 2, 3] and reward.stop == 3


@by_family
def test_rg_opd_and_rgs_gradients_are_the_authors_score_and_grad(family):
    """What RG-OPD and RGS read (``reward_gradient``, ``head_gradients``) is their ``score_and_grad`` per head."""
    from flowalign.sampling.guidance import head_gradients, reward_gradient

    reward = family.authors_weights()
    x, sigma, cond = family.inputs()
    want = family.answers()["grad"]
    grad, _ = reward_gradient(reward, x, sigma, cond)
    torch.testing.assert_close(grad, family.as_latent(torch.tensor(want["preference"])), rtol=1e-5, atol=1e-6)
    others = [head for head in want if head != "preference"]
    assert others  # the default setting's answers hold the other heads' gradients too
    grads, _ = head_gradients(reward, x, sigma, cond, others)
    for head in others:
        torch.testing.assert_close(grads[head], family.as_latent(torch.tensor(want[head])), rtol=1e-5, atol=1e-6)


# SD3's train-reward grid_pool run is tests/rewards/cli/test_train_reward.py's (with the authors' recipe)
@pytest.mark.parametrize("family", [FLUX, ZIMAGE], ids=["flux", "zimage"])
def test_train_reward_builds_the_familys_architecture_on_its_model(family, tiny_model_dir, tmp_path):
    """``train-reward --architecture grid_pool`` on a model of the family trains its registers (their preset
    scaled to the tiny model's 2 blocks, with what the family reads from the policy) and the folder loads back as
    them."""
    policy, config, out, prompts, chosen = train_grid_pool(family.train_model(tiny_model_dir, tmp_path), tmp_path)
    assert config["family"] == family.name and config["feature_layers"] == [1] and config["num_reward_tokens"] == 4
    assert {k: config[k] for k in family.policy_options(policy)} == family.policy_options(policy)
    reward = load_latent_reward(out)
    assert type(reward) is family.reward_class and reward.head_names == ["reward"]
    assert reward.score(chosen[:2], torch.tensor([0.5, 0.5]), policy.encode(prompts[:2])).shape == (2,)


# ------------------------------------------------------------------------------------------- SD3 only
@pytest.mark.parametrize("case, match", [
    ("head order", "head order differs"),
    ("backbone", "backbone 'flux'"),
    ("missing", "lacks config.yaml"),
    ("width", "width 32 do not fit|backbone"),
])
def test_sd3_authors_folder_mismatches_fail_in_one_line(tmp_path, case, match):
    heads = SD3.register()["head_names"]
    folder = SD3.write_authors_folder(
        tmp_path / "theirs",
        manifest_over={"head_names": heads[::-1]} if case == "head order" else
        {"backbone": "flux"} if case == "backbone" else None)
    if case == "missing":
        (folder / "config.yaml").unlink()
    other = SD3.build_transformer(num_attention_heads=4) if case == "width" else SD3.transformer
    with pytest.raises(UserError, match=match) as err:
        load_latent_reward(folder, transformer=other)
    assert "\n" not in str(err.value)


def test_backbone_weights_of_another_shape_are_refused():
    state = {"model.reward_tokens": torch.zeros(4, 32),
             "model.backbone.transformer.pos_embed.proj.weight": torch.zeros(32, 16, 2, 2)}
    with pytest.raises(UserError, match="pos_embed.proj.weight"):
        from_authors_state(state, SD3.transformer)
    assert list(from_authors_state(state)) == ["reward_tokens"]


def test_folders_without_an_architecture_still_load_as_registers():
    reward = LatentRegisters.load(REPO_ROOT / "assets" / "tiny-sd3-vvr-latent-reward")
    assert type(reward) is LatentRegisters
