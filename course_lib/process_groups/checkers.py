"""Notebook 00's exercises: the sum of the ranks and the list of ranks, their checkers and reference solutions."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from course_lib.exercises import ExerciseFailed, expect_equal


def solution_rank_sum() -> int:
    """Reference solution: 0 + 1 + ... + (world_size - 1), by one all_reduce of each rank's number."""
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)
    return int(t.item())


def solution_gather_ranks() -> list[int]:
    """Reference solution: every rank's number, in rank order, by all_gather_object."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, dist.get_rank())
    return out


def check_rank_sum(fn: Callable[[], int | torch.Tensor]) -> None:
    """fn() on every rank must return 0 + 1 + ... + (world_size - 1)."""
    n = dist.get_world_size()
    got = fn()
    expect_equal(
        f"rank_sum() with world size {n}", int(got) if isinstance(got, torch.Tensor) else got, n * (n - 1) // 2
    )


def check_gather_ranks(fn: Callable[[], list[int]]) -> None:
    """fn() on every rank must return [0, 1, ..., world_size - 1] as a list of ints."""
    got = fn()
    if not isinstance(got, list):
        raise ExerciseFailed(f"gather_ranks() must return a list, got {type(got).__name__}")
    expect_equal("gather_ranks()", got, list(range(dist.get_world_size())))
