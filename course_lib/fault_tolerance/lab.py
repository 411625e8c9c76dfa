"""Notebook 07's lab: the elastic run (two torchrun agents, one rendezvous) and the torchft runs, started from the
kernel; the pictures, drawn from what the runs asserted (world sizes, steps, quorums), no timings."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from course_lib.fault_tolerance.elastic import EVENTS
from course_lib.fault_tolerance.replicas import LIGHTHOUSE, QUIET, SYNC_RUNS
from course_lib.launch import processes
from course_lib.launch.spec import RunDir, RunSpec, visible_gpu

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Elastic membership on one machine: two torchrun agents (`--nnodes 1:2`, "nodes") join and leave one c10d
# rendezvous that node 0 hosts; each change restarts the group at the new world size (rank side: train_elastic).
# Everything started here is ended by process group and recorded pid, whatever happens, within a hard timeout.

# Rendezvous settings (torchrun --rdzv-conf): generous to join, quick to drop a dead node and to close a round.
RDZV_CONF = "join_timeout=300,last_call_timeout=3,close_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=5"


@dataclass
class Node:
    name: str
    spec: RunSpec
    run: RunDir
    proc: processes.Agent | None = None  # the torchrun agent
    lines: list[str] = field(default_factory=list)  # the agent's own output
    pump: threading.Thread | None = None

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.exitcode


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
                resumed_from = start["step"] if start["saved_by"] else None
                found.append(Segment(start["world"], resumed_from, start["saved_by"], start["restarts"], *zip(*steps)))
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
    for node in nodes:
        if node.proc is not None:
            processes.end_run(node.proc, node.run)
    for node in nodes:
        if node.pump is not None:
            node.pump.join(timeout=10)
    left = [pid for node in nodes for pid in processes.running(node.run.started())]
    for node in nodes:
        node.run.remove()
    return left


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
        env["CUDA_VISIBLE_DEVICES"] = visible_gpu(index)  # one GPU per node: both nodes' rank has LOCAL_RANK 0
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
    return _prepared(f"node {index}", spec, body)


def _prepared(name: str, spec: RunSpec, body: str) -> Node:
    """A node (a torchrun agent, not started yet) whose ranks will run `body` under `spec`."""
    run = RunDir.create()
    run.cell.write_text(body)
    spec.write(run)
    return Node(name, spec, run)


def _start(node: Node, deadline: float) -> None:
    node.proc = proc = processes.start_agent(node.spec, node.run)
    node.pump = threading.Thread(
        target=processes.pump, args=(proc, deadline, lambda line, name: node.lines.append(line)), daemon=True
    )
    node.pump.start()


def _wait(what: str, done: Callable[[], bool], nodes: list[Node], deadline: float) -> None:
    while not done():
        for node in nodes:
            if node.proc is not None and node.proc.exitcode is not None:
                tail = "\n".join(node.lines[-30:])
                raise RuntimeError(f"{node.name}'s agent exited while waiting for {what}:\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}: every process was ended")
        time.sleep(0.1)


def _finish(nodes: list[Node], deadline: float) -> None:
    """Wait until every node's agent has exited; raise if one failed."""
    finished = lambda: all(n.proc is not None and n.proc.exitcode is not None for n in nodes)
    _wait(f"{', '.join(n.name for n in nodes)} to finish", finished, [], deadline)
    codes = {n.name: n.exit_code for n in nodes}
    if any(codes.values()):
        raise RuntimeError(f"a run failed: exit codes {codes}")


def _add_notes(error: BaseException, nodes: list[Node], ended: str) -> None:
    """Attach each agent's and rank's last output before their run folders are deleted, then end every node."""
    for node in nodes:
        error.add_note(f"--- {node.name}'s agent, last lines:\n" + "\n".join(node.lines[-20:]))
        for log in sorted(node.run.logs.glob("*/attempt_*/*/stderr.log")):
            tail = "\n".join(log.read_text().splitlines()[-15:])
            error.add_note(f"--- {node.name}, {log.parent.parent.name}, a rank's stderr:\n{tail}")
    error.add_note(f"processes left behind after ending {ended}: {_end(nodes)}")


def _begin(root: str | os.PathLike, timeout_s: float) -> tuple[Path, float, float]:
    """`root`, made if absent; the time now and the deadline `timeout_s` from now (time.monotonic)."""
    Path(root).mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    return Path(root), start, start + timeout_s


def _paused(root: Path, step: int, world: int) -> Callable[[], bool]:
    log = root / EVENTS
    return lambda: any(e["event"] == "pause" and (e["step"], e["world"]) == (step, world) for e in read_json_lines(log))


