"""AnyFlow-FAR streaming policy on its tiny twin: chunk-by-chunk rollouts equal to ``AnyFlowFARPipeline`` on the
same noise, the KV cache as a value (forks share their prefix, appending leaves a cache as it was), per-chunk
log-probs that re-evaluate to ratio 1, LoRA in the pipeline's format, and the published size on the meta device."""

from __future__ import annotations

import copy

import pytest
import torch

import pipelines
from flowalign.errors import UserError
from flowalign.evaluation import sample_seeded
from flowalign.paths import REPO_ROOT
from flowalign.plan import build_on_meta
from flowalign.protocols import StreamingPolicy
from flowalign.sampling import rollout, sde_step, stream_rollout
from tests.pipelines.family_checks import LORA, PROMPTS, perturbed_lora_policy

SIZE = dict(height=32, width=32, num_frames=9)


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("anyflow_far")


@pytest.fixture(scope="module")
def policy(folder):
    return pipelines.load(folder)


@pytest.fixture(scope="module")
def cfg_policy(folder):
    return pipelines.load(folder, defaults={"guidance_scale": 3.0})


def noise(policy, n=2, seed=0):
    return policy.initial_noise(n, torch.Generator().manual_seed(seed))


def test_end_to_end_shapes_chunks_and_range(policy):
    assert isinstance(policy, StreamingPolicy) and policy.streaming and policy.family == "anyflow_far"
    # 9 frames at 32 px, tiny VAE ×2 in time and ×4 in space: five latent frames as chunks of 1, 2, 2
    assert policy.latent_shape == (4, 5, 8, 8) and policy.chunk_frames == [1, 2, 2]
    r = stream_rollout(policy, PROMPTS, num_steps=3, initial_noise=noise(policy))
    assert [c.shape for c in r.chunks] == [(2, 4, 4, f, 8, 8) for f in (1, 2, 2)]
    assert r.final_latents.shape == (2, 4, 5, 8, 8) and r.log_probs.isnan().all()  # ODE: no log-probs
    assert [c.num_chunks for c in r.caches] == [0, 1, 2]
    assert r.samples.shape == (2, 9, 3, 32, 32) and r.samples.min() >= 0 and r.samples.max() <= 1


def test_sigmas_are_the_flow_map_schedulers(policy):
    for n in (1, 4, 8):
        ref = copy.deepcopy(policy.pipe.scheduler)
        ref.set_timesteps(n)
        assert torch.equal(policy.sigmas(n), ref.sigmas.float()) and policy.sigmas(n)[-1] == 0


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_stream_reproduces_the_diffusers_pipeline(policy, cfg_policy, guidance):
    """Our chunk loop (mean-velocity jumps, the cache re-encoded after every chunk, CFG with the cache held for
    both halves) against ``pipe(...)`` on the same noise."""
    p = cfg_policy if guidance > 1 else policy
    x1 = noise(p, seed=7)
    ours = stream_rollout(p, PROMPTS, num_steps=4, initial_noise=x1, decode=False).final_latents
    with torch.no_grad():
        theirs = p.pipe(prompt=PROMPTS, **SIZE, num_inference_steps=4, guidance_scale=guidance, latents=x1.clone(),
                        output_type="latent").frames
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_plain_flow_model_steps_with_its_instantaneous_velocity_as_the_pipeline_does(folder):
    """``use_mean_velocity: false`` (a model trained with r = t) against ``pipe(..., use_mean_velocity=False)``,
    and a different stream from the mean-velocity default on the same noise."""
    plain = pipelines.load(folder, defaults={"use_mean_velocity": False})
    x1 = noise(plain, seed=5)
    ours = stream_rollout(plain, PROMPTS, num_steps=3, initial_noise=x1, decode=False).final_latents
    with torch.no_grad():
        theirs = plain.pipe(prompt=PROMPTS, **SIZE, num_inference_steps=3, latents=x1.clone(), use_mean_velocity=False,
                            output_type="latent").frames
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    mean = stream_rollout(pipelines.load(folder), PROMPTS, num_steps=3, initial_noise=x1, decode=False).final_latents
    assert not torch.allclose(ours, mean, atol=1e-4)


def test_a_chunk_depends_on_the_chunks_before_it_through_the_cache(policy):
    """Change chunk 0's noise only: chunk 0 and, through the cache, the later chunks change; each chunk's
    velocity at the same input differs between the two caches."""
    x1 = noise(policy, seed=3)
    other = x1.clone()
    other[:, :, policy.chunk_slice(0)] = noise(policy, seed=4)[:, :, policy.chunk_slice(0)]
    a = stream_rollout(policy, PROMPTS, num_steps=2, initial_noise=x1, decode=False)
    b = stream_rollout(policy, PROMPTS, num_steps=2, initial_noise=other, decode=False)
    assert not torch.allclose(a.chunks[0][:, -1], b.chunks[0][:, -1])
    x = x1[:, :, policy.chunk_slice(2)]
    with torch.no_grad():
        va = policy.chunk_velocity(x, 0.5, 0.25, a.caches[2], a.cond, 1.0)
        vb = policy.chunk_velocity(x, 0.5, 0.25, b.caches[2], b.cond, 1.0)
    assert (va - vb).abs().max() > 1e-4


