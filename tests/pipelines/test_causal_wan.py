"""The causal Wan streaming family (Self-Forcing / LongLive) against the authors' inference pipeline.

Known answers (``known_answers/causal_wan_longlive.json`` and ``.safetensors``, provenance inside): LongLive's
``CausalInferencePipeline`` (the Self-Forcing pipeline with a local window and a frame sink) run unchanged on a
tiny ``CausalWanModel`` with seeded weights, every denoising call's input state and x0 prediction recorded, in
Self-Forcing's setting (global attention, three chunks), LongLive's (a 9-frame window with a 3-frame sink,
five chunks, so chunks 3 and 4 lose the frames between the sink and the window) and KVPO's perturbed window on
LongLive (six chunks; blocks 4 and 5 read the sink, the drawn frames 3..5 and their 6 nearest frames, which
chunk routing to {0, 1, 3} and {0, 1, 4} of the resident cache gives) and in their recipe's frames (seven chunks;
blocks 5 and 6 read the sink, the drawn frames 3, 5, 6, 9, 10 and their 4 nearest frames, three of them the block
being made: frame routing, :class:`flowalign.protocols.KeptFrames`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import pipelines
from flowalign.errors import UserError
from flowalign.protocols import Conditioning, KeptFrames
from flowalign.sampling.streaming import stream_rollout
from pipelines.causal_wan import CausalWanPolicy, attended_frames, convert_generator
from pipelines.tiny import save_tiny

KNOWN = Path(__file__).parent / "known_answers" / "causal_wan_longlive"
ANSWERS = json.loads(KNOWN.with_suffix(".json").read_text())
TENSORS = load_file(str(KNOWN.with_suffix(".safetensors")))


def authors_weights() -> dict[str, torch.Tensor]:
    """Their CausalWanModel's seeded weights (the rule in the provenance), in their names."""
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name in sorted(ANSWERS["weight_shapes"]):
        value = torch.randn(ANSWERS["weight_shapes"][name], generator=g) * 0.2
        if name.endswith("norm_q.weight") or name.endswith("norm_k.weight") or ".norm3.weight" in name:
            value = value + 1.0
        weights[f"model.{name}"] = value  # as their wrapper's state dict names them
    return weights


#: KVPO's routing in the perturbed settings: chunk → the history chunks (or frames) it reads
ROUTES = {"longlive_routed": {4: (0, 1, 3), 5: (0, 1, 4)},
          "longlive_frames": {5: KeptFrames((0, 1, 2, 3, 5, 6, 9, 10, 14)),
                              6: KeptFrames((0, 1, 2, 3, 5, 6, 9, 10, 17))},
          # their cache full at the first routed block: frames 9..13 selected, the entries of 12..16 read
          "longlive_full": {6: KeptFrames((0, 1, 2, 12, 13, 14, 15, 16, 17)),
                            7: KeptFrames((0, 1, 2, 12, 13, 14, 15, 16, 20))}}


def twin(tmp_path: Path, label: str, answers: dict = ANSWERS) -> CausalWanPolicy:
    """The tiny causal twin at the known answers' sizes (a setting of ``answers``), holding their weights."""
    setting = answers["settings"][label]
    window = None if setting["local_attn_size"] == -1 else setting["local_attn_size"]
    folder = tmp_path / label
    save_tiny("causal_wan", folder, transformer={"attention_head_dim": 16, "ffn_dim": 64, "freq_dim": 32,
                                                  "text_dim": 16},
              sampling={"height": 16, "width": 16, "num_frames": 2 * (setting["frames"] - 1) + 1,
                        "attention_window": window, "sink_frames": setting["sink_size"],
                        "global_sink": setting.get("global_sink", True),
                        "cache_frames": setting.get("cache_frames")})  # theirs: the window, or the training size
    policy = pipelines.load(folder)
    policy.transformer.load_state_dict(convert_generator(authors_weights()), strict=True)
    return policy


