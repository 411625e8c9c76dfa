"""Elastic membership on one machine: two torchrun agents (two "nodes") join and leave one c10d rendezvous.

    torchrun --nnodes 1:2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --max-restarts K

Node 0 hosts the rendezvous store and trains alone; node 1 starts and joins (node 0's agent sees it waiting
and restarts the group at world size 2); node 1 is then stopped (SIGTERM to its agent, as a scheduler
preempting it would), node 0's workers lose their peer, and its agent restarts the group at world size 1
once the rendezvous has dropped the dead node (its heartbeats stopped). The rank side is
:func:`~course_lib.checkpoint.elastic_train.train_elastic`. Everything started here is ended by process
group and recorded pid, whatever happens, within a hard overall timeout.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.checkpoint.elastic_train import EVENTS
from course_lib.launch import processes
from course_lib.launch.spec import RunDir, RunSpec

# Rendezvous settings (torchrun --rdzv-conf): generous to join, quick to drop a dead node and to close a round.
RDZV_CONF = "join_timeout=300,last_call_timeout=3,close_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=5"


@dataclass
class Node:
    name: str
    spec: RunSpec
    run: RunDir
    proc: subprocess.Popen | None = None  # the torchrun agent
    lines: list[str] = field(default_factory=list)  # the agent's own output
    pump: threading.Thread | None = None


@dataclass
class ElasticRun:
    events: list[dict]  # rank 0's log, in order: start, step and pause events
    references: dict[int, list[float]]  # world size -> losses of an uninterrupted run at that size
    agent_lines: dict[str, list[str]]  # node name -> its agent's output
    exit_codes: dict[str, int | None]
    left: list[int]  # pids of processes of the run still alive after it ended: none
    wall_s: float


@dataclass(frozen=True)
class Segment:
    """One start of the program that trained: at one world size, from one checkpoint."""

    world: int
    resumed_from: int | None  # the checkpoint's step; None: from scratch
    saved_by: int | None  # how many ranks wrote that checkpoint
    restarts: int  # TORCHELASTIC_RESTART_COUNT: the agent's failures so far (membership changes do not count)
    steps: tuple[int, ...]
    losses: tuple[float, ...]


def segments(events: list[dict]) -> list[Segment]:
    """The starts of the program that trained at least one step, in order, from rank 0's log."""
    found: list[Segment] = []
    start: dict | None = None
    steps: list[tuple[int, float]] = []
    for event in [*events, {"event": "start"}]:  # a sentinel closes the last start
        if event["event"] == "start":
            if start is not None and steps:
                found.append(
                    Segment(
                        start["world"],
                        start["step"] if start["saved_by"] else None,
                        start["saved_by"],
                        start["restarts"],
                        tuple(s for s, _ in steps),
                        tuple(loss for _, loss in steps),
                    )
                )
            start, steps = event, []
        elif event["event"] == "step":
            steps.append((event["step"], event["loss"]))
    return found


