"""UMM-Reflection on the tiny Qwen-Image-Edit twin as a unified model: trajectories of reflections and revisions
whose one advantage weighs every term, and the text side's log-probs are the model's own."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from flowalign.cli.common import load_policy
from flowalign.cli.main import main as cli_main
from flowalign.config import ParallelSection, load_config
from flowalign.errors import UserError
from flowalign.evaluation import evaluate
from flowalign.gallery import gallery_from_evals
from flowalign.parallel import strategy
from flowalign.protocols import RewardOutput, UnifiedPolicy
from flowalign.reflection import Reflection, reflect, stopped
from flowalign.sampling import sde_step
from flowalign.train import build_trainer
from flowalign.trainers.optim import setup_optimisation
from flowalign.trainers.parts.policy_gradient import ppo_clip_loss
from flowalign.trainers.parts.reference_kl import token_k3, transition_kl
from flowalign.trainers.parts.reflection_credit import (
    ShapedCredit,
    channel_scales,
    shaped_advantages,
    trajectory_reward,
    trajectory_rewards,
)
from flowalign.trainers.umm_reflection import (
    RevisionUnit,
    TokenUnit,
    UMMReflectionConfig,
    UMMReflectionTrainer,
    sft_coefficients,
)
from tests.tiny_recipes import REPO, one_step

from .resume_check import assert_trains_and_resumes_bit_exactly

RECIPE = REPO / "configs" / "tiny" / "umm_reflection_vvr.yaml"
#: the authors' functions run on fixed numbers (waltstephen/UMM-Reflection @ 8510796, float64)
KNOWN = Path(__file__).parent / "known_answers"
MODEL = REPO / "assets" / "tiny-qwen-image-edit"
#: 2 prompts × 2 trajectories, 2 rounds of 2-token reflections on the untrained twin (its random writer's
#: mechanics, not the recipe's trained model); "s" ends some trajectories after round 1 and one after
#: round 2 with this seed (asserted below, so a change of the tiny model shows)
SMALL = ("trainer.prompts_per_step=2", "trainer.max_new_tokens=2", "trainer.stop_phrase=s", "trainer.rounds=2",
         f"model.path={MODEL}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A trainer of the tiny recipe and one collected batch."""
    torch.manual_seed(0)
    trainer = build_trainer(load_config(RECIPE, [*one_step(RECIPE, tmp_path_factory.mktemp("umm") / "run"), *SMALL]))
    return trainer, trainer.collect(0)


def gradients(trainer, batch, units) -> dict[str, torch.Tensor]:
    """The summed loss's gradient of the language and the flow LoRA, flattened."""
    trainer.policy.trainable.zero_grad(set_to_none=True)
    for unit in units:
        trainer.loss(batch, unit)[0].backward()
    named = [(n, p) for n, p in trainer.policy.trainable.named_parameters() if p.requires_grad]
    flat = lambda part: torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                   for n, p in named if n.startswith(part)])
    return {"language": flat("language"), "flow": flat("flow")}


def test_the_policy_is_one_model_in_both_roles(trained):
    trainer, _ = trained
    policy = trainer.policy
    assert isinstance(policy, UnifiedPolicy)
    trained_names = [n for n, p in policy.trainable.named_parameters() if p.requires_grad]
    assert {n.split(".")[0] for n in trained_names} == {"language", "flow"}
    assert all("lora" in n for n in trained_names)
    # one optimiser over both roles' tensors (the recipe's joint form: one parameter group)
    assert {id(p) for p in trainer.params} == {id(p) for p in policy.trainable.parameters() if p.requires_grad}
    assert len(trainer.optimizer.param_groups) == 1


def test_siblings_share_their_first_image_bit_for_bit(trained):
    _, batch = trained
    first = batch.first
    assert torch.equal(batch.rounds[0].images, first)
    assert torch.equal(first[0], first[1]) and torch.equal(first[2], first[3])
    assert not torch.equal(first[0], first[2])  # another prompt, another image
    # the siblings' reflections and revisions differ (their own keyed draws)
    assert not torch.equal(batch.rounds[0].tokens[0], batch.rounds[0].tokens[1])


def test_a_stopped_trajectory_has_no_later_terms(trained):
    trainer, batch = trained
    r1, r2 = batch.rounds
    assert r1.reflected.all() and r1.revised.tolist() == [True, True, False, True]
    assert r2.reflected.tolist() == [True, True, False, True] and r2.revised.tolist() == [True, False, False, True]
    assert stopped(trainer.policy.decode_tokens(r1.tokens[2:3]), "s").all()
    assert (r2.tokens[2] == -1).all() and (r2.log_probs[2] == 0).all()
    assert torch.equal(batch.final[2], batch.first[2])  # never revised
    units = trainer.units(batch)
    assert any(isinstance(u, TokenUnit) and u.index == 2 and u.round == 0 for u in units)  # its stopping reflection
    assert not any(isinstance(u, TokenUnit) and u.index == 2 and u.round == 1 for u in units)
    revised = [(u.round, batch.rounds[u.round].revisions[u.batch].index.tolist()) for u in units
               if isinstance(u, RevisionUnit)]
    assert not any(2 in idx for _, idx in revised) and not any(r == 1 and 1 in idx for r, idx in revised)
    # its gradient is that of its round-1 reflection alone
    only = dataclasses.replace(batch, coefficients=torch.tensor([0.0, 0.0, 1.0, 0.0]))
    mine = [u for u in units if isinstance(u, TokenUnit) and u.index == 2]
    whole, first = gradients(trainer, only, units), gradients(trainer, only, mine)
    assert torch.equal(whole["language"], first["language"]) and not whole["flow"].any()


