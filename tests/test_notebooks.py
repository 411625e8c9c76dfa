"""The notebooks: stored outputs clean, parameters checked at once, other NPROCs under papermill, the runner's report.

nbval (``make test``, see the Makefile) separately re-executes the notebooks at their default
parameters and compares with the stored outputs. The papermill runs at other NPROCs are marked
`sweep` and run with ``make test-ranks`` (TEST_NPROCS=1,2,4,6,8 for the full sweep); so does each notebook's
setup at NPROC 1-8 on faked GPU counts (tests/test_gpu_counts.py).
"""

from __future__ import annotations

import ast
import json
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
from notebook_kit import write_notebook

from course_lib.exercises import PREDICTION_METADATA
from tools import probe, runner
from tools.editions import ANSWER

NOTEBOOKS = runner.find_notebooks([])


def outputs_text(nb) -> list[str]:
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") + json.dumps(out.get("data", {}).get("text/plain", "")))
    return texts


# `make test-ranks` runs every notebook end to end at each NPROC of TEST_NPROCS (default 1 and 4; CI's choice):
# it runs there, its own assertions holding at that world size, or its first cells refuse it at once.
# Not at the notebook's own NPROC: nbval (`make test`) runs it there already, and compares every output.
RANK_COUNTS = [int(n) for n in os.environ.get("TEST_NPROCS", "1,4").split(",")]


def default_nproc(nb) -> int:
    """The NPROC a notebook's parameters cell sets."""
    parameters, _ = probe.setup_cells(nb)
    for node in ast.parse(parameters).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["NPROC"]:
            return ast.literal_eval(node.value)
    raise ValueError("the parameters cell sets no NPROC")


OTHER_NPROCS = [
    pytest.param(path, n, id=f"{path.stem}-{n}")
    for path in NOTEBOOKS
    for n in RANK_COUNTS
    if n != default_nproc(nbformat.read(path, as_version=4))
]


def solved_nproc(path: Path) -> int:
    """The sweep's run that carries the solutions: NPROC 4 (1 where 4 is the notebook's own), so predictions are
    checked at a world size other than the stored run's."""
    return 1 if default_nproc(nbformat.read(path, as_version=4)) == 4 else 4


SOLUTIONS = Path(runner.NOTEBOOKS) / "solutions"
EXERCISE_HEADER = re.compile(r"^# Exercise \d+\b.*$", re.M)


def solution_blocks(path: Path) -> list[str]:
    """The blocks of a solution file: each starts with a line `# Exercise N ...` and holds what replaces the stub's
    definitions in that exercise's cell."""
    text = (SOLUTIONS / f"{path.stem}.py").read_text()
    starts = [m.start() for m in EXERCISE_HEADER.finditer(text)]
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]


def python_of(source: str) -> str:
    """A cell's source with its IPython magics and shell lines commented out."""
    return re.sub(r"^(\s*)([%!])", r"\1#", source, flags=re.M)


def defined_names(statement: ast.stmt) -> set[str]:
    if isinstance(statement, (ast.FunctionDef, ast.ClassDef)):
        return {statement.name}
    if isinstance(statement, ast.Assign):
        return {t.id for t in statement.targets if isinstance(t, ast.Name)}
    return set()


def exercise_cells(nb) -> dict[int, set[str]]:
    """The cells a learner answers in, with the names each must define: the stub a `check(fn, ...)` call judges, and
    the `predicted_x = None` a `check_prediction(..., predicted_x, ...)` call reads."""
    targets: dict[int, set[str]] = {}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not EXERCISE_CELL.search(cell.source):
            continue
        for call in ast.walk(ast.parse(python_of(cell.source))):
            name = getattr(getattr(call, "func", None), "id", "")
            if name not in ("check", "check_prediction") or len(call.args) < 2:
                continue
            answer = call.args[0 if name == "check" else 1]
            if not isinstance(answer, ast.Name):
                continue
            defining = [
                i
                for i, c in enumerate(nb.cells[: index + 1])
                if c.cell_type == "code"
                and any(answer.id in defined_names(s) for s in ast.parse(python_of(c.source)).body)
            ]
            assert defining, f"cell {index} checks {answer.id}, which no cell above defines"
            targets.setdefault(defining[-1], set()).add(answer.id)
    return targets


def solve(nb, blocks: list[str]) -> list[int]:
    """Put each solution block in place of the stub definitions of its exercise cell (the one that defines what
    the block defines); returns the cells solved, in block order."""
    targets = exercise_cells(nb)
    solved = []
    for block in blocks:
        names = set().union(*map(defined_names, ast.parse(block).body))
        found = [i for i, answers in targets.items() if answers & names]
        assert len(found) == 1, f"{block.splitlines()[0]!r} defines {sorted(names)}: exercise cells {found}"
        index = found[0]
        statements = ast.parse(python_of(nb.cells[index].source)).body
        stubs = [s for s in statements if defined_names(s) & names]
        lines = nb.cells[index].source.splitlines()
        for stub in reversed(stubs):
            lines[stub.lineno - 1 : stub.end_lineno] = block.rstrip().splitlines() if stub is stubs[0] else []
        nb.cells[index].source = "\n".join(lines)
        solved.append(index)
    return solved


