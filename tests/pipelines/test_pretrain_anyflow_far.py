"""``flowalign pretrain-tiny anyflow_far``: the clean-context training forward gives each chunk exactly what the
stream gives it from the KV cache, the warm start from the tiny Wan model keeps that model's weights and time
conditioning, and a seconds-long run exports a streaming folder that ``pipelines.load`` samples."""

from __future__ import annotations

import argparse
import copy
import json

import pytest
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel

import pipelines
from flowalign.cli.main import main
from flowalign.errors import UserError
from flowalign.paths import assets_dir
from flowalign.sampling import stream_rollout
from pipelines.anyflow_far import attend_with_sdpa
from pipelines.pretrain import anyflow_far
from pipelines.pretrain.stage import losses
from tests.pipelines.family_checks import PROMPTS

WAN = assets_dir() / "tiny-wan-motion"


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return pipelines.load(tiny_model_dir("anyflow_far"))


def chunk(x: torch.Tensor, policy, k: int) -> torch.Tensor:
    """Chunk ``k`` of FAR-layout frames ``(B, F, C, H, W)`` in the policy's layout ``(B, C, f, H, W)``."""
    return x[:, policy.chunk_slice(k)].permute(0, 2, 1, 3, 4)


@pytest.mark.parametrize("attention", ["flex", "sdpa"])
def test_each_trained_chunk_sees_what_the_stream_gives_it_from_the_cache(policy, attention):
    """The training forward's prediction for chunk k equals the policy's streaming velocity of the same noised
    chunk after the clean chunks before it (chunk 2 reads chunk 0 in compressed form), on flex attention and
    on the dense SDPA path pretraining uses on CPU; and it depends on that history."""
    transformer = policy.transformer
    if attention == "sdpa":
        transformer = copy.deepcopy(transformer)
        attend_with_sdpa(transformer)
    g = torch.Generator().manual_seed(0)
    c, f, h, w = policy.latent_shape
    clip = torch.randn(2, f, c, h, w, generator=g)  # clean latents, FAR layout
    noisy = torch.randn(2, f, c, h, w, generator=g)
    cond = policy.encode(PROMPTS)
    text = cond.tensors["prompt_embeds"]
    latents = clip.permute(0, 2, 1, 3, 4)
    for k, sigma in ((0, 0.8), (1, 0.55), (2, 0.3)):
        t = torch.full((2,), 1000 * sigma)
        with torch.no_grad():
            trained = anyflow_far.streamed_velocity(transformer, clip, k, noisy[:, policy.chunk_slice(k)], t, text)
            cache = policy.history_cache(latents[:, :, :sum(policy.chunk_frames[:k])], range(k), cond, 1.0)
            streamed = policy.chunk_velocity(chunk(noisy, policy, k), sigma, sigma, cache, cond, 1.0)
            other = anyflow_far.streamed_velocity(transformer, -clip, k, noisy[:, policy.chunk_slice(k)], t, text)
        torch.testing.assert_close(trained.permute(0, 2, 1, 3, 4), streamed, rtol=1e-4, atol=1e-4)
        assert (k == 0) == torch.allclose(other, trained, atol=1e-5)  # chunk 0 alone has no history


def test_the_training_loss_has_gradients_everywhere_on_cpu():
    wan = WanTransformer3DModel.from_pretrained(WAN / "transformer")
    far = anyflow_far.warm_start(wan, (1, 2, 2), 2, (1, 8, 8))
    attend_with_sdpa(far)
    torch.manual_seed(0)
    text = {"encoder_hidden_states": torch.randn(2, 8, wan.config.text_dim)}
    for _ in range(2):  # both layouts (two chunks, three chunks) come up within a few draws
        loss = anyflow_far.flow_loss(far, torch.randn(2, 4, 5, 16, 16), text)
        loss.backward()
    grads = [p.grad for p in far.parameters()]
    assert torch.isfinite(loss) and all(gr is not None and torch.isfinite(gr).all() for gr in grads)


