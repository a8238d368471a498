"""The streaming trainers on a causal Wan generator (Self-Forcing / LongLive's architecture, whose own sampler
re-noises every step): each trains two steps and resumes bit-exactly; KVPO scores branches by the clean
predictions their re-noised steps took (ratio 1 at the first update); AR-CoPO's deterministic replay is refused
there in one line."""

from __future__ import annotations

import json

import pytest
import torch

from flowalign.errors import UserError
from flowalign.train import build_trainer

from .conftest import small_config
from .resume_check import assert_trains_and_resumes_bit_exactly
from .test_afd import write_teacher_videos
from .test_ar_copo import STREAM as AR_COPO
#: KVPO routing in frames, as the authors route LongLive's cache: of the twin's 9 frames (3 chunks of 3, no window,
#: no sink) chunk 2 reads frame 5 (its 4 nearest frames count its own 3) and one drawn of frames 0..1
KVPO = ("trainer.name=kvpo", "trainer.num_steps=2", "model.finetune=lora", "trainer.nearest_frames=4",
        "trainer.older_frames=1")


@pytest.fixture(scope="module")
def causal_dir(tiny_model_dir):
    return tiny_model_dir("causal_wan")


@pytest.fixture(scope="module")
def long_teacher_dir(tmp_path_factory):
    """Teacher videos as long as the causal twin's (17 frames)."""
    return write_teacher_videos(tmp_path_factory.mktemp("teacher17"), frames=17)


def test_kvpo_scores_re_noised_branches_by_the_predictions_they_took(tmp_path, causal_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "run", causal_dir, prompt_file, *KVPO))
    batch = t.collect(0)
    states, taken, sigmas = batch.groups[0].states[0], batch.groups[0].taken[0], t.policy.sigmas(2)
    # the first step re-noised x̂0 = x − σ·u with fresh noise ε: taken as stored, ε is not the state it left
    # (the jump (x' − x)/(σ' − σ) of a re-noised step would give ε = x exactly)
    x, x_next, s, s_next = states[:, 0], states[:, 1], sigmas[0], sigmas[1]
    eps = (x_next - (1 - s_next) * (x - s * taken[:, 0])) / s_next
    assert abs(torch.corrcoef(torch.stack([eps.flatten(), x.flatten()]))[0, 1]) < 0.2
    assert abs(eps.std().item() - 1) < 0.2
    # π_old replayed the history the anchor stream wrote; the update writes it anew: the same cache
    assert torch.equal(t.scores(batch.groups[0], grad=False).cpu(), batch.groups[0].old_scores)
    logs = t.update(batch, torch.Generator().manual_seed(0))
    assert logs["ratio_dev"] < 1e-5 and logs["grad_norm"] > 0


def test_kvpo_routes_a_causal_models_history_frame_by_frame(tmp_path, causal_dir, prompt_file):
    """Each branch's chunk 2 reads frame 5 and one drawn frame of 0..1, both drawn across the group; the routed
    branches differ from each other."""
    t = build_trainer(small_config(tmp_path / "run", causal_dir, prompt_file, *KVPO))
    assert t.route_chunks == [2]
    batch = t.collect(0)
    for group in batch.groups:
        assert {r.frames for r in group.routings} == {(0, 5), (1, 5)}
        assert not torch.allclose(group.states[0][0, -1], group.states[0][1, -1])
    assert batch.logs["kvpo/kept_fraction"] == pytest.approx(2 / 6)


@pytest.mark.parametrize("trainer", ["kvpo", "ar_copo", "afd"])
def test_trains_and_resumes_bit_exactly(tmp_path, causal_dir, prompt_file, long_teacher_dir, trainer):
    extra = {"kvpo": KVPO, "ar_copo": AR_COPO,
             "afd": ("trainer.name=afd", "trainer.num_steps=2", "model.finetune=lora", "trainer.train_timesteps=1",
                     f"trainer.teacher={{videos: '{long_teacher_dir}'}}")}[trainer]
    assert_trains_and_resumes_bit_exactly(tmp_path, causal_dir, prompt_file, *extra)


def test_ar_copos_deterministic_replay_is_refused_on_a_re_noising_model(tmp_path, causal_dir, prompt_file):
    with pytest.raises(UserError, match="anchor=candidates"):
        build_trainer(small_config(tmp_path / "run", causal_dir, prompt_file, *AR_COPO, "trainer.anchor=center"))