def verdicts(cell) -> list[str]:
    """What the checks in a cell said: lines of its outputs that are a verdict."""
    text = "\n".join(out.get("text", "") + "".join(out.get("data", {}).get("text/plain", "")) for out in cell.outputs)
    return [line for line in text.splitlines() if line.startswith(("✓", "✗")) or "not attempted yet" in line]


@pytest.mark.sweep
@pytest.mark.timeout(1800)  # a whole notebook (15 at NPROC 4 took over 300 s in CI); a hung cell fails first, at 600 s
@pytest.mark.parametrize("path, nproc", OTHER_NPROCS)
def test_notebook_runs_at_nproc_or_refuses_it_at_once(path, nproc, tmp_path, probe_kernel):
    name, message, _ = probe.Setup(nbformat.read(path, as_version=4), probe_kernel).run(NPROC=nproc)
    probe_kernel.close()  # not needed beside the notebook's own kernel
    if name:
        assert name == "ParameterError" and "Values from 1 to 8 that work" in message, (name, message)
        return  # refused in its first cells, which start no rank (test_parameters_are_checked_in_the_first_cells)
    run, solved = path, []
    if nproc == solved_nproc(path):  # this run carries the solutions: every check must pass
        nb = nbformat.read(path, as_version=4)
        solved = solve(nb, solution_blocks(path))
        (tmp_path / "solved").mkdir()
        run = tmp_path / "solved" / path.name
        nbformat.write(nb, run)
        (run.parent / "solutions").symlink_to(SOLUTIONS)
    out = tmp_path / "out"
    argv = [str(run), "-p", "NPROC", str(nproc), "--out", str(out), "--timeout", "600", "--no-progress"]
    assert runner.main(argv) == 0
    executed = nbformat.read(out / path.name, as_version=4)
    injected = [c.source for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert injected and f"NPROC = {nproc}" in injected[0], f"papermill did not inject NPROC = {nproc}"
    warnings = [t for t in outputs_text(executed) if "Warning" in t or "deprecated" in t]
    assert warnings == [], f"outputs carry warnings: {warnings[:3]}"
    if not solved:
        assert answers_shown_too_early(executed) == []
        return
    said = [v for c in executed.cells if c.cell_type == "code" for v in verdicts(c)]
    wrong = [v for v in said if not v.startswith("✓")]
    assert wrong == [], f"with the solutions of solutions/{path.stem}.py in place, checks said: {wrong}"
    checks = sum(len(EXERCISE_CELL.findall(c.source)) for c in executed.cells if c.cell_type == "code")
    assert len(said) == checks, f"{checks} checks, {len(said)} verdicts: {said}"


EXERCISE_CELL = re.compile(r"^\s*check(_prediction)?\(", re.M)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_exercise_has_a_solution_that_fits_its_cell(path):
    """solutions/NN_name.py has one block per exercise cell, defining what its stub defines; the sweep's solved run
    (`make test-ranks`) then runs them through their checks."""
    nb = nbformat.read(path, as_version=4)
    exercises = sorted(exercise_cells(nb))
    assert sorted(solve(nb, solution_blocks(path))) == exercises
    for index in exercises:
        ast.parse(python_of(nb.cells[index].source))  # still Python once the block is in


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


# ---- a learner's hour -------------------------------------------------------------------------------------------

WORDS, CELLS, DISPLAYED_LINES = 3500, 70, 40


def hour_budget(nb) -> dict[str, int]:
    """Words of prose, cells, and the longest code block a cell displays with `viz.show` (the part that teaches)."""
    shown = [
        len("".join(out.get("data", {}).get("text/plain", "")).splitlines())
        for cell in nb.cells
        if cell.cell_type == "code" and "viz.show(" in cell.source
        for out in cell.get("outputs", [])
        if "text/html" in out.get("data", {})
    ]
    return {
        "words": sum(len(c.source.split()) for c in nb.cells if c.cell_type == "markdown"),
        "cells": len(nb.cells),
        "longest display": max(shown, default=0),
    }


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_reads_in_an_hour(path):
    """At most 3,500 words of prose, 70 cells and 40-line displays: what a learner reads in about an hour."""
    budget = hour_budget(nbformat.read(path, as_version=4))
    limits = {"words": WORDS, "cells": CELLS, "longest display": DISPLAYED_LINES}
    assert all(budget[k] <= limits[k] for k in limits), f"{budget} against at most {limits}"


# ---- predict, then see: nothing above a prediction shows its answer -----------------------------


def predictions(nb) -> list[tuple[int, int, str, float, str]]:
    """(prompt cell, check cell, name, measured, unit) of each check_prediction verdict: the prompt is the cell
    that sets the learner's variable (``predicted_x = None``), the measured value comes from the verdict's output
    metadata."""
    found = []
    for index, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            verdict = out.get("metadata", {}).get(PREDICTION_METADATA)
            if not verdict:
                continue
            calls = [
                node
                for node in ast.walk(ast.parse(python_of(cell.source)))
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "check_prediction"
            ]
            assert len(calls) == 1 and isinstance(calls[0].args[1], ast.Name), cell.source
            variable = calls[0].args[1].id
            prompts = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and sets_to_none(c.source, variable)]
            assert len(prompts) == 1, f"{variable} = None should be set in one cell, found {prompts}"
            found.append((prompts[0], index, verdict["name"], verdict["measured"], verdict.get("unit", "")))
    return found


