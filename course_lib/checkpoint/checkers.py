"""Notebook 05's exercise: find the newest complete checkpoint, checked against good and broken directories."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from course_lib.checkpoint.atomic import METADATA
from course_lib.checkpoint.integrity import latest_complete
from course_lib.checkpoint.sharded import save_sharded
from course_lib.exercises import ExerciseFailed


def reference_find_latest_complete(root: str | os.PathLike) -> Path | None:
    """The exercise's reference answer: a path, or None."""
    return latest_complete(root)[0]


def _exercise_fixtures(base: Path) -> list[tuple[str, Path, str | None]]:
    """Directories of checkpoints, good and bad, each with the expected answer (a directory name or None)."""

    def save(root: Path, step: int) -> Path:
        return save_sharded(root, step, {"weights": torch.arange(6.0) + step, "step": step}, no_dist=True)

    cases: list[tuple[str, Path, str | None]] = []
    root = base / "newest_truncated"
    for step in (2, 9, 10):
        save(root, step)
    shard = root / "step_10" / "shard_0.pt"
    shard.write_bytes(shard.read_bytes()[:-20])
    save(root, 11).rename(root / "step_11.tmp")  # committed name removed: never finished
    (root / "step_12").mkdir()  # a directory with no metadata
    (root / "notes.txt").write_text("not a checkpoint")
    cases.append(("the newest is truncated, newer ones are partial", root, "step_9"))
    root = base / "numeric_order"
    for step in (9, 10):
        save(root, step)
    cases.append(("step_10 is newer than step_9", root, "step_10"))
    root = base / "all_bad"
    save(root, 4)
    (root / "step_4" / METADATA).unlink()
    save(root, 5)
    (root / "step_5" / "shard_0.pt").write_bytes(b"garbage")
    cases.append(("no complete checkpoint", root, None))
    cases.append(("the directory does not exist yet", base / "missing", None))
    return cases


def check_find_latest_complete(find_latest_complete: Callable[[str], Any]) -> None:
    """Exercise checker: run on every rank against fixtures in a private directory."""
    with tempfile.TemporaryDirectory() as base:
        for what, root, expected in _exercise_fixtures(Path(base)):
            try:
                got = find_latest_complete(str(root))
            except Exception as error:
                raise ExerciseFailed(f"{what}: raised {type(error).__name__}: {error}") from None
            got_name = None if got is None else Path(got).name
            if got_name != expected:
                raise ExerciseFailed(f"{what}: expected {expected!r}, got {got_name!r}")
