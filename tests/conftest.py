"""Session-wide test setup: offline hubs, one CPU thread, tiny model folders saved once per session, and the
``requires_program`` marker (tests/missing_programs.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# `@pytest.mark.requires_program("tesseract")`: skip where a system program is missing; and a test erroring
# for a missing program without that marker fails with a message saying to add it
from tests.missing_programs import (  # noqa: F401 - hooks
    pytest_collection_modifyitems, pytest_configure, pytest_runtest_makereport)

# Nothing is ever downloaded; a test that tries fails fast instead of hanging on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The test machines are shared: one intra-op thread keeps a run from starving its neighbours.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_model_dir(family, **overrides) -> Path``: a tiny diffusers folder (+ ``flowalign.json``)
    written by :func:`pipelines.tiny.save_tiny`, saved once per session per (family, overrides)."""
    from pipelines.tiny import save_tiny

    saved: dict[str, Path] = {}

    def get(family: str, **overrides) -> Path:
        key = f"{family}-{sorted(overrides.items())!r}"
        if key not in saved:
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            save_tiny(family, folder, **overrides)
            saved[key] = folder
        return saved[key]

    return get


@pytest.fixture(scope="session")
def tiny_sd3_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("sd3")


@pytest.fixture(scope="session")
def tiny_flux_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("flux")


@pytest.fixture(scope="session")
def tiny_wan_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("wan")


@pytest.fixture
def small_disk(tmp_path: Path) -> Callable[[int], Path]:
    """``small_disk(kib) -> Path``: a real file system of ``kib`` KiB (a tmpfs) that fills up like a full
    disk, with the errors real writers raise; skipped where mounting is not permitted."""
    import shutil
    import subprocess

    mounted: list[Path] = []

    def mount(kib: int) -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        if shutil.which("mount") is None or os.geteuid() != 0 or subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={kib}k,mode=777", "tmpfs", str(folder)],
                capture_output=True).returncode:
            pytest.skip("needs a small real file system: mounting a tmpfs is not permitted here")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