def test_forks_share_everything_before_the_fork_chunk(policy):
    x1 = noise(policy, seed=5)
    base = stream_rollout(policy, PROMPTS, num_steps=2, initial_noise=x1, decode=False)
    prefix = base.prefix(1).repeat_interleave(3)
    fresh = noise(policy, n=6, seed=6)
    forks = stream_rollout(policy, [p for p in PROMPTS for _ in range(3)], num_steps=2, initial_noise=fresh,
                           prefix=prefix, decode=False)
    assert forks.start == 1 and forks.caches[0] is None
    shared = base.chunks[0][:, -1].repeat_interleave(3, dim=0)
    assert torch.equal(forks.chunks[0][:, -1], shared)  # the prefix, bit for bit
    assert not torch.allclose(forks.chunks[1][:, -1], forks.chunks[1][:, -1][[1, 0, 2, 4, 3, 5]])  # forks differ
    # a fork with the original noise from the fork chunk on is the original stream
    again = stream_rollout(policy, PROMPTS, num_steps=2, initial_noise=x1, prefix=base.prefix(1), decode=False)
    assert torch.equal(again.final_latents, base.final_latents)


def test_appending_a_chunk_leaves_the_cache_it_started_from_as_it_was(policy):
    cond = policy.encode(PROMPTS)
    empty = policy.empty_cache(2, 1.0)
    clean = noise(policy, seed=8)[:, :, :1]
    one = policy.append_chunks(empty, clean, cond, 1.0)
    before = {i: {k: t.clone() for k, t in layer.items()} for i, layer in one.layers.items()}
    two = policy.append_chunks(one, noise(policy, seed=9)[:, :, :3], cond, 1.0)
    assert two.num_chunks == 2 and one.num_chunks == 1
    assert all(torch.equal(one.layers[i][k], before[i][k]) for i in before for k in before[i])
    assert any(not torch.equal(two.layers[i][k], one.layers[i][k]) for i in before for k in before[i])
    with pytest.raises(UserError, match="latent frames"):
        policy.append_chunks(one, clean, cond, 1.0)  # chunks 0..1 are 3 frames, not 1


def test_selecting_cache_rows_keeps_both_cfg_halves(cfg_policy):
    """Under CFG a cache holds [uncond; cond] rows; selecting streams must pick both halves of each."""
    r = stream_rollout(cfg_policy, PROMPTS, num_steps=2, initial_noise=noise(cfg_policy, seed=10), decode=False)
    cache, x = r.caches[2], noise(cfg_policy, seed=11)[:, :, cfg_policy.chunk_slice(2)]
    with torch.no_grad():
        both = cfg_policy.chunk_velocity(x, 0.5, 0.25, cache, r.cond, 3.0)
        second = cfg_policy.chunk_velocity(x[[1]], 0.5, 0.25, cache.select([1]), r.cond[[1]], 3.0)
    torch.testing.assert_close(second, both[[1]], rtol=1e-5, atol=1e-5)
    with pytest.raises(UserError, match="cache holds 2 streams"):
        cfg_policy.chunk_velocity(x[[1]], 0.5, 0.25, cache, r.cond[[1]], 3.0)


