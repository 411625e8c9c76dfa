"""Point-to-point plumbing of the from-scratch collectives: one exchange with both neighbours at once,
and a counter of the bytes sent.

The counter is module state on purpose: the notebook reads it on each rank after the algorithms
ran, without threading a logger through every call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Bytes this process handed to dist.isend in the from-scratch algorithms (see reset_traffic).
_traffic = {"bytes_sent": 0, "messages": 0}


def reset_traffic() -> None:
    """Zero the counter of bytes this rank sent in the from-scratch algorithms."""
    _traffic.update(bytes_sent=0, messages=0)


def traffic() -> dict[str, int]:
    """Bytes and messages this rank sent since reset_traffic()."""
    return dict(_traffic)


def _peer(group: dist.ProcessGroup | None, group_rank: int) -> int:
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
        ops.append(dist.P2POp(dist.isend, send, _peer(group, dst), group))
        _traffic["bytes_sent"] += send.numel() * send.element_size()
        _traffic["messages"] += 1
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, _peer(group, src), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
