"""The processes of a run: the torchrun agent the kernel starts, and the ranks the agent starts.

Nothing of a run outlives it: each dies with its parent and is ended by recorded pid or process group, never by name."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import select
import selectors
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from course_lib.launch.spec import RunDir, RunSpec

_IMPORT_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds course_lib/
_ACTIVE: dict[int, tuple[Agent, RunDir]] = {}  # agent pid -> (agent, its run), until ended


WORKER = "course_lib.launch.worker"  # the program of a `%%torchrun` cell's ranks
# Variables torch reads only when imported: a run that sets one gets exec'd ranks, which import torch afresh.
READ_AT_IMPORT = ("TORCH_CPP_LOG_LEVEL", "TORCH_DISTRIBUTED_DEBUG", "TORCH_LOGS", "TORCH_SHOW_CPP_STACKTRACES")
ENV_AT_IMPORT = dict(os.environ)  # in a forked rank: the forkserver's, which torchrun's variables for it then change


def forks_ranks(env: dict[str, str]) -> bool:
    """Whether ranks with agent_env `env` fork from the forkserver (torch imported there once), not start afresh."""
    # pidfd_open: a forked rank ends with its agent, which is not its parent. 3.14 changed the forkserver's handshake.
    usable = hasattr(os, "pidfd_open") and sys.version_info < (3, 14)
    return usable and not any(name in env for name in READ_AT_IMPORT)


def torchrun_args(spec: RunSpec, run: RunDir, program: str = WORKER, forked: bool = False) -> list[str]:
    """torchrun's arguments for `run`: ``... --module PROGRAM RUN_DIR``, or PROGRAM's file as forked ranks' function."""
    cmd = ["--nproc-per-node", str(spec.nproc), "--max-restarts", str(spec.max_restarts), "--monitor-interval", "0.1"]
    cmd += ["--log-dir", str(run.logs), "--redirects", "3"]
    if spec.stream:
        cmd += ["--tee", "3"]
    if spec.multi_node:
        rdzv = {
            "--nnodes": spec.nnodes,
            "--node-rank": spec.node_rank,
            "--rdzv-endpoint": spec.rdzv_endpoint,
            "--rdzv-backend": spec.rdzv_backend,
            "--rdzv-id": spec.rdzv_id,
        }
        cmd += [part for flag, value in rdzv.items() if value is not None for part in (flag, str(value))]
    else:
        cmd += ["--standalone"]  # a free rendezvous port per run: runs never collide
    if forked:  # the program's file, run as a function of each forked rank
        origin = importlib.util.find_spec(program).origin  # type: ignore[union-attr]
        return [*cmd, "--start-method", "forkserver", "--run-path", str(origin), str(run.path)]
    return [*cmd, "--module", program, str(run.path)]


def agent_env(spec: RunSpec) -> dict[str, str]:
    """The ranks' environment: gloo ranks see no GPU (FSDP2 and DeviceMesh would follow it onto one), TF32 off."""
    hidden = {"CUDA_VISIBLE_DEVICES": ""} if spec.backend == "gloo" else {}
    env = {**os.environ, **hidden, **spec.env}
    env.pop("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", None)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // spec.nproc)))
    env["PYTHONUNBUFFERED"] = "1"  # output of a rank that is killed is not lost
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_IMPORT_ROOT), env.get("PYTHONPATH")]))
    env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank${rank}]: "  # output.STREAM_PREFIX reads it
    if spec.max_restarts:
        # Rank 0 of every rendezvous round hosts a fresh store. Shared across rounds (torch's default), the agent's
        # store keeps the last round's addresses under the same keys, and a restarted group connects to dead peers.
        # Only where a group may restart: the shared store outlives rank 0, which RPC's shutdown relies on.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def torchrun_env(nproc: int, backend: str = "auto") -> dict[str, str]:
    """agent_env of a `%%torchrun -n NPROC --backend BACKEND` cell, for a torchrun started by other means."""
    return agent_env(RunSpec.create(nproc=nproc, backend=backend))


_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(["torch.distributed.run", "ipyparallel.engine.app", __name__])


class Agent(_FORKSERVER.Process):  # type: ignore[name-defined,misc]
    """A torchrun agent forked from multiprocessing's forkserver, which imported torch once for all of them.

    `python -m torch.distributed.run` spends ~1.2 s importing torch before it starts a rank: every cell did."""

    stdout: multiprocessing.connection.Connection  # the agent's output, read by pump (unless it goes to a log)
    stderr: multiprocessing.connection.Connection

    def poll(self) -> int | None:  # as subprocess.Popen's, so the session ends its processes alike
        return self.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self.join(timeout)
        return self.exitcode


def start_forkserver() -> None:
    """Start the agents' forkserver now (it preloads torch in the background), not at the first cell."""
    multiprocessing.forkserver.ensure_running()


_SERVER: Any = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]  # its address has no public getter


def start_agent(spec: RunSpec, run: RunDir, program: str = WORKER, log: Path | None = None) -> Agent:
    """Start torchrun for `run` in a session of its own, output into pipes or `log`; end_run (or exit) ends it."""
    pipes = [] if log else [_FORKSERVER.Pipe(duplex=False) for _ in range(2)]
    output = str(log) if log else tuple(write for _, write in pipes)
    start_forkserver()  # (again, if a cell killed it)
    env = agent_env(spec)
    forkserver = _SERVER._forkserver_address if forks_ranks(env) else None
    args = (os.getpid(), torchrun_args(spec, run, program, bool(forkserver)), env, output, run.agent_file, forkserver)
    agent = Agent(target=_agent_main, args=args)
    agent.start()
    for _, write in pipes:
        write.close()  # the agent holds the only write ends: the pipes close when it exits
    if pipes:
        agent.stdout, agent.stderr = (read for read, _ in pipes)
    _ACTIVE[agent.pid] = (agent, run)
    return agent


