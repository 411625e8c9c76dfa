"""The exercises of notebook 08, checked on the ranks: the split operator's backward, a row-parallel forward."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comms
from course_lib.exercises import ExerciseFailed, calls_into
from course_lib.launch.runtime import rank_device
from course_lib.tensor_parallel.layers import RowParallelLinear
from course_lib.tensor_parallel.operators import GatherFromParallel, gather_last_dim

_WRITE_THE_GATHER = "this calls the course's own gather (gather_last_dim): write the collective yourself"
_AUTOGRAD_GATHER = (
    "this calls torch.distributed.nn.functional.all_gather, a ready-made autograd gather: the exercise is to write "
    "the split's backward yourself, with dist.all_gather and torch.cat"
)


def check_split_backward(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """fn(grad_slice) -> gradient of the whole input of the split operator."""
    rank, n = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    torch.manual_seed(0)
    full = nn.Linear(12 * n, 5).to(device)
    x = torch.randn(3, 12 * n).to(device).requires_grad_()
    full(x).pow(2).sum().backward()
    assert x.grad is not None
    expected = x.grad.clone()

    def checked(grad_slice: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn import functional as autograd_collectives

        ready_made: dict[str, Callable | type] = {
            "course": gather_last_dim,
            "course layer": GatherFromParallel,
            "autograd": autograd_collectives.all_gather,
        }
        with calls_into(ready_made) as called, comms.Recorder() as recorder:
            try:
                got = fn(grad_slice)
            finally:
                if called:
                    raise ExerciseFailed(_AUTOGRAD_GATHER if called[0] == "autograd" else _WRITE_THE_GATHER)
        sent, budget = recorder.sent_bytes(), comms.RING["all_gather"](n) * expected.numel() * expected.element_size()
        if sent > budget + 1e-9:
            raise ExerciseFailed(
                f"rank {rank}: this rank sent {sent:,.0f} bytes where an all-gather of the slices' gradients sends "
                f"{budget:,.0f}: an all-reduce of a zero-padded tensor (or any sum) moves twice that. Every rank "
                "already has its own slice: it only needs the others'"
            )
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ExerciseFailed(
                f"rank {rank}: for a slice gradient of shape {tuple(grad_slice.shape)} the "
                f"input gradient should have the whole input's shape {tuple(expected.shape)}, "
                f"got {shape}"
            )
        return got

    layer = RowParallelLinear(full, input_is_parallel=False, split_backward_fn=checked)
    mine = x.detach().clone().requires_grad_()
    layer(mine).pow(2).sum().backward()
    got = mine.grad
    if got is None or got.shape != expected.shape:
        shape = None if got is None else tuple(got.shape)
        raise ExerciseFailed(
            f"rank {rank}: the input gradient should have the input's shape {tuple(expected.shape)}, got {shape}"
        )
    wrong = ~torch.isclose(got, expected, atol=1e-5, rtol=1e-4)
    if wrong.any():
        i, j = (int(v) for v in wrong.nonzero()[0])
        owner = j // 12
        raise ExerciseFailed(
            f"rank {rank}: input gradient [{i}, {j}] (feature {j} is computed on rank {owner}) "
            f"expected {expected[i, j].item():.5g}, got {got[i, j].item():.5g} "
            f"({int(wrong.sum())} of {wrong.numel()} elements wrong)"
        )


def check_row_parallel_forward(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """fn(x_slice, weight_slice, bias) -> y = x Wᵀ + b, whole, on every rank."""
    rank, n = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    for seed, rows in ((0, 3), (1, 5)):
        torch.manual_seed(seed)
        full = nn.Linear(4 * n, 6)
        with torch.no_grad():
            full.bias.uniform_(1.0, 2.0)  # far from zero: a bias added N times shows
        full = full.to(device)
        x = torch.randn(rows, 4 * n).to(device)
        expected = full(x).detach()
        mine = slice(4 * rank, 4 * (rank + 1))
        with comms.Recorder() as recorder:
            got = fn(x[:, mine].clone(), full.weight.detach()[:, mine].clone(), full.bias.detach().clone())
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ExerciseFailed(
                f"rank {rank}: y should have the whole output's shape {tuple(expected.shape)}, got {shape}"
            )
        got = got.detach().to(expected.device)
        wrong = ~torch.isclose(got, expected, atol=1e-5, rtol=1e-4)
        if wrong.any():
            i, j = (int(v) for v in wrong.nonzero()[0])
            offset = (got - expected) / full.bias.detach()
            same = bool(torch.allclose(offset, offset[0, 0].expand_as(offset), atol=1e-3))
            hint = f" (every element is off by {offset[0, 0].item():.3g} times its column's bias)" if same else ""
            raise ExerciseFailed(
                f"rank {rank}: y[{i}, {j}] expected {expected[i, j].item():.5g}, got {got[i, j].item():.5g} "
                f"({int(wrong.sum())} of {wrong.numel()} elements wrong){hint}"
            )
        sent, budget = recorder.sent_bytes(), comms.RING["all_reduce"](n) * expected.numel() * expected.element_size()
        if sent > budget:
            raise ExerciseFailed(
                f"rank {rank}: right numbers, but this rank sent {sent:,.0f} bytes where one all-reduce of the partial "
                f"output sends {budget:,.0f}: gathering the inputs or the weights to multiply locally undoes the row "
                "split. Each rank multiplies its own slices; only the partial products travel"
            )
