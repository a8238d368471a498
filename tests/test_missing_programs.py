"""The ``requires_program`` marker and the check behind it (tests/missing_programs.py), run on a generated
test file in a subprocess: a marked test skips with the program's name where it is missing and runs where it
is found; an unmarked test that errors for a missing program fails with a message saying to mark it; other
failures, a missing data file among them, are left as they are."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ABSENT = "flowalign-no-such-program"

GENERATED = textwrap.dedent(f'''
    import subprocess
    import pytest

    class UserError(Exception):
        pass

    @pytest.mark.requires_program("{ABSENT}", install="apt-get install {ABSENT}")
    def test_marked_and_missing():
        subprocess.run(["{ABSENT}"])

    @pytest.mark.requires_program("sh")
    def test_marked_and_present():
        assert subprocess.run(["sh", "-c", "exit 0"]).returncode == 0

    def test_unmarked_subprocess():
        subprocess.run(["{ABSENT}", "--version"])

    def test_unmarked_one_line_error():
        try:
            raise FileNotFoundError("x")
        except FileNotFoundError:
            raise UserError("ocr reward: engine tesseract needs the tesseract program (apt-get ...)") from None

    @pytest.fixture
    def engine():
        raise UserError("render: needs the chromium program (apt-get install chromium)")

    def test_unmarked_fixture_error(engine):
        pass

    @pytest.mark.requires_program("sh")
    def test_marked_for_another_program():
        subprocess.run(["{ABSENT}"])

    def test_missing_data_file():
        open("no-such-file.txt")

    def test_plain_failure():
        assert 1 == 2
''')


def test_marked_tests_skip_and_unmarked_ones_missing_a_program_fail_with_the_fix(tmp_path):
    (tmp_path / "test_generated.py").write_text(GENERATED)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.missing_programs", "-p", "no:cacheprovider",
                           "-n", "0", "-rA", "-q", "--rootdir", str(tmp_path), str(tmp_path / "test_generated.py")],
                          cwd=REPO, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    lines = {line.split(" ")[1].split("::")[-1]: line for line in out.splitlines()
             if line.split(" ")[0] in ("PASSED", "FAILED", "SKIPPED", "ERROR") and "::" in line}
    assert lines["test_marked_and_present"].startswith("PASSED")
    skip = [line for line in out.splitlines() if line.startswith("SKIPPED") and ABSENT in line]
    assert len(skip) == 1 and f"needs the {ABSENT} program, not found on PATH (apt-get install {ABSENT})" in skip[0]
    fix = f'mark it @pytest.mark.requires_program("{ABSENT}"'
    for name, program in [("test_unmarked_subprocess", ABSENT), ("test_unmarked_one_line_error", "tesseract"),
                          ("test_unmarked_fixture_error", "chromium")]:
        assert lines[name].startswith(("FAILED", "ERROR")), out
        assert f"test_generated.py::{name} failed because the system program '{program}' is missing" in out
    assert out.count(fix) >= 1 and 'mark it @pytest.mark.requires_program("tesseract"' in out
    assert "marked requires_program('sh') but not for 'flowalign-no-such-program': add it" in out
    # a missing data file and a plain assertion are not blamed on a program
    assert lines["test_missing_data_file"].startswith("FAILED") and lines["test_plain_failure"].startswith("FAILED")
    assert out.count("failed because the system program") == 4
