"""scripts/opsd_targets.py builds exactly the targets DiffusionOPSD trains on."""

import torch

from flowalign.train import build_trainer
from tests.scripts import load_script

from .test_diffusion_opsd import vvr_run


def test_the_scripts_targets_are_the_trainers(tmp_path, tiny_sd3_dir):
    script = load_script("opsd_targets")
    t = build_trainer(vvr_run(tmp_path / "run", tiny_sd3_dir, "trainer.rho=0.2", "trainer.ascent_steps=3"))
    prompts, metadata, groups = t.step_prompts(0)
    chunk = t.sample(prompts, metadata, groups).chunks[0]
    with t.behaviour.swapped_in():
        (unit,) = t.prepare(chunk, torch.full((len(chunk),), 0.5), torch.ones(len(chunk), dtype=torch.bool),
                            torch.Generator().manual_seed(0))
    y0 = script.anchor(t.policy, chunk, sigma_star=t.tcfg.sigma_star)
    y_pos, y_neg = script.targets(t.policy, t.rewards, chunk, y0, rho=0.2, ascent_steps=3)
    for ours, theirs in ((y0, "y0"), (y_pos, "y_pos"), (y_neg, "y_neg")):
        torch.testing.assert_close(ours, unit.tensors[theirs], atol=1e-6, rtol=0)
    assert not torch.allclose(y_pos, y0)  # a real ascent, not the anchor handed back
    # the "final" anchor starts from the rollout's last latent instead
    torch.testing.assert_close(script.anchor(t.policy, chunk, sigma_star=0.278, where="final"), chunk.final_latents)
