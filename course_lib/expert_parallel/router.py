"""The router of a mixture-of-experts layer: top-k experts per token, capacity, and the load-balancing loss."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.models import seeded


@dataclass
class Routing:
    """Where the T tokens of one batch go: their k experts, gates, which assignments fit, the auxiliary loss."""

    probs: torch.Tensor  # (T, E) router probabilities
    experts: torch.Tensor  # (T, k) chosen experts, most probable first
    gates: torch.Tensor  # (T, k) their probabilities: the weights of the experts' outputs
    kept: torch.Tensor  # (T, k) True where the assignment fits in its expert's capacity
    aux_loss: torch.Tensor  # load-balancing loss (scalar)
    capacity: int  # assignments each expert takes at most

    def routed_per_expert(self) -> torch.Tensor:
        """Assignments each expert was chosen for, before the capacity cut (E,)."""
        return torch.bincount(self.experts.flatten(), minlength=self.probs.shape[1])

    def kept_per_expert(self) -> torch.Tensor:
        """Assignments each expert computes (E,)."""
        return torch.bincount(self.experts[self.kept], minlength=self.probs.shape[1])

    def dropped(self) -> int:
        """Assignments dropped for lack of capacity."""
        return int((~self.kept).sum())


def capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor · T·k / E): the most assignments one expert takes from a batch of T tokens."""
    return math.ceil(capacity_factor * tokens * top_k / n_experts - 1e-9)  # 1.25·32·2/8 = 10, not 11


def keep_within_capacity(experts: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """(T, k) mask of the assignments each expert takes: its first `cap`, first choices before second ones."""
    queue = experts.t().reshape(-1)  # all first choices in token order, then all second choices, ...
    place = (F.one_hot(queue, n_experts).cumsum(0) - 1).gather(1, queue[:, None]).squeeze(1)
    return (place < cap).view(experts.shape[1], experts.shape[0]).t()


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """E · Σ_e f_e · P_e: f_e share of the assignments routed to e (no gradient), P_e mean probability of e."""
    n_experts = probs.shape[1]
    share = torch.bincount(experts.flatten(), minlength=n_experts).to(probs.dtype) / experts.numel()
    return n_experts * (share * probs.mean(0)).sum()


class TopKRouter(nn.Module):
    """x (T, d) -> Routing. Seeded: the same weights on every rank (it is replicated)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int = 2, capacity_factor: float = 1.25, seed: int = 0):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be between 1 and the number of experts ({n_experts}), got {top_k}")
        with seeded(seed):
            self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor

    def forward(self, x: torch.Tensor) -> Routing:
        probs = F.softmax(self.gate(x), dim=-1)
        gates, experts = probs.topk(self.top_k, dim=-1)
        cap = capacity(x.shape[0], self.n_experts, self.top_k, self.capacity_factor)
        kept = keep_within_capacity(experts, self.n_experts, cap)
        return Routing(probs, experts, gates, kept, load_balancing_loss(probs, experts), cap)
