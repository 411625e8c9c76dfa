"""Notebook 10's expert-parallel exercise, checked on the ranks: the dispatch of tokens to their experts.

The solution is in notebooks/solutions/10_context_parallel.py, not here.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
import torch.distributed as dist

from course_lib.exercises import ExerciseFailed
from course_lib.exercises.calls import COMMUNICATION, gather_reports, record_calls, run_bounded, side_group
from course_lib.launch.runtime import rank_device

_ALL_TO_ALL_ONLY = "the tokens travel with dist.all_to_all_single (the counts first, then the rows)"
_FORBIDDEN = tuple(c for c in COMMUNICATION if c != "all_to_all_single")


def _rows(pairs: list[tuple[int, list[float]]]) -> list[tuple[int, tuple[float, ...]]]:
    return sorted((e, tuple(round(x, 5) for x in row)) for e, row in pairs)


def check_dispatch(fn: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """fn(tokens, expert_of_token, n_experts) -> (rows, expert_of_row): every token of every rank routed to
    one of this rank's experts (rank r holds experts r·E/N ... (r+1)·E/N - 1), with its expert; any order.

    Each rank has its own tokens (a different number per rank) and routes them unevenly.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    side = side_group()
    n_experts = 2 * n
    per_rank = n_experts // n
    for trial in range(2):
        gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
        count = 4 + 3 * rank + trial
        tokens = torch.randn(count, 3, generator=gen)
        experts = torch.randint(0, n_experts, (count,), generator=gen)
        everyone: list = [None] * n
        dist.all_gather_object(everyone, (tokens, experts), group=side)
        expected = _rows(
            [(int(e), row.tolist()) for t, ex in everyone for row, e in zip(t, ex) if int(e) // per_rank == rank]
        )
        device = rank_device()
        with record_calls(forbidden=_FORBIDDEN, advice=_ALL_TO_ALL_ONLY) as calls:
            got, error = run_bounded(fn, tokens.to(device), experts.to(device), n_experts)
        reports = gather_reports(None if error is None else f"{type(error).__name__}: {error}", side)
        failed = [(r, e) for r, e in enumerate(reports) if e is not None]
        if failed:
            r, e = failed[0]
            raise ExerciseFailed(f"rank {r} raised or waited too long: {e}")
        if not any(call.name == "all_to_all_single" for call in calls):
            raise ExerciseFailed(f"rank {rank} never called dist.all_to_all_single: {_ALL_TO_ALL_ONLY}")
        if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
            raise ExerciseFailed("dispatch must return two tensors: the rows received and the expert of each row")
        rows, row_experts = (t.detach().cpu() for t in got)
        if len(rows) != len(row_experts):
            raise ExerciseFailed(f"rank {rank}: {len(rows)} rows but {len(row_experts)} experts")
        foreign = [int(e) for e in row_experts if int(e) // per_rank != rank]
        if foreign:
            raise ExerciseFailed(
                f"rank {rank} (experts {rank * per_rank}-{(rank + 1) * per_rank - 1}) received a row for expert "
                f"{foreign[0]}, which rank {foreign[0] // per_rank} holds ({len(foreign)} of {len(rows)} rows "
                "belong to other ranks' experts)"
            )
        mine = _rows([(int(e), row.tolist()) for row, e in zip(rows, row_experts)])
        if len(mine) != len(expected):
            raise ExerciseFailed(f"rank {rank} should receive {len(expected)} rows for its experts, got {len(mine)}")
        if mine != expected:
            wrong = sum(a != b for a, b in zip(mine, expected))
            raise ExerciseFailed(f"rank {rank}: {wrong} of {len(mine)} rows are not the tokens routed to its experts")
