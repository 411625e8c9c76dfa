"""The processes of a session: the ipyparallel controller, the torchrun agent, and one engine per rank.

Some escape every death signal, so all are ended by session id: by the kernel on stop, by a watcher when it dies."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from course_lib.launch.failures import exit_codes, how_it_ended
from course_lib.launch.processes import Agent, kill_group, running, start_agent
from course_lib.launch.spec import RunDir, RunSpec
from course_lib.launch.worker import is_torchrun_agent

CLUSTER_ID = "session"
START_TIMEOUT_S = 180.0  # start-up of the controller and every engine (slow on a loaded machine)
# The controller pings each engine every PING_MS and drops it after MISSES missed pings: a dead rank
# is noticed within 3 s (ipyparallel's defaults, 3 s x 10, would take half a minute). The hub registers an engine
# at the ping after its first answer, so a short period starts a session sooner (1 s: 2 s more at 4 ranks).
PING_MS = 100
MISSES = 30
Process = subprocess.Popen | Agent  # the controller, the agent


class SessionDir(RunDir):
    """The private folder of one session: a RunDir plus ipyparallel's connection files and the processes' logs."""

    PREFIX = "dist-session-"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.profile = path / "profile"
        self.security = self.profile / "security"
        self.client_file = self.security / f"ipcontroller-{CLUSTER_ID}-client.json"
        self.engine_file = self.security / f"ipcontroller-{CLUSTER_ID}-engine.json"
        self.controller_log = path / "controller.log"
        self.agent_log = path / "agent.log"
        self.watcher_log = path / "watcher.log"


def die_with_kernel() -> None:
    """Before exec in a child of the kernel: SIGTERM when the kernel dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_controller(folder: SessionDir) -> subprocess.Popen:
    """ipcontroller on loopback, random ports, one process (schedulers in threads)."""
    cmd = [sys.executable, "-m", "ipyparallel.controller", f"--profile-dir={folder.profile}"]
    cmd += [f"--cluster-id={CLUSTER_ID}", "--ip=127.0.0.1", "--IPController.use_threads=True"]
    cmd += [f"--HeartMonitor.period={PING_MS}", f"--HeartMonitor.max_heartmonitor_misses={MISSES}"]
    cmd += ["--log-level=WARN"]
    with open(folder.controller_log, "wb") as log:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_kernel,
        )


def start_engines(folder: SessionDir, nproc: int, backend: str) -> Agent:
    """torchrun with one engine per rank, started as a `%%torchrun` cell's agent, output teed into agent.log."""
    spec = RunSpec(nproc=nproc, backend=backend, stream=True, env={"IPP_NONINTERACTIVE": "1"})  # no progress widgets
    # An engine exits if the profile folder is missing, and on a loaded machine it may start before the controller
    # has made it: the engines then wait for the controller's connection file in the folder (wait_for_url_file).
    folder.profile.mkdir(mode=0o700, exist_ok=True)
    return start_agent(spec, folder, "course_lib.session.processes", folder.agent_log)


