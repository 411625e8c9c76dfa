"""Async tensor parallelism from scratch: the all-gather before a column-parallel matmul, cut into chunks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import comms
from course_lib.collectives import peer
from course_lib.launch.runtime import synchronize


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
    """This rank's median seconds for the plain and the chunked product of (N · rows, d_in) by (d_in, d_out),
    alternating the two so that load hits both alike; every call starts together (a barrier) and ends synchronized."""
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
