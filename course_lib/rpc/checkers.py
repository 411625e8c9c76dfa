"""The exercise of notebook 08: a counter held behind an RRef, updated by every trainer.

The checker and the functions it sends to the workers; :func:`add_on_owner` is the reference solution.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist
import torch.distributed.rpc as rpc

from course_lib.exercises import ExerciseFailed
from course_lib.rpc.agent import start, worker_name

AddFn = Callable[[rpc.RRef, int], int]  # add_fn(counter_rref, amount) -> the total after this update


class Counter:
    """State on the owner. Reading is slow (as a real store would be), so two RPC threads
    that read, add and write without holding `lock` lose updates."""

    def __init__(self):
        self.value = 0
        self.lock = threading.Lock()

    def read(self) -> int:
        value = self.value
        time.sleep(0.02)  # the value is on its way back while other threads may write
        return value

    def write(self, value: int) -> None:
        self.value = value


def add_on_owner(counter_rref: rpc.RRef, amount: int) -> int:
    """Reference solution: runs on the counter's owner; returns the total after this update."""
    counter = counter_rref.local_value()
    with counter.lock:
        total = counter.read() + amount
        counter.write(total)
    return total


def _read_counter(counter_rref: rpc.RRef) -> int:
    return counter_rref.local_value().value


def check_counter(add_fn: AddFn, calls_per_trainer: int = 8, amount_base: int = 1) -> None:
    """Checker: every trainer sends `calls_per_trainer` concurrent updates through `add_fn`,
    run on the server; the total must be the sum of every amount, and every call must have
    seen a different total (no two updates interleaved)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    start(rank, world_size)
    problem = None
    try:
        if rank == 0:
            counter_rref = rpc.RRef(Counter())
            futures = [
                rpc.rpc_async(worker_name(r), _trainer_counts, args=(counter_rref, add_fn, r, calls_per_trainer))
                for r in range(1, world_size)
            ]
            returned = [v for f in futures for v in f.wait()]
            expected = sum(r * amount_base * calls_per_trainer for r in range(1, world_size))
            total = _read_counter(counter_rref)
            if total != expected:
                problem = (
                    f"the counter's owner: total expected {expected}, got {total} "
                    f"after {len(returned)} updates from {world_size - 1} trainer(s)"
                )
            elif sorted(returned) != sorted(set(returned)) or max(returned, default=0) != expected:
                problem = (
                    f"the {len(returned)} calls returned the totals {sorted(returned)}: each call "
                    f"must return the total right after its own update (all different, the last = {expected})"
                )
    finally:
        rpc.shutdown()
    if problem:
        raise ExerciseFailed(problem)


def _trainer_counts(counter_rref: rpc.RRef, add_fn: AddFn, trainer_rank: int, calls: int) -> list[int]:
    """Runs on a trainer: `calls` updates in flight at once, each adding `trainer_rank`."""
    owner = counter_rref.owner()
    futures = [rpc.rpc_async(owner, add_fn, args=(counter_rref, trainer_rank)) for _ in range(calls)]
    return [f.wait() for f in futures]
