"""Execute the course's notebooks with papermill and report a summary table.

    python -m tools.runner                     # every notebook -> build/course/
    python -m tools.runner 03 -p NPROC 4       # one notebook (name prefix), 4 ranks
    python -m tools.runner -p BACKEND nccl -p NPROC 8   # a GPU node
    python -m tools.runner --nproc-up-to 8 -p BACKEND nccl   # each notebook at its largest NPROC <= 8
    python -m tools.runner --inplace           # refresh the stored outputs nbval compares

Each notebook runs with notebooks/ as its working directory. With --nproc-up-to G, each notebook
runs at the largest NPROC from G down to 1 that its own parameter check accepts (its setup cells
run alone in a kernel first, see tools.probe); a notebook that accepts none is skipped,
with its reason. The table gives each notebook's NPROC and backend, and names the failing cell and
rank. The exit status is non-zero when any notebook fails (a skipped one does not fail the run).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

from tools import kernel, probe

ROOT = Path(__file__).resolve().parents[1]  # the repository (this file is tools/runner.py)
NOTEBOOKS = ROOT / "notebooks"
DEFAULT_OUT = ROOT / "build" / "course"
RANK_ERRORS = ("RankFailedError", "RunTimeoutError")  # the launcher's errors, raised for failing ranks


@dataclass
class Outcome:
    notebook: str
    status: str  # "ok", "FAILED" or "skipped"
    seconds: float
    detail: str = ""  # the failing cell and rank, or why the notebook was skipped
    nproc: str = "-"  # the NPROC it ran with, as the table shows it
    backend: str = "-"  # the backend of its NPROC-rank cells
    message: str = ""  # the failing cell's error message, printed under the table (the run's folder may be gone)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def find_notebooks(selectors: list[str]) -> list[Path]:
    """All notebooks in order, or those whose file name starts with (or equals) each selector."""
    every = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if not selectors:
        return every
    chosen = []
    for sel in selectors:
        path = Path(sel)
        if path.suffix == ".ipynb" and path.exists():
            chosen.append(path.resolve())
            continue
        matches = [nb for nb in every if nb.name.startswith(sel)]
        if not matches:
            names = ", ".join(nb.stem for nb in every)
            raise SystemExit(f"no notebook matches {sel!r}; the notebooks are: {names}")
        chosen += matches
    return chosen


def parse_value(text: str) -> int | float | bool | str:
    """Command-line parameter values: int, float, bool, else str (as papermill's -p)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def notebook_defaults(path: Path) -> dict[str, Any]:
    """The literal values that the notebook's `parameters` cell assigns (those papermill overrides)."""
    nb = nbformat.read(path, as_version=4)
    cell = next((c for c in nb.cells if c.cell_type == "code" and "parameters" in c.metadata.get("tags", [])), None)
    try:
        body = ast.parse(cell.source).body if cell is not None else []
    except SyntaxError:  # a magic in the parameters cell
        return {}
    values = {}
    for node in body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            with contextlib.suppress(ValueError, TypeError, SyntaxError):  # not a literal
                values[node.targets[0].id] = ast.literal_eval(node.value)
    return values


def planned_backend(nproc: object, backend: object) -> str:
    """The backend of the NPROC-rank cells (the launcher's rule); the request itself where that refuses it."""
    from course_lib.launch.spec import LaunchError, resolve_backend

    try:
        return resolve_backend(str(backend), int(str(nproc)))
    except (LaunchError, ValueError):
        return str(backend)


def describe_failure(output_nb: Path, error: BaseException) -> str:
    """'cell 7, rank 1: ZeroDivisionError' from papermill's error and the executed notebook."""
    count = getattr(error, "exec_count", None)  # papermill's PapermillExecutionError has it
    where = f"cell {count}" if count else "a cell"
    ename = getattr(error, "ename", type(error).__name__)
    # Only the launcher's errors come from ranks; a kernel-side error may mention "rank" in its text.
    ranks = re.search(r"\brank (\d+)", str(getattr(error, "evalue", ""))) if ename in RANK_ERRORS else None
    rank = f", rank {ranks.group(1)}" if ranks else ""
    return f"{where}{rank}: {ename}"


def failure_message(error: BaseException, lines: int = 25) -> str:
    """The error's message as the cell printed it, cut to its last `lines` lines (a rank's traceback ends there)."""
    text = str(getattr(error, "evalue", error)).rstrip().splitlines()
    return "\n".join((["..."] if len(text) > lines else []) + text[-lines:])


def strip_run_metadata(nb: Any) -> None:  # an nbformat NotebookNode
    """Make stored outputs deterministic: no papermill timing, no injected cells."""
    nb.metadata.pop("papermill", None)
    nb.cells = [c for c in nb.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    for cell in nb.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)


def run_notebook(path: Path, output: Path, parameters: dict, timeout: float, progress: bool) -> Outcome:
    import papermill as pm

    start = time.monotonic()
    launched: list[Any] = []
    try:
        directory = probe.private_dir()
    except ValueError as error:  # no short directory for the sockets: say so before starting anything
        return Outcome(path.stem, "FAILED", time.monotonic() - start, "kernel cannot start", message=str(error))
    try:
        pm.execute_notebook(
            str(path),
            str(output),
            parameters=parameters or None,
            cwd=str(path.parent),
            kernel_name="python3",
            progress_bar=progress,
            execution_timeout=timeout,
            kernel_manager_class=kernel.ipc_kernel_manager(
                directory, launched
            ),  # passed on to nbclient's NotebookClient
        )
    except pm.PapermillExecutionError as error:
        detail, message = describe_failure(output, error), failure_message(error)
        return Outcome(path.stem, "FAILED", time.monotonic() - start, detail, message=message)
    except Exception as error:  # kernel died, timeout, bad notebook: still one row of the table
        seconds = time.monotonic() - start
        if kernel.is_kernel_failure(error):
            message = kernel.kernel_failure(error, directory, launched)
            return Outcome(path.stem, "FAILED", seconds, message.split(" (", 1)[0], message=message)
        return Outcome(path.stem, "FAILED", seconds, f"{type(error).__name__}: {error}"[:120])
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return Outcome(path.stem, "ok", time.monotonic() - start)


def print_table(outcomes: list[Outcome]) -> None:
    width = max([len("notebook")] + [len(o.notebook) for o in outcomes])
    backend_width = max([len("backend")] + [len(o.backend) for o in outcomes])
    print(f"\n{'notebook':<{width}}  status   NPROC  {'backend':<{backend_width}}  seconds  failure")
    for o in outcomes:
        print(
            f"{o.notebook:<{width}}  {o.status:<7}  {o.nproc:>5}  {o.backend:<{backend_width}}  "
            f"{o.seconds:7.1f}  {o.detail}"
        )
    for o in outcomes:
        if o.message:
            print(f"\n{o.notebook}, {o.detail}:\n" + "\n".join(f"  {line}" for line in o.message.splitlines()))
    failed = sum(o.status == "FAILED" for o in outcomes)
    skipped = sum(o.status == "skipped" for o in outcomes)
    print(f"\n{len(outcomes) - failed - skipped} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))


def run_one(path: Path, output: Path, parameters: dict, args: argparse.Namespace) -> Outcome:
    """One notebook: its NPROC chosen (with --nproc-up-to), then executed; one row of the table."""
    start = time.monotonic()
    if args.nproc_up_to is not None:
        try:
            nproc, refusal = probe.choose_nproc(path, args.nproc_up_to, parameters)
        except Exception as error:  # ProbeError, a kernel that did not start or answer
            detail = str(error) if isinstance(error, probe.ProbeError) else f"{type(error).__name__}: {error}"[:120]
            return Outcome(path.stem, "FAILED", time.monotonic() - start, detail)
        if nproc is None:
            print(f"  skipped: it accepts no NPROC from 1 to {args.nproc_up_to}", flush=True)
            return Outcome(path.stem, "skipped", time.monotonic() - start, refusal)
        parameters = {**parameters, "NPROC": nproc}
        print(f"  NPROC {nproc}: the largest from {args.nproc_up_to} down to 1 that it accepts", flush=True)
    outcome = run_notebook(path, output, parameters, args.timeout, not args.no_progress)
    outcome.seconds = time.monotonic() - start  # the probe's seconds too
    values = {**notebook_defaults(path), **parameters}
    if "NPROC" in values:
        outcome.nproc = str(values["NPROC"])
        if "BACKEND" in values:
            outcome.backend = planned_backend(values["NPROC"], values["BACKEND"])
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.runner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("notebooks", nargs="*", help="notebook paths or name prefixes (default: all)")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"executed copies go here (default {DEFAULT_OUT})"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds one cell may run (default 900)")
    parser.add_argument(
        "--inplace", action="store_true", help="write the executed notebooks over the sources (refresh stored outputs)"
    )
    parser.add_argument(
        "--nproc-up-to",
        type=int,
        metavar="G",
        help="run each notebook at the largest NPROC from G down to 1 that its parameter check accepts with the "
        "other -p values; skip (with its reason) a notebook that accepts none. On a GPU node: G = its GPUs",
    )
    parser.add_argument("--no-progress", action="store_true", help="no per-cell progress bars")
    args = parser.parse_args(argv)
    os.environ["COURSE_HEADLESS"] = "1"  # explorers draw their default view (see course_lib.viz)

    parameters = {name: parse_value(value) for name, value in args.parameter}
    if args.inplace and (parameters or args.nproc_up_to is not None):
        parser.error("--inplace stores the reference outputs, which use the default parameters: drop -p, --nproc-up-to")
    if args.nproc_up_to is not None and args.nproc_up_to < 1:
        parser.error(f"--nproc-up-to {args.nproc_up_to}: give at least 1")
    if args.nproc_up_to is not None and "NPROC" in parameters:
        parser.error("--nproc-up-to chooses NPROC per notebook: drop -p NPROC, or drop --nproc-up-to to force it")
    notebooks = find_notebooks(args.notebooks)
    args.out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for i, path in enumerate(notebooks, 1):
        print(f"[{i}/{len(notebooks)}] {path.stem}", flush=True)
        if args.inplace:
            with tempfile.TemporaryDirectory() as tmp:
                output = Path(tmp) / path.name
                outcome = run_one(path, output, parameters, args)
                if outcome.ok:
                    nb = nbformat.read(output, as_version=4)
                    strip_run_metadata(nb)
                    nbformat.write(nb, path)
        else:
            outcome = run_one(path, args.out / path.name, parameters, args)
        outcomes.append(outcome)
    print_table(outcomes)
    return 1 if any(o.status == "FAILED" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
