"""Code a module keeps a copy of, to read top to bottom (or to call no private name of diffusers), says where
it comes from as diffusers does: ``# Copied from package.module.Name[.attr] [with Old->New[, Old->New]]`` on
the line above the ``def``. Each such copy's body (its statements after the docstring) stays identical to
the original's, with the listed renames applied; the docstrings may differ (they carry each copy's shapes)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flowalign", "pipelines", "rewards")
MARKER = re.compile(r"^\s*# Copied from ([\w.]+)(?: with (.+))?\s*$")


def markers(root: Path) -> list[tuple[Path, int, str, str]]:
    """``(file, line of the def, target, renames)`` of every ``# Copied from`` comment under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            match = MARKER.match(line)
            if match:
                found.append((path, i + 2, match.group(1), match.group(2) or ""))
    return found


def resolve(dotted: str) -> object:
    """The object a dotted name points at: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"nothing importable in {dotted!r}")


def body(source: str) -> str:
    """The statements of the one function in ``source`` after its docstring, as ``ast.unparse`` writes them."""
    (func,) = ast.parse(textwrap.dedent(source)).body
    statements = func.body
    if statements and isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant):
        statements = statements[1:]
    return "\n".join(ast.unparse(s) for s in statements)


def function_at(path: Path, line: int) -> str:
    """The source of the function (decorators skipped) whose ``def`` is at ``line`` of ``path`` or follows it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and min(
                [node.lineno, *(d.lineno for d in node.decorator_list)]) == line:
            node.decorator_list = []
            return ast.unparse(node)
    raise AssertionError(f"{path}:{line}: a '# Copied from' comment must stand right above a def")


def differs(path: Path, line: int, target: str, renames: str) -> str | None:
    """None when the copy at ``path:line`` matches ``target``; else what differs."""
    original = inspect.getsource(resolve(target))
    for rename in filter(None, (r.strip() for r in renames.split(","))):
        old, new = (s.strip() for s in rename.split("->"))
        original = original.replace(old, new)
    mine, theirs = body(function_at(path, line)), body(original)
    return None if mine == theirs else f"copy:\n{mine}\n\noriginal ({target}):\n{theirs}"


ALL = [m for package in PACKAGES for m in markers(REPO / package)]


def test_the_copies_are_marked():
    """The copies the families and rewards keep (a test that finds none would check nothing)."""
    targets = {(str(p.relative_to(REPO)), t) for p, _, t, _ in ALL}
    flux_ids = "diffusers.pipelines.flux.pipeline_flux.FluxPipeline._prepare_latent_image_ids"
    assert {("pipelines/_common.py", flux_ids), ("pipelines/zimage.py", "pipelines.sd3.SD3Policy.decode")} <= targets


@pytest.mark.parametrize("path, line, target, renames", ALL,
                         ids=[f"{p.relative_to(REPO)}:{n}" for p, n, _, _ in ALL])
def test_every_marked_copy_is_identical_to_its_original(path, line, target, renames):
    problem = differs(path, line, target, renames)
    assert problem is None, f"{path.relative_to(REPO)}:{line} drifted from {target}; copy it again\n{problem}"


def test_the_check_sees_a_drifted_copy_and_applies_renames(tmp_path):
    module = tmp_path / "copies.py"
    module.write_text(textwrap.dedent('''
        # Copied from tests.test_copied_from.body
        def same(source):
            """Another docstring: allowed."""
            (func,) = ast.parse(textwrap.dedent(source)).body
            statements = func.body
            if statements and isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant):
                statements = statements[1:]
            return "\\n".join(ast.unparse(s) for s in statements)


        # Copied from tests.test_copied_from.body with statements->stmts
        def renamed(source):
            (func,) = ast.parse(textwrap.dedent(source)).body
            stmts = func.body
            if stmts and isinstance(stmts[0], ast.Expr) and isinstance(stmts[0].value, ast.Constant):
                stmts = stmts[1:]
            return "\\n".join(ast.unparse(s) for s in stmts)


        # Copied from tests.test_copied_from.body
        def drifted(source):
            (func,) = ast.parse(textwrap.dedent(source)).body
            return func.body
    '''))
    found = markers(tmp_path)
    assert [line for _, line, _, _ in found] == [3, 13, 22]
    assert [differs(*m) is None for m in found] == [True, True, False]
