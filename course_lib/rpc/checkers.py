"""Notebook 12's exercises, checked on the workers: a counter behind an RRef; a rendezvous completing every caller."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from course_lib.exercises import ExerciseFailed
from course_lib.exercises.calls import DEADLOCK_S
from course_lib.rpc.remote_functions import start, worker_name

AddFn = Callable[[rpc.RRef, int], int]  # add_fn(counter_rref, amount) -> the total after this update


class Counter:
    """State on the owner. Every read is slow (as a real store's would be), so two RPC threads that read, add and
    write without holding `lock` lose updates, through read/write, `value` or `_value` alike."""

    def __init__(self):
        self._stored = 0
        self.lock = threading.Lock()
        self.writes_unlocked = 0  # writes made while no thread held `lock`: counted for the checker

    def read(self) -> int:
        value = self._stored
        time.sleep(0.02)  # the value is on its way back while other threads may write
        return value

    def write(self, value: int) -> None:
        self.writes_unlocked += not self.lock.locked()
        self._stored = value

    value = _value = property(read, write)


def _read_counter(counter_rref: rpc.RRef) -> tuple[int, int]:
    counter = counter_rref.local_value()
    return counter._stored, counter.writes_unlocked


def _judged_on_owner(problem_on_owner: Callable[[int], str | None]) -> None:
    """Every rank joins RPC; rank 0 runs `problem_on_owner(world_size)`, whose answer (if any) fails the exercise."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    start(rank, world_size)
    try:
        problem = problem_on_owner(world_size) if rank == 0 else None
    finally:
        rpc.shutdown()
    if problem:
        raise ExerciseFailed(problem)


def check_counter(add_fn: AddFn, calls_per_trainer: int = 8, amount_base: int = 1) -> None:
    """Checker: every trainer's concurrent add_fn updates must hold the lock, sum right and never interleave."""

    def problem_on_owner(world_size: int) -> str | None:
        counter_rref = rpc.RRef(Counter())
        futures = [
            rpc.rpc_async(worker_name(r), _trainer_counts, args=(counter_rref, add_fn, r, calls_per_trainer))
            for r in range(1, world_size)
        ]
        returned = [v for f in futures for v in f.wait()]
        expected = sum(r * amount_base * calls_per_trainer for r in range(1, world_size))
        total, unlocked = _read_counter(counter_rref)
        if unlocked:
            return (
                f"{unlocked} of the {len(returned)} updates wrote the counter without holding counter.lock: an "
                f"unlocked read-add-write loses an update whenever two RPC threads interleave, even if this run's "
                f"timing spared it; the exercise is to hold the lock across the read, the add and the write"
            )
        if total != expected:
            return (
                f"the counter's owner: total expected {expected}, got {total} "
                f"after {len(returned)} updates from {world_size - 1} trainer(s)"
            )
        if sorted(returned) != sorted(set(returned)) or max(returned, default=0) != expected:
            return (
                f"the {len(returned)} calls returned the totals {sorted(returned)}: each call "
                f"must return the total right after its own update (all different, the last = {expected})"
            )
        return None

    _judged_on_owner(problem_on_owner)


def _trainer_counts(counter_rref: rpc.RRef, add_fn: AddFn, trainer_rank: int, calls: int) -> list[int]:
    """Runs on a trainer: `calls` updates in flight at once, each adding `trainer_rank`."""
    owner = counter_rref.owner()
    futures = [rpc.rpc_async(owner, add_fn, args=(counter_rref, trainer_rank)) for _ in range(calls)]
    return [f.wait() for f in futures]


# ---- diagnose: a rendezvous on the owner ------------------------------------------------------------------


class Rendezvous:
    """State on the owner: `expected` calls make a round; each caller's reply is the round's sorted values."""

    def __init__(self, expected: int):
        self.expected = expected
        self.lock = threading.Lock()
        self.values: list[int] = []
        self.round_done: torch.futures.Future = torch.futures.Future()
        self.handed_out: list[torch.futures.Future] = []  # every future returned, completed at the end


JoinFn = Callable[[Rendezvous, int], torch.futures.Future]  # join_fn(rendezvous, value) -> future of the round


@rpc.functions.async_execution
def _join_on_owner(rendezvous_rref: rpc.RRef, join_fn: JoinFn, value: int) -> torch.futures.Future:
    """Runs on the owner, on an RPC thread: the reply is sent when the learner's future completes."""
    rendezvous = rendezvous_rref.local_value()
    future = join_fn(rendezvous, value)
    if not isinstance(future, torch.futures.Future):
        answer: torch.futures.Future = torch.futures.Future()
        answer.set_result(("not a future", type(future).__name__))
        return answer
    with rendezvous.lock:
        rendezvous.handed_out.append(future)
    return future


def _trainer_joins(rendezvous_rref: rpc.RRef, join_fn: JoinFn, values: list[list[int]]) -> list[list[object]]:
    """Runs on a trainer: per round, all its values join at once; stops at the first reply that never came."""
    owner = rendezvous_rref.owner()
    replies: list[list[object]] = []
    for round_values in values:
        futures = [
            rpc.rpc_async(owner, _join_on_owner, args=(rendezvous_rref, join_fn, v), timeout=DEADLOCK_S)
            for v in round_values
        ]
        got: list[object] = []
        for future in futures:
            try:
                got.append(future.wait())
            except RuntimeError as error:
                if "timeout" not in str(error):
                    raise
                got.append("timeout")
        replies.append(got)
        if "timeout" in got:
            break
    return replies


def check_join_round(join_fn: JoinFn, rounds: int = 2, calls_per_trainer: int = 2) -> None:
    """Checker: concurrent join_fn calls, `rounds` in a row, must each get their round's sorted values from all."""

    def problem_on_owner(world_size: int) -> str | None:
        salt = int(torch.randint(1000, 10**6, ()))  # the values are unknown before the run
        values = {
            r: [[salt + 1000 * k + 10 * r + c for c in range(calls_per_trainer)] for k in range(rounds)]
            for r in range(1, world_size)
        }
        rendezvous = Rendezvous(expected=calls_per_trainer * (world_size - 1))
        rendezvous_rref = rpc.RRef(rendezvous)
        futures = {
            r: rpc.rpc_async(worker_name(r), _trainer_joins, args=(rendezvous_rref, join_fn, values[r])) for r in values
        }
        replies = {r: f.wait() for r, f in futures.items()}
        with rendezvous.lock:  # answer whatever is still pending, so that shutdown does not wait for it
            for future in [*rendezvous.handed_out, rendezvous.round_done]:
                if not future.done():
                    future.set_result(None)
        return _first_wrong_reply(replies, values, rounds)

    _judged_on_owner(problem_on_owner)


def _first_wrong_reply(replies: dict[int, list[list[object]]], values: dict, rounds: int) -> str | None:
    for k in range(rounds):
        expected = sorted(v for r in values for v in values[r][k])
        for r, per_round in replies.items():
            got = per_round[k] if k < len(per_round) else []
            for reply in got:
                if reply == "timeout":
                    return (
                        f"trainer{r}, round {k}: no reply within {DEADLOCK_S:.0f} s: the future your function "
                        f"returned to this caller was never completed"
                    )
                if isinstance(reply, tuple) and reply[:1] == ("not a future",):
                    return f"join_round must return a torch.futures.Future, got {reply[1]}"
                if reply != expected:
                    return (
                        f"trainer{r}, round {k}: expected the {len(expected)} values of the round, sorted, got {reply}"
                    )
    return None
