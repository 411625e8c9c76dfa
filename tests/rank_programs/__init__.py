"""Rank programs for the multi-rank tests: plain functions, linted and with real line numbers.

A program is a module-level function `program(rank, world_size, **kwargs) -> dict`; `run` starts it
on N gloo ranks with the course's launcher and returns each rank's dict, indexed by rank.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from collections.abc import Callable
from typing import Any

from course_lib.launch import launch

# `make test` runs a multi-rank test at one world size, 3: odd, so rows, shards and rings divide unevenly.
# The other sizes are marked `sweep`, with the notebooks at other NPROCs, for `make test-ranks`.
WORLD_SIZE = 3


def world_sizes(*sizes: int) -> list:
    """Parametrize a test over world sizes: WORLD_SIZE runs in `make test`, the others in `make test-ranks`."""
    import pytest  # here: the ranks import this package for its programs, and need no pytest

    return [n if n == WORLD_SIZE else pytest.param(n, marks=pytest.mark.sweep) for n in sizes]


def quiet(text: str, stream: str) -> None:
    """A launcher `write` that drops rank output (the tests look at returned values)."""


def run(
    program: Callable[..., dict], nproc: int, *, kwargs: dict[str, Any] | None = None, **launch_options: Any
) -> list[dict]:
    """Run `program(rank, world_size, **kwargs)` on `nproc` ranks; the per-rank results, by rank."""
    body = (
        f"from {program.__module__} import {program.__name__}\n"
        f"result = {program.__name__}(rank, world_size, **program_kwargs)\n"
    )
    launch_options.setdefault("backend", "gloo")
    launch_options.setdefault("write", quiet)
    done = launch(body, nproc, out=["result"], push={"program_kwargs": kwargs or {}}, **launch_options)
    return done.values["result"]


def run_source(program: Callable[..., dict], nproc: int, **kwargs: Any) -> list[dict]:
    """Like `run`, for a program defined in a test file: its source is sent to the ranks (a test module
    is not importable there), so it must import what it uses inside its body."""
    body = textwrap.dedent(inspect.getsource(program))
    body += f"\nresult = {program.__name__}(rank, world_size, **program_kwargs)\n"
    done = launch(body, nproc, backend="gloo", out=["result"], push={"program_kwargs": kwargs}, write=quiet)
    return done.values["result"]


# ---- exercise checkers: every answer judged in one launch -----------------------------------------


def reference(fn: Callable) -> str:
    """How a rank finds `fn`: "module:name" for course_lib, "path:name" for a test module or a solutions file
    (which the rank runs afresh, with NPROC set to its world size, as the notebook would)."""
    if fn.__module__.startswith("course_lib."):
        return f"{fn.__module__}:{fn.__qualname__}"
    return f"{fn.__code__.co_filename}:{fn.__name__}"


def judge_program(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict:
    """Each (answer, checker) in turn: "ok", the checker's ExerciseFailed message, or what else was raised."""
    import importlib
    import runpy

    import torch.distributed as dist

    from course_lib.exercises import ExerciseFailed

    files: dict[str, dict] = {}

    def find(ref: str) -> Callable:
        where, name = ref.rsplit(":", 1)
        if where.endswith(".py"):
            if where not in files:
                files[where] = runpy.run_path(where, init_globals={"NPROC": world_size})
            return files[where][name]
        return getattr(importlib.import_module(where), name)

    verdicts = []
    for index, (answer, checker) in enumerate(cases):
        try:
            find(checker)(find(answer))
            verdicts.append("ok")
        except ExerciseFailed as error:
            verdicts.append(str(error))
        except Exception as error:  # what check() reports as "your function raised"
            verdicts.append(f"raised {type(error).__name__}: {error}")
        steps: list[Any] = [None] * world_size
        dist.all_gather_object(steps, index)
        if len(set(steps)) != 1:
            raise RuntimeError(f"{answer} left the ranks out of step ({steps}): judge it in a launch of its own")
    return {"verdicts": verdicts}


def judge(cases: list[tuple[Callable, Callable]], nproc: int, **launch_options: Any) -> list[list[str]]:
    """Judge every (answer, checker) in one launch of `nproc` ranks: for each case, each rank's verdict.

    Only for answers that leave every rank in step: one that sends a rank into a collective the others skip
    hangs the launch (check() gives such an answer a world of its own).
    """
    refs = [(reference(answer), reference(checker)) for answer, checker in cases]
    launch_options.setdefault("timeout", 300)
    ranks = run(judge_program, nproc, kwargs={"cases": refs}, **launch_options)
    return [[r["verdicts"][i] for r in ranks] for i in range(len(cases))]


def assert_judged(
    right: list[tuple[Callable, Callable]], wrong: list[tuple[Callable, Callable, str | re.Pattern]], nproc: int = 3
) -> None:
    """One launch: each (answer, checker) of `right` passes on every rank, and each (answer, checker, says) of
    `wrong` fails on some rank with a message that contains `says`, or matches it (a pattern): the reason the
    checker gives, not any failure."""
    verdicts = judge([*right, *[(answer, checker) for answer, checker, _ in wrong]], nproc)
    for (answer, _), per_rank in zip(right, verdicts):
        assert per_rank == ["ok"] * nproc, (answer.__name__, per_rank)
    for (answer, _, says), per_rank in zip(wrong, verdicts[len(right) :]):
        failed = [verdict for verdict in per_rank if verdict != "ok"]
        found = [v for v in failed if (says.search(v) if isinstance(says, re.Pattern) else says in v)]
        assert found, (answer.__name__, says, per_rank)


def assert_checker(
    checker: Callable,
    right: Callable,
    wrong: dict[Callable, str | re.Pattern],
    nproc: int = 3,
    stub: Callable | None = None,
) -> None:
    """assert_judged for one checker: its solution `right`, and {wrong answer: what its message says}; and the
    exercise's `stub`, as the notebook gives it, is "not attempted yet" (check() returns None, launching nothing)."""
    from course_lib.exercises import check

    assert stub is None or check(stub, checker, quiet=True) is None, stub
    assert_judged([(right, checker)], [(answer, checker, says) for answer, says in wrong.items()], nproc)