def test_ar_copos_candidates_share_their_centres_solver_noise(tmp_path, causal_dir, prompt_file):
    """The paper's controlled noise sharing on a re-noising model: the candidates of a fork differ in their chunk's
    initial noise only; the fresh noise of each step is their centre's, the same for all of them."""
    t = build_trainer(small_config(tmp_path / "run", causal_dir, prompt_file, *AR_COPO))
    groups, _ = t.forks(0)
    sigma = t.policy.sigmas(2)[1]
    for group in groups:
        eps = (group.states[:, 1] - (1 - sigma) * group.x0[:, 0]) / sigma  # (G, C, f, H, W): each step-0 draw
        assert torch.allclose(eps, eps[:1].expand_as(eps), atol=1e-4)
        assert not torch.allclose(group.states[:, 0], group.states[:1, 0].expand_as(group.states[:, 0]))


def test_sequence_parallelism_is_refused_for_a_streaming_model(causal_dir):
    """Before anything is sharded: a split sequence cannot carry the KV cache the policy hands each block."""
    import pipelines
    from flowalign.config import ParallelSection
    from flowalign.parallel import DDP
    from flowalign.trainers.optim import setup_optimisation

    policy = pipelines.load(causal_dir, lora={"rank": 2, "alpha": 2.0})
    parallel = DDP(ParallelSection(sequence_parallel=2), world=2, rank=0, device="cpu")
    with pytest.raises(UserError, match="sequence_parallel=2: a streaming model"):
        setup_optimisation(policy, None, parallel)


def test_ar_copo_streams_a_group_in_fork_batches_with_the_same_candidates(tmp_path, causal_dir, prompt_file):
    """``fork_batch``: fewer candidates streamed at once (fewer caches held), the same candidates, states and
    clean predictions: each stream's noise and draws are its own."""
    whole = build_trainer(small_config(tmp_path / "a", causal_dir, prompt_file, *AR_COPO)).forks(0)[0]
    parts = build_trainer(small_config(tmp_path / "b", causal_dir, prompt_file, *AR_COPO,
                                       "trainer.fork_batch=3")).forks(0)[0]
    for a, b in zip(whole, parts):
        assert a.chunk == b.chunk and a.candidates.shape[0] == 4
        for x, y in ((a.candidates, b.candidates), (a.states, b.states), (a.x0, b.x0)):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.advantages, b.advantages, atol=2e-3, rtol=0)  # decoded in other batches


@pytest.mark.parametrize("trainer", ["kvpo", "ar_copo"])
def test_checkpointed_chunk_calls_give_the_same_update(tmp_path, causal_dir, prompt_file, trainer, monkeypatch):
    """With ``model.gradient_checkpointing`` each differentiated chunk call is recomputed in the backward pass
    (:mod:`flowalign.trainers.parts.stream_calls`): the same update as keeping the whole graph."""
    from flowalign.trainers.parts import stream_calls

    extra = KVPO if trainer == "kvpo" else AR_COPO
    plain = build_trainer(small_config(tmp_path / "a", causal_dir, prompt_file, *extra))
    saved = build_trainer(small_config(tmp_path / "b", causal_dir, prompt_file, *extra,
                                       "model.gradient_checkpointing=true"))
    batch = plain.collect(0)
    wrapped, checkpoint = [], stream_calls.checkpoint
    monkeypatch.setattr(stream_calls, "checkpoint", lambda *a, **k: wrapped.append(1) or checkpoint(*a, **k))
    logs = [plain.update(batch, torch.Generator().manual_seed(0))]
    assert not wrapped  # the whole graph kept without gradient checkpointing
    logs.append(saved.update(batch, torch.Generator().manual_seed(0)))
    assert wrapped  # every differentiated chunk call recomputed with it
    assert logs[0]["grad_norm"] > 0
    assert logs[1]["grad_norm"] == pytest.approx(logs[0]["grad_norm"], rel=1e-5)
    for a, b in zip(plain.params, saved.params):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def segment_file(tmp_path_factory):
    """Prompts of two segments each (LongLive's interactive JSONL lines)."""
    path = tmp_path_factory.mktemp("segments") / "prompts.jsonl"
    rows = [["a red circle", "a red circle moving right"], ["a blue square", "a blue square moving up"]]
    path.write_text("".join(json.dumps({"prompts": r}) + "\n" for r in rows))
    return path


