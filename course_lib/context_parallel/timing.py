"""Time one attention layer's forward and backward with ring attention, on the ranks of a group."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from course_lib.context_parallel.layout import all_positions, shard_sequence
from course_lib.context_parallel.ring_attention import ring_attention
from course_lib.launch.runtime import synchronize


def time_ring_step(
    layout: str,
    seq_len: int,
    group: dist.ProcessGroup | None = None,
    *,
    batch: int = 1,
    heads: int = 4,
    head_dim: int = 32,
    repeats: int = 3,
    device: torch.device | str = "cpu",
) -> float:
    """Median seconds of forward + backward of causal ring attention over `seq_len` tokens, slowest rank.

    Every rank of `group` must call it. The first run warms up and is not timed.
    """
    n, r = dist.get_world_size(group), dist.get_rank(group)
    held = all_positions(layout, seq_len, n)
    torch.manual_seed(0)
    q, k, v = (shard_sequence(torch.randn(batch, heads, seq_len, head_dim), held[r], 2).to(device) for _ in range(3))
    times = []
    for _ in range(repeats + 1):
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        dist.barrier(group=group)
        start = time.perf_counter()
        ring_attention(q_, k_, v_, held, group=group).sum().backward()
        synchronize(q_.device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=q.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)  # a step ends when its slowest rank ends
        times.append(float(elapsed))
    return statistics.median(times[1:])