@pytest.mark.parametrize("label", ["self_forcing", "longlive", "longlive_routed", "longlive_frames", "longlive_full"])
def test_every_denoising_call_equals_the_authors_pipeline(tmp_path: Path, label: str) -> None:
    """Each chunk's four x0 predictions from the states their pipeline fed its generator (re-noised with their
    draws), each reading a cache this policy wrote from their clean chunks (routed where their perturbation
    was set): equal to theirs."""
    policy = twin(tmp_path, label)
    setting = ANSWERS["settings"][label]
    assert isinstance(policy, CausalWanPolicy) and policy.chunk_frames == [3] * (setting["frames"] // 3)
    sigmas = policy.sigmas(4)
    denoising = [c for c in setting["calls"] if c["t"] != 0.0]
    assert [c["t"] for c in denoising[:4]] == (sigmas[:4] * 1000).tolist()  # the timesteps they read, in float32
    cond = Conditioning({"prompt_embeds": TENSORS["prompt_embeds"]}, ["a", "b"])
    inputs, x0s = TENSORS[f"{label}.inputs"], TENSORS[f"{label}.x0"]
    cache, clean, worst = policy.empty_cache(2, 1.0), [], 0.0
    routes = ROUTES.get(label, {})
    for k in range(len(policy.chunk_frames)):
        cache = policy.reroute(cache, routes.get(k, range(k)))
        for i in range(4):
            call = 4 * k + i
            assert denoising[call]["start_frame"] == 3 * k
            x = inputs[call].permute(0, 2, 1, 3, 4)  # their (B, f, C, H, W) → (B, C, f, H, W)
            v = policy.chunk_velocity(x, sigmas[i].item(), sigmas[i + 1].item(), cache, cond, 1.0)
            x0 = (x - sigmas[i] * v).permute(0, 2, 1, 3, 4)
            worst = max(worst, (x0 - x0s[call]).abs().max().item())
        clean.append(x0s[4 * k + 3].permute(0, 2, 1, 3, 4))
        cache = policy.append_chunks(cache, torch.cat(clean, dim=2), cond, 1.0)
    assert worst < 1e-4, worst
    assert x0s.abs().mean() > 0.3  # the predictions are not near zero: the tolerance means something


def test_the_window_and_sink_matter_in_the_longlive_answers(tmp_path: Path) -> None:
    """Reading LongLive's chunk 4 with the whole history (Self-Forcing's attention) misses their prediction:
    the known answers do test the window."""
    policy = twin(tmp_path, "longlive")
    policy.window = policy.cache_frames = None
    cond = Conditioning({"prompt_embeds": TENSORS["prompt_embeds"]}, ["a", "b"])
    x0s, inputs = TENSORS["longlive.x0"], TENSORS["longlive.inputs"]
    clean = torch.cat([x0s[4 * k + 3].permute(0, 2, 1, 3, 4) for k in range(4)], dim=2)
    cache = policy.append_chunks(policy.empty_cache(2, 1.0), clean, cond, 1.0)
    x, sigma = inputs[16].permute(0, 2, 1, 3, 4), policy.sigmas(4)[0]
    x0 = (x - sigma * policy.chunk_velocity(x, sigma.item(), 0.9, cache, cond, 1.0)).permute(0, 2, 1, 3, 4)
    assert (x0 - x0s[16]).abs().max() > 1e-2


def test_attended_frames_follow_the_rolling_cache_with_a_sink() -> None:
    assert attended_frames(12, 3, None, 0) == [(0, 12)]
    assert attended_frames(6, 3, 12, 3) == [(0, 6)]  # everything still fits the window
    # LongLive's 12-frame window, 3-frame sink: chunk 5 (frames 15..17) reads frames 0..2 and 9..14 besides itself
    assert attended_frames(15, 3, 12, 3) == [(0, 3), (9, 15)]
    assert attended_frames(3, 3, 6, 3) == [(0, 3)]


def test_the_whole_video_pass_is_block_causal(tmp_path: Path) -> None:
    """``velocity`` over the whole video: a chunk's prediction does not depend on later chunks, and the first
    chunk's equals the streamed chunk's at the same σ (it reads nothing cached)."""
    folder = tmp_path / "twin"
    save_tiny("causal_wan", folder)
    policy = pipelines.load(folder)
    cond = policy.encode(["a red ball"])
    x = policy.initial_noise(1, torch.Generator().manual_seed(0))
    v = policy.velocity(x, 0.75, cond, 1.0)
    later = x.clone()
    later[:, :, policy.chunk_slice(2)] += 1.0
    v2 = policy.velocity(later, 0.75, cond, 1.0)
    assert torch.allclose(v[:, :, :6], v2[:, :, :6], atol=1e-6) and not torch.allclose(v[:, :, 6:], v2[:, :, 6:])
    first = policy.chunk_velocity(x[:, :, :3], 0.75, 0.5, policy.empty_cache(1, 1.0), cond, 1.0)
    assert torch.allclose(first, v[:, :, :3], atol=1e-5)


def test_streams_re_noise_with_draws_keyed_by_their_own_noise(tmp_path: Path) -> None:
    """The own sampler re-noises x̂0 with fresh noise (CPS at η = 1): a stream's video does not depend on the
    batch it is sampled in, a fork from its prefix redraws the same noise, and other initial noise gives
    other draws."""
    folder = tmp_path / "twin"
    save_tiny("causal_wan", folder)
    policy = pipelines.load(folder)
    noise = policy.initial_noise(2, torch.Generator().manual_seed(0))
    both = stream_rollout(policy, ["a", "b"], num_steps=4, initial_noise=noise, decode=False)
    alone = stream_rollout(policy, ["b"], num_steps=4, initial_noise=noise[1:], decode=False)
    assert torch.allclose(both.final_latents[1:], alone.final_latents, atol=1e-5)
    forked = stream_rollout(policy, ["b"], num_steps=4, initial_noise=noise[1:], prefix=alone.prefix(1), decode=False)
    assert torch.allclose(forked.final_latents, alone.final_latents, atol=1e-5)
    # each step lands on (1 − σ')·x̂0 + σ'·ε: its log-prob is finite, the last step (σ' = 0) deterministic
    assert torch.isfinite(both.log_probs[:, :, :3]).all() and torch.isnan(both.log_probs[:, :, 3]).all()
    x, sigmas = both.chunks[0][:, 0], both.sigmas
    v = policy.chunk_velocity(x, sigmas[0].item(), sigmas[1].item(), policy.empty_cache(2, 1.0), policy.encode(["a", "b"]), 1.0)
    x0 = x - sigmas[0] * v
    eps = (both.chunks[0][:, 1] - (1 - sigmas[1]) * x0) / sigmas[1]
    assert abs(eps.std().item() - 1.0) < 0.15 and abs(eps.mean().item()) < 0.1
    other = stream_rollout(policy, ["b"], num_steps=4, initial_noise=noise[:1], decode=False)
    assert not torch.allclose(other.final_latents, alone.final_latents)


def test_guidance_and_chunking_are_refused_in_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "twin"
    save_tiny("causal_wan", folder)
    with pytest.raises(UserError, match="guidance_scale"):
        pipelines.load(folder, defaults={"guidance_scale": 4.0})
    with pytest.raises(UserError, match="chunk_frames"):
        pipelines.load(folder, defaults={"chunk_frames": 4})
    with pytest.raises(UserError, match="attention_window"):
        pipelines.load(folder, defaults={"attention_window": 4, "sink_frames": 3})
    policy = pipelines.load(folder)
    with pytest.raises(UserError, match="without CFG"):
        policy.empty_cache(1, 3.0)


def test_the_caches_of_a_stream_share_the_entries_each_chunk_wrote(tmp_path: Path) -> None:
    """A rollout keeps the cache every chunk started from: each chunk's entries are stored once (a later cache
    holds the same tensors), so the stored caches grow with the video, not with its square."""
    folder = tmp_path / "twin"
    save_tiny("causal_wan", folder)
    policy = pipelines.load(folder)
    r = stream_rollout(policy, ["a"], num_steps=2, initial_noise=policy.initial_noise(1, torch.Generator().manual_seed(0)),
                       decode=False)
    first, last = r.caches[1], r.caches[2]
    assert first.num_chunks == 1 and last.num_chunks == 2
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(first.segments[0].blocks, last.segments[0].blocks))


