"""Run a piece of code on N ranks under the real torchrun, from a notebook or a test.

:func:`launch` writes the code into a fresh run directory, starts
``python -m torch.distributed.run ... --module course_lib.launch.worker RUN_DIR`` in
its own session, and waits. It owns every process it starts: on success,
failure, timeout or interrupt, nothing of the run is left alive. Processes are
ended by their recorded pid or process group, never by name.

Rank output is read from torchrun's per-rank log files (default: printed after
the run, grouped by rank) or from torchrun's ``--tee`` stream (``stream=True``:
live, ``[rank N]`` prefixed). Either way the kernel prints it, so it reaches
the notebook even under nbval, where ipykernel ignores child-process output.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import keyword
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from course_lib.launch.backend import LaunchError, resolve_backend

DEFAULT_TIMEOUT_S = 300.0
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
_STREAM_PREFIX = re.compile(r"^\[rank(\d+)\]: ?")
# Lines the ranks' libraries print that teach nothing (kept out of the cell).
_NOISE = [
    re.compile(p)
    for p in (
        r"^\[Gloo\] Rank \d+ is connected to",
        r"^USDT:.*SyncActivityProfilerHandler.*profiler_(start|stop)$",  # kineto's trace points, every profile
        r"^\s*$",
    )
]


@dataclass
class RankFailure:
    rank: int
    kind: str  # "raised", "signal", "exit", "stopped", "running"
    summary: str  # e.g. "ValueError: boom" or "killed by SIGKILL"
    traceback: str = ""
    cell_line: int | None = None


class RankFailedError(RuntimeError):
    """One or more ranks failed; the message names them and the failing line of the cell."""

    def __init__(self, message: str, failures: list[RankFailure], result: RunResult):
        super().__init__(message)
        self.failures = failures
        self.result = result

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures if f.kind not in ("stopped",)]

    def _render_traceback_(self) -> list[str]:
        lines = [f"{type(self).__name__}: {self}"]
        if self.failures and self.failures[0].traceback:
            lines += ["", f"--- rank {self.failures[0].rank} traceback ---", self.failures[0].traceback.rstrip()]
        return lines


class RunTimeoutError(RankFailedError, TimeoutError):
    """The run passed its wall-clock limit; every process was ended."""


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


def check_nproc(nproc: Any) -> int:
    try:
        value = int(str(nproc))
    except ValueError:
        raise LaunchError(f"-n must be a whole number of ranks per node, got {nproc!r}") from None
    if value < 1:
        raise LaunchError(f"-n must be at least 1 rank, got {value}")
    return value


def check_names(names: Iterable[str], flag: str) -> list[str]:
    names = [n for n in names if n]
    for name in names:
        if not name.isidentifier() or keyword.iskeyword(name):
            raise LaunchError(f"{flag} takes Python variable names separated by commas; {name!r} is not one")
    return names


# ---------------------------------------------------------------------------
# Process ownership


_ACTIVE: dict[int, tuple[subprocess.Popen, Path]] = {}


def _preexec() -> None:
    """In the torchrun agent, before exec: die (SIGTERM, so it stops its workers) with the kernel."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _recorded_worker_pids(run_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted((run_dir / "ranks").glob("attempt_*/*.pid")) if p.read_text().strip()]


def _alive_workers(run_dir: Path) -> list[int]:
    """Recorded worker pids that are still this run's processes (guards against pid reuse)."""
    import psutil

    alive = []
    for pid in _recorded_worker_pids(run_dir):
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE and str(run_dir) in " ".join(proc.cmdline()):
                alive.append(pid)
        except psutil.Error:
            continue
    return alive


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def end_run(proc: subprocess.Popen, run_dir: Path, grace_s: float = 3.0) -> None:
    """End the agent and every worker of one run; return when none is left."""
    if proc.poll() is None:
        _kill_group(proc.pid, signal.SIGTERM)  # the agent stops its workers on SIGTERM
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    _kill_group(proc.pid, signal.SIGKILL)
    # Workers run in sessions of their own (pgid == pid): their groups include their children.
    for pid in _recorded_worker_pids(run_dir):
        _kill_group(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait(5)
    deadline = time.monotonic() + 5
    while _alive_workers(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)


@atexit.register
def _end_all_runs() -> None:
    for proc, run_dir in list(_ACTIVE.values()):
        end_run(proc, run_dir, grace_s=1.0)


# ---------------------------------------------------------------------------
# Reading what the ranks left behind


def _attempt_dirs(run_dir: Path) -> list[Path]:
    dirs = list((run_dir / "logs").glob("*/attempt_*"))
    return sorted(dirs, key=lambda d: int(d.name.split("_")[1]))


