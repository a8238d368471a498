"""The authors' paper architecture (``grid_pool``, their ``latent_reward_grid_pool_nope_multihead``) on SD3.

Known answers: their model (latent_reward_grid.py @ 4c1ba48) was run on a tiny seeded SD3 transformer with
every register/head parameter drawn from a seed in the sorted order of their parameter names; the scores per
head and d score / d latent are in ``tests/flowalign/trainers/known_answers/lrr_grid_pool.json``. The same
draw over OUR parameter names reproduces their weights one to one (the names are theirs), so equal scores
and gradients check the architecture, and the name check checks that their state dicts load.
"""

import json
from pathlib import Path

import pytest
import torch
from diffusers import SD3Transformer2DModel

from flowalign.errors import UserError
from flowalign.paths import REPO_ROOT
from flowalign.protocols import Conditioning
from flowalign.sampling import load_latent_reward
from rewards.latent_registers import LatentRegisters
from rewards.latent_registers.sd3_grid import PAPER, GridRegisters, from_authors_state, paper_options

from .authors_folders import write_register_folder
from .seeded_weights import seeded_fill

KNOWN = Path(__file__).parents[2] / "flowalign" / "trainers" / "known_answers" / "lrr_grid_pool.json"


@pytest.fixture(scope="module")
def known() -> dict:
    return json.loads(KNOWN.read_text())


@pytest.fixture(scope="module")
def transformer(known) -> SD3Transformer2DModel:
    tr = SD3Transformer2DModel(**known["transformer"])
    seeded_fill(tr.named_parameters(), known["seeds"]["transformer"])
    return tr.requires_grad_(False).eval()


def options(known: dict, **over) -> dict:
    r = known["register"]
    keys = ("feature_layers", "text_layers", "num_transformer_layers", "layer_index_base", "num_reward_tokens",
            "num_attn_heads", "pool_factor", "width", "head_hidden_factor", "skip_attn2", "use_self_attn")
    return {"heads": r["head_names"], **{k: r[k] for k in keys}, **over}


def authors_weights(known, transformer, **over) -> GridRegisters:
    reward = GridRegisters(transformer, **options(known, **over))
    seeded_fill(reward.named_parameters(), known["seeds"]["register"])
    return reward


def inputs(known: dict):
    i = known["inputs"]
    cond = Conditioning({"prompt_embeds": torch.tensor(i["prompt_embeds"]),
                         "pooled_prompt_embeds": torch.tensor(i["pooled_prompt_embeds"])})
    return torch.tensor(i["latents"]), torch.tensor(i["sigma"]), cond


def assert_equals_known(reward, known: dict, entry: str) -> None:
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


def test_parameter_names_and_shapes_are_the_authors(known, transformer):
    reward = authors_weights(known, transformer)
    assert {k: list(v.shape) for k, v in reward.state_dict().items()} == known["state_dict_shapes"]
    assert sorted(n for n, _ in reward.named_parameters()) == known["trainable"]


@pytest.mark.parametrize("skip_attn2", [True, False])
def test_scores_and_latent_gradient_equal_the_authors(known, transformer, skip_attn2):
    reward = authors_weights(known, transformer, skip_attn2=skip_attn2)
    assert_equals_known(reward, known, "skip_attn2" if skip_attn2 else "with_attn2")
    assert reward.score(*inputs(known)).shape == (2,)


def test_generator_velocity_is_unchanged_by_the_register_path(known, transformer):
    x, sigma, cond = inputs(known)

    def velocity():
        return transformer(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=cond.tensors["prompt_embeds"],
                           pooled_projections=cond.tensors["pooled_prompt_embeds"], return_dict=False)[0]

    before = velocity()
    reward = authors_weights(known, transformer)
    reward.score(x.clone().requires_grad_(True), sigma, cond).sum().backward()
    assert torch.equal(velocity(), before)
    assert not any(p.requires_grad for p in transformer.parameters())
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in transformer.transformer_blocks)


