"""ipyparallel's `%%px` / `%px` / `%autopx` on the session's view, with two changes.

Output comes in rank order when the cell ends, as `%%torchrun`'s; the wait watches the ranks, so a dead rank ends it."""

from __future__ import annotations

import sys
from typing import Any

from ipyparallel.client.magics import ParallelMagics
from IPython import get_ipython

from course_lib.launch.launcher import by_rank, print_to_notebook
from course_lib.session import session as sessions


class SessionParallelMagics(ParallelMagics):
    """ipyparallel's magics on the session's view; the waiting is the session's (see module doc)."""

    stream_output = False  # grouped by rank once the cell ends (show_outputs), not interleaved as it comes
    progress_after_seconds = -1  # no progress bar in the stored outputs

    @property  # type: ignore[override]
    def view(self) -> Any:
        """Always the running session's view, also after a restart (LaunchError when none runs)."""
        return sessions.current().view

    @view.setter
    def view(self, value: Any) -> None:  # ParallelMagics.__init__ assigns it: the session's view is the one
        pass

    def parallel_execute(self, cell: str, block: bool | None = None, groupby: str = "type", **options: Any) -> Any:
        """`groupby` (%%px --group-outputs) is accepted and ignored: rank output has one layout, show_outputs's."""
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
                show_outputs(result)
        try:
            result.get()
        except Exception as error:
            raise session.explain(error, cell) from None


def show_outputs(result: Any) -> None:
    """What the ranks printed, as %%torchrun shows it; then what they displayed or returned, as ipyparallel does."""
    result.wait_for_output(1)
    per_rank = (lambda values: [values]) if isinstance(result.engine_id, int) else list  # --targets 0: one rank
    ranks = per_rank(result.engine_id)
    for name in ("stdout", "stderr"):
        text = by_rank(dict(zip(ranks, per_rank(getattr(result, name)))))
        if text:
            print_to_notebook(text, name)
    for rank, outputs in zip(ranks, per_rank(result.outputs)):
        for output in outputs:  # figures and other rich displays, tagged with their rank
            get_ipython().display_pub.publish(
                data=output["data"], metadata={**(output["metadata"] or {}), "engine": rank}
            )
    result.display_outputs(result_only=True)  # the value of a cell's last expression, as Out[rank:n]
