"""A sharded checkpointer from scratch: each rank writes its rows, rank 0 the metadata, any world size loads."""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from course_lib.checkpoint.atomic import (
    FORMAT,
    METADATA,
    OBJECTS,
    CheckpointError,
    _barrier,
    _commit,
    _prepare,
    _rank_world,
    _sha256,
    verify,
)
from course_lib.checkpoint.raw_rows import read_rows, read_whole, row_bytes, write_rows


def shard_rows(n_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) that `rank` holds when `n_rows` are split over `world_size` ranks.

    torch.chunk's rule, which FSDP2's Shard(0) follows: ceil(n/W) rows per rank, the last ranks get
    fewer (possibly none)."""
    per_rank = -(-n_rows // world_size)
    start = min(rank * per_rank, n_rows)
    return start, min(start + per_rank, n_rows)


def read_plan(n_rows: int, saved_world: int, loading_world: int) -> list[list[tuple[int, int, int]]]:
    """For each loading rank: the (saved rank, start, stop) row ranges it must read to rebuild its shard."""
    plan = []
    for loading_rank in range(loading_world):
        start, stop = shard_rows(n_rows, loading_world, loading_rank)
        reads = []
        for saved_rank in range(saved_world):
            s, e = shard_rows(n_rows, saved_world, saved_rank)
            lo, hi = max(start, s), min(stop, e)
            if lo < hi:
                reads.append((saved_rank, lo, hi))
        plan.append(reads)
    return plan


def bytes_to_read(directory: str | os.PathLike, loading_world: int) -> list[dict[str, int]]:
    """Bytes each loading rank must read (rows, replicated, header), from metadata alone: load_sharded's must match."""
    directory = Path(directory)
    tensors = json.loads((directory / METADATA).read_text())["tensors"].values()
    header = (directory / METADATA).stat().st_size + (directory / OBJECTS).stat().st_size

    def rows_and_width(entry: dict[str, Any]) -> tuple[int, int]:
        return (entry["shape"][0] if entry["shape"] else 1), row_bytes(entry["shape"], getattr(torch, entry["dtype"]))

    replicated = sum(n * width for n, width in map(rows_and_width, (e for e in tensors if not e["sharded"])))
    sharded = [rows_and_width(e) for e in tensors if e["sharded"]]
    held = [
        sum(width * (stop - start) for n, width in sharded for start, stop in [shard_rows(n, loading_world, r)])
        for r in range(loading_world)
    ]
    return [{"rows": rows, "replicated": replicated, "header": header} for rows in held]


def _flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"model": {"0.weight": t}} -> {"model/0.weight": t}; anything that is not a dict is a leaf."""
    flat = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, name + "/"))
        else:
            flat[name] = value
    return flat


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def _materialize(state: dict[str, Any]) -> dict[str, Any]:
    """Stateful objects become their state_dict (as DCP does)."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}


def save_sharded(root: str | os.PathLike, step: int, state: dict[str, Any], *, no_dist: bool = False) -> Path:
    """Save `state` (nested dicts of DTensors sharded on dim 0, plain tensors and Python values) as step_N."""
    from torch.distributed.tensor import DTensor

    rank, world_size = _rank_world(no_dist)
    partial, final = _prepare(Path(root), step, no_dist)
    objects: dict[str, Any] = {}
    entries: dict[str, dict[str, Any]] = {}
    mine: dict[str, dict[str, Any]] = {}  # name -> this rank's chunk: offset and row checksums
    shard = partial / f"shard_{rank}.bin"
    with open(shard, "wb") as f:
        for name, value in _flatten(_materialize(state)).items():
            if isinstance(value, DTensor):
                start, stop = shard_rows(value.shape[0], world_size, rank)
                local = value.to_local()
                if local.shape[0] != stop - start:
                    raise CheckpointError(
                        f"{name}: rank {rank} holds {local.shape[0]} rows, expected {stop - start} "
                        "(only dim-0 sharding over the whole world is supported)"
                    )
                mine[name] = write_rows(f, local)
                holders = range(world_size)
            elif isinstance(value, torch.Tensor):
                if rank == 0:
                    mine[name] = write_rows(f, value, whole=True)  # every loading rank reads it whole
                holders = range(1)
            else:
                objects[name] = value
                continue
            rows = value.shape[0] if value.dim() else 1
            spans = [(r, shard_rows(rows, len(holders), r)) for r in holders]
            entries[name] = {
                "shape": list(value.shape),
                "dtype": str(value.dtype).removeprefix("torch."),
                "sharded": isinstance(value, DTensor),  # False: every loading rank reads it whole
                "chunks": [{"file": f"shard_{r}.bin", "rows": list(span)} for r, span in spans if span[0] < span[1]],
            }
        f.flush()
        os.fsync(f.fileno())  # on disk before the commit can claim it is
    if rank == 0:
        torch.save(objects, partial / OBJECTS)
    gathered: list[Any] = [None] * world_size
    info = (shard.name, shard.stat().st_size, _sha256(shard), mine)
    if world_size > 1:
        dist.all_gather_object(gathered, info)
    else:
        gathered = [info]
    if rank == 0:
        gathered.append((OBJECTS, (partial / OBJECTS).stat().st_size, _sha256(partial / OBJECTS), {}))
        for file, _, _, chunks in gathered:
            for name, chunk in chunks.items():  # a rank that holds no rows of a tensor has no chunk of it
                for listed in (c for c in entries[name]["chunks"] if c["file"] == file):
                    listed.update(chunk)
        metadata = {
            "format": FORMAT,
            "step": step,
            "world_size": world_size,
            "files": {file: {"bytes": size, "sha256": sha} for file, size, sha, _ in gathered},
            "tensors": entries,
        }
        (partial / METADATA).write_text(json.dumps(metadata, indent=1))  # the last file of the checkpoint
        _commit(partial, final)
    _barrier(no_dist)
    return final