def tail(log: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return ""


def first_failure(folder: SessionDir) -> str | None:
    """'rank 2 (SIGKILL)' from torchrun's report of the first rank that died, if it wrote one."""
    text = folder.agent_log.read_text(errors="replace") if folder.agent_log.exists() else ""
    first = next(iter(exit_codes(text).items()), None)  # the root cause comes first
    return None if first is None else f"rank {first[0]} ({how_it_ended(first[1])})"


def interrupt(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGINT)


def start_watcher(folder: SessionDir) -> subprocess.Popen:
    """Start the process that ends the session when the kernel ends without stopping it (SIGKILL included)."""
    code = "import sys\nfrom course_lib.session.processes import watch\nwatch(sys.argv[1], int(sys.argv[2]))"
    with open(folder.watcher_log, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-c", code, str(folder.path), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )


def watch_over(watcher: subprocess.Popen | None, proc: Process) -> Process:
    """Tell the watcher of `proc` (started in a session of its own); return `proc`."""
    if watcher is not None and watcher.stdin is not None:
        with contextlib.suppress(OSError):  # a watcher that is gone: end() still ends `proc`
            watcher.stdin.write(f"{proc.pid}\n".encode())
            watcher.stdin.flush()
    return proc


def watch(path: str, kernel: int) -> None:
    """The watcher's program (see start_watcher): `kernel` is the pid of the kernel that started it."""
    import select

    folder = SessionDir(Path(path))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the kernel's end, or a request to stop, ends it
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(0))
    received = b""
    try:
        while os.getppid() == kernel:  # until the kernel closes the pipe or dies
            if select.select([sys.stdin], [], [], 0.5)[0]:
                chunk = os.read(sys.stdin.fileno(), 4096)
                if not chunk:
                    break
                received += chunk
    finally:
        end_sessions(folder, [int(pid) for pid in received.split() if pid.isdigit()])
        folder.remove()


def session_processes(folder: SessionDir, leaders: list[int]) -> list[int]:
    """Every live process (but this one) in a session of `leaders` or of an engine, even with its leader gone."""
    import psutil

    sids = {sid for sid in {*leaders, *folder.rank_pids().values()} if _still_ours(sid, folder)}
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.pid != os.getpid() and os.getsid(proc.pid) in sids and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
    return found


def _still_ours(sid: int, folder: SessionDir) -> bool:
    """Whether session `sid` may still hold our processes: Linux reuses no pid while a session of that id is left."""
    import psutil

    try:
        leader = psutil.Process(sid)
        if leader.status() == psutil.STATUS_ZOMBIE:
            return True
        if os.getsid(sid) != sid:
            return False  # a newcomer: what was left of the session is gone
        cmdline = leader.cmdline()
        # the controller names the folder; the agent (forked: the forkserver's command line) is named by torchrun's
        # main (is_torchrun_agent); an engine recorded its start time
        ours = not cmdline or str(folder.path) in " ".join(cmdline) or is_torchrun_agent(sid)
        return ours or sid in running(folder.started())
    except (psutil.NoSuchProcess, ProcessLookupError):
        return True  # the leader is gone: what it started may be left in its session
    except (psutil.Error, OSError):
        return False


def end_sessions(folder: SessionDir, leaders: list[int], timeout_s: float = 5.0) -> None:
    """SIGKILL every process of session_processes (no state to save) until none is left.

    The engines first, then the agent by SIGTERM: it exits through torchrun's shutdown, which unlinks the semaphores
    of its forked ranks' queues; a SIGKILL would leave them in /dev/shm."""
    import psutil

    for pid in running(folder.started()):
        kill_group(pid, signal.SIGKILL)
    agents = []
    for pid in leaders:
        with contextlib.suppress(psutil.Error):
            if is_torchrun_agent(pid):
                agents.append(agent := psutil.Process(pid))
                agent.terminate()
    psutil.wait_procs(agents, timeout=timeout_s)
    for pgid in [*leaders, *folder.rank_pids().values()]:  # most of them, at once
        if _still_ours(pgid, folder):
            kill_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while (pids := session_processes(folder, leaders)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def end(procs: list[Process], folder: SessionDir, watcher: subprocess.Popen | None = None) -> None:
    """End the agent, every engine, the controller and what they started, then the watcher; return when none is left."""
    end_sessions(folder, [proc.pid for proc in procs])
    for proc in procs:
        proc.wait(5)
    if watcher is not None:
        with contextlib.suppress(OSError):
            watcher.stdin.close()  # type: ignore[union-attr]  # the watcher finds nothing left, and exits
        try:
            watcher.wait(10)
        except subprocess.TimeoutExpired:  # still starting on a loaded machine: nothing is left to watch
            watcher.kill()
            watcher.wait()


def prepare(backend: str, timeout_s: float) -> dict[str, Any]:
    """Join the process group; the namespace of the rank's cells: torch, dist, rank, world_size, local_rank, device."""
    import torch
    import torch.distributed as dist

    from course_lib.launch.runtime import init_distributed

    ctx = init_distributed(backend, timeout_s=timeout_s)
    return {
        "torch": torch,
        "dist": dist,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "local_rank": ctx.local_rank,
        "device": ctx.device,
    }


def main(folder: Path) -> None:
    from course_lib.launch.worker import start_rank

    session = SessionDir(folder)
    _, rank, _ = start_rank(session)  # dies with the agent, records its pid as a cell's rank does

    from ipyparallel.engine.app import IPEngine

    IPEngine.launch_instance(
        [
            f"--file={session.engine_file}",
            f"--profile-dir={session.profile}",
            f"--IPEngine.id={rank}",
            "--IPEngine.enable_nanny=False",  # the kernel signals engines by pid: no extra process
            f"--IPEngine.wait_for_url_file={START_TIMEOUT_S}",  # started with the controller, not after it
            f"--IPEngine.timeout={START_TIMEOUT_S}",  # the hub answers registration slowly on a loaded machine
            "--log-level=WARN",
        ]
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
