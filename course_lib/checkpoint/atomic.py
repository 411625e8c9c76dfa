"""What makes a checkpoint complete or absent, shared by every saver and by the integrity checks."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist

FORMAT = "course_lib.checkpoint/2"  # 2: raw rows with a CRC-32 each, objects.pt
METADATA = "metadata.json"
OBJECTS = "objects.pt"  # the Python values of a state (rank 0 writes them; every loading rank reads them)
STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the problem."""


def _rank_world(no_dist: bool = False) -> tuple[int, int]:
    """(rank, world size), or (0, 1) outside a process group."""
    if not no_dist and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier(no_dist: bool = False) -> None:
    if not no_dist and dist.is_available() and dist.is_initialized():
        dist.barrier()


def _commit(partial: Path, final: Path) -> None:
    """Rank 0 makes a finished checkpoint visible: one rename, then the directory entry is made durable."""
    os.replace(partial, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prepare(root: Path, step: int, no_dist: bool = False) -> tuple[Path, Path]:
    """(step_N.tmp, step_N): a fresh empty step_N.tmp on every rank's view; step_N is never overwritten."""
    final, partial = root / f"step_{step}", root / f"step_{step}.tmp"
    if final.exists():
        raise CheckpointError(f"{final.name}: already exists; a checkpoint is never overwritten")
    rank, _ = _rank_world(no_dist)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # the leftovers of a save that died
        partial.mkdir(parents=True)
    _barrier(no_dist)
    return partial, final


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
