"""``encode_posterior``: the VAE posterior's mean and standard deviation in each family's clean-latent layout,
from which SOAR and SFT draw a fresh x0 each time they train a pair (the authors' ``latent_dist.sample()``)."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

import pipelines


@pytest.mark.parametrize("family", ["sd3", "kontext", "flux2"])
def test_a_posterior_sample_encodes_to_the_mean_plus_the_std_times_its_noise(family, tiny_model_dir, monkeypatch):
    """The mean is :meth:`encode_images`' x0, bit for bit; the std is laid out and scaled as the latents are:
    a posterior whose mode is moved by one std encodes to ``mean + std`` (each family's normalisation is affine
    and its packing a permutation), and a sample ``m + s·ξ`` to ``mean + std·ξ'`` with ξ' ~ N(0, I)."""
    policy = pipelines.load(tiny_model_dir(family))
    h, w = int(policy.defaults["height"]), int(policy.defaults["width"])
    images = torch.rand(2, 3, h, w, generator=torch.Generator().manual_seed(0))
    mean, std = policy.encode_posterior(images)
    assert torch.equal(mean, policy.encode_images(images)) and mean.shape == std.shape
    assert bool((std > 0).all())
    built = DiagonalGaussianDistribution.__init__

    def moved_by_one_std(self, *args, **kwargs):  # the encoders read its mean or its mode (the same tensor)
        built(self, *args, **kwargs)
        self.mean = self.mean + self.std

    monkeypatch.setattr(DiagonalGaussianDistribution, "__init__", moved_by_one_std)
    torch.testing.assert_close(policy.encode_images(images), mean + std, rtol=1e-4, atol=1e-5)
