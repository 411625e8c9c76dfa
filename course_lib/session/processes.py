"""The processes of a session: the ipyparallel controller, the torchrun agent, one engine per rank.

The kernel starts the controller and the agent, each in a session of its own that dies with the
kernel (PR_SET_PDEATHSIG, as for `%%torchrun`); the agent starts the engines, which die with it.
Every process is ended by its recorded pid or process group, never by name. All files of a session
live in one private temporary folder (mode 0700), removed when the session stops.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from course_lib.launch.processes import agent_env, kill_group
from course_lib.launch.spec import RunSpec

CLUSTER_ID = "session"
START_TIMEOUT_S = 180.0  # start-up of the controller and every engine (slow on a loaded machine)
# The controller pings each engine every PING_MS and drops it after MISSES missed pings: a dead rank
# is noticed within a few seconds (ipyparallel's defaults, 3 s x 10, would take half a minute).
PING_MS = 1000
MISSES = 3


class SessionDir:
    """The private folder of one session.

    profile/security/ipcontroller-session-{client,engine}.json   ipyparallel's connection files
    ranks/R.pid        the pid of rank R's engine (how the kernel signals and ends it)
    controller.log, agent.log    their output (the agent's names the rank that died first)
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.profile = path / "profile"
        self.security = self.profile / "security"
        self.client_file = self.security / f"ipcontroller-{CLUSTER_ID}-client.json"
        self.engine_file = self.security / f"ipcontroller-{CLUSTER_ID}-engine.json"
        self.ranks = path / "ranks"
        self.controller_log = path / "controller.log"
        self.agent_log = path / "agent.log"

    @classmethod
    def create(cls) -> SessionDir:
        return cls(Path(tempfile.mkdtemp(prefix="dist-session-")))  # mkdtemp: mode 0700

    def pid_file(self, rank: int) -> Path:
        return self.ranks / f"{rank}.pid"

    def rank_pids(self) -> dict[int, int]:
        """{rank: engine pid} for every rank that recorded one."""
        found = {}
        for path in self.ranks.glob("*.pid"):
            with contextlib.suppress(ValueError):
                found[int(path.stem)] = int(path.read_text().strip())
        return dict(sorted(found.items()))

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _die_with_kernel() -> None:
    """In the controller and the agent, before exec: SIGKILL when the kernel dies, even by SIGKILL.

    Nothing of a session needs a graceful end: the engines die with the agent (launch.worker.die_with_parent).
    """
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_kernel,
        )


def start_controller(folder: SessionDir) -> subprocess.Popen:
    """ipcontroller on loopback, random ports, one process (schedulers in threads)."""
    cmd = [sys.executable, "-m", "ipyparallel.controller", f"--profile-dir={folder.profile}"]
    cmd += [f"--cluster-id={CLUSTER_ID}", "--ip=127.0.0.1", "--IPController.use_threads=True"]
    cmd += [f"--HeartMonitor.period={PING_MS}", f"--HeartMonitor.max_heartmonitor_misses={MISSES}"]
    cmd += ["--log-level=WARN"]
    return _start(cmd, folder.controller_log)


def start_agent(folder: SessionDir, nproc: int, backend: str) -> subprocess.Popen:
    """torchrun with one course_lib.session.engine per rank (gloo ranks see no GPU: agent_env)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["--max-restarts", "0", "--monitor-interval", "0.1"]
    cmd += ["--module", "course_lib.session.engine", str(folder.path)]
    env = agent_env(RunSpec(nproc=nproc, backend=backend))
    env["IPP_NONINTERACTIVE"] = "1"  # no progress widgets inside the engines
    return _start(cmd, folder.agent_log, env)


def tail(log: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return ""


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as dead)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def first_failure(folder: SessionDir) -> str | None:
    """'rank 2 (exitcode -9)' from torchrun's report of the first rank that died, if it wrote one."""
    text = folder.agent_log.read_text(errors="replace") if folder.agent_log.exists() else ""
    found = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", text, re.S)
    if not found:
        return None
    rank, code = found.groups()
    with contextlib.suppress(ValueError):
        if int(code) < 0:
            return f"rank {rank} ({signal.Signals(-int(code)).name})"
    return f"rank {rank} (exit code {code})"


def interrupt(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGINT)


def end(procs: list[subprocess.Popen], folder: SessionDir) -> None:
    """End the agent, every engine and the controller (SIGKILL: no state to save); return when none is left."""
    pids = list(folder.rank_pids().values())
    for pgid in [proc.pid for proc in procs] + pids:  # engines run in sessions of their own (torchrun's)
        kill_group(pgid, signal.SIGKILL)
    for proc in procs:
        proc.wait(5)
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
