"""The course's two editions from one source, `notebooks/` (executed, outputs stored):

- the learner's copy, `practice/`: every output cleared and every answer cell folded, made on first use and never
  overwritten, so a learner's work survives `git pull`;
- the site's sources, `build/site-src/`: the stored notebooks as they are (nothing re-executed), each answer cell
  folded behind a click, for Sphinx and myst-nb (`make site`).

A cell tagged `answer` reveals what an exercise asks before the learner has answered it (tests/test_notebooks.py
checks that nothing else between a prediction and its check does).

    python tools/editions.py practice          # make the copies that are missing; say which are out of date
    python tools/editions.py restore 03        # a fresh copy of notebook 03 (yours is kept beside it)
    python tools/editions.py site-sources DIR  # the site's sources
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import shutil
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
PRACTICE = REPO / "practice"
SITE = REPO / "site"  # conf.py, the home page and the style of the site
ANSWER = "answer"
MATHJAX_FILES = ("tex-svg.js", "input/tex/extensions")  # MathJax served by the site itself: it builds and reads offline


def course_notebooks(folder: Path = NOTEBOOKS) -> list[Path]:
    return sorted(folder.glob("[0-9][0-9]_*.ipynb"))


def is_answer(cell) -> bool:
    return ANSWER in cell.metadata.get("tags", [])


# ---- the learner's copy ------------------------------------------------------------------------------------------


FOLDED = "An answer, folded: open it once you have yours."  # the one line JupyterLab shows of a folded cell


def learner_copy(nb):
    """The notebook with no output and every answer cell folded (JupyterLab shows a bar with its first line)."""
    nb = nbformat.from_dict(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        if is_answer(cell):
            cell.metadata["jupyter"] = {"source_hidden": True, "outputs_hidden": True}
            first = f"# {FOLDED}" if cell.cell_type == "code" else f"*{FOLDED}*\n"
            cell.source = f"{first}\n{cell.source}"
    nb.metadata.pop("widgets", None)  # the explorers' saved widget state: an output too
    nb.metadata["course"] = {"made_from": fingerprint(nb)}
    return nb


def fingerprint(nb) -> str:
    """What the course's version of a notebook teaches: its cells' sources and tags, not their outputs."""
    text = "\x00".join(f"{c.cell_type}\x01{c.source}\x01{c.metadata.get('tags', [])}" for c in nb.cells)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def made_from(path: Path) -> str | None:
    return nbformat.read(path, as_version=4).metadata.get("course", {}).get("made_from")


def make_practice(practice: Path = PRACTICE, notebooks: Path = NOTEBOOKS) -> list[str]:
    """Copy every notebook the learner has no copy of yet; never touch one that exists. Returns what to tell."""
    practice.mkdir(exist_ok=True)
    solutions = practice / "solutions"  # `%load solutions/NN_x.py` works from the copy as from notebooks/
    if not solutions.exists():
        solutions.symlink_to(notebooks / "solutions", target_is_directory=True)
    made, behind = [], []
    for source in course_notebooks(notebooks):
        target = practice / source.name
        course = learner_copy(nbformat.read(source, as_version=4))
        if not target.exists():
            nbformat.write(course, target)
            made.append(source.name)
        elif made_from(target) != course.metadata["course"]["made_from"]:
            behind.append(source.name)
    said = [f"{practice}: your copy of the course, every output cleared, answers folded"]
    if made:
        said.append(f"  made {len(made)}: {', '.join(n[:2] for n in made)}")
    for name in behind:
        said.append(
            f"  {name}: the course changed since your copy was made; `make fresh NB={name[:2]}` gets the new one"
        )
    return said


def restore(number: str, practice: Path = PRACTICE, notebooks: Path = NOTEBOOKS) -> list[str]:
    """A fresh copy of one notebook; the learner's copy, if any, is kept beside it under a dated name."""
    found = [p for p in course_notebooks(notebooks) if p.name.startswith(f"{number.zfill(2)}_")]
    if len(found) != 1:
        numbers = ", ".join(p.name[:2] for p in course_notebooks(notebooks))
        raise SystemExit(f"no notebook {number!r}: give its number, one of {numbers}")
    source = found[0]
    practice.mkdir(exist_ok=True)
    target = practice / source.name
    said = []
    if target.exists():
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        kept = target.with_name(f"{target.stem}.mine-{stamp}.ipynb")
        target.rename(kept)
        said.append(f"kept your copy as {kept}")
    nbformat.write(learner_copy(nbformat.read(source, as_version=4)), target)
    said.append(f"wrote a fresh {target} (outputs cleared, answers folded)")
    return said


# ---- the site's sources ------------------------------------------------------------------------------------------

SHOW_ANSWER, HIDE_ANSWER = "Show the answer", "Hide the answer"


def site_copy(nb):
    """The stored notebook for the site: answer cells folded (a code cell whole, a markdown cell in a <details>)."""
    nb = nbformat.from_dict(nb)
    for cell in nb.cells:
        if not is_answer(cell):
            continue
        if cell.cell_type == "code":
            cell.metadata["tags"] = [*cell.metadata["tags"], "hide-cell"]
            cell.metadata["mystnb"] = {"code_prompt_show": SHOW_ANSWER, "code_prompt_hide": HIDE_ANSWER}
        else:
            summary = f'<details class="answer"><summary>{SHOW_ANSWER}</summary>'
            cell.source = f"{summary}\n\n{cell.source}\n\n</details>"
    return nb


def site_sources(out: Path, notebooks: Path = NOTEBOOKS) -> None:
    """Sphinx's source folder: the site's own pages, the notebooks folded, and MathJax."""
    import mathjax  # the django-static-mathjax package: MathJax 3's files, for a site that needs no network

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(SITE, out)
    for source in course_notebooks(notebooks):
        nbformat.write(site_copy(nbformat.read(source, as_version=4)), out / source.name)
    es5 = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
    for name in MATHJAX_FILES:
        src, dst = es5 / name, out / "_static" / "mathjax" / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, dst)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("practice", help="make the learner's copies that are missing, in practice/")
    fresh = commands.add_parser("restore", help="a fresh copy of one notebook in practice/ (yours is kept)")
    fresh.add_argument("number", help="the notebook's number, e.g. 03")
    site = commands.add_parser("site-sources", help="the site's sources, for sphinx-build")
    site.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "practice":
        print("\n".join(make_practice()))
    elif args.command == "restore":
        print("\n".join(restore(args.number)))
    else:
        site_sources(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
