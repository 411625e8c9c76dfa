"""Notebook 03's lab: the notebook's model, data and training run, for one process and for every rank."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from course_lib import training
from course_lib.data import regression

# Notebook 03's training run: one fixed data set, the notebook's MLP, and the course's training loop over them,
# which one process (the reference, whole global batches) and every rank (its rows of each batch) run alike.


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
    """`steps` optimizer steps of :func:`course_lib.training.train` on the notebook's data, in order. Each global
    batch has micro_batch x world_size samples; rank r trains on its rows of it (world_size=1: one process, the
    whole batch: the reference run). `clip()` is called between backward and step (gradient clipping);
    `first_step` continues a run. Returns rank-local losses."""
    return training.train(
        model,
        optimizer,
        dataset(),
        steps,
        micro_batch * world_size,
        rank=rank,
        world_size=world_size,
        first_step=first_step,
        shuffle_seed=None,
        device=device,
        before_step=clip,
    )
