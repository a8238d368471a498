"""Tests that need a system program skip with the reason where it is missing, and nothing else may error for one.

``make test`` has to pass on a fresh machine with nothing but Python packages installed. A test that runs a
program pip cannot install (tesseract, chromium, ...) carries the marker::

    @pytest.mark.requires_program("tesseract", install="apt-get install tesseract-ocr")

and is skipped, naming the program and how to install it, when ``shutil.which`` does not find it; where it
is found (CI installs them, ``.ci/run``), the test runs. A test without the marker that fails because a
program is missing fails with a message saying to add the marker, rather than an error that looks like a
bug. ``tests/conftest.py`` loads these hooks; ``tests/test_missing_programs.py`` checks them.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

MARKER = "requires_program"
#: what the project's and its libraries' errors say when a program is missing
_MISSING = re.compile(r"needs the ([\w.+-]+) program"  # this project's one-line errors
                      r"|([\w.+-]+) is not installed or it's not in your PATH"  # pytesseract
                      r"|([\w.+-]+) (?:program |executable |binary )?(?:is not installed|not found on PATH)")


def missing(name: str) -> bool:
    """Whether the program ``name`` is not on PATH."""
    return shutil.which(name) is None


def _missing_program(error: BaseException) -> str | None:
    """The program whose absence ``error`` (or an exception it was raised from or during) reports, else None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, FileNotFoundError) and error.filename and _raised_by_exec(error):
            return str(error.filename)
        match = _MISSING.search(str(error))
        if match:
            return next(g for g in match.groups() if g)
        error = error.__cause__ or error.__context__
    return None


def _raised_by_exec(error: BaseException) -> bool:
    """Whether ``error`` came from starting a program (subprocess or os.exec*), not from opening a file."""
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "_execute_child" and code.co_filename == subprocess.__file__:
            return True
        if code.co_name.startswith("exec") and code.co_filename.endswith("os.py"):
            return True
        tb = tb.tb_next
    return False


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}(name, install=None): skip, naming the program and its install "
                                       "command, when the system program `name` is not on PATH")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # a skip mark, not a skip raised later: the summary then names the test, and no fixture is set up for it
    for item in items:
        for mark in item.iter_markers(MARKER):
            name, install = mark.args[0], mark.kwargs.get("install")
            if missing(name):
                item.add_marker(pytest.mark.skip(
                    reason=f"needs the {name} program, not found on PATH" + (f" ({install})" if install else "")))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or not report.failed:
        return
    program = _missing_program(call.excinfo.value)
    if program is None:
        return
    marked = [m.args[0] for m in item.iter_markers(MARKER)]
    hint = (f"it is marked requires_program({', '.join(map(repr, marked))}) but not for {program!r}: add it"
            if marked else f'mark it @pytest.mark.requires_program("{program}", install="...")')
    report.outcome = "failed"
    report.longrepr = (f"{item.nodeid} failed because the system program {program!r} is missing: {hint}, so it "
                       f"skips with the reason where the program is not installed (tests/missing_programs.py).\n\n"
                       f"{report.longrepr}")
