"""course_lib.tensor_parallel: column- and row-parallel layers from scratch, and torch's DTensor plans.

One linear layer y = x Wᵀ + b is split over the N ranks of a tensor-parallel group:

* column-parallel: rank r holds rows r of W (a slice of the *outputs*); every rank needs the whole x,
  and produces its slice of y with no communication.
* row-parallel: rank r holds columns r of W (a slice of the *inputs*); it multiplies its slice of x
  and the partial products are summed with one all-reduce.

Column then row (MLP up/down, attention q/k/v then o) needs one all-reduce forward. Autograd is told
where the communication goes with two conjugate operators (Megatron-LM's f and g):

    copy_to_parallel     forward: identity     backward: all-reduce   (before a column-parallel layer)
    reduce_from_parallel forward: all-reduce   backward: identity     (after a row-parallel layer)

plus a split operator (take my slice forward, all-gather backward) for a row-parallel layer whose
input is not yet split, and its reverse.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from course_lib.compare import local_tensor
from course_lib.exercises import ExerciseFailed
from course_lib.models import Attention, TransformerBlock

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

# Collectives issued by the from-scratch operators, by name and direction ("forward all_reduce": 2, ...).
COMMS: Counter = Counter()


def shard_size(size: int, world_size: int, what: str) -> int:
    """size // world_size, or a ValueError that says which tensor-parallel sizes would divide `size`."""
    if size % world_size:
        fits = [n for n in range(1, min(size, 64) + 1) if size % n == 0]
        raise ValueError(
            f"{what}: {size} does not split evenly over {world_size} ranks; "
            f"tensor-parallel sizes that divide {size}: {fits}"
        )
    return size // world_size


# ---- the conjugate operators --------------------------------------------------------------------------


