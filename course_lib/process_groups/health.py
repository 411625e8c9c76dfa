"""Notebook 00: process groups and torchrun. The health check and the exercises' checkers."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from course_lib.exercises import ExerciseFailed, expect_equal

TORCHRUN_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
)


def torchrun_env() -> dict[str, str]:
    """The variables torchrun sets for every rank (all a rank needs to join the group)."""
    return {name: os.environ.get(name, "<unset>") for name in TORCHRUN_ENV}


def health_check(device: torch.device | str = "cpu") -> float:
    """All-reduce a one from every rank: the sum must equal the world size.

    Proves every rank reached every other through the backend. Raises on failure.
    """
    ones = torch.ones(1, device=device)
    dist.all_reduce(ones, op=dist.ReduceOp.SUM)
    total = ones.item()
    if total != dist.get_world_size():
        raise RuntimeError(
            f"health check failed on rank {dist.get_rank()}: sum {total}, expected world size {dist.get_world_size()}"
        )
    return total


# ---- exercises -------------------------------------------------------------


def solution_rank_sum() -> int:
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)
    return int(t.item())


def solution_gather_ranks() -> list[int]:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, dist.get_rank())
    return out


def check_rank_sum(fn) -> None:
    """fn() on every rank must return 0 + 1 + ... + (world_size - 1)."""
    n = dist.get_world_size()
    got = fn()
    expect_equal(
        f"rank_sum() with world size {n}", int(got) if isinstance(got, torch.Tensor) else got, n * (n - 1) // 2
    )


def check_gather_ranks(fn) -> None:
    """fn() on every rank must return [0, 1, ..., world_size - 1] as a list of ints."""
    got = fn()
    if not isinstance(got, list):
        raise ExerciseFailed(f"gather_ranks() must return a list, got {type(got).__name__}")
    expect_equal("gather_ranks()", got, list(range(dist.get_world_size())))
