"""Column- and row-parallel linear layers from scratch, and the course's TransformerBlock built from them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.models import Attention, FeedForward, TransformerBlock
from course_lib.tensor_parallel.operators import (
    CopyToParallel,
    GatherFromParallel,
    ReduceFromParallel,
    SplitToParallel,
    gather_last_dim,
    shard_size,
)


class ColumnParallelLinear(nn.Module):
    """Rank r keeps rows [r·out/N, (r+1)·out/N) of W and b: its slice of the outputs."""

    def __init__(self, full: nn.Linear, group=None, gather_output: bool = False, copy_input: bool = True):
        super().__init__()
        # copy_input=False: the caller applied copy_to_parallel once for several layers (q, k, v)
        self.group, self.gather_output, self.copy_input = group, gather_output, copy_input
        n, r = dist.get_world_size(group), dist.get_rank(group)
        rows = shard_size(full.out_features, n, "output features of a column-parallel layer")
        self.weight = nn.Parameter(full.weight.detach()[r * rows : (r + 1) * rows].clone())
        self.bias = nn.Parameter(full.bias.detach()[r * rows : (r + 1) * rows].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = CopyToParallel.apply(x, self.group)  # backward: sum the input gradients of all slices
        y = nn.functional.linear(x, self.weight, self.bias)
        return GatherFromParallel.apply(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Rank r keeps columns [r·in/N, (r+1)·in/N) of W; partial products are all-reduced; b added once."""

    def __init__(self, full: nn.Linear, group=None, input_is_parallel: bool = True, split_backward_fn=None):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.split_backward_fn = split_backward_fn or (lambda g: gather_last_dim(g, group))
        n, r = dist.get_world_size(group), dist.get_rank(group)
        cols = shard_size(full.in_features, n, "input features of a row-parallel layer")
        self.weight = nn.Parameter(full.weight.detach()[:, r * cols : (r + 1) * cols].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())  # replicated: added after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = SplitToParallel.apply(x, self.group, self.split_backward_fn)
        partial = nn.functional.linear(x, self.weight)
        return ReduceFromParallel.apply(partial, self.group) + self.bias


class ParallelFeedForward(nn.Module):
    """up column-parallel (d_ff/N hidden units per rank), GELU locally, down row-parallel: one all-reduce."""

    def __init__(self, full: FeedForward, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.up = ColumnParallelLinear(full.up, group)
        self.act = nn.GELU()
        self.down = RowParallelLinear(full.down, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class ParallelAttention(nn.Module):
    """q, k, v column-parallel (n_heads/N whole heads per rank), attention locally, o row-parallel."""

    def __init__(self, full: Attention, n_heads: int, group: dist.ProcessGroup | None = None):
        super().__init__()
        shard_size(n_heads, dist.get_world_size(group), "attention heads")
        self.head_dim = full.head_dim
        self.q, self.k, self.v = (ColumnParallelLinear(getattr(full, name), group, copy_input=False) for name in "qkv")
        self.o = RowParallelLinear(full.o, group)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one f for q, k and v together: a single all-reduce of their summed input gradients
        return Attention.forward(self, CopyToParallel.apply(x, self.group))  # type: ignore[arg-type]  # same fields


class ParallelTransformerBlock(nn.Module):
    """The course's TransformerBlock with attention and feed-forward tensor-parallel; norms replicated."""

    def __init__(self, full: TransformerBlock, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.norm1, self.norm2, self.dropout1, self.dropout2 = full.norm1, full.norm2, full.dropout1, full.dropout2
        self.attention = ParallelAttention(full.attention, full.n_heads, group)
        self.feed_forward = ParallelFeedForward(full.feed_forward, group)

    forward = TransformerBlock.forward


def shard_of(full: torch.Tensor, name: str, rank: int, world_size: int) -> torch.Tensor:
    """The slice of a full TransformerBlock parameter that the from-scratch layers keep on `rank`."""
    column = any(name.startswith(p) for p in ("attention.q.", "attention.k.", "attention.v.", "feed_forward.up."))
    row_weight = name in ("attention.o.weight", "feed_forward.down.weight")
    if column:
        n = full.shape[0] // world_size
        return full[rank * n : (rank + 1) * n]
    if row_weight:
        n = full.shape[1] // world_size
        return full[:, rank * n : (rank + 1) * n]
    return full
