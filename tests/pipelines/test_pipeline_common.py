"""The helpers every family shares: the per-prompt embedding cache and the policy options."""

from __future__ import annotations

import pytest
import torch

import pipelines
from flowalign.errors import UserError

PROMPTS = ["a red circle", "two blue squares"]


@pytest.fixture
def policy(tiny_sd3_dir):
    return pipelines.load(tiny_sd3_dir)


def encoder_calls(policy) -> list[int]:
    calls: list[int] = []
    policy.pipe.text_encoder_3.register_forward_hook(lambda *a: calls.append(1))
    return calls


def test_cached_embeddings_are_the_pipelines_own(policy):
    """Cached rows (and the CFG negative, the empty prompt) equal what the pipeline's encode_prompt gives."""
    max_len = int(policy.defaults["max_sequence_length"])
    policy.encode(PROMPTS)
    cond = policy.encode(PROMPTS)  # served from the cache
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            embeds, negative, pooled, negative_pooled = policy.pipe.encode_prompt(
                prompt=[prompt], prompt_2=None, prompt_3=None, max_sequence_length=max_len,
                do_classifier_free_guidance=True,
            )
            assert torch.equal(cond.tensors["prompt_embeds"][i], embeds[0])
            assert torch.equal(cond.tensors["pooled_prompt_embeds"][i], pooled[0])
            assert torch.equal(cond.tensors["negative_prompt_embeds"][i], negative[0])
            assert torch.equal(cond.tensors["negative_pooled_prompt_embeds"][i], negative_pooled[0])


def test_negative_prompt_is_encoded_once(policy):
    calls = encoder_calls(policy)
    policy.encode([PROMPTS[0]])
    assert len(calls) == 2  # the prompt and the empty negative
    policy.encode([PROMPTS[1]])
    assert len(calls) == 3  # only the new prompt


def test_a_training_text_encoder_bypasses_the_cache_and_a_changed_one_refreshes_it(policy):
    before = policy.encode(PROMPTS).tensors["prompt_embeds"]
    encoder = policy.pipe.text_encoder_3
    encoder.requires_grad_(True)
    calls = encoder_calls(policy)
    trained = policy.encode(PROMPTS).tensors["prompt_embeds"]
    policy.encode(PROMPTS)
    assert len(calls) == 2 * (len(PROMPTS) + 1), "no cache while the text encoder trains"
    assert trained.requires_grad, "embeddings carry gradients to the text encoder"
    optimiser = torch.optim.SGD(encoder.parameters(), lr=0.1)
    trained.pow(2).mean().backward()
    optimiser.step()
    encoder.requires_grad_(False)
    after = policy.encode(PROMPTS).tensors["prompt_embeds"]
    assert not after.requires_grad
    assert not torch.equal(after, before), "rows from the old weights were dropped"
    n = len(calls)
    assert torch.equal(policy.encode(PROMPTS).tensors["prompt_embeds"], after)
    assert len(calls) == n, "frozen again: cached again"


def test_weights_loaded_in_place_refresh_the_cache(policy):
    before = policy.encode(PROMPTS).tensors["pooled_prompt_embeds"]
    encoder = policy.pipe.text_encoder
    state = {k: v * 1.5 for k, v in encoder.state_dict().items()}
    encoder.load_state_dict(state)
    after = policy.encode(PROMPTS).tensors["pooled_prompt_embeds"]
    assert not torch.equal(after, before)


def test_unknown_policy_option_is_refused(tiny_sd3_dir):
    from pipelines.sd3 import SD3Policy

    with pytest.raises(UserError, match="decode_batch"):
        SD3Policy(tiny_sd3_dir, decode_batchsize=4)
    with pytest.raises(UserError, match="multiple of"):
        pipelines.load(tiny_sd3_dir, defaults={"height": 33})


