"""Rank programs for tests/test_process_groups.py (and the exercise batches of tests/test_collectives.py)."""

from __future__ import annotations

import importlib
import runpy

from course_lib import process_groups
from course_lib.exercises import ExerciseFailed


def health(rank: int, world_size: int) -> dict:
    return {"total": process_groups.health_check()}


def judge(rank: int, world_size: int, cases: list[tuple[str, str, str]], solutions: str) -> dict:
    """Run many (answer, checker) cases in one launch: "ok" or the ExerciseFailed message for each.

    An answer is "solution:NAME" (from the solutions file, loaded with NPROC = world_size) or
    "MODULE:NAME" (a wrong answer, a module-level function of a test module); a checker is "MODULE:NAME".
    Only for answers that fail on every rank at the same call: a rank that leaves a checker early would
    desynchronise the next one.
    """
    loaded = runpy.run_path(solutions, init_globals={"NPROC": world_size})
    messages = []
    for answer, checker in cases:
        where, name = answer.split(":")
        fn = loaded[name] if where == "solution" else getattr(importlib.import_module(where), name)
        module, checker_name = checker.split(":")
        try:
            getattr(importlib.import_module(module), checker_name)(fn)
            messages.append("ok")
        except ExerciseFailed as error:
            messages.append(str(error))
    return {"messages": messages}