def run_elastic(
    root: str | Path,
    *,
    total_steps: int = 12,
    pauses: tuple[int, int] = (4, 8),
    backend: str = "gloo",
    max_restarts: int = 3,
    timeout_s: float = 240.0,
) -> ElasticRun:
    """Train on node 0 to `pauses[0]`, add node 1, train to `pauses[1]`, stop node 1, train to the end."""
    root, start, deadline = _begin(root, timeout_s)
    body = (
        "from course_lib.fault_tolerance import train_elastic\n"
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
        _wait("node 0 to finish", lambda: agent.exitcode is not None, [], deadline)
    except BaseException as error:
        _add_notes(error, nodes, "both nodes")
        raise
    left = _end(nodes)
    references = {w: json.loads((root / f"reference_{w}.json").read_text()) for w in (1, 2)}
    return ElasticRun(
        events=read_json_lines(root / EVENTS),
        references=references,
        agent_lines={n.name: n.lines for n in nodes},
        exit_codes={n.name: n.exit_code for n in nodes},
        left=left,
        wall_s=time.monotonic() - start,
    )


# Replica groups started from the kernel with the machinery above: one one-rank torchrun run each, and torchft's
# lighthouse in this process (a Rust thread). run_torchft is the failure run, compare_sync the synchronisation runs.


@dataclass
class TorchftRun:
    events: dict[str, list[dict]]  # "replica 0", "replica 1", "replica 1 again" -> its log, in order
    weights: dict[str, dict[str, torch.Tensor]]  # "replica 0", "replica 1" -> final weights
    killed_at: float  # time.time() of the kill
    exit_codes: dict[str, int | None]
    left: list[int]  # pids of processes of the run still alive after it ended: none
    wall_s: float


def _replica(name: str, call: str, timeout_s: float) -> Node:
    """One replica group running replicas.`call`: a one-rank torchrun run, gloo on the CPU (ProcessGroupGloo)."""
    body = f"from course_lib.fault_tolerance import replicas\nreplicas.{call}\n"
    return _prepared(name, RunSpec.create(nproc=1, backend="gloo", init=False, timeout=timeout_s, env=QUIET), body)


def _lighthouse() -> tuple[Any, str]:
    """A lighthouse server in this process (a Rust thread) on loopback, and its address."""
    # torchft's Rust side reads RUST_LOG when a server starts and logs every quorum at INFO by default
    os.environ.setdefault("RUST_LOG", "error")
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", **LIGHTHOUSE)
    port = server.address().rsplit(":", 1)[1]  # it advertises the host's name; the replicas dial loopback
    return server, f"http://127.0.0.1:{port}"


def run_torchft(
    root: str | os.PathLike,
    *,
    total_steps: int = 14,
    kill_at: int = 6,
    rejoin_at: int = 10,
    timeout_s: float = 120.0,
) -> TorchftRun:
    """Kill replica 1 before `kill_at`, restart it to heal from replica 0 at `rejoin_at`, then both to `total_steps`."""
    root, start, deadline = _begin(root, timeout_s)
    lighthouse, address = _lighthouse()
    call = lambda r, extra: (
        f"train_replica({str(root)!r}, {r}, {address!r}, {total_steps}, limit_s={timeout_s}, {extra})"
    )
    first = _replica("replica 0", call(0, f"wait_for_rejoin_at={rejoin_at}"), timeout_s)
    second = _replica("replica 1", call(1, f"pause_at={kill_at}"), timeout_s)
    again = _replica("replica 1 again", call(1, "rejoining=True"), timeout_s)
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
        second.proc.join(30)  # its torchrun agent sees the worker die and exits
        alone = lambda: any(e["event"] == "step" and e["step"] == kill_at for e in read_json_lines(log0))
        _wait(f"replica 0 to commit step {kill_at} alone", alone, [first], deadline)
        log1.rename(root / "replica_1_first.jsonl")
        _start(again, deadline)
        _finish([first, again], deadline)
    except BaseException as error:
        _add_notes(error, nodes, "every replica")
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
        exit_codes={n.name: n.exit_code for n in nodes},
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
    root, _, deadline = _begin(root, timeout_s)
    started = {name: _lighthouse() for name in SYNC_RUNS}
    addresses = {name: address for name, (_, address) in started.items()}
    call = lambda r: f"train_synced({str(root)!r}, {r}, {addresses!r}, {steps}, limit_s={timeout_s})"
    nodes = [_replica(f"replica {r}", call(r), timeout_s) for r in (0, 1)]
    try:
        for node in nodes:
            _start(node, deadline)
        _finish(nodes, deadline)
    except BaseException as error:
        _add_notes(error, nodes, "every replica")
        raise
    finally:
        for server, _ in started.values():
            server.shutdown()
    left = _end(nodes)
    records = [json.loads((root / f"synced_{r}.json").read_text()) for r in (0, 1)]
    return SyncComparison(records[0], steps, records[0] == records[1], left)


def draw_rendezvous_rounds(worlds: Sequence[int], steps: Sequence[tuple[int, int]]) -> None:
    """One column per rendezvous round: admitted agents and worker ranks, steps trained, and what closed the round."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    fig, ax = plt.subplots(figsize=(11, 3.2))
    why = [
        "node 0 alone: MIN = 1 reached,\nround closes after last_call",
        "node 1 registers: node 0's agent\nrestarts its workers (no retry)",
        "node 1's agent stops (SIGTERM):\ncollectives fail (a retry)",
    ]
    for i, (world, (first, last)) in enumerate(zip(worlds, steps)):
        x = 3.6 * i
        ax.text(x + 1.4, 2.55, f"round {i + 1}: world size {world}", ha="center", fontweight="bold", fontsize=9)
        ax.text(x + 1.4, 2.2, f"steps {first}-{last}", ha="center", fontsize=8)
        for node in (0, 1):
            y = 1.2 - 0.9 * node
            inside = node < world
            box = FancyBboxPatch(
                (x, y),
                2.8,
                0.6,
                boxstyle="round,pad=0.03",
                linestyle="-" if inside else ":",
                facecolor="tab:blue" if node == 0 else "tab:orange",
                alpha=0.8 if inside else 0.08,
            )
            ax.add_patch(box)
            label = f"node {node}: agent + rank {node}" if inside else f"node {node}: not in this round"
            ax.text(x + 1.4, y + 0.3, label, ha="center", va="center", fontsize=8)
        ax.text(x + 1.4, -0.45, why[i] if i < len(why) else "", ha="center", va="top", fontsize=7.5, color="dimgray")
        if i:
            ax.annotate("", xy=(x - 0.05, 1.0), xytext=(x - 0.75, 1.0), arrowprops={"arrowstyle": "->"})
    ax.set(xlim=(-0.2, 3.6 * len(worlds)), ylim=(-1.3, 2.8))
    ax.axis("off")
    ax.set_title(
        "the c10d rendezvous: each round admits the agents present, numbers the workers, and starts them", fontsize=9
    )
    plt.tight_layout()
    plt.show()


def draw_replica_groups(quorum: dict[int, int], killed_at: int, healed_at: int) -> None:
    """torchft's traffic (lighthouse, managers, all-reduce, healing), and the quorum's size at each step."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.2), gridspec_kw={"width_ratios": [3, 2]})
    boxes = {
        "lighthouse": (1.5, 2.3),
        "replica group 0\nManager + DDP": (0.2, 0.4),
        "replica group 1\nManager + DDP": (2.8, 0.4),
    }
    for text, (x, y) in boxes.items():
        color = "lightgray" if text == "lighthouse" else ("tab:blue" if "0" in text else "tab:orange")
        left.text(
            x,
            y,
            text,
            ha="center",
            va="center",
            fontsize=8,
            bbox={"boxstyle": "round", "facecolor": color, "alpha": 0.5},
        )
    for x in (0.2, 2.8):
        left.annotate("", xy=(1.5, 2.05), xytext=(x, 0.75), arrowprops={"arrowstyle": "<->", "color": "gray"})
    left.text(0.55, 1.55, "heartbeat every 100 ms;\nquorum request per step", fontsize=7, color="gray", ha="center")
    left.annotate("", xy=(2.1, 0.3), xytext=(0.9, 0.3), arrowprops={"arrowstyle": "<->", "color": "tab:green"})
    left.text(
        1.5, 0.05, "all-reduce of gradients\n(the quorum's process group)", ha="center", fontsize=7, color="tab:green"
    )
    left.annotate(
        "", xy=(2.1, 0.65), xytext=(0.9, 0.65), arrowprops={"arrowstyle": "->", "color": "tab:red", "linestyle": "--"}
    )
    left.text(1.5, 0.8, "heal: state from a peer", ha="center", fontsize=7, color="tab:red")
    left.set(xlim=(-0.6, 3.6), ylim=(-0.4, 2.7))
    left.axis("off")
    steps = sorted(quorum)
    right.step(steps, [quorum[s] for s in steps], where="mid", color="tab:blue")
    right.axvline(killed_at - 0.5, color="red", linestyle=":", label=f"replica 1 killed before step {killed_at}")
    right.axvline(healed_at, color="tab:green", linestyle="--", label=f"new replica 1 heals at step {healed_at}")
    right.set(
        xlabel="step",
        ylabel="replica groups in the quorum",
        yticks=[1, 2],
        ylim=(0.5, 2.5),
        title="the quorum, step by step",
    )
    right.legend(fontsize=7, loc="lower left")
    plt.tight_layout()
    plt.show()


def plot_elastic(segments: list[Segment], references: dict[int, list[float]]) -> Figure:
    """Each start's losses (colour = world size) over the uninterrupted runs at each world size."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3))
    styles = {1: ("tab:blue", "-"), 2: ("tab:orange", "--")}
    for world, losses in sorted(references.items()):
        color, line = styles.get(world, ("gray", ":"))
        ax.plot(range(len(losses)), losses, line, color=color, alpha=0.5, label=f"uninterrupted, {world} rank(s)")
    for i, segment in enumerate(segments):
        color, _ = styles.get(segment.world, ("gray", ":"))
        ax.plot(segment.steps, segment.losses, "o", color=color, label=f"elastic, {segment.world} rank(s)")
        if i:
            ax.axvline(segment.steps[0] - 0.5, color="gray", linestyle=":", linewidth=1)
            change = "joins" if segment.world > segments[i - 1].world else "leaves"
            ax.text(segment.steps[0] - 0.4, max(segment.losses), f"node 1 {change}", fontsize=8, va="top")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set(xlabel="step", ylabel="loss (global batch)", title="one loss curve across two membership changes")
    fig.tight_layout()
    return fig