def test_one_advantage_weighs_every_term_of_its_trajectory(trained):
    trainer, batch = trained
    units = trainer.units(batch)
    n = len(batch.prompts)
    per = [gradients(trainer, dataclasses.replace(batch, coefficients=torch.eye(n)[j]), units) for j in range(n)]
    for j in (0, 1, 3):  # revised trajectories: both their reflections and their revisions train
        assert per[j]["language"].abs().sum() > 0 and per[j]["flow"].abs().sum() > 0
    advantages = torch.tensor([0.7, -1.3, 0.4, 0.2])
    mixed = gradients(trainer, dataclasses.replace(batch, coefficients=advantages), units)
    for part in ("language", "flow"):
        expected = sum(a * g[part] for a, g in zip(advantages.tolist(), per))
        assert torch.allclose(mixed[part], expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())
    zero = gradients(trainer, dataclasses.replace(batch, coefficients=torch.zeros(n)), units)
    assert not zero["language"].any() and not zero["flow"].any()


def test_the_shaped_reward_and_advantage_are_the_authors():
    """R(τ) of g022_whole_trajectory_reward.trajectory_reward and its group_advantages (std floor 0.1, clip 1)."""
    data = json.loads((KNOWN / "umm_reflection_credit.json").read_text())
    credit = ShapedCredit()
    cases = data["rewards"]
    for case in cases:
        assert trajectory_reward(case["states"], case["premature_stop"], credit) == pytest.approx(case["reward"],
                                                                                                  rel=1e-6, abs=1e-12)
    width = max(len(c["states"]) for c in cases)  # the batched form: rows padded past their states
    scores = torch.tensor([c["states"] + [0.5] * (width - len(c["states"])) for c in cases], dtype=torch.float64)
    counts = torch.tensor([len(c["states"]) for c in cases])
    premature = torch.tensor([c["premature_stop"] for c in cases])
    expected = torch.tensor([c["reward"] for c in cases], dtype=torch.float64)
    assert torch.allclose(trajectory_rewards(scores, counts, premature, credit), expected, rtol=1e-6, atol=1e-12)
    for name, case in data["group_advantages"].items():
        rewards = torch.tensor(case["rewards"], dtype=torch.float64)
        ours = shaped_advantages(rewards, torch.zeros(len(rewards), dtype=torch.long), credit)
        assert torch.allclose(ours, torch.tensor(case["advantages"], dtype=torch.float64), rtol=1e-6, atol=1e-12), name
    # groups are normalised separately; an invalid member takes no part and gets 0
    spread, narrow = (torch.tensor(data["group_advantages"][k]["rewards"], dtype=torch.float64)
                      for k in ("spread", "narrow"))
    both = shaped_advantages(torch.cat([spread, narrow, torch.tensor([9.0])]),
                             torch.tensor([0] * len(spread) + [1] * len(narrow) + [1]), credit,
                             torch.tensor([True] * (len(spread) + len(narrow)) + [False]))
    expected = [*data["group_advantages"]["spread"]["advantages"], *data["group_advantages"]["narrow"]["advantages"], 0]
    assert torch.allclose(both, torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-12)


def test_a_score_outside_0_1_is_refused_by_the_shaped_credit():
    with pytest.raises(UserError, match="trainer.credit=shaped needs rewards in \\[0, 1\\].*trainer.credit=final"):
        trajectory_rewards(torch.tensor([[0.2, 1.5]]), torch.tensor([2]), torch.tensor([False]), ShapedCredit())


def test_the_loss_weights_are_the_authors():
    """A trajectory's reflections each one PPO mean (ε 0.2), its revisions each the mean over their SDE steps
    (ε 0.1), averaged within the trajectory and over the trajectories that have any (trajectory_channel_scales,
    clipped_text_ppo_loss, the flow learn loop): flowalign's channel_scales and ppo_clip_loss, as units() uses
    them, give the authors' losses."""
    data = json.loads((KNOWN / "umm_reflection_loss.json").read_text())
    trajs = data["trajectories"]
    text = channel_scales(torch.tensor([len(t["turns"]) for t in trajs]))
    flow = channel_scales(torch.tensor([len(t["revisions"]) for t in trajs]))
    assert torch.allclose(text, torch.tensor(data["text_scales"], dtype=torch.float64), rtol=1e-6, atol=0)
    assert torch.allclose(flow, torch.tensor(data["flow_scales"], dtype=torch.float64), rtol=1e-6, atol=0)

    def term(record: dict, advantage: float, scale: float, clip: float) -> torch.Tensor:
        new, old = (torch.tensor(record[k], dtype=torch.float64) for k in ("new", "old"))
        per, _, _ = ppo_clip_loss(new, old, torch.full_like(new, advantage), clip)
        return per.sum() * scale / len(new)  # each token / step weighted as a TokenUnit / RevisionUnit is

    text_loss = sum(term(u, t["advantage"], float(text[i]), data["text_clip"])
                    for i, t in enumerate(trajs) for u in t["turns"])
    flow_loss = sum(term(c, t["advantage"], float(flow[i]), data["flow_clip"])
                    for i, t in enumerate(trajs) for c in t["revisions"])
    assert float(text_loss) == pytest.approx(data["text_loss"], rel=1e-6)
    assert float(flow_loss) == pytest.approx(data["flow_loss"], rel=1e-6)


