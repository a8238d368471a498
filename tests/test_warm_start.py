"""The warm-started processes the run tests use (tests/warm_start.py) behave as ``subprocess.Popen`` would:
exit codes, output, signals, environment, working folder; ranks that stop together as under torchrun."""

from __future__ import annotations

import signal
import time

import pytest

from tests.warm_start import REPO, RUN_ENV, run_env, run_ranks, starter


def probe(*args: str, env: dict[str, str] | None = None, cwd=REPO):
    return starter().start("tests.warm_probe", list(args), env or run_env(), cwd=cwd)


@pytest.mark.parametrize("args, code, needle", [
    (("exit", "0"), 0, "argv ['exit', '0']"),
    (("exit", "3"), 3, "argv"),
    (("message", "bad input"), 1, "bad input"),
    (("raise", "boom"), 1, "RuntimeError: boom"),
    (("atexit", "4"), 4, "shut down as an interpreter does"),  # the interpreter's own exit, not os._exit
])
def test_exit_codes_and_output_are_the_processs(args, code, needle):
    proc = probe(*args)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == code and needle in out, out


def test_environment_and_folder_are_the_requests(tmp_path):
    out, _ = probe("env", "PROBE_VALUE", env=run_env(PROBE_VALUE="42"), cwd=tmp_path).communicate(timeout=60)
    assert "PROBE_VALUE=42" in out and f"cwd {tmp_path}" in out
    out, _ = probe("env", "PROBE_VALUE").communicate(timeout=60)
    assert "PROBE_VALUE=None" in out  # nothing left over from the previous child
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        probe("exit", "0", env={**run_env(), "OMP_NUM_THREADS": "4"})
    assert RUN_ENV["MKL_CBWR"] == "COMPATIBLE"


def test_a_signal_ends_the_process_with_that_signal():
    proc = probe("sleep", "60")
    assert proc.stdout.readline().startswith("argv") and proc.stdout.readline() == "sleeping\n"
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    with pytest.raises(Exception, match="pid"):
        probe("sleep", "60").wait(timeout=0.5)


def test_the_first_rank_to_fail_stops_the_others():
    start = time.monotonic()
    code, out = run_ranks("tests.warm_probe", ["rank"], 2, timeout=120)
    assert code == 5 and time.monotonic() - start < 30, out
    assert out.count("argv ['rank']") == 2
