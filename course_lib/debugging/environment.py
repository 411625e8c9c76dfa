"""What each rank runs on, where ranks disagree, and the readable part of a DETAIL mismatch error."""

from __future__ import annotations

import os
import platform
import re

import torch
import torch.distributed as dist

# Keys that differ between ranks by design; every other key should be equal on all ranks.
PER_RANK_KEYS = ("rank", "local_rank", "pid", "device")

DEBUG_ENV = (
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_CPP_LOG_LEVEL",
    "NCCL_DEBUG",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)


def environment_report(device: torch.device | str = "cpu") -> dict[str, str]:
    """What this rank runs on: versions, backend, device, world, and the debug variables that are set.

    Collect it on every rank (a mixed installation or a rank on the wrong GPU shows up as a difference).
    """
    device = torch.device(device)
    report = {
        "rank": str(dist.get_rank()),
        "local_rank": os.environ.get("LOCAL_RANK", "0"),
        "world_size": str(dist.get_world_size()),
        "backend": str(dist.get_backend()),
        "device": str(device),
        "pid": str(os.getpid()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_available": str(torch.cuda.is_available()),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "n/a",
        "gloo_available": str(dist.is_gloo_available()),
        "nccl_available": str(dist.is_nccl_available()),
        "threads": str(torch.get_num_threads()),
    }
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    for name in DEBUG_ENV:
        report[name] = os.environ.get(name, "<unset>")
    return report


def differing_keys(reports: list[dict[str, str]]) -> list[str]:
    """Keys (other than the per-rank ones) whose values are not the same on every rank."""
    keys = sorted(set().union(*reports))
    return [k for k in keys if k not in PER_RANK_KEYS and len({r.get(k) for r in reports}) > 1]


# ---- TORCH_DISTRIBUTED_DEBUG=DETAIL ----------------------------------------------------------------

_FINGERPRINT = re.compile(
    r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
    r"OpType=(\w+), TensorShape=\[([\d, ]*)\]"
)


def mismatch_fingerprints(message: str) -> list[tuple[int, int, str, tuple[int, ...]]]:
    """(rank, sequence number, collective, shape) for each rank named in a DETAIL mismatch error."""
    return [
        (int(r), int(seq), op, tuple(int(s) for s in shape.replace(" ", "").split(",") if s))
        for r, seq, op, shape in _FINGERPRINT.findall(message)
    ]
