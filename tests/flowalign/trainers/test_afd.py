"""Adversarial Flow Distillation: the prompt-paired Bradley-Terry discriminator, its advantages, the zero update
of a discriminator at chance, black-box teachers (a folder of videos, a second model) and bit-exact resume
(docs/methods/afd.md)."""

import json

import pytest
import torch

from flowalign.errors import UserError
from flowalign.media import save_video
from flowalign.trainers.parts.teacher_videos import ModelTeacher, VideoFolderTeacher
from flowalign.train import build_trainer
from flowalign.trainers.afd import discriminator_advantages, on_policy_nft_loss, weighted_matching_loss
from flowalign.trainers.parts.negative_aware import reward_weight
from flowalign.trainers.parts.video_discriminator import PromptPairedDiscriminator, bradley_terry_loss

from .conftest import small_config
from .resume_check import assert_trains_and_resumes_bit_exactly

PROMPTS = ["a red circle", "a blue square", "a green star", "a yellow triangle"]


def moving_square(direction: int, colour: tuple[float, float, float], frames: int = 9, size: int = 32) -> torch.Tensor:
    """``(F, 3, size, size)``: a square crossing the frame left to right (``direction`` 1) or back (−1)."""
    video = torch.ones(frames, 3, size, size)
    for f in range(frames):
        x = 4 + round(f * (size - 12) / (frames - 1))
        x = x if direction > 0 else size - 8 - x
        video[f, :, 12:20, x:x + 8] = torch.tensor(colour).view(3, 1, 1)
    return video


@pytest.fixture(scope="module")
def far_dir(tiny_model_dir):
    return tiny_model_dir("anyflow_far")


def write_teacher_videos(folder, frames: int = 9):
    """Two teacher videos a prompt of ``PROMPTS`` (a square moving each way), listed in ``videos.jsonl``."""
    rows = []
    for i, prompt in enumerate(PROMPTS):
        for j in range(2):
            path = save_video(moving_square(1 if j == 0 else -1, (0.9, 0.1 * i, 0.2), frames=frames),
                              folder / f"{i}-{j}.gif")
            rows.append(json.dumps({"prompt": prompt, "video": path.name}))
    (folder / "videos.jsonl").write_text("\n".join(rows) + "\n")
    return folder


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return write_teacher_videos(tmp_path_factory.mktemp("teacher"))


def stream(teacher_dir, *extra):
    return ("trainer.name=afd", "trainer.num_steps=2", "model.finetune=lora", "trainer.train_timesteps=1",
            f"trainer.teacher={{videos: '{teacher_dir}'}}", *extra)


def test_the_discriminator_learns_what_separates_paired_teacher_and_student_videos():
    """Teacher squares move right, student squares (same prompt, same colour) move left: only the motion tells
    them apart, and the discriminator learns it (it sees frame differences)."""
    torch.manual_seed(0)
    d = PromptPairedDiscriminator(width=8)
    opt = torch.optim.Adam(d.parameters(), lr=3e-3, betas=(0.5, 0.999))
    colours = [(0.9, 0.1, 0.1), (0.1, 0.2, 0.9), (0.1, 0.8, 0.2), (0.9, 0.8, 0.1)]
    teacher = torch.stack([moving_square(1, c) for c in colours])
    student = torch.stack([moving_square(-1, c) for c in colours])
    first = bradley_terry_loss(d(teacher, PROMPTS), d(student, PROMPTS)).item()
    for _ in range(60):
        opt.zero_grad()
        loss = bradley_terry_loss(d(teacher, PROMPTS), d(student, PROMPTS))
        loss.backward()
        opt.step()
    with torch.no_grad():
        margin = d(teacher, PROMPTS) - d(student, PROMPTS)
    assert abs(first - 0.693) < 0.05  # σ(0): a fresh discriminator is near chance
    assert loss.item() < 0.2 and (margin > 0).all()


