"""The notebooks: stored outputs clean, parameters checked at once, other NPROCs under papermill, the runner's report.

nbval (``make test``, see the Makefile) separately re-executes the notebooks at their default
parameters and compares with the stored outputs. The papermill runs at other NPROCs are marked
`notebook` and run with ``make test-ranks`` (TEST_NPROCS=1,2,4,8 for the full sweep).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import nbformat
import pytest
import torch
from notebook_kit import write_notebook

from course_lib import params
from course_lib.launch import probe, runner

NOTEBOOKS = runner.find_notebooks([])


def outputs_text(nb) -> list[str]:
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") + json.dumps(out.get("data", {}).get("text/plain", "")))
    return texts


# `make test-ranks` runs every notebook end to end at each NPROC of TEST_NPROCS (default 1 and 4; CI's choice):
# it runs there, its own assertions holding at that world size, or its first cells refuse it at once.
RANK_COUNTS = [int(n) for n in os.environ.get("TEST_NPROCS", "1,4").split(",")]


@pytest.mark.notebook
@pytest.mark.timeout(1800)  # a whole notebook (13 at NPROC 4 took over 300 s in CI); a hung cell fails first, at 600 s
@pytest.mark.parametrize("nproc", RANK_COUNTS)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_at_nproc_or_refuses_it_at_once(path, nproc, tmp_path, probe_kernel):
    name, message, _ = probe.Setup(nbformat.read(path, as_version=4), probe_kernel).run(NPROC=nproc)
    probe_kernel.close()  # not needed beside the notebook's own kernel
    if name:
        assert name == "ParameterError" and "Values from 1 to 8 that work" in message, (name, message)
        return  # refused in its first cells, which start no rank (test_parameters_are_checked_in_the_first_cells)
    assert (
        runner.main([str(path), "-p", "NPROC", str(nproc), "--out", str(tmp_path), "--timeout", "600", "--no-progress"])
        == 0
    )
    executed = nbformat.read(tmp_path / path.name, as_version=4)
    injected = [c.source for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert injected and f"NPROC = {nproc}" in injected[0], f"papermill did not inject NPROC = {nproc}"
    warnings = [t for t in outputs_text(executed) if "Warning" in t or "deprecated" in t]
    assert warnings == [], f"outputs carry warnings: {warnings[:3]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_notebook_is_clean(path):
    """Stored outputs are a deterministic reference: executed in order, no papermill residue or errors."""
    nb = nbformat.read(path, as_version=4)
    assert "papermill" not in nb.metadata
    assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells), "needs a cell tagged parameters"
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), "store outputs with `make outputs`"
    for cell in nb.cells:
        assert "injected-parameters" not in cell.metadata.get("tags", [])
        assert all(o.get("output_type") != "error" for o in cell.get("outputs", []))
    assert not [t for t in outputs_text(nb) if "Warning" in t or "deprecated" in t]


def test_runner_reports_failing_cell_and_rank(tmp_path, capsys):
    path = write_notebook(
        tmp_path / "99_failing.ipynb",
        "NPROC = 2",
        "%load_ext course_lib",
        "%%torchrun -n $NPROC --backend gloo\nif rank == 1:\n    raise KeyError('shard')\n",
    )
    assert runner.main([str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 1
    table = capsys.readouterr().out
    assert "99_failing  FAILED" in table
    assert "cell 3, rank 1: RankFailedError" in table
    assert "0 passed, 1 failed" in table


def test_runner_leaves_no_session_behind(tmp_path):
    """A notebook that starts a persistent session and never stops it: its ranks end with the notebook."""
    import psutil

    path = write_notebook(
        tmp_path / "98_session_left_running.ipynb",
        "%load_ext course_lib",
        "%dist start -n 2 --backend gloo",
        "from course_lib.session import session\nprint('PIDS', *session.current().folder.rank_pids().values())",
    )
    assert runner.main([str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    printed = "".join(outputs_text(nbformat.read(tmp_path / "out" / path.name, as_version=4)))
    pids = [int(p) for p in printed.split("PIDS", 1)[1].split()[:2]]
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if psutil.pid_exists(p)], f"rank processes {pids} outlived their notebook"


# ---- every notebook refuses a bad NPROC in its first cells, at once ---------------------------


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_parameters_are_checked_in_the_first_cells(path):
    """Before its check, a notebook starts no rank: a refusal comes from cells that only import and compute."""
    _, cells = probe.setup_cells(nbformat.read(path, as_version=4))
    starting_ranks = re.compile(r"%%?torchrun|%dist|%%?px|(?<![.\w])(check|launch)\(|subprocess\.\w+\(")
    assert not [(i, m.group()) for i, cell in enumerate(cells) for m in starting_ranks.finditer(cell)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_nproc_from_1_to_8_runs_or_is_refused_at_once(path, probe_kernel):
    """The setup cells either accept NPROC or raise ParameterError naming the values that work."""
    setup = probe.Setup(nbformat.read(path, as_version=4), probe_kernel)
    name, message, _ = setup.run()  # the notebook's own parameters first: they work, and imports are warm after
    assert name == "", f"the notebook's default parameters fail: {name}: {message}"

    works, refused, problems = [], {}, []
    for nproc in params.TRIED_ON_CPU:
        name, message, _ = setup.run(NPROC=nproc, BACKEND="auto")
        if not name:
            works.append(nproc)
            continue
        refused[nproc] = message
        if name != "ParameterError":
            problems.append(f"NPROC={nproc}: {name}: {message} (expected ParameterError or no error)")
    good = ", ".join(str(n) for n in works)
    for nproc, message in refused.items():
        if f"Values from 1 to 8 that work: {good}" not in message:
            problems.append(f"NPROC={nproc}: the message does not name the values that work ({good}): {message}")
    assert works, "no NPROC from 1 to 8 works"
    assert problems == [], "\n".join(problems)

    if not torch.cuda.is_available():  # nccl needs a GPU per rank: refused at once on this machine
        name, message, _ = setup.run(NPROC=works[0], BACKEND="nccl")
        assert name == "ParameterError", f"BACKEND='nccl' on a machine without GPUs: {name or 'accepted'} {message}"
        assert "nccl" in message, message


def test_runner_names_a_rank_only_for_rank_errors():
    from types import SimpleNamespace

    from_ranks = SimpleNamespace(exec_count=5, ename="RankFailedError", evalue="rank 1 raised ValueError")
    in_kernel = SimpleNamespace(exec_count=3, ename="ParameterError", evalue="rank 1 is the server, NPROC >= 2")
    assert runner.describe_failure(Path("x.ipynb"), from_ranks) == "cell 5, rank 1: RankFailedError"
    assert runner.describe_failure(Path("x.ipynb"), in_kernel) == "cell 3: ParameterError"
