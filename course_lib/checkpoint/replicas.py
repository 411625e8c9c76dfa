"""Replica groups started from the kernel: one one-rank torchrun run each, a torchft lighthouse in this process.

The machinery is section 10's (``checkpoint.elastic``: start, kill by recorded pid, end, check that nothing is
left); the lighthouse is torchft's ``LighthouseServer``, a Rust thread, no process. :func:`run_torchft` is the
failure run of section 11, :func:`compare_sync` the runs of section 12.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from course_lib.checkpoint.elastic import Node, _end, _start, _wait, read_json_lines
from course_lib.checkpoint.fault_tolerance import LIGHTHOUSE, QUIET
from course_lib.checkpoint.local_sgd import SYNC_RUNS
from course_lib.launch import processes
from course_lib.launch.spec import RunDir, RunSpec


@dataclass
class TorchftRun:
    events: dict[str, list[dict]]  # "replica 0", "replica 1", "replica 1 again" -> its log, in order
    weights: dict[str, dict[str, torch.Tensor]]  # "replica 0", "replica 1" -> final weights
    killed_at: float  # time.time() of the kill
    exit_codes: dict[str, int | None]
    left: list[int]  # pids of processes of the run still alive after it ended: none
    wall_s: float


def _replica(name: str, body: str, timeout_s: float) -> Node:
    """One replica group: a one-rank torchrun run of its own, gloo on the CPU (torchft's ProcessGroupGloo)."""
    spec = RunSpec.create(nproc=1, backend="gloo", init=False, timeout=timeout_s, env=QUIET)
    run = RunDir.create()
    run.cell.write_text(body)
    spec.write(run)
    return Node(name, spec, run)


def _add_notes(error: BaseException, nodes: list[Node]) -> None:
    """Each replica's last stderr lines, then end every replica (naming any process still alive: none)."""
    for node in nodes:
        for log in sorted(node.run.logs.glob("*/attempt_*/*/stderr.log")):
            tail = "\n".join(log.read_text().splitlines()[-15:])
            error.add_note(f"--- {node.name}, its stderr:\n{tail}")
    error.add_note(f"processes left behind after ending every replica: {_end(nodes)}")


def _lighthouse() -> tuple[Any, str]:
    """A lighthouse server in this process (a Rust thread) on loopback, and its address."""
    # torchft's Rust side reads RUST_LOG when a server starts and logs every quorum at INFO by default
    os.environ.setdefault("RUST_LOG", "error")
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", **LIGHTHOUSE)
    port = server.address().rsplit(":", 1)[1]  # it advertises the host's name; the replicas dial loopback
    return server, f"http://127.0.0.1:{port}"


def _body(module: str, call: str) -> str:
    """The cell a replica's torchrun run executes: one call into a module of this package."""
    return f"from course_lib.checkpoint import {module}\n{module}.{call}\n"


def run_torchft(
    root: str | os.PathLike,
    *,
    total_steps: int = 14,
    kill_at: int = 6,
    rejoin_at: int = 10,
    timeout_s: float = 120.0,
) -> TorchftRun:
    """Two replicas train; replica 1 is killed (SIGKILL, by recorded pid) before step `kill_at`; replica 0 trains on
    alone; replica 1 starts again, heals from replica 0 at step `rejoin_at`, and both train to `total_steps`.

    Raises TimeoutError after `timeout_s` seconds in all, with each replica's last log lines.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = start + timeout_s
    lighthouse, address = _lighthouse()
    steps = f"{total_steps}, limit_s={timeout_s}"
    first = _replica(
        "replica 0",
        _body(
            "fault_tolerance", f"train_replica({str(root)!r}, 0, {address!r}, {steps}, wait_for_rejoin_at={rejoin_at})"
        ),
        timeout_s,
    )
    second = _replica(
        "replica 1",
        _body("fault_tolerance", f"train_replica({str(root)!r}, 1, {address!r}, {steps}, pause_at={kill_at})"),
        timeout_s,
    )
    again = _replica(
        "replica 1 again",
        _body("fault_tolerance", f"train_replica({str(root)!r}, 1, {address!r}, {steps}, rejoining=True)"),
        timeout_s,
    )
    nodes = [first, second, again]
    log0, log1 = root / "replica_0.jsonl", root / "replica_1.jsonl"
    try:
        _start(first, deadline)
        _start(second, deadline)
        paused = lambda: any(e["event"] == "pause" for e in read_json_lines(log1))
        _wait(f"replica 1 to reach step {kill_at}", paused, [first, second], deadline)
        for pid in second.run.pids():  # the replica's process, by its recorded pid: no cleanup, no goodbye
            processes.kill_group(pid, signal.SIGKILL)
        killed_at = time.time()
        assert second.proc is not None
        second.proc.wait(30)  # its torchrun agent sees the worker die and exits
        alone = lambda: any(e["event"] == "step" and e["step"] == kill_at for e in read_json_lines(log0))
        _wait(f"replica 0 to commit step {kill_at} alone", alone, [first], deadline)
        log1.rename(root / "replica_1_first.jsonl")
        _start(again, deadline)
        done = lambda: all(n.proc is not None and n.proc.poll() is not None for n in (first, again))
        _wait("both replicas to finish", done, [], deadline)
        codes = {n.name: None if n.proc is None else n.proc.returncode for n in (first, again)}
        if any(codes.values()):
            raise RuntimeError(f"a replica failed: exit codes {codes}")
    except BaseException as error:
        _add_notes(error, nodes)
        raise
    finally:
        lighthouse.shutdown()
    left = _end(nodes)
    events = {
        "replica 0": read_json_lines(log0),
        "replica 1": read_json_lines(root / "replica_1_first.jsonl"),
        "replica 1 again": read_json_lines(log1),
    }
    weights = {f"replica {r}": torch.load(root / f"replica_{r}.pt", weights_only=True) for r in (0, 1)}
    return TorchftRun(
        events=events,
        weights=weights,
        killed_at=killed_at,
        exit_codes={n.name: None if n.proc is None else n.proc.returncode for n in nodes},
        left=left,
        wall_s=time.monotonic() - start,
    )


@dataclass
class SyncComparison:
    runs: dict[str, dict[str, list]]  # SYNC_RUNS name -> {"allreduced": bytes per call, "losses": every 8 steps}
    steps: int
    replicas_agree: bool  # both replicas recorded the same calls and losses
    left: list[int]  # pids of processes of the run still alive after it ended: none


def compare_sync(root: str | os.PathLike, *, steps: int = 24, timeout_s: float = 120.0) -> SyncComparison:
    """Run :func:`train_synced` on two replicas (one torchrun run each, a lighthouse per run in this process)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    started = {name: _lighthouse() for name in SYNC_RUNS}
    servers = {name: server for name, (server, _) in started.items()}
    addresses = {name: address for name, (_, address) in started.items()}
    nodes = [
        _replica(
            f"replica {r}",
            _body("local_sgd", f"train_synced({str(root)!r}, {r}, {addresses!r}, {steps}, limit_s={timeout_s})"),
            timeout_s,
        )
        for r in (0, 1)
    ]
    try:
        for node in nodes:
            _start(node, deadline)
        finished = lambda: all(n.proc is not None and n.proc.poll() is not None for n in nodes)
        _wait("both replicas to finish", finished, [], deadline)
        codes = [None if n.proc is None else n.proc.returncode for n in nodes]
        if any(codes):
            raise RuntimeError(f"a replica failed: exit codes {codes}")
    except BaseException as error:
        _add_notes(error, nodes)
        raise
    finally:
        for server in servers.values():
            server.shutdown()
    left = _end(nodes)
    records = [json.loads((root / f"synced_{r}.json").read_text()) for r in (0, 1)]
    return SyncComparison(records[0], steps, records[0] == records[1], left)
