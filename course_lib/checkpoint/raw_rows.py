"""Our checkpointer's shard files: rows of raw tensor bytes, a CRC-32 per row, as a rank checks only rows it reads."""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import torch

from course_lib.checkpoint.atomic import CheckpointError


def row_bytes(shape: list[int] | torch.Size, dtype: torch.dtype) -> int:
    """Bytes of one row (dim 0) of a tensor; a 0-dim tensor is one row of one element."""
    elements = 1
    for size in list(shape)[1:]:
        elements *= size
    return elements * torch.tensor([], dtype=dtype).element_size()


def write_rows(file: BinaryIO, tensor: torch.Tensor, *, whole: bool = False) -> dict[str, Any]:
    """Append `tensor`'s bytes to `file`; its byte offset there and the CRC-32 of each row.

    `whole`: one CRC-32 for the whole tensor, for a tensor every loading rank reads whole (a 1-D RNG
    state of 5056 bytes would otherwise need 5056 checksums).
    """
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    rows = tensor.shape[0] if tensor.dim() else 1
    block = rows if whole else 1  # rows per checksum
    width = row_bytes(tensor.shape, tensor.dtype) * block
    offset = file.tell()
    file.write(data)
    crcs = "".join(f"{zlib.crc32(data[i : i + width]):08x}" for i in range(0, len(data), width)) if width else ""
    return {"offset": offset, "rows_per_crc": block, "crc32": crcs}  # 8 hex digits per block, one string


def read_rows(
    directory: Path, chunk: dict[str, Any], entry: dict[str, Any], lo: int, hi: int, counter: list[int]
) -> torch.Tensor:
    """Rows [lo, hi) (global row numbers) of a tensor from the saved `chunk` that holds them, checked."""
    dtype = getattr(torch, entry["dtype"])
    width = row_bytes(entry["shape"], dtype)
    first = chunk["rows"][0]
    path = directory / chunk["file"]
    start, length = chunk["offset"] + (lo - first) * width, (hi - lo) * width
    buffer = bytearray(length)
    with open(path, "rb", buffering=0) as f:  # unbuffered: the bytes asked for are the bytes read
        f.seek(start)
        got = f.readinto(buffer) or 0
        while 0 < got < length:
            more = f.readinto(memoryview(buffer)[got:]) or 0
            if not more:
                break
            got += more
    counter[0] += got
    if got < length:
        raise CheckpointError(f"{directory.name}/{chunk['file']}: truncated: rows {lo}-{hi} end past the file's end")
    block = chunk["rows_per_crc"]  # lo and hi fall on block boundaries: 1 row, or the whole tensor
    for k in range((hi - lo) // block):
        index = (lo - first) // block + k
        got_crc = zlib.crc32(memoryview(buffer)[k * block * width : (k + 1) * block * width])
        if f"{got_crc:08x}" != chunk["crc32"][8 * index : 8 * (index + 1)]:
            raise CheckpointError(f"{directory.name}/{chunk['file']}: corrupt: row {lo + k * block} fails its CRC-32")
    if not length:
        return torch.empty((0, *entry["shape"][1:]), dtype=dtype)
    values = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype)
    return values.reshape(entry["shape"]) if not entry["shape"] else values.view(hi - lo, *entry["shape"][1:])


def read_whole(path: Path, counter: list[int]) -> bytes:
    """A whole (small) file, its bytes added to counter[0]."""
    data = path.read_bytes()
    counter[0] += len(data)
    return data


def bytes_read_by_process() -> int | None:
    """rchar of /proc/self/io: every byte this process got from read() calls (None where there is none)."""
    io = Path(f"/proc/{os.getpid()}/io")
    if not io.exists():
        return None
    return int(next(line.split()[1] for line in io.read_text().splitlines() if line.startswith("rchar:")))
