"""``--recipe authors`` (``rewards/latent_registers/recipe.py``) steps as the register authors' training loop
(``training.py`` @ 0b10a8a: AdamW, LambdaLR warm-up, clip, EMA copied into the model at the end), restated
here as a plain loop on a toy model whose gradients are large enough for the clip to act."""

import copy

import torch
from torch import nn

from rewards.latent_registers.recipe import AuthorsRecipe


def batches(n: int = 12):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(5, 3, generator=gen) * 30, torch.randn(5, 1, generator=gen)) for _ in range(n)]


def loss_of(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def their_loop(model: nn.Module, lr: float, wd: float, warmup: int, decay: float, clip: float) -> None:
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=wd)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, float(step + 1) / max(1, warmup)) if warmup > 0 else 1.0)
    ema = {n: p.detach().clone().float() for n, p in model.named_parameters() if p.requires_grad}
    for batch in batches():
        loss_of(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(trainable, clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad:
                    ema[n].mul_(decay).add_(p.detach().float(), alpha=1.0 - decay)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in ema:
                p.copy_(ema[n])


def test_the_recipe_steps_as_the_authors_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.SiLU(), nn.Linear(8, 1))
    model[0].bias.requires_grad_(False)  # frozen weights are neither stepped nor averaged
    theirs, ours = copy.deepcopy(model), copy.deepcopy(model)
    their_loop(theirs, lr=1e-2, wd=0.01, warmup=5, decay=0.9, clip=1.0)
    recipe = AuthorsRecipe(ours, lr=1e-2, weight_decay=0.01, warmup_steps=5, ema_decay=0.9, max_grad_norm=1.0)
    for batch in batches():
        recipe.zero_grad()
        loss_of(ours, batch).backward()
        recipe.step()
    raw = copy.deepcopy(ours)
    recipe.finish()
    for (name, a), b in zip(theirs.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
    assert not torch.equal(raw[2].weight, ours[2].weight)  # the saved reward is the average, not the last step
    assert torch.equal(ours[0].bias, model[0].bias)


def test_a_resumed_recipe_continues_where_it_stopped():
    torch.manual_seed(1)
    model = nn.Linear(3, 1)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    ra = AuthorsRecipe(a, lr=1e-2, warmup_steps=4)
    for i, batch in enumerate(batches()):
        ra.zero_grad()
        loss_of(a, batch).backward()
        ra.step()
        if i == 5:
            b.load_state_dict(a.state_dict())
            rb = AuthorsRecipe(b, lr=1e-2, warmup_steps=4)
            rb.load_state_dict(copy.deepcopy(ra.state_dict()))
        elif i > 5:
            rb.zero_grad()
            loss_of(b, batch).backward()
            rb.step()
    ra.finish(), rb.finish()
    torch.testing.assert_close(b.weight, a.weight, rtol=0, atol=0)
