"""Notebook 03's training harness: one fixed data set, the notebook's MLP, and a loop that one
process (the reference, whole global batches) and every rank (its slice of each batch) run alike."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def global_batches(
    steps: int, global_batch: int, seed: int = 0, pool: int = 1024
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `steps` batches of one fixed regression data set (32 -> 7 features): the same
    data set whatever `steps` is, so a run can be continued (train(..., first_step=k))."""
    from course_lib.data import regression

    if steps * global_batch > pool:
        raise ValueError(f"{steps} batches of {global_batch} need more than the {pool} samples")
    x, y = regression(n=pool, d_out=7, seed=seed).tensors
    return [
        (x[s * global_batch : (s + 1) * global_batch], y[s * global_batch : (s + 1) * global_batch])
        for s in range(steps)
    ]


def make_model() -> nn.Module:
    """The notebook's MLP: 32 -> 45 -> 45 -> 7. Unit sizes 1485, 2070 and 322 elements: none
    divisible by 4, the first not by 2, the last not by 3, so every N in 2, 3, 4 cuts unevenly."""
    from course_lib.models import MLP

    return MLP(d_in=32, d_hidden=45, d_out=7, n_layers=2, seed=0)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    micro_batch: int = 8,
    world_size: int = 1,
    rank: int = 0,
    clip: Callable[[], object] | None = None,
    device: torch.device | str = "cpu",
    first_step: int = 0,
) -> list[float]:
    """`steps` optimizer steps. Each global batch has micro_batch x world_size samples; rank r trains
    on its r-th slice (world_size=1: one process, the whole batch: the reference run).
    `clip()` is called between backward and step (gradient clipping); `first_step` continues a run
    (global batch number `first_step` comes next). Returns rank-local losses."""
    losses = []
    for x, y in global_batches(first_step + steps, micro_batch * world_size)[first_step:]:
        lo = rank * micro_batch
        x, y = x[lo : lo + micro_batch].to(device), y[lo : lo + micro_batch].to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            clip()
        optimizer.step()
        losses.append(loss.item())
    return losses
