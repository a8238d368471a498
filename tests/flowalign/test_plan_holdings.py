"""flowalign plan counts what a trainer with a ``collect`` of its own holds, phase by phase
(:mod:`flowalign.plan_holdings`): checked against the tensors one step of each trainer's tiny recipe makes on
the CPU (Self-OPD's decoded branch candidates, KVPO's anchor streams, Diffusion-DPO's pairs, GARDO's reference
snapshot), and the plan's rows against an analytic count of the same buffers."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from flowalign.config import load_config
from flowalign.paths import REPO_ROOT
from flowalign.plan import (
    GB,
    Activations,
    inspect_model,
    memory_rows,
    plan_text,
    settings,
)
from flowalign.plan_holdings import self_opd_branched_steps
from flowalign.train import build_trainer
from tests.tiny_recipes import one_step

TINY = REPO_ROOT / "configs" / "tiny"
SAMPLING = "sampling, above the update's peak"
HELD = "rollouts of the step"


def _tiny(recipe: str, tmp_path, *overrides: str):
    path = TINY / f"{recipe}.yaml"
    return load_config(path, [*one_step(path, tmp_path / "run"), *overrides])


def _no_update_peak(model):
    """The model with no activations, so the sampling row shows everything the sampling phases hold above
    what the step keeps through the update (the gradients aside)."""
    return replace(model, activations=Activations(0.0, 0.0, 0.0, 0.0), decode=0.0)


def _record_decodes(trainer) -> list[int]:
    """Bytes of every ``policy.decode`` output from now on (the policy's own decode stays in place)."""
    seen: list[int] = []
    decode = trainer.policy.decode

    def recorded(x0):
        out = decode(x0)
        seen.append(out.nbytes)
        return out

    trainer.policy.decode = recorded
    return seen


def _record_scored(trainer) -> list[int]:
    """Bytes of the samples each ``trainer.score`` call receives."""
    seen: list[int] = []
    score = trainer.score

    def recorded(samples, *args, **kwargs):
        seen.append(samples.nbytes)
        return score(samples, *args, **kwargs)

    trainer.score = recorded
    return seen


def _row_difference(model, s, a, b, row):
    return memory_rows(model, a)[row] - memory_rows(model, b)[row]


# ---------------------------------------------------------------------------------------------- Self-OPD


@pytest.mark.parametrize("trunk,trunks,per_state", [
    ((), 1, 3),  # the tiny recipe's ODE trunk: its own deterministic branch
    (("trainer.trunks=2", "trainer.trunk_noise_level=0.7", "trainer.drop_flat=false"), 2, 4),  # SDE: K + 1 a state
], ids=["ode_trunk", "sde_trunks"])
def test_self_opd_counts_its_decoded_branch_candidates_at_the_scoring_peak(tmp_path, monkeypatch, trunk, trunks,
                                                                          per_state):
    monkeypatch.chdir(REPO_ROOT)
    sizes = ("trainer.prompts_per_step=2", "trainer.branch_steps=2", "trainer.num_steps=4",
             "trainer.max_step_fraction=1", "trainer.ema_decay=0", *trunk)
    cfg = _tiny("self_opd_vvr", tmp_path, "trainer.branches=3", *sizes)
    trainer = build_trainer(cfg)
    decodes, scored = _record_decodes(trainer), _record_scored(trainer)
    torch.manual_seed(0)
    batch = trainer.collect(0)
    model = inspect_model(cfg, REPO_ROOT / cfg.model.path)
    s = settings(cfg, "ddp", 1, model)
    n = len(trainer.branched_steps(0))
    assert n == self_opd_branched_steps(trainer.tcfg) == 2  # the planner draws as many states as the trainer
    candidates = 2 * trunks * n * per_state  # prompts x trunks x branched states x (branches [+ deterministic])
    d = model.rollout.decoded
    # the trunks' decodes and the candidates', as the plan sizes a sample
    assert sum(decodes) == (2 * trunks + candidates) * d
    assert scored == [candidates * d]  # every candidate scored at once: their concatenation
    assert len(batch.sets) == 2 * trunks * n and all(not b.branches.is_cuda for b in batch.sets)
    # through the update: the trunks alone; at the scoring peak: the candidates twice (the list, its concatenation)
    bare = _no_update_peak(model)
    rows = memory_rows(bare, s)
    assert rows[HELD] == pytest.approx(s.rollout_bytes(model.rollout)) and s.samples == 2 * trunks
    grads = rows["gradients"]
    assert rows[SAMPLING] == pytest.approx(max(0.0, 2 * candidates * d - grads))
    # each further branch adds exactly its two decoded copies per branched state and trunk
    more = settings(load_config(TINY / "self_opd_vvr.yaml", [*one_step(TINY / "self_opd_vvr.yaml", tmp_path / "r2"),
                                                             "trainer.branches=4", *sizes]), "ddp", 1, model)
    assert _row_difference(bare, s, more, s, SAMPLING) == pytest.approx(2 * 2 * trunks * n * d)
    # the update's own peak absorbs them when it is higher
    assert memory_rows(replace(bare, decode=0.0, activations=Activations(GB, 0, 0, 0)), s)[SAMPLING] == 0.0


def test_self_opd_draws_no_more_states_than_have_positive_odds():
    from flowalign.trainers.self_opd import SelfOPDConfig

    tcfg = SelfOPDConfig(num_steps=10, branch_steps=4, max_step_fraction=0.5, step_weights=[1.0, 0.0, 2.0])
    assert self_opd_branched_steps(tcfg) == 2
    assert self_opd_branched_steps(tcfg.model_copy(update={"step_weights": []})) == 4
    assert self_opd_branched_steps(tcfg.model_copy(update={"step_weights": [], "branch_steps": 9})) == 5


# ---------------------------------------------------------------------------------------------- KVPO


@pytest.mark.parametrize("advantage", ["anchor", "group"])
def test_kvpo_counts_its_anchor_streams_beside_the_decoded_branches(advantage, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    # the group advantage from the earlier form's recipe (the authors' recipe pins options only anchor reads)
    recipe = "kvpo_motion" if advantage == "anchor" else "kvpo_energy_motion"
    cfg = _tiny(recipe, tmp_path, "trainer.prompts_per_step=2", "trainer.group_size=3",
                "trainer.num_steps=2", f"trainer.advantage={advantage}")
    trainer = build_trainer(cfg)
    module = sys.modules[type(trainer).__module__]
    anchors = []
    stream = module.stream_rollout

    def recorded(policy, prompts, *args, **kwargs):
        out = stream(policy, prompts, *args, **kwargs)
        if kwargs.get("prefix") is None:
            anchors.append(out)
        return out

    monkeypatch.setattr(module, "stream_rollout", recorded)
    decodes, scored = _record_decodes(trainer), _record_scored(trainer)
    torch.manual_seed(0)
    batch = trainer.collect(0)
    model = inspect_model(cfg, REPO_ROOT / cfg.model.path)
    s = settings(cfg, "ddp", 1, model)
    # one anchor stream per prompt: every chunk's T + 1 latents, as the plan sizes a latent
    assert len(anchors) == 2 and all(len(a) == 1 for a in anchors)
    assert sum(c.nbytes for a in anchors for c in a.chunks) == pytest.approx(2 * 3 * model.rollout.latent)
    d = model.rollout.decoded
    videos = 2 * 3 + (2 if advantage == "anchor" else 0)  # the branches', and the anchors' under the anchor advantage
    assert sum(decodes) == pytest.approx(videos * d)
    assert sum(scored) == pytest.approx(videos * d)
    # the branch batch lives in CPU memory: nothing of the step is kept on the device through the update
    assert all(not t.is_cuda for g in batch.groups for t in (g.prefix, *g.states))
    bare = _no_update_peak(model)
    rows = memory_rows(bare, s)
    assert rows[HELD] == 0.0
    # each anchor keeps its KV caches (as the model's policy sizes them) while the branches are scored
    assert model.rollout.kv_cache > 0
    anchor = 2 * (3 * model.rollout.latent + model.rollout.conditioning + model.rollout.kv_cache)
    branch_videos = 2 * 2 * 3 * d  # kept in a list, then concatenated
    scoring = anchor + branch_videos + (2 * d if advantage == "anchor" else 0)
    # while the branches stream: the anchor, the streamed branch's own caches and the videos decoded so far
    streaming = anchor + 2 * model.rollout.kv_cache + 2 * 3 * d
    assert rows[SAMPLING] == pytest.approx(max(0.0, max(scoring, streaming) - rows["gradients"]))


def test_kvpo_anchor_is_counted_once_per_prompt():
    """Doubling the prompts doubles the anchors and the branch videos, nothing else."""
    cfg = load_config(TINY / "kvpo_motion.yaml", ["trainer.prompts_per_step=1"])
    model = _no_update_peak(inspect_model(cfg, REPO_ROOT / cfg.model.path))
    s = settings(cfg, "ddp", 1, model)
    one, two = (memory_rows(model, replace(s, prompts_per_step=p))[SAMPLING] + memory_rows(model, s)["gradients"]
                for p in (1, 2))
    assert two == pytest.approx(2 * one) and one > 0


# ---------------------------------------------------------------------------------------------- Diffusion-DPO


def _pairs_file(tmp_path, n: int = 2) -> str:
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        for kind in ("chosen", "rejected"):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(tmp_path / f"{kind}{i}.png")
        rows.append({"prompt": f"a red circle {i}", "chosen": f"chosen{i}.png", "rejected": f"rejected{i}.png"})
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(tmp_path / "prefs.jsonl")


def _pair_bytes(batch) -> tuple[int, int]:
    return batch.x_w.nbytes + batch.x_l.nbytes, sum(t.nbytes for t in batch.cond.tensors.values())


def _measured_units(model, trainer, prompts: list[str]):
    """The model with one sample's latent, conditioning and decoded sample as the policy makes them (the
    tiny SD3's VAE halves four times, not eight, and its CLIP length is its own: the units are taken from
    the policy so that what is compared is what the step holds, not the family's shapes)."""
    from flowalign.plan import Rollout

    rollout = trainer.sample(prompts[:1] * 2, [{}, {}], torch.tensor([0, 0]), torch.tensor([0, 0]), 0).chunks[0]
    latent = rollout.latents[:1, 0].nbytes
    cond = sum(t[:1].nbytes for t in rollout.cond.tensors.values())
    return replace(model, rollout=Rollout(latent, cond, rollout.samples[:1].nbytes))


def test_diffusion_dpo_with_offline_pairs_holds_its_pairs_not_rollouts(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    cfg = _tiny("diffusion_dpo_vvr", tmp_path, "trainer.prompts_per_step=2", "trainer.group_size=8",
                f"trainer.pairs={_pairs_file(tmp_path)}", "rewards=[]")
    trainer = build_trainer(cfg)
    batch = trainer.collect(0)
    model = _no_update_peak(_measured_units(inspect_model(cfg, REPO_ROOT / cfg.model.path), trainer, ["a red circle"]))
    s = settings(cfg, "ddp", 1, model)
    latents, cond = _pair_bytes(batch)
    assert len(batch.seeds) == 2
    assert s.samples == 0  # no rollout is drawn (it was P x G)
    rows = memory_rows(model, s)
    assert rows[HELD] == pytest.approx(latents + cond)  # two latents and one conditioning a pair
    assert latents == pytest.approx(2 * 2 * model.rollout.latent)
    # while collecting: the two images of each pair at the model's size, float32, beside its latents
    assert rows[SAMPLING] == pytest.approx(max(0.0, 2 * 2 * model.rollout.decoded - rows["gradients"]))
    # and the encoder's peak for one image on top (encode_images encodes one at a time)
    encoding = memory_rows(replace(model, encode=GB), s)[SAMPLING]
    assert encoding == pytest.approx(2 * 2 * model.rollout.decoded + GB - rows["gradients"])
    out = plan_text(cfg, REPO_ROOT / cfg.model.path, 1, 80)
    assert "rollouts a step per rank" not in out and HELD in out


def test_diffusion_dpo_online_keeps_the_pairs_through_the_update_and_the_rollouts_while_picking(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    # brightness varies within every group, so each prompt gives a pair
    cfg = _tiny("diffusion_dpo_vvr", tmp_path, "trainer.prompts_per_step=2", "trainer.group_size=4",
                "rewards=[{name: brightness, weight: 1.0}]")
    trainer = build_trainer(cfg)
    torch.manual_seed(0)
    batch = trainer.collect(0)
    model = _no_update_peak(_measured_units(inspect_model(cfg, REPO_ROOT / cfg.model.path), trainer, ["a red circle"]))
    s = settings(cfg, "ddp", 1, model)
    assert s.samples == 8
    latents, cond = _pair_bytes(batch) if batch.cond is not None else (0, 0)
    per_pair = 2 * model.rollout.latent + model.rollout.conditioning
    assert len(batch.seeds) == 2 and latents + cond == pytest.approx(len(batch.seeds) * per_pair)  # a pair a prompt at most
    rows = memory_rows(model, s)
    assert rows[HELD] == pytest.approx(2 * per_pair)
    # picking: all 8 rollouts, their final latents and conditioning concatenated, and the pairs cut from them
    picking = s.rollout_bytes(model.rollout) + 8 * (model.rollout.latent + model.rollout.conditioning) + 2 * per_pair
    assert rows[SAMPLING] == pytest.approx(max(0.0, picking - rows[HELD] - rows["gradients"]))


# ---------------------------------------------------------------------------------------------- GARDO


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gardo_reference_snapshot_is_held_all_along_and_swapped_in_only_with_a_kl(beta, tmp_path, monkeypatch):
    """The snapshot is a copy of the trained tensors from the start, so it is counted with the copies every
    phase holds (the update's peak included); the live copy swapped_in keeps exists only while its passes run
    (a KL), outside the update, so it adds to the sampling peak alone."""
    monkeypatch.chdir(REPO_ROOT)
    cfg = _tiny("gardo_vvr", tmp_path, f"trainer.beta={beta}", "trainer.ema_decay=0")
    trainer = build_trainer(cfg)
    module = sys.modules[type(trainer).__module__]
    swaps = []
    swapped_in = module.swapped_in

    def recorded(params, tensors):
        swaps.append(sum(p.nbytes for p in params))
        return swapped_in(params, tensors)

    monkeypatch.setattr(module, "swapped_in", recorded)
    torch.manual_seed(0)
    trainer.train_step()
    model = inspect_model(cfg, REPO_ROOT / cfg.model.path)
    s = settings(cfg, "ddp", 1, model)
    snapshot = sum(t.nbytes for t in trainer.reference)
    assert snapshot == model.trainable * 4  # the LoRA's tensors, float32
    rows = memory_rows(model, s)
    assert rows["reference / EMA copies"] == pytest.approx(snapshot)
    assert s.swapped_in is (beta > 0) and bool(swaps) is (beta > 0)
    assert all(b == snapshot for b in swaps)
    above = replace(model, decode=10 * GB)
    assert _row_difference(above, s, s, replace(s, swapped_in=False), SAMPLING) == pytest.approx(snapshot if beta else 0)


@pytest.mark.parametrize("overrides", [(), ("trainer.timestep_fraction=0.5",),
                                       ("trainer.steps_per_chunk=1", "trainer.updates_per_epoch=1")])
def test_gardo_keeps_its_reference_means_through_the_update(overrides, tmp_path, monkeypatch):
    """With a KL every sample's reference step means (float32 latents, one per trained step) are computed
    before the update and kept through it: the plan holds as many as the trainer stores."""
    from flowalign.plan import Rollout

    monkeypatch.chdir(REPO_ROOT)
    # brightness varies within every group: every chunk has advantages, so every chunk's means are stored
    cfg = _tiny("gardo_vvr", tmp_path, "trainer.beta=0.04", "trainer.ema_decay=0", "trainer.prompts_per_step=2",
                "trainer.group_size=2", "trainer.num_steps=4", "trainer.main_reward=brightness",
                "rewards=[{name: brightness, weight: 1.0}, {name: vvr_soft, weight: 0.0}]", *overrides)
    trainer = build_trainer(cfg)
    torch.manual_seed(0)
    batch = trainer.collect(0)
    plan = trainer.plan(batch, torch.Generator().manual_seed(0))
    stored = {id(t): t for t in (batch.prepared or {}).values()}
    stored.update({id(u.reference): u.reference for units in plan.steps for u in units if u.reference is not None})
    chunk = batch.chunks[0]
    latent = chunk.latents[:1, 0].nbytes
    n = type(trainer).reference_steps(trainer.tcfg)
    assert sum(t.nbytes for t in stored.values()) == 2 * 2 * n * latent
    model = inspect_model(cfg, REPO_ROOT / cfg.model.path)
    model = _no_update_peak(replace(model, rollout=Rollout(latent, model.rollout.conditioning, model.rollout.decoded)))
    s = settings(cfg, "ddp", 1, model)
    rows = memory_rows(model, s)
    assert rows[HELD] == pytest.approx(s.rollout_bytes(model.rollout) + 2 * 2 * n * latent)
    # computing them runs under the swapped-in snapshot: the live copy above what the update keeps
    assert rows[SAMPLING] == pytest.approx(max(0.0, model.trainable * 4 - rows["gradients"]))


def test_the_encode_peak_is_sized_only_for_a_trainer_that_encodes_images(tmp_path):
    """Offline pairs encode images: one image's encoder peak, sized on the meta device as the real encoder
    allocates it on the CPU (every tensor made during the pass, the live ones at their most); online pairs and
    Flow-GRPO encode none (0)."""
    from flowalign.plan import _LiveBytes, build_on_meta, encode_peak_bytes

    offline = load_config(TINY / "diffusion_dpo_vvr.yaml", [f"trainer.pairs={_pairs_file(tmp_path)}", "rewards=[]"])
    model = inspect_model(offline, REPO_ROOT / offline.model.path)
    assert model.encode > 0
    for recipe in ("diffusion_dpo_vvr", "flow_grpo_vvr"):
        cfg = load_config(TINY / f"{recipe}.yaml")
        assert inspect_model(cfg, REPO_ROOT / cfg.model.path).encode == 0.0
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(REPO_ROOT / offline.model.path / "vae").eval()
    size = 64  # the tiny model's
    live = _LiveBytes()
    with torch.no_grad(), live:
        vae.encode(torch.rand(1, 3, size, size))
    meta = build_on_meta(REPO_ROOT / offline.model.path)["vae"]
    assert model.encode == encode_peak_bytes(meta, (1, 3, size, size), torch.float32) == live.peak


# ---------------------------------------------------------------------------------------------- Flow-GRPO family


def _stored_means(trainer, batch) -> list[torch.Tensor]:
    """Every reference step mean the step keeps: those prepared while scoring and those ``plan`` computed."""
    plan = trainer.plan(batch, torch.Generator().manual_seed(0))
    stored = {id(t): t for t in (batch.prepared or {}).values()}
    stored.update({id(u.reference): u.reference for units in plan.steps for u in units if u.reference is not None})
    return list(stored.values())


@pytest.mark.parametrize("recipe, overrides", [
    ("flow_grpo_vvr", ()),
    ("flow_grpo_vvr", ("trainer.timestep_fraction=0.5", "trainer.sde_last_step=false")),
    ("dance_grpo_vvr", ()),
    ("mix_grpo_vvr", ("trainer.window_size=2",)),
    ("flash_grpo_vvr", ()),
])
def test_the_flow_grpo_family_keeps_its_reference_means_with_a_kl(recipe, overrides, tmp_path, monkeypatch):
    """With ``beta > 0`` every sample's KL reference step means (one float32 latent per trained step) are kept
    through the update: the plan of the same recipe with ``beta: 0`` is lower by exactly what one real step on
    the CPU stores, and under fsdp (where the loss computes them) by nothing."""
    from flowalign.plan import Rollout

    monkeypatch.chdir(REPO_ROOT)
    # brightness varies within every group: every chunk has advantages, so every chunk's means are stored
    common = ("trainer.ema_decay=0", "trainer.prompts_per_step=2", "trainer.group_size=2", "trainer.num_steps=4",
              "trainer.inner_epochs=1", "rewards=[{name: brightness, weight: 1.0}]", *overrides)
    cfg = _tiny(recipe, tmp_path, "trainer.beta=0.04", *common)
    trainer = build_trainer(cfg)
    torch.manual_seed(0)
    batch = trainer.collect(0)
    means = _stored_means(trainer, batch)
    latent = batch.chunks[0].latents[:1, 0].nbytes
    n = type(trainer).reference_steps(trainer.tcfg)
    assert len(means) and sum(t.nbytes for t in means) == 2 * 2 * n * latent
    assert {t.dtype for t in means} == {torch.float32}
    model = inspect_model(cfg, REPO_ROOT / cfg.model.path)
    model = replace(model, rollout=Rollout(latent, model.rollout.conditioning, model.rollout.decoded))
    without = _tiny(recipe, tmp_path, "trainer.beta=0", *common)
    for strategy, kept in (("ddp", sum(t.nbytes for t in means)), ("fsdp", 0)):
        with_kl, no_kl = (sum(memory_rows(model, settings(c, strategy, 2, model)).values()) for c in (cfg, without))
        assert with_kl - no_kl == pytest.approx(kept)


def test_tempflow_every_step_holds_a_rollout_per_branch_and_step(tmp_path, monkeypatch):
    """``branching: every_step`` rolls out ``group_size`` branches at each of the ``|K|`` branching steps of a
    prompt: the plan holds as many rollouts as one real step draws (|K|·G a prompt, not G), and with a KL one
    reference step mean each (its one SDE step)."""
    monkeypatch.chdir(REPO_ROOT)
    cfg = _tiny("tempflow_grpo_vvr", tmp_path, "trainer.beta=0.04", "trainer.ema_decay=0", "trainer.prompts_per_step=2",
                "trainer.group_size=2", "trainer.num_steps=4", "trainer.branch_steps=[0, 1, 2]", "trainer.inner_epochs=1",
                "rewards=[{name: brightness, weight: 1.0}]")
    trainer = build_trainer(cfg)
    torch.manual_seed(0)
    batch = trainer.collect(0)
    drawn = sum(len(c) for c in batch.chunks)
    assert drawn == 2 * 3 * 2
    means = _stored_means(trainer, batch)
    model = _no_update_peak(_measured_units(inspect_model(cfg, REPO_ROOT / cfg.model.path), trainer, ["a red circle"]))
    assert sum(t.nbytes for t in means) == drawn * model.rollout.latent  # one step a rollout
    s = settings(cfg, "ddp", 1, model)
    assert s.samples == drawn
    rows = memory_rows(model, s)
    assert rows[HELD] == pytest.approx(drawn * s.sample_bytes(model.rollout) + sum(t.nbytes for t in means))


@pytest.mark.parametrize("beta", [0.04, 0.0])
def test_flow_opd_keeps_its_teachers_step_means_through_the_update(beta, tmp_path, monkeypatch):
    """kl_reward_grpo stores, unsharded, the routed teacher's step mean at every trained (chunk, step), whatever
    ``beta``, and with ``beta > 0`` the reference's beside it: the plan holds as many float32 latents as one real
    step stores, and under fsdp (where the loss computes both) none."""
    monkeypatch.chdir(REPO_ROOT)
    common = ("trainer.ema_decay=0", "trainer.prompts_per_step=2", "trainer.group_size=2", "trainer.batch_size=2",
              "trainer.num_steps=4", "trainer.timestep_fraction=0.5")
    cfg = _tiny("flow_opd_kl_vvr", tmp_path, f"trainer.beta={beta}", *common)
    trainer = build_trainer(cfg)
    torch.manual_seed(0)
    batch = trainer.collect(0)
    plan = trainer.plan(batch, torch.Generator().manual_seed(0))
    teachers = {id(u.teacher): u.teacher for units in plan.steps for u in units if u.teacher is not None}
    references = {id(t): t for t in (batch.prepared or {}).values()}
    references.update({id(u.reference): u.reference for units in plan.steps for u in units if u.reference is not None})
    stored = [*teachers.values(), *references.values()]
    assert {t.dtype for t in stored} == {torch.float32}
    latent = batch.chunks[0].latents[:1, 0].nbytes
    n = type(trainer).reference_steps(trainer.tcfg)
    assert n == 2 and sum(t.nbytes for t in teachers.values()) == 2 * 2 * n * latent
    assert sum(t.nbytes for t in references.values()) == (2 * 2 * n * latent if beta else 0)
    model = _no_update_peak(_measured_units(inspect_model(cfg, REPO_ROOT / cfg.model.path), trainer, ["a red circle"]))
    for strategy, kept in (("ddp", sum(t.nbytes for t in stored)), ("fsdp", 0)):
        s = settings(cfg, strategy, 1, model)
        assert memory_rows(model, s)[HELD] == pytest.approx(s.rollout_bytes(model.rollout) + kept)


def test_flow_opd_velocity_distillation_holds_its_states_and_targets_not_rollouts(tmp_path, monkeypatch):
    """velocity_distillation stores no step mean (whatever ``beta``): through the update it keeps its batch of
    states and targets (``x``, the teachers' and the anchor's velocities, S a sample, and the conditionings),
    its rollouts gone with ``collect``; the plan holds exactly what one real step's batch holds."""
    monkeypatch.chdir(REPO_ROOT)
    cfg = _tiny("flow_opd_vvr", tmp_path, "trainer.beta=0.04", "trainer.cold_start_steps=0", "trainer.ema_decay=0",
                "trainer.prompts_per_step=2", "trainer.group_size=2", "trainer.batch_size=2", "trainer.num_steps=4",
                "trainer.states_per_sample=3")
    trainer = build_trainer(cfg)
    torch.manual_seed(0)
    batch = trainer.collect(0)
    assert batch.x.shape[:2] == (4, 3) and batch.v_anchor is not None
    targets = batch.x.nbytes + batch.v_teacher.nbytes + batch.v_anchor.nbytes
    cond = sum(t.nbytes for t in batch.cond.tensors.values())
    model = _no_update_peak(_measured_units(inspect_model(cfg, REPO_ROOT / cfg.model.path), trainer, ["a red circle"]))
    assert targets == 4 * 3 * 3 * model.rollout.latent and cond == 4 * model.rollout.conditioning
    for strategy in ("ddp", "fsdp"):
        rows = memory_rows(model, settings(cfg, strategy, 1, model))
        assert rows[HELD] == pytest.approx(targets + cond)


# ---------------------------------------------------------------------------------------------- DiffusionOPSD


def test_the_reward_gradient_through_the_decoder_is_sized_for_the_chunks_diffusion_opsd_backpropagates(
        tmp_path, monkeypatch):
    """DiffusionOPSD's targets take the reward's gradient through the VAE decoder, one training chunk at a time
    while the step's rollouts are held: the plan sizes that chunk's decode with grad and its backward on the
    meta device as the real decoder allocates it on the CPU (forward and backward, the live tensors at their
    most), adds it to that moment alone, and only where the direction is the reward's gradient."""
    from diffusers import AutoencoderKL

    from flowalign.plan import _LiveBytes, build_on_meta, decode_gradient_peak_bytes

    monkeypatch.chdir(REPO_ROOT)
    sizes = ("trainer.prompts_per_step=2", "trainer.group_size=2", "trainer.batch_size=2", "trainer.num_steps=2",
             "trainer.ema_decay=0")
    cfg = _tiny("diffusion_opsd_vvr", tmp_path, *sizes)
    trainer = build_trainer(cfg)
    rows_with_grad: list[int] = []
    decode = trainer.policy.decode

    def recorded(x0):
        if torch.is_grad_enabled() and x0.requires_grad:
            rows_with_grad.append(x0.shape[0])
        return decode(x0)

    trainer.policy.decode = recorded
    torch.manual_seed(0)
    trainer.plan(trainer.collect(0), torch.Generator().manual_seed(0))
    assert rows_with_grad and max(rows_with_grad) == trainer.training_batch(trainer.tcfg) == 2

    model = inspect_model(cfg, REPO_ROOT / cfg.model.path)
    vae = AutoencoderKL.from_pretrained(REPO_ROOT / cfg.model.path / "vae").eval().requires_grad_(False)
    latent = torch.zeros(2, vae.config.latent_channels, 16, 16, requires_grad=True)  # the tiny model's 64 px
    live = _LiveBytes()
    with live:
        torch.autograd.grad(vae.decode(latent, return_dict=False)[0].float().sum(), latent)
    meta = build_on_meta(REPO_ROOT / cfg.model.path)["vae"]
    assert model.reward_gradient == decode_gradient_peak_bytes(meta, tuple(latent.shape), torch.float32)
    # the CPU's backward kernels keep a few intermediates the meta ones do not (1.5 % here)
    assert model.reward_gradient == pytest.approx(live.peak, rel=0.02)
    assert model.reward_gradient > 2 * model.decode > 0  # grad keeps what a no-grad decode frees as it goes

    # the moment's excess is the chunk's peak; other directions and trainers take no reward gradient
    bare = _no_update_peak(model)
    random = _tiny("diffusion_opsd_vvr", tmp_path, *sizes, "trainer.direction=random")
    assert inspect_model(random, REPO_ROOT / cfg.model.path).reward_gradient == 0.0
    s, s_random = settings(cfg, "ddp", 1, model), settings(random, "ddp", 1, model)
    assert _row_difference(bare, s, s, s_random, SAMPLING) == pytest.approx(model.reward_gradient)
    flow_grpo = _tiny("flow_grpo_vvr", tmp_path)
    assert inspect_model(flow_grpo, REPO_ROOT / flow_grpo.model.path).reward_gradient == 0.0


# ---------------------------------------------------------------------------------------------- DanceGRPO loop


@pytest.mark.parametrize("recipe", ["dance_grpo_vvr", "pref_grpo_vvr"])
@pytest.mark.parametrize("step_draw,rows", [("per_sample", 1), ("per_batch", 4)])
def test_the_dance_loop_sizes_activations_for_the_rows_one_training_forward_takes(recipe, step_draw, rows, tmp_path,
                                                                                  monkeypatch):
    """DanceGRPO's and Pref-GRPO's samples train one by one at their own drawn steps (``step_draw: per_sample``):
    the plan sizes activations for one sample's forward, not the rollout batch's (a 9-edit Qwen-Image-Edit group
    would otherwise be planned at 9× its activations)."""
    monkeypatch.chdir(REPO_ROOT)
    cfg = _tiny(recipe, tmp_path, "trainer.prompts_per_step=2", "trainer.group_size=2", "trainer.batch_size=4",
                f"trainer.step_draw={step_draw}", "trainer.guidance_scale=1",
                'rewards=[{"name": "jpeg_compressibility"}]')  # varies within every group: every sample trains
    trainer = build_trainer(cfg)
    seen: list[int] = []
    velocity = trainer.policy.velocity

    def recorded(x, *args, **kwargs):
        if torch.is_grad_enabled():
            seen.append(x.shape[0])
        return velocity(x, *args, **kwargs)

    trainer.policy.velocity = recorded
    torch.manual_seed(0)
    trainer.train_step()
    assert seen and max(seen) == trainer.training_batch(trainer.tcfg) == rows
