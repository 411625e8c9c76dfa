"""Notebook 03's training harness: one fixed data set, the notebook's MLP, and a loop that one
process (the reference, whole global batches) and every rank (its rows of each batch) run alike."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from course_lib.data import batch_for_step, regression


def dataset() -> TensorDataset:
    """The notebook's data: 1024 samples of one fixed regression task, 32 -> 7 features, taken in order."""
    return regression(n=1024, d_out=7)


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
    on its rows of it (:func:`course_lib.data.batch_for_step`; world_size=1: one process, the whole batch:
    the reference run).
    `clip()` is called between backward and step (gradient clipping); `first_step` continues a run
    (global batch number `first_step` comes next). Returns rank-local losses."""
    data, losses = dataset(), []
    for step in range(first_step, first_step + steps):
        batch = batch_for_step(data, step, micro_batch * world_size, rank, world_size, shuffle_seed=None)
        x, y = (t.to(device) for t in batch)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            clip()
        optimizer.step()
        losses.append(loss.item())
    return losses