SWITCH = json.loads((KNOWN.parent / "causal_wan_switch.json").read_text())
SWITCH_TENSORS = load_file(str(KNOWN.parent / "causal_wan_switch.safetensors"))


def segment_embeds(count: int) -> list[torch.Tensor]:
    """Each prompt segment's embeddings (the rule in the switch answers' provenance)."""
    g, out = torch.Generator().manual_seed(4), []
    for _ in range(count):
        e = torch.zeros(2, 512, 16)
        e[:, :5] = torch.randn(2, 5, 16, generator=g)
        out.append(e)
    return out


@pytest.mark.parametrize("label", list(SWITCH["settings"]))
def test_prompt_switches_recache_as_the_authors_interactive_pipeline(tmp_path: Path, label: str) -> None:
    """LongLive's interactive streams: at each switch the cache is recached under the next prompt (the sink kept or
    restarted, inside or past the first window, with global attention); every later x0 prediction, from the
    states their pipeline fed its generator, equals theirs."""
    setting = SWITCH["settings"][label]
    policy = twin(tmp_path, label, SWITCH)
    embeds = segment_embeds(len(setting["switch_frame_indices"]) + 1)
    conds = [Conditioning({"prompt_embeds": e}, ["a", "b"]) for e in embeds]
    sigmas = policy.sigmas(4)
    inputs, x0s = SWITCH_TENSORS[f"{label}.inputs"], SWITCH_TENSORS[f"{label}.x0"]
    cache, clean, segment, worst, switched = policy.empty_cache(2, 1.0), [], 0, 0.0, []
    pending = list(setting["switch_frame_indices"])
    for k in range(len(policy.chunk_frames)):
        if pending and 3 * k >= pending[0]:  # their rule: the first block starting at or after the switch frame
            pending.pop(0)
            segment += 1
            cache = policy.switch_prompt(cache, torch.cat(clean, dim=2), conds[segment], 1.0)
            switched.append(3 * k)
        for i in range(4):
            x = inputs[4 * k + i].permute(0, 2, 1, 3, 4)
            v = policy.chunk_velocity(x, sigmas[i].item(), sigmas[i + 1].item(), cache, conds[segment], 1.0)
            worst = max(worst, ((x - sigmas[i] * v).permute(0, 2, 1, 3, 4) - x0s[4 * k + i]).abs().max().item())
        clean.append(x0s[4 * k + 3].permute(0, 2, 1, 3, 4))
        cache = policy.append_chunks(cache, torch.cat(clean, dim=2), conds[segment], 1.0)
    recaches = [c["start_frame"] + c["frames"] for c in setting["calls"] if c["frames"] > 3]
    assert switched == recaches and switched  # the switches fell where theirs recached
    assert worst < 1e-4, worst


