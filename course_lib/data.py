"""Synthetic data sets: deterministic, small, learnable."""

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
