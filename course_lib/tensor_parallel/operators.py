"""Tensor parallelism's communication as autograd ops (Megatron-LM's f and g); async TP's chunked all-gather matmul."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from course_lib import comms
from course_lib.collectives import peer
from course_lib.launch.runtime import synchronize


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


def all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """all_gather(x, dim 0) @ weightᵀ, each rank's chunk of x multiplied while the next one travels.

    x: (rows, d_in), this rank's rows (the same count on every rank); weight: (d_out, d_in), this rank's columns'
    rows of the full weight. Returns (N · rows, d_out), rank j's rows at [j · rows, (j + 1) · rows).
    """
    n, r = dist.get_world_size(group), dist.get_rank(group)
    rows = x.shape[0]
    out = x.new_empty((n * rows, weight.shape[0]))
    chunk = x.contiguous()
    with comms.collective("all_gather", x, group):
        for step in range(n):
            works = []
            if step < n - 1:  # post the exchange first, then compute: the message travels during the matmul
                incoming = torch.empty_like(chunk)
                works = dist.batch_isend_irecv(
                    [
                        dist.P2POp(dist.isend, chunk, peer(group, (r + 1) % n), group),
                        dist.P2POp(dist.irecv, incoming, peer(group, (r - 1) % n), group),
                    ]
                )
            owner = (r - step) % n  # whose rows this chunk is
            torch.matmul(chunk, weight.t(), out=out[owner * rows : (owner + 1) * rows])
            for work in works:
                work.wait()
            if works:
                chunk = incoming
    return out


def gather_then_matmul(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The same product, plain: the whole all-gather, then one matmul."""
    gathered = x.new_empty((dist.get_world_size(group) * x.shape[0], x.shape[1]))
    dist.all_gather_single(gathered, x.contiguous(), group=group)
    return gathered @ weight.t()


def time_overlap(
    rows: int, d_in: int, d_out: int, device: torch.device, repeats: int = 7, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Median seconds of the plain and chunked product, alternated so load hits both; each barrier-started, synced."""
    import statistics
    import time

    torch.manual_seed(dist.get_rank(group))
    x, weight = torch.randn(rows, d_in, device=device), torch.randn(d_out, d_in, device=device)
    times: dict[str, list[float]] = {"plain": [], "chunked": []}
    for _ in range(repeats):
        for name, product in (("plain", gather_then_matmul), ("chunked", all_gather_matmul)):
            dist.barrier(group)
            start = time.perf_counter()
            product(x, weight, group)
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