def agent_messages(lines: list[str]) -> list[str]:
    """What an agent logged about its worker group: its ``[default] ...`` lines and each round's world size."""
    pattern = re.compile(r"\]\s+(\[default\] .*|group_world_size=\d+)$")
    return [m.group(1) for line in lines if (m := pattern.search(line))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _end(nodes: list[Node]) -> list[int]:
    """End both nodes' agents and workers (process group, recorded pids); the pids of any still alive."""
    from course_lib.debugging import processes_of

    for node in nodes:
        if node.proc is not None:
            processes.end_run(node.proc, node.run)
    for node in nodes:
        if node.pump is not None:
            node.pump.join(timeout=10)
    left = [pid for node in nodes for pid in processes_of(str(node.run.path))]
    for node in nodes:
        node.run.remove()
    return left


def read_events(root: Path) -> list[dict]:
    """Rank 0's log so far."""
    return read_json_lines(root / EVENTS)


def read_json_lines(path: Path) -> list[dict]:
    """A log of one JSON object per line, so far (none if absent; a line still being written is skipped)."""
    events = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return events


def _node(index: int, body: str, backend: str, endpoint: str, rdzv_id: str, restarts: int, timeout_s: float) -> Node:
    env = {
        "PET_RDZV_CONF": f"is_host={int(index == 0)},{RDZV_CONF}",  # torchrun reads its flags from PET_*
        "PET_LOCAL_ADDR": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
        "LOGLEVEL": "INFO",  # the agent logs its rendezvous rounds and restarts
    }
    if backend == "nccl":
        env["CUDA_VISIBLE_DEVICES"] = str(index)  # one GPU per node: both nodes' rank has LOCAL_RANK 0
    spec = RunSpec.create(
        nproc=1,
        backend=backend,
        init=False,  # the program joins the group itself, once per round
        timeout=timeout_s,
        max_restarts=restarts,
        nnodes="1:2",
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_id=rdzv_id,
        env=env,
    )
    run = RunDir.create()
    run.cell.write_text(body)
    spec.write(run)
    return Node(f"node {index}", spec, run)


def _start(node: Node, deadline: float) -> None:
    node.proc = proc = processes.start_agent(node.spec, node.run)
    node.pump = threading.Thread(
        target=processes.pump, args=(proc, deadline, lambda line, name: node.lines.append(line)), daemon=True
    )
    node.pump.start()


def _wait(what: str, done: Callable[[], bool], nodes: list[Node], deadline: float) -> None:
    while not done():
        for node in nodes:
            if node.proc is not None and node.proc.poll() is not None:
                tail = "\n".join(node.lines[-30:])
                raise RuntimeError(f"{node.name}'s agent exited while waiting for {what}:\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}: every process was ended")
        time.sleep(0.1)


def _paused(root: Path, step: int, world: int) -> Callable[[], bool]:
    return lambda: any(e["event"] == "pause" and e["step"] == step and e["world"] == world for e in read_events(root))


def run_elastic(
    root: str | Path,
    *,
    total_steps: int = 12,
    pauses: tuple[int, int] = (4, 8),
    backend: str = "gloo",
    max_restarts: int = 3,
    timeout_s: float = 240.0,
) -> ElasticRun:
    """Train on node 0 to `pauses[0]`, add node 1, train to `pauses[1]`, stop node 1, train to the end.

    Raises TimeoutError after `timeout_s` seconds in all (and RuntimeError if an agent exits early), with
    a note listing the processes still alive after every process was ended (none).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = start + timeout_s
    body = (
        "from course_lib.checkpoint import train_elastic\n"
        f"train_elastic({str(root)!r}, {total_steps}, {tuple(pauses)!r}, backend={backend!r})\n"
    )
    endpoint, rdzv_id = f"127.0.0.1:{_free_port()}", f"elastic-{uuid.uuid4().hex[:8]}"
    nodes = [_node(i, body, backend, endpoint, rdzv_id, max_restarts, timeout_s) for i in range(2)]
    first, second = nodes
    try:
        _start(first, deadline)
        _wait(f"node 0 alone to pause at step {pauses[0]}", _paused(root, pauses[0], 1), nodes, deadline)
        _start(second, deadline)
        _wait(f"both nodes to pause at step {pauses[1]}", _paused(root, pauses[1], 2), nodes, deadline)
        assert first.proc is not None and second.proc is not None
        processes.kill_group(second.proc.pid, signal.SIGTERM)  # node 1 leaves, as a preempted node does
        agent = first.proc
        _wait("node 0 to finish", lambda: agent.poll() is not None, [], deadline)
    except BaseException as error:
        for node in nodes:  # what the agents and ranks said, before their run folders go
            error.add_note(f"--- {node.name}'s agent, last lines:\n" + "\n".join(node.lines[-20:]))
            for log in sorted(node.run.logs.glob("*/attempt_*/*/stderr.log")):
                tail = "\n".join(log.read_text().splitlines()[-15:])
                error.add_note(f"--- {node.name}, {log.parent.parent.name}, a rank's stderr:\n{tail}")
        error.add_note(f"processes left behind after ending both nodes: {_end(nodes)}")
        raise
    left = _end(nodes)
    references = {w: json.loads((root / f"reference_{w}.json").read_text()) for w in (1, 2)}
    return ElasticRun(
        events=read_events(root),
        references=references,
        agent_lines={n.name: n.lines for n in nodes},
        exit_codes={n.name: None if n.proc is None else n.proc.returncode for n in nodes},
        left=left,
        wall_s=time.monotonic() - start,
    )