def test_the_former_advantages_are_the_students_log_odds_centred_per_prompt():
    student = torch.tensor([[2.0, 0.0, 1.0], [5.0, 5.0, 5.0]])
    teacher = torch.tensor([1.0, -3.0])
    a = discriminator_advantages(student, teacher, clip=10.0, form="centred")
    torch.testing.assert_close(a, torch.tensor([[1.0, -1.0, 0.0], [0.0, 0.0, 0.0]]))
    # the teacher's own score cancels within a prompt; the clip bounds what one video can weigh
    torch.testing.assert_close(discriminator_advantages(student, teacher + 7, clip=10.0, form="centred"), a)
    assert discriminator_advantages(student * 10, teacher, clip=2.0, form="centred").abs().max() == 2.0


def test_advantages_are_the_log_odds_normalised_as_diffusion_nft_and_mapped_to_r():
    """The default: the log-odds s = D_S − D_T, minus their prompt's mean, divided by the population std of
    every s of the step + 1e-4, clipped to ±A_max; r = A/(2·A_max) + ½ (DiffusionNFT's normalised advantage
    and optimality weight), worked by hand."""
    student = torch.tensor([[3.0, 1.0], [0.0, -2.0]])
    teacher = torch.tensor([2.0, 1.0])
    # s = [[1, −1], [−1, −3]]: prompt means 0 and −2 → centred [[1, −1], [1, −1]]; the batch mean of s is −1,
    # its squared deviations 4, 0, 0, 4 → population variance 2, std √2 (the teacher's score enters the std)
    a = discriminator_advantages(student, teacher, clip=5.0)
    expected = torch.tensor([[1.0, -1.0], [1.0, -1.0]]) / (2.0 ** 0.5 + 1e-4)
    torch.testing.assert_close(a, expected)
    assert abs(a[0, 0].item() - 0.707057) < 1e-5  # not the unbiased std (√(8/3): 0.61234), nor a prompt's (1)
    # the same std given from every rank's log-odds
    torch.testing.assert_close(discriminator_advantages(student, teacher, 5.0, scale=torch.tensor(2.0 ** 0.5)), a)
    # r = A/(2·5) + ½ = ½ ± 0.0707057
    torch.testing.assert_close(reward_weight(a.flatten(), 5.0), torch.tensor([0.5707057, 0.4292943] * 2))
    # a discriminator that scores every student alike: A = 0, r = ½ exactly
    flat = discriminator_advantages(torch.full((2, 3), 0.3), teacher, clip=5.0)
    assert torch.equal(flat, torch.zeros(2, 3)) and torch.equal(reward_weight(flat.flatten(), 5.0), torch.full((6,), 0.5))
    # the clip bounds the normalised advantage (only reachable with groups larger than the rest of the batch)
    assert discriminator_advantages(student, teacher, clip=0.5).abs().max() == 0.5


def test_the_nft_loss_mirrors_the_velocity_around_the_starting_weights():
    """DiffusionNFT's r·mean(v⁺ − (ε − x0))² + (1 − r)·mean(v⁻ − (ε − x0))² with v_old = sg(v): v± equal v in
    value (the loss is the plain matching error) and its gradient is 2β·(2r − 1)·(v − (ε − x0))/D, worked by hand
    for v = [1, 3], ε − x0 = [0, 1] (D = 2), β = ½."""
    clean, eps = torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    sigma = 0.4
    noised = (1 - sigma) * clean + sigma * eps

    def value_and_grad(r: float, beta: float = 0.5):
        v = torch.tensor([[1.0, 3.0]], requires_grad=True)
        loss, _ = on_policy_nft_loss(v, noised, clean, eps, sigma, torch.tensor([r]), beta, 5.0)
        (grad,) = torch.autograd.grad(loss.sum(), v)
        return loss.item(), grad

    loss, grad = value_and_grad(0.75)
    assert loss == pytest.approx(2.5)                                   # mean([1², 2²])
    torch.testing.assert_close(grad, torch.tensor([[0.25, 0.5]]))       # 2·½·(2·¾ − 1)/2 · [1, 2]
    torch.testing.assert_close(value_and_grad(0.25)[1], torch.tensor([[-0.25, -0.5]]))  # pushed away
    assert torch.equal(value_and_grad(0.5)[1], torch.zeros(1, 2))       # r = ½ teaches nothing
    torch.testing.assert_close(value_and_grad(1.0, beta=1.0)[1], torch.tensor([[1.0, 2.0]]))  # β = 1, r = 1: plain FM


