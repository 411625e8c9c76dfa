"""What a chrome trace written by torch.profiler holds: event names, and the size of each all-reduce."""

from __future__ import annotations

import json
import math
import re


def trace_event_names(path: str) -> list[str]:
    """Names of the complete events ("ph": "X") in a chrome trace written by torch.profiler."""
    with open(path) as f:
        trace = json.load(f)
    return [e["name"] for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "name" in e]


def allreduce_sizes(path: str) -> list[int]:
    """Elements in each all-reduce call of a chrome trace (the dispatcher's c10d::allreduce_ events,
    which torch.profiler records with their input shapes when record_shapes=True), in call order."""
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    calls = sorted(
        (e for e in events if e.get("name") == "c10d::allreduce_" and e.get("ph") == "X"), key=lambda e: e["ts"]
    )
    sizes = []
    for e in calls:
        dims = e.get("args", {}).get("Input Dims", [[[]]])[0]  # the first input is the tensor list
        sizes.append(sum(math.prod(d) for d in dims))
    return sizes


def is_allreduce(name: str) -> bool:
    """Matches the profiler's names for an all-reduce: c10d::allreduce_, gloo:all_reduce, nccl:all_reduce."""
    return re.search(r"all_?reduce", name) is not None
