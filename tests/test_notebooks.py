"""Every notebook under papermill with NPROC=3 (its own assertions must hold), and the runner's report.

nbval (``pytest --nbval notebooks``, see the Makefile) separately re-executes the notebooks at
their default parameters and compares with the stored outputs.
"""

from __future__ import annotations

import json

import nbformat
import pytest

from course_lib import runner

NOTEBOOKS = runner.find_notebooks([])


def outputs_text(nb) -> list[str]:
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") + json.dumps(out.get("data", {}).get("text/plain", "")))
    return texts


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_with_three_ranks(path, tmp_path):
    assert runner.main([str(path), "-p", "NPROC", "3", "--out", str(tmp_path), "--no-progress"]) == 0
    executed = nbformat.read(tmp_path / path.name, as_version=4)
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
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("NPROC = 2", metadata={"tags": ["parameters"]}),
            nbformat.v4.new_code_cell("%load_ext course_lib"),
            nbformat.v4.new_code_cell(
                "%%torchrun -n $NPROC --backend gloo\nif rank == 1:\n    raise KeyError('shard')\n"
            ),
        ]
    )
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "99_failing.ipynb"
    nbformat.write(nb, path)
    assert runner.main([str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 1
    table = capsys.readouterr().out
    assert "99_failing  FAILED" in table
    assert "cell 3, rank 1: RankFailedError" in table
    assert "0 passed, 1 failed" in table
