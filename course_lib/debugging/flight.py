"""The flight recorder: each rank's ring buffer of its last collectives, dumped and read back."""

from __future__ import annotations

import os
import pickle
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
