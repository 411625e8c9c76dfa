"""A mixture-of-experts layer (top-k router, capacity, load-balancing loss) on one process and sharded over ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.expert_parallel.dispatch import AllToAllFn, all_to_all, exchange_counts
from course_lib.models import FeedForward, seeded
from course_lib.tensor_parallel import shard_size


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


def make_experts(n_experts: int, d_model: int, d_ff: int, seed: int = 1) -> nn.ModuleList:
    """E FeedForward experts, seeded: the same weights on every rank."""
    with seeded(seed):
        return nn.ModuleList(FeedForward(d_model, d_ff) for _ in range(n_experts))


def run_experts(experts: nn.ModuleList, rows: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
    """experts[expert_of_row[i]](rows[i]) for every row: rows grouped by expert, one call per expert."""
    order = torch.argsort(expert_of_row, stable=True)
    sizes = torch.bincount(expert_of_row, minlength=len(experts)).tolist()
    grouped = rows[order].split(sizes)
    outputs = torch.cat([expert(chunk) for expert, chunk in zip(experts, grouped)])
    return outputs[torch.argsort(order)]


class MoE(nn.Module):
    """The reference: router and every expert on one process."""

    def __init__(self, router: TopKRouter, experts: nn.ModuleList):
        super().__init__()
        self.router, self.experts = router, experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        routing = self.router(x)
        token, choice = routing.kept.nonzero(as_tuple=True)
        out = run_experts(self.experts, x[token], routing.experts[token, choice])
        y = torch.zeros_like(x).index_add(0, token, out * routing.gates[token, choice].unsqueeze(-1))
        return y, routing


class ExpertParallelMoE(nn.Module):
    """MoE with E/N experts per rank of `group`; tokens travel with two all-to-alls (dispatch, combine)."""

    def __init__(
        self,
        router: TopKRouter,
        experts: nn.ModuleList,
        group: dist.ProcessGroup | None = None,
        exchange: AllToAllFn = all_to_all,
    ):
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.per_rank = shard_size(len(experts), n, "experts")
        self.router, self.group, self.exchange = router, group, exchange
        self.first = r * self.per_rank  # my experts: first, first + 1, ..., first + E/N - 1
        self.experts = nn.ModuleList(experts[self.first : self.first + self.per_rank])
        self.last: dict[str, torch.Tensor] = {}  # counts of the last forward, to look at

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        routing = self.router(x)
        token, choice = routing.kept.nonzero(as_tuple=True)
        expert = routing.experts[token, choice]
        order = torch.argsort(expert, stable=True)  # by expert, hence by the rank that holds it
        token, choice, expert = token[order], choice[order], expert[order]
        per_expert = torch.bincount(expert, minlength=self.router.n_experts)
        received = exchange_counts(per_expert, self.group)  # first the counts: (N, E/N)
        send_splits = per_expert.view(len(received), -1).sum(1).tolist()
        recv_splits = received.sum(1).tolist()
        rows = self.exchange(x[token], send_splits, recv_splits, self.group)
        # rows arrive by source rank, and from each source grouped by my experts
        mine = torch.arange(self.per_rank, device=received.device).repeat(len(received))
        outputs = run_experts(self.experts, rows, torch.repeat_interleave(mine, received.flatten()))
        back = self.exchange(outputs, recv_splits, send_splits, self.group)
        y = torch.zeros_like(x).index_add(0, token, back * routing.gates[token, choice].unsqueeze(-1))
        self.last = dict(sent=per_expert, received=received, send_splits=torch.tensor(send_splits))
        return y, routing

    def global_name(self, name: str) -> str:
        """My parameter `name` as the single-process MoE names it: "experts.1.up.weight" -> "experts.7.up.weight"."""
        if not name.startswith("experts."):
            return name
        _, index, rest = name.split(".", 2)
        return f"experts.{self.first + int(index)}.{rest}"
