"""Notebook 11's exercises, checked on the ranks: the dispatch of tokens to their experts, and the capacity cut."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
import torch.distributed as dist

from course_lib.exercises import ExerciseFailed, expect_equal, refusing
from course_lib.exercises.calls import COMMUNICATION, gather_reports, record_calls, run_bounded, side_group
from course_lib.expert_parallel.moe import TopKRouter, keep_within_capacity
from course_lib.launch.runtime import rank_device

_ALL_TO_ALL_ONLY = "the tokens travel with dist.all_to_all_single (the counts first, then the rows)"
_FORBIDDEN = tuple(c for c in COMMUNICATION if c != "all_to_all_single")


def _rows(pairs: list[tuple[int, list[float]]]) -> list[tuple[int, tuple[float, ...]]]:
    return sorted((e, tuple(round(x, 5) for x in row)) for e, row in pairs)


def check_dispatch(fn: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """fn(tokens, expert_of_token, n_experts) -> (rows, expert_of_row): every rank's tokens for this rank's experts."""
    rank, n = dist.get_rank(), dist.get_world_size()
    side = side_group()
    n_experts = 2 * n
    per_rank = n_experts // n
    for trial in range(2):
        gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
        count = 4 + 3 * rank + trial
        tokens = torch.randn(count, 16, generator=gen)  # wide rows: sending a row twice shows in the bytes
        experts = torch.randint(0, n_experts, (count,), generator=gen)
        experts[0] = rank * per_rank  # one token stays home: a copy sent to every rank costs more than the dispatch
        everyone: list = [None] * n
        dist.all_gather_object(everyone, (tokens, experts), group=side)
        expected = _rows(
            [(int(e), row.tolist()) for t, ex in everyone for row, e in zip(t, ex) if int(e) // per_rank == rank]
        )
        device = rank_device()
        with record_calls(forbidden=_FORBIDDEN, advice=_ALL_TO_ALL_ONLY) as recorder:
            got, error = run_bounded(fn, tokens.to(device), experts.to(device), n_experts)
        reports = gather_reports(None if error is None else f"{type(error).__name__}: {error}", side)
        failed = [(r, e) for r, e in enumerate(reports) if e is not None]
        if failed:
            r, e = failed[0]
            raise ExerciseFailed(f"rank {r} raised or waited too long: {e}")
        if not any(call.op == "all_to_all" for call in recorder.calls):  # the only one not refused
            raise ExerciseFailed(f"rank {rank} never called dist.all_to_all_single: {_ALL_TO_ALL_ONLY}")
        away = int((experts // per_rank != rank).sum())  # rows that must leave: each to its expert's rank, once
        budget = away * (tokens[0].nbytes + experts[0].nbytes) + (n - 1) * per_rank * 8  # and the counts
        sent = sum(call.nbytes for call in recorder.calls)
        if sent > budget:
            raise ExerciseFailed(
                f"rank {rank} sent {sent} B, where its {away} tokens for other ranks' experts, their expert ids and "
                f"the counts take at most {budget} B: send each token only to the rank of its expert (not to every "
                "rank, to be filtered there)"
            )
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


_WRITE_THE_CUT = (
    "this uses the course's own capacity cut (the router calls it): write the queue yourself, first choices "
    "before second choices"
)


def check_capacity_mask(fn: Callable[[torch.Tensor, int, int], torch.Tensor]) -> None:
    """fn(experts, n_experts, cap) -> (T, k) mask: each expert's first `cap` assignments, first choices first."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    # token 1's first choice (expert 0) comes before token 0's second choice: in token order it would not
    cases = [(torch.tensor([[1, 0], [0, 1], [0, 2]]), 3, 2)]
    for tokens, n_experts, top_k, cap in ((12, 4, 2, 3), (20, 6, 3, 4), (9, 5, 1, 1)):
        cases.append((torch.rand(tokens, n_experts, generator=gen).topk(top_k, dim=-1).indices, n_experts, cap))
    for experts, n_experts, cap in cases:
        with refusing(keep_within_capacity, TopKRouter, why=_WRITE_THE_CUT):
            got = fn(experts.clone(), n_experts, cap)
        if not isinstance(got, torch.Tensor) or got.dtype != torch.bool:
            raise ExerciseFailed(f"capacity_mask must return a bool tensor, got {getattr(got, 'dtype', type(got))}")
        expect_equal(
            f"rank {rank}: the assignments kept ({experts.shape[0]} tokens, top-{experts.shape[1]} of {n_experts} "
            f"experts, capacity {cap})",
            got.cpu().int(),
            keep_within_capacity(experts, n_experts, cap).int(),
        )