def test_units_weigh_each_reflection_and_revision_by_its_trajectorys_channel_share(trained):
    trainer, batch = trained
    units = trainer.units(batch)
    turns, revisions = batch.turn_counts(), batch.revision_counts()
    assert turns.tolist() == [2, 2, 1, 2] and revisions.tolist() == [2, 1, 0, 2]  # SMALL's stops (asserted below)
    text, flow = channel_scales(turns), channel_scales(revisions)
    for u in units:
        if isinstance(u, TokenUnit):
            n = int((batch.rounds[u.round].tokens[u.index] != -1).sum())
            assert u.scale == pytest.approx(float(text[u.index]) / n, rel=1e-6)
        else:
            rev = batch.rounds[u.round].revisions[u.batch]
            steps = len(rev.rollout.trained_steps())
            assert torch.allclose(u.scale.double(), flow[rev.index] / steps, rtol=1e-6)
    # each trajectory's text terms sum to 1/N_y, its flow terms to 1/N_K
    for i in range(len(batch.prompts)):
        words = sum(u.scale * int((batch.rounds[u.round].tokens[i] != -1).sum())
                    for u in units if isinstance(u, TokenUnit) and u.index == i)
        assert words == pytest.approx(1 / 4, rel=1e-6)


def test_the_shaped_credit_reads_every_image_state_of_a_trajectory(trained):
    """States: the first image's score, then one per revision; stopping on an image below 1 is charged; the
    round cap is not."""
    trainer, batch = trained
    before = torch.tensor([[0.2, 0.2, 0.6, 0.6], [0.5, 0.1, 0.6, 0.9]])  # each round's input image, per trajectory
    final = torch.tensor([1.0, 0.1, 0.6, 0.4])  # 1 and 2 kept their image after they stopped
    valid = torch.tensor([True, True, True, True])
    rewards, advantages = trainer.shaped(batch.rounds, before, final, batch.groups, valid)
    credit = trainer.tcfg.shaped_credit()
    expected = [trajectory_reward([0.2, 0.5, 1.0], False, credit),  # revised twice, the cap ends it
                trajectory_reward([0.2, 0.1], True, credit),  # revised once, then stopped below 1
                trajectory_reward([0.6], True, credit),  # stopped at once
                trajectory_reward([0.6, 0.9, 0.4], False, credit)]
    assert rewards.tolist() == pytest.approx(expected, rel=1e-6)
    groups = batch.groups
    assert torch.allclose(advantages.double(), shaped_advantages(torch.tensor(expected, dtype=torch.float64), groups,
                                                                 credit), atol=1e-6)
    _, masked = trainer.shaped(batch.rounds, before, final, groups, torch.tensor([True, True, False, True]))
    assert masked[2] == 0 and masked[3] == 0  # group 1: one valid member left, nothing to compare it with


def test_revisions_train_a_window_of_two_steps_from_the_first_half(trained):
    """The authors' SDE window: 2 contiguous steps from the first half of the revision's steps, drawn per revision
    (their per repair call, keyed by seed, step, trajectory and round); a rollout too short for it: the widest that
    fits."""
    trainer, batch = trained
    assert trainer.tcfg.sde_window_size == 2 and trainer.tcfg.num_steps == 2  # too short: the widest that fits
    for r, rnd in enumerate(batch.rounds):
        assert {trainer.revision_window(0, r, g, m) for g in range(2) for m in range(2)} == {(0, 1)}
        assert {tuple(rev.rollout.trained_steps()) for rev in rnd.revisions} == {(0,)}
    # the loop's revisions are SDE on each one's window only, those of one window batched together
    windows = {0: (1, 2), 1: (0, 2), 2: (1, 2)}
    rounds, _ = reflect(trainer.policy, batch.first[:3], batch.prompts[:3], Reflection(1, 2, "a phrase never said"),
                        lambda i, salt, r: 7 + 100 * i + salt + r, num_steps=6, guidance_scale=1.0, batch_size=4,
                        sampler="flow_grpo", noise_level=0.7, windows=lambda i, r: windows[i])
    got = {tuple(rev.index.tolist()): rev.rollout.trained_steps() for rev in rounds[0].revisions}
    assert got == {(0, 2): [1, 2], (1,): [0, 1]}
    wide = trainer.tcfg
    try:
        trainer.tcfg = wide.model_copy(update={"num_steps": 4})
        assert {trainer.revision_window(s, r, 0, 1) for s in range(40) for r in range(2)} == {(0, 2)}  # one fits
        trainer.tcfg = wide.model_copy(update={"num_steps": 20})
        starts = {trainer.revision_window(s, 0, 0, 0)[0] for s in range(200)}
        assert starts == set(range(9))  # U{0..8}: steps 0..9, the first half of 20
        # per revision: the siblings of one round draw their own windows, the same on any rank or batch
        siblings = [trainer.revision_window(3, 1, 5, m) for m in range(8)]
        assert len(set(siblings)) > 1 and siblings == [trainer.revision_window(3, 1, 5, m) for m in range(8)]
        trainer.tcfg = wide.model_copy(update={"sde_window_size": 0})
        assert trainer.revision_window(0, 0, 0, 0) is None
    finally:
        trainer.tcfg = wide


def test_token_log_probs_are_the_models_own_generate_scores(trained):
    trainer, batch = trained
    policy = trainer.policy
    image, prompt = batch.first[0], batch.prompts[0]
    with torch.no_grad(), policy.writing():
        out = policy.language.generate(**policy._inputs(image, prompt), max_new_tokens=4, do_sample=False,
                                       output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, -len(out.logits):]
    expected = torch.stack([torch.log_softmax(l[0].float(), -1)[t] for l, t in zip(out.logits, tokens)])
    with torch.no_grad():
        ours = policy.token_log_probs(image[None], [prompt], tokens[None])[0]
    assert torch.allclose(ours, expected, atol=1e-5)
    # the rollout's stored log-probs are the scorer's on the same tokens at the training temperature (the
    # tokens' on-policy ratio is 1), not the model's own at 1
    assert trainer.tcfg.temperature == 0.9
    for rnd in batch.rounds:
        with torch.no_grad():
            again = policy.token_log_probs(rnd.images, batch.prompts, rnd.tokens, temperature=0.9)
            plain = policy.token_log_probs(rnd.images, batch.prompts, rnd.tokens)
        assert torch.allclose(again * rnd.reflected[:, None], rnd.log_probs, atol=1e-5)
        assert not torch.allclose(plain * rnd.reflected[:, None], rnd.log_probs, atol=1e-3)


