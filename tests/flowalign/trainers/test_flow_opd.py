"""Flow-OPD: single-reward teachers distilled on-policy into one student, each on its own domain
(docs/methods/flow_opd.md)."""

import pytest
import torch

from flowalign.saved_weights import load_adapter_checked
from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer, check_run
from flowalign.trainers.flow_opd import distillation_loss, route

from .conftest import small_config, small_run
from .resume_check import assert_trains_and_resumes_bit_exactly


@pytest.fixture(scope="module")
def teachers(tmp_path_factory, tiny_sd3_dir, prompt_file):
    """``same``: an adapter equal to a fresh student's (LoRA B = 0); ``trained``: a flow_grpo run's checkpoint."""
    root = tmp_path_factory.mktemp("teachers")
    torch.manual_seed(0)
    fresh = build_trainer(small_config(root / "fresh", tiny_sd3_dir, prompt_file))
    fresh.policy.save_adapter(root / "same")
    torch.manual_seed(0)
    build_trainer(small_config(root / "run", tiny_sd3_dir, prompt_file, "trainer.max_steps=1",
                               "trainer.lr=1e-2", "run.checkpoint_every=1")).train()
    return {"same": root / "same", "trained": root / "run" / "checkpoints" / "step-000001"}


def opd(tmp_path, tiny_sd3_dir, prompt_file, teachers_yaml, *extra):
    torch.manual_seed(0)
    return build_trainer(small_config(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=flow_opd",
                                      f"trainer.teachers={teachers_yaml}", "trainer.prompts_per_step=4",
                                      "trainer.group_size=1", "trainer.batch_size=4", *extra))


def test_route_takes_the_first_matching_teacher():
    prompts = ["a red circle", "a blue square", "a green star", "a yellow triangle"]
    assert route(prompts, ["red|blue", "green|red"]).tolist() == [0, 0, 1, -1]
    assert route(prompts, [None]).tolist() == [0, 0, 0, 0]


def test_distillation_loss_on_a_known_answer():
    v = torch.tensor([[1.0, 2.0], [0.0, 0.0]], requires_grad=True)
    vt, va = torch.tensor([[0.0, 0.0], [1.0, 1.0]]), torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    loss, _ = distillation_loss(v, vt, va, torch.tensor([1.0, 0.0]), anchor_weight=0.5)
    # sample 0: mean(1, 4) + 0.5·mean(0, 4) = 3.5; sample 1 (not routed): 0.5·mean(0, 4) = 1
    torch.testing.assert_close(loss, torch.tensor([3.5, 1.0]))
    loss.sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([[1.0, 2.0 + 1.0], [0.0, -1.0]]))


def per_sample_losses(t, batch):
    from flowalign.trainers.base import SliceUnit

    return [t.loss(batch, SliceUnit(slice(n, n + 1), 1))[0].item() for n in range(len(batch.x))]