def test_sde_chunks_store_log_probs_that_reevaluate_to_ratio_one(folder):
    policy = pipelines.load(folder, lora=LORA)
    r = stream_rollout(policy, PROMPTS, num_steps=3, sampler="flow_grpo", sde_chunks=[1], decode=False,
                       generator=torch.Generator().manual_seed(0))
    assert r.log_probs[:, 1].isfinite().all() and r.log_probs[:, [0, 2]].isnan().all()
    for i in range(3):
        x, x_next, stored = r.step(1, i)
        s, s_next = r.sigmas[i].item(), r.sigmas[i + 1].item()
        v = policy.chunk_velocity(x, s, s_next, r.caches[1], r.cond, 1.0)
        again = sde_step("flow_grpo", v, x, s, s_next, noise_level=r.noise_level, prev_sample=x_next).log_prob
        assert (again.detach() - stored).abs().max() < 1e-5
        again.sum().backward()  # the chunk's log-prob reaches the LoRA weights
    grads = [p.grad for p in policy.trainable.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0


def test_whole_video_rollouts_are_refused_and_evaluation_streams(policy):
    with pytest.raises(UserError, match="chunk by chunk"):
        rollout(policy, PROMPTS, num_steps=2, sampler="ode")
    videos = sample_seeded(policy, PROMPTS, seed=3, num_steps=2, progress=False)
    expected = stream_rollout(policy, PROMPTS, num_steps=2, initial_noise=torch.cat(
        [policy.initial_noise(1, torch.Generator().manual_seed(3 + i)) for i in range(2)])).samples
    torch.testing.assert_close(videos, expected)


def test_the_saved_lora_loads_with_the_pipelines_own_loader(folder, tmp_path):
    trained = perturbed_lora_policy(folder)
    trained.save_adapter(tmp_path / "adapter")
    fresh = pipelines.load(folder)
    fresh.pipe.load_lora_weights(str(tmp_path / "adapter"))
    x1 = noise(trained, seed=12)
    ours = stream_rollout(trained, PROMPTS, num_steps=2, initial_noise=x1, decode=False).final_latents
    loaded = stream_rollout(fresh, PROMPTS, num_steps=2, initial_noise=x1, decode=False).final_latents
    base = stream_rollout(pipelines.load(folder), PROMPTS, num_steps=2, initial_noise=x1, decode=False).final_latents
    assert (ours - base).abs().max() > 1e-4  # the adapter matters
    torch.testing.assert_close(loaded, ours, rtol=1e-5, atol=1e-5)


def test_bad_chunk_partition_and_num_frames_are_user_errors(folder):
    with pytest.raises(UserError, match="chunk_partition"):
        pipelines.load(folder, defaults={"chunk_partition": [2, 2]})
    with pytest.raises(UserError, match="num_frames"):
        pipelines.load(folder, defaults={"num_frames": 8})
    with pytest.raises(UserError, match="sde_chunks"):
        stream_rollout(pipelines.load(folder), PROMPTS, num_steps=2, sampler="flow_grpo", sde_chunks=[3])


def test_published_size_on_the_meta_device():
    """The 1.3B release is Wan 2.1-1.3B made causal: the same blocks plus FAR's compressed patch embedding
    and AnyFlow's second timestep embedding (about 3 M parameters more)."""
    arch = REPO_ROOT / "assets" / "architectures"
    far = sum(p.numel() for p in build_on_meta(arch / "anyflow-far-wan2.1-1.3b")["transformer"].parameters())
    wan = sum(p.numel() for p in build_on_meta(arch / "wan2.1-1.3b")["transformer"].parameters())
    assert 0 < far - wan < 0.005 * wan and abs(far - 1.42e9) / 1.42e9 < 0.01


def test_training_reads_the_cache_with_sdpa_and_gets_the_flex_result(folder, policy):
    """A trained policy on CPU reads the cache through SDPA (flex attention has no CPU backward): the same
    velocities as the frozen policy's flex attention, to float rounding."""
    from pipelines.anyflow_far import CausalAttentionOnSDPA

    trained = pipelines.load(folder, lora=LORA)  # a fresh LoRA is zero: the base model's function
    processors = {type(m.processor) for m in trained.transformer.modules() if hasattr(m, "processor")}
    assert CausalAttentionOnSDPA in processors
    assert CausalAttentionOnSDPA not in {type(m.processor) for m in policy.transformer.modules() if hasattr(m, "processor")}
    x1 = noise(policy, seed=13)
    ours = stream_rollout(trained, PROMPTS, num_steps=2, initial_noise=x1, decode=False)
    flex = stream_rollout(policy, PROMPTS, num_steps=2, initial_noise=x1, decode=False)
    torch.testing.assert_close(ours.final_latents, flex.final_latents, rtol=1e-5, atol=1e-5)


def test_a_routing_that_keeps_every_entry_is_the_pipelines_stream(policy):
    x1 = noise(policy, seed=14)
    routed = stream_rollout(policy, PROMPTS, num_steps=3, initial_noise=x1, route=lambda k: range(k), decode=False)
    with torch.no_grad():
        theirs = policy.pipe(prompt=PROMPTS, **SIZE, num_inference_steps=3, latents=x1.clone(), output_type="latent").frames
    torch.testing.assert_close(routed.final_latents, theirs, rtol=1e-5, atol=1e-5)


def test_a_routed_out_chunk_is_absent_from_what_the_next_chunk_reads(policy):
    """Chunk 2 with chunk 1 routed out reads exactly a history of chunk 0 alone; keeping chunk 1 differs."""
    r = stream_rollout(policy, PROMPTS, num_steps=2, initial_noise=noise(policy, seed=15), decode=False)
    clean, cond = r.final_latents[:, :, :3], r.cond
    x = noise(policy, seed=16)[:, :, policy.chunk_slice(2)]
    routed = policy.history_cache(clean, [0], cond, 1.0)
    only_first = policy.history_cache(clean[:, :, :1], [0], cond, 1.0)
    assert routed.kept == (0,) and routed.num_chunks == 2
    with torch.no_grad():
        v_routed = policy.chunk_velocity(x, 0.5, 0.25, routed, cond, 1.0)
        v_first = policy.chunk_velocity(x, 0.5, 0.25, only_first, cond, 1.0)
        v_full = policy.chunk_velocity(x, 0.5, 0.25, r.caches[2], cond, 1.0)
    torch.testing.assert_close(v_routed, v_first)
    assert (v_routed - v_full).abs().max() > 1e-4
    with pytest.raises(UserError, match="outside"):
        policy.history_cache(clean, [2], cond, 1.0)