def test_the_warm_start_is_the_wan_model_with_its_time_conditioning():
    wan = WanTransformer3DModel.from_pretrained(WAN / "transformer")
    far = anyflow_far.warm_start(wan, (1, 2, 2), 2, (1, 8, 8))
    theirs, ours = wan.state_dict(), far.state_dict()
    assert all(torch.equal(ours[k], v) for k, v in theirs.items())
    assert far.far_patch_embedding.weight.shape[-2:] == (8, 8)
    # at r = t the dual-timestep embedding is the Wan model's timestep embedding
    t = torch.tensor([[0.0, 250.0, 999.0]])
    text = torch.zeros(1, 4, wan.config.text_dim)
    with torch.no_grad():
        rt_emb, _ = far.condition_embedder.forward_timestep(t, t, text, 1)
        emb = wan.condition_embedder
        expected = emb.time_embedder(emb.timesteps_proj(t.flatten()).to(text))
    torch.testing.assert_close(rt_emb[0], expected, rtol=1e-5, atol=1e-5)


def test_an_init_folder_that_is_not_a_wan_model_is_refused(tmp_path):
    args = argparse.Namespace(init_from=str(tmp_path), chunk_partition="1,2,2", compressed_patch="1,8,8")
    with pytest.raises(UserError, match="--init-from"):
        anyflow_far.check(args)
    args.init_from = str(WAN)
    anyflow_far.check(args)
    args.chunk_partition = "2,2"
    with pytest.raises(UserError, match="5 latent frames"):
        anyflow_far.check(args)


def test_a_short_run_exports_a_streaming_folder(tmp_path):
    out, export = tmp_path / "run", tmp_path / "model"
    assert main(["pretrain-tiny", "anyflow_far", "--out", str(out), "--export", str(export), "--n-scenes", "8",
                 "--dit-steps", "3", "--dit-minutes", "0", "--batch", "4", "--warmup", "1", "--demo-n", "0",
                 "--sample-steps", "2", "--threads", str(torch.get_num_threads())]) == 0
    assert len(losses(out / "dit")) == 3
    defaults = json.loads((export / "flowalign.json").read_text())
    assert defaults["family"] == "anyflow_far" and defaults["use_mean_velocity"] is False
    policy = pipelines.load(export)
    assert policy.family == "anyflow_far" and policy.chunk_frames == [1, 2, 2] and policy.latent_shape == (4, 5, 16, 16)
    before = AutoencoderKLWan.from_pretrained(WAN / "vae").state_dict()
    assert all(torch.equal(v, before[k]) for k, v in policy.vae.state_dict().items())  # the VAE is reused frozen
    video = stream_rollout(policy, PROMPTS, num_steps=2, initial_noise=policy.initial_noise(2)).samples
    assert video.shape == (2, 9, 3, 32, 32)


def test_the_shipped_model_streams_as_its_diffusers_pipeline_does():
    """``assets/tiny-anyflow-far-motion`` at its ``flowalign.json`` defaults (CFG 4, instantaneous velocity)
    against ``AnyFlowFARPipeline`` on the same noise."""
    policy = pipelines.load(assets_dir() / "tiny-anyflow-far-motion")
    assert policy.defaults["use_mean_velocity"] is False and policy.defaults["guidance_scale"] == 4.0
    x1 = policy.initial_noise(2, torch.Generator().manual_seed(0))
    ours = stream_rollout(policy, PROMPTS, num_steps=3, initial_noise=x1, decode=False).final_latents
    with torch.no_grad():
        theirs = policy.pipe(prompt=PROMPTS, height=32, width=32, num_frames=9, num_inference_steps=3,
                             guidance_scale=4.0, max_sequence_length=16, use_mean_velocity=False,
                             latents=x1.clone(), output_type="latent").frames
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)  # CFG 4 magnifies the float rounding
