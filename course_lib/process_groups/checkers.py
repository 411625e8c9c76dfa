"""Notebook 00's exercise checkers: each rank's fresh secret value means no answer is right without communicating."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from course_lib.exercises import ExerciseFailed, expect_equal
from course_lib.exercises.calls import gather_reports, record_calls, run_bounded, secret_values, side_group
from course_lib.launch.runtime import rank_device

_CALLS = 3  # each checker calls the learner's function this many times, with new secrets every time


def _communicated(name: str, calls: list[Any]) -> None:
    if not calls:
        raise ExerciseFailed(
            f"{name} called no torch.distributed function on rank {dist.get_rank()}: "
            "the other ranks' values can only reach this rank through a collective"
        )


def check_rank_sum(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """fn(value) on every rank must return the element-wise sum of every rank's `value`, by communicating."""
    n = dist.get_world_size()
    for call in range(_CALLS):
        value = secret_values((3,)).to(rank_device())
        expected = value.clone()
        dist.all_reduce(expected)
        with record_calls() as recorded:
            got = fn(value.clone())
        _communicated("rank_sum", recorded.calls)
        if not isinstance(got, torch.Tensor):
            raise ExerciseFailed(f"rank_sum must return a tensor, got {type(got).__name__}")
        expect_equal(f"rank_sum(value) on {n} ranks, call {call + 1} with new values", got.cpu(), expected.cpu())


def check_gather_values(fn: Callable[[int], list[int]]) -> None:
    """fn(value) on every rank must return [value of rank 0, value of rank 1, ...], by communicating."""
    n = dist.get_world_size()
    for call in range(_CALLS):
        value = int(secret_values().item()) + 1000 * dist.get_rank()  # + 1000 rank: distinct even if draws collide
        expected: list[Any] = [None] * n
        dist.all_gather_object(expected, value)
        with record_calls() as recorded:
            got = fn(value)
        _communicated("gather_values", recorded.calls)
        if not isinstance(got, list):
            raise ExerciseFailed(f"gather_values must return a list, got {type(got).__name__}")
        got = [int(v.item()) if isinstance(v, torch.Tensor) else v for v in got]
        expect_equal(f"gather_values(value) on {n} ranks, call {call + 1} with new values", got, expected)


def check_mean_loss(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """fn(loss) -> mean loss, same calls on all ranks, one print; the loss is on CPU so a lone all-reduce times out."""
    rank, n = dist.get_rank(), dist.get_world_size()
    side = side_group()
    # Positive, as losses are: the sum of two or more can never equal their mean, so "forgot to divide" always fails.
    loss = (secret_values().abs() + 1).reshape(1) / 4
    expected = loss.clone()
    dist.all_reduce(expected)
    expected /= n
    printed = io.StringIO()
    with record_calls() as recorded, contextlib.redirect_stdout(printed):
        got, error = run_bounded(fn, loss.clone())
    sys.stdout.write(printed.getvalue())  # the learner sees what their function printed
    names = [call.op for call in recorded.calls]
    lines = len(printed.getvalue().splitlines())
    reports = gather_reports((names, None if error is None else type(error).__name__, lines), side)
    stuck = [r for r, (_, failed, _) in enumerate(reports) if failed]
    if len({tuple(calls_of_rank) for calls_of_rank, _, _ in reports}) > 1:
        made = "; ".join(f"rank {r}: {calls_of_rank or 'none'}" for r, (calls_of_rank, _, _) in enumerate(reports))
        waited = f" (ranks {stuck} waited in vain until the timeout)" if stuck else ""
        raise ExerciseFailed(
            f"the ranks made different communication calls ({made}){waited}: "
            "every rank must call the same collectives, in the same order"
        )
    if error is not None:
        raise ExerciseFailed(f"mean_loss raised {type(error).__name__}: {str(error)[:200]}")
    _communicated("mean_loss", recorded.calls)
    if not isinstance(got, torch.Tensor):
        raise ExerciseFailed(f"mean_loss must return a tensor, got {type(got).__name__}")
    expect_equal(f"mean_loss(loss) on rank {rank} of {n}", got.reshape(-1).cpu(), expected.cpu())
    lines_per_rank = [rank_lines for _, _, rank_lines in reports]
    if sum(lines_per_rank) != 1:
        raise ExerciseFailed(
            f"mean_loss printed {sum(lines_per_rank)} lines in all (per rank: {lines_per_rank}): the log needs one "
            "line, so one rank prints it after the collective that every rank calls"
        )
