"""scripts/pretrain_tiny.py: growing a pretrained transformer (``--init-from --num-layers``) keeps its function
exactly, and the grown blocks are the identity only until their gates train."""


import pytest
import torch

from pipelines.tiny import build_tiny_sd3
from tests.scripts import load_script


pretrain = load_script("pretrain_tiny")


def _inputs(tr, batch=2):
    g = torch.Generator().manual_seed(0)
    c = tr.config
    x = torch.randn(batch, c.in_channels, c.sample_size, c.sample_size, generator=g)
    text = torch.randn(batch, 7, c.joint_attention_dim, generator=g)
    pooled = torch.randn(batch, c.pooled_projection_dim, generator=g)
    return dict(hidden_states=x, timestep=torch.tensor([250.0, 800.0]), encoder_hidden_states=text,
                pooled_projections=pooled)


def test_deepened_transformer_computes_the_same_function():
    old = build_tiny_sd3(seed=3, transformer={"num_layers": 2}).transformer.eval()
    new = pretrain.deepen_transformer(old, 4).eval()
    assert new.config.num_layers == 4
    assert [b.context_pre_only for b in new.transformer_blocks] == [False, False, False, True]
    torch.testing.assert_close(old.transformer_blocks[0].attn.to_q.weight, new.transformer_blocks[1].attn.to_q.weight)
    with torch.no_grad():
        a, b = old(**_inputs(old)).sample, new(**_inputs(new)).sample
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    # the identity is held by zero gates only: once they move, the new blocks change the output
    with torch.no_grad():
        new.transformer_blocks[0].norm1.linear.bias.normal_()
        c = new(**_inputs(new)).sample
    assert (c - a).abs().max() > 1e-3


def test_deepening_needs_a_multiple_of_the_depth():
    old = build_tiny_sd3(seed=3, transformer={"num_layers": 2}).transformer
    with pytest.raises(ValueError, match="multiple"):
        pretrain.deepen_transformer(old, 3)
