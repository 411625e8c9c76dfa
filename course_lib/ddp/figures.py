"""Kernel-side arithmetic behind notebook 02's figures and tables: the bucket simulator, memory,
and what dividing by N before the sum does in low precision."""

from __future__ import annotations

import torch

from course_lib.comms import sent_per_rank
from course_lib.ddp.minimal_ddp import MB
from course_lib.memory import zero_bytes_per_gpu


def low_precision_mean(grads: list[torch.Tensor], divide_first: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The mean of the ranks' gradients as a reduction in their dtype computes it: added one rank after
    the other (every addition rounds), each divided by N before (`divide_first`, as torch DDP does) or
    the sum divided after. Returns (mean, the running partial sums)."""
    n = len(grads)
    terms = [g / n for g in grads] if divide_first else list(grads)
    partial = [terms[0]]
    for term in terms[1:]:
        partial.append(partial[-1] + term)
    return (partial[-1] if divide_first else partial[-1] / n), partial


def simulate_buckets(
    grad_bytes_in_order: list[int],
    grad_ready_s: list[float],
    bucket_cap_mb: float,
    latency_s: float,
    bandwidth_Bps: float,
    world_size: int,
) -> list[tuple[float, float]]:
    """Model of bucketed all-reduce during backward.

    Gradients (in the order backward produces them) become ready at `grad_ready_s`; a bucket is sent
    when its last gradient is ready and the previous all-reduce has finished (one at a time, as on
    one communicator). Each call costs latency + ring bytes / bandwidth. Returns the list of
    (start, end) per bucket.
    """
    cap = bucket_cap_mb * MB
    buckets: list[tuple[int, float]] = []  # (bytes, ready time), closed as in assign_buckets
    size = 0
    for nbytes, t in zip(grad_bytes_in_order, grad_ready_s):
        size += nbytes
        if size >= cap:
            buckets.append((size, t))
            size = 0
    if size:
        buckets.append((size, grad_ready_s[-1]))
    calls, free_at = [], 0.0
    for nbytes, ready in buckets:
        start = max(ready, free_at)
        free_at = start + latency_s + sent_per_rank("all_reduce", nbytes, world_size) / bandwidth_Bps
        calls.append((start, free_at))
    return calls


def overlap_fraction(calls: list[tuple[float, float]], backward_s: float) -> float:
    """Share of the communication time that falls inside backward (hidden behind compute)."""
    total = sum(e - s for s, e in calls)
    hidden = sum(max(0.0, min(e, backward_s) - s) for s, e in calls)
    return hidden / total if total else 1.0


def ddp_bytes_per_rank(n_params: int, param_bytes: int = 4, optimizer_states: int = 2, bucket_copy: bool = True) -> int:
    """Every rank holds everything (ZeRO's stage 0): weights + gradients + optimizer states, plus the
    bucket copy of the gradients unless gradient_as_bucket_view=True. Activations come on top and scale with B/N."""
    held = zero_bytes_per_gpu(
        n_params,
        world_size=1,
        stage=0,
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        optimizer_bytes=optimizer_states * param_bytes,
    )["total"]
    return int(held) + (n_params * param_bytes if bucket_copy else 0)