def test_the_weighted_matching_loss_pulls_toward_good_students_and_pushes_from_bad():
    target = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    v = torch.zeros(2, 2, requires_grad=True)
    (grad,) = torch.autograd.grad(weighted_matching_loss(v, target, torch.tensor([1.0, -1.0])), v)
    stepped = v.detach() - 0.1 * grad
    assert (stepped[0] > 0).all() and (stepped[1] > 0).all()  # toward row 0's target, away from row 1's
    (zero,) = torch.autograd.grad(weighted_matching_loss(v, target, torch.zeros(2)), v)
    assert torch.equal(zero, torch.zeros_like(zero))


def test_a_discriminator_at_chance_gives_a_zero_update(tmp_path, far_dir, teacher_dir, prompt_file):
    """A discriminator that scores every video alike (its last layer zero: σ(0) = ½ for every pair) gives every
    student a zero advantage and the student no gradient; the same step with a discriminator that is not at
    chance moves it."""
    t = build_trainer(small_config(tmp_path / "run", far_dir, prompt_file, *stream(teacher_dir, "trainer.disc_steps=0")))
    with torch.no_grad():
        t.discriminator.head[-1].weight.zero_()
    batch = t.collect(0)
    assert batch.logs["disc/teacher_win_prob"] == pytest.approx(0.5) and batch.logs["zero_adv_fraction"] == 1.0
    params = [p for p in t.params if p.requires_grad]

    def grads(b):
        loss, _ = t.loss(b, t.plan(b, torch.Generator()).steps[0][0])
        return torch.autograd.grad(loss, params, allow_unused=True)

    assert all(g is None or torch.equal(g, torch.zeros_like(g)) for g in grads(batch))
    with torch.no_grad():
        t.discriminator.head[-1].weight.normal_()
    live = t.collect(0)
    assert live.logs["zero_adv_fraction"] < 1.0
    assert any(g is not None and g.abs().sum() > 0 for g in grads(live))


def test_the_discriminator_trains_on_its_step_and_resumes_bit_exactly(tmp_path, far_dir, teacher_dir, prompt_file):
    straight = assert_trains_and_resumes_bit_exactly(tmp_path, far_dir, prompt_file, *stream(teacher_dir))
    fresh = build_trainer(small_config(tmp_path / "fresh", far_dir, prompt_file, *stream(teacher_dir)))
    moved = [not torch.equal(a, b) for a, b in zip(straight.discriminator.parameters(), fresh.discriminator.parameters())]
    assert any(moved)  # the critic learnt, and its weights and Adam state came back on resume


def test_a_folder_teacher_serves_its_videos_by_prompt_and_refuses_prompts_it_lacks(teacher_dir, tmp_path):
    teacher = VideoFolderTeacher(teacher_dir)
    videos = teacher.videos(PROMPTS[:2], [0, 1])
    assert videos.shape == (2, 9, 3, 32, 32) and 0 <= videos.min() and videos.max() <= 1
    # seed 0 picks the right-moving video, seed 1 the left-moving one: the square's column in the last frame
    last = videos[:, -1, 1]  # green channel: the square is dark there on a white background
    assert last[0, 16, 24:].mean() < last[0, 16, :8].mean() and last[1, 16, :8].mean() < last[1, 16, 24:].mean()
    with pytest.raises(UserError, match="no video for 1 of the training prompts"):
        teacher.check_prompts(["a purple hexagon", *PROMPTS])
    with pytest.raises(UserError, match="videos.jsonl"):
        VideoFolderTeacher(tmp_path)


def test_a_model_teacher_samples_its_own_videos_and_a_non_streaming_student_is_refused(tmp_path, tiny_wan_dir,
                                                                                       teacher_dir, prompt_file):
    teacher = ModelTeacher(tiny_wan_dir, "cpu", num_steps=2)
    a, b = teacher.videos(PROMPTS[:2], [3, 4]), teacher.videos(PROMPTS[:2], [3, 4])
    assert a.ndim == 5 and a.shape[2] == 3 and torch.equal(a, b)  # the same seeds, the same videos
    with pytest.raises(UserError, match="streaming"):
        build_trainer(small_config(tmp_path / "run", tiny_wan_dir, prompt_file, *stream(teacher_dir)))
