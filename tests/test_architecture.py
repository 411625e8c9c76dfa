"""The shape of course_lib that CONTRIBUTING.md promises: small modules, typed public functions, cheap imports."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "course_lib"
NOTEBOOKS = ROOT / "notebooks"
MODULES = sorted(LIBRARY.rglob("*.py"))
PACKAGES = sorted(p.parent for p in LIBRARY.glob("*/__init__.py"))
RUNTIME = {"launch", "session", "exercises"}  # the machinery every lesson runs on, not a lesson
TECHNIQUES = [p for p in PACKAGES if p.name not in RUNTIME]
MAX_LINES = 300
LAB_MAX_LINES = 600


def test_every_module_is_short_enough_to_read_in_one_sitting():
    """An algorithm file reads in one sitting (300 lines); a lab, the harness around it, may run to 600."""
    cap = {p: LAB_MAX_LINES if p.name == "lab.py" else MAX_LINES for p in MODULES}
    long = {str(p.relative_to(LIBRARY)): n for p in MODULES if (n := len(p.read_text().splitlines())) > cap[p]}
    assert not long, f"too long to read in one sitting (lines): {long}; split the algorithm by idea"


@functools.cache
def _shown_modules() -> frozenset[str]:
    """The modules whose code a notebook puts on the page with `viz.show(name.attribute...)`."""
    shown = set()
    for notebook in NOTEBOOKS.glob("*.ipynb"):
        names: dict[str, str] = {}  # a name a notebook imports from course_lib -> what it is
        for cell in json.loads(notebook.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            code = "\n".join(line for line in "".join(cell["source"]).splitlines() if not line.startswith(("%", "!")))
            for node in ast.walk(ast.parse(code)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_lib"):
                    names |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
                elif isinstance(node, ast.Call) and ast.unparse(node.func) == "viz.show":
                    root, *attributes = ast.unparse(node.args[0]).split(".")
                    module, _, name = names[root].rpartition(".")
                    obj = getattr(importlib.import_module(module), name, None) or importlib.import_module(names[root])
                    for attribute in attributes:
                        obj = getattr(obj, attribute)
                    shown.add(inspect.getmodule(obj).__name__)
    return frozenset(shown)


@pytest.mark.parametrize("package", TECHNIQUES, ids=lambda p: p.name)
def test_a_technique_package_is_its_algorithm_its_lab_and_its_checkers(package: Path):
    """Every module but `lab.py` (harness, measurements, figures) and `checkers.py` is the algorithm: a notebook
    shows its code, or a module it shows imports it."""
    modules = {_module_name(p): p for p in package.glob("*.py") if p.stem not in ("__init__", "lab", "checkers")}
    algorithm = set(modules) & _shown_modules()
    while grown := set().union(*(_imports_at_load(modules[m], set(modules)) for m in algorithm)) - algorithm:
        algorithm |= grown
    stray = sorted(set(modules) - algorithm)
    assert not stray, f"{stray}: no notebook shows them or what they serve; move them into {package.name}/lab.py"


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


@functools.cache
def _code() -> tuple[tuple[Path, str], ...]:
    """(file, code) of what may use a package: notebooks' code cells, solutions, tests, benchmarks, launch scripts
    and the library (read once for every package's test)."""
    found = []
    for notebook in NOTEBOOKS.glob("*.ipynb"):
        cells = json.loads(notebook.read_text())["cells"]
        found.append((notebook, "".join("".join(c["source"]) + "\n" for c in cells if c["cell_type"] == "code")))
    for folder in (NOTEBOOKS / "solutions", ROOT / "tests", ROOT / "benchmarks", ROOT / "launch", LIBRARY):
        found += [(p, p.read_text()) for p in folder.rglob("*") if p.suffix in (".py", ".sh")]
    return tuple(found)


def _code_outside(package: Path) -> str:
    return "\n".join(text for path, text in _code() if package not in path.parents)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_a_package_exports_only_what_is_used_outside_it(package: Path):
    """Its __init__ imports the names notebooks, tests and other packages use, and nothing else (no __all__)."""
    tree = ast.parse((package / "__init__.py").read_text())
    exported = [a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names]
    assert not any(isinstance(node, ast.Assign) and "__all__" in ast.unparse(node) for node in tree.body)
    code = _code_outside(package)
    unused = [name for name in exported if not re.search(rf"\b{re.escape(name)}\b", code)]
    assert not unused, f"course_lib.{package.name} exports names nothing outside it uses: {unused}"
    module = importlib.import_module(f"course_lib.{package.name}")
    assert all(hasattr(module, name) for name in exported)


@pytest.mark.parametrize("package", TECHNIQUES, ids=lambda p: p.name)
def test_a_technique_uses_another_only_through_its_package(package: Path):
    """A later lesson builds on an earlier one's exports (docs/architecture.md), never on its modules."""
    techniques = {p.name for p in TECHNIQUES} - {package.name}
    reached = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            reached += [
                f"{path.name}: {name}"
                for name in names
                if name.count(".") >= 2 and name.split(".")[:2] in (["course_lib", t] for t in techniques)
            ]
    assert not reached, f"{reached}: import these from the package (its __init__ exports them)"


@pytest.mark.parametrize("module", ["course_lib", "course_lib.launch", "course_lib.launch.worker"])
def test_importing_the_launch_side_does_not_import_torch(module: str):
    """A rank imports these before it records its pid, so the launcher can end it during torch's slow import."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_at_load(path: Path, modules: set[str]) -> set[str]:
    """The course_lib modules that loading `path` loads (module-level imports; `from package import module` names
    the module)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            }
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found & modules


def test_no_import_cycles():
    """No module is loaded, directly or through others, by one of the modules it loads."""
    modules = {_module_name(p): p for p in MODULES}
    graph = {name: _imports_at_load(path, set(modules)) for name, path in modules.items()}
    done: set[str] = set()

    def cycle_from(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for loaded in sorted(graph[name]):
            if found := cycle_from(loaded, [*path, name]):
                return found
        done.add(name)
        return None

    cycles = [found for name in sorted(graph) if (found := cycle_from(name, []))]
    assert not cycles, " -> ".join(cycles[0])