def _clean(text: str, cell_file: str) -> str:
    lines = [line for line in text.splitlines() if not any(p.search(line) for p in _NOISE)]
    return "\n".join(lines).replace(cell_file, "<torchrun cell>")


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _agent_exit_codes(agent_log: str) -> dict[int, int]:
    """torchrun's failure summary: 'rank : 1 (local_rank: 1)' followed by 'exitcode : -9'."""
    codes = {}
    for match in re.finditer(r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", agent_log):
        codes[int(match.group(1))] = int(match.group(2))
    return codes


def _add_silent_deaths(attempts: list[Attempt], agent_log: str, run_dir: Path) -> None:
    """Name the ranks that died without raising: the likely root cause of their peers' errors.

    Such a rank started (pid recorded) but left neither an error file nor a `done` marker, and
    the agent did not stop it ('Sending process P closing signal SIGTERM'). The agent's
    'failed (exitcode: -9) ... (pid: P)' line, when it saw that rank first, gives the signal.
    """
    stopped = {int(pid) for pid in re.findall(r"Sending process (\d+) closing signal", agent_log)}
    codes = {
        int(pid): int(code)
        for code, pid in re.findall(r"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: (\d+)\)", agent_log)
    }
    by_index = {a.index: a for a in attempts}
    for pid_file in (run_dir / "ranks").glob("attempt_*/*.pid"):
        index, rank = int(pid_file.parent.name.split("_")[1]), int(pid_file.stem)
        attempt = by_index.get(index)
        pid = int(pid_file.read_text() or 0)
        if (
            attempt is None
            or pid in stopped
            or (pid_file.parent / f"{rank}.done").exists()
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


def _read_attempt(attempt_dir: Path, run_dir: Path, nproc: int, node_rank: int) -> Attempt:
    index = int(attempt_dir.name.split("_")[1])
    attempt = Attempt(index)
    cell_file = str(run_dir / "cell.py")
    stamped: list[tuple[int, RankFailure]] = []
    for local in range(nproc):
        mapping = run_dir / "ranks" / f"attempt_{index}" / f"local_{local}"
        rank = int(mapping.read_text()) if mapping.exists() else node_rank * nproc + local
        rank_dir = attempt_dir / str(local)
        for name, store in (("stdout", attempt.stdout), ("stderr", attempt.stderr)):
            log = rank_dir / f"{name}.log"
            if log.exists():
                text = _clean(log.read_text(errors="replace"), cell_file)
                # Python's own "[rankN]: Traceback" echo duplicates the error file: drop it.
                store[rank] = "\n".join(line for line in text.splitlines() if not _STREAM_PREFIX.match(line))
        error_file = rank_dir / "error.json"
        if error_file.exists():
            failure = _failure_from_error_file(rank, error_file, cell_file)
            stamped.append((error_file.stat().st_mtime_ns, failure))
    # Earliest error first: the root cause, before the ranks that lost a peer because of it.
    attempt.failures = [f for _, f in sorted(stamped, key=lambda item: item[0])]
    return attempt


def _failure_from_error_file(rank: int, path: Path, cell_file: str) -> RankFailure:
    data = json.loads(path.read_text())["message"]
    callstack = data["extraInfo"]["py_callstack"]
    lines = [int(m) for m in re.findall(rf'File "{re.escape(cell_file)}", line (\d+)', callstack)]
    cell_line = lines[-1] if lines else None  # innermost frame inside the cell
    tb = callstack.replace(cell_file, "<torchrun cell>")
    return RankFailure(rank, "raised", data["message"], tb, cell_line)


def _describe(failures: list[RankFailure], cell_source: list[str]) -> str:
    """The first failure in full; the ranks that failed because of it in one line each."""
    first, rest = failures[0], failures[1:]
    text = f"rank {first.rank} {'raised ' if first.kind == 'raised' else ''}{first.summary}"
    if first.cell_line is not None and 0 < first.cell_line <= len(cell_source):
        text += f"\n  at cell line {first.cell_line}: {cell_source[first.cell_line - 1].strip()}"
    for f in rest:
        summary = f.summary if len(f.summary) <= 100 else f.summary[:97] + "..."
        text += f"\nthen rank {f.rank} {'raised ' if f.kind == 'raised' else ''}{summary}"
    return text


# ---------------------------------------------------------------------------


def _emit_default(write: Callable[[str, str], None], attempts: list[Attempt]) -> None:
    """Rank output grouped by rank, in rank order: one block for stdout, one for stderr."""
    blocks: dict[str, list[str]] = {"stdout": [], "stderr": []}
    for attempt in attempts:
        if len(attempts) > 1:
            blocks["stdout"].append(f"--- attempt {attempt.index} ---\n")
        for name in ("stdout", "stderr"):
            texts = getattr(attempt, name)
            for rank in sorted(texts):
                blocks[name] += [f"[rank {rank}] {line}\n" for line in texts[rank].splitlines()]
        if len(attempts) > 1 and attempt.failures:
            what = "; ".join(f"rank {f.rank} {f.summary}" for f in attempt.failures[:1])
            blocks["stdout"].append(f"attempt {attempt.index} failed: {what}\n")
    for name, lines in blocks.items():
        if lines:
            write("".join(lines), name)


def _print(text: str, stream: str) -> None:
    target = sys.stdout if stream == "stdout" else sys.stderr
    target.write(text)
    target.flush()


def launch(
    body: str,
    nproc: int = 2,
    *,
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT_S,
    out: Iterable[str] = (),
    push: dict[str, Any] | None = None,
    stream: bool = False,
    init: bool = True,
    max_restarts: int = 0,
    nnodes: str | None = None,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_backend: str | None = None,
    rdzv_id: str | None = None,
    env: dict[str, str] | None = None,
    write: Callable[[str, str], None] = _print,
) -> RunResult:
    """Run `body` on `nproc` ranks per node; raise RankFailedError if any rank fails.

    `out` names variables to bring back (``result.values[name][rank]``); `push`
    maps names to values the ranks receive before the body runs.
    """
    nproc = check_nproc(nproc)
    out = check_names(out, "--out")
    push = dict(push or {})
    check_names(push, "--push")
    if not timeout or float(timeout) <= 0:
        raise LaunchError(f"--timeout must be a positive number of seconds, got {timeout!r}")
    timeout = float(timeout)
    if max_restarts < 0:
        raise LaunchError("--max-restarts must be 0 or more")
    backend = resolve_backend(backend, nproc)
    multi_node = any(v is not None for v in (nnodes, rdzv_endpoint, rdzv_backend, rdzv_id))
    node_rank_value = int(node_rank or 0)

    run_dir = Path(tempfile.mkdtemp(prefix="torchrun-cell-"))
    try:
        return _run(
            body,
            nproc,
            backend,
            timeout,
            out,
            push,
            stream,
            init,
            max_restarts,
            multi_node,
            dict(
                nnodes=nnodes,
                node_rank=node_rank,
                rdzv_endpoint=rdzv_endpoint,
                rdzv_backend=rdzv_backend,
                rdzv_id=rdzv_id,
            ),
            node_rank_value,
            env,
            write,
            run_dir,
        )
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _run(
    body,
    nproc,
    backend,
    timeout,
    out,
    push,
    stream,
    init,
    max_restarts,
    multi_node,
    rdzv,
    node_rank,
    env,
    write,
    run_dir: Path,
) -> RunResult:
    import torch

    cell_file = run_dir / "cell.py"
    cell_file.write_text(body)
    cell_source = body.splitlines()
    if push:
        torch.save(push, run_dir / "push.pt")
    # The process group gives up a little before the wall clock, so a stuck
    # collective surfaces as an error naming it rather than as a kill.
    pg_timeout = max(5.0, timeout - 10.0) if timeout > 20 else max(1.0, timeout * 0.8)
    (run_dir / "config.json").write_text(
        json.dumps({"init": init, "backend": backend, "pg_timeout_s": pg_timeout, "out": out, "push": bool(push)})
    )

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.1",
        "--log-dir",
        str(run_dir / "logs"),
        "--redirects",
        "3",
    ]
    if stream:
        cmd += ["--tee", "3"]
    if multi_node:
        for key, value in rdzv.items():
            if value is not None:
                cmd += [f"--{key.replace('_', '-')}", str(value)]
    else:
        cmd += ["--standalone"]  # a free rendezvous port per run: runs never collide
    cmd += ["--module", "course_lib.launch.worker", str(run_dir)]

    run_env = dict(os.environ)
    run_env.update(env or {})
    run_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    run_env["PYTHONUNBUFFERED"] = "1"  # output of a rank that is killed is not lost
    run_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), run_env.get("PYTHONPATH")]))
    run_env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank${rank}]: "
    run_env.pop("PYTEST_CURRENT_TEST", None)

    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=run_env, start_new_session=True, preexec_fn=_preexec
    )
    _ACTIVE[proc.pid] = (proc, run_dir)
    agent_log: list[str] = []
    timed_out = False
    try:
        timed_out = _pump(proc, start + timeout, stream, write, agent_log)
    except BaseException:  # KeyboardInterrupt from the kernel, or anything else: leave nothing behind
        end_run(proc, run_dir)
        write("Interrupted: every process of the run was ended.\n", "stderr")
        raise
    finally:
        running = _alive_workers(run_dir) if timed_out else []
        running_ranks = _running_ranks(run_dir, node_rank, nproc) if timed_out else []
        end_run(proc, run_dir)
        _ACTIVE.pop(proc.pid, None)
    wall = time.monotonic() - start

    attempts = [_read_attempt(d, run_dir, nproc, node_rank) for d in _attempt_dirs(run_dir)]
    if not timed_out:  # on a timeout the launcher itself killed the ranks still running
        _add_silent_deaths(attempts, "".join(agent_log), run_dir)
    if not stream:
        _emit_default(write, attempts)
    values = _collect_values(run_dir, out) if proc.returncode == 0 and not timed_out else {}
    result = RunResult(nproc, backend, attempts, values, wall, "".join(agent_log))

    if timed_out:
        failures = [RankFailure(r, "running", "still running") for r in running_ranks]
        names = ", ".join(str(r) for r in running_ranks) or "none"
        raise RunTimeoutError(
            f"the run passed --timeout {timeout:g} s; ranks still running: {names}. "
            f"Every process was ended ({len(running)} workers killed). Look for a collective "
            f"that not every rank calls, or raise --timeout.",
            failures,
            result,
        )
    if proc.returncode != 0:
        failures = _final_failures(attempts, result.agent_log)
        if not failures:
            tail = "\n".join(result.agent_log.strip().splitlines()[-15:])
            raise RankFailedError(f"torchrun failed before the ranks ran (exit {proc.returncode}):\n{tail}", [], result)
        raise RankFailedError(_describe(failures, cell_source), failures, result)
    return result


