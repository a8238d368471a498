"""Import a file of ``scripts/`` (not a package) as a module, for tests of the scripts' helpers."""

import ast
import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """``scripts/<name>.py`` as a module. The sibling scripts it imports (``from win_rate import read``, which
    works when Python runs a script, since its folder comes first on the path) are loaded the same way first."""
    path = SCRIPTS / f"{name}.py"
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom) and node.module and (SCRIPTS / f"{node.module}.py").is_file():
            sys.modules.setdefault(node.module, load_script(node.module))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
