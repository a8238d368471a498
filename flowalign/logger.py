"""Run logging: ``metrics.jsonl`` always, TensorBoard by default, W&B when installed and asked for."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flowalign import strict_json
from flowalign.io import atomic_path


def _parse(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


class RunLogger:
    """Writes scalars from rank 0; other ranks get a logger that does nothing."""

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool, wandb: bool, project: str,
                 name: str, config: dict[str, Any]):
        self.enabled = enabled
        self.tb = self.wandb = None
        self.already_logged: set[tuple[int, tuple[str, ...]]] = set()
        if not enabled:
            return
        self.metrics_path = run_dir / "metrics.jsonl"
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if wandb:
            try:
                import wandb as wandb_lib
            except ImportError:
                print("warning: run.wandb is true but wandb is not installed (pip install wandb); logging without it",
                      file=sys.stderr)
            else:
                self.wandb = wandb_lib.init(project=project, name=name, config=config, dir=str(run_dir), resume="allow")

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after ``step`` (a resumed run re-logs them; -1 drops all), and a line torn by
        a kill mid-write, with a warning."""
        if not self.enabled or not self.metrics_path.exists():
            return
        kept = []
        for number, line in enumerate(self.metrics_path.read_text(errors="replace").splitlines(), 1):
            row = _parse(line)
            if row is None and line.strip():
                print(f"warning: {self.metrics_path}:{number} is a torn row ({line[:60]!r}); dropped", file=sys.stderr)
            elif row is not None and row.get("step", 0) <= step:
                kept.append(line)
                if row.get("step", 0) == step:  # e.g. the final evaluation of a run killed before it ended
                    self.already_logged.add((step, tuple(sorted(row))))
        with atomic_path(self.metrics_path) as tmp:
            tmp.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        row_id = (step, tuple(sorted(["step", *scalars])))
        if row_id in self.already_logged:  # the same row of the step resumed from: logged once only
            self.already_logged.discard(row_id)
            return
        with open(self.metrics_path, "a") as f:
            f.write(strict_json.dumps({"step": step, **scalars}) + "\n")
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


@contextmanager
def diffusers_warnings_off() -> Iterator[None]:
    """diffusers' logging at errors only inside the block (its advice on casting a loaded model with ``to()``
    does not apply to the weightless copies the planner and the FLOP count build on the meta device)."""
    from diffusers.utils import logging as diffusers_logging

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(level)
