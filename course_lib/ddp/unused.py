"""Parameters without a gradient in a step: a model with a branch not taken, and what DDP's answers cost."""

from __future__ import annotations

import torch
from torch import nn

from course_lib.models import MLP, seeded


class MLPWithBranches(nn.Module):
    """The course MLP as a trunk, and branches of which a forward takes one, or none."""

    def __init__(
        self, d_in: int = 32, d_hidden: int = 64, d_out: int = 8, n_layers: int = 4, n_branches: int = 2, seed: int = 0
    ) -> None:
        super().__init__()
        self.trunk = MLP(d_in, d_hidden, d_out, n_layers, seed=seed)
        with seeded(seed + 1):  # seeded too: every rank builds the same branches
            self.branches = nn.ModuleList(nn.Linear(d_out, d_out) for _ in range(n_branches))

    def forward(self, x: torch.Tensor, branch: int | None = None) -> torch.Tensor:
        h = self.trunk(x)
        return h if branch is None else h + self.branches[branch](h)


def branch_indices(model: nn.Module) -> list[int]:
    """Positions of the branches' parameters in model.parameters(): the indices DDP's error names."""
    names = [name.removeprefix("module.") for name, _ in model.named_parameters()]
    return [i for i, name in enumerate(names) if name.startswith("branches.")]
