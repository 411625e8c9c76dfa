"""Are the ranks' gradients identical? One checksum per parameter tensor, compared with MAX and MIN."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """Position weights for a checksum: the same on every rank, different for every position."""
    return torch.linspace(1.0, 2.0, n, dtype=torch.float64, device=device)


def gradient_checksums(model: nn.Module) -> torch.Tensor:
    """One float64 number per parameter: the position-weighted sum of its gradient (0 when it has none).

    Position weights make a swap of two entries visible, which a plain sum would miss.
    """
    sums = []
    for p in model.parameters():
        if p.grad is None:
            sums.append(torch.zeros((), dtype=torch.float64, device=p.device))
        else:
            g = p.grad.detach().reshape(-1).to(torch.float64)
            sums.append((g * _weights(g.numel(), g.device)).sum())
    return torch.stack(sums)


def checksum_range(
    model: nn.Module, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's checksums, their MAX over the ranks, their MIN): a collective, call it on every rank.

    Every rank gets the same MAX and MIN, so every rank reaches the same verdict. A NaN checksum
    counts as +Inf: MAX/MIN may drop a NaN, they keep an Inf.
    """
    mine = gradient_checksums(model)
    mine = torch.where(mine.isnan(), math.inf, mine)
    high, low = mine.clone(), mine.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    return mine, high, low