def test_the_kl_terms_are_the_authors():
    """The text KL (g008_counting.text_k3_kl_loss, bound g022_linear: β·mean_t k3(log π_θ − log π_ref), exp
    linear above 10 nats) and the flow KL (bagel.equal_variance_transition_kl: mean_D Δμ²/(2·std_dev_t²·Δt)),
    waltstephen/UMM-Reflection @ 8510796, float64, on fixed numbers; β 1e-4 both (G022_KL_BETA_TEXT / _FLOW)."""
    data = json.loads((KNOWN / "umm_reflection_kl.json").read_text())
    assert data["beta"] == 1e-4
    for turn in data["text_kl"]:
        new, ref = (torch.tensor(turn[k], dtype=torch.float64) for k in ("new", "reference"))
        k3 = token_k3(new, ref)
        assert torch.allclose(k3, torch.tensor(turn["k3"], dtype=torch.float64), rtol=1e-6, atol=0)
        assert float(data["beta"] * k3.mean()) == pytest.approx(turn["kl_loss"], rel=1e-6)
    assert max(max(t["k3"]) for t in data["text_kl"]) > 1e4  # one token past the linearisation
    for step in data["flow_kl"]:
        mean, ref = (torch.tensor(step[k], dtype=torch.float64).view(step["shape"]) for k in ("mean", "reference_mean"))
        std = torch.tensor(step["noise_std"], dtype=torch.float64)  # τ = std_dev_t·sqrt(Δt), the step's noise
        assert float(transition_kl(mean, ref, std)[0]) == pytest.approx(step["kl"], rel=1e-6)


def test_the_kl_terms_pull_both_roles_toward_the_starting_model(trained):
    """With both adapters moved off the start, a zero-advantage batch still trains: each reflection token by
    β_tok·k3 against the LoRA-off log-probs (at the training temperature), each revision step by β_rev·KL of the
    transitions; β 0 leaves nothing, and the plan then drops the zero-advantage trajectories' units."""
    trainer, batch = trained
    policy, tcfg = trainer.policy, trainer.tcfg
    zero = dataclasses.replace(batch, coefficients=torch.zeros(len(batch.prompts)))
    units = trainer.units(batch)
    saved = {n: p.detach().clone() for n, p in policy.trainable.named_parameters() if "lora_B" in n}
    try:
        with torch.no_grad():
            g = torch.Generator().manual_seed(4)
            for n, p in policy.trainable.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.05 * torch.randn(p.shape, generator=g))
        token = next(u for u in units if isinstance(u, TokenUnit))
        rnd, i = batch.rounds[token.round], token.index
        mask = rnd.tokens[i] != -1
        with torch.no_grad():
            args = (rnd.images[i : i + 1], batch.prompts[i : i + 1], rnd.tokens[i : i + 1])
            lp = policy.token_log_probs(*args, temperature=0.9)[0][mask]
            with policy.adapter_disabled():
                ref = policy.token_log_probs(*args, temperature=0.9)[0][mask]
            loss, info = trainer.loss(zero, token)
        assert info["token_kl"] > 0
        assert not torch.allclose(lp, ref, atol=1e-4)
        expected = (tcfg.token_kl_beta * token_k3(lp.double(), ref.double())).sum() * token.scale
        assert loss.item() == pytest.approx(float(expected), rel=1e-4) and loss.item() > 0
        pulled = gradients(trainer, zero, units)
        assert pulled["language"].abs().sum() > 0 and pulled["flow"].abs().sum() > 0
        assert trainer.revision_loss(zero, next(u for u in units if isinstance(u, RevisionUnit)))[1]["kl"] > 0
        assert sum(map(len, trainer.plan(zero, torch.Generator()).steps)) == len(units)  # every term trains
        trainer.tcfg = tcfg.model_copy(update={"token_kl_beta": 0.0, "revision_kl_beta": 0.0})
        off = gradients(trainer, zero, units)
        assert not off["language"].any() and not off["flow"].any()
        assert trainer.plan(zero, torch.Generator()).steps[0] == []
    finally:
        trainer.tcfg = tcfg
        with torch.no_grad():
            for n, p in policy.trainable.named_parameters():
                if n in saved:
                    p.copy_(saved[n])


def test_revisions_are_on_policy(trained):
    trainer, batch = trained
    units = [u for u in trainer.units(batch) if isinstance(u, RevisionUnit)]
    assert units
    with torch.no_grad():
        assert max(trainer.loss(batch, u)[1]["ratio_dev"] for u in units) < 1e-5