def sets_to_none(source: str, variable: str) -> bool:
    return bool(re.search(rf"^{variable} = None\b", source, re.M))


def renderings(value: float) -> set[str]:
    """The ways a notebook might print `value`: digits with or without separators, rounded to 3-6 significant
    digits, scaled to k/M/G (and to KiB/MiB/GiB with decimals and the unit: "7.000" alone is any 7), as a
    percentage. None for a value of one significant digit, and no form of fewer than 3 digits (2 for a percentage):
    "3" or "0.1" are everywhere on a page and prove nothing."""
    if significant_digits(f"{value:.15g}".rstrip("0")) < 2:
        return set()
    forms: set[str] = set()
    for v in [value] + [value / s for s in (1e3, 1e6, 1e9, 1e12) if abs(value) / s >= 1]:
        if float(v).is_integer():
            forms |= {f"{int(v)}", f"{int(v):,}"}
        forms |= {f"{v:.{d}f}" for d in (1, 2, 3)} | {f"{v:.{g}g}" for g in (3, 4, 5, 6)}
    for v, unit in [(value / s, u) for s, u in ((2**10, "KiB"), (2**20, "MiB"), (2**30, "GiB")) if abs(value) >= s]:
        forms |= {f"{v:.{d}f}{space}{unit}" for d in (1, 2, 3) for space in ("", " ")}  # "7.000" alone: any 7
    forms = {f for f in forms if significant_digits(f) >= 3}
    if 0 < abs(value) < 1:
        forms |= {f"{100 * value:.{d}f}%" for d in (0, 1, 2) if significant_digits(f"{100 * value:.{d}f}") >= 2}
    return forms


def significant_digits(form: str) -> int:
    """Digits from the first non-zero one ("0.111": 3, "2.50": 3, "3": 1)."""
    digits = re.sub(r"e[+-]\d+$", "", form).replace(",", "").replace(".", "").replace("-", "").lstrip("0")
    return sum(ch.isdigit() for ch in digits)


def page_text(cell) -> str:
    """What a reader sees of a cell: its source, and its outputs' text."""
    texts = [cell.source]
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        texts += [
            out.get("text", ""),
            data.get("text/plain", ""),
            data.get("text/markdown", ""),
            data.get("text/html", ""),
        ]
    return "\n".join(t if isinstance(t, str) else "".join(t) for t in texts)


DURATION_UNITS = ("ns", "us", "µs", "ms", "s")


def answers_shown_too_early(nb, *, require_distinct: bool = False, until_check: bool = False) -> list[str]:
    """Each prediction whose measured value appears, in any rendering, in a cell up to its prompt; with `until_check`,
    also in a cell between the prompt and the check that is not folded (tagged `answer`: the learner's copy and the
    site fold it, tools/editions.py)."""
    problems = []
    for prompt, check, name, measured, unit in predictions(nb):
        forms = renderings(measured)
        if require_distinct and not forms:
            problems.append(f"{name}: the answer {measured:g} is too short to tell apart from other numbers")
        shown = nb.cells[: prompt + 1]
        if until_check:
            shown += [c for c in nb.cells[prompt + 1 : check] if ANSWER not in c.metadata.get("tags", [])]
        above = "\n".join(page_text(cell) for cell in shown)
        # A duration or a rate printed above ("plain 29.1 ms", "29.1 MB/s") is a timing that varies run to run,
        # not a byte or FLOP count rendered: it gives the answer away only when the answer is itself a time.
        not_a_duration = "" if unit in DURATION_UNITS else rf"(?!\s?(?:{'|'.join(DURATION_UNITS)})\b|\s?\w*/s\b)"
        for form in sorted(forms):
            match = re.search(rf"(?<![\d.,])(?<!\d[.,]){re.escape(form)}(?!\d|[.,]\d){not_a_duration}", above)
            if match:
                context = above[max(0, match.start() - 60) : match.end() + 20].replace("\n", " ")
                where = (
                    f"above its check (cell {check}) unfolded" if until_check else f"above the prompt (cell {prompt})"
                )
                problems.append(f"{name}: its answer {measured:g} shows {where} as {context!r}")
                break
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_predictions_come_before_their_answers(path):
    """Every predict exercise is asked before anything on the page shows its answer, and between the question and its
    check only cells tagged `answer` (folded on the site and in the learner's copy) show it (the stored run)."""
    nb = nbformat.read(path, as_version=4)
    assert predictions(nb), "no check_prediction verdict with its measured value: refresh with `make outputs`"
    assert answers_shown_too_early(nb, require_distinct=True) == []
    assert answers_shown_too_early(nb, until_check=True) == [], "fold these cells: tag them `answer`"