def _pump(proc, deadline, stream, write, agent_log) -> bool:
    """Read the agent's pipes until it exits; True if the deadline passed first."""
    selector = selectors.DefaultSelector()
    for pipe, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
        os.set_blocking(pipe.fileno(), False)
        selector.register(pipe, selectors.EVENT_READ, name)
    partial = {"stdout": "", "stderr": ""}
    try:
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            for key, _ in selector.select(min(remaining, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                text = partial[key.data] + chunk.decode(errors="replace")
                *lines, partial[key.data] = text.split("\n")
                for line in lines:
                    _route(line, key.data, stream, write, agent_log)
        for name, rest in partial.items():
            if rest:
                _route(rest, name, stream, write, agent_log)
        while proc.poll() is None:
            if time.monotonic() > deadline:
                return True
            time.sleep(0.05)
        return False
    finally:
        selector.close()


def _route(line: str, name: str, stream: bool, write, agent_log: list[str]) -> None:
    match = _STREAM_PREFIX.match(line)
    if stream and match:
        text = line[match.end() :]
        if not any(p.search(text) for p in _NOISE):
            write(f"[rank {match.group(1)}] {text}\n", name)
    elif not match:
        agent_log.append(line + "\n")


def _running_ranks(run_dir: Path, node_rank: int, nproc: int) -> list[int]:
    """Ranks of the last attempt that started and did not finish."""
    attempts = sorted((run_dir / "ranks").glob("attempt_*"), key=lambda d: int(d.name.split("_")[1]))
    if not attempts:
        return list(range(node_rank * nproc, (node_rank + 1) * nproc))
    started = sorted(int(p.stem) for p in attempts[-1].glob("*.pid"))
    return [r for r in started if not (attempts[-1] / f"{r}.done").exists()]


def _final_failures(attempts: list[Attempt], agent_log: str) -> list[RankFailure]:
    """Who failed in the last attempt, and how: raised, killed by a signal, or stopped by torchrun."""
    raised = attempts[-1].failures if attempts else []
    failed = {f.rank for f in raised}
    died, stopped = [], []
    codes = {r: c for r, c in sorted(_agent_exit_codes(agent_log).items()) if r not in failed}
    others_failed = bool(raised) or any(c != -signal.SIGTERM for c in codes.values())
    for rank, code in codes.items():
        if code == -signal.SIGTERM and others_failed:
            stopped.append(RankFailure(rank, "stopped", "was stopped by torchrun after the failure"))
        elif code < 0:
            died.append(RankFailure(rank, "signal", f"was killed by {_signal_name(code)}"))
        else:
            died.append(RankFailure(rank, "exit", f"exited with code {code} without raising"))
    # A rank that died without a word is the likely root cause of its peers' errors.
    failures = died + list(raised) + stopped
    return failures


def _collect_values(run_dir: Path, out: list[str]) -> dict[str, list[Any]]:
    """Each name's values from this node's ranks, in rank order (all ranks on one node)."""
    import torch

    files = sorted((run_dir / "out").glob("*.pt"), key=lambda p: int(p.stem))
    saved = [torch.load(p, weights_only=False, map_location="cpu") for p in files]
    return {name: [s[name] for s in saved] for name in out}


def standalone_script(body: str, *, backend: str = "auto", init: bool = True, nproc: int = 2) -> str:
    """The cell as a script that plain torchrun runs, with what the magic does spelled out."""
    head = [
        "# Written by %%torchrun --save. Run it with, for example:",
        f"#   torchrun --standalone --nproc-per-node {nproc} THIS_FILE.py",
        "#   torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 THIS_FILE.py",
    ]
    if not init:
        return "\n".join(head) + "\n\n" + body.rstrip() + "\n"
    head += [
        "import torch",
        "import torch.distributed as dist",
        "",
        "from course_lib.launch import runtime",
        "",
        f"_ctx = runtime.init_distributed({backend!r})",
        "rank, world_size, local_rank, device = _ctx.rank, _ctx.world_size, _ctx.local_rank, _ctx.device",
        "",
    ]
    return "\n".join(head) + "\n" + body.rstrip() + "\n\nruntime.shutdown()\n"
