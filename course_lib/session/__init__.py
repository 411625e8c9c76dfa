"""Persistent ranks behind the notebook: `%dist` starts N ipyparallel engines under torchrun.

    magic      `%dist start | status | restart | stop`; %%px placeholders until a session runs
    px         ipyparallel's %%px / %px / %autopx on the session's view: rank-ordered output, named failures
    session    the one session of this kernel: start, wait, explain failures, stop; view()
    processes  the controller, the torchrun agent and the engines: started, watched, every one ended; what
               torchrun starts on each rank: an engine whose id is the rank, in the process group

Importing this package imports neither torch nor ipyparallel (each rank imports it at start-up).
"""

from __future__ import annotations

from typing import Any


def view() -> Any:  # an ipyparallel DirectView
    """The DirectView of the running session: its targets are the ranks (engine id == rank)."""
    from course_lib.session.session import current  # not at import: a rank imports this package at start-up

    return current().view
