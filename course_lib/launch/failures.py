"""What a run returns (RunResult) and, when a rank failed, which, how and why: the error a failing cell raises.

The first failure is usually the root cause; a rank that died without raising leaves only traces in the agent's log."""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from course_lib.launch.spec import RunDir, RunSpec

CELL_NAME = "<torchrun cell>"  # how tracebacks and output name the cell's file


@dataclass
class RankFailure:
    rank: int
    kind: str  # "raised", "signal", "exit", "stopped", "running"
    summary: str  # e.g. "ValueError: boom" or "killed by SIGKILL"
    traceback: str = ""
    cell_line: int | None = None


@dataclass
class Attempt:
    index: int
    stdout: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)
    failures: list[RankFailure] = field(default_factory=list)


@dataclass
class RunResult:
    nproc: int
    backend: str
    attempts: list[Attempt]
    values: dict[str, list[Any]]
    wall_s: float
    agent_log: str

    @property
    def stdout(self) -> dict[int, str]:
        """Each rank's stdout in the last attempt."""
        return self.attempts[-1].stdout if self.attempts else {}


class RankFailedError(RuntimeError):
    """Ranks of a `%%torchrun` or `%%px` cell failed; the message names them and the cell's failing line."""

    def __init__(self, message: str, failures: list[RankFailure]):
        super().__init__(message)
        self.failures = failures

    def _render_traceback_(self) -> list[str]:
        lines = [f"{type(self).__name__}: {self}"]
        if self.failures and self.failures[0].traceback:
            lines += ["", f"--- rank {self.failures[0].rank} traceback ---", self.failures[0].traceback.rstrip()]
        return lines


class RunTimeoutError(RankFailedError, TimeoutError):
    """The run passed its wall-clock limit; every process was ended."""