def read_my_rows(
    directory: Path, entry: dict[str, Any], local: torch.Tensor, start: int, stop: int, counter: list[int]
) -> list[str]:
    """Fill `local`, this rank's rows [start, stop) of one tensor, from the saved chunks that overlap them; return
    the files read. A file that holds none of these rows is never opened."""
    files = []
    for chunk in entry["chunks"]:  # {"file": "shard_1.bin", "rows": [32, 64], "offset": ..., "crc32": [...]}
        lo, hi = max(start, chunk["rows"][0]), min(stop, chunk["rows"][1])
        if lo >= hi:
            continue
        rows = read_rows(directory, chunk, entry, lo, hi, counter)  # one seek, one read, a CRC-32 check per row
        if local.dim() == 0:
            local.copy_(rows)
        else:
            local[lo - start : hi - start].copy_(rows)
        files.append(chunk["file"])
    return files


@dataclass
class Loaded:
    """What one rank read: per tensor the files it read rows from, and the bytes it read in all."""

    files: dict[str, list[str]]
    bytes_read: int
    row_bytes: int


def load_sharded(directory: str | os.PathLike, state: dict[str, Any]) -> Loaded:
    """Fill `state` (same structure as when saved, at *any* world size) from a checkpoint, in place."""
    from torch.distributed.tensor import DTensor

    directory = Path(directory)
    counter = [0]
    metadata = _read_metadata(directory, counter)
    rank, world_size = _rank_world()
    objects_file = read_whole(directory / OBJECTS, counter)
    if hashlib.sha256(objects_file).hexdigest() != metadata["files"][OBJECTS]["sha256"]:
        raise CheckpointError(f"{directory.name}/{OBJECTS}: corrupt: SHA-256 differs from the metadata")
    objects = torch.load(io.BytesIO(objects_file), weights_only=True)
    header = counter[0]
    flat = _flatten(_materialize(state))
    for key, value in state.items():
        for name in getattr(value, "OPTIONAL", ()):  # values a checkpoint may lack (AppState: "cuda_rng")
            path = f"{key}/{name}"
            if path in flat and path not in objects and path not in metadata["tensors"]:
                del flat[path]
    missing = [n for n, t in flat.items() if isinstance(t, torch.Tensor) and n not in metadata["tensors"]]
    if missing:
        raise CheckpointError(
            f"{directory.name}: has no tensor {missing[0]!r} ({len(missing)} of this model's "
            f"tensors missing): a checkpoint from a different model"
        )
    files_read: dict[str, list[str]] = {}
    for name, target in flat.items():
        if not isinstance(target, torch.Tensor):
            if name not in objects:
                raise CheckpointError(f"{directory.name}: has no value {name!r}: saved from a different program?")
            flat[name] = objects[name]
            continue
        entry = metadata["tensors"][name]
        if entry["shape"] != list(target.shape):
            raise CheckpointError(
                f"{directory.name}: {name!r} was saved with shape {entry['shape']}, "
                f"this model has {list(target.shape)}: a checkpoint from a different model"
            )
        if entry["dtype"] != str(target.dtype).removeprefix("torch."):
            raise CheckpointError(
                f"{directory.name}: {name!r} was saved as {entry['dtype']}, this model has {target.dtype}"
            )
        if isinstance(target, DTensor):
            start, stop = shard_rows(target.shape[0], world_size, rank)
            local = target.to_local()
        else:
            start, stop = 0, (target.shape[0] if target.dim() else 1)
            local = target
        files_read[name] = read_my_rows(directory, entry, local, start, stop, counter)
    loaded = _unflatten(flat)
    for key, value in state.items():
        if isinstance(value, Stateful):
            value.load_state_dict(loaded[key])
        else:
            state[key] = loaded[key]
    return Loaded(files=files_read, bytes_read=counter[0], row_bytes=counter[0] - header)


def _read_metadata(directory: Path, counter: list[int]) -> dict[str, Any]:
    """metadata.json of a committed checkpoint of ours, and the sizes of the files it lists (stat only)."""
    if directory.name.endswith(".tmp") or not (directory / METADATA).exists():
        verify(directory)  # raises the message for a missing, uncommitted or unfinished checkpoint
        raise CheckpointError(f"{directory.name}: a DCP checkpoint; load it with dcp.load")
    try:
        metadata = json.loads(read_whole(directory / METADATA, counter))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{directory.name}/{METADATA}: unreadable ({error})") from None
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{directory.name}/{METADATA}: format {metadata.get('format')!r}, expected {FORMAT!r}")
    for file, expected in metadata["files"].items():
        size = (directory / file).stat().st_size if (directory / file).exists() else None
        if size != expected["bytes"]:
            raise CheckpointError(f"{directory.name}/{file}: {size} bytes, metadata records {expected['bytes']}")
    return metadata


def flat_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a nested state, by flattened name ("model/0.weight")."""
    return {k: v for k, v in _flatten(state).items() if isinstance(v, torch.Tensor)}
