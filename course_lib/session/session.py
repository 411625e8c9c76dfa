"""One persistent session: the controller, the agent, N engines, and the view whose targets are the ranks.

Every wait goes through Session.wait, which watches the rank processes: a dead rank is named at once."""

from __future__ import annotations

import atexit
import contextlib
import re
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from course_lib.launch.failures import RankFailedError, RankFailure, describe_failures
from course_lib.launch.processes import running
from course_lib.launch.spec import LaunchError, RunSpec
from course_lib.session import processes
from course_lib.session.processes import START_TIMEOUT_S, SessionDir

PROCESS_GROUP_TIMEOUT_S = 60.0  # the process-group timeout: how long a collective waits for missing ranks
INTERRUPT_GRACE_S = 5.0  # after SIGINT, how long the ranks get to stop before the session restarts
RESTART = "run %dist restart"
NO_SESSION = "no session is running: run %dist start -n N first"
TIMEOUT_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError")

_SESSION: Session | None = None


@dataclass(frozen=True)
class Settings:
    nproc: int
    backend: str  # "gloo" or "nccl"
    timeout: float

    @classmethod
    def create(cls, nproc: object, backend: object = "auto", timeout: object = PROCESS_GROUP_TIMEOUT_S) -> Settings:
        """Checked like a %%torchrun request (RunSpec.create): LaunchError for anything that cannot run."""
        spec = RunSpec.create(nproc=nproc, backend=backend, timeout=timeout)
        return cls(spec.nproc, spec.backend, spec.timeout)


def current() -> Session:
    """The running session; LaunchError when there is none."""
    if _SESSION is None:
        raise LaunchError(NO_SESSION)
    return _SESSION


def start(settings: Settings) -> Session:
    global _SESSION
    if _SESSION is not None:
        raise LaunchError(
            f"a session with {_SESSION.settings.nproc} ranks is already running: "
            "%dist restart starts fresh ranks with the same settings, %dist stop ends it"
        )
    _SESSION = Session(settings)
    try:
        _SESSION.start()
    except BaseException:
        stop()
        raise
    return _SESSION


@atexit.register
def stop() -> None:
    """Stop the running session, if any: no process of it is left, its folder is removed."""
    global _SESSION
    session, _SESSION = _SESSION, None
    if session is not None:
        session.stop()


