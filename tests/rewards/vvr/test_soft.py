"""The differentiable VVR surrogate ``vvr_soft``: gradients, agreement with the verifier per constraint
family on rendered scenes, batch / dtype / invalid-input handling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rewards
from flowalign.errors import UserError
from flowalign.protocols import Reward
from rewards.vvr import Task, VVRSoftReward, generate_tasks, render, verify


def _obj(i, shape, colour, size, x, y, filled=True):
    return {"id": i, "shape": shape, "colour": colour, "size": size, "filled": filled, "x": x, "y": y}


def _task(objects, constraints, background="white"):
    return Task.from_dict({"level": "hard", "background": background, "objects": objects, "constraints": constraints})


def _image(task, size=64) -> torch.Tensor:
    return torch.from_numpy(np.array(render(task, size))).permute(2, 0, 1).float() / 255


RED, BLUE = {"colour": "red", "shape": "circle"}, {"colour": "blue", "shape": "square"}
# (name, constraint, objects of the correct scene, objects (or background) of the mutated scene)
CASES = [
    ("count", {"type": "count_colour_shape", "colour": "red", "shape": "circle", "n": 2},
     [_obj(0, "circle", "red", "medium", 0.3, 0.5), _obj(1, "circle", "red", "medium", 0.7, 0.5)],
     [_obj(0, "circle", "red", "medium", 0.3, 0.5)]),
    ("absent", {"type": "absent", "ref": {"colour": "green", "shape": "star"}},
     [_obj(0, "circle", "red", "medium", 0.3, 0.5)],
     [_obj(0, "circle", "red", "medium", 0.3, 0.5), _obj(1, "star", "green", "medium", 0.7, 0.5)]),
    ("colour", {"type": "colour_of", "ref": {"shape": "circle"}, "colour": "red"},
     [_obj(0, "circle", "red", "medium", 0.5, 0.5)], [_obj(0, "circle", "yellow", "medium", 0.5, 0.5)]),
    ("size", {"type": "size_class", "ref": RED, "size": "large"},
     [_obj(0, "circle", "red", "large", 0.5, 0.5)], [_obj(0, "circle", "red", "small", 0.5, 0.5)]),
    ("bigger", {"type": "bigger", "a": RED, "b": BLUE},
     [_obj(0, "circle", "red", "large", 0.3, 0.5), _obj(1, "square", "blue", "small", 0.75, 0.5)],
     [_obj(0, "circle", "red", "small", 0.3, 0.5), _obj(1, "square", "blue", "large", 0.7, 0.5)]),
    ("left_of", {"type": "left_of", "a": RED, "b": BLUE},
     [_obj(0, "circle", "red", "medium", 0.25, 0.5), _obj(1, "square", "blue", "medium", 0.75, 0.5)],
     [_obj(0, "circle", "red", "medium", 0.75, 0.5), _obj(1, "square", "blue", "medium", 0.25, 0.5)]),
    ("above", {"type": "above", "a": RED, "b": BLUE},
     [_obj(0, "circle", "red", "medium", 0.5, 0.25), _obj(1, "square", "blue", "medium", 0.5, 0.75)],
     [_obj(0, "circle", "red", "medium", 0.5, 0.75), _obj(1, "square", "blue", "medium", 0.5, 0.25)]),
    ("aligned", {"type": "horizontally_aligned", "a": RED, "b": BLUE},
     [_obj(0, "circle", "red", "medium", 0.25, 0.5), _obj(1, "square", "blue", "medium", 0.75, 0.5)],
     [_obj(0, "circle", "red", "medium", 0.25, 0.25), _obj(1, "square", "blue", "medium", 0.75, 0.75)]),
    ("inside", {"type": "inside", "a": RED, "b": BLUE},
     [_obj(0, "square", "blue", "large", 0.5, 0.5), _obj(1, "circle", "red", "small", 0.5, 0.5)],
     [_obj(0, "square", "blue", "large", 0.3, 0.5), _obj(1, "circle", "red", "small", 0.8, 0.5)]),
    ("region", {"type": "region", "ref": RED, "region": "top-left"},
     [_obj(0, "circle", "red", "medium", 0.25, 0.25)], [_obj(0, "circle", "red", "medium", 0.75, 0.75)]),
    ("filled", {"type": "filled", "ref": RED, "filled": True},
     [_obj(0, "circle", "red", "large", 0.5, 0.5)], [_obj(0, "circle", "red", "large", 0.5, 0.5, filled=False)]),
    ("background", {"type": "background_colour", "colour": "black"}, "black", "white"),
]


@pytest.mark.parametrize("name,constraint,good,bad", CASES, ids=[c[0] for c in CASES])
def test_a_correct_render_scores_higher_than_a_mutated_one(name, constraint, good, bad):
    """Each constraint family: the verifier passes the correct render and fails the mutation, and the
    surrogate ranks them the same way."""
    if isinstance(good, str):  # background: same object, other canvas colour
        obj = [_obj(0, "circle", "red", "medium", 0.5, 0.5)]
        task, mutated = _task(obj, [constraint], good), _task(obj, [constraint], bad)
    else:
        task, mutated = _task(good, [constraint]), _task(bad, [constraint])
    assert verify(task, render(task, 64)).all_passed and not verify(task, render(mutated, 64)).all_passed
    x = torch.stack([_image(task), _image(mutated)])
    score = rewards.load("vvr_soft")(x, ["", ""], [{"task": task}, {"task": task}]).components["vvr_soft"]
    assert score[0] > score[1] + 0.1, (name, score.tolist())


def test_registered_differentiable_and_gradients_are_finite():
    reward = rewards.load("vvr_soft")
    assert isinstance(reward, VVRSoftReward) and isinstance(reward, Reward) and reward.differentiable
    tasks = generate_tasks(3, seed=4, level="hard") + generate_tasks(3, seed=4, level="medium")
    rendered = torch.stack([_image(t) for t in tasks])
    noise = torch.rand(len(tasks), 3, 64, 64, generator=torch.Generator().manual_seed(0))
    for images in (rendered, noise, torch.full_like(noise, 0.5)):
        x = images.clone().requires_grad_(True)
        out = reward(x, [t.prompt for t in tasks], [{"task": t.to_dict()} for t in tasks])
        score = out.components["vvr_soft"]
        assert score.shape == (6,) and score.dtype == torch.float32 and ((score >= 0) & (score <= 1)).all()
        (grad,) = torch.autograd.grad(score.sum(), x)
        assert torch.isfinite(grad).all()
        # every sample has a gradient of its own (also a flat grey image, far from every object)
        assert (grad.flatten(1).norm(dim=1) > 0).all()


COUNT = [{"type": "count_colour_shape", "colour": "red", "shape": "circle", "n": 2}]
LEFT = [{"type": "left_of", "a": RED, "b": BLUE}]


@pytest.mark.parametrize("task,wrong,gain", [
    (_task([_obj(0, "circle", "red", "medium", 0.3, 0.5), _obj(1, "circle", "red", "medium", 0.7, 0.5)], COUNT),
     _task([_obj(0, "circle", "red", "medium", 0.3, 0.5)], COUNT), 0.03),
    (_task([_obj(0, "circle", "red", "medium", 0.25, 0.5), _obj(1, "square", "blue", "medium", 0.75, 0.5)], LEFT),
     _task([_obj(0, "circle", "red", "medium", 0.75, 0.5), _obj(1, "square", "blue", "medium", 0.25, 0.5)], LEFT),
     0.0005),
], ids=["count", "left_of"])
def test_gradient_ascent_on_pixels_raises_the_score(task, wrong, gain):
    """Following ∇R from a wrong scene (an object missing; two objects swapped) raises R steadily: the
    gradient points uphill (a sign error or a detached path would lower or freeze it)."""
    reward = rewards.load("vvr_soft")
    x = _image(wrong)[None].requires_grad_(True)
    scores = []
    for _ in range(20):
        score = reward(x, [""], [{"task": task}]).components["vvr_soft"]
        (grad,) = torch.autograd.grad(score.sum(), x)
        scores.append(score.item())
        with torch.no_grad():
            x += 0.02 * grad.sign()
            x.clamp_(0, 1)
    assert scores[-1] > scores[0] + gain and all(b >= a - 1e-4 for a, b in zip(scores, scores[1:])), scores


def test_batch_dtype_size_and_invalid_samples():
    tasks = generate_tasks(3, seed=5, level="hard")
    x = torch.stack([_image(t) for t in tasks])
    meta = [{"task": t} for t in tasks]
    reward = rewards.load("vvr_soft")
    batch = reward(x, [""] * 3, meta).components["vvr_soft"]
    single = torch.cat([reward(x[i : i + 1], [""], meta[i : i + 1]).components["vvr_soft"] for i in range(3)])
    torch.testing.assert_close(batch, single)
    # half-precision input: scored in float32, gradients flow back in the input's dtype
    xb = x.to(torch.bfloat16).requires_grad_(True)
    out = reward(xb, [""] * 3, meta).components["vvr_soft"]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, batch, atol=0.05, rtol=0)
    out.sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and torch.isfinite(xb.grad.float()).all()
    # larger images are pooled to the working size: a 256 px render scores like the 64 px one
    big = torch.stack([_image(t, 256) for t in tasks])
    torch.testing.assert_close(reward(big, [""] * 3, meta).components["vvr_soft"], batch, atol=0.1, rtol=0)
    # a sample without a task, or with NaN pixels, is invalid and leaves the others untouched
    bad = x.clone()
    bad[1, 0, 0, 0] = float("nan")
    out = reward(bad, [""] * 3, [meta[0], meta[1], {}])
    assert out.valid.tolist() == [True, False, False]
    assert out.components["vvr_soft"][0] == batch[0] and "no 'task'" in out.info[2]["reason"]
    with pytest.raises(UserError, match="images"):
        reward(torch.rand(1, 2, 3, 64, 64), [""], [{}])
    with pytest.raises(UserError, match="gamma"):
        VVRSoftReward(gamma=1.5)


def test_without_count_gradients_counts_keep_their_value_and_pass_no_gradient():
    """``count_gradients=False``: a count's soft mass gradient grows or shrinks objects instead of adding
    or removing one, so it is cut — the scores are unchanged, a count task has exactly zero gradient, and
    a relation still has one (through the centroids, not through its objects' presence)."""
    count = _task([_obj(0, "circle", "red", "medium", 0.3, 0.5)], COUNT)
    left = _task([_obj(0, "circle", "red", "medium", 0.75, 0.5), _obj(1, "square", "blue", "medium", 0.25, 0.5)], LEFT)
    meta = [{"task": count}, {"task": left}]
    x = torch.stack([_image(count), _image(left)]).requires_grad_(True)
    full = rewards.load("vvr_soft")(x, ["", ""], meta).components["vvr_soft"]
    cut = rewards.load("vvr_soft", count_gradients=False)(x, ["", ""], meta).components["vvr_soft"]
    torch.testing.assert_close(cut, full)
    (g_full,) = torch.autograd.grad(full.sum(), x)
    (g_cut,) = torch.autograd.grad(cut.sum(), x)
    assert g_full[0].abs().sum() > 0 and g_cut[0].abs().sum() == 0
    assert g_cut[1].abs().sum() > 0 and not torch.equal(g_cut[1], g_full[1])


SHAPE_PROMPT_SHAPES = ("circle", "square", "triangle", "pentagon", "hexagon", "star")


@pytest.mark.parametrize("named", SHAPE_PROMPT_SHAPES)
def test_with_shapes_the_named_shape_outscores_every_other_shape(named):
    """``shapes=True``: "a red <named>" scores its own render above renders of every other shape of the
    same colour, size and place (the verifier's verdicts), where without shapes the score ranks them by
    area alone."""
    task = _task([_obj(0, named, "red", "medium", 0.5, 0.5)], [{"type": "exists", "ref": {"colour": "red", "shape": named}}])
    renders = [_task([_obj(0, s, "red", "medium", 0.5, 0.5)], task.to_dict()["constraints"]) for s in SHAPE_PROMPT_SHAPES]
    assert [verify(task, render(r, 64)).all_passed for r in renders] == [s == named for s in SHAPE_PROMPT_SHAPES]
    x = torch.stack([_image(r) for r in renders])
    meta = [{"task": task}] * len(renders)
    score = VVRSoftReward(shapes=True)(x, [""] * len(renders), meta).components["vvr_soft"]
    own = SHAPE_PROMPT_SHAPES.index(named)
    assert score[own] > 0.6 and (torch.cat([score[:own], score[own + 1:]]) < score[own] - 0.3).all(), score.tolist()
    plain = VVRSoftReward()(x, [""] * len(renders), meta).components["vvr_soft"]
    # without shapes, mass decides: the shape covering most of its box (the square) tops every prompt
    assert plain.argmax() == SHAPE_PROMPT_SHAPES.index("square"), plain.tolist()


def test_shape_gradient_turns_a_circle_into_the_hexagon_the_verifier_reads():
    """Ascending the shape term (alone: no count gradients) from a red circle under "a red hexagon" raises
    it and ends in an image the hard verifier reads as a red hexagon; the first gradient leaves the
    object's centre alone (circle and hexagon agree there) and acts on its rim."""
    constraints = [{"type": "exists", "ref": {"colour": "red", "shape": "hexagon"}}]
    task = _task([_obj(0, "hexagon", "red", "large", 0.5, 0.5)], constraints)
    x = _image(_task([_obj(0, "circle", "red", "large", 0.5, 0.5)], constraints))[None].requires_grad_(True)
    assert not verify(task, _pil(x)).all_passed
    reward = VVRSoftReward(shapes=True, count_gradients=False)
    scores, first = [], None
    for _ in range(40):
        score = reward(x, [""], [{"task": task}]).components["vvr_soft"]
        (grad,) = torch.autograd.grad(score.sum(), x)
        first = grad if first is None else first
        scores.append(score.item())
        with torch.no_grad():
            x += grad / grad.norm()
            x.clamp_(0, 1)
    assert scores[-1] > scores[0] + 0.5, scores
    assert verify(task, _pil(x)).all_passed
    moved = first[0].abs().sum(0)
    assert moved[30:34, 30:34].sum() < 1e-3 * moved.max() and moved.max() > 0


def _pil(x: torch.Tensor):
    from PIL import Image

    return Image.fromarray((x.detach()[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