def _agent_main(
    kernel: int,
    args: list[str],
    env: dict[str, str],
    output: str | tuple[multiprocessing.connection.Connection, multiprocessing.connection.Connection],
    agent_file: Path,
    forkserver: str | None,
) -> None:
    """torchrun's main in the forked agent: its own session, output into the pipes or log, an end with the kernel.

    With `forkserver` (its address), the ranks fork from the kernel's forkserver, which has torch imported and runs no
    thread, not from this agent, whose threads (the store's, a watcher) could hold a lock at the fork."""
    os.setsid()
    run, kernel_gone = RunDir(agent_file.parent), threading.Event()
    if hasattr(os, "pidfd_open"):  # Linux: the agent's parent is the forkserver, so no PR_SET_PDEATHSIG
        when_gone(kernel, lambda: _stop(run, kernel_gone))
    if isinstance(output, str):
        log = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        fds = [log, log]
    else:
        fds = [connection.fileno() for connection in output]
    for fd, target in zip(fds, (1, 2), strict=True):
        os.dup2(fd, target)
    sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    if "LOGLEVEL" in env:  # torch's loggers read it when imported, which the forkserver did
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("torch.distributed"):
                logging.getLogger(name).setLevel(env["LOGLEVEL"])
    # What an exec'd rank gets from this agent, which a forked one takes on (worker.adopt_agent).
    agent_file.write_text(json.dumps({"pid": os.getpid(), "cwd": os.getcwd(), "env": env}))
    if forkserver:
        _SERVER._forkserver_address = forkserver  # its alive pipe is inherited (forkserver._serve_one)
        _SERVER.ensure_running = lambda: None  # running: the kernel started it
    from torch.distributed.run import main

    try:
        main(args)
    finally:
        # A run read through pipes (a cell's, a lab's) has nobody left to read or remove its files, the environment
        # among them; a session's folder is its watcher's, which still reads the engines' pids there.
        if kernel_gone.is_set() and not isinstance(output, str):
            run.remove()


def when_gone(pid: int, action: Callable[[], object]) -> None:
    """Run `action` in a thread once process `pid` exits, even by SIGKILL (Linux's pidfd_open); at once if it has."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        action()
        return

    def wait() -> None:
        select.select([pidfd], [], [])
        action()

    threading.Thread(target=wait, daemon=True).start()


def _stop(run: RunDir, kernel_gone: threading.Event) -> None:
    """The kernel is gone: end the ranks' sessions (what the ranks started: the launcher's end_run, which died with
    it, would have), then SIGTERM this agent; torchrun ends the rest, and the run's folder goes once it has."""
    for pid in running(run.started()):
        kill_group(pid, signal.SIGKILL)
    kernel_gone.set()
    os.kill(os.getpid(), signal.SIGTERM)


def running(pids: Iterable[int] | dict[int, float]) -> list[int]:
    """Those of `pids` still running (zombies gone); given {pid: start time}, only those started then (not reused)."""
    import psutil

    alive = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            # create_time adds /proc/stat's btime, whole seconds that move when the clock is set: allow 1 s of it
            same = not isinstance(pids, dict) or abs(proc.create_time() - pids[pid]) < 1.5
            if same and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.Error:
            continue
    return alive


def kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def end_run(proc: Agent, run: RunDir, grace_s: float = 3.0) -> None:
    """End the agent and every worker of one run; return when none is left."""
    if proc.exitcode is None:
        kill_group(proc.pid, signal.SIGTERM)  # the agent stops its workers on SIGTERM
        proc.join(grace_s)
    # Workers run in sessions of their own (pgid == pid): their groups include their children. Then the agent, which
    # once they are gone exits through torchrun's shutdown and unlinks its forked ranks' semaphores (not on SIGKILL).
    for pid in running(run.started()):
        kill_group(pid, signal.SIGKILL)
    if proc.exitcode is None:
        proc.join(1)
    kill_group(proc.pid, signal.SIGKILL)
    proc.join(5)
    deadline = time.monotonic() + 5
    while running(run.started()) and time.monotonic() < deadline:
        time.sleep(0.05)
    _ACTIVE.pop(proc.pid, None)


@atexit.register
def _end_all_runs() -> None:
    for proc, run in list(_ACTIVE.values()):
        if (
            proc.is_alive()
        ):  # one that exited (a session's, which the session ends) needs nothing: its pid may be reused
            end_run(proc, run, grace_s=1.0)


def pump(proc: Agent, deadline: float, on_line: Callable[[str, str], None]) -> bool:
    """Pass the agent's output lines to `on_line` until it exits; True if the monotonic `deadline` passed first."""
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
                    on_line(line, key.data)
        for name, rest in partial.items():
            if rest:
                on_line(rest, name)
        # Only wait: reading the exit code from two threads at once (pump in a thread, its caller) loses it.
        return not multiprocessing.connection.wait([proc.sentinel], max(0.0, deadline - time.monotonic()))
    finally:
        selector.close()
