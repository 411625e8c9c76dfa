"""The communication of expert parallelism: counts first, then tokens, with all_to_all_single."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from course_lib import comms

Group = dist.ProcessGroup | None  # None: the default group
AllToAllFn = Callable[[torch.Tensor, Sequence[int], Sequence[int], Any], torch.Tensor]


def exchange_counts(per_expert: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(E,) rows this rank sends to each expert -> (N, E/N): rows each rank sends to each of my experts."""
    n = dist.get_world_size(group)
    send = per_expert.view(n, -1).contiguous()  # row j: the experts of rank j
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (list(send_splits), list(recv_splits)), group
        return _all_to_all(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        send_splits, recv_splits = ctx.splits
        return _all_to_all(grad, recv_splits, send_splits, ctx.group), None, None, None


def _all_to_all(
    x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, list(recv_splits), list(send_splits), group=group)
    return out


def all_to_all(
    x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group: Group = None
) -> torch.Tensor:
    """Rows [Σ send_splits[:j], Σ send_splits[:j+1]) of x go to rank j; rows from rank j arrive in its place."""
    return AllToAll.apply(x, send_splits, recv_splits, group)


def torch_all_to_all(
    x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group: Group = None
) -> torch.Tensor:
    """The same with PyTorch's differentiable functional collective (what torchtitan's expert parallelism uses)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    pg = group if group is not None else dist.group.WORLD
    assert pg is not None, "torch.distributed is not initialised"
    out = all_to_all_single_autograd(x.contiguous(), list(recv_splits), list(send_splits), pg)
    return wait_tensor(out)


def all_to_all_bytes_by_kind(rec: comms.Recorder) -> dict[str, int]:
    """Bytes this rank sent to the others per all-to-all kind, from a recorder around ExpertParallelMoE passes."""
    order = {"forward": ("dispatch", "combine"), "backward": ("combine backward", "dispatch backward")}
    seen = {"forward": 0, "backward": 0}
    sent: dict[str, int] = {}
    for c in rec.calls:
        if c.op != "all_to_all":
            continue
        if c.dtype.is_floating_point:
            kind = order[c.phase][seen[c.phase] % 2]
            seen[c.phase] += 1
        else:
            kind = "counts"
        sent[kind] = sent.get(kind, 0) + c.nbytes
    return sent