def test_sft_imitates_each_groups_best_trajectory_when_it_improved():
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    first = torch.tensor([0.5, 0.5, 0.2, 0.2, 0.9, 0.9])
    final = torch.tensor([0.4, 0.7, 0.3, 0.3, 0.1, 0.8])
    assert sft_coefficients(groups, first, final).tolist() == [0, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("optimisers", ["separate", "joint"])
def test_resumes_bit_exactly(tmp_path, prompt_file, optimisers):
    """Both AdamW groups' moments are saved and restored (the second step reads them)."""
    straight = assert_trains_and_resumes_bit_exactly(
        tmp_path, MODEL, prompt_file, "trainer.name=umm_reflection", "trainer.prompts_per_step=1",
        "trainer.group_size=2", "trainer.batch_size=2", "trainer.num_steps=2", "trainer.max_new_tokens=2",
        "trainer.guidance_scale=1.0", "trainer.advantage=group", f"trainer.optimisers={optimisers}")
    groups = [g.get("name") for g in straight.optimizer.param_groups]
    assert groups == (["flow", "text"] if optimisers == "separate" else [None])
    assert all(straight.optimizer.state[p] for p in straight.params)  # every tensor of both roles stepped


# ---------------------------------------------------------------------------------------------- the optimisers


def test_the_optimisers_are_the_authors():
    """Their update order (waltstephen/UMM-Reflection @ 8510796, ``update_multiround_group``: text phase, then
    flow phase, each ``clip_trainable_gradients`` to 1 then ``step_channel_optimizer``, a channel with no record
    on any rank not stepped), their AdamW of each role (lr 5e-6, betas (0.9, 0.999), weight decay 1e-4, eps
    1e-8), run on fixed float64 gradients: the loop's optimiser with the "text" and "flow" groups stepped one
    after the other moves the weights as their two optimisers (rtol 1e-6); one joint step and clip does not."""
    data = json.loads((KNOWN / "umm_reflection_optimisers.json").read_text())
    tcfg = UMMReflectionConfig(lr=data["lr"], betas=tuple(data["betas"]), weight_decay=data["weight_decay"],
                               grad_clip=data["max_grad_norm"])
    assert torch.optim.AdamW([torch.zeros(1)]).defaults["eps"] == data["eps"]  # the loop's AdamW keeps 1e-8

    def run(groups: bool) -> list[dict[str, dict[str, torch.Tensor]]]:
        weights = torch.nn.ModuleDict({role: torch.nn.ParameterDict(
            {n: torch.nn.Parameter(torch.tensor(v, dtype=torch.float64).view(data["shapes"][role][n]))
             for n, v in d.items()}) for role, d in data["initial"].items()})
        policy = SimpleNamespace(trainable=weights)
        optimisation = setup_optimisation(policy, tcfg, strategy(ParallelSection(), 1, 0, "cpu"),
                                          (lambda name, p: name.split(".")[0]) if groups else None)
        deltas = []
        for step in data["steps"]:
            for role in ("text", "flow"):  # text first: a step reads nothing of the other role here
                if step["gradients"][role] is None:
                    continue  # no record anywhere: their channel is globally inactive, the plan has no step
                for n, p in weights[role].items():
                    p.grad = torch.tensor(step["gradients"][role][n], dtype=torch.float64).view(p.shape)
                if groups:
                    norm = optimisation.optimizer_step(role)
                    assert float(norm) == pytest.approx(step[f"{role}_grad_norm"], rel=1e-6)
            if not groups:
                optimisation.optimizer_step()
            deltas.append({role: {n: (p.detach() - torch.tensor(data["initial"][role][n], dtype=torch.float64)
                                      .view(p.shape)).flatten() for n, p in d.items()} for role, d in weights.items()})
        return deltas

    def matches(deltas: list[dict[str, dict[str, torch.Tensor]]]) -> bool:
        return all(torch.allclose(mine[role][n], torch.tensor(theirs["delta"][role][n], dtype=torch.float64),
                                  rtol=1e-6, atol=0)
                   for mine, theirs in zip(deltas, data["steps"]) for role in mine for n in mine[role])

    assert matches(run(groups=True))
    assert not matches(run(groups=False))


@contextlib.contextmanager
def optimised(trainer, **options):
    """``trainer`` with ``options`` set and a fresh optimiser built for them (``optimisers`` decides its groups);
    its weights, options and optimiser are restored after (the module's trainer is shared)."""
    tcfg, optimisation = trainer.tcfg, trainer.optimisation
    saved = {n: p.detach().clone() for n, p in trainer.policy.trainable.named_parameters()}
    trainer.tcfg = tcfg.model_copy(update=options)
    trainer.optimisation = setup_optimisation(trainer.policy, trainer.tcfg, trainer.parallel,
                                              trainer.parameter_groups())
    try:
        yield trainer
    finally:
        trainer.tcfg, trainer.optimisation = tcfg, optimisation
        with torch.no_grad():
            for n, p in trainer.policy.trainable.named_parameters():
                p.copy_(saved[n])
                p.grad = None


def roles(trainer) -> dict[str, list[torch.nn.Parameter]]:
    """The trained tensors of each role, by the trainable module's parts (language LoRA, transformer adapter)."""
    named = [(n, p) for n, p in trainer.policy.trainable.named_parameters() if p.requires_grad]
    return {"text": [p for n, p in named if n.startswith("language")],
            "flow": [p for n, p in named if n.startswith("flow")]}


def flat(tensors: list[torch.Tensor | None]) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors])


def one_update(trainer, batch) -> dict:
    """One ``update`` of ``batch``: the gradients AdamW read at each of its steps (role → flat, None where
    absent), each role's weights when the first unit of each kind ran its forward, and the weights after."""
    seen: list[dict[str, torch.Tensor | None]] = []
    at_forward: dict[str, dict[str, torch.Tensor]] = {}
    step, loss = trainer.optimisation.optimizer.step, trainer.loss
    parts = roles(trainer)

    def spied_step(*args, **kwargs):
        seen.append({role: None if all(p.grad is None for p in ps) else flat([p.grad for p in ps])
                     for role, ps in parts.items()})
        return step(*args, **kwargs)

    def spied_loss(b, unit):
        at_forward.setdefault(type(unit).__name__, {role: flat(ps).clone() for role, ps in parts.items()})
        return loss(b, unit)

    trainer.optimisation.optimizer.step, trainer.loss = spied_step, spied_loss
    try:
        logs = trainer.update(batch, torch.Generator())
    finally:
        trainer.optimisation.optimizer.step, trainer.loss = step, loss
    return {"grads": seen, "at_forward": at_forward, "after": {r: flat(ps).clone() for r, ps in parts.items()},
            "logs": logs}


ADVANTAGES = torch.tensor([0.7, -1.3, 0.4, 0.2])


