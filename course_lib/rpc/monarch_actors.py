"""A single controller with Monarch: actors on a process mesh, driven from the notebook's own process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# Monarch's mesh controllers poll the processes' state every 10 s by default, so the controller would learn of a
# dead process up to 10 s late; 1 s keeps the failure cell short. Read once, when monarch is first imported.
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")

import monarch.actor
from monarch.actor import Actor, MeshFailure, ProcMesh, current_rank, endpoint, this_host
from monarch.config import configure

from course_lib import comms
from course_lib.launch.processes import running

# In IPython, importing monarch turns on forwarding of the processes' stdout/stderr to the notebook. Our actors print
# nothing, and with forwarding on, `ProcMesh.stop()` first waits (without a timeout) for every process's log
# forwarder to flush, which never happens once a process has died: the failure cell would hang. Off, as in scripts.
configure(enable_log_forwarding=False)

DIM = "procs"  # the name of the mesh's one dimension: actors.slice(procs=...) selects along it


class Worker(Actor):
    """One per process of the mesh. Its state (`total`) stays between calls, like a `%%px` rank's variables."""

    def __init__(self) -> None:
        self.rank = current_rank().rank  # this actor's coordinate along DIM
        self.total = 0.0

    @endpoint
    def whoami(self) -> tuple[int, int]:
        return self.rank, os.getpid()

    @endpoint
    def add(self, amount: float) -> float:
        self.total += amount
        return self.total

    @endpoint
    def reset(self, total: float) -> None:
        self.total = total

    @endpoint
    def echo(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @endpoint
    def all_reduce(self) -> dict[str, Any]:
        """A gloo all-reduce among the actors, in the world `setup_torch_elastic_env` set up (no GPU used)."""
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        tensor = torch.full((4,), float(dist.get_rank() + 1))
        with comms.Recorder() as recorder:
            dist.all_reduce(tensor)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        return {"rank": rank, "world_size": world_size, "value": tensor.tolist(), "calls": recorder.counts()}

    @endpoint
    def leave_process_group(self) -> None:
        dist.destroy_process_group()


class FailingWorker(Worker):
    """A `Worker` that can fail in the two ways of section 4: its endpoint raises, or its process dies."""

    @endpoint
    def fail(self, message: str) -> None:
        raise ValueError(message)

    @endpoint
    def exit_process(self, code: int) -> None:
        os._exit(code)  # the whole process dies at once, as after a segfault or an out-of-memory kill


@dataclass
class Mesh:
    """What :func:`process_mesh` hands the cell: the processes, their pids, the failures seen by the controller."""

    procs: ProcMesh
    pids: list[int] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (mesh name, report) seen by the controller

    async def wait_for_failure(self, mesh_name: str, timeout_s: float = 30.0) -> str:
        """First failure report of actor mesh `mesh_name`; reports arrive async, shortly after a call sees it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # Monarch names an actor mesh "<the name given to spawn>-<a unique suffix>"
            reports = [report for name, report in self.failures if name.rsplit("-", 1)[0] == mesh_name]
            if reports:
                return reports[0]
            await asyncio.sleep(0.05)
        raise TimeoutError(f"no failure of {mesh_name!r} reached the controller within {timeout_s} s: {self.failures}")


@contextlib.asynccontextmanager
async def process_mesh(n: int, stop_timeout_s: float = 30.0) -> AsyncIterator[Mesh]:
    """`n` processes on this host (a mesh with one dimension, DIM), for the `async with` block only.

    Monarch's futures are awaited here: a notebook cell already runs in an event loop, where a blocking `.get()`
    warns and can deadlock. While the block runs, a failure that reaches the controller (a process that died) is
    recorded in `mesh.failures` instead of going to Monarch's default hook, which ends the controller's process.
    At the end the mesh is stopped and every recorded pid must be gone; one still there is killed by its pid and
    reported.
    """
    mesh = Mesh(procs=_spawn_procs(n))
    default_hook = monarch.actor.unhandled_fault_hook

    def record(failure: MeshFailure) -> None:  # returning normally marks the failure handled
        mesh.failures.append((failure.mesh_name, failure.report()))

    monarch.actor.unhandled_fault_hook = record  # Monarch looks the hook up there at every failure
    try:
        probe = mesh.procs.spawn("probe", Worker)
        mesh.pids = [pid for _, pid in (await probe.whoami.call()).values()]
        yield mesh
    finally:
        try:
            await asyncio.wait_for(mesh.procs.stop(), stop_timeout_s)
        finally:
            left = await _wait_until_gone(mesh.pids, stop_timeout_s)
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            monarch.actor.unhandled_fault_hook = default_hook
        if left:
            raise RuntimeError(f"mesh processes {left} were still running after stop(); killed")


async def endpoint_round_trip(actor: Any, repeats: int = 7, warmup: int = 3) -> float:
    """Fastest of `repeats` 8-byte `echo` round trips to one actor (s), as section 7's smallest rpc_sync."""
    tensor = torch.zeros(2)
    for _ in range(warmup):
        await actor.echo.call_one(tensor)
    times = []
    for _ in range(repeats):
        start_time = time.perf_counter()
        await actor.echo.call_one(tensor)
        times.append(time.perf_counter() - start_time)
    return min(times)


async def _wait_until_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while running(pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return running(pids)


def _spawn_procs(n: int) -> ProcMesh:
    """this_host().spawn_procs minus the log-path line Monarch writes to fd 2, which no setting silences."""
    with tempfile.TemporaryFile(mode="w+") as captured:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            host = this_host()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        for line in captured:
            if not line.startswith("Monarch internal logs are being written to "):
                sys.stderr.write(line)
    return host.spawn_procs(per_host={DIM: n})


__all__ = ["DIM", "FailingWorker", "Mesh", "Worker", "endpoint_round_trip", "process_mesh", "running"]
