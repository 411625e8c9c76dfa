"""Notebook 04's exercise: a found-inf check that agrees across ranks; its reference solution and checker."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from course_lib.exercises import ExerciseFailed


def solution_found_inf(grads: list[torch.Tensor]) -> torch.Tensor:
    found = torch.zeros(())
    for grad in grads:
        if not torch.isfinite(grad).all():
            found.fill_(1.0)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return found


def _found_inf_cases(world_size: int) -> list[tuple[str, dict[int, float]]]:
    """(description, {rank: bad value}) cases; ranks not listed hold finite gradients."""
    last = world_size - 1
    return [
        ("no overflow anywhere", {}),
        (f"inf on rank {last} only", {last: math.inf}),
        ("nan on rank 0 only", {0: math.nan}),
        ("-inf on every rank", {r: -math.inf for r in range(world_size)}),
        (f"inf on ranks 0 and {last}", {0: math.inf, last: math.inf}),
    ]


def check_found_inf(fn: Callable[[list[torch.Tensor]], torch.Tensor]) -> None:
    """Runs on every rank: `fn(grads)` must return 1.0 on every rank iff some rank has a non-finite gradient.

    After each case the ranks agree (MAX all-reduce) on whether any of them got a wrong answer, so all
    ranks stop at the same case: the ranks that were wrong raise ExerciseFailed, the others return.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for description, bad in _found_inf_cases(world_size):
        grads = [torch.randn(4, 3), torch.randn(3)]
        if rank in bad:
            grads[1][2] = bad[rank]
        originals = [g.clone() for g in grads]
        expected = 1.0 if bad else 0.0
        wrong = None
        try:
            got = fn(grads)
            got = got.detach().cpu() if isinstance(got, torch.Tensor) else torch.tensor(float(got))
            if got.numel() != 1 or float(got) != expected:
                shown = got.flatten().tolist() if got.numel() > 1 else float(got)
                wrong = f"case '{description}': expected {expected}, got {shown}"
            elif not all(torch.equal(g.nan_to_num(), o.nan_to_num()) for g, o in zip(grads, originals)):
                wrong = f"case '{description}': the check changed the gradients; it should only read them"
        except Exception as error:
            wrong = f"case '{description}': your function raised {type(error).__name__}: {error}"
        anyone_wrong = torch.tensor(1.0 if wrong else 0.0)
        dist.all_reduce(anyone_wrong, op=dist.ReduceOp.MAX)
        if wrong:
            raise ExerciseFailed(wrong)
        if anyone_wrong.item():
            return  # another rank's answer was wrong; that rank reports it
