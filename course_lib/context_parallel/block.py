"""The course's TransformerBlock with context parallelism: each rank runs the block on its tokens only.
Only attention needs other tokens (from the ring); replicated parameters' gradients are summed as in DDP."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.context_parallel.ring_attention import ring_attention
from course_lib.models import Attention, TransformerBlock


class ContextParallelAttention(nn.Module):
    """models.Attention with the sequence split over `group`: q, k, v of my tokens, ring attention, o."""

    def __init__(self, full: Attention, held: list[torch.Tensor], group: dist.ProcessGroup | None = None):
        super().__init__()
        self.q, self.k, self.v, self.o, self.head_dim = full.q, full.k, full.v, full.o, full.head_dim
        self.held, self.group = held, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens = x.shape[0], x.shape[1]

        def heads(t: torch.Tensor) -> torch.Tensor:  # (b, s, width) -> (b, heads, s, head_dim)
            return t.view(batch, tokens, -1, self.head_dim).transpose(1, 2)

        y = ring_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), self.held, group=self.group)
        return self.o(y.transpose(1, 2).reshape(batch, tokens, -1))


class ContextParallelBlock(nn.Module):
    """TransformerBlock whose attention is ContextParallelAttention; everything else as it was."""

    def __init__(self, full: TransformerBlock, held: list[torch.Tensor], group: dist.ProcessGroup | None = None):
        super().__init__()
        self.norm1, self.norm2, self.dropout1, self.dropout2 = full.norm1, full.norm2, full.dropout1, full.dropout2
        self.attention = ContextParallelAttention(full.attention, held, group)
        self.feed_forward = full.feed_forward

    forward = TransformerBlock.forward


def sum_gradients(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """All-reduce (sum) every parameter gradient over `group`: each rank held the part from its tokens."""
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
