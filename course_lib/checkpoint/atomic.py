"""Complete-or-absent checkpoints for every saver, integrity checks, which to resume, and rank 0's full-state save."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
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


def save_full_snapshot(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> None:
    """Gather the full model and optimizer state onto rank 0 and write one torch.save file there.

    Every rank takes part in the gather; only rank 0 holds the result (cpu_offload) and writes it,
    to a temporary name first, so a crash never leaves a half-written file under the real name.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    rank, _ = _rank_world()
    if rank == 0:
        path = Path(path)
        partial = path.with_name(path.name + ".tmp")
        torch.save({"model": model_state, "optimizer": optimizer_state, "step": step}, partial)
        os.replace(partial, path)  # atomic: the old file or the new one, never half of one
    _barrier()  # nobody goes on (or exits) before the file is complete


def load_full_snapshot(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Every rank reads the full file and keeps its own shard (set_state_dict reshards). Returns the step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    snapshot = torch.load(path, map_location="cpu", weights_only=True)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=snapshot["model"],
        optim_state_dict=snapshot["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    return snapshot["step"]


def verify(directory: str | os.PathLike) -> dict[str, Any]:
    """Raise CheckpointError unless `directory` is a complete checkpoint (ours or DCP's); return its metadata.

    Ours: metadata.json present, every file it lists present with the recorded size and SHA-256.
    DCP's: .metadata present and every .distcp file at least as long as the byte ranges it indexes.
    """
    directory = Path(directory)
    name = directory.name
    if not directory.is_dir():
        raise CheckpointError(f"{name}: no such checkpoint directory")
    if name.endswith(".tmp"):
        raise CheckpointError(f"{name}: an uncommitted save (its job died before the rename)")
    if (directory / ".metadata").exists() and not (directory / METADATA).exists():
        return _verify_dcp(directory)
    meta_path = directory / METADATA
    if not meta_path.exists():
        raise CheckpointError(f"{name}/{METADATA}: missing; the save did not finish")
    try:
        metadata = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{name}/{METADATA}: unreadable ({error})") from None
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{name}/{METADATA}: format {metadata.get('format')!r}, expected {FORMAT!r}")
    for file, expected in metadata["files"].items():
        path = directory / file
        if not path.exists():
            raise CheckpointError(f"{name}/{file}: missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"{name}/{file}: truncated or overwritten: {size} bytes, metadata records {expected['bytes']}"
            )
        if _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"{name}/{file}: corrupt: SHA-256 differs from the metadata")
    return metadata


def _verify_dcp(directory: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except Exception as error:
        raise CheckpointError(f"{directory.name}/.metadata: unreadable ({type(error).__name__})") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for file, size in sorted(needed.items()):
        path = directory / file
        if not path.exists():
            raise CheckpointError(f"{directory.name}/{file}: missing")
        if path.stat().st_size < size:
            raise CheckpointError(
                f"{directory.name}/{file}: truncated: {path.stat().st_size} bytes, the metadata indexes {size}"
            )
    return {"format": "dcp", "files": {f: {"bytes": s} for f, s in needed.items()}}


def files_of(directory: str | os.PathLike) -> list[tuple[str, int]]:
    """(relative name, bytes) of every file in a checkpoint directory, sorted."""
    directory = Path(directory)
    return sorted((str(p.relative_to(directory)), p.stat().st_size) for p in directory.rglob("*") if p.is_file())


def latest_complete(root: str | os.PathLike) -> tuple[Path | None, list[tuple[str, str]]]:
    """Newest verified checkpoint by step number (as strings step_9 > step_10), and what was skipped and why."""
    root = Path(root)
    if not root.is_dir():
        return None, []
    candidates = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))), reverse=True)
    skipped = [(p.name, "uncommitted") for p in sorted(root.glob("step_*.tmp"))]
    for _, path in candidates:
        try:
            verify(path)
            return path, skipped
        except CheckpointError as error:
            skipped.append((path.name, str(error)))
    return None, skipped
