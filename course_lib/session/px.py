"""ipyparallel's `%%px` / `%px` / `%autopx` on the session's view, with two changes.

Output is shown grouped by rank in rank order once the cell ends (deterministic for nbval), and the
wait watches the ranks (Session.wait), so a dead rank, a stuck collective or an interrupt ends the
cell with a message that says what happened and what to do (Session.explain, Session.interrupt).
"""

from __future__ import annotations

import sys
from typing import Any

from ipyparallel.client.magics import ParallelMagics

from course_lib.session import session as sessions


class SessionParallelMagics(ParallelMagics):
    """ipyparallel's magics on the session's view; the waiting is the session's (see module doc)."""

    stream_output = False  # grouped by rank once the cell ends, not interleaved as it comes
    progress_after_seconds = -1  # no progress bar in the stored outputs

    @property  # type: ignore[override]
    def view(self) -> Any:
        """Always the running session's view, also after a restart (SessionError when none runs)."""
        return sessions.current().view

    @view.setter
    def view(self, value: Any) -> None:  # ParallelMagics.__init__ assigns it: the session's view is the one
        pass

    def parallel_execute(self, cell: str, block: bool | None = None, groupby: str = "type", **options: Any) -> Any:
        session = sessions.current()
        session.check()
        if not (self.view.block if block is None else block):
            return super().parallel_execute(cell, block=False, save_name=options.get("save_name"))
        result = super().parallel_execute(cell, block=False, save_name=options.get("save_name"))
        try:
            session.wait(result)
        except KeyboardInterrupt:
            print(session.interrupt(result), file=sys.stderr)
            raise
        finally:
            if result.done():
                result.wait_for_output(1)
                result.display_outputs(groupby)
        try:
            result.get()
        except Exception as error:
            raise session.explain(error) from None
