"""The two editions of tools/editions.py: the learner's copy (practice/) and the site's sources.

The site itself is built by `make site` (warnings as errors) and read in Chromium by tests/browser/test_site.py.
"""

from __future__ import annotations

import shutil
import subprocess

import nbformat
import pytest

from tools import editions

NOTEBOOKS = editions.course_notebooks()


def test_the_learners_copy_has_every_notebook_no_output_and_answers_folded(tmp_path):
    said = editions.make_practice(tmp_path / "practice")
    copies = editions.course_notebooks(tmp_path / "practice")
    assert [p.name for p in copies] == [p.name for p in NOTEBOOKS]
    assert said[1] == f"  made {len(NOTEBOOKS)}: " + ", ".join(p.name[:2] for p in NOTEBOOKS)
    with_outputs, answers = [], 0
    for stored, copy in zip(NOTEBOOKS, copies):
        original, nb = nbformat.read(stored, as_version=4), nbformat.read(copy, as_version=4)
        # every cell, unchanged but for the line that says a folded cell holds an answer
        assert [c.source for c in nb.cells] == [
            (f"# {editions.FOLDED}\n" if c.cell_type == "code" else f"*{editions.FOLDED}*\n\n") * editions.is_answer(c)
            + c.source
            for c in original.cells
        ]
        with_outputs += [(copy.name, i) for i, c in enumerate(nb.cells) if c.get("outputs") or c.get("execution_count")]
        for cell in nb.cells:
            folded = cell.metadata.get("jupyter", {}).get("source_hidden", False)
            assert folded == editions.is_answer(cell), (copy.name, cell.source[:80])
            answers += folded
    assert with_outputs == []
    assert answers >= 10  # the prediction exercises' answer cells (tests/test_notebooks.py finds them)
    # `%load solutions/NN_x.py` works from the copy
    assert (tmp_path / "practice" / "solutions" / "03_fsdp2.py").read_text().startswith("# Solutions to notebook 03")


@pytest.fixture
def course(tmp_path):
    """A snapshot of notebooks/: what the course is while a test runs, whoever edits the working tree meanwhile."""
    shutil.copytree(editions.NOTEBOOKS, tmp_path / "notebooks", ignore=shutil.ignore_patterns("checkpoints", "*.png"))
    return tmp_path / "notebooks"


def edit_as_a_learner(copy):
    """Change a copy's NPROC cell, as a learner trying another world size would."""
    nb = nbformat.read(copy, as_version=4)
    nb.cells[2].source = "NPROC = 3  # my change"
    return nb


def test_the_learners_copy_is_never_overwritten(tmp_path, course):
    practice = tmp_path / "practice"
    editions.make_practice(practice, course)
    mine = practice / NOTEBOOKS[3].name
    nb = edit_as_a_learner(mine)
    nb.cells.append(nbformat.v4.new_code_cell("my_answer = 42", outputs=[], execution_count=7))
    nbformat.write(nb, mine)
    before = mine.read_bytes()
    (practice / NOTEBOOKS[0].name).unlink()  # a notebook the learner deleted (or one new in the course) comes back

    said = editions.make_practice(practice, course)
    assert mine.read_bytes() == before
    assert said[1] == f"  made 1: {NOTEBOOKS[0].name[:2]}"
    assert not [line for line in said if "changed" in line]  # the learner's edits are not the course changing


def test_a_copy_behind_the_course_is_named_with_the_command_that_renews_it(tmp_path, course):
    notebooks = course
    editions.make_practice(tmp_path / "practice", notebooks)
    course = nbformat.read(notebooks / NOTEBOOKS[1].name, as_version=4)
    course.cells[0].source += "\n\nA sentence the course added after `git pull`."
    nbformat.write(course, notebooks / NOTEBOOKS[1].name)

    said = editions.make_practice(tmp_path / "practice", notebooks)
    name = NOTEBOOKS[1].name
    assert said[1:] == [
        f"  {name}: the course changed since your copy was made; `make fresh NB={name[:2]}` gets the new one"
    ]
    assert "A sentence the course added" not in (tmp_path / "practice" / name).read_text()  # still the learner's
    editions.restore(name[:2], tmp_path / "practice", notebooks)
    assert "A sentence the course added" in (tmp_path / "practice" / name).read_text()
    assert editions.make_practice(tmp_path / "practice", notebooks)[1:] == []


def test_restore_writes_a_fresh_copy_and_keeps_the_learners(tmp_path, course):
    practice = tmp_path / "practice"
    editions.make_practice(practice, course)
    mine = practice / NOTEBOOKS[3].name
    nbformat.write(edit_as_a_learner(mine), mine)

    said = editions.restore("3", practice, course)
    (kept,) = practice.glob(f"{mine.stem}.mine-*.ipynb")
    assert said == [f"kept your copy as {kept}", f"wrote a fresh {mine} (outputs cleared, answers folded)"]
    assert "my change" in kept.read_text() and "my change" not in mine.read_text()
    fresh = nbformat.read(mine, as_version=4)
    assert fresh == editions.learner_copy(nbformat.read(course / NOTEBOOKS[3].name, as_version=4))
    assert sorted(p.name for p in practice.glob("*.ipynb")) == sorted([*(p.name for p in NOTEBOOKS), kept.name])

    with pytest.raises(SystemExit, match=r"no notebook '42': give its number, one of 00, 01, .*, 13"):
        editions.restore("42", practice, course)


def test_make_fresh_without_a_notebook_says_how(tmp_path):
    done = subprocess.run(["make", "-s", "fresh"], cwd=editions.REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "say which notebook: make fresh NB=03" in done.stderr


def test_the_site_folds_answer_cells_and_nothing_else():
    code = nbformat.v4.new_code_cell("print(1_317_376)", metadata={"tags": ["answer"]})
    prose = nbformat.v4.new_markdown_cell("HSDP sends 4/3x DDP's bytes.", metadata={"tags": ["answer"]})
    plain = nbformat.v4.new_markdown_cell("**Predict first.**")
    site = editions.site_copy(nbformat.v4.new_notebook(cells=[plain, code, prose]))
    assert site.cells[0] == plain
    assert site.cells[1].metadata["tags"] == ["answer", "hide-cell"]
    assert site.cells[1].metadata["mystnb"]["code_prompt_show"] == "Show the answer"
    assert site.cells[2].source == (
        '<details class="answer"><summary>Show the answer</summary>\n\nHSDP sends 4/3x DDP\'s bytes.\n\n</details>'
    )


def test_the_sites_sources_hold_every_notebook_and_mathjax(tmp_path):
    editions.site_sources(tmp_path / "src")
    assert sorted(p.name for p in (tmp_path / "src").glob("[0-9]*.ipynb")) == [p.name for p in NOTEBOOKS]
    assert (tmp_path / "src" / "conf.py").exists() and (tmp_path / "src" / "index.md").exists()
    assert (tmp_path / "src" / "_static" / "mathjax" / "tex-svg.js").stat().st_size > 1_000_000
    folded = [
        c
        for p in editions.course_notebooks(tmp_path / "src")
        for c in nbformat.read(p, as_version=4).cells
        if "hide-cell" in c.metadata.get("tags", []) or c.source.startswith('<details class="answer">')
    ]
    answers = [c for p in NOTEBOOKS for c in nbformat.read(p, as_version=4).cells if editions.is_answer(c)]
    assert len(folded) == len(answers) >= 10