def test_kvpo_streams_that_switch_prompts(tmp_path, causal_dir, segment_file):
    """Their multi-prompt streams: the anchor and the branches switch to each prompt's second segment at frame 6
    (chunk 2, the routed chunk), whose prompt the routed chunk follows; the replay's history is the switched
    stream's (the first update has ratio 1, two steps train and resume bit-exactly)."""
    from flowalign.sampling import stream_rollout

    extra = (*KVPO, "trainer.switch_frames=[6]")
    t = build_trainer(small_config(tmp_path / "run", causal_dir, segment_file, *extra))
    batch = t.collect(0)
    for group in batch.groups:
        first, second = next(r for r in (["a red circle", "a red circle moving right"],
                                         ["a blue square", "a blue square moving up"]) if r[1] == group.prompt)
        assert group.chunk == 2 and group.history == [(0, first), (2, second)]
        # the update writes the history anew (recached at the switch): the cache the anchor stream wrote, to the bit
        assert torch.equal(t.scores(group, grad=False).cpu(), group.old_scores)
    logs = t.update(batch, torch.Generator().manual_seed(0))
    assert logs["ratio_dev"] < 1e-5 and logs["grad_norm"] > 0
    # the anchor streams switched: their chunk 2 is not the one-prompt stream's
    noise = t.policy.initial_noise(1, torch.Generator().manual_seed(0))
    one = stream_rollout(t.policy, ["a red circle"], num_steps=2, initial_noise=noise, decode=False)
    two = stream_rollout(t.policy, ["a red circle"], num_steps=2, initial_noise=noise, decode=False,
                         switches=t.segments.switches({"prompts": ["a red circle", "a red circle moving right"]}))
    assert not torch.allclose(one.chunks[2][:, -1], two.chunks[2][:, -1], atol=1e-3)
    assert_trains_and_resumes_bit_exactly(tmp_path / "resume", causal_dir, segment_file, *extra)


def test_switch_frames_need_segments_and_a_model_that_recaches(tmp_path, causal_dir, prompt_file, tiny_model_dir):
    with pytest.raises(UserError, match="prompt 1 of data.prompts has 1 prompt segment"):
        build_trainer(small_config(tmp_path / "a", causal_dir, prompt_file, *KVPO, "trainer.switch_frames=[6]"))
    from .test_kvpo import AUTHORS
    with pytest.raises(UserError, match="streams one prompt a video"):
        build_trainer(small_config(tmp_path / "b", tiny_model_dir("anyflow_far"), prompt_file, *AUTHORS,
                                   "trainer.switch_frames=[3]"))


def test_kvpo_scores_the_streaming_chunk_holding_the_routed_chunk(tmp_path, causal_dir, prompt_file):
    """``local_layout: [3, 6]`` (the twin's 9 frames as a first chunk of 3, then one of 6): the local signal of a
    branch routed at chunk 2 (frames 6..8) is the decoded frames 3..8 of its stream, the anchor's likewise."""
    t = build_trainer(small_config(tmp_path / "run", causal_dir, prompt_file, *KVPO, "trainer.local_layout=[3, 6]"))
    assert t.local_span(2) == slice(3, 9) and t.local_span(1) == slice(3, 9)
    lengths, score = [], t.score

    def recording(samples, *args, **kw):
        lengths.append(samples.shape[1])
        return score(samples, *args, **kw)

    t.score = recording
    t.collect(0)
    six = t.policy.decode(torch.zeros(1, *t.policy.latent_shape)[:, :, 3:9]).shape[1]
    assert lengths.count(six) == 2 * t.tcfg.prompts_per_step  # each group's branches, and its anchor


def test_kvpo_reads_drawn_frames_where_their_full_cache_slots_put_them(tmp_path, prompt_file):
    """A 9-frame resident cache full at the routed chunk 4 (frames 12..14): the pool their plan draws from is
    frames 6..7; their window reads the entries one chunk later (``pool_reads: code``, the default), 9..10, which
    the cache still holds; ``planned`` would need frames the cache has dropped, so nothing is routable."""
    from pipelines.tiny import save_tiny

    folder = tmp_path / "twin"
    save_tiny("causal_wan", folder, sampling={"num_frames": 29, "attention_window": 9, "sink_frames": 3})
    frames = ("trainer.name=kvpo", "trainer.num_steps=2", "model.finetune=lora", "trainer.nearest_frames=4",
              "trainer.route_chunks=[4]")
    t = build_trainer(small_config(tmp_path / "run", folder, prompt_file, *frames))
    assert t.frames.pool(4, 1) == [6, 7] and t.frames.shift(4) == 3
    batch = t.collect(0)
    assert {r.frames for g in batch.groups for r in g.routings} == {(0, 1, 2, 9, 10, 11)}
    with pytest.raises(UserError, match="nearest_frames"):
        build_trainer(small_config(tmp_path / "b", folder, prompt_file, *frames, "trainer.pool_reads=planned"))
