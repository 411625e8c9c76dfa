"""Rank programs for the multi-rank tests: plain functions, linted and with real line numbers.

A program is a module-level function `program(rank, world_size, **kwargs) -> dict`; `run` starts it
on N gloo ranks with the course's launcher and returns each rank's dict, indexed by rank.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from course_lib.launch import launch


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
