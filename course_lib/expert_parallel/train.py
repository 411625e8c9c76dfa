"""A short training run of an expert-parallel MoE, to watch the load balance with and without the auxiliary loss."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import compare
from course_lib.expert_parallel.lab import imbalance
from course_lib.expert_parallel.moe import ExpertParallelMoE


def token_batch(tokens: int, d_model: int, rank: int, step: int = 0, shift: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Rank `rank`'s tokens at `step`: Gaussian around a common direction of length ≈ shift·√d (seeded)."""
    direction = shift * torch.randn(d_model, generator=torch.Generator().manual_seed(seed))
    mine = torch.Generator().manual_seed(1_000_003 * (seed + 1) + 1009 * rank + step)
    return torch.randn(tokens, d_model, generator=mine) + direction


def train_load_balance(
    moe: ExpertParallelMoE,
    steps: int = 30,
    aux_weight: float = 0.1,
    tokens: int = 64,
    lr: float = 1e-2,
    shift: float = 1.0,
    seed: int = 0,
) -> list[dict[str, float]]:
    """Train `moe` for `steps` Adam steps; per step: imbalance and dropped share over every rank's tokens, loss."""
    group, n, rank = moe.group, dist.get_world_size(moe.group), dist.get_rank(moe.group)
    d, device = moe.router.gate.in_features, moe.router.gate.weight.device
    mix = (torch.randn(d, d, generator=torch.Generator().manual_seed(seed + 1)) / d**0.5).to(device)
    optimizer = torch.optim.Adam(moe.parameters(), lr=lr)
    history = []
    for step in range(steps):
        x = token_batch(tokens, d, rank, step + 1, shift, seed).to(device)  # every rank its own tokens
        y, routing = moe(x)
        task = F.mse_loss(y, torch.tanh(x @ mix))
        optimizer.zero_grad()
        (task + aux_weight * routing.aux_loss).backward()
        for p in moe.router.parameters():  # replicated: average its gradient over the ranks
            grad = compare.grad_of(p, "router")
            dist.all_reduce(grad, group=group)
            grad /= n
        for p in moe.experts.parameters():  # each expert saw every rank's tokens, each rank's loss a mean
            if p.grad is not None:
                p.grad /= n
        optimizer.step()
        extra = torch.tensor([routing.dropped(), task.item()], dtype=torch.float64, device=device)
        stats = torch.cat([routing.routed_per_expert().double(), extra])
        dist.all_reduce(stats, group=group)
        routed = stats[:-2]
        history.append(
            dict(
                imbalance=imbalance(routed),
                dropped=float(stats[-2] / routed.sum()),
                loss=float(stats[-1] / n),
            )
        )
    return history