def test_separate_optimisers_step_text_then_run_the_revisions_on_the_weights_it_left(trained):
    """``separate`` (default): two optimiser steps, the reflections' units then the revisions' units, as the
    authors' text phase before their flow phase: the revisions' forwards read the stepped language LoRA and the
    untouched transformer adapter; ``joint``: one step, every forward on the weights before it."""
    trainer, batch = trained
    batch = dataclasses.replace(batch, coefficients=ADVANTAGES)
    start = {r: flat(ps).clone() for r, ps in roles(trainer).items()}
    with optimised(trainer, optimisers="separate"):
        assert [g["name"] for g in trainer.optimisation.optimizer.param_groups] == ["flow", "text"]
        plan = trainer.plan(batch, torch.Generator())
        assert plan.groups == ["text", "flow"] and plan.global_weights
        assert all(isinstance(u, TokenUnit) for u in plan.steps[0]) and plan.steps[0]
        assert all(isinstance(u, RevisionUnit) for u in plan.steps[1]) and plan.steps[1]
        out = one_update(trainer, batch)
        first_text, then_flow = out["grads"]
        assert then_flow["text"] is None and first_text["flow"] is None  # each step reads its own role alone
        revision = out["at_forward"]["RevisionUnit"]
        assert not torch.equal(out["after"]["text"], start["text"])
        assert torch.equal(revision["text"], out["after"]["text"])  # the text step came first
        assert torch.equal(revision["flow"], start["flow"]) and not torch.equal(out["after"]["flow"], start["flow"])
        assert {"train/grad_norm_text", "train/grad_norm_flow"} <= {f"train/{k}" for k in out["logs"]}
        # a role with no term anywhere takes no step (their globally inactive channel)
        unrevised = dataclasses.replace(batch, rounds=[dataclasses.replace(
            r, revised=torch.zeros_like(r.revised), revisions=[]) for r in batch.rounds])
        assert trainer.plan(unrevised, torch.Generator()).groups == ["text"]
    with optimised(trainer, optimisers="separate", token_weight=0.0):
        assert trainer.plan(batch, torch.Generator()).groups == ["flow"]
    with optimised(trainer, optimisers="joint"):
        plan = trainer.plan(batch, torch.Generator())
        assert len(plan.steps) == 1 and plan.groups is None
        out = one_update(trainer, batch)
        assert torch.equal(out["at_forward"]["RevisionUnit"]["text"], start["text"])


def test_separate_optimisers_clip_each_roles_gradient_by_its_own_norm(trained):
    """A flow gradient made 10⁴ times larger (``revision_weight``) leaves the text step bit for bit under
    ``separate`` (its gradient clipped to ``grad_clip`` by its own norm); under ``joint`` the one clip of both
    scales the text gradient down with it, and the text update moves."""
    trainer, batch = trained
    batch = dataclasses.replace(batch, coefficients=ADVANTAGES)
    text_units = [u for u in trainer.units(batch) if isinstance(u, TokenUnit)]
    raw = gradients(trainer, batch, text_units)["language"]
    trainer.policy.trainable.zero_grad(set_to_none=True)
    clip = trainer.tcfg.grad_clip
    runs = {}
    for optimisers in ("separate", "joint"):
        for weight in (1.0, 1e4):
            with optimised(trainer, optimisers=optimisers, revision_weight=weight):
                runs[optimisers, weight] = one_update(trainer, batch)
    for weight in (1.0, 1e4):
        text = runs["separate", weight]["grads"][0]["text"]
        assert torch.allclose(text, raw * min(1.0, clip / raw.norm().item()), rtol=1e-5, atol=1e-12)
        assert runs["separate", weight]["grads"][1]["flow"].norm() <= clip * (1 + 1e-5)
    assert torch.equal(runs["separate", 1.0]["grads"][0]["text"], runs["separate", 1e4]["grads"][0]["text"])
    assert torch.equal(runs["separate", 1.0]["after"]["text"], runs["separate", 1e4]["after"]["text"])
    joint = runs["joint", 1e4]["grads"][0]
    assert torch.cat([joint["text"], joint["flow"]]).norm() <= clip * (1 + 1e-5)
    assert joint["text"].norm() < 0.2 * runs["separate", 1e4]["grads"][0]["text"].norm()  # scaled by the flow's
    assert not torch.equal(runs["joint", 1.0]["after"]["text"], runs["joint", 1e4]["after"]["text"])


def test_joint_is_the_former_step_one_adamw_one_clip(trained):
    """``joint`` (pinned by the tiny recipe, and for runs saved before the option): one optimiser step of every
    unit, both roles' gradients clipped together, one AdamW over one group: the same weights, bit for bit, as
    that step written out."""
    trainer, batch = trained
    batch = dataclasses.replace(batch, coefficients=ADVANTAGES)
    with optimised(trainer, optimisers="joint"):
        params = list(trainer.optimisation.params)
        start = [p.detach().clone() for p in params]
        (units,) = trainer.plan(batch, torch.Generator()).steps
        for unit in units:
            trainer.loss(batch, unit)[0].backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(params, trainer.tcfg.grad_clip)
        adamw = torch.optim.AdamW(params, lr=trainer.tcfg.lr, betas=trainer.tcfg.betas,
                                  weight_decay=trainer.tcfg.weight_decay)
        adamw.step()
        expected = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
                p.grad = None
        trainer.update(batch, torch.Generator())
        assert all(torch.equal(p, e) for p, e in zip(params, expected))


