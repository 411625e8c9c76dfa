"""Tiny deterministic models shared by the notebooks.

Small enough that a step takes milliseconds on a laptop CPU, big enough to have
several layers to shard, bucket or split into pipeline stages.
"""
from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Sequential):
    """`n_layers` blocks of Linear + GELU, then a Linear head. Seeded: same weights on every rank."""

    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 8, n_layers: int = 4, seed: int = 0):
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        width = d_in
        for _ in range(n_layers):
            layers += [nn.Linear(width, d_hidden), nn.GELU()]
            width = d_hidden
        layers.append(nn.Linear(width, d_out))
        super().__init__(*layers)


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
