"""The processes of a run: the torchrun agent the kernel starts, and the ranks the agent starts.

Nothing of a run outlives it: each dies with its parent and is ended by recorded pid or process group, never by name."""

from __future__ import annotations

import atexit
import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from course_lib.launch.spec import RunDir, RunSpec

_IMPORT_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds course_lib/
_ACTIVE: dict[int, tuple[subprocess.Popen, RunDir]] = {}  # agent pid -> (agent, its run), until ended


WORKER = "course_lib.launch.worker"  # the program of a `%%torchrun` cell's ranks


def torchrun_command(spec: RunSpec, run: RunDir, program: str = WORKER) -> list[str]:
    """``python -m torch.distributed.run ... --module PROGRAM RUN_DIR`` (a session's engines: session.processes)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(spec.nproc)]
    cmd += ["--max-restarts", str(spec.max_restarts), "--monitor-interval", "0.1"]
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


def start_agent(spec: RunSpec, run: RunDir) -> subprocess.Popen:
    """Start torchrun for `run` in a session of its own; it is ended by end_run (or at exit)."""
    proc = subprocess.Popen(
        torchrun_command(spec, run),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=agent_env(spec),
        start_new_session=True,
        preexec_fn=die_with_kernel,
    )
    _ACTIVE[proc.pid] = (proc, run)
    return proc


def die_with_kernel() -> None:
    """Before exec in a child of the kernel: SIGTERM when the kernel dies (even by SIGKILL), so torchrun stops ranks."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def running(pids: Iterable[int], naming: str | Path | None = None) -> list[int]:
    """Those of `pids` still running (zombies gone) whose command line names `naming`: a reused pid is not counted."""
    import psutil

    alive = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE and (naming is None or str(naming) in " ".join(proc.cmdline())):
                alive.append(pid)
        except psutil.Error:
            continue
    return alive


def kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def end_run(proc: subprocess.Popen, run: RunDir, grace_s: float = 3.0) -> None:
    """End the agent and every worker of one run; return when none is left."""
    if proc.poll() is None:
        kill_group(proc.pid, signal.SIGTERM)  # the agent stops its workers on SIGTERM
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    kill_group(proc.pid, signal.SIGKILL)
    # Workers run in sessions of their own (pgid == pid): their groups include their children.
    for pid in run.pids():
        kill_group(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait(5)
    deadline = time.monotonic() + 5
    while running(run.pids(), run.path) and time.monotonic() < deadline:
        time.sleep(0.05)
    _ACTIVE.pop(proc.pid, None)


@atexit.register
def _end_all_runs() -> None:
    for proc, run in list(_ACTIVE.values()):
        end_run(proc, run, grace_s=1.0)


def pump(proc: subprocess.Popen, deadline: float, on_line: Callable[[str, str], None]) -> bool:
    """Pass the agent's output lines to `on_line` until it exits; True if the monotonic `deadline` passed first."""
    assert proc.stdout is not None and proc.stderr is not None, "start_agent pipes both"
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
        while proc.poll() is None:
            if time.monotonic() > deadline:
                return True
            time.sleep(0.05)
        return False
    finally:
        selector.close()
