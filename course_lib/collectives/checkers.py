"""Notebook 01's checkers: ring reduce-scatter and all-gather from send/recv, a deadlock-free token pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from course_lib import comms
from course_lib.collectives import ring
from course_lib.collectives.ring import chunk_sizes
from course_lib.exercises import ExerciseFailed, calls_into, expect_equal
from course_lib.exercises.calls import (
    COLLECTIVES,
    DEADLOCK_S,
    NONBLOCKING_P2P,
    gather_reports,
    record_calls,
    run_bounded,
    secret_values,
    side_group,
)
from course_lib.launch.runtime import rank_device

_POINT_TO_POINT_ONLY = "use dist.send/recv, isend/irecv or batch_isend_irecv"
_COURSE_RING = (  # what section 4 shows after the exercises: the answer, not a way to it
    ring.reduce_scatter_step_,
    ring.all_gather_step_,
    ring._ring_reduce_scatter_,
    ring._ring_all_gather_,
    ring.ring_all_reduce,
)
_WRITE_IT = "this calls the course's own ring (section 4 shows it): write the sends and receives yourself"
_NOT_NAIVE = (
    "this computes the whole sum with collectives.naive_all_reduce (every tensor through rank 0) and cuts it "
    "afterwards: the exercise is the ring, one chunk to the right neighbour per step"
)


def _off_the_ring(what: str, messages: comms.Recorder, sizes: list[int], element_size: int) -> str | None:
    """Why this rank's messages are not a ring's, or None: to the right only, from the left only, N-1 chunks sent."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    peers = [(c.op, c.peer) for c in messages.calls if c.op in ("send", "recv") and c.peer is not None]
    strays = sorted(
        {
            f"{kind} {'to' if kind == 'send' else 'from'} rank {peer}"
            for kind, peer in peers
            if peer != (right if kind == "send" else left)
        }
    )
    if strays:
        return (
            f"{what}: rank {rank} made {', '.join(strays)}; in a ring a rank sends only to its right neighbour "
            f"(rank {right}) and receives only from its left one (rank {left}): the exercise is the ring's steps"
        )
    budget, sent = (n - 1) * max(sizes) * element_size, messages.wire_bytes()
    if sent > budget:
        return (
            f"{what}: rank {rank} sent {sent} bytes of a {sum(sizes) * element_size}-byte tensor; a ring sends N-1 "
            f"chunks, (N-1)/N of it (at most {budget} bytes here): whole or zero-padded tensors are not the ring"
        )
    return None


def _ring_only(fn: Callable[..., Any], args: tuple, what: str, sizes: list[int], element_size: int) -> Any:
    """fn(*args), collectives refused, messages held to a ring; the first failure is raised on all ranks (in step)."""
    side = side_group()
    course = {f.__qualname__: f for f in (*_COURSE_RING, ring.naive_all_reduce)}
    messages = comms.Recorder()
    with calls_into(course) as ran:  # refusing(), with a reason for each (sys.setprofile holds one hook at a time)
        try:
            with record_calls(forbidden=COLLECTIVES, advice=_POINT_TO_POINT_ONLY), messages:
                got = fn(*args)
        finally:
            if ran:
                raise ExerciseFailed(_NOT_NAIVE if "naive_all_reduce" in ran else _WRITE_IT)
    problems = [p for p in gather_reports(_off_the_ring(what, messages, sizes, element_size), side) if p]
    if problems:
        raise ExerciseFailed(problems[0])
    return got


# Sizes the checks try: divisible, not divisible, fewer elements than ranks are added per N.
def _check_sizes(n: int) -> list[int]:
    return [4 * n, 4 * n + 1, 2 * n + n - 1, 1, 37]


def _secret(numel: int) -> torch.Tensor:
    """Fresh whole numbers private to this rank: sums are exact in any order and need every rank's data to recompute."""
    return secret_values((numel,)).to(rank_device())  # where a model's tensors are: the GPU under NCCL


