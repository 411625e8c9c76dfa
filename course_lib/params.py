"""A notebook's first cells check its parameters, so a value that cannot work fails at once."""

from __future__ import annotations

from collections.abc import Callable

from course_lib.launch.spec import LaunchError, backend_for, check_nproc, resolve_backend

__all__ = ["TRIED_ON_CPU", "ParameterError", "backend_for", "check"]

TRIED_ON_CPU = range(1, 9)  # the world sizes every notebook is tried at on the CPU


class ParameterError(LaunchError):
    """A parameter the notebook cannot run with; the message says which values work."""


def check(nproc: object, backend: object = "auto", works: Callable[[int], bool] | None = None, why: str = "") -> int:
    """NPROC as an int, or ParameterError naming the values that work and why."""
    try:
        n = check_nproc(nproc)
        resolve_backend(str(backend), n)
    except LaunchError as error:
        raise ParameterError(f"NPROC={nproc!r}, BACKEND={backend!r}: {error}") from None
    if works is not None and not works(n):
        good = ", ".join(str(k) for k in TRIED_ON_CPU if works(k))
        raise ParameterError(f"NPROC={n} does not work in this notebook: {why}. Values from 1 to 8 that work: {good}")
    return n
