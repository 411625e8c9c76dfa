"""Notebook 06's exercise checkers: find the newest complete checkpoint; agree on it across ranks.

The solutions are in notebooks/solutions/06_checkpointing.py; the expected answers are
built into each case's directories.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from course_lib.checkpoint.atomic import METADATA
from course_lib.checkpoint.sharded import save_sharded
from course_lib.exercises import ExerciseFailed


def _exercise_fixtures(base: Path) -> list[tuple[str, Path, str | None]]:
    """Directories of checkpoints, good and bad, each with the expected answer (a directory name or None)."""

    def save(root: Path, step: int) -> Path:
        return save_sharded(root, step, {"weights": torch.arange(6.0) + step, "step": step}, no_dist=True)

    cases: list[tuple[str, Path, str | None]] = []
    root = base / "newest_truncated"
    for step in (2, 9, 10):
        save(root, step)
    shard = root / "step_10" / "shard_0.bin"
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
    (root / "step_5" / "shard_0.bin").write_bytes(b"garbage")
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


def _resume_views(base: Path, rank: int, world_size: int) -> list[tuple[str, Path, int | None]]:
    """Per case: this rank's view of the checkpoint directory, and the step rank 0's view resumes from.

    Each node sees the shared directory with a lag, or has its own disk: rank 0's newest complete
    checkpoint (a random step, drawn on rank 0) is missing, uncommitted or truncated in the other ranks' views.
    """

    def save(root: Path, step: int) -> Path:
        return save_sharded(root, step, {"weights": torch.arange(4.0) + step, "step": step}, no_dist=True)

    drawn = [random.Random().randrange(6, 60, 2) if rank == 0 else None]
    dist.broadcast_object_list(drawn)  # the checker's own collective, before the learner's function runs
    newest = int(drawn[0])  # type: ignore[arg-type]
    cases: list[tuple[str, Path, int | None]] = []
    root = base / "lagging"
    save(root, 4)
    if rank == 0:
        save(root, newest)
    else:
        save(root, newest).rename(root / f"step_{newest}.tmp")  # not yet committed in this view
    cases.append((f"rank 0 sees step_{newest} committed, the others do not yet", root, newest))
    root = base / "rank0_truncated"
    for step in (2, newest):
        save(root, step)
    if rank == 0:
        shard = root / f"step_{newest}" / "shard_0.bin"
        shard.write_bytes(shard.read_bytes()[:-8])
    cases.append((f"rank 0's step_{newest} is truncated, the others' is fine", root, 2))
    root = base / "only_others"
    if rank != 0:
        save(root, newest)
    cases.append(("rank 0 sees no checkpoint, the others do", root, None))
    return cases


def check_agreed_resume_step(resume_step: Callable[[str], Any]) -> None:
    """Exercise checker: every rank must return the step rank 0's newest complete checkpoint has (or None).

    Each rank gets its own view of the directory (see _resume_views), so a rank that decides alone
    resumes from another step than rank 0. After each case the ranks agree on whether anyone was wrong,
    so they stop together.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    with tempfile.TemporaryDirectory() as base:
        for what, root, expected in _resume_views(Path(base), rank, world_size):
            wrong = None
            try:
                got = resume_step(str(root))
                if got != expected:
                    wrong = f"case '{what}': returned step {got!r}, rank 0 resumes from step {expected!r}"
            except Exception as error:
                wrong = f"case '{what}': your function raised {type(error).__name__}: {error}"
            everyone: list[Any] = [None] * world_size
            dist.all_gather_object(everyone, wrong is not None)
            if wrong:
                raise ExerciseFailed(wrong)
            if any(everyone):
                return  # another rank's answer was wrong; that rank reports it
