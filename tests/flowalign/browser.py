"""Find and drive headless Chromium (Debian's ``chromium`` package) to check pages the way people see them.

Tests using it carry ``@pytest.mark.requires_program("chromium", ...)`` (tests/missing_programs.py): they skip
where it is not on PATH, and run where CI installs it (.ci/run)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

# a quiet, offline, throw-away browser: no sandbox (tests run as root in containers), no GPU, nothing
# that phones home or touches a profile other than a fresh one per run
_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio",
]
# virtual time lets the page's load handlers run without sleeping in real time
_VIRTUAL_TIME_MS = 5000
_TIMEOUT_S = 60


def find_chromium() -> Path | None:
    """The ``chromium`` on PATH (what ``requires_program`` looks for); ``None`` when it is not installed."""
    found = shutil.which("chromium")
    return Path(found) if found else None


def _run(chromium: Path, args: list[str], url: str) -> str:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        done = subprocess.run(
            [str(chromium), *_FLAGS, f"--user-data-dir={profile}", *args, url],
            capture_output=True, text=True, timeout=_TIMEOUT_S, check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"chromium exited with {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def render_in_chromium(html_path: Path, screenshot_path: Path | None, *, fragment: str = "",
                       window_size: tuple[int, int] = (1280, 900)) -> str:
    """Load ``html_path`` (``#fragment`` appended when given), let its scripts run, and return the DOM
    serialised after load; also save a PNG screenshot of the viewport to ``screenshot_path``."""
    chromium = find_chromium()
    if chromium is None:
        raise FileNotFoundError("rendering a page needs the chromium program (apt-get install -y chromium)")
    url = Path(html_path).resolve().as_uri() + (f"#{fragment}" if fragment else "")
    dom = _run(chromium, [f"--virtual-time-budget={_VIRTUAL_TIME_MS}", "--dump-dom"], url)
    if screenshot_path is not None:
        screenshot_path = Path(screenshot_path).resolve()
        screenshot_path.parent.mkdir(parents=True, exist_ok=True)
        _run(chromium, [f"--virtual-time-budget={_VIRTUAL_TIME_MS}", f"--window-size={window_size[0]},{window_size[1]}",
                        f"--screenshot={screenshot_path}"], url)
        if not screenshot_path.is_file():
            raise RuntimeError(f"chromium wrote no screenshot to {screenshot_path}")
    return dom
