"""Writes the capstone's data, course_lib/gpt/course_text.txt: the notebooks' markdown at one commit, in course order.

python -m tools.course_text [--rev REV] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from course_lib.gpt.text import SNAPSHOT

SNAPSHOT_REV = "0aba430"  # the commit whose notebooks/*.ipynb prose the snapshot holds
REPO = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def notebook_markdown(source: str) -> str:
    """The markdown cells of one notebook (its JSON text), joined by blank lines."""
    cells = json.loads(source)["cells"]
    return "\n\n".join("".join(c["source"]).strip() for c in cells if c["cell_type"] == "markdown")


def course_prose(rev: str = SNAPSHOT_REV) -> str:
    """The markdown of every notebooks/NN_*.ipynb at `rev`, in course order."""
    paths = sorted(p for p in git("ls-tree", "--name-only", rev, "notebooks/").split() if p.endswith(".ipynb"))
    return "\n\n".join(notebook_markdown(git("show", f"{rev}:{p}")) for p in paths) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default=SNAPSHOT_REV, help=f"the commit to read (default {SNAPSHOT_REV})")
    parser.add_argument("--out", type=Path, default=SNAPSHOT)
    args = parser.parse_args(argv)
    text = course_prose(args.rev)
    args.out.write_text(text, encoding="utf-8")
    print(f"{args.out}: {len(text)} characters, {len(text.encode())} bytes, {len(set(text))} distinct characters")


if __name__ == "__main__":
    main()
