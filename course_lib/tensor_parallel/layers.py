"""Column- and row-parallel linears from scratch, a TransformerBlock of them, the same as a parallelize_module plan."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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


if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle


def tp_plan(sequence_parallel: bool = False, shared_input: bool = False) -> dict[str, ParallelStyle]:
    """parallelize_module plan for TransformerBlock: q/k/v/up column-wise, o/down row-wise.

    shared_input (torchtitan's Llama plan does this): PrepareModuleInput on attention and feed_forward turns
    their input into one DTensor that q, k and v (or up) all read, so autograd adds their Partial input
    gradients before the single all-reduce; without it each column layer wraps a plain tensor of its own
    and all-reduces its input gradient alone (3 all-reduces for q, k, v in backward instead of 1).
    With sequence_parallel the norms (and the dropout between them) work on a slice of the sequence:
    the block's input and output are sharded on dim 1; an all-gather before attention/feed-forward
    and a reduce-scatter after them replace each all-reduce.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    layout = Shard(1) if sequence_parallel else Replicate()  # of the block's input and output, as in torchtitan
    plan: dict[str, ParallelStyle] = {f"attention.{name}": ColwiseParallel() for name in "qkv"}
    plan["feed_forward.up"] = ColwiseParallel()
    plan["attention.o"] = RowwiseParallel(output_layouts=layout)
    plan["feed_forward.down"] = RowwiseParallel(output_layouts=layout)
    if sequence_parallel or shared_input:
        for name in ("attention", "feed_forward"):
            plan[name] = PrepareModuleInput(input_layouts=(layout,), desired_input_layouts=(Replicate(),))
    if sequence_parallel:
        plan["norm1"] = plan["norm2"] = SequenceParallel()
    return plan


def torch_parallel_block(
    mesh: DeviceMesh, sequence_parallel: bool = False, shared_input: bool = False, **block_args: Any
) -> nn.Module:
    """A TransformerBlock(**block_args) parallelized over `mesh` by :func:`tp_plan` (its heads must split evenly)."""
    from torch.distributed.tensor.parallel import parallelize_module

    heads = block_args.get("n_heads", 12)
    shard_size(heads, mesh.size(), "attention heads")
    return parallelize_module(TransformerBlock(**block_args), mesh, tp_plan(sequence_parallel, shared_input))