def test_the_sft_cold_start_imitates_the_kept_trajectory(trained):
    """``objective: sft`` on the same trajectories: the kept one's reflections by likelihood, its revisions by
    flow matching; the others weigh nothing."""
    trainer, batch = trained
    rl = trainer.tcfg
    trainer.tcfg = rl.model_copy(update={"objective": "sft"})
    try:
        units = trainer.units(batch)
        assert all(u.noise is not None for u in units if isinstance(u, RevisionUnit))
        kept = dataclasses.replace(batch, coefficients=torch.tensor([0.0, 1.0, 0.0, 0.0]))
        token = next(u for u in units if isinstance(u, TokenUnit) and u.index == 1)
        with torch.no_grad():
            rnd = batch.rounds[0]
            lp = trainer.policy.token_log_probs(rnd.images[1:2], batch.prompts[1:2], rnd.tokens[1:2])
            assert trainer.loss(kept, token)[0].item() == pytest.approx(-token.scale * lp.sum().item(), rel=1e-5)
        grads = gradients(trainer, kept, units)
        assert grads["language"].abs().sum() > 0 and grads["flow"].abs().sum() > 0
        none = gradients(trainer, dataclasses.replace(batch, coefficients=torch.zeros(4)), units)
        assert not none["language"].any() and not none["flow"].any()
    finally:
        trainer.tcfg = rl


class MeanPixel:
    """A reward that tells an image from its revision: each sample's mean pixel."""

    name = "mean_pixel"
    differentiable = False

    def __call__(self, samples, prompts, metadata):
        return RewardOutput({"mean_pixel": samples.float().mean((1, 2, 3))}, torch.ones(len(samples), dtype=torch.bool))


def evaluated(policy, how, prompts, metadata, out_dir):
    """Each sample's score, its notes, and the texts the policy wrote per ``generate`` call, with ``how`` as
    the evaluation's reflection."""
    written, generate = [], policy.generate

    def spy(images, *args, **kw):
        out = generate(images, *args, **kw)
        written.append(policy.decode_tokens(out[0]))
        return out

    saved, policy.reflection, policy.generate = policy.reflection, how, spy
    try:
        evaluate(policy, prompts, metadata, MeanPixel(), seed=5, num_steps=2, guidance_scale=1.0, batch_size=2,
                 out_dir=out_dir, progress=False)
    finally:
        policy.reflection = saved
        del policy.generate
    rows = [json.loads(line) for line in (out_dir / "results.jsonl").read_text().splitlines()]
    return [r["score"] for r in rows], [r.get("notes", {}).get("reflections") for r in rows], written


def test_evaluation_scores_the_final_image_of_the_models_own_reflection_loop(trained, tmp_path):
    trainer, _ = trained
    policy = trainer.policy
    # the trainer's rounds, length and stop phrase (SMALL), at the evaluation's temperature
    assert policy.reflection == Reflection(2, 2, "s", 0.5)
    prompts, metadata = trainer.data.prompts[:3], trainer.data.metadata[:3]
    never = "a phrase no reflection holds"
    first, first_notes, none = evaluated(policy, None, prompts, metadata, tmp_path / "first")
    one, _, _ = evaluated(policy, Reflection(1, 2, never, 0.5), prompts, metadata, tmp_path / "one")
    two, notes, written = evaluated(policy, Reflection(2, 2, never, 0.5), prompts, metadata, tmp_path / "two")
    assert not none and first_notes == [None] * 3  # the first image alone: nothing written
    # two rounds over batches of 2 + 1 samples, each round a reflection per sample and a revision
    assert [len(w) for w in written] == [2, 2, 1, 1]
    assert all(n.startswith("1: ") and " | 2: " in n for n in notes)
    for f, o, t in zip(first, one, two):  # the score is the last revision's, not the first image's
        assert f != pytest.approx(o, abs=1e-7) and o != pytest.approx(t, abs=1e-7)
    # the gallery shows what was written beside each final image
    _, rows = gallery_from_evals([tmp_path / "two"], ["two rounds"])
    assert [r.cells[0].reason for r in rows] == notes
    # a stop reflection ends the loop: the image it judged is final
    stop = written[0][0]  # sample 0's first reflection
    assert stop.strip()
    early, early_notes, _ = evaluated(policy, Reflection(2, 2, stop, 0.5), prompts, metadata, tmp_path / "stop")
    assert early[0] == pytest.approx(first[0], abs=1e-7) and early_notes[0] == f"1: {stop}"
    firsts = written[0] + written[2]  # each sample's round-1 reflection
    for i in (1, 2):  # the others go on as before, unless they happened to say it too
        assert early[i] == pytest.approx(first[i] if stop.lower() in firsts[i].lower() else two[i], abs=1e-7)


