"""The shape of course_lib that CONTRIBUTING.md promises: small modules, typed public functions, cheap imports."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parent.parent / "course_lib"
MODULES = sorted(LIBRARY.rglob("*.py"))
PACKAGES = sorted(p.parent for p in LIBRARY.glob("*/__init__.py"))
MAX_LINES = 300


def test_every_module_is_short_enough_to_read_in_one_sitting():
    long = {str(p.relative_to(LIBRARY)): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by concern (at most {MAX_LINES} lines each): {long}"


def _public_functions(tree: ast.Module):
    """Module-level functions and methods of module-level classes whose names do not start with '_'."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                    yield f"{node.name}.{item.name}", item


def _untyped(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = function.args
    every = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    missing = [a.arg for a in every if a.annotation is None and a.arg not in ("self", "cls")]
    if function.returns is None:
        missing.append("return")
    return missing


def test_every_public_function_has_type_hints():
    untyped = []
    for path in MODULES:
        for name, function in _public_functions(ast.parse(path.read_text())):
            if missing := _untyped(function):
                untyped.append(f"{path.relative_to(LIBRARY)}: {name} ({', '.join(missing)})")
    assert not untyped, "annotate:\n" + "\n".join(untyped)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_package_exports_what_it_names(package: Path):
    module = importlib.import_module(f"course_lib.{package.name}")
    exported = getattr(module, "__all__", None)
    assert exported, f"course_lib.{package.name} lists its public names in __all__"
    assert not [name for name in exported if not hasattr(module, name)]


@pytest.mark.parametrize("module", ["course_lib", "course_lib.launch", "course_lib.launch.worker"])
def test_importing_the_launch_side_does_not_import_torch(module: str):
    """A rank imports these before it records its pid, so the launcher can end it during torch's slow import."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
