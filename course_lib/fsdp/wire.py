"""Bytes on the wire per rank and step: which collective ran on which group, and what it costs.

FSDP2 (and HSDP) call ``dist.all_gather_single``, ``dist.reduce_scatter_single`` and
``dist.all_reduce`` from Python, so wrapping those three while a step runs records every call:
its op, the ranks of its group and the bytes of the *full* tensor (the gathered output, the
reduced input). :func:`sent_bytes` turns the record into bytes sent per rank under a cost model:
a ring (what NCCL does: all-gather and reduce-scatter (n-1)/n of the tensor, all-reduce twice
that), or gloo's, whose reduce-scatter is an all-reduce on the wire (measured in notebook 03).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

# bytes a rank sends per byte of the full tensor, for a group of n ranks
RING = {"all_gather": (1, 1), "reduce_scatter": (1, 1), "all_reduce": (2, 1)}  # (a, b): a (n-1) / (b n)
GLOO = {"all_gather": (1, 1), "reduce_scatter": (2, 1), "all_reduce": (2, 1)}

Group = dist.ProcessGroup | None
Call = tuple[str, tuple[int, ...], int]  # (op, group ranks, bytes of the full tensor)


@contextmanager
def recorded_collectives() -> Iterator[list[Call]]:
    """Record (op, group ranks, full-tensor bytes) of every FSDP-style collective called inside."""
    calls: list[Call] = []
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single", "all_reduce")}

    def ranks(group: Group) -> tuple[int, ...]:
        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Group = None, **kw: Any) -> Any:
        calls.append(("all_gather", ranks(group), nbytes(output)))
        return originals["all_gather_single"](output, input, group=group, **kw)

    def reduce_scatter_single(
        output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Group = None, **kw: Any
    ) -> Any:
        calls.append(("reduce_scatter", ranks(group), nbytes(input)))
        return originals["reduce_scatter_single"](output, input, op=op, group=group, **kw)

    def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Group = None, **kw: Any) -> Any:
        calls.append(("all_reduce", ranks(group), nbytes(tensor)))
        return originals["all_reduce"](tensor, op=op, group=group, **kw)

    replacements = {
        "all_gather_single": all_gather_single,
        "reduce_scatter_single": reduce_scatter_single,
        "all_reduce": all_reduce,
    }
    for name, fn in replacements.items():
        setattr(dist, name, fn)
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def sent_bytes(calls: list[Call], model: dict[str, tuple[int, int]] = RING) -> float:
    """Bytes one rank sends for the recorded calls, under the cost model `model` (RING or GLOO)."""
    total = 0.0
    for op, group, nbytes in calls:
        n = len(group)
        a, b = model[op]
        total += a * (n - 1) / (b * n) * nbytes
    return total


def per_group(calls: list[Call]) -> dict[tuple[str, tuple[int, ...]], tuple[int, int]]:
    """{(op, group ranks): (calls, full-tensor bytes)}: what each group communicated."""
    table: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}
    for op, group, nbytes in calls:
        k, b = table.get((op, group), (0, 0))
        table[(op, group)] = (k + 1, b + nbytes)
    return table