class Session:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.folder = SessionDir.create()
        self.procs: list[processes.Process] = []  # the controller, the agent
        self.watcher: subprocess.Popen | None = None  # ends them if the kernel dies (processes.start_watcher)
        self.client: Any = None
        self.view: Any = None
        self.seconds = 0.0

    @property
    def ranks(self) -> list[int]:
        return list(range(self.settings.nproc))

    def start(self) -> None:
        from ipyparallel import Client

        begin = time.monotonic()
        deadline = begin + START_TIMEOUT_S
        self.watcher = processes.start_watcher(self.folder)
        # Both at once: the engines import torch while the controller starts, then wait for its file.
        controller = processes.start_controller(self.folder)
        self.procs.append(processes.watch_over(self.watcher, controller))
        agent = processes.start_engines(self.folder, self.settings.nproc, self.settings.backend)
        self.procs.append(processes.watch_over(self.watcher, agent))
        while self.client is None or len(self.client.ids) < self.settings.nproc:
            died = self.dead()
            if died or time.monotonic() > deadline:
                why = died or f"not every engine registered within {START_TIMEOUT_S:g} s"
                logs = "\n".join(processes.tail(log) for log in (self.folder.controller_log, self.folder.agent_log))
                raise LaunchError(f"the session did not start: {why}\n{logs}")
            if self.client is None and self.folder.client_file.exists():
                with contextlib.suppress(ValueError):  # the controller may be writing it still
                    # Its hub may answer slowly on a loaded machine: wait for it as long as for the engines.
                    self.client = Client(str(self.folder.client_file), timeout=max(1.0, deadline - time.monotonic()))
            time.sleep(0.05)
        self.view = self.client[self.ranks]
        self.view.block = True
        setup = "from course_lib.session.processes import prepare as _prepare\n"
        setup += f"globals().update(_prepare({self.settings.backend!r}, {self.settings.timeout!r}))\ndel _prepare\n"
        result = self.view.execute(setup, block=False)
        self.wait(result)
        try:
            result.get()
        except Exception as error:
            raise self.explain(error) from None
        self.seconds = time.monotonic() - begin

    def dead(self) -> RankFailedError | None:
        """RankFailedError('rank 2 (SIGKILL) died') if a rank, the agent or the controller is gone, else None."""
        records = self.folder.recorded_starts()  # read once: a rank may record its pid meanwhile
        pids = dict(sorted({rank: pid for _, rank, pid, _ in records}.items()))
        alive = running({pid: start for _, _, pid, start in records})
        gone = [rank for rank, pid in pids.items() if pid not in alive]
        agent_gone = len(self.procs) > 1 and self.procs[1].poll() is not None
        if gone or agent_gone:
            first = processes.first_failure(self.folder)  # torchrun's report, once it has ended the others
            ranks = _ranks(gone)
            died = f"{first or ranks} died" + (f" (now gone: {ranks})" if first and gone else "")
            return RankFailedError(
                died + watchdog_hint(first, self.settings), [RankFailure(r, "exit", "died") for r in gone]
            )
        if self.procs and self.procs[0].poll() is not None:
            return RankFailedError("the ipyparallel controller died", [])
        return None

    def check(self) -> None:
        """RankFailedError naming the dead rank when the session cannot run cells."""
        if died := self.dead():
            raise RankFailedError(f"{died}: the session's ranks are gone: {RESTART}", died.failures)

    def wait(self, result: Any) -> None:
        """Wait for `result`, checking the ranks 10 times a second; RankFailedError if one dies meanwhile."""
        while not result.wait(0.1):
            self.check()

    def interrupt(self, result: Any) -> str:
        """SIGINT to every rank; if they do not stop within INTERRUPT_GRACE_S, a fresh session. Says which."""
        processes.interrupt(list(self.folder.rank_pids().values()))
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while not result.done() and time.monotonic() < deadline and not self.dead():
            time.sleep(0.05)
        if result.done():
            return "interrupted: sent SIGINT to every rank, which stopped the cell; the session keeps its state"
        restart()
        return (
            f"interrupted: the ranks did not stop within {INTERRUPT_GRACE_S:g} s of SIGINT, so the session "
            "was restarted (fresh ranks: earlier variables are gone)"
        )

    def explain(self, error: BaseException, cell: str = "") -> BaseException:
        """One RankFailedError for the ranks' CompositeError, worded as a `%%torchrun` failure; others unchanged."""
        elist = getattr(error, "elist", None)  # a CompositeError; a RemoteError when one rank was targeted
        if elist is None and hasattr(error, "engine_info"):
            elist = [(error.ename, error.evalue, error.traceback, error.engine_info)]  # type: ignore[attr-defined]
        if elist is None:
            return error
        if died := self.dead():
            return RankFailedError(f"{died} while the cell ran: the session's ranks are gone: {RESTART}", died.failures)
        raised = sorted((info.get("engine_id", -1), name, str(value), tb or "") for name, value, tb, info in elist)
        failures = [
            RankFailure(rank, "raised", f"{name}: {value}", _plain(tb), _cell_line(tb))
            for rank, name, value, tb in raised
        ]
        stuck = [rank for rank, name, value, _ in raised if _timed_out(name, value)]
        if stuck:
            return RankFailedError(
                f"{_ranks(stuck)} waited in a collective that not every rank entered and gave up after the "
                f"process-group timeout ({self.settings.timeout:g} s): the process group is now broken: {RESTART}",
                failures,
            )
        return RankFailedError(describe_failures(failures, cell.splitlines()), failures)

    def status(self) -> str:
        import psutil

        why = self.dead()
        lines = [
            f"{self.settings.nproc} ranks, backend {self.settings.backend}, "
            f"collective timeout {self.settings.timeout:g} s: " + (str(why) if why else "all alive")
        ]
        for rank, pid in self.folder.rank_pids().items():
            try:
                rss = psutil.Process(pid).memory_info().rss / 2**20
                lines.append(f"rank {rank}: pid {pid}, {rss:.0f} MiB resident")
            except psutil.Error:
                lines.append(f"rank {rank}: pid {pid}, gone")
        if self.settings.backend == "nccl" and not why:
            self.view.execute("_dist_cuda_mib = (torch.cuda.memory_allocated(device) / 2**20, str(device))", block=True)
            for rank, (mib, on) in enumerate(self.view.pull("_dist_cuda_mib", block=True)):
                lines.append(f"rank {rank}: {mib:.0f} MiB allocated on {on}")
        return "\n".join(lines)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        processes.end(self.procs, self.folder, self.watcher)
        self.folder.remove()


def restart() -> Session:
    """Stop the running session and start a fresh one with the same settings."""
    settings = current().settings
    stop()
    return start(settings)


def watchdog_hint(first_failure: str | None, settings: Settings) -> str:
    """Why an NCCL rank died of SIGABRT: its collectives are asynchronous, so a stuck one ends in the watchdog."""
    if settings.backend != "nccl" or not first_failure or "SIGABRT" not in first_failure:
        return ""
    return (
        f" (NCCL's watchdog aborts a rank whose collective has not completed within the timeout, "
        f"{settings.timeout:g} s: most often a collective that not every rank entered; under NCCL the cell "
        "that called it returned at once)"
    )


def _timed_out(name: str, value: str) -> bool:
    return name in TIMEOUT_ERRORS or bool(re.search(r"timed? ?out", value, re.I))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _cell_line(traceback: str) -> int | None:
    """The line of the cell in the first frame of the cell in an engine's traceback."""
    found = re.search(r"(?:Cell In\[\d+\]|<module>|<ipython-input-[^>]*>),? line (\d+)", _plain(traceback))
    return int(found.group(1)) if found else None


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)
