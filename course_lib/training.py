"""The course's training step and the loop that feeds it: lessons extend them through hooks instead of writing loops."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from course_lib.data import batch_for_step

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    loss_fn: Loss = nn.functional.mse_loss,
    before_step: Callable[[], object] | None = None,
) -> torch.Tensor:
    """One optimizer step on (x, y); returns this rank's loss, detached."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    if before_step is not None:
        before_step()
    optimizer.step()
    return loss.detach()


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: TensorDataset,
    steps: int,
    global_batch: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    first_step: int = 0,
    shuffle_seed: int | None = 0,
    device: torch.device | str | None = None,
    before_step: Callable[[], object] | None = None,
    around_step: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
    after_step: Callable[[int, float], object] | None = None,
) -> list[float]:
    """Run global steps from first_step on this rank's rows, with around/after hooks; returns the rank's losses."""
    device = device if device is not None else next(model.parameters()).device
    losses = []
    for i in range(first_step, first_step + steps):
        x, y = (t.to(device) for t in batch_for_step(data, i, global_batch, rank, world_size, shuffle_seed))
        with around_step():
            loss = step(model, optimizer, x, y, before_step=before_step).item()
        losses.append(loss)
        if after_step is not None:
            after_step(i, loss)
    return losses
