"""The communication of a tensor-parallel layer, as autograd operators (Megatron-LM's f and g)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def shard_size(size: int, world_size: int, what: str) -> int:
    """size // world_size, or a ValueError that says which tensor-parallel sizes would divide `size`."""
    if size % world_size:
        fits = [n for n in range(1, min(size, 64) + 1) if size % n == 0]
        raise ValueError(
            f"{what}: {size} does not split evenly over {world_size} ranks; "
            f"tensor-parallel sizes that divide {size}: {fits}"
        )
    return size // world_size


class CopyToParallel(torch.autograd.Function):
    """f: identity forward; backward all-reduces the input gradient (each rank's slice contributed a part)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward (sum the partial products); backward identity (every rank needs all of dy)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def split_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's slice of the last dimension (no communication)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    width = shard_size(x.shape[-1], n, "input features of a row-parallel layer")
    return x[..., r * width : (r + 1) * width]


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's slice along the last dimension (all-gather)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class SplitToParallel(torch.autograd.Function):
    """Forward: keep my slice of the last dim. Backward: all-gather the slices' gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        group: dist.ProcessGroup | None,
        backward_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        ctx.group, ctx.backward_fn = group, backward_fn
        return split_last_dim(x, group).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.backward_fn(grad.contiguous()), None, None


class GatherFromParallel(torch.autograd.Function):
    """Forward: all-gather the slices. Backward: keep my slice of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return gather_last_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return split_last_dim(grad, ctx.group).clone(), None
