"""Ranks that differ: uneven batch counts (Join from scratch, and its reference run), parameters without a gradient."""

from __future__ import annotations

import copy
import itertools

import torch
import torch.distributed as dist
from torch import nn

from course_lib.ddp.minimal_ddp import MinimalDDP, unwrap
from course_lib.models import MLP, seeded

Batch = tuple[torch.Tensor, torch.Tensor]


def uneven_batches(world_size: int, batch_size: int = 8, fewest: int = 2, seed: int = 2) -> list[list[Batch]]:
    """Every rank's batches, the same lists on every rank: rank r has `fewest + r`, of samples only it sees."""
    from course_lib.data import regression

    counts = [fewest + r for r in range(world_size)]
    x, y = regression(n=batch_size * sum(counts), seed=seed).tensors
    starts = iter(range(0, len(x), batch_size))
    return [[(x[s : s + batch_size], y[s : s + batch_size]) for s in itertools.islice(starts, n)] for n in counts]


@torch.no_grad()
def shadow_all_reduce(model: MinimalDDP) -> None:
    """A rank without a batch answers the others' bucket all-reduces with zeros, in bucket order.

    It receives their average like everybody else, so its optimizer can take the same step.
    """
    for bucket in model.buckets:
        bucket.buffer.zero_()
        dist.all_reduce(bucket.buffer, group=model.process_group)
        for p, view in bucket.views():
            p.grad = view.view_as(p).clone()


def train_with_join(model: MinimalDDP, batches: list[Batch], optimizer: torch.optim.Optimizer) -> int:
    """Join from scratch: train on this rank's batches, however many; returns the steps every rank took."""
    device = next(model.parameters()).device
    for step in itertools.count():
        has_batch = step < len(batches)
        still = torch.tensor([float(has_batch)], device=device)
        dist.all_reduce(still, group=model.process_group)  # how many ranks still have a batch: all ask, every step
        if still.item() == 0:
            return step
        optimizer.zero_grad()
        if has_batch:
            x, y = (t.to(device) for t in batches[step])
            nn.functional.mse_loss(model(x), y).backward()  # MinimalDDP all-reduces each bucket
        else:
            shadow_all_reduce(model)
        optimizer.step()  # the same step on every rank, also on those out of data: the replicas stay one
    raise AssertionError("unreachable")


def uneven_reference(
    model: nn.Module, batches: list[list[Batch]], lr: float, divide_by_initial_world_size: bool = True
) -> nn.Module:
    """One-process SGD reference for Join: step k sums the present ranks' gradients, divided by N or by their count."""
    reference = copy.deepcopy(unwrap(model)).cpu()
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    for step in range(max(len(b) for b in batches)):
        present = [b[step] for b in batches if step < len(b)]
        divisor = len(batches) if divide_by_initial_world_size else len(present)
        optimizer.zero_grad()
        for x, y in present:
            (nn.functional.mse_loss(reference(x), y) / divisor).backward()
        optimizer.step()
    return reference


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
