"""`%dist start | status | restart | stop`, and ipyparallel's `%%px` / `%px` / `%autopx` bound to the session.

Until a session runs, the px magics are placeholders that say to start one."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class

from course_lib.launch.spec import LaunchError
from course_lib.session import session as sessions
from course_lib.session.session import NO_SESSION, PROCESS_GROUP_TIMEOUT_S, Settings


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would exit the kernel
        raise LaunchError(f"%dist: {message} (usage: {self.format_usage().strip()})")


PARSER = _Parser(prog="%dist", allow_abbrev=False, add_help=False)
PARSER.add_argument("action", choices=["start", "status", "restart", "stop"])
PARSER.add_argument("-n", "--nproc", metavar="N", help="ranks (engines), one torchrun process each")
PARSER.add_argument("--backend", default="auto", metavar="NAME", help="auto (default), gloo or nccl")
PARSER.add_argument(
    "--timeout",
    default=PROCESS_GROUP_TIMEOUT_S,
    metavar="S",
    help=f"process-group timeout: how long a collective waits for a late rank (default {PROCESS_GROUP_TIMEOUT_S:g} s)",
)


@magics_class
class DistMagics(Magics):
    @line_magic
    def dist(self, line: str) -> None:
        """%dist start -n N [--backend auto|gloo|nccl] [--timeout S] | status | restart | stop: ranks that persist."""
        args = PARSER.parse_args(shlex.split(line))
        if args.action == "start":
            if args.nproc is None:
                raise LaunchError("%dist start needs -n N, the number of ranks")
            settings = Settings.create(args.nproc, args.backend, args.timeout)  # refuses before starting
            self._started(sessions.start(settings))
        elif args.action == "restart":
            self._unbind()
            self._started(sessions.restart())
        elif args.action == "status":
            print(sessions.current().status())
        else:
            self._unbind()
            sessions.stop()
            print("session stopped")

    def _started(self, session: sessions.Session) -> None:
        from course_lib.session.px import SessionParallelMagics  # imports ipyparallel: not at %load_ext

        self.shell.register_magics(SessionParallelMagics(self.shell, session.view))  # type: ignore[union-attr]
        s = session.settings
        print(f"session: {s.nproc} ranks, backend {s.backend}, started in {session.seconds:.1f} s")

    def _unbind(self) -> None:
        """Put the placeholders back (and leave %autopx) before the view goes."""
        bound = self.shell.magics_manager.registry.get("SessionParallelMagics")  # type: ignore[union-attr]
        if bound is not None and bound._autopx:
            bound._disable_autopx()
        self.shell.register_magics(NoSessionMagics)  # type: ignore[union-attr]


@magics_class
class NoSessionMagics(Magics):
    """The names ipyparallel's magics take once a session runs; until then, each says to start one."""

    @line_cell_magic
    def px(self, line: str, cell: str | None = None) -> None:
        raise LaunchError(NO_SESSION)

    @line_magic
    def autopx(self, line: str) -> None:
        raise LaunchError(NO_SESSION)

    @line_magic
    def pxresult(self, line: str) -> None:
        raise LaunchError(NO_SESSION)

    @line_magic
    def pxconfig(self, line: str) -> None:
        raise LaunchError(NO_SESSION)