def test_a_prediction_shown_too_early_is_caught():
    verdict = {"metadata": {PREDICTION_METADATA: {"name": "bytes", "measured": 226176.0}}}
    measure = nbformat.v4.new_code_cell("measure()", outputs=[nbformat.v4.new_output("stream", text="DP 226.2 kB\n")])
    prompt = nbformat.v4.new_code_cell("predicted_bytes = None")
    check_cell = nbformat.v4.new_code_cell(
        'check_prediction("bytes", predicted_bytes, measured)',
        outputs=[nbformat.v4.new_output("display_data", data={"text/plain": "bytes: not attempted yet"}, **verdict)],
    )
    early = nbformat.v4.new_notebook(cells=[measure, prompt, check_cell])
    (problem,) = answers_shown_too_early(early)
    assert problem.startswith("bytes: its answer 226176 shows above the prompt (cell 1) as 'measure() DP 226.2 kB")
    late = nbformat.v4.new_notebook(cells=[prompt, measure, check_cell])
    assert answers_shown_too_early(late) == []
    # between the question and its check the answer must be folded: a cell tagged `answer`
    (problem,) = answers_shown_too_early(late, until_check=True)
    assert problem.startswith("bytes: its answer 226176 shows above its check (cell 2) unfolded as")
    measure.metadata["tags"] = [ANSWER]
    assert answers_shown_too_early(late, until_check=True) == []
    measure.metadata["tags"] = []
    # a timing that happens to read like the answer scaled ("226.2 ms" beside 226176 B) does not give it away,
    # unless the answer is a time
    timing = nbformat.v4.new_code_cell(
        "time()", outputs=[nbformat.v4.new_output("stream", text="step 226.2 ms, 226.2 MB/s\n")]
    )
    assert answers_shown_too_early(nbformat.v4.new_notebook(cells=[timing, prompt, check_cell])) == []
    verdict["metadata"][PREDICTION_METADATA]["unit"] = "ms"
    check_cell.outputs[0].metadata = verdict["metadata"]
    assert len(answers_shown_too_early(nbformat.v4.new_notebook(cells=[timing, prompt, check_cell]))) == 1
    assert renderings(3.0) == set() and "11%" in renderings(1 / 9) and "2.50" in renderings(2.5e9)
    # 7 MiB (notebook 01's answer at 8 ranks) is "7.00 MiB", not the bus factor "7.000" a table prints beside it
    assert "7.00 MiB" in renderings(7 * 2**20) and "7.000" not in renderings(7 * 2**20)


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


def test_runner_names_a_rank_only_for_rank_errors():
    from_ranks = SimpleNamespace(exec_count=5, ename="RankFailedError", evalue="rank 1 raised ValueError")
    in_kernel = SimpleNamespace(exec_count=3, ename="ParameterError", evalue="rank 1 is the server, NPROC >= 2")
    assert runner.describe_failure(Path("x.ipynb"), from_ranks) == "cell 5, rank 1: RankFailedError"
    assert runner.describe_failure(Path("x.ipynb"), in_kernel) == "cell 3: ParameterError"


def test_runner_prints_the_failing_cells_message_under_the_table(capsys):
    long = SimpleNamespace(evalue="\n".join(f"line {i}" for i in range(40)))
    assert runner.failure_message(long, lines=3) == "...\nline 37\nline 38\nline 39"
    failed = runner.Outcome("06_checkpointing", "FAILED", 1.0, "cell 40: AssertionError", message="{10: 'trained'}")
    runner.print_table([failed, runner.Outcome("08_tensor_parallel", "ok", 1.0)])
    assert "06_checkpointing, cell 40: AssertionError:\n  {10: 'trained'}\n" in capsys.readouterr().out