def test_a_teacher_equal_to_the_student_gives_zero_loss(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    t = opd(tmp_path / "r", tiny_sd3_dir, prompt_file, f"[{{adapter: {teachers['same']}}}]",
            "trainer.cold_start_steps=0", "trainer.anchor_weight=0")
    batch = t.collect(0)
    assert batch.routed.tolist() == [1.0] * 4
    # zero up to the rounding of batch-size-dependent kernels (a trained teacher's loss is ~1e-4, see below)
    assert max(per_sample_losses(t, batch)) < 1e-10


def test_each_teacher_supervises_only_its_own_domain(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    """Teacher 0 (trained) owns red/blue prompts, teacher 1 (= the student) green ones, yellow has none."""
    spec = f"[{{adapter: {teachers['trained']}, match: 'red|blue'}}, {{adapter: {teachers['same']}, match: green}}]"
    t = opd(tmp_path / "r", tiny_sd3_dir, prompt_file, spec, "trainer.cold_start_steps=0", "trainer.anchor_weight=0")
    batch = t.collect(0)
    prompts = [t.data.prompts[i] for i in t.step_indices(0)]
    losses = dict(zip(prompts, per_sample_losses(t, batch)))
    assert losses["a red circle"] > 1e-8 and losses["a blue square"] > 1e-8
    assert losses["a green star"] < 1e-10 and losses["a yellow triangle"] == 0  # yellow: no teacher term at all
    # the red row's target is the trained teacher's own velocity (loaded into a separate model)
    torch.manual_seed(0)
    other = build_trainer(small_config(tmp_path / "o", tiny_sd3_dir, prompt_file))
    load_adapter_checked(other.policy, teachers["trained"])
    n = prompts.index("a red circle")
    with torch.no_grad():
        v = other.policy.velocity(batch.x[n:n + 1, 0], batch.sigma[n:n + 1, 0], batch.cond[[n]], batch.guidance)
    torch.testing.assert_close(batch.v_teacher[n:n + 1, 0], v)
    assert not torch.equal(batch.v_teacher[n:n + 1, 0],
                           t.policy.velocity(batch.x[n:n + 1, 0], batch.sigma[n:n + 1, 0], batch.cond[[n]],
                                             batch.guidance).detach())


def test_the_cold_start_fits_the_teachers_samples_then_distillation_begins(tmp_path, tiny_sd3_dir, prompt_file,
                                                                           teachers):
    t = opd(tmp_path / "r", tiny_sd3_dir, prompt_file, f"[{{adapter: {teachers['trained']}}}]",
            "trainer.cold_start_steps=1")
    cold, warm = t.collect(0), t.collect(1)
    assert cold.logs["stage"] == 0 and cold.guidance == 1.0 and cold.x.shape[1] == 1
    assert warm.logs["stage"] == 1 and warm.x.shape[1] == t.tcfg.num_steps and warm.v_anchor is not None


def test_a_missing_teacher_is_named_when_training_starts(tmp_path, tiny_sd3_dir, prompt_file):
    check_run(load_config(None, small_run(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=flow_opd",
                                          "trainer.teachers=[{adapter: /no/such/run}]")))  # plan, --check: fine
    with pytest.raises(UserError, match="/no/such/run.* does not exist; train the teacher first"):
        opd(tmp_path / "t", tiny_sd3_dir, prompt_file, "[{adapter: /no/such/run}]")


@pytest.mark.parametrize("bad,match", [("[{adapter: ADAPTER, reward: ocr}]", "not one of the run's rewards"),
                                       ("[{adapter: ADAPTER, match: '(unclosed'}]", "not a regular expression")])
def test_bad_teachers_name_the_field(tmp_path, tiny_sd3_dir, prompt_file, teachers, bad, match):
    spec = bad.replace("ADAPTER", str(teachers["same"]))
    with pytest.raises(UserError, match=match):
        check_run(load_config(None, small_run(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=flow_opd",
                                              f"trainer.teachers={spec}")))


def test_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=flow_opd",
                                          "trainer.group_size=1",
                                          f"trainer.teachers=[{{adapter: {teachers['trained']}}}]",
                                          "trainer.cold_start_steps=1", "trainer.states_per_sample=2")


def test_a_teacher_no_prompt_is_routed_to_is_warned_about(tmp_path, tiny_sd3_dir, prompt_file, teachers, capsys):
    same = teachers["same"]
    opd(tmp_path / "r", tiny_sd3_dir, prompt_file,
        f"[{{adapter: {same}, match: red}}, {{adapter: {same}, match: 'red circle'}}, {{adapter: {same}, match: purple}}]")
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: trainer.teachers[")]
    # [1] only ever matches what [0] takes first; [2] matches nothing; [0] is used
    assert [line[: len("warning: trainer.teachers[1]")] for line in warned] == \
        ["warning: trainer.teachers[1]", "warning: trainer.teachers[2]"]
    assert "match='purple') is the first match of none of the 4 training prompts" in warned[1]
