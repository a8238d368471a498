"""Where the shipped assets (tiny models, benchmark splits) live."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def assets_dir() -> Path:
    """``$FLOWALIGN_ASSETS`` if set, else the repository's ``assets/`` folder."""
    return Path(os.environ.get("FLOWALIGN_ASSETS", REPO_ROOT / "assets"))


def default_model_dir() -> Path:
    """The embedded default model, pretrained by ``flowalign pretrain-tiny sd3``."""
    return assets_dir() / "tiny-sd3-vvr"