def test_a_switched_stream_follows_its_first_prompt_until_the_switch(tmp_path: Path) -> None:
    """Chunks before the switch are the unswitched stream's bit for bit; from the switch on the stream follows
    the new prompt (its chunks differ); switches that share a chunk, fall outside the video or come with the
    wrong number of prompts are refused."""
    folder = tmp_path / "twin"
    save_tiny("causal_wan", folder, sampling={"attention_window": 6, "sink_frames": 3})
    policy = pipelines.load(folder)
    noise = policy.initial_noise(1, torch.Generator().manual_seed(0))
    plain = stream_rollout(policy, ["a red ball"], num_steps=2, initial_noise=noise, decode=False)
    switched = stream_rollout(policy, ["a red ball"], num_steps=2, initial_noise=noise, decode=False,
                              switches=[(3, ["a blue cube"])])
    assert torch.equal(plain.chunks[0], switched.chunks[0])
    assert not torch.allclose(plain.chunks[1][:, -1], switched.chunks[1][:, -1], atol=1e-3)
    # a fork from the switched stream's chunk 2 reads the recached cache under the new prompt: the same chunk
    fork = stream_rollout(policy, ["a red ball"], num_steps=2, initial_noise=noise, decode=False,
                          prefix=switched.prefix(2), switches=[(3, ["a blue cube"])])
    assert torch.equal(fork.chunks[2], switched.chunks[2])
    for switches, match in [([(3, ["b"]), (2, ["c"])], "later chunks"), ([(9, ["b"])], "must fall in"),
                            ([(3, ["b", "c"])], "2 prompts for 1 streams")]:
        with pytest.raises(UserError, match=match):
            stream_rollout(policy, ["a"], num_steps=2, initial_noise=noise, decode=False, switches=switches)