def test_only_registers_and_heads_train(known, transformer):
    reward = authors_weights(known, transformer)
    x, sigma, cond = inputs(known)
    loss = sum(s.sum() for s in reward.score_heads(x, sigma, cond).values())
    loss.backward()
    assert all(p.grad is None for p in transformer.parameters())
    trained = {n for n, p in reward.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert {"reward_tokens", "reward_q_proj.weight", "reward_head.query_proj.weight", "score_mlps.2.2.weight",
            "reward_head.layer_adapters_text.0.cond_mlp.2.weight"} <= trained
    assert not any(n.startswith("reward_head.attn2.") for n in trained)  # skipped, as in the preset


def test_save_load_round_trips(known, transformer, tmp_path):
    reward = authors_weights(known, transformer)
    reward.save(tmp_path / "r")
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["architecture"] == "grid_pool" and config["class"] == "rewards.latent_registers:LatentRegisters"
    again = load_latent_reward(tmp_path / "r", transformer=transformer)
    assert isinstance(again, GridRegisters) and again.head_names == reward.head_names
    for k, v in reward.state_dict().items():
        assert torch.equal(again.state_dict()[k], v)
    assert_equals_known(again, known, "skip_attn2")


def write_authors_folder(folder: Path, known: dict, reward: GridRegisters, transformer, *, manifest_over=None,
                         register_over=None) -> Path:
    """Their ``save_register_checkpoint`` layout: the wrapper's state dict (``model.`` + the model's, frozen
    backbone included), ``config.yaml`` {train, register} and ``manifest.json``."""
    r = known["register"]
    register = {"head_names": r["head_names"], "feature_layers": r["feature_layers"], "text_layers": r["text_layers"],
                "num_transformer_layers": r["num_transformer_layers"],
                "architecture": "latent_reward_grid_pool_nope_multihead", "skip_attn2": True, "head_hidden_factor": 2,
                "layer_index_base": 1, "num_reward_tokens": r["num_reward_tokens"], "num_attn_heads": 8,
                "pool_factor": r["pool_factor"], "vis_h": 64, "vis_w": 64, "width": -1, "dropout": 0.0,
                "use_proj_in": False, "use_self_attn": True, **(register_over or {})}
    manifest = {"format_version": 1, "backbone": "sd3", "backbone_revision": "c8c84018e", "adapter": "register",
                "head_names": r["head_names"], "feature_layers": r["feature_layers"],
                "noise_convention": "timestep = 1000 sigma", "source_checkpoint": None, **(manifest_over or {})}
    return write_register_folder(folder, reward, transformer, {"train": {"learning_rate": 5e-5}, "register": register},
                                 manifest)


def test_authors_folder_loads_on_a_local_base_model(known, transformer, tmp_path):
    folder = write_authors_folder(tmp_path / "theirs", known, authors_weights(known, transformer), transformer)
    base = tmp_path / "sd3"
    transformer.save_pretrained(str(base / "transformer"))
    with pytest.raises(UserError, match="base_model"):
        load_latent_reward(folder)
    reward = load_latent_reward(folder, base_model=str(base))
    assert reward.head_names == known["register"]["head_names"]
    assert_equals_known(reward, known, "skip_attn2")
    # or named once, in a config.json beside their files: then any load_latent_reward(DIR) caller reads it
    (folder / "config.json").write_text(json.dumps({"class": "rewards.latent_registers:LatentRegisters",
                                                    "architecture": "grid_pool", "base_model": str(base)}))
    assert_equals_known(load_latent_reward(folder), known, "skip_attn2")


@pytest.mark.parametrize("case, match", [
    ("head order", "head order differs"),
    ("backbone", "backbone 'flux'"),
    ("missing", "lacks config.yaml"),
    ("architecture", "register.architecture"),
    ("width", "width 32 do not fit|backbone"),
])
def test_authors_folder_mismatches_fail_in_one_line(known, transformer, tmp_path, case, match):
    heads = known["register"]["head_names"]
    folder = write_authors_folder(
        tmp_path / "theirs", known, authors_weights(known, transformer), transformer,
        manifest_over={"head_names": heads[::-1]} if case == "head order" else
        {"backbone": "flux"} if case == "backbone" else None,
        register_over={"architecture": "latent_reward_grid_mlp"} if case == "architecture" else None)
    if case == "missing":
        (folder / "config.yaml").unlink()
    other = transformer
    if case == "width":
        other = SD3Transformer2DModel(**{**known["transformer"], "num_attention_heads": 4})
    with pytest.raises(UserError, match=match) as err:
        load_latent_reward(folder, transformer=other)
    assert "\n" not in str(err.value)


def test_backbone_weights_of_another_shape_are_refused(known, transformer):
    state = {"model.reward_tokens": torch.zeros(4, 32),
             "model.backbone.transformer.pos_embed.proj.weight": torch.zeros(32, 16, 2, 2)}
    with pytest.raises(UserError, match="pos_embed.proj.weight"):
        from_authors_state(state, transformer)
    assert list(from_authors_state(state)) == ["reward_tokens"]


def test_token_grid_not_divisible_by_pool_factor_fails_in_one_line(known, transformer):
    reward = authors_weights(known, transformer)
    _, sigma, cond = inputs(known)
    with pytest.raises(UserError, match="6x6 token grid is not divisible by pool_factor 4"):
        reward.score(torch.randn(2, 4, 12, 12), sigma, cond)


def test_the_preset_scales_with_depth_and_is_the_authors_on_sd3_medium():
    assert paper_options(24) == PAPER
    assert paper_options(6)["feature_layers"] == [1, 2, 3] and paper_options(6)["num_transformer_layers"] == 3


def test_folders_without_an_architecture_still_load_as_registers():
    reward = LatentRegisters.load(REPO_ROOT / "assets" / "tiny-sd3-vvr-latent-reward")
    assert type(reward) is LatentRegisters


def test_rg_opd_and_rgs_gradients_are_the_authors_score_and_grad(known, transformer):
    """What RG-OPD and RGS read (``reward_gradient``, ``head_gradients``) is their ``score_and_grad`` per head."""
    from flowalign.sampling.guidance import head_gradients, reward_gradient

    reward = authors_weights(known, transformer)
    x, sigma, cond = inputs(known)
    want = known["skip_attn2"]["grad"]
    grad, score = reward_gradient(reward, x, sigma, cond)
    torch.testing.assert_close(grad, torch.tensor(want["preference"]), rtol=1e-5, atol=1e-6)
    grads, _ = head_gradients(reward, x, sigma, cond, ["imagereward", "pickscore"])
    for head in ("imagereward", "pickscore"):
        torch.testing.assert_close(grads[head], torch.tensor(want[head]), rtol=1e-5, atol=1e-6)
