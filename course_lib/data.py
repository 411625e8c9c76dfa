"""Synthetic data sets, and the one way the course cuts them into global batches and a rank's rows."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def regression(n: int = 256, d_in: int = 32, d_out: int = 8, seed: int = 0, noise: float = 0.01) -> TensorDataset:
    """y = tanh(x W) + noise, for a fixed random W: an MLP can fit it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g) / d_in**0.5
    y = torch.tanh(x @ w) + noise * torch.randn(n, d_out, generator=g)
    return TensorDataset(x, y)


def batch_for_step(
    data: TensorDataset, step: int, global_batch: int, rank: int = 0, world_size: int = 1, shuffle_seed: int | None = 0
) -> tuple[torch.Tensor, ...]:
    """This rank's contiguous rows of global batch `step`: pure in `step`, so any N sees the same batches."""
    n = len(data)
    if not 0 < global_batch <= n:
        raise ValueError(f"a global batch of {global_batch} samples must be positive and fit in the {n} samples")
    epoch, index = divmod(step, n // global_batch)
    if shuffle_seed is None:
        order = torch.arange(n)
    else:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(shuffle_seed + epoch))
    per_rank = global_batch // world_size
    start = index * global_batch + rank * per_rank
    rows = order[start : start + per_rank]
    return tuple(t[rows] for t in data.tensors)
