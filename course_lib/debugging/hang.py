"""A hang diagnosed from outside: every rank's stacks, then the flight recorder's buffer of its last collectives."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from course_lib.debugging.stacks import ThreadStack, dump_stack, main_thread
from course_lib.launch.processes import running

# Entries kept per process group. NCCL reads it too; its older name, TORCH_NCCL_TRACE_BUFFER_SIZE, still works
# in torch 2.13 and prints a deprecation warning.
BUFFER_VARIABLES = {"TORCH_FR_BUFFER_SIZE": "2000"}


def flight_recorder_dump(backend: str) -> bytes:
    """This process's flight-recorder buffer as a pickle (NCCL keeps its own recorder, gloo the generic one)."""
    import torch._C._distributed_c10d as c10d

    if "nccl" in backend:  # "nccl", or the course's "cpu:gloo,cuda:nccl"
        return c10d._dump_nccl_trace()  # type: ignore[attr-defined]  # CUDA builds only
    return c10d._dump_fr_trace()  # type: ignore[attr-defined]  # not in torch's stubs


def dump_when_asked(directory: str | os.PathLike, rank: int, backend: str) -> threading.Thread:
    """Start a thread that writes this rank's buffer to DIRECTORY/rank_<rank> once DIRECTORY/dump exists."""
    directory = Path(directory)

    def wait_then_dump() -> None:
        flight_recorder_dump(backend)  # the first dump takes seconds (stack symbolization): pay it now
        while not (directory / "dump").exists():
            time.sleep(0.05)
        partial = directory / f".rank_{rank}"
        partial.write_bytes(flight_recorder_dump(backend))
        partial.rename(directory / f"rank_{rank}")  # complete or absent

    thread = threading.Thread(target=wait_then_dump, name="flight-recorder-dump", daemon=True)
    thread.start()
    return thread


@dataclass(frozen=True)
class FlightRecord:
    """One rank's dump: the default group's counters and its collectives, oldest first."""

    rank: int
    last_enqueued: int  # sequence number of the last collective this rank issued
    last_completed: int  # ... and of the last one it saw finish
    entries: tuple[dict[str, Any], ...]

    def describe(self, seq: int, program: str = "cell.py") -> str:
        """``#3 gloo:all_reduce of [4] from train (cell line 13)``, or that this rank never issued #seq."""
        for entry in self.entries:
            if entry["collective_seq_id"] == seq:
                sizes = ", ".join(str(s) for s in entry["input_sizes"])
                mine = [f for f in entry.get("frames", []) if Path(f["filename"]).name == program]
                where = f" from {mine[0]['name']} (cell line {mine[0]['line']})" if mine else ""
                return f"#{seq} {entry['profiling_name']} of {sizes}{where}"
        return f"never issued #{seq}"


def read_flight_records(
    directory: str | os.PathLike, prefix: str = "rank_", group: str = "0"
) -> dict[int, FlightRecord]:
    """Every PREFIX<rank> dump in `directory`, by rank: the collectives of one process group."""
    records = {}
    for path in sorted(Path(directory).glob(f"{prefix}*")):
        suffix = path.name[len(prefix) :]
        if not suffix.isdigit():
            continue
        dump = pickle.loads(path.read_bytes())
        entries = tuple(e for e in dump.get("entries", []) if str(e["process_group"][0]) == group)
        status = dump.get("pg_status", {}).get(group, {})
        issued = [e["collective_seq_id"] for e in entries]
        records[int(suffix)] = FlightRecord(
            rank=int(suffix),
            last_enqueued=int(status.get("last_enqueued_collective", max(issued, default=0))),
            last_completed=int(status.get("last_completed_collective", -1)),
            entries=entries,
        )
    return records


def arm_for_diagnosis(directory: str | os.PathLike) -> None:
    """Rank side, first thing in the program: leave this rank's pid, and dump the flight recorder when asked."""
    import torch.distributed as dist

    rank = dist.get_rank()
    dump_when_asked(directory, rank, dist.get_backend())
    partial = Path(directory) / f".pid_{rank}"
    partial.write_text(str(os.getpid()))
    partial.rename(Path(directory) / f"pid_{rank}")  # complete or absent
    print(f"diagnosis: rank {rank} pid {os.getpid()}", flush=True)  # any line makes the kernel look


