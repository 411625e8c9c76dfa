"""The processes of a run: the torchrun agent the kernel starts, and the ranks the agent starts.

The kernel owns every process it starts: on success, failure, timeout, interrupt or its own exit,
nothing of a run is left alive. Processes are ended by their recorded pid or process group, never
by name. The agent runs in a session of its own and dies with the kernel (PR_SET_PDEATHSIG); each
rank records its pid in the run directory and dies with the agent (see worker.die_with_parent).
"""

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
    """The kernel's environment, with the spec's extra variables and what the ranks need.

    gloo ranks see no GPU: on a GPU node they run as on a laptop (FSDP2 and DeviceMesh would
    otherwise follow the accelerator and move them onto GPUs). TF32 stays off in every rank.
    """
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
    """The environment a `%%torchrun -n NPROC --backend BACKEND` cell gives torchrun (agent_env), for a torchrun
    started by other means, such as a subprocess: on a GPU node gloo ranks see no GPU and NCCL ranks the node's,
    with no TF32 override in either; OMP threads shared out over the ranks; rank-prefixed lines under --tee."""
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
    """In a process the kernel starts (an agent, a controller), before exec: SIGTERM when the kernel dies.

    SIGTERM, so a torchrun agent stops its workers; even a kernel killed by SIGKILL sends it.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def running(pids: Iterable[int], naming: str | Path | None = None) -> list[int]:
    """Those of `pids` whose process runs (a zombie counts as gone) and, given `naming`, whose command line
    names it: a run's folder, so a recorded pid that now belongs to another process does not count."""
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
    """Pass each line of the agent's pipes to `on_line(line, "stdout" | "stderr")` until it exits.

    True if the monotonic `deadline` passed first (the agent is then still running).
    """
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