def test_2x2_packing_is_the_pipelines_own_and_unpacking_inverts_it():
    """pack_2x2 / unpack_2x2 replace FLUX.1's and Qwen-Image's private packing: the same tokens, bit for bit."""
    from diffusers import FluxPipeline, QwenImagePipeline

    from pipelines._common import pack_2x2, unpack_2x2

    z = torch.randn(3, 4, 6, 10, generator=torch.Generator().manual_seed(0))
    tokens = pack_2x2(z)
    assert torch.equal(tokens, FluxPipeline._pack_latents(z, 3, 4, 6, 10))
    assert torch.equal(pack_2x2(z[:, :, None]), QwenImagePipeline._pack_latents(z[:, :, None], 3, 4, 6, 10))
    assert torch.equal(pack_2x2(z[:, None]), QwenImagePipeline._pack_latents(z[:, None], 3, 4, 6, 10))  # its noise
    assert torch.equal(unpack_2x2(tokens, 6, 10), z)
    assert torch.equal(unpack_2x2(tokens, 6, 10), FluxPipeline._unpack_latents(tokens, 48, 80, 8))


def test_encode_with_empty_negative_stacks_every_key_a_family_names_and_its_empty_prompt_negative():
    """Each key is stacked in prompt order; with CFG every key gets its ``negative_`` twin, the empty prompt's
    row repeated per prompt, and the empty prompt is encoded once however often it is asked for."""
    from pipelines._common import PromptCache, encode_with_empty_negative

    encoded: list[str] = []

    def encode(prompts: list[str]) -> dict[str, torch.Tensor]:  # (B, 3) embeddings and (B, 2) masks from the text
        encoded.extend(prompts)
        lengths = torch.tensor([float(len(p)) for p in prompts])
        return {"embeds": lengths[:, None] * torch.arange(1.0, 4.0), "mask": torch.stack([lengths, -lengths], 1)}

    cache = PromptCache(8)
    keys = ("embeds", "mask")
    cond = encode_with_empty_negative(cache, PROMPTS, encode, True, keys)
    again = encode_with_empty_negative(cache, PROMPTS[::-1], encode, True, keys)
    assert sorted(encoded) == sorted([*PROMPTS, ""])  # each string once, the empty negative included
    assert set(cond.tensors) == {"embeds", "mask", "negative_embeds", "negative_mask"}
    for i, prompt in enumerate(PROMPTS):
        assert torch.equal(cond.tensors["embeds"][i], len(prompt) * torch.arange(1.0, 4.0))
        assert torch.equal(cond.tensors["mask"][i], torch.tensor([len(prompt), -len(prompt)], dtype=torch.float32))
    assert torch.equal(again.tensors["embeds"], cond.tensors["embeds"].flip(0))
    assert torch.equal(cond.tensors["negative_embeds"], torch.zeros(len(PROMPTS), 3))
    assert cond.tensors["negative_mask"].shape == (len(PROMPTS), 2)
    plain = encode_with_empty_negative(PromptCache(8), PROMPTS, encode, False, keys)
    assert set(plain.tensors) == {"embeds", "mask"}


def test_a_folder_with_another_scheduler_is_refused_naming_both():
    from types import SimpleNamespace

    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    from pipelines._common import require_scheduler

    require_scheduler(SimpleNamespace(scheduler=FlowMatchEulerDiscreteScheduler()), FlowMatchEulerDiscreteScheduler,
                      "m", "LTX-2")
    with pytest.raises(UserError, match="m: scheduler UniPCMultistepScheduler is not supported; LTX-2 folders ship "
                                        "FlowMatchEulerDiscreteScheduler"):
        require_scheduler(SimpleNamespace(scheduler=UniPCMultistepScheduler()), FlowMatchEulerDiscreteScheduler,
                          "m", "LTX-2")


def test_input_images_join_the_conditioning_one_per_prompt_in_order():
    from flowalign.protocols import Conditioning
    from pipelines._common import with_input_images

    cond = Conditioning({"prompt_embeds": torch.zeros(2, 4, 8)}, PROMPTS)
    images = [torch.full((3, 4, 4), 0.25), torch.full((3, 4, 4), 0.75)]

    def mean_colour(image: torch.Tensor) -> torch.Tensor:  # (3, H, W) -> (1, 3)
        return image.mean(dim=(1, 2))[None]

    joined = with_input_images(cond, images, mean_colour, "image_latents", "an edit needs an input image")
    assert torch.equal(joined.tensors["prompt_embeds"], cond.tensors["prompt_embeds"]) and joined.prompts == PROMPTS
    assert torch.equal(joined.tensors["image_latents"], torch.tensor([[0.25] * 3, [0.75] * 3]))
    with pytest.raises(UserError, match=r"an edit needs an input image per prompt \(2 prompts, 1 images\)"):
        with_input_images(cond, images[:1], mean_colour, "image_latents", "an edit needs an input image")