def failure_from_error_file(rank: int, path: Path, cell_file: str) -> RankFailure:
    """The exception a rank recorded in torchelastic's error file, with its innermost cell line."""
    data = json.loads(path.read_text())["message"]
    callstack = data["extraInfo"]["py_callstack"]
    lines = [int(m) for m in re.findall(rf'File "{re.escape(cell_file)}", line (\d+)', callstack)]
    cell_line = lines[-1] if lines else None  # innermost frame inside the cell
    tb = callstack.replace(cell_file, CELL_NAME)
    return RankFailure(rank, "raised", data["message"], tb, cell_line)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def exit_codes(agent_log: str) -> dict[int, int]:
    """rank -> exit code from torchrun's failure summary, root cause first; the one reader of it, for both magics."""
    root = agent_log.rfind("Root Cause")
    ordered = agent_log[root:] + agent_log[:root] if root >= 0 else agent_log
    codes: dict[int, int] = {}
    for match in re.finditer(r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", ordered):
        codes.setdefault(int(match.group(1)), int(match.group(2)))
    return codes


def how_it_ended(code: int) -> str:
    """'SIGKILL' for a rank killed by a signal, else 'exit code 3'."""
    return _signal_name(code) if code < 0 else f"exit code {code}"


def add_silent_deaths(attempts: list[Attempt], agent_log: str, run: RunDir) -> None:
    """Name the ranks that died without raising (no error file, no `done`, not stopped): likely root causes."""
    # torchrun's words for "stopped after another's failure": exec'd ranks, forked ranks, torch.multiprocessing's
    closing = r"Sending process (\d+) closing signal|(?:Closing|Terminating) process (\d+) via signal"
    stopped = {int(a or b) for a, b in re.findall(closing, agent_log)}
    codes = {
        int(pid): int(code)
        for code, pid in re.findall(r"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: (\d+)\)", agent_log)
    }
    by_index = {a.index: a for a in attempts}
    for index, rank, pid in reversed(run.recorded_pids()):  # inserted first: the lowest rank leads
        attempt = by_index.get(index)
        if (
            attempt is None
            or pid in stopped
            or run.done_file(index, rank).exists()
            or rank in {f.rank for f in attempt.failures}
        ):
            continue
        code = codes.get(pid)
        if code is not None and code < 0:
            summary = f"was killed by {_signal_name(code)}"
        elif code:
            summary = f"exited with code {code} without raising"
        else:
            summary = "died without raising an exception (killed by a signal, or os._exit)"
        attempt.failures.insert(0, RankFailure(rank, "signal", summary))


def running_ranks(run: RunDir, spec: RunSpec) -> list[int]:
    """This node's ranks that had not finished the last attempt, ranks not yet started (a slow start) included."""
    ranks = range(spec.first_rank, spec.first_rank + spec.nproc)
    attempts = run.attempts()
    if not attempts:
        return list(ranks)
    return [r for r in ranks if not run.done_file(attempts[-1], r).exists()]


def final_failures(attempts: list[Attempt], agent_log: str) -> list[RankFailure]:
    """Who failed in the last attempt, and how: raised, killed by a signal, or stopped by torchrun."""
    raised = attempts[-1].failures if attempts else []
    failed = {f.rank for f in raised}
    died, stopped = [], []
    codes = {r: c for r, c in sorted(exit_codes(agent_log).items()) if r not in failed}
    others_failed = bool(raised) or any(c != -signal.SIGTERM for c in codes.values())
    for rank, code in codes.items():
        if code == -signal.SIGTERM and others_failed:
            stopped.append(RankFailure(rank, "stopped", "was stopped by torchrun after the failure"))
        elif code < 0:
            died.append(RankFailure(rank, "signal", f"was killed by {_signal_name(code)}"))
        else:
            died.append(RankFailure(rank, "exit", f"exited with code {code} without raising"))
    # A rank that died without a word is the likely root cause of its peers' errors.
    return died + list(raised) + stopped


def describe_failures(failures: list[RankFailure], cell_source: list[str]) -> str:
    """The first failure in full; the ranks that failed because of it in one line each."""
    first, rest = failures[0], failures[1:]
    text = f"rank {first.rank} {'raised ' if first.kind == 'raised' else ''}{first.summary}"
    if first.cell_line is not None and 0 < first.cell_line <= len(cell_source):
        text += f"\n  at cell line {first.cell_line}: {cell_source[first.cell_line - 1].strip()}"
    for f in rest:
        summary = f.summary if len(f.summary) <= 100 else f.summary[:97] + "..."
        text += f"\nthen rank {f.rank} {'raised ' if f.kind == 'raised' else ''}{summary}"
    return text


def failed_error(returncode: int, result: RunResult, cell_source: list[str], max_restarts: int = 0) -> RankFailedError:
    """The error for an agent exit `returncode` != 0; where the agent itself failed, it ends with its log's tail."""
    failures = final_failures(result.attempts, result.agent_log)
    tail = "\n".join(result.agent_log.strip().splitlines()[-15:])
    used = len(result.attempts) - 1
    if failures:
        message = describe_failures(failures, cell_source)
        if used >= max_restarts:
            return RankFailedError(message, failures)
        message += (
            f"\ntorchrun's agent exited (code {returncode}) after {used} of its {max_restarts} restarts, "
            f"without restarting the group; its log ends:\n{tail}"
        )
    elif result.attempts:
        message = f"torchrun's agent exited (code {returncode}) while no rank had failed; its log ends:\n{tail}"
    else:
        message = f"torchrun failed before the ranks ran (exit {returncode}):\n{tail}"
    return RankFailedError(message, failures)


def timeout_error(spec: RunSpec, running: list[int], killed: int) -> RunTimeoutError:
    """The error for a run that passed --timeout; `running` ranks had not finished, `killed` workers were ended."""
    names = ", ".join(str(r) for r in running) or "none"
    return RunTimeoutError(
        f"the run passed --timeout {spec.timeout:g} s; ranks still running: {names}. "
        f"Every process was ended ({killed} workers killed). Look for a collective "
        f"that not every rank calls, or raise --timeout.",
        [RankFailure(r, "running", "still running") for r in running],
    )
