"""The exercise of notebook 06: the backward of the split operator, its checker and reference answer."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from course_lib.exercises import ExerciseFailed
from course_lib.tensor_parallel.layers import RowParallelLinear


def split_backward(grad_slice: torch.Tensor) -> torch.Tensor:
    """Reference backward of the row-parallel input operator: the gradient of the whole input.

    Self-contained (the exercise check runs its source on the ranks): all-gather the slices, concatenate.
    """
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(grad_slice) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, grad_slice.contiguous())
    return torch.cat(parts, dim=-1)


def check_split_backward(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """fn(grad_slice) -> gradient of the whole input of the split operator.

    A RowParallelLinear whose input is not yet split uses `fn` as the backward of its split; the input
    gradient must equal single-process autograd's on every rank.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = nn.Linear(12 * n, 5)
    x = torch.randn(3, 12 * n, requires_grad=True)
    full(x).pow(2).sum().backward()
    assert x.grad is not None
    expected = x.grad.clone()

    def checked(grad_slice: torch.Tensor) -> torch.Tensor:
        got = fn(grad_slice)
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
