"""Is a checkpoint complete? And which one to resume from."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from course_lib.checkpoint.atomic import FORMAT, METADATA, STEP_DIR, CheckpointError, _sha256


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
    """The newest committed checkpoint under `root` that passes :func:`verify`, and what was skipped (why).
    Newest by step number (string order puts step_9 after step_10); a corrupt one is skipped, so the job falls back."""
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