def test_a_switched_history_is_the_cache_the_switched_stream_read(tmp_path: Path) -> None:
    """``switched_history`` (a replay's history of a stream that switched prompts) gives each chunk the cache the
    stream read there; the one-prompt history does not."""
    from flowalign.sampling.streaming import switched_history

    folder = tmp_path / "twin"
    save_tiny("causal_wan", folder, sampling={"attention_window": 6, "sink_frames": 3})
    policy = pipelines.load(folder)
    noise = policy.initial_noise(1, torch.Generator().manual_seed(0))
    r = stream_rollout(policy, ["a"], num_steps=2, initial_noise=noise, decode=False,
                       switches=[(3, ["b"]), (6, ["c"])])
    segments = [(0, policy.encode(["a"])), (1, policy.encode(["b"])), (2, policy.encode(["c"]))]
    for k, prompt in [(1, "b"), (2, "c")]:
        prefix, cond, x = r.prefix(k), policy.encode([prompt]), r.chunks[k][:, 0]
        expected = policy.chunk_velocity(x, 1.0, 0.5, prefix.cache, cond, 1.0)
        replayed = policy.chunk_velocity(x, 1.0, 0.5, switched_history(policy, prefix.clean, segments, 1.0), cond, 1.0)
        unswitched = policy.chunk_velocity(x, 1.0, 0.5, policy.history_cache(prefix.clean, range(k), segments[0][1],
                                                                             1.0), cond, 1.0)
        assert (replayed - expected).abs().max() < 1e-6
        assert (unswitched - expected).abs().max() > 1e-4  # the tiny model reads its prompt weakly, but reads it


def test_a_resident_cache_of_the_window_streams_the_same_video_and_holds_only_its_frames(tmp_path: Path) -> None:
    """``cache_frames`` (their rolling cache; the window by default) evicts what the window no longer reads: the
    stream is the one of a cache holding every frame, bit for bit, while it holds the sink and the last frames
    only. A routing's frames stay while it holds them (their fixed memory tokens); routing to an evicted frame is
    refused in one line."""
    policies = {}
    for label, cache_frames in [("window", None), ("every", 15)]:
        save_tiny("causal_wan", tmp_path / label, sampling={"num_frames": 29, "attention_window": 9, "sink_frames": 3,
                                                            "cache_frames": cache_frames})
        policies[label] = pipelines.load(tmp_path / label)
    policy = policies["window"]
    assert policy.cache_frames == 9
    noise = policy.initial_noise(1, torch.Generator().manual_seed(0))
    a, b = (stream_rollout(policies[k], ["a"], num_steps=2, initial_noise=noise, decode=False) for k in policies)
    assert torch.equal(a.final_latents, b.final_latents)
    assert sorted(a.caches[4].alive()) == [0, 1, 2, 9, 10, 11] and len(b.caches[4].alive()) == 12
    with pytest.raises(UserError, match=r"frames \[4\] have left the model's resident cache"):
        policy.reroute(a.caches[3], KeptFrames((0, 1, 2, 4)))
    routed = policy.reroute(b.caches[3], KeptFrames((0, 1, 2, 4)))
    assert 4 in policy._evict(routed).alive()  # held on to by the routing
    assert 4 not in policy._evict(dataclasses.replace(routed, pinned=frozenset())).alive()