def test_first_image_only_evaluation_is_an_option(tmp_path_factory):
    trainer = build_trainer(load_config(RECIPE, [*one_step(RECIPE, tmp_path_factory.mktemp("first") / "run"),
                                                 f"model.path={MODEL}", "trainer.eval_first_image_only=true"]))
    assert trainer.policy.reflection is None


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A one-step run of the tiny recipe whose weights moved (brightness differs between siblings' images
    where vvr scores 0 on the untrained twin), 2 rounds of 2-token reflections that never stop."""
    out = tmp_path_factory.mktemp("saved") / "run"
    assert cli_main(["train", str(RECIPE), *one_step(RECIPE, out), f"model.path={MODEL}", "trainer.max_new_tokens=2",
                     "trainer.rounds=2",
                     "trainer.stop_phrase=a phrase no reflection holds", "rewards=[{name: brightness, weight: 1.0}]",
                     "trainer.lr=0.01"]) == 0
    return out


def test_evaluate_runs_a_saved_runs_reflection_loop(saved_run, tmp_path):
    """``flowalign evaluate --adapter RUN`` on a unified family: the unified policy with the run's language LoRA,
    evaluated by the run's reflection loop (its rounds, length, stop phrase, evaluation temperature); a
    checkpoint folder is the same, and the flags override the run's settings."""
    checkpoint = saved_run / "checkpoints" / "step-000001"
    common = ["evaluate", "--model", str(MODEL), "--bench", "vvr", "--n", "2", "--steps", "2", "--guidance", "1.0",
              "--batch-size", "2"]
    for name, extra in (("run", ["--adapter", str(saved_run)]), ("checkpoint", ["--adapter", str(checkpoint)]),
                        ("one", ["--adapter", str(checkpoint), "--rounds", "1"])):
        assert cli_main([*common, *extra, "--out", str(tmp_path / name)]) == 0, name
    read = lambda name: [json.loads(line) for line in (tmp_path / name / "results.jsonl").read_text().splitlines()]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["reflection"] == {"rounds": 2, "max_new_tokens": 2, "stop_phrase": "a phrase no reflection holds",
                                     "temperature": 0.5}
    run, checkpoint_rows, one = (read(n) for n in ("run", "checkpoint", "one"))
    assert all(r["notes"]["reflections"].startswith("1: ") and " | 2: " in r["notes"]["reflections"] for r in run)
    assert [r["notes"] for r in run] == [r["notes"] for r in checkpoint_rows]
    for r, c in zip(run, checkpoint_rows):  # the same final images
        assert (tmp_path / "run" / r["file"]).read_bytes() == (tmp_path / "checkpoint" / c["file"]).read_bytes()
    assert all(" | 2: " not in r["notes"]["reflections"] for r in one)  # --rounds 1
    # the policy holds the checkpoint's tensors, both roles (and they moved in training)
    args = argparse.Namespace(model=str(MODEL), adapter=str(saved_run), device="cpu", dtype="fp32", ema=False)
    policy = load_policy(args)
    saved = load_file(str(checkpoint / "reflection_lora.safetensors"))
    mine = policy.language_adapter()
    assert set(saved) == set(mine) and all(torch.equal(saved[k], mine[k].detach()) for k in saved)
    assert max(v.abs().max().item() for k, v in saved.items() if "lora_B" in k) > 0
    flow = {k: v for k, v in load_file(str(checkpoint / "trainable.safetensors")).items() if k.startswith("flow.")}
    state = policy.trainable.state_dict()
    assert flow and all(torch.equal(flow[k], state[k]) for k in flow)
    assert max(v.abs().max().item() for k, v in flow.items() if "lora_B" in k) > 0


def test_evaluate_runs_the_base_models_own_loop_without_an_adapter(tmp_path):
    """A unified model before any training is evaluated by its own loop when ``--rounds`` is given (the base
    of a umm_reflection run): R rounds of reflections in the results; ``--rounds 0`` scores its first image
    alone; without the flags the model is the editing family it is, which needs input images."""
    common = ["evaluate", "--model", str(MODEL), "--bench", "vvr", "--n", "2", "--steps", "2", "--guidance", "1.0",
              "--batch-size", "2", "--stop-phrase", "a phrase no reflection holds", "--reflection-tokens", "2"]
    for rounds in ("0", "2"):
        assert cli_main([*common, "--rounds", rounds, "--out", str(tmp_path / rounds)]) == 0, rounds
    read = lambda name: [json.loads(line) for line in (tmp_path / name / "results.jsonl").read_text().splitlines()]
    looped, first = read("2"), read("0")
    assert all(r["notes"]["reflections"].startswith("1: ") and " | 2: " in r["notes"]["reflections"] for r in looped)
    assert all("reflections" not in r.get("notes", {}) for r in first)
    assert json.loads((tmp_path / "2" / "metrics.json").read_text())["reflection"]["rounds"] == 2
    args = argparse.Namespace(model=str(MODEL), adapter=None, device="cpu", dtype="fp32", ema=False, rounds=None,
                              max_new_tokens=None, reflection_tokens=None, stop_phrase=None,
                              reflection_temperature=None)
    assert not hasattr(load_policy(args), "reflection")  # no flags: the editing model itself


def test_reflection_flags_are_refused_for_a_family_that_cannot_write(tmp_path, capsys):
    code = cli_main(["evaluate", "--model", str(REPO / "assets" / "tiny-sd3-vvr"), "--adapter", str(tmp_path),
                     "--rounds", "2", "--n", "1", "--out", str(tmp_path / "out")])
    assert code == 2 and "--rounds: the sd3 family cannot write about its images" in capsys.readouterr().err


def test_revisions_sample_the_authors_floored_flow_transition(trained):
    """The revisions' SDE is the authors' (``flow_grpo_floored``, η 1.0, the recipe's and the default): the stored
    log-prob of a trained step is that step's re-evaluated at the sampling weights, and the former form
    (``revision_sampler: flow_grpo``) takes Flow-GRPO's 0.7 when no noise level is given."""
    trainer, batch = trained
    assert trainer.sampler == "flow_grpo_floored" and trainer.noise_level == 1.0
    rev = batch.rounds[0].revisions[0]
    chunk = rev.rollout
    assert chunk.sampler == "flow_grpo_floored" and chunk.noise_level == 1.0
    (k,) = chunk.trained_steps()
    x_k, x_next, stored = chunk.step(k)
    with torch.no_grad():
        v = trainer.unified.editor.velocity(x_k, chunk.sigmas[k].item(), chunk.cond, chunk.guidance_scale)
    again = sde_step("flow_grpo_floored", v, x_k, chunk.sigmas[k].item(), chunk.sigmas[k + 1].item(), noise_level=1.0,
                     prev_sample=x_next)
    torch.testing.assert_close(again.log_prob, stored.to(again.log_prob), rtol=1e-5, atol=1e-5)
    former = trainer.tcfg.model_copy(update={"revision_sampler": "flow_grpo", "noise_level": None})
    assert UMMReflectionTrainer.noise_level.fget(SimpleNamespace(tcfg=former)) == 0.7
    assert UMMReflectionTrainer.noise_level.fget(
        SimpleNamespace(tcfg=former.model_copy(update={"revision_sampler": "flow_grpo_floored"}))) == 1.0
