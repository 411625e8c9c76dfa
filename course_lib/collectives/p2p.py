"""Point-to-point plumbing of the from-scratch collectives: one exchange with both neighbours at once."""

from __future__ import annotations

import torch
import torch.distributed as dist


def peer(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (send/recv address ranks globally)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def send_recv(
    send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group: dist.ProcessGroup | None = None
) -> None:
    """Send `send` to dst while receiving `recv` from src, both at once.
    batch_isend_irecv posts both before waiting, so a ring of such exchanges cannot deadlock."""
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, peer(group, dst), group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, peer(group, src), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