@dataclass
class HangDiagnosis:
    stacks: dict[int, ThreadStack]  # each rank's main thread once the stacks stopped moving
    rounds: int  # rounds of py-spy dumps until two in a row agreed
    flight: dict[int, FlightRecord]  # each rank's flight-recorder dump
    left: list[int]  # pids of the run's processes still alive after it was ended
    output: list[str] = field(default_factory=list)  # what the ranks printed


class _Diagnosed(Exception):
    """Raised from the output callback once the evidence is in: the launcher then ends every process."""


def settled_stacks(
    pids: dict[int, int], deadline: float, pause_s: float = 0.5, still_s: float | None = None
) -> tuple[dict[int, ThreadStack], int]:
    """Dump every rank's main thread until two rounds agree and every rank is idle; (stacks, rounds).

    With `still_s`, a rank that is not idle counts too once its stack has not moved for `still_s` seconds: a
    rank whose host waits for a GPU spins (CUDA's default while a process has fewer contexts than cores), so
    py-spy sees it running, but its frames stay where they are.
    """
    previous: dict[int, ThreadStack] | None = None
    since: dict[int, float] = {}  # when each rank's current stack was first seen
    rounds = 0
    while True:
        now = time.monotonic()
        stacks = {rank: main_thread(dump_stack(pid)) for rank, pid in sorted(pids.items())}
        rounds += 1
        for r, stack in stacks.items():
            if previous is None or stack.shape() != previous[r].shape():
                since[r] = now
        agree = previous is not None and all(stacks[r].shape() == previous[r].shape() for r in stacks)
        still = all(s.idle or (still_s is not None and now - since[r] >= still_s) for r, s in stacks.items())
        if agree and still:
            return stacks, rounds
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ranks' stacks still change after {rounds} dumps: slow, not stuck?")
        previous = stacks
        time.sleep(pause_s)


def diagnose_hang(
    body: str,
    nproc: int,
    *,
    backend: str = "auto",
    push: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 180.0,
) -> HangDiagnosis:
    """Run `body` (which calls ``arm_for_diagnosis(DIAGNOSIS_DIR)`` first, then hangs) and diagnose it."""
    from course_lib.launch import launch
    from course_lib.launch.spec import backend_for

    directory = Path(tempfile.mkdtemp(prefix="hang-diagnosis-"))
    # The stacks must settle well before the process-group timeout (the run's timeout less 10 s), at which NCCL's
    # watchdog ends a stuck collective, and its process with it.
    deadline = time.monotonic() + 0.8 * timeout
    # Under NCCL a rank waiting for its all-reduce spins in the CUDA driver: still for 3 s, not idle, means stuck.
    still_s = 3.0 if backend_for(nproc, backend) == "nccl" else None
    pids: dict[int, int] = {}
    found: dict[str, Any] = {}
    output: list[str] = []

    def on_output(text: str, stream: str) -> None:
        output.append(text)
        # The pid files, not the lines: torchrun's --tee may hand over a line in two pieces.
        pids.update({int(p.name[4:]): int(p.read_text()) for p in directory.glob("pid_*")})
        if len(pids) < nproc or found:
            return
        found["stacks"], found["rounds"] = settled_stacks(pids, deadline, still_s=still_s)
        (directory / "dump").touch()
        while len(list(directory.glob("rank_*"))) < nproc:
            if time.monotonic() > deadline:
                raise TimeoutError("not every rank wrote its flight-recorder dump")
            time.sleep(0.05)
        raise _Diagnosed

    try:
        launch(
            body,
            nproc,
            backend=backend,
            push={**(push or {}), "DIAGNOSIS_DIR": str(directory)},
            env={**BUFFER_VARIABLES, **(env or {})},
            stream=True,
            write=on_output,
            timeout=timeout,
        )
    except _Diagnosed:
        pass
    else:
        raise RuntimeError("the program finished: there was no hang to diagnose")
    finally:
        flight = read_flight_records(directory)
        shutil.rmtree(directory, ignore_errors=True)
    return HangDiagnosis(found["stacks"], found["rounds"], flight, running(list(pids.values())), output)
