"""A run killed again and again at chosen moments (model load, each checkpoint file, evaluation, a metrics
row), with files of its newest checkpoint cut short between restarts, ends at the weights of a run never
interrupted and logs every step once."""

import json
import random

import pytest
from safetensors.torch import load_file

from flowalign import checkpoint as ckpt

from .conftest import small_run
from .faults import exit_code, run_forked

#: (function, mode, calls per checkpoint): where a restart is killed; ``torn`` leaves the file it was writing
#: cut in half. The fault strikes at a random call within the restart's first two checkpoints (steps), so
#: some restarts get a checkpoint further and others none.
FAULTS = [
    ("pipelines:load", "kill", 0),
    ("flowalign.checkpoint:save_file", "torn", 3),  # rng, trainable, optimizer
    ("pipelines.lora:save_adapter", "torn", 1),
    ("flowalign.checkpoint:write_json", "kill", 2),  # optimizer.json, trainer_state.json
    ("flowalign.manifest:write_json", "kill", 1),
    ("flowalign.checkpoint:finalise", "kill", 1),
    ("flowalign.evaluation:sample_seeded_with_notes", "kill", 1),  # once an evaluation, every other step
    ("flowalign.logger:RunLogger.log", "torn", 1),  # a step's row (and an evaluation's)
]


def _args(run_dir, tiny_sd3_dir, prompt_file):
    return ["train", "/dev/null", *small_run(run_dir, tiny_sd3_dir, prompt_file, "trainer.max_steps=5",
                                             "run.checkpoint_every=1", "eval.bench=vvr", "eval.level=easy",
                                             "eval.n=1", "eval.num_steps=2", "eval.every=2", "eval.gallery=false")]


def _cut_newest(run_dir, rng):
    newest = ckpt.latest_checkpoint(run_dir)
    if newest is None:
        return
    victim = rng.choice(sorted(p for p in newest.rglob("*") if p.is_file()))
    victim.write_bytes(victim.read_bytes()[: int(victim.stat().st_size * rng.random())])


@pytest.mark.slow
def test_repeated_kills_and_damaged_checkpoints_end_at_the_uninterrupted_weights(tmp_path, tiny_sd3_dir, prompt_file):
    reference = run_forked(_args(tmp_path / "reference", tiny_sd3_dir, prompt_file), wait=False)  # alongside
    rng = random.Random(28)
    run_dir = tmp_path / "faulty"
    codes = []
    for function, mode, per_checkpoint in rng.sample(FAULTS, len(FAULTS)):
        k = 1 if per_checkpoint == 0 else per_checkpoint * rng.randint(0, 1) + rng.randint(1, per_checkpoint)
        codes.append(run_forked(_args(run_dir, tiny_sd3_dir, prompt_file), (function, k, mode)))
        if rng.random() < 0.5:
            _cut_newest(run_dir, rng)
    assert set(codes) <= {0, -9} and codes.count(-9) >= 6, codes  # the faults struck before the run ended
    assert run_forked(_args(run_dir, tiny_sd3_dir, prompt_file)) == 0
    assert exit_code(reference) == 0

    a = load_file(str(tmp_path / "reference" / "checkpoints" / "step-000005" / "trainable.safetensors"))
    b = load_file(str(run_dir / "checkpoints" / "step-000005" / "trainable.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    rows, reference_rows = ([json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
                            for d in (run_dir, tmp_path / "reference"))
    logged = [(r["step"], "eval/n" in r) for r in rows]
    assert logged == [(0, True), (1, False), (2, False), (2, True), (3, False), (4, False), (4, True), (5, False),
                      (5, True)]
    assert logged == [(r["step"], "eval/n" in r) for r in reference_rows]
    assert [r for r in rows if "eval/n" in r] == [r for r in reference_rows if "eval/n" in r]
