"""A mixture-of-experts layer on one process, and the same with its experts sharded over ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.expert_parallel.dispatch import AllToAllFn, all_to_all, exchange_counts
from course_lib.expert_parallel.router import Routing, TopKRouter
from course_lib.models import FeedForward, seeded
from course_lib.tensor_parallel import shard_size


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