def check_reduce_scatter(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """fn(tensor) on every rank must return chunk `rank` of the sum, cut as torch.tensor_split does, by a ring."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for numel in _check_sizes(n):
        data = _secret(numel)
        total = data.clone()
        dist.all_reduce(total)
        expected = torch.tensor_split(total, n)[rank]
        what = f"reduce_scatter of {numel} elements on {n} ranks"
        got = _ring_only(fn, (data.clone(),), what, chunk_sizes(numel, n), data.element_size())
        expect_equal(
            f"{what} (chunk {rank})",
            got.reshape(-1) if isinstance(got, torch.Tensor) else got,
            expected,
        )


def check_all_gather(fn: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> None:
    """fn(chunk, sizes) on every rank must return all chunks concatenated in rank order, by a ring."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for numel in _check_sizes(n):
        full = _secret(numel)
        dist.broadcast(full, src=0)  # rank 0's draw on every rank: the expected answer, of which fn sees one chunk
        sizes = chunk_sizes(numel, n)
        chunk = torch.tensor_split(full, n)[rank].clone()
        what = f"all_gather of {numel} elements on {n} ranks"
        got = _ring_only(fn, (chunk, sizes), what, sizes, full.element_size())
        expect_equal(
            f"{what} (chunk sizes {sizes})",
            got.reshape(-1) if isinstance(got, torch.Tensor) else got,
            full,
        )


def waiting_forever(calls: list[list[tuple[str, int | None]]]) -> list[int]:
    """Ranks left waiting if every blocking send waits for its recv (as NCCL and large messages do); [] if none."""
    done = [0] * len(calls)

    def next_call(rank: int) -> tuple[str, int | None] | None:
        return calls[rank][done[rank]] if done[rank] < len(calls[rank]) else None

    progress = True
    while progress:
        progress = False
        for rank in range(len(calls)):
            call = next_call(rank)
            if call is None or call[0] != "send" or call[1] is None or not 0 <= call[1] < len(calls):
                continue
            peer = call[1]
            if next_call(peer) in (("recv", rank), ("recv", None)):
                done[rank] += 1
                done[peer] += 1
                progress = True
    return [rank for rank in range(len(calls)) if next_call(rank) is not None]


def _describe(calls: list[tuple[str, int | None]]) -> str:
    return ", ".join(f"{name} {'to' if name == 'send' else 'from'} {peer}" for name, peer in calls) or "nothing"


def check_pass_right(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Checker: blocking send/recv in a deadlock-free order; a CPU token, so gloo's host-side wait can be bounded."""
    rank, n = dist.get_rank(), dist.get_world_size()
    side = side_group()
    token = secret_values((4,))
    tokens = [torch.empty_like(token) for _ in range(n)]
    dist.all_gather(tokens, token)
    advice = "the exercise is to fix the order of the blocking dist.send and dist.recv"
    with record_calls(forbidden=COLLECTIVES + NONBLOCKING_P2P, advice=advice, bound_s=DEADLOCK_S) as recorded:
        got, error = run_bounded(fn, token.clone())
    calls = [(call.op, call.peer) for call in recorded.calls]
    reports = gather_reports((calls, error is not None), side)
    made = "; ".join(f"rank {r}: {_describe(c)}" for r, (c, _) in enumerate(reports))
    stuck = [r for r, (_, failed) in enumerate(reports) if failed]
    if stuck:
        raise ExerciseFailed(f"deadlock: ranks {stuck} still waited after {DEADLOCK_S:g} s. Calls in order: {made}")
    waiting = waiting_forever([c for c, _ in reports])
    if waiting:
        raise ExerciseFailed(
            f"this order finished only because the sends were buffered; if a send waits for its "
            f"receiver (NCCL, large tensors), ranks {waiting} wait forever. Calls in order: {made}"
        )
    if not isinstance(got, torch.Tensor):
        raise ExerciseFailed(f"pass_right must return a tensor, got {type(got).__name__}")
    expect_equal(
        f"pass_right on rank {rank} of {n} (the token of rank {(rank - 1) % n})",
        got.cpu(),
        tokens[(rank - 1) % n].cpu(),
    )