class CopyToParallel(torch.autograd.Function):
    """f: identity forward; backward all-reduces the input gradient (each rank's slice contributed a part)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        COMMS["backward all_reduce"] += 1
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward (sum the partial products); backward identity (every rank needs all of dy)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        COMMS["forward all_reduce"] += 1
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def split_last_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's slice of the last dimension (no communication)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    width = shard_size(x.shape[-1], n, "input features of a row-parallel layer")
    return x[..., r * width : (r + 1) * width]


def gather_last_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's slice along the last dimension (all-gather)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def split_backward(grad_slice: torch.Tensor) -> torch.Tensor:
    """Reference backward of the row-parallel input operator: the gradient of the whole input.

    Self-contained (the exercise check runs its source on the ranks): all-gather the slices, concatenate.
    """
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(grad_slice) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, grad_slice.contiguous())
    return torch.cat(parts, dim=-1)


class SplitToParallel(torch.autograd.Function):
    """Forward: keep my slice of the last dim. Backward: all-gather the slices' gradients.

    `backward_fn` is the backward used (the exercise swaps in the learner's).
    """

    @staticmethod
    def forward(ctx, x, group, backward_fn):
        ctx.group, ctx.backward_fn = group, backward_fn
        return split_last_dim(x, group).clone()

    @staticmethod
    def backward(ctx, grad):
        COMMS["backward all_gather"] += 1
        return ctx.backward_fn(grad.contiguous()), None, None


class GatherFromParallel(torch.autograd.Function):
    """Forward: all-gather the slices. Backward: keep my slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        COMMS["forward all_gather"] += 1
        return gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_last_dim(grad, ctx.group).clone(), None


# ---- the layers ---------------------------------------------------------------------------------------


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

    def __init__(self, full, group=None):
        super().__init__()
        self.up = ColumnParallelLinear(full.up, group)
        self.act = nn.GELU()
        self.down = RowParallelLinear(full.down, group)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class ParallelAttention(nn.Module):
    """q, k, v column-parallel (n_heads/N whole heads per rank), attention locally, o row-parallel."""

    def __init__(self, full, n_heads: int, group=None):
        super().__init__()
        shard_size(n_heads, dist.get_world_size(group), "attention heads")
        self.head_dim = full.head_dim
        self.q, self.k, self.v = (ColumnParallelLinear(getattr(full, name), group, copy_input=False) for name in "qkv")
        self.o = RowParallelLinear(full.o, group)
        self.group = group

    def forward(self, x):
        # one f for q, k and v together: a single all-reduce of their summed input gradients
        return Attention.forward(self, CopyToParallel.apply(x, self.group))  # type: ignore[arg-type]  # same fields


class ParallelTransformerBlock(nn.Module):
    """The course's TransformerBlock with attention and feed-forward tensor-parallel; norms replicated."""

    def __init__(self, full: TransformerBlock, group=None):
        super().__init__()
        self.norm1, self.norm2, self.dropout1, self.dropout2 = full.norm1, full.norm2, full.dropout1, full.dropout2
        self.attention = ParallelAttention(full.attention, full.n_heads, group)
        self.feed_forward = ParallelFeedForward(full.feed_forward, group)

    forward = TransformerBlock.forward


# ---- torch's API --------------------------------------------------------------------------------------


def tp_plan(sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """parallelize_module plan for TransformerBlock: q/k/v/up column-wise, o/down row-wise.

    With sequence_parallel the norms (and the dropout between them) work on a slice of the sequence:
    the block's input and output are sharded on dim 1; an all-gather before attention/feed-forward
    and a reduce-scatter after them replace each all-reduce.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan: dict[str, ParallelStyle] = {f"attention.{name}": ColwiseParallel() for name in "qkv"}
    plan["feed_forward.up"] = ColwiseParallel()
    if not sequence_parallel:
        plan["attention.o"] = RowwiseParallel()
        plan["feed_forward.down"] = RowwiseParallel()
        return plan
    plan.update(
        {
            "norm1": SequenceParallel(),
            "norm2": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.o": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.down": RowwiseParallel(output_layouts=Shard(1)),
        }
    )
    return plan


def torch_parallel_block(mesh, sequence_parallel: bool = False, **block_args) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    heads = block_args.get("n_heads", 12)
    shard_size(heads, mesh.size(), "attention heads")
    return parallelize_module(TransformerBlock(**block_args), mesh, tp_plan(sequence_parallel))


def full_gradients(block: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter gradients of a (possibly DTensor-parallelized) block, gathered into full tensors."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, p in block.named_parameters():
        if p.grad is None:
            raise ValueError(f"{name} has no gradient: run backward first")
        grads[name] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    return grads


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


def param_bytes_per_rank(block: nn.Module) -> int:
    return sum(local_tensor(p).numel() * p.element_size() for p in block.parameters())


def saved_activation_bytes(block: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward on this rank during block(x) (parameters excluded)."""
    params = {local_tensor(p).untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = local_tensor(t).untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(seen.values())


# ---- the exercise -------------------------------------------------------------------------------------


def check_split_backward(fn) -> None:
    """fn(grad_slice) -> gradient of the whole input of the split operator.

    A RowParallelLinear whose input is not yet split uses `fn` as the backward of its split; the input
    gradient must equal single-process autograd's on every rank.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = nn.Linear(12 * n, 5)
    x = torch.randn(3, 12 * n, requires_grad=True)
    full(x).pow(2).sum().backward()
    assert x.grad is not None
    expected = x.grad.clone()

    def checked(grad_slice):
        got = fn(grad_slice)
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ExerciseFailed(
                f"rank {rank}: for a slice gradient of shape {tuple(grad_slice.shape)} the "
                f"input gradient should have the whole input's shape {tuple(expected.shape)}, "
                f"got {shape}"
            )
        return got

    layer = RowParallelLinear(full, input_is_parallel=False, split_backward_fn=checked)
    mine = x.detach().clone().requires_grad_()
    layer(mine).pow(2).sum().backward()
    got = mine.grad
    if got is None or got.shape != expected.shape:
        shape = None if got is None else tuple(got.shape)
        raise ExerciseFailed(
            f"rank {rank}: the input gradient should have the input's shape {tuple(expected.shape)}, got {shape}"
        )
    wrong = ~torch.isclose(got, expected, atol=1e-5, rtol=1e-4)
    if wrong.any():
        i, j = (int(v) for v in wrong.nonzero()[0])
        owner = j // 12
        raise ExerciseFailed(
            f"rank {rank}: input gradient [{i}, {j}] (feature {j} is computed on rank {owner}) "
            f"expected {expected[i, j].item():.5g}, got {got[i, j].item():.5g} "
            f"({int(wrong.sum())} of {wrong.numel()} elements wrong)"
        )


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| / max(max |expected|, 1).

    float32 sums taken in a different order differ by ~1e-7 of the values' scale; the floor of 1 keeps
    gradients that are zero in exact arithmetic (k's bias: softmax ignores a shift) from dividing noise by noise.
    """
    return ((got - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item()
