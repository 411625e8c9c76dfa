"""Persistent ranks behind the notebook: `%dist` starts N ipyparallel engines under torchrun; `%%px` runs cells there.

Importing this package imports neither torch nor ipyparallel: each rank imports it at start-up."""

from __future__ import annotations

from typing import Any


def view() -> Any:  # an ipyparallel DirectView
    """The DirectView of the running session: its targets are the ranks (engine id == rank)."""
    from course_lib.session.session import current  # not at import: a rank imports this package at start-up

    return current().view
