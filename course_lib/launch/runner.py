"""Execute the course's notebooks with papermill and report a summary table.

    python -m course_lib.launch.runner                     # every notebook -> build/course/
    python -m course_lib.launch.runner 03 -p NPROC 4       # one notebook (name prefix), 4 ranks
    python -m course_lib.launch.runner -p BACKEND nccl -p NPROC 8   # a GPU node
    python -m course_lib.launch.runner --inplace           # refresh the stored outputs nbval compares

Each notebook runs with notebooks/ as its working directory. The exit status is
non-zero when any notebook fails; the table names the failing cell and rank.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is course_lib/launch/runner.py)
NOTEBOOKS = ROOT / "notebooks"
DEFAULT_OUT = ROOT / "build" / "course"
RANK_ERRORS = ("RankFailedError", "RunTimeoutError")  # the launcher's errors, raised for failing ranks


@dataclass
class Outcome:
    notebook: str
    ok: bool
    seconds: float
    detail: str = ""


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


def describe_failure(output_nb: Path, error: BaseException) -> str:
    """'cell 7, rank 1: ZeroDivisionError' from papermill's error and the executed notebook."""
    count = getattr(error, "exec_count", None)  # papermill's PapermillExecutionError has it
    where = f"cell {count}" if count else "a cell"
    ename = getattr(error, "ename", type(error).__name__)
    # Only the launcher's errors come from ranks; a kernel-side error may mention "rank" in its text.
    ranks = re.search(r"\brank (\d+)", str(getattr(error, "evalue", ""))) if ename in RANK_ERRORS else None
    rank = f", rank {ranks.group(1)}" if ranks else ""
    return f"{where}{rank}: {ename}"


def strip_run_metadata(nb: Any) -> None:  # an nbformat NotebookNode
    """Make stored outputs deterministic: no papermill timing, no injected cells."""
    nb.metadata.pop("papermill", None)
    nb.cells = [c for c in nb.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    for cell in nb.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)


def ipc_kernel_manager() -> type:
    """A kernel manager whose kernel talks over Unix sockets instead of loopback TCP.

    ipykernel warns "Kernel is running over TCP without encryption" for a TCP kernel without CurveZMQ
    keys: anyone on the machine could connect to its ports. IPC sockets live in Jupyter's runtime
    directory (mode 0700), so only this user reaches the kernel, and the warning has no cause left.
    """
    from jupyter_client import AsyncKernelManager
    from jupyter_core.paths import jupyter_runtime_dir
    from jupyter_core.utils import ensure_dir_exists
    from traitlets import default

    class IPCKernelManager(AsyncKernelManager):
        transport = "ipc"

        @default("ip")
        def _absolute_ipc_path(self) -> str:
            # jupyter_client's default can be the relative "kernel-ipc", which the kernel resolves in
            # the notebook's directory and the client in ours: an absolute path is the same for both.
            ensure_dir_exists(jupyter_runtime_dir(), 0o700)
            return os.path.join(jupyter_runtime_dir(), f"kernel-{uuid.uuid4()}-ipc")

    return IPCKernelManager


def run_notebook(path: Path, output: Path, parameters: dict, timeout: float, progress: bool) -> Outcome:
    import papermill as pm

    start = time.monotonic()
    try:
        pm.execute_notebook(
            str(path),
            str(output),
            parameters=parameters or None,
            cwd=str(path.parent),
            kernel_name="python3",
            progress_bar=progress,
            execution_timeout=timeout,
            kernel_manager_class=ipc_kernel_manager(),  # passed on to nbclient's NotebookClient
        )
    except pm.PapermillExecutionError as error:
        return Outcome(path.stem, False, time.monotonic() - start, describe_failure(output, error))
    except Exception as error:  # kernel died, timeout, bad notebook: still one row of the table
        return Outcome(path.stem, False, time.monotonic() - start, f"{type(error).__name__}: {error}"[:120])
    return Outcome(path.stem, True, time.monotonic() - start)


def print_table(outcomes: list[Outcome]) -> None:
    width = max([len("notebook")] + [len(o.notebook) for o in outcomes])
    print(f"\n{'notebook':<{width}}  status  seconds  failure")
    for o in outcomes:
        print(f"{o.notebook:<{width}}  {'ok' if o.ok else 'FAILED':<6}  {o.seconds:7.1f}  {o.detail}")
    failed = sum(not o.ok for o in outcomes)
    print(f"\n{len(outcomes) - failed} passed, {failed} failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.launch.runner",
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
    parser.add_argument("--no-progress", action="store_true", help="no per-cell progress bars")
    args = parser.parse_args(argv)
    os.environ["COURSE_HEADLESS"] = "1"  # explorers draw their default view (see course_lib.viz)

    parameters = {name: parse_value(value) for name, value in args.parameter}
    if args.inplace and parameters:
        parser.error("--inplace stores the reference outputs, which use the default parameters: drop -p")
    notebooks = find_notebooks(args.notebooks)
    args.out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for i, path in enumerate(notebooks, 1):
        print(f"[{i}/{len(notebooks)}] {path.stem}", flush=True)
        if args.inplace:
            with tempfile.TemporaryDirectory() as tmp:
                output = Path(tmp) / path.name
                outcome = run_notebook(path, output, parameters, args.timeout, not args.no_progress)
                if outcome.ok:
                    nb = nbformat.read(output, as_version=4)
                    strip_run_metadata(nb)
                    nbformat.write(nb, path)
        else:
            output = args.out / path.name
            outcome = run_notebook(path, output, parameters, args.timeout, not args.no_progress)
        outcomes.append(outcome)
    print_table(outcomes)
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
