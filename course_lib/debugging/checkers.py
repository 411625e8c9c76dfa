"""The exercise of notebook 10: `gradients_in_sync(model)`, its reference solution and its checker."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from course_lib.debugging.checksums import checksum_range
from course_lib.exercises import ExerciseFailed
from course_lib.launch.runtime import rank_device


def solution_gradients_in_sync(model: nn.Module) -> bool:
    _, high, low = checksum_range(model)
    return bool(torch.equal(high, low))


def _model_with_gradients(seed_offset: int) -> nn.Module:
    """A small MLP whose gradients are identical on every rank (same weights, same batch)."""
    from course_lib.models import MLP

    device = rank_device()
    model = MLP(d_in=8, d_hidden=16, d_out=4, n_layers=2).to(device)
    g = torch.Generator().manual_seed(100 + seed_offset)
    x, y = torch.randn(16, 8, generator=g).to(device), torch.randn(16, 4, generator=g).to(device)
    nn.functional.mse_loss(model(x), y).backward()
    return model


def check_gradients_in_sync(fn: Callable[[nn.Module], object]) -> None:
    """fn(model) must return True on every rank when gradients agree, False on every rank when not.

    Cases: in sync; one entry nudged on the last rank; on rank 0; two entries swapped on rank 1 (a
    plain sum would not see it); a parameter without a gradient on every rank (still in sync).
    """
    rank, world = dist.get_rank(), dist.get_world_size()

    def nudge(model, on_rank):
        if rank == on_rank:
            model[0].weight.grad[1, 2] += 1e-3

    def swap(model, on_rank):
        if rank == on_rank:
            g = model[2].weight.grad
            g[0, 0], g[0, 1] = g[0, 1].clone(), g[0, 0].clone()

    def drop(model, on_rank):
        model[-1].bias.grad = None

    cases = [
        ("gradients identical on every rank", None, None, True),
        (f"one gradient entry changed on rank {world - 1}", nudge, world - 1, False),
        ("one gradient entry changed on rank 0", nudge, 0, False),
        ("two entries of one gradient swapped on rank 1", swap, 1, False),
        ("a parameter without a gradient on every rank", drop, None, True),
    ]
    for i, (what, fault, on_rank, expected) in enumerate(cases):
        model = _model_with_gradients(i)
        if fault is not None:
            fault(model, on_rank)
        got = fn(model)
        if not isinstance(got, (bool, torch.Tensor)) or (isinstance(got, torch.Tensor) and got.numel() != 1):
            raise ExerciseFailed(f"gradients_in_sync must return True or False, got {got!r}")
        got = bool(got)
        if got != expected:
            raise ExerciseFailed(f"{what}: expected {expected} on every rank, got {got} on rank {rank}")
    # A check every rank must agree on: a verdict differing between ranks would leave ranks in
    # different branches of the training loop.
    dist.barrier()
