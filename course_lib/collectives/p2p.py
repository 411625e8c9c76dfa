"""Point-to-point plumbing of the from-scratch collectives: one exchange with both neighbours at once.

Their bytes are counted by :class:`course_lib.comms.Recorder`, which sees every send.
"""

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

    batch_isend_irecv posts both before waiting, so a ring where every rank sends
    to its right and receives from its left cannot deadlock (on NCCL it also
    groups them into one launch). Empty tensors are skipped: both sides know the
    chunk sizes, so they skip the same message.
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, peer(group, dst), group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, peer(group, src), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
